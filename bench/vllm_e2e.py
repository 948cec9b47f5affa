"""End-to-end vLLM decoding: no speculation, ngram, and Vegas / StreamingLLM drafting through the
vegas_ext plugin, on the embedded SmolLM2-135M, at several contexts x batch sizes.

Run in the vLLM venv (scripts/test_vllm.sh makes one):

    python -m bench.vllm_e2e --contexts 2048 4096 8128 --batches 1 4 16 --new-tokens 64 \
        --out bench/results/tmp/vllm_e2e

One engine per method, each in its own process (the stock methods with the plugin filtered out of
every vLLM process, ``VLLM_PLUGINS=""``), all methods in one invocation, one after the other.
``--verify-cost`` instead times one verification's attention per layer (SmolLM2's shapes, γ + 1
queries per request, vLLM's CPU_ATTN cache of ``--block-size`` pages, ``--layers`` distinct caches
cycled so that the keys come from memory as in a forward): vLLM's own kernel
(``cpu_attention_with_kv_cache``), that kernel plus ``paged_block_scores`` (the plugin before
issue 32), and ``paged_verify_attention`` (output and scores in one pass) with page scores and
with the per-token scores token drafts select from (``score_block_size=1``), alternating, medians.

Per (context, batch) cell: B prompts of ``context`` tokens of real text (``--document``, *Pride
and Prejudice* by default: windows at different offsets, or with ``--prompt-style summarize``
bench/e2e.py's prompts: a part of it and its summary instruction in the chat template), first
generated with ``max_tokens=1`` so that the prompts sit in vLLM's
prefix cache, then again with ``max_tokens=new_tokens`` (greedy, EOS ignored), timed: output
tokens / s of that second call is (almost) pure decoding. Mean acceptance length = 1 + accepted /
drafts from ``LLM.get_metrics()`` over that call. ``decode_tokens_per_s`` leaves out the prefill
step (output tokens after each request's first, over the span from the batch's first first token to
its last token, vLLM's request timestamps). For the drafting methods the proposer's counters
(``VEGAS_VLLM_STATS_DIR``, read before and after the call) give ``drafter``: tokens read per draft
token and layer, their share of a dense draft's, and with ``vegas_auto`` the γ decisions and the
cost model's step times. Output: ``runs.jsonl`` (one line per cell and method), ``summary.md``
(the tables), ``config.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from bench.common import commit_label

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# "vegas" / "streamingllm": every request drafts γ; "vegas_auto": each request 0..γ (gamma_policy "auto");
# "*_token": draft_granularity "token" (selected tokens per KV head instead of whole pages), γ fixed;
# the drafts' linears follow --draft-weights. (The two-pass verification and in-place token drafts of
# earlier A/B runs: measure against an older commit.)
METHODS = ("none", "ngram", "vegas", "streamingllm", "vegas_auto", "vegas_token", "streamingllm_token")
DEFAULT_METHODS = ["none", "ngram", "vegas", "streamingllm", "vegas_auto"]


def spec_for(method, gamma, ratio, min_tokens, draft_weights="int8"):
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": gamma, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    from vegas_ext.vllm import speculative_config

    auto = method == "vegas_auto"
    token = "_token" in method
    algo = "streamingllm" if method.startswith("streamingllm") else "vegas"
    spec = speculative_config(num_speculative_tokens=gamma, sparse_attn_algorithm=algo,
                              sparse_attn_ratio=ratio, sparse_attn_min_tokens=min_tokens,
                              draft_granularity="token" if token else "page",
                              draft_weights=None if draft_weights == "model" else draft_weights,
                              gamma_policy="auto" if auto else "fixed")
    return spec


def _counters(llm):
    out = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                      "vllm:spec_decode_num_draft_tokens"):
            out[m.name] = m.value
    return out


def _proposer_stats(stats_dir):
    """Rank 0's proposer counters (``VEGAS_VLLM_STATS_DIR``), or ``{}``."""
    path = os.path.join(stats_dir or "", "stats-rank0.json")
    if not stats_dir or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _draft_reads(before, after, num_layers, page_size):
    """What the cell's drafts read, from the proposer counters before and after it: tokens read per
    draft token and layer (``tokens_read_per_draft``), the share of a dense draft's reads
    (``read_share``), the γ decisions (``gamma_histogram``) and plain steps where the best allocation
    would have drafted for some request (``vetoed_steps``)."""
    d = {k: after[k] - before.get(k, 0) for k, v in after.items() if isinstance(v, int) and not isinstance(v, bool)}
    out = {"draft_tokens": d.get("draft_tokens", 0)}
    if "tokens_read" in d:  # token granularity
        read, dense = d["tokens_read"], d["tokens_dense"]
    else:
        read, dense = d.get("pages_read", 0) * page_size, d.get("pages_dense", 0) * page_size
    if out["draft_tokens"]:
        out["tokens_read_per_draft"] = read / (out["draft_tokens"] * num_layers)
        out["read_share"] = read / dense if dense else None
    if "gamma_histogram" in after:
        h0 = before.get("gamma_histogram") or [0] * len(after["gamma_histogram"])
        out["gamma_histogram"] = [a - b for a, b in zip(after["gamma_histogram"], h0)]
        out["vetoed_steps"] = after.get("vetoed_steps", 0) - before.get("vetoed_steps", 0)
        out.update((k, v) for k, v in after.items() if k.startswith("cost_t_"))  # the cost model at the end
    return out


