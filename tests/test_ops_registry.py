"""Where the vegas ops come from (issue 46): every schema from csrc/registration.cpp's
TORCH_LIBRARY only, none re-declared in Python; importing vegas_ext.ops without the compiled
extension fails with an error that says how to build it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from vegas_ext import ops

ROOT = Path(__file__).resolve().parents[1]


def _cpp_ops():
    text = (ROOT / "csrc" / "registration.cpp").read_text()
    return re.findall(r'm\.def\(\s*"(\w+)\(', text)


def test_every_schema_is_registered_by_the_cpp_library():
    names = _cpp_ops()
    assert tuple(names) == ops._OPS  # the wrappers' list follows registration.cpp
    for name in names:
        dump = torch._C._dispatch_dump(f"vegas::{name}")
        debug = next(line for line in dump.splitlines() if line.startswith("debug:"))
        assert "registration.cpp" in debug, (name, debug)


def test_ops_py_declares_no_schema():
    src = (ROOT / "python" / "vegas_ext" / "ops.py").read_text()
    assert "torch.library.Library(" not in src and ".define(" not in src


def test_import_without_the_compiled_extension_says_how_to_build():
    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'vegas_ext._C':\n"
        "            raise ImportError('no build here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import vegas_ext.ops\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    assert res.returncode != 0
    assert "ImportError: vegas_ext: the compiled extension vegas_ext._C is not available (no build here)" in res.stderr
    assert "pip install --no-build-isolation -e ." in res.stderr
