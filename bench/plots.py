"""PNG plots of an end-to-end benchmark run (``bench.e2e``'s ``runs.jsonl``).

Writes, into the results folder:

* ``mal_vs_ratio.png``: mean acceptance length (pooled: 1 + all accepted / all drafts of the runs,
  e.g. over documents) vs KV budget ratio, one panel per (context, batch), one line per algorithm
  configuration;
* ``tokens_per_s_vs_context.png``: decode tokens/s vs context length, one panel per (batch, ratio),
  plain decoding (``hf``, ``full``) in every panel;
* ``per_position_acceptance.png``: fraction of drafts whose j-th token was accepted, one panel per
  gamma, one line per configuration;
* ``selection_overhead.png``: selection time as a share of an iteration, per configuration;
* ``gamma_per_iteration.png``: the gamma ``num_speculative_tokens=auto`` chose at every iteration,
  one panel per (context, batch), one line per run.

Colour = algorithm, line style = gamma.

Called by ``bench.e2e`` after a run and by ``python -m bench.report runs RUNS.jsonl`` (or call
:func:`write_plots`).
"""
from __future__ import annotations

import os
import re
from collections import defaultdict
from typing import Any, Dict, List, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from bench.common import median  # noqa: E402

_SPEC = ("hf", "full")


def _base_label(r: Dict[str, Any]) -> str:
    """Configuration label without the ratio (``vegas/shared g6 b16``)."""
    return re.sub(r" r[0-9.e-]+", "", r["label"])


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


_COLORS = {"vegas": "tab:red", "quest": "tab:blue", "streamingllm": "tab:green", "full": "black", "hf": "tab:gray"}
_STYLES = ["-", "--", ":", "-."]


def _algo(r: Dict[str, Any]) -> str:
    return r["algorithm"] + (f"/{r['variant']}" if r.get("variant") else "")


def _gamma_key(g):
    """Sort key of a ``num_speculative_tokens`` value: integers first, then ``"auto"``."""
    return (1, 0) if isinstance(g, str) else (0, g)


def _style(r: Dict[str, Any], gammas: List[int], algos: List[str]):
    """Colour by algorithm (variants get their own), line style by gamma."""
    a = _algo(r)
    color = _COLORS.get(a) or plt.get_cmap("tab10")(algos.index(a) % 10)
    g = r.get("num_speculative_tokens") or 0
    ls = _STYLES[gammas.index(g) % len(_STYLES)] if g in gammas else "-"
    return color, ls


