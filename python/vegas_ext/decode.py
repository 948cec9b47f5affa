"""Self-speculative decoding with verification-guided sparse attention (Vegas, arXiv 2602.07223).

:func:`generate` runs :func:`prefill` once, then iterations until every row is done. One
iteration (the method: ``docs/method.md``), each phase a short function over one
:class:`DecodeState`:

1. :func:`select` -- the next draft's KV blocks (:mod:`vegas_ext.selection`; for ``"vegas"`` the
   top-k blocks by the block scores of recent verifications, sinks first), only when the
   iteration drafts;
2. :func:`draft` -- ``gamma`` tokens with the model itself, each layer attending only to the
   selected blocks plus the *tail* (every token since the start of the last verification window):
   :func:`vegas_ext.ops.sparse_draft_attention`;
3. :func:`verify` -- the last target token and the ``gamma`` drafts in one forward with full
   causal attention (:func:`vegas_ext.ops.verify_attention`), which also returns, per layer, the
   softmax mass each KV block received;
4. :func:`accept` -- greedy or speculative sampling (:mod:`vegas_ext.acceptance`);
5. :func:`emit` -- the accepted tokens and the target's own, counted
   (:class:`~vegas_ext.stats.DecodeStats`); the cache is committed and rejected drafts rolled back
   by length.

:func:`iteration` runs one with a given ``gamma``; :func:`advance` chooses ``gamma`` from a policy
(:mod:`vegas_ext.speculation`) and runs it. Selection algorithms are pluggable
(:func:`register_selection_algorithm`).
"""
from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import config, prefill_cache as prefill_cache_mod
from .acceptance import greedy_accept, make_warpers, probs, speculative_accept
from .attention import EXACT_ROPE_TYPES, AttentionState, check_model_supported, patched, rope_types
from .cache import VegasCache, model_device
from .compiled_steps import CompiledSteps, compiled_steps, eager_forward_lock, model_forward
from .draft_forward import lean_draft
from .draft_weights import cached_draft_weights
from .selection import (
    SELECTION_ALGORITHMS,
    FullAttention,
    SelectionConfig,
    SelectionContext,
    SelectionStrategy,
    VegasSelection,
    budget_blocks,
    register_selection_algorithm,
)
from .speculation import GammaPolicy, IterationCosts, make_gamma_policy
from .stats import DecodeStats

__all__ = [
    "generate",
    "GenerateOutput",
    "DecodeSettings",
    "DecodeState",
    "SelectionConfig",
    "SelectionContext",
    "SelectionStrategy",
    "VegasSelection",
    "FullAttention",
    "SELECTION_ALGORITHMS",
    "register_selection_algorithm",
    "budget_blocks",
    "speculative_accept",
    "greedy_accept",
    "make_warpers",
]


@dataclass
class GenerateOutput:
    """Result of :func:`generate`.

    Attributes:
        sequences: ``[B, T + new]`` int64: the prompt exactly as given (left padding kept) followed by
            the new tokens; rows that finished early are padded with ``pad_token_id`` (HF-style).
        stats: counters (vLLM names), timings and the configuration used; see :func:`generate`.
        cache: the :class:`~vegas_ext.cache.VegasCache` after the call (only with
            ``return_cache=True``): per row, ``lengths[b]`` = prompt + new tokens - 1 valid K/V.
    """

    sequences: Tensor
    stats: dict = field(default_factory=dict)
    cache: Optional[VegasCache] = None


# =========================================================================== decoding state
@dataclass
class DecodeSettings:
    """What one :func:`generate` call fixes and never changes (``lean_draft`` is built at the first
    draft step, where the draft weights are installed).

    Attributes:
        model, fwd_kw: the HF model and the name of its cache argument.
        strategy: the :class:`SelectionStrategy`; ``policy``: the :class:`GammaPolicy`.
        do_sample, warpers, generator: the acceptance rule's options.
        eos: ``[E]`` int64 EOS ids; ``max_pos``: the model's positions; ``sync``: device sync.
        compact: whether finished rows leave the batch.
        streamer: optional HF streamer (batch size 1).
        draft_weights: the :class:`~vegas_ext.draft_weights.DraftWeights` the draft forwards' linears
            read, or ``None`` (the model's own); ``lean_draft``: the draft steps' forward
            (:class:`~vegas_ext.draft_forward.LeanDraft`, ``False``: the model's own; ``None``: not built yet).
        logits_processor, stopping_criteria: optional HF-style ``(input_ids [n, L], scores) -> ...``
            callables applied per position as plain decoding applies them
            (:meth:`DecodeState.process`, :meth:`DecodeState.stop_positions`); ``prompt_ids``:
            ``[B0, T]`` the caller's prompts as given, the start of the ``input_ids`` they see;
            ``pad_token_id``: what follows a finished row's tokens there, and pads a row on the left.
    """

    model: object
    fwd_kw: str
    strategy: SelectionStrategy
    policy: GammaPolicy
    do_sample: bool
    warpers: object
    generator: Optional[torch.Generator]
    eos: Tensor
    max_pos: int
    sync: Callable[[], None]
    compact: bool = True
    streamer: object = None
    draft_weights: object = None
    lean_draft: object = None  # the draft forward (draft_forward.LeanDraft; False: the model's), made on first draft
    compiled: Optional[CompiledSteps] = None
    logits_processor: Optional[Callable[[Tensor, Tensor], Tensor]] = None
    stopping_criteria: Optional[Callable[[Tensor, Optional[Tensor]], Tensor]] = None
    prompt_ids: Optional[Tensor] = None
    pad_token_id: int = 0


