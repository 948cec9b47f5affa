"""Speculative sampling keeps the target distribution (Leviathan et al. 2023; Chen et al. 2023).

Two levels: the acceptance rule alone on synthetic distributions (exact expected marginals), and
the whole loop on a tiny-vocabulary model whose sparse drafts differ a lot from the target
(chi-square of many seeded rows against the exact joint distribution of the next tokens,
enumerated with plain forwards). Both would fail with a wrong acceptance ratio or an
unnormalized / wrong residual.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import vegas_ext
from vegas_ext import decode, speculation
from vegas_ext.decode import make_warpers, speculative_accept

from decode_utils import make_model, one_thread  # noqa: F401

scipy_stats = pytest.importorskip("scipy.stats")

pytestmark = pytest.mark.usefixtures("one_thread")

P_MIN = 1e-4  # fixed seeds: deterministic; a correct sampler gives p-values far above this


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs``; cells expected < 5 are pooled."""
    counts = counts.double().flatten()
    n = counts.sum()
    exp = probs.double().flatten() * n
    small = exp < 5
    obs_c = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp_c = torch.cat([exp[~small], exp[small].sum().view(1)])
    keep = exp_c > 0
    if bool((obs_c[~keep] > 0).any()):
        return 0.0  # mass where the target has none
    obs_c, exp_c = obs_c[keep], exp_c[keep]
    stat = float(((obs_c - exp_c) ** 2 / exp_c).sum())
    return float(scipy_stats.chi2.sf(stat, df=len(obs_c) - 1))


