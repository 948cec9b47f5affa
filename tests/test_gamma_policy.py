"""``num_speculative_tokens="auto"``: the gamma policy's choices, and losslessness whatever it picks."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import vegas_ext
from vegas_ext import speculation
from vegas_ext.speculation import AutoGamma, FixedGamma, IterationCosts, RowGamma

from decode_utils import FAMILIES, cached_model, first_diff, hf_greedy, make_prompts, one_thread  # noqa: F401
from test_cli import run_cli, tiny_model_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPARSE = dict(sparse_attn_ratio=0.05, sparse_attn_min_tokens=32, block_size=8, eos_token_id=[])
CAPS = torch.tensor([100, 100])


def _feed(p, g, t_draft, c0, c1, drafted, accepted, t_select=0.0):
    p.observe_iteration(IterationCosts(g, g * t_draft, c0 + c1 * (g + 1), t_select if g else 0.0, scored=g > 0),
                        torch.tensor(drafted), torch.tensor(accepted))


def _feed_one(p, g, draft, verify, select=0.0, accepted=None, scored=None):
    """One iteration of a batch-1 run: ``g`` drafted, ``accepted`` of them accepted (default all);
    the verification scored the KV blocks iff ``g > 0`` unless ``scored`` says otherwise."""
    p.observe_iteration(IterationCosts(g, draft, verify, select, scored=g > 0 if scored is None else scored),
                        torch.tensor([g]), torch.tensor([g if accepted is None else accepted]))


def _warm(p, t_draft, c0, c1, acc):
    """The two warm-up iterations (gamma first_gamma = 2, then 0), every row accepting ``acc`` of 2."""
    assert p.choose(CAPS, 8) == p.first_gamma == 2
    _feed(p, 2, t_draft, c0, c1, [2, 2], [acc, acc], 0.001)
    assert p.choose(CAPS, 8) == 0
    _feed(p, 0, t_draft, c0, c1, [0, 0], [0, 0])


# --------------------------------------------------------------------------- the policy alone
def test_auto_speculates_when_drafts_are_cheap_and_accepted():
    p = AutoGamma(8)
    _warm(p, t_draft=0.01, c0=0.1, c1=0.001, acc=2)
    for _ in range(6):
        g = p.choose(CAPS, 8)
        _feed(p, g, 0.01, 0.1, 0.001, [g, g], [g, g], 0.001)
    assert g == 8  # every draft accepted, drafting ~free: the longest run
    assert all(a > 0.9 for a in p.acceptance()[:3])
    c0, c1 = p.verify_fit()
    assert math.isclose(c0, 0.1, rel_tol=1e-6) and math.isclose(c1, 0.001, rel_tol=1e-4)


def test_auto_decodes_plainly_when_speculation_loses_and_keeps_probing():
    p = AutoGamma(8, exploration=0.0)  # probes only (no draft on the upper bound)
    # drafting is cheap (accepted drafts would pay), verifying costs grow fast, no draft accepted
    _warm(p, t_draft=0.02, c0=0.08, c1=0.03, acc=0)
    assert not p.hopeless(CAPS, 8)
    gs = []
    for _ in range(40):
        g = p.choose(CAPS, 8)
        gs.append(g)
        _feed(p, g, 0.02, 0.08, 0.03, [g, g], [0, 0], 0.001)
    assert gs.count(0) >= 35
    probes = [i for i, g in enumerate(gs) if g > 0]
    assert p.num_probes == len(probes) >= 2
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # back-off: probes get rarer


def test_auto_does_not_probe_where_no_acceptance_could_pay():
    """A draft step costs 0.9 of a plain step and verifying grows fast (batch 1 on a CPU: the
    weights dominate every step): even with every draft accepted no gamma beats plain decoding,
    so after the warm-up the policy runs no probe for ``hopeless_probe_interval`` plain
    iterations, then one (the costs may have drifted) and again none for as long."""
    p = AutoGamma(8)
    _warm(p, t_draft=0.1, c0=0.08, c1=0.03, acc=2)  # every draft accepted: acceptance is not the reason
    assert p.hopeless(CAPS, 8)
    best = max(p.rate(g, CAPS, [1.0] * 8, optimistic=True) for g in range(1, 9)) / p.rate(0, CAPS)
    assert 0.8 < best < 0.97
    gs = []
    for _ in range(2 * p.hopeless_probe_interval + 2):
        g = p.choose(CAPS, 8)
        gs.append(g)
        _feed(p, g, 0.1, 0.08, 0.03, [g, g], [g, g], 0.001)
    probes = [i for i, g in enumerate(gs) if g > 0]
    n = p.hopeless_probe_interval
    assert probes == [n - 1, 2 * n - 1] and p.num_probes == 2  # after n plain steps in a row, twice
    # the same costs with the old spacing (a probe after every 4-32 plain steps) when told to
    eager = AutoGamma(8, hopeless_probe_interval=0)
    _warm(eager, t_draft=0.1, c0=0.08, c1=0.03, acc=2)
    ge = []
    for _ in range(40):
        g = eager.choose(CAPS, 8)
        ge.append(g)
        _feed(eager, g, 0.1, 0.08, 0.03, [g, g], [g, g], 0.001)
    assert eager.num_probes >= 2 and ge.count(0) >= 30


def test_auto_switches_back_on_when_speculation_starts_to_pay():
    p = AutoGamma(8)
    _warm(p, t_draft=0.02, c0=0.08, c1=0.03, acc=0)
    for _ in range(10):
        g = p.choose(CAPS, 8)
        _feed(p, g, 0.02, 0.08, 0.03, [g, g], [0, 0])
    # the context grew: verification now dominated by attention, drafts accepted, drafting cheap
    gs = []
    for _ in range(60):
        g = p.choose(CAPS, 8)
        gs.append(g)
        _feed(p, g, 0.02, 0.5, 0.01, [g, g], [g, g], 0.001)
    assert gs[-1] >= 4 and gs[-10:].count(0) == 0



def test_auto_stays_plain_near_break_even():
    """A predicted gain inside the margin (~1 % with the estimates the policy has by then; the
    true rates would give more) is not taken: plain steps, apart from probes."""
    p = AutoGamma(8)
    # every draft accepted, but a draft step costs 0.95 of a plain step (verification as a plain step)
    _warm(p, t_draft=0.095, c0=0.1, c1=0.0, acc=2)
    gs = []
    for _ in range(30):
        g = p.choose(CAPS, 8)
        gs.append(g)
        _feed(p, g, 0.095, 0.1, 0.0, [g, g], [g, g])
    plain = p.expected_tokens(0, CAPS) / p.relative_cost(0)
    best = max(p.expected_tokens(g, CAPS) / p.relative_cost(g) for g in range(1, 9)) / plain
    assert 1.0 < best < 1.03  # a gain, but inside the margin
    assert gs.count(0) >= 25 and p.num_probes == 30 - gs.count(0)  # speculation only in probes


def test_auto_batch_one_recovers_from_early_rejections():
    """Batch 1: the first drafts are all rejected (speculation looks lost), then every draft is
    accepted; a probe's accepted drafts raise the pooled estimate of every position, and
    speculation comes back within a few probes instead of staying off for the run."""
    caps = torch.tensor([200])
    p = AutoGamma(8)
    assert p.choose(caps, 8) == 2
    _feed_one(p, 2, 2 * 0.04, 0.11 + 0.01 * 3, 0.001, accepted=0)
    assert p.choose(caps, 8) == 0
    _feed_one(p, 0, 0.0, 0.11)
    gs = []
    for _ in range(60):
        g = p.choose(caps, 8)
        gs.append(g)
        _feed_one(p, g, g * 0.04, 0.1 + 0.01 * (g + 1), 0.001 if g else 0.0)
    first_on = next(i for i in range(len(gs) - 5) if all(x > 0 for x in gs[i:i + 5]))
    assert first_on <= 20 and gs[-20:].count(0) == 0


def test_auto_climbs_out_of_short_drafts_after_early_rejections():
    """Batch 4 at costs measured at 4K, batch 4 (in plain steps: a draft step 0.6, verifying
    q = 2 / 3 / 4 tokens 1.27 / 1.45 / 1.30): the first two drafts of 2 are rejected at position 2
    in half the rows, every later draft is accepted. Drafting 1 token never retries position 2,
    and without climbing the loop drafts 1 token for the rest of the run; climbs draft longer now
    and then, time the cheaper q = 4, and the drafts grow to the longest."""
    t = 0.185
    verify = {1: 1.0, 2: 1.27, 3: 1.45, 4: 1.30, 5: 1.32, 6: 1.45, 7: 1.56, 8: 1.62, 9: 1.68}
    caps = torch.tensor([400] * 4)

    def run(p, n=60):
        gs, bad = [], 0
        for _ in range(n):
            g = p.choose(caps, 8)
            acc = [g] * 4
            if g >= 2 and bad < 2:
                acc, bad = [1, g, 1, g], bad + 1
            gs.append(g)
            costs = IterationCosts(g, g * 0.6 * t, verify[g + 1] * t, 0.035 * t if g else 0.0, scored=g > 0)
            p.observe_iteration(costs, torch.tensor([g] * 4), torch.tensor(acc))
        return gs

    flat = run(AutoGamma(8))  # climbing is off by default
    assert flat[-40:].count(1) >= 38  # locked in
    p = AutoGamma(8, climb=True)
    gs = run(p)
    assert gs[-30:] == [8] * 30 and p.num_probes >= 1
    assert p.acceptance()[1] > 0.9


def test_optimistic_gamma_chooses_the_length_at_the_upper_bound():
    """``optimistic_gamma``: where the estimates say speculate, the draft length is the best at the
    upper-bound acceptance; with the same observations it drafts at least as long, and it still
    decodes plainly where drafts are rejected."""
    caps = torch.tensor([200])
    lengths = {}
    for opt in (False, True):
        p = RowGamma(8, optimistic_gamma=opt, prior_weight=4)  # a weak prior: the rejection shortens drafts
        p.observe_prefill(9, 1, 0.2)
        gs = []
        for it in range(30):
            g = p.choose(caps, 8)
            gs.append(g)
            acc = 0 if it == 1 and g > 1 else g  # one early rejection at position 1
            p.observe_iteration(IterationCosts(g, 0.01 * g, 0.07 + 0.004 * (g + 1), 0.001 if g else 0.0,
                                               scored=g > 0, tokens=g + 1, rows=1), torch.tensor([g]),
                                torch.tensor([acc]))
        lengths[opt] = gs[5:]
    assert min(a <= b for a, b in zip(lengths[False], lengths[True])) and sum(lengths[True]) > sum(lengths[False])
    p = RowGamma(8, optimistic_gamma=True)
    p.observe_prefill(9, 1, 0.2)
    for _ in range(30):
        g = p.choose(caps, 8)
        p.observe_iteration(IterationCosts(g, 0.01 * g, 0.07 + 0.004 * (g + 1), 0.001 if g else 0.0, scored=g > 0,
                                           tokens=g + 1, rows=1), torch.tensor([g]), torch.tensor([0]))
    assert p.history[-10:].count(0) >= 8


def test_auto_explores_while_few_trials_say_it_loses():
    """Batch 1 at 8K-like costs (a draft step ~0.55 of a plain step, speculation worth ~+10 % at
    the true acceptance): the first two drafts are rejected. On the estimates alone speculation
    looks lost, and without exploration only the probes (every 4-16 iterations) can bring it
    back; with few trials behind the estimate the upper bound still drafts, and once the drafts
    are accepted it speculates at once. If the drafts keep being rejected instead, the bound
    falls and only probes draft."""
    caps = torch.tensor([400])

    def run(p, accept, n=24):
        assert p.choose(caps, 8) == 2
        _feed_one(p, 2, 2 * 0.058, 0.101 + 0.0064 * 3, 0.0003, accepted=0)
        assert p.choose(caps, 8) == 0
        _feed_one(p, 0, 0.0, 0.105)
        gs = []
        for _ in range(n):
            g = p.choose(caps, 8)
            gs.append(g)
            _feed_one(p, g, g * 0.058, 0.101 + 0.0064 * (g + 1), 0.0003 if g else 0.0, accepted=g if accept else 0)
        return gs

    greedy, p = AutoGamma(8, exploration=0.0), AutoGamma(8)
    g_greedy, g_explore = run(greedy, accept=True), run(p, accept=True)
    assert g_greedy[:3] == [0, 0, 0]  # plain until the first probe
    assert g_explore[0] >= 1 and all(g >= 1 for g in g_explore)  # drafts on the bound, then on the estimates
    assert sum(g_explore) > sum(g_greedy) + 4
    upper, est = p.acceptance_upper(), p.acceptance()
    assert all(1.0 >= u >= a for u, a in zip(upper, est))
    losing = AutoGamma(8)
    gs = run(losing, accept=False)
    explored = [i for i, g in enumerate(gs) if g > 0]
    assert len(explored) - losing.num_probes <= 2  # at most a couple of drafts beyond the probes
    assert losing.num_probes >= 1 and gs[-6:].count(0) >= 5


def test_auto_verify_line_is_anchored_at_the_scored_plain_step():
    """While every speculative pass shares one q, the verify line runs through it and the plain
    step that scored the KV blocks (q = 1 with the scoring overhead), not through the unscored
    plain step: the overhead stays in the intercept and longer drafts are not overpriced."""
    p = AutoGamma(8)
    tp, s, c1 = 0.1, 0.02, 0.005  # plain step, block-scoring overhead, seconds per query row
    _feed_one(p, 0, 0.0, tp)
    _feed_one(p, 2, 0.02, tp + s + c1 * 2, 0.001)
    c1_unanchored = p.verify_fit()[1]
    assert c1_unanchored == pytest.approx((s + 2 * c1) / 2)  # through (1, t_plain): overhead in the slope
    _feed_one(p, 0, 0.0, tp + s, scored=True)
    c0, c1_fit = p.verify_fit()
    assert c1_fit == pytest.approx(c1) and c0 == pytest.approx(tp + s - c1)
    assert p.relative_cost(6) == pytest.approx((tp + s + 6 * c1) / tp + 6 * 0.1 + 0.01)


def test_auto_scored_plain_anchor_expires_and_stays_out_of_multi_q_fits():
    """The scored plain step anchors the single-q line only while it is among the last
    2 * window scored passes (timings from a shorter context expire); through several q the line
    is the speculative passes' own."""
    p = AutoGamma(8)
    tp, anchor, t4 = 0.1, 1.13, 1.15 * (1.10 + 0.03 * 4)
    _feed_one(p, 0, 0.0, tp)
    _feed_one(p, 0, 0.0, tp * anchor, scored=True)
    slopes = []
    for _ in range(2 * p.window):
        _feed_one(p, 3, 0.03, tp * t4, 0.001)
        slopes.append(p.verify_fit()[1] / tp)
    assert slopes[0] == pytest.approx((t4 - anchor) / 3)  # anchored
    assert slopes[-2] == pytest.approx((t4 - anchor) / 3)  # the anchor is the oldest of the last 2 * window
    assert slopes[-1] == pytest.approx((t4 - 1.0) / 3)  # expired: through the plain step (1, 1)
    # a second q: the least-squares line through the speculative passes, the scored plain step left out
    _feed_one(p, 0, 0.0, tp * 2.0, scored=True)
    for _ in range(p.window):
        _feed_one(p, 5, 0.05, tp * 1.15 * (1.10 + 0.03 * 6), 0.001)
    c0, c1 = p.verify_fit()
    assert c1 == pytest.approx(tp * 1.15 * 0.03) and c0 == pytest.approx(tp * 1.15 * 1.10)


