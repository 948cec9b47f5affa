"""``generate(prefill_cache=...)``: one prompt's prefill K/V shared by calls on the same model.

A benchmark runs several algorithms and repeats on one prompt; the prefill (the prompt but its last
tokens through the model) is the same for all of them, so the first call stores its K/V in a dict
the caller passes, and later calls copy them instead of recomputing. A copy is taken exactly when
the result would be the same: the same prompt, the same model object (a weak reference) computing
the same function, judged by :func:`fingerprint`. Every other call recomputes and says why in
``stats["prefill_miss"]``: ``"empty"``, ``"other prompt"``, ``"other model"``,
``"model changed: weights, modules"`` or ``"not fingerprintable: <what>"``.

What the fingerprint sees and what it cannot:

* Weights and buffers by storage, in-place version counter, dtype, device and shape: a reload,
  ``.to()``, ``load_state_dict`` or an in-place write through the tensor changes it. The dict
  holds the storages it keyed (so a storage freed by ``module.to(...)`` cannot pass its address on
  to the next one); passing a new dict lets them go.
* An *inference tensor* (made under ``torch.inference_mode()``, as servers load weights) has no
  version counter, so an in-place edit of it cannot be seen: such a model never reuses a prefill
  (``"not fingerprintable: model.<name> is an inference tensor ..."``). Nor does a tensor with no
  storage PyTorch can describe (an opaque or subclass tensor).
* Writes into ``param.data`` in place bump no version counter (PyTorch's ``.data`` is untracked by
  design): after such an edit, pass a new dict.
* Module attributes by value (numbers, strings, dtypes, enums and flags such as transformers'
  ``_kernels_mode``, tensors as above, containers of them); a module attribute that is a function
  or an arbitrary object, and any forward hook (module or global), make the model
  not fingerprintable: they can read state nobody can compare.
* Every config object's ``to_dict()``; the float32 matmul precision and the autocast state.
"""
from __future__ import annotations

import enum
import itertools
import weakref
from typing import Callable, List, Optional

import torch
from torch import Tensor

from .config import OptionTypeError
from .packed_linear import tensor_key

__all__ = ["check_prefill_cache", "copy_into", "fingerprint", "mismatch", "prefill_cache_is_for", "store"]


class NotFingerprintable(Exception):
    """Part of a model's function that :func:`fingerprint` cannot capture reliably."""


#: ``vars(module)`` entries that are torch's own bookkeeping (tensors and hooks are taken apart)
_MODULE_INTERNALS = frozenset((
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_is_full_backward_hook",
    "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
))
_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def _tensor(t: Tensor, where: str, keep: Optional[list] = None) -> tuple:
    """:func:`~vegas_ext.packed_linear.tensor_key` of ``t`` where its in-place changes can be seen;
    ``keep`` collects ``t``'s storage: a key names a storage by its address, which a freed
    storage would hand on to the next one (``module.to(fp8).to(fp32)`` did, in one allocation)."""
    if t.is_inference():
        raise NotFingerprintable(
            f"{where} is an inference tensor (made under torch.inference_mode()), whose in-place changes "
            f"cannot be seen; load or clone the weights outside inference_mode to reuse prefills")
    key = tensor_key(t)
    if key[0] != "tensor":
        raise NotFingerprintable(f"{where} is a tensor without a storage whose changes can be seen ({t.layout})")
    if keep is not None:
        keep.append(t.untyped_storage())
    return key


