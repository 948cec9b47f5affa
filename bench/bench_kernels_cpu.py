"""CPU microbenchmark of the vegas kernels.

    python bench/bench_kernels_cpu.py [--seq-lens 2048 8192 32768] [--dtype float32] [--repeats 7]
    python bench/bench_kernels_cpu.py --grid [--old-tree /path/to/other/checkout] [--repeats 5]

--grid: verify_attention (block scores included) over model shapes (SmolLM2 9/3 heads D 64 at
batch 1 and 4, Llama-3-8B 32/8 D 128 at batch 1) x S x Q x block size x threads, each row with
its achieved GFLOP/s (4 * B * Hq * Q * S * D flops: QK and PV, causal cut ignored) and its ratio
per thread to a square 1024^3 torch.mm on one thread, and, at Q = 1, the K/V bytes read per
second against a one-thread tensor copy of the same size (bytes read per second), all measured
in the same run, interleaved, medians of wall-clock times. With --old-tree, a second worker
process runs the same calls on that checkout's in-place build (two builds cannot share one
process: both register the same operators), interleaved call by call with ours, so old and
new see the same machine load (each timed call right after an untimed one, the order of the
trees alternating every repeat: use an even --repeats; the anchors of a cell are timed before
its kernel calls, not between them). Also block_topk at the vegas default (block size 1: one row
per (batch, KV head, layer), all layers in one call) and sparse_draft_attention at the vegas
default (5 % of 8K tokens in 1-token blocks, 30 layers' caches, so its gathers come from DRAM;
--skip-verify: only these). Writes <--out>_grid.{jsonl,md}.

Compares, in one process, interleaved, medians of --repeats:
* verify_attention (Q=7, GQA 4: 32 query / 8 KV heads, D=128) vs
  torch SDPA on the same cache with the causal mask, K/V repeated for GQA
  (and SDPA with enable_gqa=True), at each S. Ours also produces block scores.
* sparse_draft_attention with a 5 % budget (block 16) vs dense single-query decode
  attention over the full cache (SDPA, Q=1) at the largest S.
* block_topk on the largest S's blocks (2048 at 32K) x 8 heads x batch 4, 5 % kept, vs one
  verify_attention at that S.
Writes <--out>.{jsonl,md} (default bench/results/tmp/, ignored by git).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Optional
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GRID_SHAPES, ROOT, run_metadata, time_fns, write_rows  # noqa: E402

if "--worker" not in sys.argv:
    import vegas_ext  # noqa: E402,F401
    from vegas_ext import reference  # noqa: E402

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sdpa_verify(q, k, v, mask, group, enable_gqa):
    qh = q.transpose(1, 2)  # [B, Hq, Q, D]
    if enable_gqa:
        return F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=True)
    kr = k.repeat_interleave(group, dim=1)
    vr = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(qh, kr, vr, attn_mask=mask)


def worker(tree: str):
    """Serves timing requests (JSON lines on stdin) with the extension of checkout ``tree``."""
    sys.path.insert(0, str(Path(tree) / "python"))
    import vegas_ext.ops  # noqa: F401  (the package import is lazy; ops loads the extension)

    state = {}
    out = sys.stdout
    sys.stdout = sys.stderr
    for line in sys.stdin:
        req = json.loads(line)
        torch.set_num_threads(int(req.get("threads", 1)))
        if req["op"] == "setup":
            B, Hq, Hkv, D, S = (req[x] for x in ("B", "Hq", "Hkv", "D", "S"))
            g = torch.Generator().manual_seed(0)
            state.clear()
            state["kv"] = (torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g))
            state["lens"] = torch.full((B,), S, dtype=torch.int32)
            state["B"], state["Hq"], state["D"] = B, Hq, D
            res = {"ok": True, "file": vegas_ext.__file__}
        elif req["op"] == "verify":
            k, v = state["kv"]
            q = state.get(("q", req["Q"]))
            if q is None:
                q = state[("q", req["Q"])] = torch.randn(state["B"], req["Q"], state["Hq"], state["D"])
            f = torch.ops.vegas.verify_attention
            args = (q, k, v, state["lens"], req["bs"], state["D"] ** -0.5, None)
            t = time.perf_counter()
            f(*args)
            res = {"s": time.perf_counter() - t}
        elif req["op"] == "mm":
            a = state.setdefault("mm", (torch.randn(1024, 1024), torch.randn(1024, 1024)))
            t = time.perf_counter()
            torch.mm(*a)
            res = {"s": time.perf_counter() - t}
        elif req["op"] == "copy":
            n = req["numel"]
            if state.get("copy_n") != n:
                state["copy"] = (torch.randn(n), torch.empty(n))
                state["copy_n"] = n
            src, dst = state["copy"]
            t = time.perf_counter()
            dst.copy_(src)
            res = {"s": time.perf_counter() - t}
        elif req["op"] == "read":
            n = req["numel"]
            if state.get("read_n") != n:
                state["read"] = torch.randn(n)
                state["read_n"] = n
            src = state["read"]
            t = time.perf_counter()
            src.sum()
            res = {"s": time.perf_counter() - t}
        elif req["op"] == "draft":
            # sparse_draft_attention at the vegas default over `layers` distinct caches (each call
            # reads its K/V from DRAM, as the 30 layers of a draft step do): K sorted random
            # 1-token blocks before the tail of 7 tokens, all layers timed together
            B, Hq, Hkv, D, S, K, L = (req[x] for x in ("B", "Hq", "Hkv", "D", "S", "K", "layers"))
            key = (B, Hq, Hkv, D, S, K, L)
            if state.get("draft_key") != key:
                g = torch.Generator().manual_seed(2)
                kv = [(torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)) for _ in range(L)]
                idx = torch.stack([torch.randperm(S - 7, generator=g)[:K].sort().values for _ in range(B * Hkv)])
                state["draft"] = (kv, idx.view(B, Hkv, K).int(), torch.full((B,), S - 7, dtype=torch.int32),
                                  torch.full((B,), S, dtype=torch.int32), torch.randn(B, 1, Hq, D))
                state["draft_key"] = key
            kv, idx, tail, lens, q = state["draft"]
            f = torch.ops.vegas.sparse_draft_attention
            t = time.perf_counter()
            for k, v in kv:
                f(q, k, v, idx, tail, lens, 1, D ** -0.5)
            res = {"s": time.perf_counter() - t}
        elif req["op"] == "topk":
            R, N, kk = req["rows"], req["N"], req["k"]
            if state.get("topk_key") != (R, N, kk):
                g = torch.Generator().manual_seed(1)
                state["topk"] = (torch.rand(1, R, N, generator=g), torch.full((1,), kk, dtype=torch.int32),
                                 torch.full((1,), N, dtype=torch.int32))
                state["topk_key"] = (R, N, kk)
            sc, kt, nc = state["topk"]
            t = time.perf_counter()
            torch.ops.vegas.block_topk(sc, kt, nc, kk, 1)
            res = {"s": time.perf_counter() - t}
        else:
            res = {"error": req["op"]}
        out.write(json.dumps(res) + "\n")
        out.flush()


class Worker:
    def __init__(self, tree):
        self.p = subprocess.Popen([sys.executable, __file__, "--worker", str(tree)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))

    def __call__(self, **req):
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self):
        self.p.stdin.close()
        self.p.wait()


def fma_peak_gflops() -> Optional[float]:
    """One core's fp32 FMA peak (bench/fma_peak.cpp, compiled here with g++ -march=native), or
    None without a compiler. The fastest of three runs."""
    exe = ROOT / "bench" / "results" / "tmp" / "fma_peak"
    exe.parent.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["g++", "-O3", "-march=native", str(ROOT / "bench" / "fma_peak.cpp"), "-o", str(exe)],
                       check=True, capture_output=True)
        return max(float(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()[0])
                   for _ in range(3))
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


def grid_targets(rows, names, peak=None):
    """Markdown lines: the grid read against the kernel's targets (medians over the matching rows)."""
    ver = [r for r in rows if r.get("kernel") == "verify_attention"]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    out = ["", "Against the targets (medians over the rows named; `new` first, then the other trees):", ""]
    out.append("| target | cell | " + " | ".join(names) + " |")
    out.append("|---|---|" + "---|" * len(names))
    for shape in dict.fromkeys(r["shape"] for r in ver):
        for S in sorted({r["S"] for r in ver if r["shape"] == shape}):
            sel = [r for r in ver if r["shape"] == shape and r["S"] == S and r["threads"] == 1 and 5 <= r["Q"] <= 9]
            if sel:
                out.append(f"| Q 5-9, 1 thread: GFLOP/s / sgemm >= 0.60 | {shape} {S} | "
                           + " | ".join(f"{med([r[f'{n}_ratio_sgemm_per_thread'] for r in sel]):.2f}" for n in names) + " |")
                if peak:
                    out.append(f"| Q 5-9, 1 thread: GFLOP/s / FMA peak (stricter) | {shape} {S} | "
                               + " | ".join(f"{med([r[f'{n}_gflops'] for r in sel]) / peak:.2f}" for n in names) + " |")
    q1 = [r for r in ver if r["Q"] == 1 and r["threads"] == 1 and "copy_gbs" in r]
    if q1:
        out.append("| Q 1, 1 thread: K/V GB/s / copy >= 0.70 | all shapes, S | "
                   + " | ".join(f"{med([r[f'{n}_ratio_copy'] for r in q1]):.2f}" for n in names) + " |")
        out.append("| Q 1, 1 thread: K/V GB/s / read-only stream (stricter) | all shapes, S | "
                   + " | ".join(f"{med([r[f'{n}_ratio_read'] for r in q1]):.2f}" for n in names) + " |")
    key = lambda r: (r["shape"], r["S"], r["Q"], r["block_size"])  # noqa: E731
    one = {key(r): r for r in ver if r["threads"] == 1}
    for bs in sorted({r["block_size"] for r in ver}):
        two = [(one[key(r)], r) for r in ver if r["threads"] == 2 and r["S"] == 8192 and r["block_size"] == bs
               and key(r) in one and r["Q"] > 1]
        if two:
            out.append(f"| 2 threads / 1 thread speed >= 1.7, S 8K, Q > 1 | block size {bs} | "
                       + " | ".join(f"{med([a[f'{n}_ms'] / b[f'{n}_ms'] for a, b in two]):.2f}" for n in names) + " |")
    for thr in sorted({r["threads"] for r in ver}):
        by = {(r["shape"], r["S"], r["Q"]): {} for r in ver if r["threads"] == thr}
        for r in ver:
            if r["threads"] == thr:
                by[(r["shape"], r["S"], r["Q"])][r["block_size"]] = r
        pairs = [v for k, v in by.items() if 1 in v and 16 in v and k[2] > 1]
        if pairs:
            out.append(f"| block size 1 / block size 16 time <= 1.10, Q > 1 | {thr} thread(s) | "
                       + " | ".join(f"{med([v[1][f'{n}_ms'] / v[16][f'{n}_ms'] for v in pairs]):.2f}" for n in names) + " |")
    return out


