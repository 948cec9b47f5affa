#!/usr/bin/env python3
"""The README's picture: mean acceptance length of vegas / quest / streamingllm vs KV budget.

Pools the committed CPU grid (``bench/results/acceptance_grid_xeon_avx512/part_*/runs.jsonl``: contexts 2K/4K/8K,
batch 1 and 4, three documents, 32 new tokens per row, greedy) per algorithm, γ and budget ratio:
mean acceptance length = 1 + all accepted draft tokens / all drafts. One panel per γ. Prints the
pooled values (the README's and ``acceptance_grid_xeon_avx512/README.md``'s tables) and writes the PNG.

    python bench/readme_figure.py [RUNS.jsonl ...] [--out bench/results/acceptance_grid_xeon_avx512/acceptance_vs_budget.png]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_RUNS = sorted(glob.glob(os.path.join(HERE, "results", "acceptance_grid_xeon_avx512", "part_*", "runs.jsonl")))
ALGOS = ("vegas", "quest", "streamingllm")


def pooled(paths):
    """({(algorithm, gamma, ratio): [accepted, drafts]}, {algorithm: block sizes}) over ``paths`` (no variants)."""
    acc = defaultdict(lambda: [0, 0])
    blocks = defaultdict(set)
    for p in paths:
        with open(p) as f:
            for line in f:
                r = json.loads(line)
                if r.get("algorithm") not in ALGOS or r.get("variant") or not r.get("num_drafts"):
                    continue
                k = (r["algorithm"], r["num_speculative_tokens"], r["sparse_attn_ratio"])
                acc[k][0] += r["num_accepted_tokens"]
                acc[k][1] += r["num_drafts"]
                blocks[r["algorithm"]].add(r.get("block_size"))
    return acc, blocks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", default=DEFAULT_RUNS, help="runs.jsonl files (default: the CPU grid)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "acceptance_grid_xeon_avx512", "acceptance_vs_budget.png"),
                    help="PNG to write")
    args = ap.parse_args(argv)
    if not args.runs:
        ap.error("no runs.jsonl given and none found under bench/results/acceptance_grid_xeon_avx512/")
    acc, blocks = pooled(args.runs)
    gammas = sorted({g for _, g, _ in acc})
    ratios = sorted({r for _, _, r in acc})

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"vegas": "tab:red", "quest": "tab:blue", "streamingllm": "tab:green"}
    fig, axes = plt.subplots(1, len(gammas), figsize=(3.6 * len(gammas), 3.2), sharey=True, squeeze=False)
    for ax, g in zip(axes[0], gammas):
        for a in ALGOS:
            xs = [r for r in ratios if acc.get((a, g, r), [0, 0])[1]]
            ys = [1 + acc[(a, g, r)][0] / acc[(a, g, r)][1] for r in xs]
            bs = ", ".join(f"{b}-token" for b in sorted(blocks[a], key=str))
            ax.plot(xs, ys, "o-", color=colors[a], label=f"{a} ({bs} blocks)")
            print(f"gamma {g} {a:12s} " + "  ".join(f"r{r}: {y:.2f}" for r, y in zip(xs, ys)))
        ax.set_title(f"γ = {g}")
        ax.set_xlabel("KV budget (fraction of the context)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean acceptance length")
    axes[0][0].legend(loc="upper left", fontsize=8)
    n = sum(d for _, d in acc.values())
    fig.suptitle(f"Drafting at equal KV budget: SmolLM2-135M, CPU, 2K-8K tokens of real text ({n:,} drafts)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=80)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