def _run_step_shaped(p, n, tp=0.1, draft=0.08, verify=None):
    """``n`` iterations of a batch-2 run whose verification cost is a step function of q (in plain
    steps: a dearer q = 3 between cheaper q = 2 and 4, as measured at 2K context, batch 4), every
    draft accepted; after plain steps a scored plain step comes first, as in the loop."""
    verify = verify or {1: 1.0, 2: 1.22, 3: 1.40, 4: 1.18, 5: 1.24, 6: 1.30, 7: 1.36, 8: 1.42, 9: 1.48}
    gs, last = [], 1
    for _ in range(n):
        g = p.choose(CAPS, 8)
        if g and last == 0:
            p.note_plain_step()
            p.observe_iteration(IterationCosts(0, 0.0, tp * 1.02, 0.0, scored=True),
                                torch.tensor([0, 0]), torch.tensor([0, 0]))
        p.observe_iteration(IterationCosts(g, g * draft, tp * verify[g + 1], 0.001 if g else 0.0, scored=g > 0),
                            torch.tensor([g, g]), torch.tensor([g, g]))
        gs.append(g)
        last = g
    return gs


def test_auto_probes_walk_past_a_dearer_q():
    """The warm-up times q = 3 (dear) and the probes q = 2; a line through them prices q = 4 at
    ~1.6 plain steps and speculation never looks worth it. Probes price an untimed q one above a
    timed one at that one's cost, so a probe tries q = 4, finds it cheap (1.18), and speculation
    stays on (walking on to longer drafts, every one being accepted)."""
    p = AutoGamma(8)
    gs = _run_step_shaped(p, 14)
    assert gs[-1] == 3 and p.num_probes == 2  # the second probe tried q = 4 ...
    assert p.relative_cost(3) == pytest.approx(1.18 + 3 * 0.8 + 0.01)  # ... and it costs its own median
    gs += _run_step_shaped(p, 46)
    assert gs[14:].count(0) == 0 and min(gs[14:]) >= 3 and p.num_probes == 2, gs  # on for good


