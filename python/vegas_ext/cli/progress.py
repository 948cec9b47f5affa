"""Progress of a generation run on stderr: a tqdm bar on a terminal, a line every
:data:`LOG_INTERVAL_S` seconds in a log file or a pipe (tqdm always redraws with ``\\r``).

:class:`RunProgress` composes four small parts: :class:`RunTimer` (the run's times),
:class:`LayerHooks` (forward hooks on the decoder layers: prefill by layer, forward passes),
:class:`PhaseBar` (the bar of the current phase) and :class:`ProgressStreamer` (the HF-style
streamer that counts new tokens). Torch is imported only inside the functions.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional

from .common import _eprint

#: Seconds between progress lines when stderr is not a terminal (a log file or a pipe).
LOG_INTERVAL_S = 10.0


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
    """A tqdm bar on stderr when it is a terminal (and tqdm is installed), else a :class:`_LogBar`."""
    if not sys.stderr.isatty():
        return _LogBar(desc, total, unit)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _LogBar(desc, total, unit)
    try:  # a terminal that reports 0 columns (some ptys) would get an empty bar
        sized = os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except (OSError, ValueError, AttributeError):
        sized = False
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=sized,
                ncols=None if sized else 80, nrows=None if sized else 24)


class PhaseBar:
    """At most one open bar (:func:`_bar`): :meth:`open` replaces it, :meth:`update` and
    :meth:`close` do nothing when none is open."""

    def __init__(self):
        self._bar = None

    def open(self, desc: str, total: Optional[int], unit: str) -> None:
        self.close()
        self._bar = _bar(desc, total, unit)

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class RunTimer:
    """``time.perf_counter()`` times of one run: ``t_start``, ``t_first`` (the first new token,
    i.e. the end of prefill; ``None`` until then) and ``t_end`` (the streamer's end, or ``None``)."""

    def __init__(self):
        self.t_start = time.perf_counter()
        self.t_first: Optional[float] = None
        self.t_end: Optional[float] = None

    def start(self) -> None:
        self.t_start = time.perf_counter()

    def first(self) -> float:
        """Marks the end of prefill (once); returns ``t_first``."""
        if self.t_first is None:
            self.t_first = time.perf_counter()
        return self.t_first

    def end(self) -> None:
        self.t_end = time.perf_counter()

    def decode_s(self) -> float:
        """Seconds from the end of prefill (or the start) to the end (or now)."""
        return (self.t_end or time.perf_counter()) - (self.t_first or self.t_start)


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


class LayerHooks:
    """Forward hooks on decoder ``layers`` that call ``on_layer(is_last)`` after each layer's
    forward, between :meth:`attach` and :meth:`detach`."""

    def __init__(self, layers, on_layer: Callable[[bool], None]):
        self.layers, self.on_layer = layers, on_layer
        self._handles: list = []

    def __len__(self) -> int:
        return len(self.layers)

    def attach(self) -> None:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_hook(self._hook(i == last)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, is_last: bool):
        def hook(module, inputs, output):
            self.on_layer(is_last)
        return hook


class ProgressStreamer:
    """A HF-style streamer (``put`` / ``end``) for ``generate``: forwards every call to ``inner``
    (e.g. a ``TextStreamer``), skips the first ``put`` (the prompt), counts the new tokens per row
    in ``count`` and reports them to ``on_tokens(n)``; ``end`` calls ``on_end()``."""

    def __init__(self, batch_size: int, on_tokens: Callable[[int], None], on_end: Callable[[], None],
                 inner=None):
        self.batch_size, self.on_tokens, self.on_end, self.inner = batch_size, on_tokens, on_end, inner
        self.count = 0
        self._prompt_seen = False

    def put(self, value) -> None:
        if self.inner is not None:
            self.inner.put(value)
        if not self._prompt_seen:  # the first put carries the prompt
            self._prompt_seen = True
            return
        if value.dim() >= 2:
            n = value.shape[-1]
        elif self.batch_size == 1:
            n = value.numel()
        else:
            n = 1
        self.count += n
        self.on_tokens(n)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()
        self.on_end()


class RunProgress:
    """Progress of one generation run (ours or HF's) on stderr, in two phases.

    * prefill: the prompt's forward pass, counted layer by layer (forward hooks on the decoder
      layers), so a long prompt on a CPU shows where it is and how long it has left;
    * decoding: ``decode_bar="token"``: new tokens (from the streamer: batch size 1, or HF's
      ``generate``); ``"forward pass"``: forward passes (our loop with several rows, which
      streams nothing); ``None``: no bar (the text itself streams to the terminal).

    Each phase ends with one summary line (``vegas: prefill (vegas): 7,182 tokens in 94.1 s``).
    ``streamer`` (a :class:`ProgressStreamer`, forwarding to ``inner``) goes to ``generate``;
    ``t_first`` (the first new token: end of prefill) and ``t_end`` are ``time.perf_counter()``
    times. Use as a context manager around the run; ``show=False`` only records times. Raises
    ``ValueError`` for another ``decode_bar``.
    """

    def __init__(self, model, label: str, batch_size: int, prompt_tokens: int, max_new_tokens: int,
                 show: bool = True, decode_bar: Optional[str] = "token", inner=None):
        if decode_bar not in ("token", "forward pass", None):
            raise ValueError(f"decode_bar must be 'token', 'forward pass' or None, got {decode_bar!r}")
        self.label, self.batch_size, self.prompt_tokens = label, batch_size, prompt_tokens
        self.max_new_tokens, self.show, self.decode_bar = max_new_tokens, show, decode_bar
        layers = _decoder_layers(model) if show else None
        self.hooks = LayerHooks(layers, self._on_layer) if layers is not None else None
        self.streamer = ProgressStreamer(batch_size, self._on_tokens, self._on_end, inner)
        self.timer = RunTimer()
        self.bar = PhaseBar()
        self.phase = "prefill"
        self._forwards = 0

    @property
    def t_first(self) -> Optional[float]:
        return self.timer.t_first

    @property
    def t_end(self) -> Optional[float]:
        return self.timer.t_end

    @property
    def count(self) -> int:
        """New tokens per row reported by the streamer."""
        return self.streamer.count

    def __enter__(self):
        self.timer.start()
        if self.show:
            if self.hooks is not None:
                self.hooks.attach()
                self.bar.open(f"prefill ({self.label})", len(self.hooks), "layer")
            if not sys.stderr.isatty():
                _eprint(f"vegas: prefill ({self.label}): {self._rows_tokens()} ...")
        return self

    def __exit__(self, *exc):
        if self.hooks is not None:
            self.hooks.detach()
        if self.phase == "prefill":
            self._end_prefill()
        self.bar.close()
        if self.show and exc[0] is None:
            _eprint(self._decoding_line())
        return False

    def _rows_tokens(self) -> str:
        rows = f"{self.batch_size} rows x " if self.batch_size > 1 else ""
        return f"{rows}{self.prompt_tokens:,} tokens"

    def _decoding_line(self) -> str:
        t = self.timer.decode_s()
        done = f"{self.count} tokens" if self.count else f"{self._forwards} forward passes"
        per_row = " per row" if self.batch_size > 1 else ""
        rate = f" ({self.count / t:.2f} tokens/s{per_row})" if self.count and t > 0 else ""
        return f"vegas: decoding ({self.label}): {done} in {t:.1f} s{rate}"

    def _end_prefill(self) -> None:
        self.phase = "decoding"
        self.bar.close()
        t_first = self.timer.first()
        if self.show:
            _eprint(f"vegas: prefill ({self.label}): {self._rows_tokens()} in {t_first - self.timer.t_start:.1f} s")
            if self.decode_bar == "token":
                self.bar.open(f"decoding ({self.label})", self.max_new_tokens, "token")
            elif self.decode_bar == "forward pass" and self.hooks is not None:
                self.bar.open(f"decoding ({self.label})", None, "forward pass")

    def _on_layer(self, is_last: bool) -> None:
        if self.phase == "prefill":
            self.bar.update(1)
            if is_last:
                self._end_prefill()
        elif is_last:
            self._forwards += 1
            if self.decode_bar == "forward pass":
                self.bar.update(1)

    def _on_tokens(self, n: int) -> None:
        if self.phase == "prefill":
            self._end_prefill()
        if self.decode_bar == "token":
            self.bar.update(n)

    def _on_end(self) -> None:
        self.timer.end()
        self.bar.close()
