"""Plain-PyTorch references of the three vegas ops.

Device-agnostic and written for clarity, not speed: they materialize the [Q, S]
score matrix that the kernels avoid. Tests and benchmarks compare the compiled
kernels against them, and :mod:`vegas_ext.ops` falls back to them where no
compiled kernel exists for a device. All math is done in float32 (inputs are
upcast first), so fp16 inputs whose dot products exceed 65504 stay finite.

Contracts: see :mod:`vegas_ext.ops`. Method: Vegas, "Self-Speculative Decoding
with Verification-Guided Sparse Attention", arXiv 2602.07223.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "verify_attention",
    "block_topk",
    "sparse_draft_attention",
    "masked_attention",
    "causal_allowed_mask",
    "draft_allowed_mask",
    "block_minmax_update",
    "quest_block_scores",
    "paged_block_scores",
    "paged_verify_attention",
    "paged_token_scores",
    "paged_sparse_draft_attention",
    "weight_only_linear",
    "rope_kv_write",
    "add_rms_norm",
    "silu_mul",
]


def masked_attention(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, compute_dtype=torch.float32
):
    """Dense attention with an explicit mask.

    q [B, Q, H_q, D]; k, v [B, H_kv, S, D]; allowed [B, H_q or 1, Q, S] bool.
    Returns out [B, Q, H_q, D] (dtype of q), lse [B, H_q, Q] and probabilities
    [B, H_q, Q, S], computed in ``compute_dtype`` (float32 for the reference; the
    tests also run it in bf16/fp16 as the same-precision baseline).
    """
    B, Q, Hq, D = q.shape
    group = Hq // k.shape[1]
    # [B, H_kv, S, D] -> [B, H_q, S, D]; query head h reads KV head h // group
    kf = k.to(compute_dtype).repeat_interleave(group, dim=1)
    vf = v.to(compute_dtype).repeat_interleave(group, dim=1)
    qf = q.to(compute_dtype).transpose(1, 2)  # [B, Hq, Q, D]
    s = (qf * scale) @ kf.transpose(-1, -2)  # [B, Hq, Q, S]
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s.float(), dim=-1)  # [B, Hq, Q]
    p = torch.exp(s - lse.unsqueeze(-1).to(compute_dtype))
    out = (p @ vf).transpose(1, 2).to(q.dtype)  # [B, Q, Hq, D]
    return out, lse, p


def causal_allowed_mask(seq_lens: Tensor, Q: int, S: int, device) -> Tensor:
    """[B, Q, S] bool: query i of row b sees tokens t <= seq_lens[b] - Q + i."""
    t = torch.arange(S, device=device)
    qpos = seq_lens.long().view(-1, 1) - Q + torch.arange(Q, device=device).view(1, -1)  # [B, Q]
    return t.view(1, 1, S) <= qpos.unsqueeze(-1)  # [B, Q, S]


def verify_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seq_lens: Tensor,
    block_size: int,
    scale: float,
    query_weights: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Reference of :func:`vegas_ext.ops.verify_attention` (same contract)."""
    B, Q, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    allowed = causal_allowed_mask(seq_lens, Q, S, q.device).unsqueeze(1)  # [B, 1, Q, S]
    out, lse, p = masked_attention(q, k_cache, v_cache, allowed, scale)
    p = p.float()
    w = torch.ones(Q, device=q.device) if query_weights is None else query_weights.float()
    pw = (p * w.view(1, 1, Q, 1)).sum(dim=2)  # [B, Hq, S]
    pw = pw.view(B, Hkv, group, S).sum(dim=2)  # [B, Hkv, S]
    nblocks = math.ceil(S / block_size)
    pad = nblocks * block_size - S
    pw = torch.nn.functional.pad(pw, (0, pad))
    block_scores = pw.view(B, Hkv, nblocks, block_size).sum(-1)
    return out, lse, block_scores


