"""Per-forward costs of one decoding iteration on the embedded SmolLM2, without prefill.

Fills a :class:`vegas_ext.cache.VegasCache` (and, for HF, a ``DynamicCache``) with ``context``
random K/V per row, then times single forwards, interleaved and repeated, keeping the minimum
(robust to a busy shared machine):

* ``hf_step``: HF's own decode step (sdpa, DynamicCache; the appended token is cropped after),
* ``full_step``: our plain step (``verify_attention`` with Q=1; the ``"full"`` algorithm),
* ``draft_step``: one draft token over the selected budget (``sparse_draft_attention``), as the
  decode loop runs it: through the lean draft forward (``vegas_ext.draft_forward``) where it
  applies (the record's ``lean_draft`` says which),
* ``verify``: the verification of gamma+1 tokens (``verify_attention``),
* ``select``: one ``block_topk`` over all layers,
* ``draft_step_fp16`` / ``draft_step_int8`` (``--draft-weights fp16,int8``): the draft step with
  its linears on the low-precision copy (``generate(draft_weights=...)``, vegas_ext.draft_weights).

and prints the speedups the cost model predicts for a mean acceptance length ``tau`` (given or
1 + 0.8 * gamma): ``tau * full_step / (gamma * draft_step + verify + select)``. ``--profile`` adds,
per forward, where its time went (our attention ops, the linear layers, the rest; torch.profiler).

On a GPU (the end-to-end step of bench/gpu_check.sh): a random-weight model of Llama-3-8B's shape
(weights cannot travel to the GPU machine; step times do not depend on their values), bf16,
32K context, batch 8, the fixed acceptance pattern ``--tau``::

    python -m bench.decode_step_costs --model-config llama3-8b --device cuda \
        --dtype bfloat16 --contexts 32768 --batches 8 --gamma 6 --tau 5 --no-hf

Usage: ``python -m bench.decode_step_costs --contexts 2048,4096,8192 --batches 1,4 --gamma 6``
(``--block-size`` defaults to vegas's default, 1.)
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import DynamicCache

from bench.common import add_pack_linears_flag, pack_linears, sync
from vegas_ext import models
from vegas_ext.attention import AttentionState, patched
from vegas_ext.cache import VegasCache
from vegas_ext.decode import SelectionConfig, SelectionContext, VegasSelection, _cache_kwarg

#: random-weight model shapes (``--model-config``); ``tiny`` is for a smoke test
MODEL_CONFIGS = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      rope_theta=500000.0),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
}


def random_model(name: str, device: torch.device, dtype: torch.dtype):
    """A Llama-architecture ``*ForCausalLM`` of shape ``MODEL_CONFIGS[name]`` with random weights,
    built directly on ``device`` in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**MODEL_CONFIGS[name])
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


#: ops whose self time counts as the linear layers in ``--profile`` (F.linear, oneDNN's packed linear)
LINEAR_OPS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear",
              "mkldnn::_linear_pointwise", "mkl::_mkl_linear", "vegas::weight_only_linear")


#: our ops that count as "other" in ``--profile`` (RoPE and the K/V write of the lean draft forward)
NOT_ATTENTION_OPS = ("vegas::rope_kv_write", "vegas::add_rms_norm", "vegas::silu_mul")


def profile_forward(fn, dev) -> dict:
    """Runs ``fn`` once under ``torch.profiler`` (CPU): its wall time and the self time of our
    ``vegas::*`` attention ops, of :data:`LINEAR_OPS` and of the rest (wall minus both: the other
    ops, :data:`NOT_ATTENTION_OPS` included, and the Python between them), in ms. The profiler adds
    a little to each op."""
    from torch.profiler import ProfilerActivity, profile

    sync(dev)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        t0 = time.perf_counter()
        fn()
        sync(dev)
        wall = time.perf_counter() - t0
    attn = lin = 0.0
    for ev in p.key_averages():
        if ev.key in LINEAR_OPS:
            lin += ev.self_cpu_time_total
        elif ev.key.startswith("vegas::") and ev.key not in NOT_ATTENTION_OPS:
            attn += ev.self_cpu_time_total
    wall_ms, attn_ms, lin_ms = wall * 1e3, attn / 1e3, lin / 1e3
    return dict(wall=round(wall_ms, 2), attention=round(attn_ms, 2), linears=round(lin_ms, 2),
                other=round(wall_ms - attn_ms - lin_ms, 2))


