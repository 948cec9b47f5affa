"""Per-forward costs of one decoding iteration on the embedded SmolLM2, without prefill.

Fills a :class:`vegas_ext.cache.VegasCache` (and, for HF, a ``DynamicCache``) with ``context``
random K/V per row, then times single forwards, interleaved and repeated, keeping the minimum
(robust to a busy shared machine):

* ``hf_step``: HF's own decode step (sdpa, DynamicCache; the appended token is cropped after),
* ``full_step``: our plain step (``verify_attention`` with Q=1; the ``"full"`` algorithm),
* ``draft_step``: one draft token over the selected budget (``sparse_draft_attention``),
* ``verify``: the verification of gamma+1 tokens (``verify_attention``),
* ``select``: one ``block_topk`` over all layers.

and prints the speedups the cost model predicts for a mean acceptance length ``tau`` (given or
1 + 0.8 * gamma): ``tau * full_step / (gamma * draft_step + verify + select)``.

Usage: ``python bench/decode_step_costs.py --contexts 2048,4096,8192 --batches 1,4 --gamma 6``
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import DynamicCache

from vegas_ext import models
from vegas_ext.cache import VegasCache
from vegas_ext.decode import SelectionConfig, SelectionContext, VegasSelection, _cache_kwarg
from vegas_ext.hf import AttentionState, patched


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--tau", type=float, default=None, help="mean acceptance length for the prediction")
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = models.load_model()
    cfg = model.config
    V = cfg.vocab_size
    g = args.gamma
    ck = _cache_kwarg(model)
    tau = args.tau if args.tau is not None else 1 + 0.8 * g
    out_f = open(args.out, "a") if args.out else None
    for B in [int(x) for x in args.batches.split(",")]:
        for S in [int(x) for x in args.contexts.split(",")]:
            torch.manual_seed(0)
            cache = VegasCache.for_model(model, B, S + g + 2)
            for lay in cache.layers:
                lay.keys.normal_()
                lay.values.normal_()
            cache.commit(torch.full((B,), S, dtype=torch.int32))
            st = AttentionState(cache=cache, block_size=args.block_size)
            L, H = len(cache.layers), cache.layers[0].num_heads
            nb = -(-cache.max_len // args.block_size)
            st.block_scores = torch.rand(L, B, H, nb)
            sel = VegasSelection(SelectionConfig(args.ratio, args.min_tokens, None, args.block_size, 1, False))
            tail = torch.full((B,), S - g - 1, dtype=torch.int32)
            st.tail_start = tail
            ctx = SelectionContext(st.block_scores, cache.lengths, tail, cache)
            st.block_indices = sel.select(ctx)
            hf_cache = DynamicCache(config=cfg)
            hd = cache.layers[0].keys.shape[-1]
            for i in range(L):
                hf_cache.update(torch.randn(B, H, S, hd), torch.randn(B, H, S, hd), i)
            tok = torch.randint(0, V, (B, g + 1))
            pos = torch.full((B, g + 1), S) + torch.arange(g + 1)

            def our(mode, q):
                st.mode = mode
                cache.begin_forward(q)
                model(input_ids=tok[:, :q], position_ids=pos[:, :q], use_cache=True, logits_to_keep=0, **{ck: cache})

            def hf_step():
                model(input_ids=tok[:, :1], position_ids=pos[:, :1], use_cache=True,
                      attention_mask=torch.ones(B, S + 1, dtype=torch.long), **{ck: hf_cache})
                hf_cache.crop(-1)  # drop the appended token (5.24 API; older: crop(S))

            def select():
                st.block_indices = sel.select(ctx)

            fns = {
                "hf_step": hf_step,
                "full_step": lambda: our("verify", 1),
                "draft_step": lambda: our("draft", 1),
                "verify": lambda: our("verify", g + 1),
                "select": select,
            }
            best = {k: float("inf") for k in fns}
            with torch.inference_mode():
                for _ in range(args.reps):
                    with patched(model):
                        with st.activate():
                            for k in ("full_step", "draft_step", "verify", "select"):
                                t0 = time.perf_counter()
                                fns[k]()
                                best[k] = min(best[k], time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    hf_step()
                    best["hf_step"] = min(best["hf_step"], time.perf_counter() - t0)
            it = g * best["draft_step"] + best["verify"] + best["select"]
            rec = dict(
                context=S, batch=B, gamma=g, tau=tau, block_size=args.block_size, ratio=args.ratio,
                min_tokens=args.min_tokens, threads=torch.get_num_threads(), dtype=str(next(model.parameters()).dtype),
                **{f"{k}_ms": round(v * 1e3, 2) for k, v in best.items()},
                hf_tok_s=round(B / best["hf_step"], 2), full_tok_s=round(B / best["full_step"], 2),
                vegas_tok_s_pred=round(B * tau / it, 2),
                pred_speedup_vs_full=round(tau * best["full_step"] / it, 2),
                pred_speedup_vs_hf=round(tau * best["hf_step"] / it, 2),
            )
            print(json.dumps(rec), flush=True)
            if out_f:
                out_f.write(json.dumps(rec) + "\n")
                out_f.flush()
            del cache, hf_cache, st


if __name__ == "__main__":
    main()
