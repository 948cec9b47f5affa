"""GPU microbenchmark of the three vegas CUDA kernels.

    python -m bench.bench_cuda_kernels [--seq-lens 8192 32768 131072] [--batches 1 2 4 8 32]
                                       [--block-sizes 1 16]

Attention shape: Llama-3-8B and Qwen3-8B (identical: 32 query heads, 8 KV heads,
head_dim 128), bf16, block sizes 1 (vegas's default: block scores from the block-score
pass) and 16 (slots), full-length rows. Per (S, batch, block size):
* verify_attention at Q = 7 (block scores included) vs torch SDPA, flash backend, on
  the same cache with a lower-right causal mask (enable_gqa, or K/V repeated when flash
  refuses GQA and the copy fits); bytes/s over the K/V bytes (each read once), and over the
  bytes the kernels read (block size < 16: the block-score pass reads K a second time, so
  1.5x the K/V bytes), each also as a share of the measured copy bandwidth;
* sparse_draft_attention, Q = 1, 5 % budget (random blocks) + an 8-token tail: time and
  achieved bytes/s over the bytes it reads, against a measured device-to-device copy;
* block_topk of the verification's block scores (k = the 5 % budget, 1 sink): time and
  its share of one verify_attention call;
* the workspace of one verify_attention call: measured (peak bytes requested from the
  caching allocator minus the outputs) and vegas_ext.ops.cuda_workspace_bytes;
* at S <= 32K, paged_verify_attention (the vLLM plugin's one pass: output and page scores)
  on the same keys and values as 16-token pages, against verify_attention and SDPA-flash,
  and paged_block_scores alone (what the two-pass form adds to the engine's attention).
Then one op-level decode step (gamma = 6 drafts and one verification of 7 queries over
8 layers, block size 1, top-k selection; 32K context, batch 8): host syncs per step
(torch.cuda.set_sync_debug_mode; expected 0), and with VEGAS_CUDA_VALUE_CHECKS=1 for
comparison; step time eager vs replayed from a CUDA graph.
Timing: CUDA events, L2 flushed (256 MiB write) before every call, median of repeats.
Targets (issue 47), checked at the end of the table: verify <= 1.1x SDPA-flash at batch 1;
verify >= 70 % of copy bandwidth at 32K x 8; block_topk at block size 1 < 10 % of a
verification at 32K x 1; draft >= 60 % of copy bandwidth at 128K x 32. Writes <out>.jsonl
and <out>.md.
"""
import argparse
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import vegas_ext  # noqa: F401  (loads torch.ops.vegas)
from bench.common import ROOT, run_metadata, write_rows
from vegas_ext import ops

_FLUSH = None