def test_auto_probes_that_find_a_dearer_q_stay_plain():
    """The same run with q >= 3 growing steeply: the probe that tries q = 4 times it dear, and
    speculation stays off (probes only)."""
    p = AutoGamma(8)
    steep = {1: 1.0, 2: 1.22, 3: 1.40, 4: 1.60, 5: 1.80, 6: 2.0, 7: 2.2, 8: 2.4, 9: 2.6}
    gs = _run_step_shaped(p, 14, verify=steep)
    assert gs[-1] == 3 and p.num_probes == 2  # the second probe tried q = 4 ...
    assert p.relative_cost(3) == pytest.approx(1.60 + 3 * 0.8 + 0.01)  # ... and timed it dear
    gs += _run_step_shaped(p, 46, verify=steep)
    assert gs[10:].count(0) >= 42 and p.num_probes >= 3


def test_auto_optimistic_cost_is_the_lower_of_line_and_the_q_below():
    """An untimed q is priced at most at the median of the q just below it (>= 2), and never above
    the line; q two above a timed one, and q = 2 above the plain steps, keep the line."""
    p = AutoGamma(8)
    tp = 0.1
    _feed_one(p, 0, 0.0, tp)
    _feed_one(p, 0, 0.0, tp * 1.0, scored=True)
    for _ in range(3):
        _feed_one(p, 2, 0.02, tp * 1.4, 0.001)  # q = 3 at 1.4: the line through (1, 1.0) rises 0.2 per q
    draft_sel = 3 * 0.1 + 0.01
    assert p.relative_cost(3, optimistic=True) == pytest.approx(1.4 + draft_sel)  # q = 4: at q = 3's cost
    assert p.relative_cost(3) == pytest.approx(1.6 + draft_sel)  # the line
    assert p.relative_cost(4, optimistic=True) == pytest.approx(p.relative_cost(4))  # q = 5: the line
    assert p.relative_cost(1, optimistic=True) == pytest.approx(p.relative_cost(1))  # q = 2: the line
    # a q below the line's value stays at the line's value: a q - 1 dearer than the line is not used
    p2 = AutoGamma(8)
    _feed_one(p2, 0, 0.0, tp)
    for q, t in ((3, 1.8), (5, 1.2)):  # least squares: flat at 1.5 (c1 < 0)
        for _ in range(2):
            _feed_one(p2, q - 1, 0.01 * (q - 1), tp * t, 0.001)
    assert p2.relative_cost(3, optimistic=True) == pytest.approx(p2.relative_cost(3))


