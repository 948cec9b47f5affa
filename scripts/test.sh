#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the test suite, in parallel where the cores allow.
#
#   bash scripts/test.sh [pytest args]
#
# VEGAS_TEST_WORKERS  pytest-xdist workers (default: the cores, at most 8; 1 = serial, one process)
# VEGAS_SKIP_SETUP=1  skip scripts/setup.sh (CI runs it as a phase of its own)
# With N workers each gets cores/N OpenMP / torch threads (OMP_NUM_THREADS, unless set), so the
# workers do not oversubscribe the cores; tests that set their own thread count still get it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${VEGAS_SKIP_SETUP:-0}" != "1" ]; then
  bash scripts/setup.sh
fi
PY=${PYTHON:-python3}
cores=$(nproc)
workers=${VEGAS_TEST_WORKERS:-$((cores < 8 ? cores : 8))}
par=()
if [ "$workers" -gt 1 ]; then
  if "$PY" -c "import xdist" 2>/dev/null; then
    threads=$((cores / workers))
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}
    # worksteal: an idle worker takes queued tests from a busy one (the slow real-model tests)
    par=(-n "$workers" --dist worksteal)
  else
    echo "test.sh: pytest-xdist is not installed (the [test] extra has it): running serially" >&2
  fi
fi
exec "$PY" -m pytest -q -ra "${par[@]}" tests "$@"
