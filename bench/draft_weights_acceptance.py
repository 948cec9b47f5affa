"""Acceptance with low-precision draft weights against full-precision drafts (issue 33).

Per document: one prompt of ``--context`` tokens (batch 1), greedy, fixed gamma, ``--new`` tokens;
the same prompt decoded with ``draft_weights`` = none / fp16 / int8 (the prefill shared through
``prefill_cache``). Reports the mean acceptance length (MAL), the acceptance per draft position,
and whether the tokens equal the fp32-draft run's (they must: the verification is unchanged).
Also the next-token argmax agreement of a quantized forward with the fp32 model over the
prompt's last ``--agree-positions`` positions (one prefill forward per kind; int4 = groups of 32,
simulated by dequantized weights, only measured, never decoded).

    python -m bench.draft_weights_acceptance --out bench/results/draft_weights_xeon_avx512/acceptance.json

``--cuda-kinds`` (issue 47) measures the CUDA draft linears' numerics on CPU, side by side with the
CPU kinds: every kind's draft linear runs the same way (the model's own draft forward, not the lean
one; the decode's draft weights replaced by the kind's linear), through PyTorch's CPU kernels of the
very ops the CUDA copies call -- ``int8-pc``: per-channel int8 through ``torch._weight_int8pack_mm``;
``fp8``: per-channel e4m3 weights and per-row e4m3 activations through ``torch._scaled_mm`` (bf16
out) -- and ``fp8-w`` (e4m3 weights dequantized to fp32, activations fp32: weight-only fp8's numerics,
for comparison). ``fp16`` / ``int8`` there are dequantized fp32 weights (the CPU kinds' numerics).

    python -m bench.draft_weights_acceptance --cuda-kinds --context 1024 --new 64 \
        --out bench/results/draft_weights_cuda_kinds_sim/acceptance.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from bench.common import pack_linears
from bench.e2e import build_batch
from vegas_ext import decode as decode_mod, generate, models
from vegas_ext.draft_weights import cached_draft_weights, fp8_linear, int8_channel_linear, quantize_fp8, quantize_int8

#: ``--cuda-kinds``: the kinds decoded (None: the model's own weights) and measured for agreement.
SIM_DECODE = (None, "fp16", "int8", "int8-pc", "fp8-w", "fp8")
SIM_AGREE = ("fp16", "int8", "int8-pc", "fp8-w", "fp8", "int4")


def _fake_quant(w, kind):
    """Dequantized copy of ``w`` as the draft would see it (int4: symmetric, groups of 32, [-7, 7])."""
    if kind == "fp16":
        return w.half().float()
    if kind == "int8":
        q, s = quantize_int8(w, 64)
        return (q.float() * s.repeat_interleave(64, 1)[:, : w.shape[1]])
    if kind == "int8-pc":
        q, s = quantize_int8(w, w.shape[1])
        return q.float() * s
    if kind == "fp8-w":
        q, s = quantize_fp8(w)
        return q.float() * s[:, None]
    if kind == "int4":
        N, K = w.shape
        ng = -(-K // 32)
        wp = F.pad(w, (0, ng * 32 - K)).view(N, ng, 32)
        s = wp.abs().amax(-1, keepdim=True) / 7
        q = torch.round(wp / torch.where(s > 0, s, torch.ones_like(s))).clamp(-7, 7)
        return (q * s).view(N, ng * 32)[:, :K]
    raise ValueError(kind)


def sim_linear(kind, mod):
    """``x -> y`` of ``mod`` as ``kind``'s draft linear computes it (see the module docstring)."""
    w, b = mod.weight.detach(), mod.bias
    if kind == "int8-pc":
        q, s = quantize_int8(w, w.shape[1])
        s = s.view(-1).contiguous()
        f = lambda x2: int8_channel_linear(x2, q, s)  # noqa: E731
    elif kind == "fp8":
        q, s = quantize_fp8(w)
        f = lambda x2: fp8_linear(x2, q, s).float()  # noqa: E731
    else:
        wd = _fake_quant(w, kind)
        f = lambda x2: x2 @ wd.T  # noqa: E731

    def linear(x):
        y = f(x.reshape(-1, x.shape[-1]))
        y = y if b is None else y + b
        return y.view(*x.shape[:-1], y.shape[-1])
    return linear


def sim_agreement(model, ids, n, kinds):
    """:func:`agreement` with each linear's forward replaced by :func:`sim_linear` of the kind."""
    lins = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.inference_mode():
        ref = model(input_ids=ids).logits[0, -n:].argmax(-1)
    out = {}
    for k in kinds:
        try:
            for m in lins:
                m.forward = sim_linear(k, m)
            with torch.inference_mode():
                got = model(input_ids=ids).logits[0, -n:].argmax(-1)
        finally:
            for m in lins:
                del m.forward
        out[k] = float((got == ref).float().mean())
    return out


def sim_decode(model, ids, mask, args, pc):
    """Per kind of :data:`SIM_DECODE`: greedy Vegas decoding whose drafts' linears are ``kind``'s
    (:func:`sim_linear`; the verification reads the model's own weights as always)."""
    runs = {}
    lean = decode_mod.lean_draft
    decode_mod.lean_draft = lambda *a, **k: None  # drafts through the model's forward: the wrapped linears
    try:
        for kind in SIM_DECODE:
            dw = None
            if kind is not None:
                dw = cached_draft_weights(model, "fp16")  # the installed wrappers call dw.linear
                fns = {id(m): sim_linear(kind, m) for m in dw.linears()}
                dw.linear = lambda mod, x, own, fns=fns: fns[id(mod)](x) if id(mod) in fns else own(mod, x)
            t0 = time.perf_counter()
            out = generate(model, ids, mask, max_new_tokens=args.new, num_speculative_tokens=args.gamma,
                           gamma_policy="fixed", eos_token_id=[], prefill_cache=pc,
                           draft_weights=None if kind is None else "fp16")
            s = out.stats
            runs[str(kind)] = {"mal": s["mean_acceptance_length"], "acceptance_rate": s["draft_acceptance_rate"],
                               "accepted_per_pos": s["num_accepted_tokens_per_pos"], "drafts": s["num_drafts"],
                               "wall_s": round(time.perf_counter() - t0, 2),
                               "tokens": out.sequences[0, ids.shape[1]:].tolist()}
            if dw is not None:
                del dw.linear
    finally:
        decode_mod.lean_draft = lean
    return runs


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
    ap.add_argument("--cuda-kinds", action="store_true",
                    help="the CUDA draft linears' numerics (int8-pc, fp8, fp8-w) beside fp16 / int8, see above")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = models.load_model()
    results = {"config": vars(args), "docs": {}}
    docs = args.docs.split(",")
    prompts = {doc: build_batch(tok, doc, args.context, 1, False) for doc in docs}
    if args.cuda_kinds:
        for doc in docs:
            ids, mask = prompts[doc]
            agree = sim_agreement(model, ids[:, -min(args.context, 1024):], args.agree_positions, SIM_AGREE)
            runs = sim_decode(model, ids, mask, args, {})
            base = runs["None"]["tokens"]
            for r in runs.values():
                r["identical_to_fp32_drafts"] = r.pop("tokens") == base
            results["docs"][doc] = {"argmax_agreement": agree, "runs": runs}
            print(doc, json.dumps(results["docs"][doc]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        return
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
