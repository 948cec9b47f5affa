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




@pytest.fixture(scope="session", autouse=True)
def _front_ends():
    """The ``run_llm.py --serve`` processes live as long as the session (vllm_utils.run_llm)."""
    yield
    from vllm_utils import close_front_ends

    close_front_ends()


def pytest_terminal_summary(terminalreporter):
    from vllm_utils import RUNS, STARTED

    if RUNS:
        terminalreporter.write_line(f"vLLM runs: {len(RUNS)} ({STARTED['processes']} processes started by the tests), "
                                    f"{sum(s for _, s in RUNS):.0f} s in all")
        for what, s in RUNS:
            terminalreporter.write_line(f"  {s:6.1f} s  {what}")
