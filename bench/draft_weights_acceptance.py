"""Acceptance with low-precision draft weights against full-precision drafts (issue 33).

Per document: one prompt of ``--context`` tokens (batch 1), greedy, fixed gamma, ``--new`` tokens;
the same prompt decoded with ``draft_weights`` = none / fp16 / int8 (the prefill shared through
``prefill_cache``). Reports the mean acceptance length (MAL), the acceptance per draft position,
and whether the tokens equal the fp32-draft run's (they must: the verification is unchanged).
Also the next-token argmax agreement of a quantized forward with the fp32 model over the
prompt's last ``--agree-positions`` positions (one prefill forward per kind; int4 = groups of 32,
simulated by dequantized weights, only measured, never decoded).

    python -m bench.draft_weights_acceptance --out bench/results/draft_weights_xeon_avx512/acceptance.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from bench.common import pack_linears
from bench.e2e import build_batch
from vegas_ext import generate, models
from vegas_ext.draft_weights import quantize_int8


def _fake_quant(w, kind):
    """Dequantized copy of ``w`` as the draft would see it (int4: symmetric, groups of 32, [-7, 7])."""
    if kind == "fp16":
        return w.half().float()
    if kind == "int8":
        q, s = quantize_int8(w, 64)
        return (q.float() * s.repeat_interleave(64, 1)[:, : w.shape[1]])
    if kind == "int4":
        N, K = w.shape
        ng = -(-K // 32)
        wp = F.pad(w, (0, ng * 32 - K)).view(N, ng, 32)
        s = wp.abs().amax(-1, keepdim=True) / 7
        q = torch.round(wp / torch.where(s > 0, s, torch.ones_like(s))).clamp(-7, 7)
        return (q * s).view(N, ng * 32)[:, :K]
    raise ValueError(kind)


def agreement(model, ids, n, kinds):
    """Fraction of the last ``n`` positions whose argmax with fake-quantized linears equals fp32's."""
    lins = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.inference_mode():
        ref = model(input_ids=ids).logits[0, -n:].argmax(-1)
    out = {}
    for k in kinds:
        saved = [m.weight for m in lins]
        try:  # new Parameters on the linears only: a tied input embedding keeps its fp32 weight
            for m in lins:
                m.weight = torch.nn.Parameter(_fake_quant(m.weight.detach(), k), requires_grad=False)
            with torch.inference_mode():
                got = model(input_ids=ids).logits[0, -n:].argmax(-1)
        finally:
            for m, w in zip(lins, saved):
                m.weight = w
        out[k] = float((got == ref).float().mean())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", default="pride_and_prejudice,kjv,python_docs")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--agree-positions", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = models.load_model()
    results = {"config": vars(args), "docs": {}}
    docs = args.docs.split(",")
    prompts = {doc: build_batch(tok, doc, args.context, 1, False) for doc in docs}
    # agreement first, on the unpacked model (the fake quantization edits nn.Linear weights)
    agree = {doc: agreement(model, prompts[doc][0][:, -min(args.context, 1024):], args.agree_positions,
                            ["fp16", "int8", "int4"]) for doc in docs}
    pack_linears(model, True)  # as the CLI decodes
    for doc in docs:
        ids, mask = prompts[doc]
        pc, runs = {}, {}
        for kind in (None, "fp16", "int8"):
            out = generate(model, ids, mask, max_new_tokens=args.new, num_speculative_tokens=args.gamma,
                           gamma_policy="fixed", eos_token_id=[], prefill_cache=pc, draft_weights=kind)
            s = out.stats
            runs[str(kind)] = {"mal": s["mean_acceptance_length"], "acceptance_rate": s["draft_acceptance_rate"],
                               "accepted_per_pos": s["num_accepted_tokens_per_pos"], "drafts": s["num_drafts"],
                               "tokens": out.sequences[0, ids.shape[1]:].tolist()}
        base = runs["None"]["tokens"]
        for r in runs.values():
            r["identical_to_fp32_drafts"] = r.pop("tokens") == base
        results["docs"][doc] = {"argmax_agreement": agree[doc], "runs": runs}
        print(doc, json.dumps(results["docs"][doc]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
