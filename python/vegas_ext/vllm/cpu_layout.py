"""vLLM's CPU_ATTN KV cache page layout as views our ops read (imports torch only, not vLLM, so
benchmarks that mimic the layout without vLLM use the same views)."""
from __future__ import annotations

import torch

__all__ = ["PLAIN_KEY_ISAS", "key_cache_view", "value_cache_view"]

#: CPU attention ISAs whose key pages are stored ``[D, block_size]`` (checked by
#: ``tests/vllm_plugin/test_vllm_plugin.py::test_cpu_key_layout`` against ``cpu_attn_reshape_and_cache``).
PLAIN_KEY_ISAS = ("vec", "vec16")


def key_cache_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """Keys of a CPU_ATTN cache ``[num_blocks, H_kv, block_size, 2 * D]`` as a
    ``[num_blocks, H_kv, block_size, D]`` view.

    Each (block, head) holds ``block_size * D`` key elements then as many value elements
    (``CPUAttentionBackendImpl`` splits ``[num_blocks, H_kv, 2 * block_size, D]`` in halves), and
    ``cpu_attn_reshape_and_cache`` of the ``vec`` / ``vec16`` ISAs writes the keys transposed,
    ``[D, block_size]``: element (token t, dim d) at offset ``d * block_size + t``."""
    nb, h, bs, d2 = kv_cache.shape
    return kv_cache.view(nb, h, 2, d2 // 2, bs)[:, :, 0].transpose(2, 3)


def value_cache_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """Values of a CPU_ATTN cache ``[num_blocks, H_kv, block_size, 2 * D]`` as a
    ``[num_blocks, H_kv, block_size, D]`` view: the second half of each (block, head), stored
    ``[block_size, D]`` by ``cpu_attn_reshape_and_cache`` (checked by
    ``tests/vllm_plugin/test_vllm_plugin.py::test_cpu_key_layout``)."""
    nb, h, bs, d2 = kv_cache.shape
    return kv_cache.view(nb, h, 2, bs, d2 // 2)[:, :, 1]
