"""γ per request (``PerRequestGamma``, driven by the vLLM plugin): each request's own choice under
shared step costs, without vLLM."""
from __future__ import annotations

import pytest

from vegas_ext.speculation import IterationCosts, PerRequestGamma


def _costs(p, t_plain=0.1, t_draft=0.01, c0=0.1, c1=0.002, steps=3, batch_sizes=(1,)):
    """Plain steps, then speculative steps of 2 and 4 drafts, timed like a CPU engine's, for the
    cost model of each of ``batch_sizes``."""
    for b in batch_sizes:
        for _ in range(steps):
            p.observe_step(IterationCosts(0, 0.0, t_plain, 0.0, scored=False), batch_size=b)
        for g in (2, 4) * steps:
            p.observe_step(IterationCosts(g, g * t_draft, c0 + c1 * (g + 1), 0.001, scored=True), batch_size=b)


def _run(p, rid, accept_all, steps=12, cap=6):
    g = 0
    for _ in range(steps):
        g = p.choose(rid, cap)
        p.observe_request(rid, g, g if accept_all else 0)
    return g


def test_low_acceptance_goes_plain_high_acceptance_drafts():
    p = PerRequestGamma(6)
    _costs(p)
    hi, lo = _run(p, "hi", True, steps=30), _run(p, "lo", False, steps=30)
    assert hi == 6, hi  # every draft accepted, drafts at 0.1 plain step: the longest drafts pay
    assert lo == 0, lo
    assert p.requests["hi"].acceptance()[0] > 0.9 and p.requests["lo"].acceptance()[0] < 0.3
    # the requests do not share estimates: "lo" went plain but for an occasional probe, "hi" never did
    assert sum(g > 0 for g in p.requests["lo"].history[-10:]) <= 1
    assert p.requests["hi"].history[-28:] == [6] * 28


def test_nothing_pays_when_drafts_cost_a_plain_step():
    p = PerRequestGamma(6)
    _costs(p, t_draft=0.1)  # a draft forward as dear as a plain step (batch 1 on a CPU)
    assert _run(p, "a", True, steps=8) == 0


def test_caps_limits_and_forgetting():
    p = PerRequestGamma(3)
    _costs(p)
    assert p.choose("a", 0) == 0
    assert all(0 <= p.choose("a", 2) <= 2 for _ in range(10))
    assert "a" in p.requests
    p.forget("a")
    p.forget("never-seen")
    assert "a" not in p.requests
    # the warm-up that measures costs is skipped once they are known: the prior decides at once
    assert p.choose("b", 3) > 0
    p.observe_request("unknown", 2, 1)  # no estimate to update, no error
    assert sum(p.stats()["gamma_histogram"]) == 12


def test_before_costs_are_known_requests_warm_up_then_wait():
    p = PerRequestGamma(4)
    assert p.choose("a", 4) == 2  # AutoGamma's warm-up: first_gamma drafts
    assert p.choose("a", 4) == 0  # then plain until a plain step has been timed
    assert p.choose("a", 4) == 0


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_bad_max_gamma(bad):
    with pytest.raises(ValueError, match="max_gamma"):
        PerRequestGamma(bad)


def test_vllm_gamma_policy_option_is_validated():
    from vegas_ext.vllm.options import VegasOptions

    assert VegasOptions().gamma_policy == "auto"
    assert VegasOptions.from_mapping({"gamma_policy": "fixed"}).gamma_policy == "fixed"
    for bad in ("Auto", "adaptive", None, 6):
        with pytest.raises(ValueError, match="gamma_policy must be one of"):
            VegasOptions(gamma_policy=bad)


