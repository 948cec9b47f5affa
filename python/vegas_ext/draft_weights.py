"""Low-precision weights for Vegas's draft forwards only (``generate(draft_weights=...)``).

A draft step of a small model on CPU streams every linear weight from memory once per token, so
its linears cost what the weights weigh: 538 MB in fp32 for SmolLM2-135M. The draft only has to
guess the target's next tokens, so its linears may read a copy of the weights in fewer bytes:

* ``"fp16"``: float16 copy (2 bytes per weight); argmax agreement with the fp32 model 99.8-100 %
  on SmolLM2-135M (issue 33's measurements).
* ``"int8"``: int8 with one float32 scale per :data:`INT8_GROUP_SIZE` = 64 weights along the input
  dimension, symmetric (``w ~= q * scale``, ``scale = max|w| / 127`` per group), 1.06 bytes per
  weight; agreement 96.9-97 %. Activations stay float32 and sums are float32 (weight-only: this
  model's activation outliers make activation quantization unusable, 34-40 % agreement).
* ``"int4"`` is refused: groups of 32 agreed on only 53-71 % of positions on SmolLM2-135M (three
  documents; 60-61 % in issue 33), too few accepted drafts to pay for the verification; nothing
  implements it.

The verification and plain steps keep the model's own weights, so the output is exactly plain
decoding's (greedy: token for token; sampling: the target distribution, with ``q`` from the
low-precision draft). On CPU the copies run through :func:`vegas_ext.ops.weight_only_linear`; on
CUDA both options map to a float16 copy through ``F.linear`` (no new kernel there).

Mechanics: every ``nn.Linear`` of the model (including :class:`~vegas_ext.packed_linear.PackedLinear`
and the output layer) gets a low-precision copy, made once and cached beside the model
(:mod:`vegas_ext.model_state`: weakly, so the model still pickles, saves and is freed as before;
one kind at a time; ``vegas_ext.release(model)`` drops it); a copy is remade when its source weight
or bias is replaced (another tensor object) or changed in place (version counter or storage address;
writes into ``param.data`` in place and in-place edits of inference tensors bypass both and are not
seen: call ``vegas_ext.release(model)`` after such edits; the output stays exact either way, only
the acceptance of drafts would suffer). While :meth:`DraftWeights.installed`
is entered, the linears' classes' ``forward`` is wrapped by a function that takes the copy only
inside :meth:`DraftWeights.active` (a per-thread context flag) for a module that has one, else
calls the class's own forward (a class attribute: nothing lands on the model's modules).
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
import time
import weakref
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import model_state, ops as _ops  # ops: loads the compiled torch.ops.vegas.weight_only_linear
from .config import DRAFT_WEIGHTS, check_draft_weights
from .packed_linear import tensor_key

__all__ = ["DRAFT_WEIGHTS", "INT8_GROUP_SIZE", "DraftWeights", "check_draft_weights", "draft_weights_for",
           "quantize_int8", "weight_copy", "cached_draft_weights", "own_forward"]

#: Weights per int8 scale along the input dimension (a multiple of 16, the kernel's vector).
INT8_GROUP_SIZE = 64

#: The :class:`DraftWeights` whose copies the wrapped linears use on this thread (None: the originals).
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("vegas_draft_weights_active", default=None)
_INSTALL_LOCK = threading.Lock()
#: class -> (number of installed() users, the class's own ``forward`` before wrapping)
_INSTALLED: Dict[type, Tuple[int, object]] = {}
_CPU_KERNEL = _ops.has_compiled_kernel("weight_only_linear", "cpu")


def quantize_int8(weight: Tensor, group_size: int = INT8_GROUP_SIZE) -> Tuple[Tensor, Tensor]:
    """Symmetric int8 weight-only quantization with one scale per group of ``group_size`` columns.

    Args:
        weight: ``[N, K]`` floating point (any device).
        group_size: columns per scale, >= 1 (the last group of a row may be shorter).

    Returns:
        ``(q [N, K] int8 in [-127, 127], scales [N, ceil(K / group_size)] float32)`` with
        ``weight ~= q * scales.repeat_interleave(group_size, 1)[:, :K]``; an all-zero group gets
        scale 0. ``ValueError`` names ``weight`` / ``group_size`` when they do not fit.
    """
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight: expected a 2-D floating-point tensor [N, K], got "
                         f"{getattr(weight, 'dtype', type(weight).__name__)} {tuple(getattr(weight, 'shape', ()))}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected an int >= 1, got {group_size!r}")
    N, K = weight.shape
    ng = -(-K // group_size)
    w = weight.detach().float()
    wp = F.pad(w, (0, ng * group_size - K)).view(N, ng, group_size)
    scales = wp.abs().amax(-1) / 127.0
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(wp * inv[..., None]).clamp_(-127, 127).to(torch.int8).view(N, ng * group_size)[:, :K]
    return q.contiguous(), scales.contiguous()


def weight_copy(weight: Tensor, kind: str) -> Tuple[Tensor, Optional[Tensor]]:
    """The CPU draft copy of a linear's ``[N, K]`` weight for :func:`vegas_ext.ops.weight_only_linear`:
    ``(int8 weight, float32 scales)`` for ``"int8"`` (:func:`quantize_int8`, groups of
    :data:`INT8_GROUP_SIZE`), ``(float16 weight, None)`` for ``"fp16"``."""
    w = weight.detach()
    if kind == "fp16":
        return w.to(torch.float16).contiguous(), None
    return quantize_int8(w, INT8_GROUP_SIZE)


def _version_key(t: Optional[Tensor]) -> tuple:
    # not data_ptr(): it materializes a copy-on-write storage, which made every packed linear repack
    return () if t is None else tensor_key(t)


class _Copy:
    """The low-precision copy of one linear's weight (and bias where the copy needs its own).
    It keeps references to the source tensors, so that "the same object, same version counter and
    storage address" identifies unchanged sources (a held tensor's address cannot be reused)."""

    __slots__ = ("src", "key", "weight", "scales", "bias", "nbytes")

    def __init__(self, mod: nn.Module, kind: str):
        w, b = mod.weight.detach(), None if mod.bias is None else mod.bias.detach()
        self.src = (mod.weight, mod.bias)
        self.key = (_version_key(mod.weight), _version_key(mod.bias))
        self.scales = None
        if w.device.type == "cuda":  # CUDA: a float16 copy through F.linear, whatever the kind
            self.weight = w.to(torch.float16).contiguous()
            self.bias = None if b is None else b.to(torch.float16)
        else:
            self.weight, self.scales = weight_copy(w, kind)
            self.bias = None if b is None else b.float().contiguous()
        own_bias = self.bias is not None and (b is None or self.bias.data_ptr() != b.data_ptr())
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.weight, self.scales) if t is not None)
        self.nbytes += self.bias.numel() * self.bias.element_size() if own_bias else 0

    def fresh(self, mod: nn.Module) -> bool:
        """Whether ``mod``'s weight and bias are still the tensors this copy was made from, unedited."""
        w, b = self.src
        return mod.weight is w and mod.bias is b and (_version_key(w), _version_key(b)) == self.key


