"""Replay a gamma policy against step costs and acceptance measured by ``bench/e2e.py``.

The end-to-end runs that judge ``num_speculative_tokens="auto"`` are noisy (6-10 % between
repeats of one configuration on a quiet 2-core VM) and slow (the auto-gamma grid takes over an hour), too noisy to
compare two policy variants that differ by a few per cent. This script takes, per (context,
batch) cell of a ``runs.jsonl`` from ``bench/e2e.py``, the costs the loop measured -- a plain
step, a draft step, the selection, and the verification pass at each ``q = gamma + 1`` of the
fixed-gamma rows (a least-squares line through them) -- and simulates decoding with the real
policy classes of ``vegas_ext.speculation``: every timing multiplied by a Gaussian noise factor,
each draft accepted with probability ``p`` given that the ones before it were (several ``p``),
rows stopping at ``--new-tokens``; a speculative iteration after plain steps is preceded by a
plain step that scores the KV blocks, as in ``vegas_ext.decode.advance``. Reported: each policy's
decode rate relative to ``full`` (plain decoding) and to the best fixed gamma of the cell,
medians over seeds.

    python -m bench.gamma_policy_sim --runs bench/results/gamma_xeon_avx512/kjv_256tok_b4/runs.jsonl --new-tokens 64

``--costs`` replays our loop's ``auto`` instead (``RowGamma``: drafts per row, priced per
verified token) against the forward times of ``bench/decode_step_costs.py --verify-tokens``: a
plain step, a draft step per row count, the selection and the verification of ``B q`` tokens for
each ``q``; rows accept with probability ``p`` (spread over the batch with ``--row-spread``),
finished rows stay in the batch with no tokens, and a first forward at each token count costs
``--first-call`` more (oneDNN prepares each new shape once: at 2 threads 211 packed linears took
45 ms at their first call with 5 rows against 32 ms at their second, ~15 % of a forward):

    python -m bench.decode_step_costs --contexts 8192 --batches 1,4 --verify-tokens 2,3,4,5,6,7,8,9 \
        --draft-weights int8 --no-hf --threads 2 --out costs.jsonl
    python -m bench.gamma_policy_sim --costs costs.jsonl --new-tokens 128 --fixed 2 3 4 5 6 7 8 \
        --acceptance 0.7 0.8 0.9 0.95 --seeds 96 --variants '[{"prior_weight": 4}]'

This is a model of the loop, not a measurement: it omits everything the costs do not capture
(cache effects between phases, a machine that changes speed unless ``--drift`` models one; the
plain step that scores the KV blocks before drafting is charged the verification line at q = 1, at least a plain step;
with ``--verify-model measured`` exactly a plain step, its scoring overhead not measured),
and by default it prices verification
with one line per cell, which smooths out the step-shaped verify cost of the real loop (query
rows fill whole vector registers; at batch 4 the whole forward is not monotonic in q):
``--verify-model measured`` uses each q's own measured cost instead. It is how the policy's defaults
were chosen; the end-to-end runs are how they are judged.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
from typing import Dict, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from bench.common import load_runs, row_gamma_kwargs
from vegas_ext.speculation import AutoGamma, FixedGamma, IterationCosts, RowGamma, make_gamma_policy

HERE = os.path.dirname(os.path.abspath(__file__))


def cells_from_runs(path, verify_model="line", repeats="first"):
    """``{(context, batch): (t_plain, t_draft_step, t_select, verify(q) -> s)}`` in ms, from the
    fixed-gamma rows of an e2e ``runs.jsonl``: the first repeat's (``repeats="first"``), or
    every repeat's, each as a ratio to its own repeat's ``full`` step, medians over repeats times
    the median ``full`` step (``"all"``). ``verify_model="line"``: a least-squares line through
    the verification pass of each ``q``; ``"measured"``: each ``q``'s own cost (the step shape
    the line smooths out), linear between measured ``q`` and from ``(1, t_plain)`` to the
    smallest, flat past the largest (both optimistic: the jump from ``q = 1`` is spread over the
    q below the smallest measured one, and q past the largest cost no more; fixed gammas and
    auto drafts beyond the measured range are favoured). Rows of a repeat without a ``full`` run
    are skipped (with a note on stderr)."""
    rows, _ = load_runs([path])
    cells = {}
    for r in rows:
        if repeats == "first" and r.get("repeat", 0) != 0:
            continue
        if r["algorithm"] != "vegas" or r["num_speculative_tokens"] in ("auto", 0):
            continue
        tf = r.get("cost_t_full_ms")
        if not tf:  # its repeat has no `full` run to take ratios to
            print(f"skipped: a {r['context']} x {r['batch_size']} row of repeat {r.get('repeat', 0)} "
                  "without a full step time", file=sys.stderr)
            continue
        c = cells.setdefault((r["context"], r["batch_size"]), {"full": {}, "draft": [], "sel": [], "v": {}})
        c["full"][r.get("repeat", 0)] = tf
        c["draft"].append(r["cost_t_draft_step_ms"] / tf)
        c["sel"].append(r["cost_t_select_ms"] / tf)
        c["v"].setdefault(int(r["num_speculative_tokens"]) + 1, []).append(r["cost_t_verify_ms"] / tf)
    out = {}
    for key, c in sorted(cells.items()):
        tf = statistics.median(c["full"].values())
        qs = sorted(c["v"])
        vq = [tf * statistics.median(c["v"][x]) for x in qs]
        if verify_model == "line":
            c1, c0 = np.polyfit(np.array(qs), np.array(vq), 1)
            verify = (lambda x, c0=c0, c1=c1: c0 + c1 * x)
        elif verify_model == "measured":
            verify = (lambda x, xp=[1] + qs, fp=[tf] + vq: float(np.interp(x, xp, fp)))
        else:
            raise ValueError(f"verify_model must be 'line' or 'measured', got {verify_model!r}")
        out[key] = (tf, tf * statistics.median(c["draft"]), tf * statistics.median(c["sel"]), verify)
    return out


def simulate(policy, p, t_plain, t_draft, t_select, verify, n_new, batch, noise, seed):
    """Decode ``batch`` rows to ``n_new`` tokens with ``policy``; returns tokens per ms."""
    rng = random.Random(seed)
    n = [0] * batch
    elapsed, fresh = 0.0, True  # the prefill scored the KV blocks, as in the loop

    def jitter():
        return max(0.2, 1.0 + rng.gauss(0.0, noise))

    def vtime(q, scored=True):
        if q == 1:
            return (max(t_plain, verify(1)) if scored else t_plain) * jitter()
        return verify(q) * jitter()

    while min(n) < n_new:
        active = [b for b in range(batch) if n[b] < n_new]
        caps = torch.tensor([n_new - n[b] - 1 for b in active])
        g = policy.choose(caps, int(caps.max()))
        if g and not fresh:  # the loop scores the KV blocks in a plain step first
            policy.note_plain_step()
            t = vtime(1, scored=True)
            elapsed += t
            zero = torch.zeros(len(active), dtype=torch.long)
            policy.observe_iteration(IterationCosts(0, 0.0, t, 0.0, scored=True), zero, zero)
            for b in active:
                n[b] += 1
            active = [b for b in range(batch) if n[b] < n_new]
            if not active:
                break
            g = min(g, max(n_new - n[b] - 1 for b in active))
        td = g * t_draft * jitter()
        tv = vtime(g + 1, scored=g > 0)
        ts = t_select * jitter() if g else 0.0
        elapsed += td + tv + ts
        drafted, accepted = [], []
        for b in active:
            d = max(0, min(g, n_new - n[b] - 1))
            a = 0
            while a < d and rng.random() < p:
                a += 1
            drafted.append(d)
            accepted.append(a)
            n[b] += a + 1
        fresh = g > 0
        policy.observe_iteration(IterationCosts(g, td, tv, ts, scored=g > 0), torch.tensor(drafted),
                                 torch.tensor(accepted))
    return batch * n_new / elapsed


def _curve_points(r: dict, batch: int) -> Tuple[tuple, tuple]:
    """``(tokens, ms)`` of one record's verifications: ``(B, full_step)`` and ``(B q, verify_q<q>)``."""
    pts = {batch: float(r["full_step_ms"])}
    pts.update({batch * int(k[len("verify_q"):-3]): float(v) for k, v in r.items()
                if k.startswith("verify_q") and k.endswith("_ms") and isinstance(v, (int, float))})
    return tuple(zip(*sorted(pts.items())))


