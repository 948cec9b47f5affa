"""A model's linears per decoding step: ``F.linear`` against oneDNN-packed weights (vegas_ext.pack_linear_weights).

One "step" multiplies M rows (batch x tokens: M = batch for a plain or draft step, batch x
(gamma + 1) for a verification pass) by every linear weight of the model, lm_head included,
as a decoding forward does. Both ways are timed interleaved in one run, medians over rounds,
against the machine's own limit measured in the same run: a read-only stream over a tensor the
size of the weights (``sum``), i.e. the time a step would take if it only had to read each weight
once at that rate. Also checks whether the packed results are the same bits for every M (row i of
an M-row product against row i of the largest).

    python -m bench.bench_packed_linears --threads 1 --rows 1 2 4 8 12 16 20 24 28 36 \
        --out bench/results/tmp/smollm2

``--mkl`` adds MKL's packed sgemm (``torch.ops.mkl._mkl_linear``) as a third way.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import command_line, run_metadata, time_fns, write_rows
from vegas_ext import models
from vegas_ext.packed_linear import can_pack


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.bench_packed_linears", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 20, 24, 28, 36],
                    help="M values: rows per step (default 1 2 4 8 12 16 20 24 28 36)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mkl", action="store_true",
                    help="also time MKL's packed sgemm (torch.ops.mkl._mkl_linear); its weights are packed for "
                         "one row count, so every --rows value holds one more copy of them")
    ap.add_argument("--out", default=None, help="write OUT.jsonl and OUT.md")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.threads < 1 or min(a.rows) < 1:
        ap.error("--rounds, --threads and every --rows value must be >= 1")
    return ap, a


def step_fn(W, P, M, way):
    """One step's products of M random rows by every weight: ``way`` is "F.linear", "packed" or "mkl"."""
    xs = {}
    for w in W:
        xs.setdefault(w.shape[1], torch.randn(M, w.shape[1]))
    if way == "mkl":
        PM = [torch.ops.mkl._mkl_reorder_linear_weight(w, M) for w in W]
        return lambda: [torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, M) for w, p in zip(W, PM)]
    if way == "packed":
        return lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                        for w, p in zip(W, P)]
    return lambda: [F.linear(xs[w.shape[1]], w) for w in W]


def same_bits_across_rows(W, P, rows):
    """Per M: whether each packed product of M rows equals the first M rows of the largest M's product."""
    Mx = max(rows)
    xs = [torch.randn(Mx, w.shape[1]) for w in W]
    fulls = [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for x, p in zip(xs, P)]
    def packed(x, p):
        return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    return {M: all(torch.equal(full[:M], packed(x[:M].contiguous(), p)) for x, p, full in zip(xs, P, fulls))
            for M in rows}


def markdown(rows, meta, a, nbytes, n_lin, read_ms) -> str:
    read_gbs = meta["read_gbs"]
    lines = ["# Linears per decoding step: F.linear vs oneDNN-packed weights", "",
             f"{meta['device_name']}, {a.threads} thread(s), torch {meta['torch']}, commit {meta['commit']}, "
             f"{meta['model']}: {n_lin} linears (lm_head included), {nbytes / 1e6:.0f} MB fp32; medians of "
             f"{a.rounds} interleaved rounds. Read stream over {nbytes / 1e6:.0f} MB in the same run: "
             f"{read_gbs:.1f} GB/s ({read_ms:.1f} ms).", "",
             "| M (rows) | F.linear ms | packed ms | speedup | F.linear GB/s of weights | packed GB/s | "
             "packed / read stream | packed rows = rows of M " + str(max(a.rows)) + " |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['rows']} | {r['flinear_ms']} | {r['packed_ms']} | {r['speedup']:.2f}x | "
                     f"{r['flinear_gbs']} | {r['packed_gbs']} | {r['packed_gbs'] / read_gbs:.2f} | "
                     f"{'yes' if r['packed_same_bits_as_largest_m'] else 'no'} |")
    if a.mkl:
        lines += ["", "MKL's packed sgemm (weights packed for each row count) in the same rounds:", "",
                  "| M (rows) | MKL packed ms | oneDNN packed ms | F.linear ms | MKL GFLOP/s | oneDNN GFLOP/s |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['rows']} | {r['mkl_ms']} | {r['packed_ms']} | {r['flinear_ms']} | {r['mkl_gflops']} | "
                         f"{r['packed_gflops']} |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap, a = parse_args(argv)
    torch.set_num_threads(a.threads)
    model, _ = models.load_model(a.model)
    lins = [m for m in model.modules() if can_pack(m)]  # modules() yields a shared module once
    if not lins:
        ap.error("no fp32 CPU nn.Linear in the model (or PyTorch without oneDNN)")
    W = [m.weight.detach() for m in lins]
    P = [torch.ops.mkldnn._reorder_linear_weight(w) for w in W]
    nbytes = sum(w.numel() * 4 for w in W)
    big = torch.ones(nbytes // 4)
    fns = {("read", 0): lambda: big.sum()}
    for M in a.rows:
        for way in ("F.linear", "packed") + (("mkl",) if a.mkl else ()):
            fns[(way, M)] = step_fn(W, P, M, way)
    with torch.inference_mode():
        med = time_fns(fns, repeats=a.rounds, warmup=1)
        invariant = same_bits_across_rows(W, P, a.rows)
    read_gbs = nbytes / med[("read", 0)] / 1e9
    meta = run_metadata("cpu")
    meta.update(threads=a.threads, model=a.model or "embedded SmolLM2-135M", linears=len(W),
                weight_mb=round(nbytes / 1e6, 1), rounds=a.rounds, read_gbs=round(read_gbs, 2))
    rows = []
    for M in a.rows:
        fl, pk = med[("F.linear", M)], med[("packed", M)]
        flops = sum(2 * M * w.numel() for w in W)
        rows.append(dict(meta, rows=M, flinear_ms=round(fl * 1e3, 2), packed_ms=round(pk * 1e3, 2),
                         speedup=round(fl / pk, 3), flinear_gbs=round(nbytes / fl / 1e9, 2),
                         packed_gbs=round(nbytes / pk / 1e9, 2), flinear_gflops=round(flops / fl / 1e9, 1),
                         packed_gflops=round(flops / pk / 1e9, 1), packed_same_bits_as_largest_m=invariant[M]))
        if a.mkl:
            mk = med[("mkl", M)]
            rows[-1].update(mkl_ms=round(mk * 1e3, 2), mkl_gflops=round(flops / mk / 1e9, 1))
    md = markdown(rows, meta, a, nbytes, len(W), med[("read", 0)] * 1e3)
    print(md)
    if a.out:
        write_rows(Path(a.out + ".jsonl"), rows)
        Path(a.out + ".md").write_text(f"Command: `{command_line('bench_packed_linears', argv)}`\n\n{md}\n")


if __name__ == "__main__":
    main()
