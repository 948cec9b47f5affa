"""The CUDA kernels of the vegas ops (csrc/cuda/).

Three groups:

* ``test_cuda_kernels_compiled_in_this_build`` -- no GPU needed: when torch is a CUDA build
  and a CUDA toolkit is present (so setup.py builds the CUDA sources), the CUDA kernels
  must be registered. Skipped when the build was CPU-only by choice (VEGAS_BUILD_CUDA=0).
* ``test_emulated_*`` -- no GPU needed: the kernel sources compiled as host C++ against
  the software emulation in csrc/cuda/emu (one std::thread per CUDA thread, mma/ldmatrix
  from the PTX fragment layouts), compared with the references. Evidence that indexing
  and numerics are right, not a substitute for hardware. Compiles once (~1 min on 2
  cores, cached); VEGAS_SKIP_EMULATOR=1 skips them.
* everything else -- needs a GPU (skipped cleanly without one): each kernel against the
  reference exactly as the CPU tests do, both kernel paths (tensor-core and SIMT, the
  latter via VEGAS_CUDA_FORCE_SIMT=1), opcheck, CUDA-graph capture/replay, top-k ties/NaN.
  These call torch.ops.vegas.* directly (the opt-in wrapper is for users).
"""
import hashlib
import math
import os
from pathlib import Path

import pytest
import torch

from op_utils import (
    ATTN_SHAPES,
    assert_verify_matches,
    make_inputs,
    max_err,
    out_error_bound,
    random_selection,
    shape_id,
    verify_case,
)
from vegas_ext import ops, reference

ROOT = Path(__file__).resolve().parents[1]
HAS_GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
CUDA = "cuda"


# ---------------------------------------------------------------------------
# build check (no GPU)
# ---------------------------------------------------------------------------
def test_cuda_kernels_compiled_in_this_build():
    from torch.utils import cpp_extension

    flag = os.environ.get("VEGAS_BUILD_CUDA", "").strip()
    if flag in ("0", "false", "False", "no"):
        pytest.skip("CPU-only build requested (VEGAS_BUILD_CUDA=0)")
    if torch.version.cuda is None or cpp_extension.CUDA_HOME is None:
        pytest.skip("no CUDA build of torch or no CUDA toolkit: setup.py builds CPU kernels only")
    if not ops.EXTENSION_LOADED:
        pytest.fail("vegas_ext._C is not built")
    for op in ("verify_attention", "block_topk", "sparse_draft_attention"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"vegas::{op}", "CUDA"), (
            f"vegas::{op} has no CUDA kernel although torch {torch.__version__} is a CUDA "
            f"build and CUDA_HOME={cpp_extension.CUDA_HOME}: rebuild with "
            "`pip install --no-build-isolation -e .` (or set VEGAS_BUILD_CUDA=0 for a CPU-only build)"
        )


# ---------------------------------------------------------------------------
# software emulation of the kernels (no GPU)
# ---------------------------------------------------------------------------
_EMU = None


def _emu():
    global _EMU
    if os.environ.get("VEGAS_SKIP_EMULATOR", "0") == "1":
        pytest.skip("VEGAS_SKIP_EMULATOR=1")
    if _EMU is None:
        from torch.utils import cpp_extension

        srcs = sorted((ROOT / "csrc" / "cuda").rglob("*")) + [ROOT / "csrc" / "checks.h"]
        h = hashlib.sha1()
        for p in srcs:
            if p.is_file() and p.suffix in (".h", ".cuh", ".cpp"):
                h.update(p.read_bytes())
        try:
            _EMU = cpp_extension.load(
                name=f"vegas_cuda_emu_{h.hexdigest()[:12]}",
                sources=[str(ROOT / "csrc" / "cuda" / "emu" / "emu_ops.cpp")],
                extra_include_paths=[str(ROOT / "csrc")],
                extra_cflags=["-DVEGAS_EMULATE", "-std=c++20", "-O1", "-g0"],
                verbose=False,
            )
        except Exception as e:  # no compiler / ninja: not the kernels' fault
            pytest.skip(f"could not build the kernel emulation: {e}")
    return _EMU


