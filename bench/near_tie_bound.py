"""How far apart two logits can be and still be ordered differently by Vegas's verification and by
plain greedy decoding's one-token step; the numbers behind docs/lossless.md and the near-tie bound
of ``vegas_ext.cli`` (``NEAR_TIE_EPS``).

For every emitted position whose prefix is the same in both runs (each row up to and including its
first difference from HF ``generate``), compares the logits our loop decided on (the prefill's last
row, or column j of a verification forward whose first j drafts were accepted) with the logits of
HF's own step at that position (``output_logits``). With ``d = ours - hf`` over the vocabulary,
two tokens can be ordered differently only if HF's gap between them is at most
``spread = max(d) - min(d)``. Prints per configuration the largest spread in ulps of the row's
largest |logit| and ("rel") the largest ``|d_t - d_top|`` in units of ``eps |h| max(|w_t|, |w_top|)``
(``h`` the output layer's input, ``w`` its rows: the unit of the near-tie bound), and every first
difference with HF's gap there (ulps at the larger logit, ulps of the row scale, units).

    OMP_NUM_THREADS=1 PYTHONPATH=tests python -m bench.near_tie_bound            # tiny models
    ... --no-tiny --wide | --wide-half | --smollm [--smollm-len N] | --audit-tests  [--json out.json]

``--audit-tests`` prints the smallest top-2 gap (same units) of the HF references of the tests
that assert exact equality: far above the bound, their result does not depend on the CPU.
Forced narrower instruction sets: VEGAS_CPU_ISA=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2.
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch


def ulp(x: float, dtype=torch.float32) -> float:
    fi = torch.finfo(dtype)
    return fi.eps * 2.0 ** math.floor(math.log2(max(abs(x), fi.tiny)))


def capture_ours(model, ids, mask, **kw):
    """Runs ``vegas_ext.generate``; returns (new tokens [B, N], {(row, pos): logits [V] fp32})."""
    import vegas_ext
    from vegas_ext import decode

    rec = []
    real = decode.DecodeState.forward

    def fwd(self, ids_, pos_, keep):
        out = real(self, ids_, pos_, keep)
        if self.attn.mode == "verify":
            n_gen = None if self.n_gen is None else self.n_gen.clone()
            rows = None if self.rows is None else self.rows.clone()
            rec.append((n_gen, rows, ids_.clone(), out.detach().float().clone()))
        return out

    decode.DecodeState.forward = fwd
    try:
        out = vegas_ext.generate(model, ids, mask, **{"gamma_policy": "fixed", **kw})  # the γ asked, every iteration
    finally:
        decode.DecodeState.forward = real
    T = ids.shape[1]
    new = out.sequences[:, T:]
    got = {}
    for n_gen, rows, fids, logits in rec:
        if n_gen is None:  # the prefill's last tokens: logits[:, -1] decide token 0
            for r in range(logits.shape[0]):
                got[(r, 0)] = logits[r, -1]
            continue
        for i in range(logits.shape[0]):
            r, n = int(rows[i]), int(n_gen[i])
            for j in range(logits.shape[1]):
                if n + j >= new.shape[1]:
                    break
                if j and int(fids[i, j]) != int(new[r, n + j - 1]):
                    break  # a rejected draft: later columns saw another prefix
                got.setdefault((r, n + j), logits[i, j])
    return new, got


def hf_steps(model, ids, mask, n, eos):
    """HF greedy: (new tokens, per-step logits [B, V], per-step lm_head inputs [B, H])."""
    hs = []
    hook = model.get_output_embeddings().register_forward_pre_hook(
        lambda mod, args: hs.append(args[0][:, -1].detach().float().clone()))
    with torch.inference_mode():
        o = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    hook.remove()
    return o.sequences[:, ids.shape[1]:], [l.float() for l in o.logits], hs


def measure(model, ids, mask, n, kw, dtype, label, pack=False):
    """One configuration: returns a dict of the largest spread and the first differences."""
    hf_new, hf_logits, hf_h = hf_steps(model, ids, mask, n, [])
    wn = model.get_output_embeddings().weight.detach().float().norm(dim=1)  # ||w_t||
    if pack:
        from vegas_ext.packed_linear import pack_linear_weights

        pack_linear_weights(model)
    new, ours = capture_ours(model, ids, mask, max_new_tokens=n, eos_token_id=[], pad_token_id=0, **kw)
    worst = dict(spread_ulps=0.0, spread=0.0, maxabs=0.0, scale=0.0)
    worst_rel = 0.0  # max over positions and t of |d_t - d_top| / (eps |h| max(|w_t|, |w_top|))
    eps = torch.finfo(dtype).eps
    diffs = []
    for r in range(ids.shape[0]):
        neq = (new[r] != hf_new[r]).nonzero()
        stop = int(neq[0]) if len(neq) else n - 1
        for p in range(stop + 1):
            h = hf_logits[p][r]
            d = ours[(r, p)] - h
            scale = float(h.abs().max())
            spread = float(d.max() - d.min())
            su = spread / ulp(scale, dtype)
            top = int(h.argmax())
            rel = (d - d[top]).abs() / (eps * float(hf_h[p][r].norm()) * torch.maximum(wn, wn[top]))
            worst_rel = max(worst_rel, float(rel.max()))
            if su > worst["spread_ulps"]:
                worst = dict(spread_ulps=su, spread=spread, maxabs=float(d.abs().max()), scale=scale, row=r, pos=p)
        if len(neq):
            p = int(neq[0])
            h = hf_logits[p][r]
            a, b = int(hf_new[r, p]), int(new[r, p])
            gap = float(h[a] - h[b])
            diffs.append(dict(row=r, pos=p, hf=a, ours=b, gap=gap,
                              rel=gap / (eps * float(hf_h[p][r].norm()) * float(torch.maximum(wn[a], wn[b]))),
                              ulps_at_pair=gap / ulp(max(abs(float(h[a])), abs(float(h[b]))), dtype),
                              ulps_at_scale=gap / ulp(float(h.abs().max()), dtype)))
    return dict(label=label, positions=sum(1 for _ in ours), worst=worst, worst_rel=worst_rel, diffs=diffs)


def top2_margin(model, ids, mask, n):
    """The smallest top-2 gap of HF greedy's steps, in units of eps |h| max(|w_1|, |w_2|): a test
    that asserts exact equality with HF greedy is safe on any CPU when it is far above the bound."""
    _, logits, hs = hf_steps(model, ids, mask, n, [])
    wn = model.get_output_embeddings().weight.detach().float().norm(dim=1)
    eps = torch.finfo(model.dtype).eps
    best = float("inf")
    for lg, h in zip(logits, hs):
        top = lg.topk(2, dim=-1)
        for r in range(lg.shape[0]):
            a, b = top.indices[r].tolist()
            gap = float(top.values[r, 0] - top.values[r, 1])
            best = min(best, gap / (eps * float(h[r].norm()) * max(float(wn[a]), float(wn[b]))))
    return best


def near_tied_lm_head(m, noise=5e-5, seed=1):
    """Case 009's construction: every lm_head row a copy of row 0 (x50) plus tiny noise."""
    with torch.no_grad():
        w = m.lm_head.weight
        w.copy_(w[0:1].expand_as(w) * 50 + noise * torch.randn(w.shape, generator=torch.Generator().manual_seed(seed)))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``): which grids to run (see the module docstring)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm", action="store_true", help="also the embedded SmolLM2-135M (slow)")
    ap.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--wide", action="store_true", help="tiny models: 3 seeds x 2 and 6 layers x gamma 2, 5")
    ap.add_argument("--wide-half", action="store_true", help="tiny models in bfloat16 / float16, 2 and 6 layers")
    ap.add_argument("--smollm-len", type=int, default=600, help="SmolLM2 prompt tokens (of the embedded document)")
    ap.add_argument("--audit-tests", action="store_true",
                    help="smallest top-2 margins of the HF references of tests that assert exact equality")
    ap.add_argument("--json")
    return ap.parse_args(argv)


