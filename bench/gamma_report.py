#!/usr/bin/env python3
"""``num_speculative_tokens="auto"`` against ``full`` and fixed gammas, from ``bench/e2e.py`` runs.

For every (document, context, batch) cell: the decode speedup over ``full`` of ``auto`` and of each
fixed gamma (median over repeats, each run against the ``full`` run of the same repeat), the best
fixed gamma, ``auto / best fixed``, the gammas ``auto`` chose (histogram over all its iterations)
and whether the targets hold (``auto >= 0.97 x full``; ``auto >= 0.95 x best fixed``). Then the
same per (context, batch) with medians over documents.

Usage::

    python bench/gamma_report.py bench/results/auto_gamma_cpu/*/runs.jsonl --out bench/results/auto_gamma_cpu

Writes ``<out>/summary.md`` (also printed) and ``<out>/gamma_per_iteration.png`` (all auto runs);
use a folder of its own (not one of the e2e runs', whose summary.md it would replace).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report import load_runs  # noqa: E402

FULL_TARGET = 0.97
BEST_TARGET = 0.95


def _med(xs) -> Optional[float]:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else None


def _f(x, fmt="{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def cell_rows(records: List[Dict[str, Any]]) -> Dict[tuple, Dict[Any, Dict[str, Any]]]:
    """``{(doc, context, batch): {gamma: {"speedup", "tok_s", "mal", "hist", "identical"}}}`` for the
    ``vegas`` runs (gamma an int or ``"auto"``) and ``full`` (key ``"full"``)."""
    groups: Dict[tuple, Dict[Any, List[Dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r["algorithm"] == "full":
            groups[(r["doc"], r["context"], r["batch_size"])]["full"].append(r)
        elif r["algorithm"] == "vegas" and not r.get("variant"):
            groups[(r["doc"], r["context"], r["batch_size"])][r["num_speculative_tokens"]].append(r)
    out = {}
    for key, by_g in groups.items():
        out[key] = {}
        for g, rs in by_g.items():
            hist = None
            if g == "auto":
                hists = [r.get("gamma_histogram") for r in rs if r.get("gamma_histogram")]
                hist = [sum(h[i] for h in hists) for i in range(len(hists[0]))] if hists else None
            out[key][g] = {
                "speedup": 1.0 if g == "full" else _med([r.get("speedup_vs_full") for r in rs]),
                "tok_s": _med([r.get("decode_tokens_per_s") for r in rs]),
                "mal": _med([r.get("mean_acceptance_length") for r in rs]),
                "hist": hist,
                "identical": all(r.get("identical_to_plain") for r in rs),
                "n": len(rs),
            }
    return dict(sorted(out.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])))


def _fixed(cell) -> List[int]:
    return sorted(g for g in cell if isinstance(g, int))


def summary_markdown(records: List[Dict[str, Any]]) -> str:
    cells = cell_rows(records)
    gammas = sorted({g for c in cells.values() for g in _fixed(c)})
    r0 = records[0]
    commits = sorted({str(r.get("git_commit"))[:10] + (" (dirty)" if r.get("git_dirty") else "") for r in records})
    new_tokens = sorted({r.get("max_new_tokens") for r in records}, key=str)
    lines = [
        "# num_speculative_tokens=auto vs full and fixed gamma",
        "",
        f"Model {r0.get('model')}, {r0.get('dtype')}, {r0.get('device')} ({r0.get('device_name')}, "
        f"{r0.get('num_threads')} thread(s)); commit {', '.join(commits)}; "
        f"{' / '.join(map(str, new_tokens))} new tokens per row (by run: see runs.jsonl), greedy, "
        "EOS ignored; vegas ratio 0.05, min 256 tokens, block size 1; auto: max_speculative_tokens "
        "8. Speedup = decode tok/s / decode tok/s of `full` in the same repeat (median over repeats).",
        "",
        "| doc | ctx | B | full tok/s | auto | " + " | ".join(f"γ {g}" for g in gammas)
        + " | best fixed | auto / best | auto γ histogram (0..8) | auto MAL | ≥0.97 full | ≥0.95 best | identical |",
        "| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in gammas)
        + " | --- | ---: | --- | ---: | --- | --- | --- |",
    ]
    per_ctx = defaultdict(lambda: defaultdict(list))
    for (doc, ctx, B), c in cells.items():
        auto = c.get("auto", {})
        fixed = {g: c[g]["speedup"] for g in _fixed(c) if c[g]["speedup"] is not None}
        best_g = max(fixed, key=fixed.get) if fixed else None
        a = auto.get("speedup")
        rel = a / fixed[best_g] if a is not None and best_g is not None else None
        ident = all(v["identical"] for v in c.values())
        lines.append(
            f"| {doc} | {ctx} | {B} | {_f(c.get('full', {}).get('tok_s'))} | **{_f(a)}** | "
            + " | ".join(_f(c[g]["speedup"]) if g in c else "–" for g in gammas)
            + f" | γ {best_g} ({_f(fixed.get(best_g))}) | {_f(rel)} | {auto.get('hist')} | {_f(auto.get('mal'))} | "
            f"{'–' if a is None else ('yes' if a >= FULL_TARGET else '**no**')} | "
            f"{'–' if rel is None else ('yes' if rel >= BEST_TARGET else '**no**')} | {'yes' if ident else '**no**'} |"
        )
        for g, v in c.items():
            per_ctx[(ctx, B)][g].append(v["speedup"])
    lines += ["", "Medians over documents:", "",
              "| ctx | B | auto | " + " | ".join(f"γ {g}" for g in gammas) + " | best fixed | auto / best |",
              "| ---: | ---: | ---: | " + " | ".join("---:" for _ in gammas) + " | --- | ---: |"]
    for (ctx, B), by_g in sorted(per_ctx.items()):
        fixed = {g: _med(by_g[g]) for g in gammas if by_g.get(g)}
        best_g = max(fixed, key=fixed.get) if fixed else None
        a = _med(by_g.get("auto", []))
        lines.append(f"| {ctx} | {B} | **{_f(a)}** | " + " | ".join(_f(fixed.get(g)) for g in gammas)
                     + f" | γ {best_g} | {_f(a / fixed[best_g] if a and best_g is not None else None)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="runs.jsonl files of bench/e2e.py")
    ap.add_argument("--out", default=None, help="folder for summary.md and the plot (default: print only)")
    args = ap.parse_args(argv)
    records, _ = load_runs(args.runs)
    if not records:
        raise SystemExit("gamma_report: no runs found")
    md = summary_markdown(records)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "summary.md"), "w") as f:
            f.write(md)
        try:
            import plots

            print(f"plot: {plots.gamma_plot(records, args.out)}", file=sys.stderr)
        except ImportError as e:
            print(f"plot skipped: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
