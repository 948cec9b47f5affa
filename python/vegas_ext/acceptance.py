"""Acceptance rules of the decode loop: greedy verification, speculative sampling, warpers.

* :func:`greedy_accept`: the longest prefix of drafts equal to the target's argmax, then the
  target's token.
* :func:`speculative_accept`: speculative sampling (Leviathan et al., "Fast Inference from
  Transformers via Speculative Decoding", ICML 2023; Chen et al., "Accelerating Large Language
  Model Decoding with Speculative Sampling", 2023): the output follows the target distribution for
  any draft distribution and any number of drafts.
* :func:`make_warpers` / :func:`probs`: transformers' temperature / top-k / top-p warpers, applied
  alike to the draft and the target distributions.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

__all__ = ["make_warpers", "probs", "greedy_accept", "speculative_accept"]

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


def probs(logits: Tensor, warpers: LogitsProcessorList) -> Tensor:
    """Warped probabilities ``[..., V]`` float32 of ``logits`` ``[..., V]`` (softmax after ``warpers``)."""
    shape = logits.shape
    x = logits.reshape(-1, shape[-1]).float()
    if len(warpers):
        x = warpers(None, x)
    return torch.softmax(x, dim=-1).view(shape)


def greedy_accept(drafts: Tensor, target_logits: Tensor, num_drafts: Optional[Tensor] = None):
    """Greedy verification.

    Args:
        drafts: ``[B, g]`` int64 draft tokens.
        target_logits: ``[B, g + 1, V]`` target logits at the positions of the last target token and
            the ``g`` drafts.
        num_drafts: optional ``[B]`` int64, row ``b`` verifies only its first ``num_drafts[b]``
            drafts (``<= g``; its logits past ``num_drafts[b]`` are never read). Default: all ``g``.

    Returns:
        ``(a, t)``: ``[B]`` accepted draft counts (longest prefix equal to the target's argmax) and
        ``[B]`` the target's token after them (the correction, or the bonus if all ``g`` pass).
    """
    tgt = target_logits.argmax(-1)
    g = drafts.shape[1]
    if g:
        a = (drafts == tgt[:, :g]).long().cumprod(1).sum(1)
        if num_drafts is not None:
            a = torch.minimum(a, num_drafts)
    else:
        a = torch.zeros(drafts.shape[0], dtype=torch.long, device=drafts.device)
    t = tgt.gather(1, a[:, None])[:, 0]
    return a, t


def speculative_accept(drafts: Tensor, q: Tensor, p: Tensor, generator: Optional[torch.Generator] = None,
                       num_drafts: Optional[Tensor] = None):
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023), vectorized over rows.

    Draft ``j`` is accepted with probability ``min(1, p_j(x) / q_j(x))``; at the first rejection the
    token is drawn from ``normalize(max(p_a - q_a, 0))`` (from ``p_a`` if that residual has no mass,
    e.g. ``p == q``: never NaN); if all pass, from ``p_g``. The output is distributed as ``p``.

    Args:
        drafts: ``[B, g]`` int64 draft tokens, drawn from ``q``.
        q: ``[B, g, V]`` float32, exactly the (warped) distributions the drafts were drawn from.
        p: ``[B, g + 1, V]`` float32 warped target distributions.
        generator: optional ``torch.Generator`` (reproducible runs).
        num_drafts: optional ``[B]`` int64, row ``b`` verifies only its first ``num_drafts[b]``
            drafts (``<= g``): if all of those pass, its next token is drawn from
            ``p[b, num_drafts[b]]``, as if it had drafted no more. Default: all ``g``.

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
        if num_drafts is not None:  # a row past its own drafts takes the bonus token from p
            a = torch.minimum(a, num_drafts)
            q = torch.where((torch.arange(g, device=q.device)[None, :] < num_drafts[:, None])[..., None], q, 0.0)
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