def test_auto_respects_limits_and_caps():
    p = AutoGamma(8)
    assert p.choose(CAPS, 0) == 0  # nothing may be drafted
    _feed(p, 0, 0.01, 0.1, 0.001, [0, 0], [0, 0])
    p = AutoGamma(8)
    assert p.choose(CAPS, 1) == 1  # the warm-up's first_gamma (2), clamped to the limit
    # rows that can emit at most one more token gain nothing from drafts beyond it
    assert p.expected_tokens(5, torch.tensor([0, 1])) == pytest.approx(1 + 1 + p.acceptance()[0])
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        AutoGamma(0)


def test_auto_choice_depends_only_on_observations():
    def run():
        p = AutoGamma(6)
        seq = []
        for i in range(30):
            g = p.choose(CAPS, 6)
            seq.append(g)
            acc = min(g, i % 4)
            _feed(p, g, 0.02 + 0.001 * (i % 3), 0.1, 0.02, [g, g], [acc, max(0, acc - 1)], 0.002)
        return seq, p.stats()

    assert run() == run()
    seq, st = run()
    assert st["gamma_per_iteration"] == seq and sum(st["gamma_histogram"]) == len(seq)
    assert len(st["acceptance_estimates"]) == 6 and st["cost_t_draft_ms"] > 0
    assert FixedGamma(4).choose(CAPS, 3) == 3


