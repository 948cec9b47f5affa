"""The Vegas drafter near ``max_model_len`` (issue 32's MAL difference at 8K x batch 4).

vLLM's runner skips the drafter for the whole batch once the batch's longest request is within γ
positions of ``max_model_len`` (``GPUModelRunner._input_fits_in_drafter``) and then schedules γ
token-0 drafts for every request, which verification rejects. The output stays exact, but the rest
of the batch loses its speculation and the acceptance counters drop by an amount that depends on
when the longest request gets there (1.85 vs 2.81 at 8K x 4 in
``bench/results/vllm_one_pass_xeon_avx512``, where ``max_model_len`` was the context + 32). The
plugin lets the Vegas proposer run anyway: it caps each request's drafts at its own remaining
positions."""
import json
import os

from vegas_ext.vllm import speculative_config

from vllm_utils import BASE_LLM, run_llm, text_prompts

GAMMA = 6
MAX_LEN = 1024
# request 0 ends exactly at max_model_len after 20 tokens; request 1, far from it, decodes 60
NEW = [20, 60]


def test_drafts_stay_vegas_near_max_model_len(smollm_dir, tokenizer, tmp_path):
    prompts = text_prompts(tokenizer, [MAX_LEN - NEW[0], 300])
    cfg = {"llm": dict(BASE_LLM, model=smollm_dir, max_model_len=MAX_LEN), "prompts": prompts,
           "sampling": {"temperature": 0.0, "ignore_eos": True}, "max_tokens_per_prompt": NEW}
    stock = run_llm(cfg, plugin=False)
    c = json.loads(json.dumps(cfg))
    c["llm"]["speculative_config"] = dict(
        speculative_config(num_speculative_tokens=GAMMA, sparse_attn_algorithm="vegas", sparse_attn_ratio=0.05,
                           sparse_attn_min_tokens=256), gamma_policy="fixed")
    stats_dir = str(tmp_path / "stats")
    ours = run_llm(c, env={"VEGAS_VLLM_STATS_DIR": stats_dir})
    assert "error" not in ours, ours.get("traceback")
    with open(os.path.join(stats_dir, "stats-rank0.json")) as f:
        stats = json.load(f)
    assert [len(o) for o in ours["outputs"]] == NEW
    assert ours["outputs"] == stock["outputs"]
    m = ours["metrics"]
    # Every draft vLLM verified came from the proposer (some of the proposer's last drafts are never
    # verified). With vLLM's own check, once request 0 is within γ of max_model_len, both requests
    # verify γ token-0 drafts per step until request 0 has finished at one token per step.
    assert 0 < m["vllm:spec_decode_num_draft_tokens"] <= stats["draft_tokens"], (m, stats)
