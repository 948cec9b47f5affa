"""``generate(prefill_cache=...)`` reuses a stored prefill only for the model (weights, dtype,
device) that filled it."""
from __future__ import annotations

import pytest
import torch

import vegas_ext
from vegas_ext.prefill_cache import prefill_cache_is_for

from decode_utils import first_diff, hf_greedy, make_model, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

KW = dict(max_new_tokens=40, num_speculative_tokens=4, gamma_policy="fixed", sparse_attn_ratio=0.05,
          sparse_attn_min_tokens=16,
          block_size=8, eos_token_id=[])


def _prompt(vocab):
    return torch.randint(3, vocab, (1, 40), generator=torch.Generator().manual_seed(7))


def test_prefill_cache_of_another_model_is_not_reused():
    m1, m2 = make_model("llama", seed=23), make_model("llama", seed=99)  # same config, other weights
    ids = _prompt(m1.config.vocab_size)
    mask = torch.ones_like(ids)
    pc = {}
    o1 = vegas_ext.generate(m1, ids, **KW, prefill_cache=pc)
    assert not o1.stats["prefill_reused"] and prefill_cache_is_for(pc, m1) and not prefill_cache_is_for(pc, m2)
    o2 = vegas_ext.generate(m2, ids, **KW, prefill_cache=pc)
    ref2 = hf_greedy(m2, ids, mask, 40, eos_token_id=[])
    assert not o2.stats["prefill_reused"]
    assert torch.equal(o2.sequences, ref2), first_diff(o2.sequences, ref2)
    assert prefill_cache_is_for(pc, m2)  # refilled by m2
    o3 = vegas_ext.generate(m2, ids, **KW, prefill_cache=pc)
    assert o3.stats["prefill_reused"] and torch.equal(o3.sequences, ref2)
    o4 = vegas_ext.generate(m1, ids, **KW, prefill_cache=pc)
    assert not o4.stats["prefill_reused"] and torch.equal(o4.sequences, o1.sequences)


def test_prefill_cache_after_in_place_weight_change_or_dtype_change_is_not_reused():
    m = make_model("llama", seed=23)
    ids = _prompt(m.config.vocab_size)
    pc = {}
    vegas_ext.generate(m, ids, **KW, prefill_cache=pc)
    with torch.no_grad():
        m.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # same storage, new version
    assert not prefill_cache_is_for(pc, m)
    o = vegas_ext.generate(m, ids, **KW, prefill_cache=pc)
    ref = hf_greedy(m, ids, torch.ones_like(ids), 40, eos_token_id=[])
    assert not o.stats["prefill_reused"] and torch.equal(o.sequences, ref), first_diff(o.sequences, ref)
    m.to(torch.bfloat16)
    assert not prefill_cache_is_for(pc, m)
    o = vegas_ext.generate(m, ids, **KW, prefill_cache=pc)
    assert not o.stats["prefill_reused"] and o.stats["dtype"] == "bfloat16"
    assert pc["k"][0].dtype == torch.bfloat16


# --------------------------------------------------------------------------- case 008: the model's function
CASE_KW = dict(max_new_tokens=8, num_speculative_tokens=3, gamma_policy="fixed", eos_token_id=[], pad_token_id=0)


def _case_model_and_prompts():
    from decode_utils import make_prompts
    m = make_model("llama")
    ids, mask = make_prompts(256, [60, 45])
    return m, ids, mask


def _steer_hook(steer):
    return lambda mod, i, o: (o[0] + steer,) + tuple(o[1:]) if isinstance(o, tuple) else o + steer


def _add_hook(m, kind, steer):
    layer = m.model.layers[0]
    if kind == "forward":
        return layer.register_forward_hook(_steer_hook(steer))
    if kind == "forward_with_kwargs":
        return layer.register_forward_hook(lambda mod, a, kw, o: _steer_hook(steer)(mod, a, o), with_kwargs=True)
    if kind == "pre":
        return m.model.layers[1].register_forward_pre_hook(lambda mod, a: (a[0] + steer,) + tuple(a[1:]))
    if kind == "global":
        from torch.nn.modules.module import register_module_forward_hook

        def hook(mod, i, o):  # steers the first decoder layer only
            return _steer_hook(steer)(mod, i, o) if mod is layer else None
        return register_module_forward_hook(hook)
    raise KeyError(kind)


