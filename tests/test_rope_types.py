"""RoPE types and other position-dependent options: each supported one decodes exactly as plain greedy
across its switch point, and the ones transformers evaluates per forward are refused at the start
of ``generate()`` where our forwards would split positions differently (case 007)."""
from __future__ import annotations

import pytest
import torch

import vegas_ext
from vegas_ext.attention import EXACT_ROPE_TYPES, SUPPORTED_ROPE_TYPES, check_model_supported

from decode_utils import first_diff, hf_greedy, make_model, make_prompts, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

ORIG = 32  # original_max_position_embeddings of the scaled types: the prompts and windows straddle it
FAMILIES = ("llama", "qwen3")
FULL = dict(sparse_attn_ratio=1.0, sparse_attn_min_tokens=0)
SPARSE = dict(sparse_attn_ratio=0.25, sparse_attn_min_tokens=8, block_size=4)

def _policy(gamma):
    """``gamma_policy`` for a parametrized γ: an int is the γ of every iteration."""
    return "auto" if gamma == "auto" else "fixed"



def _rope(rtype: str, head_dim: int, max_pos: int) -> dict:
    rp = dict(rope_type=rtype, rope_theta=10000.0)
    if rtype in ("linear", "dynamic"):
        rp.update(factor=4.0)
    elif rtype == "yarn":
        rp.update(factor=max_pos / ORIG, original_max_position_embeddings=ORIG)
    elif rtype == "llama3":
        rp.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=ORIG)
    elif rtype == "longrope":  # long factors far from the short ones: a wrong set changes the tokens
        rp.update(short_factor=[1.0] * (head_dim // 2), long_factor=[64.0] * (head_dim // 2),
                  original_max_position_embeddings=ORIG)
    elif rtype == "proportional":
        rp.update(partial_rotary_factor=0.5)
    return rp


def _model(family: str, rtype: str, max_pos: int = 256):
    head_dim = 16  # both families here: hidden 64 / 4 heads (qwen3 sets head_dim=16)
    return make_model(family, seed=0, rope_parameters=_rope(rtype, head_dim, max_pos), max_position_embeddings=max_pos)


def _check_exact(model, lengths, new, gamma, **kw):
    ids, mask = make_prompts(model.config.vocab_size, lengths, seed=0)
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=new, num_speculative_tokens=gamma,
                             gamma_policy=_policy(gamma), eos_token_id=[],
                             pad_token_id=0, **kw)
    ref = hf_greedy(model, ids, mask, out.sequences.shape[1] - ids.shape[1], eos_token_id=[])
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    return out


def test_supported_lists():
    assert set(EXACT_ROPE_TYPES) < set(SUPPORTED_ROPE_TYPES)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    # every type transformers knows is decided here (a new one must be added on purpose)
    assert set(ROPE_INIT_FUNCTIONS) | {"default"} == set(SUPPORTED_ROPE_TYPES)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rtype", EXACT_ROPE_TYPES)
def test_position_only_rope_is_exact_across_the_original_length(family, rtype):
    m = _model(family, rtype)
    # prompts either side of ORIG, ragged; gamma + 1 windows straddle it; full and sparse drafts
    _check_exact(m, [26], 20, 4, **FULL)
    _check_exact(m, [30, 34], 12, 3, **SPARSE)
    _check_exact(m, [33, 12], 10, 5, **FULL)


@pytest.mark.parametrize("family", FAMILIES)
def test_longrope_within_its_original_length_is_exact(family):
    m = _model(family, "longrope")
    _check_exact(m, [20], ORIG - 20, 4, **FULL)  # context exactly ORIG: short factors throughout
    _check_exact(m, [24, 9], ORIG - 24, 3, **SPARSE)


@pytest.mark.parametrize("family", FAMILIES)
def test_longrope_past_its_original_length_is_refused_before_any_forward(family):
    m = _model(family, "longrope")
    calls = []
    m.model.register_forward_pre_hook(lambda *a: calls.append(1))
    ids, mask = make_prompts(m.config.vocab_size, [26], seed=0)
    for new in (20, ORIG - 26 + 1):  # the case's 007 geometry, and one token past the boundary
        with pytest.raises(ValueError, match=r"rope_type'\]='longrope'.*original_max_position_embeddings=32"):
            vegas_ext.generate(m, ids, mask, max_new_tokens=new, num_speculative_tokens=4, gamma_policy="fixed",
                               eos_token_id=[],
                               pad_token_id=0, **FULL)
    assert calls == []
    with pytest.raises(ValueError, match="longrope"):
        check_model_supported(m)  # default context: max_position_embeddings


