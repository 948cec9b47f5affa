"""The lean draft forward (vegas_ext.draft_forward) and its op vegas::rope_kv_write: the lean
forward computes what the model's own forward computes in draft mode (logits and the K/V written),
for every supported family and draft-weights kind; decoding with it stays plain greedy; models it
does not reproduce fall back; the op equals its reference and names bad arguments."""
import pytest
import torch

import vegas_ext
from vegas_ext import decode, draft_forward, ops, reference
from vegas_ext.attention import AttentionState, patched
from vegas_ext.cache import VegasCache
from vegas_ext.decode import _cache_kwarg
from vegas_ext.draft_weights import draft_weights_for

from decode_utils import FAMILIES, first_diff, hf_greedy, make_model, make_prompts

ERR = (RuntimeError, ValueError)
KW = dict(num_speculative_tokens=3, gamma_policy="fixed", sparse_attn_ratio=0.3, sparse_attn_min_tokens=8)


def _draft_state(model, lens, seed=0):
    """A cache with random K/V and ``lens`` tokens per row, and a draft-mode state over random
    1-token blocks before a 3-token tail."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    cache = VegasCache.for_model(model, B, max(lens) + 4)
    for lay in cache.layers:
        lay.keys.copy_(torch.randn(lay.keys.shape, generator=g))
        lay.values.copy_(torch.randn(lay.values.shape, generator=g))
    cache.commit(torch.tensor(lens, dtype=torch.int32))
    st = AttentionState(cache=cache, mode="draft", block_size=1)
    L, H = len(cache.layers), cache.layers[0].num_heads
    K = 5
    idx = torch.stack([torch.randperm(min(lens) - 3, generator=g)[:K].sort().values for _ in range(L * B * H)])
    st.block_indices = idx.view(L, B, H, K).int()
    st.tail_start = (cache.lengths - 3).int()
    return cache, st


def _snapshot(cache, B):
    """The K/V of every layer at the positions the current forward writes."""
    rows = torch.arange(B)[:, None]
    return [(lay.keys[rows, :, cache._write_pos].clone(), lay.values[rows, :, cache._write_pos].clone())
            for lay in cache.layers]


@pytest.mark.parametrize("kind", [None, "fp16", "int8"], ids=["fp32", "fp16", "int8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lean_draft_computes_the_models_draft(family, kind):
    model = make_model(family, seed=3)
    dw = draft_weights_for(model, kind)
    lens = [40, 33]
    cache, st = _draft_state(model, lens)
    lean = draft_forward.lean_draft(model, dw)
    assert lean is not None
    ids = torch.tensor([[5], [9]])
    pos = torch.tensor([[lens[0]], [lens[1]]])
    import contextlib

    inst = dw.installed() if dw is not None else contextlib.nullcontext()
    act = dw.active() if dw is not None else contextlib.nullcontext()
    with torch.inference_mode(), patched(model), st.activate(), inst:
        with act:
            cache.begin_forward(1)
            want = model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{_cache_kwarg(model): cache}).logits
        want_kv = _snapshot(cache, 2)
        rows = torch.arange(2)[:, None]
        for lay in cache.layers:  # the lean forward must write them itself
            lay.keys[rows, :, cache._write_pos] = 0.0
            lay.values[rows, :, cache._write_pos] = 0.0
        cache.begin_forward(1)
        got = lean(ids, pos, st)
        got_kv = _snapshot(cache, 2)
    assert got.shape == want.shape == (2, 1, model.config.vocab_size)
    # int8: the kernel rounds x to int16 steps of max|x| / 32767 per group, so an ulp of difference
    # upstream (the lean RMSNorm) can move one input by a step
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 if kind == "int8" else 1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for (gk, gv), (wk, wv) in zip(got_kv, want_kv):
        torch.testing.assert_close(gk, wk, rtol=1e-5, atol=1e-4 if kind == "int8" else 1e-6)
        torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-4 if kind == "int8" else 1e-6)


@pytest.mark.parametrize("kind", [None, "int8"], ids=["fp32", "int8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_with_the_lean_draft_is_plain_greedy(family, kind, monkeypatch):
    calls = []
    real = draft_forward.LeanDraft.__call__
    monkeypatch.setattr(draft_forward.LeanDraft, "__call__",
                        lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    model = make_model(family, seed=11)
    ids, mask = make_prompts(model.config.vocab_size, [50, 37], seed=12)
    ref = hf_greedy(model, ids, mask, 24, eos_token_id=[])
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=24, eos_token_id=[], draft_weights=kind, **KW)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    assert calls
    n = len(calls)
    monkeypatch.setattr(decode, "lean_draft", lambda *a: None)  # the model's own forward drafts the same tokens
    off = vegas_ext.generate(model, ids, mask, max_new_tokens=24, eos_token_id=[], draft_weights=kind, **KW)
    assert len(calls) == n and torch.equal(off.sequences, ref)
    assert abs(off.stats["draft_acceptance_rate"] - out.stats["draft_acceptance_rate"]) <= 0.02
    assert out.stats["draft_acceptance_rate"] > 0.1


def test_quest_hooks_run_in_the_lean_draft():
    model = make_model("llama", seed=4)
    ids, mask = make_prompts(model.config.vocab_size, [60, 41], seed=5)
    ref = hf_greedy(model, ids, mask, 20, eos_token_id=[])
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=20, eos_token_id=[], sparse_attn_algorithm="quest",
                             block_size=4, draft_weights="int8", **KW)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    assert out.stats["draft_acceptance_rate"] > 0.2


def test_models_it_does_not_reproduce_draft_through_their_forward():
    model = make_model("llama", seed=6)
    assert draft_forward.lean_draft(model) is not None
    seen = []
    h = model.model.layers[1].mlp.register_forward_hook(lambda m, i, o: seen.append(1))
    try:
        assert draft_forward.lean_draft(model) is None  # a hook it would skip
        ids, mask = make_prompts(model.config.vocab_size, [30], seed=7)
        ref = hf_greedy(model, ids, mask, 12, eos_token_id=[])
        seen.clear()
        out = vegas_ext.generate(model, ids, mask, max_new_tokens=12, eos_token_id=[], draft_weights="int8", **KW)
        assert torch.equal(out.sequences, ref)
        assert out.stats["num_draft_tokens"] > 0  # every draft ran the hooked module
        assert len(seen) >= out.stats["num_draft_tokens"] + out.stats["num_iterations"]
    finally:
        h.remove()
    assert draft_forward.lean_draft(make_model("llama", seed=6).to(torch.bfloat16)) is None
    assert draft_forward.lean_draft(make_model("llama", seed=6, hidden_act="gelu")) is None


def test_fused_copies_are_views_and_follow_edits():
    # q/k/v with biases; packed int8 fuses whole 16-row blocks only: heads of 16 (q 64, k / v 32 rows)
    model = make_model("qwen2", seed=8, num_attention_heads=4)
    odd = make_model("qwen2")  # heads of 10: k / v of 20 rows stay apart
    oa = odd.model.layers[0].self_attn
    assert draft_weights_for(odd, "int8").fused((oa.q_proj, oa.k_proj, oa.v_proj)) is None
    assert draft_weights_for(odd, "int8").fused((odd.model.layers[0].mlp.gate_proj, odd.model.layers[0].mlp.up_proj))
    dw = draft_weights_for(model, "int8")
    a = model.model.layers[0].self_attn
    f = dw.fused((a.q_proj, a.k_proj, a.v_proj))
    assert f is not None and f.bias is not None
    cq = dw._copies[id(a.q_proj)]
    assert cq.weight.untyped_storage().data_ptr() == f.weight.untyped_storage().data_ptr()
    assert f.weight.shape[0] * 16 == a.q_proj.out_features + a.k_proj.out_features + a.v_proj.out_features
    nbytes = dw.nbytes
    with torch.no_grad():
        a.k_proj.weight.mul_(2.0)
    dw = draft_weights_for(model, "int8")  # generate's refresh
    f2 = dw.fused((a.q_proj, a.k_proj, a.v_proj))
    assert f2 is not None and f2 is not f and dw.nbytes == nbytes
    k0 = a.q_proj.out_features // 16
    torch.testing.assert_close(f2.weight[k0:k0 + a.k_proj.out_features // 16], dw._copies[id(a.k_proj)].weight)
    ids, mask = make_prompts(model.config.vocab_size, [40], seed=9)
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=16, eos_token_id=[], draft_weights="int8", **KW)
    assert torch.equal(out.sequences, hf_greedy(model, ids, mask, 16, eos_token_id=[]))
    assert out.stats["draft_acceptance_rate"] > 0.2


# ------------------------------------------------------------------------------ vegas::rope_kv_write
def _rkw_args(B=2, Q=3, Hq=6, Hkv=2, D=16, S=20, dtype=torch.float32, seed=0, fused=False):
    g = torch.Generator().manual_seed(seed)
    if fused:  # head views of one fused projection, as the lean forward passes them
        qkv = torch.randn(B, Q, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], -1)
        q, k, v = q.view(B, Q, Hq, D), k.view(B, Q, Hkv, D), v.view(B, Q, Hkv, D)
    else:
        q = torch.randn(B, Q, Hq, D, generator=g).to(dtype)
        k = torch.randn(B, Q, Hkv, D, generator=g).to(dtype)
        v = torch.randn(B, Q, Hkv, D, generator=g).to(dtype)
    ang = torch.rand(B, Q, D, generator=g) * 6
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    kc = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    vc = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    start = torch.tensor([S - Q, 2, 0, (S - Q) // 2])[:B]
    pos = start[:, None] + torch.arange(Q)
    return q, k, v, cos, sin, kc, vc, pos


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused_views"])
@pytest.mark.parametrize("shape", [(1, 1, 9, 3, 64, 30), (2, 3, 6, 2, 16, 20), (4, 1, 4, 4, 2, 5)],
                         ids=lambda s: "B{}Q{}Hq{}Hkv{}D{}S{}".format(*s))
def test_rope_kv_write_equals_reference(shape, fused):
    B, Q, Hq, Hkv, D, S = shape
    a = _rkw_args(B, Q, Hq, Hkv, D, S, fused=fused)
    b = [t.clone() for t in a]
    got = ops.rope_kv_write(*a)
    want = reference.rope_kv_write(*b)
    assert got.shape == (B, Q, Hq, D) and got.is_contiguous()
    assert torch.equal(got, want)  # the same roundings: bit for bit in float32
    assert torch.equal(a[5], b[5]) and torch.equal(a[6], b[6])  # caches, untouched positions included


def test_rope_kv_write_equals_transformers_rotation():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, v, cos, sin, kc, vc, pos = _rkw_args()
    qe, ke = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    got = ops.rope_kv_write(q, k, v, cos, sin, kc, vc, pos)
    assert torch.equal(got, qe.transpose(1, 2))
    rows = torch.arange(2)[:, None]
    assert torch.equal(kc[rows, :, pos], ke.transpose(1, 2)) and torch.equal(vc[rows, :, pos], v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_kv_write_half_dtypes(dtype):
    a = _rkw_args(dtype=dtype, seed=4)
    b = [t.clone() for t in a]
    got = ops.rope_kv_write(*a)
    torch.testing.assert_close(got, reference.rope_kv_write(*b), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(a[5], b[5], rtol=2e-2, atol=2e-2)
    assert torch.equal(a[6], b[6])


def test_rope_kv_write_opcheck():
    torch.library.opcheck(torch.ops.vegas.rope_kv_write.default, _rkw_args())


@pytest.mark.parametrize("i,bad,match", [
    (0, lambda t: t[..., :15], "D must be even"),
    (0, lambda t: t.double(), "q must be float32"),
    (1, lambda t: t[:, :, :, :8], "k must have shape"),
    (2, lambda t: t[:, :, :1], "v must have the heads of k"),
    (3, lambda t: t[:, :2], "cos must have shape"),
    (4, lambda t: t.half(), "sin dtype"),
    (5, lambda t: t[:1], "k_cache must have shape"),
    (6, lambda t: t[:, :, :5], "v_cache must have the length"),
    (7, lambda t: t.int(), "write_pos must be int64"),
    (7, lambda t: t + 100, "write_pos"),
    (7, lambda t: t[:, :1], "write_pos must have shape"),
    (1, lambda t: t.transpose(2, 3).contiguous().transpose(2, 3), "stride"),
])
def test_rope_kv_write_bad_input_names_the_argument(i, bad, match):
    a = list(_rkw_args())
    a[i] = bad(a[i])
    with pytest.raises(ERR, match=match):
        ops.rope_kv_write(*a)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        ops.rope_kv_write(None, *a[1:])


# ------------------------------------------------------------------------------- vegas::add_rms_norm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 576), (4, 1, 64), (2, 3, 17), (5, 1)], ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "noadd"])
def test_add_rms_norm_equals_reference(shape, dtype, with_residual):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype) if with_residual else None
    w = torch.randn(shape[-1], generator=g).to(dtype)
    x2 = x.clone()
    got = ops.add_rms_norm(x, r, w, 1e-5)
    want = reference.add_rms_norm(x2, r, w, 1e-5)
    assert torch.equal(x, x2)  # the same in-place sum (or none)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **tol)


def test_add_rms_norm_equals_transformers_rmsnorm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    mod = LlamaRMSNorm(96, eps=1e-6)
    with torch.no_grad():
        mod.weight.normal_()
    x = torch.randn(3, 2, 96)
    torch.testing.assert_close(ops.add_rms_norm(x.clone(), None, mod.weight.detach(), 1e-6), mod(x).detach(),
                               rtol=1e-5, atol=1e-6)


def test_add_rms_norm_opcheck():
    torch.library.opcheck(torch.ops.vegas.add_rms_norm.default, (torch.randn(2, 8), torch.randn(2, 8),
                                                                 torch.randn(8), 1e-5))
    torch.library.opcheck(torch.ops.vegas.add_rms_norm.default, (torch.randn(2, 8), None, torch.randn(8), 1e-5))


@pytest.mark.parametrize("name,make,match", [
    ("x", lambda x, r, w: (x.t(), r.t(), w), "x must be contiguous"),
    ("x", lambda x, r, w: (x.double(), r.double(), w.double()), "x must be float32"),
    ("weight", lambda x, r, w: (x, r, w[:5]), "weight must have shape"),
    ("weight", lambda x, r, w: (x, r, w.half()), "weight dtype"),
    ("residual", lambda x, r, w: (x, r[:1], w), "residual must have the shape"),
    ("residual", lambda x, r, w: (x, r.half(), w), "residual dtype"),
])
def test_add_rms_norm_bad_input_names_the_argument(name, make, match):
    x, r, w = make(torch.randn(4, 8), torch.randn(4, 8), torch.randn(8))
    with pytest.raises(ERR, match=match):
        ops.add_rms_norm(x, r, w, 1e-5)
    with pytest.raises(ERR, match="eps"):
        ops.add_rms_norm(torch.randn(4, 8), None, torch.randn(8), -1.0)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        ops.add_rms_norm(torch.randn(4, 8), None, [1.0] * 8, 1e-5)


# ----------------------------------------------------------------------------------- vegas::silu_mul
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 3072), (4, 1, 256), (3, 2, 10), (2,)], ids=str)
def test_silu_mul_equals_reference(shape, dtype):
    gu = (torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    got = ops.silu_mul(gu)
    g, u = gu.chunk(2, -1)
    want = torch.nn.functional.silu(g) * u  # transformers' act_fn(gate) * up
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got, reference.silu_mul(gu), **tol)
    strided = torch.randn(*shape[:-1], shape[-1] * 2)[..., ::2].to(dtype)  # not contiguous
    torch.testing.assert_close(ops.silu_mul(strided), reference.silu_mul(strided), **tol)


def test_silu_mul_opcheck_and_bad_input():
    torch.library.opcheck(torch.ops.vegas.silu_mul.default, (torch.randn(3, 8),))
    with pytest.raises(ERR, match="gate_up's last dimension must be even"):
        ops.silu_mul(torch.randn(2, 7))
    with pytest.raises(ERR, match="gate_up must be float32"):
        ops.silu_mul(torch.randn(2, 8).double())
    with pytest.raises(TypeError, match="gate_up must be a torch.Tensor"):
        ops.silu_mul([1.0, 2.0])


def test_prefill_cache_is_reused_with_draft_weights():
    """The draft weights' forward wrappers (installed for the whole call) compute the original
    outside drafts: they must not make the model unfingerprintable (every prefill was recomputed)."""
    model = make_model("llama", seed=3)
    ids, mask = make_prompts(model.config.vocab_size, [40], seed=2)
    pc = {}
    kw = dict(max_new_tokens=8, eos_token_id=[], prefill_cache=pc, **KW)
    vegas_ext.generate(model, ids, mask, sparse_attn_algorithm="full", **kw)
    for dw in ("int8", "int8", None):
        out = vegas_ext.generate(model, ids, mask, draft_weights=dw, **kw)
        assert out.stats["prefill_reused"] and out.stats["prefill_miss"] is None, out.stats["prefill_miss"]
        assert torch.equal(out.sequences, hf_greedy(model, ids, mask, 8, eos_token_id=[]))