def _on_curve(xs, ys, n: float) -> float:
    """Linear between the points, the last two points' line beyond."""
    if n <= xs[-1] or len(xs) < 2:
        return float(np.interp(n, xs, ys))
    return ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (n - xs[-1])


class CostTable:
    """Measured forward times of one batch size from ``bench/decode_step_costs.py --verify-tokens``
    (ms): a plain step, the verification of ``n`` tokens packed over the batch (each row's ``q``
    tokens: the points ``(B q, verify_q<q>)`` and ``(B, full_step)``, linear between them, the last
    two points' line beyond), a draft step of ``r`` rows (the line through the file's batch sizes:
    a step drafts only the rows that still draft) and the selection. Finished rows stay in the
    batch with no tokens: with ``a`` of ``B`` rows active, ``q = n / a`` tokens each, a verification
    costs the batch-1 curve's at ``q`` plus ``(a - 1) / (B - 1)`` of the way to this batch's at
    ``B q`` (the last row alone costs a batch-1 verification); without batch 1 in the file, this
    batch's at ``B q`` (idle rows priced as active ones). Raises ``ValueError`` on a record that
    lacks a field or holds fewer than two verification counts."""

    def __init__(self, recs: dict, batch: int, draft_key: str):
        r = recs[batch]
        for name in ("full_step_ms", "select_ms", draft_key):
            if not isinstance(r.get(name), (int, float)):
                raise ValueError(f"batch {batch} has no number {name!r} (fields: {', '.join(sorted(r))})")
        self.batch, self.plain, self.select = batch, float(r["full_step_ms"]), float(r["select_ms"])
        self.xs, self.ys = _curve_points(r, batch)
        if len(self.xs) < 3:
            raise ValueError(f"batch {batch} has no verify_q<q>_ms entries (run decode_step_costs with "
                             "--verify-tokens)")
        self.one = _curve_points(recs[1], 1) if 1 in recs and batch > 1 else None
        d = {b: float(rec[draft_key]) for b, rec in recs.items() if isinstance(rec.get(draft_key), (int, float))}
        lo, hi = min(d), max(d)
        self.d1 = (d[hi] - d[lo]) / (hi - lo) if hi > lo else 0.0
        self.d0 = d[lo] - self.d1 * lo

    def verify(self, tokens: int, active: Optional[int] = None) -> float:
        """ms of a verification of ``tokens`` tokens over ``active`` rows (default all)."""
        a = self.batch if active is None else max(1, active)
        if a == self.batch:
            return _on_curve(self.xs, self.ys, tokens)
        q = tokens / a
        full = _on_curve(self.xs, self.ys, self.batch * q)
        if self.one is None:
            return full
        one = _on_curve(*self.one, q)
        return one + (a - 1) / (self.batch - 1) * (full - one)

    def draft(self, rows: int) -> float:
        return self.d0 + self.d1 * rows


