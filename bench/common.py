"""Helpers shared by the benchmarks: run metadata, robust timing, small statistics, output files.

Everything here is imported as ``bench.common`` (run the scripts as ``python -m bench.<script>``
from the repository root). torch is imported lazily, so the reports stay importable without it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# verify_attention shapes of the kernel benchmarks (bench_kernels_cpu --grid, ab_trees_cpu):
# name: (B, Hq, Hkv, D)
GRID_SHAPES = {
    "smollm2-b1": (1, 9, 3, 64),
    "smollm2-b4": (4, 9, 3, 64),
    "llama3-8b-b1": (1, 32, 8, 128),
}


# ------------------------------------------------------------------------ statistics, formatting

def median(xs: Iterable[Any]) -> Optional[float]:
    """Median of the numbers in ``xs`` (None and other non-numbers skipped); None when there are none."""
    xs = [x for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return statistics.median(xs) if xs else None


def gmean(xs: Iterable[Any]) -> Optional[float]:
    """Geometric mean of the positive numbers in ``xs``; None when there are none."""
    xs = [x for x in xs if isinstance(x, (int, float)) and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def fmt(x: Optional[float], spec: str = "{:.2f}") -> str:
    """``spec.format(x)``, or an en dash for a missing value (the tables' convention)."""
    return "–" if x is None else spec.format(x)


# ---------------------------------------------------------------------------------- run metadata

def git_commit(tree: Optional[os.PathLike] = None, short: bool = False) -> Tuple[Optional[str], Optional[bool]]:
    """``(sha, dirty)`` of the checkout at ``tree`` (default: this one): the commit, abbreviated with
    ``short``, and whether tracked files differ from it; ``(None, None)`` outside a git checkout."""
    cwd = str(tree or ROOT)
    try:
        cmd = ["git", "rev-parse", "--short", "HEAD"] if short else ["git", "rev-parse", "HEAD"]
        sha = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
        return (sha or None), (dirty if sha else None)
    except (OSError, subprocess.SubprocessError):
        return None, None


def commit_label(tree: Optional[os.PathLike] = None) -> str:
    """``abc1234``, ``abc1234-dirty`` or ``unknown``: the short commit as the kernel tables print it."""
    sha, dirty = git_commit(tree, short=True)
    return "unknown" if sha is None else sha + ("-dirty" if dirty else "")


def sync(device) -> None:
    """Waits for ``device``'s queued work (CUDA); a no-op on CPU. Call around a timed region."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: str = "cpu") -> str:
    """The GPU's name, or the CPU's model name (``/proc/cpuinfo``) with torch's thread count."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu} ({torch.get_num_threads()} threads)"


def run_metadata(device: str = "cpu") -> dict:
    """Device, versions, commit (:func:`commit_label`) and date, recorded with every kernel row."""
    import torch

    meta = {
        "device": device,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit_label(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    return meta


# ---------------------------------------------------------------------------------------- timing

def time_fns(fns: dict, repeats: int = 10, warmup: int = 2) -> dict:
    """Median seconds per call of each fn, interleaved so machine noise hits all alike."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    samples = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


# ------------------------------------------------------------------------------ model options

def add_pack_linears_flag(ap: argparse.ArgumentParser) -> None:
    """``--pack-linears / --no-pack-linears`` (default on, as in the CLI): pass the parsed value to
    :func:`pack_linears`."""
    ap.add_argument("--pack-linears", action=argparse.BooleanOptionalAction, default=True,
                    help="CPU float32: the model's linears on weights packed for oneDNN "
                         "(vegas_ext.pack_linear_weights; default on, as in the CLI)")


def add_cpus_flag(ap: argparse.ArgumentParser) -> None:
    """``--cpus LIST``: the cores an A/B's processes are pinned to (``taskset -c``), one OpenMP thread
    each; checked and normalized by :func:`check_cpus`."""
    ap.add_argument("--cpus", default="1", metavar="LIST",
                    help="cores to pin the processes to (taskset -c LIST, e.g. 1 or 0,1), one thread per core")


def check_cpus(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Normalizes ``args.cpus`` (distinct core numbers, comma-separated) and returns their count;
    ``ap.error`` (exit 2) naming the flag otherwise."""
    cores = [c.strip() for c in args.cpus.split(",")]
    if not all(c.isdigit() for c in cores) or len(set(map(int, cores))) != len(cores):
        ap.error(f"--cpus: a comma-separated list of distinct core numbers, e.g. 0,1 (got {args.cpus!r})")
    args.cpus = ",".join(str(int(c)) for c in cores)
    return len(cores)


def pack_linears(model, enabled: bool) -> int:
    """``vegas_ext.pack_linear_weights(model)`` where ``enabled`` (``--pack-linears``); the number packed."""
    from vegas_ext.packed_linear import pack_linear_weights

    return pack_linear_weights(model) if enabled else 0


# ---------------------------------------------------------------------------------------- files

def row_gamma_kwargs(variant: dict) -> dict:
    """``RowGamma`` keyword arguments from a variant's JSON object, whose ``costs`` (an object) are
    ``TokenCostModel``'s (built here, with the variant's ``window``)."""
    from vegas_ext.speculation import TokenCostModel

    kw = dict(variant)
    if "costs" in kw:
        if not isinstance(kw["costs"], dict):
            raise ValueError("costs must be an object of TokenCostModel keyword arguments")
        if "window" in kw["costs"]:
            raise ValueError("window is a RowGamma setting: give it beside costs, not inside")
        kw["costs"] = TokenCostModel(kw.get("window", 5), **kw["costs"])
    return kw


def write_rows(path: Path, rows: list) -> None:
    """One JSON object per line into ``path`` (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def load_runs(paths: Iterable[str]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """Records of every ``runs.jsonl`` in ``paths`` and the ``config.json`` next to each (or ``{}``)."""
    records, configs = [], []
    for p in paths:
        with open(p) as f:
            records += [json.loads(line) for line in f if line.strip()]
        cfg_path = os.path.join(os.path.dirname(os.path.abspath(p)), "config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                configs.append(json.load(f))
        else:
            configs.append({})
    return records, configs


def command_line(module: str, argv: List[str]) -> str:
    """``python -m bench.<module> ARGS``: how a result file records the command that wrote it."""
    import shlex

    return " ".join(["python", "-m", f"bench.{module}"] + [shlex.quote(a) for a in argv])