# --------------------------------------------------------------------------- the rule alone
def _synthetic(V=6, g=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(g + 1, V, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(g, V, generator=gen) * 1.5, -1)
    return p, q


def _run_rule(p, q, n, seed=1, accept=speculative_accept):
    g, V = q.shape
    gen = torch.Generator().manual_seed(seed)
    qb = q.expand(n, g, V).contiguous()
    drafts = torch.multinomial(qb.view(-1, V), 1, generator=gen).view(n, g)
    a, t = accept(drafts, qb, p.expand(n, g + 1, V).contiguous(), gen)
    first = torch.where(a > 0, drafts[:, 0], t)
    second_rows = a >= 1
    second = torch.where(a[second_rows] > 1, drafts[second_rows, 1], t[second_rows])
    return a, first, second


def test_rule_keeps_target_marginals():
    p, q = _synthetic()
    V = p.shape[1]
    a, first, second = _run_rule(p, q, 40000)
    assert chi2_pvalue(torch.bincount(first, minlength=V), p[0]) > P_MIN
    # given the first draft was accepted, the next token follows the next target distribution
    assert chi2_pvalue(torch.bincount(second, minlength=V), p[1]) > P_MIN
    # acceptance probability of the first draft = sum_x min(p, q)
    exp_acc = float(torch.minimum(p[0], q[0]).sum())
    assert abs(float((a > 0).float().mean()) - exp_acc) < 0.01


def _accept_wrong_ratio(drafts, q, p, generator=None, num_drafts=None):
    # BUG on purpose: accepts with min(1, q/p) instead of min(1, p/q)
    if q is None:  # no drafts this iteration
        return speculative_accept(drafts, q, p, generator, num_drafts)
    return speculative_accept(drafts, p[:, : q.shape[1]], torch.cat([q, p[:, -1:]], 1), generator, num_drafts)


def _accept_unnormalized_residual(drafts, q, p, generator=None, num_drafts=None):
    # BUG on purpose: on rejection samples from p instead of normalize(max(p - q, 0))
    if q is None:  # no drafts this iteration
        return speculative_accept(drafts, q, p, generator, num_drafts)
    B, g = drafts.shape
    pd = p[:, :g].gather(-1, drafts[..., None])[..., 0]
    qd = q.gather(-1, drafts[..., None])[..., 0]
    u = torch.rand((B, g), generator=generator)
    a = (u * qd < pd).long().cumprod(1).sum(1)
    if num_drafts is not None:
        a = torch.minimum(a, num_drafts)
    pa = p.gather(1, a[:, None, None].expand(B, 1, p.shape[-1]))[:, 0]
    return a, torch.multinomial(pa, 1, generator=generator)[:, 0]


@pytest.mark.parametrize("broken", [_accept_wrong_ratio, _accept_unnormalized_residual])
def test_rule_check_detects_broken_samplers(broken):
    """The chi-square above has the power to catch the classic mistakes."""
    p, q = _synthetic()
    _, first, _ = _run_rule(p, q, 40000, accept=broken)
    assert chi2_pvalue(torch.bincount(first, minlength=p.shape[1]), p[0]) < 1e-6


def test_rule_with_equal_distributions_has_no_nan():
    p, _ = _synthetic(V=5, g=2)
    q = p[:2].clone()
    n = 5000
    gen = torch.Generator().manual_seed(3)
    drafts = torch.multinomial(q.expand(n, 2, 5).reshape(-1, 5), 1, generator=gen).view(n, 2)
    a, t = speculative_accept(drafts, q.expand(n, 2, 5), p.expand(n, 3, 5), gen)
    assert bool((a == 2).all())  # p == q: every draft accepted
    assert chi2_pvalue(torch.bincount(t, minlength=5), p[2]) > P_MIN
    # a residual with no mass (p <= q everywhere, as rounding can make it) falls back to p: no NaN
    q3 = torch.tensor([[0.0, 0.5, 0.5]]).expand(n, 1, 3)
    p3 = torch.tensor([[0.0, 0.25, 0.25], [0.0, 0.5, 0.5]]).expand(n, 2, 3)
    d3 = torch.multinomial(q3[:, 0], 1, generator=gen)
    a3, t3 = speculative_accept(d3, q3, p3, gen)
    assert 0 < int((a3 == 0).sum()) < n
    assert bool((t3 > 0).all())


def test_rule_never_emits_outside_target_support():
    p, q = _synthetic(V=6, g=2, seed=5)
    p = p.clone()
    p[:, :2] = 0  # e.g. top-k removed these in the target but not in the draft
    p = p / p.sum(-1, keepdim=True)
    a, first, second = _run_rule(p, q, 20000, seed=7)
    assert not bool((first < 2).any()) and not bool((second < 2).any())


# --------------------------------------------------------------------------- the whole loop
V_SMALL = 5
K_NEW = 3
PROMPT = 32
N_ROWS = 5000


def _small_model():
    # wider init than default: the sink-only sparse draft differs from the target (acceptance ~0.7)
    # while the next-token distributions stay spread over many cells
    return make_model("llama", seed=11, vocab_size=V_SMALL, initializer_range=0.2, max_position_embeddings=256)


def _exact_joint(model, prompt, warpers):
    """Exact joint distribution of the next K_NEW tokens under the warped target, ``[V]*K``;
    ``warpers(input_ids, scores)``: any HF-style logits processor list (applied with each prefix)."""
    V = V_SMALL
    joint = torch.ones(())
    with torch.inference_mode():
        for k in range(K_NEW):
            prefixes = torch.tensor(list(itertools.product(range(V), repeat=k)), dtype=torch.long).view(V**k, k)
            seqs = torch.cat([prompt.expand(V**k, -1), prefixes], 1)
            logits = model(input_ids=seqs).logits[:, -1].float()
            probs = torch.softmax(warpers(seqs, logits), -1)  # [V^k, V]
            joint = (joint.reshape(-1, 1) * probs).reshape([V] * (k + 1))
    return joint


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.8, 4, 0.9)],
    ids=["plain", "warped"],
)
def test_generate_sampling_matches_target_distribution(temperature, top_k, top_p):
    model = _small_model()
    gen0 = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V_SMALL, (1, PROMPT), generator=gen0)
    n = N_ROWS
    warpers = make_warpers(temperature, top_k, top_p)
    joint = _exact_joint(model, prompt, warpers)
    out = vegas_ext.generate(
        model,
        prompt.expand(n, -1),
        max_new_tokens=K_NEW,
        num_speculative_tokens=3, gamma_policy="fixed",
        sparse_attn_ratio=0.01,
        sparse_attn_min_tokens=0,
        block_size=4,
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(1),
    )
    s = out.stats
    # drafts differ from the target: some rejected, some accepted
    assert 0.05 < s["draft_acceptance_rate"] < 0.95, s["draft_acceptance_rate"]
    new = out.sequences[:, PROMPT:]
    cell = (new * torch.tensor([V_SMALL**2, V_SMALL, 1])).sum(1)
    counts = torch.bincount(cell, minlength=V_SMALL**K_NEW)
    pv = chi2_pvalue(counts, joint)
    assert pv > P_MIN, f"chi-square p-value {pv:.2e}"


@pytest.mark.parametrize("broken", [_accept_wrong_ratio, _accept_unnormalized_residual])
def test_generate_sampling_detects_a_broken_acceptance(monkeypatch, broken):
    """Same check with the acceptance broken on purpose inside the loop: it must fail."""
    model = _small_model()
    gen0 = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V_SMALL, (1, PROMPT), generator=gen0)
    joint = _exact_joint(model, prompt, make_warpers())
    monkeypatch.setattr(decode, "speculative_accept", broken)
    out = vegas_ext.generate(
        model, prompt.expand(N_ROWS,
                -1), max_new_tokens=K_NEW, num_speculative_tokens=3, gamma_policy="fixed", sparse_attn_ratio=0.01,
        sparse_attn_min_tokens=0, block_size=4, do_sample=True, eos_token_id=[],
        generator=torch.Generator().manual_seed(1),
    )
    new = out.sequences[:, PROMPT:]
    counts = torch.bincount((new * torch.tensor([V_SMALL**2, V_SMALL, 1])).sum(1), minlength=V_SMALL**K_NEW)
    assert chi2_pvalue(counts, joint) < 1e-6


