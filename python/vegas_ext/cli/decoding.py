"""Our run: the keyword arguments of :func:`vegas_ext.generate` from the flags, the seed, and the
timed run with its progress (and the text streamed to a terminal). Torch is imported only inside
the functions."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List

from .arguments import CLIError
from .common import _eprint, _sync
from .inputs import Batch, new_tokens
from .progress import RunProgress


@dataclass
class Run:
    """The outcome of one timed run: ``tokens`` (each row's new tokens, cut after EOS), ``stats``
    (:func:`vegas_ext.generate`'s, with ``wall_s`` and ``wall_tokens_per_s`` added), ``wall``
    (seconds, prefill included) and ``streamed`` (the text already went to stdout)."""

    tokens: List[List[int]]
    stats: Dict[str, Any]
    wall: float
    streamed: bool

    @property
    def n_tokens(self) -> int:
        """New tokens over all rows."""
        return sum(len(r) for r in self.tokens)


def generate_kwargs(args, batch: Batch, generator) -> Dict[str, Any]:
    """The keyword arguments of :func:`vegas_ext.generate` for the checked ``args``: the flags'
    :class:`~vegas_ext.config.VegasConfig` (built once, in ``_validate``) and the batch's own."""
    return {
        "vegas_config": args.vegas_config,
        "max_new_tokens": batch.max_new,  # lowered to fit the model's positions
        "eos_token_id": batch.eos,  # [] = never stop at EOS
        "pad_token_id": batch.pad_id,
        "generator": generator,
    }


def make_generator(args, device):
    """``--seed``: seeds torch and returns a ``torch.Generator`` on ``device`` (None without a
    seed); notes on stderr when sampling with gamma auto cannot repeat its tokens."""
    import torch

    if args.seed is None:
        return None
    torch.manual_seed(args.seed)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    if args.do_sample and args.gamma_policy == "auto" and args.algorithm != "full":
        _eprint("vegas: note: --seed with sampling and --gamma-policy auto samples the same "
                "distribution on every run, but the drafts per iteration follow this run's timings, so "
                "the tokens can differ between runs; give --gamma-policy fixed for identical output")
    return generator


def _progress(model, tok, batch: Batch, args) -> RunProgress:
    """The run's progress. The decode loop streams batch size 1 only: the text streams to stdout
    when it is a terminal (then the text is the decoding progress), else a token bar / progress
    lines on stderr; several rows get a bar of forward passes."""
    show = not args.no_progress
    stream_text = show and not args.json and batch.size == 1 and sys.stdout.isatty()
    inner = None
    if stream_text:
        from transformers import TextStreamer

        inner = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    decode_bar = None if stream_text else ("token" if batch.size == 1 else "forward pass")
    return RunProgress(model, args.algorithm, batch.size, batch.longest, batch.max_new, show=show,
                       decode_bar=decode_bar, inner=inner)


def run_vegas(model, tok, batch: Batch, kwargs: Dict[str, Any], args) -> Run:
    """Runs :func:`vegas_ext.generate` on ``batch`` with its progress, timed; raises
    :class:`CLIError` when the loop refuses the model or its config."""
    import torch

    from .. import generate

    prog = _progress(model, tok, batch, args)
    t0 = time.perf_counter()
    try:
        with prog, torch.inference_mode():
            out = generate(model, batch.ids, batch.mask, streamer=prog.streamer if batch.size == 1 else None,
                           **kwargs)
    except ValueError as e:  # e.g. an unsupported model / config refused by the decode loop
        raise CLIError(str(e).splitlines()[0]) from None
    _sync(batch.ids.device)
    wall = time.perf_counter() - t0  # (a streamed text already ended with its newline: TextStreamer.end)
    stats = dict(getattr(out, "stats", {}) or {})
    tokens = new_tokens(out.sequences, batch.ids.shape[1], batch.eos, batch.max_new)
    n = sum(len(r) for r in tokens)
    stats.setdefault("wall_s", wall)
    stats["wall_tokens_per_s"] = n / wall if wall > 0 else None
    streamed = prog.streamer.inner is not None  # a TextStreamer printed the text as it came
    return Run(tokens=tokens, stats=stats, wall=wall, streamed=streamed)