def _step_profile(fn, dev, top=12) -> tuple:
    """One run of ``fn`` under torch.profiler with CPU (and, on CUDA, CUDA) activity after a warm-up
    run: ``(summary dict, top-ops Markdown lines)``. wall: perf_counter around the call and a sync;
    host_ops: the self CPU time of every op (the Python between ops is wall minus host time not
    hidden behind the device); device_busy: the sum of the device time of every op (kernels on one
    stream do not overlap), so device_busy / wall near 1 is device-bound, far below 1 host-bound."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    fn()
    sync(dev)
    with profile(activities=acts) as p:
        t0 = time.perf_counter()
        fn()
        sync(dev)
        wall = time.perf_counter() - t0
    from torch.autograd import DeviceType

    avgs = p.key_averages()
    dev_t = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    kern = [e for e in avgs if e.device_type == DeviceType.CUDA]  # kernels, memcpys, memsets
    host = [e for e in avgs if e.device_type == DeviceType.CPU]
    host_us = sum(e.self_cpu_time_total for e in host)
    dev_us = sum(dev_t(e) for e in kern)
    summ = dict(wall_ms=round(wall * 1e3, 3), host_ops_ms=round(host_us / 1e3, 3),
                device_busy_ms=round(dev_us / 1e3, 3), device_busy_over_wall=round(dev_us / 1e3 / (wall * 1e3), 3),
                device_kernels=sum(e.count for e in kern))
    lines = ["| op or kernel | calls | host self ms | device ms |", "|---|---|---|---|"]
    for e in sorted(kern, key=dev_t, reverse=True)[:top]:
        lines.append(f"| kernel `{e.key[:90]}` | {e.count} | - | {dev_t(e) / 1e3:.3f} |")
    for e in sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]:
        lines.append(f"| op `{e.key[:90]}` | {e.count} | {e.self_cpu_time_total / 1e3:.3f} | - |")
    return summ, lines


def profile_summary(model, cell, fns: dict, dws: dict, args: argparse.Namespace) -> str:
    """Markdown: torch.profiler of one plain step (``full_step``) and one draft step (``draft_step``)
    of ``cell`` -- host time vs device time and the top ops by device and by host self time."""
    out = [f"# One plain and one draft decode step under torch.profiler: {args.model_config or 'SmolLM2-135M'}, "
           f"{next(model.parameters()).dtype}, context {cell.S}, batch {cell.B}, block size {args.block_size}, "
           f"device {torch.cuda.get_device_name(cell.dev) if cell.dev.type == 'cuda' else 'cpu'}", "",
           "wall: one call incl. a final sync; host ops: self CPU time of all ops; device busy: sum of the "
           "device time of all kernels (one stream). device busy / wall near 1: device-bound; far below: "
           "host-bound (launch and Python overhead).", ""]
    with torch.inference_mode(), patched(model), cell.st.activate(), _installed(dws):
        for name in ("full_step", "draft_step"):
            summ, lines = _step_profile(fns[name], cell.dev)
            out += [f"## {name}", "", "  ".join(f"{k} {v}" for k, v in summ.items()), ""] + lines + [""]
            print(json.dumps(dict(profile_step=name, **summ)), flush=True)
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--verify-tokens", default="", metavar="Q,...",
                    help="also time the verification of each q tokens per row (verify_q<q>_ms), e.g. 2,3,4,5,6,7,8,9: "
                         "the cost table of bench/gamma_policy_sim.py --costs")
    ap.add_argument("--tau", type=float, default=None, help="mean acceptance length for the prediction")
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=VegasSelection.default_block_size)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--model-config", default=None, choices=sorted(MODEL_CONFIGS),
                    help="random-weight model of this shape instead of the embedded SmolLM2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    add_pack_linears_flag(ap)
    ap.add_argument("--draft-weights", default="",
                    help="also time the draft step with these low-precision draft linears, e.g. fp16,int8 "
                         "(draft_step_<kind>_ms; the prediction pred_speedup_vs_full_<kind>)")
    ap.add_argument("--no-hf", action="store_true", help="skip HF's own step (and its DynamicCache copy)")
    ap.add_argument("--compile-steps", action="store_true",
                    help="also time the steps as compile_steps=True runs them (*_graph: CUDA graphs on CUDA; "
                         "the backend: vegas_ext.compiled_steps.COMPILE_BACKEND, VEGAS_COMPILE_BACKEND)")
    ap.add_argument("--profile-summary", default=None, metavar="MD",
                    help="write to MD a torch.profiler summary (CPU + CUDA activity) of one plain step and "
                         "one draft step of the first cell: wall, host op time, device busy time, top ops")
    ap.add_argument("--profile", action="store_true",
                    help="after the timing, run each of our forwards 3 more times under torch.profiler and "
                         "record where the fastest one's time went (profile_ms: our attention ops, the linear "
                         "layers, the rest; other_net: the unprofiled minimum less both)")
    args = ap.parse_args(argv)
    shortest = min(int(x) for x in args.contexts.split(","))
    counts = [x.strip() for x in args.verify_tokens.split(",") if x.strip()]
    for x in counts:
        if not (x.isascii() and x.isdigit() and 1 <= int(x) <= shortest):
            ap.error(f"--verify-tokens: {x!r} is not a token count in 1..{shortest} (the shortest context)")
    args.verify_tokens = [int(x) for x in counts]  # parsed once: build_cell and main read the list
    return args


def load(args: argparse.Namespace):
    """``(model, packed, dws)``: the model of ``--model-config`` (or the embedded SmolLM2) on
    ``--device`` in ``--dtype``, the number of linears packed, and a :class:`DraftWeights` per kind
    of ``--draft-weights``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = models.parse_dtype(args.dtype)
    if args.model_config:
        model = random_model(args.model_config, device, dtype)
    else:
        model, _ = models.load_model(dtype=dtype, device=device)
    packed = pack_linears(model, args.pack_linears)
    from vegas_ext.draft_weights import DraftWeights

    dws = {k: DraftWeights(model, k) for k in args.draft_weights.split(",") if k}
    return model, packed, dws


