"""Small helpers shared by the ``vegas`` command's modules (standard library at import time)."""
from __future__ import annotations

import math
import sys


def _eprint(*a, **k):
    """``print`` to stderr, flushed (progress and statistics go there; stdout carries the text)."""
    print(*a, file=sys.stderr, flush=True, **k)


def _sync(device) -> None:
    """Waits for ``device``'s queued work (CUDA), so wall times measure the work itself."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize()


def _jsonable(x):
    """``x`` with tensors as lists, numpy / torch scalars as Python numbers, NaN and infinities as
    ``None`` and dict keys as strings (what ``json.dumps`` takes and every JSON reader parses)."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if hasattr(x, "item") and callable(x.item):
        return x.item()
    return x
