"""vegas_ext: self-speculative decoding with verification-guided sparse attention.

Vegas (Yue, Xue, Huang, arXiv 2602.07223): draft with the same model attending to a few
KV blocks, verify with full attention, and pick the next draft's blocks from the
verification's own attention mass.

Ops (``torch.ops.vegas.*``, typed wrappers in :mod:`vegas_ext.ops`):
:func:`verify_attention`, :func:`block_topk`, :func:`sparse_draft_attention`.
Decoding: :func:`generate` (returns a :class:`GenerateOutput`). CPU speed: :func:`pack_linear_weights`
(the model's fp32 linears on weights packed once for oneDNN). :func:`release` drops every cache
kept for a model (draft weight copies, packed copies; :mod:`vegas_ext.model_state`).

Importing the package loads torch and the compiled ops, so every ``torch.ops.vegas.*`` op is
callable right after ``import vegas_ext`` (the convention of PyTorch C++ extensions). transformers
and the decode loop load on first use of an attribute (``vegas_ext.generate``, ``vegas_ext.hf``,
...); ``generate``, ``GenerateOutput``, ``decode`` and ``selection`` also register the rival
selection algorithms (``"streamingllm"``, ``"quest"``). The ``vegas`` console script
(:mod:`vegas_ext_cli`) parses its arguments before this package is imported, so ``vegas --help``
answers at once.
"""
import importlib

from . import ops  # registers torch.ops.vegas.* (loads torch and the compiled library)

__version__ = "0.1.0"

# attribute -> submodule that defines it
_EXPORTS = {
    "verify_attention": "ops",
    "block_topk": "ops",
    "sparse_draft_attention": "ops",
    "generate": "decode",
    "GenerateOutput": "decode",
    "pack_linear_weights": "packed_linear",
    "unpack_linear_weights": "packed_linear",
    "release": "model_state",
}
# submodules loaded on first use (the ops are loaded above)
_TORCH_SUBMODULES = {"reference", "cache", "attention", "hf", "decode", "selection", "prefill_cache", "model_state"}
# names whose use must also see every selection algorithm registered
_NEEDS_ALL_ALGORITHMS = {"generate", "GenerateOutput", "decode", "selection"}

__all__ = ["ops", "reference", "verify_attention", "block_topk", "sparse_draft_attention", "generate",
           "GenerateOutput", "pack_linear_weights", "unpack_linear_weights", "release", "__version__"]


def __getattr__(name):
    """Loads the transformers-side parts on first use (PEP 562); see the module docstring."""
    module = _EXPORTS.get(name, name if name in _TORCH_SUBMODULES else None)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    mod = importlib.import_module("." + module, __name__)
    if name in _NEEDS_ALL_ALGORITHMS:
        importlib.import_module(".selection", __name__)  # registers "streamingllm" and "quest"
    value = getattr(mod, name) if name in _EXPORTS else mod
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
