"""Models offloaded with accelerate (parameters on the meta device, hooks that load them in each
forward): vegas_ext.generate decodes them as plain generate does, and the draft-side speed-ups
(draft weights, the lean draft forward, packed linears) leave the offloaded modules alone
(handed case 016)."""
from __future__ import annotations

import pytest
import torch

import vegas_ext
from vegas_ext.packed_linear import pack_linear_weights

from decode_utils import make_config, make_model, make_prompts, one_thread  # noqa: F401

accelerate = pytest.importorskip("accelerate")

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 12


def _offloaded(family: str, whole: bool):
    """A fresh model, its prompts and plain greedy's tokens (before offloading); then offloaded:
    the whole model (``cpu_offload``), or its second decoder layer only."""
    model = make_model(family, seed=3)
    ids, mask = make_prompts(model.config.vocab_size, [40, 29], seed=2)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    accelerate.cpu_offload(model if whole else model.model.layers[1])
    return model, ids, mask, ref


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "one_layer"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_offloaded_model_decodes_as_plain_generate(family, whole):
    """It failed with "Tensor.item() cannot be called on meta tensors" (the prompts were moved to
    the first parameter's device, meta), with or without draft weights."""
    model, ids, mask, ref = _offloaded(family, whole)
    assert next(model.model.layers[1].parameters()).is_meta
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(plain, ref)  # accelerate's own forward is unchanged
    for dw in (None, "int8", "fp16"):
        for algorithm in ("vegas", "quest", "full"):
            out = vegas_ext.generate(model, ids, mask, max_new_tokens=NEW, num_speculative_tokens=3,
                                     gamma_policy="fixed",
                                     sparse_attn_algorithm=algorithm, sparse_attn_min_tokens=8, block_size=4,
                                     draft_weights=dw)
            assert torch.equal(out.sequences, ref), (dw, algorithm)
            assert out.sequences.device.type == "cpu"
            if dw is not None and algorithm != "full":
                # copies of the loaded linears only (none where everything is offloaded)
                assert (out.stats["draft_weights_bytes"] > 0) is (not whole), out.stats
                assert out.stats["draft_weights_format"] == (None if whole else {"int8": "int8-g64"}.get(dw, dw))


def test_offloaded_model_through_hf_generate():
    model, ids, mask, ref = _offloaded("llama", True)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, custom_generate=vegas_ext.hf.generate,
                         num_speculative_tokens=3, gamma_policy="fixed", draft_weights="int8")
    assert torch.equal(out, ref)


def test_model_device_is_the_hooks_execution_device():
    from vegas_ext.cache import model_device

    model, *_ = _offloaded("llama", True)
    assert next(model.parameters()).is_meta and model_device(model) == torch.device("cpu")
    assert model_device(make_model("llama")) == torch.device("cpu")


def test_offloaded_linears_are_left_to_their_hooks():
    """Packing drops hooks, so offloaded linears are not packed; the loaded ones are."""
    model, ids, mask, ref = _offloaded("llama", False)
    n_linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    offloaded = sum(type(m) is torch.nn.Linear for m in model.model.layers[1].modules())
    assert pack_linear_weights(model) == n_linears - offloaded
    assert all(type(m) is torch.nn.Linear for m in model.model.layers[1].modules() if hasattr(m, "in_features"))
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=NEW, num_speculative_tokens=3,
                             gamma_policy="fixed", draft_weights="int8")
    assert torch.equal(out.sequences, ref)


def test_meta_model_without_weights_is_refused_before_any_work():
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(make_config("llama"))
    ids, mask = make_prompts(256, [10])
    with pytest.raises(ValueError, match=r"^model's parameters are on the meta device \(no weights loaded\).*"
                                         r"LlamaForCausalLM\.from_pretrained"):
        vegas_ext.generate(model, ids, mask, max_new_tokens=4)
