"""A CPU attention kernel between a model's linears, as it runs inside a forward.

Times ``paged_verify_attention`` (one verification of γ + 1 queries per request over vLLM's
CPU_ATTN page layout, SmolLM2-135M's shapes: 9 query / 3 KV heads, D 64, 32-token pages) for
``--layers`` layers in a row, alone and with each layer's linears (SmolLM2's q/k/v, o, gate/up
and down projections, fp32, through ``torch.nn.functional.linear``) before it. "In context" is
(linears + attention) - (linears alone), per layer: what the attention adds to a forward. Torch's
linears run on ATen's OpenMP threads, which keep spinning for a while after each op; a kernel
whose own threads must wait for those cores pays for it here and not in a timing of the kernel
alone. Alternating rounds, medians of ``--repeats``; run the script once per build to compare.

    python -m bench.attention_in_forward --contexts 2048 8000 --batches 1 4 16
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from vegas_ext import ops
from vegas_ext.vllm.cpu_layout import key_cache_view, value_cache_view

HQ, HKV, D, PAGE = 9, 3, 64, 32
LINEARS = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M: qkv, o, gate+up, down


def _views(kv):
    """Keys ``[D, page]`` then values ``[page, D]`` per (page, KV head), as vLLM's CPU_ATTN."""
    return key_cache_view(kv), value_cache_view(kv)


def cell(ctx: int, batch: int, queries: int, layers: int, repeats: int) -> dict:
    """Median ms: ``linears`` (all layers), ``alone`` and ``in_context`` (per layer)."""
    g = torch.Generator().manual_seed(0)
    pages = -(-ctx // PAGE)
    nb = batch * pages + 1
    caches = [_views(torch.randn(nb, HKV, PAGE, 2 * D, generator=g)) for _ in range(layers)]
    weights = [[torch.randn(o, i, generator=g) for o, i in LINEARS] for _ in range(layers)]
    bt = torch.randperm(nb - 1, generator=g)[: batch * pages].view(batch, pages).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(0, (batch + 1) * queries, queries, dtype=torch.int32)
    q = torch.randn(batch * queries, HQ, D, generator=g)
    x, x_mlp = torch.randn(batch * queries, 576, generator=g), torch.randn(batch * queries, 1536, generator=g)

    def layer(i, linears, attention):
        if linears:
            for w in weights[i][:3]:
                torch.nn.functional.linear(x, w)
            torch.nn.functional.linear(x_mlp, weights[i][3])
        if attention:
            ops.paged_verify_attention(q, *caches[i], bt, lens, qsl, queries, D ** -0.5)

    ways = {"linears": (True, False), "alone": (False, True), "both": (True, True)}
    times = {k: [] for k in ways}
    for _ in range(repeats):
        for name, (lin, att) in ways.items():
            t = time.perf_counter()
            for i in range(layers):
                layer(i, lin, att)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"linears": med["linears"], "alone": med["alone"] / layers,
            "in_context": (med["both"] - med["linears"]) / layers}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", nargs="+", type=int, default=[2048, 8000], help="tokens per request")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16], help="requests")
    p.add_argument("--gamma", type=int, default=6, help="drafts verified per request (γ + 1 queries)")
    p.add_argument("--layers", type=int, default=30, help="layers in a row, each with its own cache")
    p.add_argument("--repeats", type=int, default=9, help="rounds (medians)")
    args = p.parse_args(argv)
    if min(args.contexts + args.batches) < 1 or args.gamma < 0 or args.layers < 1 or args.repeats < 1:
        p.error("--contexts, --batches, --layers and --repeats must be >= 1, --gamma >= 0")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"{torch.get_num_threads()} threads, {args.layers} layers, γ + 1 = {args.gamma + 1} queries, "
          f"medians of {args.repeats}\n")
    print("| context | batch | linears ms (all layers) | attention alone ms/layer | in context ms/layer |")
    print("|---:|---:|---:|---:|---:|")
    for ctx in args.contexts:
        for b in args.batches:
            r = cell(ctx, b, args.gamma + 1, args.layers, args.repeats)
            print(f"| {ctx} | {b} | {r['linears']:.1f} | {r['alone']:.3f} | {r['in_context']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