# --------------------------------------------------------------------------- in the loop
class _CheapDrafts(RowGamma):
    """The loop's ``auto`` policy fed synthetic costs under which speculation pays, so that it
    drafts long runs (the tiny test models' real timings favour plain steps)."""

    def observe_iteration(self, costs, drafted, accepted):
        g = costs.gamma
        super().observe_iteration(IterationCosts(g, 0.01 * g, 1.0 + 0.01 * costs.tokens, 0.001 if g else 0.0,
                                                 scored=costs.scored, tokens=costs.tokens, rows=costs.rows),
                                  drafted, accepted)


@pytest.mark.parametrize("cheap", [False, True], ids=["measured", "cheap_drafts"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_auto_greedy_equals_plain_greedy(family, batch, cheap, monkeypatch):
    if cheap:
        monkeypatch.setattr(speculation, "RowGamma", _CheapDrafts)
    model = cached_model(family)
    ids, mask = make_prompts(model.config.vocab_size, [300, 217, 281][:batch], seed=batch)
    ref = hf_greedy(model, ids, mask, 30, eos_token_id=[])
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=30, num_speculative_tokens="auto", **SPARSE)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    s = out.stats
    assert s["gamma_policy"] == "auto" and s["num_speculative_tokens"] == 8  # "auto": the default cap
    assert len(s["num_accepted_tokens_per_pos"]) == 8
    assert len(s["gamma_per_iteration"]) == s["num_iterations"] == sum(s["gamma_histogram"])
    # the warm-up: 2 drafts; the prefill's last forward and this verification time two token counts,
    # so no plain step is needed to start the cost model
    assert s["gamma_per_iteration"][0] == 2
    if cheap:
        gs = s["gamma_per_iteration"]
        assert max(gs) >= 4 and s["num_accepted_tokens"] > 0 and gs[1] > 0
        # plain steps do not score blocks: drafting after one takes a scoring plain step first
        assert all(gs[i - 1] == gs[i - 2] == 0 for i in range(2, len(gs)) if gs[i] and not gs[i - 1])


def test_auto_is_the_default_and_full_ignores_it():
    model = cached_model("llama")
    ids, mask = make_prompts(model.config.vocab_size, [300], seed=1)
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=8, **SPARSE)
    assert out.stats["gamma_policy"] == "auto"
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=8, sparse_attn_algorithm="full", **SPARSE)
    assert out.stats["gamma_policy"] == "fixed" and set(out.stats["gamma_per_iteration"]) == {0}
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=8, num_speculative_tokens=4, **SPARSE)
    assert out.stats["gamma_policy"] == "auto" and out.stats["num_speculative_tokens"] == 4  # a cap
    assert max(out.stats["gamma_per_iteration"]) <= 4
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=8, num_speculative_tokens=4, gamma_policy="fixed",
                             **SPARSE)
    assert out.stats["gamma_policy"] == "fixed" and out.stats["gamma_per_iteration"][0] == 4


