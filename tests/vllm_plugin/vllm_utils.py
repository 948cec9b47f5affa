"""Helpers of the vLLM plugin tests and of bench/vllm_e2e.py (run in a venv with vLLM, see scripts/test_vllm.sh).

Every engine runs outside the test process through ``run_llm.py``, in its own engine-core process:
one front-end process (``run_llm.py --serve``) per plugin setting serves the engines of the whole
session, one after another, so vLLM is imported twice per session instead of once per engine
(``VEGAS_VLLM_FRESH_PROCESSES=1``: a fresh ``run_llm.py`` process per engine, as before).
``plugin=False`` sets ``VLLM_PLUGINS=""`` there, so no vLLM process loads the plugin (the stock
engine); a stock configuration runs once per session (its result is kept). Configurations that must
fail at ``LLM(...)`` are checked in the test process (``construction_error``): no engine starts."""
import atexit
import copy
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# small CPU engines: fp32, eager, 32-token pages, 1 GiB of KV cache
BASE_LLM = dict(dtype="float32", enforce_eager=True, block_size=32, disable_log_stats=False, seed=0)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "VLLM_LOGGING_LEVEL": "WARNING"}
# (what, wall seconds) of every engine run, probe and server of the session; conftest prints them
RUNS = []
STARTED = {"processes": 0}  # vLLM processes the tests started themselves (front ends, probes, servers)


def record_run(what, t0, process=False):
    """Note a vLLM run begun at ``time.perf_counter()`` ``t0`` (``process``: in a process of its own)."""
    RUNS.append((what, time.perf_counter() - t0))
    STARTED["processes"] += bool(process)


class _FrontEnd:
    """A ``run_llm.py --serve`` process: vLLM's front end for every engine of one plugin setting."""

    def __init__(self, plugin):
        self.plugin, self.proc = plugin, None

    def _start(self):
        env = dict(os.environ, **ENV)
        if not self.plugin:
            env["VLLM_PLUGINS"] = ""
        fd, self.log_path = tempfile.mkstemp(prefix="run_llm-serve-", suffix=".log")
        r, w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "run_llm.py"), "--serve", str(w)],
                                     stdin=subprocess.PIPE, stdout=fd, stderr=subprocess.STDOUT, env=env,
                                     pass_fds=(w,), start_new_session=True, text=True)
        os.close(fd)
        os.close(w)
        self.done = os.fdopen(r)
        STARTED["processes"] += 1

    def _log(self, start):
        with open(self.log_path, errors="replace") as f:
            f.seek(start)
            return f.read()[-6000:]

    def run(self, cfg_path, out_path, env, timeout):
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self._start()
        start = os.path.getsize(self.log_path)
        job = json.dumps({"cfg": cfg_path, "out": out_path, "env": env or {}})
        try:
            self.proc.stdin.write(job + "\n")
            self.proc.stdin.flush()
            ready = select.select([self.done], [], [], timeout)[0]
            finished = bool(ready) and self.done.readline() == "done\n"
        except OSError:  # it exited
            ready, finished = True, False
        if not finished:
            log = self._log(start)
            self.close(kill=True)
            raise AssertionError(f"run_llm.py --serve {'exited' if ready else f'timed out after {timeout} s'}:\n{log}")
        with open(out_path) as f:
            res = json.load(f)
        res["log"] = self._log(start)
        if "crash" in res:  # it exits after a crash; the next run starts a fresh one
            self.close()
            raise AssertionError(f"run_llm.py failed:\n{res['crash']}\n{res['log']}")
        return res

    def close(self, kill=False):
        if self.proc is None:
            return
        if not kill:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                kill = True
        if kill:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its engine-core and worker processes too
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.done.close()
        os.unlink(self.log_path)
        self.proc = None


_FRONT_ENDS = {True: _FrontEnd(True), False: _FrontEnd(False)}
_STOCK = {}  # stock results by configuration: each is computed once per session


def close_front_ends():
    """Stop the ``run_llm.py --serve`` processes (the session's end; also at exit)."""
    for fe in _FRONT_ENDS.values():
        fe.close()


atexit.register(close_front_ends)


def run_llm(cfg, *, plugin=True, env=None, timeout=900):
    """Run ``cfg``'s engine through ``run_llm.py`` (see the module docstring); returns its JSON result.
    ``env``: variables for this engine's processes."""
    key = None if plugin or env else json.dumps(cfg, sort_keys=True)
    if key in _STOCK:
        return copy.deepcopy(_STOCK[key])
    what = f"engine {'plugin' if plugin else 'stock'} {os.path.basename(cfg['llm']['model'])}"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        cp, op = os.path.join(d, "cfg.json"), os.path.join(d, "out.json")
        with open(cp, "w") as f:
            json.dump(cfg, f)
        if os.environ.get("VEGAS_VLLM_FRESH_PROCESSES", "0") == "1":
            res = _run_fresh(cp, op, plugin, env, timeout)
            record_run(what + " (own process)", t0, process=True)
        else:
            res = _FRONT_ENDS[plugin].run(cp, op, env, timeout)
            record_run(what, t0)
    if key is not None:
        _STOCK[key] = copy.deepcopy(res)
    return res


def _run_fresh(cp, op, plugin, env, timeout):
    e = dict(os.environ, **ENV, **(env or {}))
    if not plugin:
        e["VLLM_PLUGINS"] = ""
    p = subprocess.run([sys.executable, os.path.join(HERE, "run_llm.py"), cp, op], env=e, timeout=timeout,
                       capture_output=True, text=True)
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
