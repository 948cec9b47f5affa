"""vegas_ext: self-speculative decoding with verification-guided sparse attention.

Vegas (Yue, Xue, Huang, arXiv 2602.07223): draft with the same model attending to a few
KV blocks, verify with full attention, and pick the next draft's blocks from the
verification's own attention mass.

Ops (``torch.ops.vegas.*``, typed wrappers in :mod:`vegas_ext.ops`):
:func:`verify_attention`, :func:`block_topk`, :func:`sparse_draft_attention`.
"""
from . import ops, reference
from .ops import block_topk, sparse_draft_attention, verify_attention
from .decode import generate, GenerateOutput
from . import selection  # the selection strategies (full, vegas, streamingllm, quest)

__version__ = "0.1.0"

__all__ = ["ops", "reference", "verify_attention", "block_topk", "sparse_draft_attention", "generate", "GenerateOutput", "__version__"]
