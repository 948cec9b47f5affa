#!/usr/bin/env python3
"""End-to-end benchmark: HF ``generate`` vs our ``"full"`` loop vs ``"vegas"`` on real long documents.

One process loads the model once, builds prompts of exactly the requested token counts from real
documents (the document's start, then an instruction; batch rows start at different places of
the document), and for every cell (document x context x batch size) runs each algorithm
configuration ``--repeats`` times, interleaved (hf, full, vegas configs, hf, full, ...), after a
warm-up. Every run is greedy with EOS ignored, so all produce exactly ``--max-new-tokens``
tokens per row and can be compared token for token with plain greedy decoding.

Writes into ``bench/results/<name>/`` (or ``--out``):

* ``runs.jsonl``: one JSON object per run (configuration, versions, commit, acceptance stats,
  tokens/s, speedups vs ``full`` and vs HF from the same repeat, time split, identical flag);
* ``summary.md``: a Markdown table of medians per cell and configuration (also printed);
* ``config.json``: the command line and the environment.

Examples::

    python -m bench.e2e                                         # the full grid (slow on CPU)
    python -m bench.e2e --docs kjv --context-lengths 512 --batch-sizes 1 \\
        --max-new-tokens 8 --repeats 1 --out bench/results/tmp/smoke   # smoke run

Metrics: ``decode_tokens_per_s`` = new tokens after each row's first / (total - prefill) time,
the number the project's speed targets are about; ``tokens_per_s`` includes prefill. HF's prefill time is
taken from its streamer (time of the first new token).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from bench.common import add_pack_linears_flag, fmt as _f, git_commit, median as _med, pack_linears, sync
from vegas_ext import documents, models
from vegas_ext.config import OPTIONS as _OPTIONS  # the harness's defaults are generate's
from vegas_ext.decode import SELECTION_ALGORITHMS  # every algorithm, streamingllm and quest included

_DW_DEFAULT = str(_OPTIONS["draft_weights"].default).lower()
_MIN_TOKENS = _OPTIONS["sparse_attn_min_tokens"].default
_GAMMA_CAP = _OPTIONS["num_speculative_tokens"].default

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_DOCS = "pride_and_prejudice,kjv"
DEFAULT_CONTEXTS = "2048,4096,8192"


# ------------------------------------------------------------------------------------ helpers

def _csv(type_, words=()):
    def parse(s: str):
        out = []
        for x in s.split(","):
            x = x.strip()
            if not x:
                continue
            if x in words:
                out.append(x)
            elif type_ is int and x.lower().endswith("k"):
                out.append(int(float(x[:-1]) * 1024))
            else:
                out.append(type_(x))
        if not out:
            raise argparse.ArgumentTypeError("empty list")
        return out
    return parse


def environment(device: torch.device) -> Dict[str, Any]:
    """Versions and machine facts recorded with every run."""
    import transformers

    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()),
        "num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import vegas_ext

        env["vegas_ext"] = vegas_ext.__version__
        env["cpu_kernels"] = bool(vegas_ext.ops.has_compiled_kernel("verify_attention", "cpu"))
        env["cuda_kernels"] = bool(vegas_ext.ops.has_compiled_kernel("verify_attention", "cuda"))
    except Exception:  # noqa: BLE001 - informational only
        pass
    env.update(zip(("git_commit", "git_dirty"), git_commit()))
    return env


FILE_INSTRUCTION = "Summarize the text above in a few sentences."


def document_text(doc: str):
    """``(text, instruction)`` of ``doc``: an embedded document name (``documents.list_documents()``)
    or the path of a UTF-8 text file (then the instruction is :data:`FILE_INSTRUCTION`). Raises
    ``ValueError`` for anything else."""
    if doc in documents.list_documents():
        return documents.load_document(doc), documents.INSTRUCTIONS[doc]
    if os.path.isfile(doc):
        with open(doc, encoding="utf-8") as f:
            return f.read(), FILE_INSTRUCTION
    raise ValueError(f"unknown document {doc!r}: neither one of {documents.list_documents()} nor a text file")


def build_batch(tok, doc: str, context: int, batch: int, chat: bool):
    """``[batch, context]`` prompt ids: row ``i`` starts ``i/batch`` of the way into the document
    (at a paragraph start), cut to exactly ``context`` tokens including the instruction. ``doc``
    as in :func:`document_text`."""
    text, instr = document_text(doc)
    rows = []
    for i in range(batch):
        start = 0
        if i:
            start = text.find("\n\n", i * len(text) // (batch + 1))
            start = 0 if start < 0 else start + 2
        rows.append(documents.make_prompt_ids(tok, text[start:], context, instruction=instr, chat=chat))
    ids = torch.tensor(rows, dtype=torch.long)
    return ids, torch.ones_like(ids)


class _Clock:
    """HF streamer that records when the first new token arrives (end of prefill)."""

    def __init__(self):
        self.n_put = 0
        self.t_first: Optional[float] = None

    def put(self, value):
        self.n_put += 1
        if self.n_put == 2:
            self.t_first = time.perf_counter()

    def end(self):
        pass


def run_hf(model, ids, mask, max_new: int, pad_id: int, prefill_cache: Optional[dict] = None) -> Dict[str, Any]:
    """Plain greedy HF ``generate`` (EOS ignored); returns tokens and timings.

    With ``prefill_cache`` (filled by our loop on the same unpadded prompt, ``T - 1`` tokens), HF
    starts from a ``DynamicCache`` holding that prefill instead of recomputing it (benchmarks: the
    decode tokens/s is unaffected, ``time_prefill_s`` is then one forward of the last token)."""
    from transformers import DynamicCache, GenerationConfig

    gc = GenerationConfig(max_new_tokens=max_new, do_sample=False, num_beams=1,
                          eos_token_id=[], pad_token_id=pad_id)
    clock = _Clock()
    kw = {}
    B, T = ids.shape
    pc = prefill_cache
    from vegas_ext.decode import _cache_kwarg
    from vegas_ext.prefill_cache import prefill_cache_is_for

    if (pc and pc.get("ids") is not None and bool(mask.all()) and pc["ids"].shape == (B, T - 1)
            and torch.equal(pc["ids"], ids[:, :T - 1]) and prefill_cache_is_for(pc, model)):

        kw[_cache_kwarg(model)] = DynamicCache([(k.clone(), v.clone()) for k, v in zip(pc["k"], pc["v"])])
    sync(ids.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc, streamer=clock, **kw)
    sync(ids.device)
    t1 = time.perf_counter()
    new = out[:, T:]
    n = new.numel()
    prefill = (clock.t_first - t0) if clock.t_first else None
    dec_t = (t1 - clock.t_first) if clock.t_first else None
    return {
        "tokens": new.tolist(),
        "stats": {
            "num_generated_tokens": n,
            "time_total_s": t1 - t0,
            "time_prefill_s": prefill,
            "tokens_per_s": n / (t1 - t0),
            "decode_tokens_per_s": ((n - B) / dec_t) if dec_t and n > B else None,
            "num_iterations": new.shape[1] - 1,  # steps after prefill
            "prefill_reused": bool(kw),
        },
    }


def run_ours(model, ids, mask, max_new: int, pad_id: int, algorithm: str, gamma, ratio: float,
             block_size: int, extra: Dict[str, Any]) -> Dict[str, Any]:
    """Our decode loop (``vegas_ext.generate``), greedy, EOS ignored; ``extra`` holds further
    ``generate`` options (``query_weights``, ``share_selection_across_heads``,
    ``selection_refresh_interval``, ``prefill_cache``, ...)."""
    from vegas_ext import generate  # also registers the rival algorithms

    sync(ids.device)
    with torch.inference_mode():
        out = generate(model, ids, mask, max_new_tokens=max_new, num_speculative_tokens=gamma,
                       sparse_attn_algorithm=algorithm, sparse_attn_ratio=ratio, block_size=block_size,
                       eos_token_id=[], pad_token_id=pad_id, **extra)
    sync(ids.device)
    T = ids.shape[1]
    return {"tokens": out.sequences[:, T:].tolist(), "stats": dict(out.stats)}


def _iter_time(result) -> Optional[float]:
    """Seconds per decoding iteration after prefill of a ``full`` / ``hf`` run (one token per row)."""
    if not result:
        return None
    s = result[1]["stats"]
    it = s.get("num_iterations")
    if not it or s.get("time_total_s") is None:
        return None
    return (s["time_total_s"] - (s.get("time_prefill_s") or 0.0)) / it


def cost_model(s: Dict[str, Any], c: Dict[str, Any], t_full: Optional[float]) -> Dict[str, Any]:
    """Per-iteration costs of a run and the speedup a simple cost model predicts from them:
    ``tau * t_full / (gamma * t_draft + t_verify + t_select)`` with ``tau`` the mean acceptance
    length, ``t_full`` the ``full`` run's seconds per token step of the same repeat, and the draft /
    verify / select seconds per iteration of this run (the select time after prefill, Quest's
    in-forward work included). Also ``select_overhead_share`` = select / measured iteration time."""
    out = {"cost_t_full_ms": 1000 * t_full if t_full else None, "cost_gamma_t_draft_ms": None,
           "cost_t_draft_step_ms": None, "cost_t_verify_ms": None, "cost_t_select_ms": None,
           "cost_model_speedup_bound": None, "select_overhead_share": None}
    it = s.get("num_iterations")
    if c["algorithm"] in ("hf", "full") or not it or s.get("time_draft_s") is None:
        return out
    steps = sum(s.get("gamma_per_iteration") or []) or None  # draft steps run (fixed or auto gamma)
    td = s["time_draft_s"] / it
    tv = s["time_verify_s"] / it
    tsel = (s["time_select_s"] - (s.get("time_select_prefill_s") or 0.0)) / it
    t_it = (s["time_total_s"] - (s.get("time_prefill_s") or 0.0)) / it
    out.update(cost_gamma_t_draft_ms=1000 * td, cost_t_draft_step_ms=1000 * s["time_draft_s"] / steps if steps else None,
               cost_t_verify_ms=1000 * tv, cost_t_select_ms=1000 * tsel,
               select_overhead_share=tsel / t_it if t_it > 0 else None)
    tau = s.get("mean_acceptance_length")
    if t_full and tau and (td + tv + tsel) > 0:
        out["cost_model_speedup_bound"] = tau * t_full / (td + tv + tsel)
    return out


def _num(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x


# ------------------------------------------------------------------------------------ main

def parse_args(argv=None):
    """Command line of the benchmark (see the module docstring); a usage error (exit 2) on a bad
    value (:func:`check_args`)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    return args


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: what to run (:func:`_add_grid_flags`), then how (:func:`_add_run_flags`)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    _add_grid_flags(ap)
    _add_run_flags(ap)
    return ap


