"""The Hugging Face drop-in: patching, fallback equality, model checks, and the real SmolLM2."""
from __future__ import annotations

import time

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import vegas_ext
from vegas_ext import attention
from vegas_ext.attention import check_model_supported, is_patched, patch_model, patched, unpatch_model

from decode_utils import FAMILIES, first_diff, hf_greedy, make_model, make_prompts, one_thread  # noqa: F401


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_unpatched_forward_and_generate(family):
    model = make_model(family)
    ids, mask = make_prompts(model.config.vocab_size, [40, 25, 33], seed=2)
    with torch.inference_mode():
        ref_logits = model(input_ids=ids, attention_mask=mask).logits
    ref_gen = hf_greedy(model, ids, mask, 12, eos_token_id=[])
    patch_model(model)
    try:
        assert is_patched(model) and model.config._attn_implementation == "vegas"
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(logits, ref_logits, atol=1e-6, rtol=1e-6)
        gen = hf_greedy(model, ids, mask, 12, eos_token_id=[])
        assert torch.equal(gen, ref_gen), first_diff(gen, ref_gen)
        # our loop on an already patched model leaves it patched, and HF generate still works after
        out = vegas_ext.generate(model, ids, mask, max_new_tokens=12, eos_token_id=[], sparse_attn_min_tokens=8,
                                 block_size=4)
        assert torch.equal(out.sequences, ref_gen), first_diff(out.sequences, ref_gen)
        assert is_patched(model)
        gen2 = hf_greedy(model, ids, mask, 12, eos_token_id=[])
        assert torch.equal(gen2, ref_gen)
    finally:
        unpatch_model(model)
    assert model.config._attn_implementation == "sdpa" and not is_patched(model)


@pytest.mark.usefixtures("one_thread")
def test_generate_restores_attention_implementation():
    model = make_model("llama")
    model.set_attn_implementation("eager")
    ids, mask = make_prompts(model.config.vocab_size, [20])
    vegas_ext.generate(model, ids, mask, max_new_tokens=4)
    assert model.config._attn_implementation == "eager"
    with patched(model):
        assert is_patched(model)
    assert model.config._attn_implementation == "eager"


def test_attention_function_and_mask_are_registered():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping["vegas"] is attention.vegas_attention_forward
    assert AttentionMaskInterface._global_mapping["vegas"] is attention.vegas_attention_mask


def test_sliding_window_configs_are_refused():
    model = make_model("mistral", sliding_window=64)
    with pytest.raises(ValueError, match=r"config\.sliding_window=64"):
        patch_model(model)
    assert not is_patched(model)
    ids, mask = make_prompts(model.config.vocab_size, [100])
    with pytest.raises(ValueError, match=r"config\.sliding_window"):
        vegas_ext.generate(model, ids, mask, max_new_tokens=4)
    # Qwen2 with sliding layers
    q = make_model("qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=1)
    with pytest.raises(ValueError, match=r"config\.sliding_window=32"):
        check_model_supported(q, 100)


@pytest.mark.usefixtures("one_thread")
def test_sliding_window_covering_the_context_is_accepted():
    model = make_model("mistral", sliding_window=64)
    ids, mask = make_prompts(model.config.vocab_size, [30, 21], seed=4)
    ref = hf_greedy(model, ids, mask, 20, eos_token_id=[])
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=20, eos_token_id=[], sparse_attn_min_tokens=8,
                             block_size=4)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    assert not is_patched(model)
    # Qwen2/3 configs with use_sliding_window=False have no window at all
    check_model_supported(make_model("qwen2"), 10**6)


def test_unsupported_model_is_refused():
    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=64, bos_token_id=0,
                                   eos_token_id=0))
    with pytest.raises(ValueError, match="unsupported model"):
        patch_model(m)
    with pytest.raises(ValueError, match=r"model must be a Hugging Face causal LM .* got GPT2LMHeadModel"):
        vegas_ext.generate(m, torch.tensor([[1, 2, 3]]), max_new_tokens=2)


# --------------------------------------------------------------------------- the real model
def _long_text(tokenizer, min_tokens):
    from pydoc_data.topics import topics  # the Python docs shipped with CPython (PSF license)

    parts, n = [], 0
    for name in sorted(topics):
        parts.append(topics[name])
        n += len(topics[name]) // 3
        if n > min_tokens * 1.5:
            break
    text = "\n\n".join(parts)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :min_tokens]
    return ids


@pytest.mark.slow
def test_smollm2_greedy_equals_hf_generate_on_2k_tokens_of_real_text():
    models = pytest.importorskip("vegas_ext.models")
    try:
        model, tok = models.load_model()
    except ValueError as e:  # the embedded model package is not installed
        pytest.skip(str(e))
    ids = _long_text(tok, 2100)
    assert ids.shape[1] == 2100
    n = 32
    t0 = time.perf_counter()
    ref = hf_greedy(model, ids, None, n, eos_token_id=[])
    t_hf = time.perf_counter() - t0
    out = vegas_ext.generate(model, ids, max_new_tokens=n, num_speculative_tokens=6, gamma_policy="fixed",
                             eos_token_id=[])
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    s = out.stats
    print(
        f"\nSmolLM2 2100-token prompt, {n} new: HF {n / t_hf:.1f} tok/s (incl. prefill); vegas "
        f"{s['tokens_per_s']:.1f} tok/s, mean acceptance length {s['mean_acceptance_length']:.2f}"
    )
    assert s["num_accepted_tokens"] > 0
