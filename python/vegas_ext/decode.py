"""Self-speculative decoding with verification-guided sparse attention (Vegas, arXiv 2602.07223).

One iteration (see ``shared/VEGAS.md``):

1. **Draft** ``gamma`` tokens with the model itself, each layer attending only to the KV blocks
   selected at the last verification plus the *tail* (every token since the start of the last
   verification window): :func:`vegas_ext.ops.sparse_draft_attention`.
2. **Verify** the last target token and the ``gamma`` drafts in one forward with full causal
   attention (:func:`vegas_ext.ops.verify_attention`), which also returns, per layer, the softmax
   mass each KV block received.
3. **Accept**: greedy -- the longest prefix of drafts equal to the target's argmax, then the
   target's token; sampling -- speculative sampling (Leviathan et al., "Fast Inference from
   Transformers via Speculative Decoding", ICML 2023; Chen et al., "Accelerating Large Language
   Model Decoding with Speculative Sampling", 2023). Roll the cache back by length.
4. **Select** the next draft's blocks: per layer (and per KV head, or shared), the top-k blocks by
   verification score, sinks first (:func:`vegas_ext.ops.block_topk`), all layers in one call.

Selection algorithms are pluggable (:func:`register_selection_algorithm`); ``"vegas"`` and
``"full"`` (plain decoding through the same cache and kernels, the honest baseline) are built in;
the rivals ``"streamingllm"`` and ``"quest"`` live in :mod:`vegas_ext.selection`.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Type, Union

import torch
from torch import Tensor
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from . import ops
from .cache import VegasCache
from .hf import AttentionState, patched

__all__ = [
    "generate",
    "GenerateOutput",
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


# =========================================================================== output
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


# =========================================================================== selection strategies
@dataclass
class SelectionConfig:
    """Budget and selection options shared by the selection algorithms."""

    ratio: float = 0.05
    min_tokens: int = 256
    max_tokens: Optional[int] = None
    block_size: int = 16
    num_sink_blocks: int = 1
    share_selection_across_heads: bool = False
    refresh_interval: int = 1


@dataclass
class SelectionContext:
    """What a strategy sees after a verification.

    Attributes:
        block_scores: ``[L, B, H_kv, N]`` float32 verification scores (``None`` if the strategy does
            not ask for them).
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


