"""Hugging Face drop-in: the ``torch.ops.vegas`` ops as a transformers attention implementation.

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

:func:`generate` is the decode loop for HF's own ``model.generate(..., custom_generate=
vegas_ext.hf.generate)`` and ``pipeline("text-generation")`` (see ``docs/hf_generate.md``).

Supported: ``LlamaForCausalLM`` (SmolLM2, Llama 2/3, TinyLlama), ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``MistralForCausalLM``. Sliding-window configs are refused unless the window
covers the needed context. Method: Vegas, arXiv 2602.07223.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import config, ops
from .cache import VegasCache

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
    "generate",
    "VegasGenerateOutput",
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
    """

    cache: VegasCache
    mode: str = "prefill"
    block_size: int = 16
    query_weights: Optional[Callable[[int], Optional[Tensor]]] = None
    block_scores: Optional[Tensor] = None
    block_indices: Optional[Tensor] = None
    tail_start: Optional[Tensor] = None
    draft_hook: Optional[Callable] = None
    write_hook: Optional[Callable] = None
    layer_calls: int = 0
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
    st = _ACTIVE.get()
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
        st.write_hook(layer, key, st.cache.seq_lens - query.shape[2])
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
    if mode == "verify":
        out, _lse, scores = ops.verify_attention(
            q, key, value, st.cache.seq_lens, st.block_size, float(scaling), st.weights_for(q.shape[1])
        )
        if st.block_scores is not None:
            st.block_scores[layer].copy_(scores)
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


def vegas_attention_mask(*args, **kwargs):
    """transformers mask function (``AttentionMaskInterface`` signature): ``None`` while our decode
    loop runs (the ops mask by per-row lengths), else exactly transformers' ``sdpa_mask``."""
    if _ACTIVE.get() is not None:
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
_SCOPES_ATTR = "_vegas_patch_scopes"    # open patched() scopes on this model
_RESTORE_ATTR = "_vegas_patch_restore"  # whether the last scope to close unpatches


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
            model._vegas_prev_attn_implementation = cur
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
            if model.config._attn_implementation != ATTN_IMPLEMENTATION:
                raise ValueError(
                    f"vegas: {type(model).__name__} refused set_attn_implementation({ATTN_IMPLEMENTATION!r})")
        if getattr(model, _SCOPES_ATTR, 0):
            setattr(model, _RESTORE_ATTR, False)  # patched on purpose: stays patched after the scopes
    return model


def unpatch_model(model):
    """Restore the attention implementation ``model`` had before :func:`patch_model` (default
    ``"sdpa"``). A no-op on an unpatched model. Returns ``model``.

    While :func:`patched` scopes are open on ``model`` (a :func:`vegas_ext.generate` running in
    another thread, or a streamer callback inside one), the restore is deferred until the last
    of them closes: switching the implementation under a running forward would silently change
    its tokens."""
    with _PATCH_LOCK:
        if getattr(model, _SCOPES_ATTR, 0):
            setattr(model, _RESTORE_ATTR, True)
            return model
        _restore(model)
    return model


def _restore(model) -> None:
    if model.config._attn_implementation == ATTN_IMPLEMENTATION:
        prev = getattr(model, "_vegas_prev_attn_implementation", None) or "sdpa"
        model.set_attn_implementation(prev)
    if hasattr(model, "_vegas_prev_attn_implementation"):
        del model._vegas_prev_attn_implementation


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
        scopes = getattr(model, _SCOPES_ATTR, 0)
        if scopes == 0:
            was = is_patched(model)
            if was:
                check_model_supported(model, max_context)
            else:
                patch_model(model, max_context)
            setattr(model, _RESTORE_ATTR, not was)
        else:
            check_model_supported(model, max_context)
            if not is_patched(model):  # switched away by hand while scopes were open
                raise RuntimeError(
                    f"vegas: the attention implementation of {type(model).__name__} was changed to "
                    f"{model.config._attn_implementation!r} while a vegas decode was running on it"
                )
        setattr(model, _SCOPES_ATTR, scopes + 1)
    try:
        yield model
    finally:
        with _PATCH_LOCK:
            scopes = getattr(model, _SCOPES_ATTR) - 1
            if scopes:
                setattr(model, _SCOPES_ATTR, scopes)
            else:
                delattr(model, _SCOPES_ATTR)
                if getattr(model, _RESTORE_ATTR, False):
                    _restore(model)
                if hasattr(model, _RESTORE_ATTR):
                    delattr(model, _RESTORE_ATTR)


