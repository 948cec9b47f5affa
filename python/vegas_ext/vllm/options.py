"""Vegas options for the vLLM plugin: names, defaults, validation (imports neither torch nor vLLM)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Mapping

#: Dotted path of the proposer class that vLLM's ``custom_class`` method builds.
PROPOSER_PATH = "vegas_ext.vllm.proposer.VegasProposer"
#: Key of the Vegas options inside ``VllmConfig.additional_config``.
ADDITIONAL_CONFIG_KEY = "vegas"
#: Keys of ``speculative_config`` that the plugin moves into ``additional_config``.
OPTION_KEYS = ("sparse_attn_algorithm", "sparse_attn_ratio", "sparse_attn_min_tokens", "sparse_attn_max_tokens",
               "num_sink_pages", "gamma_policy")
ALGORITHMS = ("vegas", "streamingllm")
#: ``gamma_policy`` values: every request drafts ``num_speculative_tokens`` / each its own number.
GAMMA_POLICIES = ("fixed", "auto")
#: ``hf_config.model_type`` values whose vLLM models the plugin drafts with (plain decoder-only
#: attention through one KV cache group, no sliding window).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclasses.dataclass(frozen=True)
class VegasOptions:
    """Validated Vegas options.

    Attributes:
        sparse_attn_algorithm: ``"vegas"`` (pages ranked by the verification's attention mass, per
            layer) or ``"streamingllm"`` (sink pages + the most recent pages before the tail).
        sparse_attn_ratio: budget as a fraction of the context, in ``(0, 1]``.
        sparse_attn_min_tokens: the budget's lower bound in tokens (``>= 0``).
        sparse_attn_max_tokens: optional upper bound in tokens (``None``: none).
        num_sink_pages: leading pages always in the budget (attention sinks), ``>= 0``.
        gamma_policy: ``"fixed"`` (every request drafts ``num_speculative_tokens``) or ``"auto"``
            (each request drafts its own ``0..num_speculative_tokens`` per step, from its acceptance
            and the measured step costs: :class:`vegas_ext.speculation.PerRequestGamma`).

    The budget in pages is ``ceil(clamp(ceil(ratio * context), min_tokens, max_tokens) / page_size)``,
    sinks included; the tail (the last verification window and this round's drafts) comes on top.
    """

    sparse_attn_algorithm: str = "vegas"
    sparse_attn_ratio: float = 0.05
    sparse_attn_min_tokens: int = 256
    sparse_attn_max_tokens: Any = None
    num_sink_pages: int = 1
    gamma_policy: str = "auto"

    def __post_init__(self):
        a = self.sparse_attn_algorithm
        if a not in ALGORITHMS:
            raise ValueError(f"vegas_ext.vllm: sparse_attn_algorithm must be one of {ALGORITHMS}, got {a!r}")
        if self.gamma_policy not in GAMMA_POLICIES:
            raise ValueError(f"vegas_ext.vllm: gamma_policy must be one of {GAMMA_POLICIES}, got {self.gamma_policy!r}")
        r = self.sparse_attn_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not (0 < r <= 1):
            raise ValueError(f"vegas_ext.vllm: sparse_attn_ratio must be a number in (0, 1], got {r!r}")
        for name in ("sparse_attn_min_tokens", "num_sink_pages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"vegas_ext.vllm: {name} must be an integer >= 0, got {v!r}")
        m = self.sparse_attn_max_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < max(1, self.sparse_attn_min_tokens)):
            raise ValueError(
                f"vegas_ext.vllm: sparse_attn_max_tokens must be None or an integer >= max(1, sparse_attn_min_tokens) "
                f"= {max(1, self.sparse_attn_min_tokens)}, got {m!r}")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "VegasOptions":
        """Build from a dict; unknown keys raise ``ValueError`` naming them and the known ones."""
        unknown = sorted(set(d) - set(OPTION_KEYS))
        if unknown:
            raise ValueError(f"vegas_ext.vllm: unknown option(s) {unknown}; expected some of {list(OPTION_KEYS)}")
        return cls(**dict(d))

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def budget_pages(self, context_len: int, page_size: int) -> int:
        """Pages in the draft's budget (sinks included) for a context of ``context_len`` tokens."""
        tok = max(math.ceil(context_len * self.sparse_attn_ratio), self.sparse_attn_min_tokens)
        if self.sparse_attn_max_tokens is not None:
            tok = min(tok, self.sparse_attn_max_tokens)
        return -(-tok // page_size)
