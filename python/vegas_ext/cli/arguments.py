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
    VegasConfig,
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


#: The decoding flags, from :data:`vegas_ext.config.OPTIONS` (flag, type, default, help), by group.
_SPECULATION = ("max_new_tokens", "num_speculative_tokens", "gamma_policy", "sparse_attn_algorithm", "draft_weights",
                "compile_steps")
_SELECTION = ("sparse_attn_ratio", "sparse_attn_min_tokens", "sparse_attn_max_tokens", "block_size",
              "num_sink_blocks", "num_recent_tokens", "share_selection_across_heads", "query_weights",
              "selection_refresh_interval", "score_decay")
_SAMPLING = ("do_sample", "temperature", "top_k", "top_p")


def _flag_value(v: Any) -> str:
    return "none" if v is None else str(v)


def _option_flag(d, name: str) -> None:
    """The flag of option ``name`` as the table defines it (``OPTIONS[name].cli``)."""
    opt = OPTIONS[name]
    default = opt.default_at("cli")
    kw: Dict[str, Any] = dict(dest=opt.cli[2:].replace("-", "_"), default=default)
    if opt.kind == "bool":
        kw["action"] = "store_true"
        shown = ""
    else:
        shown = f" (default {_flag_value(default)})"
        if opt.kind == "int":
            kw["type"] = _int(opt.cli)
        elif opt.kind == "float":
            kw["type"] = float
        elif opt.kind == "choice" and name == "draft_weights":
            kw.update(type=_draft_weights, choices=DRAFT_WEIGHT_FLAGS)
        elif opt.kind == "choice" and name != "sparse_attn_algorithm":  # algorithms: checked with the config
            kw["choices"] = tuple(_flag_value(c) for c in opt.choices)
    names = [opt.cli] + (["--gamma"] if name == "num_speculative_tokens" else [])
    d.add_argument(*names, help=opt.doc + shown, **kw)


def _speculation_flags(d) -> None:
    for name in _SPECULATION:
        _option_flag(d, name)


def _selection_flags(d) -> None:
    for name in _SELECTION:
        _option_flag(d, name)


def _sampling_flags(d) -> None:
    for name in _SAMPLING:
        _option_flag(d, name)
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
    returns a checked copy of ``args`` with ``vegas_config``, the one options value
    (:class:`~vegas_ext.config.VegasConfig`, built from the flags as every door builds it),
    ``num_speculative_tokens`` (the int cap), ``gamma_policy`` and ``block_size`` (the
    algorithm's default where not given) filled in. ``args`` itself is left unchanged. Raises
    :class:`CLIError` naming the flag and what it expects."""
    try:
        cfg = _vegas_config(args)
    except ValueError as e:
        raise CLIError(str(e)) from None
    _check_cli_flags(args)
    block_size = DEFAULT_BLOCK_SIZE[cfg.sparse_attn_algorithm] if cfg.block_size is None else cfg.block_size
    return argparse.Namespace(**{**vars(args), "vegas_config": cfg, "gamma_policy": cfg.gamma_policy,
                                 "num_speculative_tokens": cfg.num_speculative_tokens, "block_size": block_size})


def decode_options(args) -> Dict[str, Any]:
    """The flag table: every :func:`vegas_ext.generate` option that has a flag
    (``config.OPTIONS[name].cli``), mapped from its API name to the flag's parsed value
    (``--draft-weights none``: ``None``; ``--num-speculative-tokens``: an int or ``"auto"``)."""
    out = {name: getattr(args, opt.cli[2:].replace("-", "_")) for name, opt in OPTIONS.items() if opt.cli}
    if out.get("draft_weights") == "none":
        out["draft_weights"] = None
    gamma = out.get("num_speculative_tokens")
    if isinstance(gamma, str) and gamma != "auto":
        if _parse_int(gamma) is None:
            raise CLIError(f"--num-speculative-tokens must be an integer >= 1 or auto, got {gamma!r}")
        out["num_speculative_tokens"] = _parse_int(gamma)
    return out


def _vegas_config(args) -> VegasConfig:
    """The decode options through :class:`~vegas_ext.config.VegasConfig`, named by their flags,
    plus what only the CLI asks (γ >= 1: plain decoding is ``--algorithm full``; at least one new
    token); raises ``ValueError``."""
    values = decode_options(args)
    labels = {name: opt.cli for name, opt in OPTIONS.items() if opt.cli}
    gamma = values["num_speculative_tokens"]
    if gamma != "auto":
        check_int(gamma, "--num-speculative-tokens", 1, INT64_MAX, what="or auto")
    check_int(values["max_new_tokens"], "--max-new-tokens", 1, INT64_MAX)
    cfg = VegasConfig.build(values, door="cli", labels=labels)
    if args.batch_size is not None:
        check_int(args.batch_size, "--batch-size", 1, MAX_BATCH_SIZE)
    if args.seed is not None:
        check_seed(args.seed, "--seed")
    return cfg


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
