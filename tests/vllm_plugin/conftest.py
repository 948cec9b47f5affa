"""Fixtures of the vLLM plugin tests (helpers: vllm_utils.py)."""
import importlib.util

import pytest

# The main suite (tests/) runs where vLLM is not installed: skip this folder there.
if importlib.util.find_spec("vllm") is None:
    collect_ignore = ["test_vllm_plugin.py", "test_vllm_serve.py", "test_vllm_host_guard.py",
                      "test_vllm_max_model_len.py", "test_vllm_draft_linears.py"]


@pytest.fixture(scope="session")
def smollm_dir():
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (converted once and cached)."""
    from vegas_ext.models import convert_gguf, default_model_path

    return convert_gguf(default_model_path())


@pytest.fixture(scope="session")
def tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)




def pytest_terminal_summary(terminalreporter):
    from vllm_utils import PROCESSES

    if PROCESSES:
        terminalreporter.write_line(f"vLLM processes started: {len(PROCESSES)}, "
                                    f"{sum(s for _, s in PROCESSES):.0f} s in all")
        for what, s in PROCESSES:
            terminalreporter.write_line(f"  {s:6.1f} s  {what}")
