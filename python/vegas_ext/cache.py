"""A preallocated, per-row KV cache for self-speculative decoding (Vegas, arXiv 2602.07223).

:class:`VegasCache` is a ``transformers`` :class:`~transformers.Cache` subclass, so a Hugging Face
Llama-family model accepts it as its cache argument. Each layer owns two buffers
``[B, H_kv, S_max, D]`` (the layout of the ``torch.ops.vegas`` ops and of HF's static cache),
allocated once. Every row ``b`` keeps its own valid length ``lengths[b]`` (int32): the tokens
``[0, lengths[b])`` of that row are valid, left-aligned (no padding inside the cache).

One model forward over ``Q`` new tokens per row goes like this:

1. the decode loop calls :meth:`VegasCache.begin_forward` with ``Q`` (and an ``offset`` for the
   later draft steps of a round); this fixes where each row writes: positions
   ``lengths[b] + offset ... lengths[b] + offset + Q - 1``;
2. every layer's ``update()`` scatters its new K/V there (one indexed assignment per buffer) and returns
   the *whole* buffers; the attention function reads ``seq_lens`` (= ``lengths + offset + Q``) to
   know what is valid;
3. the loop then :meth:`commit` s the new lengths. Rollback of rejected drafts is just a smaller
   length: nothing is copied, nothing is freed; stale K/V past a row's length is never read and is
   overwritten by the next forward.

No ``torch.cat`` growth, no per-step copies of the cache.
"""
from __future__ import annotations

import copy
import ctypes
import sys
import weakref
from typing import Optional, Tuple

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = ["VegasCache", "VegasCacheLayer", "model_device"]

_HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 / arm64 Linux
_MADV_HUGEPAGE = 14