# --------------------------------------------------------------------------- model.generate(custom_generate=...)
@dataclass
class VegasGenerateOutput(GenerateDecoderOnlyOutput):
    """What :func:`generate` returns under ``return_dict_in_generate=True``: HF's
    ``GenerateDecoderOnlyOutput`` with ``sequences`` ``[B, T + n]`` int64 and ``stats``, the dict of
    :func:`vegas_ext.generate` (acceptance counters, timings, configuration). ``scores``,
    ``logits``, ``attentions``, ``hidden_states`` and ``cache`` stay ``None``."""

    stats: Optional[dict] = None


#: model kwargs HF's ``generate`` prepares for a decoding loop; anything else is refused
_PREPARED_MODEL_KWARGS = ("attention_mask", "position_ids", "logits_to_keep", "use_cache", "cache",
                          "past_key_values", "cache_position")


def _refuse(option: str, why: str):
    raise ValueError(f"vegas_ext.hf.generate: {option} is not supported ({why})")


def _hf_generate_call() -> dict:
    """Locals of the HF ``GenerationMixin.generate`` that called :func:`generate`, or ``{}``; under
    ``"_call_kwargs"`` the keyword arguments ``model.generate`` was called with.

    transformers passes a callable ``custom_generate`` neither the ``streamer`` nor the
    ``assistant_model`` given to ``model.generate`` (its ``_extract_generation_mode_kwargs`` keeps
    only the callable's own extra arguments), so they are read from that call's frame: the
    streamer to be honoured, the assistant model to be refused rather than silently ignored. It
    also pops ``tokenizer`` from ``generate``'s own ``**kwargs`` before that, so the call's keyword
    arguments are read where they are still whole: in the frames of the decorators that wrap
    ``generate`` (``torch.no_grad``, transformers' deprecation wrapper), each holding its ``kwargs``."""
    from transformers.generation.utils import GenerationMixin

    wrappers, fn = set(), GenerationMixin.generate
    while hasattr(fn, "__wrapped__") and hasattr(fn, "__code__"):
        wrappers.add(fn.__code__)
        fn = fn.__wrapped__
    code = inspect.unwrap(GenerationMixin.generate).__code__
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back if frame.f_code.co_filename == __file__ else None
    if frame is None:
        return {}
    found, call_kwargs, outer = dict(frame.f_locals), {}, frame.f_back
    while outer is not None and outer.f_code in wrappers:  # innermost first: what generate itself got
        kw = outer.f_locals.get("kwargs")
        if isinstance(kw, dict):
            for k, v in kw.items():
                call_kwargs.setdefault(k, v)
        outer = outer.f_back
    found["_call_kwargs"] = call_kwargs
    return found


class _AfterPrompt:
    """A streamer that drops the first ``put`` (the prompt, which HF's ``generate`` already sent)."""

    def __init__(self, inner):
        self.inner, self.first = inner, True

    def put(self, value):
        if self.first:
            self.first = False
            return
        self.inner.put(value)

    def end(self):
        self.inner.end()