def format_result(res: dict) -> str:
    """The printed lines of one :func:`measure` result: its largest spread, then one line per first difference."""
    w = res["worst"]
    return (f"{res['label']:<48} pos {res['positions']:4d}  spread {w['spread']:.3g} = {w['spread_ulps']:.1f} ulp"
            f"(scale {w['scale']:.3g})  rel {res['worst_rel']:.2f} eps|h||w|  diffs {len(res['diffs'])}"
            + "".join(f"\n    diff r{d['row']} p{d['pos']}: gap {d['gap']:.3g} = {d['ulps_at_pair']:.1f} ulp(pair) "
                      f"= {d['ulps_at_scale']:.1f} ulp(scale) = {d['rel']:.3f} eps|h||w|"
                      for d in res["diffs"]))


# Each *_cells generator yields the arguments of :func:`measure`, building each model only when
# its turn comes (a packed model is changed by its measurement).

def wide_cells():
    """``--wide``: both families x 2 inits x 2 and 6 layers x 3 seeds x gamma 2, 5; then case 009's
    near-tied lm_head (noise 2e-6) under a dense draft, 6 prompts."""
    from decode_utils import FAMILIES, make_model, make_prompts

    for fam in FAMILIES:
        for init in (0.02, 0.15):
            for layers in (2, 6):
                for seed in range(3):
                    for g in (2, 5):
                        m = make_model(fam, seed=10 + seed, initializer_range=init, num_hidden_layers=layers)
                        ids, mask = make_prompts(m.config.vocab_size, [400, 64, 200], seed=seed)
                        kw = dict(num_speculative_tokens=g, sparse_attn_ratio=0.1, sparse_attn_min_tokens=16)
                        yield m, ids, mask, 16, kw, torch.float32, f"{fam} init {init} L{layers} s{seed} g{g}"
    for s_ in range(6):
        m = make_model("llama", seed=0)
        near_tied_lm_head(m, 2e-6)
        ids, mask = make_prompts(256, [80, 60], seed=s_)
        yield m, ids, mask, 24, dict(num_speculative_tokens=4), torch.float32, f"case009 dense seed {s_}"


