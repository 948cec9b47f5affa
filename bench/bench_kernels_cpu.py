"""CPU microbenchmark of the three vegas kernels.

    python bench/bench_kernels_cpu.py [--seq-lens 2048 8192 32768] [--dtype float32] [--repeats 7]

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
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, run_metadata, time_fns, write_rows  # noqa: E402

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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--dtype", choices=list(DT), default="float32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tmp" / "kernels_cpu",
                    help="output prefix (.jsonl, .md); the committed results are bench/results/kernels_cpu.*")
    args = ap.parse_args()
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
