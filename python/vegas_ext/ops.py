"""Typed Python wrappers and fake (meta) kernels of the ``torch.ops.vegas`` ops.

One registry: the schemas are in ``csrc/registration.cpp`` only (its ``TORCH_LIBRARY(vegas)``
runs when this module imports the compiled ``vegas_ext._C``); CPU kernels in ``csrc/cpu/<op>.cpp``;
CUDA kernels in ``csrc/cuda/<op>.cu``; references in :mod:`vegas_ext.reference`; here the typed
wrappers, the fake kernels (``torch.compile``) and the no-backward guards. Method: Vegas,
"Self-Speculative Decoding with Verification-Guided Sparse Attention" (Yue, Xue, Huang),
arXiv 2602.07223.

Conventions shared by all ops (the KV cache of one layer):

* ``k_cache``, ``v_cache``: ``[B, H_kv, S, D]``, last dim contiguous (HF static-cache layout).
* ``seq_lens``: ``[B]`` int32; tokens ``[0, seq_lens[b])`` of row ``b`` are valid.
* GQA: ``H_q`` is a multiple of ``H_kv``; query head ``h`` reads KV head ``h // (H_q // H_kv)``.
* Block ``j`` covers tokens ``[j * block_size, (j + 1) * block_size)``.
* dtypes: q/k/v float32, bfloat16 or float16 (all the same); accumulation in float32.

Importing this module needs the compiled extension (``bash scripts/setup.sh`` or
``pip install --no-build-isolation -e .`` builds it): without it, or with one built from sources
older than an op here, the import raises an ImportError saying so.

Dispatch: the compiled kernels run on CPU and on CUDA (they passed every CUDA test against the
references on an H200, bench/results/gpu_h200). ``VEGAS_CUDA_KERNELS=0`` (or
:func:`set_cuda_kernels_enabled` ``(False)``) makes CUDA tensors take the plain-PyTorch
references instead, for debugging; so does any device without a compiled kernel (a build
without CUDA, or the CPU-only ops on CUDA).

Where the input checks run:

* Shapes, dtypes, devices, strides and the Python scalars (``block_size``, ``scale``,
  ``max_k``, ...): on the host from tensor metadata, on every call and every device (no
  device access, no synchronization); also in the fake kernels, so ``torch.compile``
  traces see the same errors.
* Values held in tensors (``seq_lens``, ``tail_start``, ``block_indices``, ``k``,
  ``num_candidates``): on CPU by the kernels, always. On CUDA the compiled kernels do
  *not* copy them to the host by default (that would be a blocking device-to-host sync
  per call, and would break CUDA-graph capture); set ``VEGAS_CUDA_VALUE_CHECKS=1`` to
  get the same errors as on CPU while debugging (skipped during graph capture). Without
  it the CUDA kernels guard on the device: a batch row with ``seq_lens`` outside
  ``[Q, S]`` (or, for the draft, ``tail_start`` outside ``[0, seq_lens - Q]``) gets NaN
  in all its outputs, block indices outside ``[0, ceil(S / block_size))`` select nothing,
  a block index repeated in a row is attended twice, and ``block_topk`` treats negative
  ``k`` / ``num_candidates`` as 0. The callers in this package produce these values on
  the host side correctly by construction (the decode loop owns the lengths and the
  selection). The reference fallback checks values on every device (it syncs).
"""
from __future__ import annotations

import functools
import inspect
import math
import os
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import reference

__all__ = [
    "verify_attention",
    "block_topk",
    "sparse_draft_attention",
    "block_minmax_update",
    "quest_block_scores",
    "has_compiled_kernel",
    "cpu_op",
    "set_cuda_kernels_enabled",
    "cuda_workspace_bytes",
    "EXTENSION_LOADED",
]

try:
    from . import _C  # noqa: F401  (loading it runs csrc/registration.cpp: every vegas:: schema)
except ImportError as _e:
    raise ImportError(
        f"vegas_ext: the compiled extension vegas_ext._C is not available ({_e}); build it with "
        "`bash scripts/setup.sh` or `pip install --no-build-isolation -e .`"
    ) from _e

#: True: importing this module fails without the compiled extension (kept for callers that check).
EXTENSION_LOADED = True

# Every op of csrc/registration.cpp, in its order.
_OPS = ("verify_attention", "block_topk", "sparse_draft_attention", "block_minmax_update", "quest_block_scores",
        "paged_block_scores", "paged_verify_attention", "paged_sparse_draft_attention", "weight_only_linear",
        "rope_kv_write", "add_rms_norm", "silu_mul")


def _op_defined(name: str) -> bool:
    """Whether the loaded library defines ``vegas::<name>``."""
    try:
        return getattr(torch.ops.vegas, name).default is not None
    except (AttributeError, RuntimeError):
        return False


_MISSING = [op for op in _OPS if not _op_defined(op)]
if _MISSING:  # a stale build: one clear error instead of failures at the first use of each op
    raise ImportError(
        f"vegas_ext: the compiled extension {_C.__file__} defines no vegas::{', vegas::'.join(_MISSING)}: it was "
        "built from older sources; rebuild it with `bash scripts/setup.sh` or `pip install --no-build-isolation -e .`"
    )

_CUDA_ENABLED = os.environ.get("VEGAS_CUDA_KERNELS", "1") != "0"


def set_cuda_kernels_enabled(enabled: bool) -> None:
    """Use the compiled CUDA kernels (``True``, the default) or the plain-PyTorch references
    (``False``: debugging) for CUDA tensors; ``VEGAS_CUDA_KERNELS=0`` sets ``False`` at import."""
    global _CUDA_ENABLED
    _CUDA_ENABLED = bool(enabled)


def has_compiled_kernel(op: str, device_type: str) -> bool:
    """True when ``torch.ops.vegas.<op>`` has a compiled kernel for ``device_type`` (``"cpu"`` or
    ``"cuda"``; False for other devices and for an op name the library does not define)."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"vegas::{op}", key)
    except RuntimeError:  # "operator vegas::<op> does not exist"
        return False


# Looked up once, so the wrappers stay traceable by torch.compile (a dict read).
_COMPILED = {(op, dev): has_compiled_kernel(op, dev) for op in _OPS for dev in ("cpu", "cuda")}


def cpu_op(name: str):
    """``torch.ops.vegas.<name>.default`` where its CPU kernel is built, else the checked wrapper
    ``vegas_ext.ops.<name>`` (the reference). For hot loops on CPU tensors whose arguments the caller
    has already checked (the lean draft forward, a packed verification, the draft weights'
    linears: hundreds of calls per step), which skip the wrapper's checks and dispatch."""
    return getattr(torch.ops.vegas, name).default if has_compiled_kernel(name, "cpu") else globals()[name]


def _use_compiled(op: str, device: torch.device) -> bool:
    if device.type == "cuda" and not _CUDA_ENABLED:
        return False
    return _COMPILED.get((op, device.type), False)


