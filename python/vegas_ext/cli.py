"""The ``vegas`` command: ``vegas generate`` runs self-speculative decoding on a real model.

Examples::

    vegas generate --chat --compare           # embedded SmolLM2 on the embedded 7,128-token document
    vegas generate --prompt "Hello" --chat --max-new-tokens 32
    vegas generate --model ./my-llama --prompt-file doc.txt --batch-size 4 --json

Text goes to stdout (streamed for a single row on a terminal), progress and statistics to
stderr; with ``--json`` stdout carries exactly one JSON object. Bad input ends with a one-line
``vegas: error: ...`` on stderr and exit status 2.

Start-up is cheap: this module imports only the standard library at import time, so ``--help``
and argument errors answer at once; torch, transformers and the model load after parsing.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import math
import os
import re
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

# preloaded without the package by the console script (vegas_ext_cli), so parsing needs no torch
config = sys.modules.get(f"{__package__}.config") or importlib.import_module(".config", __package__)

#: Algorithms ``--algorithm`` accepts, checked before torch is imported (a test keeps this equal
#: to the decode loop's registry, ``vegas_ext.decode.SELECTION_ALGORITHMS`` with the rivals).
ALGORITHMS = config.ALGORITHMS
DTYPES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half", "float")
#: Seconds between progress lines when stderr is not a terminal (a log file or a pipe).
LOG_INTERVAL_S = 10.0
#: A first difference is a near-tie when the gap between the two tokens' target logits is at most
#: ``NEAR_TIE_EPS[dtype] * eps * |h| * max(|w_a|, |w_b|)``: ``eps`` of the run's dtype, ``h`` the
#: final hidden state fed to the output layer, ``w_a``, ``w_b`` the two tokens' output-layer rows.
#: A logit is the dot product ``w . h``, whose rounding (and that of the forward behind ``h``)
#: scales with ``|h| |w|``, not with the logit, which cancellation can make small. Largest
#: difference measured between verification and HF's one-token step (``bench/near_tie_bound.py``,
#: docs/lossless.md), float32: 3.15 on SmolLM2-135M, 3.3 on random models with the usual init, 19
#: on 6-layer random models with 7x that init (huge attention scores); bfloat16 / float16: 0.44 on
#: SmolLM2, 2.9 on those random models. Empirical bounds, about 3x the worst measured.
NEAR_TIE_EPS = {"float32": 64.0, "bfloat16": 8.0, "float16": 8.0}
#: The rule when ``|h|`` or ``|w|`` is unknown (the output layer was not found): a gap of at most
#: this many units in the last place of the dtype at the larger of the two logits.
NEAR_TIE_ULPS = 8


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (no usage dump) and exit with status 2."""

    def error(self, message):  # noqa: D401
        self.exit(2, f"vegas: error: {message}\n")


# ---------------------------------------------------------------------------------------------
# argument parsing (standard library only)

_DECIMAL = re.compile(r"[+-]?[0-9]+")


def _parse_int(s: str) -> Optional[int]:
    """``s`` as an int if it is plain decimal digits with an optional sign, else None (``int()``
    would also take ``1_0``, surrounding spaces and non-ASCII digits)."""
    if not _DECIMAL.fullmatch(s):
        return None
    try:
        return int(s)
    except ValueError:  # more digits than int() converts
        return None


