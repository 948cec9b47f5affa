"""vegas::verify_attention (CPU kernel) against the PyTorch reference."""
import math

import pytest
import torch

from vegas_ext import ops, reference

from op_utils import ATTN_SHAPES, assert_verify_matches, make_inputs, max_err, run_with_isa, shape_id, verify_case

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


# Shapes at the edges of the main loop's blocking: rows live in vector lanes (8 or 16) and
# are blocked 6 at a time in P.V, head_dim in 16-float chunks (64 at a time with AVX-512),
# tokens in tiles of 64, several row vectors per score block (more than one block's worth
# at R = 128); with AVX-512, R <= 8 rows with R * D <= 384 take the tokens-in-lanes path (qk_few: 16 tokens per
# score vector, head_dim tails by masked loads, row-wise softmax); with AVX2, R <= 4 rows (8 tokens
# per score vector), and where R fills blocks of 3 row vectors (at most 1/5 padding) the P V
# accumulates transposed, 3 row vectors x 4 head_dim elements at a time, the remainder one by one.
# With AVX-512, 1 or 3 groups of 8 rows, and 2 groups at an even D, take the QK on head_dim pairs
# (pair_qk: 8 rows x 2 elements per vector, an odd D's last element in the even lanes only); 2 groups
# at an odd D and 5 groups keep rows in lanes.
EDGE_SHAPES = [
    (2, 1, 4, 1, 36, 150, 1),     # R = 4, D 36: AVX2's largest tokens-in-lanes R, a head_dim tail of 4
    (2, 5, 5, 5, 30, 140, 3),     # R = 5: AVX2's fewest rows in lanes; D 30: not a multiple of 4 or 8
    (2, 7, 9, 3, 64, 333, 1),     # R = 21 of 24 lanes: AVX2's transposed P V (SmolLM2 verifying 6 drafts)
    (1, 5, 9, 1, 38, 150, 4),     # R = 45 of 48: two transposed P V blocks, D 38 = 9 x 4 + 2 single
    (3, 2, 8, 2, 40, 77, 1),      # R = 8, the most rows of the tokens-in-lanes path; D 40 = 32 + 8
    (2, 3, 9, 3, 64, 100, 1),     # R = 9, the fewest rows of the rows-in-lanes path
    (2, 1, 6, 2, 128, 300, 1),    # R = 3, D 128: the tokens-in-lanes path's largest R * D (384)
    (2, 2, 16, 4, 128, 100, 1),   # R = 8, D 128: R * D above it, rows in lanes
    (2, 5, 7, 1, 80, 333, 1),     # R = 35: not a multiple of 6, 8 or 16; D 80 = 64 + 16
    (1, 3, 10, 5, 72, 200, 16),   # R = 6, D 72: a head_dim tail below one vector
    (2, 16, 8, 1, 64, 150, 7),    # R = 128: several score blocks of row vectors
    (3, 9, 9, 3, 40, 129, 1),     # R = 27, D 40, S one past two tiles
    (1, 1, 32, 8, 128, 4111, 1),  # Q = 1 (plain decode), splits across threads
    (2, 7, 9, 3, 37, 200, 1),     # R = 21 (3 groups of 8) with an odd D: the pair QK's masked last element
    (1, 5, 16, 2, 33, 150, 3),    # R = 40: 5 groups of 8, rows in lanes; D 33
    (2, 6, 3, 1, 65, 130, 2),     # R = 18 (3 groups, 6 padded rows), D 65: pair QK, odd D
    (2, 1, 7, 1, 65, 140, 1),     # R = 7, D 65: above the tokens-in-lanes R * D; one group, 16 tokens a block
    (2, 5, 9, 3, 80, 200, 1),     # R = 15: pair QK on 2 groups of 8 (1 padded row), D 80
    (1, 4, 16, 4, 64, 150, 5),    # R = 16: 2 full groups
    (2, 3, 12, 3, 33, 130, 1),    # R = 12 with an odd D: 2 groups keep rows in lanes
    (2, 5, 2, 1, 2, 90, 1),       # R = 10, D 2: the smallest D that 2 groups take (row_pad8 16 <= 8 D)
    (1, 2, 6, 1, 36, 150, 1),     # R = 12, D 36: 2 groups, 2 full lines of 8 pairs and a short last line
    (1, 1, 7, 1, 100, 140, 1),    # R = 7, D 100: one group (2 rows' prefetches per pair step), a short last line
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", EDGE_SHAPES, ids=shape_id)
def test_blocking_edges_match_reference(shape, dtype):
    assert_verify_matches(shape, dtype, _run(shape, dtype, seed=5))


@pytest.mark.parametrize("bs", [1, 16, 64])
def test_tiles_cut_by_seq_lens_and_causality(bs):
    """Lengths ending just inside, at and past tile edges (64), so a tile's last query rows
    see a few tokens more than its first, and rows whose visible prefix ends mid-tile."""
    B, Q, Hq, Hkv, D, S = 7, 9, 12, 3, 64, 200
    q, k, v, _ = make_inputs(B, Q, Hq, Hkv, D, S, torch.float32, seed=6)
    lens = torch.tensor([9, 63, 64, 65, 70, 128, 200], dtype=torch.int32)
    scale = D ** -0.5
    w = torch.rand(Q, generator=torch.Generator().manual_seed(1)) + 0.1
    out, lse, bsc = torch.ops.vegas.verify_attention(q, k, v, lens, bs, scale, w)
    out_r, lse_r, bsc_r = reference.verify_attention(q, k, v, lens, bs, scale, w)
    assert max_err(out, out_r) < 3e-5
    assert max_err(lse, lse_r) < 1e-4
    assert max_err(bsc, bsc_r) < 1e-4 * Q * (Hq // Hkv)
    for b in range(B):  # nothing past each row's length
        assert bool((bsc[b, :, math.ceil(int(lens[b]) / bs):] == 0).all())


def test_threads_and_splits_agree():
    """One thread (one split per head or a few) and two threads (more splits) agree."""
    shape = (1, 7, 9, 3, 64, 3000, 1)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        (q, k, v, lens, scale), one, want = _run(shape, torch.float32, seed=7)
        torch.set_num_threads(2)
        two = torch.ops.vegas.verify_attention(q, k, v, lens, 1, scale, None)
    finally:
        torch.set_num_threads(n)
    for a, b, r in zip(one, two, want):
        assert max_err(a, b) < 1e-5 and max_err(a, r) < 1e-4



@pytest.mark.parametrize("threads", [1, 2])
def test_finish_in_task_and_second_pass_agree_with_reference(threads):
    """Both ways the block sums are finished: by the task that attended (one split per
    (batch, KV head): 5 x 3 tasks keep both threads busy) and by a second pass over the splits
    (one (batch, KV head), 3000 tokens: several splits). Block sizes 1, 7 (not dividing the
    lengths) and 16, ragged lengths, query weights, bf16 and fp32; the larger call runs between
    two smaller ones, so the per-thread buffers that are reused across calls shrink and grow."""
    n = torch.get_num_threads()
    cases = [(5, 7, 9, 3, 64, 300), (1, 7, 8, 1, 80, 3000), (5, 5, 12, 3, 64, 257)]
    try:
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            for bs in (1, 7, 16):
                for i, (B, Q, Hq, Hkv, D, S) in enumerate(cases):
                    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, dtype, seed=10 + i)
                    w = torch.rand(Q, generator=torch.Generator().manual_seed(i)) + 0.1
                    got = torch.ops.vegas.verify_attention(q, k, v, lens, bs, D ** -0.5, w)
                    want = reference.verify_attention(q.float(), k.float(), v.float(), lens, bs, D ** -0.5, w)
                    tol = 1e-4 if dtype == torch.float32 else 2e-2
                    assert max_err(got[0].float(), want[0]) < tol * 3, (dtype, bs, i)
                    assert max_err(got[1], want[1]) < tol * 10, (dtype, bs, i)
                    assert max_err(got[2], want[2]) < tol * Q * (Hq // Hkv), (dtype, bs, i)
                    for b in range(B):
                        assert bool((got[2][b, :, math.ceil(int(lens[b]) / bs):] == 0).all())
    finally:
        torch.set_num_threads(n)

INF_V_SCRIPT = r"""
import torch
from op_utils import make_inputs
from vegas_ext import reference
q, k, v, lens = make_inputs(1, 7, 3, 1, 64, 70, torch.float32, seed=2)
lens[:] = 70
v[0, 0, 69, 0] = float("inf")  # the last token: only the last query sees it
got = torch.ops.vegas.verify_attention(q, k, v, lens, 16, 0.125, None)
want = reference.verify_attention(q, k, v, lens, 16, 0.125)
for g, w in zip(got, want):
    torch.testing.assert_close(g, w, equal_nan=True, atol=1e-4, rtol=1e-4)
assert torch.isnan(got[0][0, :6, :, 0]).all() and torch.isfinite(got[1]).all()
print("ok")
"""


def test_avx2_transposed_pv_matches_reference_on_a_nonfinite_value():
    """AVX2's transposed P V runs every row of a tile over the longest visible prefix (rows that
    do not see a token have P = 0 there), as the reference's P @ V does: an inf in V at a token
    only the last query sees makes the earlier queries' outputs NaN in that head_dim column
    (0 * inf), as in the reference; lse and block scores stay finite."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("needs an AVX2 processor")
    run_with_isa(INF_V_SCRIPT, "avx2")


ISA_SCRIPT = r"""
import math, torch
from op_utils import assert_verify_matches, make_inputs, max_err, random_selection, verify_case
from vegas_ext import reference
shapes = {shapes!r}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for shape in shapes:
        assert_verify_matches(shape, dtype, verify_case(shape, dtype, seed=3))
        B, Q, Hq, Hkv, D, S, bs = shape
        q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, dtype, seed=4)
        nb = math.ceil(S / bs)
        idx = random_selection(B, Hkv, nb, max(1, min(nb, 9)), seed=2)
        tail = (lens - Q - 5).clamp(min=0).int()
        got = torch.ops.vegas.sparse_draft_attention(q, k, v, idx, tail, lens, bs, D ** -0.5)
        want = reference.sparse_draft_attention(q, k, v, idx, tail, lens, bs, D ** -0.5)
        assert max_err(got, want) <= (3e-5 if dtype == torch.float32 else 3e-2), (shape, dtype)
print("ok")
"""


@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_narrower_isa_paths_match_reference(isa):
    """The baseline and AVX2 builds of the main loop (the AVX-512 one runs everywhere else in
    these tests where the processor has it), forced by VEGAS_CPU_ISA in a fresh process."""
    shapes = EDGE_SHAPES[:8] + [(2, 7, 9, 3, 64, 300, 16), (2, 1, 8, 2, 128, 257, 1), (1, 9, 9, 3, 38, 170, 1)]
    run_with_isa(ISA_SCRIPT, isa, shapes=shapes)


@pytest.mark.parametrize("hq", [3, 9])  # R = 6 (tokens in lanes) and R = 18 (AVX-512: pair QK)
def test_row_that_sees_only_minus_inf_scores_gets_zero_output(hq):
    """Query 0 sees only token 0, whose K makes every score -inf: its ``out`` is 0 and its ``lse``
    -inf (documented; the reference's softmax gives NaN). Query 1 also sees token 1 and matches
    the reference."""
    D = 8
    q, k, v, _ = make_inputs(1, 2, hq, 1, D, 2, torch.float32, seed=3)
    q[..., 0] = q[..., 0].abs() + 0.1
    k[0, 0, 0, 0] = float("-inf")
    lens = torch.tensor([2], dtype=torch.int32)
    out, lse, bsc = torch.ops.vegas.verify_attention(q, k, v, lens, 1, D ** -0.5, None)
    want_out, want_lse, _ = reference.verify_attention(q, k, v, lens, 1, D ** -0.5)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    assert torch.isneginf(lse[0, :, 0]).all()
    torch.testing.assert_close(out[0, 1], want_out[0, 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[0, :, 1], want_lse[0, :, 1], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(bsc).all()


@pytest.mark.parametrize("d_inf", [0, 36])
def test_nonfinite_key_at_an_odd_head_dims_last_element_matches_reference(d_inf):
    """R = 21 with D 37 (AVX-512: the QK on head_dim pairs, the 37th element multiplied into the
    even lanes only): an infinite K element there or at element 0 gives the reference's -inf
    scores, not 0 * inf = NaN from an odd lane."""
    D, S = 37, 200
    q, k, v, _ = make_inputs(1, 7, 3, 1, D, S, torch.float32, seed=11)
    q[..., d_inf] = -q[..., d_inf].abs()
    k[0, 0, 50, d_inf] = float("inf")
    lens = torch.tensor([S], dtype=torch.int32)
    got = torch.ops.vegas.verify_attention(q, k, v, lens, 1, D ** -0.5, None)
    want = reference.verify_attention(q, k, v, lens, 1, D ** -0.5)
    for g, w in zip(got, want):
        assert torch.isfinite(w).all()
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bs", [1, 5, 16])
@pytest.mark.parametrize("shape", [(1, 3, 9, 3), (1, 7, 3, 1), (1, 2, 2, 1)], ids=["R9", "R21", "R4"])
def test_nonfinite_key_in_fully_visible_tiles_matches_reference(shape, bs):
    """An infinite K element in a fully visible tile (where the rows-in-lanes loop skips the causal
    mask, so its padded lanes hold 0 * inf = NaN). Scores of -inf: outputs, lse and every block
    score equal the reference's, so no padded lane leaks into a real row or block. Scores of +inf
    poison their rows (documented: l becomes NaN): outputs NaN where the reference's are."""
    B, Q, Hq, Hkv = shape
    D, S = 24, 300
    for sign in (-1.0, 1.0):
        q, k, v, _ = make_inputs(B, Q, Hq, Hkv, D, S, torch.float32, seed=9)
        q[..., 0] = sign * q[..., 0].abs()
        k[0, 0, 100, 0] = float("inf")
        lens = torch.tensor([S], dtype=torch.int32)
        got = torch.ops.vegas.verify_attention(q, k, v, lens, bs, D ** -0.5, None)
        want = reference.verify_attention(q, k, v, lens, bs, D ** -0.5)
        for g, w in zip(got if sign < 0 else got[:1], want):
            assert torch.isfinite(w).all() or sign > 0
            torch.testing.assert_close(g, w, equal_nan=True, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("Q", [4, 12, 30])  # R 4 (tokens in lanes), 12 (pair QK), 30 (rows in lanes)
def test_poisoned_row_leaves_blocks_across_a_tile_edge_it_does_not_see_finite(Q):
    """Query 0 sees tokens <= L - Q and alone gets a +inf score (token 10): its lse is NaN and, as
    documented, its NaN reaches only the blocks it has mass in. Block 21 (tokens 63-65 at block
    size 3) straddles the 64-token tile edge past what query 0 sees: rescaling its sum begun in
    the first tile by that row's alpha = exp(inf - inf) = NaN must keep the row's zero, so the block
    score is finite and equals the reference's."""
    D, L, bs = 8, Q + 62, 3
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, Q, 1, D, generator=g)
    k = torch.randn(1, 1, L, D, generator=g)
    v = torch.randn(1, 1, L, D, generator=g)
    q[0, :, 0, 0] = -q[0, :, 0, 0].abs() - 0.1
    q[0, 0, 0, 0] = 1.0
    k[0, 0, 10, 0] = float("inf")
    lens = torch.tensor([L], dtype=torch.int32)
    out, lse, bsc = torch.ops.vegas.verify_attention(q, k, v, lens, bs, D ** -0.5, None)
    want_out, want_lse, want_bsc = reference.verify_attention(q, k, v, lens, bs, D ** -0.5)
    assert torch.isnan(lse[0, 0, 0]) and torch.isfinite(lse[0, 0, 1:]).all()
    assert torch.isfinite(want_bsc[0, 0, 21]) and torch.isfinite(bsc[0, 0, 21])
    torch.testing.assert_close(bsc[0, 0, 21:], want_bsc[0, 0, 21:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0, 1:], want_out[0, 1:], atol=1e-5, rtol=1e-5)
