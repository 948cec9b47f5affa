"""A lean forward for Vegas's draft steps: the decoder layers without transformers' per-layer Python.

A draft step of a small model on CPU is short (SmolLM2-135M with int8 draft weights: ~20 ms), so
what runs around the kernels counts: through the model's own ``forward`` each of the 30 layers
passes a dozen ``nn.Module`` calls and decorators, an RMSNorm of seven ops, a RoPE of a dozen, the
K/V write and the attention wrapper's bookkeeping -- ~0.4 ms per layer, as much as the sparse
attention and the linears of a layer together (issue 33). :class:`LeanDraft` runs the same
computation with fewer calls:

* each residual add and the RMSNorm after it in one op, :func:`vegas_ext.ops.add_rms_norm`;
  q/k/v, and gate/up, as one kernel call each on the fused low-precision copies
  (:class:`~vegas_ext.draft_weights.DraftWeights` stores them so), the gated activation on the
  fused gate/up output in one op, :func:`vegas_ext.ops.silu_mul`;
* RoPE on q and k and the K/V write into the cache in one op, :func:`vegas_ext.ops.rope_kv_write`;
* the cos/sin of the positions once per forward (the model's own rotary module), the attention
  straight to :func:`vegas_ext.ops.sparse_draft_attention`, the logits of the last position only.

Only the drafts take it: they are guesses that the verification (the model's own ``forward``,
unchanged) accepts or rejects, so the output stays plain decoding's whatever the drafts are.
Their values are still the model's, computed in another order (equal up to float32 rounding on
the models tested). The K/V a draft writes are rewritten by the verification of those positions
before anything else reads them, as before.

Taken for ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and
``MistralForCausalLM`` with float32 weights on CPU, SiLU MLPs, full RoPE (no partial rotary) and
no hooks or replaced ``forward`` on any module (besides the draft weights' own wrapper); any other
model drafts through its own ``forward`` (:func:`lean_draft` returns ``None``).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import ops
from .draft_weights import own_forward

__all__ = ["LeanDraft", "lean_draft"]

#: ``*ForCausalLM`` classes whose decoder layers :class:`LeanDraft` reproduces
_MODELS = {
    "LlamaForCausalLM": "LlamaDecoderLayer",
    "Qwen2ForCausalLM": "Qwen2DecoderLayer",
    "Qwen3ForCausalLM": "Qwen3DecoderLayer",
    "MistralForCausalLM": "MistralDecoderLayer",
}
_SILU = ("silu", "swish")


# the lean forward runs on CPU only, straight to the kernels (~200 calls per draft step)
_WOL = ops.cpu_op("weight_only_linear")
_ADD_RMS_NORM = ops.cpu_op("add_rms_norm")
_ROPE_KV_WRITE = ops.cpu_op("rope_kv_write")
_ATTEND = ops.cpu_op("sparse_draft_attention")
_SILU_MUL = ops.cpu_op("silu_mul")


def _norm(mod: nn.Module) -> Optional[Tuple[Tensor, float]]:
    """``(weight, eps)`` of an HF RMSNorm (``weight * x / sqrt(mean(x^2) + eps)``), else None."""
    w, eps = getattr(mod, "weight", None), getattr(mod, "variance_epsilon", None)
    if not type(mod).__name__.endswith("RMSNorm") or not isinstance(w, Tensor) or eps is None:
        return None
    return w, float(eps)


def _plain_module(m: nn.Module) -> bool:
    """No hooks and no replaced ``forward``."""
    return not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks) and (
        "forward" not in m.__dict__)


def _linear_fn(dw, mod: nn.Module) -> Callable[[Tensor], Tensor]:
    """``x -> mod(x)`` on the module's low-precision copy when ``dw`` holds one, else the module."""
    c = dw.copy_of(mod) if dw is not None else None
    if c is None or c.weight.device.type != "cpu":
        fwd = own_forward(type(mod))  # not the draft weights' wrapper: it would only pass it on
        return lambda x: fwd(mod, x)
    w, s, b, gs = c.weight, c.scales, c.bias, _group_size()
    return lambda x: _WOL(x, w, s, b, gs)


def _qkv_fn(dw, mods, heads) -> Callable[[Tensor], List[Tensor]]:
    """``h [B, Q, hidden] -> (q, k, v)`` as ``[B, Q, H, D]`` (views), in one kernel call when
    ``dw`` holds the fused q/k/v copy."""
    hq, hkv, d = heads
    f = dw.fused(mods) if dw is not None else None
    if f is None:
        fq, fk, fv = (_linear_fn(dw, m) for m in mods)
        return lambda x: (fq(x).view(*x.shape[:-1], hq, d), fk(x).view(*x.shape[:-1], hkv, d),
                          fv(x).view(*x.shape[:-1], hkv, d))
    w, s, b, gs, nh = f.weight, f.scales, f.bias, _group_size(), [hq, hkv, hkv]
    return lambda x: _WOL(x, w, s, b, gs).view(*x.shape[:-1], hq + 2 * hkv, d).split_with_sizes(nh, -2)


