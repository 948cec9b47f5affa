"""How many tokens to draft per iteration: the ``gamma`` policy of the decode loop.

A policy is asked before every iteration for the batch's ``gamma`` (:meth:`GammaPolicy.choose`)
and is told afterwards what the iteration cost and how many drafts were accepted
(:meth:`GammaPolicy.observe_iteration`). Its choice may depend on the past only, so decoding stays
lossless whatever it picks (greedy equals plain greedy; speculative sampling keeps the target
distribution for any number of drafts fixed before they are drawn).

* ``"fixed"`` -- :class:`FixedGamma`: always ``num_speculative_tokens`` (shrunk near a row's end).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Type

from torch import Tensor

__all__ = ["GammaPolicy", "FixedGamma", "IterationCosts", "GAMMA_POLICIES", "register_gamma_policy"]


@dataclass
class IterationCosts:
    """Measured seconds of one iteration's phases: ``draft`` (all ``gamma`` draft steps),
    ``verify`` (one verification forward of ``gamma + 1`` tokens, acceptance included) and
    ``select`` (the selection before the drafts, 0 if none ran)."""

    gamma: int
    draft: float
    verify: float
    select: float


class GammaPolicy:
    """Base class of a ``gamma`` policy.

    Attributes:
        max_gamma: the largest ``gamma`` it may return (sizes the cache and the per-position stats).
    """

    name = "base"

    def __init__(self, max_gamma: int):
        self.max_gamma = int(max_gamma)

    def choose(self, caps: Tensor, limit: int) -> int:
        """``gamma`` for the next iteration, in ``[0, min(max_gamma, limit)]``.

        Args:
            caps: ``[B]`` int64, per active row the most drafts that row could still emit
                (``max_new_tokens`` left minus 1).
            limit: the most drafts the batch may write (``max(caps)`` and the model's last position).
        """
        raise NotImplementedError

    def observe_iteration(self, costs: IterationCosts, drafted: Tensor, accepted: Tensor) -> None:
        """After an iteration: its costs and, per active row, ``drafted`` (``[B]`` drafts that
        could be emitted) and ``accepted`` (``[B]`` of them matching the target, ``<= drafted``)."""

    def stats(self) -> dict:
        """Entries added to ``generate``'s stats."""
        return {}


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
        return max(0, min(self.max_gamma, int(limit)))
