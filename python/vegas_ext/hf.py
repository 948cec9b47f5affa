"""Hugging Face's own ``model.generate(..., custom_generate=vegas_ext.hf.generate)`` and
``pipeline("text-generation")`` on the Vegas decode loop (see ``docs/hf_generate.md``).

:func:`generate` takes what HF's ``generate`` prepared (lengths, EOS, padding, sampling options,
logits processors, stopping criteria, the streamer) and runs :func:`vegas_ext.generate`; what it
cannot honour exactly is refused before any work, naming the option. The attention backend the
loop runs on is :mod:`vegas_ext.attention`. Method: Vegas, arXiv 2602.07223.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor
from transformers.generation.utils import GenerateDecoderOnlyOutput

from . import config, decode

__all__ = ["generate", "VegasGenerateOutput"]


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
        if isinstance(c, EosTokenCriteria) and {i for i in c.eos_token_id.flatten().tolist() if i >= 0} <= set(eos):
            continue  # negative ids: no token has one
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
    generator: Optional[torch.Generator] = None,
    prefill_cache: Optional[dict] = None,
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
        generator, prefill_cache: as for :func:`vegas_ext.generate`.
        the Vegas options (``config.door_options("hf")``: ``num_speculative_tokens``,
            ``gamma_policy``, ``draft_weights``, ``sparse_attn_algorithm``, ``sparse_attn_ratio``,
            ...): given to ``model.generate`` as extra keyword arguments (this function's signature
            lists them, from the one table :data:`vegas_ext.config.OPTIONS`, so that HF passes them
            on); left out = the table's default. Validated once into a
            :class:`~vegas_ext.config.VegasConfig`.
        vegas_options: the same options as a dict.
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

    opts = {k: model_kwargs.pop(k) for k in _HF_OPTIONS if k in model_kwargs}
    # None where None is no value of the option means its default, as for HF's own arguments
    opts = {k: v for k, v in opts.items() if v is not None or config.OPTIONS[k].none_ok or k == "draft_weights"}
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
    for k, v in (vegas_options or {}).items():
        if k in _RESERVED_VEGAS_OPTIONS:
            _refuse(f"vegas_options[{k!r}]", "set it through model.generate's own arguments")
        if k in opts:
            _refuse(f"vegas_options[{k!r}]", f"{k} is also given as an argument of model.generate")
        opts[k] = v
    procs = _loop_processors(logits_processor, gc, opts)
    opts.update(max_new_tokens=max(0, int(gc.max_length) - T), do_sample=bool(gc.do_sample))
    cfg = config.VegasConfig.build(opts, door="hf", algorithms=decode.SELECTION_ALGORITHMS)
    out = decode.generate(
        model, input_ids, model_kwargs.get("attention_mask"), vegas_config=cfg, eos_token_id=eos,
        pad_token_id=pad, streamer=_AfterPrompt(streamer) if forwarded else streamer, generator=generator,
        prefill_cache=prefill_cache, logits_processor=procs, stopping_criteria=criteria, hf_semantics=True,
    )
    if gc.return_dict_in_generate:
        return VegasGenerateOutput(sequences=out.sequences, stats=out.stats)
    return out.sequences


def _eos_and_pad_ids(gc):
    """``(eos ids list, pad id or None)`` as HF's ``generate`` resolved them into ``gc`` (pad: else
    the first EOS); a direct call reads the config's. A negative EOS id, which HF only warns about
    (no token ever has it), is left out: the same answer."""
    eos_t = getattr(gc, "_eos_token_tensor", gc.eos_token_id)
    pad_t = getattr(gc, "_pad_token_tensor", gc.pad_token_id)
    eos = [] if eos_t is None else [int(x) for x in torch.as_tensor(eos_t).flatten().tolist() if int(x) >= 0]
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


#: The Vegas options ``model.generate`` passes on (listed in :func:`generate`'s signature, below)
_HF_OPTIONS = config.door_options("hf")


def _signature_with_options(fn):
    """``fn``'s signature plus the :data:`_HF_OPTIONS` as keyword-only parameters (default ``None``:
    the table's): transformers passes a callable ``custom_generate`` exactly the extra keyword
    arguments its signature names."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    var_kw = params.pop()  # **model_kwargs
    opts = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in _HF_OPTIONS]
    fn.__signature__ = sig.replace(parameters=params + opts + [var_kw])
    return fn


_signature_with_options(generate)

#: arguments of vegas_ext.generate that model.generate's own options set
_RESERVED_VEGAS_OPTIONS = frozenset({
    "model", "input_ids", "attention_mask", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "eos_token_id", "pad_token_id", "streamer", "logits_processor", "stopping_criteria", "hf_semantics",
})
