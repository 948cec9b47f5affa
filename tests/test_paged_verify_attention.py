"""vegas::paged_verify_attention (verification attention + page scores in one pass over a
vLLM-style paged cache) against the reference, against paged_block_scores (same scores) and
verify_attention (same output on the same tokens laid out densely); opcheck; bad input."""
import pytest
import torch

from vegas_ext import ops, reference

ERR = (RuntimeError, ValueError)


def _case(q_lens, seq_lens, Hq, Hkv, D, ps, dtype, *, seed=0, layout="cpu_vec", spare_pages=3):
    """Random packed queries and a shuffled paged cache holding each request's keys and values.

    layout "cpu_vec": vLLM's CPU_ATTN cache [NP, Hkv, 2 * ps, D] whose pages hold keys [D, ps] then
    values [ps, D]; "flash": [NP, ps, Hkv, D] caches viewed as [NP, Hkv, ps, D]; "dense": plain
    contiguous [NP, Hkv, ps, D] caches. Returns (q, key_cache, value_cache, block_table, seq_lens, qsl)."""
    g = torch.Generator().manual_seed(seed)
    R = len(q_lens)
    pages_per = [-(-L // ps) for L in seq_lens]
    P = max(pages_per) + 1
    NP = sum(pages_per) + spare_pages
    perm = torch.randperm(NP, generator=g)
    bt = torch.full((R, P), -1, dtype=torch.int32)
    if layout == "cpu_vec":
        raw = torch.randn(NP, Hkv, 2 * ps * D, generator=g).to(dtype)
        kc = raw[:, :, : ps * D].view(NP, Hkv, D, ps).transpose(2, 3)
        vc = raw[:, :, ps * D :].view(NP, Hkv, ps, D)
    elif layout == "flash":
        kc = torch.randn(NP, ps, Hkv, D, generator=g).to(dtype).transpose(1, 2)
        vc = torch.randn(NP, ps, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    else:
        kc = torch.randn(NP, Hkv, ps, D, generator=g).to(dtype)
        vc = torch.randn(NP, Hkv, ps, D, generator=g).to(dtype)
    used = 0
    for r in range(R):
        bt[r, : pages_per[r]] = perm[used : used + pages_per[r]].int()
        used += pages_per[r]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), Hq, D, generator=g).to(dtype)
    return q, kc, vc, bt, torch.tensor(seq_lens, dtype=torch.int32), qsl


CASES = [
    # (q_lens, seq_lens, Hq, Hkv, D, page_size)
    ([7], [300], 9, 3, 64, 32),                       # SmolLM2 verifying 6 drafts, mid-page end
    ([1, 7, 3, 5], [33, 1000, 64, 129], 8, 2, 64, 32),  # ragged batch, GQA 4
    ([12, 1], [12, 2], 4, 4, 80, 16),                 # a whole prefill, a 2-token request, D 80
    ([5, 0, 2], [77, 50, 9], 6, 1, 128, 7),           # a request without queries; odd page size, MQA
    ([7, 7], [4100, 257], 32, 8, 128, 128),           # long context, page size 128
    ([60, 3], [200, 40], 9, 3, 64, 32),               # a prefill chunk longer than one query block
    ([3], [5000], 3, 3, 20, 16),                      # GQA 1, D not a multiple of the vector width
]


@pytest.mark.parametrize("layout", ["cpu_vec", "flash", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"R{len(c[0])}S{max(c[1])}H{c[2]}-{c[3]}D{c[4]}ps{c[5]}")
def test_matches_reference(case, dtype, layout):
    q_lens, seq_lens, Hq, Hkv, D, ps = case
    q, kc, vc, bt, lens, qsl = _case(q_lens, seq_lens, Hq, Hkv, D, ps, dtype, layout=layout)
    nq = 7
    out, sc = torch.ops.vegas.paged_verify_attention(q, kc, vc, bt, lens, qsl, nq, D ** -0.5)
    want_out, want_sc = reference.paged_verify_attention(q, kc, vc, bt, lens, qsl, nq, D ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert sc.shape == (len(q_lens), Hkv, bt.shape[1]) and sc.dtype == torch.float32
    # same input values on both sides, fp32 math on both: bf16 differs by the output's rounding
    otol = 2e-5 if dtype == torch.float32 else 1e-2
    stol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, want_out, atol=otol, rtol=otol)
    torch.testing.assert_close(sc, want_sc, atol=stol, rtol=stol)
    G = Hq // Hkv
    for r, (ql, L) in enumerate(zip(q_lens, seq_lens)):
        torch.testing.assert_close(sc[r].sum(-1), torch.full((Hkv,), float(G * min(ql, nq))), atol=1e-3, rtol=1e-4)
        assert torch.all(sc[r, :, -(-L // ps):] == 0)


@pytest.mark.parametrize("threads", [1, 2])
def test_scores_equal_paged_block_scores(threads):
    """The proposer's selection signal does not change: the same scores as paged_block_scores
    (split or not: one thread keeps one split per (request, KV head), two split short batches)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, kc, vc, bt, lens, qsl = _case([7, 7, 1], [2048, 3000, 700], 9, 3, 64, 32, torch.float32, seed=2)
        for nq in (1, 7):
            _, sc = ops.paged_verify_attention(q, kc, vc, bt, lens, qsl, nq, 0.125)
            want = ops.paged_block_scores(q, kc, bt, lens, qsl, nq, 0.125)
            torch.testing.assert_close(sc, want, atol=1e-6, rtol=1e-5)
    finally:
        torch.set_num_threads(old)


def test_equals_verify_attention():
    """Same tokens laid out densely: verify_attention's output and block scores."""
    Hq, Hkv, D, ps, L, Q = 9, 3, 64, 16, 200, 5
    q, kc, vc, bt, lens, qsl = _case([Q], [L], Hq, Hkv, D, ps, torch.float32, seed=3)
    pages = bt[0, : -(-L // ps)].long()
    dk = kc[pages].permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :L].unsqueeze(0).contiguous()
    dv = vc[pages].permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :L].unsqueeze(0).contiguous()
    want_out, _, want_sc = ops.verify_attention(q.unsqueeze(0), dk, dv, lens, ps, D ** -0.5)
    out, sc = ops.paged_verify_attention(q, kc, vc, bt, lens, qsl, Q, D ** -0.5)
    torch.testing.assert_close(out, want_out[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(sc[0, :, : want_sc.shape[-1]], want_sc[0], atol=2e-5, rtol=1e-4)


def test_padding_rows_and_num_queries():
    """Rows past query_start_loc[R] (vLLM pads the batch) are zero; num_queries limits the scored rows only."""
    q, kc, vc, bt, lens, qsl = _case([6], [90], 4, 2, 64, 32, torch.float32, seed=1)
    qp = torch.cat([q, torch.randn(3, 4, 64)])
    out1, last = ops.paged_verify_attention(qp, kc, vc, bt, lens, qsl, 1, 0.125)
    out6, _ = ops.paged_verify_attention(qp, kc, vc, bt, lens, qsl, 6, 0.125)
    assert torch.all(out1[6:] == 0)
    torch.testing.assert_close(out1, out6)
    torch.testing.assert_close(last.sum(-1), torch.full((1, 2), 2.0))
    _, only_last = ops.paged_verify_attention(q[-1:], kc, vc, bt, lens, torch.tensor([0, 1], dtype=torch.int32), 1,
                                              0.125)
    torch.testing.assert_close(last, only_last)


@pytest.mark.parametrize("sb", [None, 1])
def test_no_query_gives_zeros(sb):
    """Requests without queries (every one of them, padded rows after): zero output, zero scores."""
    q, kc, vc, bt, lens, qsl = _case([0, 0], [50, 90], 4, 2, 64, 32, torch.float32, seed=5)
    for _ in range(2):  # the second call reuses the first's freed (non-zero) memory
        out, sc = ops.paged_verify_attention(torch.randn(3, 4, 64) * 1e3, kc, vc, bt, lens, qsl, 4, 0.125,
                                             score_block_size=sb)
        assert torch.all(out == 0) and torch.all(sc == 0)


def test_nan_key_poisons_only_rows_that_see_it():
    """A NaN key at the last position reaches only the last query (as in the reference)."""
    q, kc, vc, bt, lens, qsl = _case([3], [40], 2, 1, 16, 8, torch.float32, seed=4, layout="dense")
    kc = kc.clone()
    kc[bt[0, 4].long(), 0, 39 % 8] = float("nan")
    out, sc = ops.paged_verify_attention(q, kc, vc, bt, lens, qsl, 3, 0.25)
    want_out, _ = reference.paged_verify_attention(q, kc, vc, bt, lens, qsl, 3, 0.25)
    assert torch.isnan(out[2]).all() and not torch.isnan(out[:2]).any()
    torch.testing.assert_close(out[:2], want_out[:2], atol=2e-5, rtol=1e-4)
    assert torch.isfinite(sc).all()


def test_opcheck():
    q, kc, vc, bt, lens, qsl = _case([3, 2], [70, 40], 9, 3, 64, 32, torch.float32)
    torch.library.opcheck(torch.ops.vegas.paged_verify_attention.default, (q, kc, vc, bt, lens, qsl, 4, 0.125))


def test_fallback_matches_kernel():
    """The checked reference path (used for CUDA tensors) agrees with the CPU kernel."""
    q, kc, vc, bt, lens, qsl = _case([2, 7], [45, 300], 8, 2, 64, 32, torch.float32, seed=5)
    got = ops._pva_fallback(q, kc, vc, bt, lens, qsl, 7, 0.125)
    want = torch.ops.vegas.paged_verify_attention(q, kc, vc, bt, lens, qsl, 7, 0.125)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fn", [torch.ops.vegas.paged_verify_attention, ops._pva_fallback],
                         ids=["kernel", "fallback"])
def test_bad_input(fn):
    q, kc, vc, bt, lens, qsl = _case([3], [70], 9, 3, 64, 32, torch.float32)
    with pytest.raises(ERR, match="num_queries"):
        fn(q, kc, vc, bt, lens, qsl, 0, 0.125)
    with pytest.raises(ERR, match="scale"):
        fn(q, kc, vc, bt, lens, qsl, 3, float("nan"))
    with pytest.raises(ERR, match="H_q"):
        fn(q[:, :8], kc, vc, bt, lens, qsl, 3, 0.125)
    with pytest.raises(ERR, match="seq_lens"):
        fn(q, kc, vc, bt, torch.tensor([2], dtype=torch.int32), qsl, 3, 0.125)
    with pytest.raises(ERR, match="block_table"):
        bad = bt.clone()
        bad[0, 0] = -1
        fn(q, kc, vc, bad, lens, qsl, 3, 0.125)
    with pytest.raises(ERR, match="query_start_loc"):
        fn(q, kc, vc, bt, lens, torch.tensor([0, 5], dtype=torch.int32), 3, 0.125)
    with pytest.raises(ERR, match="value_cache"):
        fn(q, kc, vc[:, :, :16], bt, lens, qsl, 3, 0.125)
    with pytest.raises(ERR, match="value_cache dtype"):
        fn(q, kc, vc.bfloat16(), bt, lens, qsl, 3, 0.125)
    with pytest.raises(ERR, match="dtype"):
        fn(q.bfloat16(), kc, vc, bt, lens, qsl, 3, 0.125)


# The CUDA kernel (csrc/cuda/paged_verify_attention_kernel.cuh) compiled as host C++ against the
# software emulation (tests/cuda_emu.py); evidence of indexing and numerics, not of GPU behaviour.
EMU_CASES = [
    # (q_lens, seq_lens, Hq, Hkv, D, page_size)
    ([7], [300], 9, 3, 64, 32),              # GQA 3, mid-page end
    ([1, 5, 0, 3], [33, 161, 20, 64], 8, 2, 80, 16),  # ragged, a request without queries, D 80
    ([12, 2], [12, 40], 4, 1, 20, 7),        # a whole prefill (48 rows: 3 passes), odd page size, D 20
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", EMU_CASES, ids=lambda c: f"R{len(c[0])}S{max(c[1])}H{c[2]}-{c[3]}D{c[4]}ps{c[5]}")
def test_cuda_kernel_emulated(case, dtype):
    from cuda_emu import load_emulator

    emu = load_emulator()
    q_lens, seq_lens, Hq, Hkv, D, ps = case
    q, kc, vc, bt, lens, qsl = _case(q_lens, seq_lens, Hq, Hkv, D, ps, dtype, layout="flash")
    for nq, chunk in ((7, 40), (1, 256)):  # short chunks: several CTAs per request
        out, sc = emu.paged_verify_attention(q, kc, vc, bt, lens, qsl, nq, D ** -0.5, chunk, 0)
        want_out, want_sc = reference.paged_verify_attention(q, kc, vc, bt, lens, qsl, nq, D ** -0.5)
        otol = 2e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out, want_out, atol=otol, rtol=otol)
        torch.testing.assert_close(sc, want_sc, atol=5e-5, rtol=5e-5)


def test_cuda_kernel_emulated_checks_and_guards():
    """Value checks on request name the argument; without them a bad request gets NaN scores."""
    from cuda_emu import load_emulator

    emu = load_emulator()
    q, kc, vc, bt, lens, qsl = _case([3], [70], 9, 3, 64, 32, torch.float32, layout="flash")
    bad_lens = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(ERR, match="seq_lens"):
        emu.paged_verify_attention(q, kc, vc, bt, bad_lens, qsl, 3, 0.125, 256, 1)
    _, sc = emu.paged_verify_attention(q, kc, vc, bt, bad_lens, qsl, 3, 0.125, 256, 0)
    assert torch.isnan(sc).all()
    with pytest.raises(ERR, match="value_cache"):
        emu.paged_verify_attention(q, kc, vc[:, :2], bt, lens, qsl, 3, 0.125, 256, 0)


# score_block_size: token-granular (or any block size) scores from the same pass
SB_CASES = [
    # (q_lens, seq_lens, Hq, Hkv, D, page_size)
    ([7], [300], 9, 3, 64, 32),
    ([1, 7, 0, 5], [33, 1000, 20, 129], 8, 2, 64, 32),  # ragged, a request without queries
    ([5, 2], [77, 9], 6, 1, 128, 7),                    # odd page size, MQA
    ([7, 3], [700, 257], 8, 4, 80, 128),                # page 128: chunks of one page
]


@pytest.mark.parametrize("sb", [1, 3, 16, 48, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", SB_CASES, ids=lambda c: f"R{len(c[0])}S{max(c[1])}H{c[2]}-{c[3]}D{c[4]}ps{c[5]}")
def test_score_block_size_matches_reference(case, dtype, sb):
    q_lens, seq_lens, Hq, Hkv, D, ps = case
    q, kc, vc, bt, lens, qsl = _case(q_lens, seq_lens, Hq, Hkv, D, ps, dtype)
    out, sc = torch.ops.vegas.paged_verify_attention(q, kc, vc, bt, lens, qsl, 7, D ** -0.5, sb)
    want_out, want_sc = reference.paged_verify_attention(q, kc, vc, bt, lens, qsl, 7, D ** -0.5, sb)
    P = bt.shape[1]
    assert sc.shape == (len(q_lens), Hkv, -(-P * ps // sb)) and sc.dtype == torch.float32
    otol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, want_out, atol=otol, rtol=otol)
    stol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(sc, want_sc, atol=stol, rtol=stol)
    # the output does not depend on the score blocks
    out_page, _ = torch.ops.vegas.paged_verify_attention(q, kc, vc, bt, lens, qsl, 7, D ** -0.5)
    assert torch.equal(out, out_page)


@pytest.mark.parametrize("threads", [1, 2])
def test_token_scores_sum_to_page_scores(threads):
    """Scores at block size 1 summed over each page are the page scores (split or not)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for (q_lens, seq_lens, Hq, Hkv, D, ps) in SB_CASES:
            q, kc, vc, bt, lens, qsl = _case(q_lens, seq_lens, Hq, Hkv, D, ps, torch.float32, seed=7)
            for nq in (1, 7):
                _, tok = ops.paged_verify_attention(q, kc, vc, bt, lens, qsl, nq, 0.125, score_block_size=1)
                _, page = ops.paged_verify_attention(q, kc, vc, bt, lens, qsl, nq, 0.125)
                assert tok.shape[-1] == bt.shape[1] * ps
                torch.testing.assert_close(tok.view(*page.shape, ps).sum(-1), page, atol=1e-5, rtol=1e-5)
                for r, L in enumerate(seq_lens):
                    assert torch.all(tok[r, :, L:] == 0)
                    if q_lens[r]:
                        assert torch.all(tok[r, :, :L] >= 0)
                    else:  # no query, no mass (the kernel writes every score: its outputs start uninitialized)
                        assert torch.all(tok[r] == 0) and torch.all(page[r] == 0)
    finally:
        torch.set_num_threads(old)


def test_score_block_size_opcheck_fallback_and_bad_input():
    q, kc, vc, bt, lens, qsl = _case([3, 2], [70, 40], 9, 3, 64, 32, torch.float32)
    torch.library.opcheck(torch.ops.vegas.paged_verify_attention.default, (q, kc, vc, bt, lens, qsl, 4, 0.125, 1))
    got = ops._pva_fallback(q, kc, vc, bt, lens, qsl, 4, 0.125, 1)
    want = torch.ops.vegas.paged_verify_attention(q, kc, vc, bt, lens, qsl, 4, 0.125, 1)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    for fn in (torch.ops.vegas.paged_verify_attention, ops._pva_fallback):
        with pytest.raises(ERR, match="score_block_size"):
            fn(q, kc, vc, bt, lens, qsl, 4, 0.125, 0)