def _add_grid_flags(ap: argparse.ArgumentParser) -> None:
    """The model, the cells (documents x contexts x batch sizes) and the algorithm configurations."""
    ap.add_argument("--model", default=None, help="model (default: embedded SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--docs", type=_csv(str), default=_csv(str)(DEFAULT_DOCS),
                    help=f"documents: names from {documents.list_documents()} or paths of UTF-8 text files "
                         f"(prompt files; instruction {FILE_INSTRUCTION!r}) (default {DEFAULT_DOCS})")
    ap.add_argument("--context-lengths", type=_csv(int), default=_csv(int)(DEFAULT_CONTEXTS),
                    help="prompt lengths in tokens, e.g. 2048,4096,8k; clamped so prompt + new tokens fit "
                         f"the model's positions (default {DEFAULT_CONTEXTS})")
    ap.add_argument("--batch-sizes", type=_csv(int), default=[1, 4], help="default 1,4")
    ap.add_argument("--algorithms", type=_csv(str), default=["hf", "full", "vegas"],
                    help="hf (HF generate), full, vegas, streamingllm, quest or any registered selection algorithm, "
                         "optionally with options after slashes: vegas/first_last, vegas/shared, vegas/refresh=4, "
                         "vegas/decay=0, vegas/recent=0 (num_recent_tokens), vegas/bs=64 (overrides --block-sizes), quest/g=auto (this spec's gamma only, run once "
                         "beside a --num-speculative-tokens sweep), combinable (vegas/shared/first_last) "
                         "(default hf,full,vegas)")
    ap.add_argument("--num-speculative-tokens", type=_csv(int, ("auto",)), default=["auto"],
                    help="gamma values for sparse algorithms: integers and/or auto (chosen per iteration, "
                         "up to --max-speculative-tokens), e.g. auto,2,3,4,6 (default auto)")
    ap.add_argument("--max-speculative-tokens", type=int, default=_GAMMA_CAP,
                    help=f"largest gamma of auto: generate's num_speculative_tokens (default {_GAMMA_CAP})")
    ap.add_argument("--ratios", type=_csv(float), default=[0.05], help="KV budget ratios (default 0.05)")
    ap.add_argument("--block-sizes", type=_csv(int), default=[None],
                    help="block sizes (default: each algorithm's own, 1 for vegas and 16 for streamingllm / quest)")
    ap.add_argument("--min-tokens", type=int, default=_MIN_TOKENS, help=f"sparse_attn_min_tokens (default {_MIN_TOKENS})")
    ap.add_argument("--draft-weights", type=_csv(str), default=[_DW_DEFAULT],
                    help="generate(draft_weights=...) of every drafting configuration, one run each: "
                         f"none, fp16, int8 (e.g. none,fp16,int8; default {_DW_DEFAULT}, generate's); an algorithm "
                         "spec's dw=<kind> option (vegas/dw=int8) fixes it for that spec")
    ap.add_argument("--share-selection", action="store_true", help="share_selection_across_heads=True")
    ap.add_argument("--query-weights", default="all", help="all (default) or first_last")
    ap.add_argument("--refresh-interval", type=int, default=1,
                    help="selection_refresh_interval: re-select every N iterations (SparseSpec; default 1)")
    ap.add_argument("--score-decay", type=float, default=None,
                    help="score_decay of vegas (default: generate's); a spec's decay=X (vegas/decay=0) overrides it")