def load_cost_tables(path: str, context: Optional[int], draft_key: str) -> Dict[int, "CostTable"]:
    """``{batch: CostTable}`` from the records of a ``decode_step_costs`` JSONL (the last record per
    (context, batch); ``context`` None: the largest context in the file). Raises ``OSError`` for a
    file it cannot read and ``ValueError`` for one without usable records."""
    recs = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"line {i} is not JSON ({e.msg})") from None
                if not isinstance(rec, dict) or not isinstance(rec.get("context"), int) \
                        or not isinstance(rec.get("batch"), int):
                    raise ValueError(f"line {i} is not a decode_step_costs record (no context and batch)")
                recs.append(rec)
    if not recs:
        raise ValueError("no records")
    ctx = context if context is not None else max(r["context"] for r in recs)
    by_batch = {r["batch"]: r for r in recs if r["context"] == ctx}
    if not by_batch:
        raise ValueError(f"no record at context {ctx} (contexts: {sorted({r['context'] for r in recs})})")
    return {b: CostTable(by_batch, b, draft_key) for b in sorted(by_batch)}


class _RowsReplay:
    """The state of one :func:`simulate_rows` run: rows' progress, the clock and the noise."""

    def __init__(self, policy, p_rows, table: CostTable, n_new, noise, seed, first_call, drift=0.0,
                 drift_period=1000.0):
        self.policy, self.p_rows, self.table, self.n_new = policy, p_rows, table, n_new
        self.noise, self.first_call, self.rng = noise, first_call, random.Random(seed)
        # the machine's speed: its own generator, so every policy of a seed meets the same phases in time
        self.drift, self.drift_period, self.drift_rng = drift, drift_period, random.Random(f"drift {seed}")
        self.speed, self.phase_end = 1.0, 0.0
        self.B = len(p_rows)
        self.n = [0] * self.B
        self.elapsed, self.seen = 0.0, set()

    def jitter(self) -> float:
        """A timing's factor: the current phase's speed times Gaussian noise."""
        while self.drift and self.elapsed >= self.phase_end:
            self.phase_end += self.drift_rng.expovariate(1.0 / self.drift_period)
            self.speed = math.exp(self.drift_rng.gauss(0.0, self.drift))
        return self.speed * max(0.2, 1.0 + self.rng.gauss(0.0, self.noise))

    def verify(self, tokens: int, scored: bool) -> float:
        """ms of a verification of ``tokens`` tokens over the active rows (an unscored one of ``B``
        tokens: a plain step)."""
        t = self.table.plain if not scored and tokens == self.B else self.table.verify(tokens, len(self.active()))
        if tokens not in self.seen:  # a new shape
            self.seen.add(tokens)
            t *= 1.0 + self.first_call
        return t * self.jitter()

    def active(self) -> list:
        return [b for b in range(self.B) if self.n[b] < self.n_new]

    def caps(self) -> Tensor:
        return torch.tensor([self.n_new - x - 1 if x < self.n_new else -1 for x in self.n])

    def scored_plain_step(self) -> None:
        """The plain step that scores the KV blocks before drafts that follow plain steps."""
        self.policy.note_plain_step()
        active = self.active()
        t = self.verify(len(active), True)
        self.elapsed += t
        zero = torch.zeros(self.B, dtype=torch.long)
        self.policy.observe_iteration(IterationCosts(0, 0.0, t / 1e3, 0.0, scored=True, tokens=len(active),
                                                     rows=self.B), zero, zero)
        for b in active:
            self.n[b] += 1

    def iteration(self, gs: list) -> None:
        """Draft ``gs[b]`` tokens per row (draft steps of the rows still drafting), verify, accept."""
        g, active, table = max(gs), self.active(), self.table
        steps = [(r, table.draft(r) * self.jitter()) for r in (sum(1 for x in gs if x > s) for s in range(g))]
        td = sum(t for _, t in steps)
        tokens = sum(gs[b] + 1 for b in active)
        tv = self.verify(tokens, g > 0)
        ts = table.select * self.jitter() if g else 0.0
        self.elapsed += td + tv + ts
        drafted, accepted = [0] * self.B, [0] * self.B
        for b in active:
            a = 0
            while a < gs[b] and self.rng.random() < self.p_rows[b]:
                a += 1
            drafted[b], accepted[b] = gs[b], a
            self.n[b] = min(self.n_new, self.n[b] + a + 1)
        steps_s = [(r, t / 1e3) for r, t in steps] if g else None
        self.policy.observe_iteration(IterationCosts(g, td / 1e3, tv / 1e3, ts / 1e3, scored=g > 0, tokens=tokens,
                                                     rows=self.B, draft_steps=steps_s),
                                      torch.tensor(drafted), torch.tensor(accepted))