def wide_half_cells():
    """``--wide-half``: both families in bfloat16 and float16 x 2 inits x 2 and 6 layers x 2 seeds."""
    from decode_utils import FAMILIES, make_model, make_prompts

    for fam in FAMILIES:
        for dt in (torch.bfloat16, torch.float16):
            for init in (0.02, 0.15):
                for layers in (2, 6):
                    for seed in range(2):
                        m = make_model(fam, seed=10 + seed, initializer_range=init, num_hidden_layers=layers).to(dt)
                        ids, mask = make_prompts(m.config.vocab_size, [400, 64, 200], seed=seed)
                        kw = dict(num_speculative_tokens=4, sparse_attn_ratio=0.1, sparse_attn_min_tokens=16)
                        yield m, ids, mask, 16, kw, dt, f"{fam} {dt} init {init} L{layers} s{seed}"


def tiny_cells():
    """The default grid: both families x 2 inits x gamma 1, 4, 8 (gamma 4 also packed); case 009's
    near-tied lm_head, 12 prompts (3 also packed); both families in bfloat16 and float16."""
    from decode_utils import FAMILIES, make_model, make_prompts

    for fam in FAMILIES:
        for init in (0.02, 0.15):
            for g in (1, 4, 8):
                for pack in ((False, True) if g == 4 else (False,)):
                    m = make_model(fam, seed=3, initializer_range=init)
                    V = m.config.vocab_size
                    ids, mask = make_prompts(V, [300, 120, 37], seed=g)
                    kw = dict(num_speculative_tokens=g, sparse_attn_ratio=0.1, sparse_attn_min_tokens=16)
                    label = f"{fam} init {init} g{g}{' packed' if pack else ''}"
                    yield m, ids, mask, 24, kw, torch.float32, label, pack
    for s in range(12):
        for pack in ((False, True) if s < 3 else (False,)):
            m = make_model("llama", seed=0)
            near_tied_lm_head(m)
            ids, mask = make_prompts(256, [80, 60], seed=s)
            yield (m, ids, mask, 24, dict(num_speculative_tokens=4), torch.float32,
                   f"case009 seed {s}{' packed' if pack else ''}", pack)
    for fam in FAMILIES:
        for dt in (torch.bfloat16, torch.float16):
            m = make_model(fam, seed=3, initializer_range=0.15).to(dt)
            ids, mask = make_prompts(m.config.vocab_size, [200, 90], seed=5)
            yield m, ids, mask, 24, dict(num_speculative_tokens=4, sparse_attn_ratio=0.1,
                                         sparse_attn_min_tokens=16), dt, f"{fam} {dt}"


