"""Loading: the heavy imports, the device and dtype, the model and its tokenizer."""
from __future__ import annotations

import contextlib
import functools
import sys

from .arguments import CLIError
from .common import _eprint


def import_decoder() -> None:
    """Imports torch, transformers and the decode loop (with every selection algorithm
    registered), and turns transformers' own warnings and bars off (ours are on stderr)."""
    import torch  # noqa: F401

    from .. import generate  # noqa: F401

    _quiet_transformers()


def _quiet_transformers() -> None:
    """transformers' own warnings and weight-loading bars off (ours are on stderr)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _resolve_device_dtype(args):
    """``(torch.device, torch.dtype)`` from ``--device`` (``auto``: cuda when available) and
    ``--dtype``; raises :class:`CLIError` for one this machine cannot run."""
    import torch

    from .. import models

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dtype = models.parse_dtype(args.dtype)
        device = torch.device(device)
    except (ValueError, RuntimeError) as e:
        raise CLIError(str(e).splitlines()[0]) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda requested but CUDA is not available")
    return device, dtype


@contextlib.contextmanager
def _quiet_conversion_bar():
    """transformers' GGUF conversion bar (its own tqdm, ~300 ``\\r`` updates) off when stderr is
    not a terminal; the load's start and end lines say what happens."""
    try:
        if sys.stderr.isatty():
            raise ImportError
        from tqdm.auto import tqdm
        from transformers import modeling_gguf_pytorch_utils as gguf_utils

        old = gguf_utils.tqdm
    except (ImportError, AttributeError):
        yield
        return
    gguf_utils.tqdm = functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = old


def _load(args, dtype, device, show: bool):
    """``(model, tokenizer, packed)``: ``--model`` (default: the embedded SmolLM2) in ``dtype`` on
    ``device``; ``packed`` is the number of linears put on oneDNN-packed weights (0 unless CPU
    float32 with ``--pack-linears``). Raises :class:`CLIError` for a model that cannot load."""
    from .. import models

    name = args.model or "the embedded SmolLM2-135M-Instruct"
    if show:
        first = (f"; first use: converting the GGUF file once (~0.5-2 min), cached in {models.cache_root()}"
                 if models.needs_conversion(args.model) else "")
        _eprint(f"vegas: loading {name}{first} ...")
    try:
        with _quiet_conversion_bar():
            model, tok = models.load_model(args.model, dtype=dtype, device=device)
    except ValueError as e:
        raise CLIError(str(e).splitlines()[0]) from None
    info = models.last_load_info
    packed = 0
    if args.pack_linears:
        from ..packed_linear import pack_linear_weights

        packed = pack_linear_weights(model)  # 0 unless CPU float32 (see vegas_ext.packed_linear)
    if show:
        _eprint(f"vegas: loaded in {info.get('seconds', 0):.1f} s ({info.get('how')}): "
                f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.3g}M params, "
                f"{str(dtype).replace('torch.', '')}, {device}"
                + (f"; {packed} linears on oneDNN-packed weights" if packed else ""))
    return model, tok, packed
