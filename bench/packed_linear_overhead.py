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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 12])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--old", default=None, help="another packed_linear.py whose PackedLinear to time too")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, _ = models.load_model(a.model)
    lins = [m for m in model.modules() if can_pack(m)]
    mods = {"PackedLinear": [PackedLinear(m) for m in lins]}
    if a.old:
        spec = importlib.util.spec_from_file_location("old_packed_linear", a.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        # copies: the old module's data_ptr() key would un-mark the shared weights' copy-on-write storage
        mods["old PackedLinear"] = [old.PackedLinear(copy.deepcopy(m)) for m in lins]
    packed = [p._current() for p in mods["PackedLinear"]]
    fns = {}
    for M in a.rows:
        xs = {}
        for m in lins:
            xs.setdefault(m.in_features, torch.randn(M, m.in_features))
        fns[("bare op", M)] = (lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(
            xs[m.in_features], p, m.bias, "none", [], "") for m, p in zip(lins, packed)])
        for name, ms in mods.items():
            fns[(name, M)] = (lambda xs=xs, ms=ms: [p(xs[p.in_features]) for p in ms])
        fns[("F.linear", M)] = (lambda xs=xs: [F.linear(xs[m.in_features], m.weight, m.bias) for m in lins])
    t = {k: [] for k in fns}
    with torch.inference_mode():
        for f in fns.values():
            f()
        for _ in range(a.rounds):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                t[k].append(time.perf_counter() - t0)
    print(f"{len(lins)} linears, {a.threads} thread(s), medians of {a.rounds} interleaved rounds")
    for M in a.rows:
        base = statistics.median(t[("bare op", M)])
        for k in fns:
            if k[1] == M:
                med = statistics.median(t[k])
                print(f"M={M:3d} {k[0]:18s} {med * 1e3:8.2f} ms  {med / base:5.3f}x bare op")
    checks = mods["PackedLinear"]
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n // len(checks) + 1):
        for p in checks:
            p._current()
    per = (time.perf_counter() - t0) / ((n // len(checks) + 1) * len(checks))
    print(f"weight check alone: {per * 1e6:.2f} us per call, {per * len(checks) * 1e3:.3f} ms per pass")


if __name__ == "__main__":
    main()