def _check_generation_config(gc, hf_call: dict, logits_processor, model_kwargs) -> None:
    """``ValueError`` naming the first option :func:`generate` cannot honour exactly."""
    if getattr(gc, "num_beams", 1) not in (None, 1):
        _refuse(f"num_beams={gc.num_beams}", "beam search; use num_beams=1")
    if (getattr(gc, "num_beam_groups", 1) or 1) > 1:
        _refuse(f"num_beam_groups={gc.num_beam_groups}", "diverse beam search")
    if getattr(gc, "penalty_alpha", None) is not None and (gc.top_k or 0) > 1:
        _refuse(f"penalty_alpha={gc.penalty_alpha}", "contrastive search")
    if getattr(gc, "dola_layers", None) is not None:
        _refuse(f"dola_layers={gc.dola_layers!r}", "DoLa decoding")
    if hf_call.get("assistant_model") is not None:
        _refuse("assistant_model", "Vegas drafts with the model itself")
    for name in ("prompt_lookup_num_tokens", "assistant_early_exit"):
        if getattr(gc, name, None) is not None:
            _refuse(f"{name}={getattr(gc, name)}", "Vegas drafts with the model itself")
    if gc.return_dict_in_generate:
        for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
            if getattr(gc, name, False):
                _refuse(f"{name}=True",
                        "the loop verifies several tokens per forward; sequences and stats are returned")
    if hf_call.get("synced_gpus"):
        _refuse("synced_gpus=True", "single-process decoding")
    if getattr(gc, "guidance_scale", None) not in (None, 1, 1.0):
        _refuse(f"guidance_scale={gc.guidance_scale}", "classifier-free guidance runs its own model calls per step")
    from transformers.generation.logits_process import (
        SynthIDTextWatermarkLogitsProcessor,
        UnbatchedClassifierFreeGuidanceLogitsProcessor,
    )

    for proc in logits_processor or ():
        if isinstance(proc, UnbatchedClassifierFreeGuidanceLogitsProcessor):
            _refuse("negative_prompt_ids / guidance_scale",
                    "classifier-free guidance runs its own model calls per step")
        if isinstance(proc, SynthIDTextWatermarkLogitsProcessor):
            _refuse("watermarking_config (SynthID)", "its state assumes one call per generated token")
    if model_kwargs.get("inputs_embeds") is not None:
        _refuse("inputs_embeds", "the loop decodes from input_ids")
    for name in ("cache", "past_key_values"):
        c = model_kwargs.get(name)
        if c is not None and hasattr(c, "get_seq_length") and int(c.get_seq_length()) > 0:
            _refuse(f"{name} (a filled cache)", "decoding starts from the prompt; pass the whole prompt instead")
    other = sorted(k for k, v in model_kwargs.items() if k not in _PREPARED_MODEL_KWARGS and v is not None)
    if other:
        _refuse(", ".join(other), "model inputs other than input_ids / attention_mask")


def _plain_warpers(procs):
    """``(temperature, top_k, top_p)`` when ``procs`` are exactly the warpers
    :func:`vegas_ext.acceptance.make_warpers` builds (HF's classes, in HF's order, default filter
    value and ``min_tokens_to_keep``), else ``None``. Then the loop applies them itself, with no
    per-position processor calls."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    t, k, p, stage = 1.0, 0, 1.0, 0
    for w in procs:
        plain = getattr(w, "filter_value", -float("inf")) == -float("inf") and getattr(w, "min_tokens_to_keep", 1) == 1
        if type(w) is TemperatureLogitsWarper and stage < 1:
            t, stage = float(w.temperature), 1
        elif type(w) is TopKLogitsWarper and stage < 2 and plain:
            k, stage = int(w.top_k), 2
        elif type(w) is TopPLogitsWarper and stage < 3 and plain:
            p, stage = float(w.top_p), 3
        else:
            return None
    return t, k, p


def _needed_criteria(stopping_criteria, max_length: int, eos: List[int]):
    """``stopping_criteria`` without the max-length and EOS criteria the loop applies itself
    (``None`` when nothing else is left, so the loop does no per-token checks)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

    rest = StoppingCriteriaList()
    for c in stopping_criteria or ():
        if isinstance(c, MaxLengthCriteria) and c.max_length >= max_length:
            continue  # ends no row before max_new_tokens does
        if isinstance(c, EosTokenCriteria) and set(c.eos_token_id.flatten().tolist()) <= set(eos):
            continue
        rest.append(c)
    return rest if len(rest) else None


