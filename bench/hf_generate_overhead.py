"""Overhead of ``model.generate(custom_generate=vegas_ext.hf.generate)`` against calling
``vegas_ext.generate`` directly, same prompts and options (issue 31; target: within 3 %).

For each context x batch it decodes the same greedy continuation both ways, interleaved
(direct, HF, direct, HF, ...) so machine noise hits both alike, and reports the median wall
time of each and their ratio; the sequences must be identical. It also times what the HF path
spends outside the loop (``hf_path_cost_ms``: the call with the loop stubbed out), the part of the
ratio that long decodes on a shared machine cannot resolve. Both paths share one
``prefill_cache`` (the prompt's K/V are computed once, then copied), so the times are the
decode loop plus each path's own preparation -- what going through HF adds.

Usage: ``python -m bench.hf_generate_overhead --contexts 2048 8192 --batches 1 4 --new 16 --repeats 3
--out bench/results/hf_generate_overhead_xeon_avx512/hf_generate_overhead.jsonl``
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch

import vegas_ext
from bench.common import ROOT, add_pack_linears_flag, pack_linears, run_metadata, sync, write_rows
from vegas_ext import documents, hf, models

DOCS = ["pride_and_prejudice", "python_docs", "kjv"]


def _gamma(s: str):
    return s if s == "auto" else int(s)


def hf_path_cost(model, ids, mask, pad, new, opts, repeats: int = 20) -> float:
    """Median seconds that ``model.generate(custom_generate=hf.generate)`` spends outside the decode
    loop (HF's input preparation, processors / criteria construction, hf.generate's checks): the
    same call with the loop replaced by a stub that returns the prompt. Noise-free, unlike the
    difference of two long decodes on a shared machine."""
    from vegas_ext import decode

    real = decode.generate
    decode.generate = lambda model, input_ids, *a, **k: decode.GenerateOutput(sequences=input_ids)
    try:
        times = []
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                               pad_token_id=pad, custom_generate=hf.generate, **opts)
            times.append(time.perf_counter() - t0)
    finally:
        decode.generate = real
    return statistics.median(times[2:])


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--new", type=int, default=16, help="new tokens per row")
    ap.add_argument("--gamma", type=_gamma, default=4, help="num_speculative_tokens (an int, or auto)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per path (after one warm-up each)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prep-only", action="store_true", help="only the HF path's cost outside the loop (fast)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "hf_generate_overhead.jsonl"))
    add_pack_linears_flag(ap)
    return ap.parse_args(argv)


def cell_paths(model, ids, mask, pad, new: int, opts: dict):
    """``(direct, via_hf)``: the two ways to decode ``new`` tokens after ``ids``, each returning the
    sequences; they share one ``prefill_cache``, filled by whichever runs first."""
    pc: dict = {}

    def direct():
        with torch.inference_mode():
            return vegas_ext.generate(model, ids, mask, max_new_tokens=new, pad_token_id=pad,
                                      prefill_cache=pc, **opts).sequences

    def via_hf():
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                  do_sample=False, pad_token_id=pad, custom_generate=hf.generate,
                                  prefill_cache=pc, **opts)

    return direct, via_hf


def time_paths(direct, via_hf, repeats: int):
    """``(identical, times)``: whether the warm-up runs of both paths gave the same sequences, and
    the seconds of each of ``repeats`` interleaved timed runs per path (``{"direct": [...], "hf": [...]}``)."""
    a, b = direct(), via_hf()  # warm-up (fills the prefill cache)
    same = bool(torch.equal(a, b))
    t = {"direct": [], "hf": []}
    for _ in range(repeats):
        for name, fn in (("direct", direct), ("hf", via_hf)):
            sync("cpu")
            t0 = time.perf_counter()
            fn()
            sync("cpu")
            t[name].append(time.perf_counter() - t0)
    return same, t


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    model, tok = models.load_model()
    packed = pack_linears(model, args.pack_linears)
    meta = run_metadata("cpu")
    names = [d for d in DOCS if d in documents.list_documents()] or documents.list_documents()[:1]
    opts = dict(num_speculative_tokens=args.gamma, gamma_policy="auto" if args.gamma == "auto" else "fixed")
    rows_out = []
    for ctx in args.contexts:
        for B in args.batches:
            rows = [documents.make_prompt_ids(tok, names[b % len(names)], ctx) for b in range(B)]
            ids = torch.tensor(rows, dtype=torch.long)
            mask = torch.ones_like(ids)
            pad = tok.pad_token_id  # EOS ids: the model's generation config on both paths
            prep = hf_path_cost(model, ids, mask, pad, args.new, opts)
            print(json.dumps({"context": ctx, "batch": B, "hf_path_cost_ms": prep * 1e3}), flush=True)
            if args.prep_only:
                rows_out.append({"context": ctx, "batch": B, "hf_path_cost_ms": prep * 1e3, **meta})
                write_rows(Path(args.out), rows_out)
                continue
            same, t = time_paths(*cell_paths(model, ids, mask, pad, args.new, opts), args.repeats)
            md, mh = statistics.median(t["direct"]), statistics.median(t["hf"])
            row = {"context": ctx, "batch": B, "new_tokens": args.new, "gamma": args.gamma, "dtype": "float32",
                   "threads": torch.get_num_threads(), "packed_linears": packed, "identical": same,
                   "direct_s": t["direct"], "hf_s": t["hf"], "median_direct_s": md, "median_hf_s": mh,
                   "hf_path_cost_ms": prep * 1e3,
                   "ratio_hf_over_direct": mh / md, **meta}
            rows_out.append(row)
            print(json.dumps({k: row[k] for k in ("context", "batch", "identical", "median_direct_s", "median_hf_s",
                                                  "ratio_hf_over_direct")}), flush=True)
            write_rows(Path(args.out), rows_out)  # after each configuration: a cut-short run keeps its rows


if __name__ == "__main__":
    main()
