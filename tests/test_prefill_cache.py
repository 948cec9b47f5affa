"""``generate(prefill_cache=...)`` reuses a stored prefill only for the model (weights, dtype,
device) that filled it."""
from __future__ import annotations

import pytest
import torch

import vegas_ext
from vegas_ext.decode import prefill_cache_is_for

from decode_utils import first_diff, hf_greedy, make_model, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

KW = dict(max_new_tokens=40, num_speculative_tokens=4, sparse_attn_ratio=0.05, sparse_attn_min_tokens=16,
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