def simulate_rows(policy, p_rows, table: CostTable, n_new, noise, seed, first_call=0.0, drift=0.0,
                  drift_period=1000.0):
    """Decode ``len(p_rows)`` rows to ``n_new`` tokens each as our loop does with drafts per row
    (``policy.choose_rows``; finished rows stay in the batch with no tokens, draft steps draft the
    rows that still draft), row ``b`` accepting each draft with probability ``p_rows[b]`` given the
    ones before it; timings from ``table`` times Gaussian noise (relative std ``noise``), the first
    forward at each token count ``1 + first_call`` times dearer (a new shape; the prefill's last
    forward, ``cap + 1`` tokens per row, is the first at its count and is not counted in the time);
    with ``drift``, the machine's speed changes in phases (lengths exponential with mean
    ``drift_period`` ms of replayed time, each multiplying every timing by ``exp(N(0, drift))``),
    the same phases for every policy of a seed. Returns tokens per ms."""
    run = _RowsReplay(policy, p_rows, table, n_new, noise, seed, first_call, drift, drift_period)
    B = run.B
    n0 = B * (policy.max_gamma + 1)
    t0 = run.verify(n0, True)
    if hasattr(policy, "observe_prefill"):  # the cost model's first point
        policy.observe_prefill(n0, B, t0 / 1e3)
    fresh = True  # the prefill scored the KV blocks
    while run.active():
        gs = policy.choose_rows(run.caps()).clamp(min=0).tolist()
        if any(gs) and not fresh:  # the loop scores the KV blocks in a plain step first
            run.scored_plain_step()
            if not run.active():
                break
            gs = [max(0, min(g, int(x))) for g, x in zip(gs, run.caps().tolist())]
        run.iteration(gs)
        fresh = max(gs) > 0
    return B * n_new / run.elapsed