def generate(
    model,
    input_ids: Tensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool = False,
    streamer=None,
    *,
    num_speculative_tokens=None,
    max_speculative_tokens: Optional[int] = None,
    sparse_attn_algorithm: Optional[str] = None,
    sparse_attn_ratio: Optional[float] = None,
    sparse_attn_min_tokens: Optional[int] = None,
    sparse_attn_max_tokens: Optional[int] = None,
    block_size: Optional[int] = None,
    num_sink_blocks: Optional[int] = None,
    share_selection_across_heads: Optional[bool] = None,
    query_weights: Optional[str] = None,
    selection_refresh_interval: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    prefill_cache: Optional[dict] = None,
    draft_weights: Optional[str] = None,
    vegas_options: Optional[dict] = None,
    stop_strings=None,
    tokenizer=None,
    **model_kwargs,
):
    """Vegas as the decoding loop of HF's own ``generate``: pass it as ``custom_generate``.

    ::

        out = model.generate(**inputs, custom_generate=vegas_ext.hf.generate, max_new_tokens=64,
                             num_speculative_tokens="auto", sparse_attn_algorithm="vegas")
        pipe = pipeline("text-generation", model=model, tokenizer=tok)
        pipe(prompt, custom_generate=vegas_ext.hf.generate, max_new_tokens=64)

    HF prepares everything as for plain decoding (generation config, left padding and attention
    mask, logits processors, stopping criteria, the streamer's prompt) and calls this function,
    which runs :func:`vegas_ext.generate` -- the same loop, no second implementation -- with:
    ``max_new_tokens = generation_config.max_length - T`` (``T`` = the padded prompt width, as
    HF counts it), the generation config's EOS ids and pad id, ``do_sample``, HF's logits
    processors (repetition penalty, no-repeat n-gram, min length / min new tokens, bad words,
    suppress tokens, sequence bias, ... and, when sampling, its temperature / top-k / top-p /
    min-p warpers) applied at every verified and drafted position with that position's own
    ``input_ids`` (every row of the batch a prefix that row really has), and HF's stopping
    criteria (``stop_strings``, ``max_time``, custom ones) checked after every emitted token; the
    attention mask and positions read as HF reads them (``hf_semantics``: a 0 inside a prompt
    skips that token; rows go on past ``max_position_embeddings``). Greedy output equals plain
    ``model.generate`` token for token in float32; sampling follows the distribution of plain
    sampling with the same options. What it cannot reproduce it refuses before any forward.

    Args:
        model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
            streamer: as HF's ``generate`` passes them to a decoding loop (``input_ids`` ``[B, T]``
            int64, left padded; the streamer is read from the calling ``generate`` when HF does
            not pass it, batch size 1).
        num_speculative_tokens, max_speculative_tokens, sparse_attn_algorithm, sparse_attn_ratio,
            sparse_attn_min_tokens, sparse_attn_max_tokens, block_size, num_sink_blocks,
            share_selection_across_heads, query_weights, selection_refresh_interval, generator,
            prefill_cache, draft_weights: the options of :func:`vegas_ext.generate`, given to ``model.generate``
            as extra keyword arguments; ``None`` = :func:`vegas_ext.generate`'s default.
        vegas_options: any other keyword arguments of :func:`vegas_ext.generate`, as a dict.
        stop_strings, tokenizer: HF's stop strings (``str`` or list), checked as plain decoding
            checks them (``StopStringCriteria``), with the ``tokenizer`` given to
            ``model.generate`` (or a pipeline's, for its ``stop_sequence``) as HF documents it.
            transformers passes a callable ``custom_generate`` no ``tokenizer``, so it is read
            from the ``model.generate`` call (:func:`_hf_generate_call`); one bound with
            ``functools.partial(vegas_ext.hf.generate, tokenizer=tok)`` takes precedence.
            ``stop_strings`` given to ``model.generate`` reach this function instead of HF's own
            check, which would fail without the tokenizer.
        **model_kwargs: what HF prepared (``attention_mask``, ``position_ids``, an empty cache, ...).

    Returns:
        ``sequences`` ``[B, T + n]`` int64 (prompt as given, new tokens, ``pad_token_id`` after a
        row's end), or with ``return_dict_in_generate=True`` a :class:`VegasGenerateOutput`
        (``sequences`` and ``stats``).

    Raises:
        ValueError naming the option, before any forward, for what cannot be honoured exactly
        (the list, with remedies: ``docs/hf_generate.md``): ``num_beams > 1``,
        ``num_beam_groups``, ``penalty_alpha`` (contrastive search), ``dola_layers``,
        ``assistant_model``, ``prompt_lookup_num_tokens``, ``assistant_early_exit``,
        ``output_scores`` / ``output_logits`` / ``output_attentions`` / ``output_hidden_states``
        with ``return_dict_in_generate``, ``synced_gpus``, ``guidance_scale`` /
        ``negative_prompt_ids``, a SynthID ``watermarking_config``, ``inputs_embeds``, a filled
        ``past_key_values`` / ``cache``, other model inputs, stopping
        criteria that end rows early in a batch without an EOS id (plain decoding then keeps
        generating those rows), a streamer with batch size > 1, ``stop_strings`` with no tokenizer,
        a row that ends in padding (right padding, also where HF inferred the mask from
        ``pad_token_id``), a row with no prompt token, a context past ``max_position_embeddings``
        with a ``dynamic`` / ``longrope`` RoPE; and the errors of :func:`vegas_ext.generate`
        (unsupported model, out-of-range options).
    """
    from .decode import generate as vegas_generate

    gc = model.generation_config if generation_config is None else generation_config
    hf_call = _hf_generate_call()
    forwarded = streamer is None and hf_call.get("streamer") is not None  # HF already sent it the prompt
    streamer = hf_call.get("streamer") if streamer is None else streamer
    synced_gpus = synced_gpus or bool(hf_call.get("synced_gpus"))
    _check_generation_config(gc, {**hf_call, "synced_gpus": synced_gpus}, logits_processor, model_kwargs)
    eos, pad = _eos_and_pad_ids(gc)
    B, T = input_ids.shape
    if tokenizer is None:  # as HF documents it: model.generate(..., stop_strings=..., tokenizer=tok)
        tokenizer = hf_call.get("_call_kwargs", {}).get("tokenizer")
    if hf_call.get("kwargs_has_attention_mask") is False:
        _check_inferred_mask(model_kwargs.get("attention_mask"), pad)
    criteria = _stopping_criteria(stopping_criteria, int(gc.max_length), eos, stop_strings, tokenizer, B)
    opts = dict(
        num_speculative_tokens=num_speculative_tokens, max_speculative_tokens=max_speculative_tokens,
        sparse_attn_algorithm=sparse_attn_algorithm, sparse_attn_ratio=sparse_attn_ratio,
        sparse_attn_min_tokens=sparse_attn_min_tokens, sparse_attn_max_tokens=sparse_attn_max_tokens,
        block_size=block_size, num_sink_blocks=num_sink_blocks,
        share_selection_across_heads=share_selection_across_heads, query_weights=query_weights,
        selection_refresh_interval=selection_refresh_interval, generator=generator, prefill_cache=prefill_cache,
        draft_weights=draft_weights,
    )
    opts = {k: v for k, v in opts.items() if v is not None}
    procs = _loop_processors(logits_processor, gc, opts)
    for k, v in (vegas_options or {}).items():
        if k in _RESERVED_VEGAS_OPTIONS:
            _refuse(f"vegas_options[{k!r}]", "set it through model.generate's own arguments")
        opts[k] = v
    out = vegas_generate(
        model, input_ids, model_kwargs.get("attention_mask"),
        max_new_tokens=max(0, int(gc.max_length) - T), do_sample=bool(gc.do_sample), eos_token_id=eos,
        pad_token_id=pad, streamer=_AfterPrompt(streamer) if forwarded else streamer,
        logits_processor=procs, stopping_criteria=criteria, hf_semantics=True, **opts,
    )
    if gc.return_dict_in_generate:
        return VegasGenerateOutput(sequences=out.sequences, stats=out.stats)
    return out.sequences


