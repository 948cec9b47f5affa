#!/usr/bin/env python3
"""Check that every file under bench/results/ is cited, and that there are at most 160 of them.

bench/results/ keeps only the measurements behind today's README, docs and defaults, one folder per
claim; a new measurement of a claim replaces its folder, and the rest lives in git history. A file
is cited when a path that names it or one of its folders appears in:

* README.md, docs/, python/, bench/ (outside bench/results), csrc/ or tests/: a ``bench/results/...``
  path in any text (code comments and docstrings included; globs and ``{a,b}`` allowed after the
  first folder, which must be named), or in Python a path built from ``RESULTS`` or a ``"results"``
  component (``RESULTS / "x" / "y"``, ``os.path.join(HERE, "results", "x", name)``);
* a README.md under bench/results/ that is itself cited: a path in backticks or a link target,
  relative to the README's folder and inside it (bench/results/README.md is the index: cited by the
  README, it may cite any folder).

Usage: ``python scripts/check_results_cited.py [--root DIR] [--max-files N] [-v]``; exits 1 and
names the uncited files, or says by how much the count is over. ``-v`` prints what cites each file.
Run by ``scripts/lint.sh``.
"""
from __future__ import annotations

import argparse
import ast
import fnmatch
import os
import posixpath
import re
import subprocess
import sys

RESULTS = "bench/results"
MAX_FILES = 160
SOURCES = ["README.md", "docs", "python", "bench", "csrc", "tests"]
TEXT_EXT = (".md", ".py", ".h", ".hpp", ".cpp", ".cu", ".cuh", ".sh", ".txt", ".toml", ".cfg")
PATH_IN_TEXT = re.compile(r"bench/results/([\w.*?{},/\-]+)")
BACKTICKS = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
GLOB = set("*?[")


def expand_braces(s: str) -> list:
    """``a_{x,y}.md`` -> ``["a_x.md", "a_y.md"]`` (first group first, recursively)."""
    m = re.search(r"\{([^{}]*)\}", s)
    if not m:
        return [s]
    return [out for alt in m.group(1).split(",") for out in expand_braces(s[:m.start()] + alt + s[m.end():])]


def clean(path: str):
    """A cited path relative to bench/results, or None: no empty or glob first folder (``kernels_*``
    names no claim), no escape upwards."""
    path = path.strip().rstrip(".,;:)'\"").rstrip("/")
    if not path:
        return None
    path = posixpath.normpath(path)
    first = path.split("/")[0]
    if first in ("", ".", "..") or GLOB & set(first):
        return None
    return path


def files_under_results(root: str) -> list:
    """Tracked and new (untracked, not ignored) files under bench/results, relative to it."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", RESULTS],
                         cwd=root, capture_output=True, text=True)
    if out.returncode == 0:
        names = out.stdout.split("\n")
    else:  # not a git checkout (an exported tree): every file on disk
        base = os.path.join(root, RESULTS)
        names = [os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
                 for d, _, fs in os.walk(base) for f in fs]
    prefix = RESULTS + "/"
    return sorted({n[len(prefix):] for n in names if n.startswith(prefix) and os.path.isfile(os.path.join(root, n))})


def source_files(root: str):
    for top in SOURCES:
        full = os.path.join(root, top)
        if os.path.isfile(full):
            yield top
            continue
        for d, dirs, fs in os.walk(full):
            rel = os.path.relpath(d, root).replace(os.sep, "/")
            if rel == RESULTS or rel.startswith(RESULTS + "/"):
                dirs[:] = []
                continue
            dirs[:] = [x for x in dirs if not x.startswith(".") and x != "__pycache__"]
            yield from (f"{rel}/{f}" for f in fs if f.endswith(TEXT_EXT))


def _parts(node, aliases):
    """A path expression as a list of components: "<R>" for the results folder, "*" for anything
    not a string constant."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return ["<R>" if node.value == "results" else node.value]
    if isinstance(node, ast.Name):
        return ["<R>"] if node.id == "RESULTS" else aliases.get(node.id, ["*"])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _parts(node.left, aliases) + _parts(node.right, aliases)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join":
        return [p for a in node.args for p in _parts(a, aliases)]
    return ["*"]