def cuda_time_ms(fn, target_ms=150.0, min_reps=5, max_reps=100):
    """Median ms of fn() with the L2 flushed before each call (CUDA events)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    reps = int(max(min_reps, min(max_reps, target_ms / max(est, 1e-3))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        _FLUSH.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def host_syncs(fn):
    """Synchronizing CUDA calls torch detects while fn() runs (set_sync_debug_mode "warn"), and
    their distinct messages. Torch reports them as Python warnings or, from inside a custom op's
    C++ code, on the process's stderr: both are counted (stderr is captured at the fd)."""
    torch.cuda.synchronize()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        os.dup2(tmp.fileno(), 2)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        lines = [ln for ln in tmp.read().decode(errors="replace").splitlines() if "synchroniz" in ln.lower()]
    torch.cuda.synchronize()
    msgs = lines + [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    msgs = [m for m in msgs if "prototype feature" not in m]  # set_sync_debug_mode's own notice
    return len(msgs), sorted({m.split("] ", 1)[-1][:160] for m in msgs})


def workspace_measured(call, out_bytes):
    """Peak bytes requested from the caching allocator during call(), minus its outputs."""
    call()
    torch.cuda.synchronize()
    base = torch.cuda.memory_stats()["requested_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["requested_bytes.all.peak"] - base - out_bytes


def decode_step_check(layers=8, B=8, S=32768, gamma=6, K=1639, Hq=32, Hkv=8, D=128):
    """One op-level Vegas decode step (gamma drafts over every layer, then the verification
    of gamma + 1 queries over every layer with block scores, then top-k): host syncs per
    step (default and with VEGAS_CUDA_VALUE_CHECKS=1) and step ms eager / CUDA graph."""
    dev, dt, bs, scale = "cuda", torch.bfloat16, 1, D ** -0.5
    kc = [torch.randn(B, Hkv, S, D, device=dev, dtype=dt) for _ in range(layers)]
    vc = [torch.randn(B, Hkv, S, D, device=dev, dtype=dt) for _ in range(layers)]
    qd = torch.randn(gamma, layers, B, 1, Hq, D, device=dev, dtype=dt)
    qv = torch.randn(layers, B, gamma + 1, Hq, D, device=dev, dtype=dt)
    lens = torch.full((B,), S - gamma - 1, dtype=torch.int32, device=dev)
    idx = torch.rand(B * Hkv, S - 64, device=dev).argsort(dim=1)[:, :K].sort(dim=1).values
    idx = idx.to(torch.int32).view(B, Hkv, K).contiguous()
    kt = torch.full((B,), K, dtype=torch.int32, device=dev)

    def step():
        tail = lens - 1
        for i in range(gamma):
            for l in range(layers):
                torch.ops.vegas.sparse_draft_attention(qd[i, l], kc[l], vc[l], idx, tail, lens + i + 1, bs, scale)
        vlens = lens + gamma
        sc = None
        for l in range(layers):
            _, _, bsc = torch.ops.vegas.verify_attention(qv[l], kc[l], vc[l], vlens, bs, scale, None)
            sc = bsc if sc is None else sc + bsc
        ncand = (vlens - gamma - 1).to(torch.int32)
        idx.copy_(torch.ops.vegas.block_topk(sc, kt, ncand, K, 1))

    r = dict(layers=layers, B=B, S=S, gamma=gamma, K=K, block_size=bs)
    step()
    r["host_syncs_per_step"], r["host_sync_messages"] = host_syncs(step)
    prev = os.environ.get("VEGAS_CUDA_VALUE_CHECKS")
    os.environ["VEGAS_CUDA_VALUE_CHECKS"] = "1"
    try:
        r["host_syncs_per_step_with_value_checks"], _ = host_syncs(step)
    finally:
        if prev is None:
            del os.environ["VEGAS_CUDA_VALUE_CHECKS"]
        else:
            os.environ["VEGAS_CUDA_VALUE_CHECKS"] = prev
    r["step_ms_eager"] = cuda_time_ms(step, target_ms=300, max_reps=10)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    r["step_ms_graph"] = cuda_time_ms(graph.replay, target_ms=300, max_reps=10)
    kc = vc = graph = None  # drop the caches (step() holds them) before empty_cache
    torch.cuda.empty_cache()
    return r


def copy_bandwidth():
    n = 2 * 1024 ** 3
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = cuda_time_ms(lambda: y.copy_(x))
    return 2 * n / (ms * 1e-3)  # bytes read + written per second


def sdpa_flash(q, k, v, group):
    """SDPA flash backend on [B, Q, Hq, D] q; returns (callable, label) or (None, why)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    Q, S = q.shape[1], k.shape[2]
    qh = q.transpose(1, 2)
    mask = causal_lower_right(Q, S)
    tries = [("flash, enable_gqa", lambda: F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=True))]
    rep_bytes = 2 * k.numel() * k.element_size() * group
    if rep_bytes < 0.4 * torch.cuda.mem_get_info()[0]:
        kr = k.repeat_interleave(group, dim=1)
        vr = v.repeat_interleave(group, dim=1)
        tries.append(("flash, K/V repeated", lambda: F.scaled_dot_product_attention(qh, kr, vr, attn_mask=mask)))
    why = []
    for label, fn in tries:
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                out = fn()
            torch.cuda.synchronize()

            def run(fn=fn):
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return fn()

            return run, label, out
        except Exception as e:  # backend refused this form
            why.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return None, "; ".join(why) or "K/V repeat does not fit", None


# the measured shape: Llama-3-8B = Qwen3-8B attention, verifying 6 drafts
Q, HQ, HKV, D = 7, 32, 8, 128


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.bench_cuda_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--budget", type=float, default=0.05)
    ap.add_argument("--skip-decode-step", action="store_true", help="skip the op-level decode-step check")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kernels_cuda")
    return ap.parse_args(argv)


def verify_row(r, q, k, v, lens, bs, sd_ms, sd_out, kv_bytes):
    """Times verify_attention at block size ``bs`` into ``r`` (against SDPA where it ran); returns its block scores."""
    scale = D ** -0.5
    ours = lambda: torch.ops.vegas.verify_attention(q, k, v, lens, bs, scale, None)  # noqa: E731
    out, lse, bsc = ours()
    r["verify_ms"] = cuda_time_ms(ours)
    r["verify_bytes_per_s"] = kv_bytes / (r["verify_ms"] * 1e-3)
    # block size < 16: the block-score pass reads K (half the K/V bytes) once more
    read = kv_bytes * (1.5 if bs < 16 else 1.0)
    r["verify_read_bytes_per_s"] = read / (r["verify_ms"] * 1e-3)
    r["verify_frac_of_copy"] = r["verify_bytes_per_s"] / r["copy_bytes_per_s"]
    r["verify_read_frac_of_copy"] = r["verify_read_bytes_per_s"] / r["copy_bytes_per_s"]
    if sd_ms is not None:
        r["sdpa_ms"] = sd_ms
        r["verify_over_sdpa"] = r["verify_ms"] / r["sdpa_ms"]
        r["max_err_vs_sdpa"] = (out.float() - sd_out.transpose(1, 2).float()).abs().max().item()
    out_bytes = sum(t.numel() * t.element_size() for t in (out, lse, bsc))
    r["verify_workspace_bytes"] = workspace_measured(ours, out_bytes)
    r["verify_workspace_bytes_formula"] = ops.cuda_workspace_bytes(
        "verify_attention", r["B"], Q, HQ, HKV, D, r["S"], bs, num_sms=r["sms"], smem_per_sm=r["smem_per_sm"])
    return bsc


def draft_and_topk_row(r, q, k, v, lens, bs, bsc, budget, bw):
    """Times one draft token's sparse_draft_attention (``budget`` of S in blocks of ``bs`` before an
    8-token tail) and block_topk over ``bsc`` into ``r``."""
    B, S, dev, tail_len = r["B"], r["S"], q.device, 8
    ncand = (S - tail_len) // bs
    K = max(1, math.ceil(budget * S / bs))
    idx = torch.rand(B * HKV, ncand, device=dev).argsort(dim=1)[:, :K].sort(dim=1).values
    idx = idx.to(torch.int32).view(B, HKV, K).contiguous()
    tail = torch.full((B,), S - tail_len, dtype=torch.int32, device=dev)
    q1 = q[:, :1].contiguous()
    draft = lambda: torch.ops.vegas.sparse_draft_attention(q1, k, v, idx, tail, lens, bs, D ** -0.5)  # noqa: E731
    draft()
    r["draft_ms"] = cuda_time_ms(draft)
    r["draft_bytes_per_s"] = 2 * B * HKV * (K * bs + tail_len) * D * 2 / (r["draft_ms"] * 1e-3)
    r["draft_frac_of_copy"] = r["draft_bytes_per_s"] / bw
    kt = torch.full((B,), K, dtype=torch.int32, device=dev)
    nct = torch.full((B,), ncand, dtype=torch.int32, device=dev)
    topk = lambda: torch.ops.vegas.block_topk(bsc, kt, nct, K, 1)  # noqa: E731
    topk()
    r["topk_ms"] = cuda_time_ms(topk)
    r["topk_share_of_verify"] = r["topk_ms"] / r["verify_ms"]


def paged_row(r, q, k, v, lens, sd_ms, ps=16):
    """Times paged_verify_attention and paged_block_scores on ``k``/``v`` cut into pages of ``ps``
    tokens (the flash layout [pages, H_kv, ps, D]); returns its Markdown line."""
    B, S = r["B"], r["S"]
    npg = S // ps
    kc = k.view(B, HKV, npg, ps, D).permute(0, 2, 1, 3, 4).reshape(B * npg, HKV, ps, D)
    vc = v.view(B, HKV, npg, ps, D).permute(0, 2, 1, 3, 4).reshape(B * npg, HKV, ps, D)
    bt = torch.arange(B * npg, dtype=torch.int32, device=q.device).view(B, npg)
    qp = q.reshape(B * Q, HQ, D)
    qsl = torch.arange(0, B * Q + 1, Q, dtype=torch.int32, device=q.device)
    scale = D ** -0.5
    pva = lambda: torch.ops.vegas.paged_verify_attention(qp, kc, vc, bt, lens, qsl, Q, scale)  # noqa: E731
    pbs = lambda: torch.ops.vegas.paged_block_scores(qp, kc, bt, lens, qsl, Q, scale)  # noqa: E731
    out, _ = pva()
    dense_out = torch.ops.vegas.verify_attention(q, k, v, lens, ps, scale, None)[0]
    r["paged_max_err_vs_verify"] = (out.view(B, Q, HQ, D).float() - dense_out.float()).abs().max().item()
    r["paged_verify_ms"] = cuda_time_ms(pva)
    r["paged_block_scores_ms"] = cuda_time_ms(pbs)
    sd = f"{r['paged_verify_ms'] / sd_ms:.2f}x" if sd_ms else "n/a"
    return (f"| {S} | {B} | {r['paged_verify_ms']:.3f} | {r['paged_verify_ms'] / r['verify_ms']:.2f}x | {sd} | "
            f"{r['paged_block_scores_ms']:.3f} | {r['paged_max_err_vs_verify']:.1e} |")


def row_line(r, label) -> str:
    sd_txt = f"{r['sdpa_ms']:.3f}" if "sdpa_ms" in r else "n/a"
    ratio = f"{r['verify_over_sdpa']:.2f}x" if "verify_over_sdpa" in r else f"n/a ({label})"
    err = f"{r['max_err_vs_sdpa']:.1e}" if "max_err_vs_sdpa" in r else "-"
    return (f"| {r['S']} | {r['B']} | {r['block_size']} | {r['verify_ms']:.3f} | "
            f"{r['verify_bytes_per_s'] / 1e12:.2f} ({100 * r['verify_frac_of_copy']:.0f} %) | "
            f"{r['verify_read_bytes_per_s'] / 1e12:.2f} ({100 * r['verify_read_frac_of_copy']:.0f} %) | "
            f"{sd_txt} | {ratio} | {r['draft_ms']:.3f} | {r['draft_bytes_per_s'] / 1e12:.2f} "
            f"({100 * r['draft_frac_of_copy']:.0f} %) | {r['topk_ms']:.3f} ({100 * r['topk_share_of_verify']:.1f} %) | "
            f"{err} | {r['verify_workspace_bytes'] / 1e6:.1f} ({r['verify_workspace_bytes_formula'] / 1e6:.1f}) |")


def cell_rows(meta, S, B, args, bw):
    """Every block size's row at (S, B), with its Markdown line; ``[]`` where the GPU lacks the memory."""
    dev, dt = "cuda", torch.bfloat16
    kv_bytes = 2 * B * HKV * S * D * 2
    need = 2.2 * kv_bytes
    if need > torch.cuda.mem_get_info()[0]:
        print(f"| {S} | {B} | skipped: needs {need / 2**30:.0f} GiB |", flush=True)
        return []
    q = torch.randn(B, Q, HQ, D, device=dev, dtype=dt)
    k = torch.randn(B, HKV, S, D, device=dev, dtype=dt)
    v = torch.randn(B, HKV, S, D, device=dev, dtype=dt)
    lens = torch.full((B,), S, dtype=torch.int32, device=dev)
    sd, label, sd_out = sdpa_flash(q, k, v, HQ // HKV)
    sd_ms = cuda_time_ms(sd) if sd is not None else None
    out = []
    for bs in args.block_sizes:
        r = dict(meta, S=S, B=B, Q=Q, Hq=HQ, Hkv=HKV, D=D, block_size=bs, dtype="bfloat16", sdpa_variant=label)
        bsc = verify_row(r, q, k, v, lens, bs, sd_ms, sd_out, kv_bytes)
        draft_and_topk_row(r, q, k, v, lens, bs, bsc, args.budget, bw)
        line = row_line(r, label)
        print(line, flush=True)
        if bs == args.block_sizes[0] and S <= 32768 and S % 16 == 0:
            r["paged_line"] = paged_row(r, q, k, v, lens, sd_ms)
        out.append((r, line))
        del bsc
    del sd, sd_out, q, k, v
    torch.cuda.empty_cache()
    return out


def target_lines(rows) -> list:
    """The issue-47 targets against the measured rows: one Markdown line each, 'met' / 'NOT met' /
    'not measured' (a cell skipped or absent from the grid)."""
    cells = [r for r in rows if r.get("kind") != "decode_step"]

    def pick(S=None, B=None, bs=None):
        return [r for r in cells if (S is None or r["S"] == S) and (B is None or r["B"] == B)
                and (bs is None or r["block_size"] == bs)]

    def verdict(ok, got):
        return f"{'met' if ok else 'NOT met'} ({got})" if got else "not measured"

    b1 = [r for r in pick(B=1) if "verify_over_sdpa" in r]
    worst = max(b1, key=lambda r: r["verify_over_sdpa"]) if b1 else None
    bw = pick(S=32768, B=8)
    best_bw = max(bw, key=lambda r: r["verify_frac_of_copy"]) if bw else None
    tk = pick(S=32768, B=1, bs=1)
    dr = pick(S=131072, B=32)
    return [
        "targets (issue 47):",
        "* verify_attention <= 1.10x SDPA-flash at batch 1: " + verdict(
            worst is not None and worst["verify_over_sdpa"] <= 1.10,
            worst and f"worst {worst['verify_over_sdpa']:.2f}x at S {worst['S']}, block {worst['block_size']}; "
            + ", ".join(f"{r['S']}/bs{r['block_size']}: {r['verify_over_sdpa']:.2f}x" for r in b1)),
        "* verify_attention >= 70 % of copy bandwidth at 32K x 8 (K/V bytes read once): " + verdict(
            best_bw is not None and best_bw["verify_frac_of_copy"] >= 0.70,
            best_bw and ", ".join(f"bs {r['block_size']}: {100 * r['verify_frac_of_copy']:.0f} % "
                                  f"({100 * r['verify_read_frac_of_copy']:.0f} % of the bytes read)" for r in bw)),
        "* block_topk at block size 1 < 10 % of a verification at 32K x 1: " + verdict(
            bool(tk) and tk[0]["topk_share_of_verify"] < 0.10,
            tk and f"{tk[0]['topk_ms']:.3f} ms = {100 * tk[0]['topk_share_of_verify']:.1f} %"),
        "* sparse_draft_attention >= 60 % of copy bandwidth at 128K x 32: " + verdict(
            bool(dr) and max(r["draft_frac_of_copy"] for r in dr) >= 0.60,
            dr and f"{100 * max(r['draft_frac_of_copy'] for r in dr):.0f} %"),
    ]


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_cuda_kernels needs a CUDA device")
    if not torch._C._dispatch_has_kernel_for_dispatch_key("vegas::verify_attention", "CUDA"):
        sys.exit("vegas_ext was built without CUDA kernels (build with CUDA_HOME set)")
    torch.manual_seed(0)
    meta = run_metadata("cuda")
    props = torch.cuda.get_device_properties(0)
    meta.update(sms=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
                smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", 233472))
    bw = copy_bandwidth()
    meta["copy_bytes_per_s"] = bw
    lines = [
        f"# vegas CUDA kernels on {meta['device_name']} ({meta['sms']} SMs, sm_{props.major}{props.minor}), "
        f"torch {meta['torch']}, commit {meta['commit']}",
        f"shape: Llama-3-8B = Qwen3-8B attention (Hq 32, Hkv 8, D 128), bf16, blocks {args.block_sizes}; "
        f"device-to-device copy {bw / 1e12:.2f} TB/s (read + write)",
        "",
        "| S | B | block | verify ms | verify K/V TB/s (% copy) | verify read TB/s (% copy) | SDPA-flash ms "
        "| verify / SDPA | draft ms | draft TB/s (% copy) "
        "| top-k ms (% verify) | max err vs SDPA | verify workspace MB (formula) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    rows = []
    for S in args.seq_lens:
        for B in args.batches:
            for r, line in cell_rows(meta, S, B, args, bw):
                rows.append(r)
                lines.append(line)
    paged = [r.pop("paged_line") for r in rows if "paged_line" in r]
    if paged:
        lines += ["", "paged_verify_attention (one pass: output + 16-token page scores, Q 7, pages of 16 in order)",
                  "", "| S | B | paged verify ms | / verify_attention | / SDPA-flash | paged_block_scores ms "
                  "| max err vs verify_attention |", "|---|---|---|---|---|---|---|"] + paged
        print("\n".join(lines[-len(paged) - 4:]), flush=True)
    if not args.skip_decode_step:
        ds = decode_step_check()
        rows.append(dict(meta, kind="decode_step", **ds))
        lines += ["", f"op-level decode step ({ds['layers']} layers, batch {ds['B']}, S {ds['S']}, "
                  f"gamma {ds['gamma']}, "
                  f"block size {ds['block_size']}, K {ds['K']}): host syncs per step {ds['host_syncs_per_step']} "
                  f"(with VEGAS_CUDA_VALUE_CHECKS=1: {ds['host_syncs_per_step_with_value_checks']}); "
                  f"step {ds['step_ms_eager']:.2f} ms eager, {ds['step_ms_graph']:.2f} ms as a CUDA graph"]
        if ds["host_sync_messages"]:
            lines[-1] += f" (syncs seen: {'; '.join(ds['host_sync_messages'])})"
        print(lines[-1], flush=True)
    sdpa_labels = sorted({r.get("sdpa_variant", "") for r in rows})
    lines += ["", f"SDPA variant(s): {'; '.join(sdpa_labels)}", ""] + target_lines(rows)
    out = Path(args.out)
    write_rows(out.with_suffix(".jsonl"), rows)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(target_lines(rows)))
    print(f"wrote {out.with_suffix('.jsonl')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
