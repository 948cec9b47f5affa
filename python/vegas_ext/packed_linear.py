"""Linear layers on weights packed once for oneDNN (CPU, fp32): faster small-batch decoding steps.

A decoding step multiplies a few rows (batch x 1 token; batch x (gamma + 1) in a verification
pass) by every weight matrix of the model, so on CPU the linears stream all their weights from
memory per step. ``F.linear`` reads the row-major ``[out, in]`` matrix as it is; oneDNN's inner
product on a weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``
without a batch size, the layout PyTorch's Inductor uses for frozen CPU linears) serves any number
of rows and streams the weights faster.

Measured with SmolLM2-135M's 211 linears with lm_head (538 MB fp32), 1 thread, medians of
interleaved rounds (``bench/bench_packed_linears.py``):

* Intel Xeon (AVX-512; ``bench/results/packed_linears_xeon_avx512/``): packed 1.31x faster than
  ``F.linear`` at 4 rows, 1.73x at 12, 1.13x at 28; but 0.80-0.81x at 1-2 rows, where
  ``F.linear`` (MKL's sgemm) streams the weights as a matrix-vector product.
* AMD EPYC Zen 4 (``bench/results/packed_linears_zen4/``): packed 1.64x at 2 rows, 2.52x at 3,
  1.89x at 4, 1.50x at 28; at 2 threads 1.59x at 1 row (``F.linear`` runs a single row on one
  thread) and 3.49x at 3. In a whole plain step at one thread, though, one packed row was 3-4 %
  slower (``bench/results/packed_linears_zen4/step_costs_ab.md``).

So fewer than ``min_rows`` rows keep ``F.linear``; the default (:func:`default_min_rows`, read at
every call) is 4 on Intel CPUs, 2 on AMD CPUs at one thread and 1 at more (by ``/proc/cpuinfo``'s
vendor and ``torch.get_num_threads()``, so a machine and thread count always take the same
path). The packed results were also the same bits for every number of rows from 2 to 36 (row i
of a 4-row product equals row i of a 36-row one); this is what that oneDNN build did, not a
guarantee.

Only CPU fp32 linears are packed; the module computes what ``nn.Linear`` would on its weight as it
is *now*. The weight stays the real ``nn.Parameter`` (state dicts, tied embeddings, fingerprints and
optimizers see it); the packed copy is a cache of it, never saved, copied or pickled, and rebuilt
when the weight changed:

* Every write to the weight through PyTorch is seen, writes through ``.data`` included (they do not
  bump ``weight._version``): packing turns the weight's storage into a copy-on-write one
  (``torch._lazy_clone``, nothing copied), the first write through any alias materializes it, and
  each call checks that (``torch._C._is_cow_tensor``) with the weight's identity and storage,
  ~1 us in all (``bench/packed_linear_overhead.py``: within noise of the bare oneDNN op); the
  weight is repacked on the next call after a write. A weight whose storage PyTorch cannot make
  copy-on-write (a file mapping, as transformers 5 loads safetensors; a NumPy array) gets memory
  of its own at packing. Not seen: writes that bypass PyTorch (through a NumPy array or DLPack
  capsule of the weight kept across a call, or C code keeping its raw pointer); call
  :func:`unpack_linear_weights` before editing weights that way. Code that calls ``data_ptr()``
  on the weight (``torch.save``, ``save_pretrained``) counts as a write: one repack follows.
* A new weight (``linear.weight = ...``, ``weight.data = ...``, ``model.to(dtype or device)``): other
  dtypes and devices, and weights of tensor subclasses, take ``F.linear``; a new fp32 CPU weight is
  packed on its next call. CPU autocast and autograd (grad enabled with a weight or input that
  requires grad) take ``F.linear`` too, as ``nn.Linear`` would compute them.
* ``copy.deepcopy``, ``pickle`` and ``torch.save(model)``/``torch.load`` work: the copy packs its own
  weights on its first call. :func:`unpack_linear_weights` turns the modules back into ``nn.Linear``.
* Linears with hooks or a replaced ``forward`` (accelerate's offloading) are left as they are.
* Under ``torch.compile`` the modules are ``F.linear`` (Inductor cannot lower the packed op on a
  weight that is not a graph constant).
"""
from __future__ import annotations

import numbers
import threading
import warnings
from typing import Optional

import torch
from torch import Tensor, nn

__all__ = ["PACKED_MIN_ROWS", "PackedLinear", "can_pack", "default_min_rows", "pack_linear_weights",
           "unpack_linear_weights"]