def _add_run_flags(ap: argparse.ArgumentParser) -> None:
    """How each run goes (prefill reuse, new tokens, dtype, device, threads, repeats) and where the
    results go."""
    ap.add_argument("--no-reuse-prefill", action="store_true",
                    help="recompute the prefill in every run (default: prefill once per cell, reused by every "
                         "run of the cell, HF included; decode tokens/s is unaffected, e2e tokens/s then is not "
                         "a real end-to-end number)")
    ap.add_argument("--no-plots", action="store_true", help="do not write the PNG plots")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per row (default 64)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    add_pack_linears_flag(ap)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration and cell (default 2)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--name", default=None, help="results folder name under bench/results (default e2e-<timestamp>)")
    ap.add_argument("--out", default=None, help="results folder (overrides --name)")


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``ap.error`` (exit 2) on a document that cannot be read, a count below its minimum, an
    unknown algorithm or algorithm option, or an unknown kind of draft weights."""
    for d in args.docs:
        try:
            document_text(d)
        except (ValueError, OSError, UnicodeDecodeError) as e:
            ap.error(str(e))
    if args.max_new_tokens < 1 or args.repeats < 1 or min(args.batch_sizes) < 1 or min(args.context_lengths) < 8:
        ap.error("--max-new-tokens, --repeats, --batch-sizes must be >= 1 and contexts >= 8")
    for a in args.algorithms:
        if a in ("hf", "full"):
            continue
        try:
            spec = parse_algorithm_spec(a, args)
        except ValueError as e:
            ap.error(str(e))
        if spec["algorithm"] not in SELECTION_ALGORITHMS:
            ap.error(f"unknown algorithm {spec['algorithm']!r}; choose from hf, {', '.join(sorted(SELECTION_ALGORITHMS))}")
        if spec["draft_weights_override"] not in (None, "none", "fp16", "int8"):
            ap.error(f"dw= in {a!r} must be none, fp16 or int8")
    for dw in args.draft_weights:
        if dw not in ("none", "fp16", "int8"):
            ap.error(f"--draft-weights must list none, fp16 or int8 (int4 is refused by generate), got {dw!r}")


def parse_algorithm_spec(spec: str, args) -> Dict[str, Any]:
    """``"vegas/first_last/shared/refresh=4/decay=0/recent=0/bs=64"`` -> algorithm name and its options
    (defaults from ``--query-weights``, ``--share-selection``, ``--refresh-interval``,
    ``--score-decay``). Raises ``ValueError`` on an unknown option."""
    name, *opts = spec.split("/")
    out = {"algorithm": name, "variant": "/".join(o for o in opts if not o.startswith("g=")),
           "query_weights": args.query_weights, "share_selection_across_heads": args.share_selection,
           "selection_refresh_interval": args.refresh_interval, "score_decay": args.score_decay,
           "num_recent_tokens": None, "block_size_override": None,
           "draft_weights_override": None, "gamma_override": None}
    for o in opts:
        if o in ("first_last", "all"):
            out["query_weights"] = o
        elif o in ("shared", "per_head"):
            out["share_selection_across_heads"] = o == "shared"
        elif o.startswith("refresh="):
            out["selection_refresh_interval"] = int(o.split("=", 1)[1])
        elif o.startswith("decay="):
            out["score_decay"] = float(o.split("=", 1)[1])
        elif o.startswith("recent="):
            out["num_recent_tokens"] = int(o.split("=", 1)[1])
        elif o.startswith("bs="):
            out["block_size_override"] = int(o.split("=", 1)[1])
        elif o.startswith("dw="):
            out["draft_weights_override"] = o.split("=", 1)[1]
        elif o.startswith("g="):  # this spec's gamma only (e.g. rivals at auto beside a gamma sweep)
            v = o.split("=", 1)[1]
            out["gamma_override"] = v if v == "auto" else int(v)
        else:
            raise ValueError(f"unknown algorithm option {o!r} in {spec!r}")
    return out


def configurations(args) -> List[Dict[str, Any]]:
    """Algorithm configurations of one cell, in run order: baselines first, then for every
    (gamma, ratio, block size) the algorithms one after another, so that the runs compared with
    each other are adjacent in time and a burst of machine noise hits them alike."""
    cfgs = []
    none = {"variant": "", "query_weights": None, "share_selection_across_heads": None,
            "selection_refresh_interval": None, "score_decay": None, "num_recent_tokens": None}
    for a in args.algorithms:
        if a in ("hf", "full"):
            cfgs.append({"algorithm": a, "num_speculative_tokens": 0, "sparse_attn_ratio": None, "block_size": None,
                         **none})
    specs = []
    for a in args.algorithms:
        if a in ("hf", "full"):
            continue
        spec = parse_algorithm_spec(a, args)
        opts = {k: v for k, v in spec.items()
                if k not in ("algorithm", "block_size_override", "draft_weights_override", "gamma_override")}
        specs.append((spec, opts))
    for g in args.num_speculative_tokens:
        for r in args.ratios:
            for bs in args.block_sizes:
                for spec, opts in specs:  # a variant with its own block size (gamma) runs at one slot
                    if spec["block_size_override"] and bs != args.block_sizes[0]:
                        continue
                    if spec["gamma_override"] is not None and g != args.num_speculative_tokens[0]:
                        continue
                    bsz = spec["block_size_override"] or bs or SELECTION_ALGORITHMS[spec["algorithm"]].default_block_size
                    for dw in ([spec["draft_weights_override"]] if spec["draft_weights_override"] else args.draft_weights):
                        gg = g if spec["gamma_override"] is None else spec["gamma_override"]
                        cfgs.append({"algorithm": spec["algorithm"], "num_speculative_tokens": gg, "sparse_attn_ratio": r,
                                     "block_size": bsz, **opts, "draft_weights": None if dw == "none" else dw})
    return cfgs


def _reads_scores(algorithm: str) -> bool:
    return bool(SELECTION_ALGORITHMS[algorithm].needs_verify_scores)


def cfg_label(c: Dict[str, Any]) -> str:
    """Short label of a configuration, e.g. ``vegas g6 r0.05 b16`` or ``vegas/first_last g6 r0.05 b16``."""
    if c["algorithm"] in ("hf", "full"):
        return c["algorithm"]
    name = c["algorithm"] + (f"/{c['variant']}" if c.get("variant") else "")
    dw = f" dw={c['draft_weights']}" if c.get("draft_weights") and "dw=" not in name else ""
    return f"{name} g{c['num_speculative_tokens']} r{c['sparse_attn_ratio']:g} b{c['block_size']}{dw}"


@dataclass
class Harness:
    """What every cell of one benchmark run shares: the arguments, the loaded model and tokenizer,
    the environment recorded with each run and the results folder."""

    args: argparse.Namespace
    model: Any
    tok: Any
    device: torch.device
    dtype: torch.dtype
    model_name: str
    env: Dict[str, Any]
    out_dir: str

    @property
    def pad_id(self) -> int:
        return self.tok.pad_token_id if self.tok.pad_token_id is not None else 0

    @property
    def runs_path(self) -> str:
        return os.path.join(self.out_dir, "runs.jsonl")

    def run(self, c: Dict[str, Any], ids, mask, max_new: int, pc: Optional[dict] = None) -> Dict[str, Any]:
        """One run of configuration ``c`` (:func:`configurations`) on ``ids``: :func:`run_hf` or
        :func:`run_ours` with the options of ``c`` and the command line."""
        args = self.args
        if c["algorithm"] == "hf":
            return run_hf(self.model, ids, mask, max_new, self.pad_id, prefill_cache=pc)
        g = c["num_speculative_tokens"] or 0
        extra = {"sparse_attn_min_tokens": args.min_tokens, "prefill_cache": pc,
                 "gamma_policy": "auto" if g == "auto" else "fixed"}  # "auto": up to --max-speculative-tokens
        g = args.max_speculative_tokens if g == "auto" else g
        if c["algorithm"] != "full":
            extra.update(share_selection_across_heads=c["share_selection_across_heads"],
                         query_weights=c["query_weights"], selection_refresh_interval=c["selection_refresh_interval"],
                         draft_weights=c.get("draft_weights"))
            for opt in ("score_decay", "num_recent_tokens"):
                if c.get(opt) is not None:
                    extra[opt] = c[opt]
        return run_ours(self.model, ids, mask, max_new, self.pad_id, c["algorithm"],
                        g if c["algorithm"] != "full" else 0, c["sparse_attn_ratio"] or 0.05, c["block_size"] or 16,
                        extra)


def setup(args: argparse.Namespace, argv=None) -> Harness:
    """Threads, device and dtype from ``args``; loads the model; creates the results folder and
    writes its ``config.json`` (the command line ``argv``, default ``sys.argv``, and the environment)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = models.parse_dtype(args.dtype)

    name = args.name or datetime.datetime.now().strftime("e2e-%Y%m%d-%H%M%S")
    out_dir = args.out or os.path.join(ROOT, "bench", "results", name)
    os.makedirs(out_dir, exist_ok=True)
    # runs.jsonl starts afresh below: an earlier invocation's summary must not outlive its runs
    # when this one stops before writing its own
    stale = os.path.join(out_dir, "summary.md")
    if os.path.exists(stale):
        os.remove(stale)

    t0 = time.perf_counter()
    model, tok = models.load_model(args.model, dtype=dtype, device=device)
    load_s = time.perf_counter() - t0
    packed = pack_linears(model, args.pack_linears)
    env = environment(device)
    model_name = args.model or "embedded:SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"argv": sys.argv if argv is None else list(argv), "args": vars(args), "model": model_name,
                   "model_load_s": load_s, "model_load": dict(models.last_load_info),
                   "packed_linears": packed, **env}, f, indent=1)
    return Harness(args, model, tok, device, dtype, model_name, env, out_dir)


