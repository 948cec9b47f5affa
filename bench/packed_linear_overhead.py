"""What PackedLinear's per-call bookkeeping costs: a model's linears as modules against the bare op.

Times, interleaved in one run (medians over rounds), one pass over every packed linear of the model
(SmolLM2-135M by default: 211 with lm_head) at M rows: the bare oneDNN op on the packed weights
(``torch.ops.mkldnn._linear_pointwise``), the same through ``PackedLinear.forward`` (weight checks
included), and ``F.linear``; ``--old FILE`` adds the PackedLinear of another packed_linear.py.

    python bench/packed_linear_overhead.py --threads 1 --rows 4 12 --rounds 15
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import time

import torch
import torch.nn.functional as F

from vegas_ext import models
from vegas_ext.packed_linear import PackedLinear, can_pack


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 12])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--old", default=None, help="another packed_linear.py whose PackedLinear to time too")
    return ap.parse_args(argv)


def packed_modules(lins: list, old_path=None) -> dict:
    """Name -> the ``PackedLinear`` of each linear in ``lins``; with ``old_path`` also the
    ``PackedLinear`` of that packed_linear.py (as ``"old PackedLinear"``)."""
    mods = {"PackedLinear": [PackedLinear(m) for m in lins]}
    if old_path:
        spec = importlib.util.spec_from_file_location("old_packed_linear", old_path)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        # copies: the old module's data_ptr() key would un-mark the shared weights' copy-on-write storage
        mods["old PackedLinear"] = [old.PackedLinear(copy.deepcopy(m)) for m in lins]
    return mods


def pass_fns(lins: list, mods: dict, rows: list) -> dict:
    """``(way, M) -> fn``: one pass over every linear at M rows by the bare op on the packed weights,
    by each of ``mods`` and by ``F.linear``."""
    packed = [p._current() for p in mods["PackedLinear"]]
    fns = {}
    for M in rows:
        xs = {}
        for m in lins:
            xs.setdefault(m.in_features, torch.randn(M, m.in_features))
        fns[("bare op", M)] = (lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(
            xs[m.in_features], p, m.bias, "none", [], "") for m, p in zip(lins, packed)])
        for name, ms in mods.items():
            fns[(name, M)] = (lambda xs=xs, ms=ms: [p(xs[p.in_features]) for p in ms])
        fns[("F.linear", M)] = (lambda xs=xs: [F.linear(xs[m.in_features], m.weight, m.bias) for m in lins])
    return fns


def time_rounds(fns: dict, rounds: int) -> dict:
    """Seconds of each fn in each of ``rounds`` interleaved rounds, after one warm-up call each."""
    t = {k: [] for k in fns}
    with torch.inference_mode():
        for f in fns.values():
            f()
        for _ in range(rounds):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                t[k].append(time.perf_counter() - t0)
    return t


def weight_check_cost(checks: list, n: int = 20000) -> float:
    """Seconds per ``PackedLinear._current()`` call (its weight check alone), over about ``n`` calls."""
    t0 = time.perf_counter()
    for _ in range(n // len(checks) + 1):
        for p in checks:
            p._current()
    return (time.perf_counter() - t0) / ((n // len(checks) + 1) * len(checks))


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    model, _ = models.load_model(a.model)
    lins = [m for m in model.modules() if can_pack(m)]
    mods = packed_modules(lins, a.old)
    fns = pass_fns(lins, mods, a.rows)
    t = time_rounds(fns, a.rounds)
    print(f"{len(lins)} linears, {a.threads} thread(s), medians of {a.rounds} interleaved rounds")
    for M in a.rows:
        base = statistics.median(t[("bare op", M)])
        for k in fns:
            if k[1] == M:
                med = statistics.median(t[k])
                print(f"M={M:3d} {k[0]:18s} {med * 1e3:8.2f} ms  {med / base:5.3f}x bare op")
    checks = mods["PackedLinear"]
    per = weight_check_cost(checks)
    print(f"weight check alone: {per * 1e6:.2f} us per call, {per * len(checks) * 1e3:.3f} ms per pass")


if __name__ == "__main__":
    main()
