"""Runs one vLLM engine in a fresh process and writes its outputs as JSON (used by tests/vllm_plugin and
bench/vllm_e2e.py, so every configuration starts clean and ``VLLM_PLUGINS`` applies to all of
vLLM's processes).

    python tests/vllm_plugin/run_llm.py CONFIG.json OUT.json

CONFIG: ``{"llm": {LLM kwargs}, "prompts": [token id lists], "sampling": {SamplingParams kwargs},
"n_seeds": optional int (one request per seed, same prompt; seeds from "seed_offset", default 0),
"n_copies": optional int (unseeded copies), "max_tokens_per_prompt": optional list (overrides
"sampling"'s max_tokens per prompt), "expect_error": optional bool}``.
OUT: ``{"outputs": [[token ids]], "metrics": {name: value}, "seconds": {"init": s, "generate": s},
"error": optional str}``.
"""
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


def main(cfg_path, out_path):
    with open(cfg_path) as f:
        cfg = json.load(f)
    from vllm import LLM, SamplingParams

    res = {"outputs": [], "metrics": {}, "seconds": {}}
    t0 = time.perf_counter()
    try:
        llm = LLM(**cfg["llm"])
    except Exception as e:  # the bad-input tests look at this message
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
        with open(out_path, "w") as f:
            json.dump(res, f)
        return
    res["seconds"]["init"] = time.perf_counter() - t0
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
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1], sys.argv[2])
