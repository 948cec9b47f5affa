"""The decode loop: lossless greedy output vs HF generate, rollback, edge cases, stats, selection."""
from __future__ import annotations

import functools
import math

import pytest
import torch

import vegas_ext
from vegas_ext.cache import VegasCache
from vegas_ext.decode import (
    SELECTION_ALGORITHMS,
    SelectionConfig,
    SelectionContext,
    VegasSelection,
    budget_blocks,
)

from decode_utils import (  # noqa: F401
    FAMILIES,
    cached_model,
    first_diff,
    hf_greedy,
    make_model,
    make_prompts,
    one_thread,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# sparse enough on ~300-token prompts that drafts are approximate: 32 tokens = 4 blocks of 8
SPARSE = dict(sparse_attn_ratio=0.05, sparse_attn_min_tokens=32, block_size=8)
EXACT = dict(sparse_attn_ratio=1.0, sparse_attn_min_tokens=0, block_size=8)
NEW = 24
LENGTHS = {1: [300], 3: [300, 217, 281]}

def _policy(gamma):
    """``gamma_policy`` for a parametrized γ: an int is the γ of every iteration."""
    return "auto" if gamma == "auto" else "fixed"



@functools.lru_cache(maxsize=None)
def _case(family, batch):
    model = cached_model(family)
    ids, mask = make_prompts(model.config.vocab_size, LENGTHS[batch], seed=batch)
    ref = hf_greedy(model, ids, mask, NEW, eos_token_id=[])
    return model, ids, mask, ref


def _gen(model, ids, mask, **kw):
    kw.setdefault("max_new_tokens", NEW)
    kw.setdefault("eos_token_id", [])
    return vegas_ext.generate(model, ids, mask, **kw)


# --------------------------------------------------------------------------- lossless greedy
@pytest.mark.parametrize("gamma", [1, 4, 8])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate(family, batch, gamma):
    model, ids, mask, ref = _case(family, batch)
    out = _gen(model, ids, mask, num_speculative_tokens=gamma, gamma_policy=_policy(gamma), **SPARSE)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    s = out.stats
    assert s["num_draft_tokens"] > 0
    if gamma > 1:  # the budget is sparse: drafts are approximate, some are rejected
        assert s["draft_acceptance_rate"] < 1.0
    assert len(s["num_accepted_tokens_per_pos"]) == gamma


@pytest.mark.parametrize("family", FAMILIES)
def test_sparse_drafts_are_approximate_but_useful(family):
    model, ids, mask, ref = _case(family, 3)
    out = _gen(model, ids, mask, num_speculative_tokens=4, gamma_policy="fixed", **SPARSE)
    assert 0.0 < out.stats["draft_acceptance_rate"] < 1.0


@pytest.mark.parametrize("family", FAMILIES)
def test_full_algorithm_equals_hf_generate(family):
    model, ids, mask, ref = _case(family, 3)
    out = _gen(model, ids, mask, sparse_attn_algorithm="full")
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    s = out.stats
    assert s["num_drafts"] == 0 and s["num_draft_tokens"] == 0
    assert s["mean_acceptance_length"] == 1.0
    assert s["num_iterations"] == NEW - 1
    assert s["num_speculative_tokens"] == 0


@pytest.mark.parametrize(
    "opts",
    [
        dict(share_selection_across_heads=True),
        dict(query_weights="first_last"),
        dict(num_sink_blocks=0),
        dict(block_size=1, sparse_attn_min_tokens=24),
        dict(block_size=16, sparse_attn_min_tokens=16, sparse_attn_max_tokens=32, sparse_attn_ratio=0.5),
    ],
    ids=["shared", "first_last", "no_sink", "block1", "block16_max"],
)
def test_selection_variants_are_lossless(opts):
    model, ids, mask, ref = _case("llama", 3)
    kw = dict(SPARSE)
    kw.update(opts)
    out = _gen(model, ids, mask, num_speculative_tokens=4, gamma_policy="fixed", **kw)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)


def test_exact_budget_accepts_nearly_everything():
    model, ids, mask, ref = _case("qwen3", 3)
    out = _gen(model, ids, mask, num_speculative_tokens=4, gamma_policy="fixed", **EXACT)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    # the budget covers every block before the tail: drafts are exact up to float rounding
    assert out.stats["draft_acceptance_rate"] > 0.95


