"""The CUDA kernel of vegas::paged_block_scores (csrc/cuda/paged_block_scores_kernel.cuh).

* ``test_emulated_*`` / ``test_plan_*`` -- no GPU needed: the kernel source compiled as host C++
  against the software emulation (tests/cuda_emu.py, the same host logic ops_host.h as the CUDA
  launcher), compared with reference.paged_block_scores on odd shapes (GQA 1/3/4, D 20/64/80/128,
  page sizes 7/16/32, ragged seq_lens ending mid-page, num_queries 1 and > q_len, requests
  without queries), fp32/bf16/fp16, the three key-cache layouts (16-byte loads and the strided
  path), short chunks (many CTAs per request) and the default; the device-side guards; no
  device-to-host copy unless value checks are asked for. Evidence of correct indexing and
  numerics, not a substitute for hardware. VEGAS_SKIP_EMULATOR=1 skips them.
* ``test_gpu_*`` -- need a CUDA device (skipped cleanly without one): the compiled CUDA op
  against the reference, opcheck, value checks, CUDA-graph capture, no host sync.
"""
import pytest
import torch

from vegas_ext import ops, reference

from cuda_emu import load_emulator
from test_paged_block_scores import _paged_case

HAS_GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
ERR = (RuntimeError, ValueError)

# Same inputs (rounded to the dtype) on both sides and fp32 math on both: the differences are
# the summation order and exp2 vs exp. Bounds ~30x the largest error measured in the
# emulation (7e-7 for every dtype), leaving room for the GPU's approximate exp2f / log2f.
TOL = {torch.float32: 2e-5, torch.bfloat16: 5e-5, torch.float16: 5e-5}

EMU_CASES = [
    # (q_lens, seq_lens, Hq, Hkv, D, page_size)
    ([7], [300], 9, 3, 64, 32),                 # GQA 3, mid-page end
    ([1, 5, 3], [33, 161, 64], 8, 2, 80, 16),   # GQA 4, D 80, a page-aligned request
    ([4, 0, 2], [77, 50, 9], 4, 4, 128, 16),    # GQA 1, a request without queries
    ([3, 6], [45, 100], 6, 2, 20, 7),           # D not a multiple of 8, odd page size
    ([12, 1], [12, 2], 4, 1, 64, 32),           # a whole prefill (12 * 4 = 48 rows: 2 passes), GQA 4
]


def _emu_call(emu, q, kc, bt, lens, qsl, nq, scale, chunk_tokens=512, sms=4, checks=0):
    return emu.paged_block_scores(q, kc, bt, lens, qsl, nq, scale, chunk_tokens, sms, checks)


