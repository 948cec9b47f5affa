"""The ``vegas`` command: ``vegas generate`` runs self-speculative decoding on a real model.

Examples::

    vegas generate --chat --compare           # embedded SmolLM2 on the embedded 7,128-token document
    vegas generate --prompt "Hello" --chat --max-new-tokens 32
    vegas generate --model ./my-llama --prompt-file doc.txt --batch-size 4 --json

Text goes to stdout (streamed for a single row on a terminal), progress and statistics to
stderr; with ``--json`` stdout carries exactly one JSON object. Bad input ends with a one-line
``vegas: error: ...`` on stderr and exit status 2.

One job per module: :mod:`.arguments` (the flags and their checks), :mod:`.inputs` (prompts to a
padded batch), :mod:`.loading` (device, dtype, model), :mod:`.decoding` (our timed run),
:mod:`.progress` (bars and phase lines), :mod:`.compare` (``--compare`` and the near-tie rule),
:mod:`.report` (what is printed). Start-up is cheap: every module imports only the standard
library at import time, so ``--help`` and argument errors answer at once; torch, transformers and
the model load after parsing (the console script :mod:`vegas_ext_cli` loads this package without
the torch-loading ``vegas_ext/__init__``).
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

# ``_name as _name``: private names the tests use, re-exported
from .arguments import (
    ALGORITHMS,
    DTYPES,
    CLIError,
    _validate as _validate,
    build_parser,
    check_model_flag,
)
from .common import _eprint
from .compare import (
    CONTRACT,
    NEAR_TIE_EPS,
    NEAR_TIE_ULPS,
    _ChosenLogits as _ChosenLogits,
    compare_with_hf,
    compare_with_plain,
    first_difference,
    identical_line,
    near_tie_eps,
    near_tie_tolerance,
    warm_up,
)
from .decoding import generate_kwargs, make_generator, run_vegas
from .inputs import _read_prompts as _read_prompts, _read_stdin as _read_stdin, make_batch, new_tokens
from .loading import _load, _resolve_device_dtype, import_decoder
from .progress import LOG_INTERVAL_S, RunProgress, _LogBar as _LogBar
from .report import build_result, cpu_snapshot, print_result, prompt_line

__all__ = [
    "main", "cmd_generate", "build_parser", "CLIError", "ALGORITHMS", "DTYPES", "LOG_INTERVAL_S",
    "NEAR_TIE_EPS", "NEAR_TIE_ULPS", "CONTRACT", "RunProgress", "new_tokens", "near_tie_eps",
    "near_tie_tolerance", "first_difference", "identical_line",
]

def cmd_generate(args) -> int:
    """Runs ``vegas generate`` with parsed ``args`` (left unchanged); returns the exit status.
    Raises :class:`CLIError` for bad input."""
    opts = _validate(args)  # a checked copy: gamma as an int, the algorithm's block size
    # the inputs before the (slow) imports and model load, so a bad file or path fails fast; the
    # default document last (reading it imports the package, and so torch)
    prompts = _read_prompts(opts) if opts.prompt or opts.prompt_file is not None else None
    check_model_flag(opts)
    prompts = prompts or _read_prompts(opts)
    show = not opts.no_progress
    if show:
        _eprint("vegas: starting (importing torch and transformers) ...")
    import_decoder()
    device, dtype = _resolve_device_dtype(opts)
    dtype_name = str(dtype).replace("torch.", "")
    model, tok, packed = _load(opts, dtype, device, show)

    batch = make_batch(tok, model, prompts, opts, device, show)
    if show:
        _eprint(prompt_line(opts, batch))
    kwargs = generate_kwargs(opts, batch, make_generator(opts, device))
    if opts.compare:
        warm_up(model, batch, kwargs, opts.algorithm)

    marks = [cpu_snapshot()]  # before each run: other processes' CPU use per run (busy_note)
    run = run_vegas(model, tok, batch, kwargs, opts)
    result = build_result(opts, tok, batch, run, dtype_name, device, packed)
    if opts.compare:
        marks.append(cpu_snapshot())
        result.update(compare_with_hf(model, batch, run, dtype, opts.do_sample, show))
        if opts.algorithm != "full":
            marks.append(cpu_snapshot())
            result.update(compare_with_plain(model, batch, run, kwargs, show))

    print_result(result, run, opts, dtype_name, None if None in marks else marks)
    return 0


#: The subcommands: ``args.command`` -> the function that runs it (returns the exit status).
COMMANDS = {"generate": cmd_generate}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``vegas`` console script; returns the exit status (0 ok, 2 bad input,
    130 interrupted)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = COMMANDS.get(getattr(args, "command", None))
    if command is None:
        parser.print_help(sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return command(args)
    except CLIError as e:
        _eprint(f"vegas: error: {e}")
        return 2
    except KeyboardInterrupt:
        _eprint("vegas: interrupted")
        return 130
