"""How many tokens to draft per iteration: the ``gamma`` policy of the decode loop.

A policy is asked before every iteration for the batch's ``gamma`` (:meth:`GammaPolicy.choose`)
and is told afterwards what the iteration cost and how many drafts were accepted
(:meth:`GammaPolicy.observe_iteration`). Its choice may depend on the past only, so decoding stays
lossless whatever it picks (greedy equals plain greedy; speculative sampling keeps the target
distribution for any number of drafts fixed before they are drawn).

* ``"fixed"`` -- :class:`FixedGamma`: always ``num_speculative_tokens`` (shrunk near a row's end);
* ``"auto"`` -- :class:`AutoGamma`: before every iteration the ``g`` in ``0..max_speculative_tokens``
  with the most expected emitted tokens per second, from acceptance rates and step costs the loop
  measures as it decodes (``g = 0``: a plain step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Type

from torch import Tensor

__all__ = ["GammaPolicy", "FixedGamma", "AutoGamma", "IterationCosts", "GAMMA_POLICIES", "register_gamma_policy"]


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


GAMMA_POLICIES: Dict[str, Type[GammaPolicy]] = {}


def register_gamma_policy(name: str):
    """Class decorator: make a :class:`GammaPolicy` available under ``name``."""

    def deco(cls):
        cls.name = name
        GAMMA_POLICIES[name] = cls
        return cls

    return deco


@register_gamma_policy("fixed")
class FixedGamma(GammaPolicy):
    """Always ``max_gamma`` drafts, shrunk so that no row drafts what it could never emit."""

    def choose(self, caps: Tensor, limit: int) -> int:
        g = max(0, min(self.max_gamma, int(limit)))
        self.history.append(g)
        return g


@register_gamma_policy("auto")
class AutoGamma(GammaPolicy):
    """``gamma`` chosen before every iteration to maximize the expected emitted tokens per second.

    For a candidate ``g`` in ``0..min(max_gamma, limit)``:

    * expected tokens of row ``b``: ``1 + sum_{j <= min(g, caps[b])} prod_{i <= j} a_i``, with
      ``a_i`` the running estimate of the probability that draft ``i`` is accepted given that the
      drafts before it were (pooled over rows; exponentially forgotten counts, factor
      ``acceptance_decay`` per iteration). Each position's prior is ``prior_weight`` pseudo-trials
      at the rate pooled over all positions (itself behind ``prior_weight`` pseudo-trials at
      ``prior_acceptance``): positions the recent iterations did not reach take the pooled rate
      instead of staying wherever their last few trials left them (conditional acceptance
      varies little with the position: 0.86-0.95 at positions 1-4 on the embedded model), so that
      drafting short for a while does not make longer drafts look worse than they are;
    * cost: ``g * t_draft + t_verify(g + 1) + (t_select if g > 0)``, from the loop's own timings.
      Every timing is divided by the current plain-step time ``t_plain`` (a moving average, weight
      ``cost_ema``, of the plain steps' verification times; the plain step right before a
      speculative iteration is adjacent in time), so that a machine that slows down or speeds up
      between plain and speculative iterations does not bias the comparison; ``t_draft`` and
      ``t_select`` are medians of the last ``window`` such ratios, and ``t_verify(q) = c0 + c1 * q``
      a least-squares fit through the median ratio of each ``q`` among the last ``2 * window``
      speculative verification passes (``q >= 2``; each ``q`` weighted by its count, ``c0, c1 >=
      0``; only the last ``2 * window`` are kept, so that timings from an earlier regime, a
      shorter context, expire). While they all share one ``q``, the line runs through it and the
      median of the plain steps that scored the KV blocks among the last ``2 * window`` scored
      passes (``q = 1`` with the scoring overhead every speculative pass pays; the loop runs one
      before drafting after plain steps), or, without one, the unscored plain step ``(1, 1)``
      (``c0`` may be negative; the scoring overhead then sits in the slope, so drafts longer than
      the one timed look dearer than they are). Scored plain steps stay out of the fit through
      several ``q``: frequent after plain runs, they would crowd the speculative passes out of the
      window and, with a verification cost that is a step function of ``q``, tilt the line. A
      ``q >= 2`` among those passes costs its own median instead of the line: the
      kernels' cost is a step function of ``q`` (query rows fill whole vector registers: with
      SmolLM2's 3 query heads per KV head, q <= 5 fits 16 lanes, q = 6 needs 32), so a line
      through q = 3..7 overprices q = 5 and underprices q = 6. ``g = 0`` is a plain step through
      the same verification kernel without block scoring: its cost is one plain step by
      definition (the unscored plain steps set ``t_plain`` and stay out of the fit).

    A ``g > 0`` is chosen when its predicted rate beats the plain step's by more than ``margin``
    (3 %: the cost model's own error on a busy machine is of that order, and a wrong choice near
    break-even costs more than it gains), or when the decision to decode plainly would rest on
    few trials: the most promising ``g >= 1`` (by the estimates) is also drafted when its rate at
    the upper bound ``a_i + exploration * sqrt(a_i (1 - a_i) / n)`` (``n``: the pooled,
    forgotten trials behind the estimate plus ``prior_weight``) beats the plain step by the
    margin. A few early rejections at batch 1 (bad luck more often than bad drafts: ~10 % of
    64-token runs at 0.9 acceptance see 2 of their first 6 drafts rejected) then do not turn
    speculation off near break-even; where it clearly loses, the bound falls below break-even
    after a few trials. The forgetting keeps ``n`` bounded (about ``prior_weight + B g / (1 -
    acceptance_decay)``: ~37 at batch 1 drafting 1), so the bound stays ~0.05 above an estimate
    of 0.9 at batch 1 and the policy leans to speculating where the predicted gain is within the
    margin. The draft length itself is chosen with the estimates, not the bound; such a draft
    counts as speculation (it resets the probe interval), not as a probe.

    Warm-up: the first iteration drafts ``first_gamma`` tokens and the second none, so that both
    a speculative and a plain iteration have been timed. After ``probe_interval`` plain
    iterations in a row it runs one probing iteration with the best ``g >= 1`` by predicted rate
    (acceptance and draft costs keep being learned, e.g. as the context grows; the pooled
    acceptance lets a short probe inform every position), its rate computed with optimistic
    verification costs: a ``q`` not timed lately, one above a timed ``q >= 2``, is assumed to
    cost no more than that one. A line through the timed ``q`` cannot foresee a cheaper ``q``
    past a dearer one, and at batch 4 on a 2-core CPU the whole forward is not monotonic in
    ``q`` (measured at 2K context: ``q = 2 / 3 / 4 / 5`` at 1.22 / 1.33 / 1.18 / 1.24 plain
    steps, the jump from ``q = 1`` taking most of it; a line through ``q = 1, 2`` prices
    ``q = 4`` at 1.7); so probes walk up one ``q`` at a time while a longer draft would pay at
    the cost of the shorter one, and each probe times the ``q`` it tried. Where the costs do
    grow with ``q`` and drafts are mostly accepted, the probes so walk up to ``max_gamma`` one
    step per probe (each costing little more than it emits); where drafts are mostly rejected the
    longer drafts look worse and the probes stay short. A probe that does not switch speculation back on
    doubles the interval, up to ``max_probe_interval`` (32: replayed against the costs measured on
    three CPUs, 256 new tokens, the worst cell went from 0.966-0.977x plain decoding with 16 to
    0.971-0.980x, 64-token runs and the 8K cells unchanged). Where no ``g`` could pay even if every draft
    were accepted (its rate at acceptance 1, with the optimistic verification costs, below the plain
    step's by more than ``margin``: at batch 1 on a CPU, where a draft step costs most of a plain step
    because the weights, not the KV cache, dominate), a probe could teach nothing that would switch
    speculation on, so none runs until ``hopeless_probe_interval`` plain iterations in a row: the
    probes are then for the costs alone, which drift slowly (the context grows one token per
    step). Measured on one AMD EPYC (Zen 3) core, batch 1 at 2K, a draft step costs 0.87 of a plain
    step and verifying 2 tokens 1.36: the best rate at acceptance 1 is 0.89 of plain decoding, and
    each probe lost ~0.4 plain steps. The acceptance counts are forgotten slowly
    (``acceptance_decay`` 0.97 per iteration) behind a prior worth ``prior_weight`` trials, so
    that a few early rejections at batch 1 do not turn speculation off for the rest of the run.

    Climbing: speculation that settles on a short draft never retries the longer ones, so their
    estimates and costs stay wherever the first iterations left them. Measured at 4K, batch 4
    (KJV, 256 new tokens, one Intel Xeon core): a few rejections at draft position 2 in the first
    iterations held its estimate near 0.6 (its acceptance over a fixed-gamma run: 0.94), verifying
    3 tokens cost 1.45 plain steps but 4 tokens 1.30 (the line through q = 2, 3 priced q = 4 at
    1.6), and in 3 of 10 runs without climbing the loop drafted 1 token per iteration for most of
    the run (0.90-0.94 of fixed gamma 3; another 3 stayed plain but for probes, 0.88-0.94; 4
    reached 3-4 drafts, 0.96-1.03; ``bench/results/gamma_policy_choices/climb/``). With ``climb=True``,
    after ``climb_interval`` speculative iterations in a row that drafted at most ``g``
    (``probe_interval``, doubling after each check up to ``max_probe_interval``, back to
    ``probe_interval`` once the estimates choose a longer draft by themselves), the policy
    drafts the longer ``g' > g`` with the best rate at the upper-bound acceptance and the probes'
    optimistic verification costs, if that rate beats ``g``'s at the estimates. A climb counts
    as a probe (``num_probes``). It does not help the other failure above, probes from a plain
    run that keep choosing 1-2 drafts where only 3 or more pay. Off by default: at 4K, batch 4
    it ran at 1.03 / 1.05 / 1.07x plain decoding against 0.98 / 1.11 / 0.99 without (fixed gamma
    3: 1.04 / 1.15 / 1.11), but at 2K, batch 4 at 1.01 / 1.02 / 0.96 against 1.08 / 1.03 / 0.96
    (it decoded plainly in ~135 of ~175 iterations, without in 36-129), and the replay
    (independent acceptances) puts its cost at up to 1.5 % in the worst cells: no net gain shown.

    Lossless whatever it picks: the choice depends on past timings and acceptances only.
    The expected-tokens formula generalizes ``(1 - a^(g+1)) / (1 - a)`` of Leviathan et al.
    (ICML 2023) to per-position rates.
    """

    def __init__(self, max_gamma: int, prior_acceptance: float = 0.8, prior_weight: float = 4.0,
                 acceptance_decay: float = 0.97, cost_ema: float = 0.5, window: int = 5,
                 first_gamma: int = 2, probe_interval: int = 4, max_probe_interval: int = 32,
                 margin: float = 0.03, exploration: float = 1.0, hopeless_probe_interval: int = 64,
                 climb: bool = False):
        super().__init__(max_gamma)
        if self.max_gamma < 1:
            raise ValueError(f"max_speculative_tokens must be >= 1 with num_speculative_tokens='auto', got {max_gamma}")
        self.prior_acceptance, self.prior_weight = float(prior_acceptance), float(prior_weight)
        self.acceptance_decay, self.cost_ema, self.window = acceptance_decay, cost_ema, int(window)
        self.first_gamma = max(1, min(int(first_gamma), self.max_gamma))
        self.min_probe_interval = self.probe_interval = int(probe_interval)
        self.max_probe_interval = int(max_probe_interval)
        self.hopeless_probe_interval = int(hopeless_probe_interval)
        self.margin = float(margin)
        self.exploration = float(exploration)
        self.tries = [0.0] * self.max_gamma
        self.successes = [0.0] * self.max_gamma
        self.t_plain: Optional[float] = None  # seconds of a plain step (moving average)
        self._draft_ratios: List[float] = []  # draft step / t_plain, last `window`
        self._select_ratios: List[float] = []
        self._verify_obs: List[Tuple[int, float]] = []  # (q, verify(q) / t_plain), last 2 * `window` with q >= 2
        self._scored_plain: List[Tuple[int, float]] = []  # (scored pass number, ratio), scored plain steps
        self._scored_passes = 0  # verification passes that scored the KV blocks (q >= 1)
        self._pending: List[IterationCosts] = []  # timed before the first plain step
        self.num_probes = 0
        self._plain_run = 0
        self.climb = bool(climb)
        self.climb_interval = self.min_probe_interval
        self._same_run = 0  # speculative iterations in a row drafting at most `_steady` tokens
        self._steady = 0

    # ------------------------------------------------------------------ estimates
    def acceptance(self) -> List[float]:
        """``[max_gamma]`` current estimates ``a_i`` (conditional acceptance at draft position i)."""
        w = self.prior_weight
        pooled = (sum(self.successes) + w * self.prior_acceptance) / (sum(self.tries) + w)
        return [(s + w * pooled) / (n + w) for s, n in zip(self.successes, self.tries)]

    def acceptance_upper(self) -> List[float]:
        """``[max_gamma]`` optimistic estimates: ``a_i + exploration * sqrt(a_i (1 - a_i) / n)``,
        ``n`` the pooled trials behind the estimates (prior included), at most 1."""
        n = sum(self.tries) + self.prior_weight
        k = self.exploration
        return [min(1.0, a + k * math.sqrt(max(a * (1.0 - a), 0.0) / n)) for a in self.acceptance()]

    def _verify_by_q(self) -> Dict[int, List[float]]:
        """The recent speculative verification ratios (``verify(q) / t_plain``) grouped by ``q``."""
        by_q: Dict[int, List[float]] = {}
        for q, r in self._verify_obs:
            by_q.setdefault(q, []).append(r)
        return by_q

    def _verify_fit_ratio(self) -> Tuple[float, float]:
        pts = [(q, _median(v), len(v)) for q, v in self._verify_by_q().items()]
        if not pts:
            return 1.0, 0.0
        if len(pts) == 1:  # one q >= 2 timed: the line through it and a recent scored plain step, else (1, 1)
            q, t, _ = pts[0]
            recent = [r for n, r in self._scored_plain if n > self._scored_passes - 2 * self.window]
            t1 = _median(recent, 1.0)
            c1 = max(0.0, (t - t1) / (q - 1))
            return t - c1 * q, c1
        sw = sum(w for _, _, w in pts)
        mq = sum(q * w for q, _, w in pts) / sw
        mt = sum(t * w for _, t, w in pts) / sw
        vq = sum(w * (q - mq) ** 2 for q, _, w in pts)
        if vq <= 1e-12 * sw:
            return mt, 0.0
        c1 = sum(w * (q - mq) * (t - mt) for q, t, w in pts) / vq
        c0 = mt - c1 * mq
        if c1 < 0:
            return mt, 0.0
        if c0 < 0:
            return 0.0, sum(w * q * t for q, t, w in pts) / sum(w * q * q for q, _, w in pts)
        return c0, c1

    def verify_fit(self) -> Tuple[float, float]:
        """``(c0, c1)`` seconds of ``t_verify(q) = c0 + c1 q`` (speculative verification passes,
        ``q >= 2``) at the current ``t_plain``: while a single ``q`` was timed, through it and a
        recent scored plain step (else the plain step ``(1, 1)``); ``(t_plain, 0)`` before any;
        ``(0, 0)`` before any plain step."""
        c0, c1 = self._verify_fit_ratio()
        tp = self.t_plain or 0.0
        return c0 * tp, c1 * tp

    def relative_cost(self, g: int, optimistic: bool = False) -> float:
        """Predicted time of an iteration with ``g`` drafts, in plain steps (1 for ``g = 0``); its
        verification part is at least one plain step (a line fitted through noisy passes, e.g.
        ``c0`` 84 ms, ``c1`` 0 against a 93.6 ms plain step at 2K, batch 4, could price it lower).

        ``optimistic``: a ``q = g + 1`` not timed lately while ``q - 1 >= 2`` was costs at most
        that ``q - 1``'s median (what probes assume, see ``choose``)."""
        if g == 0:
            return 1.0
        q = g + 1
        by_q = self._verify_by_q()
        seen = by_q.get(q)
        if seen:  # timed lately: its own median (the cost is a step function of q, not a line)
            c = _median(seen)
        else:
            c0, c1 = self._verify_fit_ratio()
            c = c0 + c1 * q
            if optimistic and by_q.get(q - 1):
                c = min(c, _median(by_q[q - 1]))
        # a verification of q >= 2 tokens is the plain step's forward with more query rows (and
        # block scoring): never cheaper than one plain step, whatever a noisy fit or median says
        c = max(c, 1.0)
        return c + g * _median(self._draft_ratios, 0.0) + _median(self._select_ratios, 0.0)

    def cost(self, g: int) -> float:
        """Predicted seconds of an iteration with ``g`` drafts (at the current ``t_plain``)."""
        return self.relative_cost(g) * (self.t_plain or 0.0)

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
        """Predicted emitted tokens per plain-step time with ``g`` drafts:
        ``expected_tokens(g, caps, acceptance) / relative_cost(g, optimistic)``."""
        return self.expected_tokens(g, caps, acceptance) / max(self.relative_cost(g, optimistic), 1e-12)

    def hopeless(self, caps: Tensor, limit: int) -> bool:
        """Whether no ``g`` in ``1..min(max_gamma, limit)`` could beat a plain step by the margin
        even if every draft were accepted (rates with the optimistic verification costs)."""
        hi = max(0, min(self.max_gamma, int(limit)))
        perfect = [1.0] * self.max_gamma
        best = max((self.rate(g, caps, perfect, optimistic=True) for g in range(1, hi + 1)), default=0.0)
        return best * (1.0 + self.margin) < self.rate(0, caps)

    # ------------------------------------------------------------------ policy
    def choose(self, caps: Tensor, limit: int) -> int:
        hi = max(0, min(self.max_gamma, int(limit)))
        it = len(self.history)
        if hi == 0:
            g = 0
        elif it == 0:
            g = min(self.first_gamma, hi)
        elif it == 1 or self.t_plain is None:
            g = 0
        else:
            rate = [self.rate(g, caps) for g in range(hi + 1)]
            rate[0] *= 1.0 + self.margin  # speculate only on a clear predicted gain
            g = max(range(hi + 1), key=lambda i: rate[i])
            if g == 0 and self.exploration > 0:  # few trials behind the estimates: optimistic
                best = max(range(1, hi + 1), key=lambda i: rate[i])
                if self.rate(best, caps, self.acceptance_upper()) > rate[0]:
                    g = best
            if g > 0:
                self._plain_run, self.probe_interval = 0, self.min_probe_interval
                g = self._climb(g, caps, hi)
            else:
                self._plain_run += 1
                if self._plain_run >= self.probe_interval and (
                        self._plain_run >= self.hopeless_probe_interval or not self.hopeless(caps, hi)):
                    opt = [self.rate(i, caps, optimistic=True) for i in range(hi + 1)]
                    g = max(range(1, hi + 1), key=lambda i: opt[i])
                    self.num_probes += 1
                    self._plain_run = 0
                    self.probe_interval = min(2 * self.probe_interval, self.max_probe_interval)
        self.history.append(g)
        return g

    def _climb(self, g: int, caps: Tensor, hi: int) -> int:
        """``g``, or a longer draft when ``climb_interval`` speculative iterations in a row drafted
        at most ``g`` and a longer one could pay (see the class docstring)."""
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

    def _push(self, xs: List[float], x: float) -> None:
        xs.append(x)
        del xs[: -self.window]

    def _observe_costs(self, c: IterationCosts) -> None:
        if c.gamma == 0:
            if c.scored and self.t_plain is not None:  # scoring blocks costs more than a plain step
                self._scored_passes += 1
                self._scored_plain.append((self._scored_passes, c.verify / self.t_plain))
                del self._scored_plain[: -self.window]
                return
            self.t_plain = c.verify if self.t_plain is None else (1 - self.cost_ema) * self.t_plain + self.cost_ema * c.verify
            pending, self._pending = self._pending, []
            for p in pending:
                self._observe_costs(p)
        elif self.t_plain is None:
            self._pending.append(c)
            return
        tp = self.t_plain
        if c.gamma:
            self._scored_passes += 1
            self._verify_obs.append((c.gamma + 1, c.verify / tp))
            del self._verify_obs[: -2 * self.window]
            self._push(self._draft_ratios, c.draft / c.gamma / tp)
            if c.select > 0:
                self._push(self._select_ratios, c.select / tp)

    def observe_iteration(self, costs: IterationCosts, drafted: Tensor, accepted: Tensor) -> None:
        self._observe_costs(costs)
        g = costs.gamma
        if not g:
            return
        d, a = drafted.tolist(), accepted.tolist()
        for i in range(self.max_gamma):
            self.tries[i] = self.acceptance_decay * self.tries[i] + sum(1 for dr, ac in zip(d, a) if dr > i and ac >= i)
            self.successes[i] = self.acceptance_decay * self.successes[i] + sum(1 for ac in a if ac > i)

    def stats(self) -> dict:
        c0, c1 = self.verify_fit()
        tp = self.t_plain
        ms = lambda r: None if tp is None or r is None else 1000 * r * tp  # noqa: E731
        return {
            **super().stats(),
            "acceptance_estimates": [round(x, 4) for x in self.acceptance()],
            "cost_t_plain_ms": None if tp is None else 1000 * tp,
            "cost_t_draft_ms": ms(_median(self._draft_ratios, None)),
            "cost_t_select_ms": ms(_median(self._select_ratios, None)),
            "cost_t_verify_c0_ms": 1000 * c0,
            "cost_t_verify_c1_ms": 1000 * c1,
            "num_probes": self.num_probes,
        }


def _median(xs: List[float], empty=None):
    if not xs:
        return empty
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])
