"""Helpers shared by the benchmarks: run metadata and robust timing."""
import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# verify_attention shapes of the kernel benchmarks (bench_kernels_cpu.py --grid, ab_trees_cpu.py):
# name: (B, Hq, Hkv, D)
GRID_SHAPES = {
    "smollm2-b1": (1, 9, 3, 64),
    "smollm2-b4": (4, 9, 3, 64),
    "llama3-8b-b1": (1, 32, 8, 128),
}


def sync(device) -> None:
    """Waits for ``device``'s queued work (CUDA); a no-op on CPU. Call around a timed region."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def device_name(device: str = "cpu") -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} ({torch.get_num_threads()} threads)"


def run_metadata(device: str = "cpu") -> dict:
    meta = {
        "device": device,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except Exception:
        pass
    return meta


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


def add_pack_linears_flag(ap: argparse.ArgumentParser) -> None:
    """``--pack-linears / --no-pack-linears`` (default on, as in the CLI): pass the parsed value to
    :func:`pack_linears`."""
    ap.add_argument("--pack-linears", action=argparse.BooleanOptionalAction, default=True,
                    help="CPU float32: the model's linears on weights packed for oneDNN "
                         "(vegas_ext.pack_linear_weights; default on, as in the CLI)")


def pack_linears(model, enabled: bool) -> int:
    """``vegas_ext.pack_linear_weights(model)`` where ``enabled`` (``--pack-linears``); the number packed."""
    from vegas_ext.packed_linear import pack_linear_weights

    return pack_linear_weights(model) if enabled else 0


def write_rows(path: Path, rows: list):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
