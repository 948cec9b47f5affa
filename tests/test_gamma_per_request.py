"""γ per request (``PerRequestGamma``, driven by the vLLM plugin): our loop's ``RowGamma`` over the
requests of each engine step -- each request's own acceptance, drafts allocated together under
the engine's step costs (``allocate_drafts``, ``TokenCostModel``) -- without vLLM."""
from __future__ import annotations

import pytest

from vegas_ext.speculation import IterationCosts, PerRequestGamma, allocate_drafts


def _costs(p, t_plain=0.1, t_draft=0.01, c0=0.1, c1=0.002, steps=3, batch_sizes=(1,)):
    """Plain steps, then speculative steps of 2 and 4 drafts per request, timed like a CPU engine's
    (the verification ``c0 + c1 (g + 1)`` whatever the batch), for each of ``batch_sizes``."""
    for b in batch_sizes:
        for _ in range(steps):
            p.observe_step(IterationCosts(0, 0.0, t_plain, 0.0, scored=False), batch_size=b)
        for g in (2, 4) * steps:
            p.observe_step(IterationCosts(g, g * t_draft, c0 + c1 * (g + 1), 0.001, scored=True), batch_size=b)


def _step(p, accept, cap=6):
    """One engine step of the requests in ``accept`` (request id -> all drafts accepted or none)."""
    reqs = [(rid, cap) for rid in accept]
    gs = p.choose_batch(reqs)
    for (rid, _), g in zip(reqs, gs):
        p.observe_request(rid, g, g if accept[rid] else 0)
    return gs


def _run(p, rid, accept_all, steps=12, cap=6):
    g = 0
    for _ in range(steps):
        g = p.choose(rid, cap)
        p.observe_request(rid, g, g if accept_all else 0)
    return g


def test_low_acceptance_goes_plain_high_acceptance_drafts():
    """Two requests in one batch: the one whose drafts are accepted drafts the cap, the one whose
    drafts are rejected stops drafting (the estimates are per request)."""
    p = PerRequestGamma(6)
    _costs(p, batch_sizes=(2,))
    gs = [_step(p, {"hi": True, "lo": False}) for _ in range(30)]
    assert [g[0] for g in gs[-25:]] == [6] * 25  # drafts at 0.1 plain step, all accepted: the cap pays
    assert sum(g[1] for g in gs[-10:]) <= 1, gs  # plain but for an occasional draft
    assert p.requests["hi"].rates()[0] > 0.9 and p.requests["lo"].rates()[0] < 0.3
    assert p.stats()["gamma_histogram"][6] >= 25


def test_nothing_pays_when_drafts_cost_a_plain_step():
    p = PerRequestGamma(6)
    _costs(p, t_draft=0.1)  # a draft forward as dear as a plain step (batch 1 on a CPU)
    assert _run(p, "a", True, steps=8) == 0


def test_drafts_are_allocate_drafts_over_the_requests():
    """The step's drafts are :func:`allocate_drafts`' over one row per request (its estimates, caps,
    the chosen draft steps and the cost model's price per verified token; ragged at no margin)."""
    p = PerRequestGamma(6, exploration=0.0)
    _costs(p, t_draft=0.01, c1=0.02, batch_sizes=(3,))
    accept = {"a": True, "b": False, "c": True}
    for _ in range(6):
        _step(p, accept)
    reqs = [("a", 6), ("b", 6), ("c", 2)]
    gs = p.choose_batch(reqs)
    G = p.row_policy.history[-1]
    assert G > 0 and gs[2] <= 2
    marginal = []
    for rid, _ in reqs:
        m, x = [], 1.0
        for a in p.requests[rid].rates():
            x *= a
            m.append(x)
        marginal.append(m)
    _, want = allocate_drafts(marginal, [c for _, c in reqs], G, lambda n: p.costs.iteration(G, n, 3))
    assert gs == want and gs[0] > gs[1]


def test_caps_limits_and_forgetting():
    p = PerRequestGamma(3)
    _costs(p)
    assert p.choose("a", 0) == 0
    assert all(0 <= p.choose("a", 2) <= 2 for _ in range(10))
    assert "a" in p.requests
    p.forget("a")
    p.forget("never-seen")
    assert "a" not in p.requests
    # the warm-up that measures costs is over once they are known: the prior decides at once
    assert p.choose("b", 3) > 0
    p.observe_request("unknown", 2, 1)  # no estimate to update, no error
    assert sum(p.stats()["gamma_histogram"]) == 12
    assert p.choose_batch([]) == []
    # requests of the step that cannot draft are rows that verify one token: priced, never drafted
    assert len(p.choose_batch([("b", 3)], batch_size=4)) == 1


def test_before_costs_are_known_the_engine_warms_up_then_waits():
    p = PerRequestGamma(4)
    assert p.choose("a", 4) == 2  # RowGamma's warm-up: first_gamma drafts
    assert p.choose("a", 4) == 0  # then plain until the verification is timed at two token counts
    assert p.choose_batch([("a", 4), ("b", 4)]) == [0, 0]