def warm_up(h: Harness, cfgs: List[Dict[str, Any]]) -> None:
    """One short run of every configuration, so first-call costs (allocator, lazy inits, thread
    pools) stay out of the numbers."""
    w_ids, w_mask = build_batch(h.tok, h.args.docs[0], 64, 1, h.args.chat)
    for c in cfgs:
        h.run(c, w_ids.to(h.device), w_mask.to(h.device), 4)


def run_cells(h: Harness, cfgs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Every cell (document x context x batch size), each configuration ``--repeats`` times; each
    run's record is written to ``runs.jsonl`` as it comes (a folder holds one invocation's runs: a
    rerun into it starts the file afresh, as it rewrites config.json). Returns the records."""
    from tqdm.auto import tqdm

    args = h.args
    cells = [(d, ctx, b) for ctx in args.context_lengths for b in args.batch_sizes for d in args.docs]
    total = len(cells) * args.repeats * len(cfgs)
    bar = tqdm(total=total, desc="e2e", unit="run", file=sys.stderr, dynamic_ncols=True)
    records: List[Dict[str, Any]] = []
    with open(h.runs_path, "w") as runs_f:
        for doc, ctx_req, B in cells:
            for recs in run_cell(h, cfgs, doc, ctx_req, B, bar):
                records += recs
                runs_f.writelines(json.dumps(rec) + "\n" for rec in recs)
                runs_f.flush()
    bar.close()
    return records


def run_cell(h: Harness, cfgs: List[Dict[str, Any]], doc: str, ctx_req: int, B: int, bar):
    """Yields, for each repeat of the cell, the records of its runs (:func:`run_records`). The
    context is clamped so prompt + new tokens + the largest gamma fit the model's positions; unless
    ``--no-reuse-prefill``, one prefill (the longest, gamma 0) is computed first and reused by every run."""
    args = h.args
    max_pos = int(getattr(h.model.config, "max_position_embeddings", 1 << 30))
    g_max = max(args.max_speculative_tokens if g == "auto" else g for g in args.num_speculative_tokens)
    ctx = min(ctx_req, max_pos - args.max_new_tokens - g_max - 1)
    ids, mask = build_batch(h.tok, doc, ctx, B, args.chat)
    ids, mask = ids.to(h.device), mask.to(h.device)
    pc: Optional[dict] = None
    t_pf = None
    if not args.no_reuse_prefill:
        pc = {}
        bar.set_postfix_str(f"{doc} ctx={ctx} B={B} prefill")
        t_pf = time.perf_counter()
        run_ours(h.model, ids, mask, 1, h.pad_id, "full", 0, 0.05, 16, {"prefill_cache": pc})
        t_pf = time.perf_counter() - t_pf
    cell = {"doc": doc, "context_requested": ctx_req, "context": ctx, "batch_size": B}
    for rep in range(args.repeats):
        # rotate the order every repeat so no configuration always runs first / last
        order = cfgs[rep % len(cfgs):] + cfgs[:rep % len(cfgs)]
        results = {}
        for c in order:
            bar.set_postfix_str(f"{doc} ctx={ctx} B={B} {cfg_label(c)}")
            results[cfg_label(c)] = (c, h.run(c, ids, mask, args.max_new_tokens, pc))
            bar.update(1)
        yield run_records(h, {**cell, "repeat": rep}, results, t_pf)


def run_records(h: Harness, cell: Dict[str, Any], results: Dict[str, Any], cell_prefill_s: Optional[float]):
    """The ``runs.jsonl`` records of one repeat of a cell: ``results`` maps each configuration's
    label to ``(configuration, result)``; ``cell`` holds the doc, contexts, batch size and repeat;
    ``cell_prefill_s`` the shared prefill's seconds (None without one)."""
    ref = results.get("full") or results.get("hf")
    full_it = _iter_time(results.get("full"))
    records = []
    for label, (c, r) in results.items():
        s = r["stats"]
        drafting = c["algorithm"] not in ("hf", "full")
        rec = {
            **cell, "label": label, **c,
            "max_new_tokens": h.args.max_new_tokens, "dtype": str(h.dtype).replace("torch.", ""),
            "model": h.model_name, "chat": h.args.chat,
            "sparse_attn_min_tokens": h.args.min_tokens if drafting else None,
            # the value used (generate's default too), where the algorithm reads verification scores
            "score_decay": s.get("score_decay") if drafting and _reads_scores(c["algorithm"]) else None,
            "num_recent_tokens": s.get("num_recent_tokens") if drafting and _reads_scores(c["algorithm"]) else None,
            **_stat_fields(s),
            "identical_to_plain": (r["tokens"] == ref[1]["tokens"]) if ref else None,
            "plain_reference": "full" if "full" in results else ("hf" if "hf" in results else None),
            "identical_to_hf": (r["tokens"] == results["hf"][1]["tokens"]) if "hf" in results else None,
            "prefill_reused": s.get("prefill_reused"),
            "prefill_miss": s.get("prefill_miss"),
            "draft_weights_bytes": s.get("draft_weights_bytes"),
            "cell_prefill_s": cell_prefill_s,
            "time_select_inline_s": s.get("time_select_inline_s"),
            "time_select_prefill_s": s.get("time_select_prefill_s"),
            # the gamma policy's choices and (auto) its estimates; fitted costs as fitted_*
            **{("fitted_" + k if k.startswith("cost_") else k): s.get(k)
               for k in _POLICY_FIELDS if k in s and drafting},
            **cost_model(s, c, full_it),
            **h.env,
        }
        for base in ("full", "hf"):
            b = results.get(base)
            bd = b[1]["stats"].get("decode_tokens_per_s") if b else None
            be = b[1]["stats"].get("tokens_per_s") if b else None
            rec[f"speedup_vs_{base}"] = (s["decode_tokens_per_s"] / bd) if bd and s.get("decode_tokens_per_s") else None
            rec[f"e2e_speedup_vs_{base}"] = (s["tokens_per_s"] / be) if be and s.get("tokens_per_s") else None
        records.append(rec)
    return records


