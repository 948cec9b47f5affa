"""A/B configurations of the ``auto`` gamma policy end to end, on one cell, in alternating rounds.

``bench/gamma_policy_sim.py`` replays a policy against measured costs with independent
acceptances; what it cannot reproduce -- the order in which a real run's early acceptances and
timings arrive, which decides whether the policy settles on a short draft -- only a real run
shows, and one run per configuration says little (the same configuration ran at 1.00x and 1.12x
plain decoding at 4K, batch 4 on the same machine). This script decodes one batch of
``bench/e2e.py``'s prompts (``build_batch``: rows start at different places of the document) with
``full`` (plain decoding), each ``auto`` configuration given (keyword arguments of ``RowGamma``,
the loop's ``auto``) and each fixed gamma given, ``--rounds`` times in alternating order, checks
that every run's tokens equal plain decoding's, and prints one JSON line per run
(``decode_tokens_per_s`` of ``out.stats``, γ per iteration and its histogram, mean acceptance
length) and per configuration the median ratio to ``full`` of the same round.

    python -m bench.ab_gamma_policy --context 4096 --batch 4 --rounds 3 \\
        --variants '{"climb": {"climb": true}, "default": {}, "gamma 3": 3}'

Greedy, EOS ignored, fp32, the embedded model unless ``--model`` names one, the vegas defaults
(ratio 0.05, block size 1); pin it to one core (``taskset -c 0``) on a shared machine.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics

import torch

from bench.common import add_pack_linears_flag, pack_linears, row_gamma_kwargs
from bench.e2e import build_batch
from vegas_ext import decode, generate, speculation
from vegas_ext.models import load_model


@contextlib.contextmanager
def _auto_with(kwargs: dict):
    """While inside, ``gamma_policy="auto"`` in our loop builds ``RowGamma(cap, **kwargs)`` (the
    policy :func:`vegas_ext.speculation.make_gamma_policy` gives it) instead of its defaults."""
    original = decode.make_gamma_policy

    def make(cap, gamma_policy, **kw):
        if gamma_policy == "auto" and cap > 0 and not kw.get("per_request"):
            return speculation.RowGamma(cap, **row_gamma_kwargs(kwargs))
        return original(cap, gamma_policy, **kw)

    decode.make_gamma_policy = make
    try:
        yield
    finally:
        decode.make_gamma_policy = original


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.ab_gamma_policy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded model)")
    ap.add_argument("--doc", default="kjv", help="document of vegas_ext.documents (default kjv)")
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens per row (default 4096)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    add_pack_linears_flag(ap)
    ap.add_argument("--variants", type=json.loads, required=True, metavar="JSON",
                    help='{"name": RowGamma keyword arguments (an object; "costs": an object of TokenCostModel\'s) '
                         'or a fixed gamma (an int), ...}')
    a = ap.parse_args(argv)
    if not isinstance(a.variants, dict) or not a.variants or "full" in a.variants:
        ap.error('--variants: a non-empty JSON object of names (not "full") to keyword objects or ints')
    for name, v in a.variants.items():
        if isinstance(v, dict):
            if "cost_ema" in v:  # RowGamma ignores it
                ap.error(f"--variants: {name!r}: cost_ema cannot be varied here")
            try:
                speculation.RowGamma(8, **row_gamma_kwargs(v))
            except (TypeError, ValueError, OverflowError) as e:
                ap.error(f"--variants: {name!r}: {e}")
        elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
            ap.error(f"--variants: {name!r} must be a keyword object or a fixed gamma >= 1, got {v!r}")
    if a.rounds < 1 or a.batch < 1 or a.max_new_tokens < 2:
        ap.error("--rounds and --batch must be >= 1, --max-new-tokens >= 2")
    return a


def run_one(model, ids, mask, variant, max_new_tokens, prefill_cache):
    """One greedy ``generate``: ``full`` (variant None), a fixed gamma (an int) or ``auto`` with the
    RowGamma keyword arguments ``variant``; the prompt's prefill is shared through ``prefill_cache``."""
    kw = dict(sparse_attn_algorithm="vegas", sparse_attn_ratio=0.05, eos_token_id=[], prefill_cache=prefill_cache)
    if variant is None:
        kw.update(sparse_attn_algorithm="full", num_speculative_tokens=0)
    elif isinstance(variant, int):
        kw.update(num_speculative_tokens=variant, gamma_policy="fixed")
    else:
        kw.update(num_speculative_tokens="auto")
    with _auto_with(variant if isinstance(variant, dict) else {}):
        return generate(model, ids, mask, max_new_tokens=max_new_tokens, **kw)


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    model, tok = load_model(a.model)
    packed = pack_linears(model, a.pack_linears)
    ids, mask = build_batch(tok, a.doc, a.context, a.batch, False)
    names = list(a.variants)
    rates = {k: [] for k in ["full", *names]}
    ref = None
    pc: dict = {}  # the prompt's prefill once, reused by every run (decode tokens/s does not include it)
    for r in range(a.rounds):
        for name in ["full", *(names if r % 2 == 0 else names[::-1])]:
            out = run_one(model, ids, mask, a.variants.get(name), a.max_new_tokens, pc)
            s = out.stats
            if ref is None:
                ref = out.sequences.clone()
            tps = s["decode_tokens_per_s"]
            rates[name].append(tps)
            print(json.dumps({"round": r, "name": name, "decode_tokens_per_s": round(tps, 3),
                              "identical_to_plain": bool(torch.equal(out.sequences, ref)),
                              "gamma_histogram": s.get("gamma_histogram"), "num_probes": s.get("num_probes"),
                              "gamma_per_iteration": s.get("gamma_per_iteration"),
                              "mean_acceptance_length": round(s.get("mean_acceptance_length", 0.0), 3)}), flush=True)
    print(f"\n{a.doc}, context {a.context}, batch {a.batch}, {a.max_new_tokens} new tokens, {a.rounds} rounds, "
          f"{a.threads} thread(s), torch {torch.__version__}, {packed} linears packed for oneDNN")
    print("| configuration | median x full | per round |\n|---|---:|---|")
    for name, v in rates.items():
        per = [t / f for t, f in zip(v, rates["full"])]
        print(f"| {name} | {statistics.median(per):.3f} | {' / '.join(f'{x:.3f}' for x in per)} |")


if __name__ == "__main__":
    main()
