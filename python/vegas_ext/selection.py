"""Draft-KV selection strategies: every algorithm that chooses the blocks a draft attends to.

Only the choice of the draft's KV blocks differs between algorithms; drafting
(:func:`vegas_ext.ops.sparse_draft_attention` over the selected blocks plus the tail), verification
and acceptance are shared by the decode loop (:mod:`vegas_ext.decode`), so acceptance and cost are
compared on equal terms at equal budget (:func:`budget_blocks` blocks besides the tail, sinks
included).

* ``"full"`` -- :class:`FullAttention`: no drafts, plain decoding through the same cache and
  kernels (the honest baseline).
* ``"vegas"`` -- :class:`VegasSelection`: top-k blocks by the attention mass the verification
  queries put on them (Vegas, arXiv 2602.07223), options ``query_weights``,
  ``share_selection_across_heads``, ``block_size``, ``selection_refresh_interval``, ``score_decay``.
* ``"streamingllm"`` -- :class:`StreamingLLMSelection`: attention sinks + the most recent blocks
  (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453; the
  drafter of MagicDec, Chen et al., arXiv 2408.11049). No scores.
* ``"quest"`` -- :class:`QuestSelection`: per KV head, per block key min/max kept current in the
  cache; at every draft step, per layer, blocks ranked by the upper bound
  ``sum_d max(q_d max_d, q_d min_d)`` of that step's query (Tang et al., "Quest: Query-Aware
  Sparsity for Efficient Long-Context LLM Inference", arXiv 2406.10774; MagicDec-Quest).

New algorithms: subclass :class:`SelectionStrategy` and decorate with
:func:`register_selection_algorithm`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Type

import torch
from torch import Tensor

from . import config, ops
from .attention import AttentionState
from .compiled_steps import in_compiled_step

if TYPE_CHECKING:
    from .cache import VegasCache

__all__ = [
    "SelectionConfig",
    "SelectionContext",
    "SelectionStrategy",
    "SELECTION_ALGORITHMS",
    "register_selection_algorithm",
    "budget_blocks",
    "FullAttention",
    "VegasSelection",
    "StreamingLLMSelection",
    "QuestSelection",
    "streaming_indices",
]

@dataclass
class SelectionConfig:
    """Budget and selection options shared by the selection algorithms (defaults: the option
    table, :data:`vegas_ext.config.OPTIONS`; ``block_size`` the rivals' 16)."""

    ratio: float = config.OPTIONS["sparse_attn_ratio"].default
    min_tokens: int = config.OPTIONS["sparse_attn_min_tokens"].default
    max_tokens: Optional[int] = config.OPTIONS["sparse_attn_max_tokens"].default
    block_size: int = config.DEFAULT_BLOCK_SIZE["quest"]
    num_sink_blocks: int = config.OPTIONS["num_sink_blocks"].default
    num_recent_tokens: int = config.OPTIONS["num_recent_tokens"].default
    share_selection_across_heads: bool = config.OPTIONS["share_selection_across_heads"].default
    refresh_interval: int = config.OPTIONS["selection_refresh_interval"].default
    score_decay: float = config.OPTIONS["score_decay"].default


@dataclass
class SelectionContext:
    """What a strategy sees after a verification.

    Attributes:
        block_scores: ``[L, B, H_kv, N]`` float32 verification scores, the last verification's
            plus ``score_decay`` times those stored before it (``None`` if the strategy does not
            ask for them).
        lengths: ``[B]`` int32 committed context length per row (budget base).
        tail_start: ``[B]`` int32 start of the next draft tail (the last verification window).
        cache: the :class:`VegasCache`.
        previous: the indices the last round used (``None`` at the first selection), e.g. for a
            refresh stride that keeps them.
        iteration: decoding iterations done so far (0 after prefill).
    """

    block_scores: Optional[Tensor]
    lengths: Tensor
    tail_start: Tensor
    cache: VegasCache
    previous: Optional[Tensor] = None
    iteration: int = 0


def _now() -> float:
    """``time.perf_counter()``, 0 in a compiled step (see :meth:`QuestSelection._add_time`)."""
    return 0.0 if in_compiled_step() else time.perf_counter()


def budget_blocks(lengths: Tensor, cfg: SelectionConfig) -> Tensor:
    """Blocks per row for the draft: ``ceil(ceil(ratio * length) clamped to [min_tokens, max_tokens] / block_size)``
    (:func:`vegas_ext.config.budget_blocks`, the formula the vLLM plugin uses too).

    Args:
        lengths: ``[B]`` int context lengths.
        cfg: the budget options.

    Returns:
        ``[B]`` int32 block counts.
    """
    return config.budget_blocks(lengths, cfg.ratio, cfg.min_tokens, cfg.max_tokens, cfg.block_size)


class SelectionStrategy:
    """Base class of a draft-KV selection algorithm.

    Class attributes:
        name: the ``sparse_attn_algorithm`` string.
        drafts: ``False`` for plain decoding (no speculation, ``gamma`` forced to 0).
        needs_verify_scores: whether :meth:`select` reads the verification's block scores.

    A strategy returns, after every verification, the ``[L, B, H_kv, K]`` int32 block indices the
    next draft round attends to (besides the tail), or provides :meth:`draft_hook` to choose per
    layer at each draft step (query-aware algorithms such as Quest).
    """

    name = "base"
    drafts = True
    needs_verify_scores = False
    #: tokens per KV block when ``generate(block_size=None)`` (the default)
    default_block_size = 16

    def __init__(self, cfg: SelectionConfig):
        self.cfg = cfg
        # seconds of selection work done inside the model's forwards (hooks), by phase; generate()
        # moves them from time_{phase}_s to time_select_s so the overhead comparison is honest
        self.inline_select_time_s = {"prefill": 0.0, "draft": 0.0, "verify": 0.0}

    def setup(self, state: AttentionState) -> None:
        """Called once per :func:`generate` call, after the cache and the attention state exist
        (allocate per-call metadata here). Default: install :meth:`draft_hook`."""
        state.draft_hook = self.draft_hook()

    def teardown(self, state: AttentionState) -> None:
        """Called once at the end of every :func:`generate` call (also after an error): release the
        per-call metadata and the hooks, so that no reference cycle keeps the cache alive.
        Default: remove the hooks from ``state``."""
        state.write_hook = None
        state.draft_hook = None

    def select(self, ctx: SelectionContext) -> Optional[Tensor]:
        """``[L, B, H_kv, K]`` int32 block indices for the next draft round (``-1`` unused)."""
        raise NotImplementedError

    def draft_hook(self) -> Optional[Callable]:
        """Optional per-layer chooser ``(layer, q, k_cache, v_cache) -> [B, H_kv, K]`` used at every
        draft step instead of the indices from :meth:`select`."""
        return None

    def keep_rows(self, rows: Tensor) -> None:
        """The decode loop dropped finished rows from the batch: keep only the per-row metadata
        of ``rows`` (``[B']`` int64 indices into the current batch, ascending). Default: nothing
        (the strategy holds no per-row state)."""


SELECTION_ALGORITHMS: Dict[str, Type[SelectionStrategy]] = {}


def register_selection_algorithm(name: str):
    """Class decorator: make a :class:`SelectionStrategy` available as ``sparse_attn_algorithm=name``."""

    def deco(cls):
        cls.name = name
        SELECTION_ALGORITHMS[name] = cls
        return cls

    return deco


@register_selection_algorithm("full")
class FullAttention(SelectionStrategy):
    """No speculation: one verified token per iteration through the same cache and kernels
    (the honest baseline for speedups)."""

    drafts = False


@register_selection_algorithm("vegas")
class VegasSelection(SelectionStrategy):
    """Vegas (arXiv 2602.07223): top-k blocks by the attention mass the verification queries put on
    them, among the blocks before the draft tail, sink blocks first and the blocks holding the
    ``num_recent_tokens`` tokens before the tail always (a local window beside the top entries, as
    SparseSpec-L, arXiv 2607.27735; within the budget); per KV head, or one set per
    layer (scores summed over heads) with ``share_selection_across_heads``. All layers in one
    :func:`vegas_ext.ops.block_topk` call (layers stacked into the batch dimension). With
    ``refresh_interval = n > 1`` the blocks are re-selected only every ``n`` iterations and kept in
    between (SparseSpec's stride, arXiv 2512.01278 "PillarAttn"). The scores it ranks carry
    ``score_decay`` times the earlier verifications' (stored by the attention, not here), so
    more than one verification's queries rank the blocks, as SparseSpec-L ranks by its last 16
    (arXiv 2607.27735)."""

    needs_verify_scores = True
    # 1, token granularity: highest acceptance in bench/results/variants_xeon_avx512
    default_block_size = config.DEFAULT_BLOCK_SIZE["vegas"]

    def select(self, ctx: SelectionContext) -> Tensor:
        cfg = self.cfg
        n = max(1, int(cfg.refresh_interval))
        if n > 1 and ctx.previous is not None and ctx.iteration % n != 0:
            return ctx.previous
        scores = ctx.block_scores
        L, B, H, N = scores.shape
        k = budget_blocks(ctx.lengths, cfg)
        ncand = _num_candidates(ctx.tail_start, cfg.block_size)
        max_k = max(1, min(int(k.max()), N))
        s = scores.view(L * B, H, N)
        if cfg.share_selection_across_heads:
            s = s.sum(1, keepdim=True)
        recent = -(-int(cfg.num_recent_tokens) // cfg.block_size)
        idx = ops.block_topk(s, k.repeat(L), ncand.repeat(L), max_k, cfg.num_sink_blocks, recent)
        idx = idx.view(L, B, -1, max_k)
        if cfg.share_selection_across_heads:
            idx = idx.expand(L, B, H, max_k).contiguous()
        return idx



def _num_candidates(tail_start: Tensor, block_size: int) -> Tensor:
    """``[B]`` int32: blocks that hold a token before the tail, ``ceil(tail_start / block_size)``."""
    return torch.div(tail_start + (block_size - 1), block_size, rounding_mode="floor").to(torch.int32)


def streaming_indices(k: Tensor, num_candidates: Tensor, num_sink_blocks: int, max_k: int) -> Tensor:
    """StreamingLLM's block set per row: sinks, then the most recent candidate blocks.

    Args:
        k: ``[B]`` int blocks wanted per row (the budget, sinks included).
        num_candidates: ``[B]`` int, row ``b`` chooses among blocks ``[0, num_candidates[b])``.
        num_sink_blocks: leading blocks taken first (as many as fit).
        max_k: output width.

    Returns:
        ``[B, max_k]`` int32: ``c = min(k, num_candidates, max_k)`` ascending block indices --
        ``[0, s)`` with ``s = min(num_sink_blocks, c)``, then ``[num_candidates - (c - s),
        num_candidates)`` -- then ``-1``.
    """
    k = k.long()
    nc = num_candidates.long()
    c = torch.minimum(torch.minimum(k, nc), torch.full_like(k, max_k))
    s = torch.clamp(c, max=num_sink_blocks)
    r = torch.arange(max_k, device=k.device)[None, :]
    recent0 = (nc - (c - s))[:, None]
    idx = torch.where(r < s[:, None], r, recent0 + (r - s[:, None]))
    idx = torch.where(r < c[:, None], idx, torch.full_like(idx, -1))
    return idx.to(torch.int32)


@register_selection_algorithm("streamingllm")
class StreamingLLMSelection(SelectionStrategy):
    """StreamingLLM drafting (Xiao et al., arXiv 2309.17453; MagicDec's drafter, arXiv 2408.11049).

    The draft attends to ``num_sink_blocks`` leading blocks (attention sinks) and the most recent
    blocks before the tail, ``budget_blocks`` blocks in all, plus the tail. The same blocks for every
    layer and KV head; no scores are read (the verification's block scores are not even stored).
    """

    needs_verify_scores = False

    def select(self, ctx: SelectionContext) -> Tensor:
        """``[L, B, H_kv, K]`` int32 indices (sinks + most recent blocks before ``ctx.tail_start``)."""
        cfg = self.cfg
        cache = ctx.cache
        L = len(cache.layers)
        H = cache.layers[0].num_heads
        k = budget_blocks(ctx.lengths, cfg)
        nc = _num_candidates(ctx.tail_start, cfg.block_size)
        max_k = max(1, int(torch.minimum(k, nc).max()))
        idx = streaming_indices(k, nc, cfg.num_sink_blocks, max_k)  # [B, K]
        B = idx.shape[0]
        return idx.view(1, B, 1, max_k).expand(L, B, H, max_k).contiguous()


@register_selection_algorithm("quest")
class QuestSelection(SelectionStrategy):
    """Quest drafting (Tang et al., arXiv 2406.10774; MagicDec-Quest's drafter).

    Metadata: per layer, ``key_min`` / ``key_max`` ``[B, H_kv, N, D]`` (``N = ceil(S_max /
    block_size)``, the cache's dtype), allocated in :meth:`setup` and updated by
    :func:`vegas_ext.ops.block_minmax_update` after every cache write -- prefill, draft and verify
    -- from the first written position, through :attr:`AttentionState.write_hook`. A rollback is
    covered because the next write starts at the rolled-back length and recomputes its block from
    valid tokens; blocks past ``ceil(seq_lens / block_size)`` are never scored.

    Selection: at every draft step, in every layer, the step's query scores each block before the
    tail with :func:`vegas_ext.ops.quest_block_scores` (summed over the query heads of each KV head
    group), and :func:`vegas_ext.ops.block_topk` takes ``budget_blocks`` of them per KV head, sinks
    first. The cost of both hooks is timed and reported as selection time
    (``stats["time_select_inline_s"]`` is included in ``time_select_s`` and removed from the draft /
    verify / prefill times).

    Attributes (between :meth:`setup` and :meth:`teardown`, i.e. during one ``generate`` call):
    ``key_min``, ``key_max`` (lists over layers), ``last_indices`` ``[L, B, H_kv, K]`` int32 (the
    blocks each layer used at the latest draft step).
    """

    needs_verify_scores = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.key_min: List[Tensor] = []
        self.key_max: List[Tensor] = []
        self.last_indices: Optional[Tensor] = None
        self._k: Optional[Tensor] = None
        self._nc: Optional[Tensor] = None
        self._max_k = 1
        self._state: Optional[AttentionState] = None
        self._sync: Callable[[], None] = lambda: None

    def setup(self, state: AttentionState) -> None:
        """Allocate the per-layer min/max metadata and install the write and draft hooks."""
        cache = state.cache
        bs = self.cfg.block_size
        kl = cache.layers[0].keys
        B, H, S, D = kl.shape
        N = -(-S // bs)
        self.key_min = [torch.zeros((B, H, N, D), dtype=kl.dtype, device=kl.device) for _ in cache.layers]
        self.key_max = [torch.zeros((B, H, N, D), dtype=kl.dtype, device=kl.device) for _ in cache.layers]
        self.last_indices = torch.full((len(cache.layers), B, H, 1), -1, dtype=torch.int32, device=kl.device)
        self._state = state
        if kl.device.type == "cuda":
            self._sync = torch.cuda.synchronize
        state.write_hook = self._on_write
        state.draft_hook = self._choose

    def teardown(self, state: AttentionState) -> None:
        """Drop the hooks, the state and the per-call metadata (no cycle keeps the cache alive)."""
        super().teardown(state)
        self._state = None
        self.key_min, self.key_max, self.last_indices = [], [], None

    def keep_rows(self, rows: Tensor) -> None:
        """Keep the key min/max, the budget and the last indices of ``rows`` only."""
        self.key_min = [t[rows] for t in self.key_min]
        self.key_max = [t[rows] for t in self.key_max]
        if self.last_indices is not None:
            self.last_indices = self.last_indices[:, rows]
        if self._k is not None:
            self._k, self._nc = self._k[rows], self._nc[rows]

    def _on_write(self, layer: int, k_cache: Tensor, start: Tensor) -> None:
        t0 = _now()
        st = self._state
        ops.block_minmax_update(self.key_min[layer], self.key_max[layer], k_cache, st.cache.seq_lens,
                                start.to(torch.int32), self.cfg.block_size)
        self._add_time(st.mode if st.mode in self.inline_select_time_s else "prefill", t0)

    def select(self, ctx: SelectionContext) -> None:
        """Per draft round: the budget and the candidate blocks (before the tail); the blocks
        themselves are chosen per step and layer by the draft hook. Returns ``None``."""
        cfg = self.cfg
        self._k = budget_blocks(ctx.lengths, cfg)
        self._nc = _num_candidates(ctx.tail_start, cfg.block_size)
        # a power of two (unused slots are -1): a compiled draft step, whose trace takes max_k as a
        # constant, recompiles a few times per context length rather than at every budget
        self._max_k = 1 << (max(1, int(torch.minimum(self._k, self._nc).max())) - 1).bit_length()
        L, B, H = self.last_indices.shape[:3]
        self.last_indices = torch.full((L, B, H, self._max_k), -1, dtype=torch.int32, device=self._k.device)
        return None

    def _add_time(self, phase: str, t0: float) -> None:
        """Adds the seconds since ``t0`` (device synced) to ``phase``'s inline selection time; not
        in a compiled step, which is timed whole (neither the clock nor a sync can be traced, and
        a float read in the trace would become a guard that fails at the next call)."""
        if in_compiled_step():
            return
        self._sync()
        self.inline_select_time_s[phase] += time.perf_counter() - t0

    def _choose(self, layer: int, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        t0 = _now()
        scores = ops.quest_block_scores(q, self.key_min[layer], self.key_max[layer], self._nc)
        idx = ops.block_topk(scores, self._k, self._nc, self._max_k, self.cfg.num_sink_blocks)
        self.last_indices[layer] = idx
        self._add_time("draft", t0)
        return idx