# --------------------------------------------------------------------------- rollback
def test_rollback_cache_equals_plain_decoding():
    model, ids, mask, ref = _case("llama", 3)
    spec = _gen(model, ids, mask, num_speculative_tokens=4, gamma_policy="fixed", return_cache=True, **SPARSE)
    plain = _gen(model, ids, mask, sparse_attn_algorithm="full", return_cache=True)
    assert torch.equal(spec.sequences, plain.sequences)
    assert spec.stats["num_accepted_tokens"] < spec.stats["num_draft_tokens"]  # there were rejections
    lens = torch.tensor(LENGTHS[3]) + NEW - 1
    assert spec.cache.lengths.tolist() == lens.tolist()
    assert plain.cache.lengths.tolist() == lens.tolist()
    for layer in range(len(spec.cache.layers)):
        for b in range(3):
            ks, vs = spec.cache.valid_kv(layer, b)
            kp, vp = plain.cache.valid_kv(layer, b)
            torch.testing.assert_close(ks, kp, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(vs, vp, atol=1e-5, rtol=1e-5)


def test_cache_scatter_rollback_unit():
    c = VegasCache(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=4, max_len=16, dtype=torch.float32,
                   device="cpu")
    c.commit(torch.tensor([3, 5]))
    c.begin_forward(2, offset=1)
    assert c.seq_lens.tolist() == [6, 8]
    k = torch.arange(2 * 2 * 2 * 4, dtype=torch.float32).view(2, 2, 2, 4)
    kb, vb = c.update(k, -k, 0)
    assert kb is c.layers[0].keys
    torch.testing.assert_close(kb[0, :, 4:6], k[0])
    torch.testing.assert_close(kb[1, :, 6:8], k[1])
    torch.testing.assert_close(vb[1, :, 6:8], -k[1])
    assert float(kb[0, :, 6:].abs().sum()) == 0.0
    c.rollback(torch.tensor([4, 4]))
    assert c.valid_kv(0, 1)[0].shape == (2, 4, 4)
    with pytest.raises(ValueError, match="max_len"):
        c.begin_forward(13)


def test_cache_copy_and_pickle_keep_layers_bound():
    """Layers hold a weak reference to their cache: deepcopy and pickle must re-bind it to the copy."""
    import copy
    import pickle

    c = VegasCache(num_layers=2, batch_size=2, num_kv_heads=1, head_dim=4, max_len=8, dtype=torch.float32, device="cpu")
    c.commit(torch.tensor([2, 3]))
    for dup in (copy.deepcopy(c), pickle.loads(pickle.dumps(c))):
        assert all(layer._parent is dup for layer in dup.layers)
        assert dup.layers[0].keys is not c.layers[0].keys
        dup.begin_forward(1)
        dup.update(torch.ones(2, 1, 1, 4), torch.ones(2, 1, 1, 4), 0)
        assert float(dup.layers[0].keys[0, 0, 2].sum()) == 4.0
        assert float(c.layers[0].keys.abs().sum()) == 0.0  # the original is untouched
        assert dup.get_seq_length() == 4 and c.get_seq_length() == 3  # the forward in flight is the copy's
    layer = VegasCache(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=4, max_len=4, dtype=torch.float32,
                       device="cpu").layers[0]  # its cache is gone at once
    with pytest.raises(RuntimeError, match="was freed"):
        layer.get_seq_length()


def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def test_cache_buffers_are_zero_and_advised_huge_pages():
    """The KV buffers start as zeros; on Linux with transparent huge pages available ("always" or
    "madvise") the cache asks for them (the advice covers the whole 2 MiB pages inside a buffer)."""
    from vegas_ext.cache import advise_huge_pages

    c = VegasCache(num_layers=2, batch_size=2, num_kv_heads=3, head_dim=64, max_len=4096, dtype=torch.float32,
                   device="cpu")
    for layer in c.layers:
        assert layer.keys.shape == (2, 3, 4096, 64) and not layer.keys.any() and not layer.values.any()
    assert advise_huge_pages(torch.zeros(16)) is False  # smaller than one huge page: nothing to advise
    assert advise_huge_pages(torch.zeros(1 << 20).to_sparse()) is False  # no strided storage
    assert advise_huge_pages(torch.zeros(1).expand(1 << 24)) is False  # 4 bytes of storage, not 64 MiB
    big = c.layers[0].keys
    if _thp_mode() in ("always", "madvise"):
        assert advise_huge_pages(big) is True


# --------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("lengths", [[1], [1, 40, 300]], ids=["alone", "batch"])
def test_one_token_prompt(lengths):
    model = cached_model("qwen2")
    ids, mask = make_prompts(model.config.vocab_size, lengths, seed=7)
    ref = hf_greedy(model, ids, mask, 16, eos_token_id=[])
    out = _gen(model, ids, mask, max_new_tokens=16, num_speculative_tokens=4, gamma_policy="fixed", **SPARSE)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)