def _int(name):
    """argparse type: an integer (range checks happen in _validate, with clearer messages)."""
    def parse(s):
        v = _parse_int(s)
        if v is None:
            raise argparse.ArgumentTypeError(f"must be an integer, got {s!r}")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``vegas`` argument parser (subcommand ``generate``)."""
    p = _Parser(prog="vegas",
                description="Self-speculative decoding with verification-guided sparse attention (Vegas).")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    g = sub.add_parser(
        "generate",
        help="generate text with Vegas self-speculative decoding",
        description="Generate text with Vegas self-speculative decoding. Default: the embedded "
        "SmolLM2-135M-Instruct model on the embedded 7,128-token document (chapters 1-5 of Pride and "
        "Prejudice) with an instruction to summarize it (7,182 tokens with --chat).",
    )
    m = g.add_argument_group("model")
    m.add_argument("--model", default=None,
                   help="local HF model folder, .gguf file, or hub id already in the local HF cache "
                        "(default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF)")
    m.add_argument("--dtype", default="float32",
                   help="float32 (default), bfloat16 or float16; greedy output is plain greedy's, token for token, "
                        "except where the two best logits are within rounding (docs/lossless.md)")
    m.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available; default)")
    m.add_argument("--pack-linears", action=argparse.BooleanOptionalAction, default=True,
                   help="on CPU in float32, run the model's linear layers on weights packed once for oneDNN "
                        "(faster decoding steps; the --compare run uses the same model; default: on)")
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
                   help="sparse_attn_algorithm: vegas (default), streamingllm, quest, or full "
                        "(plain decoding through our cache and kernels)")
    d.add_argument("--ratio", type=float, default=0.05,
                   help="KV budget as a fraction of the context, in (0, 1] (default 0.05)")
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
    d.add_argument("--draft-weights", choices=("none", "fp16", "int8", "int4"), default="int8",
                   help="weights of the draft forwards' linears: int8 (default: weight-only, groups of 64), "
                        "fp16, or none (the model's own): a low-precision copy made once; verification keeps "
                        "the model's weights, so the output is unchanged (int4 is refused: too inaccurate). "
                        "int8 drafted fastest: docs/draft_weights.md")
    d.add_argument("--do-sample", action="store_true", help="sample (speculative sampling) instead of greedy decoding")
    d.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    d.add_argument("--top-k", type=_int("--top-k"), default=0, help="top-k filter, 0 = off (default)")
    d.add_argument("--top-p", type=float, default=1.0, help="nucleus filter in (0, 1] (default 1.0 = off)")
    d.add_argument("--seed", type=_int("--seed"), default=None, help="random seed (sampling)")
    d.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS; always generate --max-new-tokens")
    o = g.add_argument_group("output")
    o.add_argument("--compare", action="store_true",
                   help="also run plain greedy decoding with Hugging Face's model.generate and with our own "
                        "loop (--algorithm full); report both speedups and whether the tokens are identical "
                        "(where not: the first differing token and "
                        "the gap between the two tokens' target logits there)")
    o.add_argument("--json", action="store_true",
                   help="print one JSON object to stdout: text, new token ids, stats (and the comparison)")
    o.add_argument("--json-prompt-ids", action="store_true",
                   help="with --json: also include the prompt token ids (long: one id per prompt token)")
    o.add_argument("--no-progress", action="store_true", help="no progress lines / bars, no streaming")
    g.set_defaults(func=cmd_generate)
    return p


def _validate(args) -> None:
    """Type, range and choice checks that need no torch (so a bad flag fails in well under a
    second): the decode options through :mod:`vegas_ext.config`, as :func:`vegas_ext.generate`
    checks them, named by their flags; the CLI's own flags here."""
    gamma = args.num_speculative_tokens
    if gamma != "auto":
        if _parse_int(gamma) is None:
            raise CLIError(f"--num-speculative-tokens must be an integer >= 1 or auto, got {gamma!r}")
        gamma = args.num_speculative_tokens = _parse_int(gamma)
    values = dict(
        max_new_tokens=args.max_new_tokens, num_speculative_tokens=gamma,
        max_speculative_tokens=args.max_speculative_tokens, sparse_attn_algorithm=args.algorithm,
        sparse_attn_ratio=args.ratio, sparse_attn_min_tokens=args.min_tokens, sparse_attn_max_tokens=args.max_tokens,
        block_size=args.block_size, num_sink_blocks=args.sink_blocks, share_selection_across_heads=args.share_selection,
        query_weights=args.query_weights, selection_refresh_interval=args.refresh_interval, do_sample=args.do_sample,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
    )
    labels = {name: opt.cli for name, opt in config.OPTIONS.items() if opt.cli}
    try:
        if gamma != "auto":  # >= 1: the CLI's plain decoding is --algorithm full
            config.check_int(gamma, "--num-speculative-tokens", 1, config.INT64_MAX, what="or auto")
        config.check_generate_options(values, labels)
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        if args.batch_size is not None:
            config.check_int(args.batch_size, "--batch-size", 1, config.MAX_BATCH_SIZE)
        if args.seed is not None:
            config.check_seed(args.seed, "--seed")
    except ValueError as e:
        raise CLIError(str(e)) from None
    if str(args.dtype).lower().replace("torch.", "") not in DTYPES:
        raise CLIError(f"unknown --dtype {args.dtype!r}; choose one of float32, bfloat16, float16")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
        raise CLIError(f"--device must be cpu, cuda, cuda:N or auto, got {args.device!r}")
    if args.prompt is not None and any(p == "" for p in args.prompt):
        raise CLIError("--prompt must not be empty")
    if args.json_prompt_ids and not args.json:
        raise CLIError("--json-prompt-ids needs --json")


# ---------------------------------------------------------------------------------------------
# prompts and tokens

def _eprint(*a, **k):
    print(*a, file=sys.stderr, flush=True, **k)


def _read_prompts(args) -> List[str]:
    if args.prompt_file is not None:
        if args.prompt_file == "-":
            text = _read_stdin()
        else:
            if os.path.isdir(args.prompt_file):
                raise CLIError(f"--prompt-file {args.prompt_file} is a directory, not a text file")
            # any other readable path: a pipe (<(cmd), /dev/fd/N, a FIFO) or a device as well as a file
            if not os.path.exists(args.prompt_file):
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


