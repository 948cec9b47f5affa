"""Case 013: state vegas_ext keeps per model (draft weight copies, packed copies) never changes what
the model can do: after a call it still pickles, saves and deep-copies, is freed by reference
counting alone, and ``vegas_ext.release`` drops the caches."""
from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch

import vegas_ext
from vegas_ext import model_state
from vegas_ext.packed_linear import PackedLinear, pack_linear_weights

from decode_utils import first_diff, hf_greedy, make_model, make_prompts, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

KW = dict(num_speculative_tokens=3, gamma_policy="fixed", sparse_attn_ratio=0.1, sparse_attn_min_tokens=8,
          block_size=4, eos_token_id=[])


def _call(model, kind, n=6):
    ids, mask = make_prompts(model.config.vocab_size, [30, 22], seed=4)
    return vegas_ext.generate(model, ids, mask, max_new_tokens=n, draft_weights=kind, **KW), ids, mask


def _no_vegas_attributes(model):
    for name, m in model.named_modules():
        left = [k for k in vars(m) if "vegas" in k.lower()] + (["forward"] if "forward" in vars(m) else [])
        assert not left, f"{name or 'model'} keeps {left}"


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("kind", ["fp16", "int8"])
def test_model_pickles_saves_and_copies_after_a_call_with_draft_weights(kind, packed):
    model = make_model("llama", seed=3)
    if packed:
        assert pack_linear_weights(model) > 0
    out, ids, mask = _call(model, kind)
    assert out.stats["draft_weights_bytes"] > 0
    _no_vegas_attributes(model)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        again, _, _ = _call(clone, kind)
        assert torch.equal(again.sequences, out.sequences), first_diff(again.sequences, out.sequences)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    ref = hf_greedy(loaded, ids, mask, 6, eos_token_id=[])
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)


@pytest.mark.parametrize("kind", [None, "fp16", "int8"])
def test_model_is_freed_by_reference_counting_after_a_call(kind):
    gc.collect()
    gc.disable()  # what frees the model must be reference counting, not the cycle collector
    try:
        model = make_model("llama", seed=3)
        pack_linear_weights(model)
        _call(model, kind)
        dw = model_state.get(model, "draft_weights")
        assert (dw is None) == (kind is None)
        ref, dw_ref = weakref.ref(model), (weakref.ref(dw) if dw is not None else None)
        del model, dw
        assert ref() is None, "the model outlived its last reference"
        assert dw_ref is None or dw_ref() is None, "the draft weight copies outlived the model"
    finally:
        gc.enable()


def test_release_drops_every_cache_and_output_is_unchanged():
    model = make_model("llama", seed=3)
    assert pack_linear_weights(model) > 0
    out, ids, mask = _call(model, "int8")
    packs = [m for m in model.modules() if isinstance(m, PackedLinear) and m._pack is not None]
    assert packs and model_state.get(model, "draft_weights") is not None
    assert vegas_ext.release(model) == 1 + len(packs)
    assert model_state.get(model, "draft_weights") is None
    assert all(m._pack is None for m in model.modules() if isinstance(m, PackedLinear))
    assert vegas_ext.release(model) == 0
    again, _, _ = _call(model, "int8")
    assert torch.equal(again.sequences, out.sequences)
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        vegas_ext.release("not a model")


def test_a_later_call_without_draft_weights_keeps_the_copy_until_released():
    model = make_model("llama", seed=3)
    _call(model, "fp16")
    dw = model_state.get(model, "draft_weights")
    _call(model, None)
    assert model_state.get(model, "draft_weights") is dw  # kept for the next call that asks
    vegas_ext.release(model)
    assert model_state.get(model, "draft_weights") is None


@pytest.mark.parametrize("kind", ["fp16", "int8"])
def test_copies_taken_during_a_call_carry_nothing_of_it(kind, monkeypatch):
    """Break test: a deepcopy / pickle / torch.save taken by another thread while a call with draft
    weights runs used to carry the per-module forward wrapper (unpicklable; a copy computing with
    the original's weights). The wrapper is a class attribute now: copies taken mid-call are clean."""
    from vegas_ext import draft_weights as dwm

    model = make_model("llama", seed=3)
    taken = {}
    real = dwm.DraftWeights.linear

    def linear(self, mod, x, own):  # runs inside the call, as another thread would see the model
        if not taken:
            taken["copy"] = copy.deepcopy(model)
            taken["pickle"] = pickle.loads(pickle.dumps(model))
            buf = io.BytesIO()
            torch.save(model, buf)
            buf.seek(0)
            taken["save"] = torch.load(buf, weights_only=False)
        return real(self, mod, x, own)

    monkeypatch.setattr(dwm.DraftWeights, "linear", linear)
    monkeypatch.setattr(vegas_ext.decode, "lean_draft", lambda *a: None)  # drafts through the linears
    out, ids, mask = _call(model, kind)
    assert set(taken) == {"copy", "pickle", "save"}
    monkeypatch.undo()
    for name, c in taken.items():
        _no_vegas_attributes(c)
        with torch.inference_mode():  # copied inside the call's inference mode
            c.lm_head.weight.zero_()  # the copy computes with its own weights, not the original's
            x = torch.randn(2, c.config.hidden_size)
            assert torch.equal(c.lm_head(x), torch.zeros(2, c.config.vocab_size)), name
            assert not torch.equal(model.lm_head(x), c.lm_head(x))