def block_topk(
    block_scores: Tensor,
    k: Tensor,
    num_candidates: Tensor,
    max_k: int,
    num_sink_blocks: int,
    num_recent_blocks: int = 0,
) -> Tensor:
    """Reference of :func:`vegas_ext.ops.block_topk` (same contract).

    Rank = (sink and recent blocks first, then eligible non-NaN by score descending, then
    eligible NaN, then ineligible), ties to the lower index; built from stable sorts.
    """
    B, H, N = block_scores.shape
    dev = block_scores.device
    idx = torch.arange(N, device=dev)
    elig = torch.minimum(num_candidates.long(), torch.tensor(N, device=dev)).view(B, 1, 1)
    c = torch.minimum(torch.minimum(k.long(), torch.tensor(max_k, device=dev)), elig.view(B))
    c = c.view(B, 1, 1).expand(B, H, 1)
    s = block_scores.float()
    nan = torch.isnan(s)
    key = torch.where(nan, torch.full_like(s, float("-inf")), s)
    is_elig = idx.view(1, 1, N) < elig
    is_sink = (idx.view(1, 1, N) < num_sink_blocks) & is_elig
    # the last r eligible blocks, r = min(num_recent_blocks, c - sinks taken): all of them are taken
    r = torch.clamp(c - torch.clamp(c, max=num_sink_blocks), max=num_recent_blocks)
    forced = is_sink | ((idx.view(1, 1, N) >= elig - r) & is_elig)
    category = torch.where(
        forced,
        torch.zeros_like(s, dtype=torch.long),
        torch.where(is_elig, torch.where(nan, 2, 1), 3),
    )
    # sinks and recent blocks rank by index (lowest first), so give them one equal top key
    key = torch.where(forced, torch.full_like(s, float("inf")), key)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    cat_sorted = torch.gather(category, -1, order)
    order2 = torch.sort(cat_sorted, dim=-1, stable=True).indices
    order = torch.gather(order, -1, order2)  # best first
    kk = min(max_k, N)
    top = order[..., :kk]
    keep = torch.arange(kk, device=dev).view(1, 1, kk) < c
    top = torch.where(keep, top, torch.full_like(top, N))  # N sorts after every index
    top = torch.sort(top, dim=-1).values
    top = torch.where(top == N, torch.full_like(top, -1), top)
    out = torch.full((B, H, max_k), -1, dtype=torch.int32, device=dev)
    out[..., :kk] = top.to(torch.int32)
    return out


def sparse_draft_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_indices: Tensor,
    tail_start: Tensor,
    seq_lens: Tensor,
    block_size: int,
    scale: float,
) -> Tensor:
    """Reference of :func:`vegas_ext.ops.sparse_draft_attention` (same contract)."""
    allowed = draft_allowed_mask(q, k_cache, block_indices, tail_start, seq_lens, block_size)
    out, _, _ = masked_attention(q, k_cache, v_cache, allowed, scale)
    return out


def draft_allowed_mask(
    q: Tensor, k_cache: Tensor, block_indices: Tensor, tail_start: Tensor, seq_lens: Tensor, block_size: int
) -> Tensor:
    """[B, H_q, Q, S] bool: which tokens each draft query may attend to."""
    B, Q, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    dev = q.device
    nblocks = math.ceil(S / block_size)
    sel = torch.zeros(B, Hkv, nblocks + 1, dtype=torch.bool, device=dev)
    bi = block_indices.long()
    bi = torch.where(bi < 0, torch.full_like(bi, nblocks), bi)  # -1 -> dummy slot
    sel.scatter_(2, bi, True)
    sel = sel[..., :nblocks]
    t = torch.arange(S, device=dev)
    tok_sel = sel.repeat_interleave(block_size, dim=2)[..., :S]  # [B, Hkv, S]
    tok_sel = tok_sel & (t.view(1, 1, S) < tail_start.long().view(B, 1, 1))
    causal = causal_allowed_mask(seq_lens, Q, S, dev)  # [B, Q, S]
    in_tail = t.view(1, S) >= tail_start.long().view(B, 1)  # [B, S]
    allowed = (tok_sel.unsqueeze(2) | in_tail.view(B, 1, 1, S)) & causal.unsqueeze(1)  # [B,Hkv,Q,S]
    return allowed.repeat_interleave(group, dim=1)  # [B, Hq, Q, S]


