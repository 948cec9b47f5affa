"""Low-precision weights for the drafter's linears inside vLLM (the ``draft_weights`` option).

A Vegas draft forward in vLLM runs the target model itself over a few KV pages, so at a few
thousand tokens of context its cost is the weights it streams: 538 MB per forward for
SmolLM2-135M in fp32, most of a plain decoding step. As in our own loop
(:mod:`vegas_ext.draft_weights`), the draft forwards may read a copy of every linear weight in
fewer bytes (``"int8"``: one float32 scale per 64 weights, 1.06 bytes per weight; ``"fp16"``)
through :func:`vegas_ext.ops.weight_only_linear`, while every target (verification, prefill,
plain) forward keeps the model's own weights: the output is exactly vLLM's.

Where: on the CPU platform every unquantized linear of a vLLM model (``LinearBase`` layers and
the output embedding, tied or not) gets its kernel from
``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` after loading, which packs the
weight for oneDNN and drops the original (``layer.weight`` becomes empty). :func:`wrap_dispatch`
wraps that function: when the engine being loaded is a Vegas engine asking for ``draft_weights``
(read from the current ``VllmConfig``), it quantizes the layer's weight (the rank's shard under
tensor parallelism) before the packing, and wraps the ``layer.cpu_linear`` vLLM installs so that
the copy is used only while :func:`drafting` is entered (the proposer's draft loop) in this
process. Quantized layers with another quant method, and GPUs, are left alone (the draft then
reads the model's weights; :func:`copies` counts what was made).
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Dict, Optional

import torch

from .. import model_state, ops
from ..draft_weights import INT8_GROUP_SIZE, weight_copy
from ..packed_linear import tensor_key
from .options import ADDITIONAL_CONFIG_KEY, VegasOptions, is_vegas_spec

__all__ = ["copies", "drafting", "requested_kind", "wrap_dispatch"]

_ACTIVE = False
#: layers given a copy in this process, their bytes, and linear calls that read a copy
_STATS: Dict[str, int] = {"linears": 0, "bytes": 0, "calls": 0}
#: The dispatch wrappers this module made (one is never wrapped again)
_OUR_WRAPPERS: "weakref.WeakSet" = weakref.WeakSet()


def copies() -> Dict[str, int]:
    """``{"linears", "bytes", "calls"}``: layers of this process given a draft copy (a tied
    embedding counts twice), the copies' bytes (once), and linear calls that read one."""
    return dict(_STATS)


@contextlib.contextmanager
def drafting():
    """Within: the wrapped linears of this process read their draft copies (not re-entrant
    across threads: vLLM's workers run one forward at a time)."""
    global _ACTIVE
    prev, _ACTIVE = _ACTIVE, True
    try:
        yield
    finally:
        _ACTIVE = prev


def requested_kind(vllm_config) -> Optional[str]:
    """``"int8"`` / ``"fp16"`` when ``vllm_config`` is a Vegas engine whose drafter asks for
    low-precision weights, else ``None``."""
    if vllm_config is None or not is_vegas_spec(getattr(vllm_config, "speculative_config", None)):
        return None
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    return VegasOptions.from_mapping(extra.get(ADDITIONAL_CONFIG_KEY) or {}).draft_weights


def _make_copy(weight: torch.Tensor, kind: str):
    """``(weight copy, scales or None)``, made once per parameter: a tied output embedding shares
    its parameter (and so its copy) with the input embedding, which vLLM dispatches too."""
    key = (kind, tensor_key(weight))  # weights reloaded in place get a new copy
    made = model_state.get(weight, "vllm_draft_copy")  # beside the tensor, weakly keyed
    if made is not None and made[0] == key:
        return made[1:]
    copy = weight_copy(weight, kind)
    model_state.put(weight, "vllm_draft_copy", (key, *copy))
    _STATS["bytes"] += copy[0].numel() * copy[0].element_size() + (0 if copy[1] is None else copy[1].numel() * 4)
    return copy


def _wrap_cpu_linear(layer, original, weight: torch.Tensor, scales: Optional[torch.Tensor]) -> None:
    def cpu_linear(x, w, bias):
        if not _ACTIVE:
            return original(x, w, bias)
        _STATS["calls"] += 1
        b = None if bias is None else bias.float()
        y = ops.weight_only_linear(x.float(), weight, scales, b, INT8_GROUP_SIZE)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    layer.cpu_linear = cpu_linear
    _STATS["linears"] += 1


def wrap_dispatch(original):
    """``dispatch_cpu_unquantized_gemm(layer, remove_weight)`` that first copies the layer's 2-D
    weight for the drafter when the engine being loaded asks for it (see module)."""
    if original in _OUR_WRAPPERS:
        return original

    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # a vLLM without it: the drafts read the model's weights (the proposer warns)
        return original

    @functools.wraps(original)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight, *args, **kwargs):
        kind = requested_kind(get_current_vllm_config_or_none())
        w = getattr(layer, "weight", None)
        copy = None
        if kind is not None and isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_floating_point() \
                and not w.is_meta and w.device.type == "cpu" and w.numel() > 0:
            copy = _make_copy(w, kind)
        out = original(layer, remove_weight, *args, **kwargs)
        if copy is not None and callable(getattr(layer, "cpu_linear", None)):
            _wrap_cpu_linear(layer, layer.cpu_linear, *copy)
        return out

    _OUR_WRAPPERS.add(dispatch_cpu_unquantized_gemm)
    return dispatch_cpu_unquantized_gemm