#: Sibling linears that read the same input, by attribute name on their parent module (HF's Llama family).
_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Fused:
    """One matrix holding the copies of sibling linears (rows stacked in member order): ``weight``
    ``[sum N_i, K]``, ``scales`` (int8) and ``bias`` (``None`` when no member has one), and
    ``splits`` (the members' ``N_i``). The members' :class:`_Copy` objects are re-pointed to row
    views of it, so a member whose copy is remade (weight edited) leaves the group invalid."""

    __slots__ = ("members", "copies", "weight", "scales", "bias", "splits")

    @classmethod
    def make(cls, dw: "DraftWeights", members) -> Optional["_Fused"]:
        copies = [dw._copies.get(id(m)) for m in members]
        if any(c is None or c.weight.device.type != "cpu" for c in copies):
            return None
        ref = copies[0]
        if any(c.weight.dtype != ref.weight.dtype or c.weight.shape[1] != ref.weight.shape[1]
               or (c.scales is None) != (ref.scales is None) or (c.bias is None) != (ref.bias is None)
               for c in copies):
            return None
        f = cls()
        f.members = tuple(weakref.ref(m) for m in members)
        f.copies = tuple(copies)
        f.splits = tuple(int(c.weight.shape[0]) for c in copies)
        f.weight = torch.cat([c.weight for c in copies]).contiguous()
        f.scales = None if ref.scales is None else torch.cat([c.scales for c in copies]).contiguous()
        f.bias = None if ref.bias is None else torch.cat([c.bias for c in copies]).contiguous()
        r0 = 0
        for c, n in zip(copies, f.splits):  # the members read their rows of the fused matrix
            c.weight = f.weight[r0:r0 + n]
            if f.scales is not None:
                c.scales = f.scales[r0:r0 + n]
            r0 += n
        return f

    def valid(self, dw: "DraftWeights") -> bool:
        """Whether every member still has this group's copy (none was remade since)."""
        for ref, c in zip(self.members, self.copies):
            m = ref()
            if m is None or dw._copies.get(id(m)) is not c:
                return False
        return True


