#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q -ra tests "$@"