def main_rows(args: argparse.Namespace) -> None:
    """``--costs``: our loop's ``auto`` (drafts per row) against fixed gammas on a measured cost table."""
    tables = args.tables
    cap = args.max_speculative_tokens
    policies = {"full": lambda: FixedGamma(0), "auto": lambda: make_gamma_policy(cap, "auto")}
    for i, v in enumerate(args.variants or []):
        policies[f"variant {i}"] = (lambda v=v: RowGamma(cap, **row_gamma_kwargs(v)))
    policies.update({f"gamma {g}": (lambda g=g: FixedGamma(g)) for g in args.fixed})
    names = [k for k in policies if k.startswith("auto") or k.startswith("variant")]
    print(f"# {args.costs}: {args.new_tokens} new tokens, noise {args.noise}, first call +{args.first_call}, "
          f"drift {args.drift} per {args.drift_period:g} ms, "
          f"{args.seeds} seeds, cap {cap}, acceptance spread between rows {args.row_spread}")
    for i, v in enumerate(args.variants or []):
        print(f"# variant {i}: {json.dumps(v)}")
    print("\n| batch | p | best fixed (x full) | " + " | ".join(f"{k} / best" for k in names) + " |")
    print("|---:|---:|---|" + "---:|" * len(names))
    worst = {k: [] for k in names}
    for B, table in tables.items():
        for p in args.acceptance:
            p_rows = [p] if B == 1 else [min(1.0, max(0.0, p + args.row_spread * (2 * b / (B - 1) - 1)))
                                         for b in range(B)]
            rate = {k: statistics.mean(simulate_rows(mk(), p_rows, table, args.new_tokens, args.noise, s,
                                                     args.first_call, args.drift, args.drift_period)
                                       for s in range(args.seeds))
                    for k, mk in policies.items()}
            fixed = {k: v for k, v in rate.items() if k.startswith("gamma")}
            best = max(fixed, key=fixed.get)
            for k in names:
                worst[k].append(rate[k] / fixed[best])
            print(f"| {B} | {p:.2f} | {best} ({fixed[best] / rate['full']:.2f}x) | "
                  + " | ".join(f"{rate[k] / fixed[best]:.3f}" for k in names) + " |")
    print()
    for k in names:
        print(f"{k} / best fixed: min {min(worst[k]):.3f}, mean {statistics.mean(worst[k]):.3f}")


