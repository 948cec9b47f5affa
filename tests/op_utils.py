"""Shared helpers for the op tests: random inputs and per-dtype error bounds.

Error bound convention (flash-attention's): a kernel fed bf16/fp16 inputs must be
within 2x the error that a same-precision PyTorch computation (matmuls and softmax
in that dtype) makes against the float32 reference, plus a small floor.
"""
import math

import torch

from vegas_ext import reference

# (B, Q, H_q, H_kv, D, S, block_size): odd shapes shared by the CPU and CUDA op tests --
# GQA ratios 3/1/4 and MQA, S = 1, S not a multiple of block_size, S >= 4096, ragged lengths.
ATTN_SHAPES = [
    (1, 1, 4, 1, 64, 1, 1),
    (2, 7, 9, 3, 64, 300, 16),
    (3, 5, 8, 8, 80, 1000, 7),
    (4, 8, 32, 8, 128, 4100, 64),
    (2, 3, 4, 1, 128, 257, 1),
    (3, 2, 9, 3, 80, 77, 64),
    (1, 8, 32, 8, 64, 4096, 16),
    (4, 1, 8, 8, 64, 129, 7),
]


def shape_id(s):
    return "B{}Q{}Hq{}Hkv{}D{}S{}bs{}".format(*s)


ATOL_FLOOR = {torch.float32: 3e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def make_inputs(B, Q, Hq, Hkv, D, S, dtype, *, seed=0, device="cpu", magnitude=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Q, Hq, D, generator=g) * magnitude).to(dtype).to(device)
    k = (torch.randn(B, Hkv, S, D, generator=g) * magnitude).to(dtype).to(device)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype).to(device)
    # ragged lengths in [Q, S]; include both extremes when B allows
    lens = torch.randint(Q, S + 1, (B,), generator=g)
    lens[0] = S
    if B > 1:
        lens[-1] = Q
    return q, k, v, lens.to(torch.int32).to(device)


def out_error_bound(q, k, v, allowed, scale, dtype):
    """2x the error of a same-precision dense attention vs the fp32 one (with a floor)."""
    if dtype == torch.float32:
        return ATOL_FLOOR[dtype]
    exact, _, _ = reference.masked_attention(q.float(), k.float(), v.float(), allowed, scale)
    low, _, _ = reference.masked_attention(q, k, v, allowed, scale, compute_dtype=dtype)
    err = (low.float() - exact.float()).abs().max().item()
    return max(2.0 * err, ATOL_FLOOR[dtype])


def max_err(a, b):
    e = (a.float() - b.float()).abs().max().item()
    assert math.isfinite(e), "non-finite values"
    return e


def random_selection(B, Hkv, nblocks, K, *, seed=0, pad=1):
    """[B, H_kv, K] int32 unique block indices per row (random order), last `pad` slots -1."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B * Hkv):
        perm = torch.randperm(nblocks, generator=g)[:K]
        r = torch.full((K,), -1, dtype=torch.int32)
        r[: max(0, min(K, nblocks) - pad)] = perm[: max(0, min(K, nblocks) - pad)].int()
        rows.append(r)
    return torch.stack(rows).view(B, Hkv, K)


def verify_case(shape, dtype, *, device="cpu", query_weights=None, seed=0):
    """Run torch.ops.vegas.verify_attention and the reference on one random case.
    Returns ((q, k, v, lens, scale), kernel outputs, reference outputs)."""
    B, Q, Hq, Hkv, D, S, bs = shape
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, dtype, seed=seed, device=device)
    scale = D ** -0.5
    got = torch.ops.vegas.verify_attention(q, k, v, lens, bs, scale, query_weights)
    want = reference.verify_attention(q, k, v, lens, bs, scale, query_weights)
    return (q, k, v, lens, scale), got, want


def assert_verify_matches(shape, dtype, case):
    """Shapes, dtypes and per-dtype error bounds of verify_attention's three outputs."""
    (q, k, v, lens, scale), (out, lse, bsc), (out_r, lse_r, bsc_r) = case
    B, Q, Hq, Hkv, D, S, bs = shape
    assert out.shape == (B, Q, Hq, D) and out.dtype == dtype
    assert lse.shape == (B, Hq, Q) and lse.dtype == torch.float32
    assert bsc.shape == (B, Hkv, math.ceil(S / bs)) and bsc.dtype == torch.float32
    allowed = reference.causal_allowed_mask(lens, Q, S, q.device).unsqueeze(1)
    assert max_err(out, out_r) <= out_error_bound(q, k, v, allowed, scale, dtype)
    assert max_err(lse, lse_r) <= 1e-4 * max(1.0, lse_r.abs().max().item())
    # block scores are sums of probabilities computed in fp32 from the same inputs
    assert max_err(bsc, bsc_r) <= 1e-4 * Q * (Hq // Hkv)


def run_with_isa(script, isa, **fields):
    """Runs ``script`` (formatted with ``tests`` = the tests folder and ``fields``) in a fresh
    process with the CPU kernels forced to the instruction set ``isa`` by VEGAS_CPU_ISA (read once
    per process); it must print "ok" last."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).parent)
    code = script.format(tests=tests, **fields)
    # the script imports the tests' helpers (op_utils, test modules) from this folder
    env = dict(os.environ, VEGAS_CPU_ISA=isa,
               PYTHONPATH=os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
