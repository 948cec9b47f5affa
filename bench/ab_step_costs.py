"""bench/decode_step_costs.py in two checkouts, one process at a time: a decoding step's A/B.

    python -m bench.ab_step_costs --old-tree /path/to/other/checkout [--rounds 3] [--cpus 1] [--out PREFIX] \
        -- --contexts 8192 --batches 1,4 --gamma 4 --draft-weights int8 --profile --no-hf --threads 1

Each round runs ``python -m bench.decode_step_costs ARGS`` (this checkout's script: the same
measurement for both) once on each tree's package and build (``PYTHONPATH`` = its ``python/``),
the order alternating every round,
pinned to the same cores (``--cpus``, one by default, with as many OpenMP threads; as
bench/ab_trees_cpu.py, whose reasons apply: two trees timed at once in two processes measure
identical code 10-20 % apart on a shared 2-core VM). Reported per cell (context,
batch) and step: each tree's median over rounds of the per-process minimum, and the median of the
per-round ratio old / new; plus draft / plain step ratios and ``--profile``'s split of the draft
steps. Writes ``<--out>.{jsonl,md}`` (the raw records, one per tree and round, and the table).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import RESULTS, ROOT, add_cpus_flag, check_cpus, command_line, commit_label

STEPS = ("full_step_ms", "draft_step_ms", "draft_step_fp16_ms", "draft_step_int8_ms", "verify_ms", "select_ms")


def run_tree(tree: Path, argv, cpus: str, threads: int) -> list:
    """One ``decode_step_costs`` process (this checkout's) on ``tree``'s package, pinned to ``cpus``
    (a taskset list) with ``threads`` OpenMP threads (one per core): its JSON records."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "python"), str(ROOT)]),
               OMP_NUM_THREADS=str(threads))
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        cmd = ["taskset", "-c", cpus, sys.executable, "-m", "bench.decode_step_costs", *argv, "--out", f.name]
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        return [json.loads(line) for line in Path(f.name).read_text().splitlines() if line.strip()]


def _med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 2) if xs else None


def summarize(recs: dict) -> list:
    """Per (context, batch): medians over rounds per tree and step, and old / new per round."""
    rows = []
    cells = sorted({(r["context"], r["batch"]) for r in recs["new"]}, key=lambda c: (c[1], c[0]))
    for S, B in cells:
        by = {t: [r for r in recs[t] if (r["context"], r["batch"]) == (S, B)] for t in recs}
        row = dict(context=S, batch=B, rounds=len(by["new"]))
        for k in STEPS:
            if not all(k in r for t in by for r in by[t]):
                continue
            row[k] = {t: _med(r[k] for r in by[t]) for t in by}
            row[k]["old_over_new"] = _med(o[k] / n[k] for o, n in zip(by["old"], by["new"]))
            if k.startswith("draft_step"):
                row[k.replace("_ms", "_over_plain")] = {
                    t: round(statistics.median(r[k] / r["full_step_ms"] for r in by[t]), 3) for t in by}
        for t in by:
            profs = [r.get("profile_ms") for r in by[t] if r.get("profile_ms")]
            if profs:
                row.setdefault("profile_ms", {})[t] = {
                    step: {part: _med(p[step][part] for p in profs if step in p)
                           for part in ("wall", "attention", "linears", "other", "other_net")}
                    for step in profs[0] if step.startswith("draft_step")}
        rows.append(row)
    return rows


def markdown(rows, meta, argv) -> str:
    lines = [f"Command: `{command_line('ab_step_costs', argv)}`", "",
             f"new = {meta['new']}, old = {meta['old']}; one `decode_step_costs` process per tree at a time, order "
             f"alternating, {meta['rounds']} rounds, pinned to core(s) {meta['cpus']}; ms = median over rounds of each "
             "process's minimum; old / new = median of the per-round ratios.", "",
             "| context x batch | step | old ms | new ms | old / new | old / plain | new / plain |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        for k in STEPS:
            if k not in r:
                continue
            rel = r.get(k.replace("_ms", "_over_plain"), {})
            lines.append(f"| {r['context'] // 1024}K x {r['batch']} | {k[:-3]} | {r[k]['old']} | {r[k]['new']} | "
                         f"{r[k]['old_over_new']} | {rel.get('old', '-')} | {rel.get('new', '-')} |")
    if any("profile_ms" in r for r in rows):
        lines += ["", "Draft steps under torch.profiler (per process the fastest of 3 profiled forwards; medians over "
                  "rounds; ms): wall / attention ops / linears / other (= wall - both: the other ops and the Python, "
                  "with the profiler's own cost per op; % of wall) / other net (the unprofiled step time - "
                  "attention - linears; % of the step).", "",
                  "| context x batch | step | tree | wall | attention | linears | other | other net |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            for t, steps in r.get("profile_ms", {}).items():
                for step, p in steps.items():
                    share = f" ({100 * p['other'] / p['wall']:.0f} %)" if p["wall"] else ""
                    step_ms = r.get(f"{step}_ms", {}).get(t)
                    net = p.get("other_net")
                    net_s = "-" if net is None else f"{net}" + (f" ({100 * net / step_ms:.0f} %)" if step_ms else "")
                    lines.append(f"| {r['context'] // 1024}K x {r['batch']} | {step} | {t} | {p['wall']} | "
                                 f"{p['attention']} | {p['linears']} | {p['other']}{share} | {net_s} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    i = argv.index("--") if "--" in argv else len(argv)
    ours, theirs = argv[:i], argv[i + 1:]  # ours, then decode_step_costs's
    ap = argparse.ArgumentParser(prog="python -m bench.ab_step_costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-tree", required=True, help="a second checkout with an in-place build")
    ap.add_argument("--rounds", type=int, default=3)
    add_cpus_flag(ap)  # pass decode_step_costs a matching --threads
    ap.add_argument("--out", default=str(RESULTS / "tmp" / "ab_step_costs"))
    args = ap.parse_args(ours)
    threads = check_cpus(ap, args)
    trees = {"new": ROOT, "old": Path(args.old_tree).resolve()}
    recs = {t: [] for t in trees}
    for rnd in range(args.rounds):
        for t in (["new", "old"] if rnd % 2 == 0 else ["old", "new"]):
            recs[t] += [dict(r, tree=t, round=rnd) for r in run_tree(trees[t], theirs, args.cpus, threads)]
            print(f"round {rnd} {t} done", file=sys.stderr, flush=True)
    meta = dict(new=commit_label(trees["new"]), old=commit_label(trees["old"]), rounds=args.rounds, cpus=args.cpus,
                argv=sys.argv)
    rows = summarize(recs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out + ".jsonl", "w") as f:
        f.write(json.dumps(meta) + "\n")
        for t in recs:
            for r in recs[t]:
                f.write(json.dumps(r) + "\n")
    md = markdown(rows, meta, argv)
    Path(args.out + ".md").write_text(md)
    print(md, end="")


if __name__ == "__main__":
    main()