def _plain(v, where: str, depth: int = 0, keep: Optional[list] = None):
    """A hashable snapshot of ``v`` if it is plain data (scalars, dtypes, enums and flags, classes,
    tensors by storage and version, and tuples / lists / sets / dicts of them; other objects inside
    such a container by type and identity, e.g. transformers 5.25's ``_kernel_funcs`` slots of hub
    kernels); raises :class:`NotFingerprintable` for a module attribute that is itself a function
    or object."""
    if isinstance(v, _SCALARS):
        return v
    if isinstance(v, enum.Enum):  # a value, not behaviour (e.g. transformers' kernels.Mode flags)
        return ("enum", type(v).__module__, type(v).__qualname__, repr(v.value))
    if isinstance(v, type):
        return ("class", v.__module__, v.__qualname__, id(v))
    if isinstance(v, Tensor):
        return _tensor(v, where, keep)
    if depth < 4:
        if isinstance(v, (tuple, list)):
            return (type(v).__name__,) + tuple(_plain(x, f"{where}[{i}]", depth + 1, keep) for i, x in enumerate(v))
        if isinstance(v, (set, frozenset)):
            return ("set",) + tuple(sorted((_plain(x, where, depth + 1, keep) for x in v), key=repr))
        if isinstance(v, dict):
            items = ((repr(k), _plain(x, f"{where}[{k!r}]", depth + 1, keep)) for k, x in v.items())
            return ("dict",) + tuple(sorted(items, key=repr))
    if depth > 0:  # replaced -> another identity; what it does inside is the caller's contract
        return ("object", type(v).__module__, type(v).__qualname__, id(v))
    raise NotFingerprintable(f"{where} is a {type(v).__name__}")


def _config_snapshot(config, where: str):
    try:
        d = config.to_dict()
    except Exception as e:  # noqa: BLE001 - any failure means: cannot tell whether it changed
        raise NotFingerprintable(f"{where}.to_dict() failed ({type(e).__name__})") from e
    return _plain(d, where)


def fingerprint(model, keep: Optional[list] = None) -> dict:
    """What determines the prefill K/V ``model`` computes, in parts (cheap: no tensor data read):

    * ``"weights"``: every parameter's and buffer's storage, in-place version counter, dtype,
      device and shape (a reload, ``.to()`` or in-place update changes it);
    * ``"modules"``: each module's path, class and plain attributes (``variance_epsilon``,
      ``scaling``, ``training``, enums, ..., tensors by storage and version);
    * ``"config"``: ``config.to_dict()`` of every config object the modules hold;
    * ``"torch"``: the float32 matmul precision and autocast state of the model's device.

    Raises :class:`NotFingerprintable` naming what it cannot capture: a forward hook or pre-hook
    (module or global: a hook can read any state, e.g. a global steering vector), an inference
    tensor or a tensor without a describable storage (in-place changes unseen), or a module
    attribute that is not plain data (an assigned ``forward``, a callable, an object). ``keep``
    (a list) receives every storage keyed, so that whoever holds the fingerprint holds them too:
    while it does, no other storage can take one's address."""
    g = torch.nn.modules.module
    for kind in ("_global_forward_hooks", "_global_forward_pre_hooks"):
        if getattr(g, kind, None):
            raise NotFingerprintable(f"a global forward hook (torch.nn.modules.module.{kind})")
    weights, modules, configs = [], [], {}
    for name, mod in model.named_modules():  # one walk (parameters() and buffers() walk again)
        where = f"model.{name}" if name else "model"
        if mod._forward_hooks or mod._forward_pre_hooks:
            raise NotFingerprintable(f"a forward hook on {where}")
        for tname, t in itertools.chain(mod._parameters.items(), mod._buffers.items()):
            if t is not None:
                weights.append(_tensor(t, f"{where}.{tname}", keep))
        attrs = []
        caches = getattr(type(mod), "function_independent_attrs", ())  # e.g. PackedLinear's pack
        for k, v in vars(mod).items():
            if k in _MODULE_INTERNALS or k in caches:
                continue
            if k == "generation_config" or k == "config":  # decoding options / snapshot below
                if k == "config" and id(v) not in configs:
                    configs[id(v)] = _config_snapshot(v, f"{where}.config")
                continue
            attrs.append((k, _plain(v, f"{where}.{k}", keep=keep)))
        modules.append((name, type(mod), tuple(attrs)))
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    dev = first.device.type if first is not None else "cpu"
    try:
        amp = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
    except (RuntimeError, TypeError, AttributeError):
        amp = None
    return {"weights": tuple(weights), "modules": tuple(modules), "config": tuple(sorted(configs.values(), key=repr)),
            "torch": (torch.get_float32_matmul_precision(), amp)}


