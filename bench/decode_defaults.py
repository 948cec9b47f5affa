"""Measure what the defaults of ``vegas_ext.generate`` should be, on the embedded SmolLM2 (CPU).

For each selection variant it runs one greedy ``generate`` with a large gamma (default 8) on a real
document prompt of ``--context`` tokens and records the per-position acceptance. Acceptance for a
smaller gamma is read off the same counts (``tau(g) = 1 + sum_{j<g} P(accepted > j)``), so one run
per variant prices every gamma. Per-step costs come from the same runs (draft step, verify of
gamma+1 tokens, selection) and from a ``"full"`` run (a plain step). The cost model

    tokens/s(g) ~= tau(g) / (g * t_draft + t_verify(g + 1) + t_select)

(t_verify interpolated linearly in the number of verified tokens between the plain step and the
gamma+1 verify) then ranks gamma against plain decoding. Greedy output is also checked against
the ``"full"`` loop (lossless).

Usage: ``python -m bench.decode_defaults --context 4096 --new 48 --out bench/results/tmp/decode_defaults.jsonl``
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import vegas_ext
from vegas_ext import documents, models

VARIANTS = [
    dict(block_size=16, sparse_attn_ratio=0.05, sparse_attn_min_tokens=256),
    dict(block_size=16, sparse_attn_ratio=0.05, sparse_attn_min_tokens=64),
    dict(block_size=16, sparse_attn_ratio=0.1, sparse_attn_min_tokens=64),
    dict(block_size=64, sparse_attn_ratio=0.05, sparse_attn_min_tokens=256),
    dict(block_size=1, sparse_attn_ratio=0.05, sparse_attn_min_tokens=256),
    dict(block_size=16, sparse_attn_ratio=0.05, sparse_attn_min_tokens=256, share_selection_across_heads=True),
    dict(block_size=16, sparse_attn_ratio=0.05, sparse_attn_min_tokens=256, query_weights="first_last"),
]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--document", default="pride_and_prejudice")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--variants", default="all", help="comma-separated indices into VARIANTS, or all")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def variant_record(args: argparse.Namespace, v: dict, out, full, t_plain: float, wall_s: float) -> dict:
    """The record of variant ``v``'s run ``out`` (a ``generate`` output; ``full`` the plain run,
    ``t_plain`` its seconds per step): acceptance per position, per-step costs, and the cost model's
    tokens/s for every gamma up to ``--gamma`` (module docstring)."""
    s = out.stats
    it = max(s["num_iterations"], 1)
    drafts = max(s["num_drafts"], 1)
    p_acc = [c / drafts for c in s["num_accepted_tokens_per_pos"]]
    t_draft = s["time_draft_s"] / max(s["num_draft_tokens"] / args.batch, 1)
    t_ver = s["time_verify_s"] / it
    t_sel = s["time_select_s"] / it
    pred = {}
    for g in range(0, args.gamma + 1):
        tau = 1 + sum(p_acc[:g])
        tv = t_plain + (t_ver - t_plain) * g / args.gamma
        pred[g] = args.batch * tau / (g * t_draft + tv + (t_sel if g else 0.0))
    best = max(pred, key=pred.get)
    return dict(
        kind="vegas", variant=v, context=args.context, batch=args.batch, gamma=args.gamma,
        identical=bool(torch.equal(out.sequences, full.sequences)),
        mean_acceptance_length=s["mean_acceptance_length"], draft_acceptance_rate=s["draft_acceptance_rate"],
        p_accept_per_pos=[round(x, 3) for x in p_acc],
        t_draft_step_s=t_draft, t_verify_s=t_ver, t_select_s=t_sel, t_plain_step_s=t_plain,
        predicted_tokens_per_s={g: round(x, 2) for g, x in pred.items()}, best_gamma=best,
        measured_decode_tokens_per_s=s["decode_tokens_per_s"], wall_s=wall_s,
    )


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = models.load_model()
    docs = [args.document] + [d for d in documents.list_documents() if d != args.document]
    rows = [documents.make_prompt_ids(tok, docs[b % len(docs)], args.context) for b in range(args.batch)]
    ids = torch.tensor(rows)
    common = dict(max_new_tokens=args.new, eos_token_id=[])
    out_f = open(args.out, "a") if args.out else None

    def emit(rec):
        print(json.dumps(rec), flush=True)
        if out_f:
            out_f.write(json.dumps(rec) + "\n")
            out_f.flush()

    full = vegas_ext.generate(model, ids, sparse_attn_algorithm="full", **common)
    fs = full.stats
    t_plain = fs["time_verify_s"] / max(fs["num_iterations"], 1)
    emit(dict(kind="full", context=args.context, batch=args.batch, t_step_s=t_plain,
              decode_tokens_per_s=fs["decode_tokens_per_s"], time_prefill_s=fs["time_prefill_s"],
              threads=torch.get_num_threads()))
    picks = range(len(VARIANTS)) if args.variants == "all" else [int(i) for i in args.variants.split(",")]
    for i in picks:
        v = dict(VARIANTS[i])
        t0 = time.perf_counter()
        out = vegas_ext.generate(model, ids, num_speculative_tokens=args.gamma, gamma_policy="fixed", **v, **common)
        emit(variant_record(args, v, out, full, t_plain, time.perf_counter() - t0))


if __name__ == "__main__":
    main()
