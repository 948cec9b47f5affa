"""Vegas options for the vLLM plugin: names, defaults, validation (imports neither torch nor vLLM)."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping

from .. import config

#: Dotted path of the proposer class that vLLM's ``custom_class`` method builds.
PROPOSER_PATH = "vegas_ext.vllm.proposer.VegasProposer"
#: Key of the Vegas options inside ``VllmConfig.additional_config``.
ADDITIONAL_CONFIG_KEY = "vegas"
#: Keys of ``speculative_config`` that the plugin moves into ``additional_config``.
OPTION_KEYS = ("sparse_attn_algorithm", "sparse_attn_ratio", "sparse_attn_min_tokens", "sparse_attn_max_tokens",
               "num_sink_pages", "gamma_policy", "draft_granularity", "draft_weights")
ALGORITHMS = config.VLLM_ALGORITHMS
#: ``gamma_policy`` values: each request drafts its own number (``"auto"``) / ``num_speculative_tokens``.
GAMMA_POLICIES = config.GAMMA_POLICIES
#: ``draft_granularity`` values: drafts attend to whole selected pages (one selection per layer,
#: through a compacted block table) or to selected tokens (block size 1, per KV head).
DRAFT_GRANULARITIES = config.DRAFT_GRANULARITIES
#: ``hf_config.model_type`` values whose vLLM models the plugin drafts with (plain decoder-only
#: attention through one KV cache group, no sliding window).
SUPPORTED_MODEL_TYPES = config.SUPPORTED_MODEL_TYPES
_PREFIX = "vegas_ext.vllm: "
#: The plugin's names in messages; ``num_sink_pages`` is the loop's ``num_sink_blocks`` (a page is
#: one of vLLM's KV cache blocks).
_LABELS = {**{k: _PREFIX + k for k in OPTION_KEYS}, "num_sink_blocks": _PREFIX + "num_sink_pages"}


def _default(name: str) -> Any:
    """The plugin's default of option ``name`` (:data:`vegas_ext.config.OPTIONS`, written once)."""
    return config.OPTIONS[name].default_at("vllm")


def is_vegas_spec(spec) -> bool:
    """Whether a ``SpeculativeConfig`` (or ``None``) selects the Vegas proposer."""
    return (spec is not None and getattr(spec, "method", None) == "custom_class"
            and getattr(spec, "model", None) == PROPOSER_PATH)


def check_num_speculative_tokens(g: Any) -> int:
    """γ for vLLM: an integer in ``[1, 2**63 - 1]`` (:func:`vegas_ext.config.check_int`)."""
    return config.check_int(g, _PREFIX + "num_speculative_tokens", 1, config.INT64_MAX)


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
        draft_granularity: ``"page"`` (drafts attend to whole selected pages, one selection per
            layer shared by its KV heads, through vLLM's kernel over a compacted block table) or
            ``"token"`` (drafts attend to selected tokens, one selection per layer and KV head,
            through :func:`vegas_ext.ops.paged_sparse_draft_attention` over the real block table;
            the verification keeps per-token scores).
        draft_weights: the precision of the weights the draft forwards' linears read on CPU:
            ``"int8"`` (one float32 scale per 64 weights), ``"fp16"`` or ``None`` (the model's own;
            :mod:`vegas_ext.vllm.draft_linears`). Verification forwards always read the model's own
            weights, so the output is unchanged; ``"int4"`` is refused (too few drafts accepted).

    The budget in pages is ``ceil(clamp(ceil(ratio * context), min_tokens, max_tokens) / page_size)``,
    sinks included; the tail (the last verification window and this round's drafts) comes on top.
    In token mode the budget is ``clamp(ceil(ratio * context), min_tokens, max_tokens)`` tokens,
    ``num_sink_pages * page_size`` sink tokens included, and the tail starts at the verification
    window's first token instead of its page.
    """

    sparse_attn_algorithm: str = _default("sparse_attn_algorithm")
    sparse_attn_ratio: float = _default("sparse_attn_ratio")
    sparse_attn_min_tokens: int = _default("sparse_attn_min_tokens")
    sparse_attn_max_tokens: Any = _default("sparse_attn_max_tokens")
    num_sink_pages: int = _default("num_sink_blocks")
    gamma_policy: str = _default("gamma_policy")
    draft_granularity: str = _default("draft_granularity")
    draft_weights: Any = _default("draft_weights")

    def __post_init__(self):
        values = {k: getattr(self, k) for k in OPTION_KEYS
                  if k not in ("gamma_policy", "draft_granularity", "draft_weights")}
        values["num_sink_blocks"] = values.pop("num_sink_pages")
        out = config.check_selection({"sparse_attn_algorithm": values.pop("sparse_attn_algorithm")}, _LABELS,
                                     algorithms=ALGORITHMS)
        out.update(config.check_budget(values, _LABELS))
        out["num_sink_pages"] = out.pop("num_sink_blocks")
        gp = self.gamma_policy
        if not isinstance(gp, str) or gp not in GAMMA_POLICIES:
            raise ValueError(f"{_PREFIX}gamma_policy must be one of {GAMMA_POLICIES}, got {gp!r}")
        out["gamma_policy"] = str(gp)
        dg = self.draft_granularity
        if not isinstance(dg, str) or dg not in DRAFT_GRANULARITIES:
            raise ValueError(f"{_PREFIX}draft_granularity must be one of {DRAFT_GRANULARITIES}, got {dg!r}")
        out["draft_granularity"] = str(dg)
        out["draft_weights"] = config.check_draft_weights(self.draft_weights, _PREFIX + "draft_weights")
        for k, v in out.items():  # normalized (a numpy integer becomes an int); frozen, hence setattr
            object.__setattr__(self, k, v)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "VegasOptions":
        """Build from a dict; unknown keys raise ``ValueError`` naming them and the known ones."""
        unknown = sorted(set(d) - set(OPTION_KEYS))
        if unknown:
            raise ValueError(f"vegas_ext.vllm: unknown option(s) {unknown}; expected some of {list(OPTION_KEYS)}")
        return cls(**dict(d))

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def budget_tokens(self, context_len: int) -> int:
        """Tokens in a token-granular draft's budget (sinks included) for ``context_len`` tokens."""
        return config.budget_blocks(context_len, self.sparse_attn_ratio, self.sparse_attn_min_tokens,
                                    self.sparse_attn_max_tokens, 1)

    def budget_pages(self, context_len: int, page_size: int) -> int:
        """Pages in the draft's budget (sinks included) for a context of ``context_len`` tokens
        (:func:`vegas_ext.config.budget_blocks` with ``page_size`` tokens per block)."""
        return config.budget_blocks(context_len, self.sparse_attn_ratio, self.sparse_attn_min_tokens,
                                    self.sparse_attn_max_tokens, page_size)
