"""One loaded model shared by several decode calls at once (threads, streamer callbacks).

Patching is per model (``config._attn_implementation``) while a decode call's scope is per call;
these tests pin the rule that no call ever switches the implementation under another's forward:
every overlapping call returns plain greedy's tokens.
"""
from __future__ import annotations

import threading

import pytest
import torch

import vegas_ext
from vegas_ext.attention import is_patched, patch_model, patched, unpatch_model

from decode_utils import first_diff, hf_greedy, make_model, make_prompts

GEN = dict(max_new_tokens=10, num_speculative_tokens=4, gamma_policy="fixed", sparse_attn_ratio=0.05,
           sparse_attn_min_tokens=0,
           eos_token_id=[], block_size=4)


class _Hook:
    """A streamer that runs ``fn`` at its ``at``-th ``put`` (the prompt is put 1)."""

    def __init__(self, at, fn):
        self.at, self.fn, self.n = at, fn, 0

    def put(self, _x):
        self.n += 1
        if self.n == self.at:
            self.fn()

    def end(self):
        pass


@pytest.fixture
def model_and_refs():
    model = make_model("llama")
    ids, mask = make_prompts(model.config.vocab_size, [48], seed=11)
    ids2, mask2 = make_prompts(model.config.vocab_size, [37], seed=12)
    ref = hf_greedy(model, ids, mask, GEN["max_new_tokens"], eos_token_id=[])
    ref2 = hf_greedy(model, ids2, mask2, GEN["max_new_tokens"], eos_token_id=[])
    return model, (ids, ref), (ids2, ref2)


def test_overlapping_calls_in_two_threads_keep_greedy_tokens(model_and_refs):
    """B enters first (patches), A enters while B runs, B finishes while A is mid-decode: B's exit
    must not unpatch the model under A (it did before: A's later forwards fell back to SDPA over
    the whole cache buffer and emitted other tokens, silently)."""
    model, (ids_a, ref_a), (ids_b, ref_b) = model_and_refs
    b_inside, b_go, b_done = threading.Event(), threading.Event(), threading.Event()
    res = {}

    def run_b():
        def pause():
            b_inside.set()
            assert b_go.wait(60)
        res["b"] = vegas_ext.generate(model, ids_b, streamer=_Hook(2, pause), **GEN).sequences
        b_done.set()

    def a_midway():  # A is inside its decode: let B finish and leave its scope
        b_go.set()
        assert b_done.wait(60)

    tb = threading.Thread(target=run_b)
    tb.start()
    assert b_inside.wait(60)
    res["a"] = vegas_ext.generate(model, ids_a, streamer=_Hook(3, a_midway), **GEN).sequences
    tb.join(60)
    assert torch.equal(res["a"], ref_a), first_diff(res["a"], ref_a)
    assert torch.equal(res["b"], ref_b), first_diff(res["b"], ref_b)
    assert not is_patched(model)  # the last scope out restored it
    assert not hasattr(model, "_vegas_patch_scopes")


def test_unpatch_during_a_decode_is_deferred(model_and_refs):
    model, (ids, ref), _ = model_and_refs
    out = vegas_ext.generate(model, ids, streamer=_Hook(3, lambda: unpatch_model(model)), **GEN)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    assert not is_patched(model)


def test_patch_during_a_decode_keeps_the_model_patched(model_and_refs):
    model, (ids, ref), _ = model_and_refs
    out = vegas_ext.generate(model, ids, streamer=_Hook(3, lambda: patch_model(model)), **GEN)
    assert torch.equal(out.sequences, ref)
    assert is_patched(model)  # patched on purpose during the call: stays patched
    unpatch_model(model)
    assert not is_patched(model)


def test_nested_scopes_restore_once(model_and_refs):
    model = model_and_refs[0]
    with patched(model):
        with patched(model):
            assert is_patched(model)
        assert is_patched(model)
    assert not is_patched(model)


def test_manual_switch_while_a_decode_runs_raises(model_and_refs):
    """Switching the implementation by hand under a running decode can't be deferred: it must fail
    loudly rather than emit other tokens."""
    model, (ids, _ref), _ = model_and_refs
    with pytest.raises(RuntimeError, match="attention implementation"):
        vegas_ext.generate(model, ids, streamer=_Hook(3, lambda: model.set_attn_implementation("sdpa")), **GEN)
    assert not hasattr(model, "_vegas_patch_scopes")


def test_threads_stress_match_plain_greedy(model_and_refs):
    model, (ids_a, ref_a), (ids_b, ref_b) = model_and_refs
    bad = []

    def work(ids, ref):
        for _ in range(8):
            seq = vegas_ext.generate(model, ids, **GEN).sequences
            if not torch.equal(seq, ref):
                bad.append(first_diff(seq, ref))

    ts = [threading.Thread(target=work, args=a) for a in ((ids_a, ref_a), (ids_b, ref_b))]
    [t.start() for t in ts]
    [t.join(120) for t in ts]
    assert not bad, bad
    assert not is_patched(model)
