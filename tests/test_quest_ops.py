"""vegas::block_minmax_update and vegas::quest_block_scores (Quest, arXiv 2406.10774)
against the references; metadata equals a recomputation after appends and rollbacks."""
import math

import pytest
import torch

from vegas_ext import ops, reference

ERR = (RuntimeError, ValueError)


def _fresh_meta(B, Hkv, S, D, bs, dtype=torch.float32):
    N = math.ceil(S / bs)
    return torch.zeros(B, Hkv, N, D, dtype=dtype), torch.zeros(B, Hkv, N, D, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 100, 64, 16), (3, 1, 37, 80, 7), (1, 2, 5, 128, 1), (2, 8, 300, 64, 64)],
                         ids=str)
def test_minmax_matches_reference(shape, dtype):
    B, Hkv, S, D, bs = shape
    k = torch.randn(B, Hkv, S, D).to(dtype)
    lens = torch.randint(0, S + 1, (B,), dtype=torch.int32)
    lens[0] = S
    start = torch.zeros(B, dtype=torch.int32)
    a = _fresh_meta(B, Hkv, S, D, bs, dtype)
    b = _fresh_meta(B, Hkv, S, D, bs, dtype)
    torch.ops.vegas.block_minmax_update(a[0], a[1], k, lens, start, bs)
    reference.block_minmax_update(b[0], b[1], k, lens, start, bs)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_minmax_tracks_appends_and_rollbacks():
    """Grow, roll back, rewrite: incremental metadata == recomputation from the cache."""
    B, Hkv, S, D, bs = 2, 3, 90, 64, 16
    k = torch.zeros(B, Hkv, S, D)
    kmin, kmax = _fresh_meta(B, Hkv, S, D, bs)
    lens = torch.tensor([0, 0], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    for step, (grow, back) in enumerate([(20, 0), (7, 3), (30, 12), (5, 5), (17, 0)]):
        start = lens.clone()
        new = lens + grow
        for b in range(B):
            k[b, :, int(lens[b]) : int(new[b])] = torch.randn(Hkv, grow, D, generator=g)
        ops.block_minmax_update(kmin, kmax, k, new.int(), start, bs)
        lens = (new - back).int()
        if back:
            # after a rollback the next writes overwrite the tail; refresh from the new end
            k[:, :, int(lens.min()) :] = torch.randn(B, Hkv, S - int(lens.min()), D, generator=g)
            ops.block_minmax_update(kmin, kmax, k, lens, lens.clone(), bs)
        want_min, want_max = _fresh_meta(B, Hkv, S, D, bs)
        reference.block_minmax_update(want_min, want_max, k, lens, torch.zeros(B, dtype=torch.int32), bs)
        for b in range(B):
            nb = math.ceil(int(lens[b]) / bs)
            assert torch.equal(kmin[b, :, :nb], want_min[b, :, :nb]), step
            assert torch.equal(kmax[b, :, :nb], want_max[b, :, :nb]), step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 1, 9, 3, 64, 20), (1, 3, 32, 8, 128, 7), (3, 2, 4, 1, 80, 1)], ids=str)
def test_quest_scores_match_reference(shape, dtype):
    B, Q, Hq, Hkv, D, N = shape
    q = torch.randn(B, Q, Hq, D).to(dtype)
    a = torch.randn(B, Hkv, N, D)
    kmin, kmax = torch.minimum(a, a.flip(-1)).to(dtype), torch.maximum(a, a.flip(-1)).to(dtype)
    nb = torch.randint(0, N + 2, (B,), dtype=torch.int32)
    got = torch.ops.vegas.quest_block_scores(q, kmin, kmax, nb)
    want = reference.quest_block_scores(q, kmin, kmax, nb)
    assert got.shape == (B, Hkv, N) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_quest_score_bounds_every_dot_product():
    B, Q, Hq, Hkv, D, S, bs = 1, 1, 4, 2, 64, 64, 16
    k = torch.randn(B, Hkv, S, D)
    q = torch.randn(B, Q, Hq, D)
    kmin, kmax = _fresh_meta(B, Hkv, S, D, bs)
    ops.block_minmax_update(kmin, kmax, k, torch.tensor([S], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), bs)
    s = ops.quest_block_scores(q, kmin, kmax, torch.tensor([S // bs], dtype=torch.int32))
    G = Hq // Hkv
    for g in range(Hkv):
        dots = (q[0, 0, g * G : (g + 1) * G] @ k[0, g].T)  # [G, S]
        per_block = dots.view(G, S // bs, bs).amax(-1).sum(0)  # max over block, summed over heads
        assert bool((s[0, g] >= per_block - 1e-4).all())


def test_quest_opcheck():
    q = torch.randn(2, 1, 6, 64)
    kmin = torch.randn(2, 3, 10, 64)
    kmax = kmin + torch.rand(2, 3, 10, 64)
    torch.library.opcheck(torch.ops.vegas.quest_block_scores.default,
                          (q, kmin, kmax, torch.tensor([10, 4], dtype=torch.int32)))
    k = torch.randn(2, 3, 40, 64)
    torch.library.opcheck(
        torch.ops.vegas.block_minmax_update.default,
        (torch.zeros(2, 3, 3, 64), torch.zeros(2, 3, 3, 64), k, torch.tensor([40, 17], dtype=torch.int32),
         torch.tensor([0, 5], dtype=torch.int32), 16),
    )


def test_quest_bad_inputs_named():
    q = torch.randn(2, 1, 6, 64)
    kmin = torch.randn(2, 3, 10, 64)
    with pytest.raises(ERR, match="key_max"):
        torch.ops.vegas.quest_block_scores(q, kmin, torch.randn(2, 3, 9, 64), torch.tensor([1, 1], dtype=torch.int32))
    with pytest.raises(ERR, match="num_blocks"):
        torch.ops.vegas.quest_block_scores(q, kmin, kmin, torch.tensor([1, 1]))
    with pytest.raises(ERR, match="multiple"):
        torch.ops.vegas.quest_block_scores(torch.randn(2, 1, 7, 64), kmin, kmin,
                                           torch.tensor([1, 1], dtype=torch.int32))
    k = torch.randn(2, 3, 40, 64)
    with pytest.raises(ERR, match="seq_lens"):
        torch.ops.vegas.block_minmax_update(torch.zeros(2, 3, 3, 64), torch.zeros(2, 3, 3, 64), k,
                                            torch.tensor([41, 1], dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                                            16)
    with pytest.raises(ERR, match="N = ceil"):
        torch.ops.vegas.block_minmax_update(torch.zeros(2, 3, 4, 64), torch.zeros(2, 3, 4, 64), k,
                                            torch.tensor([4, 1], dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                                            16)
