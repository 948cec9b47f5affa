"""Linear layers on weights packed once for oneDNN (CPU, fp32): faster small-batch decoding steps.

A decoding step multiplies a few rows (batch x 1 token; batch x (gamma + 1) in a verification
pass) by every weight matrix of the model, so on CPU the linears stream all their weights from
memory per step. ``F.linear`` reads the row-major ``[out, in]`` matrix as it is; oneDNN's inner
product on a weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``
without a batch size, the layout PyTorch's Inductor uses for frozen CPU linears) serves any number
of rows and streams the weights faster.

Measured on one Intel Xeon core (AVX-512, 1 thread), SmolLM2-135M's 211 linears with lm_head
(538 MB fp32), medians of 7 interleaved rounds (``bench/results/packed_linears_xeon_avx512/``): packed
1.31x faster than ``F.linear`` at 4 rows, 1.73x at 12, 1.28x at 16, 1.13x at 28; but 0.80-0.88x
at 1-3 rows, where ``F.linear`` streams the weights as a matrix-vector product. So fewer than
``min_rows`` rows (default :data:`PACKED_MIN_ROWS` = 4) keep ``F.linear``. The packed results were
also the same bits for every number of rows from 2 to 36 (row i of a 4-row product equals row i
of a 36-row one); this is what that oneDNN build did, not a guarantee.

Only CPU fp32 linears are packed (other dtypes and devices were not measured and keep
``F.linear``). The original weight stays on the module (state dicts, tied embeddings and
fingerprints keep working), so the linears' weights are held twice; an in-place change of the
weight is seen (the pack is redone on the next call).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

__all__ = ["PACKED_MIN_ROWS", "PackedLinear", "can_pack", "pack_linear_weights"]

#: Fewest rows (product of the input's leading dimensions) that take the packed weights; fewer
#: take ``F.linear`` (faster there on the machine measured, see the module docstring).
PACKED_MIN_ROWS = 4


def can_pack(linear: nn.Module) -> bool:
    """Whether :func:`pack_linear_weights` packs ``linear``: an ``nn.Linear`` (not already a
    :class:`PackedLinear`) with an fp32 CPU weight, and PyTorch built with oneDNN."""
    return (type(linear) is nn.Linear and torch.backends.mkldnn.is_available()
            and linear.weight.device.type == "cpu" and linear.weight.dtype == torch.float32
            and linear.weight.dim() == 2)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` as ``nn.Linear`` computes it, on the weight packed once for oneDNN.

    Built from an ``nn.Linear`` by :func:`pack_linear_weights`; it shares that module's
    ``weight`` and ``bias`` parameters (not copies) and adds the packed weight (an opaque
    ``torch._mkldnn`` tensor, not a parameter or buffer: it is not saved in state dicts).

    Forward: ``x`` ``[..., in_features]`` fp32 on CPU -> ``[..., out_features]`` fp32. Inputs of
    fewer than ``min_rows`` rows take ``F.linear`` on the original weight. Inference only: the
    packed op has no autograd, so a call with grad enabled and a weight or input that requires
    grad takes ``F.linear`` too. ``ValueError`` names ``x`` when its last dimension, dtype or
    device does not fit.
    """

    def __init__(self, linear: nn.Linear, min_rows: int = PACKED_MIN_ROWS):
        super().__init__()
        if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 1:
            raise ValueError(f"min_rows: expected an int >= 1, got {min_rows!r}")
        if not can_pack(linear):
            raise ValueError(f"linear: expected an nn.Linear with an fp32 CPU weight and a oneDNN build of "
                             f"PyTorch, got {type(linear).__name__} with "
                             f"{getattr(getattr(linear, 'weight', None), 'dtype', None)} on "
                             f"{getattr(getattr(linear, 'weight', None), 'device', None)}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.min_rows = min_rows
        self._packed: Optional[Tensor] = None
        self._packed_of: tuple = ()
        self._repack()

    def _key(self) -> tuple:
        w = self.weight
        return (w.data_ptr(), w._version, w.dtype, w.device)

    def _repack(self) -> None:
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        self._packed_of = self._key()

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1:] != (self.in_features,) or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"x: expected a float32 CPU tensor [..., {self.in_features}], got "
                             f"{x.dtype} on {x.device} with shape {tuple(x.shape)}")
        if (x.numel() < self.min_rows * self.in_features
                or torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad)):
            return nn.functional.linear(x, self.weight, self.bias)
        if self._packed_of != self._key():  # the weight was changed or replaced since the pack
            self._repack()
        b = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, b, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"min_rows={self.min_rows}")


def pack_linear_weights(model: nn.Module, min_rows: int = PACKED_MIN_ROWS) -> int:
    """Replaces, in place, every ``nn.Linear`` of ``model`` that :func:`can_pack` accepts with a
    :class:`PackedLinear` over the same parameters (``min_rows``: see there); returns how many it replaced (0 where none
    fits, e.g. a CUDA or bf16 model, or PyTorch without oneDNN). Calling it again is harmless.

    Outputs match ``nn.Linear``'s to fp32 rounding (a different summation order, so not the same
    bits). Memory: a packed copy of each replaced weight besides the original.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 1:
        raise ValueError(f"min_rows: expected an int >= 1, got {min_rows!r}")
    todo = [(parent, name, child) for parent in model.modules()
            for name, child in parent.named_children() if can_pack(child)]
    packs = {}  # a linear module reached under two names is packed once
    for parent, name, child in todo:
        if id(child) not in packs:
            packs[id(child)] = PackedLinear(child, min_rows)
        setattr(parent, name, packs[id(child)])
    return len(packs)