def cpu_vendor() -> str:
    """The CPU's vendor string (``"GenuineIntel"``, ``"AuthenticAMD"``) from ``/proc/cpuinfo``;
    ``""`` where there is none (not Linux, not x86)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


#: Fewest rows (product of the input's leading dimensions) that take the packed weights on this CPU
#: at one thread; fewer take ``F.linear``. 2 on AMD CPUs, 4 elsewhere (see the module docstring).
_AMD = cpu_vendor() == "AuthenticAMD"
PACKED_MIN_ROWS = 2 if _AMD else 4


def default_min_rows() -> int:
    """The fewest rows that take the packed weights now: :data:`PACKED_MIN_ROWS`, or 1 on an AMD
    CPU with more than one thread (``torch.get_num_threads()``), where ``F.linear`` runs one row on
    one thread."""
    return 1 if _AMD and torch.get_num_threads() > 1 else PACKED_MIN_ROWS

# The copy-on-write storage that tells a write through any alias (``.data`` included) from none.
_is_cow = getattr(torch._C, "_is_cow_tensor", None)
_lazy_clone = getattr(torch, "_lazy_clone", None)
# Autocast changes what nn.Linear computes; the cheaper private check where this torch has it.
_autocast_on = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: torch.is_autocast_enabled("cpu"))
_PLAIN = (nn.Parameter, Tensor)
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


def _packable_weight(w) -> bool:
    """An fp32 CPU strided 2-D weight of plain type (tensor subclasses keep their own ``F.linear``)."""
    return (type(w) in _PLAIN and w.dtype is torch.float32 and w.is_cpu and w.layout is torch.strided
            and w.dim() == 2)


def tensor_key(t: Tensor) -> tuple:
    """A tensor's identity, cheap and without reading its data (the prefill fingerprint and the
    draft weights' freshness check use it): storage (offset, strides, neg/conj views),
    in-place version, dtype, device, shape. Not ``data_ptr()``: it materializes a copy-on-write
    storage, which makes packed linears repack."""
    try:
        st = t.untyped_storage()
        return ("tensor", st._cdata, t.storage_offset(), t.stride(), t.is_neg(), t.is_conj(), t._version, t.dtype,
                t.device, tuple(t.shape))
    except (RuntimeError, NotImplementedError):  # no storage (an opaque oneDNN tensor): the object itself
        return ("opaque tensor", id(t), t.layout, t.dtype, t.device, tuple(t.shape))


def _geometry(w) -> tuple:
    """How ``w`` views its storage: a ``weight.data = weight.data.t()``, ``t_()`` or ``as_strided_``
    keeps the tensor and the storage but changes what the weight is."""
    return (tuple(w.shape), w.stride(), w.storage_offset(), w.dtype, w.is_neg(), w.is_conj())


def _fresh(p: Optional[tuple], w) -> bool:
    """Whether the cache entry ``p`` (see ``PackedLinear._init_cache``) is of weight ``w`` as it is now.
    A write through any alias materializes the copy-on-write storage; a new tensor, a new storage
    (``weight.data = ...``) or another view of the same storage fails the identity checks."""
    return (p is not None and p[0] is w and w.untyped_storage()._cdata == p[1]
            and p[4] == _geometry(w) and (p[3] is None or _is_cow(w)))


def can_pack(linear: nn.Module) -> bool:
    """Whether :func:`pack_linear_weights` packs ``linear``: an ``nn.Linear`` (not a subclass, not
    already a :class:`PackedLinear`) with a non-empty fp32 CPU weight, no hooks and no replaced
    ``forward`` (packing would drop them), and PyTorch built with oneDNN and copy-on-write storages
    (2.3+)."""
    return (type(linear) is nn.Linear and torch.backends.mkldnn.is_available()
            and _is_cow is not None and _lazy_clone is not None
            and _packable_weight(linear.weight) and linear.weight.numel() > 0 and "forward" not in vars(linear)
            and not (linear._forward_hooks or linear._forward_pre_hooks or linear._backward_hooks
                     or linear._backward_pre_hooks))


class PackedLinear(nn.Module):
    """``y = x W^T + b`` as ``nn.Linear`` computes it, on the weight packed for oneDNN.

    Built from an ``nn.Linear`` by :func:`pack_linear_weights`; it shares that module's
    ``weight`` and ``bias`` parameters (not copies) and keeps a packed copy of the weight (an
    opaque ``torch._mkldnn`` tensor; not a parameter or buffer: never in state dicts, copies or
    pickles) that is rebuilt whenever the weight changed (see the module docstring for how a
    write is noticed).

    Forward: ``x`` ``[..., in_features]`` -> ``[..., out_features]``. With an fp32 CPU weight, ``x``
    must be a float32 CPU tensor (``ValueError`` naming ``x`` when its last dimension, dtype or
    device does not fit) and inputs of at least ``min_rows`` rows (``None``: :func:`default_min_rows`
    at each call) take the packed weight, fewer take ``F.linear``. With a weight of another dtype or
    device (after ``model.to(...)``), under CPU autocast, or with grad enabled and a weight, bias or
    input that requires grad (the packed op has no autograd), it is ``F.linear`` on the current
    weight, exactly ``nn.Linear``.
    """

    #: Attributes that cache or count, never change the output (the pack follows the weight): the
    #: prefill cache's fingerprint (:func:`vegas_ext.prefill_cache.fingerprint`) skips them.
    function_independent_attrs = ("_pack", "_pack_lock", "repacks")

    def __init__(self, linear: nn.Linear, min_rows: Optional[int] = None):
        super().__init__()
        self.min_rows = min_rows  # checked by the setter before anything is packed
        if not can_pack(linear):
            raise ValueError(f"linear: expected an nn.Linear with a non-empty fp32 CPU weight and no hooks, and a "
                             f"PyTorch with oneDNN and copy-on-write storages, got {type(linear).__name__} with "
                             f"{getattr(getattr(linear, 'weight', None), 'dtype', None)} on "
                             f"{getattr(getattr(linear, 'weight', None), 'device', None)}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)  # a parameter slot even when None, as nn.Linear
        self._init_cache()
        self._repack(own_memory=True)

    @property
    def min_rows(self) -> Optional[int]:
        """Fewest rows that take the packed weights (None: :func:`default_min_rows` at each call).
        Set it like an attribute; a value other than None or an int >= 1 raises ``ValueError``."""
        return self._min_rows

    @min_rows.setter
    def min_rows(self, value) -> None:
        self._min_rows = _check_min_rows(value)

    def _init_cache(self) -> None:
        # (weight tensor, its StorageImpl address, that storage (held so the address is not reused),
        # packed tensor or None) for the weight as it was packed; None when nothing is packed.
        self._pack: Optional[tuple] = None
        self._pack_lock = threading.Lock()
        self.repacks = 0  # how many times the weight was (re)packed: for tests and diagnostics

    def _repack(self, own_memory: bool = False) -> Optional[tuple]:
        """Packs the current weight and returns the new cache entry, or None where it is not an fp32
        CPU weight. A weight whose storage cannot be made copy-on-write gets memory of its own when
        ``own_memory`` (at packing), else an entry without a packed tensor (``F.linear`` until the
        weight is replaced)."""
        with self._pack_lock:
            w = self.weight
            if _fresh(self._pack, w):
                return self._pack  # another thread repacked it meanwhile
            self._pack = None  # free the stale pack before building the new one
            if not _packable_weight(w):
                return None
            with torch.no_grad():
                d = w.detach()
                packed = torch.ops.mkldnn._reorder_linear_weight(d)
                try:
                    _lazy_clone(d)  # w's storage is copy-on-write from now: any write materializes it
                except RuntimeError:  # memory PyTorch does not own (a file mapping, NumPy, DLPack)
                    if own_memory:
                        with torch.inference_mode(False):  # a normal tensor even if packed in inference mode
                            w.data = d.clone()  # the same Parameter object: ties and references keep it
                        _lazy_clone(w.detach())
                    else:
                        packed = None
            storage = w.untyped_storage()
            self._pack = (w, storage._cdata, storage, packed, _geometry(w))
            self.repacks += packed is not None
            return self._pack

    def _current(self, w: Optional[Tensor] = None) -> Optional[Tensor]:
        """The packed weight when it holds the weight's current value (repacked if it did not),
        None where ``F.linear`` must serve (weight not fp32 CPU, or not watchable)."""
        if w is None:
            w = self.weight
        p = self._pack
        # checked after _fresh: a repack in another thread drops the old entry before it marks the
        # storage copy-on-write again, which would make the old entry look fresh
        if _fresh(p, w) and self._pack is p:
            return p[3]
        if not _packable_weight(w):
            self._pack = None  # e.g. after weight.data = a bf16 tensor: F.linear
            return None
        p = self._repack()
        return None if p is None else p[3]

    def forward(self, x: Tensor) -> Tensor:
        params = self._parameters  # what self.weight returns, without nn.Module.__getattr__ (~1 us)
        try:
            w, b = params["weight"], params["bias"]
        except KeyError:  # no plain parameter any more (pruned, weight_norm, spectral_norm, parametrized)
            return nn.functional.linear(x, self.weight, self.bias)  # the computed weight, as nn.Linear
        if _compiling():  # Inductor packs constant weights itself (freezing) and cannot lower ours
            return nn.functional.linear(x, w, b)
        packed = self._current(w)
        if packed is None or _autocast_on():
            return nn.functional.linear(x, w, b)
        if (not isinstance(x, Tensor) or x.dtype is not torch.float32 or not x.is_cpu
                or x.shape[-1:] != (self.in_features,)):
            raise ValueError(f"x: expected a float32 CPU tensor [..., {self.in_features}], got "
                             f"{getattr(x, 'dtype', type(x).__name__)} on {getattr(x, 'device', None)} with shape "
                             f"{tuple(getattr(x, 'shape', ()))}")
        min_rows = self._min_rows  # read once: another thread may set it meanwhile
        if min_rows is None:
            min_rows = default_min_rows()
        if (x.numel() < min_rows * self.in_features
                or torch.is_grad_enabled() and (w.requires_grad or x.requires_grad
                                                or (b is not None and b.requires_grad))):
            return nn.functional.linear(x, w, b)
        return torch.ops.mkldnn._linear_pointwise(x, packed, None if b is None else b.detach(), "none", [], "")

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if not _fresh(self._pack, self.weight):
            self._pack = None  # .double() / .cuda(): free the old weight's packed copy now, not at the next call
        return out

    def __getstate__(self):
        # the packed tensor is opaque (no deepcopy, no pickle) and only a cache; a lock cannot be pickled
        state = dict(super().__getstate__())
        state.pop("_pack", None)
        state.pop("_pack_lock", None)
        return state

    def __setstate__(self, state):
        state = dict(state)
        if "min_rows" in state:  # pickled before min_rows became a checked property
            old = state.pop("min_rows")
            try:
                state["_min_rows"] = _check_min_rows(old)
            except ValueError:  # then unchecked; it only ever chose the faster path, never the output
                warnings.warn(f"PackedLinear: pickled min_rows={old!r} is not None or an int >= 1; using None "
                              f"(default_min_rows())", stacklevel=2)
                state["_min_rows"] = None
        state.setdefault("_min_rows", None)  # pickled before min_rows existed
        super().__setstate__(state)
        self._init_cache()  # the copy packs its own weight on its first call (deepcopy, torch.load)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"min_rows={self.min_rows}")


def _check_min_rows(min_rows) -> Optional[int]:
    """``min_rows`` as an ``int`` (NumPy integers included) or None; ``ValueError`` otherwise."""
    if min_rows is None:
        return None
    if isinstance(min_rows, bool) or not isinstance(min_rows, numbers.Integral) or min_rows < 1:
        raise ValueError(f"min_rows: expected None or an int >= 1, got {min_rows!r}")
    return int(min_rows)


def pack_linear_weights(model: nn.Module, min_rows: Optional[int] = None) -> int:
    """Replaces, in place, every ``nn.Linear`` of ``model`` that :func:`can_pack` accepts with a
    :class:`PackedLinear` over the same parameters (``min_rows``: see there); returns how many it
    replaced (0 where none fits, e.g. a CUDA or bf16 model, or PyTorch without oneDNN). Calling it
    again is harmless. Undo with :func:`unpack_linear_weights`.

    Outputs match ``nn.Linear``'s to fp32 rounding (a different summation order, so not the same
    bits), on the weights as they are at each call (see the module docstring). Memory: a packed
    copy of each replaced weight besides the original (and, for a weight in memory PyTorch does
    not own, such as a file mapping, the original is first copied into memory of its own).

    Raises ``TypeError`` when ``model`` is not an ``nn.Module``, ``ValueError`` for a bad ``min_rows``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    min_rows = _check_min_rows(min_rows)
    todo = [(parent, name, child) for parent in model.modules()
            for name, child in parent.named_children() if can_pack(child)]
    packs = {}  # a linear module reached under two names is packed once
    for parent, name, child in todo:
        if id(child) not in packs:
            packs[id(child)] = PackedLinear(child, min_rows)
        setattr(parent, name, packs[id(child)])
    return len(packs)


def unpack_linear_weights(model: nn.Module) -> int:
    """Replaces, in place, every :class:`PackedLinear` below ``model`` with an ``nn.Linear`` over the
    same ``weight`` and ``bias`` parameters (not copies), dropping the packed copies; returns how
    many it replaced (0 where none). Raises ``TypeError`` when ``model`` is not an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    todo = [(parent, name, child) for parent in model.modules()
            for name, child in parent.named_children() if isinstance(child, PackedLinear)]
    plain = {}
    for parent, name, child in todo:
        if id(child) not in plain:
            lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
            lin.weight = child.weight
            lin.bias = child.bias
            lin.train(child.training)
            child._pack = None
            plain[id(child)] = lin
        setattr(parent, name, plain[id(child)])
    return len(plain)
