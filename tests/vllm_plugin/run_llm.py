"""Runs vLLM engines outside the test process and writes their outputs as JSON (used by tests/vllm_plugin
and bench/vllm_e2e.py): ``VLLM_PLUGINS`` applies to all of vLLM's processes, and each engine gets its own
engine-core process (spawned, as vLLM does on CPU), so every configuration starts clean.

    python tests/vllm_plugin/run_llm.py CONFIG.json OUT.json    # one engine, then exit
    python tests/vllm_plugin/run_llm.py --serve DONE_FD          # one engine after another (below)

``--serve`` keeps this process, vLLM's front end, for the engines of a whole test session, so vLLM
is imported once per plugin setting instead of once per engine: it reads jobs from stdin, one JSON
line each, ``{"cfg": CONFIG.json, "out": OUT.json, "env": {variables for this engine}}``, runs the
engine, shuts it down, writes OUT (``"crash"``: the traceback of an error after construction) and
then a line to the file descriptor DONE_FD.

CONFIG: ``{"llm": {LLM kwargs}, "prompts": [token id lists], "sampling": {SamplingParams kwargs},
"n_seeds": optional int (one request per seed, same prompt; seeds from "seed_offset", default 0),
"n_copies": optional int (unseeded copies), "max_tokens_per_prompt": optional list (overrides
"sampling"'s max_tokens per prompt), "expect_error": optional bool}``.
OUT: ``{"outputs": [[token ids]], "metrics": {name: value}, "seconds": {"init": s, "generate": s},
"error": optional str}``.
"""
import gc
import json
import os
import sys
import time
import traceback


def metrics_dict(llm):
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode") or m.name in ("vllm:generation_tokens",):
            out[m.name] = list(m.values) if hasattr(m, "values") else m.value
    return out


def run(cfg, shutdown=False):
    """Build the engine of ``cfg``, generate, return OUT's dict (``shutdown``: stop the engine after)."""
    from vllm import LLM

    res = {"outputs": [], "metrics": {}, "seconds": {}}
    t0 = time.perf_counter()
    try:
        llm = LLM(**cfg["llm"])
    except Exception as e:  # a configuration LLM(...) refuses: its message
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
        return res
    res["seconds"]["init"] = time.perf_counter() - t0
    try:
        _generate(llm, cfg, res)
    finally:
        if shutdown:
            llm.llm_engine.engine_core.shutdown()  # its engine-core process (and workers) exit
    return res


def _generate(llm, cfg, res):
    from vllm import SamplingParams

    sp = cfg.get("sampling", {})
    prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
    if cfg.get("n_seeds"):
        s0 = cfg.get("seed_offset", 0)
        params = [SamplingParams(**sp, seed=s0 + s) for s in range(cfg["n_seeds"])]
        prompts = prompts * cfg["n_seeds"]
    elif cfg.get("n_copies"):  # unseeded copies: the engine's own random stream
        params = SamplingParams(**sp)
        prompts = prompts * cfg["n_copies"]
    elif cfg.get("max_tokens_per_prompt"):  # one SamplingParams per prompt, differing in max_tokens only
        params = [SamplingParams(**dict(sp, max_tokens=n)) for n in cfg["max_tokens_per_prompt"]]
    else:
        params = SamplingParams(**sp)
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    res["seconds"]["generate"] = time.perf_counter() - t1
    res["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
    try:
        res["metrics"] = metrics_dict(llm)
    except Exception as e:  # stat logging disabled
        res["metrics_error"] = str(e)


def _write(res, out_path):
    with open(out_path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out_path + ".tmp", out_path)  # a reader never sees half a file


def main(cfg_path, out_path):
    with open(cfg_path) as f:
        cfg = json.load(f)
    _write(run(cfg), out_path)


def serve(done_fd):
    done = os.fdopen(done_fd, "w", buffering=1)
    for line in sys.stdin:
        job = json.loads(line)
        saved = {k: os.environ.get(k) for k in job.get("env", {})}
        os.environ.update(job.get("env", {}))  # spawned engine-core and worker processes inherit them
        try:
            with open(job["cfg"]) as f:
                res = run(json.load(f), shutdown=True)
        except BaseException:
            res = {"crash": traceback.format_exc()[-6000:]}
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        gc.collect()
        _write(res, job["out"])
        done.write("done\n")
        if "crash" in res:
            return  # the caller starts a fresh process for what comes next


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if sys.argv[1] == "--serve":
        serve(int(sys.argv[2]))
    else:
        main(sys.argv[1], sys.argv[2])
