"""vegas::paged_block_scores (attention mass per page of a vLLM-style paged cache) against the
reference and against verify_attention's block scores on the same keys; opcheck; bad input."""
import pytest
import torch

from vegas_ext import ops, reference

ERR = (RuntimeError, ValueError)


def _paged_case(q_lens, seq_lens, Hq, Hkv, D, ps, dtype, *, seed=0, layout="cpu", spare_pages=3):
    """Random packed queries and a shuffled paged key cache holding each request's keys.

    Returns (q [T, Hq, D], key_cache view [NP, Hkv, ps, D], block_table, seq_lens, qsl, dense keys per request).
    layout "cpu": the K half of a [NP, Hkv, 2 * ps, D] cache; "cpu_vec": vLLM's CPU cache, keys [D, ps] per page;
    "flash": a [NP, ps, Hkv, D] cache viewed as [NP, Hkv, ps, D] (vLLM flash layout)."""
    g = torch.Generator().manual_seed(seed)
    R = len(q_lens)
    pages_per = [-(-L // ps) for L in seq_lens]
    P = max(pages_per) + 1
    NP = sum(pages_per) + spare_pages
    perm = torch.randperm(NP, generator=g)
    bt = torch.full((R, P), -1, dtype=torch.int32)
    if layout == "cpu":
        raw = torch.randn(NP, Hkv, 2 * ps, D, generator=g).to(dtype)
        kc = raw[:, :, :ps]
    elif layout == "cpu_vec":  # vLLM CPU_ATTN (vec ISA): each page's keys stored [D, page_size]
        raw = torch.randn(NP, Hkv, 2, D, ps, generator=g).to(dtype)
        kc = raw[:, :, 0].transpose(2, 3)
    else:
        raw = torch.randn(NP, ps, Hkv, D, generator=g).to(dtype)
        kc = raw.transpose(1, 2)
    used = 0
    for r in range(R):
        bt[r, : pages_per[r]] = perm[used : used + pages_per[r]].int()
        used += pages_per[r]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), Hq, D, generator=g).to(dtype)
    return q, kc, bt, torch.tensor(seq_lens, dtype=torch.int32), qsl


CASES = [
    # (q_lens, seq_lens, Hq, Hkv, D, page_size)
    ([7], [300], 9, 3, 64, 32),
    ([1, 7, 3, 5], [33, 1000, 64, 129], 8, 2, 64, 32),
    ([12, 1], [12, 2], 4, 4, 80, 16),          # a whole prefill, a 2-token request
    ([5, 0, 2], [77, 50, 9], 6, 1, 128, 7),     # a request without queries; odd page size
    ([7, 7], [4100, 257], 32, 8, 128, 128),
]