def grid(args):
    meta = run_metadata("cpu")
    trees = {"new": ROOT}
    if args.old_tree:
        trees["old"] = Path(args.old_tree)
    commits = {}
    for name, tree in trees.items():
        commits[name] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
                                       text=True).stdout.strip()
    workers = {name: Worker(tree) for name, tree in trees.items()}
    load0 = os.getloadavg()
    rows, lines = [], []

    def emit(line=""):
        lines.append(line)
        print(line, flush=True)

    def med(fn, n):
        return statistics.median(fn()["s"] for _ in range(n))

    names = list(trees)
    peak = fma_peak_gflops()
    meta["fma_peak_gflops"] = peak
    emit(f"# verify_attention grid: {meta['device_name']}, torch {meta['torch']}, fp32 cache, "
         + ", ".join(f"{n} = {commits[n]}" for n in names) + f", load average at start {load0[0]:.1f}")
    emit("")
    emit("Ratios: GFLOP/s per thread / one-thread 1024^3 torch.mm GFLOP/s; Q = 1: K/V GB/s / one-thread copy GB/s "
         "(bytes read per second of a tensor copy of the K/V's size) and / one-thread read GB/s (a `sum` over a "
         "tensor of that size: a read-only stream, the stricter anchor) (same run, interleaved, medians of "
         "wall-clock times).")
    if peak:
        emit("")
        emit(f"One core's fp32 FMA peak (bench/fma_peak.cpp, FMAs in registers): {peak:.0f} GFLOP/s. A BLAS need not "
             "reach it on every processor (on AMD EPYC, MKL's sgemm inside torch runs well below it), so the "
             "targets table also reads the kernel against it.")
    emit("")
    hdr = "| shape | S | Q | bs | thr | sgemm GF/s | " + " | ".join(f"{n} ms | {n} GF/s | {n} ratio" for n in names)
    hdr += " | copy GB/s | read GB/s | " + " | ".join(f"{n} GB/s | {n} /copy | {n} /read" for n in names) + " |"
    emit(hdr)
    emit("|" + "---|" * (hdr.count("|") - 1))
    for shape in ([] if args.skip_verify else args.shapes):
        B, Hq, Hkv, D = GRID_SHAPES[shape]
        for S in args.seq_lens:
            for w in workers.values():
                assert w(op="setup", B=B, Hq=Hq, Hkv=Hkv, D=D, S=S)["ok"]
            kv_bytes = 2 * B * Hkv * S * D * 4
            for threads in args.threads:
                for Q in args.queries:
                    for bs in args.block_sizes:
                        for w in workers.values():  # warm-up
                            w(op="verify", Q=Q, bs=bs, threads=threads)
                        samples = {n: [] for n in names}
                        mm, cp, rd = [], [], []
                        # The anchors first, then a pause, then the kernels: a 2-thread kernel
                        # call right after a torch.mm ran up to ~2x slower (the same tree in both
                        # roles included; OMP_WAIT_POLICY=PASSIVE did not help).
                        for _ in range(args.repeats):
                            mm.append(workers["new"](op="mm", threads=1)["s"])
                            if Q == 1:
                                cp.append(workers["new"](op="copy", numel=kv_bytes // 4, threads=1)["s"])
                                rd.append(workers["new"](op="read", numel=kv_bytes // 4, threads=1)["s"])
                        time.sleep(0.3)
                        for rep in range(args.repeats):
                            # each call right after an untimed one (as in a forward, where the
                            # calls come back to back); the order of the trees alternates.
                            for n in (names if rep % 2 == 0 else names[::-1]):
                                workers[n](op="verify", Q=Q, bs=bs, threads=threads)
                                samples[n].append(workers[n](op="verify", Q=Q, bs=bs, threads=threads)["s"])
                        flops = 4 * B * Hq * Q * S * D
                        g_mm = 2 * 1024 ** 3 / statistics.median(mm) / 1e9
                        r = dict(meta, kernel="verify_attention", shape=shape, B=B, Hq=Hq, Hkv=Hkv, D=D, S=S, Q=Q,
                                 block_size=bs, threads=threads, dtype="float32", sgemm_gflops=g_mm,
                                 load_avg=os.getloadavg()[0])
                        cells = []
                        for n in names:
                            t = statistics.median(samples[n])
                            gf = flops / t / 1e9
                            r[f"{n}_commit"], r[f"{n}_ms"], r[f"{n}_gflops"] = commits[n], t * 1e3, gf
                            r[f"{n}_ratio_sgemm_per_thread"] = gf / threads / g_mm
                            cells.append(f"{t * 1e3:.2f} | {gf:.1f} | {gf / threads / g_mm:.2f}")
                        line = f"| {shape} | {S} | {Q} | {bs} | {threads} | {g_mm:.0f} | " + " | ".join(cells)
                        if Q == 1:
                            g_cp = kv_bytes / statistics.median(cp) / 1e9
                            g_rd = kv_bytes / statistics.median(rd) / 1e9
                            r["copy_gbs"], r["read_gbs"] = g_cp, g_rd
                            cc = []
                            for n in names:
                                gb = kv_bytes / (r[f"{n}_ms"] / 1e3) / 1e9
                                r[f"{n}_kv_gbs"], r[f"{n}_ratio_copy"], r[f"{n}_ratio_read"] = gb, gb / g_cp, gb / g_rd
                                cc.append(f"{gb:.1f} | {gb / g_cp:.2f} | {gb / g_rd:.2f}")
                            line += f" | {g_cp:.1f} | {g_rd:.1f} | " + " | ".join(cc) + " |"
                        else:
                            line += " | - | - | " + " | ".join("- | - | -" for _ in names) + " |"
                        rows.append(r)
                        emit(line)
    # sparse_draft_attention at the vegas default: 5 % of 8K in 1-token blocks, 30 layers
    emit("")
    emit("| sparse_draft_attention, 30 layers x (shape, 8K, 5 % budget in 1-token blocks + 7 tail tokens), 1 thread | "
         + " | ".join(f"{n} ms" for n in names) + " |")
    emit("|---|" + "---|" * len(names))
    for shape in ("smollm2-b1", "smollm2-b4"):
        B, Hq, Hkv, D = GRID_SHAPES[shape]
        req = dict(op="draft", B=B, Hq=Hq, Hkv=Hkv, D=D, S=8192, K=410, layers=30, threads=1)
        samples = {n: [] for n in names}
        for w in workers.values():
            w(**req)
        for rep in range(args.repeats):
            for n in (names if rep % 2 == 0 else names[::-1]):
                samples[n].append(workers[n](**req)["s"])
        r = dict(meta, kernel="sparse_draft_attention", shape=shape, B=B, Hq=Hq, Hkv=Hkv, D=D, S=8192, K=410,
                 layers=30, block_size=1, threads=1)
        for n in names:
            r[f"{n}_ms"] = statistics.median(samples[n]) * 1e3
        rows.append(r)
        emit(f"| {shape} | " + " | ".join(f"{r[f'{n}_ms']:.2f}" for n in names) + " |")
    # block_topk at the vegas default: block size 1 (N = S blocks), one row per (batch, KV head, layer)
    emit("")
    emit("| block_topk rows x N, k | " + " | ".join(f"{n} ms" for n in names) + " |")
    emit("|---|" + "---|" * len(names))
    for rows_, N in ((4 * 3 * 30, 8192), (4 * 3 * 30, 2048)):
        kk = math.ceil(0.05 * N)
        samples = {n: [] for n in names}
        for w in workers.values():
            w(op="topk", rows=rows_, N=N, k=kk, threads=2)
        for _ in range(args.repeats):
            for n in names:
                samples[n].append(workers[n](op="topk", rows=rows_, N=N, k=kk, threads=2)["s"])
        r = dict(meta, kernel="block_topk", rows=rows_, N=N, k=kk, threads=2)
        for n in names:
            r[f"{n}_ms"] = statistics.median(samples[n]) * 1e3
        rows.append(r)
        emit(f"| {rows_} x {N}, k={kk} (SmolLM2 batch 4, 30 layers, bs 1) | " + " | ".join(f"{r[f'{n}_ms']:.2f}" for n in names) + " |")
    for w in workers.values():
        w.close()
    for line in grid_targets(rows, names, peak):
        emit(line)
    load1 = os.getloadavg()
    emit("")
    emit(f"Load average (1/5/15 min) at start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, "
         f"at end {load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f} on {os.cpu_count()} CPUs.")
    out = Path(str(args.out) + "_grid")
    write_rows(out.with_suffix(".jsonl"), rows)
    cmd = "python bench/bench_kernels_cpu.py " + " ".join(sys.argv[1:])
    out.with_suffix(".md").write_text(f"Command: `{cmd.strip()}`\n\n" + "\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.jsonl')} and {out.with_suffix('.md')}")


def main():
    if "--worker" in sys.argv:
        return worker(sys.argv[sys.argv.index("--worker") + 1])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", action="store_true", help="the verify_attention grid (see above)")
    ap.add_argument("--old-tree", help="--grid: a second checkout with an in-place build, timed side by side")
    ap.add_argument("--skip-verify", action="store_true",
                    help="--grid: only the sparse_draft_attention and block_topk rows")
    ap.add_argument("--shapes", nargs="+", default=list(GRID_SHAPES), choices=list(GRID_SHAPES))
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 5, 7, 9])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--dtype", choices=list(DT), default="float32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tmp" / "kernels_cpu",
                    help="output prefix (.jsonl, .md); the committed results are in bench/results/kernels_*/")
    args = ap.parse_args()
    if args.grid:
        return grid(args)
    dt = DT[args.dtype]
    B, Q, Hq, Hkv, D, bs = args.batch, 7, 32, 8, 128, 16
    group = Hq // Hkv
    scale = D ** -0.5
    meta = run_metadata("cpu")
    rows = []
    lines = []

    def emit(line=""):  # print and keep for the Markdown file
        lines.append(line)
        print(line)

    emit(f"# {meta['device_name']}, torch {meta['torch']}, commit {meta['commit']}, dtype {args.dtype}, batch {B}")
    emit("| kernel | S | ours ms | baseline | baseline ms | speedup |")
    emit("|---|---|---|---|---|---|")
    last = None
    for S in args.seq_lens:
        q = torch.randn(B, Q, Hq, D, dtype=dt)
        k = torch.randn(B, Hkv, S, D, dtype=dt)
        v = torch.randn(B, Hkv, S, D, dtype=dt)
        lens = torch.full((B,), S, dtype=torch.int32)
        mask = reference.causal_allowed_mask(lens, Q, S, "cpu").unsqueeze(1)  # [B,1,Q,S]
        t = time_fns({
            "ours": lambda: torch.ops.vegas.verify_attention(q, k, v, lens, bs, scale, None),
            "sdpa_repeat_kv": lambda: sdpa_verify(q, k, v, mask, group, False),
            "sdpa_enable_gqa": lambda: sdpa_verify(q, k, v, mask, group, True),
        }, repeats=args.repeats)
        for base in ("sdpa_repeat_kv", "sdpa_enable_gqa"):
            r = dict(meta, kernel="verify_attention", S=S, B=B, Q=Q, Hq=Hq, Hkv=Hkv, D=D, block_size=bs, dtype=args.dtype,
                     ours_ms=t["ours"] * 1e3, baseline=base, baseline_ms=t[base] * 1e3, speedup=t[base] / t["ours"])
            rows.append(r)
            emit(f"| verify_attention (Q=7, GQA 4, +block scores) | {S} | {r['ours_ms']:.2f} | {base} | {r['baseline_ms']:.2f} | {r['speedup']:.2f}x |")
        last = (S, q, k, v, lens, t["ours"])

    S, q, k, v, lens, t_verify = last
    nb = math.ceil(S / bs)
    budget_blocks = math.ceil(0.05 * S / bs)
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(nb - 1, generator=g)[:budget_blocks] for _ in range(B * Hkv)]).view(B, Hkv, budget_blocks).int()
    q1 = q[:, :1].contiguous()
    tail = (lens - 8).int()
    t = time_fns({
        "ours": lambda: torch.ops.vegas.sparse_draft_attention(q1, k, v, idx, tail, lens, bs, scale),
        "sdpa_dense_q1": lambda: F.scaled_dot_product_attention(q1.transpose(1, 2), k, v, enable_gqa=True),
        "ours_dense_q1": lambda: torch.ops.vegas.verify_attention(q1, k, v, lens, bs, scale, None),
    }, repeats=args.repeats)
    for base in ("sdpa_dense_q1", "ours_dense_q1"):
        r = dict(meta, kernel="sparse_draft_attention", S=S, B=B, Q=1, Hq=Hq, Hkv=Hkv, D=D, block_size=bs, dtype=args.dtype,
                 budget_ratio=0.05, ours_ms=t["ours"] * 1e3, baseline=base, baseline_ms=t[base] * 1e3, speedup=t[base] / t["ours"])
        rows.append(r)
        emit(f"| sparse_draft_attention (5% budget) | {S} | {r['ours_ms']:.3f} | {base} | {r['baseline_ms']:.2f} | {r['speedup']:.1f}x |")

    # top-k over the blocks of the largest S (2048 blocks at 32K), 5 % budget, batch 4 x 8 heads
    n_topk = nb
    k_topk = math.ceil(0.05 * n_topk)
    scores = torch.rand(4, 8, n_topk)
    kk = torch.full((4,), k_topk, dtype=torch.int32)
    nc = torch.full((4,), n_topk, dtype=torch.int32)
    t = time_fns({"topk": lambda: torch.ops.vegas.block_topk(scores, kk, nc, k_topk, 1)}, repeats=max(args.repeats, 20))
    share = t["topk"] / t_verify
    r = dict(meta, kernel="block_topk", B=4, H=8, N=n_topk, k=k_topk, dtype="float32", ours_ms=t["topk"] * 1e3,
             baseline=f"verify_attention S={S}", baseline_ms=t_verify * 1e3, share_of_verify=share)
    rows.append(r)
    emit(f"| block_topk (4x8x{n_topk}, k={k_topk}) | - | {r['ours_ms']:.3f} | one verify_attention at S={S} | {r['baseline_ms']:.2f} | {share * 100:.2f}% of it |")
    out = Path(args.out)
    write_rows(out.with_suffix(".jsonl"), rows)
    cmd = "python bench/bench_kernels_cpu.py " + " ".join(sys.argv[1:])
    out.with_suffix(".md").write_text(
        f"Command: `{cmd.strip()}` (medians of {args.repeats} interleaved repeats)\n\n" + "\n".join(lines) + "\n"
    )
    print(f"wrote {out.with_suffix('.jsonl')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
