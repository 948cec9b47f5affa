"""vegas::verify_attention (CPU kernel) against the PyTorch reference."""
import math

import pytest
import torch

from op_utils import ATTN_SHAPES, assert_verify_matches, make_inputs, max_err, shape_id, verify_case
from vegas_ext import ops, reference

SHAPES = ATTN_SHAPES
DTYPES = [torch.float32, torch.bfloat16]


def _run(shape, dtype, query_weights=None, seed=0):
    return verify_case(shape, dtype, query_weights=query_weights, seed=seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_matches_reference(shape, dtype):
    assert_verify_matches(shape, dtype, _run(shape, dtype))


@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3], SHAPES[4]], ids=str)
def test_block_scores_sum_to_heads_times_weights(shape):
    B, Q, Hq, Hkv, D, S, bs = shape
    w = torch.rand(Q) + 0.25
    (_, _, _, lens, _), (_, _, bsc), _ = _run(shape, torch.float32, query_weights=w)
    want = (Hq // Hkv) * w.sum().item()
    torch.testing.assert_close(bsc.sum(-1), torch.full((B, Hkv), want), rtol=1e-5, atol=1e-5)
    # blocks past each row's length are exactly zero
    for b in range(B):
        first_dead = math.ceil(int(lens[b]) / bs)
        assert bool((bsc[b, :, first_dead:] == 0).all())


def test_query_weights_select_queries():
    """first/last weighting (the authors' choice) equals the reference's."""
    shape = (2, 7, 9, 3, 64, 300, 16)
    w = torch.zeros(7)
    w[0] = w[-1] = 1.0
    _, (out, _, bsc), (out_r, _, bsc_r) = _run(shape, torch.float32, query_weights=w)
    assert max_err(bsc, bsc_r) < 1e-5
    assert max_err(out, out_r) < 1e-5


def test_fp16_large_magnitude_stays_finite():
    """q.k past 65504 before scaling: fp32 accumulation keeps outputs finite and accurate."""
    B, Q, Hq, Hkv, D, S, bs = 2, 4, 8, 2, 64, 200, 16
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, torch.float16, magnitude=60.0)
    assert (q.float()[0, 0, 0] @ k.float()[0, 0].T).abs().max() > 65504
    scale = D ** -0.5
    out, lse, bsc = torch.ops.vegas.verify_attention(q, k, v, lens, bs, scale, None)
    out_r, lse_r, bsc_r = reference.verify_attention(q, k, v, lens, bs, scale)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all() and torch.isfinite(bsc).all()
    assert max_err(out, out_r) < 2e-2
    assert max_err(lse, lse_r) < 1e-3 * lse_r.abs().max().item()
    assert max_err(bsc, bsc_r) < 1e-3


def test_noncontiguous_q_and_strided_cache():
    """q transposed from [B, H, Q, D] (as HF produces it) and a cache slice of a longer buffer."""
    B, Q, Hq, Hkv, D, S, bs = 2, 3, 8, 2, 64, 100, 16
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S + 20, torch.float32)
    lens = lens.clamp(max=S)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous view
    ks, vs = k[:, :, :S], v[:, :, :S]  # strided in the token dim of a longer buffer
    out, lse, bsc = torch.ops.vegas.verify_attention(qt, ks, vs, lens, bs, D ** -0.5, None)
    out_r, lse_r, bsc_r = reference.verify_attention(q, ks, vs, lens, bs, D ** -0.5)
    assert max_err(out, out_r) < 1e-5 and max_err(bsc, bsc_r) < 1e-5


def test_wrapper_uses_kernel_on_cpu():
    assert ops.has_compiled_kernel("verify_attention", "cpu")
    shape = (2, 7, 9, 3, 64, 300, 16)
    B, Q, Hq, Hkv, D, S, bs = shape
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, torch.float32)
    a = ops.verify_attention(q, k, v, lens, bs, D ** -0.5)
    b = torch.ops.vegas.verify_attention(q, k, v, lens, bs, D ** -0.5, None)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