def mismatch(pc: dict, model) -> Optional[str]:
    """None if ``pc``'s K/V were computed by ``model`` as it is now, else why not: ``"empty"``,
    ``"other model"``, ``"model changed: <parts>"`` (:func:`fingerprint`'s parts that differ) or
    ``"not fingerprintable: <what>"``."""
    if pc.get("ids") is None:
        return "empty"
    ref = pc.get("model")
    if ref is None or ref() is not model:
        return "other model"
    try:
        now = fingerprint(model)
    except NotFingerprintable as e:
        return f"not fingerprintable: {e}"
    old = pc.get("fingerprint") or {}
    changed = [k for k in now if old.get(k) != now[k]]
    return f"model changed: {', '.join(changed)}" if changed else None


def prefill_cache_is_for(pc: dict, model) -> bool:
    """Whether ``pc`` (a ``generate(prefill_cache=...)`` dict) was filled by ``model`` as it is
    now: the same object (weak reference) computing the same function (:func:`fingerprint`). A
    model with forward hooks, inference-tensor weights or anything else the fingerprint cannot
    capture never matches."""
    return mismatch(pc, model) is None


def copy_into(pc: Optional[dict], model, cache, ids: Tensor, write_hook: Optional[Callable]) -> Optional[str]:
    """Copy the prefill K/V of ``ids`` ``[B, t]`` from ``pc`` into ``cache`` (a
    :class:`~vegas_ext.cache.VegasCache` whose forward for ``t`` tokens has begun) if ``pc`` holds
    them for ``model`` as it is now, telling ``write_hook`` (if any) as a forward would. Returns
    ``None`` when it copied, else why not (``"no prefill_cache"`` when ``pc`` is None)."""
    if pc is None:
        return "no prefill_cache"
    B, t = ids.shape
    held = pc.get("ids")
    if held is not None and not (held.shape[0] == B and held.shape[1] >= t and torch.equal(held[:, :t], ids)):
        return "other prompt"
    why = mismatch(pc, model)
    if why is not None:
        return why
    for li, cl in enumerate(cache.layers):
        cl.keys[:, :, :t].copy_(pc["k"][li][:, :, :t])
        cl.values[:, :, :t].copy_(pc["v"][li][:, :, :t])
        if write_hook is not None:
            write_hook(li, cl.keys, torch.zeros_like(cache.seq_lens))
    return None


def store(pc: dict, model, cache, ids: Tensor) -> Optional[str]:
    """Keep the prefill K/V of ``ids`` ``[B, t]`` (the first ``t`` positions of ``cache``'s layers)
    in ``pc`` for later calls of ``model``. Returns ``None``, or why nothing was stored
    (``"not fingerprintable: <what>"``)."""
    keep: list = []
    try:
        fp = fingerprint(model, keep)
    except NotFingerprintable as e:
        return f"not fingerprintable: {e}"
    t = ids.shape[1]
    pc["model"] = weakref.ref(model)
    pc["fingerprint"] = fp
    pc["storages"] = keep  # the keyed storages stay alive, so their addresses stay theirs
    pc["ids"] = ids.clone()
    pc["k"] = [cl.keys[:, :, :t].clone() for cl in cache.layers]
    pc["v"] = [cl.values[:, :, :t].clone() for cl in cache.layers]
    return None


def check_prefill_cache(pc) -> None:
    """``prefill_cache`` is ``None`` or a dict :func:`store` filled (or empty): the entries it
    reads have the types it stores, so a foreign dict fails here naming it
    (:class:`~vegas_ext.config.OptionTypeError`, a ``ValueError``), not deep in the copy."""
    if pc is None:
        return
    if not isinstance(pc, dict):
        raise OptionTypeError(f"prefill_cache must be a dict or None, got {type(pc).__name__}")
    ids = pc.get("ids")
    if ids is not None and not (isinstance(ids, Tensor) and ids.dim() == 2):
        raise OptionTypeError(
            f"prefill_cache['ids'] must be a [B, t] tensor (as a previous generate call stored), "
            f"got {type(ids).__name__}")
    for key in ("k", "v"):
        kv: Optional[List] = pc.get(key)
        if kv is not None and not (isinstance(kv, (list, tuple)) and all(isinstance(t, Tensor) for t in kv)):
            raise OptionTypeError(
                f"prefill_cache[{key!r}] must be a list of tensors (as a previous generate call stored), "
                f"got {type(kv).__name__}")
    ref = pc.get("model")
    if ref is not None and not callable(ref):
        raise OptionTypeError(f"prefill_cache['model'] must be a weak reference, got {type(ref).__name__}")
