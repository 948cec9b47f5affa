"""Helpers of the vLLM plugin tests and of bench/vllm_e2e.py (run in a venv with vLLM, see scripts/test_vllm.sh).

Every engine runs in its own process through ``run_llm.py``; ``plugin=False`` sets
``VLLM_PLUGINS=""`` there, so no vLLM process loads the plugin (the stock engine). Configurations that
must fail at ``LLM(...)`` are checked in the test process (``construction_error``): no engine starts."""
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# small CPU engines: fp32, eager, 32-token pages, 1 GiB of KV cache
BASE_LLM = dict(dtype="float32", enforce_eager=True, block_size=32, disable_log_stats=False, seed=0)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "VLLM_LOGGING_LEVEL": "WARNING"}
# (what, wall seconds) of every vLLM process the tests started; conftest prints them at the end
PROCESSES = []


def record_process(what, t0):
    """Note a vLLM process started at ``time.perf_counter()`` ``t0`` (the session's summary lists them)."""
    PROCESSES.append((what, time.perf_counter() - t0))


def run_llm(cfg, *, plugin=True, env=None, timeout=900):
    """Run ``run_llm.py`` on ``cfg`` in a fresh process; returns its JSON result."""
    with tempfile.TemporaryDirectory() as d:
        cp, op = os.path.join(d, "cfg.json"), os.path.join(d, "out.json")
        with open(cp, "w") as f:
            json.dump(cfg, f)
        e = dict(os.environ, **ENV, **(env or {}))
        if not plugin:
            e["VLLM_PLUGINS"] = ""
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, os.path.join(HERE, "run_llm.py"), cp, op], env=e, timeout=timeout,
                           capture_output=True, text=True)
        record_process(f"run_llm {'plugin' if plugin else 'stock'} {os.path.basename(cfg['llm']['model'])}", t0)
        if not os.path.exists(op):
            raise AssertionError(f"run_llm.py failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
        with open(op) as f:
            res = json.load(f)
        res["log"] = p.stderr[-6000:]
        return res


def construction_error(llm_kwargs):
    """``LLM(**llm_kwargs)`` in this process, for a configuration that must fail before any engine starts:
    the error as ``"Type: message"`` (as run_llm.py reports it), or None if ``LLM(...)`` accepted it (the
    engine it started is shut down). ``LLM(...)`` validates its arguments, the plugin's options included
    (its ``EngineArgs.create_speculative_config`` hook, loaded through the entry point as in any vLLM
    process), in ``EngineArgs.create_engine_config`` before it starts an engine process, so a fresh
    process of its own (run_llm) would check nothing more."""
    from vllm import LLM

    try:
        llm = LLM(**llm_kwargs)
    except Exception as e:  # the bad-input tests look at this message
        return f"{type(e).__name__}: {e}"
    llm.llm_engine.engine_core.shutdown()
    return None


def text_prompts(tokenizer, lengths, doc="pride_and_prejudice"):
    """Token id prompts of the given lengths cut from a shipped public-domain text, at different offsets."""
    from vegas_ext.documents import load_document

    ids = tokenizer(load_document(doc))["input_ids"]
    out = []
    for i, n in enumerate(lengths):
        start = (i * 3001) % max(1, len(ids) - n)
        out.append(ids[start : start + n])
    return out


def tiny_llama_dir(root, *, vocab=None, layers=2, heads=4, kv_heads=2, hidden=256, seed=0, tokenizer_dir=None):
    """A random tiny Llama saved with SmolLM2's tokenizer (``vocab`` < tokenizer size: a smaller output layer)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = os.path.join(root, f"tiny-llama-v{vocab}-l{layers}-h{heads}-{kv_heads}-s{seed}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=vocab or len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=8192, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper random logits so two-token continuations are not uniform
        m.lm_head.weight.mul_(40.0)
    m.save_pretrained(path)
    tok.save_pretrained(path)
    return path