@pytest.mark.parametrize("gamma", [4, 7, 8, 20])
def test_prompt_exactly_one_block(gamma):
    model = cached_model("mistral")
    ids, mask = make_prompts(model.config.vocab_size, [8], seed=3)
    ref = hf_greedy(model, ids, mask, 20, eos_token_id=[])
    out = _gen(model, ids, mask, max_new_tokens=20, num_speculative_tokens=gamma, gamma_policy=_policy(gamma),
               sparse_attn_min_tokens=0,
               block_size=8)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)


@pytest.mark.parametrize("batch", [1, 3])
def test_eos_inside_accepted_run(batch):
    model, ids, mask, ref = _case("llama", batch)
    T = ids.shape[1]
    new0 = ref[0, T:].tolist()
    # an EOS that first appears at new-token index >= 3 of row 0: inside a run of 8 exact drafts
    j = next(i for i in range(3, NEW) if new0[i] not in new0[:i])
    eos = new0[j]
    ref_eos = hf_greedy(model, ids, mask, NEW, eos_token_id=eos)
    out = _gen(model, ids, mask, num_speculative_tokens=8, gamma_policy="fixed", eos_token_id=eos, **EXACT)
    assert torch.equal(out.sequences, ref_eos), first_diff(out.sequences, ref_eos)
    assert out.sequences[0, T + j] == eos and out.sequences.shape[1] <= T + NEW
    # nothing emitted past the EOS (padding only)
    assert (out.sequences[0, T + j + 1 :] == 0).all()


@pytest.mark.parametrize("max_new", [1, 2, 5, 11])
def test_max_new_tokens_inside_accepted_run(max_new):
    model, ids, mask, ref = _case("qwen3", 3)
    out = _gen(model, ids, mask, max_new_tokens=max_new, num_speculative_tokens=8, gamma_policy="fixed", **EXACT)
    assert torch.equal(out.sequences, ref[:, : ids.shape[1] + max_new])
    assert out.stats["num_generated_tokens"] == 3 * max_new


def test_rows_finish_early_at_their_own_eos():
    model, ids, mask, ref = _case("qwen2", 3)
    T = ids.shape[1]
    # pick an EOS that some row emits early and another row never emits
    for cand in ref[:, T + 2 : T + 12].flatten().tolist():
        hits = [(ref[b, T:] == cand).any().item() for b in range(3)]
        if any(hits) and not all(hits):
            break
    else:
        pytest.fail("no suitable EOS token in this reference "
                    "(the seeded model and prompts are fixed: they must provide one)")
    ref_eos = hf_greedy(model, ids, mask, NEW, eos_token_id=cand)
    out = _gen(model, ids, mask, num_speculative_tokens=4, gamma_policy="fixed", eos_token_id=cand, **SPARSE)
    assert torch.equal(out.sequences, ref_eos), first_diff(out.sequences, ref_eos)


def _record_positions(model):
    seen = []

    def hook(mod, args, kwargs):
        seen.append(int(kwargs["position_ids"].max()))

    return seen, model.model.register_forward_pre_hook(hook, with_kwargs=True)


def test_generation_up_to_last_position():
    model = make_model("llama", max_position_embeddings=64)
    ids, mask = make_prompts(model.config.vocab_size, [40, 33], seed=5)
    n = 64 - 40 + 1  # row 0 ends exactly at the last position
    ref = hf_greedy(model, ids, mask, n, eos_token_id=[])
    seen, h = _record_positions(model)
    try:
        out = _gen(model, ids, mask, max_new_tokens=n, num_speculative_tokens=8, gamma_policy="fixed",
                   sparse_attn_min_tokens=8, block_size=4)
    finally:
        h.remove()
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    assert max(seen) <= 63


def test_max_new_tokens_capped_at_model_positions():
    model = make_model("llama", max_position_embeddings=64)
    ids, mask = make_prompts(model.config.vocab_size, [40], seed=5)
    ref = hf_greedy(model, ids, mask, 25, eos_token_id=[])
    with pytest.warns(UserWarning, match="max_position_embeddings"):
        out = _gen(model, ids, mask, max_new_tokens=40, num_speculative_tokens=6, gamma_policy="fixed",
                   sparse_attn_min_tokens=8,
                   block_size=4)
    assert torch.equal(out.sequences, ref)