@dataclass
class Cell:
    """One (batch, context) cell: a filled :class:`VegasCache` with its attention state and
    selection, HF's ``DynamicCache`` (None with ``--no-hf``), and the gamma+1 tokens to feed."""

    B: int
    S: int
    cache: VegasCache
    st: AttentionState
    sel: VegasSelection
    ctx: SelectionContext
    hf_cache: Optional[DynamicCache]
    tok: torch.Tensor
    pos: torch.Tensor

    @property
    def dev(self) -> torch.device:
        return self.cache.layers[0].keys.device


def build_cell(model, args: argparse.Namespace, B: int, S: int) -> Cell:
    """Fills the caches of one cell with random K/V (seeded: the same cell gets the same values)
    and selects the draft budget over random block scores (the draft tail: ``--gamma``'s)."""
    g = args.gamma
    span = max([g + 1] + args.verify_tokens)  # tokens fed at most
    torch.manual_seed(0)
    cache = VegasCache.for_model(model, B, S + span + 1)
    dev = cache.layers[0].keys.device
    for lay in cache.layers:
        lay.keys.normal_()
        lay.values.normal_()
    cache.commit(torch.full((B,), S, dtype=torch.int32, device=dev))
    st = AttentionState(cache=cache, block_size=args.block_size)
    L, H = len(cache.layers), cache.layers[0].num_heads
    nb = -(-cache.max_len // args.block_size)
    st.block_scores = torch.rand(L, B, H, nb, device=dev)
    sel = VegasSelection(SelectionConfig(args.ratio, args.min_tokens, None, args.block_size, 1, False))
    tail = torch.full((B,), S - g - 1, dtype=torch.int32, device=dev)
    st.tail_start = tail
    ctx = SelectionContext(st.block_scores, cache.lengths, tail, cache)
    st.block_indices = sel.select(ctx)
    hd = cache.layers[0].keys.shape[-1]
    hf_cache = None
    if not args.no_hf:
        hf_cache = DynamicCache(config=model.config)
        for i in range(L):
            hf_cache.update(torch.randn(B, H, S, hd, device=dev, dtype=cache.layers[0].keys.dtype),
                            torch.randn(B, H, S, hd, device=dev, dtype=cache.layers[0].keys.dtype), i)
    tok = torch.randint(0, model.config.vocab_size, (B, span), device=dev)
    pos = torch.full((B, span), S, device=dev) + torch.arange(span, device=dev)
    return Cell(B, S, cache, st, sel, ctx, hf_cache, tok, pos)


def lean_drafts(model, dws: dict) -> dict:
    """The lean draft forward per draft weights (``None``: the model's own linears) where it applies,
    as the decode loop drafts; ``{}`` for a tree without one."""
    try:  # vegas_ext.draft_forward; older trees (A/B runs, bench/ab_step_costs.py) have none
        from vegas_ext.draft_forward import lean_draft
    except ImportError:
        return {}
    leans = {dw: lean_draft(model, dw) for dw in [None, *dws.values()]}
    return {k: v for k, v in leans.items() if v is not None}


def cell_forwards(model, cell: Cell, g: int, dws: dict, leans: dict, compiled=None, verify_qs=()):
    """``(fns, ours)``: the timed forwards of ``cell`` by name (``hf_step`` only with an HF cache)
    and the names of ours, in the order they are timed; draft steps through ``leans`` where they
    hold the draft weights' lean forward; ``verify_q<q>`` for each ``q`` in ``verify_qs``."""
    ck = _cache_kwarg(model)
    B, S, dev, cache, st, tok, pos = cell.B, cell.S, cell.dev, cell.cache, cell.st, cell.tok, cell.pos

    def our(mode, q):
        st.mode = mode
        cache.begin_forward(q)
        model(input_ids=tok[:, :q], position_ids=pos[:, :q], use_cache=True, logits_to_keep=0, **{ck: cache})

    def hf_step():
        model(input_ids=tok[:, :1], position_ids=pos[:, :1], use_cache=True,
              attention_mask=torch.ones(B, S + 1, dtype=torch.long, device=dev), **{ck: cell.hf_cache})
        cell.hf_cache.crop(-1)  # drop the appended token (5.24 API; older: crop(S))

    def select():
        st.block_indices = cell.sel.select(cell.ctx)

    def draft(dw=None):  # as decode.draft runs a draft step
        lean = leans.get(dw)
        if lean is None:
            return _with(dw.active(), lambda: our("draft", 1)) if dw is not None else our("draft", 1)
        st.mode = "draft"
        cache.begin_forward(1)
        return lean(tok[:, :1], pos[:, :1], st)

    fns = {
        "hf_step": hf_step,
        "full_step": lambda: our("verify", 1),
        "draft_step": draft,
        "verify": lambda: our("verify", g + 1),
        "select": select,
    }
    for k, dw in dws.items():
        fns[f"draft_step_{k}"] = (lambda dw: lambda: draft(dw))(dw)
    ours = ["full_step", "draft_step", *[f"draft_step_{k}" for k in dws], "verify", "select"]
    for q in verify_qs:
        fns[f"verify_q{q}"] = (lambda q: lambda: our("verify", q))(q)
        ours.append(f"verify_q{q}")
    if compiled is not None:  # the same steps as compile_steps=True runs them (CUDA graphs on CUDA)
        def graph(mode, q, dw=None):
            st.mode = mode
            cache.begin_forward(q)
            lean = leans.get(dw) if mode == "draft" else None
            if lean is not None:
                return compiled.lean(lean, tok[:, :1], pos[:, :1], st)
            return compiled.forward(model, ck, tok[:, :q], pos[:, :q], 1 if mode == "draft" else 0, cache, st, dw)

        fns.update(full_step_graph=lambda: graph("verify", 1), draft_step_graph=lambda: graph("draft", 1),
                   verify_graph=lambda: graph("verify", g + 1))
        for k, dw in dws.items():
            fns[f"draft_step_{k}_graph"] = (lambda dw: lambda: _with(dw.active(), lambda: graph("draft", 1, dw)))(dw)
        ours += ["full_step_graph", "draft_step_graph", *[f"draft_step_{k}_graph" for k in dws], "verify_graph"]
    if cell.hf_cache is None:
        del fns["hf_step"]
    return fns, ours


def time_cell(model, cell: Cell, fns: dict, ours: list, dws: dict, reps: int) -> dict:
    """Best seconds of each forward in ``fns`` over ``reps`` interleaved rounds (after a warm-up
    round): ours with vegas's attention installed, then HF's step without it."""
    dev = cell.dev
    best = {k: float("inf") for k in fns}
    with torch.inference_mode():
        for rep in range(reps + 1):  # round 0 warms up (not counted)
            first = rep == 0
            with patched(model), _installed(dws):
                with cell.st.activate():
                    for k in ours:
                        sync(dev)
                        t0 = time.perf_counter()
                        fns[k]()
                        sync(dev)
                        if not first:
                            best[k] = min(best[k], time.perf_counter() - t0)
            if "hf_step" in fns:
                sync(dev)
                t0 = time.perf_counter()
                fns["hf_step"]()
                sync(dev)
                if not first:
                    best["hf_step"] = min(best["hf_step"], time.perf_counter() - t0)
    return best


def profile_cell(model, cell: Cell, fns: dict, ours: list, dws: dict, best: dict) -> dict:
    """:func:`profile_forward` of each of our forwards but the selection, the fastest of 3 runs (a
    shared machine), with ``other_net``: the unprofiled best time less attention and linears (the
    rest without the profiler's own cost per op)."""
    with torch.inference_mode(), patched(model), cell.st.activate(), _installed(dws):
        prof = {k: min((profile_forward(fns[k], cell.dev) for _ in range(3)), key=lambda p: p["wall"])
                for k in ours if k != "select"}
    for k, p in prof.items():
        p["other_net"] = round(1e3 * best[k] - p["attention"] - p["linears"], 2)
    return prof


def cell_record(args: argparse.Namespace, model, packed: int, dws: dict, cell: Cell, best: dict) -> dict:
    """The JSON record of one cell: its configuration, the best times (``<forward>_ms``) and the
    cost model's predictions (see the module docstring)."""
    g, dev = args.gamma, cell.dev
    B, S = cell.B, cell.S
    tau = args.tau if args.tau is not None else 1 + 0.8 * g
    it = g * best["draft_step"] + best["verify"] + best["select"]
    hf = best.get("hf_step")
    return dict(
        model=args.model_config or "embedded SmolLM2-135M", device=str(dev),
        device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        cuda_kernels=os.environ.get("VEGAS_CUDA_KERNELS", "1") != "0" if dev.type == "cuda" else None,
        context=S, batch=B, gamma=g, tau=tau, block_size=args.block_size, ratio=args.ratio,
        min_tokens=args.min_tokens, threads=torch.get_num_threads(), dtype=str(next(model.parameters()).dtype),
        packed_linears=packed,
        **{f"{k}_ms": round(v * 1e3, 2) for k, v in best.items()},
        hf_tok_s=round(B / hf, 2) if hf else None, full_tok_s=round(B / best["full_step"], 2),
        vegas_iteration_ms=round(1e3 * it, 2), full_iteration_ms_same_tokens=round(1e3 * tau * best["full_step"], 2),
        vegas_tok_s_pred=round(B * tau / it, 2),
        pred_speedup_vs_full=round(tau * best["full_step"] / it, 2),
        pred_speedup_vs_hf=round(tau * hf / it, 2) if hf else None,
        **{f"pred_speedup_vs_full_{k}": round(tau * best["full_step"] / (
            g * best[f"draft_step_{k}"] + best["verify"] + best["select"]), 2) for k in dws},
        **{f"draft_weights_{k}_mb": round(dw.nbytes / 1e6, 1) for k, dw in dws.items()},
        **_graph_predictions(best, g, tau, dws),
    )


def _graph_predictions(best: dict, g: int, tau: float, dws: dict) -> dict:
    """With ``--compile-steps``: the predicted speed-up of compiled Vegas over the compiled plain
    loop and over the eager plain loop, per draft weights (``""``: the model's own)."""
    if "full_step_graph" not in best:
        return {}
    out = {}
    for k in ["", *dws]:
        d = best[f"draft_step_{k}_graph" if k else "draft_step_graph"]
        it = g * d + best["verify_graph"] + best["select"]
        sfx = f"_{k}" if k else ""
        out[f"graph_pred_speedup_vs_full_graph{sfx}"] = round(tau * best["full_step_graph"] / it, 2)
        out[f"graph_pred_speedup_vs_full{sfx}"] = round(tau * best["full_step"] / it, 2)
    return out


def main(argv=None):
    args = parse_args(argv)
    model, packed, dws = load(args)
    leans = lean_drafts(model, dws)
    out_f = open(args.out, "a") if args.out else None
    for B in [int(x) for x in args.batches.split(",")]:
        for S in [int(x) for x in args.contexts.split(",")]:
            cell = build_cell(model, args, B, S)
            compiled = _compiled(cell.dev) if args.compile_steps else None
            fns, ours = cell_forwards(model, cell, args.gamma, dws, leans, compiled, args.verify_tokens)
            best = time_cell(model, cell, fns, ours, dws, args.reps)
            prof = profile_cell(model, cell, fns, ours, dws, best) if args.profile else None
            if args.profile_summary:
                with open(args.profile_summary, "w") as f:
                    f.write(profile_summary(model, cell, fns, dws, args))
                args.profile_summary = None  # the first cell only
            rec = dict(cell_record(args, model, packed, dws, cell, best), lean_draft=bool(leans))
            if prof:
                rec["profile_ms"] = prof
            print(json.dumps(rec), flush=True)
            if out_f:
                out_f.write(json.dumps(rec) + "\n")
                out_f.flush()
            del cell, fns


def _compiled(dev):
    from vegas_ext.compiled_steps import compiled_steps  # not in older trees (A/B runs)

    return compiled_steps(dev)


def _with(ctx, fn):
    with ctx:
        return fn()


def _installed(dws):
    """The draft-weights wrappers on the model's linears (one install serves every kind: the
    wrapper asks whichever :class:`DraftWeights` is active)."""
    import contextlib

    return next(iter(dws.values())).installed() if dws else contextlib.nullcontext()


if __name__ == "__main__":
    main()
