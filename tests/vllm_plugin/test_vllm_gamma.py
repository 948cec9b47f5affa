"""``gamma_policy="auto"`` in vLLM: each request drafts its own number of tokens (0 included), and
greedy output stays token-identical to vLLM without speculation.

Run in the vLLM venv (scripts/test_vllm.sh). Each engine runs in its own process (vllm_utils.run_llm).
"""
import json
import os

import pytest

pytest.importorskip("vllm")  # the main suite runs without vLLM

from vegas_ext.vllm import speculative_config  # noqa: E402

from vllm_utils import BASE_LLM, construction_error, run_llm, text_prompts, tiny_llama_dir  # noqa: E402

GAMMA = 5
NEW = 40


def _run(cfg, stats_dir, gamma_policy, granularity="page"):
    c = json.loads(json.dumps(cfg))
    c["llm"]["speculative_config"] = dict(
        speculative_config(num_speculative_tokens=GAMMA, sparse_attn_ratio=0.05, sparse_attn_min_tokens=128,
                           draft_granularity=granularity),
        gamma_policy=gamma_policy)
    r = run_llm(c, env={"VEGAS_VLLM_STATS_DIR": stats_dir})
    assert "error" not in r, r.get("traceback")
    with open(os.path.join(stats_dir, "stats-rank0.json")) as f:
        r["stats"] = json.load(f)
    return r


def _first_diff(a, b):
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _check_identical(stock, ours):
    assert len(ours) == len(stock) and all(len(o) == NEW for o in stock)
    for i, (a, b) in enumerate(zip(stock, ours)):
        assert a == b, f"request {i}: first difference at token {_first_diff(a, b)}"


@pytest.fixture(scope="module")
def auto_case(smollm_dir, tokenizer):
    """Real text, 4 requests of different lengths (they end at different steps), and vLLM's
    output without speculation."""
    prompts = text_prompts(tokenizer, [900, 2300, 400, 3100])
    cfg = {"llm": dict(BASE_LLM, model=smollm_dir, max_model_len=4096), "prompts": prompts,
           "sampling": {"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True}}
    return cfg, run_llm(cfg, plugin=False)


@pytest.mark.parametrize("granularity", ["page", "token"])
def test_auto_greedy_identical_to_stock_vllm(auto_case, granularity, tmp_path_factory):
    """Same tokens as vLLM without speculation; drafts per request vary within 0..γ, so token drafts
    also run steps where only some requests still draft (their gathered K/V rows)."""
    cfg, stock = auto_case
    ours = _run(cfg, str(tmp_path_factory.mktemp(f"auto-smollm-{granularity}")), "auto", granularity)
    _check_identical(stock["outputs"], ours["outputs"])
    m, s = ours["metrics"], ours["stats"]
    hist = s["gamma_histogram"]
    assert len(hist) == GAMMA + 1 and sum(hist) > 0
    # vLLM counts the drafts of every request that drafted: at most γ each, the policy's choices
    assert m["vllm:spec_decode_num_draft_tokens"] <= GAMMA * m["vllm:spec_decode_num_drafts"]
    assert sum(g * n for g, n in enumerate(hist)) >= m["vllm:spec_decode_num_draft_tokens"]


def test_auto_goes_plain_where_drafts_fail_and_skips_scoring(smollm_dir, tmp_path_factory):
    """A random tiny Llama (its sparse drafts mostly rejected, a draft forward about as dear as a
    plain step): requests choose 0 drafts, the following target forwards record no page scores, and
    the tokens still equal vLLM's without speculation."""
    model = tiny_llama_dir(str(tmp_path_factory.mktemp("tiny")), tokenizer_dir=smollm_dir, layers=2, heads=4,
                           kv_heads=2, hidden=256, seed=2)
    prompts = [[(7 * i + 13 * j) % 5000 + 10 for j in range(n)] for i, n in enumerate([600, 1500, 1000])]
    cfg = {"llm": dict(BASE_LLM, model=model, max_model_len=2048), "prompts": prompts,
           "sampling": {"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True}}
    stock = run_llm(cfg, plugin=False)
    ours = _run(cfg, str(tmp_path_factory.mktemp("auto-tiny")), "auto")
    _check_identical(stock["outputs"], ours["outputs"])
    s = ours["stats"]
    assert s["gamma_histogram"][0] > 0, s
    assert s["unscored_steps"] > 0, s
    fixed = _run(cfg, str(tmp_path_factory.mktemp("fixed-tiny")), "fixed")
    _check_identical(stock["outputs"], fixed["outputs"])
    assert fixed["stats"]["unscored_steps"] == 0 and "gamma_histogram" not in fixed["stats"]
    metrics = fixed["metrics"]
    assert metrics["vllm:spec_decode_num_draft_tokens"] == GAMMA * metrics["vllm:spec_decode_num_drafts"]


def test_bad_gamma_policy_fails_at_construction(smollm_dir):
    spec = dict(speculative_config(num_speculative_tokens=4), gamma_policy="sometimes")
    err = construction_error(dict(BASE_LLM, model=smollm_dir, max_model_len=2048, speculative_config=spec))
    assert err is not None and "gamma_policy must be one of" in err, err
