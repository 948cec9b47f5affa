"""The ``vegas`` command: ``vegas generate`` runs self-speculative decoding on a real model.

Examples::

    vegas generate --compare                  # embedded SmolLM2 on the embedded 7K-token document
    vegas generate --prompt "Hello" --chat --max-new-tokens 32
    vegas generate --model ./my-llama --prompt-file doc.txt --batch-size 4 --json

Text goes to stdout (streamed for a single row), progress and statistics to stderr; with
``--json`` stdout carries exactly one JSON object. Bad input ends with a one-line
``vegas: error: ...`` on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

ALGORITHMS = ("vegas", "full")


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (no usage dump) and exit with status 2."""

    def error(self, message):  # noqa: D401
        self.exit(2, f"vegas: error: {message}\n")


# ---------------------------------------------------------------------------------------------
# argument parsing

def _int(name):
    """argparse type: an integer (range checks happen in _validate, with clearer messages)."""
    def parse(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {s!r}") from None
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``vegas`` argument parser (subcommand ``generate``)."""
    p = _Parser(prog="vegas", description="Self-speculative decoding with verification-guided sparse attention (Vegas).")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    g = sub.add_parser(
        "generate",
        help="generate text with Vegas self-speculative decoding",
        description="Generate text with Vegas self-speculative decoding. Default: the embedded "
        "SmolLM2-135M-Instruct model on the embedded ~7K-token document (chapters 1-5 of Pride and "
        "Prejudice) with an instruction to summarize it.",
    )
    m = g.add_argument_group("model")
    m.add_argument("--model", default=None,
                   help="local HF model folder, .gguf file, or hub id already in the local HF cache "
                        "(default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF)")
    m.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    m.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available; default)")
    pr = g.add_argument_group("prompt")
    src = pr.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", default=None,
                     help="prompt text; repeat to form a batch (default: the embedded document with its instruction)")
    src.add_argument("--prompt-file", default=None, help="read the prompt from this file ('-' for stdin)")
    pr.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    pr.add_argument("--batch-size", type=_int("--batch-size"), default=None,
                    help="number of rows: the prompt(s) repeated cyclically (default: one row per prompt)")
    d = g.add_argument_group("decoding")
    d.add_argument("--max-new-tokens", type=_int("--max-new-tokens"), default=128,
                   help="new tokens per row (default 128)")
    d.add_argument("--num-speculative-tokens", "--gamma", dest="num_speculative_tokens", default="auto",
                   help="draft tokens per iteration, gamma: an integer >= 1, or auto (default): chosen before "
                        "every iteration from the measured acceptance and step costs, 0 (plain step) .. "
                        "--max-speculative-tokens")
    d.add_argument("--max-speculative-tokens", type=_int("--max-speculative-tokens"), default=8,
                   help="largest gamma of --num-speculative-tokens auto (default 8)")
    d.add_argument("--algorithm", default="vegas",
                   help="sparse_attn_algorithm: vegas (default), streamingllm, quest, or full (plain decoding through our cache and kernels)")
    d.add_argument("--ratio", type=float, default=0.05, help="KV budget as a fraction of the context, in (0, 1] (default 0.05)")
    d.add_argument("--min-tokens", type=_int("--min-tokens"), default=256,
                   help="lower clamp of the KV budget in tokens (default 256)")
    d.add_argument("--max-tokens", type=_int("--max-tokens"), default=None,
                   help="upper clamp of the KV budget in tokens (default: none)")
    d.add_argument("--block-size", type=_int("--block-size"), default=None,
                   help="KV selection granularity in tokens (default: the algorithm's, 1 for vegas, 16 for "
                        "streamingllm and quest)")
    d.add_argument("--sink-blocks", type=_int("--sink-blocks"), default=1,
                   help="leading blocks always kept in the draft's KV set (default 1)")
    d.add_argument("--share-selection", action="store_true",
                   help="one block selection per layer shared by all KV heads (the authors' choice)")
    d.add_argument("--query-weights", choices=("all", "first_last"), default="all",
                   help="vegas: verification queries that score blocks: all (default) or first_last (the authors')")
    d.add_argument("--refresh-interval", type=_int("--refresh-interval"), default=1,
                   help="vegas: re-select the draft blocks only every N iterations (SparseSpec; default 1)")
    d.add_argument("--do-sample", action="store_true", help="sample (speculative sampling) instead of greedy decoding")
    d.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    d.add_argument("--top-k", type=_int("--top-k"), default=0, help="top-k filter, 0 = off (default)")
    d.add_argument("--top-p", type=float, default=1.0, help="nucleus filter in (0, 1] (default 1.0 = off)")
    d.add_argument("--seed", type=_int("--seed"), default=None, help="random seed (sampling)")
    d.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS; always generate --max-new-tokens")
    o = g.add_argument_group("output")
    o.add_argument("--compare", action="store_true",
                   help="also run plain greedy decoding with Hugging Face's model.generate; report speedup "
                        "and whether the tokens are identical")
    o.add_argument("--json", action="store_true", help="print one JSON object to stdout instead of text")
    o.add_argument("--no-progress", action="store_true", help="no progress bars / streaming")
    g.set_defaults(func=cmd_generate)
    return p


def _validate(args) -> None:
    if args.num_speculative_tokens != "auto":
        try:
            args.num_speculative_tokens = int(args.num_speculative_tokens)
        except ValueError:
            raise CLIError(f"--num-speculative-tokens must be an integer >= 1 or auto, got {args.num_speculative_tokens!r}") from None
        if args.num_speculative_tokens < 1:
            raise CLIError(f"--num-speculative-tokens must be >= 1 or auto, got {args.num_speculative_tokens}")
    if args.max_speculative_tokens < 1:
        raise CLIError(f"--max-speculative-tokens must be >= 1, got {args.max_speculative_tokens}")
    if not (0.0 < args.ratio <= 1.0) or math.isnan(args.ratio):
        raise CLIError(f"--ratio must be in (0, 1], got {args.ratio}")
    if args.batch_size is not None and args.batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.block_size is not None and args.block_size < 1:
        raise CLIError(f"--block-size must be >= 1, got {args.block_size}")
    if args.min_tokens < 0 or (args.max_tokens is not None and args.max_tokens < 1):
        raise CLIError("--min-tokens must be >= 0 and --max-tokens >= 1")
    if args.sink_blocks < 0:
        raise CLIError(f"--sink-blocks must be >= 0, got {args.sink_blocks}")
    if args.refresh_interval < 1:
        raise CLIError(f"--refresh-interval must be >= 1, got {args.refresh_interval}")
    if args.algorithm not in _algorithms():
        raise CLIError(f"unknown --algorithm {args.algorithm!r}; choose from {', '.join(_algorithms())}")
    if args.block_size is None:  # the algorithm's own default (vegas: 1, others: 16)
        from .decode import SELECTION_ALGORITHMS

        args.block_size = SELECTION_ALGORITHMS[args.algorithm].default_block_size
    if args.do_sample:
        if not (args.temperature > 0) or math.isinf(args.temperature):
            raise CLIError(f"--temperature must be > 0, got {args.temperature}")
        if not (0.0 < args.top_p <= 1.0):
            raise CLIError(f"--top-p must be in (0, 1], got {args.top_p}")
        if args.top_k < 0:
            raise CLIError(f"--top-k must be >= 0, got {args.top_k}")
    if args.prompt is not None and any(p == "" for p in args.prompt):
        raise CLIError("--prompt must not be empty")


def _algorithms() -> Sequence[str]:
    try:
        from . import decode

        algos = getattr(decode, "SELECTION_ALGORITHMS", None)
        if algos:
            return tuple(sorted(algos))
    except ImportError:
        pass
    return ALGORITHMS


# ---------------------------------------------------------------------------------------------
# helpers

def _eprint(*a, **k):
    print(*a, file=sys.stderr, flush=True, **k)


def _read_prompts(args) -> List[str]:
    if args.prompt_file is not None:
        if args.prompt_file == "-":
            text = sys.stdin.read()
        else:
            if not os.path.isfile(args.prompt_file):
                raise CLIError(f"prompt file not found: {args.prompt_file}")
            try:
                with open(args.prompt_file, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise CLIError(f"cannot read prompt file {args.prompt_file}: {e}") from None
        if not text.strip():
            raise CLIError(f"prompt file {args.prompt_file} is empty")
        prompts = [text]
    elif args.prompt:
        prompts = list(args.prompt)
    else:
        from .documents import default_prompt

        prompts = [default_prompt()]
    n = args.batch_size or len(prompts)
    return [prompts[i % len(prompts)] for i in range(n)]


def _encode(tok, prompts: List[str], chat: bool) -> List[List[int]]:
    out = []
    for p in prompts:
        if chat:
            if not getattr(tok, "chat_template", None):
                raise CLIError("--chat: this tokenizer has no chat template")
            ids = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                          add_generation_prompt=True, return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            ids = list(ids)
        else:
            ids = tok(p).input_ids
        if not ids:
            raise CLIError("a prompt encodes to zero tokens")
        out.append([int(t) for t in ids])
    return out


def _left_pad(rows: List[List[int]], pad_id: int, device):
    import torch

    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, L - len(r):] = 1
    return ids.to(device), mask.to(device)


def _eos_ids(model, tok) -> List[int]:
    e = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if e is None:
        e = tok.eos_token_id
    if e is None:
        return []
    return [int(x) for x in (e if isinstance(e, (list, tuple)) else [e])]


def new_tokens(sequences, prompt_len: int, eos_ids: Sequence[int], max_new_tokens: int) -> List[List[int]]:
    """New tokens of each row of ``sequences`` (``[B, prompt_len + new]``), cut after the first EOS."""
    rows = []
    for r in sequences[:, prompt_len:].tolist():
        r = r[:max_new_tokens]
        for i, t in enumerate(r):
            if t in eos_ids:
                r = r[: i + 1]
                break
        rows.append(r)
    return rows


class ProgressStreamer:
    """Streamer for ``generate`` (ours and HF's): counts new tokens, records timing, forwards to ``inner``.

    The first ``put`` carries the prompt; every later one new tokens (``[B]``, ``[B, k]`` or, for
    one row, ``[k]``). ``t_first`` is the time of the first new token (end of prefill).
    """

    def __init__(self, batch_size: int, total: int, desc: str, inner=None, show: bool = True):
        self.batch_size = batch_size
        self.inner = inner
        self.t_start = time.perf_counter()
        self.t_first: Optional[float] = None
        self.t_end: Optional[float] = None
        self.count = 0
        self._prompt_seen = False
        self.bar = None
        if show:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=False, dynamic_ncols=True)

    def put(self, value):
        if self.inner is not None:
            self.inner.put(value)
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if value.dim() >= 2:
            n = value.shape[-1]
        elif self.batch_size == 1:
            n = value.numel()
        else:
            n = 1
        self.count += n
        if self.bar is not None:
            self.bar.update(n)

    def end(self):
        if self.inner is not None:
            self.inner.end()
        self.t_end = time.perf_counter()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            if not sys.stderr.isatty():  # a file or pipe keeps the erased bar: end its line
                sys.stderr.write("\n")
                sys.stderr.flush()


def _run_hf(model, ids, mask, max_new_tokens, eos, pad_id, progress: bool):
    """Plain greedy decoding with HF ``model.generate``; returns (sequences, wall seconds, streamer)."""
    import torch
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False,
                          num_beams=1, eos_token_id=list(eos), pad_token_id=pad_id)  # [] = never stop (None would
    # fall back to the model's generation_config)
    st = ProgressStreamer(ids.shape[0], max_new_tokens, "HF generate (baseline)", show=progress)
    t0 = time.perf_counter()
    st.t_start = t0
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc, streamer=st)
    _sync(ids.device)
    return out, time.perf_counter() - t0, st


def _sync(device):
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize()


def _jsonable(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if hasattr(x, "item") and callable(x.item):
        return x.item()
    return x


def _fmt_stats(stats: Dict[str, Any]) -> List[str]:
    def g(k, fmt="{:.3f}"):
        v = stats.get(k)
        if v is None:
            return "n/a"
        try:
            return fmt.format(v)
        except (ValueError, TypeError):
            return str(v)

    lines = [
        f"generated tokens     {g('num_generated_tokens', '{}')} in {g('num_iterations', '{}')} iterations",
        f"tokens/s             {g('tokens_per_s', '{:.2f}')} (incl. prefill), "
        f"{g('decode_tokens_per_s', '{:.2f}')} decode only",
    ]
    if stats.get("num_drafts"):  # plain decoding ("full") drafts nothing: no acceptance to report
        lines += [
            f"mean accept. length  {g('mean_acceptance_length', '{:.2f}')} "
            f"(drafts {g('num_drafts', '{}')}, draft tokens {g('num_draft_tokens', '{}')}, accepted {g('num_accepted_tokens', '{}')})",
            f"draft accept. rate   {g('draft_acceptance_rate', '{:.3f}')}",
        ]
        per = stats.get("num_accepted_tokens_per_pos")
        if per is not None:
            lines.append(f"accepted per pos.    {_jsonable(per)}")
    if stats.get("gamma_histogram") is not None:
        label = f"gamma ({stats.get('gamma_policy')})"
        lines.append(f"{label:<21}iterations per gamma 0..{len(stats['gamma_histogram']) - 1}: "
                     f"{_jsonable(stats['gamma_histogram'])}")
    if stats.get("acceptance_estimates") is not None:
        lines.append(f"accept. estimates    {_jsonable(stats['acceptance_estimates'])} (per draft position)")
        lines.append(f"fitted costs         draft step {g('cost_t_draft_ms', '{:.1f}')} ms, verify(q) "
                     f"{g('cost_t_verify_c0_ms', '{:.1f}')} + {g('cost_t_verify_c1_ms', '{:.1f}')} q ms, "
                     f"select {g('cost_t_select_ms', '{:.1f}')} ms; {g('num_probes', '{}')} probes")
    parts = [f"{k[5:-2]} {stats[k]:.2f}s" for k in ("time_prefill_s", "time_draft_s", "time_verify_s", "time_select_s")
             if isinstance(stats.get(k), (int, float))]
    if parts:
        lines.append(f"time                 total {g('time_total_s', '{:.2f}')}s = " + ", ".join(parts) + " (+ rest)")
    return lines


# ---------------------------------------------------------------------------------------------
# vegas generate

def cmd_generate(args) -> int:
    """Runs ``vegas generate`` with parsed ``args``; returns the exit status."""
    _validate(args)
    prompts = _read_prompts(args)  # before the (slow) model load, so a bad file fails fast

    import torch

    from . import models

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dtype = models.parse_dtype(args.dtype)
        device = torch.device(device)
    except (ValueError, RuntimeError) as e:
        raise CLIError(str(e).splitlines()[0]) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda requested but CUDA is not available")
    progress = not args.no_progress

    if not args.json:
        if models.needs_conversion(args.model):
            _eprint(f"first use of {args.model or 'the embedded SmolLM2-135M-Instruct GGUF'}: converting it once "
                    f"(~20 s), cached in {models.cache_root()} ...")
    try:
        model, tok = models.load_model(args.model, dtype=dtype, device=device)
    except ValueError as e:
        raise CLIError(str(e).splitlines()[0]) from None
    info = models.last_load_info
    if not args.json:
        _eprint(f"loaded {args.model or 'embedded SmolLM2-135M-Instruct'} in {info.get('seconds', 0):.1f}s ({info.get('how')}); "
                f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, "
                f"{dtype}, {device}")

    rows = _encode(tok, prompts, args.chat)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    longest = max(len(r) for r in rows)
    max_new = args.max_new_tokens
    if max_pos is not None:
        if longest >= max_pos:
            raise CLIError(f"prompt has {longest} tokens but the model has only {max_pos} positions "
                           f"(room for at most {max_pos - 1} prompt tokens)")
        if longest + max_new > max_pos:
            max_new = max_pos - longest
            if not args.json:
                _eprint(f"note: --max-new-tokens lowered to {max_new} to fit the model's {max_pos} positions")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    ids, mask = _left_pad(rows, pad_id, device)
    eos = [] if args.ignore_eos else _eos_ids(model, tok)
    B = len(rows)
    if not args.json:
        _eprint(f"prompt: {B} row(s), {', '.join(str(len(r)) for r in rows[:8])}{' ...' if B > 8 else ''} tokens; "
                f"generating up to {max_new} new tokens with {args.algorithm}, gamma={args.num_speculative_tokens}, "
                f"ratio={args.ratio}, block={args.block_size}")

    try:
        from .decode import generate
    except ImportError as e:
        raise CLIError(f"the decode loop is not available: {e}") from None

    generator = None
    if args.seed is not None:
        torch.manual_seed(args.seed)
        generator = torch.Generator(device=device).manual_seed(args.seed)

    # The decode loop streams batch size 1 only: stream the text (human mode) or show a progress
    # bar (--json); larger batches print a line when done.
    stream_text = progress and not args.json and B == 1
    streamer = None
    if B == 1:
        inner = None
        if stream_text:
            from transformers import TextStreamer

            inner = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        streamer = ProgressStreamer(B, max_new, f"vegas {args.algorithm}", inner=inner,
                                    show=progress and not stream_text)
    elif progress and not args.json:
        _eprint(f"running vegas {args.algorithm} on {B} rows ...")

    kwargs = dict(
        max_new_tokens=max_new,
        num_speculative_tokens=args.num_speculative_tokens,
        max_speculative_tokens=args.max_speculative_tokens,
        sparse_attn_algorithm=args.algorithm,
        sparse_attn_ratio=args.ratio,
        sparse_attn_min_tokens=args.min_tokens,
        sparse_attn_max_tokens=args.max_tokens,
        block_size=args.block_size,
        num_sink_blocks=args.sink_blocks,
        share_selection_across_heads=args.share_selection,
        query_weights=args.query_weights,
        selection_refresh_interval=args.refresh_interval,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=eos,  # [] = never stop at EOS
        pad_token_id=pad_id,
        streamer=streamer,
        generator=generator,
    )
    if args.compare:  # warm both paths up (first-call allocations, lazy inits) on a short prompt
        w_ids, w_mask = ids[:, -min(16, ids.shape[1]):], mask[:, -min(16, ids.shape[1]):]
        with torch.inference_mode():
            generate(model, w_ids, w_mask, **{**kwargs, "max_new_tokens": 2, "streamer": None})
            _run_hf(model, w_ids, w_mask, 2, eos, pad_id, progress=False)

    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            out = generate(model, ids, mask, **kwargs)
    except ValueError as e:  # e.g. an unsupported model / config refused by the decode loop
        raise CLIError(str(e).splitlines()[0]) from None
    _sync(device)
    wall = time.perf_counter() - t0
    if stream_text:
        sys.stdout.write("\n")
        sys.stdout.flush()
    stats = dict(getattr(out, "stats", {}) or {})
    ours = new_tokens(out.sequences, ids.shape[1], eos, max_new)
    n_ours = sum(len(r) for r in ours)
    stats.setdefault("wall_s", wall)
    stats["wall_tokens_per_s"] = n_ours / wall if wall > 0 else None

    result: Dict[str, Any] = {
        "model": args.model or "embedded:SmolLM2-135M-Instruct.Q4_1.gguf",
        "algorithm": args.algorithm,
        "num_speculative_tokens": args.num_speculative_tokens,
        "sparse_attn_ratio": args.ratio,
        "block_size": args.block_size,
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "prompt_token_ids": rows,
        "token_ids": ours,
        "text": [tok.decode(r, skip_special_tokens=True) for r in ours],
        "stats": _jsonable(stats),
    }

    if args.compare:
        hf_out, hf_wall, hf_st = _run_hf(model, ids, mask, max_new, eos, pad_id, progress)
        base = new_tokens(hf_out, ids.shape[1], eos, max_new)
        n_base = sum(len(r) for r in base)
        base_tps = n_base / hf_wall if hf_wall > 0 else None
        # Decode-only rates leave out prefill (the same work for both): HF's from its streamer
        # (time of the first new token), ours from stats["time_prefill_s"].
        hf_dec = (hf_st.t_end or 0) - (hf_st.t_first or 0) if hf_st.t_first else None
        our_pre = stats.get("time_prefill_s")
        our_dec = wall - our_pre if isinstance(our_pre, (int, float)) else None
        dec_speedup = None
        if hf_dec and our_dec and n_base > B and n_ours > B:
            dec_speedup = ((n_ours - B) / our_dec) / ((n_base - B) / hf_dec)
        identical = (ours == base) if not args.do_sample else None
        result.update(
            baseline_tokens_per_s=base_tps,
            baseline_time_s=hf_wall,
            baseline_token_ids=base,
            speedup=(stats["wall_tokens_per_s"] / base_tps) if base_tps and stats["wall_tokens_per_s"] else None,
            decode_speedup=dec_speedup,
            identical=identical,
        )

    if args.json:
        print(json.dumps(_jsonable(result), default=str))
        return 0

    if not stream_text:
        for i, t in enumerate(result["text"]):
            if B > 1:
                print(f"=== row {i} ===")
            print(t)
        sys.stdout.flush()
    _eprint(f"--- {args.algorithm} stats ---")
    for line in _fmt_stats(stats):
        _eprint(line)
    _eprint(f"wall                 {wall:.2f}s for {n_ours} tokens = {stats['wall_tokens_per_s']:.2f} tok/s (incl. prefill)")
    if args.compare:
        _eprint("--- comparison with plain greedy decoding (HF model.generate) ---")
        _eprint(f"HF generate          {result['baseline_time_s']:.2f}s for {sum(len(r) for r in result['baseline_token_ids'])} "
                f"tokens = {result['baseline_tokens_per_s']:.2f} tok/s (incl. prefill)")
        sp = result["speedup"]
        _eprint(f"speedup              {sp:.2f}x end to end" + (
            f", {result['decode_speedup']:.2f}x decode only (prefill excluded)" if result["decode_speedup"] else ""))
        if result["identical"] is None:
            _eprint("identical            n/a (sampling)")
        else:
            _eprint("identical            " + ("yes: every token equals plain greedy decoding" if result["identical"]
                                             else "NO: tokens differ from plain greedy decoding"))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``vegas`` console script; returns the exit status (0 ok, 2 bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()  # weight-loading bars; ours are tqdm on stderr
    except ImportError:
        pass
    try:
        return args.func(args)
    except CLIError as e:
        _eprint(f"vegas: error: {e}")
        return 2
    except KeyboardInterrupt:
        _eprint("vegas: interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
