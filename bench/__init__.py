"""The project's benchmarks, one importable package: run each as ``python -m bench.<script>``
from the repository root (``python -m bench.e2e --help``). Shared helpers live in
:mod:`bench.common`; the reports over ``runs.jsonl`` files in :mod:`bench.report`. Results that
back the README are in ``bench/results/`` (see its README)."""
