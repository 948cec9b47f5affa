"""Counters of one :func:`vegas_ext.generate` call, with vLLM's names (``vllm.v1.spec_decode.metrics``).

:class:`DecodeStats` counts what was drafted and what of it was accepted *and emitted*: drafts that
could never be emitted (past a row's ``max_new_tokens``) are not counted as drafted, and accepted
drafts after an EOS inside an accepted run are not counted as accepted, so that
``mean_acceptance_length`` and ``draft_acceptance_rate`` describe the text the caller got.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List

import torch
from torch import Tensor

__all__ = ["DecodeStats"]


@dataclass
class DecodeStats:
    """Acceptance counters and phase timings of one decode.

    Attributes:
        num_drafts: row-iterations with at least one draft.
        num_draft_tokens: draft tokens, summed over rows (those that could be emitted).
        num_accepted_tokens: accepted draft tokens that were emitted.
        num_accepted_tokens_per_pos: per draft position ``j`` (0-based), how many row-iterations
            accepted and emitted draft ``j``; length = the largest ``gamma`` allowed.
        num_generated_tokens: new tokens, summed over rows (EOS included, padding not).
        num_iterations: draft-verify iterations after prefill.
        num_verified_tokens: tokens through the verification forwards after prefill, summed over
            rows (each row's last token plus the drafts it verified; with every row verifying the
            same count, finished rows not yet dropped included).
        time_prefill_s, time_draft_s, time_verify_s, time_select_s: seconds per phase
            (verification includes acceptance and the cache commit).
        time_compact_s: seconds spent dropping finished rows from the batch (cache copies).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: List[int] = field(default_factory=list)
    num_generated_tokens: int = 0
    num_iterations: int = 0
    num_verified_tokens: int = 0
    time_prefill_s: float = 0.0
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    time_select_s: float = 0.0
    time_compact_s: float = 0.0

    @classmethod
    def for_gamma(cls, gamma: int) -> "DecodeStats":
        """Zero counters with ``gamma`` per-position slots."""
        return cls(num_accepted_tokens_per_pos=[0] * int(gamma))

    def record(self, drafted: Tensor, accepted: Tensor) -> None:
        """Add one iteration: ``drafted`` ``[B]`` drafts per row that could be emitted (0 for rows
        that did not draft), ``accepted`` ``[B]`` of them accepted and emitted (``<= drafted``)."""
        self.num_drafts += int((drafted > 0).sum())
        self.num_draft_tokens += int(drafted.sum())
        self.num_accepted_tokens += int(accepted.sum())
        n = int(drafted.max()) if drafted.numel() else 0
        if n:
            per_pos = (accepted[:, None] > torch.arange(n, device=accepted.device)[None, :]).sum(0).tolist()
            for j, c in enumerate(per_pos):
                self.num_accepted_tokens_per_pos[j] += int(c)

    @property
    def mean_acceptance_length(self) -> float:
        """``1 + num_accepted_tokens / num_drafts`` (1.0 without drafts)."""
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)

    @property
    def draft_acceptance_rate(self) -> float:
        """``num_accepted_tokens / num_draft_tokens`` (0.0 without drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self, time_total_s: float, batch_size: int) -> dict:
        """The counters plus the derived rates: ``mean_acceptance_length``,
        ``draft_acceptance_rate``, ``time_total_s``, ``tokens_per_s`` (new tokens / total time,
        prefill included) and ``decode_tokens_per_s`` (tokens after each row's first / time after
        prefill)."""
        d = asdict(self)
        d["mean_acceptance_length"] = self.mean_acceptance_length
        d["draft_acceptance_rate"] = self.draft_acceptance_rate
        d["time_total_s"] = time_total_s
        d["tokens_per_s"] = self.num_generated_tokens / time_total_s if time_total_s > 0 else 0.0
        t_dec = time_total_s - self.time_prefill_s
        n_dec = self.num_generated_tokens - batch_size
        d["decode_tokens_per_s"] = n_dec / t_dec if t_dec > 0 and n_dec > 0 else 0.0
        return d
