"""The ``torch.ops.vegas`` ops as a transformers attention implementation (the ``"vegas"`` backend).

Plugs into transformers' own extension points (no copied model code):

* ``transformers.AttentionInterface.register("vegas", vegas_attention_forward)``;
* ``transformers.AttentionMaskInterface.register("vegas", vegas_attention_mask)``, so that while
  our decode loop runs HF builds no ``O(S)`` masks (the ops take per-row lengths instead), and
  otherwise the usual SDPA mask is built;
* ``model.set_attn_implementation("vegas")`` in :func:`patch_model` (undone by
  :func:`unpatch_model`, or scoped with :func:`patched`).

While :mod:`vegas_ext.decode` runs a model, an :class:`AttentionState` is active (a context
variable) and each layer's attention is, by ``state.mode``:

* ``"prefill"``: plain causal attention over the new tokens (PyTorch SDPA, ``is_causal=True``,
  GQA without repeating K/V); the cache must be empty (rows left-aligned at position 0). SDPA
  rather than ``verify_attention``: 43 vs 206 ms for a 2K-token prompt per layer call (9/3 heads,
  CPU), and prefill needs no block scores;
* ``"verify"``: :func:`vegas_ext.ops.verify_attention` over the whole cache; the per-layer block
  scores (``[B, H_kv, N]``) go into ``state.block_scores[layer]``;
* ``"draft"``: :func:`vegas_ext.ops.sparse_draft_attention` over ``state.block_indices[layer]``
  plus the tail ``[state.tail_start, seq_lens)``.

With no active state (ordinary ``model(...)`` / ``model.generate`` on a patched model) the call
goes to transformers' own ``sdpa`` attention with its usual mask: results equal the unpatched
model's.

The ``custom_generate`` glue for HF's own ``model.generate`` lives in :mod:`vegas_ext.hf`.

Supported: ``LlamaForCausalLM`` (SmolLM2, Llama 2/3, TinyLlama), ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``MistralForCausalLM``. Sliding-window configs are refused unless the window
covers the needed context. Method: Vegas, arXiv 2602.07223.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import config, model_state, ops
from .cache import VegasCache
from .compiled_steps import in_compiled_step

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SUPPORTED_MODEL_TYPES",
    "AttentionState",
    "check_model_supported",
    "SUPPORTED_ROPE_TYPES",
    "patch_model",
    "unpatch_model",
    "patched",
    "vegas_attention_forward",
    "vegas_attention_mask",
]

ATTN_IMPLEMENTATION = "vegas"
SUPPORTED_MODEL_TYPES = config.SUPPORTED_MODEL_TYPES

_ACTIVE: contextvars.ContextVar[Optional["AttentionState"]] = contextvars.ContextVar("vegas_attention_state",
                                                                                     default=None)


@dataclass
class AttentionState:
    """What the attention function needs during one of our forwards.

    Attributes:
        cache: the :class:`~vegas_ext.cache.VegasCache` the model writes into (its ``seq_lens`` give
            the valid tokens per row during the forward).
        mode: ``"prefill"``, ``"verify"`` or ``"draft"``.
        block_size: tokens per block for scores and selection.
        query_weights: ``None`` (every verification query counts) or a function ``Q -> [Q]`` float32
            tensor of weights for ``verify_attention``.
        block_scores: ``[L, B, H_kv, N]`` float32, filled by each layer in ``"verify"`` mode.
        score_decay: the next verification stores ``score_decay * block_scores + its scores``
            (the loop sets it to 0 after a verification that did not score: no stale mass).
        block_indices: ``[L, B, H_kv, K]`` int32 selected blocks for ``"draft"`` mode (``-1`` unused).
        tail_start: ``[B]`` int32, start of the draft tail (the last verification window).
        draft_hook: optional ``(layer_idx, q [B,Q,H_q,D], k_cache, v_cache) -> [B, H_kv, K]`` int32
            indices, called per layer in draft mode instead of reading ``block_indices`` (for
            query-aware selection such as Quest).
        write_hook: optional ``(layer_idx, k_cache [B,H_kv,S,D], start [B] int32) -> None``, called per
            layer in every mode right after the layer's new K/V were written at
            ``[start[b], cache.seq_lens[b])`` (keeps per-block metadata current, e.g. Quest's key
            min/max; rollbacks are covered because rewritten positions are reported again).
        layer_calls: attention calls served since the last :meth:`check_forward` (the decode loop
            checks that every layer of every forward came through here).
        packed: ``None``, or for a forward whose rows' tokens are packed into one sequence
            (:meth:`VegasCache.begin_packed_forward`, input ``[1, N]``) the ``(row, start, count)``
            of every row with tokens in it: row ``row``'s tokens are ``[start, start + count)``
            of the sequence, and its attention runs on them alone (``"verify"`` mode).
    """

    cache: VegasCache
    mode: str = "prefill"
    block_size: int = 16
    query_weights: Optional[Callable[[int], Optional[Tensor]]] = None
    block_scores: Optional[Tensor] = None
    score_decay: float = 0.0
    block_indices: Optional[Tensor] = None
    tail_start: Optional[Tensor] = None
    draft_hook: Optional[Callable] = None
    write_hook: Optional[Callable] = None
    layer_calls: int = 0
    packed: Optional[List[tuple]] = None
    _qw_cache: dict = field(default_factory=dict)

    @contextlib.contextmanager
    def activate(self) -> Iterator["AttentionState"]:
        """Make this the active state of the current context (thread / task) for the block."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def check_forward(self, num_layers: int) -> None:
        """Raise ``RuntimeError`` unless exactly ``num_layers`` attention calls went through the
        ``"vegas"`` implementation since the last check (then reset the count). Catches a model
        whose attention implementation was switched while our forward ran (e.g. by another
        thread), which would otherwise change tokens silently."""
        calls, self.layer_calls = self.layer_calls, 0
        if calls != num_layers:
            raise RuntimeError(
                f"vegas: {calls} of {num_layers} attention layers ran through the vegas attention implementation "
                "in this forward: the model's attention implementation was changed while a vegas decode was "
                "running on it (another thread called set_attn_implementation?)"
            )

    def weights_for(self, q_len: int) -> Optional[Tensor]:
        if self.query_weights is None:
            return None
        w = self._qw_cache.get(q_len)
        if w is None:
            w = self.query_weights(q_len)
            self._qw_cache[q_len] = w
        return w