def _facets(n: int, w: float = 4.2, h: float = 3.2):
    cols = min(n, 3) if n != 4 else 2
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols + 1.5, h * rows + 0.5), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _label_panel(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _save_facets(fig, axes, title: str, path: str) -> str:
    axes[0].legend(fontsize=6)
    fig.suptitle(title)
    return _save(fig, path)


def write_plots(records: List[Dict[str, Any]], out_dir: str) -> List[str]:
    """Write the PNGs (up to five) for ``records`` (dicts as in ``runs.jsonl``) into ``out_dir``; returns their
    paths (a plot without data is skipped). Several contexts / batch sizes / ratios / gammas are
    drawn as small multiples, one panel per cell, colour = algorithm, line style = gamma."""
    spec = [r for r in records if r.get("algorithm") not in _SPEC and r.get("mean_acceptance_length") is not None]
    gammas = sorted({r.get("num_speculative_tokens") or 0 for r in spec}, key=_gamma_key)
    algos = sorted({_algo(r) for r in records})
    paths = [mal_plot(spec, out_dir, gammas, algos), throughput_plot(records, out_dir, gammas, algos),
             per_position_plot(spec, out_dir, gammas, algos), overhead_plot(spec, out_dir), gamma_plot(spec, out_dir)]
    return [p for p in paths if p]


def mal_plot(spec: List[Dict[str, Any]], out_dir: str, gammas, algos) -> Optional[str]:
    """``mal_vs_ratio.png``: pooled MAL vs budget ratio, one panel per (context, batch)."""
    if not spec:
        return None
    cells = sorted({(r["context"], r["batch_size"]) for r in spec})
    fig, axes = _facets(len(cells))
    for ax, (ctx, B) in zip(axes, cells):
        groups = defaultdict(lambda: defaultdict(list))
        for r in spec:
            if (r["context"], r["batch_size"]) == (ctx, B):
                groups[_base_label(r)][r["sparse_attn_ratio"]].append(r)
        for key, by_ratio in sorted(groups.items()):
            xs = sorted(by_ratio)
            ys = [1 + sum(r.get("num_accepted_tokens") or 0 for r in by_ratio[x])
                  / max(1, sum(r.get("num_drafts") or 0 for r in by_ratio[x])) for x in xs]
            color, ls = _style(by_ratio[xs[0]][0], gammas, algos)
            ax.plot(xs, ys, marker="o", color=color, linestyle=ls, label=key)
        _label_panel(ax, f"context {ctx}, batch {B}", "KV budget ratio", "mean acceptance length")
    return _save_facets(fig, axes, "Acceptance vs budget (pooled over documents)",
                        os.path.join(out_dir, "mal_vs_ratio.png"))


def throughput_plot(records: List[Dict[str, Any]], out_dir: str, gammas, algos) -> Optional[str]:
    """``tokens_per_s_vs_context.png``: one panel per (batch, ratio), plain decoding in every panel."""
    tp_rs = [r for r in records if r.get("decode_tokens_per_s") is not None]
    if not tp_rs:
        return None
    batches = sorted({r["batch_size"] for r in tp_rs})
    ratios = sorted({r["sparse_attn_ratio"] for r in tp_rs if r.get("sparse_attn_ratio") is not None}) or [None]
    panels = [(b, q) for b in batches for q in ratios]
    fig, axes = _facets(len(panels))
    for ax, (B, q) in zip(axes, panels):
        tp = defaultdict(lambda: defaultdict(list))
        first = {}
        for r in tp_rs:
            if r["batch_size"] != B or (r.get("sparse_attn_ratio") not in (None, q)):
                continue
            k = _base_label(r)
            tp[k][r["context"]].append(r["decode_tokens_per_s"])
            first.setdefault(k, r)
        for key, by_ctx in sorted(tp.items()):
            xs = sorted(by_ctx)
            color, ls = _style(first[key], gammas, algos)
            ax.plot(xs, [median(by_ctx[x]) for x in xs], marker="o", color=color, linestyle=ls, label=key)
        _label_panel(ax, f"batch {B}" + (f", ratio {q:g}" if q is not None else ""), "context length (tokens)",
                     "decode tokens/s (all rows)")
    return _save_facets(fig, axes, "Throughput vs context (median over documents)",
                        os.path.join(out_dir, "tokens_per_s_vs_context.png"))


def per_position_plot(spec: List[Dict[str, Any]], out_dir: str, gammas, algos) -> Optional[str]:
    """``per_position_acceptance.png``: one panel per gamma, pooled over everything else."""
    acc = defaultdict(lambda: [None, 0, None])
    for r in spec:
        pp = r.get("num_accepted_tokens_per_pos")
        if not pp or not r.get("num_drafts"):
            continue
        a = acc[(r.get("num_speculative_tokens") or 0, _base_label(r))]
        a[0] = [x + y for x, y in zip(a[0], pp)] if a[0] is not None else list(pp)
        a[1] += r["num_drafts"]
        a[2] = r
    if not acc:
        return None
    gs = sorted({g for g, _ in acc}, key=_gamma_key)
    fig, axes = _facets(len(gs))
    for ax, g in zip(axes, gs):
        for (gg, key), (pp, n, r) in sorted(acc.items(), key=lambda kv: (_gamma_key(kv[0][0]), kv[0][1])):
            if gg != g:
                continue
            color, ls = _style(r, gammas, algos)
            ax.plot(range(1, len(pp) + 1), [x / n for x in pp], marker=".", color=color, linestyle=ls, label=key)
        _label_panel(ax, f"γ = {g}", "draft position", "fraction of drafts accepted up to here")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=6)
    fig.suptitle("Per-position acceptance (pooled over contexts, batches, ratios, documents)")
    return _save(fig, os.path.join(out_dir, "per_position_acceptance.png"))


def overhead_plot(spec: List[Dict[str, Any]], out_dir: str) -> Optional[str]:
    """``selection_overhead.png``: one bar per configuration without the ratio."""
    sh = defaultdict(list)
    for r in spec:
        if r.get("select_overhead_share") is not None:
            sh[_base_label(r)].append(r["select_overhead_share"])
    if not sh:
        return None
    keys = sorted(sh)
    fig, ax = plt.subplots(figsize=(7, max(2.5, 0.3 * len(keys) + 1)))
    ax.barh(range(len(keys)), [100 * median(sh[k]) for k in keys])
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels(keys, fontsize=7)
    ax.set_xlabel("selection time, % of an iteration (median over runs)")
    ax.set_title("Selection overhead")
    ax.grid(alpha=0.3, axis="x")
    return _save(fig, os.path.join(out_dir, "selection_overhead.png"))


def gamma_plot(records: List[Dict[str, Any]], out_dir: str) -> Optional[str]:
    """``gamma_per_iteration.png``: the gamma ``num_speculative_tokens=auto`` chose at every
    iteration, one panel per (context, batch), one line per run; ``None`` without such runs."""
    auto = [r for r in records if r.get("gamma_policy") == "auto" and r.get("gamma_per_iteration")]
    if auto:
        cells = sorted({(r["context"], r["batch_size"]) for r in auto})
        fig, axes = _facets(len(cells), w=5.0)
        for ax, (ctx, B) in zip(axes, cells):
            for r in auto:
                if (r["context"], r["batch_size"]) == (ctx, B):
                    gs = r["gamma_per_iteration"]
                    ax.step(range(1, len(gs) + 1), gs, where="mid", alpha=0.8,
                            label=f"{r['doc']} rep {r['repeat']} ({_base_label(r)})")
            _label_panel(ax, f"context {ctx}, batch {B}", "iteration", "γ chosen")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        return _save_facets(fig, axes, "γ chosen per iteration (num_speculative_tokens=auto)",
                            os.path.join(out_dir, "gamma_per_iteration.png"))
    return None
