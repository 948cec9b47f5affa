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
      ``acceptance_decay`` per iteration, with a prior of ``prior_weight`` pseudo-trials at
      ``prior_acceptance`` for position 1 and at the estimate of position ``i - 1`` for
      position ``i``);
    * cost: ``g * t_draft + t_verify(g + 1) + (t_select if g > 0)``, with ``t_draft`` (one draft
      step) and ``t_select`` exponential moving averages (weight ``cost_ema``) of the loop's own
      timings and ``t_verify(q) = c0 + c1 * q`` a least-squares fit of the verification passes
      seen (weights forgotten by ``verify_decay`` per pass). ``g = 0`` is a plain step through the
      same verification kernel: its cost is ``t_verify(1)``.

    Warm-up: the first iteration drafts ``first_gamma`` tokens and the second none, so that both
    a speculative and a plain iteration have been timed. After ``probe_interval`` plain
    iterations in a row it runs one probing iteration with the best ``g >= 1`` (acceptance and
    draft costs keep being learned, e.g. as the context grows); a probe that does not switch
    speculation back on doubles the interval, up to ``max_probe_interval``.

    Lossless whatever it picks: the choice depends on past timings and acceptances only.
    Sources: the policy's cost model follows SpecDec-style analyses (Leviathan et al., ICML 2023,
    expected tokens ``(1 - a^(g+1)) / (1 - a)`` for a constant ``a``) with per-position rates.
    """

    def __init__(self, max_gamma: int, prior_acceptance: float = 0.8, prior_weight: float = 2.0,
                 acceptance_decay: float = 0.9, verify_decay: float = 0.95, cost_ema: float = 0.3,
                 first_gamma: int = 3, probe_interval: int = 4, max_probe_interval: int = 32):
        super().__init__(max_gamma)
        if self.max_gamma < 1:
            raise ValueError(f"max_speculative_tokens must be >= 1 with num_speculative_tokens='auto', got {max_gamma}")
        self.prior_acceptance, self.prior_weight = float(prior_acceptance), float(prior_weight)
        self.acceptance_decay, self.verify_decay, self.cost_ema = acceptance_decay, verify_decay, cost_ema
        self.first_gamma = max(1, min(int(first_gamma), self.max_gamma))
        self.min_probe_interval = self.probe_interval = int(probe_interval)
        self.max_probe_interval = int(max_probe_interval)
        self.tries = [0.0] * self.max_gamma
        self.successes = [0.0] * self.max_gamma
        self.t_draft: Optional[float] = None
        self.t_select: Optional[float] = None
        self._verify_obs: List[List[float]] = []  # [q, seconds, weight]
        self.num_probes = 0
        self._plain_run = 0

    # ------------------------------------------------------------------ estimates
    def acceptance(self) -> List[float]:
        """``[max_gamma]`` current estimates ``a_i`` (conditional acceptance at draft position i)."""
        out, prior = [], self.prior_acceptance
        for s, n in zip(self.successes, self.tries):
            a = (s + self.prior_weight * prior) / (n + self.prior_weight)
            out.append(a)
            prior = a
        return out

    def verify_fit(self) -> Tuple[float, float]:
        """``(c0, c1)`` seconds of ``t_verify(q) = c0 + c1 q`` (weighted least squares, both >= 0;
        ``c1 = 0`` until two different ``q`` were timed). ``(0, 0)`` before any verification."""
        obs = self._verify_obs
        if not obs:
            return 0.0, 0.0
        sw = sum(w for _, _, w in obs)
        mq = sum(q * w for q, _, w in obs) / sw
        mt = sum(t * w for _, t, w in obs) / sw
        vq = sum(w * (q - mq) ** 2 for q, _, w in obs)
        if vq <= 1e-12 * sw:
            return mt, 0.0
        c1 = sum(w * (q - mq) * (t - mt) for q, t, w in obs) / vq
        c0 = mt - c1 * mq
        if c1 < 0:
            return mt, 0.0
        if c0 < 0:
            return 0.0, sum(w * q * t for q, t, w in obs) / sum(w * q * q for q, _, w in obs)
        return c0, c1

    def cost(self, g: int) -> float:
        """Predicted seconds of an iteration with ``g`` drafts."""
        c0, c1 = self.verify_fit()
        c = c0 + c1 * (g + 1)
        if g:
            c += g * (self.t_draft or 0.0) + (self.t_select or 0.0)
        return c

    def expected_tokens(self, g: int, caps: Tensor) -> float:
        """Expected emitted tokens of the batch with ``g`` drafts (rows capped at ``caps``)."""
        acc = self.acceptance()
        cum, p = [0.0], 1.0
        for j in range(g):
            p *= acc[j]
            cum.append(cum[-1] + p)
        return float(sum(1.0 + cum[min(g, max(0, int(c)))] for c in caps.tolist()))

    # ------------------------------------------------------------------ policy
    def choose(self, caps: Tensor, limit: int) -> int:
        hi = max(0, min(self.max_gamma, int(limit)))
        it = len(self.history)
        if hi == 0:
            g = 0
        elif it == 0:
            g = min(self.first_gamma, hi)
        elif it == 1:
            g = 0
        else:
            rate = [self.expected_tokens(g, caps) / max(self.cost(g), 1e-12) for g in range(hi + 1)]
            g = max(range(hi + 1), key=lambda i: rate[i])
            if g > 0:
                self._plain_run, self.probe_interval = 0, self.min_probe_interval
            else:
                self._plain_run += 1
                if self._plain_run >= self.probe_interval:
                    g = max(range(1, hi + 1), key=lambda i: rate[i])
                    self.num_probes += 1
                    self._plain_run = 0
                    self.probe_interval = min(2 * self.probe_interval, self.max_probe_interval)
        self.history.append(g)
        return g

    def observe_iteration(self, costs: IterationCosts, drafted: Tensor, accepted: Tensor) -> None:
        g = costs.gamma
        if g or not costs.scored:  # a plain step that also scored blocks costs more than a plain step
            for o in self._verify_obs:
                o[2] *= self.verify_decay
            self._verify_obs.append([float(g + 1), float(costs.verify), 1.0])
            if len(self._verify_obs) > 256:
                self._verify_obs.pop(0)
        if not g:
            return
        ema = lambda old, new: new if old is None else (1 - self.cost_ema) * old + self.cost_ema * new  # noqa: E731
        self.t_draft = ema(self.t_draft, costs.draft / g)
        if costs.select > 0:
            self.t_select = ema(self.t_select, costs.select)
        d, a = drafted.tolist(), accepted.tolist()
        for i in range(self.max_gamma):
            self.tries[i] = self.acceptance_decay * self.tries[i] + sum(1 for dr, ac in zip(d, a) if dr > i and ac >= i)
            self.successes[i] = self.acceptance_decay * self.successes[i] + sum(1 for ac in a if ac > i)

    def stats(self) -> dict:
        c0, c1 = self.verify_fit()
        return {
            **super().stats(),
            "acceptance_estimates": [round(x, 4) for x in self.acceptance()],
            "cost_t_draft_ms": None if self.t_draft is None else 1000 * self.t_draft,
            "cost_t_select_ms": None if self.t_select is None else 1000 * self.t_select,
            "cost_t_verify_c0_ms": 1000 * c0,
            "cost_t_verify_c1_ms": 1000 * c1,
            "num_probes": self.num_probes,
        }
