"""What ``vegas generate`` prints: the prompt line, the result (one JSON object on stdout with
``--json``; else the text on stdout and the statistics and comparisons on stderr)."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from .common import _eprint, _jsonable
from .compare import identical_line
from .decoding import Run
from .inputs import Batch

#: ``result["model"]`` without ``--model``.
EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct.Q4_1.gguf"


def prompt_line(args, batch: Batch) -> str:
    """``vegas: prompt: ...``: the rows, their lengths and the run's main settings."""
    B, rows = batch.size, batch.rows
    return (f"vegas: prompt: {B} row{'s' if B > 1 else ''} of {', '.join(f'{len(r):,}' for r in rows[:8])}"
            f"{' ...' if B > 8 else ''} "
            f"tokens{' (chat template)' if args.chat else ''}; up to {batch.max_new} new tokens per row with "
            f"{args.algorithm}, gamma {_gamma(args)}, ratio {args.ratio}, block {args.block_size}")


def _gamma(args) -> str:
    """``auto <= 8`` or ``4`` (fixed): γ as the run chooses it."""
    return f"auto <= {args.num_speculative_tokens}" if args.gamma_policy == "auto" else str(args.num_speculative_tokens)


def build_result(args, tok, batch: Batch, run: Run, dtype_name: str, device, packed: int) -> Dict[str, Any]:
    """The result's fields (the ``--json`` object before the comparison's fields)."""
    result: Dict[str, Any] = {
        "model": args.model or EMBEDDED_MODEL,
        "algorithm": args.algorithm,
        "num_speculative_tokens": args.num_speculative_tokens,
        "gamma_policy": args.gamma_policy,
        "sparse_attn_ratio": args.ratio,
        "block_size": args.block_size,
        "dtype": dtype_name,
        "device": str(device),
        "packed_linears": packed,
        "draft_weights": args.draft_weights,
        "prompt_lengths": [len(r) for r in batch.rows],
        "text": [tok.decode(r, skip_special_tokens=True) for r in run.tokens],
        "token_ids": run.tokens,
        "stats": _jsonable(run.stats),
    }
    if args.json_prompt_ids:
        result["prompt_token_ids"] = batch.rows
    return result


def print_result(result: Dict[str, Any], run: Run, args, dtype_name: str,
                 marks: Optional[Marks] = None) -> None:
    """One JSON object on stdout with ``--json``; else the text (unless it streamed) on stdout and
    the statistics and comparisons on stderr, and :func:`busy_note` (``marks``: its snapshots)."""
    if args.json:
        others = other_cores(marks)  # the note's measure, for a reader of the JSON
        result["other_processes_cores"] = None if others is None else round(others, 2)
        print(json.dumps(_jsonable(result), default=str))
        return
    if not run.streamed:
        _print_text(result["text"])
    _eprint(f"--- {args.algorithm} stats ---")
    for line in _fmt_stats(run.stats):
        _eprint(line)
    _eprint(f"wall                 {run.wall:.2f}s for {run.n_tokens} tokens = "
            f"{run.stats['wall_tokens_per_s']:.2f} tok/s (incl. prefill)")
    if "identical" in result:
        _print_hf_comparison(result, dtype_name)
    if result.get("plain_time_s") is not None:
        _print_plain_comparison(result)
    note = busy_note(marks)
    if note:
        _eprint(note)


#: Cores' worth of CPU that other processes may use on average during the runs before the
#: report says the speeds are not comparable.
OTHER_CORES_NOTE = 0.5


