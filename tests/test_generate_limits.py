"""generate(): buffers sized by what can be emitted, and clear errors for ill-typed options."""
from __future__ import annotations

import pytest
import torch

import vegas_ext
from vegas_ext import ops

from decode_utils import first_diff, hf_greedy, make_model, make_prompts


@pytest.fixture(scope="module")
def small():
    model = make_model("llama", max_position_embeddings=64)
    ids, mask = make_prompts(model.config.vocab_size, [5, 3], seed=4)
    return model, ids, mask


@pytest.mark.parametrize("kw", [
    dict(max_new_tokens=10**12),                                   # "until EOS / the last position"
    dict(max_new_tokens=10, num_speculative_tokens=10**9, gamma_policy="fixed"),
    dict(max_new_tokens=10, num_speculative_tokens=10**7),  # the cap of "auto"
    dict(max_new_tokens=10, block_size=2**31 - 1),
    dict(max_new_tokens=10, block_size=2**32),
])
def test_huge_limits_are_capped_and_exact(small, kw):
    """Huge limits are capped to what a row can emit (buffers included: these allocated
    terabytes before) and give plain decoding's tokens."""
    model, ids, mask = small
    n = min(kw["max_new_tokens"], 62)  # the 3-token row can emit 62 tokens before position 64
    with pytest.warns(UserWarning):
        ref = vegas_ext.generate(model, ids, mask, eos_token_id=[], max_new_tokens=62,
                                 sparse_attn_algorithm="full").sequences[:, : ids.shape[1] + n]
    with pytest.warns(UserWarning) if kw["max_new_tokens"] > 60 else _nullctx():
        out = vegas_ext.generate(model, ids, mask, eos_token_id=[], sparse_attn_min_tokens=0, **kw)
    assert out.sequences.shape == ref.shape
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    if n == 10:
        hf = hf_greedy(model, ids, mask, 10, eos_token_id=[])
        assert torch.equal(out.sequences, hf), first_diff(out.sequences, hf)


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("kw, name", [
    (dict(block_size=2.5), "block_size"),
    (dict(block_size=True), "block_size"),
    (dict(prefill_cache=[]), "prefill_cache"),
    (dict(do_sample="no"), "do_sample"),
    (dict(eos_token_id=2.7), "token ids"),
    (dict(eos_token_id="2"), "token ids"),
    (dict(pad_token_id=1.7), "pad_token_id"),
])
def test_ill_typed_options_raise_naming_them(small, kw, name):
    model, ids, mask = small
    with pytest.raises(ValueError, match=name):
        vegas_ext.generate(model, ids, mask, max_new_tokens=4, **kw)


def test_ops_name_a_missing_tensor():
    k = torch.zeros(1, 1, 8, 16)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        ops.verify_attention(None, k, k, torch.tensor([4], dtype=torch.int32), 1, 0.25)
    with pytest.raises(TypeError, match="num_candidates must be a torch.Tensor"):
        ops.block_topk(torch.zeros(1, 1, 4), torch.ones(1, dtype=torch.int32), None, 2, 0)  # (an int is one per row)


def test_a_cache_past_free_memory_is_refused_before_any_work(small):
    """Break test: through ``hf.generate`` (which, like plain HF, goes past max_position_embeddings)
    a huge ``max_new_tokens`` used to end in the allocator's raw error; now one message names the
    bytes, the free memory and the remedy, before any forward."""
    model, ids, mask = small
    calls = []
    h = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"KV cache .* GiB, allocated up front, more than .* lower max_new_tokens"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10**12, pad_token_id=0,
                           custom_generate=vegas_ext.hf.generate)
    finally:
        h.remove()
    assert not calls