@dataclass
class DecodeState:
    """What one :func:`generate` call carries from iteration to iteration.

    Per-row tensors are ``[B]`` over the rows of the current batch: once rows finish, they leave
    it (:func:`drop_finished_rows`) and ``rows`` maps the current rows to the caller's.

    Attributes:
        settings: the call's :class:`DecodeSettings`.
        cache: the :class:`VegasCache`; ``attn``: the :class:`AttentionState` the attention reads
            (it owns ``tail_start``, ``[B]`` int32, the start of the draft tail: the last
            verification window).
        stats: the :class:`DecodeStats` counters.
        limit_new: new tokens allowed per row; ``n_gen``: new tokens so far; ``done``: finished rows.
        last_tok: each row's last emitted token (its K/V not yet in the cache).
        new_tokens: ``[B0, max_new_tokens]`` the emitted tokens of the caller's ``B0`` rows
            (padding after a row's end); ``n_gen_all``: ``[B0]`` new tokens per caller's row.
        rows: ``[B]`` int64, the caller's row index of each current row.
        selected: whether ``attn.block_indices`` were chosen after the latest verification.
        scores_fresh: whether the latest verification stored block scores (plain steps do not).
        prefill_miss: why the prefill was not copied from ``prefill_cache`` (``None``: it was, or
            there was none).
    """

    settings: DecodeSettings
    cache: VegasCache
    attn: AttentionState
    stats: DecodeStats
    limit_new: Tensor
    new_tokens: Tensor
    n_gen: Optional[Tensor] = None
    done: Optional[Tensor] = None
    last_tok: Optional[Tensor] = None
    rows: Optional[Tensor] = None
    n_gen_all: Optional[Tensor] = None
    selected: bool = False
    scores_fresh: bool = True
    prefill_miss: Optional[str] = None

    def forward(self, ids: Tensor, pos: Tensor, keep: int) -> Tensor:
        """One model forward over ``ids`` ``[B, Q]`` at positions ``pos`` into the cache; returns
        logits ``[B, keep or Q, V]``."""
        s = self.settings
        mode = self.attn.mode
        if s.compiled is None or mode == "prefill":  # a prompt's length is one shape per call: eager
            with eager_forward_lock():
                logits = model_forward(s.model, s.fwd_kw, ids, pos, keep, self.cache, self.attn)
        else:
            logits = s.compiled.forward(s.model, s.fwd_kw, ids, pos, keep, self.cache, self.attn,
                                        s.draft_weights if mode == "draft" else None)
        self.attn.check_forward(len(self.cache.layers))  # every layer ran through our attention
        return logits

    def prefixes(self, ahead: Tensor, mask: Optional[Tensor] = None):
        """Yields ``(sel, pos, ids)`` per group of current rows (those in ``mask``, default all) with
        equal token counts ``n``: ``sel`` the rows' batch indices, ``pos`` their caller's rows, and
        ``ids`` ``[B0, T + n + A]`` int64 the caller's whole batch as plain decoding would hold it
        (the whole batch, because HF's processors may hold per-row state indexed by batch position).
        The group's rows are exact: prompt as given, emitted tokens, then ``ahead[sel]`` ``[., A]``.
        Every other row is a prefix that row really has: its first ``n + A`` tokens where it has
        emitted that many or has finished (then ``pad_token_id`` after its last token, as plain
        decoding fills a finished row), else everything it has emitted so far, right-aligned behind
        more left padding (``pad_token_id``) -- its tokens at this step do not exist yet."""
        s = self.settings
        prompt_ids, pad = s.prompt_ids, s.pad_token_id
        B0, T = prompt_ids.shape
        A, device = ahead.shape[1], prompt_ids.device
        key = self.n_gen if mask is None else torch.where(mask, self.n_gen, -1)
        have = self.n_gen_all if self.n_gen_all is not None else torch.zeros(B0, dtype=torch.long, device=device)
        finished = torch.ones(B0, dtype=torch.bool, device=device)  # rows that left the batch are finished
        finished[self.rows] = False if self.done is None else self.done
        for n in torch.unique(key).tolist():
            if n < 0:
                continue
            sel = (key == n).nonzero()[:, 0]
            pos = self.rows[sel]
            W = T + n + A
            tokens = self.new_tokens[:, : n + A]
            if tokens.shape[1] < n + A:  # drafts past the buffer: only rows shown in full reach them
                tokens = torch.cat([tokens, tokens.new_full((B0, n + A - tokens.shape[1]), pad)], 1)
            full = torch.cat([prompt_ids, tokens], 1)
            # a row that has neither emitted n + A tokens nor finished shows all it has, shifted right
            shift = torch.where(finished, 0, (n + A - have).clamp(min=0))
            src = torch.arange(W, device=device)[None, :] - shift[:, None]
            ids = torch.where(src >= 0, full.gather(1, src.clamp(min=0)), torch.full_like(full, pad))
            ids[pos, : T + n] = full[pos, : T + n]
            ids[pos, T + n:] = ahead[sel]
            yield sel, pos, ids

    def process(self, logits: Tensor, ahead: Tensor, counts: Optional[Tensor] = None) -> Tensor:
        """``logits`` ``[B, Q, V]`` of each row's next ``Q`` positions, position ``i`` following the
        row's tokens and ``ahead[:, :A - Q + 1 + i]`` (``A = ahead.shape[1]``), after
        ``logits_processor`` with each position's own prefix (float32, as HF's ``generate`` and
        assisted decoding apply processors). ``counts`` (``[B]`` int64, default all ``Q``): row
        ``b``'s first ``counts[b]`` positions only; the rest, which the caller does not read, stay
        as given (a row's drafts past its own count may run past ``max_new_tokens``, a prefix plain
        decoding never shows a processor). Returns ``logits`` itself when there is no processor."""
        processor = self.settings.logits_processor
        if processor is None:
            return logits
        Q, V = logits.shape[1], logits.shape[2]
        out = logits.to(torch.float32, copy=True)
        a0 = ahead.shape[1] - Q + 1
        for i in range(Q):
            mask = None if counts is None else counts > i
            for sel, pos, ids in self.prefixes(ahead[:, : a0 + i], mask):
                full = out.new_zeros((ids.shape[0], V))
                full[pos] = out[sel, i]
                out[sel, i] = processor(ids, full)[pos]
        return out

    def stop_positions(self, cand: Tensor, count: Tensor) -> Tensor:
        """``[B]`` int64: per row the first ``k`` in ``1..count[b]`` after whose token (``cand[b, k-1]``,
        following the row's tokens) ``stopping_criteria`` say the row is done, else 0."""
        stop = torch.zeros_like(count)
        for k in range(1, int(count.max()) + 1):
            todo = (count >= k) & (stop == 0)
            for sel, pos, ids in self.prefixes(cand[:, :k], todo):
                done = self.settings.stopping_criteria(ids, None)[pos].to(stop.device)
                stop[sel[done]] = k
        return stop

    def sample_or_argmax(self, logits: Tensor):
        """``(token [B], warped probabilities [B, V] or None)`` of ``logits`` ``[B, V]``."""
        s = self.settings
        if not s.do_sample:
            return logits.argmax(-1), None
        p = probs(logits, s.warpers)
        return torch.multinomial(p, 1, generator=s.generator)[:, 0], p


# =========================================================================== phases
#: tokens per block of the score reduction in plain steps, whose scores nobody reads (as "full")
COARSE_BLOCK_SIZE = 16


def prefill(state: DecodeState, aligned: Tensor, prompt_lens: Tensor, n0: int,
            prefill_cache: Optional[dict]) -> bool:
    """Fill the cache with each row's prompt but its last ``n0`` tokens (SDPA, or a copy from
    ``prefill_cache``), then run those ``n0`` through a verification forward and emit each row's
    first token. Returns whether the prefill was copied from ``prefill_cache``."""
    cache, st = state.cache, state.attn
    B, device = aligned.shape[0], aligned.device
    pre = prompt_lens - n0
    t_pre = int(pre.max())
    reused = False
    if t_pre > 0:
        st.mode = "prefill"
        cache.begin_forward(t_pre)
        miss = prefill_cache_mod.copy_into(prefill_cache, state.settings.model, cache, aligned[:, :t_pre],
                                           st.write_hook)
        reused = miss is None
        if not reused:
            state.prefill_miss = miss
            state.forward(aligned[:, :t_pre], torch.arange(t_pre, device=device).expand(B, t_pre), 1)
            if prefill_cache is not None:
                state.prefill_miss = prefill_cache_mod.store(prefill_cache, state.settings.model, cache,
                                                             aligned[:, :t_pre]) or state.prefill_miss
        cache.commit(pre)
    idx0 = pre[:, None] + torch.arange(n0, device=device)[None, :]
    st.mode = "verify"
    cache.begin_forward(n0)
    state.settings.sync()
    t0 = time.perf_counter()
    logits = state.forward(aligned.gather(1, idx0), idx0, 1)[:, -1]
    state.settings.sync()
    observe = getattr(state.settings.policy, "observe_prefill", None)
    if observe is not None:  # a verification of n0 tokens per row: the cost model's first point
        observe(B * n0, B, time.perf_counter() - t0)
    cache.commit(prompt_lens)
    state.rows = torch.arange(B, device=device)
    state.n_gen = torch.zeros(B, dtype=torch.long, device=device)
    first, _ = state.sample_or_argmax(state.process(logits[:, None], aligned[:, :0])[:, 0])
    cfg = state.settings
    stopped = state.n_gen if cfg.stopping_criteria is None else state.stop_positions(first[:, None], state.n_gen + 1)
    state.new_tokens[:, 0] = first
    state.n_gen = torch.ones(B, dtype=torch.long, device=device)
    state.n_gen_all = state.n_gen.clone()
    state.done = (state.n_gen >= state.limit_new) | torch.isin(first, cfg.eos) | (stopped > 0)
    state.last_tok = first
    st.tail_start = pre.to(torch.int32)
    if cfg.streamer is not None:
        cfg.streamer.put(first[:1].cpu())
    return reused


def select(state: DecodeState) -> None:
    """Choose the next draft's KV blocks from the latest verification (``strategy.select``)."""
    st = state.attn
    ctx = SelectionContext(
        block_scores=st.block_scores, lengths=state.cache.lengths, tail_start=st.tail_start,
        cache=state.cache, previous=st.block_indices, iteration=state.stats.num_iterations,
    )
    st.block_indices = state.settings.strategy.select(ctx)
    state.selected = True