def _read_stdin() -> str:
    """The prompt from stdin (``--prompt-file -``) as UTF-8 text, whatever the locale says."""
    if sys.stdin is None:  # stdin closed (`<&-`) or none given (pythonw, some embedders)
        raise CLIError("--prompt-file -: no stdin to read (it is closed)")
    buf = getattr(sys.stdin, "buffer", None)
    try:
        if buf is None:  # a text stream without bytes underneath (tests, embedding)
            return sys.stdin.read()
        return buf.read().decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # as text mode's newlines
    except UnicodeDecodeError as e:
        raise CLIError(f"--prompt-file -: stdin is not UTF-8 text ({e})") from None
    except (OSError, ValueError) as e:  # a stdin that cannot be read (closed file object, EBADF, EISDIR)
        raise CLIError(f"--prompt-file -: cannot read stdin ({e})") from None


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


# ---------------------------------------------------------------------------------------------
# progress on stderr: a tqdm bar on a terminal, a line every LOG_INTERVAL_S in a log file

class _LogBar:
    """The non-terminal stand-in for a tqdm bar: no ``\\r``; a line at most every ``interval`` s."""

    def __init__(self, desc: str, total: Optional[int], unit: str, interval: float = LOG_INTERVAL_S):
        self.desc, self.total, self.unit, self.interval = desc, total, unit, interval
        self.n = 0
        self._t0 = self._last = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self._last >= self.interval:
            self._last = now
            of = f"/{self.total}" if self.total else ""
            _eprint(f"vegas: {self.desc}: {self.n}{of} {self.unit}s, {now - self._t0:.0f} s ...")

    def close(self) -> None:
        pass


def _bar(desc: str, total: Optional[int], unit: str):
    if sys.stderr.isatty():
        from tqdm.auto import tqdm

        try:  # a terminal that reports 0 columns (some ptys) would get an empty bar
            sized = os.get_terminal_size(sys.stderr.fileno()).columns > 0
        except (OSError, ValueError, AttributeError):
            sized = False
        return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=sized,
                    ncols=None if sized else 80, nrows=None if sized else 24)
    return _LogBar(desc, total, unit)


def _decoder_layers(model):
    """The model's list of decoder layers (``model.model.layers`` for Llama/Qwen/Mistral), or None."""
    import torch

    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
        return layers
    for mod in model.modules():  # other layouts: the first ModuleList of num_hidden_layers blocks
        if isinstance(mod, torch.nn.ModuleList) and n and len(mod) == n:
            return mod
    return None