def advise_huge_pages(t: Tensor) -> bool:
    """Asks Linux to back the whole 2 MiB pages inside ``t``'s storage (all of it, for a view)
    with transparent huge pages (``madvise(MADV_HUGEPAGE)``), best before they are first touched.

    Decoding streams the whole KV cache once per step; with 4 KiB pages every 16 tokens of a
    ``D = 64`` fp32 row cross a page, and the TLB misses cost ~15 % of ``verify_attention`` at 8K
    tokens (one AMD EPYC core, huge pages in "madvise" mode). A no-op (returns False) on other
    platforms, for non-CPU or non-strided (sparse) tensors, for storages smaller than one huge
    page, or when the kernel refuses the advice (built without huge-page support); with huge
    pages set to "never" the advice is accepted and has no effect. Values are never changed.

    Args:
        t: any tensor (a KV buffer: ``[B, H_kv, S_max, D]``).

    Returns:
        True when the advice was given to at least one whole 2 MiB page."""
    if t.device.type != "cpu" or t.layout != torch.strided or not sys.platform.startswith("linux"):
        return False
    storage = t.untyped_storage()  # the memory itself: an expanded view's numel overstates it
    addr = storage.data_ptr()
    start = -(-addr // _HUGE_PAGE) * _HUGE_PAGE
    end = (addr + storage.nbytes()) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def model_device(model) -> torch.device:
    """The device ``model`` (a ``torch.nn.Module``) computes on: its first parameter's, or, where
    that is on the meta device with accelerate hooks that load the weights in each forward
    (``accelerate.cpu_offload``, ``device_map`` offloading), the hooks' execution device.

    Raises ``ValueError`` naming ``model`` for parameters on the meta device with no such hook
    (weights never loaded), or a model without parameters."""
    p = next(model.parameters(), None)
    if p is None:
        raise ValueError(f"model must have parameters, {type(model).__name__} has none")
    if not p.is_meta:
        return p.device
    for mod in model.modules():  # accelerate's AlignDevicesHook, alone or inside a SequentialHook
        hook = getattr(mod, "_hf_hook", None)
        for h in (hook, *(getattr(hook, "hooks", None) or ())):
            dev = getattr(h, "execution_device", None)
            if dev is not None:
                return torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
    raise ValueError(f"model's parameters are on the meta device (no weights loaded) and no accelerate hook loads "
                     f"them; load the weights (e.g. {type(model).__name__}.from_pretrained(path)) before generating")


def _zeros(shape, dtype, device) -> Tensor:
    """``torch.zeros``, on CPU with huge pages advised before the zeros touch the pages."""
    t = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t.zero_()


class VegasCacheLayer(CacheLayerMixin):
    """One layer of :class:`VegasCache`: ``keys`` and ``values`` buffers ``[B, H_kv, S_max, D]``.

    Holds only a weak reference to its cache: a strong one would make every cache a reference
    cycle, freed by Python's cyclic garbage collector only (which large tensors do not trigger), so
    repeated ``generate`` calls would pile up caches until memory runs out."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, parent: "VegasCache", keys: Tensor, values: Tensor):
        super().__init__()
        self._parent_ref = weakref.ref(parent)
        self.keys = keys
        self.values = values
        self.is_initialized = True
        self.max_cache_len = keys.shape[2]
        self.batch_size = keys.shape[0]
        self.num_heads = keys.shape[1]
        self.device = keys.device
        self.dtype = keys.dtype

    def __getstate__(self):  # a weak reference does not pickle; the cache re-binds it
        state = dict(self.__dict__)
        state.pop("_parent_ref", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._parent_ref = lambda: None  # until the owning VegasCache re-binds it

    @property
    def _parent(self) -> "VegasCache":
        p = self._parent_ref()
        if p is None:
            raise RuntimeError("VegasCacheLayer: its VegasCache was freed; keep the cache, not only its layers")
        return p

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:  # pragma: no cover
        pass  # buffers are allocated up front

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> Tuple[Tensor, Tensor]:
        """Scatter ``key_states`` / ``value_states`` (``[B, H_kv, Q, D]``) of each row at that row's
        write positions; return the whole ``[B, H_kv, S_max, D]`` buffers."""
        p = self._parent
        if p._write_rows is not None and p._write_pos.shape[0] == key_states.shape[2] and key_states.shape[0] == 1:
            # packed rows (begin_packed_forward): token n goes to row rows[n] at position pos[n]
            self.keys[p._write_rows, :, p._write_pos] = key_states[0].transpose(0, 1).to(self.dtype)
            self.values[p._write_rows, :, p._write_pos] = value_states[0].transpose(0, 1).to(self.dtype)
            return self.keys, self.values
        if p._write_pos is None or p._write_pos.dim() != 2 or p._write_pos.shape[1] != key_states.shape[2]:
            raise RuntimeError(
                "VegasCache.update: begin_forward(q_len) must be called with the number of new tokens "
                f"({key_states.shape[2]}) before the model forward"
            )
        # advanced indices [B, 1] and [B, Q] around a slice -> indexed shape [B, Q, H_kv, D]
        self.keys[p._row_idx, :, p._write_pos] = key_states.transpose(1, 2).to(self.dtype)
        self.values[p._row_idx, :, p._write_pos] = value_states.transpose(1, 2).to(self.dtype)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> Tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return self._parent._max_len

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self._parent.reset()

    def crop(self, tokens_to_remove: int) -> None:  # pragma: no cover - not used by HF here
        raise NotImplementedError("VegasCache rolls back per row with VegasCache.rollback(lengths)")


class VegasCache(Cache):
    """Preallocated KV cache with per-row lengths and rollback by length.

    Args:
        num_layers: number of decoder layers.
        batch_size: rows ``B``.
        num_kv_heads: ``H_kv``.
        head_dim: ``D``.
        max_len: ``S_max``, tokens per row the buffers hold (prompt + new tokens + drafts + 1).
        dtype, device: of the buffers (the model's).

    Attributes:
        layers: one :class:`VegasCacheLayer` per decoder layer (``layers[i].keys`` / ``.values``:
            ``[B, H_kv, S_max, D]``).
        lengths: ``[B]`` int32, committed valid tokens per row.
        seq_lens: ``[B]`` int32, valid tokens per row *during* the current forward
            (``lengths + offset + Q``), set by :meth:`begin_forward`.

    Memory: ``2 * num_layers * B * H_kv * S_max * D * itemsize`` bytes, allocated once (zeros; on
    Linux CPUs backed by transparent huge pages where the system allows, see
    :func:`advise_huge_pages`).
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device,
    ):
        if min(num_layers, batch_size, num_kv_heads, head_dim, max_len) < 1:
            raise ValueError("VegasCache: all sizes must be >= 1")
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        layers = [
            VegasCacheLayer(self, _zeros(shape, dtype, device), _zeros(shape, dtype, device))
            for _ in range(num_layers)
        ]
        super().__init__(layers=layers)
        self.max_len = max_len
        self.device = torch.device(device)
        self.lengths = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.seq_lens = self.lengths.clone()
        self._row_idx = torch.arange(batch_size, device=device).unsqueeze(1)
        self._write_pos: Optional[Tensor] = None
        self._write_rows: Optional[Tensor] = None  # packed forwards: each token's row
        self.write_start = self.lengths.clone()  # [B] int32, first position the current forward writes per row
        self._max_len = 0

    def _bind_layers(self) -> None:
        for layer in self.layers:
            if isinstance(layer, VegasCacheLayer):
                layer._parent_ref = weakref.ref(self)

    def __deepcopy__(self, memo):
        """A deep copy whose layers belong to the copy (not to the original)."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            setattr(new, k, copy.deepcopy(v, memo))
        new._bind_layers()
        return new

    def __setstate__(self, state):  # unpickling: layers come back unbound
        self.__dict__.update(state)
        self._bind_layers()

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int) -> "VegasCache":
        """A cache sized for ``model`` (a HF ``*ForCausalLM``): layers, KV heads and head_dim from its
        config, dtype from its parameters, device :func:`model_device` (the execution device of an
        offloaded model). Raises ``ValueError`` (before allocating) when it would not fit in the
        device's free memory (:func:`cache_bytes`)."""
        n = cache_bytes(model, batch_size, max_len)
        free = free_memory_bytes(model_device(model))
        if free is not None and n > free:
            raise ValueError(
                f"the KV cache for {batch_size} row(s) of up to {max_len:,} positions takes {n / 2**30:,.1f} GiB, "
                f"allocated up front, more than the {free / 2**30:,.1f} GiB free on {model_device(model)}; lower "
                "max_new_tokens (rows still end early at EOS) or the batch size")
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        p = next(model.parameters())
        return cls(cfg.num_hidden_layers, batch_size, n_kv, head_dim, max_len, p.dtype, model_device(model))

    # ------------------------------------------------------------------ per forward
    def begin_forward(self, q_len: int, offset: int = 0) -> None:
        """Prepare one forward of ``q_len`` new tokens per row, written at positions
        ``lengths[b] + offset + [0, q_len)``. Raises ``ValueError`` if a row would write past
        ``S_max``."""
        start = self.lengths + offset
        end_max = int(start.max()) + q_len
        if end_max > self.max_len:
            raise ValueError(f"VegasCache: a row would write up to position {end_max - 1}, past max_len {self.max_len}")
        self._write_pos = start.long().unsqueeze(1) + torch.arange(q_len, device=self.device)
        self._write_rows = None
        self.write_start = start.to(torch.int32)
        self.seq_lens = (start + q_len).to(torch.int32)
        self._max_len = end_max

    def begin_packed_forward(self, q_lens: Tensor) -> Tuple[Tensor, Tensor]:
        """Prepare one forward of ``q_lens[b]`` new tokens for row ``b`` (``[B]`` int, 0 allowed),
        packed into one sequence of ``N = q_lens.sum()`` tokens, row after row: row ``b``'s
        tokens are written at ``lengths[b] + [0, q_lens[b])``. Returns ``(rows [N], pos [N])``
        int64, each token's row and position (the forward's input is ``[1, N]``). Raises
        ``ValueError`` if a row would write past ``S_max``."""
        q_lens = q_lens.to(device=self.device, dtype=torch.long)
        end = self.lengths.long() + q_lens
        end_max = int(end.max())
        if end_max > self.max_len:
            raise ValueError(f"VegasCache: a row would write up to position {end_max - 1}, past max_len {self.max_len}")
        rows = torch.repeat_interleave(torch.arange(q_lens.numel(), device=self.device), q_lens)
        first = torch.cumsum(q_lens, 0) - q_lens
        pos = self.lengths.long()[rows] + torch.arange(rows.numel(), device=self.device) - first[rows]
        self._write_rows, self._write_pos = rows, pos
        self.write_start = self.lengths.clone()
        self.seq_lens = end.to(torch.int32)
        self._max_len = end_max
        return rows, pos

    def commit(self, lengths: Tensor) -> None:
        """Set the committed lengths (``[B]`` int); used after prefill and after acceptance."""
        self.lengths = lengths.to(device=self.device, dtype=torch.int32)
        self.seq_lens = self.lengths
        self.write_start = self.lengths
        self._max_len = int(self.lengths.max())

    rollback = commit  # rolling back is committing a smaller length: nothing moves

    def keep_rows(self, rows: Tensor) -> None:
        """Keep only the rows ``rows`` (``[B']`` int64 indices into the current rows, ascending,
        ``B' >= 1``), in that order: every layer's buffers become ``[B', H_kv, S_max, D]`` copies
        of those rows (the old buffers are freed), ``lengths`` follow. Used by the decode loop to
        drop finished rows, so that later forwards cost only the rows still decoding."""
        rows = rows.to(device=self.device, dtype=torch.long)
        if rows.dim() != 1 or rows.numel() < 1:
            raise ValueError("VegasCache.keep_rows: rows must be a non-empty 1-D index tensor, "
                             f"got shape {tuple(rows.shape)}")
        for layer in self.layers:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)
            layer.batch_size = layer.keys.shape[0]
        self._row_idx = torch.arange(rows.numel(), device=self.device).unsqueeze(1)
        self._write_pos = self._write_rows = None
        self.commit(self.lengths.index_select(0, rows))

    def reset(self) -> None:
        """Forget every row (lengths 0). The buffers keep their (stale) contents."""
        self.commit(torch.zeros_like(self.lengths))

    # ------------------------------------------------------------------ Cache API used by HF
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Longest row (HF uses it only for default positions/masks; the decode loop passes both)."""
        return self._max_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0, *args, **kwargs) -> Tuple[int, int]:
        return self.max_len, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._max_len

    def valid_kv(self, layer_idx: int, row: int) -> Tuple[Tensor, Tensor]:
        """The valid K/V of one row, ``[H_kv, lengths[row], D]`` each (views, for tests/inspection)."""
        n = int(self.lengths[row])
        return self.layers[layer_idx].keys[row, :, :n], self.layers[layer_idx].values[row, :, :n]


def cache_bytes(model, batch_size: int, max_len: int) -> int:
    """Bytes of a :meth:`VegasCache.for_model` cache: K and V of every layer, ``[B, H_kv, max_len, D]``."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    size = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * batch_size * n_kv * max_len * head_dim * size


def free_memory_bytes(device: torch.device) -> Optional[int]:
    """Free memory of ``device`` in bytes: the GPU's (``torch.cuda.mem_get_info``), or the host's
    available physical memory; ``None`` where it cannot be told."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            with open("/proc/meminfo") as f:  # Linux: what can be allocated without swapping
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
    except (AttributeError, ValueError, OSError, RuntimeError):
        pass
    return None
