#!/usr/bin/env bash
# Lint: ruff over the Python (pyproject.toml's [tool.ruff]) and clang-format over csrc/
# (.clang-format), both as checks that change nothing, and scripts/check_results_cited.py (every
# file under bench/results/ cited, at most 160 of them); exits non-zero on any finding.
#   bash scripts/lint.sh            # both
#   bash scripts/lint.sh --python   # ruff and the results check;  --cpp: clang-format only
#   bash scripts/lint.sh --fix      # apply ruff's safe fixes and clang-format in place
# ruff and clang-format come from PATH, or else are installed from PyPI (the pinned versions
# below) into $LINT_HOME (default ~/.cache/vegas_ext-lint), outside any project venv.
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF_VERSION=0.17.6
CLANG_FORMAT_VERSION=23.1.5
LINT_HOME=${LINT_HOME:-$HOME/.cache/vegas_ext-lint}
PY=${PYTHON:-python3}

what=all fix=0
for a in "$@"; do
  case "$a" in
    --python) what=python ;;
    --cpp) what=cpp ;;
    --fix) fix=1 ;;
    *) echo "lint.sh: unknown argument $a (expected --python, --cpp, --fix)" >&2; exit 2 ;;
  esac
done

# tool NAME PIP_SPEC -> the command to run (PATH first, else a pip install --target of its own:
# pip does not merge a second package's bin/ into an existing target)
tool() {
  if command -v "$1" >/dev/null 2>&1; then
    command -v "$1"
    return
  fi
  local dir="$LINT_HOME/$1-${2##*==}"
  if [ ! -x "$dir/bin/$1" ]; then
    "$PY" -m pip install -q --disable-pip-version-check --target "$dir" "$2" >&2
  fi
  echo "env PYTHONPATH=$dir $dir/bin/$1"
}

rc=0
if [ "$what" != cpp ]; then
  RUFF=$(tool ruff "ruff==$RUFF_VERSION")
  echo "== ruff $($RUFF --version | cut -d' ' -f2)"
  if [ "$fix" = 1 ]; then $RUFF check --fix . || rc=1; else $RUFF check . || rc=1; fi
  echo "== bench/results citations"
  "$PY" scripts/check_results_cited.py || rc=1
fi
if [ "$what" != python ]; then
  CLANG_FORMAT=$(tool clang-format "clang-format==$CLANG_FORMAT_VERSION")
  echo "== $($CLANG_FORMAT --version)"
  mapfile -t files < <(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh')
  if [ "$fix" = 1 ]; then
    $CLANG_FORMAT -i "${files[@]}" || rc=1
  else
    $CLANG_FORMAT --dry-run --Werror "${files[@]}" || rc=1
  fi
fi
exit $rc