def draft(state: DecodeState, g: int, num_drafts: Optional[Tensor] = None):
    """``g`` draft steps, each one token per row through the sparse draft attention; with
    ``num_drafts`` (``[B]``) step ``j`` drafts only the decoding rows with ``num_drafts > j`` where
    the lean draft forward allows it (:func:`_subset_drafts`), else every row.

    Returns ``(drafts [B, g] int64, q [B, g, V] float32 or None, steps)``: the draft tokens (a
    row's past its own ``num_drafts`` are 0), when sampling the warped distributions they were drawn
    from, and per step ``(rows drafted, seconds)``."""
    cfg = state.settings
    B = state.last_tok.shape[0]
    device = state.last_tok.device
    drafts = torch.zeros((B, g), dtype=torch.long, device=device)
    q = None
    if g and cfg.do_sample:
        q = torch.zeros((B, g, cfg.model.config.vocab_size), dtype=torch.float32, device=device)
    steps: List[Tuple[int, float]] = []
    if not g:
        return drafts, q, steps
    state.attn.mode = "draft"
    lengths = state.cache.lengths.long()
    tok = state.last_tok.clone()
    lowp = cfg.draft_weights.active() if cfg.draft_weights is not None else contextlib.nullcontext()
    forward = _draft_forward(state)
    with lowp:  # the draft's linears on the low-precision copy; verification keeps the model's own
        subsets = num_drafts is not None and _subset_drafts(state)
        want = None if num_drafts is None else torch.where(state.done, 0, num_drafts)
        for j in range(g):
            t0 = time.perf_counter()
            state.cache.begin_forward(1, offset=j)
            pos = (lengths + j).clamp(max=cfg.max_pos - 1)[:, None]
            rows = (want > j).nonzero()[:, 0] if subsets else None
            if rows is not None and rows.numel() < B:
                with eager_forward_lock():
                    lg = cfg.lean_draft(tok[rows, None], pos[rows], state.attn, rows=rows)
                t, qj = state.sample_or_argmax(lg[:, -1])
                tok[rows] = t
                drafts[rows, j] = t
                if q is not None:
                    q[rows, j] = qj
            else:
                lg = forward(tok[:, None], pos)
                counts = None if want is None else (want > j).long()  # rows past their drafts: unread
                tok, qj = state.sample_or_argmax(state.process(lg, drafts[:, :j], counts)[:, -1])
                drafts[:, j] = tok
                if q is not None:
                    q[:, j] = qj
            steps.append((B if rows is None else rows.numel(), time.perf_counter() - t0))
    return drafts, q, steps


def _subset_drafts(state: DecodeState) -> bool:
    """Whether a draft step can run on some rows only: the lean draft forward on CPU, no
    ``draft_hook`` (Quest scores every row's blocks per step) and no logits processor (it sees the
    whole batch)."""
    cfg = state.settings
    return (bool(cfg.lean_draft) and state.attn.draft_hook is None and cfg.logits_processor is None
            and cfg.compiled is None)


def _draft_forward(state: DecodeState) -> Callable[[Tensor, Tensor], Tensor]:
    """``(ids [B, 1], pos [B, 1]) -> logits [B, 1, V]`` of a draft step: the lean forward of
    :mod:`vegas_ext.draft_forward` where it reproduces the model (fewer ops per layer; drafts only,
    so the output is unchanged), else the model's own."""
    cfg = state.settings
    if cfg.lean_draft is None:  # fixed for the call, built where the draft weights are installed
        cfg.lean_draft = lean_draft(cfg.model, cfg.draft_weights) or False
    lean, st = cfg.lean_draft, state.attn
    if lean is False:
        return lambda ids, pos: state.forward(ids, pos, 1)
    if cfg.compiled is not None:
        return lambda ids, pos: cfg.compiled.lean(lean, ids, pos, st)

    def eager(ids, pos):
        with eager_forward_lock():
            return lean(ids, pos, st)

    return eager


def verify(state: DecodeState, drafts: Tensor, score: bool = True, num_drafts: Optional[Tensor] = None):
    """One full-attention forward over each row's last token and its drafts (the cache receives
    their K/V). With ``score`` the verification's block scores land in ``attn.block_scores`` for
    the next selection; without (a plain step whose scores no draft will read) the kernel reduces
    them over coarse blocks only and nothing is stored.

    ``num_drafts`` (``[B]`` int64, default all ``g``): row ``b`` verifies its first
    ``num_drafts[b]`` drafts only, and finished rows nothing. Unless every row verifies all ``g``,
    the rows' tokens are packed into one sequence (:meth:`VegasCache.begin_packed_forward`), so a
    row verifying 2 tokens does not pay for one verifying 7.

    Returns ``(logits [B, g + 1, V], tokens)``: the target logits (a row's past its own drafts are
    0, never read) and the tokens the forward took."""
    B, g = drafts.shape
    st, cache = state.attn, state.cache
    st.mode = "verify"
    ids = torch.cat([state.last_tok[:, None], drafts], 1)
    max_pos = state.settings.max_pos
    q_lens = _verified_counts(state, num_drafts)
    if q_lens is not None and (state.settings.compiled is not None or bool((q_lens == g + 1).all())):
        q_lens = None  # compiled steps: one shape per (rows, tokens), rows past their drafts are not read
    state.selected = False
    scores, block_size = st.block_scores, st.block_size
    if not score:
        st.block_scores, st.block_size = None, max(block_size, COARSE_BLOCK_SIZE)
    # earlier scores count only while every verification scored (a plain step's are not stored)
    st.score_decay = state.settings.strategy.cfg.score_decay if state.scores_fresh else 0.0
    try:
        if q_lens is None:
            cache.begin_forward(g + 1)
            ar = torch.arange(g + 1, device=drafts.device)
            pos = (cache.lengths.long()[:, None] + ar[None, :]).clamp(max=max_pos - 1)
            logits, tokens = state.forward(ids, pos, 0), B * (g + 1)
        else:
            rows, pos = cache.begin_packed_forward(q_lens)
            offs = pos - cache.lengths.long()[rows]
            counts = q_lens.tolist()
            starts = [sum(counts[:b]) for b in range(B)]
            st.packed = [(b, s0, n) for b, (s0, n) in enumerate(zip(starts, counts)) if n]
            try:
                packed = state.forward(ids[rows, offs][None], pos.clamp(max=max_pos - 1)[None], 0)[0]
            finally:
                st.packed = None
            logits = packed.new_zeros((B, g + 1, packed.shape[-1]))
            logits[rows, offs] = packed
            tokens = rows.numel()
    finally:
        st.block_scores, st.block_size = scores, block_size
    state.scores_fresh = score
    return logits, tokens


def _verified_counts(state: DecodeState, num_drafts: Optional[Tensor]) -> Optional[Tensor]:
    """``[B]`` int64: the tokens each row verifies (its last and its drafts; finished rows none), or
    ``None`` where every row verifies all drafts (``num_drafts`` None)."""
    return None if num_drafts is None else torch.where(state.done, 0, num_drafts + 1)


def accept(state: DecodeState, drafts: Tensor, q: Optional[Tensor], logits: Tensor,
           num_drafts: Optional[Tensor] = None):
    """The acceptance rule: ``(a [B] accepted drafts, t [B] the target's next token)``; row ``b``
    verifies its first ``num_drafts[b]`` drafts (default all)."""
    logits = state.process(logits, drafts, _verified_counts(state, num_drafts))
    cfg = state.settings
    if cfg.do_sample:
        return speculative_accept(drafts, q, probs(logits, cfg.warpers), cfg.generator, num_drafts)
    return greedy_accept(drafts, logits, num_drafts)


def emit(state: DecodeState, drafts: Tensor, a: Tensor, t: Tensor, num_drafts: Optional[Tensor] = None):
    """Emit each active row's accepted drafts and the target's token (up to its EOS, its stopping
    criteria and its ``max_new_tokens``), count them, and commit the cache: exact K/V for the last
    token and the emitted tokens but the last; rejected drafts are rolled back by length.

    Returns ``(drafted [B], matched [B])``: per row the drafts it verified that could be emitted
    (row ``b`` verified ``num_drafts[b]``, default all) and how many of them matched the target
    (for the ``gamma`` policy)."""
    cfg = state.settings
    B, g = drafts.shape
    active = ~state.done
    rem = state.limit_new - state.n_gen
    cand = torch.cat([drafts, drafts.new_zeros(B, 1)], 1)
    cand.scatter_(1, a[:, None], t[:, None])
    count, ended = _emitted_counts(state, cand, torch.where(active, torch.minimum(a + 1, rem), 0))
    finished = active & (ended | (count >= rem))
    rows, cols = (torch.arange(g + 1, device=drafts.device)[None, :] < count[:, None]).nonzero(as_tuple=True)
    state.new_tokens[state.rows[rows], state.n_gen[rows] + cols] = cand[rows, cols]
    # drafts that could never be emitted (past max_new_tokens) are not counted as drafted, and
    # accepted drafts after an EOS (never emitted) not as accepted
    verified = torch.full_like(rem, g) if num_drafts is None else num_drafts
    drafted = torch.where(active, torch.minimum(rem - 1, verified).clamp(min=0), torch.zeros_like(rem))
    matched = torch.minimum(a, drafted)
    state.stats.record(drafted, torch.minimum(matched, count))
    if cfg.streamer is not None and int(count[0]) > 0:
        cfg.streamer.put(cand[0, : int(count[0])].cpu())
    state.attn.tail_start = state.cache.lengths.clone()
    state.cache.commit(state.cache.lengths.long() + count)
    state.n_gen = state.n_gen + count
    state.n_gen_all[state.rows] = state.n_gen
    state.done = state.done | finished
    state.last_tok = torch.where(active, t, state.last_tok)
    return drafted, matched