@pytest.mark.parametrize("layout", ["cpu", "cpu_vec", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"R{len(c[0])}S{max(c[1])}H{c[2]}-{c[3]}D{c[4]}ps{c[5]}")
def test_matches_reference(case, dtype, layout):
    q_lens, seq_lens, Hq, Hkv, D, ps = case
    q, kc, bt, lens, qsl = _paged_case(q_lens, seq_lens, Hq, Hkv, D, ps, dtype, layout=layout)
    nq = 7
    got = torch.ops.vegas.paged_block_scores(q, kc, bt, lens, qsl, nq, D ** -0.5)
    want = reference.paged_block_scores(q, kc, bt, lens, qsl, nq, D ** -0.5)
    assert got.shape == (len(q_lens), Hkv, bt.shape[1]) and got.dtype == torch.float32
    tol = 2e-5 if dtype == torch.float32 else 2e-3  # inputs are the same bf16 values; fp32 math on both sides
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # each request's row sums to G * min(q_len, nq); zero past its pages
    G = Hq // Hkv
    for r, (ql, L) in enumerate(zip(q_lens, seq_lens)):
        torch.testing.assert_close(got[r].sum(-1), torch.full((Hkv,), float(G * min(ql, nq))), atol=1e-3, rtol=1e-4)
        assert torch.all(got[r, :, -(-L // ps):] == 0)


def test_equals_verify_attention_block_scores():
    """Same keys laid out densely: verify_attention's fused block scores with the same queries."""
    Hq, Hkv, D, ps, L, Q = 9, 3, 64, 16, 200, 5
    q, kc, bt, lens, qsl = _paged_case([Q], [L], Hq, Hkv, D, ps, torch.float32, seed=3)
    dense_k = kc[bt[0, : -(-L // ps)].long()].permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :L].unsqueeze(0)
    _, _, bs_scores = ops.verify_attention(q.unsqueeze(0), dense_k.contiguous(), dense_k.contiguous(), lens, ps,
                                           D ** -0.5)
    got = ops.paged_block_scores(q, kc, bt, lens, qsl, Q, D ** -0.5)
    torch.testing.assert_close(got[0, :, : bs_scores.shape[-1]], bs_scores[0], atol=2e-5, rtol=1e-4)


def test_num_queries_limits_the_scored_rows():
    q, kc, bt, lens, qsl = _paged_case([6], [90], 4, 2, 64, 32, torch.float32, seed=1)
    last = ops.paged_block_scores(q, kc, bt, lens, qsl, 1, 0.125)
    only_last = ops.paged_block_scores(q[-1:], kc, bt, lens, torch.tensor([0, 1], dtype=torch.int32), 1, 0.125)
    torch.testing.assert_close(last, only_last)
    torch.testing.assert_close(last.sum(-1), torch.full((1, 2), 2.0))


def test_opcheck():
    q, kc, bt, lens, qsl = _paged_case([3, 2], [70, 40], 9, 3, 64, 32, torch.float32)
    torch.library.opcheck(torch.ops.vegas.paged_block_scores.default, (q, kc, bt, lens, qsl, 4, 0.125))


def test_fallback_matches_kernel():
    """The checked reference path (used for CUDA tensors) agrees with the CPU kernel."""
    q, kc, bt, lens, qsl = _paged_case([2, 7], [45, 300], 8, 2, 64, 32, torch.float32, seed=5)
    torch.testing.assert_close(ops._paged_fallback(q, kc, bt, lens, qsl, 7, 0.125),
                               torch.ops.vegas.paged_block_scores(q, kc, bt, lens, qsl, 7, 0.125), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fn", [torch.ops.vegas.paged_block_scores, ops._paged_fallback], ids=["kernel", "fallback"])
def test_bad_input(fn):
    q, kc, bt, lens, qsl = _paged_case([3], [70], 9, 3, 64, 32, torch.float32)
    with pytest.raises(ERR, match="num_queries"):
        fn(q, kc, bt, lens, qsl, 0, 0.125)
    with pytest.raises(ERR, match="scale"):
        fn(q, kc, bt, lens, qsl, 3, -1.0)
    with pytest.raises(ERR, match="H_q"):
        fn(q[:, :8], kc, bt, lens, qsl, 3, 0.125)
    with pytest.raises(ERR, match="seq_lens"):
        fn(q, kc, bt, torch.tensor([2], dtype=torch.int32), qsl, 3, 0.125)
    with pytest.raises(ERR, match="block_table"):
        bad = bt.clone()
        bad[0, 0] = kc.shape[0]
        fn(q, kc, bad, lens, qsl, 3, 0.125)
    with pytest.raises(ERR, match="query_start_loc"):
        fn(q, kc, bt, lens, torch.tensor([0, 5], dtype=torch.int32), 3, 0.125)
    with pytest.raises(ERR, match="dtype"):
        fn(q.bfloat16(), kc, bt, lens, qsl, 3, 0.125)
    with pytest.raises(ERR, match="int32"):
        fn(q, kc, bt.long(), lens, qsl, 3, 0.125)
