"""How many tokens to draft per iteration: the ``gamma`` policy of the decode loop.

A policy is asked before every iteration for the batch's ``gamma`` (:meth:`GammaPolicy.choose`)
and is told afterwards what the iteration cost and how many drafts were accepted
(:meth:`GammaPolicy.observe_iteration`). Its choice may depend on the past only, so decoding stays
lossless whatever it picks (greedy equals plain greedy; speculative sampling keeps the target
distribution for any number of drafts fixed before they are drawn).

* ``"fixed"`` -- :class:`FixedGamma`: always ``num_speculative_tokens`` (shrunk near a row's end);
* ``"auto"`` -- :class:`AutoGamma`: before every iteration the ``g`` in ``0..num_speculative_tokens`` (the cap)
  with the most expected emitted tokens per second, from an :class:`AcceptanceEstimate` and a
  :class:`StepCostModel` the loop feeds as it decodes (``g = 0``: a plain step).

The design of ``auto`` and the measurements behind its defaults: ``docs/gamma_policy.md``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from torch import Tensor

from .config import OptionTypeError, check_bool, check_float, check_int

__all__ = ["make_gamma_policy", "GammaPolicy", "FixedGamma", "AutoGamma", "RowGamma", "AcceptanceEstimate",
           "StepCostModel", "TokenCostModel", "IterationCosts", "PerRequestGamma", "allocate_drafts"]


def _check_policy_args(**values) -> Dict[str, object]:
    """The settings of :class:`AutoGamma` / :class:`RowGamma` checked by type and range (a typo in
    an A/B variant must not run silently as something else) and returned as plain ``int`` /
    ``float`` / ``bool`` (a numpy scalar or a 0-d tensor becomes a number): ``ValueError``
    (``OptionTypeError`` for a wrong type) naming the first bad one; ``uniform_margin`` may also be
    None."""
    out: Dict[str, object] = {}
    for name, v in values.items():
        if name in ("climb", "optimistic_gamma"):
            out[name] = check_bool(v, name)
        elif name in ("first_gamma", "window"):
            out[name] = check_int(v, name, 1)
        elif name.endswith("probe_interval"):
            out[name] = check_int(v, name, 0)
        elif name == "prior_acceptance":
            out[name] = check_float(v, name, 0.0, 1.0)
        elif name in ("acceptance_decay", "cost_ema"):
            out[name] = check_float(v, name, 0.0, 1.0, low_open=True)
        elif name == "prior_weight":
            out[name] = check_float(v, name, 0.0, math.inf, low_open=True)
        elif name == "uniform_margin" and v is None:
            out[name] = None
        else:  # margin, exploration, uniform_margin
            out[name] = check_float(v, name, 0.0, math.inf)
    return out


@dataclass
class IterationCosts:
    """Measured seconds of one iteration's phases: ``draft`` (all ``gamma`` draft steps),
    ``verify`` (one verification forward of ``gamma + 1`` tokens, acceptance included) and
    ``select`` (the selection before the drafts, 0 if none ran); ``scored``: whether the
    verification also scored the KV blocks for a selection (plain steps normally do not)."""

    gamma: int
    draft: float
    verify: float
    select: float
    scored: bool = True
    tokens: int = 0  # tokens through the verification forward (sum over rows of g_b + 1); 0: not given
    rows: int = 0  # rows in the batch's forwards; 0: not given
    # per draft step (rows it drafted, seconds) where a step may draft some rows only; else None
    draft_steps: Optional[List[Tuple[int, float]]] = None


class GammaPolicy:
    """Base class of a ``gamma`` policy.

    Attributes:
        max_gamma: the largest ``gamma`` it may return (sizes the cache and the per-position stats).
    """

    name = "base"

    def __init__(self, max_gamma: int):
        self.max_gamma = int(max_gamma)
        self.history: List[int] = []  # gamma chosen per iteration

    def choose(self, caps: Tensor, limit: int) -> int:
        """``gamma`` for the next iteration, in ``[0, min(max_gamma, limit)]``.

        Args:
            caps: ``[B]`` int64, per active row the most drafts that row could still emit
                (``max_new_tokens`` left minus 1).
            limit: the most drafts the batch may write (``max(caps)`` and the model's last position).
        """
        raise NotImplementedError

    def choose_rows(self, caps: Tensor) -> Tensor:
        """Per-row drafts for the next iteration: ``[B]`` int64, row ``b``'s in ``[0, caps[b]]``.

        Args:
            caps: ``[B]`` int64, per row the most drafts it may write (``max_new_tokens`` left
                minus 1, kept inside the model's positions); ``-1`` for a row that no longer
                decodes (it gets 0 and is not verified).

        The base rule: one ``gamma`` for the batch (:meth:`choose` over the decoding rows), cut
        to each row's cap."""
        active = caps >= 0
        g = self.choose(caps[active], int(caps.max()))
        return caps.clamp(min=0, max=g)

    def keep_rows(self, rows: Tensor) -> None:
        """The batch keeps only ``rows`` (``[B']`` int64 indices into the current rows, ascending);
        per-row state follows. No per-row state here."""

    def note_plain_step(self) -> None:
        """The loop ran a plain step before the iteration just chosen (to score the KV blocks its
        drafts will attend to): recorded in the history before that choice."""
        self.history.insert(len(self.history) - 1, 0)

    def observe_iteration(self, costs: IterationCosts, drafted: Tensor, accepted: Tensor) -> None:
        """After an iteration: its costs and, per active row, ``drafted`` (``[B]`` drafts that
        could be emitted) and ``accepted`` (``[B]`` of them matching the target, ``<= drafted``)."""

    def stats(self) -> dict:
        """Entries added to ``generate``'s stats: ``gamma_policy``, ``gamma_per_iteration`` (the
        ``gamma`` of every iteration) and ``gamma_histogram`` (iterations per ``gamma``,
        ``0..max_gamma``)."""
        hist = [0] * (self.max_gamma + 1)
        for g in self.history:
            hist[g] += 1
        return {"gamma_policy": self.name, "gamma_per_iteration": list(self.history), "gamma_histogram": hist}


class FixedGamma(GammaPolicy):
    """Always ``max_gamma`` drafts, shrunk so that no row drafts what it could never emit."""

    name = "fixed"

    def choose(self, caps: Tensor, limit: int) -> int:
        g = max(0, min(self.max_gamma, int(limit)))
        self.history.append(g)
        return g


class AcceptanceEstimate:
    """Running estimate of the conditional acceptance rate ``a_i`` at each draft position.

    Counts are pooled over rows and forgotten by ``decay`` per speculative iteration; each
    position's prior is ``prior_weight`` pseudo-trials at the rate pooled over all positions
    (itself behind ``prior_weight`` pseudo-trials at ``prior_acceptance``), so positions not drafted
    lately take the pooled rate (``docs/gamma_policy.md``).
    """

    def __init__(self, max_gamma: int, prior_acceptance: float = 0.8, prior_weight: float = 4.0,
                 decay: float = 0.97):
        self.prior_acceptance, self.prior_weight, self.decay = float(prior_acceptance), float(prior_weight), decay
        self.tries = [0.0] * max_gamma
        self.successes = [0.0] * max_gamma

    def pooled(self) -> float:
        """The rate pooled over all positions (behind the prior)."""
        w = self.prior_weight
        return (sum(self.successes) + w * self.prior_acceptance) / (sum(self.tries) + w)

    def rates(self) -> List[float]:
        """``[max_gamma]`` estimates ``a_i``, each behind the pooled rate as its prior."""
        w, pooled = self.prior_weight, self.pooled()
        return [(s + w * pooled) / (n + w) for s, n in zip(self.successes, self.tries)]

    def upper(self, exploration: float) -> List[float]:
        """``[max_gamma]`` optimistic estimates ``a_i + exploration * sqrt(a_i (1 - a_i) / n)``,
        ``n`` the pooled trials behind them (prior included), at most 1."""
        n = sum(self.tries) + self.prior_weight
        return [min(1.0, a + exploration * math.sqrt(max(a * (1.0 - a), 0.0) / n)) for a in self.rates()]

    def observe(self, drafted: List[int], accepted: List[int]) -> None:
        """One speculative iteration: per row, drafts that could be emitted and drafts accepted."""
        for i in range(len(self.tries)):
            self.tries[i] = self.decay * self.tries[i] + sum(1 for d, a in zip(drafted, accepted) if d > i and a >= i)
            self.successes[i] = self.decay * self.successes[i] + sum(1 for a in accepted if a > i)


class StepCostModel:
    """Step costs measured by the loop, in units of the current plain step ``t_plain``.

    ``t_plain``: moving average (weight ``cost_ema``) of unscored plain steps; draft and selection:
    medians of the last ``window`` timings; verification of ``q`` tokens: its own recent median where
    timed (the cost is a step function of ``q``), else ``c0 + c1 q`` fitted through the last
    ``2 * window`` speculative passes (``docs/gamma_policy.md``). Timings are kept in seconds and
    divided by the current ``t_plain`` when used, so a plain step that finds the engine slower or
    faster (a longer context, another batch) rescales every ratio at once.
    """

    def __init__(self, window: int = 5, cost_ema: float = 0.5):
        self.window, self.cost_ema = int(window), cost_ema
        self.t_plain: Optional[float] = None  # seconds of a plain step (moving average)
        self._draft_secs: List[float] = []  # seconds of one draft step, last `window`
        self._select_secs: List[float] = []
        self._verify_obs: List[Tuple[int, float]] = []  # (q, seconds of verify(q)), last 2 * window, q >= 2
        self._scored_plain: List[Tuple[int, float]] = []  # (scored pass number, seconds) of scored plain steps
        self._scored_passes = 0  # verification passes that scored the KV blocks (q >= 1)
        self._pending: List[IterationCosts] = []  # timed before the first plain step

    def _push(self, xs: List[float], x: float) -> None:
        xs.append(x)
        del xs[: -self.window]

    def observe(self, c: IterationCosts) -> None:
        """Record one iteration's timings."""
        if c.gamma == 0:
            if c.scored and self.t_plain is not None:  # scoring blocks costs more than a plain step
                self._scored_passes += 1
                self._scored_plain.append((self._scored_passes, c.verify))
                del self._scored_plain[: -self.window]
                return
            ema = self.cost_ema
            self.t_plain = c.verify if self.t_plain is None else (1 - ema) * self.t_plain + ema * c.verify
            pending, self._pending = self._pending, []
            for p in pending:
                self.observe(p)
        elif self.t_plain is None:
            self._pending.append(c)
            return
        if c.gamma:
            self._scored_passes += 1
            self._verify_obs.append((c.gamma + 1, c.verify))
            del self._verify_obs[: -2 * self.window]
            self._push(self._draft_secs, c.draft / c.gamma)
            if c.select > 0:
                self._push(self._select_secs, c.select)

    def _verify_by_q(self) -> Dict[int, List[float]]:
        by_q: Dict[int, List[float]] = {}
        for q, t in self._verify_obs:
            by_q.setdefault(q, []).append(t / self.t_plain)
        return by_q

    def verify_fit_ratio(self) -> Tuple[float, float]:
        """``(c0, c1)`` of ``verify(q) / t_plain = c0 + c1 q`` (weighted least squares over the
        recent medians per ``q``, ``c0, c1 >= 0``; one ``q`` timed: the line through it and a recent
        scored plain step, else ``(1, 1)``; none: ``(1, 0)``)."""
        pts = [(q, _median(v), len(v)) for q, v in self._verify_by_q().items()]
        if not pts:
            return 1.0, 0.0
        if len(pts) == 1:
            q, t, _ = pts[0]
            recent = [t / self.t_plain for n, t in self._scored_plain if n > self._scored_passes - 2 * self.window]
            t1 = _median(recent, 1.0)
            c1 = max(0.0, (t - t1) / (q - 1))
            return t - c1 * q, c1
        return _weighted_line(pts, "flat")

    def relative_cost(self, g: int, optimistic: bool = False) -> float:
        """Predicted time of an iteration with ``g`` drafts, in plain steps (1 for ``g = 0``); its
        verification part is never below one plain step. ``optimistic``: a ``q = g + 1`` not timed
        lately while ``q - 1 >= 2`` was costs at most that one's median (what probes assume)."""
        if g == 0:
            return 1.0
        q = g + 1
        by_q = self._verify_by_q()
        seen = by_q.get(q)
        if seen:
            c = _median(seen)
        else:
            c0, c1 = self.verify_fit_ratio()
            c = c0 + c1 * q
            if optimistic and by_q.get(q - 1):
                c = min(c, _median(by_q[q - 1]))
        # more query rows (and block scoring) than a plain step: never cheaper than one
        c = max(c, 1.0)
        return c + (g * _median(self._draft_secs, 0.0) + _median(self._select_secs, 0.0)) / (self.t_plain or 1.0)

    def stats(self) -> dict:
        """``cost_t_*_ms`` entries: the plain step, draft step, selection and verify line in ms."""
        c0, c1 = self.verify_fit_ratio()
        tp = self.t_plain
        return {
            "cost_t_plain_ms": None if tp is None else 1000 * tp,
            "cost_t_draft_ms": None if not self._draft_secs else 1000 * _median(self._draft_secs),
            "cost_t_select_ms": None if not self._select_secs else 1000 * _median(self._select_secs),
            "cost_t_verify_c0_ms": 1000 * (c0 * (tp or 0.0)),
            "cost_t_verify_c1_ms": 1000 * (c1 * (tp or 0.0)),
        }


class AutoGamma(GammaPolicy):
    """``gamma`` chosen before every iteration to maximize the expected emitted tokens per second.

    Rate of ``g`` drafts: expected tokens ``sum_b 1 + sum_{j <= min(g, caps[b])} prod_{i <= j} a_i``
    (Leviathan et al., ICML 2023, with per-position rates from :class:`AcceptanceEstimate`) over
    the iteration's cost from :class:`StepCostModel`. The decision rule: a ``g > 0`` when it beats
    a plain step by ``margin``, or when the best ``g`` would at the upper-bound acceptance
    (``exploration`` standard errors); warm-up drafts ``first_gamma`` then one plain step; after
    ``probe_interval`` plain steps in a row a probe (interval doubling to ``max_probe_interval``;
    ``hopeless_probe_interval`` where no ``g`` could pay even at acceptance 1); ``climb`` retries
    longer drafts; ``optimistic_gamma`` chooses the length of a draft at the upper-bound acceptance
    (whether to draft stays on the estimates). Design and measurements: ``docs/gamma_policy.md``.
    Lossless whatever it picks: the choice depends on past timings and acceptances only. A setting
    of the wrong type or range raises ``ValueError`` naming it.
    """

    name = "auto"

    def __init__(self, max_gamma: int, prior_acceptance: float = 0.8, prior_weight: float = 4.0,
                 acceptance_decay: float = 0.97, cost_ema: float = 0.5, window: int = 5,
                 first_gamma: int = 2, probe_interval: int = 4, max_probe_interval: int = 32,
                 margin: float = 0.03, exploration: float = 1.0, hopeless_probe_interval: int = 64,
                 climb: bool = False, optimistic_gamma: bool = False):
        super().__init__(max_gamma)
        if self.max_gamma < 1:
            raise ValueError(f"num_speculative_tokens (the cap) must be >= 1 with gamma_policy='auto', got {max_gamma}")
        v = _check_policy_args(prior_acceptance=prior_acceptance, prior_weight=prior_weight,
                               acceptance_decay=acceptance_decay, cost_ema=cost_ema, window=window,
                               first_gamma=first_gamma, probe_interval=probe_interval,
                               max_probe_interval=max_probe_interval, margin=margin, exploration=exploration,
                               hopeless_probe_interval=hopeless_probe_interval, climb=climb,
                               optimistic_gamma=optimistic_gamma)
        self.acc = AcceptanceEstimate(self.max_gamma, v["prior_acceptance"], v["prior_weight"], v["acceptance_decay"])
        self.costs = StepCostModel(v["window"], v["cost_ema"])
        self.first_gamma = max(1, min(v["first_gamma"], self.max_gamma))
        self.min_probe_interval = self.probe_interval = v["probe_interval"]
        self.max_probe_interval = v["max_probe_interval"]
        self.hopeless_probe_interval = v["hopeless_probe_interval"]
        self.margin = v["margin"]
        self.exploration = v["exploration"]
        self.num_probes = 0
        self._plain_run = 0
        self.climb = v["climb"]
        self.optimistic_gamma = v["optimistic_gamma"]
        self.climb_interval = self.min_probe_interval
        self._same_run = 0  # speculative iterations in a row drafting at most `_steady` tokens
        self._steady = 0

    @property
    def window(self) -> int:
        return self.costs.window

    @property
    def t_plain(self) -> Optional[float]:
        return self.costs.t_plain

    # ------------------------------------------------------------------ estimates
    def acceptance(self) -> List[float]:
        """``[max_gamma]`` current estimates ``a_i`` (conditional acceptance at draft position i)."""
        return self.acc.rates()

    def acceptance_upper(self) -> List[float]:
        """``[max_gamma]`` optimistic estimates (``exploration`` standard errors above)."""
        return self.acc.upper(self.exploration)

    def verify_fit(self) -> Tuple[float, float]:
        """``(c0, c1)`` seconds of ``t_verify(q) = c0 + c1 q`` at the current ``t_plain``."""
        c0, c1 = self.costs.verify_fit_ratio()
        tp = self.costs.t_plain or 0.0
        return c0 * tp, c1 * tp

    def relative_cost(self, g: int, optimistic: bool = False) -> float:
        """Predicted time of an iteration with ``g`` drafts, in plain steps."""
        return self.costs.relative_cost(g, optimistic)

    def cost(self, g: int) -> float:
        """Predicted seconds of an iteration with ``g`` drafts (at the current ``t_plain``)."""
        return self.relative_cost(g) * (self.costs.t_plain or 0.0)

    def expected_tokens(self, g: int, caps: Tensor, acceptance: Optional[List[float]] = None) -> float:
        """Expected emitted tokens of the batch with ``g`` drafts (rows capped at ``caps``), at the
        current estimates or at the given per-position ``acceptance``."""
        acc = self.acceptance() if acceptance is None else acceptance
        cum, p = [0.0], 1.0
        for j in range(g):
            p *= acc[j]
            cum.append(cum[-1] + p)
        return float(sum(1.0 + cum[min(g, max(0, int(c)))] for c in caps.tolist()))

    def rate(self, g: int, caps: Tensor, acceptance: Optional[List[float]] = None,
             optimistic: bool = False) -> float:
        """Predicted emitted tokens per plain-step time with ``g`` drafts."""
        return self.expected_tokens(g, caps, acceptance) / max(self.relative_cost(g, optimistic), 1e-12)

    def hopeless(self, caps: Tensor, limit: int) -> bool:
        """Whether no ``g`` in ``1..min(max_gamma, limit)`` could beat a plain step by the margin
        even if every draft were accepted (rates with the optimistic verification costs)."""
        hi = max(0, min(self.max_gamma, int(limit)))
        perfect = [1.0] * self.max_gamma
        best = max((self.rate(g, caps, perfect, optimistic=True) for g in range(1, hi + 1)), default=0.0)
        return best * (1.0 + self.margin) < self.rate(0, caps)

    # ------------------------------------------------------------------ decision rule
    def choose(self, caps: Tensor, limit: int) -> int:
        hi = max(0, min(self.max_gamma, int(limit)))
        it = len(self.history)
        if hi == 0:
            g = 0
        elif it == 0:
            g = min(self.first_gamma, hi)
        elif self._warming_up(it):
            g = 0
        else:
            g = self._best(caps, hi)
            if g > 0:
                self._plain_run, self.probe_interval = 0, self.min_probe_interval
                g = self._climb(g, caps, hi)
            else:
                g = self._probe(caps, hi)
        self.history.append(g)
        return g

    def _warming_up(self, it: int) -> bool:
        """Whether iteration ``it`` (``>= 1``) is a plain step that measures the costs: the second,
        and any until a plain step was timed."""
        return it == 1 or self.costs.t_plain is None

    def _best(self, caps: Tensor, hi: int) -> int:
        """The best ``g`` by the estimates (plain steps favoured by ``margin``), or the best
        ``g >= 1`` when it would win at the upper-bound acceptance."""
        rate = [self.rate(g, caps) for g in range(hi + 1)]
        rate[0] *= 1.0 + self.margin  # speculate only on a clear predicted gain
        g = max(range(hi + 1), key=lambda i: rate[i])
        if g > 0 and self.optimistic_gamma:  # which draft length: at the upper-bound acceptance
            up = self.acceptance_upper()
            g = max(range(1, hi + 1), key=lambda i: self.rate(i, caps, up))
        if g == 0 and self.exploration > 0:  # few trials behind the estimates: optimistic
            best = max(range(1, hi + 1), key=lambda i: rate[i])
            if self.rate(best, caps, self.acceptance_upper()) > rate[0]:
                g = best
        return g

    def _probe(self, caps: Tensor, hi: int) -> int:
        """0, or after ``probe_interval`` plain steps in a row (``hopeless_probe_interval`` where
        no draft could pay) the best ``g >= 1`` at optimistic verification costs."""
        self._plain_run += 1
        if self._plain_run < self.probe_interval or (
                self._plain_run < self.hopeless_probe_interval and self.hopeless(caps, hi)):
            return 0
        opt = [self.rate(i, caps, optimistic=True) for i in range(hi + 1)]
        self.num_probes += 1
        self._plain_run = 0
        self.probe_interval = min(2 * self.probe_interval, self.max_probe_interval)
        return max(range(1, hi + 1), key=lambda i: opt[i])

    def _climb(self, g: int, caps: Tensor, hi: int) -> int:
        """``g``, or a longer draft when ``climb_interval`` speculative iterations in a row drafted
        at most ``g`` and a longer one could pay at the upper-bound acceptance."""
        if not self.climb or g >= hi:
            self._same_run, self._steady = 0, g
            return g
        if g > self._steady:  # the estimates chose a longer draft by themselves
            self.climb_interval = self.min_probe_interval
            self._same_run = 0
        self._steady = g
        self._same_run += 1
        if self._same_run < self.climb_interval:
            return g
        self._same_run = 0
        self.climb_interval = min(2 * self.climb_interval, self.max_probe_interval)
        up = self.acceptance_upper()
        opt = {i: self.rate(i, caps, up, optimistic=True) for i in range(g + 1, hi + 1)}
        best = max(opt, key=opt.get)
        if opt[best] <= self.rate(g, caps):
            return g
        self.num_probes += 1
        return best

    def observe_iteration(self, costs: IterationCosts, drafted: Tensor, accepted: Tensor) -> None:
        self.costs.observe(costs)
        if costs.gamma:
            self.acc.observe(drafted.tolist(), accepted.tolist())

    def stats(self) -> dict:
        return {
            **super().stats(),
            "acceptance_estimates": [round(x, 4) for x in self.acceptance()],
            **self.costs.stats(),
            "num_probes": self.num_probes,
        }


def allocate_drafts(marginal: List[List[float]], caps: List[int], gamma: int,
                    cost, uniform_margin: float = 0.0) -> Tuple[float, List[int]]:
    """The best drafts per row for one iteration of at most ``gamma`` draft steps.

    Args:
        marginal: per row ``b``, ``marginal[b][j]`` the probability that its draft ``j + 1`` is
            emitted (``prod_{i <= j} a_{b,i}``: non-increasing in ``j``).
        caps: per row the most drafts it may write (``-1``: the row does not decode).
        gamma: the draft steps of the iteration (every row drafts in each of them).
        cost: ``n_tokens -> seconds`` of the iteration when its verification takes ``n_tokens``
            tokens (each decoding row's last token plus its verified drafts).
        uniform_margin: the drafts differ between rows only where that beats every row drafting
            ``min(gamma, cap)`` by this fraction (rows with one draft count verify in one batched
            pass, without the packed pass's per-row calls).

    Returns:
        ``(rate, drafts)``: expected emitted tokens per second and per row the drafts to verify.
        With the rows' marginal gains non-increasing, adding drafts in order of gain gives the
        most expected tokens for every token count, so the best rate is on that path (Leviathan
        et al. 2023's expected tokens; verification priced per token, so a row drafting 1 does
        not pay for a row drafting 6).
    """
    active = [b for b, c in enumerate(caps) if c >= 0]
    n = len(active)
    steps = sorted(((marginal[b][j], b) for b in active for j in range(min(gamma, caps[b]))), key=lambda x: -x[0])
    drafts = [0] * len(caps)
    tokens = float(n)
    best_rate, best_k = tokens / max(cost(n), 1e-12), 0
    for k, (m, _b) in enumerate(steps, 1):
        tokens += m
        r = tokens / max(cost(n + k), 1e-12)
        if r > best_rate:
            best_rate, best_k = r, k
    for _, b in steps[:best_k]:
        drafts[b] += 1
    if uniform_margin > 0:
        uni = [max(0, min(gamma, caps[b])) if caps[b] >= 0 else 0 for b in range(len(caps))]
        if uni != drafts:
            t = n + sum(sum(marginal[b][: uni[b]]) for b in active)
            u_rate = t / max(cost(n + sum(uni)), 1e-12)
            if best_rate < u_rate * (1.0 + uniform_margin):
                return u_rate, uni
    return best_rate, drafts


class TokenCostModel:
    """Iteration costs of a batch whose rows draft their own number of tokens, in seconds.

    A verification of ``n`` tokens (each row's last token and its drafts, packed) costs
    ``c0 + c1 n``: the weights and the KV cache are read once per forward (``c0``) and every token
    pays its linears and its attention over its row's context (``c1``). A draft step of ``r`` rows
    costs ``d0 + d1 r`` likewise. Each line is fitted by least squares through the medians of the
    last ``window`` timings *per* token (row) count, so the points the line rests on -- the
    prefill's last forward, a plain step, the token counts that ragged drafts spread -- are not
    flushed out by a run of iterations at one count, and the noise of a few passes does not swing
    it (what fitting ``c0 + c1 q`` over the last passes at one ``q`` per batch did: 18.7 + 43.8 q
    and 210 + 0 q ms in two runs of one cell). Until two counts were timed the lines take the
    conservative reading: verification all per token (drafting looks dear), a step of some rows
    as dear as one of all. ``c0, c1, d0, d1 >= 0``. Rows leaving the batch (:meth:`keep_rows`)
    change what a forward reads, so the verification timings start over then. ``max_batch_sizes``:
    the verification and plain-step timings of at most that many batch sizes (the most recently
    timed) are kept (``None``: all; an engine whose batch size wanders would keep every size it
    ever ran). A count's first timing is provisional (``provisional_first``): a first call at a new
    shape carries one-time costs (oneDNN prepares each new shape once: 211 packed linears took
    45 ms at their first 7 rows and 33 ms at the second), so the second timing replaces it, and
    while it stands alone it prices its count at no more than the line through the counts timed
    twice (an upper bound, the policy would otherwise not draft that count again).
    """

    def __init__(self, window: int = 5, max_batch_sizes: Optional[int] = None, provisional_first: bool = True):
        self.window = check_int(window, "window", 1)
        self.max_batch_sizes = check_int(max_batch_sizes, "max_batch_sizes", 1, none_ok=True)
        self.provisional_first = check_bool(provisional_first, "provisional_first")
        self._first: set = set()  # ("plain", rows) / ("verify", (rows, tokens)) timed once, at their first
        self._batch_sizes: List[int] = []  # timed batch sizes, most recent last (with max_batch_sizes)
        self._verify: Dict[Tuple[int, int], List[float]] = {}  # (rows, tokens) -> seconds of scored passes
        self._plain: Dict[int, List[float]] = {}  # rows -> seconds of its last unscored plain steps
        self._draft: Dict[int, List[float]] = {}  # rows -> seconds of its last draft steps
        self._select: List[float] = []
        self.subsets = False  # whether the latest drafts could run on some rows only
        self.rows = 0  # the batch's rows at the latest timing
        self._observed, self._memo_of, self._memos = 0, -1, {}

    def _push(self, by: dict, key, t: float, first: Optional[str] = None) -> None:
        """Append ``t`` to ``by[key]`` (the last ``window`` kept); with ``first`` (the dict's name),
        a key's first timing is marked provisional and dropped when its second arrives."""
        xs = by.setdefault(key, [])
        mark = (first, key)
        if first and self.provisional_first:
            if not xs:
                self._first.add(mark)
            elif mark in self._first:
                self._first.discard(mark)
                xs.clear()
        xs.append(t)
        del xs[: -self.window]

    def _provisional(self, name: str, key) -> bool:
        return (name, key) in self._first

    @property
    def t_plain(self) -> Optional[float]:
        """Seconds of a plain step of the current batch (latest medians), or None before one."""
        return _median(self._plain[self.rows]) if self._plain.get(self.rows) else None

    def observe(self, c: IterationCosts) -> None:
        """Record one iteration (``c.tokens`` and ``c.rows`` must be given)."""
        if c.tokens <= 0 or c.rows <= 0:
            raise ValueError("TokenCostModel.observe: IterationCosts.tokens and .rows must be > 0")
        self._observed += 1
        self.rows = c.rows
        if self.max_batch_sizes:
            self._keep_recent(c.rows)
        if c.gamma == 0 and not c.scored:
            self._push(self._plain, c.rows, c.verify, "plain")
        else:
            self._push(self._verify, (c.rows, c.tokens), c.verify, "verify")
        if c.gamma:
            self.subsets = c.draft_steps is not None
            for r, t in (c.draft_steps or [(c.rows, c.draft / c.gamma)]):
                self._push(self._draft, r, t)
            if c.select > 0:
                self._select.append(c.select)
                del self._select[: -self.window]

    def _keep_recent(self, rows: int) -> None:
        """``rows`` was just timed: drop the timings of batch sizes beyond the ``max_batch_sizes`` most recent."""
        sizes = self._batch_sizes
        if rows in sizes:
            sizes.remove(rows)
        sizes.append(rows)
        for old in sizes[: -self.max_batch_sizes]:
            self._plain.pop(old, None)
            self._first.discard(("plain", old))
            for key in [k for k in self._verify if k[0] == old]:
                del self._verify[key]
                self._first.discard(("verify", key))
        del sizes[: -self.max_batch_sizes]

    def batch_sizes(self) -> List[int]:
        """The batch sizes with verification or plain-step timings, ascending."""
        return sorted({r for r, _ in self._verify} | {r for r, v in self._plain.items() if v})

    def _memo(self, key, fn):
        """``fn()``, remembered until the next :meth:`observe` (a choice prices many drafts)."""
        if self._memo_of != self._observed:
            self._memo_of, self._memos = self._observed, {}
        if key not in self._memos:
            self._memos[key] = fn()
        return self._memos[key]

    def _verify_points(self, rows: int) -> Dict[int, List[float]]:
        return self._memo(("points", rows), lambda: self._points(rows))

    def _points(self, rows: int) -> Dict[int, List[float]]:
        """Verification timings per token count for a batch of ``rows`` rows (a plain step is a
        verification of ``rows`` tokens); those of every batch size while ``rows``' own do not yet
        span two token counts (rows left the batch lately). A count timed once, at its first
        (provisional) timing, counts at no more than the curve through the other counts."""
        own, first = self._timings_by_count(rows)
        if len(own.keys() | first.keys()) < 2:
            own, first = self._timings_by_count(None)
        return _bounded(own, first)

    def _timings_by_count(self, rows: Optional[int]) -> Tuple[Dict[int, List[float]], Dict[int, List[float]]]:
        """The verification and plain-step timings of ``rows`` rows (``None``: every batch size) per
        token count: those timed twice or more, and the provisional first timings."""
        own: Dict[int, List[float]] = {}
        first: Dict[int, List[float]] = {}
        timings = [(("verify", (r, n)), n, v) for (r, n), v in self._verify.items() if rows in (None, r)]
        timings += [(("plain", r), r, v) for r, v in self._plain.items() if rows in (None, r)]
        for mark, n, v in timings:
            if v:
                (first if mark in self._first else own).setdefault(n, []).extend(v)
        return own, first

    def ready(self) -> bool:
        """Whether verification was timed at two token counts at least (the line is determined)."""
        return len(self._verify_points(self.rows)) >= 2

    def verify_fit(self, rows: Optional[int] = None) -> Tuple[float, float]:
        """``(c0, c1)`` seconds of the line ``verify(n) = c0 + c1 n`` for ``rows`` rows (default the
        current batch; ``(0, 0)`` before any timing)."""
        return _line_fit(self._verify_points(self.rows if rows is None else rows), one="origin")

    def verify(self, tokens: int, rows: int) -> float:
        """Seconds of a verification of ``tokens`` tokens over ``rows`` rows: the recent median where
        timed, else interpolated between the nearest timed counts (the cost is no line: packed
        linears get faster per row as rows grow), else the line from the nearest timed count."""
        return self._memo(("verify", tokens, rows), lambda: _curve(self._verify_points(rows), tokens, one="origin"))

    def draft_fit(self) -> Tuple[float, float]:
        """``(d0, d1)`` seconds of a draft step of ``r`` rows, ``d0 + d1 r``."""
        return self._memo("draft", lambda: _line_fit(self._draft, one="flat"))

    def plain(self, rows: int) -> float:
        """Seconds of a plain step of ``rows`` rows: its recent median, else from the verification
        (a provisional first timing: at most the verification curve's)."""
        if self._plain.get(rows):
            t = _median(self._plain[rows])
            if self._provisional("plain", rows):
                v = self.verify(rows, rows)
                t = min(t, v) if v > 0 else t
            return t
        return self.verify(rows, rows)

    def draft_step(self, rows: int) -> float:
        """Seconds of one draft step of ``rows`` rows: the recent median at that row count, else
        the fitted line (0 before any was timed)."""
        if self._draft.get(rows):
            return _median(self._draft[rows])
        d0, d1 = self.draft_fit()
        return d0 + d1 * rows

    def iteration(self, gamma: int, tokens: int, rows: int) -> float:
        """Predicted seconds of an iteration of ``gamma`` draft steps over ``rows`` rows verifying
        ``tokens`` tokens (``gamma = 0``: a plain step). Where steps draft the rows that still
        draft only (:attr:`subsets`), the steps cost ``gamma d0 + d1 (tokens - rows)``, else
        ``gamma`` steps of all rows."""
        if gamma == 0:
            return self.plain(rows)
        verify = max(self.verify(tokens, rows), self.plain(rows))  # more tokens than a plain step: never cheaper
        drafting = gamma * self.draft_step(rows)
        if self.subsets:
            d0, d1 = self.draft_fit()
            drafting = min(drafting, gamma * d0 + d1 * (tokens - rows))
        return verify + drafting + _median(self._select, 0.0)

    def stats(self) -> dict:
        """``cost_t_*_ms``: plain step, draft step (all rows), selection and the verify line in ms."""
        c0, c1 = self.verify_fit()
        d0, d1 = self.draft_fit()
        return {
            "cost_t_plain_ms": None if self.t_plain is None else 1000 * self.t_plain,
            "cost_t_draft_ms": None if not self._draft else 1000 * self.draft_step(max(self._draft)),
            "cost_t_draft_c0_ms": 1000 * d0, "cost_t_draft_per_row_ms": 1000 * d1,
            "cost_t_select_ms": None if not self._select else 1000 * _median(self._select),
            "cost_t_verify_c0_ms": 1000 * c0,
            "cost_t_verify_per_token_ms": 1000 * c1,
        }


class _RowChoice:
    """One choice of :class:`RowGamma` (built by :meth:`RowGamma.choose_rows`): the estimates and
    costs hold still while its rule prices every ``g``, so the rows' marginal gains per acceptance
    source and the iteration's seconds per ``(g, rows, tokens)`` are computed once per choice."""

    def __init__(self):
        self.upper_used = False  # the rule looked at the upper-bound acceptance (then drafts on it)
        self.upper: Optional[List[List[float]]] = None  # per row, its optimistic estimates
        # id(acceptance) -> (acceptance, per-row marginal gains); the source is held so its id stays its own
        self._marginal: Dict[Optional[int], Tuple[object, List[List[float]]]] = {}
        self._prices: Dict[Tuple[int, int], Dict[int, float]] = {}  # (g, rows) -> tokens -> seconds
        self.estimated: Dict[int, Tuple[float, List[int]]] = {}  # g -> allocate_drafts at the estimates

    def marginal_of(self, acceptance, make) -> List[List[float]]:
        """The rows' marginal gains at ``acceptance`` (``None``: the estimates), ``make()`` once."""
        key = None if acceptance is None else id(acceptance)
        if key not in self._marginal:
            self._marginal[key] = (acceptance, make())
        return self._marginal[key][1]

    def price(self, g: int, rows: int) -> Dict[int, float]:
        """The memo ``tokens -> seconds`` of iterations of ``g`` draft steps over ``rows`` rows."""
        return self._prices.setdefault((g, rows), {})


class RowGamma(AutoGamma):
    """``auto`` with drafts per row (our loop's default): each row drafts its own ``g`` in
    ``0..max_gamma`` from its own acceptance and the batch's measured costs.

    Each row has an :class:`AcceptanceEstimate` whose prior is the rate pooled over the batch
    (:attr:`acc`, so a row starts where its peers are). An iteration of ``G`` draft steps costs
    ``G`` batch draft steps plus a verification priced per token (:class:`TokenCostModel`: rows'
    tokens are packed, so a row verifying 2 tokens does not pay for one verifying 7). For every
    ``G``, :func:`allocate_drafts` finds the drafts per row with the most expected tokens per
    second; :class:`AutoGamma`'s rule (warm-up, margin over a plain step, upper-bound exploration,
    probes) then chooses ``G`` on those rates. Lossless whatever it picks (choices depend on the
    past only). Design and measurements: ``docs/gamma_policy.md``.

    Args:
        max_gamma, window, **kwargs: as :class:`AutoGamma`'s (``cost_ema`` is accepted and unused).
        prior_weight: pseudo-trials behind each prior: 8, where :class:`AutoGamma`'s 4 let one early
            rejection shorten the drafts for long (replayed: ``docs/gamma_policy.md``).
        uniform_margin: drafts differ between rows only where that beats uniform drafts by this
            fraction (default ``margin``; 0 where the verification is ragged anyway, as in vLLM).
        costs: the :class:`TokenCostModel` to use (default a new one of ``window``).
    """

    name = "auto"

    def __init__(self, max_gamma: int, window: int = 5, uniform_margin: Optional[float] = None,
                 costs: Optional[TokenCostModel] = None, prior_weight: float = 8.0, **kwargs):
        kwargs.pop("cost_ema", None)
        uniform_margin = _check_policy_args(uniform_margin=uniform_margin)["uniform_margin"]
        if costs is not None and not isinstance(costs, TokenCostModel):
            raise OptionTypeError(f"costs must be a TokenCostModel or None, got {type(costs).__name__}")
        super().__init__(max_gamma, window=window, prior_weight=prior_weight, **kwargs)
        self.costs = TokenCostModel(self.window) if costs is None else costs
        # ragged drafts only where they beat uniform ones by this (default `margin`): see allocate_drafts
        self.uniform_margin = self.margin if uniform_margin is None else uniform_margin
        self.row_acc: List[AcceptanceEstimate] = []
        self.row_choices = [0] * (self.max_gamma + 1)  # row-iterations per g
        self._choice: Optional[_RowChoice] = None  # while choose_rows runs

    def _warming_up(self, it: int) -> bool:
        """A plain step measures the costs only while the verification has been timed at one token
        count (the prefill's last forward, a verification of ``B x n0`` tokens, gives a second)."""
        return not self.costs.ready()

    def observe_prefill(self, tokens: int, rows: int, seconds: float) -> None:
        """The prefill's last forward: a scored verification of ``tokens`` tokens over ``rows`` rows."""
        self.costs.observe(IterationCosts(0, 0.0, seconds, 0.0, scored=True, tokens=tokens, rows=rows))

    def _rows(self, n: int) -> List[AcceptanceEstimate]:
        while len(self.row_acc) < n:
            self.row_acc.append(AcceptanceEstimate(self.max_gamma, self.acc.prior_acceptance, self.acc.prior_weight,
                                                   self.acc.decay))
        pooled = self.acc.pooled()
        for r in self.row_acc:
            r.prior_acceptance = pooled
        return self.row_acc

    def acceptance_upper(self):
        """Per row, its optimistic estimates (``exploration`` standard errors above)."""
        ch = self._choice
        if ch is None:
            return [r.upper(self.exploration) for r in self.row_acc]
        ch.upper_used = True
        if ch.upper is None:
            ch.upper = [r.upper(self.exploration) for r in self.row_acc]
        return ch.upper

    def _marginal(self, caps: Tensor, acceptance) -> List[List[float]]:
        rows = self._rows(caps.numel())
        out = []
        for b in range(caps.numel()):
            if acceptance is None:
                acc = rows[b].rates()
            elif acceptance and isinstance(acceptance[0], list):
                acc = acceptance[b] if b < len(acceptance) else rows[b].upper(self.exploration)
            else:
                acc = acceptance
            p, m = 1.0, []
            for a in acc:
                p *= a
                m.append(p)
            out.append(m)
        return out

    def _allocate(self, g: int, caps: Tensor, acceptance=None) -> Tuple[float, List[int]]:
        c = caps.tolist()
        rows = sum(1 for x in c if x >= 0)
        ch = self._choice
        if ch is None:
            marginal, price = self._marginal(caps, acceptance), {}
        else:
            marginal, price = ch.marginal_of(acceptance, lambda: self._marginal(caps, acceptance)), ch.price(g, rows)

        def cost(n: int) -> float:
            if n not in price:
                price[n] = self.costs.iteration(g, n, rows)
            return price[n]

        out = allocate_drafts(marginal, c, g, cost, self.uniform_margin)
        if ch is not None and acceptance is None:
            ch.estimated[g] = out
        return out

    def rate(self, g: int, caps: Tensor, acceptance=None, optimistic: bool = False) -> float:
        """Expected emitted tokens per second of the best drafts per row with ``g`` draft steps."""
        if g == 0:
            rows = int((caps >= 0).sum())
            return rows / max(self.costs.plain(rows), 1e-12)
        return self._allocate(g, caps, acceptance)[0]

    def choose_rows(self, caps: Tensor) -> Tensor:
        return self.choose_rows_priced(caps)[0]

    def choose_rows_priced(self, caps: Tensor) -> Tuple[Tensor, "_RowChoice"]:
        """:meth:`choose_rows`, and the choice's :class:`_RowChoice` (what it priced)."""
        self._rows(caps.numel())
        ch = self._choice = _RowChoice()
        try:
            g = self.choose(caps, int(caps.max()))
            if g == 0:
                drafts = [0] * caps.numel()
            else:
                _, drafts = self._allocate(g, caps, self.acceptance_upper() if ch.upper_used else None)
                if not any(drafts):  # warm-up or a probe: every row drafts, to measure
                    drafts = caps.clamp(min=0, max=g).tolist()
        finally:
            self._choice = None
        for d, c in zip(drafts, caps.tolist()):
            if c >= 0:
                self.row_choices[d] += 1
        return caps.new_tensor(drafts), ch

    def observe_iteration(self, costs: IterationCosts, drafted: Tensor, accepted: Tensor) -> None:
        self.costs.observe(costs)
        if costs.gamma:
            d, a = drafted.tolist(), accepted.tolist()
            self.acc.observe(d, a)
            for r, db, ab in zip(self._rows(len(d)), d, a):
                if db > 0:
                    r.observe([db], [ab])

    def keep_rows(self, rows: Tensor) -> None:
        self.row_acc = [self.row_acc[i] for i in rows.tolist() if i < len(self.row_acc)]

    def stats(self) -> dict:
        """As :class:`AutoGamma`'s, with ``gamma_per_iteration`` the draft steps of every iteration,
        ``row_gamma_histogram`` the row-iterations per drafts and the per-token verify cost."""
        return {**super().stats(), "row_gamma_histogram": list(self.row_choices)}


class _EngineRowGamma(RowGamma):
    """:class:`RowGamma` for an engine that times a step only when it verified exactly the previous
    step's drafts: the warm-up's drafts may go untimed (a request joined, a prefill chunk), and
    plain steps alone never time a second token count, so while the verification is not
    determined (:meth:`TokenCostModel.ready`) a plain step that was timed is followed by another
    ``first_gamma`` drafts (measured in vLLM: the first drafts untimed, 37 plain steps followed)."""

    def choose(self, caps: Tensor, limit: int) -> int:
        hi = max(0, min(self.max_gamma, int(limit)))
        if hi and self.history and self.history[-1] == 0 and not self.costs.ready() and self.costs.t_plain is not None:
            g = min(self.first_gamma, hi)
            self.history.append(g)
            return g
        return super().choose(caps, limit)


class PerRequestGamma:
    """``auto`` per request for a batched engine: our loop's :class:`RowGamma` over each engine
    step's requests, one row per request, each its own ``g`` in ``0..cap``.

    Each request id keeps its own :class:`AcceptanceEstimate` (its row's while it is in a step's
    batch; prior: the rate pooled over the engine's verified drafts, :attr:`engine_acc`, forgotten
    at ``acceptance_decay`` per step), and one :class:`TokenCostModel` prices the steps from the
    engine's timings (:meth:`observe_step`: a verification of ``n`` tokens over ``B`` requests,
    draft steps of the requests that still draft, the selection; the ``max_batch_sizes`` most
    recently timed batch sizes kept). Every step, :class:`RowGamma`'s rule chooses the step's draft
    steps ``G`` (warm-up, margin over the batch's plain step, upper-bound exploration, probes) and
    :func:`allocate_drafts` the drafts of each request -- the most expected tokens per second for
    the whole batch, which pays every draft step and every verified token: a request whose drafts
    are rejected gets none while one whose drafts are accepted keeps drafting, and drafts that do
    not pay for the batch are not run. Ragged drafts cost nothing extra here (``uniform_margin``
    0: the engine's verification is ragged by construction). The engine times a step only when it
    verified exactly the previous step's drafts, so until the verification is timed at two token
    counts every plain step that was timed is followed by ``first_gamma`` drafts again.
    Runner-independent (the vLLM plugin drives it from ``vegas_ext.vllm.proposer``). Design:
    ``docs/vllm_gamma.md``.

    Args:
        max_gamma: the most drafts any request gets (``>= 1``).
        max_batch_sizes: batch sizes whose timings the cost model keeps (see :class:`TokenCostModel`).
        **auto_kwargs: :class:`RowGamma` / :class:`AutoGamma` options (``prior_acceptance``,
            ``margin``, ``window``, ...; ``cost_ema`` is accepted and unused).

    Raises:
        ValueError: ``max_gamma`` or ``max_batch_sizes`` not an integer ``>= 1``, or an
            ``auto_kwargs`` setting of the wrong type or range (named).
    """

    history_kept = 256  # steps of RowGamma.history kept: an engine runs for ever

    def __init__(self, max_gamma: int, max_batch_sizes: int = 16, **auto_kwargs):
        self.max_gamma = max_gamma = check_int(max_gamma, "max_gamma", 1)
        if "costs" in auto_kwargs:
            raise ValueError("costs cannot be given to PerRequestGamma: it builds its own TokenCostModel "
                             "(set window and max_batch_sizes instead)")
        # requests differ far more than a batch's rows: a weak prior lets a rejected one stop drafting
        kw = {"uniform_margin": 0.0, "prior_weight": 4.0, **auto_kwargs}
        costs = TokenCostModel(kw.get("window", 5), max_batch_sizes=check_int(max_batch_sizes, "max_batch_sizes", 1))
        #: the engine's policy; its row estimates are the step's requests' (:attr:`requests`)
        self.row_policy = _EngineRowGamma(max_gamma, costs=costs, **kw)
        self.requests: Dict[str, AcceptanceEstimate] = {}  # by request id
        self._verified: Tuple[List[int], List[int]] = ([], [])  # drafted, accepted since the last step
        self.choices = [0] * (max_gamma + 1)  # decisions per g, all requests
        self.vetoed = 0  # plain steps where the best allocation drafted for some request

    @property
    def costs(self) -> TokenCostModel:
        """The engine's step costs."""
        return self.row_policy.costs

    @property
    def engine_acc(self) -> AcceptanceEstimate:
        """Every request's verified drafts pooled: the prior of each request's estimates."""
        return self.row_policy.acc

    def estimate(self, req_id: str) -> AcceptanceEstimate:
        """The request's :class:`AcceptanceEstimate` (created on first use, behind the pooled rate)."""
        a = self.requests.get(req_id)
        if a is None:
            acc = self.engine_acc
            a = self.requests[req_id] = AcceptanceEstimate(self.max_gamma, acc.pooled(), acc.prior_weight, acc.decay)
        return a

    def choose(self, req_id: str, cap: int) -> int:
        """Drafts for ``req_id`` alone in a step (:meth:`choose_batch` of one request)."""
        return self.choose_batch([(req_id, cap)])[0]

    def choose_batch(self, reqs: List[Tuple[str, int]], batch_size: Optional[int] = None) -> List[int]:
        """Drafts for one engine step of the requests ``[(req_id, cap)]`` (``cap``: the most it may
        draft, e.g. its reserved slots; each result in ``[0, min(max_gamma, cap)]``), chosen
        together: :meth:`RowGamma.choose_rows` over one row per request. ``batch_size``: the
        step's whole batch (default ``len(reqs)``), its other requests priced as rows that verify
        one token and draft none. A step that decodes plainly where the best allocation would have
        drafted for some request (its drafts do not pay for the batch by the margin) counts in
        :attr:`vetoed`."""
        import torch

        if not reqs:
            return []
        drafted, accepted = self._verified
        if drafted:  # one forgetting step per engine step, as our loop's per iteration
            self.engine_acc.observe(drafted, accepted)
            self._verified = ([], [])
        caps = [max(0, min(self.max_gamma, int(c))) for _, c in reqs]
        caps += [0] * (max(len(reqs), int(batch_size or 0)) - len(reqs))
        pol = self.row_policy
        pol.row_acc = [self.estimate(rid) for rid, _ in reqs]  # RowGamma adds the other rows' (no drafts)
        drafts, choice = pol.choose_rows_priced(torch.tensor(caps))
        del pol.history[: -self.history_kept]
        gs = drafts.tolist()[: len(reqs)]
        for g in gs:
            self.choices[g] += 1
        spec = [out for g, out in choice.estimated.items() if g > 0]  # priced at the estimates
        if not any(gs) and spec and any(max(spec, key=lambda out: out[0])[1][: len(reqs)]):
            self.vetoed += 1
        return gs

    def observe_request(self, req_id: str, drafted: int, accepted: int) -> None:
        """The request's last drafts were verified: ``accepted`` of its ``drafted`` (``>= 1``)."""
        if drafted > 0 and req_id in self.requests:
            d, a = int(drafted), min(int(accepted), int(drafted))
            self.requests[req_id].observe([d], [a])
            self._verified[0].append(d)
            self._verified[1].append(a)

    def observe_step(self, costs: IterationCosts, batch_size: Optional[int] = None) -> None:
        """One engine step's timings (``costs.gamma``: its draft steps, the most drafts any request
        verified; ``costs.tokens``: the tokens verified, default ``rows * (gamma + 1)``;
        ``costs.rows``: the requests, default ``batch_size``, else the latest timing's)."""
        rows = costs.rows or int(batch_size or 0) or self.costs.rows or 1
        tokens = costs.tokens or rows * (costs.gamma + 1)
        self.costs.observe(replace(costs, rows=rows, tokens=tokens))

    def forget(self, req_id: str) -> None:
        """Drop a finished request's estimates."""
        self.requests.pop(req_id, None)

    def cost_stats(self) -> dict:
        """The cost model's ``cost_t_*_ms`` (:meth:`TokenCostModel.stats`), with
        ``cost_t_verify_c1_ms`` the verification's ms per token (the name the plugin's stats kept)."""
        s = self.costs.stats()
        return {**s, "cost_t_verify_c1_ms": s["cost_t_verify_per_token_ms"]}

    def stats(self) -> dict:
        """``gamma_histogram`` (decisions per ``g`` over all requests), the costs (:meth:`cost_stats`),
        ``engine_acceptance`` (the new requests' prior), ``cost_batch_sizes`` (batch sizes timed),
        ``tracked_requests``, ``vetoed_steps`` and ``num_probes``."""
        return {"gamma_policy": "auto", "gamma_histogram": list(self.choices), **self.cost_stats(),
                "engine_acceptance": round(self.engine_acc.pooled(), 4), "cost_batch_sizes": self.costs.batch_sizes(),
                "tracked_requests": len(self.requests), "vetoed_steps": self.vetoed,
                "num_probes": self.row_policy.num_probes}


def _line_fit(by_n: Dict[int, List[float]], one: str = "origin") -> Tuple[float, float]:
    """``(a, b)`` of ``t = a + b n`` through timings per ``n``: weighted least squares over the
    medians per ``n`` (weights: timings per ``n``), ``a, b >= 0``. With one ``n`` timed, ``one``
    says which line: ``"origin"`` (through 0: all of it per unit) or ``"flat"`` (``b = 0``); none:
    ``(0, 0)``."""
    pts = [(n, _median(v), len(v)) for n, v in by_n.items() if v]
    if not pts:
        return 0.0, 0.0
    if len(pts) == 1:
        n, t, _ = pts[0]
        return (0.0, t / n) if one == "origin" else (t, 0.0)
    return _weighted_line(pts, "origin")


def _weighted_line(pts: List[Tuple[int, float, float]], same_x: str) -> Tuple[float, float]:
    """``(a, b)`` of ``t = a + b x``, ``a, b >= 0``, by weighted least squares through ``pts``
    (``[(x, t, weight)]``, two points at least; :func:`_line_fit` and
    :meth:`StepCostModel.verify_fit_ratio`). A falling line is flat at the weighted mean ``t``; a
    negative intercept gives the line through the origin (least squares of ``t = b x``). With the
    ``x`` not spread (``same_x``): ``"flat"`` (``b = 0``) or ``"origin"`` through the weighted mean
    point."""
    sw = sum(w for _, _, w in pts)
    mx = sum(x * w for x, _, w in pts) / sw
    mt = sum(t * w for _, t, w in pts) / sw
    vx = sum(w * (x - mx) ** 2 for x, _, w in pts)
    if vx <= 1e-12 * sw:
        return (mt, 0.0) if same_x == "flat" else (0.0, mt / mx)
    b = sum(w * (x - mx) * (t - mt) for x, t, w in pts) / vx
    a = mt - b * mx
    if b < 0:
        return mt, 0.0
    if a < 0:
        return 0.0, sum(w * x * t for x, t, w in pts) / sum(w * x * x for x, _, w in pts)
    return a, b


def _curve(by_n: Dict[int, List[float]], n: int, one: str = "origin") -> float:
    """Timing at ``n`` from timings per count: the median at ``n``; between two timed counts the
    interpolation of their medians; outside them the nearest count's median plus the slope of
    :func:`_line_fit` (0 before any timing)."""
    pts = sorted((k, _median(v)) for k, v in by_n.items() if v)
    if not pts:
        return 0.0
    for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
        if n0 <= n <= n1:
            return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
    a, b = _line_fit(by_n, one)
    if len(pts) == 1:
        return a + b * n
    k, t = pts[0] if n < pts[0][0] else pts[-1]
    return max(0.0, t + b * (n - k))


def _bounded(timed: Dict[int, List[float]], first: Dict[int, List[float]]) -> Dict[int, List[float]]:
    """``timed`` with the counts of ``first`` (each a provisional first timing, an upper bound)
    added at no more than :func:`_curve` through ``timed`` where ``timed`` spans two counts (below
    its lowest count, no more than that count's median: a cost does not fall with more tokens, and
    a line extrapolated downwards may reach 0), else as they are."""
    out = {n: list(v) for n, v in timed.items()}
    lo = min(timed) if timed else 0
    for n, v in first.items():
        t = _median(v)
        if len(timed) >= 2:
            cap = _median(timed[lo]) if n < lo else _curve(timed, n)
            t = min(t, cap) if cap > 0 else t
        out.setdefault(n, []).append(t)
    return out


def _median(xs: List[float], empty=None):
    if not xs:
        return empty
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


def make_gamma_policy(num_speculative_tokens: int, gamma_policy: str, *, per_request: bool = False):
    """The γ policy of both engines, from the options' γ cap and ``gamma_policy`` (validated by
    :class:`vegas_ext.config.VegasConfig` / the vLLM plugin's options).

    Our loop (``per_request=False``): :class:`FixedGamma` ``(0)`` for a cap of 0,
    :class:`RowGamma` ``(cap)`` for ``"auto"``, else :class:`FixedGamma` ``(cap)``. The vLLM
    plugin (``per_request=True``): :class:`PerRequestGamma` ``(cap)`` for ``"auto"``, else ``None``
    (every request drafts the cap)."""
    if per_request:
        return PerRequestGamma(num_speculative_tokens) if gamma_policy == "auto" else None
    if num_speculative_tokens == 0 or gamma_policy != "auto":
        return FixedGamma(num_speculative_tokens)
    return RowGamma(num_speculative_tokens)