class RunProgress:
    """Progress of one generation run (ours or HF's) on stderr, in two phases.

    * prefill: the prompt's forward pass, counted layer by layer (forward hooks on the decoder
      layers), so a long prompt on a CPU shows where it is and how long it has left;
    * decoding: ``decode_bar="token"``: new tokens (from the streamer: batch size 1, or HF's
      ``generate``); ``"forward pass"``: forward passes (our loop with several rows, which
      streams nothing); ``None``: no bar (the text itself streams to the terminal).

    Each phase ends with one summary line (``vegas: prefill (vegas): 7,182 tokens in 94.1 s``).
    On a terminal the bars are tqdm bars erased when done; elsewhere (a log file, a pipe) a line
    at most every :data:`LOG_INTERVAL_S` seconds, never a ``\\r``. ``streamer`` is a HF-style
    streamer (``put`` / ``end``) to pass to ``generate``; it records ``t_first`` (the first new
    token: end of prefill) and ``t_end``, and forwards to ``inner`` (e.g. a ``TextStreamer``).
    Use as a context manager around the run; ``show=False`` only records times.
    """

    def __init__(self, model, label: str, batch_size: int, prompt_tokens: int, max_new_tokens: int,
                 show: bool = True, decode_bar: Optional[str] = "token", inner=None):
        if decode_bar not in ("token", "forward pass", None):
            raise ValueError(f"decode_bar must be 'token', 'forward pass' or None, got {decode_bar!r}")
        self.label, self.batch_size, self.prompt_tokens = label, batch_size, prompt_tokens
        self.max_new_tokens, self.show, self.decode_bar, self.inner = max_new_tokens, show, decode_bar, inner
        self.layers = _decoder_layers(model) if show else None
        self.phase = "prefill"
        self.t_start = time.perf_counter()
        self.t_first: Optional[float] = None
        self.t_end: Optional[float] = None
        self.count = 0  # new tokens per row reported by the streamer
        self._forwards = 0
        self._hooks: list = []
        self._bar = None
        self._prompt_seen = False

    # -- context manager: hooks on while the run lasts
    def __enter__(self):
        self.t_start = time.perf_counter()
        if self.show:
            if self.layers is not None:
                last = len(self.layers) - 1
                for i, layer in enumerate(self.layers):
                    self._hooks.append(layer.register_forward_hook(self._layer_hook(i == last)))
                self._bar = _bar(f"prefill ({self.label})", len(self.layers), "layer")
            if not sys.stderr.isatty():
                _eprint(f"vegas: prefill ({self.label}): {self._rows_tokens()} ...")
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.phase == "prefill":
            self._end_prefill()
        self._close_bar()
        if self.show and exc[0] is None:
            t = (self.t_end or time.perf_counter()) - (self.t_first or self.t_start)
            done = f"{self.count} tokens" if self.count else f"{self._forwards} forward passes"
            per_row = " per row" if self.batch_size > 1 else ""
            rate = f" ({self.count / t:.2f} tokens/s{per_row})" if self.count and t > 0 else ""
            _eprint(f"vegas: decoding ({self.label}): {done} in {t:.1f} s{rate}")
        return False

    def _rows_tokens(self) -> str:
        rows = f"{self.batch_size} rows x " if self.batch_size > 1 else ""
        return f"{rows}{self.prompt_tokens:,} tokens"

    def _close_bar(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _end_prefill(self):
        self.phase = "decoding"
        self._close_bar()
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if self.show:
            _eprint(f"vegas: prefill ({self.label}): {self._rows_tokens()} in {self.t_first - self.t_start:.1f} s")
            if self.decode_bar == "token":
                self._bar = _bar(f"decoding ({self.label})", self.max_new_tokens, "token")
            elif self.decode_bar == "forward pass" and self.layers is not None:
                self._bar = _bar(f"decoding ({self.label})", None, "forward pass")

    def _layer_hook(self, is_last: bool):
        def hook(module, inputs, output):
            if self.phase == "prefill":
                if self._bar is not None:
                    self._bar.update(1)
                if is_last:
                    self._end_prefill()
            elif is_last:
                self._forwards += 1
                if self.decode_bar == "forward pass" and self._bar is not None:
                    self._bar.update(1)
        return hook

    # -- the streamer interface (HF's put / end)
    @property
    def streamer(self):
        return self

    def put(self, value):
        if self.inner is not None:
            self.inner.put(value)
        if not self._prompt_seen:  # the first put carries the prompt
            self._prompt_seen = True
            return
        if self.phase == "prefill":
            self._end_prefill()
        if value.dim() >= 2:
            n = value.shape[-1]
        elif self.batch_size == 1:
            n = value.numel()
        else:
            n = 1
        self.count += n
        if self.decode_bar == "token" and self._bar is not None:
            self._bar.update(n)

    def end(self):
        if self.inner is not None:
            self.inner.end()
        self.t_end = time.perf_counter()
        self._close_bar()


# ---------------------------------------------------------------------------------------------
# the comparison with plain greedy decoding

class _ChosenLogits:
    """HF ``LogitsProcessor`` that records, at each step, the target's logit of the token plain
    greedy picks (the maximum) and of the token our loop emitted at that step, and the rounding
    scale of the pair, ``|h| * max(|w_max|, |w_ours|)`` (see :data:`NEAR_TIE_EPS`; ``None`` until
    :meth:`attach` found the output layer); scores unchanged."""

    def __init__(self, ours: List[List[int]]):
        self.ours = ours
        self.steps: List[List[Optional[tuple]]] = []  # [step][row] -> (logit max, logit ours, scale) or None
        self._h = None  # [B, H] the output layer's input at the last position of the latest forward
        self._w_norm = None  # [V] float32 norms of the output layer's rows
        self._hook = None

    def attach(self, model) -> None:
        """Hooks ``model``'s output layer to see its input ``h`` (for the rounding scale)."""
        import torch

        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        w = getattr(head, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            return
        with torch.no_grad():
            self._w_norm = w.detach().float().norm(dim=1)

        def grab(module, args):  # inputs unchanged (returns None)
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.dim() in (2, 3):
                self._h = x[:, -1] if x.dim() == 3 else x

        self._hook = head.register_forward_pre_hook(grab)

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._h = None

    def __call__(self, input_ids, scores):
        step = len(self.steps)
        row_vals = []
        mx, arg = scores.max(dim=-1)
        h = self._h if self._h is not None and self._h.shape[0] == scores.shape[0] else None
        h_norm = h.float().norm(dim=-1) if h is not None else None
        for r, toks in enumerate(self.ours):
            if step < len(toks):
                scale = None
                if h_norm is not None and toks[step] < len(self._w_norm) and int(arg[r]) < len(self._w_norm):
                    scale = float(h_norm[r]) * max(float(self._w_norm[int(arg[r])]), float(self._w_norm[toks[step]]))
                row_vals.append((float(mx[r]), float(scores[r, toks[step]]), scale))
            else:
                row_vals.append(None)
        self.steps.append(row_vals)
        return scores


def _ulp(x: float, dtype) -> float:
    """Unit in the last place of ``x`` in ``dtype`` (float32 / bfloat16 / float16)."""
    import torch

    eps = torch.finfo(dtype).eps
    tiny = torch.finfo(dtype).tiny
    if not math.isfinite(x):  # a masked logit (-inf): no rounding scale, never a near-tie
        return math.inf
    ax = max(abs(x), tiny)
    return eps * 2.0 ** math.floor(math.log2(ax))


def near_tie_eps(dtype) -> float:
    """The near-tie bound of ``dtype`` (a ``torch.dtype``) in units of ``eps * |h| * max|w|``:
    :data:`NEAR_TIE_EPS` (64 for dtypes not listed there)."""
    return NEAR_TIE_EPS.get(str(dtype).replace("torch.", ""), 64.0)


def near_tie_tolerance(scale: float, dtype) -> float:
    """The largest gap between two target logits (in logits) that is a near-tie: rounding may
    order them either way. ``scale``: ``|h| * max(|w_a|, |w_b|)``, the norms of the output layer's
    input and of the two tokens' rows; ``dtype``: the model's floating ``torch.dtype``. Returns
    ``near_tie_eps(dtype) * eps(dtype) * scale`` (see :data:`NEAR_TIE_EPS`)."""
    import torch

    return near_tie_eps(dtype) * torch.finfo(dtype).eps * float(scale)


def first_difference(ours: List[List[int]], base: List[List[int]], recorder: Optional[_ChosenLogits],
                     dtype) -> Optional[Dict[str, Any]]:
    """Where our greedy tokens first differ from plain greedy decoding's, and why.

    Returns ``None`` when every row is identical, else a dict: ``row``, ``token`` (0-based index
    among the new tokens), ``ours`` / ``baseline`` (the two token ids), ``logit_ours`` /
    ``logit_baseline`` (the target's logits of both tokens at that position, from the baseline's
    own forward, whose prefix both runs share there), ``abs_delta_logit``, ``ulps`` (that gap in
    units in the last place of ``dtype`` at the larger logit), ``eps_units`` (the gap over
    ``eps(dtype) * |h| * max(|w_ours|, |w_baseline|)``, the rounding scale of the two logits; None
    when the output layer's input was not seen), ``tolerance`` (the largest gap that counts as a
    near-tie there, in logits), ``eps_bound`` (:func:`near_tie_eps` of ``dtype``) and ``near_tie``
    (``eps_units <= eps_bound``; without ``eps_units``, ``ulps <=`` :data:`NEAR_TIE_ULPS`). A row
    that merely ends earlier (EOS) counts as a difference at its end.
    """
    import torch

    best = None
    for r, (a, b) in enumerate(zip(ours, base)):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if n is None and len(a) != len(b):
            n = min(len(a), len(b))
        if n is not None and (best is None or n < best[1]):
            best = (r, n)
    if best is None:
        return None
    r, n = best
    d: Dict[str, Any] = {"row": r, "token": n,
                         "ours": ours[r][n] if n < len(ours[r]) else None,
                         "baseline": base[r][n] if n < len(base[r]) else None,
                         "logit_ours": None, "logit_baseline": None, "abs_delta_logit": None,
                         "ulps": None, "eps_units": None, "tolerance": None, "eps_bound": near_tie_eps(dtype),
                         "near_tie": False}
    vals = recorder.steps[n][r] if recorder is not None and n < len(recorder.steps) else None
    if vals is not None and d["ours"] is not None:
        lb, lo = vals[0], vals[1]
        scale = vals[2] if len(vals) > 2 else None
        gap = abs(lb - lo)
        ulp = _ulp(max(abs(lb), abs(lo)), dtype)
        d.update(logit_ours=lo, logit_baseline=lb, abs_delta_logit=gap, ulps=gap / ulp)
        if scale is not None and scale > 0 and math.isfinite(scale):
            tol = near_tie_tolerance(scale, dtype)
            d.update(eps_units=gap / (torch.finfo(dtype).eps * scale), tolerance=tol, near_tie=gap <= tol)
        else:
            d.update(tolerance=NEAR_TIE_ULPS * ulp, near_tie=gap <= NEAR_TIE_ULPS * ulp)
    return d


#: The lossless contract in one line, as ``--compare`` prints it.
CONTRACT = ("greedy output equals plain greedy decoding except where the two best target logits are "
            "within rounding, in any dtype (docs/lossless.md)")


def identical_line(identical: Optional[bool], diff: Optional[Dict[str, Any]], dtype_name: str) -> str:
    """The ``identical`` line of ``--compare``, stating the lossless contract exactly."""
    if identical is None:
        return "n/a (sampling: the output follows the target distribution, not plain greedy's tokens)"
    if identical:
        return "yes: every token equals plain greedy decoding"
    if diff is None:
        return "NO: tokens differ from plain greedy decoding"
    where = f"token {diff['token']}" + (f" of row {diff['row']}" if diff["row"] else "")
    if diff["abs_delta_logit"] is None:
        return f"NO: differs at {where} (a row ended early)"
    gap = f"|Δlogit| = {diff['abs_delta_logit']:.4g} = {diff['ulps']:.1f} {dtype_name} ulp"
    if diff.get("eps_units") is not None:
        gap += f" = {diff['eps_units']:.2f} eps·|h|·|w|, near-tie up to {diff['eps_bound']:g}"
    else:
        gap += f", near-tie up to {NEAR_TIE_ULPS} ulp"
    if diff["near_tie"]:
        return f"differs at {where} (near-tie, {gap}): {CONTRACT}"
    return f"NO: differs at {where} ({gap}; not a near-tie): a lossless violation, please report it"


def _run_hf(model, ids, mask, max_new_tokens, eos, pad_id, progress: Optional[RunProgress], recorder=None):
    """Plain greedy decoding with HF ``model.generate``; returns (sequences, wall seconds)."""
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    gc = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False,
                          num_beams=1, eos_token_id=list(eos), pad_token_id=pad_id)  # [] = never stop (None would
    # fall back to the model's generation_config)
    kw = {}
    if recorder is not None:
        kw["logits_processor"] = LogitsProcessorList([recorder])
    # HF fills options left at their defaults from model.generation_config (a repetition penalty,
    # suppressed tokens, ...): the baseline is plain greedy decoding, as our loop decodes
    saved, model.generation_config = model.generation_config, GenerationConfig()
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc,
                                 streamer=progress.streamer if progress is not None else None, **kw)
    finally:
        model.generation_config = saved
    _sync(ids.device)
    return out, time.perf_counter() - t0


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
            f"(drafts {g('num_drafts', '{}')}, draft tokens {g('num_draft_tokens', '{}')}, "
            f"accepted {g('num_accepted_tokens', '{}')})",
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
    hist = stats.get("gamma_histogram")
    if hist is not None and stats.get("num_iterations") is not None:  # did speculation happen at all?
        lines.append(f"speculated           {sum(hist[1:])} of {stats['num_iterations']} iterations drafted")
    if stats.get("draft_weights_bytes"):
        lines.append(f"draft weights        {stats.get('draft_weights_format')}: a copy of "
                     f"{stats['draft_weights_bytes'] / 2**20:.1f} MiB (made in {g('time_draft_weights_s', '{:.2f}')}s)")
    parts = [f"{k[5:-2]} {stats[k]:.2f}s" for k in ("time_prefill_s", "time_draft_s", "time_verify_s", "time_select_s")
             if isinstance(stats.get(k), (int, float))]
    if parts:
        lines.append(f"time                 total {g('time_total_s', '{:.2f}')}s = " + ", ".join(parts) + " (+ rest)")
    return lines


