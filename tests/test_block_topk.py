"""vegas::block_topk (CPU kernel): exact equality with the reference, plus properties
checked by value threshold (flashinfer style), ties, NaN/inf, sinks and padding."""
import pytest
import torch

from vegas_ext import reference

from op_utils import run_with_isa

CASES = [  # (B, H, N, max_k, sinks)
    (1, 1, 1, 1, 0),
    (2, 3, 17, 5, 1),
    (4, 8, 2048, 103, 2),
    (3, 2, 100, 128, 0),
    (2, 4, 64, 64, 64),
]


def _run(scores, k, nc, max_k, sinks):
    got = torch.ops.vegas.block_topk(scores, k, nc, max_k, sinks)
    want = reference.block_topk(scores, k, nc, max_k, sinks)
    return got, want


def _check_properties(scores, k, nc, max_k, sinks, idx):
    B, H, N = scores.shape
    for b in range(B):
        elig = min(int(nc[b]), N)
        c = min(int(k[b]), max_k, elig)
        n_sink = min(sinks, c)
        for h in range(H):
            row = idx[b, h]
            sel = row[row >= 0].tolist()
            assert len(sel) == c
            assert sel == sorted(sel) and len(set(sel)) == c
            assert bool((row[c:] == -1).all())
            assert all(0 <= j < elig for j in sel)
            assert set(range(n_sink)) <= set(sel)
            rest_sel = [j for j in sel if j >= n_sink]
            rest_uns = [j for j in range(n_sink, elig) if j not in set(sel)]
            if rest_sel and rest_uns:
                s = scores[b, h]
                key = torch.where(torch.isnan(s), torch.tensor(float("-inf")), s)
                worst_sel = min(key[j].item() for j in rest_sel)
                best_uns = max(key[j].item() for j in rest_uns)
                assert worst_sel >= best_uns  # value threshold


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference_and_threshold(case):
    B, H, N, max_k, sinks = case
    g = torch.Generator().manual_seed(N)
    scores = torch.rand(B, H, N, generator=g)
    k = torch.randint(0, max_k + 3, (B,), generator=g).int()
    nc = torch.randint(0, N + 5, (B,), generator=g).int()
    k[0], nc[0] = max_k, N  # one full row
    got, want = _run(scores, k, nc, max_k, sinks)
    assert got.dtype == torch.int32 and got.shape == (B, H, max_k)
    assert torch.equal(got, want)
    _check_properties(scores, k, nc, max_k, sinks, got)


def test_ties_prefer_lower_index():
    scores = torch.zeros(1, 2, 10)
    scores[0, 1, 5:] = 1.0
    k = torch.tensor([3], dtype=torch.int32)
    nc = torch.tensor([10], dtype=torch.int32)
    got, want = _run(scores, k, nc, 4, 0)
    assert got[0, 0].tolist() == [0, 1, 2, -1]
    assert got[0, 1].tolist() == [5, 6, 7, -1]
    assert torch.equal(got, want)


def test_integer_scores_many_ties_match_reference():
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 4, (3, 5, 300), generator=g).float()
    k = torch.tensor([7, 50, 299], dtype=torch.int32)
    nc = torch.tensor([300, 120, 299], dtype=torch.int32)
    got, want = _run(scores, k, nc, 64, 1)
    assert torch.equal(got, want)


def test_nan_and_inf_never_crash_and_nan_ranks_last():
    scores = torch.tensor([[[float("nan"), 1.0, float("-inf"), float("inf"), float("nan"), 0.5, -2.0]]])
    nc = torch.tensor([7], dtype=torch.int32)
    for kk, expect in [(1, [3]), (2, [1, 3]), (4, [1, 3, 5, 6]), (5, [1, 2, 3, 5, 6]), (6, [0, 1, 2, 3, 5, 6])]:
        k = torch.tensor([kk], dtype=torch.int32)
        got, want = _run(scores, k, nc, 7, 0)
        assert got[0, 0, :kk].tolist() == expect, kk
        assert torch.equal(got, want)


def test_all_nan_row_still_returns_c_blocks():
    scores = torch.full((1, 1, 9), float("nan"))
    got, want = _run(scores, torch.tensor([4], dtype=torch.int32), torch.tensor([9], dtype=torch.int32), 4, 1)
    assert got[0, 0].tolist() == [0, 1, 2, 3]
    assert torch.equal(got, want)


def test_sinks_fill_first_and_respect_candidates():
    scores = torch.arange(20, dtype=torch.float32).view(1, 1, 20)
    k = torch.tensor([5], dtype=torch.int32)
    got, _ = _run(scores, k, torch.tensor([12], dtype=torch.int32), 8, 2)
    assert got[0, 0].tolist() == [0, 1, 9, 10, 11, -1, -1, -1]
    got, _ = _run(scores, k, torch.tensor([1], dtype=torch.int32), 8, 2)  # only block 0 eligible
    assert got[0, 0].tolist() == [0] + [-1] * 7
    got, _ = _run(scores, torch.tensor([0], dtype=torch.int32), torch.tensor([12], dtype=torch.int32), 8, 2)
    assert got[0, 0].tolist() == [-1] * 8


