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
* ``"fp8"`` (CUDA only, compute capability >= 8.9): float8 e4m3 with one float32 scale per output
  channel (``scale = max|w| / 448`` per row), 1 byte per weight; the draft linear quantizes its
  activations per row on the fly and runs ``torch._scaled_mm`` (cuBLASLt / CUTLASS), so the weight is
  read once, in 1 byte. Refused elsewhere (``ValueError`` naming ``draft_weights``).
* ``"int4"`` is refused: groups of 32 agreed on only 53-71 % of positions on SmolLM2-135M (three
  documents; 60-61 % in issue 33), too few accepted drafts to pay for the verification; nothing
  implements it.

The verification and plain steps keep the model's own weights, so the output is exactly plain
decoding's (greedy: token for token; sampling: the target distribution, with ``q`` from the
low-precision draft). On CPU the copies run through :func:`vegas_ext.ops.weight_only_linear`. On
CUDA (no kernel of this extension; PyTorch's own ops): ``"fp16"`` is a float16 copy through
``F.linear`` (16-bit models get none: no smaller); ``"int8"`` is int8 with one float32 scale per
output channel through ``torch._weight_int8pack_mm`` (PyTorch's fused weight-only kernel takes
per-channel scales only; 1 byte per weight); ``"fp8"`` as above. A CUDA linear that ``"fp8"``
cannot take (N or K not a multiple of 16, ``torch._scaled_mm``'s rule) gets the ``"fp16"`` fallback.

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
from .compiled_steps import in_compiled_step, traced_draft_weights
from .config import DRAFT_WEIGHTS, check_draft_weights
from .packed_linear import tensor_key

__all__ = ["DRAFT_WEIGHTS", "INT8_GROUP_SIZE", "FP8_MAX", "DraftWeights", "check_draft_weights", "draft_weights_for",
           "quantize_int8", "pack_int8", "quantize_fp8", "quantize_fp8_rows", "int8_channel_linear", "fp8_linear",
           "fp8_unsupported", "weight_copy", "cached_draft_weights", "own_forward"]

#: Weights per int8 scale along the input dimension (a multiple of 16, the kernel's vector).
INT8_GROUP_SIZE = 64

#: The :class:`DraftWeights` whose copies the wrapped linears use on this thread (None: the originals).
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("vegas_draft_weights_active", default=None)
_INSTALL_LOCK = threading.Lock()
#: class -> (number of installed() users, the class's own ``forward`` before wrapping)
_INSTALLED: Dict[type, Tuple[int, object]] = {}
_WOL_CPU = _ops.cpu_op("weight_only_linear")  # straight to the kernel: ~200 calls per draft step
#: The largest finite float8 e4m3fn value (448): a per-channel / per-row scale maps max|w| onto it.
FP8_MAX = 448.0
_FP8 = torch.float8_e4m3fn


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


def pack_int8(q: Tensor) -> Tensor:
    """An int8 weight ``q`` ``[N, K]`` in the packed layout of :func:`vegas_ext.ops.weight_only_linear`:
    ``[ceil(N / 16), ceil(K / 2), 16, 2]`` int8 with element ``[b, j, l, t] = q[16 b + l, 2 j + t]``
    (zeros past ``N`` and ``K``), contiguous, so that one vector step of the CPU kernel reads the
    same two columns of 16 rows (the operand layout of AVX-512 VNNI ``vpdpwssd``). Its scales stay
    ``[N, ceil(K / group_size)]``. ``ValueError`` names ``q`` unless it is a 2-D int8 tensor."""
    if not isinstance(q, Tensor) or q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(f"q: expected a 2-D int8 tensor [N, K], got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    N, K = q.shape
    qp = F.pad(q, (0, K % 2, 0, -N % 16))
    return qp.view(qp.shape[0] // 16, 16, qp.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def quantize_fp8(weight: Tensor) -> Tuple[Tensor, Tensor]:
    """Symmetric float8 e4m3 weight quantization with one scale per output channel (row).

    Args:
        weight: ``[N, K]`` floating point (any device).

    Returns:
        ``(q [N, K] float8_e4m3fn, scales [N] float32)`` with ``weight ~= q.float() * scales[:, None]``,
        ``scales = max|w| / FP8_MAX`` per row (an all-zero row gets scale 0). Round to nearest:
        ``|w - q * s| <= 2**-4 * |w|`` for ``|w| >= 2**-6 * s`` (3 mantissa bits), else
        ``<= 2**-10 * s`` (subnormals). ``ValueError`` names ``weight`` when it is not 2-D floating point.
    """
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight: expected a 2-D floating-point tensor [N, K], got "
                         f"{getattr(weight, 'dtype', type(weight).__name__)} {tuple(getattr(weight, 'shape', ()))}")
    w = weight.detach().float()
    scales = w.abs().amax(1) / FP8_MAX
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    # |w * inv| <= 448 up to one fp32 rounding, which e4m3 rounds back to 448: no clamp needed
    return (w * inv[:, None]).to(_FP8).contiguous(), scales.contiguous()


def quantize_fp8_rows(x: Tensor) -> Tuple[Tensor, Tensor]:
    """Dynamic per-row float8 e4m3 quantization of activations, for :func:`fp8_linear`.

    Args:
        x: ``[M, K]`` floating point.

    Returns:
        ``(q [M, K] float8_e4m3fn, scales [M, 1] float32)``, ``x ~= q.float() * scales``; a zero row
        gets a tiny positive scale (``torch._scaled_mm`` multiplies by it: 0 stays 0).
    """
    s = x.abs().amax(-1, keepdim=True).float().clamp_(min=1e-30).div_(FP8_MAX)
    return (x / s).to(_FP8), s


def fp8_linear(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """``x @ dequant(weight).T`` through ``torch._scaled_mm`` with row-wise scales on both sides.

    The activations are quantized per row (:func:`quantize_fp8_rows`): ``torch._scaled_mm`` takes
    float8 on both sides, and its row-wise kernels read the weight once in 1 byte; a weight-only
    float8 matmul would first dequantize the weight (1 byte read, 2 written, 2 read again).

    Args:
        x: ``[M, K]`` floating point; weight: ``[N, K]`` float8_e4m3fn, row-major (:func:`quantize_fp8`);
        scales: ``[N]`` float32. CUDA: compute capability >= 8.9, ``K`` and ``N`` multiples of 16.

    Returns:
        ``[M, N]`` bfloat16 (the output type every row-wise ``torch._scaled_mm`` path takes).
    """
    xq, xs = quantize_fp8_rows(x)
    return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scales.view(1, -1), out_dtype=torch.bfloat16)


def int8_channel_linear(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """``x @ (weight * scales[:, None]).T`` through PyTorch's fused ``torch._weight_int8pack_mm``.

    Args:
        x: ``[M, K]`` floating point; weight: ``[N, K]`` int8 (:func:`quantize_int8` with
        ``group_size=K``); scales: ``[N]`` float32.

    Returns:
        ``[M, N]`` float32 (the CUDA kernel computes in float32 whatever ``x`` is; float32 in
        keeps the scales' dtype equal to ``x``'s, which the CPU kernel requires).
    """
    return torch._weight_int8pack_mm(x.float().contiguous(), weight, scales)


def fp8_unsupported(device) -> Optional[str]:
    """Why ``draft_weights="fp8"`` cannot run on ``device`` (a ``torch.device`` or string), or ``None``."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the model's linears are on {device.type}"
    if torch.version.hip is not None:
        return "ROCm uses other float8 types (e4m3fnuz); not implemented there"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return f"{torch.cuda.get_device_name(device)} is compute capability {cap[0]}.{cap[1]}"
    return None


def _copy_mode(w: Tensor, kind: str) -> Optional[str]:
    """How a linear with weight ``w`` computes its draft copy of ``kind``: ``"cpu"`` (the vegas
    op: fp16, or int8 in groups of 64), ``"fp16"`` (CUDA float16 ``F.linear``), ``"int8"``
    (CUDA per-channel int8, :func:`int8_channel_linear`), ``"fp8"`` (CUDA, :func:`fp8_linear`),
    or ``None``: no copy (16-bit CUDA weights under ``"fp16"``: not smaller)."""
    if w.device.type != "cuda":
        return "cpu"
    if kind == "fp8" and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0:
        return "fp8"
    if kind == "int8":
        return "int8"
    return None if w.element_size() <= 2 else "fp16"  # fp16 and the fallback of fp8's odd shapes


#: Copy mode -> what ``DraftWeights.format`` reports for it.
_FORMATS = {"cpu-fp16": "fp16", "cpu-int8": f"int8-g{INT8_GROUP_SIZE}", "fp16": "fp16",
            "int8": "int8-per-channel", "fp8": "fp8-e4m3-per-channel"}


def weight_copy(weight: Tensor, kind: str) -> Tuple[Tensor, Optional[Tensor]]:
    """The CPU draft copy of a linear's ``[N, K]`` weight for :func:`vegas_ext.ops.weight_only_linear`:
    ``(packed int8 weight, float32 scales [N, ceil(K / 64)])`` for ``"int8"`` (:func:`quantize_int8`
    in groups of :data:`INT8_GROUP_SIZE`, then :func:`pack_int8`), ``(float16 weight [N, K], None)``
    for ``"fp16"``; ``ValueError`` naming ``draft_weights`` for ``"fp8"`` (CUDA only)."""
    w = weight.detach()
    if kind == "fp8":
        raise ValueError("draft_weights='fp8' needs a CUDA GPU of compute capability >= 8.9 (float8 matmuls "
                         "through torch._scaled_mm); on CPU use 'int8' or 'fp16'")
    if kind == "fp16":
        return w.to(torch.float16).contiguous(), None
    q, s = quantize_int8(w, INT8_GROUP_SIZE)
    return pack_int8(q), s


def _version_key(t: Optional[Tensor]) -> tuple:
    # not data_ptr(): it materializes a copy-on-write storage, which made every packed linear repack
    return () if t is None else tensor_key(t)


class _Copy:
    """The low-precision copy of one linear's weight (and bias where the copy needs its own).
    It keeps references to the source tensors, so that "the same object, same version counter and
    storage address" identifies unchanged sources (a held tensor's address cannot be reused)."""

    __slots__ = ("src", "key", "mode", "weight", "scales", "bias", "nbytes")

    def __init__(self, mod: nn.Module, kind: str):
        w, b = mod.weight.detach(), None if mod.bias is None else mod.bias.detach()
        self.src = (mod.weight, mod.bias)
        self.key = (_version_key(mod.weight), _version_key(mod.bias))
        self.scales = None
        self.mode = _copy_mode(w, kind)
        if self.mode == "cpu":
            self.weight, self.scales = weight_copy(w, kind)
            self.bias = None if b is None else b.float().contiguous()
        elif self.mode == "fp16":
            self.weight = w.to(torch.float16).contiguous()
            self.bias = None if b is None else b.to(torch.float16)
        elif self.mode == "int8":
            q, s = quantize_int8(w, w.shape[1])  # one group per row: per-channel, the fused kernel's layout
            self.weight, self.scales, self.bias = q, s.view(-1).contiguous(), b
        else:  # fp8; the bias is added in the model's dtype after the matmul
            self.weight, self.scales = quantize_fp8(w)
            self.bias = b
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
    ``[sum N_i, K]`` (packed int8: ``[sum N_i / 16, ...]``, so only members of whole 16-row blocks
    fuse), ``scales`` (int8) and ``bias`` (``None`` when no member has one), and ``splits`` (the
    members' ``N_i``). The members' :class:`_Copy` objects are re-pointed to row views of it, so a
    member whose copy is remade (weight edited) leaves the group invalid."""

    __slots__ = ("members", "copies", "weight", "scales", "bias", "splits")

    @classmethod
    def make(cls, dw: "DraftWeights", members) -> Optional["_Fused"]:
        copies = [dw._copies.get(id(m)) for m in members]
        if any(c is None or c.mode != "cpu" or c.weight.device.type != "cpu" for c in copies):
            return None
        ref = copies[0]
        if any(c.weight.dtype != ref.weight.dtype or c.weight.shape[1:] != ref.weight.shape[1:]
               or (c.scales is None) != (ref.scales is None) or (c.bias is None) != (ref.bias is None)
               for c in copies):
            return None
        packed = ref.weight.dim() == 4  # int8 in blocks of 16 rows: members must fill whole blocks
        if packed and any(c.scales.shape[0] % 16 for c in copies):
            return None
        f = cls()
        f.members = tuple(weakref.ref(m) for m in members)
        f.copies = tuple(copies)
        f.splits = tuple(int((c.scales if packed else c.weight).shape[0]) for c in copies)
        f.weight = torch.cat([c.weight for c in copies]).contiguous()
        f.scales = None if ref.scales is None else torch.cat([c.scales for c in copies]).contiguous()
        f.bias = None if ref.bias is None else torch.cat([c.bias for c in copies]).contiguous()
        r0 = 0
        for c, n in zip(copies, f.splits):  # the members read their rows of the fused matrix
            c.weight = f.weight[r0 // 16:(r0 + n) // 16] if packed else f.weight[r0:r0 + n]
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
        kind: ``"fp16"``, ``"int8"`` or ``"fp8"`` (as asked); ``format``: what the copies hold
            (``"fp16"``, ``"int8-g64"`` on CPU, ``"int8-per-channel"`` and ``"fp8-e4m3-per-channel"``
            on CUDA; formats joined by ``" + "`` where linears differ, e.g. fp8 with its fp16 fallback).
        nbytes: bytes held by the copies (weights, scales, biases that are copies).
        build_s: seconds spent converting weights by the latest :meth:`refresh`.
    """

    def __init__(self, model: nn.Module, kind: str):
        if kind not in ("fp16", "int8", "fp8"):  # checked by the caller's options (draft_weights_for, generate)
            raise ValueError(f"draft_weights: a DraftWeights needs 'fp16', 'int8' or 'fp8', got {kind!r}")
        self.kind = kind
        if kind == "fp8":  # before converting anything: refused on CPU and pre-Ada GPUs
            for dev in sorted({str(m.weight.device) for m in _all_linears(model)}):
                why = fp8_unsupported(dev)
                if why is not None:
                    raise ValueError(f"draft_weights='fp8' needs every linear on a CUDA GPU of compute capability "
                                     f">= 8.9 (float8 e4m3 matmuls through torch._scaled_mm), but {why}: "
                                     f"use 'int8' or 'fp16'")
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
        16-bit CUDA weights where the copy would be float16 (``"fp16"``, ``"fp8"``'s fallback: no smaller)."""
        model = self._model_ref()
        for m in (() if model is None else _all_linears(model)):
            if _copy_mode(m.weight, self.kind) is not None:
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
        modes = {f"cpu-{self.kind}" if c.mode == "cpu" else c.mode for c in self._copies.values()}
        return " + ".join(sorted({_FORMATS[m] for m in modes})) or "none"

    def copy_of(self, mod: nn.Module) -> Optional["_Copy"]:
        """The current low-precision copy of ``mod``'s weight (remade first if its weight or bias
        changed since), or ``None`` for a module without one. Attributes: ``mode`` (``"cpu"``,
        ``"fp16"``, ``"int8"``, ``"fp8"``: see :func:`_copy_mode`), ``weight`` (the copy, ``[N, K]``:
        float16; int8 with ``scales`` ``[N]`` float32 on CUDA; float8_e4m3fn with ``scales`` ``[N]``
        float32; on CPU int8 is :func:`pack_int8`'s layout with ``scales``
        ``[N, ceil(K / INT8_GROUP_SIZE)]`` float32) and ``bias`` (float32 on
        CPU, float16 for ``"fp16"`` on CUDA, the module's own for CUDA int8 / fp8, or ``None``)."""
        c = self._copies.get(id(mod))
        if c is not None and not c.fresh(mod):
            with torch.no_grad():
                c = self._copies[id(mod)] = _Copy(mod, self.kind)
        return c

    def linear(self, mod: nn.Module, x: Tensor, own_forward) -> Tensor:
        """``mod(x)`` on the low-precision copy of ``mod``'s weight (``own_forward(mod, x)``, the
        class's own, for a module without one: another model's, or one left out)."""
        if in_compiled_step():  # the copies as refreshed when the call began (the check is not traceable)
            c = self._copies.get(id(mod))
        else:
            c = self.copy_of(mod)  # remade if edited or replaced since
        if c is None:
            return own_forward(mod, x)
        if c.mode != "cpu":
            return _device_linear(c, x)
        xf = x if x.dtype == torch.float32 else x.float()
        y = _WOL_CPU(xf, c.weight, c.scales, c.bias, INT8_GROUP_SIZE)
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


def _device_linear(c: "_Copy", x: Tensor) -> Tensor:
    """``x [..., K] -> [..., N]`` in ``x``'s dtype through the CUDA copy ``c`` (mode fp16 / int8 / fp8)."""
    if c.mode == "fp16":
        return F.linear(x.to(torch.float16), c.weight, c.bias).to(x.dtype)
    x2 = x.reshape(-1, x.shape[-1])
    y = (int8_channel_linear if c.mode == "int8" else fp8_linear)(x2, c.weight, c.scales).to(x.dtype)
    if c.bias is not None:
        y = y + c.bias
    return y.view(*x.shape[:-1], y.shape[-1])


def _all_linears(model: nn.Module):
    """``model``'s ``nn.Linear`` / ``PackedLinear`` modules with a 2-D floating-point weight not on
    the meta device (offloaded by accelerate: its hooks load the weight in the module's own forward)."""
    from .packed_linear import PackedLinear

    seen = set()
    for m in model.modules():
        if (isinstance(m, (nn.Linear, PackedLinear)) and id(m) not in seen
                and isinstance(getattr(m, "weight", None), Tensor) and m.weight.dim() == 2
                and m.weight.is_floating_point() and not m.weight.is_meta):
            seen.add(id(m))
            yield m


def _forward_owner(cls: type) -> type:
    """The class in ``cls``'s MRO that defines ``forward``."""
    return next(k for k in cls.__mro__ if "forward" in k.__dict__)


def _wrapped_forward(own):
    def forward(self, x, *args, **kwargs):
        dw = traced_draft_weights() if in_compiled_step() else _ACTIVE.get()  # ContextVar: not traceable
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
    """:func:`draft_weights_for` without checking ``kind`` (``"fp16"`` / ``"int8"`` / ``"fp8"``,
    validated with the call's options): the cached copies, made or refreshed. ``ValueError`` naming
    ``draft_weights`` for ``"fp8"`` where a linear is not on a CUDA GPU of compute capability >= 8.9."""
    cached = model_state.get(model, "draft_weights")
    if cached is not None and cached.kind == kind:
        cached.refresh()
        return cached
    model_state.pop(model, "draft_weights")  # free the old kind before converting
    dw = DraftWeights(model, kind)
    model_state.put(model, "draft_weights", dw)
    return dw