@pytest.mark.parametrize("kind", ["forward", "forward_with_kwargs", "pre", "global"])
def test_prefill_cache_is_not_reused_after_a_forward_hook_was_added(kind):
    m, ids, mask = _case_model_and_prompts()
    pc = {}
    o0 = vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
    assert not o0.stats["prefill_reused"] and o0.stats["prefill_miss"] == "empty"
    steer = torch.randn(64, generator=torch.Generator().manual_seed(0))
    handle = _add_hook(m, kind, steer)
    try:
        out = vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
        assert not out.stats["prefill_reused"]
        assert out.stats["prefill_miss"].startswith("not fingerprintable: a ")
        assert ("global" in out.stats["prefill_miss"]) == (kind == "global")
        ref = hf_greedy(m, ids, mask, 8, eos_token_id=[])
        assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
        assert not torch.equal(ref, o0.sequences)  # the hook does change the tokens
        assert not prefill_cache_is_for(pc, m)
    finally:
        handle.remove()
    # the hook gone, the model computes what filled the dict (nothing was stored meanwhile)
    back = vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
    assert back.stats["prefill_reused"] and back.stats["prefill_miss"] is None
    assert torch.equal(back.sequences, o0.sequences)


def _set_eps(m):
    for layer in m.model.layers:
        layer.input_layernorm.variance_epsilon = 0.5


def _replace_forward(m):
    m.model.layers[0].mlp.forward = lambda x: torch.zeros_like(x)


@pytest.mark.parametrize("change, why", [
    (_set_eps, "model changed: modules"),
    (lambda m: setattr(m.model.layers[0].self_attn, "scaling", 30.0), "model changed: modules"),
    (lambda m: setattr(m.config, "rms_norm_eps", 0.25), "model changed: config"),
    (_replace_forward, "not fingerprintable: model.model.layers.0.mlp.forward is a function"),
])
def test_prefill_cache_is_not_reused_after_a_module_attribute_or_config_changed(change, why):
    m, ids, mask = _case_model_and_prompts()
    pc = {}
    o0 = vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
    change(m)
    out = vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
    assert not out.stats["prefill_reused"] and out.stats["prefill_miss"] == why
    ref = hf_greedy(m, ids, mask, 8, eos_token_id=[])
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    if "config" not in why:  # the config value is read at construction only: same tokens
        assert not torch.equal(ref, o0.sequences)


def test_prefill_cache_unchanged_model_is_reused_plain_and_packed():
    m, ids, mask = _case_model_and_prompts()
    ref = hf_greedy(m, ids, mask, 8, eos_token_id=[])
    pc = {}
    first = vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
    again = vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
    assert not first.stats["prefill_reused"] and again.stats["prefill_reused"] and again.stats["prefill_miss"] is None
    assert torch.equal(first.sequences, ref) and torch.equal(again.sequences, ref)
    other = vegas_ext.generate(m, ids.flip(0), mask.flip(0), prefill_cache=pc, **CASE_KW)
    assert not other.stats["prefill_reused"] and other.stats["prefill_miss"] == "other prompt"
    assert vegas_ext.generate(m, ids, mask, **CASE_KW).stats["prefill_miss"] is None  # no dict, no miss
    from vegas_ext.packed_linear import can_pack, pack_linear_weights
    if can_pack(m.lm_head):  # oneDNN builds: packed linears keep their identity between calls
        pack_linear_weights(m, min_rows=1)
        pc = {}
        vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
        packed = vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
        assert packed.stats["prefill_reused"] and torch.equal(packed.sequences, ref)


@pytest.mark.parametrize("view", ["transposed", "neg"])
def test_prefill_cache_is_not_reused_after_a_weight_became_another_view_of_its_storage(view):
    """Regression (break test): a parameter replaced by a strided or negated view of its own storage
    (same storage address and version) changes the function: no reuse, exact tokens."""
    m, ids, mask = _case_model_and_prompts()
    pc = {}
    vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
    o = m.model.layers[0].self_attn.o_proj
    with torch.no_grad():
        o.weight = torch.nn.Parameter(o.weight.t() if view == "transposed" else o.weight._neg_view())
    out = vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
    assert not out.stats["prefill_reused"]
    assert torch.equal(out.sequences, hf_greedy(m, ids, mask, 8, eos_token_id=[]))


# --------------------------------------------------------------------------- case 014: inference tensors, enums
def _edit_in_place(m, how):
    """Edit every layer's v_proj in place (the prefill's V changes), as a server would."""
    ws = [layer.self_attn.v_proj.weight for layer in m.model.layers]
    with torch.inference_mode():
        if how == "mul_":
            for w in ws:
                w.mul_(-3.0)
        elif how == "load_state_dict":
            m.load_state_dict({k: v.clone() * (-3.0 if k.endswith("v_proj.weight") else 1.0)
                               for k, v in m.state_dict().items()})
        else:  # a merge of a low-rank delta: w += b @ a
            g = torch.Generator().manual_seed(3)
            for w in ws:
                w.add_(torch.randn(w.shape[0], 4, generator=g) @ torch.randn(4, w.shape[1], generator=g))


