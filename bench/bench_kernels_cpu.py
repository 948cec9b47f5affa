"""CPU microbenchmark of the vegas kernels.

    python -m bench.bench_kernels_cpu [--seq-lens 2048 8192 32768] [--dtype float32] [--repeats 7]
    python -m bench.bench_kernels_cpu --grid [--repeats 5]

--grid: verify_attention (block scores included) over model shapes (SmolLM2 9/3 heads D 64 at
batch 1 and 4, Llama-3-8B 32/8 D 128 at batch 1) x S x Q x block size x threads, each row with
its achieved GFLOP/s (4 * B * Hq * Q * S * D flops: QK and PV, causal cut ignored) and its ratio
per thread to a square 1024^3 torch.mm on one thread, and, at Q = 1, the K/V bytes read per
second against a one-thread tensor copy of the same size (bytes read per second), all measured
in the same run, medians of wall-clock times (each timed call right after an untimed one; the
anchors of a cell are timed before its kernel calls, not between them). To compare two builds,
use ``python -m bench.ab_trees_cpu --old-tree DIR`` (one process per tree at a time). Also
block_topk at the vegas default (block size 1: one row per (batch, KV head, layer), all layers
in one call) and sparse_draft_attention at the vegas
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
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

import vegas_ext  # noqa: F401  (loads torch.ops.vegas)
from bench.common import GRID_SHAPES, RESULTS, ROOT, command_line, run_metadata, time_fns, write_rows
from vegas_ext import reference

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sdpa_verify(q, k, v, mask, group, enable_gqa):
    qh = q.transpose(1, 2)  # [B, Hq, Q, D]
    if enable_gqa:
        return F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=True)
    kr = k.repeat_interleave(group, dim=1)
    vr = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(qh, kr, vr, attn_mask=mask)


class GridOps:
    """The grid's timed calls on inputs built once per shape: each method returns one call's seconds."""

    def __init__(self):
        self.state = {}

    def _timed(self, fn, *args) -> float:
        t = time.perf_counter()
        fn(*args)
        return time.perf_counter() - t

    def setup(self, B, Hq, Hkv, D, S):
        g = torch.Generator().manual_seed(0)
        self.state = {"kv": (torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)),
                      "lens": torch.full((B,), S, dtype=torch.int32), "B": B, "Hq": Hq, "D": D}

    def verify(self, Q, bs, threads) -> float:
        torch.set_num_threads(threads)
        st = self.state
        q = st.get(("q", Q))
        if q is None:
            q = st[("q", Q)] = torch.randn(st["B"], Q, st["Hq"], st["D"])
        k, v = st["kv"]
        return self._timed(torch.ops.vegas.verify_attention, q, k, v, st["lens"], bs, st["D"] ** -0.5, None)

    def mm(self) -> float:
        torch.set_num_threads(1)
        return self._timed(torch.mm, *self.state.setdefault("mm", (torch.randn(1024, 1024), torch.randn(1024, 1024))))

    def copy(self, numel) -> float:
        torch.set_num_threads(1)
        if self.state.get("copy_n") != numel:
            self.state["copy"], self.state["copy_n"] = (torch.randn(numel), torch.empty(numel)), numel
        src, dst = self.state["copy"]
        return self._timed(dst.copy_, src)

    def read(self, numel) -> float:
        torch.set_num_threads(1)
        if self.state.get("read_n") != numel:
            self.state["read"], self.state["read_n"] = torch.randn(numel), numel
        return self._timed(self.state["read"].sum)

    def draft(self, B, Hq, Hkv, D, S, K, layers) -> float:
        """sparse_draft_attention at the vegas default over ``layers`` distinct caches (each call reads
        its K/V from DRAM, as the layers of a draft step do): K sorted random 1-token blocks before a
        tail of 7 tokens, all layers timed together."""
        torch.set_num_threads(1)
        key = (B, Hq, Hkv, D, S, K, layers)
        if self.state.get("draft_key") != key:
            g = torch.Generator().manual_seed(2)
            kv = [(torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g))
                  for _ in range(layers)]
            idx = torch.stack([torch.randperm(S - 7, generator=g)[:K].sort().values for _ in range(B * Hkv)])
            self.state["draft"] = (kv, idx.view(B, Hkv, K).int(), torch.full((B,), S - 7, dtype=torch.int32),
                                   torch.full((B,), S, dtype=torch.int32), torch.randn(B, 1, Hq, D))
            self.state["draft_key"] = key
        kv, idx, tail, lens, q = self.state["draft"]
        f = torch.ops.vegas.sparse_draft_attention
        t = time.perf_counter()
        for k, v in kv:
            f(q, k, v, idx, tail, lens, 1, D ** -0.5)
        return time.perf_counter() - t

    def topk(self, rows, N, k) -> float:
        torch.set_num_threads(2)
        if self.state.get("topk_key") != (rows, N, k):
            g = torch.Generator().manual_seed(1)
            self.state["topk"] = (torch.rand(1, rows, N, generator=g), torch.full((1,), k, dtype=torch.int32),
                                  torch.full((1,), N, dtype=torch.int32))
            self.state["topk_key"] = (rows, N, k)
        sc, kt, nc = self.state["topk"]
        return self._timed(torch.ops.vegas.block_topk, sc, kt, nc, k, 1)


def fma_peak_gflops() -> Optional[float]:
    """One core's fp32 FMA peak (bench/fma_peak.cpp, compiled here with g++ -march=native), or
    None without a compiler. The fastest of three runs."""
    exe = RESULTS / "tmp" / "fma_peak"
    exe.parent.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["g++", "-O3", "-march=native", str(ROOT / "bench" / "fma_peak.cpp"), "-o", str(exe)],
                       check=True, capture_output=True)
        return max(float(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()[0])
                   for _ in range(3))
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


def grid_targets(rows, peak=None):
    """Markdown lines: the grid read against the kernel's targets (medians over the matching rows)."""
    ver = [r for r in rows if r.get("kernel") == "verify_attention"]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    out = ["", "Against the targets (medians over the rows named):", "", "| target | cell | value |", "|---|---|---|"]
    for shape in dict.fromkeys(r["shape"] for r in ver):
        for S in sorted({r["S"] for r in ver if r["shape"] == shape}):
            sel = [r for r in ver if r["shape"] == shape and r["S"] == S and r["threads"] == 1 and 5 <= r["Q"] <= 9]
            if sel:
                out.append(f"| Q 5-9, 1 thread: GFLOP/s / sgemm >= 0.60 | {shape} {S} | "
                           f"{med([r['ratio_sgemm_per_thread'] for r in sel]):.2f} |")
                if peak:
                    out.append(f"| Q 5-9, 1 thread: GFLOP/s / FMA peak (stricter) | {shape} {S} | "
                               f"{med([r['gflops'] for r in sel]) / peak:.2f} |")
    q1 = [r for r in ver if r["Q"] == 1 and r["threads"] == 1 and "copy_gbs" in r]
    if q1:
        out.append("| Q 1, 1 thread: K/V GB/s / copy >= 0.70 | all shapes, S | "
                   f"{med([r['ratio_copy'] for r in q1]):.2f} |")
        out.append("| Q 1, 1 thread: K/V GB/s / read-only stream (stricter) | all shapes, S | "
                   f"{med([r['ratio_read'] for r in q1]):.2f} |")
    key = lambda r: (r["shape"], r["S"], r["Q"], r["block_size"])  # noqa: E731
    one = {key(r): r for r in ver if r["threads"] == 1}
    for bs in sorted({r["block_size"] for r in ver}):
        two = [(one[key(r)], r) for r in ver if r["threads"] == 2 and r["S"] == 8192 and r["block_size"] == bs
               and key(r) in one and r["Q"] > 1]
        if two:
            out.append(f"| 2 threads / 1 thread speed >= 1.7, S 8K, Q > 1 | block size {bs} | "
                       f"{med([a['ms'] / b['ms'] for a, b in two]):.2f} |")
    for thr in sorted({r["threads"] for r in ver}):
        by = {(r["shape"], r["S"], r["Q"]): {} for r in ver if r["threads"] == thr}
        for r in ver:
            if r["threads"] == thr:
                by[(r["shape"], r["S"], r["Q"])][r["block_size"]] = r
        pairs = [v for k, v in by.items() if 1 in v and 16 in v and k[2] > 1]
        if pairs:
            out.append(f"| block size 1 / block size 16 time <= 1.10, Q > 1 | {thr} thread(s) | "
                       f"{med([v[1]['ms'] / v[16]['ms'] for v in pairs]):.2f} |")
    return out