def _eos_and_pad_ids(gc):
    """``(eos ids list, pad id or None)`` as HF's ``generate`` resolved them into ``gc`` (pad: else
    the first EOS); a direct call reads the config's."""
    eos_t = getattr(gc, "_eos_token_tensor", gc.eos_token_id)
    pad_t = getattr(gc, "_pad_token_tensor", gc.pad_token_id)
    eos = [] if eos_t is None else [int(x) for x in torch.as_tensor(eos_t).flatten().tolist()]
    return eos, None if pad_t is None else int(pad_t)


def _check_inferred_mask(mask, pad) -> None:
    """Refuse an ``attention_mask`` that transformers inferred (none was passed) as ``input_ids !=
    pad_token_id`` when it leaves a row ending in padding or empty: the caller's prompt merely
    contains the pad id there, and the message says so (:func:`vegas_ext.generate` would speak of
    a mask the caller never passed)."""
    if mask is None or mask.dim() != 2:
        return
    bad = (mask[:, -1] == 0).nonzero()[:, 0].tolist()
    if bad:
        r = bad[0]
        what = "is all" if not bool(mask[r].any()) else "ends with"
        _refuse(f"input_ids row {r} that {what} pad_token_id={pad} without an attention_mask",
                "transformers then infers attention_mask = (input_ids != pad_token_id), which makes those tokens "
                "padding, and plain decoding would predict from a padding token; pass attention_mask (1 for every "
                "prompt token), or a pad_token_id that is not in the prompt")


