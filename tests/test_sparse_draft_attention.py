"""vegas::sparse_draft_attention (CPU kernel) against the PyTorch reference."""
import math

import pytest
import torch

from vegas_ext import reference

from op_utils import ATTN_SHAPES, make_inputs, max_err, out_error_bound, random_selection

# the shared odd shapes, plus the SmolLM2 head layout at Q = 1 (a plain draft step)
SHAPES = ATTN_SHAPES + [(2, 1, 9, 3, 64, 300, 16)]


def _tail(lens, Q, seed, max_back=40):
    g = torch.Generator().manual_seed(seed)
    back = torch.randint(0, max_back + 1, lens.shape, generator=g).int()
    return (lens - Q - back).clamp(min=0).int()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}Q{}Hq{}Hkv{}D{}S{}bs{}".format(*s))
def test_matches_reference(shape, dtype):
    B, Q, Hq, Hkv, D, S, bs = shape
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, dtype, seed=1)
    nb = math.ceil(S / bs)
    idx = random_selection(B, Hkv, nb, max(1, min(nb, 9)), seed=2)
    tail = _tail(lens, Q, 3)
    scale = D ** -0.5
    out = torch.ops.vegas.sparse_draft_attention(q, k, v, idx, tail, lens, bs, scale)
    want = reference.sparse_draft_attention(q, k, v, idx, tail, lens, bs, scale)
    assert out.shape == (B, Q, Hq, D) and out.dtype == dtype
    allowed = reference.draft_allowed_mask(q, k, idx, tail, lens, bs)
    assert max_err(out, want) <= out_error_bound(q, k, v, allowed, scale, dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_all_blocks_selected_equals_verify(shape):
    B, Q, Hq, Hkv, D, S, bs = shape
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, torch.float32, seed=4)
    nb = math.ceil(S / bs)
    g = torch.Generator().manual_seed(5)
    idx = torch.stack([torch.randperm(nb, generator=g) for _ in range(B * Hkv)]).view(B, Hkv, nb).int()
    tail = _tail(lens, Q, 6)
    scale = D ** -0.5
    draft = torch.ops.vegas.sparse_draft_attention(q, k, v, idx, tail, lens, bs, scale)
    full, _, _ = torch.ops.vegas.verify_attention(q, k, v, lens, bs, scale, None)
    assert max_err(draft, full) < 2e-5


def test_no_blocks_attends_to_tail_only():
    B, Q, Hq, Hkv, D, S, bs = 2, 2, 8, 2, 64, 120, 16
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, torch.float32, seed=7)
    idx = torch.full((B, Hkv, 4), -1, dtype=torch.int32)
    tail = (lens - Q - 5).clamp(min=0).int()
    out = torch.ops.vegas.sparse_draft_attention(q, k, v, idx, tail, lens, bs, D ** -0.5)
    # dense attention over only the tail, by slicing
    for b in range(B):
        t0, L = int(tail[b]), int(lens[b])
        sub_lens = torch.tensor([L - t0], dtype=torch.int32)
        o, _, _ = reference.verify_attention(q[b : b + 1], k[b : b + 1, :, t0:L], v[b : b + 1, :, t0:L], sub_lens, 1,
                                             D ** -0.5)
        assert max_err(out[b : b + 1], o) < 1e-5


def test_block_straddling_tail_is_cut_at_tail_start():
    """Tokens of a selected block at or after tail_start count once (as tail), not twice."""
    B, Q, Hq, Hkv, D, S, bs = 1, 1, 4, 1, 64, 50, 16
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, torch.float32, seed=8)
    lens[:] = 50
    tail = torch.tensor([40], dtype=torch.int32)  # block 2 covers 32..47: 40..47 is tail
    idx = torch.tensor([[[2, 0]]], dtype=torch.int32)
    out = torch.ops.vegas.sparse_draft_attention(q, k, v, idx, tail, lens, bs, D ** -0.5)
    want = reference.sparse_draft_attention(q, k, v, idx, tail, lens, bs, D ** -0.5)
    assert max_err(out, want) < 1e-5


def test_fp16_large_magnitude_stays_finite():
    B, Q, Hq, Hkv, D, S, bs = 2, 1, 8, 2, 64, 200, 16
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, torch.float16, magnitude=60.0)
    idx = random_selection(B, Hkv, math.ceil(S / bs), 4, seed=9)
    tail = (lens - Q - 3).clamp(min=0).int()
    out = torch.ops.vegas.sparse_draft_attention(q, k, v, idx, tail, lens, bs, D ** -0.5)
    want = reference.sparse_draft_attention(q, k, v, idx, tail, lens, bs, D ** -0.5)
    assert torch.isfinite(out).all()
    assert max_err(out, want) < 2e-2
