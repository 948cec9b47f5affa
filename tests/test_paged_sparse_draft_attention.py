"""vegas::paged_sparse_draft_attention (token-granular drafts over a vLLM-style paged cache) against
the reference, against paged_verify_attention (every token selected) and sparse_draft_attention at
block size 1 (the same tokens laid out densely); opcheck; bad input."""
import pytest
import torch
from test_paged_verify_attention import _case

from vegas_ext import ops, reference

ERR = (RuntimeError, ValueError)


def _selection(seq_lens, q_lens, Hkv, K, *, seed=0, tail_back=3):
    """Random ascending token selections (-1 padded) and tail starts a few tokens before the queries."""
    g = torch.Generator().manual_seed(seed)
    R = len(seq_lens)
    idx = torch.full((R, Hkv, K), -1, dtype=torch.int32)
    tail = torch.zeros(R, dtype=torch.int32)
    for r, (L, ql) in enumerate(zip(seq_lens, q_lens)):
        ts = max(0, L - ql - tail_back)
        tail[r] = ts
        for h in range(Hkv):
            n = min(K, ts) - h % 2  # some rows padded
            if n > 0:
                # sometimes include tokens at / past tail_start (ignored by the op)
                hi = min(L, ts + 2) if h % 3 == 2 else ts
                pick = torch.randperm(hi, generator=g)[:n].sort().values
                idx[r, h, :n] = pick.int()
    return idx, tail


CASES = [
    # (q_lens, seq_lens, Hq, Hkv, D, page_size, K)
    ([1], [300], 9, 3, 64, 32, 40),                        # SmolLM2 draft step, mid-page end
    ([1, 1, 1, 1], [33, 1000, 64, 129], 8, 2, 64, 32, 50),  # batch 4, GQA 4
    ([3, 0, 2], [77, 50, 9], 6, 1, 128, 7, 20),            # several queries, a request without, MQA
    ([1, 2], [4100, 257], 32, 8, 128, 128, 300),           # long, page 128, K past one chunk
    ([30], [200], 9, 3, 20, 16, 64),                       # > kMaxRows rows: two query blocks, D 20
]