# ---------------------------------------------------------------------------------------------
# vegas generate

def _resolve_device_dtype(args):
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
    return device, dtype


@contextlib.contextmanager
def _quiet_conversion_bar():
    """transformers' GGUF conversion bar (its own tqdm, ~300 ``\\r`` updates) off when stderr is
    not a terminal; the load's start and end lines say what happens."""
    try:
        if sys.stderr.isatty():
            raise ImportError
        from tqdm.auto import tqdm
        from transformers import modeling_gguf_pytorch_utils as gguf_utils

        old = gguf_utils.tqdm
    except (ImportError, AttributeError):
        yield
        return
    gguf_utils.tqdm = functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = old


def _load(args, dtype, device, show: bool):
    from . import models

    name = args.model or "the embedded SmolLM2-135M-Instruct"
    if show:
        first = (f"; first use: converting the GGUF file once (~0.5-2 min), cached in {models.cache_root()}"
                 if models.needs_conversion(args.model) else "")
        _eprint(f"vegas: loading {name}{first} ...")
    try:
        with _quiet_conversion_bar():
            model, tok = models.load_model(args.model, dtype=dtype, device=device)
    except ValueError as e:
        raise CLIError(str(e).splitlines()[0]) from None
    info = models.last_load_info
    packed = 0
    if args.pack_linears:
        from .packed_linear import pack_linear_weights

        packed = pack_linear_weights(model)  # 0 unless CPU float32 (see vegas_ext.packed_linear)
    if show:
        _eprint(f"vegas: loaded in {info.get('seconds', 0):.1f} s ({info.get('how')}): "
                f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.3g}M params, "
                f"{str(dtype).replace('torch.', '')}, {device}"
                + (f"; {packed} linears on oneDNN-packed weights" if packed else ""))
    return model, tok, packed


