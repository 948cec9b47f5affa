"""``CPU_ATTN`` with Vegas's selection signal: per-page attention mass from the verification itself.

:class:`VegasCPUAttentionBackend` replaces ``AttentionBackendEnum.CPU_ATTN`` (registered by
:func:`vegas_ext.vllm.register`). Only on the target model's forwards while a Vegas proposer
collects scores (the :class:`VegasState` that proposer hands to each layer's implementation) does
its implementation differ from the stock ``CPUAttentionBackendImpl.forward``:

* decode / verification batches (every request has at most γ + 1 new tokens): one pass,
  :func:`vegas_ext.ops.paged_verify_attention` over the paged cache computes the attention output
  (written into vLLM's ``output``) and, for every request, the attention mass its last γ + 1
  queries put on each page, kept by layer name for the proposer that runs right after in the same
  step;
* other batches (a prefill chunk among them) and layers with features the one-pass kernel lacks
  (ALiBi, sliding window, soft-cap, sinks, non-causal): vLLM's own kernel, then
  :func:`vegas_ext.ops.paged_block_scores` on the K half of the cache.

Draft forwards run the stock forward over the proposer's compacted block table (page-granular
drafts), or, with ``draft_granularity="token"``, :func:`vegas_ext.ops.paged_sparse_draft_attention`
over the real block table and the proposer's per-(layer, KV head) token selection; the target
forward then keeps per-token scores (``score_block_size=1``). Engines without a Vegas proposer
run the stock forward alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from .. import ops
from .cpu_layout import key_cache_view, value_cache_view

__all__ = ["VegasCPUAttentionBackend", "VegasCPUAttentionImpl", "VegasState", "attach_state",
           "draft_token_attention", "key_cache_view", "one_pass_applies", "record_scores", "value_cache_view"]


@dataclass
class VegasState:
    """State a Vegas proposer owns and shares with the attention implementations of its model
    (:func:`attach_state`).

    Attributes:
        collect: compute page scores on target forwards (``active`` and the algorithm needs them).
        drafting: a draft forward is running (no scores; set by the proposer).
        num_queries: queries scored per request (γ + 1).
        score_block_size: tokens per score (``None``: per page; 1: per token, token-granular drafts).
        scores: layer name -> ``[num_reqs, H_kv, max_pages]`` float32 scores of the latest target
            forward (``[num_reqs, H_kv, max_pages * page_size]`` per token), rows in that forward's
            batch order.
        draft_tokens: while a token-granular draft runs, layer name -> ``[num_reqs, H_kv, K]``
            int32 selected tokens (ascending, -1 padded) of the draft batch's requests, and
        draft_tail: ``[num_reqs]`` int32, their tail starts; ``None`` for page-granular drafts.
        draft_kv: while a token-granular draft runs, the selected tokens' and the tail's K/V
            gathered once per round (:class:`DraftKV`).
        one_pass_calls / two_pass_calls: layer forwards that recorded scores with
            :func:`vegas_ext.ops.paged_verify_attention` / with vLLM's kernel plus
            :func:`vegas_ext.ops.paged_block_scores` (debug counters).
    """

    collect: bool = False
    drafting: bool = False
    num_queries: int = 1
    score_block_size: Optional[int] = None
    scores: Dict[str, torch.Tensor] = field(default_factory=dict)
    draft_tokens: Optional[Dict[str, torch.Tensor]] = None
    draft_tail: Optional[torch.Tensor] = None
    draft_kv: Optional["DraftKV"] = None
    one_pass_calls: int = 0
    two_pass_calls: int = 0


def attach_state(model: torch.nn.Module, state: VegasState) -> int:
    """Give every attention layer of ``model`` (modules with an ``impl``) the proposer's ``state``;
    returns how many layers got it. Layers without one record no scores."""
    n = 0
    for m in model.modules():
        impl = getattr(m, "impl", None)
        if impl is not None and hasattr(m, "layer_name"):
            impl.vegas_state = state
            n += 1
    return n


def _collecting(impl, attn_metadata) -> bool:
    st = getattr(impl, "vegas_state", None)
    return (st is not None and st.collect and not st.drafting and attn_metadata is not None
            and impl.attn_type == AttentionType.DECODER)


def one_pass_applies(impl, attn_metadata) -> bool:
    """Whether this forward runs :func:`vegas_ext.ops.paged_verify_attention` instead of vLLM's
    kernel plus :func:`vegas_ext.ops.paged_block_scores`: a target forward that collects scores,
    every request with at most γ + 1 new tokens (decode / verification; a prefill chunk keeps
    vLLM's kernel), a plain causal decoder layer (no ALiBi, sliding window, soft-cap or sinks), a
    float cache, and the op's compiled CPU kernel (on CUDA its PyTorch reference would be far
    slower than the two passes)."""
    return (ops._COMPILED.get(("paged_verify_attention", "cpu"), False)
            and _collecting(impl, attn_metadata) and not impl.is_fp8_kv_cache
            and attn_metadata.max_query_len <= impl.vegas_state.num_queries and attn_metadata.causal
            and getattr(attn_metadata, "dynamic_causal", None) is None and impl.alibi_slopes is None
            and impl.sliding_window == -1 and not impl.logits_soft_cap and impl.sinks is None)


def record_scores(layer, impl, query, key_cache, attn_metadata, value_cache=None) -> None:
    """Store the page scores of this target forward for ``layer`` in the proposer's state (see
    :func:`attach_state`); no-op on draft forwards, without a Vegas proposer, outside decoder
    self-attention. Per-token scores (``score_block_size`` set) need ``value_cache``: they come
    from :func:`vegas_ext.ops.paged_verify_attention` over each request's scored queries only."""
    if _collecting(impl, attn_metadata):
        st = impl.vegas_state
        n = attn_metadata.num_actual_tokens
        num_reqs = attn_metadata.seq_lens.shape[0]
        st.two_pass_calls += 1
        bt, qsl = attn_metadata.block_table[:num_reqs], attn_metadata.query_start_loc[: num_reqs + 1]
        if st.score_block_size is None or value_cache is None:
            st.scores[layer.layer_name] = ops.paged_block_scores(
                query[:n], key_cache, bt, attn_metadata.seq_lens, qsl, st.num_queries, impl.scale)
            return
        # the last min(q_len, γ + 1) queries of each request keep their positions (seq_len - q_len + i)
        q_lens = qsl[1:] - qsl[:-1]
        m = torch.clamp(q_lens, max=st.num_queries)
        sub_qsl = torch.zeros_like(qsl)
        sub_qsl[1:] = torch.cumsum(m, 0)
        rows = torch.repeat_interleave(qsl[1:] - m, m) + (
            torch.arange(int(sub_qsl[-1]), device=qsl.device) - torch.repeat_interleave(sub_qsl[:-1], m))
        _, st.scores[layer.layer_name] = ops.paged_verify_attention(
            query[rows.long()], key_cache, value_cache, bt, attn_metadata.seq_lens, sub_qsl, st.num_queries,
            impl.scale, st.score_block_size)