@pytest.mark.parametrize("layout", ["cpu_vec", "flash", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"R{len(c[0])}S{max(c[1])}H{c[2]}-{c[3]}D{c[4]}ps{c[5]}K{c[6]}")
def test_matches_reference(case, dtype, layout):
    q_lens, seq_lens, Hq, Hkv, D, ps, K = case
    q, kc, vc, bt, lens, qsl = _case(q_lens, seq_lens, Hq, Hkv, D, ps, dtype, layout=layout)
    idx, tail = _selection(seq_lens, q_lens, Hkv, K)
    out = torch.ops.vegas.paged_sparse_draft_attention(q, kc, vc, bt, lens, qsl, idx, tail, D ** -0.5)
    want = reference.paged_sparse_draft_attention(q, kc, vc, bt, lens, qsl, idx, tail, D ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [1, 2])
def test_all_selected_equals_paged_verify_attention(threads):
    """Every token before the tail selected: the verification's output (any tail start)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q_lens, seq_lens, Hq, Hkv, D, ps = [1, 3, 1], [700, 90, 5], 9, 3, 64, 32
        q, kc, vc, bt, lens, qsl = _case(q_lens, seq_lens, Hq, Hkv, D, ps, torch.float32, seed=3)
        want, _ = ops.paged_verify_attention(q, kc, vc, bt, lens, qsl, 1, 0.125)
        K = max(seq_lens)
        for tails in ([0, 0, 0], [699, 87, 4], [300, 40, 2]):
            idx = torch.full((3, Hkv, K), -1, dtype=torch.int32)
            for r, ts in enumerate(tails):
                idx[r, :, :ts] = torch.arange(ts, dtype=torch.int32)
            tail = torch.tensor(tails, dtype=torch.int32)
            out = ops.paged_sparse_draft_attention(q, kc, vc, bt, lens, qsl, idx, tail, 0.125)
            torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    finally:
        torch.set_num_threads(old)


def test_equals_sparse_draft_attention_block_1():
    """Same tokens laid out densely: sparse_draft_attention at block size 1."""
    Hq, Hkv, D, ps, L, Q, K = 8, 2, 64, 16, 200, 1, 37
    q, kc, vc, bt, lens, qsl = _case([Q], [L], Hq, Hkv, D, ps, torch.float32, seed=5)
    idx, tail = _selection([L], [Q], Hkv, K, seed=5, tail_back=6)
    pages = bt[0, : -(-L // ps)].long()
    dk = kc[pages].permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :L].unsqueeze(0).contiguous()
    dv = vc[pages].permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :L].unsqueeze(0).contiguous()
    # sparse_draft_attention wants in-range, unique indices: drop the ones past the tail start
    didx = torch.where(idx < tail.view(-1, 1, 1), idx, torch.full_like(idx, -1))
    want = ops.sparse_draft_attention(q.unsqueeze(0), dk, dv, didx, tail, lens, 1, D ** -0.5)
    out = ops.paged_sparse_draft_attention(q, kc, vc, bt, lens, qsl, idx, tail, D ** -0.5)
    torch.testing.assert_close(out, want[0], atol=2e-5, rtol=1e-4)


def test_padding_rows_int_arguments_and_fallback():
    q, kc, vc, bt, lens, qsl = _case([1, 1], [90, 90], 4, 2, 64, 32, torch.float32, seed=1)
    qp = torch.cat([q, torch.randn(3, 4, 64)])
    idx, _ = _selection([90, 90], [1, 1], 2, 12, seed=2)
    tail = torch.full((2,), 80, dtype=torch.int32)
    out = ops.paged_sparse_draft_attention(qp, kc, vc, bt, 90, qsl, idx, 80, 0.125)
    assert torch.all(out[2:] == 0)
    want = ops._psda_fallback(qp, kc, vc, bt, lens, qsl, idx, tail, 0.125)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_nan_key_poisons_only_rows_that_see_it():
    q, kc, vc, bt, lens, qsl = _case([2], [40], 2, 1, 16, 8, torch.float32, seed=4, layout="dense")
    kc = kc.clone()
    kc[bt[0, 4].long(), 0, 39 % 8] = float("nan")  # the last token: only the last query sees it
    idx = torch.tensor([[[0, 5, 9, -1]]], dtype=torch.int32)
    tail = torch.tensor([30], dtype=torch.int32)
    out = ops.paged_sparse_draft_attention(q, kc, vc, bt, lens, qsl, idx, tail, 0.25)
    want = reference.paged_sparse_draft_attention(q, kc, vc, bt, lens, qsl, idx, tail, 0.25)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
    torch.testing.assert_close(out[0], want[0], atol=2e-5, rtol=1e-4)


def test_opcheck():
    q, kc, vc, bt, lens, qsl = _case([1, 2], [70, 40], 9, 3, 64, 32, torch.float32)
    idx, tail = _selection([70, 40], [1, 2], 3, 10)
    torch.library.opcheck(torch.ops.vegas.paged_sparse_draft_attention.default,
                          (q, kc, vc, bt, lens, qsl, idx, tail, 0.125))


@pytest.mark.parametrize("fn", [torch.ops.vegas.paged_sparse_draft_attention, ops._psda_fallback],
                         ids=["kernel", "fallback"])
def test_bad_input(fn):
    q, kc, vc, bt, lens, qsl = _case([1], [70], 9, 3, 64, 32, torch.float32)
    idx, tail = _selection([70], [1], 3, 10)
    args = [q, kc, vc, bt, lens, qsl, idx, tail, 0.125]

    def call(**kw):
        names = ["q", "kc", "vc", "bt", "lens", "qsl", "idx", "tail", "scale"]
        return fn(*[kw.get(n, a) for n, a in zip(names, args)])

    with pytest.raises(ERR, match="token_indices"):
        call(idx=idx[:, :2])
    with pytest.raises(ERR, match="token_indices"):
        call(idx=idx.long())
    with pytest.raises(ERR, match="token_indices"):
        call(idx=idx.flip(-1))  # descending
    with pytest.raises(ERR, match="token_indices"):
        bad = idx.clone()
        bad[0, 0, 0] = -1  # padding before a token
        call(idx=bad)
    with pytest.raises(ERR, match="token_indices"):
        bad = idx.clone()
        bad[0, 0, -1] = -5
        call(idx=bad)
    with pytest.raises(ERR, match="tail_start"):
        call(tail=torch.tensor([70], dtype=torch.int32))
    with pytest.raises(ERR, match="tail_start"):
        call(tail=torch.tensor([-1], dtype=torch.int32))
    with pytest.raises(ERR, match="tail_start"):
        call(tail=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ERR, match="seq_lens"):
        call(lens=torch.tensor([7000], dtype=torch.int32))
    with pytest.raises(ERR, match="block_table"):
        bad = bt.clone()
        bad[0, 0] = 999
        call(bt=bad)
    with pytest.raises(ERR, match="value_cache"):
        call(vc=vc[:, :, :16])
    with pytest.raises(ERR, match="H_q"):
        call(q=q[:, :8])
    with pytest.raises(ERR, match="scale"):
        call(scale=0.0)
