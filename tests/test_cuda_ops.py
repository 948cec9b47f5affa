"""The CUDA kernels of the vegas ops (csrc/cuda/).

Three groups:

* ``test_cuda_kernels_compiled_in_this_build`` -- no GPU needed: when torch is a CUDA build
  and a CUDA toolkit is present (so setup.py builds the CUDA sources), the CUDA kernels
  must be registered. Skipped when the build was CPU-only by choice (VEGAS_BUILD_CUDA=0).
* ``test_emulated_*`` and the launch-plan tests -- no GPU needed: the kernel sources
  compiled as host C++ against the software emulation in csrc/cuda/emu (tests/cuda_emu.py:
  one std::thread per CUDA thread, mma/ldmatrix from the PTX fragment layouts), compared
  with the references; the device-side guards (NaN rows) without host value checks; no
  device-to-host copy per call by default; the workspace formula
  (ops.cuda_workspace_bytes) against the launchers' plan. Evidence that indexing and
  numerics are right, not a substitute for hardware. Compiles once (~1 min on 2 cores,
  cached); VEGAS_SKIP_EMULATOR=1 skips them.
* everything else -- needs a GPU (skipped cleanly without one): each kernel against the
  reference exactly as the CPU tests do, both kernel paths (tensor-core and SIMT, the
  latter via VEGAS_CUDA_FORCE_SIMT=1), opcheck, CUDA-graph capture/replay (verify -> top-k
  -> draft, and a whole 3-layer decode step), no host sync in a decode step (torch's sync
  debug mode), measured workspace = formula, top-k ties/NaN. These call
  torch.ops.vegas.* directly (the opt-in wrapper is for users).
"""
import math
import os

import pytest
import torch

from vegas_ext import ops, reference

from cuda_emu import load_emulator
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
    for op in ("verify_attention", "block_topk", "sparse_draft_attention", "paged_block_scores",
               "paged_verify_attention"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"vegas::{op}", "CUDA"), (
            f"vegas::{op} has no CUDA kernel although torch {torch.__version__} is a CUDA "
            f"build and CUDA_HOME={cpp_extension.CUDA_HOME}: rebuild with "
            "`pip install --no-build-isolation -e .` (or set VEGAS_BUILD_CUDA=0 for a CPU-only build)"
        )


# ---------------------------------------------------------------------------
# software emulation of the kernels (no GPU)
# ---------------------------------------------------------------------------
_emu = load_emulator