@dataclass
class DraftKV:
    """The K/V a round of token-granular drafts reads, gathered from the paged cache once per round
    (:func:`gather_draft_kv`): every draft step then reads them contiguously, where reading selected
    tokens in place pulls ``head_dim`` cache lines per token from the CPU key layout ``[D, page_size]``.

    Attributes:
        keys / values: layer name -> ``[R, H_kv, W, D]``: positions ``[0, max_k)`` hold the selected
            tokens (``indices`` says which are real), ``[max_k, W)`` the tail from ``tail_start``
            on; each draft step appends its token there.
        indices: layer name -> ``[R, H_kv, max_k]`` int32, ``i`` where position ``i`` holds a
            selected token, else -1 (:func:`vegas_ext.ops.sparse_draft_attention`'s ``block_indices``, block size 1).
        tail_start: ``[R]`` int64, the logical token at position ``max_k``.
        rows: the draft batch's rows of ``R`` (``None``: all, in order).
    """

    keys: Dict[str, torch.Tensor]
    values: Dict[str, torch.Tensor]
    indices: Dict[str, torch.Tensor]
    tail_start: torch.Tensor
    rows: Optional[torch.Tensor] = None


def gather_draft_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, token_indices: torch.Tensor,
                    tail_start: torch.Tensor, tail_end: torch.Tensor, width: int):
    """One layer's K/V for :class:`DraftKV`: ``[R, H_kv, width, D]`` keys and values, the tokens
    ``token_indices`` ``[R, H_kv, max_k]`` (logical, -1 padded: those positions hold token 0) at
    ``[0, max_k)``, then the tail tokens ``[tail_start, tail_end)`` (``[R]``) from ``max_k`` on
    (positions past ``tail_end`` repeat its last token until a draft step writes them).
    ``kv_cache``: a CPU_ATTN cache ``[num_blocks, H_kv, block_size, 2 * D]``; ``block_table``
    ``[R, max_blocks]``."""
    _, H_kv, bs, d2 = kv_cache.shape
    D = d2 // 2
    R, H, max_k = token_indices.shape
    dev = token_indices.device
    T = width - max_k
    last = torch.maximum(tail_end.long() - 1, tail_start.long()).view(R, 1)
    tail = torch.minimum(tail_start.long().view(R, 1) + torch.arange(T, device=dev).view(1, T), last)
    tok = torch.cat([token_indices.clamp(min=0).long(), tail.view(R, 1, T).expand(R, H, T)], -1)  # [R, H, W]
    phys = block_table.long().gather(1, torch.div(tok, bs, rounding_mode="floor").view(R, H * width))
    page_head = phys.view(R, H, width) * H_kv + torch.arange(H, device=dev).view(1, H, 1)
    t = tok % bs
    # index_select on flat views (far cheaper than advanced indexing of the strided 4-D views):
    # values as D-element rows, keys ([D, page_size] per page and head) one element at a time
    rows = (page_head * (2 * bs) + bs + t).view(-1)
    values = kv_cache.view(-1, D).index_select(0, rows).view(R, H, width, D)
    d = torch.arange(D, device=dev).view(1, 1, 1, D) * bs
    offsets = (page_head * (bs * d2) + t).unsqueeze(-1) + d
    keys = kv_cache.view(-1).index_select(0, offsets.view(-1)).view(R, H, width, D)
    return keys, values