def test_batch_check_turns_one_requests_dear_drafts_into_a_plain_step():
    """One request would draft 6 (all accepted) and three would not: alone it pays (7 tokens for
    ~3 plain steps), but the batch of 4 would get 10 tokens in ~3 plain steps instead of 4 in one."""
    p = PerRequestGamma(6, exploration=0.0, probe_interval=1000, max_probe_interval=1000,
                        hopeless_probe_interval=1000)
    _costs(p, t_plain=0.1, t_draft=0.03, c0=0.1, c1=0.002, batch_sizes=(1, 4))
    for rid, ok in (("hi", True), ("a", False), ("b", False), ("c", False)):
        _run(p, rid, ok, steps=20)
    reqs = [("hi", 6), ("a", 6), ("b", 6), ("c", 6)]
    assert p.choose_batch(reqs[:1]) == [6]
    assert 2.5 < p.costs.relative_cost(6) < 3.5
    assert p.choose_batch(reqs) == [0, 0, 0, 0] and p.vetoed == 1
    # four requests that all accept: the batch pays
    q = PerRequestGamma(6, exploration=0.0)
    _costs(q, t_plain=0.1, t_draft=0.03, c0=0.1, c1=0.002, batch_sizes=(4,))
    for rid in "wxyz":
        _run(q, rid, True, steps=20)
    assert q.choose_batch([(r, 6) for r in "wxyz"]) == [6, 6, 6, 6] and q.vetoed == 0


def test_new_requests_start_from_the_engines_acceptance():
    """A request arriving after peers whose drafts were all accepted drafts long at once; one
    arriving after peers whose drafts were all rejected starts plain; its own drafts then rule."""
    hi = PerRequestGamma(6, exploration=0.0)
    _costs(hi)
    _run(hi, "peer", True, steps=30)
    assert hi.engine_acc.pooled() > 0.95 and hi.stats()["engine_acceptance"] > 0.95
    assert hi.choose("new", 6) == 6
    assert hi.requests["new"].acc.prior_acceptance > 0.95
    assert _run(hi, "new", False, steps=30) == 0  # its own rejections win over the prior

    lo = PerRequestGamma(6, exploration=0.0, probe_interval=1000, max_probe_interval=1000,
                         hopeless_probe_interval=1000)
    _costs(lo, t_draft=0.03)
    for i in range(8):  # each peer goes plain after its first rejected drafts
        _run(lo, f"peer{i}", False, steps=5)
    assert lo.engine_acc.pooled() < 0.5
    fresh = PerRequestGamma(6, exploration=0.0)
    _costs(fresh, t_draft=0.03)
    assert fresh.choose("new", 6) >= 2  # no peers yet: the configured prior (0.8)
    assert lo.choose("new", 6) == 0


def test_each_batch_size_has_its_own_costs_and_a_new_plain_step_rescales_them():
    """Drafts that pay at batch 1 (a draft step 0.1 plain step) and do not at batch 16 (verification
    3 plain steps, a draft step 0.8): each batch size is priced by its own timings, whichever ran
    last. A plain step that finds the engine twice as slow halves every ratio at once."""
    p = PerRequestGamma(6, exploration=0.0, probe_interval=1000, max_probe_interval=1000,
                        hopeless_probe_interval=1000)
    for _ in range(3):
        p.observe_step(IterationCosts(0, 0.0, 0.1, 0.0, scored=False), batch_size=1)
        p.observe_step(IterationCosts(0, 0.0, 0.2, 0.0, scored=False), batch_size=16)
    for g in (2, 4) * 3:
        p.observe_step(IterationCosts(g, g * 0.01, 0.1 + 0.002 * (g + 1), 0.001, scored=True), batch_size=1)
        p.observe_step(IterationCosts(g, g * 0.16, 0.12 * (g + 1), 0.001, scored=True), batch_size=16)
    assert p.stats()["cost_batch_sizes"] == [1, 16]
    reqs = [(f"r{i}", 6) for i in range(16)]
    for _ in range(10):  # every draft accepted, at the prior acceptance (0.8) of 16 new requests
        for rid, g in zip([r for r, _ in reqs], p.choose_batch(reqs)):
            p.observe_request(rid, g, g)
    assert p.choose_batch(reqs) == [0] * 16 and p.costs is p.cost_models[16]
    assert p.choose_batch(reqs[:1])[0] >= 4 and p.costs is p.cost_models[1]
    assert p.choose_batch(reqs[:12]) == [0] * 12 and p.costs is p.cost_models[8]  # 8..15: not timed yet
    # batch 16: 7 queries verify in 0.84 s = 4.2 plain steps at 0.2 s, 2.1 once a plain step takes 0.4 s
    m = p.cost_models[16]
    before = m.relative_cost(6)
    for _ in range(8):
        p.observe_step(IterationCosts(0, 0.0, 0.4, 0.0, scored=False), batch_size=16)
    assert m.relative_cost(6) == pytest.approx(before / 2, rel=0.02)
