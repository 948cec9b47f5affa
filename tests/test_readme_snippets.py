"""README.md as a new user reads it: every Python snippet runs as pasted, alone, and the set-up
says how to get a CPU torch before the quick-start commands."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _blocks(lang: str):
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


PYTHON = _blocks("python")


def _id(code: str) -> str:
    if "vllm" in code:
        return "vllm"
    if "custom_generate" in code:
        return "hf_generate"
    if "generate(" in code:
        return "vegas_generate"
    return "ops" if "torch.ops.vegas" in code else "other"


def _cheap(code: str) -> str:
    """The snippet with a few new tokens instead of its 16-32 (the same code path, seconds less)."""
    return re.sub(r"\b(max_new_tokens|max_tokens)=\d+", r"\1=4", code)


def test_the_readme_has_its_snippets():
    assert sorted(_id(c) for c in PYTHON) == ["hf_generate", "ops", "vegas_generate", "vllm"]


@pytest.mark.parametrize("code", [pytest.param(c, id=_id(c),
                                               marks=[pytest.mark.slow] if "load_model" in c else [])
                                  for c in PYTHON])
def test_python_snippet_runs_alone(code, tmp_path):
    """Each snippet in a fresh interpreter, in an empty folder: no name from another snippet, no
    file of the checkout; it prints something (a snippet ending in a bare expression printed
    nothing as a script). The vLLM one needs vLLM (its own suite: scripts/test_vllm.sh)."""
    if "vllm" in code:
        pytest.importorskip("vllm")
    script = tmp_path / "snippet.py"
    script.write_text(_cheap(code))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip(), "the snippet printed nothing"


def test_quick_start_installs_a_cpu_torch_before_the_set_up():
    """The set-up keeps an installed torch, else pip takes PyPI's CUDA build (~3 GB): the quick
    start gives the command for a CPU build, before the two commands that set up."""
    quick = _blocks("bash")[0].splitlines()
    torch_line = next(i for i, line in enumerate(quick) if line.startswith("pip install torch "))
    assert "--index-url https://download.pytorch.org/whl/cpu" in quick[torch_line]
    run = next(i for i, line in enumerate(quick) if "scripts/run.sh" in line)
    test = next(i for i, line in enumerate(quick) if "scripts/test.sh" in line)
    assert quick[0].startswith("python3 -m venv") and 0 < torch_line < run < test