def test_streamer_receives_prompt_then_tokens():
    class Collect:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, v):
            self.chunks.append(v.flatten().tolist())

        def end(self):
            self.ended = True

    model, ids, mask, ref = _case("llama", 1)
    s = Collect()
    out = _gen(model, ids, mask, num_speculative_tokens=4, gamma_policy="fixed", streamer=s, **SPARSE)
    assert s.ended and s.chunks[0] == ids[0].tolist()
    assert sum(s.chunks[1:], []) == out.sequences[0, ids.shape[1] :].tolist()


def test_stats_are_consistent():
    model, ids, mask, ref = _case("qwen2", 3)
    out = _gen(model, ids, mask, num_speculative_tokens=6, gamma_policy="fixed", **SPARSE)
    s = out.stats
    for key in (
        "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
        "mean_acceptance_length", "draft_acceptance_rate", "num_generated_tokens", "num_iterations",
        "tokens_per_s", "time_total_s", "time_prefill_s", "time_draft_s", "time_verify_s", "time_select_s",
        "sparse_attn_algorithm", "num_speculative_tokens", "sparse_attn_ratio", "block_size",
    ):
        assert key in s, key
    assert s["num_generated_tokens"] == 3 * NEW
    assert sum(s["num_accepted_tokens_per_pos"]) == s["num_accepted_tokens"]
    assert s["num_accepted_tokens_per_pos"] == sorted(s["num_accepted_tokens_per_pos"], reverse=True)
    assert math.isclose(s["mean_acceptance_length"], 1 + s["num_accepted_tokens"] / s["num_drafts"])
    assert math.isclose(s["draft_acceptance_rate"], s["num_accepted_tokens"] / s["num_draft_tokens"])
    parts = s["time_prefill_s"] + s["time_draft_s"] + s["time_verify_s"] + s["time_select_s"]
    assert parts <= s["time_total_s"] * 1.001 and s["tokens_per_s"] > 0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(sparse_attn_algorithm="magic"), "sparse_attn_algorithm"),
        (dict(sparse_attn_ratio=0.0), "sparse_attn_ratio"),
        (dict(sparse_attn_ratio=1.5), "sparse_attn_ratio"),
        (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
        (dict(block_size=0), "block_size"),
        (dict(query_weights="middle"), "query_weights"),
        (dict(max_new_tokens=-2), "max_new_tokens"),
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(do_sample=True, top_p=0.0), "top_p"),
    ],
)
def test_bad_options_raise(kw, match):
    model, ids, mask, _ = _case("llama", 1)
    with pytest.raises(ValueError, match=match):
        _gen(model, ids, mask, **kw)


def test_bad_prompts_raise():
    model = cached_model("llama")
    ids, mask = make_prompts(model.config.vocab_size, [10, 6])
    with pytest.raises(ValueError, match="left padding"):
        _gen(model, ids, mask.flip(1))
    with pytest.raises(ValueError, match="at least one prompt token"):
        _gen(model, ids, torch.cat([mask[:1], torch.zeros_like(mask[:1])]))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        _gen(model, torch.randint(3, 100, (1, 1100)), None)


def test_zero_new_tokens_returns_prompt():
    model, ids, mask, _ = _case("llama", 3)
    out = _gen(model, ids, mask, max_new_tokens=0)
    assert torch.equal(out.sequences, ids)


# --------------------------------------------------------------------------- selection
def test_budget_blocks():
    cfg = SelectionConfig(ratio=0.05, min_tokens=256, max_tokens=None, block_size=16)
    lens = torch.tensor([100, 4096, 8000, 20000], dtype=torch.int32)
    assert budget_blocks(lens, cfg).tolist() == [16, 16, 25, 63]
    cfg = SelectionConfig(ratio=0.1, min_tokens=0, max_tokens=500, block_size=7)
    assert budget_blocks(lens, cfg).tolist() == [2, 59, 72, 72]


