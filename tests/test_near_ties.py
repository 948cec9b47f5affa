"""The lossless contract at near-ties (cases 009 and 012): in every dtype, greedy Vegas emits plain
greedy decoding's token given the same prefix, except where the two best target logits are within
rounding of each other (``cli.near_tie_tolerance``: 64 eps |h| max|w| in float32, 8 in bfloat16 /
float16; docs/lossless.md).

Near-ties are constructed as in case 009 (every output-layer row a copy of one row plus tiny
noise, or none: exact ties). Which way such a tie rounds depends on the CPU, the BLAS and the
forward's shape, so no assertion here says which token wins: each emitted token is checked against
HF greedy from the same prefix, and a difference must be a near-tie by the stated bound.
"""
from __future__ import annotations

import pytest
import torch

import vegas_ext
from vegas_ext import cli

from decode_utils import FAMILIES, make_model, make_prompts, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

def _policy(gamma):
    """``gamma_policy`` for a parametrized γ: an int is the γ of every iteration."""
    return "auto" if gamma == "auto" else "fixed"



def near_tied_lm_head(model, noise: float, seed: int = 1) -> None:
    """Case 009's construction: every output-layer row 50 x row 0 plus ``noise`` x N(0, 1)."""
    with torch.no_grad():
        w = model.lm_head.weight
        g = torch.Generator().manual_seed(seed)
        w.copy_(w[0:1].expand_as(w) * 50 + noise * torch.randn(w.shape, generator=g).to(w.dtype))


def hf_differences(model, prompt, ours):
    """Walks ``ours`` (one row's new tokens) along HF plain greedy decoding from the same prefix.

    ``prompt``: list of token ids (no padding). Where HF's token differs, records the gap between
    the two tokens' logits in HF's step and the near-tie tolerance there, then continues from our
    token (a fresh HF ``generate`` on the longer prefix). Returns a list of dicts ``pos``,
    ``hf``, ``ours``, ``gap``, ``tolerance``; empty when every token is HF's."""
    eps_dtype = model.dtype
    w_norm = model.get_output_embeddings().weight.detach().float().norm(dim=1)
    hs = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, a: hs.append(a[0][:, -1].float()))
    out, i = [], 0
    try:
        while i < len(ours):
            hs.clear()
            ids = torch.tensor([list(prompt) + list(ours[:i])])
            n = len(ours) - i
            with torch.inference_mode():
                o = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                   min_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0,
                                   return_dict_in_generate=True, output_logits=True)
            hf = o.sequences[0, ids.shape[1]:].tolist()
            k = next((k for k in range(n) if hf[k] != ours[i + k]), None)
            if k is None:
                break
            logits, a, b = o.logits[k][0].float(), hf[k], ours[i + k]
            scale = float(hs[k][0].norm()) * max(float(w_norm[a]), float(w_norm[b]))
            out.append(dict(pos=i + k, hf=a, ours=b, gap=float(logits[a] - logits[b]),
                            tolerance=cli.near_tie_tolerance(scale, eps_dtype)))
            i += k + 1
    finally:
        hook.remove()
    return out


def _vegas(model, ids, mask, n=24, **kw):
    kw = dict(dict(num_speculative_tokens=4, gamma_policy="fixed", sparse_attn_ratio=0.1,
                   sparse_attn_min_tokens=16), **kw)
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=n, eos_token_id=[], pad_token_id=0, **kw)
    return out.sequences[:, ids.shape[1]:]


def _check_rows(model, ids, mask, new):
    """Every row: equal to HF greedy from the same prefix but at near-ties; returns the flips."""
    flips = []
    for r in range(ids.shape[0]):
        prompt = ids[r][mask[r].bool()].tolist()
        diffs = hf_differences(model, prompt, new[r].tolist())
        for d in diffs:
            assert 0 <= d["gap"] <= d["tolerance"], (r, d)  # a real difference, not rounding
        flips += diffs
    return flips


@pytest.mark.parametrize("noise", [5e-5, 2e-6, 0.0], ids=["case009", "denser", "exact"])
@pytest.mark.parametrize("seed", range(3))
def test_near_tied_output_layer_is_greedy_up_to_near_ties(noise, seed):
    """Case 009's model and prompts (batch [80, 60], gamma 4): every token is plain greedy's but
    at near-ties. ``denser`` puts most logit gaps inside the rounding; ``exact`` makes every row
    equal (HF picks the lowest id, ours too unless a column rounds differently)."""
    m = make_model("llama", seed=0)
    near_tied_lm_head(m, noise)
    ids, mask = make_prompts(256, [80, 60], seed=seed)
    new = _vegas(m, ids, mask, sparse_attn_ratio=0.05, sparse_attn_min_tokens=256)  # case 009's defaults
    assert new.shape == (2, 24)
    _check_rows(m, ids, mask, new)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("gamma", [1, 6])
def test_near_ties_every_family(family, gamma):
    m = make_model(family, seed=2)
    near_tied_lm_head(m, 2e-6, seed=3)
    ids, mask = make_prompts(m.config.vocab_size, [150, 40, 90], seed=gamma)
    new = _vegas(m, ids, mask, num_speculative_tokens=gamma, gamma_policy=_policy(gamma))
    _check_rows(m, ids, mask, new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_near_ties_half_precision(dtype):
    m = make_model("qwen3", seed=1, initializer_range=0.15).to(dtype)
    ids, mask = make_prompts(m.config.vocab_size, [120, 70], seed=4)
    new = _vegas(m, ids, mask)
    _check_rows(m, ids, mask, new)


def test_a_real_difference_is_not_a_near_tie():
    """The check is not vacuous: a token swapped for HF's lowest-logit one is caught, with a gap
    far above the tolerance, and an unchanged run has no difference at all."""
    m = make_model("llama", seed=0, initializer_range=0.15)
    ids, mask = make_prompts(256, [60], seed=0)
    new = _vegas(m, ids, mask, n=10)[0].tolist()
    prompt = ids[0].tolist()
    assert hf_differences(m, prompt, new) == []
    with torch.no_grad():
        h = m(torch.tensor([prompt + new[:5]])).logits[0, -1]
    bad = new[:5] + [int(h.argmin())] + new[6:]
    d = hf_differences(m, prompt, bad)
    assert d[0]["pos"] == 5 and d[0]["ours"] == int(h.argmin()) and d[0]["hf"] == new[5]
    assert d[0]["gap"] > 1000 * d[0]["tolerance"] > 0


def test_near_tie_tolerance_units():
    assert cli.near_tie_tolerance(4.0, torch.float32) == pytest.approx(64 * 2.0 ** -23 * 4.0)
    assert cli.near_tie_tolerance(4.0, torch.bfloat16) == pytest.approx(8 * 2.0 ** -7 * 4.0)
    assert cli.near_tie_tolerance(4.0, torch.float16) == pytest.approx(8 * 2.0 ** -10 * 4.0)
    assert cli.near_tie_eps(torch.float64) == 64.0