def _emitted_counts(state: DecodeState, cand: Tensor, count: Tensor):
    """``(count [B], ended [B] bool)``: of the first ``count[b]`` tokens of ``cand`` ``[B, g + 1]``,
    how many a row emits (through its first EOS, or the token its stopping criteria stop at) and
    whether the row ended there."""
    ar = torch.arange(cand.shape[1], device=cand.device)
    hit = torch.isin(cand, state.settings.eos) & (ar[None, :] < count[:, None])
    ended = hit.any(1)
    count = torch.where(ended, hit.long().argmax(1) + 1, count)
    if state.settings.stopping_criteria is not None:  # a row ends after the token the criteria stop at
        stop = state.stop_positions(cand, count)
        ended = ended | (stop > 0)
        count = torch.where(stop > 0, stop, count)
    return count, ended


def advance(state: DecodeState) -> None:
    """Choose each row's drafts (the ``gamma`` policy) and run one :func:`iteration` with them. A
    plain iteration (no drafts) does not score blocks; when drafts follow one and the strategy reads
    verification scores, a plain iteration that scores them runs first."""
    cfg = state.settings
    gs = torch.where(state.done, 0, cfg.policy.choose_rows(_draft_caps(state)))  # finished rows draft nothing
    if bool((gs > 0).any()) and cfg.strategy.needs_verify_scores and not state.scores_fresh:
        cfg.policy.note_plain_step()
        kept = iteration(state, torch.zeros_like(gs), score=True)
        if bool(state.done.all()):
            return
        if kept is not None:
            gs = gs[kept]
        gs = torch.minimum(gs, _draft_caps(state).clamp(min=0))
    iteration(state, gs, score=bool((gs > 0).any()))


def _draft_caps(state: DecodeState) -> Tensor:
    """``[B]`` int64: per row the most drafts the policy may give it -- what it could still emit
    (``max_new_tokens`` left minus 1), kept inside the model's positions; ``-1`` for finished rows."""
    caps = state.limit_new - state.n_gen - 1
    room = state.settings.max_pos - 1 - state.cache.lengths.long()
    return torch.where(state.done, -1, torch.minimum(caps, room).clamp(min=0))


def iteration(state: DecodeState, num_drafts: Tensor, score: bool = True) -> Optional[Tensor]:
    """One iteration: select (if drafting) -> draft ``max(num_drafts)`` steps -> verify each row's
    own ``num_drafts[b]`` -> accept -> emit, timed per phase into ``state.stats`` and reported to
    the gamma policy; then finished rows leave the batch. Returns the kept rows' indices (``[B']``
    int64) when rows left, else ``None``."""
    cfg, stats = state.settings, state.stats
    g = int(num_drafts.max()) if num_drafts.numel() else 0
    t0 = time.perf_counter()
    t_sel = 0.0
    if g and not state.selected:
        select(state)
        cfg.sync()
        t_sel = time.perf_counter() - t0
    stats.num_iterations += 1
    t1 = time.perf_counter()
    drafts, q, steps = draft(state, g, num_drafts)
    if g:
        cfg.sync()
    t2 = time.perf_counter()
    logits, tokens = verify(state, drafts, score, num_drafts)
    drafted, matched = emit(state, drafts, *accept(state, drafts, q, logits, num_drafts), num_drafts)
    cfg.sync()
    t3 = time.perf_counter()
    stats.time_select_s += t_sel
    stats.time_draft_s += t2 - t1
    stats.time_verify_s += t3 - t2
    stats.num_verified_tokens += tokens
    subsets = bool(g) and _subset_drafts(state)  # per-step timings are host times: CPU only
    cfg.policy.observe_iteration(IterationCosts(g, t2 - t1, t3 - t2, t_sel, scored=score, tokens=tokens,
                                                rows=drafts.shape[0], draft_steps=steps if subsets else None),
                                 drafted, matched)
    # finished rows leave the batch (a copy of the cache) unless they already cost nothing: a
    # packed verification gives them no tokens and draft steps of some rows skip them
    if cfg.compact and bool(state.done.any()) and not bool(state.done.all()) and not _subset_drafts(state):
        keep = drop_finished_rows(state)
        cfg.sync()
        stats.time_compact_s += time.perf_counter() - t3
        return keep
    return None


def drop_finished_rows(state: DecodeState) -> Tensor:
    """Finished rows leave the batch: the cache rows, the attention state (block scores, indices
    and tail), the strategy's per-row metadata and the per-row progress keep the active rows only,
    so that every later forward runs on them alone."""
    keep = (~state.done).nonzero()[:, 0]
    state.cache.keep_rows(keep)
    st = state.attn
    for name in ("block_scores", "block_indices"):
        if getattr(st, name) is not None:
            setattr(st, name, getattr(st, name)[:, keep].contiguous())
    st.tail_start = st.tail_start[keep]
    state.settings.strategy.keep_rows(keep)
    state.settings.policy.keep_rows(keep)
    for name in ("limit_new", "n_gen", "done", "last_tok", "rows"):
        setattr(state, name, getattr(state, name)[keep])
    return keep


# =========================================================================== generate
def _first_last_weights(device):
    def fn(q_len: int) -> Tensor:
        w = torch.zeros(q_len, dtype=torch.float32, device=device)
        w[0] = 1.0
        w[-1] = 1.0
        return w

    return fn


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


#: generation-config options whose logits processors plain ``model.generate`` applies and this
#: loop does not (it decodes plain greedy / sampling), with their neutral values
_PROCESSOR_OPTIONS = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "sequence_bias": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "min_length": 0,
    "min_new_tokens": None,
}


def generation_config_processors(model) -> dict:
    """The options of ``model.generation_config`` that would make plain ``model.generate`` apply
    logits processors (a repetition penalty, suppressed tokens, ...), as ``{name: value}``; empty
    when it decodes plainly. :func:`generate` does not apply them (it warns);
    ``model.generate(..., custom_generate=vegas_ext.hf.generate)`` does."""
    gc = getattr(model, "generation_config", None)
    if gc is None:
        return {}
    out = {}
    for name, neutral in _PROCESSOR_OPTIONS.items():
        v = getattr(gc, name, neutral)
        if v not in (neutral, None, [], ()):
            out[name] = v
    return out