class DraftWeights:
    """Low-precision copies of every linear weight of ``model``, used by draft forwards only.

    Build with :func:`draft_weights_for` (cached on the model). Use: enter :meth:`installed` once
    around a decoding call, and :meth:`active` around each draft forward; outside :meth:`active` the
    linears compute with the model's own weights, bit for bit as without this object.

    Attributes:
        kind: ``"fp16"`` or ``"int8"`` (as asked); ``format``: what the copies hold on this device
            (``"fp16"``, ``"int8-g64"``; CUDA: ``"fp16"`` for both kinds).
        nbytes: bytes held by the copies (weights, scales, biases that are copies).
        build_s: seconds spent converting weights by the latest :meth:`refresh`.
    """

    def __init__(self, model: nn.Module, kind: str):
        if kind not in ("fp16", "int8"):  # checked by the caller's options (draft_weights_for, generate)
            raise ValueError(f"draft_weights: a DraftWeights needs 'fp16' or 'int8', got {kind!r}")
        self.kind = kind
        self._model_ref = weakref.ref(model)  # weak: this object is cached beside the model (model_state)
        self._copies: Dict[int, _Copy] = {}
        self._fused: Dict[tuple, _Fused] = {}
        self.build_s = 0.0
        self.refresh()

    # ------------------------------------------------------------------ copies
    def linears(self):
        """The modules whose forwards take the copy: every ``nn.Linear`` and ``PackedLinear``
        with a 2-D floating-point weight (each module once), except those whose weight is on the
        meta device (offloaded by accelerate, whose hooks load it in the module's own forward) and
        16-bit CUDA weights (a CUDA copy is float16: no smaller)."""
        from .packed_linear import PackedLinear

        seen = set()
        model = self._model_ref()
        for m in (() if model is None else model.modules()):
            if (isinstance(m, (nn.Linear, PackedLinear)) and id(m) not in seen
                    and isinstance(getattr(m, "weight", None), Tensor) and m.weight.dim() == 2
                    and m.weight.is_floating_point() and not m.weight.is_meta
                    and not (m.weight.is_cuda and m.weight.element_size() <= 2)):
                seen.add(id(m))
                yield m

    def refresh(self) -> int:
        """Remake the copies whose source weight or bias changed (and make missing ones); returns
        how many were (re)made. Run by :func:`draft_weights_for`; the wrapped forwards also remake
        a stale copy on use."""
        t0 = time.perf_counter()
        made = 0
        mods = list(self.linears())
        live = {id(m) for m in mods}
        for k in [k for k in self._copies if k not in live]:
            del self._copies[k]
        with torch.no_grad():
            for m in mods:
                c = self._copies.get(id(m))
                if c is None or not c.fresh(m):
                    self._copies[id(m)] = _Copy(m, self.kind)
                    made += 1
            self._fuse_groups(mods)
        self.build_s = time.perf_counter() - t0
        return made

    def _fuse_groups(self, mods) -> None:
        """Store the copies of the projections that read the same input -- q/k/v and gate/up of a
        layer -- as one matrix each, the members' copies becoming row views of it (no extra
        memory): the lean draft forward (:mod:`vegas_ext.draft_forward`) then makes one kernel
        call per group instead of three or two. CPU copies only; groups whose members differ in
        input size, kind or bias presence stay apart."""
        live = {id(m) for m in mods}
        self._fused = {k: f for k, f in self._fused.items() if f.valid(self) and all(i in live for i in k)}
        model = self._model_ref()
        for parent in (() if model is None else model.modules()):
            for names in _FUSED_GROUPS:
                members = [getattr(parent, n, None) for n in names]
                if any(not isinstance(m, nn.Module) or id(m) not in live for m in members):
                    continue
                key = tuple(id(m) for m in members)
                if key not in self._fused:
                    f = _Fused.make(self, members)
                    if f is not None:
                        self._fused[key] = f

    def fused(self, members) -> Optional["_Fused"]:
        """The fused copy of ``members`` (a tuple of linears, e.g. a layer's q/k/v projections)
        if one is held and still made of their current copies, else ``None``."""
        f = self._fused.get(tuple(id(m) for m in members))
        return f if f is not None and f.valid(self) else None

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._copies.values())

    @property
    def num_linears(self) -> int:
        return len(self._copies)

    @property
    def format(self) -> str:
        devs = {c.weight.device.type for c in self._copies.values()}
        if self.kind == "fp16" or devs == {"cuda"}:
            return "fp16"
        return f"int8-g{INT8_GROUP_SIZE}" if devs == {"cpu"} else f"int8-g{INT8_GROUP_SIZE} (cpu) / fp16 (cuda)"

    def copy_of(self, mod: nn.Module) -> Optional["_Copy"]:
        """The current low-precision copy of ``mod``'s weight (remade first if its weight or bias
        changed since), or ``None`` for a module without one. Attributes: ``weight`` (the copy,
        ``[N, K]``: float16, or int8 with ``scales`` ``[N, K / INT8_GROUP_SIZE]`` float32) and
        ``bias`` (float32 on CPU, or ``None``)."""
        c = self._copies.get(id(mod))
        if c is not None and not c.fresh(mod):
            with torch.no_grad():
                c = self._copies[id(mod)] = _Copy(mod, self.kind)
        return c

    def linear(self, mod: nn.Module, x: Tensor, own_forward) -> Tensor:
        """``mod(x)`` on the low-precision copy of ``mod``'s weight (``own_forward(mod, x)``, the
        class's own, for a module without one: another model's, or one left out)."""
        c = self.copy_of(mod)  # remade if edited or replaced since
        if c is None:
            return own_forward(mod, x)
        if c.weight.device.type == "cuda":
            return F.linear(x.to(torch.float16), c.weight, c.bias).to(x.dtype)
        xf = x if x.dtype == torch.float32 else x.float()
        # the op straight (one draft step makes ~200 of these calls); the checked reference without a build
        fn = torch.ops.vegas.weight_only_linear.default if _CPU_KERNEL else _ops.weight_only_linear
        y = fn(xf, c.weight, c.scales, c.bias, INT8_GROUP_SIZE)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    # ------------------------------------------------------------------ switching
    @contextlib.contextmanager
    def installed(self):
        """For the duration, the classes of the linears (those that define their ``forward``)
        call :meth:`linear` instead inside :meth:`active` on the calling thread, and their own
        ``forward`` everywhere else. A class attribute, not an instance one: a model pickled,
        saved or copied meanwhile (by another thread) carries nothing of this. Nesting and
        threads share one wrapper per class, removed when the last user leaves."""
        classes = {_forward_owner(type(m)) for m in self.linears()}
        with _INSTALL_LOCK:
            for c in classes:
                users, own = _INSTALLED.get(c, (0, None))
                if users == 0:
                    own = c.__dict__["forward"]
                    c.forward = _wrapped_forward(own)
                _INSTALLED[c] = (users + 1, own)
        try:
            yield self
        finally:
            with _INSTALL_LOCK:
                for c in classes:
                    users, own = _INSTALLED.pop(c)
                    if users > 1:
                        _INSTALLED[c] = (users - 1, own)
                    else:
                        c.forward = own

    @contextlib.contextmanager
    def active(self):
        """Inside, the installed linears compute with the low-precision copies (this thread only)."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


def _forward_owner(cls: type) -> type:
    """The class in ``cls``'s MRO that defines ``forward``."""
    return next(k for k in cls.__mro__ if "forward" in k.__dict__)