def test_an_untimed_warm_up_is_repeated_after_a_timed_plain_step():
    """The engine times a step only when it verified exactly the last step's drafts: where the
    warm-up's drafts went untimed, plain steps alone would never time a second token count."""
    p = PerRequestGamma(4, exploration=0.0)
    assert p.choose_batch([("a", 4)], batch_size=2) == [2]  # warm-up; "b" prefills: not timed
    assert p.choose_batch([("a", 4), ("b", 4)]) == [0, 0]
    p.observe_step(IterationCosts(0, 0.0, 0.1, 0.0, scored=False), batch_size=2)
    assert p.choose_batch([("a", 4), ("b", 4)]) == [2, 2]  # measure again
    p.observe_step(IterationCosts(2, 0.02, 0.11, 0.001, scored=True), batch_size=2)
    for rid in "ab":
        p.observe_request(rid, 2, 2)
    assert p.costs.ready() and p.choose_batch([("a", 4), ("b", 4)]) == [4, 4]  # the rule decides


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_bad_max_gamma(bad):
    with pytest.raises(ValueError, match="max_gamma"):
        PerRequestGamma(bad)


@pytest.mark.parametrize("kw, name", [(dict(window=None), "window"), (dict(window=0), "window"),
                                      (dict(max_batch_sizes=0), "max_batch_sizes"),
                                      (dict(max_batch_sizes="4"), "max_batch_sizes"), (dict(margin=-1), "margin")])
def test_bad_settings_are_named(kw, name):
    with pytest.raises(ValueError, match=f"^{name} must be "):
        PerRequestGamma(4, **kw)
    with pytest.raises(ValueError, match="^costs cannot be given"):
        PerRequestGamma(4, costs=None)


def test_vllm_gamma_policy_option_is_validated():
    from vegas_ext.vllm.options import VegasOptions

    assert VegasOptions().gamma_policy == "auto"
    assert VegasOptions.from_mapping({"gamma_policy": "fixed"}).gamma_policy == "fixed"
    for bad in ("Auto", "adaptive", None, 6):
        with pytest.raises(ValueError, match="gamma_policy must be one of"):
            VegasOptions(gamma_policy=bad)


def test_batch_check_turns_one_requests_dear_drafts_into_a_plain_step():
    """One request would draft 6 (all accepted) and three would not: alone it pays (7 tokens for
    ~5 plain steps), but the batch of 4, which pays every draft step, would get 10 tokens in ~5
    plain steps instead of 4 in one (or ~6 in 1.6 with one draft each): the step is plain and
    counts as vetoed."""
    p = PerRequestGamma(6, exploration=0.0, probe_interval=1000, max_probe_interval=1000,
                        hopeless_probe_interval=1000)
    _costs(p, t_plain=0.1, t_draft=0.06, c0=0.1, c1=0.002, batch_sizes=(1, 4))
    _run(p, "hi", True, steps=20)
    for rid in "abc":  # their first drafts all rejected
        p.estimate(rid)
        for _ in range(3):
            p.observe_request(rid, 6, 0)
    reqs = [("hi", 6), ("a", 6), ("b", 6), ("c", 6)]
    assert p.choose_batch(reqs[:1]) == [6]
    assert 4.5 < p.costs.iteration(6, 7, 1) / p.costs.plain(1) < 5.5
    assert p.choose_batch(reqs) == [0, 0, 0, 0] and p.vetoed == 1 and p.stats()["vetoed_steps"] == 1
    # four requests that all accept: the batch pays
    q = PerRequestGamma(6, exploration=0.0)
    _costs(q, t_plain=0.1, t_draft=0.03, c0=0.1, c1=0.002, batch_sizes=(4,))
    for _ in range(20):
        _step(q, dict.fromkeys("wxyz", True))
    assert q.choose_batch([(r, 6) for r in "wxyz"]) == [6, 6, 6, 6] and q.vetoed == 0


def test_new_requests_start_from_the_engines_acceptance():
    """A request arriving after peers whose drafts were all accepted drafts long at once; one
    arriving after peers whose drafts were all rejected starts plain; its own drafts then rule."""
    hi = PerRequestGamma(6, exploration=0.0)
    _costs(hi)
    _run(hi, "peer", True, steps=30)
    assert hi.engine_acc.pooled() > 0.95 and hi.stats()["engine_acceptance"] > 0.95
    assert hi.choose("new", 6) == 6
    assert hi.requests["new"].prior_acceptance > 0.95
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


def test_each_batch_size_has_its_own_costs():
    """Drafts that pay at batch 1 (a draft step 0.1 plain step) and do not at batch 16 (verification
    3 plain steps, a draft step 0.8): each batch size is priced by its own timings, whichever ran
    last; the timings of batch sizes beyond ``max_batch_sizes`` (the most recent) are dropped."""
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
    assert p.choose_batch(reqs) == [0] * 16
    assert p.choose_batch(reqs[:1])[0] >= 4
    few = PerRequestGamma(6, max_batch_sizes=2)
    for b in (1, 16, 4, 16):
        few.observe_step(IterationCosts(0, 0.0, 0.1, 0.0, scored=False), batch_size=b)
    assert few.stats()["cost_batch_sizes"] == [4, 16]


def test_engine_acceptance_forgets_once_per_step():
    """The pooled rate (the prior of new requests) decays once per engine step, however many
    requests the step verified, as our loop's decays once per iteration."""
    p = PerRequestGamma(4)
    _costs(p, batch_sizes=(8,))
    reqs = [(f"r{i}", 4) for i in range(8)]
    p.choose_batch(reqs)
    for rid, _ in reqs:
        p.observe_request(rid, 2, 2)
    p.choose_batch(reqs)
    assert p.engine_acc.tries[0] == pytest.approx(8.0)  # one step of 8 rows, not 8 decays
