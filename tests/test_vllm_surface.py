"""The vLLM plugin's user surface without vLLM: importing vegas_ext never imports vLLM, and
vegas_ext.vllm.speculative_config validates its arguments."""
import json
import subprocess
import sys

import pytest

from vegas_ext.vllm import PROPOSER_PATH, VegasOptions, engine_kwargs, speculative_config


def test_import_does_not_import_vllm():
    code = ("import sys, vegas_ext, vegas_ext.vllm, vegas_ext.vllm.options; "
            "bad = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]; "
            "assert not bad, bad; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_speculative_config_contents():
    c = speculative_config(num_speculative_tokens=4, sparse_attn_algorithm="streamingllm", sparse_attn_ratio=0.1,
                           sparse_attn_min_tokens=64)
    assert c == {"model": PROPOSER_PATH, "num_speculative_tokens": 4, "sparse_attn_algorithm": "streamingllm",
                 "sparse_attn_ratio": 0.1, "sparse_attn_min_tokens": 64, "num_sink_pages": 1,
                 "gamma_policy": "auto", "draft_granularity": "page", "draft_weights": "int8"}
    assert json.loads(json.dumps(c)) == c
    kw = engine_kwargs(num_speculative_tokens=4)
    assert kw["speculative_config"] == {"model": PROPOSER_PATH, "num_speculative_tokens": 4}
    assert kw["additional_config"]["vegas"]["sparse_attn_algorithm"] == "vegas"


def test_cli_prints_the_json():
    p = subprocess.run([sys.executable, "-m", "vegas_ext.vllm", "--num-speculative-tokens", "5", "--ratio", "0.07"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    c = json.loads(p.stdout)
    assert c["num_speculative_tokens"] == 5 and c["sparse_attn_ratio"] == 0.07 and c["model"] == PROPOSER_PATH
    p = subprocess.run([sys.executable, "-m", "vegas_ext.vllm", "--draft-weights", "none"], capture_output=True,
                       text=True)
    assert p.returncode == 0 and json.loads(p.stdout)["draft_weights"] is None, p.stderr


@pytest.mark.parametrize("kw, name", [
    (dict(sparse_attn_algorithm="quest"), "sparse_attn_algorithm"),
    (dict(sparse_attn_ratio=0.0), "sparse_attn_ratio"),
    (dict(sparse_attn_ratio=1.5), "sparse_attn_ratio"),
    (dict(sparse_attn_ratio=float("nan")), "sparse_attn_ratio"),
    (dict(sparse_attn_min_tokens=-1), "sparse_attn_min_tokens"),
    (dict(sparse_attn_max_tokens=8, sparse_attn_min_tokens=256), "sparse_attn_max_tokens"),
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_sink_pages=-2), "num_sink_pages"),
    (dict(draft_granularity="block"), "draft_granularity"),
    (dict(draft_granularity=1), "draft_granularity"),
    (dict(draft_weights="int4"), "draft_weights"),
    (dict(draft_weights="bf16"), "draft_weights"),
    (dict(draft_weights=True), "draft_weights"),
])
def test_bad_arguments_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        speculative_config(**kw)


def test_options_budget_and_unknown_keys():
    o = VegasOptions(sparse_attn_ratio=0.05, sparse_attn_min_tokens=256)
    assert o.budget_pages(1000, 32) == 8          # 256 tokens
    assert o.budget_pages(8000, 32) == 13         # 400 tokens -> 12.5 pages
    assert VegasOptions(sparse_attn_max_tokens=300).budget_pages(100000, 32) == 10
    assert o.budget_tokens(1000) == 256 and o.budget_tokens(8000) == 400  # token-granular drafts
    assert VegasOptions(draft_granularity="token").draft_granularity == "token"
    assert VegasOptions().draft_weights == "int8" and VegasOptions(draft_weights=None).draft_weights is None
    # None survives the trip through speculative_config (it is not the default)
    assert speculative_config(draft_weights=None)["draft_weights"] is None
    with pytest.raises(ValueError, match="unknown option"):
        VegasOptions.from_mapping({"sparse_attn_ratoi": 0.1})
