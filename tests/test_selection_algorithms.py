"""Selection algorithms in the shared decode loop: ``streamingllm``, ``quest``, ``vegas`` variants.

Tiny random-weight Llama / Qwen2 models (2 layers) on prompts of a few hundred tokens with a
small budget (32 tokens = 2 blocks), so drafts are approximate and rejections (rollbacks) happen.
Checks: greedy output equals HF ``generate`` (batch 1 and a ragged batch); the selected blocks
respect the budget, the sinks and the tail; Quest's min/max metadata equals a recomputation from
the cache at every draft step (after appends and rollbacks); prefill reuse; the selection time
accounting (the benchmark harness is tested in test_bench_tools.py).
"""
from __future__ import annotations

import pytest
import torch

from vegas_ext import decode, ops, reference, speculation
from vegas_ext.decode import (
    SELECTION_ALGORITHMS,
    VegasSelection,
    budget_blocks,
    generate,
    register_selection_algorithm,
)
from vegas_ext.selection import QuestSelection, StreamingLLMSelection, streaming_indices

from decode_utils import first_diff, hf_greedy, make_model, make_prompts, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 40
GAMMA = 4
SMALL = dict(sparse_attn_ratio=0.05, sparse_attn_min_tokens=32, block_size=16, eos_token_id=[])
LENGTHS = {1: [300], 3: [300, 170, 241]}

_MODELS = {}
_REFS = {}


def _model(family):
    if family not in _MODELS:
        _MODELS[family] = make_model(family)
    return _MODELS[family]


def _case(family, batch):
    key = (family, batch)
    if key not in _REFS:
        m = _model(family)
        ids, mask = make_prompts(m.config.vocab_size, LENGTHS[batch])
        _REFS[key] = (ids, mask, hf_greedy(m, ids, mask, NEW, eos_token_id=[]))
    return (_model(family),) + _REFS[key]


VARIANTS = {
    "streamingllm": dict(sparse_attn_algorithm="streamingllm"),
    "quest": dict(sparse_attn_algorithm="quest"),
    "vegas": dict(sparse_attn_algorithm="vegas"),
    "vegas-first_last": dict(sparse_attn_algorithm="vegas", query_weights="first_last"),
    "vegas-shared": dict(sparse_attn_algorithm="vegas", share_selection_across_heads=True),
    "vegas-b1": dict(sparse_attn_algorithm="vegas", block_size=1),
    "vegas-b64": dict(sparse_attn_algorithm="vegas", block_size=64),
    "vegas-refresh3": dict(sparse_attn_algorithm="vegas", selection_refresh_interval=3),
    "vegas-decay0": dict(sparse_attn_algorithm="vegas", score_decay=0.0),
    "quest-b1-sinks2": dict(sparse_attn_algorithm="quest", block_size=1, num_sink_blocks=2),
}


def test_registry_has_rivals():
    assert {"full", "vegas", "streamingllm", "quest"} <= set(SELECTION_ALGORITHMS)
    for name in ("streamingllm", "quest"):
        doc = SELECTION_ALGORITHMS[name].__doc__
        assert "arXiv" in doc


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lossless_greedy(variant, family, batch):
    if family == "qwen2" and variant not in ("streamingllm", "quest", "vegas"):
        pytest.skip("variants checked on llama")
    model, ids, mask, ref = _case(family, batch)
    out = generate(model, ids, mask, max_new_tokens=NEW, num_speculative_tokens=GAMMA, gamma_policy="fixed",
                   **{**SMALL, **VARIANTS[variant]})
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    s = out.stats
    assert s["num_draft_tokens"] > 0
    # small budget: approximate drafts (not all accepted) that still help
    assert s["num_accepted_tokens"] < s["num_draft_tokens"]
    assert s["mean_acceptance_length"] > 1.0


# ------------------------------------------------------------------ recorded selections
_LOG = []


@register_selection_algorithm("_test_rec_streamingllm")
class _RecStreaming(StreamingLLMSelection):
    def select(self, ctx):
        idx = super().select(ctx)
        _LOG.append((budget_blocks(ctx.lengths, self.cfg), ctx.tail_start.clone(), idx.clone(), ctx.iteration, None))
        return idx


@register_selection_algorithm("_test_rec_vegas")
class _RecVegas(VegasSelection):
    def select(self, ctx):
        idx = super().select(ctx)
        prev = None if ctx.previous is None else ctx.previous.clone()
        _LOG.append((budget_blocks(ctx.lengths, self.cfg), ctx.tail_start.clone(), idx.clone(), ctx.iteration, prev))
        return idx


