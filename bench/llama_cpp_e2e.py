#!/usr/bin/env python3
"""llama.cpp on the embedded GGUF, beside our loop: what a CPU user would run instead.

Decodes the same prompts as ``bench.e2e`` (same documents, token counts and row offsets, our
tokenizer's ids) with llama.cpp through ``llama-cpp-python`` (PyPI; built from source here), on
the GGUF file our loader converts (SmolLM2-135M-Instruct Q4_1: 4-bit weights as stored, f16 KV
cache): one context holding ``batch`` sequences, the prompts prefilled in ``n_batch``-token
chunks, then one ``llama_decode`` per step with one token per sequence, greedy (argmax of each
row's logits), EOS ignored. Reports prefill seconds and decode tokens/s (tokens after each row's
first / time after prefill, as ``bench.e2e``). Its tokens are not ours: llama.cpp computes with the
4-bit weights, our loop with the GGUF's weights dequantized to float32.

Writes ``runs.jsonl`` and ``summary.md`` into ``--out``. Example::

    python -m bench.llama_cpp_e2e --docs kjv --context-lengths 8192 --batch-sizes 1,4 --threads 1 \\
        --max-new-tokens 128 --out bench/results/gamma_rows_zen3/llama_cpp_t1
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any, Dict, List

import numpy as np

from bench.common import git_commit
from bench.e2e import build_batch
from vegas_ext import models


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", default="kjv", help="documents, as bench.e2e (default kjv)")
    ap.add_argument("--context-lengths", default="8192", help="prompt lengths in tokens (default 8192)")
    ap.add_argument("--batch-sizes", default="1,4", help="sequences decoded together (default 1,4)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads, prefill and decode (default 1)")
    ap.add_argument("--n-batch", type=int, default=512, help="prefill chunk in tokens (llama.cpp's n_batch)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", required=True, help="results folder")
    args = ap.parse_args(argv)
    args.docs = [d for d in args.docs.split(",") if d]
    args.context_lengths = [int(x) for x in args.context_lengths.split(",") if x]
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    if min(args.batch_sizes + args.context_lengths + [args.max_new_tokens, args.threads, args.n_batch]) < 1:
        ap.error("--batch-sizes, --context-lengths, --max-new-tokens, --threads and --n-batch must be >= 1")
    return args


class LlamaCpp:
    """One llama.cpp model and a context for ``n_seq`` sequences of up to ``n_ctx_seq`` tokens each."""

    def __init__(self, path: str, n_seq: int, n_ctx_seq: int, threads: int, n_batch: int):
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_seq * n_ctx_seq
        cp.n_batch = max(n_batch, n_seq)
        cp.n_ubatch = max(n_batch, n_seq)
        cp.n_seq_max = n_seq
        cp.n_threads = threads
        cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(max(n_batch, n_seq), 0, n_seq)
        self.n_batch = n_batch

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def _decode(self, items) -> None:
        """One ``llama_decode`` of ``items``: ``(token, pos, seq, wants_logits)``."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(tok), int(pos), 1, int(logits)
            b.seq_id[i][0] = int(seq)
        b.n_tokens = len(items)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        ptr = self.L.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def generate(self, prompts: List[List[int]], max_new: int) -> Dict[str, Any]:
        """Greedy decoding of every prompt (one sequence each); returns the new tokens and timings."""
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        first = []
        for s, ids in enumerate(prompts):
            for c in range(0, len(ids), self.n_batch):
                chunk = ids[c: c + self.n_batch]
                self._decode([(t, c + j, s, c + j == len(ids) - 1) for j, t in enumerate(chunk)])
            first.append(self._argmax(len(chunk) - 1))
        t1 = time.perf_counter()
        out = [[t] for t in first]
        pos = [len(ids) for ids in prompts]
        for _ in range(max_new - 1):
            self._decode([(out[s][-1], pos[s], s, True) for s in range(len(prompts))])
            for s in range(len(prompts)):
                out[s].append(self._argmax(s))
                pos[s] += 1
        t2 = time.perf_counter()
        n_dec = len(prompts) * (max_new - 1)
        return {"tokens": out, "time_prefill_s": t1 - t0, "time_decode_s": t2 - t1,
                "decode_tokens_per_s": n_dec / (t2 - t1) if t2 > t1 else None}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    _, tok = models.load_model()
    path = models.default_model_path()
    import llama_cpp

    env = {"llama_cpp_python": llama_cpp.__version__, "gguf": os.path.basename(path), "threads": args.threads,
           "machine": platform.processor() or platform.machine(), "git_commit": git_commit()}
    records = []
    for doc in args.docs:
        for ctx in args.context_lengths:
            for B in args.batch_sizes:
                ids, _ = build_batch(tok, doc, ctx, B, False)
                prompts = ids.tolist()
                lc = LlamaCpp(path, B, ctx + args.max_new_tokens + 8, args.threads, args.n_batch)
                try:
                    for rep in range(args.repeats):
                        r = lc.generate(prompts, args.max_new_tokens)
                        rec = {"doc": doc, "context": ctx, "batch_size": B, "repeat": rep,
                               "max_new_tokens": args.max_new_tokens, **env,
                               **{k: v for k, v in r.items() if k != "tokens"}, "tokens": r["tokens"]}
                        records.append(rec)
                        print(json.dumps({k: v for k, v in rec.items() if k != "tokens"}), flush=True)
                finally:
                    lc.close()
    with open(os.path.join(args.out, "runs.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    lines = [f"# llama.cpp (llama-cpp-python {env['llama_cpp_python']}), {env['gguf']}, {args.threads} thread(s)", "",
             f"Command: `python -m bench.llama_cpp_e2e {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             "| doc | ctx | B | decode tok/s | prefill s |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in records:
        lines.append(f"| {r['doc']} | {r['context']} | {r['batch_size']} | {r['decode_tokens_per_s']:.2f} | "
                     f"{r['time_prefill_s']:.1f} |")
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
