#!/usr/bin/env python3
"""Print the longest Python functions under the given paths (default: bench python).

Usage: ``python scripts/longest_functions.py [PATH ...] [-n 10]``. A function's length is its
line span (``def`` through its last line, docstring and nested functions included), so a long
docstring counts; methods are named ``Class.method``. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def functions(path: Path):
    """Yield ``(lines, "file:line name")`` for every function and method in one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                yield child.end_lineno - child.lineno + 1, f"{path}:{child.lineno} {name}"
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["bench", "python"], help="files or folders")
    parser.add_argument("-n", type=int, default=10, help="how many to print (default 10)")
    args = parser.parse_args(argv)
    found = []
    for root in map(Path, args.paths):
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for f in files:
            found.extend(functions(f))
    for lines, where in sorted(found, key=lambda x: -x[0])[: args.n]:
        print(f"{lines:5d}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
