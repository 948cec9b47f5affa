"""vegas::weight_only_linear against the machine's read bandwidth, on SmolLM2-135M's linear shapes.

Per row count (1, 4, 8, 16), one round times every linear of a decoding step (30 layers x
q/k/v/o/gate/up/down + the output layer) with: fp32 ``F.linear`` (the plain step's linears),
fp16 and bf16 ``F.linear`` (PyTorch's own low-precision CPU path) and the kernel on fp16 and int8
(groups of 64) weights, int8 both row-major and packed (``pack_int8``, what the draft copies hold);
rounds interleave the variants, medians are reported. GB/s = weight bytes read / time; the read
bandwidth is a 512 MB fp32 ``sum`` at the same thread count (``--threads 1 2``: a run each).
``--torchao`` adds torchao's CPU weight-only int8 (``Int8WeightOnlyConfig``, per output channel)
eager and under ``torch.compile`` (the well-kept alternatives issue 33 asked to try first; torchao
is not a dependency: install it to run these).

    python -m bench.bench_weight_only_linear --threads 1 2 --out bench/results/draft_weights_zen4/kernel.json
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import vegas_ext.ops  # noqa: F401  (registers torch.ops.vegas.*)
from vegas_ext.draft_weights import INT8_GROUP_SIZE, pack_int8, quantize_int8

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [(49152, 576)]


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1], help="thread counts, one run each")
    ap.add_argument("--out", default=None)
    ap.add_argument("--torchao", action="store_true", help="add torchao's int8 weight-only linears (eager, compiled)")
    return ap.parse_args(argv)


def read_bandwidth_gbs() -> float:
    """GB/s of the median of 5 ``sum``s over 512 MB of random fp32 (the machine's read bandwidth)."""
    big = torch.randn(128 * 1024 * 1024)
    bw = statistics.median(timed(big.sum) for _ in range(5))
    return big.numel() * 4 / bw / 1e9


def step_weights():
    """``(weights, bytes_of)``: the :data:`SHAPES` weights as fp32, fp16, bf16, int8 and packed int8
    (``{"fp32": [...], "fp16": ..., "bf16": ..., "int8": [(q, scales), ...], "int8 packed": ...}``)
    and the bytes each variant reads (packed: as row-major, its padding left out)."""
    ws = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    n_w = sum(w.numel() for w in ws)
    q8 = [quantize_int8(w, INT8_GROUP_SIZE) for w in ws]
    weights = {"fp32": ws, "fp16": [w.half() for w in ws], "bf16": [w.bfloat16() for w in ws], "int8": q8,
               "int8 packed": [(pack_int8(q), s) for q, s in q8]}
    n_int8 = sum(q.numel() + 4 * s.numel() for q, s in q8)
    bytes_of = {"fp32 F.linear": 4 * n_w, "fp16 F.linear": 2 * n_w, "bf16 F.linear": 2 * n_w,
                "kernel fp16": 2 * n_w, "kernel int8": n_int8, "kernel int8 packed": n_int8}
    return weights, bytes_of


def step_fns(weights: dict, M: int) -> dict:
    """Variant name -> one pass over every weight at ``M`` random rows (see the module docstring)."""
    ws, w16, wbf, q8, p8 = weights["fp32"], weights["fp16"], weights["bf16"], weights["int8"], weights["int8 packed"]
    op = torch.ops.vegas.weight_only_linear.default
    xs = [torch.randn(M, w.shape[1]) for w in ws]
    xh = [x.half() for x in xs]
    xb = [x.bfloat16() for x in xs]
    return {
        "fp32 F.linear": lambda: [F.linear(x, w) for x, w in zip(xs, ws)],
        "fp16 F.linear": lambda: [F.linear(x, w) for x, w in zip(xh, w16)],
        "bf16 F.linear": lambda: [F.linear(x, w) for x, w in zip(xb, wbf)],
        "kernel fp16": lambda: [op(x, w, None, None, 64) for x, w in zip(xs, w16)],
        "kernel int8": lambda: [op(x, q, s, None, INT8_GROUP_SIZE) for x, (q, s) in zip(xs, q8)],
        "kernel int8 packed": lambda: [op(x, q, s, None, INT8_GROUP_SIZE) for x, (q, s) in zip(xs, p8)],
    }


def torchao_fns(weights: dict, M: int, bytes_of: dict) -> dict:
    """torchao's int8 weight-only linears over the same weights at ``M`` rows: eager and compiled."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    mods = torch.nn.ModuleList(torch.nn.Linear(w.shape[1], w.shape[0], bias=False) for w in weights["fp32"])
    with torch.no_grad():
        for m, w in zip(mods, weights["fp32"]):
            m.weight.copy_(w)
    quantize_(mods, Int8WeightOnlyConfig(), filter_fn=lambda m, _: isinstance(m, torch.nn.Linear))
    xs = [torch.randn(M, w.shape[1]) for w in weights["fp32"]]

    def step():
        return [m(x) for m, x in zip(mods, xs)]

    n_bytes = sum(w.numel() + 4 * w.shape[0] for w in weights["fp32"])
    bytes_of["torchao int8"] = bytes_of["torchao int8 compiled"] = n_bytes
    return {"torchao int8": step, "torchao int8 compiled": torch.compile(step)}


def time_rounds(fns: dict, rounds: int) -> dict:
    """Seconds of each fn in each of ``rounds`` interleaved rounds, after one warm-up call each."""
    times = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm-up
    for _ in range(rounds):
        for k, f in fns.items():
            times[k].append(timed(f))
    return times


def run_threads(args, threads: int, weights: dict, bytes_of: dict) -> dict:
    """``{"threads", "read_bandwidth_gbs", "rows": {M: {variant: {"ms", "gbs", "of_read_bw"}}}}`` at
    ``threads`` threads, printing a line per row count."""
    torch.set_num_threads(threads)
    read_gbs = read_bandwidth_gbs()
    res = {"threads": threads, "read_bandwidth_gbs": read_gbs, "rows": {}}
    print(f"read bandwidth (512 MB fp32 sum, {threads} thread(s)): {read_gbs:.1f} GB/s")
    for M in args.rows:
        fns = step_fns(weights, M)
        if args.torchao:
            with torch.no_grad():
                fns.update(torchao_fns(weights, M, bytes_of))
        with torch.no_grad():
            times = time_rounds(fns, args.rounds)
        row = {}
        for k, ts in times.items():
            t = statistics.median(ts)
            gbs = bytes_of[k] / t / 1e9
            row[k] = {"ms": t * 1e3, "gbs": gbs, "of_read_bw": gbs / read_gbs}
        res["rows"][M] = row
        print(f"rows {M:2d}: " + "  ".join(f"{k} {v['ms']:.1f} ms {v['gbs']:.1f} GB/s ({v['of_read_bw']:.0%})"
                                          for k, v in row.items()))
    return res


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(0)
    weights, bytes_of = step_weights()
    n_w = sum(w.numel() for w in weights["fp32"])
    print(f"{n_w / 1e6:.0f} M weights")
    res = {"weights": n_w, "runs": [run_threads(args, t, weights, bytes_of) for t in args.threads]}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
