"""Rival draft-KV selection algorithms, run in the same decode loop, cache and draft kernel as Vegas.

Only the choice of the draft's KV blocks differs between algorithms; drafting
(:func:`vegas_ext.ops.sparse_draft_attention` over the selected blocks plus the tail), verification
and acceptance are shared, so acceptance and cost are compared on equal terms at equal budget
(:func:`vegas_ext.decode.budget_blocks` blocks besides the tail, sinks included).

* ``"streamingllm"`` -- :class:`StreamingLLMSelection`: attention sinks + the most recent blocks
  (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453; the
  drafter of MagicDec, Chen et al., arXiv 2408.11049). No scores.
* ``"quest"`` -- :class:`QuestSelection`: per KV head, per block key min/max kept current in the
  cache; at every draft step, per layer, blocks ranked by the upper bound
  ``sum_d max(q_d max_d, q_d min_d)`` of that step's query (Tang et al., "Quest: Query-Aware
  Sparsity for Efficient Long-Context LLM Inference", arXiv 2406.10774; MagicDec-Quest).

``"vegas"`` (verification-guided, with its options ``query_weights``,
``share_selection_across_heads``, ``block_size``, ``selection_refresh_interval``) and ``"full"``
live in :mod:`vegas_ext.decode`. Importing :mod:`vegas_ext` registers these.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional

import torch
from torch import Tensor

from . import ops
from .decode import SelectionContext, SelectionStrategy, budget_blocks, register_selection_algorithm
from .hf import AttentionState

__all__ = ["StreamingLLMSelection", "QuestSelection", "streaming_indices"]


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

    def _on_write(self, layer: int, k_cache: Tensor, start: Tensor) -> None:
        t0 = time.perf_counter()
        st = self._state
        ops.block_minmax_update(self.key_min[layer], self.key_max[layer], k_cache, st.cache.seq_lens,
                                start.to(torch.int32), self.cfg.block_size)
        self._sync()
        phase = st.mode if st.mode in self.inline_select_time_s else "prefill"
        self.inline_select_time_s[phase] += time.perf_counter() - t0

    def select(self, ctx: SelectionContext) -> None:
        """Per draft round: the budget and the candidate blocks (before the tail); the blocks
        themselves are chosen per step and layer by the draft hook. Returns ``None``."""
        cfg = self.cfg
        self._k = budget_blocks(ctx.lengths, cfg)
        self._nc = _num_candidates(ctx.tail_start, cfg.block_size)
        self._max_k = max(1, int(torch.minimum(self._k, self._nc).max()))
        L, B, H = self.last_indices.shape[:3]
        self.last_indices = torch.full((L, B, H, self._max_k), -1, dtype=torch.int32, device=self._k.device)
        return None

    def _choose(self, layer: int, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        t0 = time.perf_counter()
        scores = ops.quest_block_scores(q, self.key_min[layer], self.key_max[layer], self._nc)
        idx = ops.block_topk(scores, self._k, self._nc, self._max_k, self.cfg.num_sink_blocks)
        self.last_indices[layer] = idx
        self._sync()
        self.inline_select_time_s["draft"] += time.perf_counter() - t0
        return idx