def cpu_snapshot() -> Optional[Tuple[float, float, float]]:
    """``(wall, busy, own)`` seconds now: a monotonic clock, the busy time of all CPUs (``/proc/stat``:
    user, nice, system, irq, softirq, and steal, the time a hypervisor gave other machines) and this
    process's own CPU time. ``None`` where there is no ``/proc/stat`` (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        if fields[0] != "cpu":
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    t = os.times()  # our children too (a compiler that torch.compile starts is ours)
    return time.monotonic(), busy, t.user + t.system + t.children_user + t.children_system


Marks = List[Tuple[float, float, float]]


def other_cores(marks: Optional[Marks]) -> Optional[float]:
    """Cores' worth of CPU that other processes used on average in the busiest interval between
    consecutive :func:`cpu_snapshot` ``marks`` (one before each run) and now, so that load during
    one run of several shows; ``None`` without marks or without ``/proc/stat``."""
    now = cpu_snapshot() if marks else None
    if now is None:
        return None
    most = None
    for a, b in zip(marks, [*marks[1:], now]):
        if b[0] - a[0] > 0.05:  # a span too short to measure says nothing
            used = max(0.0, (b[1] - a[1]) - (b[2] - a[2])) / (b[0] - a[0])
            most = used if most is None else max(most, used)
    return most


def busy_note(marks: Optional[Marks] = None) -> Optional[str]:
    """A warning line when other processes shared the CPU while the runs (Vegas, HF, the plain
    loop, one after another) were timed, so that they ran under different loads; ``None`` otherwise.

    ``marks``: a :func:`cpu_snapshot` before each run; then the measure is, in the busiest run,
    the CPU time all CPUs were busy minus this process's own (and its children's) over the wall
    time (more than :data:`OTHER_CORES_NOTE` cores warns). Without them (or without
    ``/proc/stat``) the 1-minute load average above the cores (plus a margin for this process's
    threads winding down) warns; it also counts work that ended before the runs began.
    """
    n = os.cpu_count() or 1
    others = other_cores(marks)
    if others is not None:
        if others <= OTHER_CORES_NOTE:
            return None
        return (f"note: other processes used {others:.1f} of {n} cores during these runs (the busiest of them), so "
                "their speeds and speedups are not comparable; rerun on an idle machine")
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return None
    if load <= n + 0.75:
        return None
    return (f"note: load average {load:.1f} on {n} cores: other jobs shared the CPU during this run, so its "
            "speeds and speedups are not comparable; rerun on an idle machine")


def _print_text(texts: List[str]) -> None:
    for i, t in enumerate(texts):
        if len(texts) > 1:
            print(f"=== row {i} ===")
        print(t)
    sys.stdout.flush()


def _print_hf_comparison(result: Dict[str, Any], dtype_name: str) -> None:
    _eprint("--- comparison with plain greedy decoding (HF model.generate) ---")
    _eprint(f"HF generate          {result['baseline_time_s']:.2f}s for "
            f"{sum(len(r) for r in result['baseline_token_ids'])} tokens = "
            f"{result['baseline_tokens_per_s']:.2f} tok/s (incl. prefill)")
    sp = result["speedup"]
    _eprint(f"speedup              {sp:.2f}x end to end" + (
        f", {result['decode_speedup']:.2f}x decode only (prefill excluded)" if result["decode_speedup"] else ""))
    _eprint("identical            " + identical_line(result["identical"], result.get("first_difference"), dtype_name))


def _print_plain_comparison(result: Dict[str, Any]) -> None:
    _eprint("--- comparison with our own plain loop (--algorithm full, same kernels, no drafts) ---")
    _eprint(f"plain loop           {result['plain_time_s']:.2f}s for {result['plain_num_tokens']} tokens = "
            f"{result['plain_tokens_per_s']:.2f} tok/s (incl. prefill)")
    sp, dsp = result.get("speedup_vs_plain"), result.get("decode_speedup_vs_plain")
    _eprint(f"speedup (vegas)      {sp:.2f}x end to end" + (f", {dsp:.2f}x decode only" if dsp else "")
            + f" vs our plain loop; {result['speedup']:.2f}x vs HF generate"
            + ("" if result.get("plain_identical") in (None, True) else "; tokens differ from the plain loop's"))


def _stat(stats: Dict[str, Any], key: str, fmt: str = "{:.3f}") -> str:
    """``stats[key]`` formatted with ``fmt``; ``n/a`` when missing or None."""
    v = stats.get(key)
    if v is None:
        return "n/a"
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def _fmt_stats(stats: Dict[str, Any]) -> List[str]:
    """The ``--- <algorithm> stats ---`` lines of :func:`vegas_ext.generate`'s ``stats``."""
    def g(k, fmt="{:.3f}"):
        return _stat(stats, k, fmt)

    lines = [
        f"generated tokens     {g('num_generated_tokens', '{}')} in {g('num_iterations', '{}')} iterations",
        f"tokens/s             {g('tokens_per_s', '{:.2f}')} (incl. prefill), "
        f"{g('decode_tokens_per_s', '{:.2f}')} decode only",
    ]
    lines += _speculation_lines(stats, g)
    if stats.get("draft_weights_bytes"):
        lines.append(f"draft weights        {stats.get('draft_weights_format')}: a copy of "
                     f"{stats['draft_weights_bytes'] / 2**20:.1f} MiB (made in {g('time_draft_weights_s', '{:.2f}')}s)")
    parts = [f"{k[5:-2]} {stats[k]:.2f}s" for k in ("time_prefill_s", "time_draft_s", "time_verify_s", "time_select_s")
             if isinstance(stats.get(k), (int, float))]
    if parts:
        lines.append(f"time                 total {g('time_total_s', '{:.2f}')}s = " + ", ".join(parts) + " (+ rest)")
    return lines


def _speculation_lines(stats: Dict[str, Any], g) -> List[str]:
    """The drafts' lines: acceptance, the gamma policy's choices and its fitted costs."""
    lines = []
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
    hist = stats.get("gamma_histogram")
    if hist is not None:
        label = f"gamma ({stats.get('gamma_policy')})"
        lines.append(f"{label:<21}iterations per gamma 0..{len(hist) - 1}: {_jsonable(hist)}")
    if stats.get("acceptance_estimates") is not None:
        lines.append(f"accept. estimates    {_jsonable(stats['acceptance_estimates'])} (per draft position)")
        # RowGamma's TokenCostModel names its slope per token, AutoGamma's StepCostModel c1
        c1 = "cost_t_verify_per_token_ms" if "cost_t_verify_per_token_ms" in stats else "cost_t_verify_c1_ms"
        lines.append(f"fitted costs         draft step {g('cost_t_draft_ms', '{:.1f}')} ms, verify(q) "
                     f"{g('cost_t_verify_c0_ms', '{:.1f}')} + {g(c1, '{:.1f}')} q ms, "
                     f"select {g('cost_t_select_ms', '{:.1f}')} ms; {g('num_probes', '{}')} probes")
    if hist is not None and stats.get("num_iterations") is not None:  # did speculation happen at all?
        lines.append(f"speculated           {sum(hist[1:])} of {stats['num_iterations']} iterations drafted")
    return lines
