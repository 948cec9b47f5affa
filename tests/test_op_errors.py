"""Bad input raises RuntimeError/ValueError naming the argument -- never a crash or garbage.
Checked for the compiled CPU kernels (torch.ops.vegas.*) and for the reference fallback."""
import pytest
import torch

from vegas_ext import ops

ERR = (RuntimeError, ValueError)
B, Q, Hq, Hkv, D, S, BS = 2, 3, 8, 2, 64, 40, 16


def base():
    q = torch.randn(B, Q, Hq, D)
    k = torch.randn(B, Hkv, S, D)
    v = torch.randn(B, Hkv, S, D)
    lens = torch.tensor([S, 20], dtype=torch.int32)
    return q, k, v, lens


def verify_args(**over):
    q, k, v, lens = base()
    a = dict(q=q, k_cache=k, v_cache=v, seq_lens=lens, block_size=BS, scale=0.125, query_weights=None)
    a.update(over)
    return a


def call_verify(impl, a):
    if impl == "kernel":
        return torch.ops.vegas.verify_attention(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"], a["block_size"],
                                                a["scale"], a["query_weights"])
    return ops._verify_fallback(**a)


VERIFY_BAD = {
    "q rank": (dict(q=torch.randn(B, Q, Hq * D)), "q"),
    "k rank": (dict(k_cache=torch.randn(B, Hkv, S)), "k_cache"),
    "v shape": (dict(v_cache=torch.randn(B, Hkv, S - 1, D)), "v_cache"),
    "batch": (dict(k_cache=torch.randn(B + 1, Hkv, S, D), v_cache=torch.randn(B + 1, Hkv, S, D)), "batch"),
    "head_dim": (dict(k_cache=torch.randn(B, Hkv, S, D + 1), v_cache=torch.randn(B, Hkv, S, D + 1)), "head_dim"),
    "gqa": (dict(k_cache=torch.randn(B, 3, S, D), v_cache=torch.randn(B, 3, S, D)), "multiple"),
    "dtype": (dict(k_cache=torch.randn(B, Hkv, S, D, dtype=torch.bfloat16)), "dtype"),
    "q dtype": (dict(q=torch.randn(B, Q, Hq, D, dtype=torch.float64)), "q must be"),
    "seq_lens dtype": (dict(seq_lens=torch.tensor([S, 20])), "seq_lens"),
    "seq_lens shape": (dict(seq_lens=torch.tensor([S], dtype=torch.int32)), "seq_lens"),
    "seq_lens too long": (dict(seq_lens=torch.tensor([S + 1, 20], dtype=torch.int32)), "seq_lens"),
    "seq_lens < Q": (dict(seq_lens=torch.tensor([S, Q - 1], dtype=torch.int32)), "seq_lens"),
    "block_size": (dict(block_size=0), "block_size"),
    "scale": (dict(scale=float("nan")), "scale"),
    "Q > S": (dict(q=torch.randn(B, S + 1, Hq, D)), "Q"),
    "weights shape": (dict(query_weights=torch.ones(Q + 1)), "query_weights"),
    "weights dtype": (dict(query_weights=torch.ones(Q, dtype=torch.float64)), "query_weights"),
}


@pytest.mark.parametrize("impl", ["kernel", "fallback"])
@pytest.mark.parametrize("name", list(VERIFY_BAD))
def test_verify_bad_input(name, impl):
    over, needle = VERIFY_BAD[name]
    with pytest.raises(ERR, match=needle):
        call_verify(impl, verify_args(**over))


def test_verify_device_mismatch_named():
    a = verify_args(seq_lens=torch.tensor([S, 20], dtype=torch.int32, device="meta"))
    with pytest.raises(ERR, match="seq_lens"):
        call_verify("kernel", a)


def draft_args(**over):
    q, k, v, lens = base()
    q = q[:, :1]
    a = dict(
        q=q, k_cache=k, v_cache=v,
        block_indices=torch.tensor([[[0, -1]] * Hkv, [[1, 0]] * Hkv], dtype=torch.int32),
        tail_start=torch.tensor([30, 10], dtype=torch.int32), seq_lens=lens, block_size=BS, scale=0.125,
    )
    a.update(over)
    return a


def call_draft(impl, a):
    if impl == "kernel":
        return torch.ops.vegas.sparse_draft_attention(**a)
    return ops._draft_fallback(**a)