@pytest.mark.parametrize("family", FAMILIES)
def test_dynamic_ntk_is_exact_up_to_max_positions(family):
    # dynamic rescales for forwards past max_position_embeddings; no row of ours goes there (capped)
    max_pos = 48
    m = _model(family, "dynamic", max_pos=max_pos)
    rot = m.model.rotary_emb
    inv0 = rot.inv_freq.clone()
    seen = []
    rot.register_forward_pre_hook(
        lambda mod, a, kw: seen.append(int((a[1] if len(a) > 1 else kw["position_ids"]).max()) + 1), with_kwargs=True)
    with pytest.warns(UserWarning, match="capped"):
        out = _check_exact(m, [40], 30, 4, **FULL)  # capped at max_pos: windows end at the switch
    assert out.sequences.shape[1] == max_pos + 1
    _check_exact(m, [max_pos - 1], 1, 4, **SPARSE)
    _check_exact(m, [36, 20], max_pos - 36, 5, **FULL)
    assert max(seen) == max_pos and torch.equal(rot.inv_freq, inv0)


def test_dynamic_ntk_grown_by_an_earlier_forward_is_refused_then_reset():
    max_pos = 48
    m = _model("llama", "dynamic", max_pos=max_pos)
    with torch.no_grad():  # plain HF past max_position_embeddings grows the frequencies and keeps them
        m(torch.randint(3, 100, (1, max_pos + 12)))
    ids, mask = make_prompts(m.config.vocab_size, [max_pos], seed=0)
    with pytest.raises(ValueError, match=r"rope_type'\]='dynamic' with frequencies grown to 60"):
        vegas_ext.generate(m, ids, mask, max_new_tokens=1, eos_token_id=[], pad_token_id=0)
    with torch.no_grad():
        m(ids[:, :1])  # a short forward resets them (transformers' own rule)
    _check_exact(m, [max_pos], 1, 4, **FULL)
    _check_exact(m, [40], 9, 4, **FULL)


@pytest.mark.parametrize("family", FAMILIES)
def test_unknown_rope_type_and_layer_type_are_refused(family):
    m = _model(family, "default")
    m.config.rope_parameters["rope_type"] = "ntk_dynamic_custom"  # e.g. registered by a user
    ids, mask = make_prompts(m.config.vocab_size, [10], seed=0)
    with pytest.raises(ValueError,
                       match=r"unsupported RoPE type .*'ntk_dynamic_custom'.*supported RoPE types: default"):
        vegas_ext.generate(m, ids, mask, max_new_tokens=4)
    m.config.rope_parameters["rope_type"] = "default"
    m.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match=r"config\.layer_types entries \['chunked_attention'\]"):
        vegas_ext.generate(m, ids, mask, max_new_tokens=4)


def test_dynamic_rope_refuses_a_batch_a_row_of_which_would_pass_max_position_embeddings():
    """Regression (break test): plain decoding of a ragged batch whose long row goes past
    max_position_embeddings rescales the dynamic RoPE of every row, which the loop (capping that
    row) cannot reproduce: refused naming max_new_tokens; within the limit it is exact."""
    m = make_model("llama", rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0),
                   max_position_embeddings=64, initializer_range=0.15)
    ids, mask = make_prompts(m.config.vocab_size, [60, 5], seed=0)
    with pytest.raises(ValueError, match=r"max_new_tokens=40: with rope_type='dynamic'.*at most 5"):
        vegas_ext.generate(m, ids, mask, max_new_tokens=40, num_speculative_tokens=3, gamma_policy="fixed",
                           eos_token_id=[], pad_token_id=0)
    out = vegas_ext.generate(m, ids, mask, max_new_tokens=5, num_speculative_tokens=3, gamma_policy="fixed",
                             eos_token_id=[], pad_token_id=0)
    assert torch.equal(out.sequences, hf_greedy(m, ids, mask, 5, eos_token_id=[]))
