"""generate(draft_weights=...): the draft forwards' linears read a low-precision copy of the weights
(vegas_ext.draft_weights), the verification the model's own -- so greedy output stays plain greedy
token for token, and sampling keeps the target distribution; the copy is cached beside the model, remade
when a weight changes, and the linears are restored after the call."""
from __future__ import annotations

import pytest
import torch

import vegas_ext
from vegas_ext import draft_weights as dwm, model_state
from vegas_ext.packed_linear import pack_linear_weights

from decode_utils import first_diff, hf_greedy, make_model, make_prompts, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

KW = dict(num_speculative_tokens=4, gamma_policy="fixed", sparse_attn_ratio=0.1, sparse_attn_min_tokens=8, block_size=4)


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("kind", ["fp16", "int8"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])  # qwen2: q/k/v with bias
def test_greedy_equals_plain_greedy(family, kind):
    model = make_model(family)
    ids, mask = make_prompts(model.config.vocab_size, [40, 23, 31])
    ref = hf_greedy(model, ids, mask, 24, eos_token_id=[])
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=24, eos_token_id=[], draft_weights=kind, **KW)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    s = out.stats
    assert s["draft_weights"] == kind and s["num_draft_tokens"] > 0 and s["num_accepted_tokens"] > 0
    n_w = sum(m.weight.numel() for m in _linears(model))
    if kind == "fp16":
        assert s["draft_weights_bytes"] == 2 * n_w and s["draft_weights_format"] == "fp16"
    else:
        n_s = sum(-(-m.in_features // 64) * m.out_features for m in _linears(model))
        assert s["draft_weights_bytes"] == n_w + 4 * n_s  # int8 + fp32 scales; fp32 biases are shared
        assert s["draft_weights_format"] == "int8-g64"
    # the wrappers are gone after the call
    assert all("forward" not in m.__dict__ for m in _linears(model))


def test_packed_linears_greedy_equals_plain_greedy():
    model = make_model("llama", seed=3)
    ids, mask = make_prompts(model.config.vocab_size, [50, 50], seed=4)
    ref = hf_greedy(model, ids, mask, 20, eos_token_id=[])
    pack_linear_weights(model, min_rows=1)
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=20, eos_token_id=[], draft_weights="int8", **KW)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    assert out.stats["draft_weights_bytes"] > 0 and out.stats["num_draft_tokens"] > 0


def test_drafts_use_the_copy_and_verification_does_not():
    """With the copy broken on purpose (int8 scales zeroed: every draft linear outputs 0) the drafts
    are garbage and nearly all rejected, yet the output is still plain greedy's: the verification
    never reads the copy, and the draft does."""
    model = make_model("llama", seed=5)
    ids, mask = make_prompts(model.config.vocab_size, [60, 45], seed=6)
    ref = hf_greedy(model, ids, mask, 30, eos_token_id=[])
    good = vegas_ext.generate(model, ids, mask, max_new_tokens=30, eos_token_id=[], draft_weights="int8", **KW)
    dw = dwm.draft_weights_for(model, "int8")
    for c in dw._copies.values():
        c.scales.zero_()
    bad = vegas_ext.generate(model, ids, mask, max_new_tokens=30, eos_token_id=[], draft_weights="int8", **KW)
    assert torch.equal(bad.sequences, ref), first_diff(bad.sequences, ref)
    assert good.stats["draft_acceptance_rate"] > 0.2
    assert bad.stats["draft_acceptance_rate"] < good.stats["draft_acceptance_rate"] / 2


def test_copy_is_cached_and_remade_after_a_weight_edit():
    model = make_model("llama", seed=7)
    ids, mask = make_prompts(model.config.vocab_size, [30], seed=8)
    vegas_ext.generate(model, ids, mask, max_new_tokens=8, eos_token_id=[], draft_weights="fp16", **KW)
    dw = model_state.get(model, "draft_weights")
    lin = model.model.layers[0].mlp.down_proj
    before = dw._copies[id(lin)].weight
    vegas_ext.generate(model, ids, mask, max_new_tokens=8, eos_token_id=[], draft_weights="fp16", **KW)
    assert model_state.get(model, "draft_weights") is dw and dw._copies[id(lin)].weight is before  # reused
    with torch.no_grad():
        lin.weight.mul_(-1.5)  # in place: the version counter moves
    ref = hf_greedy(model, ids, mask, 16, eos_token_id=[])
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=16, eos_token_id=[], draft_weights="fp16", **KW)
    assert torch.equal(out.sequences, ref)
    now = dw._copies[id(lin)].weight
    assert now is not before and torch.equal(now, lin.weight.detach().half())
    # another kind replaces the cached one
    vegas_ext.generate(model, ids, mask, max_new_tokens=4, eos_token_id=[], draft_weights="int8", **KW)
    assert model_state.get(model, "draft_weights").kind == "int8"