def _wrapped_forward(own):
    def forward(self, x, *args, **kwargs):
        dw = _ACTIVE.get()
        if dw is None or args or kwargs:
            return own(self, x, *args, **kwargs)
        return dw.linear(self, x, own)

    return forward


def own_forward(cls: type):
    """``cls.forward`` as the class defines it, not the wrapper :meth:`DraftWeights.installed` may
    have put in its place."""
    entry = _INSTALLED.get(_forward_owner(cls))
    return cls.forward if entry is None else entry[1]


def draft_weights_for(model: nn.Module, draft_weights) -> Optional[DraftWeights]:
    """The cached :class:`DraftWeights` of ``model`` for ``draft_weights`` (``None`` -> ``None``),
    made on first use and refreshed where weights changed since; one kind is cached at a time
    (asking for another kind replaces it, freeing the old copy). The cache lives in
    :mod:`vegas_ext.model_state` (weakly keyed: nothing on the model; ``vegas_ext.release(model)``
    drops it). ``ValueError`` names ``draft_weights`` for a value outside :data:`DRAFT_WEIGHTS` or
    ``"int4"``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    check_draft_weights(draft_weights)
    return None if draft_weights is None else cached_draft_weights(model, draft_weights)


def cached_draft_weights(model: nn.Module, kind: str) -> DraftWeights:
    """:func:`draft_weights_for` without checking ``kind`` (``"fp16"`` / ``"int8"``, validated
    with the call's options): the cached copies, made or refreshed."""
    cached = model_state.get(model, "draft_weights")
    if cached is not None and cached.kind == kind:
        cached.refresh()
        return cached
    model_state.pop(model, "draft_weights")  # free the old kind before converting
    dw = DraftWeights(model, kind)
    model_state.put(model, "draft_weights", dw)
    return dw