#: the gamma policy's statistics copied into each record of a drafting run
_POLICY_FIELDS = ("gamma_policy", "gamma_histogram", "row_gamma_histogram", "gamma_per_iteration",
                  "acceptance_estimates", "cost_t_plain_ms", "cost_t_draft_ms", "cost_t_select_ms",
                  "cost_t_verify_c0_ms", "cost_t_verify_c1_ms", "cost_t_verify_per_token_ms", "num_probes")


def _stat_fields(s: Dict[str, Any]) -> Dict[str, Any]:
    """A run's acceptance counters and times (``s``: its ``stats``) as recorded in ``runs.jsonl``."""
    return {
        "mean_acceptance_length": s.get("mean_acceptance_length"),
        "draft_acceptance_rate": s.get("draft_acceptance_rate"),
        "num_accepted_tokens_per_pos": _num(s.get("num_accepted_tokens_per_pos")),
        "num_drafts": s.get("num_drafts"), "num_draft_tokens": s.get("num_draft_tokens"),
        "num_accepted_tokens": s.get("num_accepted_tokens"),
        "num_generated_tokens": s.get("num_generated_tokens"),
        "num_iterations": s.get("num_iterations"),
        "tokens_per_s": s.get("tokens_per_s"),
        "decode_tokens_per_s": s.get("decode_tokens_per_s"),
        "time_total_s": s.get("time_total_s"), "time_prefill_s": s.get("time_prefill_s"),
        "time_draft_s": s.get("time_draft_s"), "time_verify_s": s.get("time_verify_s"),
        "time_select_s": s.get("time_select_s"),
        "ms_per_iteration": (1000 * (s["time_total_s"] - (s.get("time_prefill_s") or 0)) / s["num_iterations"]
                             if s.get("num_iterations") else None),
        "num_verified_tokens": s.get("num_verified_tokens"),
        **iteration_accounting(s),
    }