def test_sampling_is_reproducible_with_a_generator():
    model = make_model("qwen3")
    prompt = torch.randint(3, model.config.vocab_size, (2, 80), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=16, num_speculative_tokens=4, gamma_policy="fixed", sparse_attn_min_tokens=16,
              block_size=8, do_sample=True,
              temperature=0.9, top_p=0.95, eos_token_id=[])
    a = vegas_ext.generate(model, prompt, generator=torch.Generator().manual_seed(5), **kw).sequences
    b = vegas_ext.generate(model, prompt, generator=torch.Generator().manual_seed(5), **kw).sequences
    c = vegas_ext.generate(model, prompt, generator=torch.Generator().manual_seed(6), **kw).sequences
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


class _AutoCheapDrafts(speculation.RowGamma):
    """``"auto"`` fed synthetic costs under which speculation pays, and no plain warm-up step:
    it drafts whenever a row may still emit a draft, as many as its acceptance estimates favour."""

    def choose(self, caps, limit):
        if len(self.history) == 1:
            self.history.append(0)  # skip the plain warm-up iteration
        return super().choose(caps, limit)

    def observe_iteration(self, costs, drafted, accepted):
        g = costs.gamma
        super().observe_iteration(type(costs)(g, 0.01 * g, 1.0 + 0.001 * costs.tokens, 0.001 if g else 0.0,
                                              scored=costs.scored, tokens=costs.tokens, rows=costs.rows),
                                  drafted, accepted)


@pytest.mark.parametrize("policy", ["measured", "cheap_drafts"])
def test_generate_sampling_with_auto_gamma_matches_target_distribution(policy, monkeypatch):
    """``num_speculative_tokens="auto"`` chooses gamma from past acceptance and timings only, so
    the sampled tokens keep the target distribution whatever it picks."""
    if policy == "cheap_drafts":
        monkeypatch.setattr(speculation, "RowGamma", _AutoCheapDrafts)
    model = _small_model()
    prompt = torch.randint(0, V_SMALL, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    joint = _exact_joint(model, prompt, make_warpers(0.8, 4, 0.9))
    out = vegas_ext.generate(
        model, prompt.expand(N_ROWS, -1), max_new_tokens=K_NEW, num_speculative_tokens=4,
        gamma_policy="auto", sparse_attn_ratio=0.01, sparse_attn_min_tokens=0, block_size=4,
        do_sample=True, temperature=0.8, top_k=4, top_p=0.9, eos_token_id=[],
        generator=torch.Generator().manual_seed(3),
    )
    s = out.stats
    assert s["gamma_policy"] == "auto" and max(s["gamma_per_iteration"]) >= 1
    assert 0.05 < s["draft_acceptance_rate"] < 0.95, s["draft_acceptance_rate"]
    new = out.sequences[:, PROMPT:]
    counts = torch.bincount((new * torch.tensor([V_SMALL**2, V_SMALL, 1])).sum(1), minlength=V_SMALL**K_NEW)
    pv = chi2_pvalue(counts, joint)
    assert pv > P_MIN, f"chi-square p-value {pv:.2e}"


class _RaggedDrafts(speculation.GammaPolicy):
    """Every row its own number of drafts, 0 included (row ``b`` drafts ``b % 4``, cut to its cap):
    the rows' tokens are packed in every verification."""

    name = "ragged"

    def choose_rows(self, caps):
        g = torch.arange(caps.numel()) % (self.max_gamma + 1)
        self.history.append(int(g.max()))
        return torch.minimum(g, caps.clamp(min=0))


def test_generate_sampling_with_ragged_drafts_matches_target_distribution(monkeypatch):
    """Rows verifying different numbers of drafts (their tokens packed into one verification)
    keep the target distribution: a row past its own drafts takes its bonus token from the target."""
    monkeypatch.setattr(decode, "make_gamma_policy", lambda cap, policy, **kw: _RaggedDrafts(cap))
    model = _small_model()
    prompt = torch.randint(0, V_SMALL, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    joint = _exact_joint(model, prompt, make_warpers())
    out = vegas_ext.generate(
        model, prompt.expand(N_ROWS, -1), max_new_tokens=K_NEW, num_speculative_tokens=3, gamma_policy="fixed",
        sparse_attn_ratio=0.01, sparse_attn_min_tokens=0, block_size=4, do_sample=True, eos_token_id=[],
        generator=torch.Generator().manual_seed(4),
    )
    s = out.stats
    assert s["num_verified_tokens"] < N_ROWS * (3 + 1) * s["num_iterations"]  # packed: rows verified their own
    assert 0.05 < s["draft_acceptance_rate"] < 0.95, s["draft_acceptance_rate"]
    new = out.sequences[:, PROMPT:]
    counts = torch.bincount((new * torch.tensor([V_SMALL**2, V_SMALL, 1])).sum(1), minlength=V_SMALL**K_NEW)
    pv = chi2_pvalue(counts, joint)
    assert pv > P_MIN, f"chi-square p-value {pv:.2e}"