@pytest.mark.parametrize("kw, match", [
    (dict(num_speculative_tokens="fast"), "num_speculative_tokens"),
    (dict(num_speculative_tokens=2.5), "num_speculative_tokens"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    (dict(gamma_policy="sometimes"), "gamma_policy"),
    (dict(num_speculative_tokens="auto", gamma_policy="fixed"), "gamma_policy"),
    (dict(max_speculative_tokens=8), "max_speculative_tokens is no longer an option: pass the cap as"),
])
def test_bad_gamma_options_raise(kw, match):
    model = cached_model("llama")
    ids, mask = make_prompts(model.config.vocab_size, [40], seed=1)
    with pytest.raises(ValueError, match=match):
        vegas_ext.generate(model, ids, mask, max_new_tokens=4, **kw)


# --------------------------------------------------------------------------- CLI
def test_cli_auto_gamma_is_default_and_reported(tiny_model_dir, capsys):  # noqa: F811
    rc, out, err = run_cli(["generate", "--model", tiny_model_dir, "--prompt", "the man said to miss bennet",
                            "--max-new-tokens", "12", "--no-progress", "--num-speculative-tokens", "5"], capsys)
    assert rc == 0, err
    assert "gamma (auto)" in err and "iterations per gamma 0..5" in err
    assert "accept. estimates" in err and "fitted costs" in err
    costs = next(line for line in err.splitlines() if line.startswith("fitted costs"))
    assert "n/a q" not in costs, costs  # RowGamma names its slope per token (was printed as n/a)


@pytest.mark.parametrize("value", ["fast", "0"])
def test_cli_bad_gamma(value, tiny_model_dir, capsys):  # noqa: F811
    rc, out, err = run_cli(["generate", "--model", tiny_model_dir, "--prompt", "hi",
                            "--num-speculative-tokens", value], capsys)
    assert rc not in (0, None) and "num-speculative-tokens" in err and "Traceback" not in err
    rc, out, err = run_cli(["generate", "--model", tiny_model_dir, "--prompt", "hi",
                            "--gamma-policy", "sometimes"], capsys)
    assert rc not in (0, None) and "gamma-policy" in err


def test_auto_verify_cost_is_at_least_one_plain_step():
    """A fit through noisy passes can price a speculative verification below a plain step (seen:
    c0 84 ms, c1 0 against a 93.6 ms plain step); the verification part of an iteration's cost
    is floored at one plain step, so a draft is never predicted to come for free."""
    p = AutoGamma(8)
    tp = 0.1
    _feed_one(p, 0, 0.0, tp)
    for q, t in ((2, 0.86), (3, 0.84)):  # timed below the plain step, flat: c0 ~0.85, c1 0
        for _ in range(2):
            _feed_one(p, q - 1, 0.01 * (q - 1), tp * t, 0.001)
    c0, c1 = p.verify_fit()
    assert c0 / tp + c1 / tp * 5 < 0.9  # the fit itself says q = 5 costs less than a plain step
    for g in (1, 2, 4, 6):  # timed (own median) and untimed (the line) q alike; drafts 0.1, select 0.01
        assert p.relative_cost(g) == pytest.approx(1.0 + g * 0.1 + 0.01)
        assert p.relative_cost(g, optimistic=True) == pytest.approx(1.0 + g * 0.1 + 0.01)


def test_ab_gamma_policy_runs_and_checks_tokens(tiny_model_dir):  # noqa: F811
    """``python -m bench.ab_gamma_policy``: every configuration's tokens equal plain decoding's, and the
    table has one row per configuration (``full`` at 1.000 by definition)."""
    r = subprocess.run([sys.executable, "-m", "bench.ab_gamma_policy", "--model", tiny_model_dir,
                        "--context", "48", "--batch", "2", "--max-new-tokens", "6", "--rounds", "2",
                        "--variants", '{"climb": {"climb": true}, "gamma 2": 2}'],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    runs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(runs) == 6 and all(x["identical_to_plain"] for x in runs)
    assert {x["name"] for x in runs} == {"full", "climb", "gamma 2"}
    assert re.search(r"^\| full \| 1\.000 \|", r.stdout, re.M)
    assert re.search(r"^\| gamma 2 \| [0-9.]+ \|", r.stdout, re.M)
    bad = subprocess.run([sys.executable, "-m", "bench.ab_gamma_policy", "--variants", '{"x": {"bogus": 1}}'],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--variants: 'x'" in bad.stderr


def test_ab_gamma_policy_checks_cost_model_variants(capsys):
    """A variant's ``costs`` builds the TokenCostModel; a bad setting there is an argparse error
    naming it (``max_batch_sizes: "x"`` used to pass and fail after the model loaded)."""
    from bench import ab_gamma_policy
    from bench.common import row_gamma_kwargs

    a = ab_gamma_policy.parse_args(["--variants", '{"old": {"costs": {"provisional_first": false}}}'])
    assert row_gamma_kwargs(a.variants["old"])["costs"].provisional_first is False
    bad = (('{"max_batch_sizes": "x"}', "max_batch_sizes must be"), ('{"max_batch_sizes": -1}', "max_batch_sizes"),
           ('{"provisional_first": "no"}', "provisional_first must be"), ('{"window": 3}', "beside costs"),
           ("[]", "costs must be an object"))
    for costs, said in bad:
        with pytest.raises(SystemExit):
            ab_gamma_policy.parse_args(["--variants", '{"v": {"costs": %s}}' % costs])
        assert said in capsys.readouterr().err


def test_ab_gamma_policy_variants_reach_the_loops_policy():
    """A variant's keyword arguments build the policy our loop's ``auto`` uses (``RowGamma``), only
    while its run lasts; fixed γ and the vLLM plugin's policy are left alone."""
    from bench import ab_gamma_policy
    from vegas_ext import decode

    with ab_gamma_policy._auto_with({"climb": True, "window": 3}):
        p = decode.make_gamma_policy(4, "auto")
        assert type(p) is speculation.RowGamma and p.climb and p.costs.window == 3
        assert isinstance(decode.make_gamma_policy(4, "fixed"), speculation.FixedGamma)
        assert isinstance(decode.make_gamma_policy(4, "auto", per_request=True), speculation.PerRequestGamma)
    p = decode.make_gamma_policy(4, "auto")
    assert type(p) is speculation.RowGamma and not p.climb and p.costs.window == 5


def test_policy_settings_are_checked():
    """A setting of the wrong type or range is refused by name (``climb="false"`` used to turn
    climbing on, ``window=0`` to fail later)."""
    bad = [dict(climb="false"), dict(optimistic_gamma=1), dict(first_gamma=0), dict(first_gamma=2.5), dict(window=0),
           dict(probe_interval=-1), dict(prior_acceptance=1.5), dict(prior_weight=0), dict(acceptance_decay=0),
           dict(margin=float("nan")), dict(exploration=-1), dict(uniform_margin=float("inf")),
           dict(first_gamma=float("inf"))]
    for kw in bad:
        name = next(iter(kw))
        with pytest.raises(ValueError, match=f"^{name} must be "):
            RowGamma(8, **kw)
    with pytest.raises(ValueError, match="costs must be a TokenCostModel"):
        RowGamma(8, costs=1)
    RowGamma(8, uniform_margin=None, climb=True, hopeless_probe_interval=0, prior_acceptance=1.0, window=1)
    AutoGamma(8, exploration=0.0, cost_ema=1.0)
    # numpy scalars and 0-d tensors are taken as the numbers they hold (their stats stay JSON)
    import json

    import numpy as np
    for cls in (AutoGamma, RowGamma):
        p = cls(8, acceptance_decay=torch.tensor(0.5), cost_ema=np.float32(0.5), window=np.int64(3),
                margin=torch.tensor(0.1), first_gamma=torch.tensor(2))
        assert type(p.acc.decay) is float and type(p.window) is int and type(p.first_gamma) is int
        json.dumps(p.stats())