@register_selection_algorithm("_test_rec_quest")
class _RecQuest(QuestSelection):
    check_metadata = False
    mismatches = []

    def select(self, ctx):
        super().select(ctx)
        self._tail = ctx.tail_start.clone()
        return None

    def _choose(self, layer, q, k_cache, v_cache):
        idx = super()._choose(layer, q, k_cache, v_cache)
        _LOG.append((self._k.clone(), self._tail.clone(), idx.clone()[None], None, None))
        if self.check_metadata:  # metadata of every block holding valid tokens == recomputation from the cache
            bs = self.cfg.block_size
            seq = self._state.cache.seq_lens
            kmin = torch.full_like(self.key_min[layer], float("nan"))
            kmax = torch.full_like(self.key_max[layer], float("nan"))
            reference.block_minmax_update(kmin, kmax, k_cache, seq, torch.zeros_like(seq), bs)
            for b in range(seq.shape[0]):
                nb = -(-int(seq[b]) // bs)
                ok = torch.equal(self.key_min[layer][b, :, :nb], kmin[b, :, :nb]) and torch.equal(
                    self.key_max[layer][b, :, :nb], kmax[b, :, :nb])
                if not ok:
                    type(self).mismatches.append((layer, b, int(seq[b])))
        return idx


def _check_log(num_sink_blocks, exact_count=True):
    assert _LOG
    for k, tail, idx, _it, _prev in _LOG:
        L, B, H, K = idx.shape
        bs = SMALL["block_size"]
        nc = (tail.long() + bs - 1) // bs
        for b in range(B):
            c = min(int(k[b]), int(nc[b]))
            for layer in range(L):
                for h in range(H):
                    row = idx[layer, b, h]
                    sel = row[row >= 0]
                    assert len(sel) == len(set(sel.tolist()))  # unique
                    assert bool((sel < nc[b]).all()), (sel, nc[b])  # before the tail
                    assert len(sel) <= int(k[b])  # budget
                    if exact_count:
                        assert len(sel) == c
                    sinks = set(range(min(num_sink_blocks, c)))
                    assert sinks <= set(sel.tolist())  # sinks kept


@pytest.mark.parametrize("alg", ["_test_rec_streamingllm", "_test_rec_vegas", "_test_rec_quest"])
@pytest.mark.parametrize("share", [False, True])
def test_selected_blocks_respect_budget_sinks_and_tail(alg, share):
    if share and alg != "_test_rec_vegas":
        pytest.skip("sharing is a vegas option")
    model, ids, mask, ref = _case("llama", 3)
    _LOG.clear()
    out = generate(model, ids, mask, max_new_tokens=NEW, num_speculative_tokens=GAMMA, gamma_policy="fixed",
                   sparse_attn_algorithm=alg,
                   num_sink_blocks=2, share_selection_across_heads=share, **SMALL)
    assert torch.equal(out.sequences, ref)
    _check_log(2)
    if alg == "_test_rec_streamingllm":  # exactly the sinks + the most recent blocks
        for k, tail, idx, _it, _prev in _LOG:
            nc = ((tail.long() + 15) // 16).to(torch.int32)
            exp = streaming_indices(k, nc, 2, idx.shape[-1])
            assert torch.equal(idx[0, :, 0], exp)
    if share:
        for _k, _t, idx, _it, _p in _LOG:
            assert bool((idx == idx[:, :, :1]).all())


def test_vegas_keeps_the_recent_blocks_before_the_tail():
    """num_recent_tokens=20 at 16-token blocks: the 2 blocks before the tail are in every draft's
    set beside the sink, the rest of the budget goes by score; output unchanged."""
    model, ids, mask, ref = _case("llama", 3)
    _LOG.clear()
    out = generate(model, ids, mask, max_new_tokens=NEW, num_speculative_tokens=GAMMA, gamma_policy="fixed",
                   sparse_attn_algorithm="_test_rec_vegas", num_sink_blocks=1, num_recent_tokens=20,
                   **{**SMALL, "sparse_attn_min_tokens": 80})
    assert torch.equal(out.sequences, ref)
    assert out.stats["num_recent_tokens"] == 20
    _check_log(1)
    for k, tail, idx, _it, _prev in _LOG:
        nc = (tail.long() + 15) // 16
        for b in range(idx.shape[1]):
            c = min(int(k[b]), int(nc[b]))
            recent = set(range(int(nc[b]) - min(2, c - 1), int(nc[b])))
            for row in idx[:, b].reshape(-1, idx.shape[-1]):
                assert recent <= set(row.tolist()), (recent, row)


def test_streaming_indices_unit():
    k = torch.tensor([3, 5, 2, 0, 4], dtype=torch.int32)
    nc = torch.tensor([10, 3, 1, 5, 4], dtype=torch.int32)
    idx = streaming_indices(k, nc, 1, 5)
    assert idx.tolist() == [
        [0, 8, 9, -1, -1],
        [0, 1, 2, -1, -1],
        [0, -1, -1, -1, -1],
        [-1, -1, -1, -1, -1],
        [0, 1, 2, 3, -1],
    ]


def test_refresh_interval_keeps_selection_between_refreshes():
    model, ids, mask, ref = _case("llama", 3)
    _LOG.clear()
    out = generate(model, ids, mask, max_new_tokens=NEW, num_speculative_tokens=GAMMA, gamma_policy="fixed",
                   sparse_attn_algorithm="_test_rec_vegas", selection_refresh_interval=3, **SMALL)
    assert torch.equal(out.sequences, ref)
    _check_log(1, exact_count=False)  # kept blocks lie before the (later) tail, within the older budget
    kept = fresh = 0
    for _k, _t, idx, it, prev in _LOG:
        if prev is not None and it % 3 != 0:
            assert torch.equal(idx, prev)
            kept += 1
        else:
            fresh += 1
    assert kept >= 2 and fresh >= 2
    assert out.stats["selection_refresh_interval"] == 3


@pytest.mark.parametrize("block_size", [16, 7])
def test_quest_metadata_equals_recomputation_after_appends_and_rollbacks(block_size):
    model, ids, mask, ref = _case("llama", 3)
    _LOG.clear()
    _RecQuest.check_metadata = True
    _RecQuest.mismatches = []
    try:
        out = generate(model, ids, mask, max_new_tokens=NEW, num_speculative_tokens=GAMMA, gamma_policy="fixed",
                       sparse_attn_algorithm="_test_rec_quest", return_cache=True,
                       **{**SMALL, "block_size": block_size})
    finally:
        _RecQuest.check_metadata = False
    assert torch.equal(out.sequences, ref)
    s = out.stats
    assert s["num_accepted_tokens"] < s["num_draft_tokens"]  # rejections -> rollbacks happened
    assert len(_LOG) >= 2 * GAMMA  # checked at many draft steps
    assert _RecQuest.mismatches == []


def test_quest_metadata_after_generate_matches_cache():
    """After the call, every block fully inside a row's committed length matches a recomputation."""
    holder = {}

    @register_selection_algorithm("_test_keep_quest")
    class _Keep(QuestSelection):
        def teardown(self, state):  # keep the final metadata; teardown releases it
            holder["key_min"], holder["key_max"] = self.key_min, self.key_max
            super().teardown(state)
            assert self.key_min == [] and self._state is None and state.write_hook is None

    model, ids, mask, ref = _case("llama", 3)
    out = generate(model, ids, mask, max_new_tokens=NEW, num_speculative_tokens=GAMMA, gamma_policy="fixed",
                   sparse_attn_algorithm="_test_keep_quest", return_cache=True, **SMALL)
    assert torch.equal(out.sequences, ref)
    key_min, key_max, cache = holder["key_min"], holder["key_max"], out.cache
    bs = 16
    for layer, cl in enumerate(cache.layers):
        kmin = torch.zeros_like(key_min[layer])
        kmax = torch.zeros_like(key_max[layer])
        reference.block_minmax_update(kmin, kmax, cl.keys, cache.lengths, torch.zeros_like(cache.lengths), bs)
        for b in range(cache.lengths.shape[0]):
            nfull = int(cache.lengths[b]) // bs
            assert torch.equal(key_min[layer][b, :, :nfull], kmin[b, :, :nfull])
            assert torch.equal(key_max[layer][b, :, :nfull], kmax[b, :, :nfull])
    del SELECTION_ALGORITHMS["_test_keep_quest"]


def test_quest_selection_time_is_accounted():
    model, ids, mask, ref = _case("llama", 1)
    out = generate(model, ids, mask, max_new_tokens=NEW, num_speculative_tokens=GAMMA, gamma_policy="fixed",
                   sparse_attn_algorithm="quest",
                   **SMALL)
    s = out.stats
    assert s["time_select_inline_s"] > 0
    assert s["time_select_s"] >= s["time_select_inline_s"] - 1e-9
    assert 0 <= s["time_select_prefill_s"] <= s["time_select_inline_s"]
    parts = s["time_prefill_s"] + s["time_draft_s"] + s["time_verify_s"] + s["time_select_s"]
    assert min(s["time_prefill_s"], s["time_draft_s"], s["time_verify_s"]) >= 0
    assert parts <= s["time_total_s"] * 1.001 + 1e-6
    out_v = generate(model, ids, mask, max_new_tokens=8, sparse_attn_algorithm="vegas", **SMALL)
    assert out_v.stats["time_select_inline_s"] == 0.0


@pytest.mark.parametrize("alg", ["vegas", "quest", "streamingllm"])
def test_prefill_cache_reuse_is_lossless(alg):
    model, ids, mask, ref = _case("llama", 3)
    pc = {}
    first = generate(model, ids, mask, max_new_tokens=1, num_speculative_tokens=0, gamma_policy="fixed",
                     sparse_attn_algorithm="full",
                     eos_token_id=[], prefill_cache=pc)
    assert not first.stats["prefill_reused"] and pc["ids"].shape == (3, 299)
    out = generate(model, ids, mask, max_new_tokens=NEW, num_speculative_tokens=GAMMA, gamma_policy="fixed",
                   sparse_attn_algorithm=alg,
                   prefill_cache=pc, **SMALL)
    assert out.stats["prefill_reused"]
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    other_ids, other_mask = make_prompts(model.config.vocab_size, LENGTHS[3], seed=7)
    o2 = generate(model, other_ids, other_mask, max_new_tokens=4, sparse_attn_algorithm=alg, prefill_cache=pc, **SMALL)
    assert not o2.stats["prefill_reused"]  # a different prompt is recomputed


@register_selection_algorithm("_test_rec_vegas_scores")
class _RecVegasScores(VegasSelection):
    def select(self, ctx):
        _LOG.append((ctx.block_scores.clone(), len(_VERIFY_CALLS)))
        return super().select(ctx)


_VERIFY_CALLS = []


class _Script(speculation.GammaPolicy):
    """γ from a list, cycled (0: a plain step)."""

    name = "script"
    script = (2, 2, 0, 0, 2, 2, 2)

    def choose_rows(self, caps):
        g = self.script[len(self.history) % len(self.script)]
        self.history.append(g)
        return torch.minimum(torch.full_like(caps, g), caps.clamp(min=0))


@pytest.mark.parametrize("decay", [0.0, 0.5, 1.0])
def test_score_decay_adds_the_earlier_verifications_scores(decay, monkeypatch):
    """The scores a selection ranks are ``decay`` times those the last one ranked plus the last
    verification's; after plain steps that did not score, the scoring verification's alone.
    Greedy output unchanged."""
    real = ops.verify_attention

    def spy(*a, **k):
        out = real(*a, **k)
        _VERIFY_CALLS.append(out[2].clone())
        return out

    monkeypatch.setattr(ops, "verify_attention", spy)
    monkeypatch.setattr(decode, "make_gamma_policy", lambda cap, policy, **kw: _Script(cap))
    model, ids, mask, ref = _case("llama", 1)
    L = model.config.num_hidden_layers
    _LOG.clear()
    _VERIFY_CALLS.clear()
    out = generate(model, ids, mask, max_new_tokens=NEW, num_speculative_tokens=2,
                   sparse_attn_algorithm="_test_rec_vegas_scores", score_decay=decay, **SMALL)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    assert out.stats["score_decay"] == decay
    prev, prev_calls, resets = None, None, 0
    for scores, n in _LOG:
        last = torch.stack(_VERIFY_CALLS[n - L:n])[:, None, 0]  # [L, 1, H, N]: the last forward's
        assert last.shape == scores.shape
        # a plain step in between (more than one forward's calls since) that did not score
        fresh = prev is not None and n - prev_calls == L
        resets += prev is not None and not fresh
        want = decay * prev + last if fresh else last
        torch.testing.assert_close(scores, want, rtol=1e-6, atol=1e-7)
        prev, prev_calls = scores, n
    assert resets >= 2 and len(_LOG) > resets + 3


def test_refresh_interval_validation():
    model, ids, mask, _ = _case("llama", 1)
    with pytest.raises(ValueError, match="selection_refresh_interval"):
        generate(model, ids, mask, max_new_tokens=2, selection_refresh_interval=0)