def _decode_rate(outs):
    """Output tokens after each request's first, per second from the batch's first first token to
    its last token (vLLM's engine-core timestamps; ``None`` without request stats): the decoding
    rate without the prefill step."""
    stats = [o.metrics for o in outs]
    if not stats or any(s is None or not getattr(s, "last_token_ts", 0) for s in stats):
        return None
    span = max(s.last_token_ts for s in stats) - min(s.first_token_ts for s in stats)
    n = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return n / span if span > 0 else None


def prompt_maker(tok, document: str, style: str):
    """``cell_prompts(ctx, B)``: ``B`` prompts of exactly ``ctx`` token ids from ``document`` (a
    name or a text file, as in :func:`bench.e2e.document_text`). ``style="text"``: windows of the
    document's tokens (tokenized once, here) at offsets ``i * 7919`` (mod the room left).
    ``style="summarize"``: :func:`bench.e2e.build_batch`'s prompts (row ``i`` from ``i / B`` into
    the document, then its summary instruction, in the chat template), the prompts of our own
    loop's harness. ``cell_prompts`` raises ``ValueError`` naming ``--document`` if the document
    is too short."""
    from bench.e2e import build_batch, document_text

    if style == "summarize":
        return lambda ctx, B: build_batch(tok, document, ctx, B, chat=True)[0].tolist()
    ids = tok(document_text(document)[0])["input_ids"]

    def cell_prompts(ctx: int, B: int):
        if len(ids) <= ctx:
            raise ValueError(f"--document {document!r} has {len(ids)} tokens; a {ctx}-token prompt needs more")
        return [ids[(i * 7919) % (len(ids) - ctx):][:ctx] for i in range(B)]

    return cell_prompts


