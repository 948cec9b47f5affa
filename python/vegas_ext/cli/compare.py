"""``--compare``: the same prompts through plain greedy decoding (HF ``model.generate`` and our
own loop with ``--algorithm full``), the speedups, and where the tokens first differ with the
near-tie rule that tells rounding from a lossless violation (docs/lossless.md). Torch is
imported only inside the functions."""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from .common import _sync
from .inputs import new_tokens
from .progress import RunProgress

if TYPE_CHECKING:
    from .decoding import Run
    from .inputs import Batch

#: A first difference is a near-tie when the gap between the two tokens' target logits is at most
#: ``NEAR_TIE_EPS[dtype] * eps * |h| * max(|w_a|, |w_b|)``: ``eps`` of the run's dtype, ``h`` the
#: final hidden state fed to the output layer, ``w_a``, ``w_b`` the two tokens' output-layer rows.
#: A logit is the dot product ``w . h``, whose rounding (and that of the forward behind ``h``)
#: scales with ``|h| |w|``, not with the logit, which cancellation can make small. Empirical
#: bounds, about 3x the largest difference measured between verification and HF's one-token step
#: (``bench/near_tie_bound.py``; the numbers per model and dtype are in docs/lossless.md).
NEAR_TIE_EPS = {"float32": 64.0, "bfloat16": 8.0, "float16": 8.0}
#: The rule when ``|h|`` or ``|w|`` is unknown (the output layer was not found): a gap of at most
#: this many units in the last place of the dtype at the larger of the two logits.
NEAR_TIE_ULPS = 8

#: The lossless contract in one line, as ``--compare`` prints it.
CONTRACT = ("greedy output equals plain greedy decoding except where the two best target logits are "
            "within rounding, in any dtype (docs/lossless.md)")


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


def _first_differing(ours: List[List[int]], base: List[List[int]]) -> Optional[tuple]:
    """``(row, token)`` of the earliest first difference over the rows (a row that ends earlier
    differs at its end), or None when every row is identical."""
    best = None
    for r, (a, b) in enumerate(zip(ours, base)):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if n is None and len(a) != len(b):
            n = min(len(a), len(b))
        if n is not None and (best is None or n < best[1]):
            best = (r, n)
    return best


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
    best = _first_differing(ours, base)
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
        d.update(_logit_gap(vals, dtype))
    return d


def _logit_gap(vals: tuple, dtype) -> Dict[str, Any]:
    """The gap fields of :func:`first_difference` from one recorded ``(logit max, logit ours,
    scale)``: the eps rule where the scale is known, else the ulp rule."""
    import torch

    lb, lo = vals[0], vals[1]
    scale = vals[2] if len(vals) > 2 else None
    gap = abs(lb - lo)
    ulp = _ulp(max(abs(lb), abs(lo)), dtype)
    d = dict(logit_ours=lo, logit_baseline=lb, abs_delta_logit=gap, ulps=gap / ulp)
    if scale is not None and scale > 0 and math.isfinite(scale):
        tol = near_tie_tolerance(scale, dtype)
        d.update(eps_units=gap / (torch.finfo(dtype).eps * scale), tolerance=tol, near_tie=gap <= tol)
    else:
        d.update(tolerance=NEAR_TIE_ULPS * ulp, near_tie=gap <= NEAR_TIE_ULPS * ulp)
    return d


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


def warm_up(model, batch: "Batch", kwargs: Dict[str, Any], algorithm: str) -> None:
    """Runs each compared path (ours, our plain loop, HF's) for 2 tokens on the last 16 prompt
    tokens, so first-call allocations and lazy inits stay out of the timed runs."""
    import torch

    from .. import generate

    n = min(16, batch.ids.shape[1])
    w_ids, w_mask = batch.ids[:, -n:], batch.mask[:, -n:]
    with torch.inference_mode():
        generate(model, w_ids, w_mask, **{**kwargs, "max_new_tokens": 2})
        if algorithm != "full":
            generate(model, w_ids, w_mask, **{**kwargs, "max_new_tokens": 2, "sparse_attn_algorithm": "full",
                                              "block_size": None, "draft_weights": None})
        _run_hf(model, w_ids, w_mask, 2, batch.eos, batch.pad_id, None)