def cuda_workspace_bytes(
    op: str,
    B: int,
    Q: int,
    H_q: int,
    H_kv: int,
    D: int,
    S: int,
    block_size: int,
    K: int = 0,
    *,
    dtype: torch.dtype = torch.bfloat16,
    aligned: bool = True,
    num_sms: int = 132,
    smem_per_sm: int = 233472,
) -> int:
    """Bytes of device workspace one CUDA ``verify_attention`` / ``sparse_draft_attention``
    call allocates (from the caching allocator, freed at return), besides its outputs.

    With ``bs = min(block_size, S)``, ``R = Q * H_q / H_kv`` query rows per KV head and
    ``np`` token splits per row (below), in float32 words::

        4 * B * H_kv * R * (np * (D + 2) + 1)              # split partials (m, l, acc) + lse
      + 4 * B * H_kv * R * ceil(S / 16) * spt              # verify, slots mode only

    ``spt = 1`` if ``bs % 16 == 0`` else ``min(16, 15 // bs + 2)``. Verification uses the
    slots mode for ``bs >= 16`` (and when the block-score pass's shared memory -- a K tile
    plus the group's queries -- would exceed 96 KiB: very many rows, or fp32 with D = 256); for
    ``bs < 16`` a second pass over K computes the block scores
    with no workspace, so at ``block_size = 1`` nothing of size ``[Q, S]`` is allocated.
    ``np`` fills the device in whole waves: the smallest ``n`` whose cost
    ``ceil(B * H_kv * nz * n / (num_sms * c)) * (max(ceil(nvt / n), 4) + 1)`` is within 3 % of
    the least over ``n`` in ``[1, min(ceil(nvt / 4), 128)]``, with ``nvt = ceil(V / tile)`` tiles, ``V = S`` (verify) or
    ``K * bs + S`` (draft), ``tile = 64`` (32 on the SIMT path for D > 128),
    ``nz = ceil(ceil(R / rows) / min(4, ceil(R / rows)))`` row groups, ``rows = 16`` on the
    tensor-core path (bf16 / fp16, D in {64, 80, 96, 128}, 16-byte aligned K/V rows:
    ``aligned``), else 8, and ``c = min(3, smem_per_sm // (main-kernel shared memory +
    1 KiB))`` resident CTAs per SM (3 for D = 128 bf16 on an H100 / H200).

    Example: Llama-3-8B attention (H_q 32, H_kv 8, D 128), S = 128K, batch 32, Q = 7, bf16,
    132 SMs: 11.2 MB at block size 1; 246 MB at block size 16.

    Args:
        op: ``"verify_attention"`` or ``"sparse_draft_attention"``.
        B, Q, H_q, H_kv, D, S: the call's sizes; block_size: as passed to the op;
        K: selected blocks per row (draft).
        dtype, aligned: pick the kernel path as the launcher does.
        num_sms: multiprocessors of the GPU (132 on H100 / H200 SXM, 108 on A100).
        smem_per_sm: shared memory per multiprocessor, bytes (228 KiB on H100 / H200,
            164 KiB on A100).

    Returns:
        int, bytes. Mirrors the launch plan of ``csrc/cuda/attention_params.h``
        (``AttnPlan::workspace_bytes``; tests/test_cuda_ops.py checks they agree).
    """
    if op not in ("verify_attention", "sparse_draft_attention"):
        raise ValueError(f"op must be 'verify_attention' or 'sparse_draft_attention', got {op!r}")
    if B == 0:
        return 0
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    bs = min(block_size, max(S, 1))
    R = Q * (H_q // H_kv)
    esize = torch.empty((), dtype=dtype).element_size()
    mma = dtype in (torch.bfloat16, torch.float16) and D in (64, 80, 96, 128) and aligned
    rows = 16 if mma else 8
    mr = cdiv(R, rows)
    nz = cdiv(mr, min(4, mr))
    tile = 64 if (mma or D <= 128) else 32
    verify = op == "verify_attention"
    vlen = S if verify else K * bs + S
    nvt = max(1, cdiv(vlen, tile))
    rg = min(4, mr)
    warps = rg * (4 if rg == 1 else 2 if rg == 2 else 1)
    if mma:  # the main kernel's shared memory (MmaSmem / SimtSmem in attention_params.h)
        smem_main = 4 * 64 * (D + 8) * esize + 3 * 64 * 4 + warps * 16 * 18 * 4
    else:
        smem_main = 2 * tile * (D + 2) * 4 + tile * 4 + rg * 8 * D * 4 + warps * 8 * 18 * 4
    ctas_per_sm = max(1, min(3, smem_per_sm // (smem_main + 1024)))
    slots = max(1, num_sms) * ctas_per_sm
    base = B * H_kv * nz
    cost = lambda n: cdiv(base * n, slots) * (max(cdiv(nvt, n), 4) + 1)  # noqa: E731
    least = min(cost(n) for n in range(1, max(1, min(cdiv(nvt, 4), 128)) + 1))
    np_ = next(n for n in range(1, 129) if cost(n) * 100 <= least * 103)  # choose_nsplit
    words = B * H_kv * R * (np_ * (D + 2) + 1)
    if verify:
        rpad = cdiv(R, 16) * 16
        kv = 2 * 64 * (D + 8) * esize if mma else 64 * (D + 2) * 4
        qs = rpad * (D + 8) * esize if mma else rpad * D * 4
        smem = kv + qs + 2 * rpad * 4 + (64 + 2) * 4
        if not (bs < 16 and smem <= 96 * 1024):
            spt = 1 if bs % 16 == 0 else min(16, 15 // bs + 2)
            words += B * H_kv * R * cdiv(S, 16) * spt
    return 4 * words


# ---------------------------------------------------------------------------
# shape checks shared by the fake kernels and the reference fallback
# ---------------------------------------------------------------------------
_ATTN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fail(op: str, msg: str):
    raise ValueError(f"vegas::{op}: {msg}")


def _require_tensors(op: str, **named) -> None:
    """``TypeError`` naming the first argument that is not a tensor (``None`` allowed only for
    names ending in ``_opt``, which are given without the suffix in the message)."""
    for name, t in named.items():
        optional = name.endswith("_opt")
        if t is None and optional:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"vegas::{op}: {name.removesuffix('_opt')} must be a torch.Tensor, got {type(t).__name__}")


def _check_attn(op, q, k_cache, v_cache, seq_lens, block_size, scale):
    if q.dim() != 4:
        _fail(op, f"q must be 4-D [B, Q, H_q, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        _fail(op, f"k_cache must be 4-D [B, H_kv, S, D], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        _fail(op, f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if q.dtype not in _ATTN_DTYPES:
        _fail(op, f"q must be float32, bfloat16 or float16, got {q.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            _fail(op, f"{name} dtype ({t.dtype}) must equal q dtype ({q.dtype})")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("seq_lens", seq_lens)):
        if t.device != q.device:
            _fail(op, f"{name} must be on the same device as q ({q.device}), got {t.device}")
    B, Q, Hq, D = q.shape
    _, Hkv, S, Dk = k_cache.shape
    if k_cache.shape[0] != B:
        _fail(op, f"k_cache batch size ({k_cache.shape[0]}) must equal q batch size ({B})")
    if Dk != D:
        _fail(op, f"k_cache head_dim ({Dk}) must equal q head_dim ({D})")
    if Hkv <= 0 or Hq <= 0 or Hq % Hkv != 0:
        _fail(op, f"the number of query heads H_q ({Hq}) must be a positive multiple of the number of KV heads "
                  f"H_kv ({Hkv})")
    if Q < 1 or Q > S:
        _fail(op, f"Q ({Q}) must lie in [1, S] = [1, {S}]")
    if block_size < 1:
        _fail(op, f"block_size must be >= 1, got {block_size}")
    if not (math.isfinite(scale) and scale > 0):
        _fail(op, f"scale must be a positive finite float, got {scale}")
    _check_per_row(op, "seq_lens", seq_lens, B)
    return B, Q, Hq, D, Hkv, S


def _check_per_row(op, name, t, B, like=None, like_name=""):
    """``t`` is ``[B]`` int32 (on ``like``'s device when given)."""
    if like is not None and t.device != like.device:
        _fail(op, f"{name} must be on the same device as {like_name} ({like.device}), got {t.device}")
    if t.dim() != 1 or t.shape[0] != B:
        _fail(op, f"{name} must have shape [B] = [{B}], got {tuple(t.shape)}")
    if t.dtype != torch.int32:
        _fail(op, f"{name} must be int32, got {t.dtype}")


def _check_seq_lens_values(op, seq_lens, Q, S):
    bad = (seq_lens < Q) | (seq_lens > S)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        _fail(op, f"seq_lens[{b}] = {int(seq_lens[b])} must lie in [Q, S] = [{Q}, {S}]")


# ---------------------------------------------------------------------------
# verify_attention
# ---------------------------------------------------------------------------
def verify_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seq_lens: Union[Tensor, int],
    block_size: int,
    scale: float,
    query_weights: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Causal attention of the Q newest tokens over the whole KV cache, plus the
    attention mass each KV block received (Vegas's selection signal, reduced inside
    the kernel from per-block partial log-sum-exps; no [Q, S] matrix is written).

    Args:
        q: ``[B, Q, H_q, D]`` float32/bfloat16/float16, the queries of the Q newest tokens
            of each row, at positions ``seq_lens[b] - Q ... seq_lens[b] - 1`` (their K/V are
            already in the cache). Query ``i`` attends to tokens ``t <= seq_lens[b] - Q + i``.
        k_cache, v_cache: ``[B, H_kv, S, D]``, dtype of q.
        seq_lens: ``[B]`` int32 in ``[Q, S]``, or a Python int for every row.
        block_size: tokens per block, ``>= 1``.
        scale: softmax scale applied to ``q . k`` (usually ``D ** -0.5``).
        query_weights: optional ``[Q]`` float32 weight of each query in the block scores
            (default 1 each; e.g. weight only the first and last query as the authors do).

    Returns:
        ``out`` ``[B, Q, H_q, D]`` (dtype of q); ``lse`` ``[B, H_q, Q]`` float32, natural-log
        log-sum-exp of the scaled scores; ``block_scores`` ``[B, H_kv, ceil(S / block_size)]``
        float32: for KV head g and block j, the sum over the query heads of g and the
        (weighted) queries of the softmax probability on the tokens of block j; zero for
        blocks past ``seq_lens[b]``. Each (b, g) row sums to ``(H_q / H_kv) * sum(weights)``.

    Raises:
        RuntimeError / ValueError naming the argument: wrong rank, mismatched batch, heads,
        head_dim, dtype or device, H_q not a multiple of H_kv, seq_lens not int32 or outside
        [Q, S], block_size < 1, a non-positive scale.

    Checks: everything but the values of ``seq_lens`` is checked on the host from metadata.
    ``seq_lens`` values: checked on CPU; on CUDA only with ``VEGAS_CUDA_VALUE_CHECKS=1``,
    otherwise a row outside ``[Q, S]`` gets NaN ``out`` / ``lse`` / ``block_scores`` (no
    host sync, CUDA-graph capturable). Any ``block_size >= 1`` is valid (one block when it
    covers S); the CUDA workspace is :func:`cuda_workspace_bytes`.

    Non-finite K (CPU kernel): a row whose visible scores are all ``-inf`` gets ``out`` 0 and
    ``lse`` ``-inf`` (the reference's softmax gives NaN there); a ``+inf`` or NaN score makes
    that row's ``out`` and ``lse`` NaN (the reference: ``lse`` ``+inf``) and its block scores NaN
    where it has mass. Rows that see only finite scores are unaffected. Non-finite V: the rows that
    see such a token get a non-finite ``out``; a row that does not see it gets NaN (``0 * inf``, as
    in the reference's dense ``P @ V``) where the kernel runs it together with one that does (each
    block of rows goes over the longest visible prefix among them), and stays finite otherwise.
    Non-finite ``query_weights`` are not rejected: they make a block score non-finite where that
    query has mass (the reference: every block).
    """
    _require_tensors("verify_attention", q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens,
                     query_weights_opt=query_weights)
    return torch.ops.vegas.verify_attention(q, k_cache, v_cache, seq_lens, block_size, scale, query_weights)


def _verify_fallback(q, k_cache, v_cache, seq_lens, block_size, scale, query_weights=None):
    op = "verify_attention"
    B, Q, Hq, D, Hkv, S = _check_attn(op, q, k_cache, v_cache, seq_lens, block_size, scale)
    _check_seq_lens_values(op, seq_lens, Q, S)
    if query_weights is not None:
        if query_weights.shape != (Q,) or query_weights.dtype != torch.float32:
            _fail(op, f"query_weights must be float32 of shape [Q] = [{Q}], got {query_weights.dtype} "
                      f"{tuple(query_weights.shape)}")
    return reference.verify_attention(q, k_cache, v_cache, seq_lens, block_size, scale, query_weights)


@torch.library.register_fake("vegas::verify_attention")
def _verify_fake(q, k_cache, v_cache, seq_lens, block_size, scale, query_weights=None):
    B, Q, Hq, D, Hkv, S = _check_attn("verify_attention", q, k_cache, v_cache, seq_lens, block_size, scale)
    out = q.new_empty((B, Q, Hq, D))
    lse = q.new_empty((B, Hq, Q), dtype=torch.float32)
    scores = q.new_empty((B, Hkv, -(-S // block_size)), dtype=torch.float32)
    return out, lse, scores


# ---------------------------------------------------------------------------
# block_topk
# ---------------------------------------------------------------------------
def block_topk(
    block_scores: Tensor,
    k: Union[Tensor, int],
    num_candidates: Union[Tensor, int],
    max_k: int,
    num_sink_blocks: int = 0,
    num_recent_blocks: int = 0,
) -> Tensor:
    """Top-k blocks per (row, head) by score, sink blocks and the most recent blocks always.

    Args:
        block_scores: ``[B, H, N]`` float32 (e.g. ``verify_attention``'s block scores;
            several layers can be stacked into the batch dimension).
        k: ``[B]`` int32, blocks wanted per row (>= 0), or a Python int for every row.
        num_candidates: ``[B]`` int32 (or a Python int for every row); row b chooses among blocks
            ``[0, min(num_candidates[b], N))`` (typically the blocks before the draft tail).
        max_k: output width; also caps the count.
        num_sink_blocks: blocks ``[0, num_sink_blocks)`` are taken first (attention sinks,
            StreamingLLM arXiv 2309.17453), as many as fit.
        num_recent_blocks: then the last ``num_recent_blocks`` eligible blocks (those just before
            the draft tail: a local window, as SparseSpec-L keeps one beside its top entries, arXiv
            2607.27735), as many as fit beside the sinks; the rest of the count goes by score.

    Returns:
        ``[B, H, max_k]`` int32: ``c = min(k[b], max_k, eligible)`` block indices in ascending
        order, then ``-1``. Ranking: higher score first; NaN ranks below every number
        (``-inf`` included); ties go to the lower index -- identical on every device and run.

    Raises:
        RuntimeError / ValueError naming the argument: block_scores not 3-D float32, k or
        num_candidates not int32 ``[B]`` or negative, max_k, num_sink_blocks or
        num_recent_blocks negative.

    Checks: negative ``k`` / ``num_candidates`` values raise on CPU; on CUDA only with
    ``VEGAS_CUDA_VALUE_CHECKS=1``, otherwise they count as 0 (no host sync).
    """
    _require_tensors("block_topk", block_scores=block_scores, k=k, num_candidates=num_candidates)
    return torch.ops.vegas.block_topk(block_scores, k, num_candidates, max_k, num_sink_blocks, num_recent_blocks)


def _check_topk(op, block_scores, k, num_candidates, max_k, num_sink_blocks, num_recent_blocks=0):
    if block_scores.dim() != 3:
        _fail(op, f"block_scores must be 3-D [B, H, N], got shape {tuple(block_scores.shape)}")
    if block_scores.dtype != torch.float32:
        _fail(op, f"block_scores must be float32, got {block_scores.dtype}")
    B = block_scores.shape[0]
    for name, t in (("k", k), ("num_candidates", num_candidates)):
        _check_per_row(op, name, t, B, block_scores, "block_scores")
    if max_k < 0:
        _fail(op, f"max_k must be >= 0, got {max_k}")
    if num_sink_blocks < 0:
        _fail(op, f"num_sink_blocks must be >= 0, got {num_sink_blocks}")
    if num_recent_blocks < 0:
        _fail(op, f"num_recent_blocks must be >= 0, got {num_recent_blocks}")
    return B


def _topk_fallback(block_scores, k, num_candidates, max_k, num_sink_blocks, num_recent_blocks=0):
    op = "block_topk"
    _check_topk(op, block_scores, k, num_candidates, max_k, num_sink_blocks, num_recent_blocks)
    for name, t in (("k", k), ("num_candidates", num_candidates)):
        if bool((t < 0).any()):
            b = int((t < 0).nonzero()[0, 0])
            _fail(op, f"{name}[{b}] = {int(t[b])} must be >= 0")
    return reference.block_topk(block_scores, k, num_candidates, max_k, num_sink_blocks, num_recent_blocks)


@torch.library.register_fake("vegas::block_topk")
def _topk_fake(block_scores, k, num_candidates, max_k, num_sink_blocks, num_recent_blocks=0):
    B = _check_topk("block_topk", block_scores, k, num_candidates, max_k, num_sink_blocks, num_recent_blocks)
    return block_scores.new_empty((B, block_scores.shape[1], max_k), dtype=torch.int32)


# ---------------------------------------------------------------------------
# sparse_draft_attention
# ---------------------------------------------------------------------------
def sparse_draft_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_indices: Tensor,
    tail_start: Union[Tensor, int],
    seq_lens: Union[Tensor, int],
    block_size: int,
    scale: float,
) -> Tensor:
    """Draft attention over a few selected KV blocks plus the tail.

    Query head h (KV head g = h // (H_q / H_kv)) attends to the tokens of g's selected
    blocks that lie before ``tail_start[b]``, plus every tail token
    ``[tail_start[b], seq_lens[b])``, causally, with an exact softmax over that set.

    Args:
        q: ``[B, Q, H_q, D]``, queries at positions ``seq_lens[b] - Q ... seq_lens[b] - 1``.
        k_cache, v_cache: ``[B, H_kv, S, D]``, dtype of q.
        block_indices: ``[B, H_kv, K]`` int32 block indices, ``-1`` = unused, unique per row,
            each in ``[0, ceil(S / block_size))``; any order.
        tail_start: ``[B]`` int32 with ``0 <= tail_start[b] <= seq_lens[b] - Q`` (the start of
            the last verification window, in Vegas), or a Python int for every row.
        seq_lens: ``[B]`` int32 in ``[Q, S]``, or a Python int for every row.
        block_size: tokens per block, ``>= 1``.
        scale: softmax scale.

    Returns:
        ``out`` ``[B, Q, H_q, D]``, dtype of q. With every block selected it equals
        ``verify_attention``'s output.

    Raises:
        RuntimeError / ValueError naming the argument, as :func:`verify_attention`, plus:
        block_indices not int32 ``[B, H_kv, K]``, an index outside ``[-1, ceil(S/block_size))``
        or repeated in a row, tail_start outside ``[0, seq_lens - Q]``.

    Checks: the values of ``seq_lens``, ``tail_start`` and ``block_indices`` raise on CPU;
    on CUDA only with ``VEGAS_CUDA_VALUE_CHECKS=1``. Otherwise (no host sync, CUDA-graph
    capturable) a row with ``seq_lens`` outside ``[Q, S]`` or ``tail_start`` outside
    ``[0, seq_lens - Q]`` gets a NaN ``out``, indices outside ``[0, ceil(S / block_size))``
    select nothing, and a repeated index is attended twice.
    """
    _require_tensors("sparse_draft_attention", q=q, k_cache=k_cache, v_cache=v_cache, block_indices=block_indices,
                     tail_start=tail_start, seq_lens=seq_lens)
    return torch.ops.vegas.sparse_draft_attention(
        q, k_cache, v_cache, block_indices, tail_start, seq_lens, block_size, scale
    )


def _check_draft(op, q, block_indices, tail_start, B, Hkv):
    if block_indices.dim() != 3 or block_indices.shape[0] != B or block_indices.shape[1] != Hkv:
        _fail(op, f"block_indices must have shape [B, H_kv, K] = [{B}, {Hkv}, K], got {tuple(block_indices.shape)}")
    if block_indices.dtype != torch.int32:
        _fail(op, f"block_indices must be int32, got {block_indices.dtype}")
    if block_indices.device != q.device:
        _fail(op, f"block_indices must be on the same device as q ({q.device}), got {block_indices.device}")
    _check_per_row(op, "tail_start", tail_start, B, q, "q")


def _draft_fallback(q, k_cache, v_cache, block_indices, tail_start, seq_lens, block_size, scale):
    op = "sparse_draft_attention"
    B, Q, Hq, D, Hkv, S = _check_attn(op, q, k_cache, v_cache, seq_lens, block_size, scale)
    _check_draft(op, q, block_indices, tail_start, B, Hkv)
    _check_seq_lens_values(op, seq_lens, Q, S)
    nblocks = -(-S // block_size)
    if bool(((block_indices < -1) | (block_indices >= nblocks)).any()):
        _fail(op, f"block_indices must be -1 (unused) or a block index in [0, ceil(S / block_size)) = [0, {nblocks})")
    srt = torch.sort(block_indices, dim=-1).values
    if bool(((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any()):
        _fail(op, "block_indices must be unique per row (a block index repeats)")
    if bool(((tail_start < 0) | (tail_start > seq_lens - Q)).any()):
        _fail(op, "tail_start must lie in [0, seq_lens - Q] for every row")
    return reference.sparse_draft_attention(q, k_cache, v_cache, block_indices, tail_start, seq_lens, block_size, scale)


@torch.library.register_fake("vegas::sparse_draft_attention")
def _draft_fake(q, k_cache, v_cache, block_indices, tail_start, seq_lens, block_size, scale):
    op = "sparse_draft_attention"
    B, Q, Hq, D, Hkv, S = _check_attn(op, q, k_cache, v_cache, seq_lens, block_size, scale)
    _check_draft(op, q, block_indices, tail_start, B, Hkv)
    return q.new_empty((B, Q, Hq, D))


# ---------------------------------------------------------------------------
# Quest selection ops (the "quest" rival selection algorithm, vegas_ext.selection)
# ---------------------------------------------------------------------------
def block_minmax_update(
    key_min: Tensor, key_max: Tensor, k_cache: Tensor, seq_lens: Union[Tensor, int], start: Union[Tensor, int],
    block_size: int,
) -> None:
    """Recompute, in place, the key-wise min / max of the KV blocks that changed.

    Quest's per-page metadata (Tang et al., "Quest: Query-Aware Sparsity for Efficient
    Long-Context LLM Inference", arXiv 2406.10774), kept current as tokens are appended or
    rolled back: for each row b, blocks ``[start[b] // block_size, ceil(seq_lens[b] / block_size))``
    are recomputed from their valid tokens ``[j*block_size, min((j+1)*block_size, seq_lens[b]))``.

    Args:
        key_min, key_max: ``[B, H_kv, ceil(S / block_size), D]`` contiguous, one dtype among
            float32/bfloat16/float16 (written in place).
        k_cache: ``[B, H_kv, S, D]``.
        seq_lens: ``[B]`` int32 in ``[0, S]``.  start: ``[B]`` int32 ``>= 0``, first changed token.
            Either may be a Python int for every row.
        block_size: tokens per block, ``>= 1``.

    Raises:
        RuntimeError / ValueError naming the argument on bad shapes, dtypes, devices or values.
    """
    torch.ops.vegas.block_minmax_update(key_min, key_max, k_cache, seq_lens, start, block_size)


def quest_block_scores(q: Tensor, key_min: Tensor, key_max: Tensor, num_blocks: Union[Tensor, int]) -> Tensor:
    """Quest's query-aware block scores: an upper bound of ``q . k`` over each block.

    ``score[b, g, j] = sum_{queries i} sum_{query heads h of group g} sum_d max(q_d * key_max_d,
    q_d * key_min_d)`` for ``j < num_blocks[b]``, ``-inf`` beyond (Quest, arXiv 2406.10774, with
    the query heads of a GQA group summed so one selection serves the KV head).

    Args:
        q: ``[B, Q, H_q, D]`` float32/bfloat16/float16.
        key_min, key_max: ``[B, H_kv, N, D]``, see :func:`block_minmax_update`.
        num_blocks: ``[B]`` int32, blocks scored per row, or a Python int for every row.

    Returns:
        ``[B, H_kv, N]`` float32 (feed to :func:`block_topk`).

    Raises:
        RuntimeError / ValueError naming the argument on bad shapes, dtypes or devices.
    """
    return torch.ops.vegas.quest_block_scores(q, key_min, key_max, num_blocks)


def _check_meta(op, key_min, key_max, B, D):
    if key_min.dim() != 4 or key_min.shape[0] != B or key_min.shape[3] != D:
        _fail(op, f"key_min must have shape [B, H_kv, N, D] = [{B}, H_kv, N, {D}], got {tuple(key_min.shape)}")
    if key_max.shape != key_min.shape:
        _fail(op, f"key_max must have the shape of key_min {tuple(key_min.shape)}, got {tuple(key_max.shape)}")
    if key_min.dtype not in _ATTN_DTYPES or key_max.dtype != key_min.dtype:
        _fail(op, f"key_min and key_max must share one dtype among float32, bfloat16, float16, got {key_min.dtype} "
                  f"and {key_max.dtype}")


def _check_int32_vec(op, name, t, B, device):
    if t.dim() != 1 or t.shape[0] != B or t.dtype != torch.int32:
        _fail(op, f"{name} must be int32 of shape [B] = [{B}], got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        _fail(op, f"{name} must be on the same device as the other tensors ({device}), got {t.device}")


@torch.library.register_fake("vegas::block_minmax_update")
def _minmax_fake(key_min, key_max, k_cache, seq_lens, start, block_size):
    op = "block_minmax_update"
    if k_cache.dim() != 4:
        _fail(op, f"k_cache must be 4-D [B, H_kv, S, D], got shape {tuple(k_cache.shape)}")
    if block_size < 1:
        _fail(op, f"block_size must be >= 1, got {block_size}")
    B, Hkv, S, D = k_cache.shape
    _check_meta(op, key_min, key_max, B, D)
    if key_min.shape[1] != Hkv or key_min.shape[2] != -(-S // block_size):
        _fail(op, f"key_min must have shape [B, H_kv, ceil(S / block_size), D] = "
                  f"[{B}, {Hkv}, {-(-S // block_size)}, {D}], got {tuple(key_min.shape)}")
    _check_int32_vec(op, "seq_lens", seq_lens, B, k_cache.device)
    _check_int32_vec(op, "start", start, B, k_cache.device)
    return None


@torch.library.register_fake("vegas::quest_block_scores")
def _quest_fake(q, key_min, key_max, num_blocks):
    op = "quest_block_scores"
    if q.dim() != 4:
        _fail(op, f"q must be 4-D [B, Q, H_q, D], got shape {tuple(q.shape)}")
    B, Q, Hq, D = q.shape
    _check_meta(op, key_min, key_max, B, D)
    Hkv = key_min.shape[1]
    if Hkv <= 0 or Hq % Hkv != 0:
        _fail(op, f"the number of query heads H_q ({Hq}) must be a positive multiple of the number of KV heads "
                  f"H_kv ({Hkv})")
    _check_int32_vec(op, "num_blocks", num_blocks, B, q.device)
    return q.new_empty((B, Hkv, key_min.shape[2]), dtype=torch.float32)


def _no_backward(op):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"vegas::{op} is an inference kernel and has no backward; call it under torch.no_grad() "
            "or torch.inference_mode(), or detach its inputs"
        )

    return backward


# Differentiating through the ops raises a clear error instead of silently returning no gradient.
for _op in ("verify_attention", "sparse_draft_attention", "quest_block_scores"):
    torch.library.register_autograd(f"vegas::{_op}", _no_backward(_op))


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _per_row(op: str, name: str, value, rows: int, device) -> Tensor:
    """``value`` as the ``[rows]`` int32 tensor the op takes: a Python int is repeated per row."""
    v = int(value)
    if not _INT32_MIN <= v <= _INT32_MAX:
        _fail(op, f"{name} = {v} does not fit in int32")
    return torch.full((rows,), v, dtype=torch.int32, device=device)


def _make_dispatching(name, compiled, fallback, per_row=(), rows_from=0):
    """The public wrapper of op ``name``: ``compiled`` (the typed function, which calls
    ``torch.ops.vegas``) where a compiled kernel serves the device, else ``fallback``.

    It keeps ``compiled``'s signature and docstring (``inspect.signature`` / ``help`` show the real
    arguments), and turns a Python int given for one of the ``per_row`` arguments (one value per
    batch row) into the ``[B]`` int32 tensor the op takes, on the device of the first argument; ``B``
    is ``shape[0]`` of argument number ``rows_from``."""
    names = list(inspect.signature(compiled).parameters)
    per_row = tuple((p, names.index(p)) for p in per_row)
    first_name, rows_name = names[0], names[rows_from]

    @functools.wraps(compiled)  # sets __wrapped__: inspect.signature and help() show compiled's
    def fn(*args, **kwargs):
        first = args[0] if args else kwargs.get(first_name)
        if not isinstance(first, torch.Tensor):  # the typed function raises the clear TypeError
            return compiled(*args, **kwargs)
        for p, i in per_row:
            v = args[i] if i < len(args) else kwargs.get(p)
            if isinstance(v, int) and not isinstance(v, bool):
                src = args[rows_from] if rows_from < len(args) else kwargs.get(rows_name)
                rows = src.shape[0] if isinstance(src, torch.Tensor) and src.dim() else 1
                v = _per_row(name, p, v, rows, first.device)
                if i < len(args):
                    args = args[:i] + (v,) + args[i + 1:]
                else:
                    kwargs[p] = v
        if _use_compiled(name, first.device):
            return compiled(*args, **kwargs)
        return fallback(*args, **kwargs)

    return fn


verify_attention = _make_dispatching("verify_attention", verify_attention, _verify_fallback, ("seq_lens",))
block_topk = _make_dispatching("block_topk", block_topk, _topk_fallback, ("k", "num_candidates"))
sparse_draft_attention = _make_dispatching("sparse_draft_attention", sparse_draft_attention, _draft_fallback,
                                           ("tail_start", "seq_lens"))
block_minmax_update = _make_dispatching("block_minmax_update", block_minmax_update, reference.block_minmax_update,
                                        ("seq_lens", "start"), rows_from=2)
quest_block_scores = _make_dispatching("quest_block_scores", quest_block_scores, reference.quest_block_scores,
                                       ("num_blocks",))


# ---------------------------------------------------------------------------
# paged_block_scores (the selection signal inside a paged-cache engine such as vLLM)
# ---------------------------------------------------------------------------
def paged_block_scores(
    q: Tensor,
    key_cache: Tensor,
    block_table: Tensor,
    seq_lens: Union[Tensor, int],
    query_start_loc: Tensor,
    num_queries: int,
    scale: float,
) -> Tensor:
    """Attention mass per page of a paged KV cache from the newest queries of each request.

    The Vegas selection signal (arXiv 2602.07223) for an engine whose own attention kernel
    returns neither scores nor a log-sum-exp (vLLM's paged kernels): the scores are recomputed
    from q and the keys, normalized per query row by the row's own log-sum-exp, and summed per
    page; the attention output is not computed. Packed-batch layout of vLLM: the queries of all
    requests are concatenated, request ``r`` owns rows ``[query_start_loc[r],
    query_start_loc[r+1])`` and its ``q_len`` queries sit at positions ``seq_lens[r] - q_len ...
    seq_lens[r] - 1`` (causal: query ``i`` sees tokens ``t <= seq_lens[r] - q_len + i``).

    Args:
        q: ``[T, H_q, D]`` float32/bfloat16/float16, any strides.
        key_cache: ``[num_pages, H_kv, page_size, D]``, dtype of q, any strides (a view: vLLM's CPU
            cache stores each page's keys as ``[D, page_size]``, see
            :func:`vegas_ext.vllm.cpu_layout.key_cache_view`; the flash layout ``[num_blocks,
            page_size, H_kv, D]`` is ``.transpose(1, 2)``).
        block_table: ``[R, max_pages]`` int32, physical page of each logical page; only the first
            ``ceil(seq_lens[r] / page_size)`` entries of a request with queries are read.
        seq_lens: ``[R]`` int32, tokens of request ``r`` including its new ones, in
            ``[q_len, max_pages * page_size]``, or a Python int for every request.
        query_start_loc: ``[R + 1]`` int32, non-decreasing, starting at 0, ending ``<= T``.
        num_queries: ``>= 1``; only the last ``min(q_len, num_queries)`` queries of each request
            are scored (a verification window: γ + 1; a prefill's last γ + 1 tokens).
        scale: softmax scale of ``q . k`` (usually ``D ** -0.5``).

    Returns:
        ``[R, H_kv, max_pages]`` float32: for KV head ``g`` and logical page ``j`` of request
        ``r``, the softmax probability on the page's tokens summed over the scored queries and
        the query heads ``g * G ... g * G + G - 1`` (``G = H_q / H_kv``); zero past
        ``seq_lens[r]`` and for requests without queries. A request's row over pages sums to
        ``G * min(q_len, num_queries)``.

    Raises:
        RuntimeError / ValueError naming the argument: wrong rank, dtype or device, H_q not a
        multiple of H_kv, head_dim mismatch, seq_lens outside the range, a
        page id outside ``[0, num_pages)``, num_queries < 1, a non-positive scale.

    CPU and CUDA kernels. The CUDA kernel (two passes over the keys: per-row max / sum, then
    per-page sums normalized by the row's log-sum-exp; head_dim <= 256) matches the reference on
    an H200 (bench/results/gpu_h200); like the other CUDA kernels it runs unless
    ``VEGAS_CUDA_KERNELS=0`` (or :func:`set_cuda_kernels_enabled` ``(False)``) asks for the
    checked plain-PyTorch reference. It makes no host sync: the values of ``seq_lens``,
    ``query_start_loc`` and ``block_table`` are checked on the host only with
    ``VEGAS_CUDA_VALUE_CHECKS=1``; without, a request with out-of-range lengths gets NaN pages
    and a page id outside the cache is not read (the rows that see it get NaN).
    """
    return torch.ops.vegas.paged_block_scores(q, key_cache, block_table, seq_lens, query_start_loc, num_queries, scale)


def _check_paged(op, q, key_cache, block_table, seq_lens, query_start_loc, num_queries, scale):
    if q.dim() != 3:
        _fail(op, f"q must be 3-D [T, H_q, D], got shape {tuple(q.shape)}")
    if key_cache.dim() != 4:
        _fail(op, f"key_cache must be 4-D [num_pages, H_kv, page_size, D], got shape {tuple(key_cache.shape)}")
    if q.dtype not in _ATTN_DTYPES:
        _fail(op, f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if key_cache.dtype != q.dtype:
        _fail(op, f"key_cache dtype ({key_cache.dtype}) must equal q dtype ({q.dtype})")
    for name, t in (("key_cache", key_cache), ("block_table", block_table), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        if t.device != q.device:
            _fail(op, f"{name} must be on the same device as q ({q.device}), got {t.device}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        _fail(op, f"block_table must be int32 [R, max_pages], got {block_table.dtype} {tuple(block_table.shape)}")
    R = block_table.shape[0]
    if seq_lens.dim() != 1 or seq_lens.shape[0] != R or seq_lens.dtype != torch.int32:
        _fail(op, f"seq_lens must be int32 of shape [R] = [{R}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != R + 1 or query_start_loc.dtype != torch.int32:
        _fail(op, f"query_start_loc must be int32 of shape [R + 1] = [{R + 1}], got {query_start_loc.dtype} "
                  f"{tuple(query_start_loc.shape)}")
    if key_cache.shape[3] != q.shape[2]:
        _fail(op, f"key_cache head_dim ({key_cache.shape[3]}) must equal q head_dim ({q.shape[2]})")
    Hq, Hkv = q.shape[1], key_cache.shape[1]
    if Hkv <= 0 or Hq <= 0 or Hq % Hkv != 0:
        _fail(op, f"the number of query heads H_q ({Hq}) must be a positive multiple of the number of KV heads "
                  f"H_kv ({Hkv})")
    if num_queries < 1:
        _fail(op, f"num_queries must be >= 1, got {num_queries}")
    if not (math.isfinite(scale) and scale > 0):
        _fail(op, f"scale must be a positive finite float, got {scale}")
    return R, Hkv, block_table.shape[1]


def _paged_fallback(q, key_cache, block_table, seq_lens, query_start_loc, num_queries, scale):
    op = "paged_block_scores"
    _check_paged(op, q, key_cache, block_table, seq_lens, query_start_loc, num_queries, scale)
    _check_paged_values(op, q, key_cache, block_table, seq_lens, query_start_loc)
    return reference.paged_block_scores(q, key_cache, block_table, seq_lens, query_start_loc, num_queries, scale)


def _check_paged_values(op, q, key_cache, block_table, seq_lens, query_start_loc):
    """Value checks of the paged ops on host copies (syncs): lengths and the page ids read."""
    R, P = block_table.shape
    ps, NP = key_cache.shape[2], key_cache.shape[0]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if qsl[0] != 0 or qsl[-1] > q.shape[0]:
        _fail(op, f"query_start_loc must start at 0 and end at most at T = {q.shape[0]}, got [{qsl[0]} .. {qsl[-1]}]")
    for r in range(R):
        ql = qsl[r + 1] - qsl[r]
        if ql < 0:
            _fail(op, f"query_start_loc must be non-decreasing, got {qsl[r]} then {qsl[r + 1]} at request {r}")
        if not (ql <= lens[r] <= P * ps):
            _fail(op, f"seq_lens[{r}] = {lens[r]} must lie in [q_len, max_pages * page_size] = [{ql}, {P * ps}]")
        if ql and lens[r]:
            used = block_table[r, : -(-lens[r] // ps)]
            if bool(((used < 0) | (used >= NP)).any()):
                _fail(op, f"block_table[{r}] holds a page id outside [0, num_pages) = [0, {NP})")


@torch.library.register_fake("vegas::paged_block_scores")
def _paged_fake(q, key_cache, block_table, seq_lens, query_start_loc, num_queries, scale):
    R, Hkv, P = _check_paged("paged_block_scores", q, key_cache, block_table, seq_lens, query_start_loc, num_queries,
                             scale)
    return q.new_empty((R, Hkv, P), dtype=torch.float32)


torch.library.register_autograd("vegas::paged_block_scores", _no_backward("paged_block_scores"))
paged_block_scores = _make_dispatching("paged_block_scores", paged_block_scores, _paged_fallback, ("seq_lens",),
                                        rows_from=2)  # one value per request: R = block_table.shape[0]
__all__.append("paged_block_scores")


# ---------------------------------------------------------------------------
# weight_only_linear (the low-precision linears of the draft forwards, vegas_ext.draft_weights)
# ---------------------------------------------------------------------------
def weight_only_linear(x: Tensor, weight: Tensor, scales: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                       group_size: int = 64) -> Tensor:
    """``y = x . W^T (+ bias)`` for few rows of float32 activations against a weight stored as
    float16, or as int8 with one float32 scale per group of ``group_size`` weights along K
    (symmetric: ``W[n, k] ~= weight[n, k] * scales[n, k // group_size]``); float32 accumulation.

    The draft forwards' linears (:mod:`vegas_ext.draft_weights`): a decoding step's 1-16 rows make
    a linear a weight-streaming problem, and reading 2 (fp16) or ~1.06 (int8, groups of 64) bytes
    per weight instead of 4 cuts its time. CPU kernel (AVX-512, AVX2+F16C or scalar, chosen at run
    time; ``VEGAS_CPU_ISA`` caps it), threads split the output columns; elsewhere the reference
    (dequantize, then ``F.linear``) runs.

    An int8 weight comes row-major ``[N, K]`` or packed (:func:`vegas_ext.draft_weights.pack_int8`:
    ``[ceil(N / 16), ceil(K / 2), 16, 2]``, two columns of 16 rows side by side), which the draft
    copies use. Packed, x is rounded to int16 per (row, group) -- to multiples of ``max |x| / 32767``
    of the group -- and the products are summed in int32 within a group (AVX-512 VNNI ``vpdpwssd``
    where the processor has it, else ``vpmaddwd``): the weights are never converted to float, which
    at 4-8 rows makes it 1.3-1.8x faster than row-major on Zen 4 (1.07-1.1x at 1 row, where both
    stream at the memory's pace: ``bench/results/draft_weights_zen4/kernel.json``). The rounding adds at most
    ``sum_k |W[n, k]| * step_g(k) / 2`` to each output; every ISA path gives the same bits.

    Args:
        x: ``[..., K]`` float32, any strides (copied to contiguous rows if needed).
        weight: ``[N, K]`` float16 or int8, or packed int8 ``[ceil(N / 16), ceil(K / 2), 16, 2]``;
            contiguous.
        scales: int8 weight: ``[N, ceil(K / group_size)]`` float32, contiguous (packed: gives N);
            float16: ``None``.
        bias: ``[N]`` float32 or ``None``.
        group_size: weights per scale along K for int8 (a positive multiple of 16; 64 by default);
            unused with float16.

    Returns:
        ``[..., N]`` float32. Equal to :func:`vegas_ext.reference.weight_only_linear` up to float32
        summation order (a different one: not the same bits); packed, the reference rounds x the
        same way, and an inf or NaN in a group of x's row makes that row's outputs NaN.

    Raises:
        ValueError / RuntimeError naming the argument: wrong rank, dtype, shape, device or layout
        of ``x``, ``weight``, ``scales`` or ``bias``; scales given with float16 or missing with
        int8; a group_size that is not a positive multiple of 16 (int8).
    """
    return torch.ops.vegas.weight_only_linear(x, weight, scales, bias, group_size)


def _check_wol(op, x, weight, scales, bias, group_size):
    _require_tensors(op, x=x, weight=weight, scales_opt=scales, bias_opt=bias)
    packed = weight.dim() == 4
    if weight.dim() != 2 and not packed:
        _fail(op, f"weight must be 2-D [N, K] or packed int8 [ceil(N / 16), ceil(K / 2), 16, 2], "
                  f"got shape {tuple(weight.shape)}")
    if packed:
        if weight.dtype != torch.int8:
            _fail(op, f"a packed (4-D) weight must be int8, got {weight.dtype}")
        if scales is None or scales.dim() != 2:
            _fail(op, "a packed int8 weight needs scales [N, ceil(K / group_size)] float32 (N: the output size)")
        N, K = scales.shape[0], (x.shape[-1] if x.dim() >= 1 else 0)
        want = (-(-N // 16), -(-K // 2), 16, 2)
        if tuple(weight.shape) != want:
            _fail(op, f"a packed int8 weight must have shape [ceil(N / 16), ceil(K / 2), 16, 2] = {list(want)} "
                      f"(N = scales.size(0), K = x.size(-1)), got {tuple(weight.shape)}")
    else:
        N, K = weight.shape
    if x.dim() < 1 or x.shape[-1] != K:
        _fail(op, f"x must have shape [..., K] with K = weight.size(1) = {K}, got {tuple(x.shape)}")
    if x.dtype != torch.float32:
        _fail(op, f"x must be float32, got {x.dtype}")
    if weight.dtype not in (torch.float16, torch.int8):
        _fail(op, f"weight must be float16 or int8, got {weight.dtype}")
    for name, t in (("weight", weight), ("scales", scales), ("bias", bias)):
        if t is not None and t.device != x.device:
            _fail(op, f"{name} must be on the same device as x ({x.device}), got {t.device}")
    if weight.dtype == torch.int8:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 16 or group_size % 16:
            _fail(op, f"group_size must be a positive multiple of 16, got {group_size!r}")
        ng = -(-K // group_size)
        if scales is None:
            _fail(op, f"scales [N, ceil(K / group_size)] = [{N}, {ng}] float32 are required with an int8 weight")
        if scales.dim() != 2 or tuple(scales.shape) != (N, ng):
            _fail(op, f"scales must have shape [N, ceil(K / group_size)] = [{N}, {ng}], got {tuple(scales.shape)}")
        if scales.dtype != torch.float32:
            _fail(op, f"scales must be float32, got {scales.dtype}")
    elif scales is not None:
        _fail(op, "scales must be None with a float16 weight")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N or bias.dtype != torch.float32):
        _fail(op, f"bias must be float32 of shape [N] = [{N}], got {bias.dtype} {tuple(bias.shape)}")
    return N


def _wol_fallback(x, weight, scales=None, bias=None, group_size=64):
    _check_wol("weight_only_linear", x, weight, scales, bias, group_size)
    return reference.weight_only_linear(x, weight, scales, bias, group_size)


@torch.library.register_fake("vegas::weight_only_linear")
def _wol_fake(x, weight, scales=None, bias=None, group_size=64):
    N = _check_wol("weight_only_linear", x, weight, scales, bias, group_size)
    return x.new_empty((*x.shape[:-1], N))


torch.library.register_autograd("vegas::weight_only_linear", _no_backward("weight_only_linear"))
weight_only_linear = _make_dispatching("weight_only_linear", weight_only_linear, _wol_fallback)
__all__.append("weight_only_linear")


# ---------------------------------------------------------------------------
# rope_kv_write (RoPE + the K/V write of one layer: the lean draft forward, vegas_ext.draft_forward)
# ---------------------------------------------------------------------------
def rope_kv_write(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                  write_pos: Tensor) -> Tensor:
    """RoPE on one layer's new queries and keys, and the rotated keys and the values written into
    that layer's KV cache, in one call (what transformers' ``apply_rotary_pos_emb`` and
    :meth:`VegasCacheLayer.update <vegas_ext.cache.VegasCacheLayer.update>` do in ~20 tensor ops).

    Rotation in the "rotate_half" layout of the Llama family: ``x * cos + rotate_half(x) * sin``,
    ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``, the two products rounded before the sum
    as the tensor ops round them (the CPU kernel equals :func:`vegas_ext.reference.rope_kv_write`
    bit for bit in float32). CPU kernel; elsewhere the reference runs.

    Args:
        q: ``[B, Q, H_q, D]`` float32, bfloat16 or float16, ``D`` even; any strides with the last
            one 1 (e.g. a head view of a fused q/k/v projection).
        k, v: ``[B, Q, H_kv, D]``, q's dtype and device, last stride 1.
        cos, sin: ``[B, Q, D]``, q's dtype, last stride 1 (the model's rotary module's output for
            the new tokens' positions).
        k_cache, v_cache: ``[B, H_kv, S, D]``, q's dtype, last stride 1; written in place at
            ``[b, :, write_pos[b, t]]`` (rotated keys / values).
        write_pos: ``[B, Q]`` int64 positions in ``[0, S)`` (distinct within a row).

    Returns:
        ``[B, Q, H_q, D]`` contiguous: the rotated queries.

    Raises:
        ValueError / RuntimeError naming the argument: wrong rank, shape, dtype, device or layout,
        an odd ``D``, a ``write_pos`` outside ``[0, S)``.
    """
    _require_tensors("rope_kv_write", q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache,
                     write_pos=write_pos)
    return torch.ops.vegas.rope_kv_write(q, k, v, cos, sin, k_cache, v_cache, write_pos)


def _check_rkw(op, q, k, v, cos, sin, k_cache, v_cache, write_pos):
    _require_tensors(op, q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, write_pos=write_pos)
    if q.dim() != 4:
        _fail(op, f"q must be 4-D [B, Q, H_q, D], got shape {tuple(q.shape)}")
    B, Q, _, D = q.shape
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        _fail(op, f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if D <= 0 or D % 2:
        _fail(op, f"head_dim D must be even and positive, got {D}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (B, Q, D):
            _fail(op, f"{name} must have shape [B, Q, H, D] = [{B}, {Q}, H, {D}], got {tuple(t.shape)}")
    if v.shape[2] != k.shape[2]:
        _fail(op, f"v must have the heads of k ({k.shape[2]}), got {v.shape[2]}")
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (B, Q, D):
            _fail(op, f"{name} must have shape [B, Q, D] = [{B}, {Q}, {D}], got {tuple(t.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (B, k.shape[2], D):
            _fail(op, f"{name} must have shape [B, H_kv, S, D] = [{B}, {k.shape[2]}, S, {D}], got {tuple(t.shape)}")
    if v_cache.shape[2] != k_cache.shape[2]:
        _fail(op, f"v_cache must have the length of k_cache ({k_cache.shape[2]}), got {v_cache.shape[2]}")
    for name, t in (("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            _fail(op, f"{name} dtype ({t.dtype}) must equal q dtype ({q.dtype})")
    for name, t in (("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("write_pos", write_pos)):
        if t.device != q.device:
            _fail(op, f"{name} must be on the same device as q ({q.device}), got {t.device}")
    if tuple(write_pos.shape) != (B, Q):
        _fail(op, f"write_pos must have shape [B, Q] = [{B}, {Q}], got {tuple(write_pos.shape)}")
    if write_pos.dtype != torch.int64:
        _fail(op, f"write_pos must be int64, got {write_pos.dtype}")


def _rkw_fallback(q, k, v, cos, sin, k_cache, v_cache, write_pos):
    _check_rkw("rope_kv_write", q, k, v, cos, sin, k_cache, v_cache, write_pos)
    S = k_cache.shape[2]
    if write_pos.numel() and (int(write_pos.min()) < 0 or int(write_pos.max()) >= S):
        _fail("rope_kv_write", f"write_pos values must lie in [0, S) = [0, {S}), got "
                               f"[{int(write_pos.min())}, {int(write_pos.max())}]")
    return reference.rope_kv_write(q, k, v, cos, sin, k_cache, v_cache, write_pos)


@torch.library.register_fake("vegas::rope_kv_write")
def _rkw_fake(q, k, v, cos, sin, k_cache, v_cache, write_pos):
    _check_rkw("rope_kv_write", q, k, v, cos, sin, k_cache, v_cache, write_pos)
    return q.new_empty(q.shape)


rope_kv_write = _make_dispatching("rope_kv_write", rope_kv_write, _rkw_fallback)
__all__.append("rope_kv_write")


# ---------------------------------------------------------------------------
# add_rms_norm (residual add + RMSNorm: the lean draft forward's norms, vegas_ext.draft_forward)
# ---------------------------------------------------------------------------
def add_rms_norm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float) -> Tensor:
    """A residual add and the RMSNorm after it, in one call: ``x += residual`` in place (skipped
    for ``residual=None``), then ``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension
    (transformers' ``LlamaRMSNorm``), computed in float32.

    On CPU a kernel (``F.rms_norm`` decomposes into ~10 tensor ops there); elsewhere the
    reference. Equal to :func:`vegas_ext.reference.add_rms_norm` up to float32 summation order.

    Args:
        x: ``[..., N]`` float32, bfloat16 or float16, contiguous; updated in place when
            ``residual`` is given.
        residual: ``None`` or x's shape and dtype.
        weight: ``[N]``, x's dtype.
        eps: float >= 0.

    Returns:
        ``[..., N]`` in x's dtype: the normed rows.

    Raises:
        ValueError / RuntimeError naming the argument: wrong shape, dtype, device or layout, a
        negative or non-finite ``eps``.
    """
    _require_tensors("add_rms_norm", x=x, residual_opt=residual, weight=weight)
    return torch.ops.vegas.add_rms_norm(x, residual, weight, float(eps))


def _check_arn(op, x, residual, weight, eps):
    _require_tensors(op, x=x, residual_opt=residual, weight=weight)
    if x.dim() < 1:
        _fail(op, "x must have at least one dimension [..., N], got a scalar")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        _fail(op, f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if not x.is_contiguous():
        _fail(op, "x must be contiguous (it is updated in place)")
    N = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != N:
        _fail(op, f"weight must have shape [N] = [{N}], got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        _fail(op, f"weight dtype ({weight.dtype}) must equal x dtype ({x.dtype})")
    if not (math.isfinite(eps) and eps >= 0):
        _fail(op, f"eps must be a finite float >= 0, got {eps}")
    if residual is not None:
        if residual.shape != x.shape:
            _fail(op, f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            _fail(op, f"residual dtype ({residual.dtype}) must equal x dtype ({x.dtype})")
    for name, t in (("weight", weight), ("residual", residual)):
        if t is not None and t.device != x.device:
            _fail(op, f"{name} must be on the same device as x ({x.device}), got {t.device}")


def _arn_fallback(x, residual, weight, eps):
    _check_arn("add_rms_norm", x, residual, weight, eps)
    return reference.add_rms_norm(x, residual, weight, eps)


@torch.library.register_fake("vegas::add_rms_norm")
def _arn_fake(x, residual, weight, eps):
    _check_arn("add_rms_norm", x, residual, weight, eps)
    return torch.empty_like(x)


add_rms_norm = _make_dispatching("add_rms_norm", add_rms_norm, _arn_fallback)
__all__.append("add_rms_norm")


# ---------------------------------------------------------------------------
# silu_mul (the gated activation on a fused gate/up projection: the lean draft forward's MLP)
# ---------------------------------------------------------------------------
def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]``: a Llama-family MLP's gated activation on its
    fused gate/up projection, in one call (a split, a SiLU and a product otherwise).

    Args:
        gate_up: ``[..., 2 * I]`` float32, bfloat16 or float16 (gate first, then up).

    Returns:
        ``[..., I]``, gate_up's dtype; equal to :func:`vegas_ext.reference.silu_mul` up to float32
        rounding of the exponential. CPU kernel; elsewhere the reference.

    Raises:
        ValueError / RuntimeError naming ``gate_up``: a scalar, an odd last dimension, another dtype.
    """
    _require_tensors("silu_mul", gate_up=gate_up)
    return torch.ops.vegas.silu_mul(gate_up)


def _check_sm(op, gate_up):
    _require_tensors(op, gate_up=gate_up)
    if gate_up.dim() < 1:
        _fail(op, "gate_up must have at least one dimension [..., 2 * I], got a scalar")
    if gate_up.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        _fail(op, f"gate_up must be float32, bfloat16 or float16, got {gate_up.dtype}")
    if gate_up.shape[-1] % 2:
        _fail(op, f"gate_up's last dimension must be even (gate and up halves), got {gate_up.shape[-1]}")


def _sm_fallback(gate_up):
    _check_sm("silu_mul", gate_up)
    return reference.silu_mul(gate_up)


@torch.library.register_fake("vegas::silu_mul")
def _sm_fake(gate_up):
    _check_sm("silu_mul", gate_up)
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


torch.library.register_autograd("vegas::silu_mul", _no_backward("silu_mul"))
silu_mul = _make_dispatching("silu_mul", silu_mul, _sm_fallback)
__all__.append("silu_mul")


# ---------------------------------------------------------------------------
# paged_verify_attention (verification attention and page scores in one pass, inside vLLM)
# ---------------------------------------------------------------------------
def paged_verify_attention(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Union[Tensor, int],
    query_start_loc: Tensor,
    num_queries: int,
    scale: float,
    score_block_size: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """Verification attention over a paged KV cache and its page scores, in one pass.

    Vegas's verification inside a paged engine (vLLM): the causal attention output of every
    packed query AND :func:`paged_block_scores` of the same call (the selection signal), computed
    from one read of each request's keys and values instead of the engine's attention followed by
    a second pass over the keys. Packed-batch layout of vLLM: request ``r`` owns query rows
    ``[query_start_loc[r], query_start_loc[r+1])``, its ``q_len`` queries sit at positions
    ``seq_lens[r] - q_len ... seq_lens[r] - 1``, query ``i`` sees tokens
    ``t <= seq_lens[r] - q_len + i`` (its own K/V must already be in the cache).

    Args:
        q: ``[T, H_q, D]`` float32/bfloat16/float16, any strides.
        key_cache: ``[num_pages, H_kv, page_size, D]``, dtype of q, any strides. vLLM's CPU cache
            stores a page's keys ``[D, page_size]``: pass
            :func:`vegas_ext.vllm.cpu_layout.key_cache_view` (the kernel reads tokens-contiguous
            pages fastest).
        value_cache: same shape and dtype as ``key_cache``, any strides (vLLM's CPU cache: the V
            half, ``[page_size, D]`` per page, :func:`vegas_ext.vllm.cpu_layout.value_cache_view`).
        block_table: ``[R, max_pages]`` int32, physical page of each logical page; only the first
            ``ceil(seq_lens[r] / page_size)`` entries of a request with queries are read.
        seq_lens: ``[R]`` int32 in ``[q_len, max_pages * page_size]``, or a Python int for all.
        query_start_loc: ``[R + 1]`` int32, non-decreasing, starting at 0, ending ``<= T``.
        num_queries: ``>= 1``; the last ``min(q_len, num_queries)`` queries of each request are
            scored (γ + 1 on a verification).
        scale: softmax scale of ``q . k`` (usually ``D ** -0.5``).
        score_block_size: logical tokens per score, ``>= 1``; ``None`` (default): ``page_size``,
            the page scores. ``1`` gives one score per token (token-granular draft selection,
            :func:`paged_sparse_draft_attention`). Any size works on CPU (blocks need not align
            with pages); the CUDA kernel accepts only ``None`` or ``page_size``.

    Returns:
        ``(out, block_scores)``: ``out`` ``[T, H_q, D]`` dtype of q (fp32 accumulation; rows past
        ``query_start_loc[R]`` are zero); ``block_scores`` ``[R, H_kv, ceil(max_pages * page_size
        / score_block_size)]`` float32 (``[R, H_kv, max_pages]`` by default), the probability mass
        of each block of tokens ``[j * b, (j + 1) * b)`` summed over the scored queries and the G
        query heads of each KV head, as :func:`paged_block_scores` (a request's row sums to
        ``G * min(q_len, num_queries)``; zero past its tokens and for requests without queries).
        Per-token scores summed over each page equal the page scores (up to fp32 rounding).

    Raises:
        RuntimeError / ValueError naming the argument, as :func:`paged_block_scores`, plus a
        ``value_cache`` whose shape, dtype or device differs from ``key_cache``'s and a
        ``score_block_size`` below 1 (or, for the CUDA kernel, other than ``page_size``).

    A NaN or infinite score poisons its row's output (NaN, as in the reference) but adds no mass
    to the scores (the reference gives NaN pages).

    CPU kernel (csrc/cpu/paged_verify_attention.cpp) and CUDA kernel (SIMT; correct on an H200
    but 25-100x slower than verify_attention, bench/results/gpu_h200): like the other CUDA kernels
    it runs unless ``VEGAS_CUDA_KERNELS=0`` (or :func:`set_cuda_kernels_enabled` ``(False)``) asks
    for the checked plain-PyTorch reference. Without ``VEGAS_CUDA_VALUE_CHECKS=1`` the CUDA kernel makes no
    host sync: a request with out-of-range lengths gets NaN scores and no output.
    """
    return torch.ops.vegas.paged_verify_attention(q, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                                                  num_queries, scale, score_block_size)


def _check_values_cache(op, key_cache, value_cache):
    if value_cache.dim() != 4 or tuple(value_cache.shape) != tuple(key_cache.shape):
        _fail(op, f"value_cache must have key_cache's shape [num_pages, H_kv, page_size, D] = "
                  f"{tuple(key_cache.shape)}, got {tuple(value_cache.shape)}")
    if value_cache.dtype != key_cache.dtype:
        _fail(op, f"value_cache dtype ({value_cache.dtype}) must equal q dtype ({key_cache.dtype})")
    if value_cache.device != key_cache.device:
        _fail(op, f"value_cache must be on the same device as key_cache ({key_cache.device}), got {value_cache.device}")


def _check_pva(op, q, key_cache, value_cache, block_table, seq_lens, query_start_loc, num_queries, scale,
               score_block_size=None):
    """Shape checks; returns (R, H_kv, number of score blocks)."""
    R, Hkv, P = _check_paged(op, q, key_cache, block_table, seq_lens, query_start_loc, num_queries, scale)
    _check_values_cache(op, key_cache, value_cache)
    ps = key_cache.shape[2]
    b = ps if score_block_size is None else score_block_size
    if b < 1:
        _fail(op, f"score_block_size must be >= 1 (or None for page_size), got {b}")
    return R, Hkv, -(-P * ps // b)


def _pva_fallback(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, num_queries, scale,
                  score_block_size=None):
    op = "paged_verify_attention"
    _check_pva(op, q, key_cache, value_cache, block_table, seq_lens, query_start_loc, num_queries, scale,
               score_block_size)
    _check_paged_values(op, q, key_cache, block_table, seq_lens, query_start_loc)
    return reference.paged_verify_attention(q, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                                            num_queries, scale, score_block_size)


@torch.library.register_fake("vegas::paged_verify_attention")
def _pva_fake(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, num_queries, scale,
              score_block_size=None):
    R, Hkv, NB = _check_pva("paged_verify_attention", q, key_cache, value_cache, block_table, seq_lens,
                            query_start_loc, num_queries, scale, score_block_size)
    return q.new_empty(q.shape), q.new_empty((R, Hkv, NB), dtype=torch.float32)


torch.library.register_autograd("vegas::paged_verify_attention", _no_backward("paged_verify_attention"))
paged_verify_attention = _make_dispatching("paged_verify_attention", paged_verify_attention, _pva_fallback,
                                           ("seq_lens",), rows_from=3)  # R = block_table.shape[0]
__all__.append("paged_verify_attention")


# ---------------------------------------------------------------------------
# paged_sparse_draft_attention (token-granular drafts inside vLLM)
# ---------------------------------------------------------------------------
def paged_sparse_draft_attention(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Union[Tensor, int],
    query_start_loc: Tensor,
    token_indices: Tensor,
    tail_start: Union[Tensor, int],
    scale: float,
) -> Tensor:
    """Draft attention over selected tokens of a paged KV cache plus the tail.

    The paged twin of :func:`sparse_draft_attention` at block size 1 (Vegas's own loop drafts at
    token granularity): query head ``h`` of request ``r`` (KV head ``g = h // (H_q / H_kv)``)
    attends to the tokens ``token_indices[r, g]`` that lie before ``tail_start[r]`` plus every
    tail token ``[tail_start[r], seq_lens[r])``, causally, with an exact softmax over that set,
    reading each token through the block table. Packed-batch layout of vLLM as
    :func:`paged_verify_attention`: request ``r`` owns query rows ``[query_start_loc[r],
    query_start_loc[r+1])`` at positions ``seq_lens[r] - q_len ... seq_lens[r] - 1`` (their K/V
    already in the cache).

    Args:
        q: ``[T, H_q, D]`` float32/bfloat16/float16, any strides.
        key_cache, value_cache: ``[num_pages, H_kv, page_size, D]``, dtype of q, any strides (the
            views that :func:`paged_verify_attention` takes).
        block_table: ``[R, max_pages]`` int32, physical page of each logical page; entries of
            the pages a request with queries reads must lie in ``[0, num_pages)``.
        seq_lens: ``[R]`` int32 in ``[q_len, max_pages * page_size]``, or a Python int for all.
        query_start_loc: ``[R + 1]`` int32, non-decreasing, starting at 0, ending ``<= T``.
        token_indices: ``[R, H_kv, K]`` int32 logical token positions, strictly ascending, then
            ``-1`` padding (:func:`block_topk`'s output at block size 1); entries at or past
            ``tail_start[r]`` are ignored (the tail holds them anyway).
        tail_start: ``[R]`` int32 in ``[0, seq_lens[r] - q_len]``, or a Python int for all.
        scale: softmax scale of ``q . k``.

    Returns:
        ``[T, H_q, D]``, dtype of q (fp32 accumulation); rows past ``query_start_loc[R]`` are
        zero. With every token before the tail selected it equals :func:`paged_verify_attention`'s
        output.

    Raises:
        RuntimeError / ValueError naming the argument: the checks of
        :func:`paged_verify_attention`, plus token_indices not int32 ``[R, H_kv, K]`` or not
        ascending-then-padding, tail_start not int32 ``[R]`` or outside its range.

    CPU kernel (csrc/cpu/paged_sparse_draft_attention.cpp); other devices run the checked
    plain-PyTorch reference (no CUDA kernel yet).
    """
    return torch.ops.vegas.paged_sparse_draft_attention(q, key_cache, value_cache, block_table, seq_lens,
                                                        query_start_loc, token_indices, tail_start, scale)


def _check_psda(op, q, key_cache, value_cache, block_table, seq_lens, query_start_loc, token_indices, tail_start,
                scale):
    R, Hkv, _ = _check_paged(op, q, key_cache, block_table, seq_lens, query_start_loc, 1, scale)
    _check_values_cache(op, key_cache, value_cache)
    if token_indices.device != q.device:
        _fail(op, f"token_indices must be on the same device as q ({q.device}), got {token_indices.device}")
    if token_indices.dim() != 3 or tuple(token_indices.shape[:2]) != (R, Hkv) or token_indices.dtype != torch.int32:
        _fail(op, f"token_indices must be int32 [R, H_kv, K] = [{R}, {Hkv}, K], got {token_indices.dtype} "
                  f"{tuple(token_indices.shape)}")
    _check_per_row(op, "tail_start", tail_start, R, q, "q")


def _psda_fallback(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, token_indices, tail_start,
                   scale):
    op = "paged_sparse_draft_attention"
    _check_psda(op, q, key_cache, value_cache, block_table, seq_lens, query_start_loc, token_indices, tail_start,
                scale)
    _check_paged_values(op, q, key_cache, block_table, seq_lens, query_start_loc)
    qsl, lens, ts = query_start_loc.tolist(), seq_lens.tolist(), tail_start.tolist()
    for r in range(block_table.shape[0]):
        ql = qsl[r + 1] - qsl[r]
        if ql and not (0 <= ts[r] <= lens[r] - ql):
            _fail(op, f"tail_start[{r}] = {ts[r]} must lie in [0, seq_lens - q_len] = [0, {lens[r] - ql}]")
    ti = token_indices.long()
    nxt = torch.cat([ti[..., 1:], torch.full_like(ti[..., :1], -1)], dim=-1)
    ok = ((ti == -1) & (nxt == -1)) | ((ti >= 0) & ((nxt == -1) | (nxt > ti)))
    if not bool(ok.all()):
        r, g = (int(x) for x in (~ok).nonzero()[0, :2])
        _fail(op, f"token_indices[{r}, {g}] must hold strictly ascending tokens >= 0 then -1 padding")
    return reference.paged_sparse_draft_attention(q, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                                                  token_indices, tail_start, scale)


@torch.library.register_fake("vegas::paged_sparse_draft_attention")
def _psda_fake(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, token_indices, tail_start, scale):
    _check_psda("paged_sparse_draft_attention", q, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                token_indices, tail_start, scale)
    return q.new_empty(q.shape)


torch.library.register_autograd("vegas::paged_sparse_draft_attention", _no_backward("paged_sparse_draft_attention"))
paged_sparse_draft_attention = _make_dispatching("paged_sparse_draft_attention", paged_sparse_draft_attention,
                                                 _psda_fallback, ("seq_lens", "tail_start"), rows_from=3)
__all__.append("paged_sparse_draft_attention")