def _check_numbers(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors for numbers out of range (NaN included)."""
    def bad(name, ok):
        if not ok:
            ap.error(f"--{name}: got {getattr(args, name.replace('-', '_'))}")

    bad("seeds", args.seeds >= 1)
    bad("new-tokens", args.new_tokens >= 2)
    bad("max-speculative-tokens", args.max_speculative_tokens >= 1)
    bad("noise", 0.0 <= args.noise < 1.0)
    bad("first-call", 0.0 <= args.first_call < 10.0)
    bad("row-spread", 0.0 <= args.row_spread <= 1.0)
    bad("drift", 0.0 <= args.drift < 2.0)
    bad("drift-period", args.drift_period > 0.0)
    bad("acceptance", all(0.0 <= p <= 1.0 for p in args.acceptance))
    bad("fixed", all(1 <= g <= args.max_speculative_tokens for g in args.fixed))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``); a usage error (exit 2) on ``--variant``
    keywords that ``AutoGamma`` refuses, before the replay."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=os.path.join(HERE, "results", "gamma_xeon_avx512", "kjv_256tok_b4", "runs.jsonl"))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--acceptance", type=float, nargs="+", default=[0.75, 0.85, 0.92],
                    help="per-position conditional acceptance rates to simulate")
    ap.add_argument("--fixed", type=int, nargs="+", default=[2, 3, 4, 6])
    ap.add_argument("--max-speculative-tokens", type=int, default=8)
    ap.add_argument("--noise", type=float, default=0.08, help="relative std of every timing")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--verify-model", choices=["line", "measured"], default="line",
                    help="verification cost per q: a line through the fixed-gamma runs, or each q's measured cost")
    ap.add_argument("--repeats", choices=["first", "all"], default="first",
                    help="costs from the first repeat, or medians over all repeats (ratios to each repeat's full step)")
    ap.add_argument("--costs", default=None, metavar="JSONL",
                    help="replay our loop's auto (drafts per row, RowGamma) on the forward times of a "
                         "bench/decode_step_costs.py --verify-tokens run instead of --runs")
    ap.add_argument("--context", type=int, default=None,
                    help="with --costs: the context's records (default the largest)")
    ap.add_argument("--draft-key", default="draft_step_int8_ms", help="with --costs: the draft step's field")
    ap.add_argument("--first-call", type=float, default=0.15,
                    help="with --costs: a first forward at a token count costs this much more (a new shape)")
    ap.add_argument("--drift", type=float, default=0.0,
                    help="with --costs: the machine's speed changes in phases, each multiplying every timing "
                         "by exp(N(0, drift)) (a VM whose speed moves within a run)")
    ap.add_argument("--drift-period", type=float, default=1000.0,
                    help="with --drift: mean length of a phase in ms of replayed time")
    ap.add_argument("--row-spread", type=float, default=0.0,
                    help="with --costs: rows' acceptance spread evenly over p +- this (batch 1: p)")
    ap.add_argument("--variants", type=json.loads, default=None, metavar="JSON",
                    help="with --costs: a list of RowGamma keyword dicts, each replayed beside auto")
    ap.add_argument("--variant", type=json.loads, default=None, metavar="JSON",
                    help='AutoGamma keyword arguments of a second auto policy, reported beside the default, '
                         'e.g. \'{"max_probe_interval": 16}\'')
    args = ap.parse_args(argv)
    _check_numbers(ap, args)
    _check_policies(ap, args)
    return args


def _check_policies(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors for ``--variant`` / ``--variants`` given to the wrong mode or with keywords the
    policy refuses, and for an unreadable ``--costs`` file (read into ``args.tables``), before the
    replay."""
    if args.costs is not None:
        if args.variant is not None:
            ap.error("--variant is for --runs (AutoGamma); with --costs give --variants (RowGamma)")
        try:  # read here: a bad file is a usage error, before the replay
            args.tables = load_cost_tables(args.costs, args.context, args.draft_key)
        except (OSError, ValueError) as e:
            ap.error(f"--costs {args.costs}: {e}")
    elif args.variants is not None:
        ap.error("--variants is for --costs; with --runs give --variant")
    if args.variants is not None:
        if not isinstance(args.variants, list) or not all(isinstance(v, dict) for v in args.variants):
            ap.error("--variants: expected a JSON list of objects")
        if any("cost_ema" in v for v in args.variants):
            ap.error("--variants: RowGamma does not use cost_ema")
        for v in args.variants:
            try:
                RowGamma(args.max_speculative_tokens, **row_gamma_kwargs(v))
            except (TypeError, ValueError) as e:
                ap.error(f"--variants: {e}")
    if args.variant is not None:
        try:  # bad keywords fail here, before the replay
            AutoGamma(args.max_speculative_tokens, **args.variant)
        except (TypeError, ValueError) as e:
            ap.error(f"--variant: {e}")


def make_policies(args: argparse.Namespace) -> dict:
    """Name -> a factory of a fresh policy: ``full``, ``auto``, ``variant`` (with ``--variant``) and
    ``gamma <g>`` for every ``--fixed`` g."""
    policies = {"full": lambda: FixedGamma(0), "auto": lambda: AutoGamma(args.max_speculative_tokens)}
    if args.variant is not None:
        policies["variant"] = lambda: AutoGamma(args.max_speculative_tokens, **args.variant)
    policies.update({f"gamma {g}": (lambda g=g: FixedGamma(g)) for g in args.fixed})
    return policies


def main(argv=None):
    args = parse_args(argv)
    if args.costs:
        return main_rows(args)
    policies = make_policies(args)
    var = args.variant is not None
    print("| context | batch | p | best fixed | auto / full | auto / best |"
          + (" variant / full | variant / best |" if var else "")
          + f" ({args.new_tokens} new tokens, noise {args.noise}, "
          f"{args.seeds} seeds, verify {args.verify_model}, repeats {args.repeats}"
          + (f", variant {json.dumps(args.variant)}" if var else "") + ")")
    print("|---:|---:|---:|---|---:|---:|" + ("---:|---:|" if var else "") + "---|")
    worst_full, worst_best, worst_var = [], [], []
    for (ctx, batch), (tp, td, ts, verify) in cells_from_runs(args.runs, args.verify_model, args.repeats).items():
        for p in args.acceptance:
            rate = {k: statistics.median(simulate(mk(), p, tp, td, ts, verify, args.new_tokens, batch, args.noise, s)
                                         for s in range(args.seeds)) for k, mk in policies.items()}
            fixed = {k: v for k, v in rate.items() if k.startswith("gamma")}
            best = max(fixed, key=fixed.get)
            a_full, a_best = rate["auto"] / rate["full"], rate["auto"] / fixed[best]
            worst_full.append(a_full)
            worst_best.append(a_best)
            row = (f"| {ctx} | {batch} | {p:.2f} | {best} ({fixed[best] / rate['full']:.2f}x full) | "
                   f"{a_full:.2f} | {a_best:.2f} |")
            if var:
                v_full, v_best = rate["variant"] / rate["full"], rate["variant"] / fixed[best]
                worst_var.append((v_full, v_best))
                row += f" {v_full:.2f} | {v_best:.2f} |"
            print(row)
    print(f"\nauto / full: min {min(worst_full):.3f}; auto / best fixed: min {min(worst_best):.3f}, "
          f"median {statistics.median(worst_best):.3f}")
    if var:
        print(f"variant / full: min {min(v for v, _ in worst_var):.3f}; variant / best fixed: min "
              f"{min(b for _, b in worst_var):.3f}, median {statistics.median(b for _, b in worst_var):.3f}")


if __name__ == "__main__":
    main()