def draft_kv_attention(layer, impl, query, key, value, attn_metadata, output):
    """A token-granular draft forward of ``layer`` over :class:`DraftKV`: appends this step's K/V
    after the tail, then :func:`vegas_ext.ops.sparse_draft_attention` (block size 1) over the
    selected tokens plus the tail. Returns ``output``."""
    d = impl.vegas_state.draft_kv
    name, n = layer.layer_name, attn_metadata.num_actual_tokens
    keys, values = d.keys[name], d.values[name]
    idx = d.indices[name]
    max_k = idx.shape[-1]
    rows = d.rows
    start = d.tail_start if rows is None else d.tail_start[rows]
    at = max_k + (attn_metadata.seq_lens[:n].long() - 1 - start)  # [n] this step's position in the buffer
    r = torch.arange(n, device=at.device) if rows is None else rows
    keys[r, :, at] = key[:n]
    values[r, :, at] = value[:n]
    if rows is not None:
        keys, values, idx = keys[rows], values[rows], idx[rows]
    out = ops.sparse_draft_attention(query[:n].unsqueeze(1), keys, values, idx, max_k, (at + 1).to(torch.int32), 1,
                                     impl.scale)
    output[:n].copy_(out.view(output[:n].shape))
    return output


def draft_token_attention(layer, impl, query, kv_cache, attn_metadata, output):
    """A token-granular draft forward of ``layer``: each query head attends to its KV head's
    selected tokens plus the tail (:func:`vegas_ext.ops.paged_sparse_draft_attention`), through the
    real block table; the drafted token's K/V are already in its slot. Returns ``output``."""
    st = impl.vegas_state
    n = attn_metadata.num_actual_tokens
    num_reqs = attn_metadata.seq_lens.shape[0]
    out = ops.paged_sparse_draft_attention(
        query[:n], key_cache_view(kv_cache), value_cache_view(kv_cache), attn_metadata.block_table[:num_reqs],
        attn_metadata.seq_lens, attn_metadata.query_start_loc[: num_reqs + 1], st.draft_tokens[layer.layer_name],
        st.draft_tail, impl.scale)
    output[:n].copy_(out.view(output[:n].shape))
    return output


def _token_drafting(impl, attn_metadata) -> bool:
    st = getattr(impl, "vegas_state", None)
    return (st is not None and st.drafting and st.draft_tokens is not None and attn_metadata is not None
            and impl.attn_type == AttentionType.DECODER and not impl.is_fp8_kv_cache)


class VegasCPUAttentionImpl(CPUAttentionBackendImpl):
    """``CPUAttentionBackendImpl`` whose forward also records per-page attention mass (see module)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is None and output_block_scale is None and _token_drafting(self, attn_metadata):
            if self.vegas_state.draft_kv is not None:
                return draft_kv_attention(layer, self, query, key, value, attn_metadata, output)
            return draft_token_attention(layer, self, query, kv_cache, attn_metadata, output)
        if output_scale is None and output_block_scale is None and one_pass_applies(self, attn_metadata):
            # K/V of this step's tokens are already in the cache (do_kv_cache_update runs first)
            st = self.vegas_state
            n = attn_metadata.num_actual_tokens
            num_reqs = attn_metadata.seq_lens.shape[0]
            out, st.scores[layer.layer_name] = ops.paged_verify_attention(
                query[:n], key_cache_view(kv_cache), value_cache_view(kv_cache), attn_metadata.block_table[:num_reqs],
                attn_metadata.seq_lens, attn_metadata.query_start_loc[: num_reqs + 1], st.num_queries, self.scale,
                st.score_block_size)
            output[:n].copy_(out.view(output[:n].shape))
            st.one_pass_calls += 1
            return output
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        if not self.is_fp8_kv_cache:
            record_scores(layer, self, query, key_cache_view(kv_cache), attn_metadata, value_cache_view(kv_cache))
        return out


class VegasCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's ``CPU_ATTN`` backend with :class:`VegasCPUAttentionImpl` as implementation."""

    @staticmethod
    def get_impl_cls():
        return VegasCPUAttentionImpl