def _eos_and_pad(model, eos_token_id, pad_token_id):
    """``(eos ids, pad id)``: the given ones, else the generation config's / config's (pad: else
    the first EOS, else 0); checked by :func:`vegas_ext.config.check_token_ids` /
    :func:`~vegas_ext.config.check_int` (errors name the argument)."""
    if eos_token_id is not None:
        eos_ids = config.check_token_ids(eos_token_id, "eos_token_id")
    else:
        eos_ids = config.check_token_ids(getattr(model.generation_config, "eos_token_id", None),
                                         "model.generation_config.eos_token_id")
    name = "pad_token_id"
    if pad_token_id is None:
        name = "model.generation_config.pad_token_id"
        pad_token_id = getattr(model.generation_config, "pad_token_id", None)
        if pad_token_id is None:
            name = "model.config.pad_token_id"
            pad_token_id = getattr(model.config, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = eos_ids[0] if eos_ids else 0
    return eos_ids, config.check_int(pad_token_id, name, config.INT64_MIN, config.INT64_MAX)


def _left_aligned(input_ids: Tensor, keep: Tensor, prompt_lens: Tensor, filler: int) -> Tensor:
    """``[B, max(prompt_lens)]``: each row's prompt tokens (``keep`` ``[B, T]`` bool: where the mask
    is 1), in order, moved to the left, ``filler`` after them."""
    order = torch.argsort((~keep).to(torch.uint8), dim=1, stable=True)  # kept positions first, in order
    L = int(prompt_lens.max())
    aligned = input_ids.gather(1, order[:, :L])
    ar = torch.arange(L, device=input_ids.device)
    return torch.where(ar[None, :] < prompt_lens[:, None], aligned, torch.full_like(aligned, filler))


def _check_model(model) -> None:
    """``model`` is a Hugging Face causal LM (``*ForCausalLM``: a generation config and an output
    head) of a supported ``config.model_type``; else an error naming ``model`` (a ``TypeError``,
    also a ``ValueError``, for something that is not a ``torch.nn.Module`` at all). The checks that
    depend on the context (sliding window, RoPE) come with the prompts."""
    expect = f"a Hugging Face causal LM (*ForCausalLM) of a supported type ({', '.join(config.SUPPORTED_MODEL_TYPES)})"
    if not isinstance(model, torch.nn.Module):
        raise config.OptionTypeError(f"model must be {expect}, got {config._describe(model)} of type "
                                     f"{type(model).__name__}")
    mtype = getattr(getattr(model, "config", None), "model_type", None)
    if mtype not in config.SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model must be {expect}, got {type(model).__name__} (model_type={mtype!r})")
    head = getattr(model, "get_output_embeddings", None)
    if getattr(model, "generation_config", None) is None or not callable(head) or head() is None:
        raise ValueError(f"model must be {expect}, got {type(model).__name__}, which has no language-model head "
                         "or generation config (pass the *ForCausalLM, not its base model)")


def _left_padded_prompts(model, input_ids, attention_mask, streamer, hf_semantics: bool = False):
    """Checks the prompts; returns ``(input_ids on the model's device, keep [B, T] bool (the prompt
    tokens), prompt_lens [B], device, max_pos)``. With ``hf_semantics`` a 0 anywhere but a row's
    last column marks a token the model skips (transformers' meaning), and a prompt may be longer
    than ``max_pos`` (:func:`_hf_position_limit` decides)."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError("input_ids must be an int64 tensor [B, T]")
    B, T = input_ids.shape
    if B < 1 or T < 1:
        raise ValueError(f"input_ids must be non-empty, got shape {tuple(input_ids.shape)}")
    if streamer is not None and B != 1:
        raise ValueError("streamer supports batch size 1 only")

    device = model_device(model)  # an offloaded model's parameters are on meta: its hooks' device
    input_ids = input_ids.to(device=device, dtype=torch.long)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if not isinstance(attention_mask, Tensor):
        raise config.OptionTypeError(
            f"attention_mask must be a [B, T] tensor of 0/1 or None, got {type(attention_mask).__name__}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape "
                         f"{tuple(input_ids.shape)}")
    attention_mask = attention_mask.to(device)
    binary = (attention_mask == 0) | (attention_mask == 1)  # NaN fails both
    if not bool(binary.all()):
        bad = attention_mask[~binary][0].item()
        raise ValueError(f"attention_mask values must be 0 or 1 (1: a prompt token, 0: left padding), got {bad!r}")
    keep = attention_mask != 0
    prompt_lens = keep.long().sum(1)
    empty = (prompt_lens == 0).nonzero()[:, 0].tolist()
    if empty:
        rows = f"row {empty[0]} is" if len(empty) == 1 else f"rows {empty} are"
        raise ValueError(
            f"attention_mask {rows} all zeros: no prompt token to continue (plain decoding would predict from "
            "padding alone); every row needs at least one prompt token: drop the row, or give it a token with mask 1 "
            "(e.g. the BOS token)")
    if hf_semantics:
        right = (~keep[:, -1]).nonzero()[:, 0].tolist()
        if right:
            raise ValueError(
                f"attention_mask must be left padding: row {right[0]} ends with a 0 (right padding"
                f"{'' if len(right) == 1 else f'; rows {right}'}), so plain decoding would predict its next token "
                "from a padding token; pad on the left (tokenizer.padding_side = 'left')")
    else:
        ar_t = torch.arange(T, device=device)
        expect = ar_t[None, :] >= (T - prompt_lens)[:, None]
        if not torch.equal(expect, keep):
            raise ValueError("attention_mask must be left padding (each row's ones contiguous at the right end)")

    _check_token_range(model, input_ids, attention_mask)
    _check_model_dtype(model)
    max_pos = int(getattr(model.config, "max_position_embeddings", 1 << 30) or (1 << 30))
    Lmax = int(prompt_lens.max())
    if Lmax > max_pos and not hf_semantics:
        raise ValueError(f"prompt of {Lmax} tokens is longer than the model's max_position_embeddings ({max_pos})")
    return input_ids, keep, prompt_lens, device, max_pos


def _hf_position_limit(model, prompt_lens: Tensor, max_new_tokens: int, max_pos: int) -> int:
    """The ``max_pos`` of a call with transformers' semantics: transformers' ``generate`` does not stop
    at ``max_position_embeddings`` (RoPE extrapolates), so neither does the loop where the rotation
    of a position is the same however positions are split into forwards (``EXACT_ROPE_TYPES``);
    returns ``max_pos`` raised so that no row is capped. ``ValueError`` up front for a context past
    it with another RoPE type (``dynamic`` rescales, ``longrope`` switches factors per forward)."""
    Lmax = int(prompt_lens.max())
    last = Lmax + max_new_tokens - 1  # the position of a longest row's last new token (never fed)
    if last <= max_pos and Lmax <= max_pos:
        return max_pos
    odd = sorted(rope_types(model.config) - set(EXACT_ROPE_TYPES))
    if odd:
        remedy = (f"lower max_new_tokens to at most {max_pos - Lmax + 1}" if Lmax <= max_pos
                  else f"shorten the prompt to at most {max_pos} tokens")
        raise ValueError(
            f"max_new_tokens={max_new_tokens}: a row of {Lmax} prompt tokens would pass the model's "
            f"max_position_embeddings={max_pos}; transformers' generate goes on there, but with rope_type {odd[0]!r} "
            "it changes the rotary frequencies per forward past that point, so its tokens depend on how the sequence "
            f"is split into forwards, which speculative decoding changes; {remedy}")
    return max(last, Lmax)


def _check_token_range(model, input_ids: Tensor, attention_mask: Tensor) -> None:
    """``ValueError`` unless every prompt token (padding aside) is in ``[0, vocab size)``: the
    embedding would fail with a bare ``IndexError`` (or read out of bounds on a GPU)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None) or int(model.config.vocab_size)
    real = input_ids[attention_mask != 0]
    lo, hi = int(real.min()), int(real.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(f"input_ids must be token ids in [0, {vocab}) (the model's vocabulary), got {bad}")


def _check_model_dtype(model) -> None:
    """``ValueError`` before any forward unless the model computes in a dtype the Vegas ops take
    (:data:`vegas_ext.config.MODEL_DTYPES`; the input embedding's dtype is the hidden states')."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    w = getattr(emb, "weight", None)
    dtype = w.dtype if isinstance(w, Tensor) else next(model.parameters()).dtype
    name = str(dtype).replace("torch.", "")
    if name not in config.MODEL_DTYPES:
        raise ValueError(f"model dtype {name} is not supported: the Vegas ops compute in "
                         f"{', '.join(config.MODEL_DTYPES)} (convert with model.to(torch.float32))")


def generate(
    model,
    input_ids: Tensor,
    attention_mask: Optional[Tensor] = None,
    *,
    vegas_config: Optional[config.VegasConfig] = None,
    eos_token_id: Union[int, Sequence[int], None] = None,
    pad_token_id: Optional[int] = None,
    streamer=None,
    generator: Optional[torch.Generator] = None,
    prefill_cache: Optional[dict] = None,
    logits_processor: Optional[Callable[[Tensor, Tensor], Tensor]] = None,
    stopping_criteria: Optional[Callable[[Tensor, Optional[Tensor]], Tensor]] = None,
    hf_semantics: bool = False,
    **options,
) -> GenerateOutput:
    """Generate with Vegas self-speculative decoding (arXiv 2602.07223) on a HF causal LM.

    Lossless up to near-ties, in every dtype: greedy output is plain greedy decoding's (HF
    ``generate`` with ``do_sample=False``) token for token, except where the two best target logits
    are within rounding of each other. Verification scores gamma + 1 tokens in one forward pass
    (other matrix shapes, the extension's attention kernel), which rounds differently from plain
    decoding's one-token forwards, so at a gap of at most ``k * eps * |h| * max(|w_a|, |w_b|)``
    (``eps`` of the dtype; ``h`` the final hidden state, ``w`` the two tokens' output-layer rows;
    ``k`` = 64 in float32, 8 in bfloat16 / float16, :func:`vegas_ext.cli.near_tie_tolerance`) the
    two can pick different tokens, and the texts differ from there on. The bound is empirical, about
    3x the largest rounding difference measured (float32: 19 units on ill-conditioned random
    models, 3.15 on SmolLM2-135M; half precision: 2.9 and 0.44; docs/lossless.md). Which token wins
    a near-tie depends on the CPU and its BLAS; HF's own ``generate`` also picks differently there
    with and without its KV cache. The float32 differences seen were at gaps of 0-8 ulps of the
    logit (at most 0.53 units), on constructed near-ties. Sampled output (``do_sample=True``)
    follows the target distribution (speculative sampling). ``vegas generate --compare`` names the
    first differing token, the gap between the two tokens' target logits there (in ulps and in those
    units) and whether it is a near-tie.
    Works on batches whose rows have different prompt lengths (left padding), each row accepting
    its own number of drafts and stopping at its own EOS / ``max_new_tokens``.

    Args:
        model: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` or
            ``MistralForCausalLM`` (patched to the ``"vegas"`` attention for the call, restored
            after; see :mod:`vegas_ext.attention`).
        input_ids: ``[B, T]`` int64 prompts, left padded.
        attention_mask: ``[B, T]`` 0/1, ones contiguous at the right end of each row (left padding);
            default all ones.
        vegas_config: a :class:`~vegas_ext.config.VegasConfig` holding the options below, validated
            where it was built; ``**options`` given as well are applied on top of it.
        **options: the options of :data:`vegas_ext.config.OPTIONS` by name, each defaulting to the
            table's value (``docs/options.md``); ``max_new_tokens`` is required:

        max_new_tokens: new tokens per row (>= 0). Also capped so a row never goes past the model's
            ``max_position_embeddings`` (it then ends at the last position; HF would extrapolate, and
            so does ``hf_semantics=True``).
        num_speculative_tokens: γ's cap, an int >= 0 (default 8; 0: plain steps); the string
            ``"auto"`` means ``gamma_policy="auto"`` with the default cap.
        gamma_policy: ``"auto"`` (default): before every iteration the ``g`` in
            ``0..num_speculative_tokens`` with the most expected emitted tokens per second, from
            the acceptance rates per draft position and the draft / verify / select costs the loop
            measures as it runs (``g = 0`` is a plain step; :class:`vegas_ext.speculation.AutoGamma`);
            ``"fixed"``: every iteration drafts ``num_speculative_tokens``. Either way shrunk near
            a row's end (``max_new_tokens`` or the last position); never writes out of bounds.
        sparse_attn_algorithm: ``"vegas"`` or ``"full"`` (``gamma = 0``: plain decoding through
            the same cache and kernels), or any name added with :func:`register_selection_algorithm`.
        sparse_attn_ratio: draft KV budget as a fraction of the context, in ``(0, 1]``.
        sparse_attn_min_tokens, sparse_attn_max_tokens: clamp of the budget in tokens
            (``ceil(ratio * context)``); the budget is then rounded up to whole blocks. When it
            covers every block before the tail, drafting is exact.
        block_size: tokens per KV block for scores and selection; ``None`` (default): the
            algorithm's ``default_block_size`` -- 1 for ``"vegas"`` (token granularity, as the
            authors' code), 16 for ``"streamingllm"`` and ``"quest"`` (Quest's pages).
        num_sink_blocks: leading blocks always selected (attention sinks).
        num_recent_tokens: ``"vegas"``: the blocks holding the last this many tokens before the
            draft tail are always selected (within the budget), the top-scored fill the rest; 0:
            the top-scored alone, as the paper. Default 32 (docs/options.md).
        share_selection_across_heads: one block set per layer (scores summed over KV heads; the
            authors' choice) instead of one per KV head.
        query_weights: ``"all"`` (every verification query scores blocks) or ``"first_last"``
            (only the first and last, as in the authors' code).
        selection_refresh_interval: re-select the draft blocks only every n iterations and keep
            them in between (SparseSpec); 1 = after every verification (default). Used by ``"vegas"``.
        score_decay: in ``[0, 1]``; the block scores a selection ranks are ``score_decay`` times
            the earlier ones plus the last verification's (reset after a plain step that did not
            score), so blocks that recent verifications attended to stay selected; 0: the last
            verification's alone, as the paper. Used by ``"vegas"``; default 0.8
            (docs/options.md).
        do_sample, temperature, top_k, top_p: sampling as in HF ``generate``; the same
            transformers warpers shape both target and draft distributions.
        eos_token_id: int or list; default ``model.generation_config.eos_token_id``; ``[]``
            disables stopping at EOS.
        pad_token_id: fills rows finished early; default the generation config's, else the first
            EOS, else 0.
        streamer: a HF streamer (``put`` / ``end``); batch size 1 only.
        generator: ``torch.Generator`` for reproducible sampling: the same generator state gives
            the same tokens with a fixed ``num_speculative_tokens``; with ``"auto"`` the drafts per
            iteration follow the loop's own timings, so a rerun draws from the same distribution
            but its tokens can differ.
        return_cache: also return the KV cache (inspection, tests). Finished rows then stay in the
            batch to the end, so that the cache holds every row; otherwise a row leaves the batch
            (cache rows included) once it hit its EOS or ``max_new_tokens``, and later forwards
            run on the rows still decoding only.
        prefill_cache: optional dict shared by calls on the same prompt (benchmarks): the first call
            stores its prefill K/V there, later calls whose prefill is a prefix of it copy it
            instead of recomputing (``stats["prefill_reused"]``; their ``time_prefill_s`` is then
            the copy). Valid because a causal model's K/V at a position depend only on the tokens
            up to it; the stored K/V may differ from a recomputation by float rounding only. Only
            the model that filled it, computing the same function, reuses it: a weak reference
            plus every parameter's storage address and version, dtype and device, each module's
            plain attributes (``variance_epsilon``, ``scaling``, ...), ``config.to_dict()`` and
            the matmul precision. A model with a forward hook or pre-hook (or a global one),
            inference-tensor weights (in-place edits unseen), or an attribute that is not plain
            data (an assigned ``forward``), never reuses nor stores. ``stats["prefill_miss"]``
            says why a call did not reuse (``"empty"``, ``"other prompt"``, ``"other model"``,
            ``"model changed: modules"``, ``"not fingerprintable: a forward hook on
            model.model.layers.0"``, ...). Writes through ``param.data`` bypass the version
            counter: pass a new dict after editing weights that way. :mod:`vegas_ext.prefill_cache`.
        draft_weights: ``"int8"`` (default; groups of 64, weight-only), ``"fp16"`` or ``None``
            (drafts use the model's weights): the draft forwards' linears read a low-precision
            copy of the weights, made once and cached beside the model (remade when a weight
            changes in place or is replaced; ``vegas_ext.release(model)`` drops it); verification
            keeps the model's weights, so the output is unchanged (greedy: token for token;
            sampling: the target distribution). ``"int4"`` is refused (too inaccurate on the
            models measured). CUDA: a float16 copy of a float32 model, none of a 16-bit one.
            ``stats["draft_weights_bytes"]``: the copy's memory. :mod:`vegas_ext.draft_weights`.
        logits_processor: optional HF-style ``(input_ids [n, L] int64, scores [n, V] float32) ->
            scores`` (e.g. a ``transformers.LogitsProcessorList``) applied, as plain decoding
            applies it, to the target logits of every verified position and to every draft
            step, each with that position's own ``input_ids``: the row's prompt exactly as given
            (left padding kept), its emitted tokens, then the drafts before the position. Greedy
            takes the argmax of the processed scores; sampling draws from the softmax of the
            processed scores (then ``temperature`` / ``top_k`` / ``top_p``) for both the draft and
            the target distributions, so the output follows the processed target. It is called
            with the caller's whole batch, each row a prefix that row really has (rows the loop
            has not brought to that length yet show what they have so far behind more left
            padding; finished rows are followed by ``pad_token_id``, as plain decoding fills
            them): a row's result must depend on that row only (its batch index may matter), and
            on the inputs only (no state carried from call to call). ``None`` (default): no
            per-position work.
        stopping_criteria: optional HF-style ``(input_ids [n, L], scores=None) -> bool [n]`` (e.g.
            a ``transformers.StoppingCriteriaList``: stop strings, max time) checked after each
            emitted token with the row's ``input_ids`` as above; a row ends after the first token
            at which it says done (the token is kept), like plain decoding. Same contract as above.
        hf_semantics: read the inputs as transformers' ``generate`` does (set by
            :func:`vegas_ext.hf.generate`): a 0 in ``attention_mask`` anywhere but a row's last
            token marks a token the model skips (it takes no position), and rows go on past
            ``max_position_embeddings`` where the RoPE gives every position the same rotation
            however the sequence is split into forwards (``ValueError`` up front for
            ``rope_type`` ``dynamic`` / ``longrope`` there) instead of being capped.

    Returns:
        :class:`GenerateOutput` with ``sequences`` ``[B, T + n]`` (``n`` = most new tokens of any
        row) and ``stats``: ``num_drafts`` (row-iterations with drafts), ``num_draft_tokens``,
        ``num_accepted_tokens``, ``num_accepted_tokens_per_pos`` (list of length ``max(gamma)``),
        ``mean_acceptance_length`` (= 1 + accepted / drafts), ``draft_acceptance_rate`` (= accepted
        / draft tokens), ``gamma_policy`` (``"fixed"`` / ``"auto"``), ``gamma_per_iteration``,
        ``gamma_histogram`` (iterations per ``gamma``), with ``"auto"`` also
        ``acceptance_estimates`` (per draft position), ``cost_t_draft_ms``, ``cost_t_select_ms``,
        ``cost_t_verify_c0_ms`` / ``cost_t_verify_c1_ms`` (the fitted ``t_verify(q) = c0 + c1 q``)
        and ``num_probes``; ``num_generated_tokens``, ``num_iterations``, ``tokens_per_s`` (new tokens
        / total time, prefill included), ``decode_tokens_per_s`` (after the first token),
        ``time_total_s``, ``time_prefill_s``, ``time_draft_s``, ``time_verify_s`` (acceptance
        included), ``time_select_s``, and the configuration. Drafts that could never be emitted
        (past a row's ``max_new_tokens``) are not counted as drafted; accepted drafts after an EOS
        inside an accepted run (not emitted) are not counted as accepted.

    Raises:
        ValueError: unsupported model or sliding window smaller than the context (names
            ``config.sliding_window``), unknown algorithm or ``query_weights``, right padding or an
            empty prompt, a prompt longer than the model's positions, prompt tokens outside the
            vocabulary, a model dtype the ops do not take (float64), and out-of-range options
            (``gamma < 0``, ratio outside ``(0, 1]``, ``block_size < 1``, NaN, past int64, ...).
        TypeError: an option of the wrong type (``config.OptionTypeError``, also a ``ValueError``):
            types are checked, not coerced; see :mod:`vegas_ext.config` and ``docs/options.md``.

    Defaults, and the measurements behind them: ``docs/options.md``.
    """
    _check_model(model)
    cfg = _vegas_config(vegas_config, options)
    opts = cfg.to_dict()
    prefill_cache_mod.check_prefill_cache(prefill_cache)
    eos_ids, pad_token_id = _eos_and_pad(model, eos_token_id, pad_token_id)
    _check_call_args(model, logits_processor, stopping_criteria)
    hf_semantics = config.check_bool(hf_semantics, "hf_semantics")
    input_ids, keep, prompt_lens, device, max_pos = _left_padded_prompts(model, input_ids, attention_mask, streamer,
                                                                         hf_semantics)
    if hf_semantics:
        max_pos = _hf_position_limit(model, prompt_lens, opts["max_new_tokens"], max_pos)
    plan = _plan(model, opts, prompt_lens, max_pos)
    config_used = _config_used(opts, plan, prompt_lens, next(model.parameters()).dtype, device)
    if opts["max_new_tokens"] == 0:  # no forward, but the same model checks as a decoding call
        check_model_supported(model, plan.max_context)
        stats = DecodeStats.for_gamma(plan.policy.max_gamma).as_dict(0.0, 0)
        return GenerateOutput(sequences=input_ids.clone(), stats={**stats, **config_used})
    if streamer is not None:
        streamer.put(input_ids.cpu())
    settings = DecodeSettings(
        model=model, fwd_kw=_cache_kwarg(model), strategy=plan.strategy, policy=plan.policy,
        do_sample=opts["do_sample"], generator=generator,
        warpers=make_warpers(opts["temperature"], opts["top_k"], opts["top_p"]) if opts["do_sample"] else None,
        eos=torch.tensor(eos_ids, dtype=torch.long, device=device), max_pos=max_pos,
        sync=torch.cuda.synchronize if device.type == "cuda" else (lambda: None),
        compact=not (cfg.return_cache or cfg.compile_steps),
        streamer=streamer, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
        prompt_ids=input_ids, pad_token_id=pad_token_id,
        # made (or refreshed) outside inference mode, so the cached copies are ordinary tensors
        draft_weights=_draft_copies(model, cfg.draft_weights) if plan.strategy.drafts and cfg.draft_weights else None,
        compiled=compiled_steps(device) if cfg.compile_steps else None,
    )
    filler = pad_token_id if 0 <= pad_token_id < int(model.config.vocab_size) else 0
    aligned = _left_aligned(input_ids, keep, prompt_lens, filler)
    dw = settings.draft_weights
    with torch.inference_mode(), patched(model, max_context=plan.max_context), \
            (dw.installed() if dw is not None else contextlib.nullcontext()):
        t_start = time.perf_counter()
        state = _new_state(settings, plan, pad_token_id)
        with state.attn.activate(), _torn_down(plan.strategy, state.attn):
            plan.strategy.setup(state.attn)  # inside: teardown runs however the call ends
            reused = prefill(state, aligned, prompt_lens, min(plan.policy.max_gamma + 1, int(prompt_lens.min())),
                             prefill_cache)
            settings.sync()
            state.stats.time_prefill_s = time.perf_counter() - t_start
            inline_pre = dict(getattr(plan.strategy, "inline_select_time_s", None) or {})
            while not bool(state.done.all()):
                advance(state)
            settings.sync()
            t_total = time.perf_counter() - t_start
    if streamer is not None:
        streamer.end()
    stats = _collect_stats(state, config_used, t_total, inline_pre, reused=reused, prefill_cache=prefill_cache)
    sequences = torch.cat([input_ids, state.new_tokens[:, : int(state.n_gen_all.max())]], 1)
    return GenerateOutput(sequences=sequences, stats=stats, cache=state.cache if cfg.return_cache else None)


def _draft_copies(model, draft_weights):
    """The model's :class:`~vegas_ext.draft_weights.DraftWeights` for ``draft_weights``, or ``None``
    where it holds no copy (every linear offloaded to the meta device: the drafts read the model's own)."""
    dw = cached_draft_weights(model, draft_weights)  # the kind was checked with the options
    return dw if dw.num_linears else None


def _vegas_config(given: Optional[config.VegasConfig], options: dict) -> config.VegasConfig:
    """The one validated options value of a :func:`generate` call: ``given`` (built at another door)
    with ``options`` on top, validated here once (:meth:`~vegas_ext.config.VegasConfig.build`)."""
    if given is not None and not isinstance(given, config.VegasConfig):
        raise config.OptionTypeError(f"vegas_config must be a vegas_ext.config.VegasConfig or None, got "
                                     f"{type(given).__name__}")
    cfg = given
    if options or given is None:
        cfg = config.VegasConfig.build(options, algorithms=SELECTION_ALGORITHMS, base=given)
    if cfg.max_new_tokens is None:
        raise config.OptionTypeError("generate() needs max_new_tokens (an int >= 0, the new tokens per row)")
    return cfg


def _check_call_args(model, logits_processor, stopping_criteria) -> None:
    """The arguments of :func:`generate` that are not options of :mod:`vegas_ext.config`; warns when
    the model's generation config asks for processors this call will not apply."""
    for name, fn in (("logits_processor", logits_processor), ("stopping_criteria", stopping_criteria)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be callable (input_ids, scores) or None, got {type(fn).__name__}")
    unapplied = generation_config_processors(model) if logits_processor is None else {}
    if unapplied:
        warnings.warn(
            f"vegas generate: model.generation_config sets {unapplied}, which plain "
            "model.generate applies as logits processors; vegas_ext.generate decodes without them (plain greedy "
            "/ sampling). Use model.generate(..., custom_generate=vegas_ext.hf.generate) to apply them.",
            stacklevel=3)


@dataclass
class _Plan:
    """The sizes and objects of one :func:`generate` call, fixed before its first forward.

    Attributes:
        prompt_lens: ``[B]`` int64; ``limit_new``: ``[B]`` new tokens each row may emit
            (``max_new_tokens``, capped at the model's last position); ``n_cap``: their maximum.
        block_size: tokens per KV block (the algorithm's default if not given; clamped to one
            block covering the whole cache).
        strategy, policy: the :class:`SelectionStrategy` and the :class:`GammaPolicy`.
        cache_len: positions the cache holds per row; ``max_context``: the longest context.
        query_weights: ``"all"`` or ``"first_last"`` (which verification queries score blocks).
    """

    prompt_lens: Tensor
    limit_new: Tensor
    n_cap: int
    block_size: int
    strategy: SelectionStrategy
    policy: GammaPolicy
    cache_len: int
    max_context: int
    query_weights: str


def _plan(model, opts: dict, prompt_lens: Tensor, max_pos: int) -> _Plan:
    """Sizes the call (new tokens per row, block size, cache length) and builds its selection
    strategy and gamma policy from the checked options ``opts``."""
    max_new = opts["max_new_tokens"]
    limit_new = _new_token_limits(model, prompt_lens, max_new, max_pos)
    n_cap = int(limit_new.max())  # most new tokens any row can emit: buffers are sized by it
    Lmax = int(prompt_lens.max())
    block_size = opts["block_size"]
    if block_size is None:
        block_size = SELECTION_ALGORITHMS[opts["sparse_attn_algorithm"]].default_block_size
    # a block covering the whole cache (at most min(Lmax + n_cap, max_pos) + n_cap positions) is
    # one block: clamp there, so huge values give the same result without overflowing int32 math
    block_size = min(int(block_size), min(Lmax + n_cap, max_pos) + n_cap + 1)
    strategy = SELECTION_ALGORITHMS[opts["sparse_attn_algorithm"]](SelectionConfig(
        ratio=float(opts["sparse_attn_ratio"]), min_tokens=int(opts["sparse_attn_min_tokens"]),
        max_tokens=opts["sparse_attn_max_tokens"], block_size=block_size,
        num_sink_blocks=int(opts["num_sink_blocks"]), num_recent_tokens=int(opts["num_recent_tokens"]),
        share_selection_across_heads=bool(opts["share_selection_across_heads"]),
        refresh_interval=int(opts["selection_refresh_interval"]),
        score_decay=float(opts["score_decay"]),
    ))
    cap = opts["num_speculative_tokens"] if strategy.drafts else 0
    if opts["gamma_policy"] == "auto":  # auto's work grows with its range: no wider than useful
        cap = min(cap, max(1, max_new - 1))
    policy = make_gamma_policy(min(cap, max_pos), opts["gamma_policy"])
    # no iteration drafts more than a row can still emit, so the cache needs at most n_cap - 1
    # draft slots whatever gamma was asked for
    cache_len = min(Lmax + n_cap, max_pos) + min(policy.max_gamma, max(n_cap - 1, 0)) + 1
    return _Plan(prompt_lens=prompt_lens, limit_new=limit_new, n_cap=n_cap, block_size=block_size,
                 strategy=strategy, policy=policy, cache_len=cache_len, max_context=min(Lmax + n_cap, max_pos),
                 query_weights=opts["query_weights"])


def _new_token_limits(model, prompt_lens: Tensor, max_new_tokens: int, max_pos: int) -> Tensor:
    """``[B]`` new tokens per row: ``max_new_tokens``, capped so no row passes the model's last
    position (with a warning); a ``ValueError`` where ``rope_type='dynamic'`` makes a cap lossy."""
    limit_new = torch.clamp(max_pos - prompt_lens + 1, max=max_new_tokens)
    if bool((limit_new < max_new_tokens).any()):
        if "dynamic" in rope_types(model.config) and int(limit_new.min()) < int(limit_new.max()):
            # plain decoding would go past max_position_embeddings with one row while others still
            # decode, and rescale the rotary frequencies of the whole batch from there
            raise ValueError(
                f"max_new_tokens={max_new_tokens}: with rope_type='dynamic' no row may pass "
                f"max_position_embeddings={max_pos} (plain decoding would rescale the rotary frequencies of the "
                "whole batch there, which a capped row cannot reproduce); lower max_new_tokens to at most "
                f"{int((max_pos - prompt_lens + 1).min())}")
        warnings.warn(
            f"vegas generate: max_new_tokens={max_new_tokens} capped so no row goes past "
            f"max_position_embeddings={max_pos}",
            stacklevel=4,
        )
    return limit_new


def _config_used(opts: dict, plan: _Plan, prompt_lens: Tensor, dtype, device) -> dict:
    """The configuration a call ran with, as reported in its ``stats``."""
    keys = ("sparse_attn_algorithm", "sparse_attn_max_tokens", "query_weights")
    out = {k: opts[k] for k in keys}
    out.update({k: float(opts[k]) for k in ("sparse_attn_ratio", "score_decay", "temperature", "top_p")})
    out.update({k: int(opts[k]) for k in ("sparse_attn_min_tokens", "num_sink_blocks", "num_recent_tokens",
                                          "selection_refresh_interval",
                                          "top_k", "max_new_tokens")})
    out.update({k: bool(opts[k]) for k in ("share_selection_across_heads", "do_sample")})
    gamma = plan.policy.max_gamma
    out.update({
        "num_speculative_tokens": gamma, "block_size": int(plan.block_size), "batch_size": len(prompt_lens),
        "prompt_lengths": prompt_lens.tolist(), "dtype": str(dtype).replace("torch.", ""),
        "device": str(device), "draft_weights": opts["draft_weights"], "compile_steps": bool(opts["compile_steps"]),
    })
    return {k: out[k] for k in _CONFIG_KEYS}


#: the order of the configuration keys in ``stats``
_CONFIG_KEYS = (
    "sparse_attn_algorithm", "num_speculative_tokens", "sparse_attn_ratio",
    "sparse_attn_min_tokens", "sparse_attn_max_tokens", "block_size", "num_sink_blocks", "num_recent_tokens",
    "share_selection_across_heads", "query_weights", "selection_refresh_interval", "score_decay", "do_sample",
    "temperature", "top_k", "top_p", "max_new_tokens", "batch_size", "prompt_lengths", "dtype", "device",
    "draft_weights", "compile_steps",
)


def _new_state(settings: DecodeSettings, plan: _Plan, pad_token_id: int) -> DecodeState:
    """An empty cache of ``plan.cache_len`` positions per row, the attention state over it (with
    room for block scores when the strategy reads them) and the loop's state before prefill."""
    model, B = settings.model, len(plan.prompt_lens)
    device = plan.prompt_lens.device
    cache = VegasCache.for_model(model, B, plan.cache_len)
    attn = AttentionState(
        cache=cache, block_size=plan.block_size,
        query_weights=_first_last_weights(device) if plan.query_weights == "first_last" else None,
    )
    if plan.strategy.drafts and plan.strategy.needs_verify_scores:
        attn.block_scores = torch.zeros(
            (len(cache.layers), B, cache.layers[0].num_heads, -(-plan.cache_len // plan.block_size)),
            dtype=torch.float32, device=device,
        )
    return DecodeState(
        settings=settings, cache=cache, attn=attn, stats=DecodeStats.for_gamma(plan.policy.max_gamma),
        limit_new=plan.limit_new, new_tokens=torch.full((B, plan.n_cap), pad_token_id, dtype=torch.long, device=device),
    )


def _collect_stats(state: DecodeState, config_used: dict, t_total: float, inline_pre: dict,
                   *, reused: bool, prefill_cache: Optional[dict]) -> dict:
    """The call's ``stats``: counters and timings (selection work done inside the forwards moved to
    ``time_select_s``), the configuration, the policy's and the draft weights' own figures."""
    stats, dw = state.stats, state.settings.draft_weights
    inline_total = _move_inline_select_time(stats, state.settings.strategy, inline_pre)
    stats.num_generated_tokens = int(state.n_gen_all.sum())
    out = {**stats.as_dict(t_total, len(state.n_gen_all)), **config_used, **state.settings.policy.stats()}
    out["prefill_reused"] = reused
    out["prefill_miss"] = None if reused or prefill_cache is None else (state.prefill_miss or "no prefill")
    out["draft_weights_bytes"] = dw.nbytes if dw is not None else 0
    out["draft_weights_format"] = dw.format if dw is not None else None
    out["time_draft_weights_s"] = dw.build_s if dw is not None else 0.0
    out["time_select_inline_s"] = inline_total
    out["time_select_prefill_s"] = float(sum(inline_pre.values()))
    return out


@contextlib.contextmanager
def _torn_down(strategy: SelectionStrategy, st: AttentionState):
    """Runs ``strategy.teardown(st)`` when the block ends, however it ends."""
    try:
        yield
    finally:
        strategy.teardown(st)


def _move_inline_select_time(stats: DecodeStats, strategy: SelectionStrategy, inline_pre: dict) -> float:
    """Selection work done inside the forwards (e.g. Quest's metadata and per-step scoring) counts
    as selection: move it from the prefill / draft / verify times to ``time_select_s``. Returns the
    seconds moved."""
    inline = dict(getattr(strategy, "inline_select_time_s", None) or {})
    moved = {"prefill": sum(inline_pre.values())}
    for phase in ("draft", "verify"):
        moved[phase] = inline.get(phase, 0.0) - inline_pre.get(phase, 0.0)
    for phase, t in moved.items():
        if t:
            setattr(stats, f"time_{phase}_s", getattr(stats, f"time_{phase}_s") - t)
            stats.time_select_s += t
    return float(sum(moved.values()))
