"""Loads vLLM's general plugins the way vLLM does (entry points) in a vLLM made to look unsupported,
then builds engine configs; prints a JSON report (used by test_vllm_host_guard.py).

    python guard_probe.py MODE MODEL_DIR

MODE: ``version`` (``vllm.__version__`` set to 0.34.0), ``module`` (``vllm.v1.worker.gpu_model_runner``
unimportable, as in vLLM 0.34) or ``none`` (the installed vLLM as it is)."""
import json
import logging
import sys
import traceback


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def attempt(fn):
    try:
        return {"ok": fn()}
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()[-3000:]}


def main(mode, model):
    import vllm

    if mode == "version":
        vllm.__version__ = "0.34.0"
    elif mode == "module":
        sys.modules["vllm.v1.worker.gpu_model_runner"] = None
    rec = Records()
    logging.getLogger("vegas_ext").addHandler(rec)

    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    from vegas_ext.vllm import PROPOSER_PATH, register

    out = {"load": attempt(lambda: load_general_plugins() or "loaded")}
    out["register_again"] = attempt(lambda: register() or "returned")  # vLLM calls it in several places
    base = dict(model=model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=512)

    def config(spec):
        c = EngineArgs(**base, speculative_config=spec).create_engine_config()
        s = c.speculative_config
        return None if s is None else {"method": s.method, "k": s.num_speculative_tokens}

    out["plain"] = attempt(lambda: config(None))
    out["ngram"] = attempt(lambda: config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}))
    out["vegas"] = attempt(lambda: config({"model": PROPOSER_PATH, "num_speculative_tokens": 4}))
    if mode != "none":
        from vllm import LLM

        out["vegas_llm"] = attempt(lambda: LLM(**base, speculative_config={"model": PROPOSER_PATH,
                                                                          "num_speculative_tokens": 4}) and "built")
    out["warnings"] = [m for m in rec.messages if m.startswith("vegas_ext")]
    print("GUARD_PROBE " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