def test_plain_decoding_makes_no_copy():
    model = make_model("llama", seed=9)
    ids, mask = make_prompts(model.config.vocab_size, [20], seed=9)
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=6, sparse_attn_algorithm="full", draft_weights="int8")
    assert out.stats["draft_weights_bytes"] == 0 and model_state.get(model, "draft_weights") is None


@pytest.mark.parametrize("bad", ["int4", "bf16", "INT8", True, 8])
def test_bad_values_are_refused(bad):
    model = make_model("llama", seed=1)
    ids, mask = make_prompts(model.config.vocab_size, [10])
    with pytest.raises(ValueError, match="draft_weights"):
        vegas_ext.generate(model, ids, mask, max_new_tokens=4, draft_weights=bad)
    if bad == "int4":
        with pytest.raises(ValueError, match="60-61 %"):
            vegas_ext.generate(model, ids, mask, max_new_tokens=4, draft_weights=bad)


def test_quantize_int8_bad_input():
    with pytest.raises(ValueError, match="weight"):
        dwm.quantize_int8(torch.zeros(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="group_size"):
        dwm.quantize_int8(torch.zeros(3, 4), 0)


def test_sampling_with_int8_drafts_matches_target_distribution():
    """Speculative sampling with q from the int8 draft: the emitted tokens follow the exact joint
    distribution of the fp32 target (chi-square over 5000 seeded rows, as test_spec_sampling)."""
    from test_spec_sampling import K_NEW, P_MIN, PROMPT, V_SMALL, _exact_joint, _small_model, chi2_pvalue

    model = _small_model()
    prompt = torch.randint(0, V_SMALL, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    warpers = vegas_ext.decode.make_warpers(1.0, 0, 1.0)
    joint = _exact_joint(model, prompt, warpers)
    out = vegas_ext.generate(model, prompt.expand(5000, -1), max_new_tokens=K_NEW, num_speculative_tokens=3,
                             gamma_policy="fixed",
                             sparse_attn_ratio=0.01, sparse_attn_min_tokens=0, block_size=4, do_sample=True,
                             eos_token_id=[], generator=torch.Generator().manual_seed(1), draft_weights="int8")
    assert 0.05 < out.stats["draft_acceptance_rate"] < 0.95
    new = out.sequences[:, PROMPT:]
    counts = torch.bincount((new * torch.tensor([V_SMALL**2, V_SMALL, 1])).sum(1), minlength=V_SMALL**K_NEW)
    pv = chi2_pvalue(counts, joint)
    assert pv > P_MIN, f"chi-square p-value {pv:.2e}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.sh runs it)")
@pytest.mark.parametrize("kind", ["fp16", "int8"])
def test_cuda_maps_to_fp16_and_stays_lossless(kind):
    """On CUDA both kinds use a float16 copy through F.linear; greedy stays plain greedy (fp32 model)."""
    model = make_model("qwen2", seed=12).cuda()
    ids, mask = make_prompts(model.config.vocab_size, [40, 25], seed=13)
    ids, mask = ids.cuda(), mask.cuda()
    ref = hf_greedy(model, ids, mask, 20, eos_token_id=[])
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=20, eos_token_id=[], draft_weights=kind, **KW)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    n_w = sum(m.weight.numel() for m in _linears(model))
    n_b = sum(m.bias.numel() for m in _linears(model) if m.bias is not None)
    assert out.stats["draft_weights_format"] == "fp16" and out.stats["draft_weights_bytes"] == 2 * (n_w + n_b)
    assert out.stats["num_accepted_tokens"] > 0


def test_draft_weights_leave_packed_linears_packed():
    """Regression: the draft copies' freshness check read ``data_ptr()``, which materializes the
    copy-on-write storage of a packed weight, so every packed linear repacked every iteration."""
    from vegas_ext.packed_linear import PackedLinear, can_pack, pack_linear_weights

    m = make_model("llama")
    if not can_pack(m.lm_head):
        pytest.skip("this PyTorch cannot pack linears (no oneDNN)")
    pack_linear_weights(m, min_rows=1)
    ids, mask = make_prompts(m.config.vocab_size, [60, 45])
    kw = dict(max_new_tokens=16, num_speculative_tokens=3, gamma_policy="fixed", draft_weights="int8",
              eos_token_id=[], pad_token_id=0)
    vegas_ext.generate(m, ids, mask, **kw)
    packed = [mod for mod in m.modules() if isinstance(mod, PackedLinear)]
    before = sum(mod.repacks for mod in packed)
    out = vegas_ext.generate(m, ids, mask, **kw)
    assert sum(mod.repacks for mod in packed) == before and out.stats["num_iterations"] > 1