def _fit_positions(model, rows, max_new: int, show: bool) -> int:
    max_pos = getattr(model.config, "max_position_embeddings", None)
    longest = max(len(r) for r in rows)
    if max_pos is not None:
        if longest >= max_pos:
            raise CLIError(f"prompt has {longest} tokens but the model has only {max_pos} positions "
                           f"(room for at most {max_pos - 1} prompt tokens)")
        if longest + max_new > max_pos:
            max_new = max_pos - longest
            if show:
                _eprint(f"vegas: note: --max-new-tokens lowered to {max_new} to fit the model's {max_pos} positions")
    return max_new


def _generate_kwargs(args, max_new, eos, pad_id, generator) -> Dict[str, Any]:
    return dict(
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
        generator=generator,
        draft_weights=None if args.draft_weights == "none" else args.draft_weights,
    )


def _compare(model, ids, mask, rows, ours, stats, wall, max_new, eos, pad_id, dtype, args, show) -> Dict[str, Any]:
    """Runs HF's plain greedy ``generate`` on the same prompt; returns the comparison fields."""
    B = len(rows)
    recorder = None if args.do_sample else _ChosenLogits(ours)
    prog = RunProgress(model, "HF generate", B, max(len(r) for r in rows), max_new, show=show)
    if recorder is not None:
        recorder.attach(model)
    try:
        with prog:
            hf_out, hf_wall = _run_hf(model, ids, mask, max_new, eos, pad_id, prog, recorder)
    finally:
        if recorder is not None:
            recorder.detach()
    base = new_tokens(hf_out, ids.shape[1], eos, max_new)
    n_ours, n_base = sum(len(r) for r in ours), sum(len(r) for r in base)
    base_tps = n_base / hf_wall if hf_wall > 0 else None
    # Decode-only rates leave out prefill (the same work for both): HF's from its streamer
    # (time of the first new token), ours from stats["time_prefill_s"].
    hf_dec = (prog.t_end or 0) - (prog.t_first or 0) if prog.t_first else None
    our_pre = stats.get("time_prefill_s")
    our_dec = wall - our_pre if isinstance(our_pre, (int, float)) else None
    dec_speedup = None
    if hf_dec and our_dec and n_base > B and n_ours > B:
        dec_speedup = ((n_ours - B) / our_dec) / ((n_base - B) / hf_dec)
    identical = (ours == base) if not args.do_sample else None
    diff = first_difference(ours, base, recorder, dtype) if identical is False else None
    return dict(
        baseline_tokens_per_s=base_tps,
        baseline_time_s=hf_wall,
        baseline_token_ids=base,
        speedup=(stats["wall_tokens_per_s"] / base_tps) if base_tps and stats["wall_tokens_per_s"] else None,
        decode_speedup=dec_speedup,
        identical=identical,
        first_difference=diff,
    )


