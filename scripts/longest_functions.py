#!/usr/bin/env python3
"""Print the longest Python functions under the given paths (default: bench python).

Usage: ``python scripts/longest_functions.py [PATH ...] [-n 10] [--code]``. A function's length
is its line span (``def`` through its last line, docstring and nested functions included);
``--code`` ranks by the span without the docstring instead. Both columns are printed: span, code.
Methods are named ``Class.method``. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def functions(path: Path):
    """Yield ``(lines, code lines, "file:line name")`` for every function and method in one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                span = child.end_lineno - child.lineno + 1
                first = child.body[0]
                doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                    and isinstance(first.value.value, str)
                code = span - (first.end_lineno - first.lineno + 1 if doc else 0)
                yield span, code, f"{path}:{child.lineno} {name}"
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
    parser.add_argument("--code", action="store_true", help="rank by lines without the docstring")
    args = parser.parse_args(argv)
    found = []
    for root in map(Path, args.paths):
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for f in files:
            found.extend(functions(f))
    for span, code, where in sorted(found, key=lambda x: -x[1 if args.code else 0])[: args.n]:
        print(f"{span:5d} {code:5d}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
