"""``FLASH_ATTN`` with Vegas's selection signal (CUDA; experimental, never run on a GPU).

Same contract as :mod:`vegas_ext.vllm.backend` for vLLM's FlashAttention backend, written against
``v1/attention/backends/flash_attn.py`` of vLLM 0.32 (cache ``[num_blocks, H_kv, block_size,
2 * D]``, keys in the first ``D`` of the last dim, ``FlashAttentionImpl.forward`` splitting it at
line 1252) and registered only when ``VEGAS_VLLM_ALLOW_CUDA=1``. The page scores come from
:func:`vegas_ext.ops.paged_block_scores`, which runs its CUDA kernel when the CUDA kernels are
used (unless ``VEGAS_CUDA_KERNELS=0``; the op ran on an H200, this backend has not) and its PyTorch
reference otherwise.
Run vLLM with ``compilation_config={"cudagraph_mode": "PIECEWISE"}``: under a full
CUDA graph the attention's Python does not run, no scores are recorded and the drafts fall back to
StreamingLLM pages.
"""
from __future__ import annotations

from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from .backend import record_scores

__all__ = ["VegasFlashAttentionBackend", "VegasFlashAttentionImpl"]


class VegasFlashAttentionImpl(FlashAttentionImpl):
    """``FlashAttentionImpl`` whose forward also records per-page attention mass."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        if attn_metadata is not None and not str(self.kv_cache_dtype).startswith("fp8"):
            record_scores(layer, self, query, kv_cache[..., : self.head_size], attn_metadata)
        return out


class VegasFlashAttentionBackend(FlashAttentionBackend):
    """vLLM's ``FLASH_ATTN`` backend with :class:`VegasFlashAttentionImpl` as implementation."""

    @staticmethod
    def get_impl_cls():
        return VegasFlashAttentionImpl