def _compare_plain(model, ids, mask, kwargs, stats, wall, ours, eos, max_new) -> Dict[str, Any]:
    """Runs our own plain loop (``sparse_attn_algorithm="full"``) on the same prompt: what
    speculation itself gained, apart from the loop's kernels. Returns the comparison fields."""
    from . import generate

    B = ids.shape[0]
    t0 = time.perf_counter()
    out = generate(model, ids, mask, **{**kwargs, "sparse_attn_algorithm": "full", "block_size": None,
                                       "draft_weights": None, "streamer": None})
    _sync(ids.device)
    plain_wall = time.perf_counter() - t0
    plain = new_tokens(out.sequences, ids.shape[1], eos, max_new)
    n_ours, n_plain = sum(len(r) for r in ours), sum(len(r) for r in plain)
    plain_tps = n_plain / plain_wall if plain_wall > 0 else None
    plain_dec = plain_wall - out.stats["time_prefill_s"]
    our_pre = stats.get("time_prefill_s")
    our_dec = wall - our_pre if isinstance(our_pre, (int, float)) else None
    dec = None
    if our_dec and plain_dec > 0 and n_plain > B and n_ours > B:
        dec = ((n_ours - B) / our_dec) / ((n_plain - B) / plain_dec)
    return dict(
        plain_time_s=plain_wall,
        plain_tokens_per_s=plain_tps,
        speedup_vs_plain=(stats["wall_tokens_per_s"] / plain_tps) if plain_tps and stats["wall_tokens_per_s"] else None,
        decode_speedup_vs_plain=dec,
        plain_identical=(ours == plain) if not kwargs.get("do_sample") else None,
    )


def _print_human(result, stats, wall, n_ours, algorithm, dtype_name, printed_text: bool) -> None:
    B = len(result["text"])
    if not printed_text:
        for i, t in enumerate(result["text"]):
            if B > 1:
                print(f"=== row {i} ===")
            print(t)
        sys.stdout.flush()
    _eprint(f"--- {algorithm} stats ---")
    for line in _fmt_stats(stats):
        _eprint(line)
    _eprint(f"wall                 {wall:.2f}s for {n_ours} tokens = {stats['wall_tokens_per_s']:.2f} tok/s "
            "(incl. prefill)")
    if "identical" in result:
        _eprint("--- comparison with plain greedy decoding (HF model.generate) ---")
        _eprint(f"HF generate          {result['baseline_time_s']:.2f}s for "
                f"{sum(len(r) for r in result['baseline_token_ids'])} tokens = "
                f"{result['baseline_tokens_per_s']:.2f} tok/s (incl. prefill)")
        sp = result["speedup"]
        _eprint(f"speedup              {sp:.2f}x end to end" + (
            f", {result['decode_speedup']:.2f}x decode only (prefill excluded)" if result["decode_speedup"] else ""))
        _eprint("identical            "
                + identical_line(result["identical"], result.get("first_difference"), dtype_name))
    if result.get("plain_time_s") is not None:
        _eprint("--- comparison with our own plain loop (--algorithm full, same kernels, no drafts) ---")
        _eprint(f"plain loop           {result['plain_time_s']:.2f}s = {result['plain_tokens_per_s']:.2f} tok/s "
                "(incl. prefill)")
        sp, dsp = result.get("speedup_vs_plain"), result.get("decode_speedup_vs_plain")
        _eprint(f"speedup (vegas)      {sp:.2f}x end to end" + (f", {dsp:.2f}x decode only" if dsp else "")
                + f" vs our plain loop; {result['speedup']:.2f}x vs HF generate"
                + ("" if result.get("plain_identical") in (None, True) else "; tokens differ from the plain loop's"))