EMU_VERIFY = [  # (B, Q, H_q, H_kv, D, S, block_size)
    (2, 7, 9, 3, 64, 300, 16),
    (2, 3, 4, 1, 128, 257, 1),
    (3, 2, 9, 3, 80, 77, 64),
    (1, 17, 12, 1, 96, 100, 7),
]
EMU_PATHS = [  # (dtype, force SIMT, min tiles per split: 1 = many splits)
    (torch.bfloat16, False, 1),
    (torch.float16, False, 4),
    (torch.float32, True, 1),
    (torch.bfloat16, True, 4),
]


def _path_id(p):
    return f"{str(p[0]).split('.')[-1]}-{'simt' if p[1] else 'auto'}-mt{p[2]}"


@pytest.mark.parametrize("path", EMU_PATHS, ids=_path_id)
@pytest.mark.parametrize("shape", EMU_VERIFY, ids=shape_id)
def test_emulated_verify_attention(shape, path):
    emu = _emu()
    dtype, simt, min_tiles = path
    B, Q, Hq, Hkv, D, S, bs = shape
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, dtype, seed=1)
    scale = D ** -0.5
    w = torch.rand(Q) + 0.5
    out, lse, bsc = emu.verify_attention(q, k, v, lens, bs, scale, w, simt, 3, True, min_tiles)
    out_r, lse_r, bsc_r = reference.verify_attention(q, k, v, lens, bs, scale, w)
    allowed = reference.causal_allowed_mask(lens, Q, S, q.device).unsqueeze(1)
    assert max_err(out, out_r) <= out_error_bound(q, k, v, allowed, scale, dtype)
    assert max_err(lse, lse_r) <= 1e-4 * max(1.0, lse_r.abs().max().item())
    assert max_err(bsc, bsc_r) <= 1e-4 * Q * (Hq // Hkv)


@pytest.mark.parametrize("path", EMU_PATHS[:3], ids=_path_id)
@pytest.mark.parametrize(
    "shape", [(2, 1, 8, 2, 64, 300, 16, 6), (2, 3, 9, 3, 80, 500, 7, 20), (3, 2, 4, 1, 128, 200, 1, 40)],
    ids=lambda s: "B{}Q{}Hq{}Hkv{}D{}S{}bs{}K{}".format(*s),
)
def test_emulated_sparse_draft_attention(shape, path):
    emu = _emu()
    dtype, simt, min_tiles = path
    B, Q, Hq, Hkv, D, S, bs, K = shape
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, dtype, seed=2)
    g = torch.Generator().manual_seed(2)
    tail = torch.stack([torch.randint(0, int(n) - Q + 1, (1,), generator=g)[0] for n in lens]).int()
    idx = random_selection(B, Hkv, -(-S // bs), K, seed=2)
    scale = D ** -0.5
    out = emu.sparse_draft_attention(q, k, v, idx, tail, lens, bs, scale, simt, 3, True, min_tiles)
    out_r = reference.sparse_draft_attention(q, k, v, idx, tail, lens, bs, scale)
    allowed = reference.draft_allowed_mask(q, k, idx, tail, lens, bs)
    assert max_err(out, out_r) <= out_error_bound(q, k, v, allowed, scale, dtype)


def _topk_scores(B, H, N, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "rand":
        return torch.rand(B, H, N, generator=g)
    if kind == "ties":
        return torch.randint(0, 4, (B, H, N), generator=g).float()
    s = torch.randn(B, H, N, generator=g)  # "special": NaN, +-inf, +-0
    m = torch.rand(B, H, N, generator=g)
    s[m < 0.1] = float("nan")
    s[(m >= 0.1) & (m < 0.15)] = float("-inf")
    s[(m >= 0.15) & (m < 0.2)] = float("inf")
    s[(m >= 0.2) & (m < 0.25)] = -0.0
    s[(m >= 0.25) & (m < 0.3)] = 0.0
    return s


TOPK_CASES = [(1, 1, 1, 1, 0), (2, 3, 17, 5, 1), (4, 8, 2048, 103, 2), (3, 2, 100, 128, 0), (2, 4, 64, 64, 64)]


def _topk_args(case, kind):
    B, H, N, max_k, sinks = case
    g = torch.Generator().manual_seed(N + 1)
    s = _topk_scores(B, H, N, kind, N)
    k = torch.randint(0, max_k + 3, (B,), generator=g).int()
    nc = torch.randint(0, N + 5, (B,), generator=g).int()
    k[0], nc[0] = max_k, N
    return s, k, nc, max_k, sinks


# fewer rows than on the GPU: the emulation runs 512 threads per row
EMU_TOPK_CASES = [(1, 1, 1, 1, 0), (2, 3, 17, 5, 1), (2, 2, 2048, 103, 2), (3, 2, 100, 128, 0), (2, 1, 64, 64, 64)]


@pytest.mark.parametrize("kind", ["rand", "ties", "special"])
@pytest.mark.parametrize("case", EMU_TOPK_CASES, ids=str)
def test_emulated_block_topk(case, kind):
    emu = _emu()
    s, k, nc, max_k, sinks = _topk_args(case, kind)
    assert torch.equal(emu.block_topk(s, k, nc, max_k, sinks, True), reference.block_topk(s, k, nc, max_k, sinks))


@pytest.mark.parametrize("path", EMU_PATHS, ids=_path_id)
def test_emulated_nan_propagates(path):
    """A NaN key poisons the rows that see it (as the reference), also across splits."""
    emu = _emu()
    dtype, simt, min_tiles = path
    q = torch.randn(1, 1, 2, 64).to(dtype)
    k = torch.randn(1, 1, 600, 64).to(dtype)
    v = torch.randn(1, 1, 600, 64).to(dtype)
    k[0, 0, 3, 0] = float("nan")
    lens = torch.tensor([600], dtype=torch.int32)
    out, lse, bsc = emu.verify_attention(q, k, v, lens, 16, 0.125, None, simt, 3, True, min_tiles)
    assert torch.isnan(out).all() and torch.isnan(lse).all() and not torch.isinf(bsc).any()


def test_emulated_unchecked_values_do_not_crash():
    """Under graph capture the value checks are skipped: out-of-range seq_lens, tail_start
    and block indices must be clamped / masked by the kernels (garbage out, no OOB)."""
    emu = _emu()
    B, Q, Hq, Hkv, D, S, bs = 3, 2, 8, 2, 64, 90, 16
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, torch.bfloat16)
    bad_lens = torch.tensor([S + 7, -3, 1], dtype=torch.int32)
    emu.verify_attention(q, k, v, bad_lens, bs, 0.125, None, False, 3, False, 1)
    idx = torch.tensor([[[0, 99, -5]], [[-1, 2, 6]], [[1, 1, 1]]], dtype=torch.int32).expand(B, Hkv, 3).contiguous()
    tail = torch.tensor([S + 3, -8, 50], dtype=torch.int32)
    emu.sparse_draft_attention(q, k, v, idx, tail, bad_lens, bs, 0.125, False, 3, False, 1)
    emu.sparse_draft_attention(q, k, v, idx, tail, bad_lens, bs, 0.125, True, 3, False, 1)
    s = torch.randn(3, 2, 50)
    out = emu.block_topk(s, torch.tensor([-4, 99, 5], dtype=torch.int32), torch.tensor([70, -1, 9], dtype=torch.int32), 8, 2, False)
    assert out.shape == (3, 2, 8)


# ---------------------------------------------------------------------------
# on a GPU
# ---------------------------------------------------------------------------
@pytest.fixture(params=["auto", "simt"])
def kernel_path(request, monkeypatch):
    """'auto': tensor-core kernels where they apply; 'simt': VEGAS_CUDA_FORCE_SIMT=1."""
    if request.param == "simt":
        monkeypatch.setenv("VEGAS_CUDA_FORCE_SIMT", "1")
    else:
        monkeypatch.delenv("VEGAS_CUDA_FORCE_SIMT", raising=False)
    return request.param


VERIFY_SHAPES = ATTN_SHAPES + [  # (B, Q, H_q, H_kv, D, S, block_size)
    (2, 16, 32, 8, 96, 2000, 16),
    (1, 24, 8, 2, 128, 3000, 5),  # Q > 16
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _verify_case(shape, dtype, query_weights=None, seed=0):
    return verify_case(shape, dtype, device=CUDA, query_weights=query_weights, seed=seed)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", VERIFY_SHAPES, ids=shape_id)
def test_verify_attention_matches_reference(shape, dtype, kernel_path):
    case = _verify_case(shape, dtype)
    assert case[1][0].is_cuda
    assert_verify_matches(shape, dtype, case)


@gpu
@pytest.mark.parametrize("shape", [VERIFY_SHAPES[1], VERIFY_SHAPES[3], VERIFY_SHAPES[4]], ids=str)
def test_verify_block_scores_sum_and_zero_tail(shape, kernel_path):
    B, Q, Hq, Hkv, D, S, bs = shape
    w = torch.rand(Q, device=CUDA) + 0.25
    (_, _, _, lens, _), (_, _, bsc), _ = _verify_case(shape, torch.bfloat16, query_weights=w)
    want = (Hq // Hkv) * w.sum().item()
    torch.testing.assert_close(bsc.sum(-1), torch.full((B, Hkv), want, device=CUDA), rtol=1e-4, atol=1e-4)
    for b in range(B):
        assert bool((bsc[b, :, math.ceil(int(lens[b]) / bs):] == 0).all())


@gpu
def test_verify_query_weights_first_last():
    w = torch.zeros(7, device=CUDA)
    w[0] = w[-1] = 1.0
    _, (out, _, bsc), (out_r, _, bsc_r) = _verify_case((2, 7, 9, 3, 64, 300, 16), torch.float32, query_weights=w)
    assert max_err(bsc, bsc_r) < 1e-5
    assert max_err(out, out_r) < 1e-5


@gpu
def test_verify_fp16_large_magnitude_stays_finite(kernel_path):
    B, Q, Hq, Hkv, D, S, bs = 2, 4, 8, 2, 64, 200, 16
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, torch.float16, magnitude=60.0, device=CUDA)
    assert (q.float()[0, 0, 0] @ k.float()[0, 0].T).abs().max() > 65504
    scale = D ** -0.5
    out, lse, bsc = torch.ops.vegas.verify_attention(q, k, v, lens, bs, scale, None)
    out_r, lse_r, bsc_r = reference.verify_attention(q, k, v, lens, bs, scale)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all() and torch.isfinite(bsc).all()
    assert max_err(lse, lse_r) <= 1e-4 * lse_r.abs().max().item()
    assert max_err(bsc, bsc_r) <= 1e-3


@gpu
def test_verify_unaligned_and_strided_cache():
    """A cache whose rows are not 16-byte aligned (falls back to the SIMT kernel) and a
    cache view with padded strides (tensor-core kernel) both match the reference."""
    B, Q, Hq, Hkv, D, S, bs = 2, 3, 8, 2, 64, 150, 16
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, torch.bfloat16, device=CUDA)
    kb = torch.zeros(B, Hkv, S, D + 1, dtype=k.dtype, device=CUDA)
    vb = torch.zeros_like(kb)
    kb[..., 1:] = k
    vb[..., 1:] = v
    kp = torch.zeros(B, Hkv, S + 5, D + 8, dtype=k.dtype, device=CUDA)
    vp = torch.zeros_like(kp)
    kp[:, :, :S, :D] = k
    vp[:, :, :S, :D] = v
    want = reference.verify_attention(q, k, v, lens, bs, D ** -0.5)
    allowed = reference.causal_allowed_mask(lens, Q, S, q.device).unsqueeze(1)
    bound = out_error_bound(q, k, v, allowed, D ** -0.5, torch.bfloat16)
    for kk, vv in ((kb[..., 1:], vb[..., 1:]), (kp[:, :, :S, :D], vp[:, :, :S, :D])):
        out, lse, bsc = torch.ops.vegas.verify_attention(q, kk, vv, lens, bs, D ** -0.5, None)
        assert max_err(out, want[0]) <= bound
        assert max_err(bsc, want[2]) <= 1e-4 * Q * (Hq // Hkv)


DRAFT_SHAPES = [  # (B, Q, H_q, H_kv, D, S, block_size, K)
    (2, 1, 8, 2, 64, 300, 16, 6),
    (3, 3, 9, 3, 80, 1000, 7, 40),
    (4, 1, 32, 8, 128, 4100, 64, 8),
    (2, 2, 4, 1, 128, 257, 1, 60),
    (1, 7, 8, 8, 64, 2000, 16, 0),
    (2, 1, 32, 8, 96, 3000, 32, 20),
]


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", DRAFT_SHAPES, ids=lambda s: "B{}Q{}Hq{}Hkv{}D{}S{}bs{}K{}".format(*s))
def test_sparse_draft_attention_matches_reference(shape, dtype, kernel_path):
    B, Q, Hq, Hkv, D, S, bs, K = shape
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, dtype, seed=3, device=CUDA)
    g = torch.Generator().manual_seed(3)
    tail = torch.stack([torch.randint(0, int(n) - Q + 1, (1,), generator=g)[0] for n in lens.cpu()]).int().to(CUDA)
    idx = random_selection(B, Hkv, -(-S // bs), K, seed=3).to(CUDA)
    scale = D ** -0.5
    out = torch.ops.vegas.sparse_draft_attention(q, k, v, idx, tail, lens, bs, scale)
    out_r = reference.sparse_draft_attention(q, k, v, idx, tail, lens, bs, scale)
    assert out.shape == (B, Q, Hq, D) and out.dtype == dtype
    allowed = reference.draft_allowed_mask(q, k, idx, tail, lens, bs)
    assert max_err(out, out_r) <= out_error_bound(q, k, v, allowed, scale, dtype)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_draft_with_every_block_equals_verify(dtype, kernel_path):
    B, Q, Hq, Hkv, D, S, bs = 2, 4, 8, 2, 64, 500, 16
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, dtype, device=CUDA)
    nb = -(-S // bs)
    idx = torch.arange(nb, dtype=torch.int32, device=CUDA).flip(0).expand(B, Hkv, nb).contiguous()
    tail = (lens - Q).clamp(min=0).to(torch.int32)
    out_d = torch.ops.vegas.sparse_draft_attention(q, k, v, idx, tail, lens, bs, D ** -0.5)
    out_v, _, _ = torch.ops.vegas.verify_attention(q, k, v, lens, bs, D ** -0.5, None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert max_err(out_d, out_v) <= tol


@gpu
@pytest.mark.parametrize("kind", ["rand", "ties", "special"])
@pytest.mark.parametrize("case", TOPK_CASES + [(2, 8, 131072, 6554, 4), (3, 2, 5000, 5000, 0)], ids=str)
def test_block_topk_matches_reference(case, kind):
    s, k, nc, max_k, sinks = _topk_args(case, kind)
    got = torch.ops.vegas.block_topk(s.to(CUDA), k.to(CUDA), nc.to(CUDA), max_k, sinks)
    want = reference.block_topk(s, k, nc, max_k, sinks)
    assert got.dtype == torch.int32 and got.is_cuda
    assert torch.equal(got.cpu(), want)


@gpu
def test_block_topk_ties_prefer_lower_index_and_nan_last():
    s = torch.zeros(1, 3, 10, device=CUDA)
    s[0, 1, 5:] = 1.0
    s[0, 2] = float("nan")
    s[0, 2, 7] = float("-inf")
    k = torch.tensor([3], dtype=torch.int32, device=CUDA)
    nc = torch.tensor([10], dtype=torch.int32, device=CUDA)
    got = torch.ops.vegas.block_topk(s, k, nc, 4, 0).cpu()
    assert got[0, 0].tolist() == [0, 1, 2, -1]
    assert got[0, 1].tolist() == [5, 6, 7, -1]
    assert got[0, 2].tolist() == [0, 1, 7, -1]  # -inf outranks NaN; NaN ties by index


@gpu
def test_cuda_bad_values_raise():
    q, k, v, lens = make_inputs(2, 2, 4, 2, 64, 50, torch.bfloat16, device=CUDA)
    bad = torch.tensor([51, 2], dtype=torch.int32, device=CUDA)
    with pytest.raises((RuntimeError, ValueError), match="seq_lens"):
        torch.ops.vegas.verify_attention(q, k, v, bad, 16, 0.125, None)
    idx = torch.tensor([[[0, 9]], [[1, -1]]], dtype=torch.int32, device=CUDA).expand(2, 2, 2).contiguous()
    tail = torch.zeros(2, dtype=torch.int32, device=CUDA)
    with pytest.raises((RuntimeError, ValueError), match="block_indices"):
        torch.ops.vegas.sparse_draft_attention(q, k, v, idx, tail, lens, 16, 0.125)
    with pytest.raises((RuntimeError, ValueError), match="tail_start"):
        torch.ops.vegas.sparse_draft_attention(q, k, v, idx.clamp(max=3), lens, lens, 16, 0.125)
    s = torch.rand(2, 2, 10, device=CUDA)
    with pytest.raises((RuntimeError, ValueError), match="k"):
        torch.ops.vegas.block_topk(s, torch.tensor([-1, 2], dtype=torch.int32, device=CUDA), lens, 4, 0)


@gpu
def test_opcheck_cuda():
    B, Q, Hq, Hkv, D, S, bs = 2, 3, 8, 2, 64, 100, 16
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, torch.bfloat16, device=CUDA)
    torch.library.opcheck(torch.ops.vegas.verify_attention.default, (q, k, v, lens, bs, 0.125, None))
    w = torch.rand(Q, device=CUDA)
    torch.library.opcheck(torch.ops.vegas.verify_attention.default, (q, k, v, lens, bs, 0.125, w))
    idx = random_selection(B, Hkv, -(-S // bs), 3).to(CUDA)
    tail = (lens - Q).to(torch.int32)
    torch.library.opcheck(torch.ops.vegas.sparse_draft_attention.default, (q, k, v, idx, tail, lens, bs, 0.125))
    s = torch.rand(B, Hkv, 7, device=CUDA)
    kk = torch.tensor([3, 9], dtype=torch.int32, device=CUDA)
    nc = torch.tensor([7, 5], dtype=torch.int32, device=CUDA)
    torch.library.opcheck(torch.ops.vegas.block_topk.default, (s, kk, nc, 4, 1))


@gpu
def test_cuda_graph_capture_and_replay():
    """verify -> top-k -> draft captured once, replayed with new inputs written in place
    (new queries, new lengths, new tail): equals eager execution each time."""
    B, Q, Hq, Hkv, D, S, bs, K = 3, 4, 8, 2, 64, 1024, 16, 12
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, torch.bfloat16, device=CUDA)
    qd = q[:, :1].clone()
    lens_d = lens.clone()
    tail = (lens - Q).to(torch.int32)
    kt = torch.full((B,), K, dtype=torch.int32, device=CUDA)
    scale = D ** -0.5

    def step():
        out, lse, bsc = torch.ops.vegas.verify_attention(q, k, v, lens, bs, scale, None)
        ncand = torch.div(tail, bs, rounding_mode="floor").to(torch.int32)
        idx = torch.ops.vegas.block_topk(bsc, kt, ncand, K, 1)
        outd = torch.ops.vegas.sparse_draft_attention(qd, k, v, idx, tail, lens_d, bs, scale)
        return out, lse, bsc, idx, outd

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up (allocator, lazy init) outside the capture
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for it in range(3):
        g = torch.Generator().manual_seed(100 + it)
        q.copy_(torch.randn(q.shape, generator=g).to(q.dtype))
        qd.copy_(torch.randn(qd.shape, generator=g).to(qd.dtype))
        new_lens = torch.randint(Q + 1, S + 1, (B,), generator=g).int()
        lens.copy_(new_lens)
        tail.copy_(new_lens - Q)
        lens_d.copy_(torch.minimum(new_lens, new_lens - Q + 1))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for a, b in zip(static, eager):
            if a.dtype == torch.int32:
                assert torch.equal(a, b)
            else:
                assert max_err(a, b) == 0.0  # same kernels, same launch plan: bitwise equal
