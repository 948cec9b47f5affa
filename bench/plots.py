#!/usr/bin/env python3
"""PNG plots of an end-to-end benchmark run (``bench/e2e.py``'s ``runs.jsonl``).

Writes, into the results folder:

* ``mal_vs_ratio.png``: mean acceptance length (pooled: 1 + all accepted / all drafts of the runs,
  e.g. over documents) vs KV budget ratio, one line per algorithm configuration (and context /
  batch when several);
* ``tokens_per_s_vs_context.png``: decode tokens/s vs context length per configuration and batch;
* ``per_position_acceptance.png``: fraction of drafts whose j-th token was accepted, per configuration;
* ``selection_overhead.png``: selection time as a share of an iteration, per configuration.

Usage: ``python bench/plots.py bench/results/<name>/runs.jsonl`` (or call :func:`write_plots`).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import sys
from collections import defaultdict
from typing import Any, Dict, List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_SPEC = ("hf", "full")


def _med(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else None


def _base_label(r: Dict[str, Any]) -> str:
    """Configuration label without the ratio (``vegas/shared g6 b16``)."""
    return re.sub(r" r[0-9.e-]+", "", r["label"])


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_plots(records: List[Dict[str, Any]], out_dir: str) -> List[str]:
    """Write the four PNGs for ``records`` (dicts as in ``runs.jsonl``) into ``out_dir``; returns their
    paths (a plot without data is skipped)."""
    paths = []
    spec = [r for r in records if r.get("algorithm") not in _SPEC and r.get("mean_acceptance_length") is not None]
    cells = sorted({(r["context"], r["batch_size"]) for r in spec})
    multi = len(cells) > 1

    # 1. MAL vs ratio
    groups = defaultdict(lambda: defaultdict(list))
    for r in spec:
        key = _base_label(r) + (f" ctx{r['context']} B{r['batch_size']}" if multi else "")
        groups[key][r["sparse_attn_ratio"]].append((r.get("num_accepted_tokens") or 0, r.get("num_drafts") or 0))
    if any(len(v) > 1 for v in groups.values()) or groups:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key, by_ratio in sorted(groups.items()):
            xs = sorted(by_ratio)
            ys = [1 + sum(a for a, _ in by_ratio[x]) / max(1, sum(d for _, d in by_ratio[x])) for x in xs]
            ax.plot(xs, ys, marker="o", label=key)
        ax.set_xlabel("KV budget ratio")
        ax.set_ylabel("mean acceptance length (pooled over runs)")
        ax.set_title("Acceptance vs budget")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        paths.append(_save(fig, os.path.join(out_dir, "mal_vs_ratio.png")))

    # 2. tokens/s vs context
    tp = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.get("decode_tokens_per_s") is None:
            continue
        tp[f"{r['label']} B{r['batch_size']}"][r["context"]].append(r["decode_tokens_per_s"])
    if tp:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key, by_ctx in sorted(tp.items()):
            xs = sorted(by_ctx)
            ax.plot(xs, [_med(by_ctx[x]) for x in xs], marker="o", label=key)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("decode tokens/s (all rows)")
        ax.set_title("Throughput vs context")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        paths.append(_save(fig, os.path.join(out_dir, "tokens_per_s_vs_context.png")))

    # 3. per-position acceptance
    acc = defaultdict(lambda: [None, 0])
    for r in spec:
        pp = r.get("num_accepted_tokens_per_pos")
        if not pp or not r.get("num_drafts"):
            continue
        a = acc[r["label"]]
        a[0] = [x + y for x, y in zip(a[0], pp)] if a[0] is not None else list(pp)
        a[1] += r["num_drafts"]
    if acc:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key, (pp, n) in sorted(acc.items()):
            ax.plot(range(1, len(pp) + 1), [x / n for x in pp], marker=".", label=key)
        ax.set_xlabel("draft position")
        ax.set_ylabel("fraction of drafts accepted up to here")
        ax.set_ylim(0, 1.02)
        ax.set_title("Per-position acceptance")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        paths.append(_save(fig, os.path.join(out_dir, "per_position_acceptance.png")))

    # 4. selection overhead share
    sh = defaultdict(list)
    for r in spec:
        if r.get("select_overhead_share") is not None:
            sh[r["label"]].append(r["select_overhead_share"])
    if sh:
        keys = sorted(sh)
        fig, ax = plt.subplots(figsize=(7, max(2.5, 0.3 * len(keys) + 1)))
        ax.barh(range(len(keys)), [100 * _med(sh[k]) for k in keys])
        ax.set_yticks(range(len(keys)))
        ax.set_yticklabels(keys, fontsize=7)
        ax.set_xlabel("selection time, % of an iteration (median over runs)")
        ax.set_title("Selection overhead")
        ax.grid(alpha=0.3, axis="x")
        paths.append(_save(fig, os.path.join(out_dir, "selection_overhead.png")))
    return paths


def main(argv=None) -> int:
    """``plots.py RUNS_JSONL [OUT_DIR]``: write the plots next to the runs (or into OUT_DIR)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        records = [json.loads(line) for line in f if line.strip()]
    out = argv[1] if len(argv) > 1 else os.path.dirname(os.path.abspath(argv[0]))
    for p in write_plots(records, out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
