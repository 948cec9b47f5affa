"""Acceptance counters describe what was emitted: no accepted draft is counted after an EOS."""
from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

import vegas_ext
from vegas_ext.stats import DecodeStats

from decode_utils import cached_model, first_diff, hf_greedy, make_prompts, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

EXACT = dict(sparse_attn_ratio=1.0, sparse_attn_min_tokens=0, block_size=8)
SPARSE = dict(sparse_attn_ratio=0.05, sparse_attn_min_tokens=32, block_size=8)
GAMMA = 6
NEW = 24
LENGTHS = {1: [300], 3: [300, 217, 281]}


@functools.lru_cache(maxsize=None)
def _case(batch):
    model = cached_model("llama")
    ids, mask = make_prompts(model.config.vocab_size, LENGTHS[batch], seed=batch)
    ref = hf_greedy(model, ids, mask, NEW, eos_token_id=[])
    return model, ids, mask, ref


def _stops(new, eos_set):
    """Per row, the new-token index of its first EOS."""
    return [next(j for j, t in enumerate(row) if t in eos_set) for row in new]


def _eos_inside_first_run(new):
    """EOS ids such that every row stops inside its first run of GAMMA drafts, each row at a
    different position (new-token index 1..GAMMA: the first token comes from prefill)."""
    B = len(new)
    for ks in itertools.product(range(1, GAMMA + 1), repeat=B):
        eos = {new[b][k] for b, k in enumerate(ks)}
        try:
            stops = _stops(new, eos)
        except StopIteration:
            continue
        if all(1 <= s <= GAMMA for s in stops) and len(set(stops)) == B:
            return sorted(eos), stops
    pytest.fail("no EOS set that ends every row inside its first accepted run "
                "(the seeded model and prompts are fixed: they must provide one)")


@pytest.mark.parametrize("batch", [1, 3])
def test_drafts_after_eos_are_not_counted_as_accepted(batch):
    model, ids, mask, ref = _case(batch)
    T = ids.shape[1]
    new = ref[:, T:].tolist()
    # with the exact budget the first round of GAMMA drafts is accepted in full by every row
    one = vegas_ext.generate(model, ids, mask, max_new_tokens=GAMMA + 2, num_speculative_tokens=GAMMA,
                             gamma_policy="fixed",
                             eos_token_id=[], **EXACT)
    assert one.stats["num_iterations"] == 1 and one.stats["num_accepted_tokens"] == GAMMA * batch
    eos, stops = _eos_inside_first_run(new)
    ref_eos = hf_greedy(model, ids, mask, NEW, eos_token_id=eos)
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=NEW, num_speculative_tokens=GAMMA, gamma_policy="fixed",
                             eos_token_id=eos, **EXACT)
    assert torch.equal(out.sequences, ref_eos), first_diff(out.sequences, ref_eos)
    s = out.stats
    # row b emitted its drafts 1..stops[b] (the last one its EOS); the rest were never emitted
    assert s["num_iterations"] == 1
    assert s["num_drafts"] == batch and s["num_draft_tokens"] == GAMMA * batch
    assert s["num_accepted_tokens"] == sum(stops)
    assert s["num_accepted_tokens_per_pos"] == [sum(st > j for st in stops) for j in range(GAMMA)]
    assert math.isclose(s["mean_acceptance_length"], 1 + sum(stops) / batch)
    assert math.isclose(s["draft_acceptance_rate"], sum(stops) / (GAMMA * batch))
    assert s["num_generated_tokens"] == sum(st + 1 for st in stops)


def test_accepted_drafts_never_exceed_emitted_tokens_with_eos():
    """Sparse drafts, rows ending at their own EOS: every accepted draft counted was emitted."""
    model, ids, mask, ref = _case(3)
    T = ids.shape[1]
    eos = sorted({ref[0, T + 9].item(), ref[2, T + 5].item()})
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=NEW, num_speculative_tokens=GAMMA, gamma_policy="fixed",
                             eos_token_id=eos, **SPARSE)
    ref_eos = hf_greedy(model, ids, mask, NEW, eos_token_id=eos)
    assert torch.equal(out.sequences, ref_eos), first_diff(out.sequences, ref_eos)
    s = out.stats
    assert 0 < s["num_accepted_tokens"] <= s["num_generated_tokens"] - 3
    assert sum(s["num_accepted_tokens_per_pos"]) == s["num_accepted_tokens"]
    assert s["num_accepted_tokens"] <= s["num_draft_tokens"]


def test_decode_stats_unit():
    s = DecodeStats.for_gamma(4)
    s.record(torch.tensor([4, 4, 0]), torch.tensor([2, 4, 0]))
    s.record(torch.tensor([3, 1, 0]), torch.tensor([0, 1, 0]))
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (4, 12, 7)
    assert s.num_accepted_tokens_per_pos == [3, 2, 1, 1]
    assert math.isclose(s.mean_acceptance_length, 1 + 7 / 4)
    assert math.isclose(s.draft_acceptance_rate, 7 / 12)
    s.num_generated_tokens, s.time_prefill_s = 20, 1.0
    d = s.as_dict(time_total_s=3.0, batch_size=2)
    assert math.isclose(d["tokens_per_s"], 20 / 3) and math.isclose(d["decode_tokens_per_s"], 18 / 2)
    empty = DecodeStats.for_gamma(0).as_dict(0.0, 0)
    assert empty["mean_acceptance_length"] == 1.0 and empty["draft_acceptance_rate"] == 0.0
