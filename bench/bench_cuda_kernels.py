"""GPU microbenchmark of the three vegas CUDA kernels.

    python bench/bench_cuda_kernels.py [--seq-lens 8192 32768 131072] [--batches 1 8 32]

Attention shape: Llama-3-8B and Qwen3-8B (identical: 32 query heads, 8 KV heads,
head_dim 128), bf16, block_size 16, full-length rows. Per (S, batch):
* verify_attention at Q = 7 (block scores included) vs torch SDPA, flash backend, on
  the same cache with a lower-right causal mask (enable_gqa, or K/V repeated when flash
  refuses GQA and the copy fits); bytes/s over the K/V bytes read;
* sparse_draft_attention, Q = 1, 5 % budget (random blocks) + an 8-token tail: time and
  achieved bytes/s over the bytes it reads, against a measured device-to-device copy;
* block_topk of the verification's block scores (k = the 5 % budget, 1 sink): time and
  its share of one verify_attention call.
Timing: CUDA events, L2 flushed (256 MiB write) before every call, median of repeats.
Targets: verify within 1.1x of SDPA-flash; draft >= 60 % of copy bandwidth;
top-k < 5 % of a verification at 32K. Writes <out>.jsonl and <out>.md.
"""
import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, run_metadata, write_rows  # noqa: E402

import vegas_ext  # noqa: E402,F401  (loads torch.ops.vegas)

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


def copy_bandwidth():
    n = 2 * 1024 ** 3
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = cuda_time_ms(lambda: y.copy_(x))
    del x, y
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kernels_cuda")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda_kernels.py needs a CUDA device")
    if not torch._C._dispatch_has_kernel_for_dispatch_key("vegas::verify_attention", "CUDA"):
        sys.exit("vegas_ext was built without CUDA kernels (build with CUDA_HOME set)")
    torch.manual_seed(0)
    dev = "cuda"
    dt = torch.bfloat16
    Q, Hq, Hkv, D, bs = 7, 32, 8, 128, args.block_size
    group, scale = Hq // Hkv, D ** -0.5
    meta = run_metadata(dev)
    props = torch.cuda.get_device_properties(0)
    meta.update(sms=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    bw = copy_bandwidth()
    meta["copy_bytes_per_s"] = bw
    lines = [
        f"# vegas CUDA kernels on {meta['device_name']} ({meta['sms']} SMs, sm_{props.major}{props.minor}), "
        f"torch {meta['torch']}, commit {meta['commit']}",
        f"shape: Llama-3-8B = Qwen3-8B attention (Hq 32, Hkv 8, D 128), bf16, block {bs}; "
        f"device-to-device copy {bw / 1e12:.2f} TB/s (read + write)",
        "",
        "| S | B | verify ms | verify TB/s | SDPA-flash ms | verify / SDPA | draft ms | draft TB/s (% copy) | top-k ms (% verify) | max err vs SDPA |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    rows = []
    for S in args.seq_lens:
        for B in args.batches:
            kv_bytes = 2 * B * Hkv * S * D * 2
            need = 2.2 * kv_bytes
            if need > torch.cuda.mem_get_info()[0]:
                print(f"| {S} | {B} | skipped: needs {need / 2**30:.0f} GiB |", flush=True)
                continue
            q = torch.randn(B, Q, Hq, D, device=dev, dtype=dt)
            k = torch.randn(B, Hkv, S, D, device=dev, dtype=dt)
            v = torch.randn(B, Hkv, S, D, device=dev, dtype=dt)
            lens = torch.full((B,), S, dtype=torch.int32, device=dev)
            r = dict(meta, S=S, B=B, Q=Q, Hq=Hq, Hkv=Hkv, D=D, block_size=bs, dtype="bfloat16")

            ours = lambda: torch.ops.vegas.verify_attention(q, k, v, lens, bs, scale, None)  # noqa: E731
            out, lse, bsc = ours()
            r["verify_ms"] = cuda_time_ms(ours)
            r["verify_bytes_per_s"] = kv_bytes / (r["verify_ms"] * 1e-3)
            sd, label, sd_out = sdpa_flash(q, k, v, group)
            r["sdpa_variant"] = label
            if sd is not None:
                r["sdpa_ms"] = cuda_time_ms(sd)
                r["verify_over_sdpa"] = r["verify_ms"] / r["sdpa_ms"]
                r["max_err_vs_sdpa"] = (out.float() - sd_out.transpose(1, 2).float()).abs().max().item()
            del sd, sd_out
            torch.cuda.empty_cache()

            # draft: Q = 1, budget blocks among those before an 8-token tail
            tail_len = 8
            ncand = (S - tail_len) // bs
            K = max(1, math.ceil(args.budget * S / bs))
            idx = torch.rand(B * Hkv, ncand, device=dev).argsort(dim=1)[:, :K].sort(dim=1).values
            idx = idx.to(torch.int32).view(B, Hkv, K).contiguous()
            tail = torch.full((B,), S - tail_len, dtype=torch.int32, device=dev)
            q1 = q[:, :1].contiguous()
            draft = lambda: torch.ops.vegas.sparse_draft_attention(q1, k, v, idx, tail, lens, bs, scale)  # noqa: E731
            draft()
            r["draft_ms"] = cuda_time_ms(draft)
            draft_bytes = 2 * B * Hkv * (K * bs + tail_len) * D * 2
            r["draft_bytes_per_s"] = draft_bytes / (r["draft_ms"] * 1e-3)
            r["draft_frac_of_copy"] = r["draft_bytes_per_s"] / bw

            kt = torch.full((B,), K, dtype=torch.int32, device=dev)
            nct = torch.full((B,), ncand, dtype=torch.int32, device=dev)
            topk = lambda: torch.ops.vegas.block_topk(bsc, kt, nct, K, 1)  # noqa: E731
            topk()
            r["topk_ms"] = cuda_time_ms(topk)
            r["topk_share_of_verify"] = r["topk_ms"] / r["verify_ms"]
            rows.append(r)
            sd_ms = f"{r['sdpa_ms']:.3f}" if "sdpa_ms" in r else "n/a"
            ratio = f"{r['verify_over_sdpa']:.2f}x" if "verify_over_sdpa" in r else f"n/a ({label})"
            err = f"{r['max_err_vs_sdpa']:.1e}" if "max_err_vs_sdpa" in r else "-"
            line = (f"| {S} | {B} | {r['verify_ms']:.3f} | {r['verify_bytes_per_s'] / 1e12:.2f} | {sd_ms} | {ratio} | "
                    f"{r['draft_ms']:.3f} | {r['draft_bytes_per_s'] / 1e12:.2f} ({100 * r['draft_frac_of_copy']:.0f} %) | "
                    f"{r['topk_ms']:.3f} ({100 * r['topk_share_of_verify']:.1f} %) | {err} |")
            lines.append(line)
            print(line, flush=True)
            del q, k, v, out, lse, bsc, idx, q1
            torch.cuda.empty_cache()
    sdpa_labels = sorted({r.get("sdpa_variant", "") for r in rows})
    lines += ["", f"SDPA variant(s): {'; '.join(sdpa_labels)}",
              "targets: verify/SDPA <= 1.10x; draft >= 60 % of copy; top-k < 5 % of verify at S=32K"]
    out = Path(args.out)
    write_rows(out.with_suffix(".jsonl"), rows)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(lines[-2])
    print(lines[-1])
    print(f"wrote {out.with_suffix('.jsonl')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
