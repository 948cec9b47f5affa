"""The compiled CUDA kernel of vegas::paged_verify_attention on a GPU (skipped cleanly without
one): against the reference on odd shapes and the three cache layouts, opcheck, value checks,
CUDA-graph capture and no host sync. The emulated kernel is tested in test_paged_verify_attention.py."""
import pytest
import torch
from test_paged_verify_attention import CASES, EMU_CASES, _case

from vegas_ext import ops, reference

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ERR = (RuntimeError, ValueError)
# Output: fp32 math on both sides, inputs rounded to the dtype; bf16 outputs round once more.
OUT_TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
SCORE_TOL = 5e-5


def _cuda_op_or_skip():
    if not torch._C._dispatch_has_kernel_for_dispatch_key("vegas::paged_verify_attention", "CUDA"):
        pytest.skip("this build has no CUDA kernel of paged_verify_attention")
    return torch.ops.vegas.paged_verify_attention


GPU_CASES = EMU_CASES + CASES + [
    ([1] * 64, [17 + 31 * i for i in range(64)], 32, 8, 128, 16),  # a decode batch
    ([7] * 16, [8192 + 97 * i for i in range(16)], 32, 8, 128, 16),  # 16 requests verifying 6 drafts at 8K
]


@gpu
@pytest.mark.parametrize("layout", ["flash", "dense", "cpu_vec"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"R{len(c[0])}S{max(c[1])}H{c[2]}-{c[3]}D{c[4]}ps{c[5]}")
def test_gpu_matches_reference(case, dtype, layout):
    op = _cuda_op_or_skip()
    q_lens, seq_lens, Hq, Hkv, D, ps = case
    args = [t.cuda() for t in _case(q_lens, seq_lens, Hq, Hkv, D, ps, dtype, layout=layout)]
    for nq in (1, 7):
        out, sc = op(*args, nq, D ** -0.5)
        want_out, want_sc = reference.paged_verify_attention(*args, nq, D ** -0.5)
        assert out.dtype == dtype and sc.dtype == torch.float32
        torch.testing.assert_close(out, want_out, atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])
        torch.testing.assert_close(sc, want_sc, atol=SCORE_TOL, rtol=1e-4)


@gpu
def test_gpu_opcheck_and_value_checks(monkeypatch):
    op = _cuda_op_or_skip()
    q, kc, vc, bt, lens, qsl = (t.cuda() for t in _case([3, 2], [70, 40], 9, 3, 64, 32, torch.bfloat16,
                                                           layout="flash"))
    torch.library.opcheck(torch.ops.vegas.paged_verify_attention.default, (q, kc, vc, bt, lens, qsl, 4, 0.125))
    monkeypatch.setattr(ops, "_CUDA_ENABLED", True)
    got = ops.paged_verify_attention(q, kc, vc, bt, lens, qsl, 4, 0.125)
    want = reference.paged_verify_attention(q, kc, vc, bt, lens, qsl, 4, 0.125)
    torch.testing.assert_close(got[0], want[0], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got[1], want[1], atol=SCORE_TOL, rtol=1e-4)
    monkeypatch.setenv("VEGAS_CUDA_VALUE_CHECKS", "1")
    with pytest.raises(ERR, match="block_table"):
        op(q, kc, vc, torch.full_like(bt, kc.shape[0]), lens, qsl, 4, 0.125)
    with pytest.raises(ERR, match="seq_lens"):
        op(q, kc, vc, bt, torch.tensor([2, 40], dtype=torch.int32, device="cuda"), qsl, 4, 0.125)


@gpu
def test_gpu_graph_capture_and_no_host_sync():
    op = _cuda_op_or_skip()
    case = _case([5, 1, 3], [300, 40, 129], 8, 2, 128, 16, torch.bfloat16, seed=7, layout="flash")
    q, kc, vc, bt, lens, qsl = (t.cuda() for t in case)
    want = reference.paged_verify_attention(q, kc, vc, bt, lens, qsl, 5, 0.1)
    op(q, kc, vc, bt, lens, qsl, 5, 0.1)  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = op(q, kc, vc, bt, lens, qsl, 5, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out[1], want[1], atol=SCORE_TOL, rtol=1e-4)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g):
        static = op(q, kc, vc, bt, lens, qsl, 5, 0.1)
    torch.cuda.current_stream().wait_stream(s)
    lens2 = lens.clone()
    lens2[0] = 250  # new lengths, same graph
    lens.copy_(lens2)
    g.replay()
    torch.cuda.synchronize()
    want2 = reference.paged_verify_attention(q, kc, vc, bt, lens2, qsl, 5, 0.1)
    torch.testing.assert_close(static[0], want2[0], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(static[1], want2[1], atol=SCORE_TOL, rtol=1e-4)