def python_citations(text: str) -> list:
    """Paths under bench/results that Python code builds from RESULTS or a "results" component."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    aliases = {}
    for node in tree.body:  # module-level names such as GRID_DIR = RESULTS / "x"
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            parts = _parts(node.value, aliases)
            if "<R>" in parts:
                aliases[node.targets[0].id] = parts
    inner = set()  # the left side of a "/" and the arguments of a join: parts of a longer path
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            inner.add(id(node.left))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join":
            inner.update(id(a) for a in node.args)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.BinOp, ast.Call)) or id(node) in inner:
            continue
        parts = _parts(node, aliases)
        if "<R>" in parts:
            rest = parts[len(parts) - parts[::-1].index("<R>"):]
            found.append("/".join(p.strip("/") for p in rest))
    return found


def text_citations(text: str) -> list:
    return [m.group(1) for m in PATH_IN_TEXT.finditer(text)]


def readme_citations(text: str, folder: str) -> list:
    """Paths a README under bench/results cites, relative to bench/results, inside its folder."""
    words = [w for span in BACKTICKS.findall(text) for w in span.split()] + LINK.findall(text)
    out = []
    for w in words:
        w = w.strip("()[],;:'\"")
        if w.startswith(RESULTS + "/"):
            rel = w[len(RESULTS) + 1:]
        else:
            rel = posixpath.join(folder, w) if folder else w
        for one in expand_braces(rel):
            p = clean(one)
            if p and (not folder or p == folder or p.startswith(folder + "/")):
                out.append(p)
    return out


def covers(citation: str, path: str) -> bool:
    """Whether a cited path (a file, a folder or a glob) covers the file ``path``."""
    parts = path.split("/")
    return any(fnmatch.fnmatchcase("/".join(parts[:i]), citation) for i in range(1, len(parts) + 1))


def cited_by(root: str, files: list) -> dict:
    """file -> the first source citing it (a file path), for every cited file."""
    citations = []  # (cited path, source)
    for src in source_files(root):
        try:
            text = open(os.path.join(root, src), encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        found = text_citations(text) + (python_citations(text) if src.endswith(".py") else [])
        citations += [(p, src) for c in found for e in expand_braces(c) if (p := clean(e))]
    result, done = {}, set()
    while True:
        for f in files:
            if f not in result:
                src = next((s for c, s in citations if covers(c, f)), None)
                if src:
                    result[f] = src
        new = [f for f in result if posixpath.basename(f) == "README.md" and f not in done]
        if not new:
            return result
        for f in new:
            done.add(f)
            text = open(os.path.join(root, RESULTS, f), encoding="utf-8").read()
            folder = posixpath.dirname(f)
            citations += [(c, f"{RESULTS}/{f}") for c in readme_citations(text, folder)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="repository root (default: this script's)")
    ap.add_argument("--max-files", type=int, default=MAX_FILES, help=f"most files allowed (default {MAX_FILES})")
    ap.add_argument("-v", "--verbose", action="store_true", help="print what cites each file")
    args = ap.parse_args(argv)
    files = files_under_results(args.root)
    cited = cited_by(args.root, files)
    if args.verbose:
        for f in files:
            print(f"{RESULTS}/{f}  <-  {cited.get(f, 'NOT CITED')}")
    uncited = [f for f in files if f not in cited]
    ok = True
    if uncited:
        ok = False
        print(f"{len(uncited)} file(s) under {RESULTS}/ cited by no README, doc, code or cited results README "
              "(cite them, or git rm them: history keeps them):", file=sys.stderr)
        for f in uncited:
            print(f"  {RESULTS}/{f}", file=sys.stderr)
    if len(files) > args.max_files:
        ok = False
        print(f"{len(files)} files under {RESULTS}/, more than {args.max_files}: replace a claim's folder "
              "rather than adding one beside it", file=sys.stderr)
    if ok:
        print(f"{RESULTS}/: {len(files)} files (at most {args.max_files}), every one cited")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