def _stopping_criteria(stopping_criteria, max_length: int, eos, stop_strings, tokenizer, batch_size: int):
    """HF's stopping criteria the loop must check itself (plus ``stop_strings``), or ``None``;
    refuses what plain decoding would honour differently."""
    criteria = _needed_criteria(stopping_criteria, max_length, eos)
    if stop_strings:
        if tokenizer is None:
            _refuse("stop_strings without a tokenizer",
                    "they are matched on decoded text; pass tokenizer=tok to model.generate, as plain decoding "
                    "requires")
        from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria

        criteria = StoppingCriteriaList(criteria or [])
        criteria.append(StopStringCriteria(stop_strings=stop_strings, tokenizer=tokenizer))
    if criteria is not None and not eos and batch_size > 1:
        _refuse("stopping criteria with batch size > 1 and no eos_token_id",
                "plain decoding keeps generating rows its criteria stopped unless an EOS id is set")
    return criteria


def _loop_processors(logits_processor, gc, opts: dict):
    """HF's logits processors for the loop to apply per position, or ``None``: sampling with
    temperature / top-k / top-p only becomes the loop's own warpers (set in ``opts``)."""
    procs = logits_processor if logits_processor is not None and len(logits_processor) else None
    warp = _plain_warpers(procs) if (procs is not None and gc.do_sample) else None
    if warp is None:
        return procs
    opts.update(temperature=warp[0], top_k=warp[1], top_p=warp[2])
    return None


#: arguments of vegas_ext.generate that model.generate's own options set
_RESERVED_VEGAS_OPTIONS = frozenset({
    "model", "input_ids", "attention_mask", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "eos_token_id", "pad_token_id", "streamer", "logits_processor", "stopping_criteria", "hf_semantics",
})