def cmd_generate(args) -> int:
    """Runs ``vegas generate`` with parsed ``args``; returns the exit status."""
    _validate(args)
    prompts = _read_prompts(args)  # before the (slow) imports and model load, so a bad file fails fast
    show = not args.no_progress
    if show:
        _eprint("vegas: starting (importing torch and transformers) ...")

    import torch

    from . import generate  # the decode loop, with every selection algorithm registered
    from .decode import SELECTION_ALGORITHMS

    _quiet_transformers()
    device, dtype = _resolve_device_dtype(args)
    if args.block_size is None:  # the algorithm's own default (vegas: 1, others: 16)
        args.block_size = SELECTION_ALGORITHMS[args.algorithm].default_block_size
    model, tok, packed = _load(args, dtype, device, show)

    rows = _encode(tok, prompts, args.chat)
    max_new = _fit_positions(model, rows, args.max_new_tokens, show)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    ids, mask = _left_pad(rows, pad_id, device)
    eos = [] if args.ignore_eos else _eos_ids(model, tok)
    B = len(rows)
    dtype_name = str(dtype).replace("torch.", "")
    if show:
        _eprint(f"vegas: prompt: {B} row{'s' if B > 1 else ''} of {', '.join(f'{len(r):,}' for r in rows[:8])}"
                f"{' ...' if B > 8 else ''} "
                f"tokens{' (chat template)' if args.chat else ''}; up to {max_new} new tokens per row with "
                f"{args.algorithm}, gamma {args.num_speculative_tokens}, ratio {args.ratio}, block {args.block_size}")

    generator = None
    if args.seed is not None:
        torch.manual_seed(args.seed)
        generator = torch.Generator(device=device).manual_seed(args.seed)
        if args.do_sample and args.num_speculative_tokens == "auto" and args.algorithm != "full":
            _eprint("vegas: note: --seed with sampling and --num-speculative-tokens auto samples the same "
                    "distribution on every run, but the drafts per iteration follow this run's timings, so "
                    "the tokens can differ between runs; give a fixed --num-speculative-tokens for "
                    "identical output")
    kwargs = _generate_kwargs(args, max_new, eos, pad_id, generator)

    if args.compare:  # warm both paths up (first-call allocations, lazy inits) on a short prompt
        w_ids, w_mask = ids[:, -min(16, ids.shape[1]):], mask[:, -min(16, ids.shape[1]):]
        with torch.inference_mode():
            generate(model, w_ids, w_mask, **{**kwargs, "max_new_tokens": 2})
            if args.algorithm != "full":
                generate(model, w_ids, w_mask, **{**kwargs, "max_new_tokens": 2, "sparse_attn_algorithm": "full",
                                                  "block_size": None, "draft_weights": None})
            _run_hf(model, w_ids, w_mask, 2, eos, pad_id, None)

    # The decode loop streams batch size 1 only. Text streams to stdout when it is a terminal
    # (then the text is the decoding progress); otherwise a token bar / progress lines on stderr.
    stream_text = show and not args.json and B == 1 and sys.stdout.isatty()
    inner = None
    if stream_text:
        from transformers import TextStreamer

        inner = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    prog = RunProgress(model, args.algorithm, B, max(len(r) for r in rows), max_new, show=show,
                       decode_bar=None if stream_text else ("token" if B == 1 else "forward pass"), inner=inner)
    t0 = time.perf_counter()
    try:
        with prog, torch.inference_mode():
            out = generate(model, ids, mask, streamer=prog.streamer if B == 1 else None, **kwargs)
    except ValueError as e:  # e.g. an unsupported model / config refused by the decode loop
        raise CLIError(str(e).splitlines()[0]) from None
    _sync(device)
    wall = time.perf_counter() - t0  # (a streamed text already ended with its newline: TextStreamer.end)
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
        "dtype": dtype_name,
        "device": str(device),
        "packed_linears": packed,
        "draft_weights": args.draft_weights,
        "prompt_lengths": [len(r) for r in rows],
        "text": [tok.decode(r, skip_special_tokens=True) for r in ours],
        "token_ids": ours,
        "stats": _jsonable(stats),
    }
    if args.json_prompt_ids:
        result["prompt_token_ids"] = rows
    if args.compare:
        result.update(_compare(model, ids, mask, rows, ours, stats, wall, max_new, eos, pad_id, dtype, args, show))
        if args.algorithm != "full":
            with torch.inference_mode():
                result.update(_compare_plain(model, ids, mask, kwargs, stats, wall, ours, eos, max_new))

    if args.json:
        print(json.dumps(_jsonable(result), default=str))
    else:
        _print_human(result, stats, wall, n_ours, args.algorithm, dtype_name, printed_text=stream_text)
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
        return args.func(args)
    except CLIError as e:
        _eprint(f"vegas: error: {e}")
        return 2
    except KeyboardInterrupt:
        _eprint("vegas: interrupted")
        return 130


def _quiet_transformers() -> None:
    """transformers' own warnings and weight-loading bars off (ours are on stderr)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
