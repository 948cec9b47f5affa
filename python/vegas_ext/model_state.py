"""What vegas_ext keeps per model (or per tensor), held beside the object rather than on it.

One mechanism for every per-object cache (the draft weights' low-precision copies of a model, the
vLLM plugin's draft copy of a weight; the packed linears' copies are reached through :func:`release`
too): a table keyed by the object's identity that refers to it only weakly. So a call of
:func:`vegas_ext.generate` never changes what the model can do afterwards: ``pickle``,
``torch.save(model)`` and ``copy.deepcopy`` see no state of ours (a copy makes its own on first
use), and the model is freed by reference counting when its last reference goes, its cached state
with it (no ``gc.collect()`` needed). Values stored here
must not refer back to the model strongly (use :func:`weakref.ref`), or the model would keep
itself alive through this table.

:func:`release` (also ``vegas_ext.release``) drops everything held for a model now.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, Tuple

from torch import nn

__all__ = ["get", "pop", "put", "release"]

# id(model) -> (weak reference to the model, {name: value}); the reference's callback removes the
# entry when the model dies, before its id can be reused
_TABLE: Dict[int, Tuple[weakref.ref, Dict[str, Any]]] = {}
_LOCK = threading.Lock()


def _entry(model: Any, create: bool):
    key = id(model)
    e = _TABLE.get(key)
    if e is not None and e[0]() is model:
        return e[1]
    if not create:
        return None

    def forget(_ref, key=key):
        with _LOCK:
            cur = _TABLE.get(key)
            if cur is not None and cur[0] is _ref:
                del _TABLE[key]

    d: Dict[str, Any] = {}
    _TABLE[key] = (weakref.ref(model, forget), d)
    return d


def get(model: Any, name: str, default: Any = None) -> Any:
    """The value stored for ``model`` (a module, or any object that takes weak references, such as
    a tensor) under ``name``, else ``default``."""
    with _LOCK:
        d = _entry(model, create=False)
        return default if d is None else d.get(name, default)


def put(model: Any, name: str, value: Any) -> None:
    """Store ``value`` for ``model`` under ``name`` (``value`` must refer to ``model`` only weakly)."""
    with _LOCK:
        _entry(model, create=True)[name] = value


def pop(model: Any, name: str, default: Any = None) -> Any:
    """Remove and return the value stored for ``model`` under ``name`` (``default`` if none)."""
    with _LOCK:
        d = _entry(model, create=False)
        return default if d is None else d.pop(name, default)


def release(model: nn.Module) -> int:
    """Drop every cache vegas_ext holds for ``model``: the draft weights' low-precision copies and
    the packed linears' oneDNN copies (:class:`~vegas_ext.packed_linear.PackedLinear` modules stay
    and repack on their next call). The model computes exactly as before; the next call that needs
    a cache builds it again. Call it after editing weights in ways the caches cannot see (writes
    through ``.data``, inference tensors edited in place, raw pointers) or to free the memory now.

    Returns the number of caches dropped. Raises ``TypeError`` when ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    from .packed_linear import PackedLinear

    with _LOCK:
        e = _TABLE.pop(id(model), None)
    n = len(e[1]) if e is not None and e[0]() is model else 0
    for m in model.modules():
        if isinstance(m, PackedLinear) and m._pack is not None:
            m._pack = None
            n += 1
    return n