@pytest.mark.parametrize("how", ["mul_", "load_state_dict", "merge"])
def test_prefill_cache_is_never_reused_over_inference_tensor_weights(how):
    """An inference tensor has no version counter: an in-place edit of it cannot be seen, so such a
    model never reuses a prefill (it used to reuse a stale one: wrong tokens)."""
    with torch.inference_mode():  # as servers load weights
        m, ids, mask = _case_model_and_prompts()
    assert m.model.layers[0].self_attn.k_proj.weight.is_inference()
    pc = {}
    first = vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
    assert not first.stats["prefill_reused"] and "inference tensor" in first.stats["prefill_miss"]
    _edit_in_place(m, how)
    out = vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
    assert not out.stats["prefill_reused"] and "inference tensor" in out.stats["prefill_miss"]
    assert "inference_mode" in out.stats["prefill_miss"]  # the remedy
    ref = hf_greedy(m, ids, mask, 8, eos_token_id=[])
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    assert not torch.equal(ref, first.sequences)  # the edit does change the tokens


class _Mode(__import__("enum").Flag):
    INFERENCE = 1
    TRAINING = 2


@pytest.mark.parametrize("value", ["kernels", "flag", "enum_in_dict"])
def test_prefill_cache_is_reused_with_enum_and_flag_attributes(value):
    """transformers 5.25 with the ``kernels`` package sets ``model._kernels_mode`` to a
    ``kernels.Mode`` flag: a value, which must not block reuse (it used to, on every call)."""
    m, ids, mask = _case_model_and_prompts()
    if value == "kernels":
        kernels = pytest.importorskip("kernels")  # a fresh install has it (transformers pulls it in)
        m._kernels_mode = kernels.Mode.INFERENCE
    elif value == "flag":
        m._kernels_mode = _Mode.INFERENCE
    else:
        m.model.layers[0].modes = {"attn": _Mode.INFERENCE}
    pc = {}
    vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
    again = vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
    assert again.stats["prefill_reused"] and again.stats["prefill_miss"] is None
    m._kernels_mode = _Mode.TRAINING  # another value: another function, as far as we can tell
    changed = vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
    assert not changed.stats["prefill_reused"] and changed.stats["prefill_miss"] == "model changed: modules"


@pytest.mark.slow
def test_prefill_cache_is_reused_on_the_embedded_model_as_loaded():
    """The embedded model as ``load_model()`` returns it on a fresh install (packed linears, the
    ``kernels`` mode where transformers sets it): the second call copies the prefill."""
    from vegas_ext import models

    m, tok = models.load_model()
    ids = tok(["The quick brown fox jumps over the lazy dog. " * 8], return_tensors="pt").input_ids
    pc = {}
    kw = dict(max_new_tokens=4, num_speculative_tokens=2, gamma_policy="fixed", prefill_cache=pc)
    first = vegas_ext.generate(m, ids, **kw)
    again = vegas_ext.generate(m, ids, **kw)
    assert first.stats["prefill_miss"] == "empty"
    assert again.stats["prefill_reused"] and again.stats["prefill_miss"] is None
    assert torch.equal(first.sequences, again.sequences)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("module", ["embed", "v_proj", "lm_head"])
def test_prefill_cache_is_not_reused_after_a_dtype_round_trip(module, dtype):
    """Break test: ``module.to(low).to(float32)`` rounds the weights and gives them a new storage,
    which the allocator used to place at the freed storage's address: the fingerprint matched and
    the stale prefill was reused (wrong tokens). The dict now holds the storages it keyed."""
    m, ids, mask = _case_model_and_prompts()
    mod = {"embed": m.model.embed_tokens, "v_proj": m.model.layers[0].self_attn.v_proj, "lm_head": m.lm_head}[module]
    pc = {}
    vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
    mod.to(dtype)
    mod.to(torch.float32)
    out = vegas_ext.generate(m, ids, mask, prefill_cache=pc, **CASE_KW)
    assert not out.stats["prefill_reused"] and out.stats["prefill_miss"] == "model changed: weights"
    ref = hf_greedy(m, ids, mask, 8, eos_token_id=[])
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