@pytest.mark.parametrize("recent_tokens", [0, 12])
@pytest.mark.parametrize("share", [False, True])
def test_vegas_selection_respects_budget_sinks_and_tail(share, recent_tokens):
    """Sinks first, the blocks of the last ``recent_tokens`` candidates (12 tokens: 2 blocks of 8)
    last, the highest scores between them; within the budget, before the tail, ascending."""
    torch.manual_seed(0)
    L, B, H, N = 3, 2, 4, 40
    scores = torch.rand(L, B, H, N)
    lengths = torch.tensor([300, 150], dtype=torch.int32)
    tail = torch.tensor([290, 141], dtype=torch.int32)
    cfg = SelectionConfig(ratio=0.2, min_tokens=0, block_size=8, num_sink_blocks=2, num_recent_tokens=recent_tokens,
                          share_selection_across_heads=share)
    idx = VegasSelection(cfg).select(SelectionContext(scores, lengths, tail, cache=None))
    k = budget_blocks(lengths, cfg)  # [8, 4] blocks
    ncand = [(290 + 7) // 8, (141 + 7) // 8]
    assert idx.shape == (L, B, H, int(k.max()))
    for l in range(L):
        for b in range(B):
            c = min(int(k[b]), ncand[b])
            nr = min(-(-recent_tokens // 8), c - 2)
            for h in range(H):
                sel = [i for i in idx[l, b, h].tolist() if i >= 0]
                assert len(sel) == c
                assert all(i < ncand[b] for i in sel) and sel == sorted(sel)
                assert sel[:2] == [0, 1]  # sinks first
                assert sel[c - nr:] == list(range(ncand[b] - nr, ncand[b]))  # the recent blocks last
                rest = [i for i in range(2, ncand[b] - nr)]
                sc = scores[l, b].sum(0) if share else scores[l, b, h]
                best = sorted(rest, key=lambda i: -float(sc[i]))[: c - 2 - nr]
                assert sorted(best) == sel[2:c - nr]
            if share:
                assert (idx[l, b] == idx[l, b, :1]).all()


def test_registry_has_builtin_algorithms():
    assert {"vegas", "full"} <= set(SELECTION_ALGORITHMS)
    assert SELECTION_ALGORITHMS["full"].drafts is False
    assert SELECTION_ALGORITHMS["vegas"].needs_verify_scores


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs(dtype):
    model = make_model("qwen3").to(dtype)
    ids, mask = make_prompts(model.config.vocab_size, [120, 77], seed=9)
    out = _gen(model, ids, mask, max_new_tokens=12, num_speculative_tokens=4, gamma_policy="fixed",
               sparse_attn_min_tokens=16, block_size=8)
    assert out.sequences.shape == (2, 120 + 12)
    assert out.stats["dtype"] == str(dtype).replace("torch.", "")
    new = out.sequences[:, 120:]
    assert bool(((new >= 0) & (new < model.config.vocab_size)).all())
    plain = _gen(model, ids, mask, max_new_tokens=12, sparse_attn_algorithm="full")
    # the same numerics path decides the first token (prefill + verify of the prompt tail)
    assert torch.equal(out.sequences[:, 120], plain.sequences[:, 120])


# --------------------------------------------------------------------------- memory
def _live_caches() -> int:
    import gc

    return sum(1 for o in gc.get_objects() if type(o) is VegasCache)


@pytest.mark.parametrize("algorithm", ["full", "vegas", "streamingllm", "quest"])
def test_cache_freed_without_cyclic_gc(algorithm):
    """Every cache is freed by reference counting when generate() returns (or raises): a reference
    cycle would keep its [B, H_kv, S_max, D] buffers until the cyclic GC runs, which large tensors
    do not trigger, so repeated calls piled up caches (found as 11+ GB in a benchmark grid)."""
    import gc

    model, ids, mask, _ = _case("llama", 1)
    gc.collect()
    base = _live_caches()
    gc.disable()
    try:
        out = _gen(model, ids, mask, max_new_tokens=6, sparse_attn_algorithm=algorithm, **SPARSE)
        assert out.stats["num_generated_tokens"] == 6
        assert _live_caches() == base
        out = _gen(model, ids, mask, max_new_tokens=6, sparse_attn_algorithm=algorithm, return_cache=True, **SPARSE)
        assert _live_caches() == base + 1  # the caller holds it, and its layers still work
        assert out.cache.layers[0].get_seq_length() > 0
        del out
        assert _live_caches() == base

        def boom(*a, **k):
            raise RuntimeError("boom")

        orig = vegas_ext.ops.verify_attention
        vegas_ext.ops.verify_attention = boom
        try:
            with pytest.raises(RuntimeError, match="boom") as err:
                _gen(model, ids, mask, max_new_tokens=6, sparse_attn_algorithm=algorithm, **SPARSE)
        finally:
            vegas_ext.ops.verify_attention = orig
        del err  # its traceback holds generate()'s frame, and with it the cache
        assert _live_caches() == base
    finally:
        gc.enable()