def _act_fn(dw, mods) -> Callable[[Tensor], Tensor]:
    """``h -> silu(gate(h)) * up(h)``, in two calls when ``dw`` holds the fused gate/up copy."""
    f = dw.fused(mods) if dw is not None else None
    if f is None:
        fg, fu = (_linear_fn(dw, m) for m in mods)
        return lambda x: F.silu(fg(x)).mul_(fu(x))
    w, s, b, gs, act = f.weight, f.scales, f.bias, _group_size(), _SILU_MUL
    return lambda x: act(_WOL(x, w, s, b, gs))


def _group_size() -> int:
    from .draft_weights import INT8_GROUP_SIZE

    return INT8_GROUP_SIZE


class _Layer:
    __slots__ = ("n1", "n2", "qkv", "o", "act", "down", "qn", "kn", "scaling")


class LeanDraft:
    """The draft forward of one model with one set of draft weights (build with :func:`lean_draft`).

    Call it as ``lean(ids, pos, state)``: ``ids`` / ``pos`` ``[B, Q]`` int64 tokens and positions,
    ``state`` the active :class:`~vegas_ext.attention.AttentionState` in ``"draft"`` mode with
    ``state.cache.begin_forward(Q, ...)`` done; returns the logits of the last position,
    ``[B, 1, V]`` float32, and writes each layer's K/V of the new tokens into the cache (the
    state's ``write_hook`` and ``draft_hook`` are honoured per layer as the attention wrapper does).

    ``lean(ids, pos, state, rows=rows)`` (``rows`` ``[R]`` int64 batch rows, ascending; ``Q = 1``,
    no ``draft_hook``) drafts those rows only: ``ids`` / ``pos`` ``[R, 1]``, logits ``[R, 1, V]``.
    The linears -- most of a draft step's work at a few rows -- run on the ``R`` rows; RoPE, the K/V
    write and the sparse attention run on the whole batch (the other rows' inputs are zeros: what
    they write lies past their verified tokens, rewritten before it is read).
    """

    def __init__(self, model: nn.Module, dw, layers: List[_Layer], heads: Tuple[int, int, int]):
        base = model.model
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm = _norm(base.norm)
        self.lm_head = _linear_fn(dw, model.lm_head)
        self.layers = layers
        self.hq, self.hkv, self.d = heads
        self.hidden = model.config.hidden_size

    def __call__(self, ids: Tensor, pos: Tensor, state, rows: Optional[Tensor] = None) -> Tensor:
        cache = state.cache
        B, Q = ids.shape
        hq, d = self.hq, self.d
        x = self.embed(ids)  # a new tensor: the residual stream is updated in place below
        cos, sin = self.rotary(x, pos)  # [B, Q, D]: the model's own rotation (RoPE type, scaling)
        if rows is not None:
            if state.draft_hook is not None or Q != 1:
                raise ValueError("LeanDraft: rows= needs one token per row and no draft_hook")
            return self._rows(x, cos, sin, state, rows)
        write_pos, seq_lens, tail, bs = cache._write_pos, cache.seq_lens, state.tail_start, state.block_size
        write_hook, draft_hook = state.write_hook, state.draft_hook
        indices = state.block_indices.unbind(0) if draft_hook is None else None  # one call, not one per layer
        norm, rope_kv, attend = _ADD_RMS_NORM, _ROPE_KV_WRITE, _ATTEND
        delta = None  # the previous layer's MLP output, added to x by the next norm
        for i, L in enumerate(self.layers):
            h = norm(x, delta, L.n1[0], L.n1[1])
            q, k, v = L.qkv(h)
            if L.qn is not None:  # Qwen3: RMSNorm of each head before the rotation
                q, k = norm(q.contiguous(), None, L.qn[0], L.qn[1]), norm(k.contiguous(), None, L.kn[0], L.kn[1])
            cl = cache.layers[i]
            keys, values = cl.keys, cl.values
            q = rope_kv(q, k, v, cos, sin, keys, values, write_pos)
            if write_hook is not None:
                write_hook(i, keys, seq_lens - Q)
            idx = draft_hook(i, q, keys, values) if draft_hook is not None else indices[i]
            o = attend(q, keys, values, idx, tail, seq_lens, bs, L.scaling)
            h = norm(x, L.o(o.view(B, Q, hq * d)), L.n2[0], L.n2[1])
            delta = L.down(L.act(h))
        x = x[:, -1:]
        return self.lm_head(norm(x.contiguous(), delta[:, -1:], self.norm[0], self.norm[1]))


    def _rows(self, x: Tensor, cos: Tensor, sin: Tensor, state, rows: Tensor) -> Tensor:
        """The draft step of the batch rows ``rows`` only (see the class docstring): ``x``, ``cos``,
        ``sin`` ``[R, 1, .]`` of those rows; returns their logits ``[R, 1, V]``."""
        cache = state.cache
        R, B = x.shape[0], cache.lengths.shape[0]
        hq, hkv, d = self.hq, self.hkv, self.d
        write_pos, seq_lens, tail, bs = cache._write_pos, cache.seq_lens, state.tail_start, state.block_size
        write_hook = state.write_hook
        cos_b = cos.new_zeros((B,) + cos.shape[1:]).index_copy_(0, rows, cos)
        sin_b = sin.new_zeros((B,) + sin.shape[1:]).index_copy_(0, rows, sin)
        qb, kb, vb = (x.new_zeros((B, 1, h, d)) for h in (hq, hkv, hkv))  # other rows: zeros
        indices = state.block_indices.unbind(0)
        norm, rope_kv, attend = _ADD_RMS_NORM, _ROPE_KV_WRITE, _ATTEND
        delta = None
        for i, L in enumerate(self.layers):
            h = norm(x, delta, L.n1[0], L.n1[1])
            q, k, v = L.qkv(h)
            if L.qn is not None:
                q, k = norm(q.contiguous(), None, L.qn[0], L.qn[1]), norm(k.contiguous(), None, L.kn[0], L.kn[1])
            qb.index_copy_(0, rows, q)
            kb.index_copy_(0, rows, k)
            vb.index_copy_(0, rows, v)
            cl = cache.layers[i]
            keys, values = cl.keys, cl.values
            qr = rope_kv(qb, kb, vb, cos_b, sin_b, keys, values, write_pos)
            if write_hook is not None:
                write_hook(i, keys, seq_lens - 1)
            o = attend(qr, keys, values, indices[i], tail, seq_lens, bs, L.scaling).index_select(0, rows)
            h = norm(x, L.o(o.view(R, 1, hq * d)), L.n2[0], L.n2[1])
            delta = L.down(L.act(h))
        return self.lm_head(norm(x, delta, self.norm[0], self.norm[1]))