DRAFT_BAD = {
    "index too large": (dict(block_indices=torch.tensor([[[3, -1]] * Hkv, [[1, 0]] * Hkv], dtype=torch.int32)),
                       "block_indices"),
    "index below -1": (dict(block_indices=torch.tensor([[[-2, -1]] * Hkv, [[1, 0]] * Hkv], dtype=torch.int32)),
                      "block_indices"),
    "duplicate": (dict(block_indices=torch.tensor([[[1, 1]] * Hkv, [[1, 0]] * Hkv], dtype=torch.int32)),
                 "block_indices"),
    "indices dtype": (dict(block_indices=torch.zeros(B, Hkv, 2, dtype=torch.int64)), "block_indices"),
    "indices heads": (dict(block_indices=torch.zeros(B, Hkv + 1, 2, dtype=torch.int32)), "block_indices"),
    "tail past seq_lens - Q": (dict(tail_start=torch.tensor([S, 10], dtype=torch.int32)), "tail_start"),
    "tail negative": (dict(tail_start=torch.tensor([-1, 10], dtype=torch.int32)), "tail_start"),
    "tail dtype": (dict(tail_start=torch.tensor([3, 1])), "tail_start"),
    "block_size": (dict(block_size=-3), "block_size"),
    "gqa": (dict(q=torch.randn(B, 1, 7, D)), "multiple"),
}


@pytest.mark.parametrize("impl", ["kernel", "fallback"])
@pytest.mark.parametrize("name", list(DRAFT_BAD))
def test_draft_bad_input(name, impl):
    over, needle = DRAFT_BAD[name]
    with pytest.raises(ERR, match=needle):
        call_draft(impl, draft_args(**over))


def topk_args(**over):
    a = dict(
        block_scores=torch.rand(2, 3, 10),
        k=torch.tensor([2, 3], dtype=torch.int32),
        num_candidates=torch.tensor([10, 5], dtype=torch.int32),
        max_k=4,
        num_sink_blocks=1,
    )
    a.update(over)
    return a


TOPK_BAD = {
    "scores rank": (dict(block_scores=torch.rand(2, 10)), "block_scores"),
    "scores dtype": (dict(block_scores=torch.rand(2, 3, 10, dtype=torch.float64)), "block_scores"),
    "k dtype": (dict(k=torch.tensor([2, 3])), "k"),
    "k shape": (dict(k=torch.tensor([2], dtype=torch.int32)), "k"),
    "k negative": (dict(k=torch.tensor([2, -1], dtype=torch.int32)), "k"),
    "candidates negative": (dict(num_candidates=torch.tensor([-2, 1], dtype=torch.int32)), "num_candidates"),
    "max_k": (dict(max_k=-1), "max_k"),
    "sinks": (dict(num_sink_blocks=-1), "num_sink_blocks"),
}


@pytest.mark.parametrize("impl", ["kernel", "fallback"])
@pytest.mark.parametrize("name", list(TOPK_BAD))
def test_topk_bad_input(name, impl):
    over, needle = TOPK_BAD[name]
    fn = torch.ops.vegas.block_topk if impl == "kernel" else ops._topk_fallback
    with pytest.raises(ERR, match=needle):
        fn(**topk_args(**over))


# --- non-finite inputs, extreme block sizes, autograd, fakes ---------------------------------


@pytest.mark.parametrize("S", [10, 2048])  # 2048: several token splits per row
@pytest.mark.parametrize("where", ["q", "k"])
def test_nan_propagates_instead_of_vanishing(S, where):
    """NaN in q or k gives NaN outputs (as the reference), never a plausible finite answer."""
    q, k, v = torch.randn(1, 1, 2, 16), torch.randn(1, 1, S, 16), torch.randn(1, 1, S, 16)
    (q if where == "q" else k)[0, 0, 0 if where == "q" else 3, 0] = float("nan")
    lens = torch.tensor([S], dtype=torch.int32)
    out, lse, bsc = torch.ops.vegas.verify_attention(q, k, v, lens, 16, 0.25, None)
    assert torch.isnan(out[0, 0, 0]).all() and torch.isnan(lse[0, 0]).all()
    assert not torch.isinf(bsc).any()
    idx = torch.tensor([[[0]]], dtype=torch.int32)
    d = torch.ops.vegas.sparse_draft_attention(q, k, v, idx, torch.tensor([S - 1], dtype=torch.int32), lens, 16, 0.25)
    assert torch.isnan(d[0, 0, 0]).all()


def test_pos_inf_key_matches_reference_and_neg_inf_score_is_masked():
    S = 2048
    for sign in (1.0, -1.0):
        q, k, v = torch.randn(1, 1, 1, 16), torch.randn(1, 1, S, 16), torch.randn(1, 1, S, 16)
        q[..., 0] = sign * q[..., 0].abs()
        k[0, 0, 100, 0] = float("inf")
        lens = torch.tensor([S], dtype=torch.int32)
        got = torch.ops.vegas.verify_attention(q, k, v, lens, 16, 0.25, None)[0]
        want = ops.reference.verify_attention(q, k, v, lens, 16, 0.25)[0]
        torch.testing.assert_close(got, want, equal_nan=True)