def block_minmax_update(
    key_min: Tensor, key_max: Tensor, k_cache: Tensor, seq_lens: Tensor, start: Tensor, block_size: int
) -> None:
    """Reference of :func:`vegas_ext.ops.block_minmax_update` (in place, same contract)."""
    B, Hkv, S, D = k_cache.shape
    N = key_min.shape[2]
    for b in range(B):
        L = int(seq_lens[b])
        j0, j1 = int(start[b]) // block_size, min(N, -(-L // block_size))
        for j in range(j0, j1):
            blk = k_cache[b, :, j * block_size : min((j + 1) * block_size, L)].float()  # [Hkv, n, D]
            key_min[b, :, j] = blk.amin(dim=1).to(key_min.dtype)
            key_max[b, :, j] = blk.amax(dim=1).to(key_max.dtype)


def quest_block_scores(q: Tensor, key_min: Tensor, key_max: Tensor, num_blocks: Tensor) -> Tensor:
    """Reference of :func:`vegas_ext.ops.quest_block_scores` (same contract)."""
    B, Q, Hq, D = q.shape
    Hkv, N = key_min.shape[1], key_min.shape[2]
    G = Hq // Hkv
    qf = q.float().view(B, Q, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, Q * G, 1, D)
    mx = key_max.float().unsqueeze(2)  # [B, Hkv, 1, N, D]
    mn = key_min.float().unsqueeze(2)
    s = torch.maximum(qf * mx, qf * mn).sum(-1).sum(2)  # [B, Hkv, N]
    valid = torch.arange(N, device=q.device).view(1, 1, N) < num_blocks.long().view(B, 1, 1)
    return torch.where(valid, s, torch.full_like(s, float("-inf")))


def paged_block_scores(
    q: Tensor,
    key_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    num_queries: int,
    scale: float,
) -> Tensor:
    """Reference of :func:`vegas_ext.ops.paged_block_scores` (same contract)."""
    ps = key_cache.shape[2]
    tok = paged_token_scores(q, key_cache, block_table, seq_lens, query_start_loc, num_queries, scale)
    return tok.view(tok.shape[0], tok.shape[1], -1, ps).sum(-1)