def lean_draft(model: nn.Module, dw=None) -> Optional[LeanDraft]:
    """A :class:`LeanDraft` of ``model`` whose linears read ``dw`` 's copies (a
    :class:`~vegas_ext.draft_weights.DraftWeights`, or ``None`` for the model's own linears), or
    ``None`` where the model is not one it reproduces (see the module docstring): then the drafts
    run through ``model``'s own ``forward``. Built once per decoding call; the copies it reads are
    those current when it is built."""
    name = type(model).__name__
    layer_type = _MODELS.get(name)
    base = getattr(model, "model", None)
    cfg = getattr(model, "config", None)
    if layer_type is None or base is None or cfg is None:
        return None
    if getattr(cfg, "hidden_act", None) not in _SILU or float(getattr(cfg, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return None
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in model.parameters()):
        return None
    from torch.nn.modules import module as _m

    if _m._global_forward_hooks or _m._global_forward_pre_hooks:
        return None
    if not all(_plain_module(m) for m in model.modules()):
        return None
    layers_mod = getattr(base, "layers", None)
    n = int(getattr(cfg, "num_hidden_layers", -1))
    if layers_mod is None or len(layers_mod) != n or n < 1:
        return None
    if not isinstance(getattr(base, "embed_tokens", None), nn.Embedding) or getattr(base, "rotary_emb", None) is None \
            or _norm(getattr(base, "norm", None)) is None or getattr(model, "lm_head", None) is None:
        return None
    heads = None
    layers = []
    for lay in layers_mod:
        if type(lay).__name__ != layer_type:
            return None
        a, m = getattr(lay, "self_attn", None), getattr(lay, "mlp", None)
        projs = [getattr(a, p, None) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        mlps = [getattr(m, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
        if any(not isinstance(p, nn.Module) for p in projs + mlps):
            return None
        d = getattr(a, "head_dim", None)
        if not isinstance(d, int) or d < 1:
            return None
        hq = getattr(projs[0], "out_features", 0) // d
        hkv = getattr(projs[1], "out_features", 0) // d
        if heads is None:
            heads = (hq, hkv, d)
        if (hq, hkv, d) != heads or hq < 1 or hkv < 1:
            return None
        L = _Layer()
        L.n1, L.n2 = _norm(lay.input_layernorm), _norm(lay.post_attention_layernorm)
        if L.n1 is None or L.n2 is None:
            return None
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        L.qn, L.kn = (_norm(qn), _norm(kn)) if qn is not None else (None, None)
        if (qn is not None) and (L.qn is None or L.kn is None):
            return None
        L.qkv = _qkv_fn(dw, tuple(projs[:3]), heads)
        L.o = _linear_fn(dw, projs[3])
        L.act = _act_fn(dw, tuple(mlps[:2]))
        L.down = _linear_fn(dw, mlps[2])
        L.scaling = float(getattr(a, "scaling", d ** -0.5))
        layers.append(L)
    return LeanDraft(model, dw, layers, heads)