def _grid_header(meta, peak, load0):
    hdr = ("| shape | S | Q | bs | thr | sgemm GF/s | ms | GF/s | ratio | copy GB/s | read GB/s | GB/s | /copy "
           "| /read |")
    lines = [f"# verify_attention grid: {meta['device_name']}, torch {meta['torch']}, fp32 cache, commit "
             f"{meta['commit']}, load average at start {load0[0]:.1f}", "",
             "Ratios: GFLOP/s per thread / one-thread 1024^3 torch.mm GFLOP/s; Q = 1: K/V GB/s / one-thread copy "
             "GB/s (bytes read per second of a tensor copy of the K/V's size) and / one-thread read GB/s (a `sum` "
             "over a tensor of that size: a read-only stream, the stricter anchor) (same run, medians of "
             "wall-clock times)."]
    if peak:
        lines += ["", f"One core's fp32 FMA peak (bench/fma_peak.cpp, FMAs in registers): {peak:.0f} GFLOP/s. A BLAS "
                  "need not reach it on every processor (on AMD EPYC, MKL's sgemm inside torch runs well below "
                  "it), so the targets table also reads the kernel against it."]
    return lines + ["", hdr, "|" + "---|" * (hdr.count("|") - 1)]


def grid_cell(ops, meta, shape, S, threads, Q, bs, repeats):
    """One verify_attention cell: the row (dict) and its Markdown line. The anchors (sgemm, and at
    Q = 1 a copy and a read of the K/V's size) are timed first, then a pause, then the kernel: a
    2-thread kernel call right after a torch.mm ran up to ~2x slower (OMP_WAIT_POLICY=PASSIVE did
    not help)."""
    B, Hq, Hkv, D = GRID_SHAPES[shape]
    kv_bytes = 2 * B * Hkv * S * D * 4
    ops.verify(Q, bs, threads)  # warm-up
    mm, cp, rd = [], [], []
    for _ in range(repeats):
        mm.append(ops.mm())
        if Q == 1:
            cp.append(ops.copy(kv_bytes // 4))
            rd.append(ops.read(kv_bytes // 4))
    time.sleep(0.3)
    samples = []
    for _ in range(repeats):  # each timed call right after an untimed one, as in a forward's back-to-back calls
        ops.verify(Q, bs, threads)
        samples.append(ops.verify(Q, bs, threads))
    t = statistics.median(samples)
    gf = 4 * B * Hq * Q * S * D / t / 1e9
    g_mm = 2 * 1024 ** 3 / statistics.median(mm) / 1e9
    r = dict(meta, kernel="verify_attention", shape=shape, B=B, Hq=Hq, Hkv=Hkv, D=D, S=S, Q=Q, block_size=bs,
             threads=threads, dtype="float32", sgemm_gflops=g_mm, load_avg=os.getloadavg()[0], ms=t * 1e3,
             gflops=gf, ratio_sgemm_per_thread=gf / threads / g_mm)
    line = (f"| {shape} | {S} | {Q} | {bs} | {threads} | {g_mm:.0f} | {t * 1e3:.2f} | {gf:.1f} | "
            f"{gf / threads / g_mm:.2f}")
    if Q != 1:
        return r, line + " | - | - | - | - | - |"
    g_cp, g_rd = kv_bytes / statistics.median(cp) / 1e9, kv_bytes / statistics.median(rd) / 1e9
    gb = kv_bytes / t / 1e9
    r.update(copy_gbs=g_cp, read_gbs=g_rd, kv_gbs=gb, ratio_copy=gb / g_cp, ratio_read=gb / g_rd)
    return r, line + f" | {g_cp:.1f} | {g_rd:.1f} | {gb:.1f} | {gb / g_cp:.2f} | {gb / g_rd:.2f} |"


def grid_draft_rows(ops, meta, repeats):
    """sparse_draft_attention at the vegas default: 5 % of 8K in 1-token blocks, 30 layers."""
    rows = []
    lines = ["", "| sparse_draft_attention, 30 layers x (shape, 8K, 5 % budget in 1-token blocks + 7 tail tokens), "
             "1 thread | ms |", "|---|---|"]
    for shape in ("smollm2-b1", "smollm2-b4"):
        B, Hq, Hkv, D = GRID_SHAPES[shape]
        req = dict(B=B, Hq=Hq, Hkv=Hkv, D=D, S=8192, K=410, layers=30)
        ops.draft(**req)
        r = dict(meta, kernel="sparse_draft_attention", shape=shape, block_size=1, threads=1, **req,
                 ms=statistics.median(ops.draft(**req) for _ in range(repeats)) * 1e3)
        rows.append(r)
        lines.append(f"| {shape} | {r['ms']:.2f} |")
    return rows, lines


def grid_topk_rows(ops, meta, repeats):
    """block_topk at the vegas default: block size 1 (N = S blocks), one row per (batch, KV head, layer)."""
    rows = []
    lines = ["", "| block_topk rows x N, k | ms |", "|---|---|"]
    for rows_, N in ((4 * 3 * 30, 8192), (4 * 3 * 30, 2048)):
        kk = math.ceil(0.05 * N)
        ops.topk(rows_, N, kk)
        r = dict(meta, kernel="block_topk", rows=rows_, N=N, k=kk, threads=2,
                 ms=statistics.median(ops.topk(rows_, N, kk) for _ in range(repeats)) * 1e3)
        rows.append(r)
        lines.append(f"| {rows_} x {N}, k={kk} (SmolLM2 batch 4, 30 layers, bs 1) | {r['ms']:.2f} |")
    return rows, lines


def grid(args, argv):
    """The --grid run: verify_attention cells, then sparse_draft_attention and block_topk, then the targets."""
    meta = run_metadata("cpu")
    load0 = os.getloadavg()
    peak = fma_peak_gflops()
    meta["fma_peak_gflops"] = peak
    ops = GridOps()
    lines = _grid_header(meta, peak, load0)
    print("\n".join(lines), flush=True)
    rows = []
    for shape in ([] if args.skip_verify else args.shapes):
        B, Hq, Hkv, D = GRID_SHAPES[shape]
        for S in args.seq_lens:
            ops.setup(B, Hq, Hkv, D, S)
            for threads in args.threads:
                for Q in args.queries:
                    for bs in args.block_sizes:
                        r, line = grid_cell(ops, meta, shape, S, threads, Q, bs, args.repeats)
                        rows.append(r)
                        lines.append(line)
                        print(line, flush=True)
    for part in (grid_draft_rows, grid_topk_rows):
        more, text = part(ops, meta, args.repeats)
        rows += more
        lines += text
        print("\n".join(text), flush=True)
    load1 = os.getloadavg()
    tail = grid_targets(rows, peak) + ["", f"Load average (1/5/15 min) at start {load0[0]:.1f}/{load0[1]:.1f}/"
                                       f"{load0[2]:.1f}, at end {load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f} on "
                                       f"{os.cpu_count()} CPUs."]
    lines += tail
    print("\n".join(tail))
    out = Path(str(args.out) + "_grid")
    write_rows(out.with_suffix(".jsonl"), rows)
    out.with_suffix(".md").write_text(f"Command: `{command_line('bench_kernels_cpu', argv)}`\n\n"
                                      + "\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.jsonl')} and {out.with_suffix('.md')}")


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.bench_kernels_cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", action="store_true", help="the verify_attention grid (see above)")
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
    ap.add_argument("--out", type=Path, default=RESULTS / "tmp" / "kernels_cpu",
                    help="output prefix (.jsonl, .md); the committed results are in bench/results/kernels_*/")
    return ap.parse_args(argv)


# verify_attention's shape against PyTorch: Llama-3-8B's heads, Q = 7, block 16
HQ, HKV, D, QV, BS = 32, 8, 128, 7, 16


def verify_vs_sdpa(args, meta, S):
    """verify_attention (with block scores) against SDPA with K/V repeated and with enable_gqa, at S."""
    dt, B, scale = DT[args.dtype], args.batch, D ** -0.5
    q = torch.randn(B, QV, HQ, D, dtype=dt)
    k = torch.randn(B, HKV, S, D, dtype=dt)
    v = torch.randn(B, HKV, S, D, dtype=dt)
    lens = torch.full((B,), S, dtype=torch.int32)
    mask = reference.causal_allowed_mask(lens, QV, S, "cpu").unsqueeze(1)  # [B,1,Q,S]
    t = time_fns({
        "ours": lambda: torch.ops.vegas.verify_attention(q, k, v, lens, BS, scale, None),
        "sdpa_repeat_kv": lambda: sdpa_verify(q, k, v, mask, HQ // HKV, False),
        "sdpa_enable_gqa": lambda: sdpa_verify(q, k, v, mask, HQ // HKV, True),
    }, repeats=args.repeats)
    rows, lines = [], []
    for base in ("sdpa_repeat_kv", "sdpa_enable_gqa"):
        r = dict(meta, kernel="verify_attention", S=S, B=B, Q=QV, Hq=HQ, Hkv=HKV, D=D, block_size=BS,
                 dtype=args.dtype, ours_ms=t["ours"] * 1e3, baseline=base, baseline_ms=t[base] * 1e3,
                 speedup=t[base] / t["ours"])
        rows.append(r)
        lines.append(f"| verify_attention (Q=7, GQA 4, +block scores) | {S} | {r['ours_ms']:.2f} | {base} | "
                     f"{r['baseline_ms']:.2f} | {r['speedup']:.2f}x |")
    return rows, lines, (q, k, v, lens, t["ours"])


def draft_vs_dense(args, meta, S, q, k, v, lens):
    """sparse_draft_attention over a 5 % budget of 16-token blocks against dense one-query attention."""
    B, scale = args.batch, D ** -0.5
    nb = math.ceil(S / BS)
    budget_blocks = math.ceil(0.05 * S / BS)
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(nb - 1, generator=g)[:budget_blocks] for _ in range(B * HKV)])
    idx = idx.view(B, HKV, budget_blocks).int()
    q1 = q[:, :1].contiguous()
    tail = (lens - 8).int()
    t = time_fns({
        "ours": lambda: torch.ops.vegas.sparse_draft_attention(q1, k, v, idx, tail, lens, BS, scale),
        "sdpa_dense_q1": lambda: F.scaled_dot_product_attention(q1.transpose(1, 2), k, v, enable_gqa=True),
        "ours_dense_q1": lambda: torch.ops.vegas.verify_attention(q1, k, v, lens, BS, scale, None),
    }, repeats=args.repeats)
    rows, lines = [], []
    for base in ("sdpa_dense_q1", "ours_dense_q1"):
        r = dict(meta, kernel="sparse_draft_attention", S=S, B=B, Q=1, Hq=HQ, Hkv=HKV, D=D, block_size=BS,
                 dtype=args.dtype, budget_ratio=0.05, ours_ms=t["ours"] * 1e3, baseline=base,
                 baseline_ms=t[base] * 1e3, speedup=t[base] / t["ours"])
        rows.append(r)
        lines.append(f"| sparse_draft_attention (5% budget) | {S} | {r['ours_ms']:.3f} | {base} | "
                     f"{r['baseline_ms']:.2f} | {r['speedup']:.1f}x |")
    return rows, lines


def topk_vs_verify(args, meta, S, t_verify):
    """block_topk over the blocks of S (2048 at 32K), 5 % kept, batch 4 x 8 heads, against one verify."""
    n_topk = math.ceil(S / BS)
    k_topk = math.ceil(0.05 * n_topk)
    scores = torch.rand(4, 8, n_topk)
    kk = torch.full((4,), k_topk, dtype=torch.int32)
    nc = torch.full((4,), n_topk, dtype=torch.int32)
    t = time_fns({"topk": lambda: torch.ops.vegas.block_topk(scores, kk, nc, k_topk, 1)}, repeats=max(args.repeats, 20))
    share = t["topk"] / t_verify
    r = dict(meta, kernel="block_topk", B=4, H=8, N=n_topk, k=k_topk, dtype="float32", ours_ms=t["topk"] * 1e3,
             baseline=f"verify_attention S={S}", baseline_ms=t_verify * 1e3, share_of_verify=share)
    line = (f"| block_topk (4x8x{n_topk}, k={k_topk}) | - | {r['ours_ms']:.3f} | one verify_attention at S={S} | "
            f"{r['baseline_ms']:.2f} | {share * 100:.2f}% of it |")
    return [r], [line]


def compare_with_torch(args, argv):
    """The default run: each kernel against its PyTorch baseline (see the module docstring)."""
    meta = run_metadata("cpu")
    lines = [f"# {meta['device_name']}, torch {meta['torch']}, commit {meta['commit']}, dtype {args.dtype}, "
             f"batch {args.batch}", "| kernel | S | ours ms | baseline | baseline ms | speedup |",
             "|---|---|---|---|---|---|"]
    print("\n".join(lines))
    rows = []
    for S in args.seq_lens:
        more, text, last = verify_vs_sdpa(args, meta, S)
        rows += more
        lines += text
        print("\n".join(text))
    S = args.seq_lens[-1]
    q, k, v, lens, t_verify = last
    for more, text in (draft_vs_dense(args, meta, S, q, k, v, lens), topk_vs_verify(args, meta, S, t_verify)):
        rows += more
        lines += text
        print("\n".join(text))
    out = Path(args.out)
    write_rows(out.with_suffix(".jsonl"), rows)
    out.with_suffix(".md").write_text(
        f"Command: `{command_line('bench_kernels_cpu', argv)}` (medians of {args.repeats} interleaved repeats)\n\n"
        + "\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.jsonl')} and {out.with_suffix('.md')}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    return grid(args, argv) if args.grid else compare_with_torch(args, argv)


if __name__ == "__main__":
    main()
