"""The ``vegas`` flags: the parser and the checks that need no torch (standard library only).

:func:`build_parser` builds the parser; :func:`_validate` checks the parsed flags (the decode
options through :mod:`vegas_ext.config`, as :func:`vegas_ext.generate` checks them) and returns a
checked copy. Both run before torch is imported, so ``--help`` and a bad flag answer at once.
"""
from __future__ import annotations

import argparse
import os
import re
from typing import Any, Dict, Optional

from ..config import (
    ALGORITHMS,
    DEFAULT_BLOCK_SIZE,
    DRAFT_WEIGHTS,
    INT64_MAX,
    MAX_BATCH_SIZE,
    OPTIONS,
    REFUSED_DRAFT_WEIGHTS,
    check_generate_options,
    check_int,
    check_model_path,
    check_seed,
)

__all__ = ["ALGORITHMS", "DTYPES", "CLIError", "build_parser"]

#: ``--dtype`` spellings accepted before torch is imported (``models.parse_dtype`` maps them).
DTYPES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half", "float")


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (no usage dump) and exit with status 2."""

    def error(self, message):  # noqa: D401
        self.exit(2, f"vegas: error: {message}\n")


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


#: ``--draft-weights`` values: :data:`vegas_ext.config.DRAFT_WEIGHTS`, ``None`` spelled ``none``.
DRAFT_WEIGHT_FLAGS = tuple("none" if v is None else v for v in DRAFT_WEIGHTS)


def _draft_weights(s: str) -> str:
    """argparse type of ``--draft-weights``: a measured-and-refused value (int4) fails here with
    its reason, before argparse's generic "invalid choice"."""
    if s in REFUSED_DRAFT_WEIGHTS:
        raise argparse.ArgumentTypeError(f"{s!r} is not supported: {REFUSED_DRAFT_WEIGHTS[s]}")
    return s


def build_parser() -> argparse.ArgumentParser:
    """The ``vegas`` argument parser: subcommand ``generate`` (``args.command``), its flags in
    four groups (model, prompt, decoding, output)."""
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
    _model_flags(g.add_argument_group("model"))
    _prompt_flags(g.add_argument_group("prompt"))
    d = g.add_argument_group("decoding")
    _speculation_flags(d)
    _selection_flags(d)
    _sampling_flags(d)
    _output_flags(g.add_argument_group("output"))
    return p


def _model_flags(m) -> None:
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


def _prompt_flags(pr) -> None:
    src = pr.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", default=None,
                     help="prompt text; repeat to form a batch (default: the embedded document with its instruction)")
    src.add_argument("--prompt-file", default=None, help="read the prompt from this file ('-' for stdin)")
    pr.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    pr.add_argument("--batch-size", type=_int("--batch-size"), default=None,
                    help="number of rows: the prompt(s) repeated cyclically (default: one row per prompt)")


def _speculation_flags(d) -> None:
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


def _selection_flags(d) -> None:
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
    d.add_argument("--draft-weights", type=_draft_weights, choices=DRAFT_WEIGHT_FLAGS, default="int8",
                   help="weights of the draft forwards' linears: int8 (default: weight-only, groups of 64), "
                        "fp16, or none (the model's own): a low-precision copy made once; verification keeps "
                        "the model's weights, so the output is unchanged. int8 drafted fastest: "
                        "docs/draft_weights.md")


def _sampling_flags(d) -> None:
    d.add_argument("--do-sample", action="store_true", help="sample (speculative sampling) instead of greedy decoding")
    d.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    d.add_argument("--top-k", type=_int("--top-k"), default=0, help="top-k filter, 0 = off (default)")
    d.add_argument("--top-p", type=float, default=1.0, help="nucleus filter in (0, 1] (default 1.0 = off)")
    d.add_argument("--seed", type=_int("--seed"), default=None, help="random seed (sampling)")
    d.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS; always generate --max-new-tokens")


def _output_flags(o) -> None:
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


def _validate(args) -> argparse.Namespace:
    """Checks the parsed flags with no torch (so a bad flag fails in well under a second) and
    returns a checked copy of ``args``: ``num_speculative_tokens`` an int or ``"auto"``,
    ``block_size`` the algorithm's default where not given. ``args`` itself is left unchanged.
    Raises :class:`CLIError` naming the flag and what it expects."""
    gamma = args.num_speculative_tokens
    if gamma != "auto":
        if _parse_int(gamma) is None:
            raise CLIError(f"--num-speculative-tokens must be an integer >= 1 or auto, got {gamma!r}")
        gamma = _parse_int(gamma)
    try:
        _check_decode_options(args, gamma)
    except ValueError as e:
        raise CLIError(str(e)) from None
    _check_cli_flags(args)
    block_size = DEFAULT_BLOCK_SIZE[args.algorithm] if args.block_size is None else args.block_size
    return argparse.Namespace(**{**vars(args), "num_speculative_tokens": gamma, "block_size": block_size})


def decode_options(args) -> Dict[str, Any]:
    """The flag table: every :func:`vegas_ext.generate` option that has a flag
    (``config.OPTIONS[name].cli``), mapped from its API name to the flag's parsed value."""
    return {name: getattr(args, opt.cli[2:].replace("-", "_")) for name, opt in OPTIONS.items() if opt.cli}


def _check_decode_options(args, gamma) -> None:
    """The decode options through :mod:`vegas_ext.config`, as :func:`vegas_ext.generate` checks
    them, named by their flags; raises ``ValueError``."""
    values = {**decode_options(args), "num_speculative_tokens": gamma}
    labels = {name: opt.cli for name, opt in OPTIONS.items() if opt.cli}
    if gamma != "auto":  # >= 1: the CLI's plain decoding is --algorithm full
        check_int(gamma, "--num-speculative-tokens", 1, INT64_MAX, what="or auto")
    check_generate_options(values, labels)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size is not None:
        check_int(args.batch_size, "--batch-size", 1, MAX_BATCH_SIZE)
    if args.seed is not None:
        check_seed(args.seed, "--seed")


def check_model_flag(args) -> None:
    """``--model`` as far as it can be checked without torch (a missing path, a file that is not
    ``.gguf``, a folder that is no model): :class:`CLIError` naming the flag, seconds before the
    imports and the load would fail on it."""
    if args.model is not None:
        try:
            check_model_path(os.path.expanduser(args.model))
        except ValueError as e:
            raise CLIError(f"--model: {e}") from None


def _check_cli_flags(args) -> None:
    """The CLI's own flags (dtype, device, prompt, output); raises :class:`CLIError`."""
    if str(args.dtype).lower().replace("torch.", "") not in DTYPES:
        raise CLIError(f"unknown --dtype {args.dtype!r}; choose one of float32, bfloat16, float16")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
        raise CLIError(f"--device must be cpu, cuda, cuda:N or auto, got {args.device!r}")
    if args.prompt is not None and any(p == "" for p in args.prompt):
        raise CLIError("--prompt must not be empty")
    if args.json_prompt_ids and not args.json:
        raise CLIError("--json-prompt-ids needs --json")