def active_state() -> Optional[AttentionState]:
    """The :class:`AttentionState` active in this context, or ``None``."""
    return _ACTIVE.get()


def _state(kwargs: dict) -> Optional[AttentionState]:
    """The state of the forward: the ``vegas_state`` keyword the decode loop passes with the model's
    inputs (HF hands it down to every attention call; traceable by ``torch.compile``), else the
    context's active one (not read in a compiled step: ``ContextVar`` is not traceable)."""
    st = kwargs.pop("vegas_state", None)
    if st is not None or _compiling():
        return st
    return _ACTIVE.get()


_compiling = in_compiled_step


def vegas_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
):
    """transformers attention function (``AttentionInterface`` signature).

    Args:
        module: the HF attention module (gives ``layer_idx``).
        query: ``[B, H_q, Q, D]``; key, value: ``[B, H_kv, S, D]`` (in our modes: the whole cache
            buffers returned by :meth:`VegasCache.update`).
        attention_mask: HF's mask; ignored in our modes (``None`` there), used by the fallback.
        scaling: softmax scale (default ``D ** -0.5``).

    Returns:
        ``(out [B, Q, H_q, D], None)``.

    Raises:
        RuntimeError: in our modes, if the K/V are not our cache's buffers of that layer, or the
            prefill does not start from an empty cache.
    """
    st = _state(kwargs)
    if st is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layer = module.layer_idx
    st.layer_calls += 1
    cl = st.cache.layers[layer]
    if key is not cl.keys or value is not cl.values:
        raise RuntimeError(
            "vegas attention: the model did not write into the active VegasCache (pass it as the model's cache)"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    mode = st.mode
    if st.write_hook is not None:
        st.write_hook(layer, key, st.cache.write_start)
    if mode == "prefill":
        q_len = query.shape[2]
        out = F.scaled_dot_product_attention(
            query,
            key[:, :, :q_len],
            value[:, :, :q_len],
            is_causal=True,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None
    q = query.transpose(1, 2).contiguous()  # [B, Q, H_q, D]
    if st.packed is not None:
        if mode != "verify":
            raise RuntimeError(f"vegas attention: packed rows are verified only, not in mode {mode!r}")
        return _packed_verify(st, layer, q, key, value, float(scaling)), None
    if mode == "verify":
        out, _lse, scores = ops.verify_attention(
            q, key, value, st.cache.seq_lens, st.block_size, float(scaling), st.weights_for(q.shape[1])
        )
        if st.block_scores is not None:
            _store_scores(st.block_scores[layer], scores, st.score_decay)
        return out, None
    if mode == "draft":
        if st.draft_hook is not None:
            idx = st.draft_hook(layer, q, key, value)
        else:
            idx = st.block_indices[layer]
        out = ops.sparse_draft_attention(
            q, key, value, idx, st.tail_start, st.cache.seq_lens, st.block_size, float(scaling)
        )
        return out, None
    raise RuntimeError(f"vegas attention: unknown mode {mode!r}")


def _store_scores(into: Tensor, scores: Tensor, decay: float) -> None:
    """``into = decay * into + scores`` in place (``scores`` alone at 0)."""
    if decay:
        into.mul_(decay).add_(scores)
    else:
        into.copy_(scores)


_VERIFY_CPU = ops.cpu_op("verify_attention")


def _packed_verify(st: AttentionState, layer: int, q: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
    """Verification of packed rows (``q`` ``[1, N, H_q, D]``): each row's queries over its own
    cache row (views, no copies), its block scores into ``st.block_scores[layer, row]``; rows
    without tokens keep their scores. Returns ``[1, N, H_q, D]``."""
    out = torch.empty_like(q)
    seq = st.cache.seq_lens
    # the rows' slices of one checked forward: straight to the CPU kernel (4-8 calls per layer)
    verify = _VERIFY_CPU if q.device.type == "cpu" else ops.verify_attention
    for b, s, n in st.packed:
        o, _lse, scores = verify(q[:, s:s + n], key[b:b + 1], value[b:b + 1], seq[b:b + 1],
                                 st.block_size, scaling, st.weights_for(n))
        out[:, s:s + n] = o
        if st.block_scores is not None:
            _store_scores(st.block_scores[layer, b], scores[0], st.score_decay)
    return out


def vegas_attention_mask(*args, **kwargs):
    """transformers mask function (``AttentionMaskInterface`` signature): ``None`` while our decode
    loop runs (the ops mask by per-row lengths), else exactly transformers' ``sdpa_mask``."""
    if not _compiling() and _ACTIVE.get() is not None:
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(ATTN_IMPLEMENTATION, vegas_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, vegas_attention_mask)


# --------------------------------------------------------------------------- model checks / patching
def _uses_sliding_window(config) -> Optional[int]:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


#: RoPE types whose rotation depends on the position only: exact under any split into forwards
EXACT_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")
#: all RoPE types the decode loop accepts; see :func:`_check_rope` for the conditions on the last two
SUPPORTED_ROPE_TYPES = EXACT_ROPE_TYPES + ("dynamic", "longrope")
#: ``config.layer_types`` entries the attention handles (sliding ones only with a covering window)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def _rope_parameter_sets(config) -> List[tuple]:
    """``[(name, rope parameters dict)]`` of ``config``: one set, or one per layer type."""
    rp = getattr(config, "rope_parameters", None)
    if rp is None:
        rp = getattr(config, "rope_scaling", None)  # older configs
    if not rp:
        return [("config.rope_parameters", {})]
    if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):
        return [(f"config.rope_parameters[{k!r}]", v) for k, v in rp.items()]
    return [("config.rope_parameters", rp)]


def _grown_dynamic_rope(model) -> Optional[int]:
    """The position count a dynamic-NTK rotary module of ``model`` grew its frequencies to in an
    earlier forward past ``max_position_embeddings`` (HF keeps them until a shorter forward), or None."""
    for mod in model.modules():
        grown = getattr(mod, "max_seq_len_cached", None)
        orig = getattr(mod, "original_max_seq_len", None)
        if grown is not None and orig is not None and int(grown) > int(orig):
            return int(grown)
    return None


def rope_types(config) -> set:
    """The RoPE types of ``config`` (``"default"`` without RoPE parameters)."""
    return {rp.get("rope_type", rp.get("type", "default")) if isinstance(rp, dict) else "default"
            for _, rp in _rope_parameter_sets(config)}


def _check_rope(model, config, need: int) -> None:
    """Refuse RoPE settings whose result would depend on how the positions are split into forwards.

    transformers computes the rotation once per forward: ``longrope`` takes its long factors for
    *every* token of a forward whose largest position reaches ``original_max_position_embeddings``,
    and ``dynamic`` rescales its base for forwards past ``max_position_embeddings``. Plain greedy
    runs the prompt in one forward and then one token per forward; our prefill split and
    ``gamma + 1``-token verification windows cross those thresholds elsewhere. So ``longrope`` is
    accepted only when the context stays within ``original_max_position_embeddings`` (short factors
    throughout), and ``dynamic`` -- whose threshold our decode never crosses, as no row goes past
    ``max_position_embeddings`` -- only while no earlier forward grew its frequencies.
    """
    for where, rp in _rope_parameter_sets(config):
        rtype = rp.get("rope_type", rp.get("type", "default")) if isinstance(rp, dict) else "default"
        if rtype not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"vegas: unsupported RoPE type {where}['rope_type']={rtype!r}; supported RoPE types: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)} (longrope only within original_max_position_embeddings)"
            )
        if rtype == "longrope":
            orig = rp.get("original_max_position_embeddings",
                          getattr(config, "original_max_position_embeddings", None))
            if orig is None or need > int(orig):
                raise ValueError(
                    f"vegas: {where}['rope_type']='longrope' is not supported for a context of {need} tokens "
                    f"beyond original_max_position_embeddings={orig}: transformers switches every token of a forward "
                    "to the long factors once that forward reaches it, so plain greedy's tokens depend on how the "
                    "sequence is split into forwards, which speculative decoding changes. Keep prompt + new tokens "
                    f"<= {orig}, or use one of: {', '.join(EXACT_ROPE_TYPES)}"
                )
        if rtype == "dynamic" and need >= int(getattr(config, "max_position_embeddings", need + 1)):
            grown = _grown_dynamic_rope(model)
            if grown is not None:
                raise ValueError(
                    f"vegas: {where}['rope_type']='dynamic' with frequencies grown to {grown} positions by an earlier "
                    f"forward past max_position_embeddings={config.max_position_embeddings}: transformers keeps them "
                    "until a shorter forward, so a context reaching max_position_embeddings would decode differently "
                    "from plain greedy; run the model once on a short input (e.g. model(input_ids[:, :1])) "
                    "to reset them"
                )
    layer_types = getattr(config, "layer_types", None) or ()
    odd = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if odd:
        raise ValueError(
            f"vegas: unsupported config.layer_types entries {odd}; supported: {', '.join(SUPPORTED_LAYER_TYPES)}"
        )


def check_model_supported(model, context_len: Optional[int] = None) -> None:
    """Raise ``ValueError`` unless ``model`` is a supported decoder (Llama, Qwen2, Qwen3, Mistral
    ``*ForCausalLM``) whose sliding window, if any, covers ``context_len`` tokens (default: the
    model's ``max_position_embeddings``) and whose RoPE gives the same rotation however positions
    are split into forwards (:data:`SUPPORTED_ROPE_TYPES`; ``longrope`` only while ``context_len``
    stays within its ``original_max_position_embeddings``). See ``docs/models.md``."""
    config = getattr(model, "config", None)
    mtype = getattr(config, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"vegas: unsupported model {type(model).__name__} (model_type={mtype!r}); supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"vegas: {type(model).__name__} has no set_attn_implementation (transformers too old?)")
    window = _uses_sliding_window(config)
    if window is not None:
        need = int(context_len if context_len is not None else config.max_position_embeddings)
        if window < need:
            raise ValueError(
                f"vegas: sliding-window attention is not supported: config.sliding_window={window} is smaller than "
                f"the context needed ({need} tokens); set config.sliding_window=None (or >= {need}) only if the "
                "model is valid with full attention"
            )
    _check_rope(model, config, int(context_len if context_len is not None else config.max_position_embeddings))


# Patching is per model but a decode call's scope is per call: two threads decoding with one
# model share ``config._attn_implementation``. One lock and a per-model count of open
# :func:`patched` scopes make the first scope patch and the last one restore, so no thread ever
# switches the implementation under another's forward.
_PATCH_LOCK = threading.RLock()
# kept beside the model (vegas_ext.model_state), never on it:
_SCOPES = "patch_scopes"    # open patched() scopes on this model
_RESTORE = "patch_restore"  # whether the last scope to close unpatches
_PREV = "prev_attn_implementation"  # what patch_model replaced


def patch_model(model, max_context: Optional[int] = None):
    """Switch ``model`` (a HF ``*ForCausalLM``) to the ``"vegas"`` attention implementation.

    The previous implementation is remembered for :func:`unpatch_model`. Outside our decode loop
    the patched model computes exactly what the unpatched one does (transformers' SDPA path).
    Thread-safe: serialized with :func:`patched` scopes of other threads.

    Args:
        model: a supported HF causal LM.
        max_context: context the caller needs (for the sliding-window check); default the model's
            ``max_position_embeddings``.

    Returns:
        ``model`` (patched in place).

    Raises:
        ValueError: unsupported model type, or a sliding window smaller than the needed context
            (the message names ``config.sliding_window``).
    """
    check_model_supported(model, max_context)
    with _PATCH_LOCK:
        cur = model.config._attn_implementation
        if cur != ATTN_IMPLEMENTATION:
            model_state.put(model, _PREV, cur)
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
            if model.config._attn_implementation != ATTN_IMPLEMENTATION:
                raise ValueError(
                    f"vegas: {type(model).__name__} refused set_attn_implementation({ATTN_IMPLEMENTATION!r})")
        if model_state.get(model, _SCOPES, 0):
            model_state.put(model, _RESTORE, False)  # patched on purpose: stays patched after the scopes
    return model


def unpatch_model(model):
    """Restore the attention implementation ``model`` had before :func:`patch_model` (default
    ``"sdpa"``). A no-op on an unpatched model. Returns ``model``.

    While :func:`patched` scopes are open on ``model`` (a :func:`vegas_ext.generate` running in
    another thread, or a streamer callback inside one), the restore is deferred until the last
    of them closes: switching the implementation under a running forward would silently change
    its tokens."""
    with _PATCH_LOCK:
        if model_state.get(model, _SCOPES, 0):
            model_state.put(model, _RESTORE, True)
            return model
        _restore(model)
    return model


def _restore(model) -> None:
    if model.config._attn_implementation == ATTN_IMPLEMENTATION:
        prev = model_state.get(model, _PREV) or "sdpa"
        model.set_attn_implementation(prev)
    model_state.pop(model, _PREV)


def is_patched(model) -> bool:
    """Whether ``model`` currently uses the ``"vegas"`` attention implementation."""
    return getattr(model.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION


@contextlib.contextmanager
def patched(model, max_context: Optional[int] = None):
    """Context manager: the model uses the ``"vegas"`` attention implementation inside the block.

    Scopes nest and may overlap across threads on one model: the first open scope patches an
    unpatched model, the last one to close restores it (an already patched model stays patched).
    Other threads may keep calling the model meanwhile; with no active :class:`AttentionState`
    the patched model computes what the unpatched one does.

    Raises:
        ValueError: as :func:`patch_model`.
    """
    with _PATCH_LOCK:
        scopes = model_state.get(model, _SCOPES, 0)
        if scopes == 0:
            was = is_patched(model)
            if was:
                check_model_supported(model, max_context)
            else:
                patch_model(model, max_context)
            model_state.put(model, _RESTORE, not was)
        else:
            check_model_supported(model, max_context)
            if not is_patched(model):  # switched away by hand while scopes were open
                raise RuntimeError(
                    f"vegas: the attention implementation of {type(model).__name__} was changed to "
                    f"{model.config._attn_implementation!r} while a vegas decode was running on it"
                )
        model_state.put(model, _SCOPES, scopes + 1)
    try:
        yield model
    finally:
        with _PATCH_LOCK:
            scopes = model_state.get(model, _SCOPES, 1) - 1
            if scopes:
                model_state.put(model, _SCOPES, scopes)
            else:
                model_state.pop(model, _SCOPES)
                if model_state.pop(model, _RESTORE, False):
                    _restore(model)