def paged_token_scores(
    q: Tensor,
    key_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    num_queries: int,
    scale: float,
    score_block_size: int = 1,
) -> Tensor:
    """:func:`paged_block_scores` per block of ``score_block_size`` logical tokens instead of per
    page: ``[R, H_kv, ceil(max_pages * page_size / score_block_size)]`` float32 (block ``j`` holds
    tokens ``[j * score_block_size, (j + 1) * score_block_size)``)."""
    R, P = block_table.shape
    Hq, D = q.shape[1], q.shape[2]
    Hkv, ps = key_cache.shape[1], key_cache.shape[2]
    G = Hq // Hkv
    out = torch.zeros(R, Hkv, P * ps, dtype=torch.float32, device=q.device)
    for r in range(R):
        q0, q1, L = int(query_start_loc[r]), int(query_start_loc[r + 1]), int(seq_lens[r])
        n = min(q1 - q0, num_queries)
        if n <= 0 or L <= 0:
            continue
        npg = -(-L // ps)
        # [H_kv, npg * ps, D] -> the request's first L tokens
        k = key_cache[block_table[r, :npg].long()].float().permute(1, 0, 2, 3).reshape(Hkv, npg * ps, D)[:, :L]
        qr = q[q1 - n : q1].float().view(n, Hkv, G, D)
        s = torch.einsum("nhgd,htd->hngt", qr, k) * scale  # [H_kv, n, G, L]
        pos = torch.arange(L - n, L, device=q.device).view(1, n, 1, 1)
        s = s.masked_fill(torch.arange(L, device=q.device).view(1, 1, 1, L) > pos, float("-inf"))
        out[r, :, :L] = torch.softmax(s, dim=-1).sum(dim=(1, 2))  # [H_kv, L]
    b = score_block_size
    nb = -(-P * ps // b)
    return torch.nn.functional.pad(out, (0, nb * b - P * ps)).view(R, Hkv, nb, b).sum(-1)


def paged_verify_attention(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    num_queries: int,
    scale: float,
    score_block_size: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """Reference of :func:`vegas_ext.ops.paged_verify_attention` (same contract): causal attention
    of every packed query over its request's pages (fp32 math), and
    :func:`paged_token_scores` of the same call (per page by default)."""
    R = block_table.shape[0]
    Hq, D = q.shape[1], q.shape[2]
    Hkv, ps = key_cache.shape[1], key_cache.shape[2]
    G = Hq // Hkv
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for r in range(R):
        q0, q1, L = int(query_start_loc[r]), int(query_start_loc[r + 1]), int(seq_lens[r])
        ql = q1 - q0
        if ql <= 0:
            continue
        npg = -(-L // ps)
        pages = block_table[r, :npg].long()
        k = key_cache[pages].float().permute(1, 0, 2, 3).reshape(Hkv, npg * ps, D)[:, :L]
        v = value_cache[pages].float().permute(1, 0, 2, 3).reshape(Hkv, npg * ps, D)[:, :L]
        qr = q[q0:q1].float().view(ql, Hkv, G, D)
        s = torch.einsum("nhgd,htd->hgnt", qr, k) * scale  # [H_kv, G, ql, L]
        pos = torch.arange(L - ql, L, device=q.device).view(1, 1, ql, 1)
        s = s.masked_fill(torch.arange(L, device=q.device).view(1, 1, 1, L) > pos, float("-inf"))
        o = torch.einsum("hgnt,htd->nhgd", torch.softmax(s, dim=-1), v)  # [ql, H_kv, G, D]
        out[q0:q1] = o.reshape(ql, Hq, D)
    b = ps if score_block_size is None else min(score_block_size, max(block_table.shape[1] * ps, 1))
    scores = paged_token_scores(q, key_cache, block_table, seq_lens, query_start_loc, num_queries, scale, b)
    return out.to(q.dtype), scores


def paged_sparse_draft_attention(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    token_indices: Tensor,
    tail_start: Tensor,
    scale: float,
) -> Tensor:
    """Reference of :func:`vegas_ext.ops.paged_sparse_draft_attention` (same contract): per
    request, a dense [H_kv, q_len, L] mask of the selected tokens before the tail plus the causal
    tail, fp32 math."""
    R = block_table.shape[0]
    Hq, D = q.shape[1], q.shape[2]
    Hkv, ps = key_cache.shape[1], key_cache.shape[2]
    G = Hq // Hkv
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for r in range(R):
        q0, q1, L, ts = (int(x) for x in (query_start_loc[r], query_start_loc[r + 1], seq_lens[r], tail_start[r]))
        ql = q1 - q0
        if ql <= 0:
            continue
        npg = -(-L // ps)
        pages = block_table[r, :npg].long()
        k = key_cache[pages].float().permute(1, 0, 2, 3).reshape(Hkv, npg * ps, D)[:, :L]
        v = value_cache[pages].float().permute(1, 0, 2, 3).reshape(Hkv, npg * ps, D)[:, :L]
        t = torch.arange(L, device=q.device)
        sel = torch.zeros(Hkv, L + 1, dtype=torch.bool, device=q.device)
        ti = token_indices[r].long()
        sel.scatter_(1, torch.where((ti >= 0) & (ti < ts), ti, torch.full_like(ti, L)), True)
        pos = torch.arange(L - ql, L, device=q.device).view(ql, 1)
        tail = (t.view(1, L) >= ts) & (t.view(1, L) <= pos)  # [ql, L]
        allowed = sel[:, :L].view(Hkv, 1, L) | tail.view(1, ql, L)  # [H_kv, ql, L]
        qr = q[q0:q1].float().view(ql, Hkv, G, D)
        s = torch.einsum("nhgd,htd->hgnt", qr, k) * scale  # [H_kv, G, ql, L]
        s = s.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        o = torch.einsum("hgnt,htd->nhgd", torch.softmax(s, dim=-1), v)
        out[q0:q1] = o.reshape(ql, Hq, D)
    return out.to(q.dtype)


def weight_only_linear(x: Tensor, weight: Tensor, scales: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                       group_size: int = 64) -> Tensor:
    """``x . W^T (+ bias)`` with ``W`` dequantized to float32 first: ``weight.float()`` for
    float16, ``weight * scales`` repeated over each group of ``group_size`` columns for int8. A
    packed int8 weight is unpacked, and x rounded as the kernel rounds it: per row and group, to
    nearest-even multiples of ``max |x| / 32767`` (NaN for a group holding an inf or NaN, 0 for a
    group whose max is below ~1e-34). Shapes: see :func:`vegas_ext.ops.weight_only_linear`."""
    if weight.dim() == 4:  # [ceil(N/16), ceil(K/2), 16, 2] -> [N, K]
        N, K = scales.shape[0], x.shape[-1]
        weight = weight.permute(0, 2, 1, 3).reshape(weight.shape[0] * 16, weight.shape[1] * 2)[:N, :K]
        x = _round_to_int16_steps(x.float(), group_size)
    K = weight.shape[1]
    w = weight.float()
    if scales is not None:
        w = w * scales.float().repeat_interleave(group_size, dim=1)[:, :K]
    return torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())


def _round_to_int16_steps(x: Tensor, group_size: int) -> Tensor:
    """x [..., K] float32 on the int16 grid of each (row, group of ``group_size``) (see above)."""
    K = x.shape[-1]
    ng = -(-K // group_size)
    xg = torch.nn.functional.pad(x, (0, ng * group_size - K)).unflatten(-1, (ng, group_size))
    amax = xg.abs().amax(-1, keepdim=True)
    finite = torch.isfinite(xg).all(-1, keepdim=True)
    inv = torch.where(finite & (amax > 0), 32767.0 / amax, torch.zeros_like(amax))
    inv = torch.where(inv <= 3.4e38, inv, torch.zeros_like(inv))
    step = torch.where(finite, amax / 32767.0, torch.full_like(amax, float("nan")))
    q = torch.where(finite, torch.round(torch.nan_to_num(xg) * inv), torch.zeros_like(xg))
    return (q * step).flatten(-2)[..., :K]


def rope_kv_write(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                  write_pos: Tensor) -> Tensor:
    """transformers' ``apply_rotary_pos_emb`` ("rotate_half" layout) on ``q`` and ``k`` with
    ``cos`` / ``sin`` ``[B, Q, D]``, then the rotated keys and ``v`` written into ``k_cache`` /
    ``v_cache`` ``[B, H_kv, S, D]`` at ``write_pos`` ``[B, Q]`` as :meth:`VegasCache.update
    <vegas_ext.cache.VegasCacheLayer.update>` writes them; returns the rotated ``q``, contiguous.
    Shapes: see :func:`vegas_ext.ops.rope_kv_write`."""
    c, s = cos[:, :, None], sin[:, :, None]

    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    q_out = (q * c) + (rot(q) * s)
    rows = torch.arange(q.shape[0], device=q.device)[:, None]
    k_cache[rows, :, write_pos] = ((k * c) + (rot(k) * s)).to(k_cache.dtype)
    v_cache[rows, :, write_pos] = v.to(v_cache.dtype)
    return q_out.contiguous()


def add_rms_norm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float) -> Tensor:
    """``x += residual`` (in place, when given), then transformers' ``LlamaRMSNorm`` of ``x``:
    ``weight * (x / sqrt(mean(x^2, -1) + eps))`` computed in float32, in ``x``'s dtype.
    Shapes: see :func:`vegas_ext.ops.add_rms_norm`."""
    if residual is not None:
        x.add_(residual)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]`` (``gate_up`` ``[..., 2 * I]``): the gated
    activation of a Llama-family MLP on its fused gate/up projection."""
    g, u = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u