def _huge_block_impl(impl):
    """(verify, draft, dtype, device) of one implementation: the compiled CPU kernels, the
    CUDA kernels in the host emulation (tensor-core path on bf16, SIMT path on fp32; CUDA
    defaults: no host-side value checks), or the CUDA kernels on a GPU."""
    if impl == "cpu":
        return torch.ops.vegas.verify_attention, torch.ops.vegas.sparse_draft_attention, torch.float32, "cpu"
    if impl == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        return torch.ops.vegas.verify_attention, torch.ops.vegas.sparse_draft_attention, torch.float32, "cuda"
    from cuda_emu import load_emulator

    emu = load_emulator()
    simt = impl == "emu-simt"
    dtype = torch.float32 if simt else torch.bfloat16

    def verify(q, k, v, lens, bs, scale, w):
        return emu.verify_attention(q, k, v, lens, bs, scale, w, simt, 3, -1, 1)

    def draft(q, k, v, idx, tail, lens, bs, scale):
        return emu.sparse_draft_attention(q, k, v, idx, tail, lens, bs, scale, simt, 3, -1, 1)

    return verify, draft, dtype, "cpu"


@pytest.mark.parametrize("impl", ["cpu", "emu-mma", "emu-simt", "cuda"])
@pytest.mark.parametrize("block_size", [2**62, 2**63 - 1, 2**62 + 5, 2**31 + 3, S + 1, S])
def test_huge_block_size_is_one_block(block_size, impl):
    """Any block_size >= S is one block holding the whole cache, on every path: the
    launchers clamp it (min(block_size, S)) before any size check or narrowing, so values
    near 2^63 neither wrap nor truncate (2^62 + 5 must not act as block size 5)."""
    verify, draft, dtype, dev = _huge_block_impl(impl)
    q, k, v, lens = (t.to(dev) for t in base())
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out, lse, bsc = verify(q, k, v, lens, block_size, 0.125, None)
    assert bsc.shape == (B, Hkv, 1)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(bsc[..., 0].cpu(), torch.full((B, Hkv), float(Q * Hq // Hkv)), rtol=1e-5, atol=1e-4)
    ref = ops.reference.verify_attention(q, k, v, lens, S, 0.125)
    torch.testing.assert_close(out.float(), ref[0].float(), **tol)
    torch.testing.assert_close(lse, ref[1], rtol=1e-4, atol=1e-4)
    idx = torch.zeros(B, Hkv, 1, dtype=torch.int32, device=dev)
    tail = torch.tensor([30, 10], dtype=torch.int32, device=dev)
    d = draft(q[:, :1].contiguous(), k, v, idx, tail, lens, block_size, 0.125)
    want = ops.reference.sparse_draft_attention(q[:, :1], k, v, idx, tail, lens, S, 0.125)
    torch.testing.assert_close(d.float(), want.float(), **tol)


def test_k_and_v_with_different_strides():
    q, k, v, lens = base()
    v2 = v.transpose(1, 2).contiguous().transpose(1, 2)  # [B, Hkv, S, D] view with other strides
    got = torch.ops.vegas.verify_attention(q, k, v2, lens, BS, 0.125, None)[0]
    torch.testing.assert_close(got, ops.reference.verify_attention(q, k, v, lens, BS, 0.125)[0], rtol=1e-5, atol=1e-5)


def test_backward_raises_clear_error():
    q, k, v, lens = base()
    q.requires_grad_(True)
    out = torch.ops.vegas.verify_attention(q, k, v, lens, BS, 0.125, None)[0]
    with pytest.raises(RuntimeError, match="no backward"):
        out.sum().backward()


def test_quest_fakes_validate_like_kernels():
    q = torch.randn(2, 2, 4, 4, device="meta")
    mn = torch.randn(1, 2, 3, 4, device="meta")
    with pytest.raises(ERR, match="key_min"):
        torch.ops.vegas.quest_block_scores(q, mn, mn, torch.tensor([2, 2], dtype=torch.int32, device="meta"))
    k = torch.randn(2, 3, 40, 64, device="meta")
    with pytest.raises(ERR, match="key_min"):
        torch.ops.vegas.block_minmax_update(torch.zeros(2, 3, 4, 64, device="meta"),
                                            torch.zeros(2, 3, 4, 64, device="meta"), k,
                                            torch.zeros(2, dtype=torch.int32, device="meta"),
                                            torch.zeros(2, dtype=torch.int32, device="meta"), 16)


def test_messages_keep_their_numbers():
    """The numbers in a kernel's message survive formatting. An extension linked with a static
    libstdc++ (a compiler wrapper did that on one GPU image) garbles them here and crashes there."""
    q = torch.randn(2, 2, 4, 64)
    k = torch.randn(2, 2, 50, 64)
    bad = torch.tensor([51, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 51 must lie in \[Q, S\] = \[2, 50\]"):
        torch.ops.vegas.verify_attention(q, k, k, bad, 16, 0.125, None)
