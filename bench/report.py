#!/usr/bin/env python3
"""Pooled report over one or more ``bench/e2e.py`` runs (``runs.jsonl`` files), e.g. the parts of a
grid run split over several processes.

Writes into ``--out``:

* ``summary.md``: the commands of the parts, then

  1. the headline: per (context, batch, gamma, ratio) cell, the mean acceptance length of every
     selection algorithm pooled over documents (1 + all accepted / all drafts), the ratios
     ``vegas / streamingllm`` and ``vegas / quest``, and each algorithm's decode speedup over our
     plain decoding (``full``; median over documents, each run against the ``full`` run of the
     same document and cell) with the cost-model bound next to it;
  2. grid-wide aggregates (geometric means of the acceptance ratios over cells, how many cells meet
     the project's targets (see the README's Results), selection overhead per algorithm, token identity of every run);
  3. plain decoding: HF ``generate`` and ``full`` decode tokens/s per (context, batch);
  4. the per-run detail table of :func:`e2e.summary_markdown`.

* the four plots of :mod:`plots` over all runs.

Usage::

    python bench/report.py bench/results/grid_cpu/part_*/runs.jsonl --out bench/results/grid_cpu

The algorithms compared are whatever the runs hold; ``vegas``, ``streamingllm`` and ``quest`` (with
no variant) get the ratio columns. Raises ``SystemExit`` with a message when no run is found.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

RIVALS = ("vegas", "quest", "streamingllm")


def load_runs(paths: Iterable[str]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """Records of every ``runs.jsonl`` in ``paths`` and the ``config.json`` next to each (or ``{}``)."""
    records, configs = [], []
    for p in paths:
        with open(p) as f:
            records += [json.loads(line) for line in f if line.strip()]
        cfg_path = os.path.join(os.path.dirname(os.path.abspath(p)), "config.json")
        configs.append(json.load(open(cfg_path)) if os.path.exists(cfg_path) else {})
    return records, configs


def _med(xs) -> Optional[float]:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else None


def _gmean(xs) -> Optional[float]:
    xs = [x for x in xs if isinstance(x, (int, float)) and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def _f(x, fmt="{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def algo_name(r: Dict[str, Any], multi_bs: Iterable[Tuple[str, str]] = ()) -> str:
    """``vegas``, ``vegas/shared``, ``vegas/bs=1``, ``quest b64``, ``hf``, ... (algorithm plus variant,
    plus the block size when ``(algorithm, variant)`` is in ``multi_bs``: it ran at several block
    sizes and the variant does not name it)."""
    v = r.get("variant") or ""
    bs = r.get("block_size")
    suffix = f" b{bs}" if (r["algorithm"], v) in set(multi_bs) and "bs=" not in v else ""
    return r["algorithm"] + (f"/{v}" if v else "") + suffix


def multi_block_size(records: List[Dict[str, Any]]) -> set:
    """``(algorithm, variant)`` pairs that ran at more than one block size in ``records``."""
    seen: Dict[Tuple[str, str], set] = defaultdict(set)
    for r in records:
        seen[(r["algorithm"], r.get("variant") or "")].add(r.get("block_size"))
    return {k for k, v in seen.items() if len(v) > 1}


def pooled_mal(rs: List[Dict[str, Any]]) -> Optional[float]:
    """1 + all accepted / all drafts over ``rs`` (documents pooled); None without drafts."""
    d = sum(r.get("num_drafts") or 0 for r in rs)
    return 1 + sum(r.get("num_accepted_tokens") or 0 for r in rs) / d if d else None


def grid_cells(records: List[Dict[str, Any]]) -> Dict[Tuple, Dict[str, List[Dict[str, Any]]]]:
    """(context, batch, gamma, ratio) -> algorithm name (:func:`algo_name`) -> runs (all documents,
    repeats)."""
    cells: Dict[Tuple, Dict[str, List[Dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    multi = multi_block_size(records)
    for r in records:
        if r["algorithm"] in ("hf", "full"):
            continue
        key = (r["context_requested"], r["batch_size"], r["num_speculative_tokens"], r["sparse_attn_ratio"])
        cells[key][algo_name(r, multi)].append(r)
    # gamma may be "auto" next to integers: integers first
    return dict(sorted(cells.items(), key=lambda kv: tuple((1, 0, x) if isinstance(x, str) else (0, x, "")
                                                           for x in kv[0])))


def report_markdown(records: List[Dict[str, Any]], configs: List[Dict[str, Any]]) -> str:
    """The pooled report (sections 1-3 of the module docstring) as Markdown."""
    if not records:
        raise SystemExit("report: no runs found")
    r0 = records[0]
    docs = sorted({r["doc"] for r in records})
    cells = grid_cells(records)
    algos = [a for a in RIVALS if any(a in c for c in cells.values())]
    others = sorted({a for c in cells.values() for a in c} - set(algos))
    algos += others
    commits = ", ".join(sorted({str(r.get("git_commit"))[:10] + (" (dirty)" if r.get("git_dirty") else "")
                                for r in records}))
    lines = ["# Selection algorithms on real text: pooled grid report", ""]
    lines.append("Parts (each one process; algorithms interleaved inside every cell):")
    lines.append("")
    for c in configs:
        if c.get("argv"):
            argv = c["argv"][1:] if c["argv"] and c["argv"][0].endswith(".py") else c["argv"]
            lines.append(f"    python bench/e2e.py {' '.join(argv)}")
    lines += ["", f"Model {r0.get('model')}, {r0.get('dtype')}, {r0.get('device')} ({r0.get('device_name')}, "
              f"{r0.get('num_threads')} thread(s) per process, {r0.get('cpu_count')} cores); torch {r0.get('torch')}, "
              f"transformers {r0.get('transformers')}; commit(s) {commits}; documents: {', '.join(docs)}; "
              f"{r0.get('max_new_tokens')} new tokens per row, greedy, EOS ignored; "
              f"{len(records)} runs.", "",
              "Block sizes (tokens): " + "; ".join(
                  f"{a} {', '.join(str(b) for b in sorted({r['block_size'] for r in records if algo_name(r) == a}))}"
                  for a in sorted({algo_name(r) for r in records if r["algorithm"] not in ("hf", "full")})) + ".", ""]

    # 1. headline table
    lines += ["## Acceptance and speedup per cell", "",
              "MAL = mean acceptance length pooled over documents (and batch rows). 'x full' = median over "
              "documents of decode tok/s / the same cell's `full` decode tok/s; the cost-model bound "
              "tau * t_full / (gamma * t_draft + t_verify + t_select) is in brackets.", ""]
    hdr = "| ctx | B | γ | ratio | " + " | ".join(f"MAL {a}" for a in algos)
    if "vegas" in algos and "streamingllm" in algos:
        hdr += " | vegas / streamingllm"
    if "vegas" in algos and "quest" in algos:
        hdr += " | vegas / quest"
    hdr += " | " + " | ".join(f"x full {a} [bound]" for a in algos) + " |"
    lines += [hdr, "|" + "---:|" * (hdr.count("|") - 1)]
    ratio_vs: Dict[str, List[float]] = defaultdict(list)
    met = defaultdict(int)
    for (ctx, B, g, ratio), by_algo in cells.items():
        mal = {a: pooled_mal(by_algo.get(a, [])) for a in algos}
        row = f"| {ctx} | {B} | {g} | {ratio:g} | "
        row += " | ".join(_f(mal[a]) for a in algos)
        for other in ("streamingllm", "quest"):
            if "vegas" in algos and other in algos:
                q = mal["vegas"] / mal[other] if mal["vegas"] and mal[other] else None
                if q:
                    ratio_vs[other].append(q)
                    met[other] += q >= (1.15 if other == "streamingllm" else 1.0 + 1e-9)
                row += f" | {_f(q)}"
        for a in algos:
            rs = by_algo.get(a, [])
            row += f" | {_f(_med([r.get('speedup_vs_full') for r in rs]))} [{_f(_med([r.get('cost_model_speedup_bound') for r in rs]))}]"
        lines.append(row + " |")

    # 2. aggregates
    n = len(cells)
    lines += ["", "## Over the grid", ""]
    if ratio_vs.get("streamingllm"):
        lines.append(f"* vegas / streamingllm MAL: geometric mean {_f(_gmean(ratio_vs['streamingllm']))} over "
                     f"{len(ratio_vs['streamingllm'])} cells (min {_f(min(ratio_vs['streamingllm']))}, max "
                     f"{_f(max(ratio_vs['streamingllm']))}); >= 1.15x in {met['streamingllm']} of {n} cells.")
    if ratio_vs.get("quest"):
        lines.append(f"* vegas / quest MAL: geometric mean {_f(_gmean(ratio_vs['quest']))} (min "
                     f"{_f(min(ratio_vs['quest']))}, max {_f(max(ratio_vs['quest']))}); vegas above quest in "
                     f"{met['quest']} of {n} cells.")
    by_gamma = defaultdict(lambda: defaultdict(list))
    for (ctx, B, g, ratio), by_algo in cells.items():
        for a in algos:
            by_gamma[g][a] += by_algo.get(a, [])
    for g in sorted(by_gamma, key=lambda x: (isinstance(x, str), str(x) if isinstance(x, str) else x)):
        lines.append(f"* γ = {g}, all cells pooled: MAL " + ", ".join(
            f"{a} {_f(pooled_mal(by_gamma[g][a]))}" for a in algos) + ".")
    for a in algos:
        rs = [r for c in cells.values() for r in c.get(a, [])]
        sh = [r.get("select_overhead_share") for r in rs]
        sh = [x for x in sh if x is not None]
        if sh:
            lines.append(f"* {a}: selection time {100 * _med(sh):.1f} % of an iteration (median over "
                         f"{len(sh)} runs, max {100 * max(sh):.1f} %); decode speedup over `full` median "
                         f"{_f(_med([r.get('speedup_vs_full') for r in rs]))}, geometric mean "
                         f"{_f(_gmean([r.get('speedup_vs_full') for r in rs]))}.")
    best = defaultdict(lambda: (None, None))
    for (ctx, B, g, ratio), by_algo in cells.items():
        for a in algos:
            s = _med([r.get("decode_tokens_per_s") for r in by_algo.get(a, [])])
            if s is not None and (best[(ctx, B, a)][0] is None or s > best[(ctx, B, a)][0]):
                best[(ctx, B, a)] = (s, f"γ{g} r{ratio:g}")
    ident = [r.get("identical_to_plain") for r in records if r.get("identical_to_plain") is not None]
    ident_hf = [r.get("identical_to_hf") for r in records if r.get("identical_to_hf") is not None]
    lines.append(f"* Greedy output identical to our plain decoding in {sum(ident)} of {len(ident)} runs, "
                 f"to HF `generate` in {sum(ident_hf)} of {len(ident_hf)}.")

    # 3. plain decoding and the best configuration per algorithm
    lines += ["", "## Throughput per (context, batch): plain decoding and each algorithm's best configuration", "",
              "decode tok/s, median over documents; for a selection algorithm the configuration (γ, ratio) with "
              "the highest median.", "",
              "| ctx | B | HF generate | full | " + " | ".join(f"{a} (best)" for a in algos) + " |",
              "|---:|---:|---:|---:|" + "---|" * len(algos)]
    for ctx, B in sorted({(r["context_requested"], r["batch_size"]) for r in records}):
        plain = {a: _med([r.get("decode_tokens_per_s") for r in records
                          if (r["context_requested"], r["batch_size"], r["algorithm"]) == (ctx, B, a)])
                 for a in ("hf", "full")}
        row = f"| {ctx} | {B} | {_f(plain['hf'])} | {_f(plain['full'])} | "
        row += " | ".join(f"{_f(best[(ctx, B, a)][0])} ({best[(ctx, B, a)][1]})" if best[(ctx, B, a)][0] else "–"
                          for a in algos)
        lines.append(row + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Writes ``summary.md`` and the plots; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="runs.jsonl files of bench/e2e.py")
    ap.add_argument("--out", required=True, help="folder for summary.md and the plots")
    ap.add_argument("--no-detail", action="store_true", help="leave out the per-run detail table")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    for p in args.runs:
        if not os.path.exists(p):
            ap.error(f"runs file not found: {p}")
    records, configs = load_runs(args.runs)
    md = report_markdown(records, configs)
    if not args.no_detail:
        import e2e

        class _A:  # the fields summary_markdown reads
            dtype = records[0].get("dtype")
            max_new_tokens = records[0].get("max_new_tokens")
            repeats = max(r.get("repeat", 0) for r in records) + 1
            no_reuse_prefill = not records[0].get("prefill_reused")

        detail = e2e.summary_markdown(records, _A, records[0], records[0].get("model"))
        md += "\n## Every run\n\n" + detail.split("\n", 2)[2].lstrip("\n")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(md)
    print(md)
    if not args.no_plots:
        import plots

        for p in plots.write_plots(records, args.out):
            print(f"plot: {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