EMU_VERIFY = [  # (B, Q, H_q, H_kv, D, S, block_size)
    (2, 7, 9, 3, 64, 300, 16),  # slots, one per 16-token step
    (2, 3, 4, 1, 128, 257, 1),  # block-score pass
    (3, 2, 9, 3, 80, 77, 64),
    (1, 17, 12, 1, 96, 100, 7),  # 204 rows: score pass on the tensor-core path, slots on SIMT
    (2, 4, 8, 2, 64, 700, 5),  # score pass: blocks cut by tiles and chunks
    (2, 2, 8, 2, 64, 200, 20),  # slots, two per step
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
    out, lse, bsc = emu.verify_attention(q, k, v, lens, bs, scale, w, simt, 3, 1, min_tiles)
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
    out = emu.sparse_draft_attention(q, k, v, idx, tail, lens, bs, scale, simt, 3, 1, min_tiles)
    out_r = reference.sparse_draft_attention(q, k, v, idx, tail, lens, bs, scale)
    allowed = reference.draft_allowed_mask(q, k, idx, tail, lens, bs)
    assert max_err(out, out_r) <= out_error_bound(q, k, v, allowed, scale, dtype)


# Small batches on the real launch plan (132 SMs, 4 tiles per split minimum): every (batch row,
# KV head) is cut into as many splits as the tiles allow, merged by attn_merge_kernel. Odd
# shapes: GQA 1 / 3 / 4 / 7, ragged lengths (make_inputs), block sizes not dividing S.
EMU_SMALL_BATCH = [  # (B, Q, H_q, H_kv, D, S, block_size, min_tiles)
    (1, 7, 32, 8, 128, 1100, 1, 4),  # Llama-3-8B heads, score pass, 5 splits of 4 tiles
    (1, 3, 7, 1, 64, 2085, 5, 1),  # GQA 7, MQA: 33 splits (two partials per merge lane)
    (2, 2, 9, 3, 80, 1500, 20, 1),  # slots, two per step; ragged rows, some splits empty
    (1, 4, 4, 4, 64, 700, 16, 1),  # GQA 1 (MHA)
    (1, 2, 8, 2, 96, 8300, 1, 1),  # 128 splits: four partials per merge lane
]
EMU_SMALL_DTYPES = [(torch.bfloat16, False), (torch.float32, True), (torch.float16, False)]


@pytest.mark.parametrize("dt", EMU_SMALL_DTYPES,
                         ids=lambda p: f"{str(p[0]).split('.')[-1]}-{'simt' if p[1] else 'auto'}")
@pytest.mark.parametrize("shape", EMU_SMALL_BATCH, ids=lambda s: "B{}Q{}Hq{}Hkv{}D{}S{}bs{}mt{}".format(*s))
def test_emulated_verify_small_batch_splits(shape, dt):
    """verify_attention at batch 1-2 with the split-KV plan that fills 132 SMs: out, lse and
    the fused block scores against the reference, per-dtype bounds (out: 2x a same-precision
    dense attention; lse 1e-4 relative; block scores 1e-4 per query row, fp32 sums)."""
    emu = _emu()
    dtype, simt = dt
    B, Q, Hq, Hkv, D, S, bs, min_tiles = shape
    if dtype == torch.float16 and D == 96 and S > 8000:
        pytest.skip("the bf16 / fp32 runs cover the 128-split case (emulation time)")
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, dtype, seed=11)
    scale = D ** -0.5
    w = torch.rand(Q) + 0.5
    nsplit = emu.attn_plan("verify_attention", B, Q, Hq, Hkv, D, S, bs, 0, dtype, not simt, 132,
                           min_tiles, 233472)[0]
    assert nsplit > 1
    out, lse, bsc = emu.verify_attention(q, k, v, lens, bs, scale, w, simt, 132, 1, min_tiles)
    out_r, lse_r, bsc_r = reference.verify_attention(q, k, v, lens, bs, scale, w)
    allowed = reference.causal_allowed_mask(lens, Q, S, q.device).unsqueeze(1)
    assert max_err(out, out_r) <= out_error_bound(q, k, v, allowed, scale, dtype)
    assert max_err(lse, lse_r) <= 1e-4 * max(1.0, lse_r.abs().max().item())
    assert max_err(bsc, bsc_r) <= 1e-4 * Q * (Hq // Hkv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_emulated_draft_small_batch_splits(dtype):
    """sparse_draft_attention at batch 1 through the same split / merge path (no scores)."""
    emu = _emu()
    B, Q, Hq, Hkv, D, S, bs, K = 1, 1, 12, 4, 64, 3000, 3, 300
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, dtype, seed=12)
    tail = (lens - 8).to(torch.int32)
    idx = random_selection(B, Hkv, -(-S // bs), K, seed=12)
    scale = D ** -0.5
    simt = dtype == torch.float32
    out = emu.sparse_draft_attention(q, k, v, idx, tail, lens, bs, scale, simt, 132, 1, 1)
    out_r = reference.sparse_draft_attention(q, k, v, idx, tail, lens, bs, scale)
    allowed = reference.draft_allowed_mask(q, k, idx, tail, lens, bs)
    assert max_err(out, out_r) <= out_error_bound(q, k, v, allowed, scale, dtype)


@pytest.mark.parametrize("S", [8192, 32768, 131072])
@pytest.mark.parametrize("B", [1, 2, 4, 8, 32])
def test_split_plan_fills_the_device(B, S):
    """Llama-3-8B attention (H_q 32, H_kv 8, D 128), Q 7, bf16, 132 SMs with 228 KiB each (H100 /
    H200): 3 resident CTAs of 75 KB per SM, 396 slots. The main kernel's grid never runs a
    partial last wave worse than the old plan and, at batch 1-4 from 32K on, fills at least 85 %
    of one wave (the old 4 x SMs target gave 512 CTAs at batch 1: 1.3 waves, i.e. 2 of them);
    3 launches per verification (main, merge, block scores)."""
    emu = _emu()
    nsplit, per_sm, ctas, merge_ctas, launches = emu.attn_plan(
        "verify_attention", B, 7, 32, 8, 128, S, 1, 0, torch.bfloat16, True, 132, 4, 233472)
    slots = 132 * per_sm
    assert per_sm == 3 and launches == 3
    assert ctas == B * 8 * nsplit  # 28 rows: one row group of two warps' 16 rows
    waves = -(-ctas // slots)
    assert ctas / (waves * slots) >= (0.85 if (B <= 4 and S >= 32768) else 0.6)
    assert merge_ctas == B * 8 * 7  # one warp per query row, 4 rows per CTA
    if B == 1 and S >= 32768:
        assert 44 <= nsplit <= 49 and waves == 1


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
    assert torch.equal(emu.block_topk(s, k, nc, max_k, sinks, 1), reference.block_topk(s, k, nc, max_k, sinks))


@pytest.mark.parametrize("recent", [1, 7, 300])
@pytest.mark.parametrize("case", EMU_TOPK_CASES[1:], ids=str)
def test_emulated_block_topk_recent_blocks(case, recent):
    """num_recent_blocks: the last eligible blocks always, the rest by score: the reference's selection."""
    emu = _emu()
    s, k, nc, max_k, sinks = _topk_args(case, "ties")
    got = emu.block_topk(s, k, nc, max_k, sinks, 1, recent)
    assert torch.equal(got, reference.block_topk(s, k, nc, max_k, sinks, recent))


@pytest.mark.parametrize("kind", ["rand", "ties", "special"])
@pytest.mark.parametrize("ncache", [0, 700, None], ids=["no-cache", "partial-cache", "all-cached"])
def test_emulated_block_topk_key_cache(ncache, kind):
    """Rows longer than the CTA's shared memory allows keep only their first keys cached, the
    rest re-read from global memory each pass: the same selection as the reference, for every
    split point (none cached, part, all), with ties, NaN and +-inf; uneven warp segments."""
    emu = _emu()
    B, H, N, max_k, sinks = 2, 2, 3001, 150, 3
    s, k, nc, _, _ = _topk_args((B, H, N, max_k, sinks), kind)
    fixed = (1 << 20) - 4 * emu.topk_cache_keys(1 << 30, 1 << 20)  # histogram, counts: not keys
    optin = 227 * 1024 if ncache is None else fixed + 4 * ncache
    want_cache = N if ncache is None else ncache
    assert emu.topk_cache_keys(N, optin) == want_cache
    got = emu.block_topk_optin(s, k, nc, max_k, sinks, optin)
    assert torch.equal(got, reference.block_topk(s, k, nc, max_k, sinks))


def test_emulated_block_topk_block_size_1_row():
    """One long row as at block size 1 (scores = probabilities over 20K tokens, 5 % budget,
    a spread of magnitudes and exact zeros past the length): the reference's selection."""
    emu = _emu()
    g = torch.Generator().manual_seed(3)
    N = 20000
    s = torch.softmax(torch.randn(1, 2, N, generator=g) * 4, dim=-1)
    s[:, :, 18000:] = 0.0
    k = torch.tensor([1000], dtype=torch.int32)
    nc = torch.tensor([N - 7], dtype=torch.int32)
    got = emu.block_topk(s, k, nc, 1000, 1, 1)
    assert torch.equal(got, reference.block_topk(s, k, nc, 1000, 1))


@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("path", EMU_PATHS, ids=_path_id)
def test_emulated_nan_propagates(path, bs):
    """A NaN key poisons the rows that see it (as the reference), also across splits."""
    emu = _emu()
    dtype, simt, min_tiles = path
    q = torch.randn(1, 1, 2, 64).to(dtype)
    k = torch.randn(1, 1, 600, 64).to(dtype)
    v = torch.randn(1, 1, 600, 64).to(dtype)
    k[0, 0, 3, 0] = float("nan")
    lens = torch.tensor([600], dtype=torch.int32)
    out, lse, bsc = emu.verify_attention(q, k, v, lens, bs, 0.125, None, simt, 3, 1, min_tiles)
    assert torch.isnan(out).all() and torch.isnan(lse).all() and not torch.isinf(bsc).any()


def _guard_inputs():
    """Out-of-range device values, as they could reach the kernels without host checks:
    rows 0 and 1 are invalid (seq_lens outside [Q, S]; for the draft also a negative
    tail_start), row 2 is valid (its block indices include out-of-range ones)."""
    B, Q, Hq, Hkv, D, S = 3, 2, 8, 2, 64, 90
    q, k, v, _ = make_inputs(B, Q, Hq, Hkv, D, S, torch.bfloat16, seed=5)
    lens = torch.tensor([S + 7, -3, 61], dtype=torch.int32)
    return q, k, v, lens


@pytest.mark.parametrize("simt", [False, True], ids=["auto", "simt"])
@pytest.mark.parametrize("bs", [1, 16], ids=["bs1-score-pass", "bs16-slots"])
def test_emulated_device_guards_poison_bad_rows(bs, simt):
    """Without the host-side value checks (the CUDA default) the kernels neither read out of
    bounds nor return plausible numbers for bad rows: every output of a row with an
    out-of-range seq_len / tail_start is NaN, block indices out of range select nothing,
    and the valid row equals the reference."""
    emu = _emu()
    q, k, v, lens = _guard_inputs()
    S, nb = k.shape[2], -(-k.shape[2] // bs)
    out, lse, bsc = emu.verify_attention(q, k, v, lens, bs, 0.125, None, simt, 3, 0, 1)
    for t in (out, lse, bsc):
        assert torch.isnan(t[:2]).all()
    want = reference.verify_attention(q[2:], k[2:], v[2:], lens[2:], bs, 0.125)
    assert max_err(out[2:], want[0]) <= 2e-2 and max_err(lse[2:], want[1]) <= 1e-3
    assert max_err(bsc[2:], want[2]) <= 1e-4 * q.shape[1] * 4

    qd = q[:, :1].contiguous()
    lens_d = torch.tensor([S + 7, 60, 50], dtype=torch.int32)
    tail = torch.tensor([3, -8, 40], dtype=torch.int32)
    idx = torch.tensor([[0, 1, 2], [0, 1, 2], [1, nb + 5, -5]], dtype=torch.int32)[:, None].expand(3, 2, 3).contiguous()
    outd = emu.sparse_draft_attention(qd, k, v, idx, tail, lens_d, bs, 0.125, simt, 3, 0, 1)
    assert torch.isnan(outd[:2]).all()
    idx_ok = torch.tensor([1, -1, -1], dtype=torch.int32).expand(1, 2, 3).contiguous()
    want_d = reference.sparse_draft_attention(qd[2:], k[2:], v[2:], idx_ok, tail[2:], lens_d[2:], bs, 0.125)
    assert max_err(outd[2:], want_d) <= 2e-2


def test_emulated_topk_clamps_unchecked_counts():
    emu = _emu()
    s = torch.randn(3, 2, 50)
    k = torch.tensor([-4, 99, 5], dtype=torch.int32)
    nc = torch.tensor([70, -1, 9], dtype=torch.int32)
    got = emu.block_topk(s, k, nc, 8, 2, 0)
    assert torch.equal(got, reference.block_topk(s, k.clamp(min=0), nc.clamp(min=0), 8, 2))


def test_emulated_no_host_copies_unless_value_checks_requested(monkeypatch):
    """The ops' host logic makes no device-to-host copy (no host sync) by default;
    VEGAS_CUDA_VALUE_CHECKS=1 turns the value checks (one copy per checked tensor) on."""
    emu = _emu()
    q, k, v, lens = make_inputs(2, 3, 8, 2, 64, 100, torch.bfloat16, seed=6)
    idx = random_selection(2, 2, 100, 4, seed=6)
    tail = (lens - 3).to(torch.int32)
    s = torch.rand(2, 2, 20)
    kk = torch.tensor([3, 4], dtype=torch.int32)

    def calls():
        emu.verify_attention(q, k, v, lens, 1, 0.125, None, False, 3, -1, 4)
        emu.sparse_draft_attention(q, k, v, idx, tail, lens, 1, 0.125, False, 3, -1, 4)
        emu.block_topk(s, kk, kk, 4, 1, -1)

    monkeypatch.delenv("VEGAS_CUDA_VALUE_CHECKS", raising=False)
    n0 = emu.host_copies()
    calls()
    assert emu.host_copies() == n0
    monkeypatch.setenv("VEGAS_CUDA_VALUE_CHECKS", "1")
    calls()
    assert emu.host_copies() == n0 + 1 + 3 + 2
    bad = lens.clone()
    bad[0] = 101
    with pytest.raises(RuntimeError, match="seq_lens"):
        emu.verify_attention(q, k, v, bad, 1, 0.125, None, False, 3, -1, 4)


@pytest.mark.parametrize("bs,mode", [(1, "score_pass"), (7, "score_pass"), (15, "score_pass"), (16, "slots"),
                                     (20, "slots"), (2**62, "slots")])
def test_block_score_mode_by_block_size(bs, mode):
    emu = _emu()
    for dt, aligned in ((torch.bfloat16, True), (torch.float32, True), (torch.bfloat16, False)):
        assert emu.score_mode(2, 7, 32, 8, 128, 4096, bs, dt, aligned) == mode


WS_SHAPES = [  # (B, Q, Hq, Hkv, D, S, block_size, K)
    (32, 7, 32, 8, 128, 131072, 1, 0),
    (8, 7, 32, 8, 128, 32768, 16, 0),
    (1, 1, 4, 1, 64, 1, 1, 1),
    (3, 17, 12, 1, 96, 100, 7, 5),
    (2, 16, 64, 2, 256, 5000, 3, 40),  # too many rows for the score pass: slots
    (4, 5, 8, 8, 80, 1000, 2**63 - 1, 1),
    (2, 1, 32, 8, 128, 131072, 1, 6554),
]


@pytest.mark.parametrize("shape", WS_SHAPES, ids=lambda s: "B{}Q{}Hq{}Hkv{}D{}S{}bs{}K{}".format(*s))
def test_workspace_formula_matches_launch_plan(shape):
    """ops.cuda_workspace_bytes (the documented formula) equals the workspace the CUDA
    launchers allocate (ops_host.h's plan), for both ops, dtypes, both kernel paths."""
    emu = _emu()
    B, Q, Hq, Hkv, D, S, bs, K = shape
    for op in ("verify_attention", "sparse_draft_attention"):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            for aligned in (True, False):
                for sms, smem in ((1, 233472), (108, 167936), (132, 233472), (132, 102400)):
                    got = ops.cuda_workspace_bytes(op, B, Q, Hq, Hkv, D, S, bs, K, dtype=dt, aligned=aligned,
                                                   num_sms=sms, smem_per_sm=smem)
                    want = emu.workspace_bytes(op, B, Q, Hq, Hkv, D, S, bs, K, dt, aligned, sms, 4, smem)
                    assert got == want, (op, dt, aligned, sms)


def test_workspace_llama3_8b_128k_batch32():
    """Llama-3-8B attention (32 query / 8 KV heads, head_dim 128), S = 128K, batch 32, Q = 7,
    bf16, 132 SMs (H100 / H200): at block size 1 the verification needs only its split
    partials (3 splits) -- 11.2 MB, where a [Q, S] probability buffer would take 3.76 GB."""
    B, Q, Hq, Hkv, D, S = 32, 7, 32, 8, 128, 131072
    R = Q * Hq // Hkv
    n = ops.cuda_workspace_bytes("verify_attention", B, Q, Hq, Hkv, D, S, 1, num_sms=132)
    assert n == 4 * B * Hkv * R * (3 * (D + 2) + 1) == 11_210_752
    dense = 4 * B * Hq * Q * S
    assert n < dense / 300
    n16 = ops.cuda_workspace_bytes("verify_attention", B, Q, Hq, Hkv, D, S, 16, num_sms=132)
    assert n16 == n + 4 * B * Hkv * R * (S // 16) == 246_091_776  # 1-slot per 16-token step
    nd = ops.cuda_workspace_bytes("sparse_draft_attention", B, 1, Hq, Hkv, D, S, 1, 6554, num_sms=132)
    assert nd == 4 * B * Hkv * 4 * (3 * (D + 2) + 1)


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
    (1, 7, 32, 8, 128, 32768, 1),  # batch 1, Llama-3-8B heads: ~47 splits per KV head (one wave)
    (2, 7, 28, 4, 128, 20000, 20),  # GQA 7, slots, ragged, block size not dividing S
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
@pytest.mark.parametrize("case", TOPK_CASES + [(2, 8, 131072, 6554, 4), (3, 2, 5000, 5000, 0),
                                               (1, 8, 32768, 1639, 1)], ids=str)
@pytest.mark.parametrize("recent", [0, 32])
def test_block_topk_matches_reference(case, kind, recent):
    s, k, nc, max_k, sinks = _topk_args(case, kind)
    got = torch.ops.vegas.block_topk(s.to(CUDA), k.to(CUDA), nc.to(CUDA), max_k, sinks, recent)
    want = reference.block_topk(s, k, nc, max_k, sinks, recent)
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
def test_cuda_bad_values_raise_with_value_checks(monkeypatch):
    monkeypatch.setenv("VEGAS_CUDA_VALUE_CHECKS", "1")
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
def test_cuda_bad_values_poison_rows_by_default(monkeypatch):
    monkeypatch.delenv("VEGAS_CUDA_VALUE_CHECKS", raising=False)
    q, k, v, lens = (t.to(CUDA) for t in _guard_inputs())
    out, lse, bsc = torch.ops.vegas.verify_attention(q, k, v, lens, 1, 0.125, None)
    assert torch.isnan(out[:2]).all() and torch.isnan(lse[:2]).all() and torch.isnan(bsc[:2]).all()
    want = reference.verify_attention(q[2:], k[2:], v[2:], lens[2:], 1, 0.125)
    assert max_err(out[2:], want[0]) <= 2e-2 and max_err(bsc[2:], want[2]) <= 1e-3


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


def _decode_step_setup(layers=3, B=2, Hq=8, Hkv=2, D=64, S=1024, bs=1, gamma=3, K=12, dtype=torch.bfloat16):
    """State of an op-level Vegas decode step on static buffers (a KV cache per layer,
    lengths, the selection of the last verification) and the step itself: gamma draft
    steps over every layer, each writing its token's K/V at device-side positions, then
    the verification of gamma + 1 queries over every layer with block scores and the
    top-k selection for the next round -- what a decode loop runs per iteration."""
    g = torch.Generator().manual_seed(7)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(CUDA)  # noqa: E731
    st = dict(
        k=[rnd(B, Hkv, S, D) for _ in range(layers)], v=[rnd(B, Hkv, S, D) for _ in range(layers)],
        qd=rnd(gamma, layers, B, 1, Hq, D), kd=rnd(gamma, layers, B, Hkv, 1, D), vd=rnd(gamma, layers, B, Hkv, 1, D),
        qv=rnd(layers, B, gamma + 1, Hq, D),
        lens=torch.tensor([S // 2, S - gamma - 5], dtype=torch.int32, device=CUDA),
        idx=torch.stack([torch.randperm((S // 2 - 8) // bs, generator=g)[:K].sort().values
                         for _ in range(B * Hkv)]).int().view(B, Hkv, K).to(CUDA),
    )
    scale = D ** -0.5

    def step():
        lens, tail = st["lens"], st["lens"] - 1
        outs = []
        for i in range(gamma):
            pos = (lens + i).long().view(B, 1, 1, 1).expand(B, Hkv, 1, D)
            for l in range(layers):
                st["k"][l].scatter_(2, pos, st["kd"][i, l])
                st["v"][l].scatter_(2, pos, st["vd"][i, l])
                outs.append(torch.ops.vegas.sparse_draft_attention(
                    st["qd"][i, l], st["k"][l], st["v"][l], st["idx"], tail, lens + i + 1, bs, scale))
        vlens = lens + gamma  # the verification sees the gamma drafts and the last accepted token
        scores = []
        for l in range(layers):
            out, lse, bsc = torch.ops.vegas.verify_attention(st["qv"][l], st["k"][l], st["v"][l], vlens, bs, scale,
                                                             None)
            outs += [out, lse]
            scores.append(bsc)
        sc = torch.stack(scores).sum(0)
        kt = torch.full((B,), K, dtype=torch.int32, device=CUDA)
        ncand = torch.div(vlens - gamma - 1, bs, rounding_mode="floor").to(torch.int32)
        st["idx"].copy_(torch.ops.vegas.block_topk(sc, kt, ncand, K, 1))
        outs.append(st["idx"].clone())
        return outs

    return st, step


@gpu
@pytest.mark.parametrize("bs", [1, 16])
def test_cuda_graph_whole_decode_step(bs, monkeypatch):
    """A whole decode step (drafts + verification + selection, 3 layers) captured in one
    CUDA graph and replayed equals eager execution bitwise; the eager step makes no host
    sync (torch's sync debug mode raises on any)."""
    monkeypatch.delenv("VEGAS_CUDA_VALUE_CHECKS", raising=False)
    st, step = _decode_step_setup(bs=bs)
    init = {n: ([t.clone() for t in st[n]] if isinstance(st[n], list) else st[n].clone()) for n in ("k", "v", "idx")}

    def restore():
        for n, t in init.items():
            if isinstance(t, list):
                for a, b in zip(st[n], t):
                    a.copy_(b)
            else:
                st[n].copy_(t)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    restore()
    graph.replay()
    replayed = [t.clone() for t in static]
    restore()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert len(eager) == len(replayed)
    for a, b in zip(replayed, eager):
        assert torch.equal(a, b) if a.dtype == torch.int32 else torch.equal(a.nan_to_num(), b.nan_to_num())


@gpu
def test_cuda_value_checks_flag_is_the_only_sync(monkeypatch):
    """The sync detector works: with VEGAS_CUDA_VALUE_CHECKS=1 the same ops do sync."""
    monkeypatch.setenv("VEGAS_CUDA_VALUE_CHECKS", "1")
    q, k, v, lens = make_inputs(2, 3, 8, 2, 64, 100, torch.bfloat16, device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.ops.vegas.verify_attention(q, k, v, lens, 16, 0.125, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
@pytest.mark.parametrize("bs", [1, 16])
def test_cuda_workspace_matches_formula(bs):
    """Peak of the bytes requested from the caching allocator during one verify / draft
    call, minus its outputs, equals ops.cuda_workspace_bytes."""
    B, Q, Hq, Hkv, D, S, K = 4, 7, 32, 8, 128, 8192, 64
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, torch.bfloat16, device=CUDA)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    idx = random_selection(B, Hkv, -(-S // bs), K).to(CUDA)
    tail = (lens - 1).to(torch.int32)
    q1 = q[:, :1].contiguous()
    for op, call, _outs in (
        ("verify_attention", lambda: torch.ops.vegas.verify_attention(q, k, v, lens, bs, D ** -0.5, None), 3),
        ("sparse_draft_attention",
         lambda: torch.ops.vegas.sparse_draft_attention(q1, k, v, idx, tail, lens, bs, D ** -0.5), 1),
    ):
        call()
        torch.cuda.synchronize()
        base = torch.cuda.memory_stats()["requested_bytes.all.current"]
        torch.cuda.reset_peak_memory_stats()
        res = call()
        torch.cuda.synchronize()
        res = res if isinstance(res, tuple) else (res,)
        out_bytes = sum(t.numel() * t.element_size() for t in res)
        measured = torch.cuda.memory_stats()["requested_bytes.all.peak"] - base - out_bytes
        Qo = Q if op == "verify_attention" else 1
        want = ops.cuda_workspace_bytes(op, B, Qo, Hq, Hkv, D, S, bs, K, num_sms=sms, smem_per_sm=smem)
        assert measured == want, (op, measured, want)