def iteration_accounting(s: Dict[str, Any]) -> Dict[str, Any]:
    """Where one decoding iteration's time goes (``s``: a run's ``stats``), per iteration after
    prefill: ``iter_draft_ms``, ``iter_verify_ms``, ``iter_select_ms`` (Quest's in-forward scoring
    included, prefill's excluded) and ``iter_other_ms`` (the rest: compaction, streamer, Python
    between phases); ``iter_tokens`` emitted tokens (all rows), ``iter_draft_steps`` draft steps,
    ``iter_verified_tokens`` tokens through the verification forward, ``verify_ms_per_token`` and
    ``draft_step_ms``. Together they say why a higher mean acceptance length does or does not
    become speed: tokens per iteration against the draft, verify and select time they cost."""
    it = s.get("num_iterations")
    if not it or s.get("time_total_s") is None:
        return {}
    steps = sum(s.get("gamma_per_iteration") or []) or 0
    dec = s["time_total_s"] - (s.get("time_prefill_s") or 0.0)
    sel = s.get("time_select_s", 0.0) - (s.get("time_select_prefill_s") or 0.0)
    draft, verify = s.get("time_draft_s", 0.0), s.get("time_verify_s", 0.0)
    n_first = s.get("batch_size") or 0
    vt = s.get("num_verified_tokens")
    return {
        "iter_draft_ms": 1000 * draft / it, "iter_verify_ms": 1000 * verify / it, "iter_select_ms": 1000 * sel / it,
        "iter_other_ms": 1000 * (dec - draft - verify - sel) / it,
        "iter_tokens": (s.get("num_generated_tokens", 0) - n_first) / it,
        "iter_draft_steps": steps / it,
        "iter_verified_tokens": vt / it if vt else None,
        "verify_ms_per_token": 1000 * verify / vt if vt else None,
        "draft_step_ms": 1000 * draft / steps if steps else None,
    }