def test_deterministic_across_runs_and_threads():
    g = torch.Generator().manual_seed(11)
    scores = torch.randint(0, 3, (4, 8, 2048), generator=g).float()
    k = torch.full((4,), 100, dtype=torch.int32)
    nc = torch.full((4,), 2048, dtype=torch.int32)
    first = torch.ops.vegas.block_topk(scores, k, nc, 128, 1)
    n = torch.get_num_threads()
    try:
        for t in (1, n):
            torch.set_num_threads(t)
            assert torch.equal(torch.ops.vegas.block_topk(scores, k, nc, 128, 1), first)
    finally:
        torch.set_num_threads(n)


def _edge_rows():
    g = torch.Generator().manual_seed(5)
    N = 8192
    base = torch.rand(6, N, generator=g)
    rows = [
        base[0],
        1.0 + torch.randint(0, 3000, (N,), generator=g) * 2.0 ** -23,  # same exponent, 11-12 low bits
        -base[1],  # all negative
        torch.where(torch.rand(N, generator=g) < 0.5, torch.tensor(-0.0), torch.tensor(0.0)),
        torch.where(torch.rand(N, generator=g) < 0.1, torch.tensor(float("nan")), base[2]),
        torch.where(torch.rand(N, generator=g) < 0.2, torch.tensor(float("inf")), -base[3] * 1e30),
    ]
    return torch.stack(rows).view(2, 3, N).contiguous()


def test_radix_select_edges_match_reference():
    """Keys that share their top 11 or 22 bits (neighbouring floats), negative scores, -0 vs
    +0, infinities and NaN, long rows at the vegas default (one block per token): exact."""
    scores = _edge_rows()
    N = scores.shape[-1]
    for kk, sinks in ((1, 0), (410, 1), (4096, 3), (N, 0), (N - 5, 2), (17, 0)):
        k = torch.tensor([kk, max(1, kk // 2)], dtype=torch.int32)
        nc = torch.tensor([N, N - 77], dtype=torch.int32)
        got, want = _run(scores, k, nc, kk, sinks)
        assert torch.equal(got, want), (kk, sinks)


@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_narrower_isa_paths_match_reference(isa):
    """The scalar passes, forced by VEGAS_CPU_ISA in a fresh process (where the processor has
    AVX-512, the other tests run its 16-keys-at-a-time passes), on the same edge rows."""
    run_with_isa("import test_block_topk as t\n"
                 "t.test_radix_select_edges_match_reference()\n"
                 "t.test_matches_reference_and_threshold(t.CASES[2])\n"
                 "print('ok')\n", isa)


RECENT_CASES = [  # (B, H, N, max_k, sinks, recent)
    (2, 3, 17, 5, 1, 2),
    (4, 8, 2048, 103, 2, 32),
    (3, 2, 100, 128, 0, 7),
    (2, 4, 64, 64, 64, 5),  # sinks take the whole count
    (3, 2, 50, 9, 2, 40),  # the recent window alone would exceed the count
]


@pytest.mark.parametrize("case", RECENT_CASES, ids=str)
def test_recent_blocks_always_taken_then_top_by_score(case):
    """num_recent_blocks: the last min(recent, c - sinks) eligible blocks are taken, beside the sinks,
    and the count's rest goes by score among the blocks between them: the reference's selection,
    ascending, on random, tied and NaN scores, with rows whose count or candidates are short."""
    B, H, N, max_k, sinks, recent = case
    g = torch.Generator().manual_seed(N + recent)
    scores = torch.rand(B, H, N, generator=g)
    scores[0, 0, ::3] = 0.5  # ties
    scores[-1, -1, 1::4] = float("nan")
    k = torch.randint(0, max_k + 3, (B,), generator=g).int()
    nc = torch.randint(0, N + 5, (B,), generator=g).int()
    k[0], nc[0] = max_k, N
    got = torch.ops.vegas.block_topk(scores, k, nc, max_k, sinks, recent)
    assert torch.equal(got, reference.block_topk(scores, k, nc, max_k, sinks, recent))
    for b in range(B):
        elig = min(int(nc[b]), N)
        c = min(int(k[b]), max_k, elig)
        n_sink = min(sinks, c)
        n_recent = min(recent, c - n_sink)
        forced = set(range(n_sink)) | set(range(elig - n_recent, elig))
        for h in range(H):
            row = got[b, h]
            sel = row[row >= 0].tolist()
            assert len(sel) == c and sel == sorted(sel) and forced <= set(sel)
            middle = [j for j in range(n_sink, elig - n_recent) if j not in set(sel)]
            chosen = [j for j in sel if j not in forced]
            if middle and chosen:
                key = torch.where(torch.isnan(scores[b, h]), torch.tensor(float("-inf")), scores[b, h])
                assert min(key[j].item() for j in chosen) >= max(key[j].item() for j in middle)


def test_recent_blocks_zero_is_the_default_and_negative_is_refused():
    g = torch.Generator().manual_seed(5)
    scores = torch.rand(2, 3, 40, generator=g)
    k = torch.tensor([8, 3], dtype=torch.int32)
    nc = torch.tensor([40, 30], dtype=torch.int32)
    default = torch.ops.vegas.block_topk(scores, k, nc, 8, 1)
    assert torch.equal(torch.ops.vegas.block_topk(scores, k, nc, 8, 1, 0), default)
    with pytest.raises(RuntimeError, match="num_recent_blocks must be >= 0"):
        torch.ops.vegas.block_topk(scores, k, nc, 8, 1, -1)