def budget_blocks(lengths: Tensor, cfg: SelectionConfig) -> Tensor:
    """Blocks per row for the draft: ``ceil(ceil(ratio * length) clamped to [min_tokens, max_tokens] / block_size)``.

    Args:
        lengths: ``[B]`` int context lengths.
        cfg: the budget options.

    Returns:
        ``[B]`` int32 block counts.
    """
    tok = torch.ceil(lengths.double() * cfg.ratio)
    tok = tok.clamp(min=cfg.min_tokens)
    if cfg.max_tokens is not None:
        tok = tok.clamp(max=cfg.max_tokens)
    return torch.ceil(tok / cfg.block_size).to(torch.int32)


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
    them, among the blocks before the draft tail, sink blocks first; per KV head, or one set per
    layer (scores summed over heads) with ``share_selection_across_heads``. All layers in one
    :func:`vegas_ext.ops.block_topk` call (layers stacked into the batch dimension). With
    ``refresh_interval = n > 1`` the blocks are re-selected only every ``n`` iterations and kept in
    between (SparseSpec's stride, arXiv 2512.01278 "PillarAttn")."""

    needs_verify_scores = True
    default_block_size = 1  # token granularity: highest acceptance in bench/results/variants_cpu

    def select(self, ctx: SelectionContext) -> Tensor:
        cfg = self.cfg
        n = max(1, int(cfg.refresh_interval))
        if n > 1 and ctx.previous is not None and ctx.iteration % n != 0:
            return ctx.previous
        scores = ctx.block_scores
        L, B, H, N = scores.shape
        k = budget_blocks(ctx.lengths, cfg)
        ncand = torch.div(ctx.tail_start + (cfg.block_size - 1), cfg.block_size, rounding_mode="floor").to(torch.int32)
        max_k = max(1, min(int(k.max()), N))
        s = scores.view(L * B, H, N)
        if cfg.share_selection_across_heads:
            s = s.sum(1, keepdim=True)
        idx = ops.block_topk(s, k.repeat(L), ncand.repeat(L), max_k, cfg.num_sink_blocks)
        idx = idx.view(L, B, -1, max_k)
        if cfg.share_selection_across_heads:
            idx = idx.expand(L, B, H, max_k).contiguous()
        return idx


# =========================================================================== acceptance
def make_warpers(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> LogitsProcessorList:
    """transformers' warpers in ``generate``'s order (temperature, top-k, top-p); identity ones omitted."""
    w = LogitsProcessorList()
    if temperature != 1.0:
        w.append(TemperatureLogitsWarper(float(temperature)))
    if top_k and top_k > 0:
        w.append(TopKLogitsWarper(int(top_k)))
    if top_p < 1.0:
        w.append(TopPLogitsWarper(float(top_p)))
    return w


def _probs(logits: Tensor, warpers: LogitsProcessorList) -> Tensor:
    """Warped probabilities, ``[..., V]`` float32."""
    shape = logits.shape
    x = logits.reshape(-1, shape[-1]).float()
    if len(warpers):
        x = warpers(None, x)
    return torch.softmax(x, dim=-1).view(shape)


def greedy_accept(drafts: Tensor, target_logits: Tensor):
    """Greedy verification.

    Args:
        drafts: ``[B, g]`` int64 draft tokens.
        target_logits: ``[B, g + 1, V]`` target logits at the positions of the last target token and
            the ``g`` drafts.

    Returns:
        ``(a, t)``: ``[B]`` accepted draft counts (longest prefix equal to the target's argmax) and
        ``[B]`` the target's token after them (the correction, or the bonus if all ``g`` pass).
    """
    tgt = target_logits.argmax(-1)
    g = drafts.shape[1]
    if g:
        a = (drafts == tgt[:, :g]).long().cumprod(1).sum(1)
    else:
        a = torch.zeros(drafts.shape[0], dtype=torch.long, device=drafts.device)
    t = tgt.gather(1, a[:, None])[:, 0]
    return a, t


def speculative_accept(drafts: Tensor, q: Tensor, p: Tensor, generator: Optional[torch.Generator] = None):
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023), vectorized over rows.

    Draft ``j`` is accepted with probability ``min(1, p_j(x) / q_j(x))``; at the first rejection the
    token is drawn from ``normalize(max(p_a - q_a, 0))`` (from ``p_a`` if that residual has no mass,
    e.g. ``p == q``: never NaN); if all pass, from ``p_g``. The output is distributed as ``p``.

    Args:
        drafts: ``[B, g]`` int64 draft tokens, drawn from ``q``.
        q: ``[B, g, V]`` float32, exactly the (warped) distributions the drafts were drawn from.
        p: ``[B, g + 1, V]`` float32 warped target distributions.
        generator: optional ``torch.Generator`` (reproducible runs).

    Returns:
        ``(a, t)``: ``[B]`` accepted counts and ``[B]`` the next token.
    """
    B, g = drafts.shape
    if g:
        pd = p[:, :g].gather(-1, drafts[..., None])[..., 0]
        qd = q.gather(-1, drafts[..., None])[..., 0]
        u = torch.rand((B, g), generator=generator, device=p.device, dtype=torch.float32)
        acc = u * qd < pd  # u < p/q without dividing; always true when p >= q
        a = acc.long().cumprod(1).sum(1)
        q_ext = torch.cat([q, q.new_zeros(B, 1, q.shape[-1])], 1)
    else:
        a = torch.zeros(B, dtype=torch.long, device=p.device)
        q_ext = p.new_zeros(B, 1, p.shape[-1])
    ia = a[:, None, None].expand(B, 1, p.shape[-1])
    pa = p.gather(1, ia)[:, 0]
    qa = q_ext.gather(1, ia)[:, 0]
    res = (pa - qa).clamp_min(0)
    dist = torch.where((res.sum(-1, keepdim=True) > 0), res, pa)
    t = torch.multinomial(dist, 1, generator=generator)[:, 0]
    return a, t


# =========================================================================== generate
_QUERY_WEIGHTS = ("all", "first_last")


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


def _as_id_list(x) -> List[int]:
    if x is None:
        return []
    if isinstance(x, Tensor):
        return [int(v) for v in x.flatten().tolist()]
    if isinstance(x, (list, tuple)):
        return [int(v) for v in x]
    return [int(x)]


def generate(
    model,
    input_ids: Tensor,
    attention_mask: Optional[Tensor] = None,
    *,
    max_new_tokens: int,
    num_speculative_tokens: int = 6,
    sparse_attn_algorithm: str = "vegas",
    sparse_attn_ratio: float = 0.05,
    sparse_attn_min_tokens: int = 256,
    sparse_attn_max_tokens: Optional[int] = None,
    block_size: Optional[int] = None,
    num_sink_blocks: int = 1,
    share_selection_across_heads: bool = False,
    query_weights: str = "all",
    selection_refresh_interval: int = 1,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: Union[int, Sequence[int], None] = None,
    pad_token_id: Optional[int] = None,
    streamer=None,
    generator: Optional[torch.Generator] = None,
    return_cache: bool = False,
    prefill_cache: Optional[dict] = None,
) -> GenerateOutput:
    """Generate with Vegas self-speculative decoding (arXiv 2602.07223) on a HF causal LM.

    Lossless: greedy output is token-for-token plain greedy decoding; sampled output follows the
    target distribution (speculative sampling). Works on batches whose rows have different prompt
    lengths (left padding), each row accepting its own number of drafts and stopping at its own
    EOS / ``max_new_tokens``.

    Args:
        model: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` or
            ``MistralForCausalLM`` (patched to the ``"vegas"`` attention for the call, restored
            after; see :mod:`vegas_ext.hf`).
        input_ids: ``[B, T]`` int64 prompts, left padded.
        attention_mask: ``[B, T]`` 0/1, ones contiguous at the right end of each row (left padding);
            default all ones.
        max_new_tokens: new tokens per row (>= 0). Also capped so a row never goes past the model's
            ``max_position_embeddings`` (it then ends at the last position; HF would extrapolate).
        num_speculative_tokens: drafts per iteration ``gamma`` (>= 0). Shrunk automatically near a
            row's end (``max_new_tokens`` or the last position); never writes out of bounds.
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
        share_selection_across_heads: one block set per layer (scores summed over KV heads; the
            authors' choice) instead of one per KV head.
        query_weights: ``"all"`` (every verification query scores blocks) or ``"first_last"``
            (only the first and last, as in the authors' code).
        selection_refresh_interval: re-select the draft blocks only every n iterations and keep
            them in between (SparseSpec); 1 = after every verification (default). Used by ``"vegas"``.
        do_sample, temperature, top_k, top_p: sampling as in HF ``generate``; the same
            transformers warpers shape both target and draft distributions.
        eos_token_id: int or list; default ``model.generation_config.eos_token_id``; ``[]``
            disables stopping at EOS.
        pad_token_id: fills rows finished early; default the generation config's, else the first
            EOS, else 0.
        streamer: a HF streamer (``put`` / ``end``); batch size 1 only.
        generator: ``torch.Generator`` for reproducible sampling.
        return_cache: also return the KV cache (inspection, tests).
        prefill_cache: optional dict shared by calls on the same prompt (benchmarks): the first call
            stores its prefill K/V there, later calls whose prefill is a prefix of it copy it
            instead of recomputing (``stats["prefill_reused"]``; their ``time_prefill_s`` is then
            the copy). Valid because a causal model's K/V at a position depend only on the tokens
            up to it; the stored K/V may differ from a recomputation by float rounding only.

    Returns:
        :class:`GenerateOutput` with ``sequences`` ``[B, T + n]`` (``n`` = most new tokens of any
        row) and ``stats``: ``num_drafts`` (row-iterations with drafts), ``num_draft_tokens``,
        ``num_accepted_tokens``, ``num_accepted_tokens_per_pos`` (list of length gamma),
        ``mean_acceptance_length`` (= 1 + accepted / drafts), ``draft_acceptance_rate`` (= accepted
        / draft tokens), ``num_generated_tokens``, ``num_iterations``, ``tokens_per_s`` (new tokens
        / total time, prefill included), ``decode_tokens_per_s`` (after the first token),
        ``time_total_s``, ``time_prefill_s``, ``time_draft_s``, ``time_verify_s`` (acceptance
        included), ``time_select_s``, and the configuration. Drafts that could never be emitted
        (past a row's ``max_new_tokens``) are not counted.

    Raises:
        ValueError: unsupported model or sliding window smaller than the context (names
            ``config.sliding_window``), unknown algorithm or ``query_weights``, right padding or an
            empty prompt, a prompt longer than the model's positions, and out-of-range options
            (``gamma < 0``, ratio outside ``(0, 1]``, ``block_size < 1``, ...).

    Defaults, and why (SmolLM2-135M-Instruct, fp32, CPU, 1 thread; ``bench/decode_defaults.py``
    and ``bench/decode_step_costs.py``):

    * ``sparse_attn_ratio=0.05``, ``sparse_attn_min_tokens=256``: on a 4K-token real-text prompt
      (greedy, gamma 8) a 64-token floor dropped the mean acceptance length from 6.7 to 5.9 and a
      10 % budget did not raise it; a draft step costs about the same for any of these budgets
      (weights dominate: 57-60 ms at 2K-8K, batch 1), so the paper's 5 % / 256 is kept.
    * ``block_size=None`` -> 1 for ``"vegas"`` (token granularity, the authors' choice): at 4K and
      8K, batch 4, gamma 6, ratio 0.05, three documents (``bench/results/variants_cpu``, ~220
      drafts each) it drafted best -- mean acceptance length 5.28 vs 4.87 with 16-token blocks and
      4.49 with 64 (StreamingLLM 4.32, Quest 4.78), ahead on every document and context -- for a
      selection cost of ~1.5 % of an iteration (one ``block_topk`` over all layers) and, after
      the block-score reduction was reworked, ~15 % more ``verify_attention`` time than 16-token
      blocks. Quest and StreamingLLM keep 16-token blocks (Quest's pages).
    * ``num_speculative_tokens=6`` (the paper's setting, kept as the API default): with the cost
      model ``tau * t_plain / (gamma * t_draft + t_verify + t_select)`` on measured step costs (plain
      / draft / verify-of-7 = 365 / 104 / 699 ms at 8K, batch 4; 86 / 57 / 165 ms at 4K, batch 1),
      gamma 2-4 is best on this CPU and 6 is 5-15 % behind it, because verifying gamma+1 tokens is
      not free here (small-M GEMMs are compute-bound: verify-of-7 ~ 2 plain steps) and a 135M
      model's draft step reads all the weights like a plain step. Measured end to end at 4K,
      batch 1 (decode only, 1 thread): ``"full"`` 10.4 tok/s, gamma 6 8.1 tok/s (tau 5.9), gamma 3
      12.4 tok/s (tau 3.8). Pass ``num_speculative_tokens=3`` on CPU; keep 6 where verification is
      nearly free (GPU, the paper's setup). At 2K, batch 1 no gamma wins by more than ~6 %: use
      ``"full"`` there.
    * per-KV-head selection (``share_selection_across_heads=False``) and all verification queries
      (``query_weights="all"``): within sampling error of the authors' shared / first-and-last
      choices (same run: shared 4.93, shared + first/last 4.88, default 4.87, first/last alone
      4.70), and per-head selection is what the kernels are built for.
    """
    # ----------------------------------------------------------------- validation
    if sparse_attn_algorithm not in SELECTION_ALGORITHMS:
        raise ValueError(
            f"sparse_attn_algorithm must be one of {sorted(SELECTION_ALGORITHMS)}, got {sparse_attn_algorithm!r}"
        )
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be an int >= 0, got {num_speculative_tokens!r}")
    if not (0.0 < float(sparse_attn_ratio) <= 1.0):
        raise ValueError(f"sparse_attn_ratio must lie in (0, 1], got {sparse_attn_ratio}")
    if sparse_attn_min_tokens < 0:
        raise ValueError(f"sparse_attn_min_tokens must be >= 0, got {sparse_attn_min_tokens}")
    if sparse_attn_max_tokens is not None and sparse_attn_max_tokens < max(1, sparse_attn_min_tokens):
        raise ValueError(
            f"sparse_attn_max_tokens ({sparse_attn_max_tokens}) must be >= max(1, sparse_attn_min_tokens)"
        )
    if block_size is None:
        block_size = SELECTION_ALGORITHMS[sparse_attn_algorithm].default_block_size
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (or None for the algorithm's default), got {block_size}")
    if num_sink_blocks < 0:
        raise ValueError(f"num_sink_blocks must be >= 0, got {num_sink_blocks}")
    if not isinstance(selection_refresh_interval, int) or selection_refresh_interval < 1:
        raise ValueError(f"selection_refresh_interval must be an int >= 1, got {selection_refresh_interval!r}")
    if query_weights not in _QUERY_WEIGHTS:
        raise ValueError(f"query_weights must be one of {_QUERY_WEIGHTS}, got {query_weights!r}")
    if do_sample:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        if not (0.0 < top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError("input_ids must be an int64 tensor [B, T]")
    B, T = input_ids.shape
    if B < 1 or T < 1:
        raise ValueError(f"input_ids must be non-empty, got shape {tuple(input_ids.shape)}")
    if streamer is not None and B != 1:
        raise ValueError("streamer supports batch size 1 only")

    p0 = next(model.parameters())
    device = p0.device
    input_ids = input_ids.to(device=device, dtype=torch.long)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
    attention_mask = attention_mask.to(device)
    prompt_lens = attention_mask.long().sum(1)
    ar_t = torch.arange(T, device=device)
    expect = (ar_t[None, :] >= (T - prompt_lens)[:, None]).long()
    if not torch.equal(expect, (attention_mask != 0).long()):
        raise ValueError("attention_mask must be left padding (each row's ones contiguous at the right end)")
    if bool((prompt_lens == 0).any()):
        raise ValueError("every row needs at least one prompt token")

    config = model.config
    max_pos = int(getattr(config, "max_position_embeddings", 1 << 30) or (1 << 30))
    Lmax = int(prompt_lens.max())
    Lmin = int(prompt_lens.min())
    if Lmax > max_pos:
        raise ValueError(f"prompt of {Lmax} tokens is longer than the model's max_position_embeddings ({max_pos})")

    strategy_cls = SELECTION_ALGORITHMS[sparse_attn_algorithm]
    sel_cfg = SelectionConfig(
        ratio=float(sparse_attn_ratio),
        min_tokens=int(sparse_attn_min_tokens),
        max_tokens=sparse_attn_max_tokens,
        block_size=int(block_size),
        num_sink_blocks=int(num_sink_blocks),
        share_selection_across_heads=bool(share_selection_across_heads),
        refresh_interval=int(selection_refresh_interval),
    )
    strategy = strategy_cls(sel_cfg)
    gamma = int(num_speculative_tokens) if strategy.drafts else 0

    # per-row limits: never past the model's last position
    limit_new = torch.clamp(max_pos - prompt_lens + 1, max=max_new_tokens)
    if bool((limit_new < max_new_tokens).any()):
        warnings.warn(
            f"vegas generate: max_new_tokens={max_new_tokens} capped so no row goes past max_position_embeddings={max_pos}"
        )
    S_max = min(Lmax + max_new_tokens, max_pos) + gamma + 1
    need_ctx = min(Lmax + max_new_tokens, max_pos)

    eos_ids = _as_id_list(eos_token_id if eos_token_id is not None else getattr(model.generation_config, "eos_token_id", None))
    if pad_token_id is None:
        pad_token_id = getattr(model.generation_config, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(config, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = eos_ids[0] if eos_ids else 0
    pad_token_id = int(pad_token_id)
    eos_t = torch.tensor(eos_ids, dtype=torch.long, device=device)
    vocab = int(config.vocab_size)
    filler = pad_token_id if 0 <= pad_token_id < vocab else 0

    stats = {
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "num_accepted_tokens_per_pos": [0] * gamma,
        "num_generated_tokens": 0,
        "num_iterations": 0,
        "time_prefill_s": 0.0,
        "time_draft_s": 0.0,
        "time_verify_s": 0.0,
        "time_select_s": 0.0,
    }
    config_used = {
        "sparse_attn_algorithm": sparse_attn_algorithm,
        "num_speculative_tokens": gamma,
        "sparse_attn_ratio": float(sparse_attn_ratio),
        "sparse_attn_min_tokens": int(sparse_attn_min_tokens),
        "sparse_attn_max_tokens": sparse_attn_max_tokens,
        "block_size": int(block_size),
        "num_sink_blocks": int(num_sink_blocks),
        "share_selection_across_heads": bool(share_selection_across_heads),
        "query_weights": query_weights,
        "selection_refresh_interval": int(selection_refresh_interval),
        "do_sample": bool(do_sample),
        "temperature": float(temperature),
        "top_k": int(top_k),
        "top_p": float(top_p),
        "max_new_tokens": int(max_new_tokens),
        "batch_size": B,
        "prompt_lengths": prompt_lens.tolist(),
        "dtype": str(p0.dtype).replace("torch.", ""),
        "device": str(device),
    }
    if max_new_tokens == 0:
        stats.update(config_used)
        _finish_stats(stats, 0.0, gamma)
        return GenerateOutput(sequences=input_ids.clone(), stats=stats)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    warpers = make_warpers(temperature, top_k, top_p) if do_sample else None
    cache_kw = _cache_kwarg(model)

    with torch.inference_mode(), patched(model, max_context=need_ctx):
        t_start = time.perf_counter()
        cache = VegasCache.for_model(model, B, S_max)
        L_layers = len(cache.layers)
        n_blocks = -(-S_max // block_size)
        st = AttentionState(
            cache=cache,
            block_size=int(block_size),
            query_weights=_first_last_weights(device) if query_weights == "first_last" else None,
        )
        if strategy.drafts and strategy.needs_verify_scores:
            st.block_scores = torch.zeros(
                (L_layers, B, cache.layers[0].num_heads, n_blocks), dtype=torch.float32, device=device
            )

        def fwd(ids: Tensor, pos: Tensor, keep: int) -> Tensor:
            out = model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=keep, **{cache_kw: cache})
            st.check_forward(L_layers)
            return out.logits

        # left-aligned prompts
        ar_l = torch.arange(Lmax, device=device)
        src = (T - prompt_lens)[:, None] + ar_l[None, :]
        aligned = input_ids.gather(1, src.clamp(max=T - 1))
        aligned = torch.where(ar_l[None, :] < prompt_lens[:, None], aligned, torch.full_like(aligned, filler))

        if streamer is not None:
            streamer.put(input_ids.cpu())

        with st.activate(), _torn_down(strategy, st):
            strategy.setup(st)  # inside: teardown runs however the call ends
            # ------------------------------------------------------------- prefill
            n0 = min(gamma + 1, Lmin)
            pre = prompt_lens - n0
            t_pre = int(pre.max())
            stats["prefill_reused"] = False
            if t_pre > 0:
                st.mode = "prefill"
                cache.begin_forward(t_pre)
                pc = prefill_cache
                if (pc is not None and pc.get("ids") is not None and pc["ids"].shape[0] == B
                        and pc["ids"].shape[1] >= t_pre and torch.equal(pc["ids"][:, :t_pre], aligned[:, :t_pre])
                        and pc["k"][0].dtype == cache.layers[0].keys.dtype):
                    for li, cl in enumerate(cache.layers):  # copy, and tell the write hook as a forward would
                        cl.keys[:, :, :t_pre].copy_(pc["k"][li][:, :, :t_pre])
                        cl.values[:, :, :t_pre].copy_(pc["v"][li][:, :, :t_pre])
                        if st.write_hook is not None:
                            st.write_hook(li, cl.keys, torch.zeros_like(cache.seq_lens))
                    stats["prefill_reused"] = True
                else:
                    fwd(aligned[:, :t_pre], ar_l[:t_pre].expand(B, t_pre), 1)
                    if pc is not None:
                        pc["ids"] = aligned[:, :t_pre].clone()
                        pc["k"] = [cl.keys[:, :, :t_pre].clone() for cl in cache.layers]
                        pc["v"] = [cl.values[:, :, :t_pre].clone() for cl in cache.layers]
                cache.commit(pre)
            idx0 = pre[:, None] + torch.arange(n0, device=device)[None, :]
            st.mode = "verify"
            cache.begin_forward(n0)
            logits = fwd(aligned.gather(1, idx0), idx0, 1)[:, -1]
            cache.commit(prompt_lens)
            if do_sample:
                first = torch.multinomial(_probs(logits, warpers), 1, generator=generator)[:, 0]
            else:
                first = logits.argmax(-1)
            sync()
            t_prefill_end = time.perf_counter()
            stats["time_prefill_s"] = t_prefill_end - t_start
            inline_pre = dict(getattr(strategy, "inline_select_time_s", None) or {})

            new_tokens = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
            new_tokens[:, 0] = first
            n_gen = torch.ones(B, dtype=torch.long, device=device)
            done = (n_gen >= limit_new) | torch.isin(first, eos_t)
            last_tok = first
            tail_start = pre.to(torch.int32)
            if streamer is not None:
                streamer.put(first[:1].cpu())

            def do_select():
                t0 = time.perf_counter()
                st.tail_start = tail_start
                ctx = SelectionContext(
                    block_scores=st.block_scores, lengths=cache.lengths, tail_start=tail_start, cache=cache,
                    previous=st.block_indices, iteration=stats["num_iterations"],
                )
                st.block_indices = strategy.select(ctx)
                sync()
                stats["time_select_s"] += time.perf_counter() - t0

            if gamma > 0 and not bool(done.all()):
                do_select()

            # ------------------------------------------------------------- iterations
            ar_g = torch.arange(gamma + 1, device=device)
            while True:
                active = ~done
                if not bool(active.any()):
                    break
                lengths = cache.lengths.long()
                rem = limit_new - n_gen
                g = gamma
                if g > 0:
                    g = min(g, int((rem - 1)[active].max()), int((max_pos - 1 - lengths)[active].min()))
                    g = max(g, 0)
                stats["num_iterations"] += 1

                # draft
                t0 = time.perf_counter()
                drafts = torch.empty((B, g), dtype=torch.long, device=device)
                q_probs = torch.empty((B, g, vocab), dtype=torch.float32, device=device) if (do_sample and g) else None
                if g:
                    st.mode = "draft"
                    tok = last_tok
                    for j in range(g):
                        cache.begin_forward(1, offset=j)
                        lg = fwd(tok[:, None], (lengths + j).clamp(max=max_pos - 1)[:, None], 1)[:, -1]
                        if do_sample:
                            qj = _probs(lg, warpers)
                            tok = torch.multinomial(qj, 1, generator=generator)[:, 0]
                            q_probs[:, j] = qj
                        else:
                            tok = lg.argmax(-1)
                        drafts[:, j] = tok
                    sync()
                t1 = time.perf_counter()
                stats["time_draft_s"] += t1 - t0

                # verify + accept
                st.mode = "verify"
                cache.begin_forward(g + 1)
                ids = torch.cat([last_tok[:, None], drafts], 1)
                pos = (lengths[:, None] + ar_g[None, : g + 1]).clamp(max=max_pos - 1)
                tl = fwd(ids, pos, 0)
                if do_sample:
                    a, t = speculative_accept(drafts, q_probs if g else None, _probs(tl, warpers), generator)
                else:
                    a, t = greedy_accept(drafts, tl)
                cand = torch.cat([drafts, drafts.new_zeros(B, 1)], 1)
                cand.scatter_(1, a[:, None], t[:, None])
                count = torch.minimum(a + 1, rem)
                hit = torch.isin(cand, eos_t) & (ar_g[None, : g + 1] < count[:, None])
                has_eos = hit.any(1)
                count = torch.where(has_eos, hit.long().argmax(1) + 1, count)
                count = torch.where(active, count, torch.zeros_like(count))
                finished = active & (has_eos | (count >= rem))
                wmask = ar_g[None, : g + 1] < count[:, None]
                rows, cols = wmask.nonzero(as_tuple=True)
                new_tokens[rows, n_gen[rows] + cols] = cand[rows, cols]
                # stats (drafts that could never be emitted are not counted)
                g_row = torch.where(active, torch.clamp(rem - 1, max=g), torch.zeros_like(rem))
                acc_row = torch.minimum(a, g_row)
                stats["num_drafts"] += int((g_row > 0).sum())
                stats["num_draft_tokens"] += int(g_row.sum())
                stats["num_accepted_tokens"] += int(acc_row.sum())
                if g:
                    per_pos = (acc_row[:, None] > torch.arange(g, device=device)[None, :]).sum(0).tolist()
                    for j, c in enumerate(per_pos):
                        stats["num_accepted_tokens_per_pos"][j] += int(c)
                if streamer is not None and int(count[0]) > 0:
                    streamer.put(cand[0, : int(count[0])].cpu())
                # roll forward / back by length: exact K/V for last_tok and the emitted tokens but the last
                tail_start = cache.lengths.clone()
                cache.commit(lengths + count)
                n_gen = n_gen + count
                done = done | finished
                last_tok = torch.where(active, t, last_tok)
                sync()
                t2 = time.perf_counter()
                stats["time_verify_s"] += t2 - t1

                # select
                if gamma > 0 and not bool(done.all()):
                    do_select()

            sync()
            t_total = time.perf_counter() - t_start

    # selection work done inside forwards (e.g. Quest's metadata and per-step scoring) counts as selection
    inline = dict(getattr(strategy, "inline_select_time_s", None) or {})
    moved = {"prefill": sum(inline_pre.values())}
    for phase in ("draft", "verify"):
        moved[phase] = inline.get(phase, 0.0) - inline_pre.get(phase, 0.0)
    for phase, t in moved.items():
        if t:
            stats[f"time_{phase}_s"] -= t
            stats["time_select_s"] += t
    stats["time_select_inline_s"] = float(sum(moved.values()))
    stats["time_select_prefill_s"] = float(moved["prefill"])
    if streamer is not None:
        streamer.end()
    n_max = int(n_gen.max())
    sequences = torch.cat([input_ids, new_tokens[:, :n_max]], 1)
    stats["num_generated_tokens"] = int(n_gen.sum())
    stats.update(config_used)
    stats["num_speculative_tokens"] = gamma
    _finish_stats(stats, t_total, gamma, B)
    return GenerateOutput(sequences=sequences, stats=stats, cache=cache if return_cache else None)


@contextlib.contextmanager
def _torn_down(strategy: SelectionStrategy, st: AttentionState):
    """Runs ``strategy.teardown(st)`` when the block ends, however it ends."""
    try:
        yield
    finally:
        strategy.teardown(st)


def _finish_stats(stats: dict, t_total: float, gamma: int, B: int = 0) -> None:
    d = stats["num_drafts"]
    stats["mean_acceptance_length"] = 1.0 + (stats["num_accepted_tokens"] / d if d else 0.0)
    stats["draft_acceptance_rate"] = (
        stats["num_accepted_tokens"] / stats["num_draft_tokens"] if stats["num_draft_tokens"] else 0.0
    )
    stats["time_total_s"] = t_total
    stats["tokens_per_s"] = stats["num_generated_tokens"] / t_total if t_total > 0 else 0.0
    t_dec = t_total - stats["time_prefill_s"]
    n_dec = stats["num_generated_tokens"] - B
    stats["decode_tokens_per_s"] = n_dec / t_dec if t_dec > 0 and n_dec > 0 else 0.0