def worker(args):
    """One engine, all cells; prints one JSON line per cell to args.worker_out."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vegas_ext.models import convert_gguf, default_model_path

    model = args.model or convert_gguf(default_model_path())
    tok = AutoTokenizer.from_pretrained(model)
    cell_prompts = prompt_maker(tok, args.document, args.prompt_style)
    spec = spec_for(args.method, args.gamma, args.ratio, args.min_tokens, args.draft_weights)
    t0 = time.perf_counter()
    # γ + 1 positions of headroom: vLLM's runner skips the drafter for the whole batch (ngram included)
    # once its longest request is within γ of max_model_len, and then verifies γ token-0 drafts
    # per request, which would measure that cut-off instead of the method near the end of a cell.
    llm = LLM(model=model, dtype=args.dtype, enforce_eager=True, block_size=args.block_size, seed=0,
              max_model_len=max(args.contexts) + args.new_tokens + args.gamma + 1, enable_prefix_caching=True,
              disable_log_stats=False, speculative_config=spec, max_num_seqs=max(args.batches))
    init_s = time.perf_counter() - t0
    stats_dir = os.environ.get("VEGAS_VLLM_STATS_DIR")
    num_layers = llm.llm_engine.model_config.get_num_layers(llm.llm_engine.vllm_config.parallel_config)
    with open(args.worker_out, "a") as f:
        for ctx in args.contexts:
            for B in args.batches:
                prompts = [{"prompt_token_ids": p} for p in cell_prompts(ctx, B)]
                llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
                c0, s0 = _counters(llm), _proposer_stats(stats_dir)
                sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
                t = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                dt = time.perf_counter() - t
                c1, s1 = _counters(llm), _proposer_stats(stats_dir)
                n_out = sum(len(o.outputs[0].token_ids) for o in outs)
                d = {k: c1.get(k, 0) - c0.get(k, 0) for k in c1}
                drafts = d.get("vllm:spec_decode_num_drafts", 0)
                row = {"method": args.method, "context": ctx, "batch": B, "new_tokens": args.new_tokens,
                       "seconds": dt, "output_tokens": n_out, "tokens_per_s": n_out / dt,
                       "decode_tokens_per_s": _decode_rate(outs),
                       "num_drafts": drafts, "num_accepted": d.get("vllm:spec_decode_num_accepted_tokens", 0),
                       "mean_acceptance_length": (1 + d["vllm:spec_decode_num_accepted_tokens"] / drafts)
                       if drafts else None,
                       "init_s": init_s, "drafter": _draft_reads(s0, s1, num_layers, args.block_size) if s1 else None,
                       "tokens": [list(o.outputs[0].token_ids) for o in outs]}
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(f"{args.method:>12} ctx {ctx:>5} B {B:>2}: {row['tokens_per_s']:7.2f} tok/s"
                      + (f"  MAL {row['mean_acceptance_length']:.2f}" if drafts else ""), flush=True)


def _verify_cost_cell(ctx, B, args, g):
    """Median ms per layer of the four ways (see verify_cost) for one (context, batch) cell."""
    import statistics

    import torch
    from vllm import _custom_ops as vops

    from vegas_ext import ops
    from vegas_ext.vllm.cpu_layout import key_cache_view, value_cache_view

    Hq, Hkv, D, ps, nq = 9, 3, 64, args.block_size, args.gamma + 1
    scale = D ** -0.5
    pages = -(-ctx // ps)
    NB = B * pages + 1
    caches = [torch.randn(NB, Hkv, ps, 2 * D, generator=g) for _ in range(args.layers)]
    bt = (torch.randperm(NB - 1, generator=g)[: B * pages].view(B, pages)).int()
    lens = torch.full((B,), ctx, dtype=torch.int32)
    qsl = torch.arange(0, (B + 1) * nq, nq, dtype=torch.int32)
    q = torch.randn(B * nq, Hq, D, generator=g)
    out = torch.empty_like(q)
    meta = vops.cpu_attn_get_scheduler_metadata(B, Hq, Hkv, D, lens, torch.float32, qsl, True, -1, "vec", True)

    def stock(kv):
        kc, vc = kv.view(NB, Hkv, 2 * ps, D).chunk(2, dim=2)
        vops.cpu_attention_with_kv_cache(q, kc, vc, out, qsl, lens, scale, True, None, -1, bt, 0.0, meta, None)

    def two_pass(kv):
        stock(kv)
        ops.paged_block_scores(q, key_cache_view(kv), bt, lens, qsl, nq, scale)

    def one_pass(kv, score_block_size=None):
        o, _ = ops.paged_verify_attention(q, key_cache_view(kv), value_cache_view(kv), bt, lens, qsl, nq, scale,
                                          score_block_size)
        out.copy_(o)

    fns = {"vllm": stock, "vllm+paged_block_scores": two_pass, "paged_verify_attention": one_pass,
           "paged_verify_attention (token scores)": lambda kv: one_pass(kv, 1)}
    times = {k: [] for k in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            for kv in caches:
                fn(kv)
            times[name].append((time.perf_counter() - t) / len(caches))
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def verify_cost(args):
    """Attention of one verification per layer, four ways (see the module docstring); prints and
    writes ``verify_cost.jsonl`` / ``verify_cost.md`` under ``args.out``."""
    import torch

    rows = []
    g = torch.Generator().manual_seed(0)
    for ctx in args.contexts:
        for B in args.batches:
            med = _verify_cost_cell(ctx, B, args, g)
            rows.append({"context": ctx, "batch": B, "queries": args.gamma + 1, "block_size": args.block_size,
                         "threads": torch.get_num_threads(), "ms_per_layer": med})
            print(f"ctx {ctx:>5} B {B:>2}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in med.items())
                  + f"; one pass / vllm {med['paged_verify_attention'] / med['vllm']:.2f}x, "
                  f"token scores / vllm {med['paged_verify_attention (token scores)'] / med['vllm']:.2f}x, "
                  f"two passes / vllm {med['vllm+paged_block_scores'] / med['vllm']:.2f}x", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "verify_cost.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    lines = ["| context | batch | vLLM ms/layer | + paged_block_scores | paged_verify_attention | with token scores "
             "| one pass / vLLM | with token scores / vLLM | two passes / vLLM |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r["ms_per_layer"]
        tok = m["paged_verify_attention (token scores)"]
        lines.append(f"| {r['context']} | {r['batch']} | {m['vllm']:.3f} | {m['vllm+paged_block_scores']:.3f} | "
                     f"{m['paged_verify_attention']:.3f} | {tok:.3f} | "
                     f"{m['paged_verify_attention'] / m['vllm']:.2f}x | {tok / m['vllm']:.2f}x | "
                     f"{m['vllm+paged_block_scores'] / m['vllm']:.2f}x |")
    head = (f"Attention of one verification per layer: SmolLM2 shapes (9 / 3 heads, D 64), fp32, {args.gamma + 1} "
            f"queries per request, block {args.block_size}, {args.layers} layer caches cycled, medians of "
            f"{args.repeats}, {rows[0]['threads'] if rows else '?'} threads, commit {commit_label()}.\n\n")
    with open(os.path.join(args.out, "verify_cost.md"), "w") as f:
        f.write(head + "\n".join(lines) + "\n")


def summarize(rows, cfg):
    base = {(r["context"], r["batch"]): r for r in rows if r["method"] == "none"}
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    lines = ["| context | batch | " + " | ".join(f"{m} tok/s" for m in methods) + " | "
             + " | ".join(f"{m} MAL" for m in methods if m != "none") + " | same tokens as none |",
             "|---:|---:|" + "---:|" * (len(methods) + len([m for m in methods if m != "none"])) + "---|"]
    cells = sorted({(r["context"], r["batch"]) for r in rows})
    for ctx, B in cells:
        by = {r["method"]: r for r in rows if (r["context"], r["batch"]) == (ctx, B)}
        b = base.get((ctx, B))
        tps = []
        for m in methods:
            r = by.get(m)
            if r is None:
                tps.append("–")
            elif m == "none" or b is None:
                tps.append(f"{r['tokens_per_s']:.1f}")
            else:
                tps.append(f"{r['tokens_per_s']:.1f} ({r['tokens_per_s'] / b['tokens_per_s']:.2f}x)")
        mals = [f"{by[m]['mean_acceptance_length']:.2f}" if m in by and by[m]["mean_acceptance_length"] else "–"
                for m in methods if m != "none"]
        same = ", ".join(f"{m}: {('yes' if by[m]['tokens'] == b['tokens'] else 'no') if b else '– (no baseline run)'}"
                         for m in methods if m != "none" and m in by)
        lines.append(f"| {ctx} | {B} | " + " | ".join(tps) + " | " + " | ".join(mals) + f" | {same} |")
    head = (f"vLLM {cfg['vllm']} ({cfg['device']}, {cfg['threads']}), SmolLM2-135M-Instruct {cfg['dtype']}, "
            f"block {cfg['block_size']}, "
            f"eager; prompts: {cfg.get('document', 'pride_and_prejudice')} ({cfg.get('prompt_style', 'text')}); "
            f"greedy, {cfg['new_tokens']} new tokens per request after a cached prefill; γ = {cfg['gamma']} "
            "(vegas_auto: at most γ, per request); "
            f"Vegas / StreamingLLM budget ratio {cfg['ratio']}, min {cfg['min_tokens']} tokens, "
            f"{cfg.get('draft_weights', 'int8')} draft weights; ngram lookup 2-4. "
            f"Commit {cfg['commit']}. Output tokens/s (ratio to no speculation), MAL = mean acceptance length "
            "(1 + accepted / drafts).\n\n")
    return head + "\n".join(lines) + "\n\n" + _drafter_table(rows, base)


def _drafter_table(rows, base):
    """Per drafting method and cell: the decoding rate without the prefill step, what a draft token
    read and, for ``vegas_auto``, the γ decisions."""
    lines = ["Without the prefill step (first to last token): decode tok/s (ratio to none). Tokens read per "
             "draft token and layer (share of a dense draft's). γ decisions: requests x steps per γ = 0, 1, ...; "
             "plain: steps the batch check made plain.", "",
             "| context | batch | method | decode tok/s | tokens read per draft token | γ decisions | plain |",
             "|---:|---:|---|---:|---:|---|---:|"]
    for r in rows:
        if r["method"] == "none":
            continue
        b, dr, d = base.get((r["context"], r["batch"])), r.get("drafter") or {}, r.get("decode_tokens_per_s")
        rate = "–" if d is None else f"{d:.1f}" + (f" ({d / b['decode_tokens_per_s']:.2f}x)"
                                                     if b and b.get("decode_tokens_per_s") else "")
        read = (f"{dr['tokens_read_per_draft']:.0f} ({dr['read_share']:.0%})" if dr.get("tokens_read_per_draft")
                and dr.get("read_share") is not None else "–")
        lines.append(f"| {r['context']} | {r['batch']} | {r['method']} | {rate} | {read} | "
                     f"{dr.get('gamma_histogram', '–')} | {dr.get('vetoed_steps', '–')} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``); ``--method`` / ``--worker-out`` (hidden)
    make the process one method's worker."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=METHODS, metavar="METHOD",
                   help="none: no speculation; ngram: vLLM's prompt lookup; vegas / streamingllm: the plugin, every "
                        "request drafts γ over selected pages; vegas_auto: the plugin's default, each request 0..γ; "
                        "*_token: selected tokens instead of pages; "
                        f"one of {', '.join(METHODS)}")
    p.add_argument("--contexts", nargs="+", type=int, default=[2048, 4096, 8128], help="prompt tokens per request")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16], help="requests per cell")
    p.add_argument("--new-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--gamma", type=int, default=6, help="num_speculative_tokens (the most with vegas_auto)")
    p.add_argument("--ratio", type=float, default=0.05, help="sparse_attn_ratio: draft budget / context")
    p.add_argument("--min-tokens", type=int, default=256, help="sparse_attn_min_tokens")
    p.add_argument("--draft-weights", default="int8", choices=("int8", "model"),
                   help="the plugin's drafts' linears: int8 copies, or the model's own weights (the draft then "
                        "differs from the target only in what its attention reads)")
    p.add_argument("--block-size", type=int, default=32, help="vLLM's page size in tokens")
    p.add_argument("--dtype", default="float32", help="model dtype (GPU FlashAttention needs bfloat16/float16)")
    p.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2, converted)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "tmp", "vllm_e2e"),
                   help="folder for runs.jsonl, summary.md, config.json")
    p.add_argument("--document", default="pride_and_prejudice",
                   help="prompt text: a name (pride_and_prejudice, kjv, python_docs) or a UTF-8 text file")
    p.add_argument("--prompt-style", default="text", choices=("text", "summarize"),
                   help="text: windows of the document; summarize: a part of it, its summary instruction, the "
                        "chat template (bench/e2e.py's prompts)")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--verify-cost", action="store_true",
                   help="time one verification's attention per layer: vLLM's kernel, + paged_block_scores, "
                        "paged_verify_attention (no engine)")
    p.add_argument("--layers", type=int, default=10, help="--verify-cost: distinct layer caches cycled")
    p.add_argument("--repeats", type=int, default=7, help="--verify-cost: rounds (medians)")
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from bench.e2e import document_text

    try:
        document_text(args.document)
    except ValueError as e:
        p.error(f"--document: {e}")
    if os.path.isfile(args.document):  # the workers run from the repository root
        args.document = os.path.abspath(args.document)
    return args


def write_config(args: argparse.Namespace) -> dict:
    """Writes ``config.json`` into ``--out`` (the arguments, vLLM's version, the commit, the device
    and the start time) and returns it."""
    import vllm

    commit = commit_label()
    cfg = {k: v for k, v in vars(args).items() if k not in ("method", "worker_out")}
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    cfg.update(vllm=vllm.__version__, commit=commit, device=device, machine=platform.machine(),
               threads=f"{os.cpu_count()} cores", started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return cfg


def run_method(args: argparse.Namespace, m: str, runs: str) -> None:
    """Runs method ``m`` over every cell in a worker process of its own (vLLM's plugins are chosen at
    start-up: none for ``none`` / ``ngram``), appending its rows to ``runs``."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", VLLM_LOGGING_LEVEL="WARNING")
    if m in ("none", "ngram"):
        env["VLLM_PLUGINS"] = ""
    if m not in ("none", "ngram"):  # the proposer's counters, read per cell
        env["VEGAS_VLLM_STATS_DIR"] = os.path.join(args.out, "proposer_stats", m)
    cmd = [sys.executable, "-m", "bench.vllm_e2e", "--method", m, "--worker-out", runs,
           "--contexts", *map(str, args.contexts),
           "--batches", *map(str, args.batches), "--new-tokens", str(args.new_tokens), "--gamma", str(args.gamma),
           "--ratio", str(args.ratio), "--min-tokens", str(args.min_tokens), "--block-size", str(args.block_size),
           "--draft-weights", args.draft_weights,
           "--dtype", args.dtype, "--document", args.document, "--prompt-style", args.prompt_style]
    if args.model:
        cmd += ["--model", args.model]
    subprocess.run(cmd, env=env, check=True, cwd=ROOT)


def main(argv=None):
    args = parse_args(argv)
    if args.method:
        return worker(args)
    if args.verify_cost:
        return verify_cost(args)
    os.makedirs(args.out, exist_ok=True)
    runs = os.path.join(args.out, "runs.jsonl")
    if os.path.exists(runs):
        os.remove(runs)
    cfg = write_config(args)
    for m in args.methods:
        run_method(args, m, runs)
    with open(runs) as f:
        rows = [json.loads(line) for line in f]
    text = summarize(rows, cfg)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