def _check_rows(got, q_lens, seq_lens, Hkv, G, ps, nq):
    for r, (ql, L) in enumerate(zip(q_lens, seq_lens)):
        torch.testing.assert_close(got[r].sum(-1), torch.full((Hkv,), float(G * min(ql, nq))), atol=1e-3, rtol=1e-4)
        assert torch.all(got[r, :, -(-L // ps):] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", EMU_CASES, ids=lambda c: f"R{len(c[0])}S{max(c[1])}H{c[2]}-{c[3]}D{c[4]}ps{c[5]}")
def test_emulated_matches_reference(case, dtype):
    """Flash layout (vLLM's CUDA cache), short chunks: several CTAs per request."""
    emu = load_emulator()
    q_lens, seq_lens, Hq, Hkv, D, ps = case
    q, kc, bt, lens, qsl = _paged_case(q_lens, seq_lens, Hq, Hkv, D, ps, dtype, layout="flash")
    for nq in (1, 5, 64):  # 64 > every q_len: all queries scored
        got = _emu_call(emu, q, kc, bt, lens, qsl, nq, D ** -0.5, chunk_tokens=40)
        want = reference.paged_block_scores(q, kc, bt, lens, qsl, nq, D ** -0.5)
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=1e-4)
        _check_rows(got, q_lens, seq_lens, Hkv, Hq // Hkv, ps, nq)


@pytest.mark.parametrize("layout", ["cpu", "cpu_vec"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [EMU_CASES[0], EMU_CASES[3]], ids=["ps32", "D20ps7"])
def test_emulated_other_layouts(case, dtype, layout):
    """The K half of a [NP, H_kv, 2 * ps, D] cache and vLLM's CPU layout (keys [D, ps] per page:
    the strided loads), default chunks (one per request here)."""
    emu = load_emulator()
    q_lens, seq_lens, Hq, Hkv, D, ps = case
    q, kc, bt, lens, qsl = _paged_case(q_lens, seq_lens, Hq, Hkv, D, ps, dtype, layout=layout)
    got = _emu_call(emu, q, kc, bt, lens, qsl, 5, D ** -0.5)
    torch.testing.assert_close(got, reference.paged_block_scores(q, kc, bt, lens, qsl, 5, D ** -0.5), atol=TOL[dtype],
                               rtol=1e-4)
    _check_rows(got, q_lens, seq_lens, Hkv, Hq // Hkv, ps, 5)


def test_emulated_flash_attn_kv_layout():
    """vegas_ext.vllm.backend_flash's cache: [num_blocks, H_kv, block_size, 2 * D], keys in the first D."""
    emu = load_emulator()
    q, kc, bt, lens, qsl = _paged_case([4, 1], [70, 33], 8, 2, 64, 16, torch.bfloat16, seed=9)
    kv = torch.randn(kc.shape[0], 2, 16, 128).bfloat16()
    kv[..., :64] = kc
    view = kv[..., :64]
    assert emu.paged_plan(q, view, bt, 4, 512)[5] is True
    torch.testing.assert_close(_emu_call(emu, q, view, bt, lens, qsl, 4, 0.125, 48),
                               reference.paged_block_scores(q, kc, bt, lens, qsl, 4, 0.125), atol=5e-5, rtol=1e-4)


def test_emulated_key_load_paths():
    """The flash / K-half layouts take the 16-byte loads, vLLM's CPU layout and D = 20 the strided ones."""
    emu = load_emulator()
    for layout, D, vec in (("flash", 64, True), ("cpu", 64, True), ("cpu_vec", 64, False), ("flash", 20, False)):
        q, kc, bt, lens, qsl = _paged_case([2], [40], 4, 2, D, 16, torch.bfloat16, layout=layout)
        assert emu.paged_plan(q, kc, bt, 5, 512)[5] is vec, (layout, D)
    # a misaligned view (page stride not a multiple of 8 elements) falls back to the strided path
    q, kc, bt, lens, qsl = _paged_case([2], [40], 4, 2, 64, 16, torch.bfloat16, layout="flash")
    base = torch.randn(kc.numel() + 1).bfloat16()
    mis = base[1:].view(kc.shape[0], kc.shape[2], kc.shape[1], kc.shape[3]).transpose(1, 2)
    assert emu.paged_plan(q, mis, bt, 5, 512)[5] is False
    torch.testing.assert_close(_emu_call(emu, q, mis, bt, lens, qsl, 2, 0.125),
                               reference.paged_block_scores(q, mis, bt, lens, qsl, 2, 0.125), atol=5e-5, rtol=1e-4)


def test_emulated_strided_queries_and_long_rows():
    """Non-contiguous q, many rows (3 passes of 32), chunks that cut 128-token tiles mid-page."""
    emu = load_emulator()
    q, kc, bt, lens, qsl = _paged_case([9, 4], [500, 70], 12, 3, 64, 16, torch.float32, seed=4)
    q_nc = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2])[:, :, ::2]
    q_nc.copy_(q)
    assert not q_nc.is_contiguous()
    for chunk in (100, 4096):
        got = _emu_call(emu, q_nc, kc, bt, lens, qsl, 9, 0.125, chunk)
        torch.testing.assert_close(got, reference.paged_block_scores(q, kc, bt, lens, qsl, 9, 0.125), atol=2e-5,
                                   rtol=1e-4)


def test_emulated_equals_cpu_kernel():
    emu = load_emulator()
    q, kc, bt, lens, qsl = _paged_case([2, 7, 1], [45, 300, 129], 8, 2, 64, 32, torch.bfloat16, seed=5)
    torch.testing.assert_close(_emu_call(emu, q, kc, bt, lens, qsl, 7, 0.125, 64),
                               torch.ops.vegas.paged_block_scores(q, kc, bt, lens, qsl, 7, 0.125), atol=5e-5, rtol=1e-4)


def test_emulated_empty_and_degenerate():
    emu = load_emulator()
    q, kc, bt, lens, qsl = _paged_case([3], [40], 4, 2, 64, 16, torch.float32)
    # no requests; no page columns
    e = _emu_call(emu, q, kc, bt[:0], lens[:0], qsl[:1], 3, 0.125)
    assert e.shape == (0, 2, bt.shape[1])
    z = torch.ops.vegas.paged_block_scores(q[:0], kc, torch.zeros(2, 0, dtype=torch.int32),
                                           torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 3,
                                           0.125)
    ze = _emu_call(emu, q[:0], kc, torch.zeros(2, 0, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                   torch.zeros(3, dtype=torch.int32), 3, 0.125)
    assert ze.shape == z.shape == (2, 2, 0)
    # T = 0 (no queries at all) with seq_lens > 0: zeros
    out = _emu_call(emu, q[:0], kc, bt, lens, torch.zeros(2, dtype=torch.int32), 3, 0.125)
    assert torch.all(out == 0)


def test_emulated_device_guards():
    """Without host value checks: an out-of-range request gets NaN pages, the others are exact;
    a page id outside the cache is never read and poisons only that request's rows."""
    emu = load_emulator()
    q, kc, bt, lens, qsl = _paged_case([2, 3, 1], [40, 90, 20], 4, 2, 64, 16, torch.float32, seed=2)
    want = reference.paged_block_scores(q, kc, bt, lens, qsl, 3, 0.125)
    bad_lens = lens.clone()
    bad_lens[1] = bt.shape[1] * 16 + 1  # past max_pages * page_size
    got = _emu_call(emu, q, kc, bt, bad_lens, qsl, 3, 0.125, 32)
    assert torch.isnan(got[1]).all()
    torch.testing.assert_close(got[[0, 2]], want[[0, 2]], atol=2e-5, rtol=1e-4)
    bad_lens[1] = 1  # below q_len
    assert torch.isnan(_emu_call(emu, q, kc, bt, bad_lens, qsl, 3, 0.125)[1]).all()
    bad_qsl = qsl.clone()
    bad_qsl[3] = q.shape[0] + 5  # past T
    got = _emu_call(emu, q, kc, bt, lens, bad_qsl, 3, 0.125)
    assert torch.isnan(got[2]).all() and not torch.isnan(got[:2]).any()
    bad_bt = bt.clone()
    bad_bt[0, 1] = kc.shape[0] + 1000
    bad_bt[2, 0] = -7
    got = _emu_call(emu, q, kc, bad_bt, lens, qsl, 3, 0.125)
    assert torch.isnan(got[0, :, :3]).all() and torch.isnan(got[2, :, :2]).all()
    torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=1e-4)
    # entries past a request's pages (and all of a request without queries) are never read
    q2, kc2, bt2, lens2, qsl2 = _paged_case([2, 0], [40, 30], 4, 2, 64, 16, torch.float32, seed=2)
    bt2[0, 3:] = 10 ** 6
    bt2[1, :] = -1
    torch.testing.assert_close(_emu_call(emu, q2, kc2, bt2, lens2, qsl2, 2, 0.125),
                               reference.paged_block_scores(q2, kc2, bt2.clamp(0, kc2.shape[0] - 1), lens2, qsl2, 2,
                                                            0.125),
                               atol=2e-5, rtol=1e-4)


def test_emulated_value_checks_and_host_copies(monkeypatch):
    """checks=1: the CPU kernel's messages; default (-1, VEGAS_CUDA_VALUE_CHECKS unset): no copy."""
    emu = load_emulator()
    monkeypatch.delenv("VEGAS_CUDA_VALUE_CHECKS", raising=False)
    q, kc, bt, lens, qsl = _paged_case([3], [70], 9, 3, 64, 32, torch.float32)
    n0 = emu.host_copies()
    _emu_call(emu, q, kc, bt, lens, qsl, 3, 0.125, checks=-1)
    assert emu.host_copies() == n0
    _emu_call(emu, q, kc, bt, lens, qsl, 3, 0.125, checks=1)
    assert emu.host_copies() == n0 + 3
    monkeypatch.setenv("VEGAS_CUDA_VALUE_CHECKS", "1")
    _emu_call(emu, q, kc, bt, lens, qsl, 3, 0.125, checks=-1)
    assert emu.host_copies() == n0 + 6
    for args, word in (
        ((q, kc, bt, torch.tensor([2], dtype=torch.int32), qsl), "seq_lens"),
        ((q, kc, bt, torch.tensor([1000], dtype=torch.int32), qsl), "seq_lens"),
        ((q, kc, torch.full_like(bt, kc.shape[0]), lens, qsl), "block_table"),
        ((q, kc, bt, lens, torch.tensor([0, 5], dtype=torch.int32)), "query_start_loc"),
        ((q, kc, bt, lens, torch.tensor([1, 3], dtype=torch.int32)), "query_start_loc"),
    ):
        with pytest.raises(ERR, match=word):
            _emu_call(emu, *args, 3, 0.125, checks=1)
        with pytest.raises(ERR, match=word):
            torch.ops.vegas.paged_block_scores(*args, 3, 0.125)


def test_emulated_shape_checks():
    emu = load_emulator()
    q, kc, bt, lens, qsl = _paged_case([3], [70], 9, 3, 64, 32, torch.float32)
    for bad, word in (
        ((q, kc, bt, lens, qsl, 0, 0.125), "num_queries"),
        ((q, kc, bt, lens, qsl, 3, -1.0), "scale"),
        ((q[:, :8], kc, bt, lens, qsl, 3, 0.125), "H_q"),
        ((q.bfloat16(), kc, bt, lens, qsl, 3, 0.125), "dtype"),
        ((q, kc, bt.long(), lens, qsl, 3, 0.125), "int32"),
        ((q[..., :32], kc, bt, lens, qsl, 3, 0.125), "head_dim"),
    ):
        with pytest.raises(ERR, match=word):
            emu.paged_block_scores(*bad, 512, 4, 0)
    big = torch.zeros(1, 1, 300)
    with pytest.raises(ERR, match="head_dim must be <= 256"):
        emu.paged_block_scores(big, torch.zeros(1, 1, 4, 300), torch.zeros(1, 1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1, 0.1, 512,
                               4, 0)


@pytest.mark.parametrize("R,Hkv,P,ps", [(1, 1, 1, 16), (1, 8, 8192, 16), (256, 8, 8192, 16), (3, 2, 50, 7),
                                        (2, 2, 3, 100000)])
def test_plan_covers_every_page(R, Hkv, P, ps):
    emu = load_emulator()
    T, Hq, nq = 40, 4 * Hkv, 5
    q = torch.zeros(T, Hq, 8)
    kc = torch.zeros(1, Hkv, 1, 8).expand(1, Hkv, ps, 8)
    bt = torch.zeros(R, P, dtype=torch.int32)
    ppc, nchunks, rows_cap, rpt, ws, _ = emu.paged_plan(q, kc, bt, nq, 512)
    assert nchunks * ppc >= P and (nchunks - 1) * ppc < P  # every page, once
    assert 1 <= ppc <= 2048 and nchunks <= 65535
    assert rows_cap == 5 * 4 and rpt == 32
    assert R * Hkv * nchunks <= max(16384, R * Hkv * -(-P // 2048))
    assert ws == 2 * 4 * R * Hkv * rows_cap * nchunks


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
def _cuda_op_or_skip():
    if not torch._C._dispatch_has_kernel_for_dispatch_key("vegas::paged_block_scores", "CUDA"):
        pytest.skip("this build has no CUDA kernel of paged_block_scores")
    return torch.ops.vegas.paged_block_scores


GPU_CASES = EMU_CASES + [
    ([1, 7, 3, 5], [33, 1000, 64, 129], 8, 2, 64, 32),
    ([7, 7], [4100, 257], 32, 8, 128, 128),
    ([1] * 64, [17 + 31 * i for i in range(64)], 32, 8, 128, 16),  # a decode batch
]


@gpu
@pytest.mark.parametrize("layout", ["flash", "cpu", "cpu_vec"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"R{len(c[0])}S{max(c[1])}H{c[2]}-{c[3]}D{c[4]}ps{c[5]}")
def test_gpu_matches_reference(case, dtype, layout):
    op = _cuda_op_or_skip()
    q_lens, seq_lens, Hq, Hkv, D, ps = case
    q, kc, bt, lens, qsl = _paged_case(q_lens, seq_lens, Hq, Hkv, D, ps, dtype, layout=layout)
    q, kc, bt, lens, qsl = (t.cuda() for t in (q, kc, bt, lens, qsl))
    for nq in (1, 5, 64):
        got = op(q, kc, bt, lens, qsl, nq, D ** -0.5)
        want = reference.paged_block_scores(q, kc, bt, lens, qsl, nq, D ** -0.5)
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=1e-4)
        _check_rows(got.cpu(), q_lens, seq_lens, Hkv, Hq // Hkv, ps, nq)


@gpu
def test_gpu_wrapper_opcheck_and_value_checks(monkeypatch):
    op = _cuda_op_or_skip()
    q, kc, bt, lens, qsl = (t.cuda() for t in _paged_case([3, 2], [70, 40], 9, 3, 64, 32, torch.bfloat16))
    torch.library.opcheck(torch.ops.vegas.paged_block_scores.default, (q, kc, bt, lens, qsl, 4, 0.125))
    monkeypatch.setattr(ops, "_CUDA_ENABLED", True)
    torch.testing.assert_close(ops.paged_block_scores(q, kc, bt, lens, qsl, 4, 0.125),
                               reference.paged_block_scores(q, kc, bt, lens, qsl, 4, 0.125), atol=5e-5, rtol=1e-4)
    monkeypatch.setenv("VEGAS_CUDA_VALUE_CHECKS", "1")
    with pytest.raises(ERR, match="block_table"):
        op(q, kc, torch.full_like(bt, kc.shape[0]), lens, qsl, 4, 0.125)
    with pytest.raises(ERR, match="seq_lens"):
        op(q, kc, bt, torch.tensor([2, 40], dtype=torch.int32, device="cuda"), qsl, 4, 0.125)
    monkeypatch.delenv("VEGAS_CUDA_VALUE_CHECKS")
    bad = bt.clone()
    bad[0, 0] = 10 ** 6  # no host check: NaN on that request's pages (zero past its length), no fault
    got = op(q, kc, bad, lens, qsl, 4, 0.125)
    torch.cuda.synchronize()
    npg = -(-70 // 32)
    assert torch.isnan(got[0, :, :npg]).all() and (got[0, :, npg:] == 0).all(), got[0]
    assert not torch.isnan(got[1]).any()


@gpu
def test_gpu_graph_capture_and_no_host_sync():
    op = _cuda_op_or_skip()
    case = _paged_case([5, 1, 3], [300, 40, 129], 8, 2, 128, 16, torch.bfloat16, seed=7)
    q, kc, bt, lens, qsl = (t.cuda() for t in case)
    want = reference.paged_block_scores(q, kc, bt, lens, qsl, 5, 0.1)
    op(q, kc, bt, lens, qsl, 5, 0.1)  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = op(q, kc, bt, lens, qsl, 5, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out, want, atol=5e-5, rtol=1e-4)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g):
        static = op(q, kc, bt, lens, qsl, 5, 0.1)
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static, want, atol=5e-5, rtol=1e-4)
    lens2 = lens.clone()
    lens2[0] = 250  # new lengths, same graph
    lens.copy_(lens2)
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static, reference.paged_block_scores(q, kc, bt, lens2, qsl, 5, 0.1), atol=5e-5,
                               rtol=1e-4)