def smollm_cells(prompt_len: int):
    """``--smollm``: the embedded SmolLM2 on the first ``prompt_len`` tokens of the default document,
    float32, float32 packed and bfloat16."""
    from vegas_ext import documents, models

    for pack, dt in ((False, torch.float32), (True, torch.float32), (False, torch.bfloat16)):
        m, tok = models.load_model(None, dtype=dt)
        doc = documents.default_document()
        text = doc if isinstance(doc, str) else "The quick brown fox jumps over the lazy dog. " * 40
        ids = torch.tensor([tok(text).input_ids[:prompt_len]])
        mask = torch.ones_like(ids)
        yield (m, ids, mask, 32, dict(num_speculative_tokens=4, sparse_attn_ratio=0.1), dt,
               f"smollm2 {dt}{' packed' if pack else ''}", pack)


def audit_tests() -> None:
    """``--audit-tests``: prints the smallest top-2 margin (:func:`top2_margin`) of the HF references
    of test_decode, test_packed_linear and test_cli's contract configurations."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import test_cli
    from decode_utils import FAMILIES, cached_model, make_model, make_prompts

    for fam in FAMILIES:
        for batch, lengths in ((1, [300]), (3, [300, 217, 281])):
            m = cached_model(fam)
            ids, mask = make_prompts(m.config.vocab_size, lengths, seed=batch)
            print(f"test_decode _case({fam}, {batch}): min top-2 margin {top2_margin(m, ids, mask, 24):.1f}",
                  flush=True)
        m = make_model(fam)  # test_packed_linear.test_packed_model_decodes_losslessly
        ids, mask = make_prompts(m.config.vocab_size, [40, 57, 23])
        print(f"test_packed_linear ({fam}): min top-2 margin {top2_margin(m, ids, mask, 24):.1f}", flush=True)
    for i, c in enumerate(test_cli.CONTRACT_CONFIGS):
        folder = test_cli._tiny_llama(tempfile.mkdtemp(), *c)
        tok = AutoTokenizer.from_pretrained(folder)
        prompt = " ".join(test_cli.WORDS[(7 * k) % len(test_cli.WORDS)] for k in range(180))
        ids = torch.tensor([tok(prompt).input_ids])
        m = AutoModelForCausalLM.from_pretrained(folder).eval()
        print(f"test_cli contract {i}: min top-2 margin {top2_margin(m, ids, torch.ones_like(ids), 24):.1f}",
              flush=True)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    results = []

    def run(cells):
        for cell in cells:
            res = measure(*cell)
            print(format_result(res), flush=True)
            results.append(res)

    if args.wide:
        run(wide_cells())
    if args.audit_tests:
        audit_tests()
    if args.wide_half:
        run(wide_half_cells())
    if args.tiny and not args.wide and not args.wide_half:
        run(tiny_cells())
    if args.smollm:
        run(smollm_cells(args.smollm_len))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