def _decode_speedup(n_ours: int, our_dec: Optional[float], n_base: int, base_dec: Optional[float],
                    rows: int) -> Optional[float]:
    """Our decode-only rate over the baseline's: tokens after each row's first (the first ends
    prefill) per second after prefill; None when either side has no decode time or tokens."""
    if our_dec and base_dec and base_dec > 0 and n_base > rows and n_ours > rows:
        return ((n_ours - rows) / our_dec) / ((n_base - rows) / base_dec)
    return None


def _our_decode_s(run: "Run") -> Optional[float]:
    pre = run.stats.get("time_prefill_s")
    return run.wall - pre if isinstance(pre, (int, float)) else None


def compare_with_hf(model, batch: "Batch", run: "Run", dtype, do_sample: bool, show: bool) -> Dict[str, Any]:
    """Runs HF's plain greedy ``generate`` on the same prompts; returns the comparison fields."""
    recorder = None if do_sample else _ChosenLogits(run.tokens)
    prog = RunProgress(model, "HF generate", batch.size, batch.longest, batch.max_new, show=show)
    if recorder is not None:
        recorder.attach(model)
    try:
        with prog:
            hf_out, hf_wall = _run_hf(model, batch.ids, batch.mask, batch.max_new, batch.eos, batch.pad_id, prog,
                                      recorder)
    finally:
        if recorder is not None:
            recorder.detach()
    base = new_tokens(hf_out, batch.ids.shape[1], batch.eos, batch.max_new)
    n_base = sum(len(r) for r in base)
    base_tps = n_base / hf_wall if hf_wall > 0 else None
    # Decode-only rates leave out prefill (the same work for both): HF's from its streamer
    # (time of the first new token), ours from stats["time_prefill_s"].
    hf_dec = (prog.t_end or 0) - (prog.t_first or 0) if prog.t_first else None
    identical = (run.tokens == base) if not do_sample else None
    ours_tps = run.stats["wall_tokens_per_s"]
    return dict(
        baseline_tokens_per_s=base_tps,
        baseline_time_s=hf_wall,
        baseline_token_ids=base,
        speedup=(ours_tps / base_tps) if base_tps and ours_tps else None,
        decode_speedup=_decode_speedup(run.n_tokens, _our_decode_s(run), n_base, hf_dec, batch.size),
        identical=identical,
        first_difference=first_difference(run.tokens, base, recorder, dtype) if identical is False else None,
    )


def compare_with_plain(model, batch: "Batch", run: "Run", kwargs: Dict[str, Any], show: bool = False) -> Dict[str, Any]:
    """Runs our own plain loop (``sparse_attn_algorithm="full"``) on the same prompts, with its
    progress on stderr when ``show``: what speculation itself gained, apart from the loop's
    kernels. Returns the comparison fields."""
    import torch

    from .. import generate

    prog = RunProgress(model, "plain loop", batch.size, batch.longest, batch.max_new, show=show,
                       decode_bar="token" if batch.size == 1 else "forward pass")
    t0 = time.perf_counter()
    with prog, torch.inference_mode():
        out = generate(model, batch.ids, batch.mask, **{**kwargs, "sparse_attn_algorithm": "full",
                                                        "block_size": None, "draft_weights": None,
                                                        "streamer": prog.streamer if batch.size == 1 else None})
    _sync(batch.ids.device)
    plain_wall = time.perf_counter() - t0
    plain = new_tokens(out.sequences, batch.ids.shape[1], batch.eos, batch.max_new)
    n_plain = sum(len(r) for r in plain)
    plain_tps = n_plain / plain_wall if plain_wall > 0 else None
    plain_dec = plain_wall - out.stats["time_prefill_s"]
    ours_tps = run.stats["wall_tokens_per_s"]
    return dict(
        plain_time_s=plain_wall,
        plain_num_tokens=n_plain,
        plain_tokens_per_s=plain_tps,
        speedup_vs_plain=(ours_tps / plain_tps) if plain_tps and ours_tps else None,
        decode_speedup_vs_plain=_decode_speedup(run.n_tokens, _our_decode_s(run), n_plain, plain_dec, batch.size),
        plain_identical=(run.tokens == plain) if not kwargs["vegas_config"].do_sample else None,
    )
