"""verify_attention (or sparse_draft_attention) in two checkouts, one process at a time: a kernel change's A/B.

    python -m bench.ab_trees_cpu --old-tree /path/to/other/checkout [--rounds 4] [--layers 30] [--out PREFIX]
    python -m bench.ab_trees_cpu --old-tree ... --op sparse_draft_attention --layers 30   # a draft step's reads

Each round runs one fresh process per tree (the order alternating every round), each timing every
cell (median of --calls calls after 3 untimed ones) pinned to --cpus (one core by default) with a
thread per core, with its own inputs (`tests/op_utils.make_inputs`, the tests' generator). Reported per cell: the median
over rounds of each tree's time and of the per-round ratio old / new. With --layers N each call
attends over each of N copies of the cache in turn, allocated on huge pages as VegasCache allocates
its buffers, so the K/V come from DRAM as in a decoding step (the default, one cache, stays in the
last-level cache at these sizes). With --op sparse_draft_attention each cell is one draft token at the
vegas default: --budget of the S tokens (5 %) as sorted random 1-token blocks before a tail of 7
tokens, per batch row and KV head (--queries is ignored).

One process at a time, because two trees timed at once in two processes (interleaved call by
call) measured identical code 10-20 % apart on a 2-core Intel Xeon VM; one at a time, cells whose
code did not change measure ~1.0x within the round-to-round noise. Each worker imports its tree's
``vegas_ext`` and the tests' ``op_utils`` through ``PYTHONPATH``.
Writes <--out>.{jsonl,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import GRID_SHAPES as SHAPES, RESULTS, ROOT, add_cpus_flag, check_cpus, command_line, commit_label

WORKER = r"""
import json, sys, time, torch
import vegas_ext.ops  # noqa: F401  (loads this tree's extension)
from op_utils import make_inputs
torch.set_num_threads(int(sys.argv[6]))
cells, calls, layers = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
op, budget = sys.argv[4], float(sys.argv[5])
out = []
for B, Q, Hq, Hkv, D, S, bs in cells:
    q, k, v, _ = make_inputs(B, Q, Hq, Hkv, D, S, torch.float32, seed=0)
    lens = torch.full((B,), S, dtype=torch.int32)
    if op == "sparse_draft_attention":  # one draft token: sorted random 1-token blocks before a 7-token tail
        g = torch.Generator().manual_seed(2)
        nsel = int(budget * S)
        idx = torch.stack([torch.randperm(S - 7, generator=g)[:nsel].sort().values for _ in range(B * Hkv)])
        idx, tail, q = idx.view(B, Hkv, nsel).int(), torch.full((B,), S - 7, dtype=torch.int32), q[:, -1:]
    if layers > 1:  # one cache per layer, on huge pages as VegasCache allocates them: read from DRAM
        from vegas_ext.cache import advise_huge_pages
        kv = []
        for _ in range(layers):
            kk, vv = torch.empty_like(k), torch.empty_like(v)
            advise_huge_pages(kk)
            advise_huge_pages(vv)
            kv.append((kk.copy_(k), vv.copy_(v)))
        del k, v
    else:
        kv = [(k, v)]
    def f():
        for kk, vv in kv:
            if op == "sparse_draft_attention":
                torch.ops.vegas.sparse_draft_attention(q, kk, vv, idx, tail, lens, 1, D ** -0.5)
            else:
                torch.ops.vegas.verify_attention(q, kk, vv, lens, bs, D ** -0.5, None)
    for _ in range(3 if layers == 1 else 1):
        f()
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t) / len(kv))
    ts.sort()
    out.append(ts[len(ts) // 2])
    del kv
print(json.dumps(out))
"""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.ab_trees_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-tree", required=True, help="a second checkout with an in-place build")
    ap.add_argument("--shapes", nargs="+", default=["smollm2-b4", "llama3-8b-b1"], choices=sorted(SHAPES))
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 2, 5, 7, 9])
    ap.add_argument("--block-size", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=15)
    add_cpus_flag(ap)
    ap.add_argument("--layers", type=int, default=1,
                    help="time one call on each of this many copies of the cache (on huge pages), so the "
                         "K/V come from DRAM as in a decoding step (30: SmolLM2's layers); the time is per call")
    ap.add_argument("--op", default="verify_attention", choices=["verify_attention", "sparse_draft_attention"])
    ap.add_argument("--budget", type=float, default=0.05,
                    help="sparse_draft_attention: the selected fraction of the S tokens (vegas's default ratio)")
    ap.add_argument("--out", default=str(RESULTS / "tmp" / "ab_trees"))
    args = ap.parse_args(argv)
    args.threads = check_cpus(ap, args)
    if not 0 < args.budget < 1:
        ap.error(f"--budget must be in (0, 1), got {args.budget}")
    if args.op == "sparse_draft_attention":
        args.queries = [1]
    return args


def run_tree(tree: Path, cells, args) -> list:
    """One worker process on ``tree``'s build: the median seconds per call of every cell."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "python"), str(ROOT / "tests")]))
    cmd = ["taskset", "-c", args.cpus, sys.executable, "-c", WORKER, json.dumps(cells), str(args.calls),
           str(args.layers), args.op, str(args.budget), str(args.threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(res.stdout.strip().splitlines()[-1])


def result_rows(names, times, args) -> list:
    """Per cell: each tree's median over rounds and the per-round old / new ratio (median, min, max)."""
    rows = []
    for i, (s, S, Q) in enumerate(names):
        new = [times["new"][r][i] for r in range(args.rounds)]
        old = [times["old"][r][i] for r in range(args.rounds)]
        ratios = [o / n for o, n in zip(old, new)]
        B, Hq, Hkv, D = SHAPES[s]
        rows.append(dict(shape=s, S=S, Q=Q, R=Q * Hq // Hkv, D=D, block_size=args.block_size, threads=args.threads,
                         new_ms=round(1e3 * statistics.median(new), 3), old_ms=round(1e3 * statistics.median(old), 3),
                         speedup=round(statistics.median(ratios), 3), speedup_min=round(min(ratios), 3),
                         speedup_max=round(max(ratios), 3),
                         new_gflops=round(4 * B * Hq * Q * S * D / statistics.median(new) / 1e9, 1)
                         if args.op == "verify_attention" else None))
    return rows


def markdown(rows, meta, args, argv) -> str:
    thr = f"{args.threads} thread{'s' if args.threads > 1 else ''} (cores {args.cpus})"
    what = (f"verify_attention, fp32, {thr}, block size {args.block_size}" if args.op == "verify_attention" else
            f"sparse_draft_attention, fp32, {thr}, one draft token over {args.budget:g} of S in 1-token "
            "blocks + a 7-token tail")
    lines = [f"Command: `{command_line('ab_trees_cpu', argv)}`", "",
             what + f"; new = {meta['new']}, old = {meta['old']}; one process per tree at a time, order "
             f"alternating, {args.rounds} rounds, median of {args.calls} calls per cell and round"
             + (f" (each call: one per copy of the cache, {args.layers} copies on huge pages, K/V from DRAM; "
                "time per copy)" if args.layers > 1 else "")
             + ". Speedup = old / new per round, median (min-max).", "",
             "| shape | S | Q | rows R | new ms | old ms | speedup | new GFLOP/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['S']} | {r['Q']} | {r['R']} | {r['new_ms']} | {r['old_ms']} | "
                     f"{r['speedup']} ({r['speedup_min']}-{r['speedup_max']}) | {r['new_gflops'] or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    cells = [(SHAPES[s][0], Q, SHAPES[s][1], SHAPES[s][2], SHAPES[s][3], S, args.block_size)
             for s in args.shapes for S in args.seq_lens for Q in args.queries]
    names = [(s, S, Q) for s in args.shapes for S in args.seq_lens for Q in args.queries]
    trees = {"new": ROOT, "old": Path(args.old_tree).resolve()}
    times = {t: [] for t in trees}
    for rnd in range(args.rounds):
        for t in (["new", "old"] if rnd % 2 == 0 else ["old", "new"]):
            times[t].append(run_tree(trees[t], cells, args))
            print(f"round {rnd} {t} done", file=sys.stderr, flush=True)
    rows = result_rows(names, times, args)
    meta = dict(cpu=platform.processor() or platform.machine(), op=args.op,
                budget=args.budget if args.op == "sparse_draft_attention" else None,
                new=commit_label(trees["new"]), old=commit_label(trees["old"]),
                rounds=args.rounds, calls=args.calls, layers=args.layers, argv=sys.argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out + ".jsonl", "w") as f:
        f.write(json.dumps(meta) + "\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")
    md = markdown(rows, meta, args, argv)
    Path(args.out + ".md").write_text(md)
    print(md, end="")


if __name__ == "__main__":
    main()
