"""vegas_ext.pack_linear_weights: the model's fp32 CPU linears on oneDNN-packed weights."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vegas_ext
from vegas_ext.packed_linear import PACKED_MIN_ROWS, PackedLinear, can_pack, pack_linear_weights

from decode_utils import FAMILIES, first_diff, hf_greedy, make_model, make_prompts, one_thread  # noqa: F401

pytestmark = [pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN"),
              pytest.mark.usefixtures("one_thread")]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 7), (5, 7), (3, 4, 7), (2, 3, 7, 7)])
@pytest.mark.parametrize("features", [(7, 13), (64, 1), (96, 200)])
def test_packed_linear_matches_linear(shape, features, bias):
    fin, fout = features
    torch.manual_seed(0)
    lin = nn.Linear(fin, fout, bias=bias)
    p = PackedLinear(lin, min_rows=1)  # every row count through the packed weights
    x = torch.randn(*shape[:-1], fin)
    with torch.no_grad():
        ref = lin(x)
        y = p(x)
    assert y.shape == ref.shape and y.dtype == torch.float32
    # fp32, a different summation order: within a few ulps of the accumulated magnitude
    bound = 8 * torch.finfo(torch.float32).eps * (x.abs() @ lin.weight.abs().T + (lin.bias.abs() if bias else 0))
    assert ((y - ref).abs() <= bound + 1e-30).all(), (y - ref).abs().max()


def test_few_rows_take_f_linear_and_more_take_the_packed_weights():
    torch.manual_seed(0)
    lin = nn.Linear(576, 192)
    p = PackedLinear(lin)
    assert p.min_rows == PACKED_MIN_ROWS == 4
    packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach())
    with torch.no_grad():
        for rows in (1, 2, 3):
            x = torch.randn(rows, 576)
            assert torch.equal(p(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        for rows in (4, 7, 28):
            x = torch.randn(rows, 576)
            assert torch.equal(p(x), torch.ops.mkldnn._linear_pointwise(x, packed, lin.bias, "none", [], ""))
        x = torch.randn(2, 2, 576)  # rows are the leading dimensions' product
        assert torch.equal(p(x), torch.ops.mkldnn._linear_pointwise(x, packed, lin.bias, "none", [], ""))


def test_packed_linear_non_contiguous_empty_and_vector_inputs():
    torch.manual_seed(0)
    lin = nn.Linear(16, 5)
    p = PackedLinear(lin, min_rows=1)
    with torch.no_grad():
        x = torch.randn(6, 3, 16).transpose(0, 1)  # non-contiguous
        torch.testing.assert_close(p(x), lin(x), rtol=1e-6, atol=1e-6)
        v = torch.randn(16)
        torch.testing.assert_close(p(v), lin(v), rtol=1e-6, atol=1e-6)
        assert p(torch.randn(0, 16)).shape == (0, 5)


def test_packed_linear_sees_in_place_weight_changes():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    p = PackedLinear(lin, min_rows=1)
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = p(x)
        lin.weight.mul_(-2.0)  # the same parameter: the pack must be redone
        after = p(x)
        torch.testing.assert_close(after, lin(x), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(before, after)


def test_packed_linear_with_grad_falls_back_to_autograd():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    p = PackedLinear(lin)
    x = torch.randn(3, 8, requires_grad=True)
    p(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    torch.testing.assert_close(x.grad, lin.weight.sum(0).expand(3, 8).detach())


@pytest.mark.parametrize("x, match", [
    (torch.randn(3, 9), r"x: expected a float32 CPU tensor \[\.\.\., 8\]"),
    (torch.randn(3, 8, dtype=torch.float64), r"x: expected a float32"),
    (torch.randn(3, 8).to(torch.bfloat16), r"x: expected a float32"),
])
def test_packed_linear_bad_input_names_x(x, match):
    p = PackedLinear(nn.Linear(8, 4))
    with pytest.raises(ValueError, match=match):
        with torch.no_grad():
            p(x)


def test_can_pack_only_fp32_cpu_linears():
    assert can_pack(nn.Linear(4, 4))
    assert not can_pack(nn.Linear(4, 4).to(torch.bfloat16))
    assert not can_pack(nn.Linear(4, 4).double())
    assert not can_pack(nn.Embedding(4, 4))
    assert not can_pack(PackedLinear(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="linear: expected an nn.Linear with an fp32 CPU weight"):
        PackedLinear(nn.Linear(4, 4).to(torch.bfloat16))
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        pack_linear_weights("not a model")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="min_rows: expected an int >= 1"):
            pack_linear_weights(nn.Linear(4, 4), min_rows=bad)
        with pytest.raises(ValueError, match="min_rows: expected an int >= 1"):
            PackedLinear(nn.Linear(4, 4), min_rows=bad)


def test_pack_linear_weights_replaces_every_linear_and_keeps_parameters():
    model = make_model("llama", tie_word_embeddings=True)
    n_lin = sum(type(m) is nn.Linear for m in model.modules())
    params = {k: v for k, v in model.state_dict().items()}
    assert pack_linear_weights(model) == n_lin  # 2 layers x 7 + lm_head
    assert n_lin == 2 * 7 + 1
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert pack_linear_weights(model) == 0  # again: nothing left to pack
    after = model.state_dict()
    assert after.keys() == params.keys()
    assert all(after[k] is params[k] or torch.equal(after[k], params[k]) for k in params)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert vegas_ext.pack_linear_weights is pack_linear_weights


def test_pack_linear_weights_leaves_other_dtypes_alone():
    model = make_model("llama").to(torch.bfloat16)
    assert pack_linear_weights(model) == 0
    assert sum(type(m) is nn.Linear for m in model.modules()) == 2 * 7 + 1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("gamma", [1, 4, "auto"])
def test_packed_model_decodes_losslessly(family, gamma):
    """Vegas on the packed model equals HF greedy on the same packed model, token for token, and
    stays close to the unpacked model's logits."""
    model = make_model(family)
    ref_model = copy.deepcopy(model)
    assert pack_linear_weights(model, min_rows=1) > 0  # every forward through the packed weights
    ids, mask = make_prompts(model.config.vocab_size, [40, 57, 23])
    ref = hf_greedy(model, ids, mask, 24, eos_token_id=[])
    with torch.inference_mode():
        out = vegas_ext.generate(model, ids, mask, max_new_tokens=24, num_speculative_tokens=gamma,
                                 sparse_attn_ratio=0.25, sparse_attn_min_tokens=8, block_size=4, eos_token_id=[])
        assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
        assert out.stats["num_draft_tokens"] > 0 or gamma == "auto"
        torch.testing.assert_close(model(ids, attention_mask=mask).logits,
                                   ref_model(ids, attention_mask=mask).logits, rtol=1e-4, atol=1e-4)
