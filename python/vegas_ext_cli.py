"""The ``vegas`` console script: parses its arguments before torch is imported.

``import vegas_ext`` loads torch and the compiled ops (so ``torch.ops.vegas.*`` is callable right
after it), which takes seconds. ``vegas --help`` and bad flags must answer at once, so this
top-level module (outside the package, whose ``__init__`` would load torch) runs the
:mod:`vegas_ext.cli` package -- standard library only at import time -- without importing
``vegas_ext`` first: the package, torch and transformers load only when ``vegas generate`` goes on
to decode (the first ``from .. import ...`` inside the command).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Optional, Sequence

__all__ = ["main"]

_CLI = "vegas_ext.cli"


def _load_by_path(name: str, path: str, package: bool = False):
    """Executes the package file ``path`` as module ``name`` without running the parent package's
    ``__init__``; registered under its real name, so a later ``import name`` finds it. With
    ``package``, ``path`` is a package's ``__init__.py`` and its submodules import as usual."""
    locations = [os.path.dirname(path)] if package else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=locations)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            sys.modules.pop(loaded, None)
        raise
    return module


def _load_cli():
    """The :mod:`vegas_ext.cli` package (and the standard-library :mod:`vegas_ext.config` it
    checks options with), executed without running ``vegas_ext/__init__.py`` first."""
    if "vegas_ext" in sys.modules or _CLI in sys.modules:  # already imported: nothing to save
        return importlib.import_module(_CLI)
    spec = importlib.util.find_spec("vegas_ext")  # locates the package without importing it
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    folder = next((d for d in locations if os.path.isfile(os.path.join(d, "cli", "__init__.py"))
                   and os.path.isfile(os.path.join(d, "config.py"))), None)
    if folder is None:  # unusual install (zip, namespace package): the ordinary, slower import
        return importlib.import_module(_CLI)
    # the cli's own modules import relative to vegas_ext.cli (already registered); its imports of
    # the decode side (``from .. import generate``) later import the package as usual
    if "vegas_ext.config" not in sys.modules:
        _load_by_path("vegas_ext.config", os.path.join(folder, "config.py"))
    return _load_by_path(_CLI, os.path.join(folder, "cli", "__init__.py"), package=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``vegas`` console script: :func:`vegas_ext.cli.main` (exit status 0 ok,
    2 bad input), with the argument parsing and checks done before torch is imported."""
    return _load_cli().main(argv)


if __name__ == "__main__":
    sys.exit(main())
