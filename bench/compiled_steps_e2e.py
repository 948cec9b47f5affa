"""End to end: our loop with compiled steps (``compile_steps=True``; CUDA graphs on CUDA) beside
the eager loop and HF ``generate``, on the embedded model and documents, side by side in one run.

Per (document, context, batch): HF ``generate`` (eager, dynamic cache), our plain loop
(``sparse_attn_algorithm="full"``) eager and compiled, and Vegas at a fixed γ eager and compiled
(fixed: one verification shape, so the compile is paid once per shape). The prefill is computed
once per cell and copied into each run (``prefill_cache``); each configuration runs once to
compile and warm up, then ``--repeats`` times (median decode tokens per second). Greedy, EOS
ignored; the ``same_tokens`` column compares each run with our eager plain loop (the bf16
contract: equal up to near ties, docs/lossless.md).

    python -m bench.compiled_steps_e2e --device cuda --dtype bfloat16 --contexts 8192 --batches 8
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.common import run_metadata, sync
from bench.e2e import build_batch, run_hf
from vegas_ext import models

CONFIGS = (  # (label, options of vegas_ext.generate or None for HF)
    ("hf", None),
    ("full", dict(sparse_attn_algorithm="full")),
    ("full compiled", dict(sparse_attn_algorithm="full", compile_steps=True)),
    ("vegas", dict(sparse_attn_algorithm="vegas")),
    ("vegas compiled", dict(sparse_attn_algorithm="vegas", compile_steps=True)),
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", default="pride_and_prejudice", help="embedded documents, comma-separated")
    ap.add_argument("--contexts", default="2048", help="prompt tokens per row, comma-separated")
    ap.add_argument("--batches", default="4", help="rows, comma-separated")
    ap.add_argument("--gamma", type=int, default=6, help="Vegas's fixed γ (default 6)")
    ap.add_argument("--draft-weights", default="int8", help="Vegas's draft_weights (none: the model's own)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--configs", default=",".join(c for c, _ in CONFIGS), help="labels to run, comma-separated")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    return ap.parse_args(argv)


def run_one(model, ids, mask, pad_id: int, args, opts, pc) -> dict:
    """One greedy run; ``opts`` ``None``: HF ``generate``, else ``vegas_ext.generate`` options."""
    if opts is None:
        r = run_hf(model, ids, mask, args.max_new_tokens, pad_id, prefill_cache=pc)
        return {"tokens": r["tokens"], "decode_tok_s": r["stats"]["decode_tokens_per_s"], "stats": {}}
    from vegas_ext import generate

    kw = dict(opts)
    if kw["sparse_attn_algorithm"] != "full":
        kw.update(num_speculative_tokens=args.gamma, gamma_policy="fixed",
                  draft_weights=None if args.draft_weights == "none" else args.draft_weights)
    sync(ids.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = generate(model, ids, mask, max_new_tokens=args.max_new_tokens, eos_token_id=[], pad_token_id=pad_id,
                       prefill_cache=pc, **kw)
    sync(ids.device)
    s = out.stats
    decode_s = (time.perf_counter() - t0) - s["time_prefill_s"]
    n = s["num_generated_tokens"] - ids.shape[0]  # the first token per row comes with the prefill
    return {"tokens": out.sequences[:, ids.shape[1]:].tolist(), "decode_tok_s": n / decode_s,
            "stats": {k: s.get(k) for k in ("mean_acceptance_length", "num_iterations", "time_draft_s",
                                            "time_verify_s", "time_select_s")}}


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = torch.device(args.device)
    model, tok = models.load_model(dtype=models.parse_dtype(args.dtype), device=dev)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    wanted = args.configs.split(",")
    meta = run_metadata(args.device)
    out_f = open(args.out, "a") if args.out else None
    for doc in args.docs.split(","):
        for S in [int(x) for x in args.contexts.split(",")]:
            for B in [int(x) for x in args.batches.split(",")]:
                ids, mask = (t.to(dev) for t in build_batch(tok, doc, S, B, chat=False))
                pc: dict = {}
                rows, ref = [], None
                for label, opts in CONFIGS:
                    if label not in wanted:
                        continue
                    t0 = time.perf_counter()
                    first = run_one(model, ids, mask, pad_id, args, opts, pc)  # compiles, warms up
                    t_first = time.perf_counter() - t0
                    runs = [run_one(model, ids, mask, pad_id, args, opts, pc) for _ in range(args.repeats)]
                    if label == "full":
                        ref = first["tokens"]
                    rec = dict(doc=doc, context=S, batch=B, config=label, gamma=args.gamma,
                               draft_weights=args.draft_weights, new_tokens=args.max_new_tokens,
                               first_run_s=round(t_first, 2),
                               decode_tok_s=round(statistics.median(r["decode_tok_s"] for r in runs), 2),
                               same_tokens_as_full=None if ref is None else runs[-1]["tokens"] == ref,
                               **runs[-1]["stats"], **meta)
                    rows.append(rec)
                    print(json.dumps(rec), flush=True)
                    if out_f:
                        out_f.write(json.dumps(rec) + "\n")
                        out_f.flush()
                base = {r["config"]: r["decode_tok_s"] for r in rows}
                for r in rows:
                    ratios = {f"vs_{b.replace(' ', '_')}": round(r["decode_tok_s"] / base[b], 2)
                              for b in ("full", "full compiled", "hf") if b in base}
                    print(f"{doc} {S}x{B} {r['config']:>15}: {r['decode_tok_s']:8.1f} tok/s  {ratios}  "
                          f"same={r['same_tokens_as_full']}  first run {r['first_run_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