def write_report(h: Harness, records: List[Dict[str, Any]], argv=None) -> None:
    """Writes ``summary.md`` (:func:`summary_markdown`) and, unless ``--no-plots``, the PNG plots;
    prints the summary on stdout and the file names on stderr."""
    args = h.args
    cmd = "python -m bench.e2e " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    md = summary_markdown(records, args, h.env, h.model_name, cmd)
    with open(os.path.join(h.out_dir, "summary.md"), "w") as f:
        f.write(md)
    if not args.no_plots:
        try:
            from bench import plots

            for pth in plots.write_plots(records, h.out_dir):
                print(f"plot: {pth}", file=sys.stderr)
        except ImportError as e:  # matplotlib missing: numbers still written
            print(f"plots skipped: {e}", file=sys.stderr)
    print(md)
    print(f"results: {h.runs_path}, {os.path.join(h.out_dir, 'summary.md')}", file=sys.stderr)


def main(argv=None) -> int:
    """Runs the benchmark: parse the command line, load the model, warm up, run every cell, write
    the report; returns 0."""
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    h = setup(args, argv)
    cfgs = configurations(args)
    if not args.no_warmup:
        warm_up(h, cfgs)
    records = run_cells(h, cfgs)
    write_report(h, records, argv)
    return 0


def summary_markdown(records: List[Dict[str, Any]], args, env: Dict[str, Any], model_name: str,
                     command: Optional[str] = None) -> str:
    """Markdown table: medians over repeats per (document, context, batch, configuration)."""
    lines = [
        "# End-to-end decoding benchmark",
        "",
        f"Command: `{command}`" if command else "",
        "",
        f"Model {model_name}, {args.dtype}, {env['device']} ({env.get('device_name')}, {env.get('num_threads')} threads); "
        f"torch {env['torch']}, transformers {env['transformers']}; commit {str(env.get('git_commit'))[:10]}"
        f"{' (dirty)' if env.get('git_dirty') else ''}; {args.max_new_tokens} new tokens per row, greedy, EOS ignored; "
        f"medians of {args.repeats} interleaved repeat(s).",
        "",
        "decode tok/s = tokens after each row's first / time after prefill (all rows); e2e includes prefill. "
        "Speedups are decode tok/s ratios against the same repeat's run. MAL = mean acceptance length "
        "(1 + accepted / drafts); DAR = draft acceptance rate. bound = cost-model speedup "
        "tau * t_full / (gamma * t_draft + t_verify + t_select) from this run's measured per-iteration costs, "
        "next to the measured 'vs full'; sel % = selection time / iteration time (Quest's per-step scoring and "
        "metadata updates included). identical = same tokens as our plain ('full') decoding"
        + ("" if args.no_reuse_prefill else "; prefill computed once per cell and reused by every run (HF included), "
           "so e2e tok/s and prefill times are not end-to-end numbers") + ".",
        "",
        "| doc | ctx | B | config | decode tok/s | e2e tok/s | ms/iter | vs full | bound | vs HF | MAL | DAR | sel % | prefill / draft / verify / select s | identical |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    keys = []
    for r in records:
        k = (r["doc"], r["context"], r["batch_size"], r["label"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        rs = [r for r in records if (r["doc"], r["context"], r["batch_size"], r["label"]) == k]
        g = lambda f: _med([r.get(f) for r in rs])  # noqa: E731
        if k[3] in ("hf", "full"):  # no drafts: acceptance stats do not apply
            g0 = g
            g = lambda f: None if f in ("mean_acceptance_length", "draft_acceptance_rate") else g0(f)  # noqa: E731
        ident = all(r.get("identical_to_plain") for r in rs) if rs[0].get("identical_to_plain") is not None else None
        split = " / ".join(_f(g(f)) for f in ("time_prefill_s", "time_draft_s", "time_verify_s", "time_select_s"))
        lines.append(
            f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {_f(g('decode_tokens_per_s'))} | {_f(g('tokens_per_s'))} | "
            f"{_f(g('ms_per_iteration'), '{:.0f}')} | {_f(g('speedup_vs_full'))} | {_f(g('cost_model_speedup_bound'))} | "
            f"{_f(g('speedup_vs_hf'))} | {_f(g('mean_acceptance_length'))} | {_f(g('draft_acceptance_rate'))} | "
            f"{_f(None if g('select_overhead_share') is None else 100 * g('select_overhead_share'), '{:.1f}')} | {split} | "
            f"{'–' if ident is None else ('yes' if ident else '**no**')} |"
        )
    return "\n".join(lines + accounting_markdown(records, keys)) + "\n"


def accounting_markdown(records: List[Dict[str, Any]], keys: List[tuple]) -> List[str]:
    """The lines of the per-iteration accounting table (:func:`iteration_accounting`, medians per
    (document, context, batch, configuration) in ``keys``)."""
    lines = ["", "Per iteration (medians): where the time goes. tokens = emitted tokens of all rows; steps = draft "
              "steps; verified = tokens through the verification forward (rows' tokens packed when their drafts "
              "differ); other = time outside draft / verify / select (compaction, Python between phases).", "",
              "| doc | ctx | B | config | tokens | steps | verified | draft ms | verify ms | select ms | other ms "
              "| ms / draft step | verify ms / token | row γ histogram |",
              "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for k in keys:
        rs = [r for r in records if (r["doc"], r["context"], r["batch_size"], r["label"]) == k]
        g = lambda f: _med([r.get(f) for r in rs])  # noqa: E731
        hist = rs[0].get("row_gamma_histogram") or rs[0].get("gamma_histogram")
        lines.append(
            f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {_f(g('iter_tokens'))} | {_f(g('iter_draft_steps'))} | "
            f"{_f(g('iter_verified_tokens'))} | {_f(g('iter_draft_ms'), '{:.1f}')} | {_f(g('iter_verify_ms'), '{:.1f}')} | "
            f"{_f(g('iter_select_ms'), '{:.1f}')} | {_f(g('iter_other_ms'), '{:.1f}')} | {_f(g('draft_step_ms'), '{:.1f}')} | "
            f"{_f(g('verify_ms_per_token'), '{:.2f}')} | {hist if hist and k[3] not in ('hf', 'full') else '–'} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
