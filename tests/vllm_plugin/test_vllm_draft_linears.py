"""vegas_ext.vllm.draft_linears on vLLM's own CPU GEMM dispatch, without an engine: the copy is
made before vLLM drops the weight, used only inside ``drafting()``, once per (tied) parameter, and
only for a Vegas engine that asks for it."""
import types

import pytest
import torch
from torch import nn

from vegas_ext import reference
from vegas_ext.draft_weights import pack_int8, quantize_int8
from vegas_ext.vllm import draft_linears
from vegas_ext.vllm.options import PROPOSER_PATH


def _config(draft_weights, proposer=PROPOSER_PATH):
    spec = types.SimpleNamespace(method="custom_class", model=proposer)
    return types.SimpleNamespace(speculative_config=spec,
                                 additional_config={"vegas": {"draft_weights": draft_weights}})


def _layer(w, b=None):
    m = nn.Module()
    m.weight = w if isinstance(w, nn.Parameter) else nn.Parameter(w, requires_grad=False)
    m.bias = None if b is None else nn.Parameter(b, requires_grad=False)
    return m


@pytest.fixture
def dispatch(monkeypatch):
    """vLLM's dispatch_cpu_unquantized_gemm wrapped as the plugin wraps it, with the 'current'
    engine config a test sets through the returned setter."""
    import vllm.config
    from vllm.model_executor.layers import utils

    current = {"cfg": None}
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: current["cfg"])
    original = getattr(utils.dispatch_cpu_unquantized_gemm, "__wrapped__", utils.dispatch_cpu_unquantized_gemm)
    return draft_linears.wrap_dispatch(original), lambda cfg: current.__setitem__("cfg", cfg)


def test_wrapping_is_idempotent(dispatch):
    fn, _ = dispatch
    assert draft_linears.wrap_dispatch(fn) is fn


@pytest.mark.parametrize("kind", ["int8", "fp16"])
def test_copy_is_read_only_while_drafting(dispatch, kind):
    fn, set_cfg = dispatch
    set_cfg(_config(kind))
    torch.manual_seed(0)
    w, b, x = torch.randn(200, 136), torch.randn(200), torch.randn(3, 136)
    exact = nn.functional.linear(x, w, b)
    layer = _layer(w.clone(), b.clone())
    before = draft_linears.copies()
    fn(layer, True)
    assert layer.weight.numel() == 0  # vLLM packed and dropped it; the copy was made first
    assert draft_linears.copies()["linears"] == before["linears"] + 1
    torch.testing.assert_close(layer.cpu_linear(x, layer.weight, layer.bias), exact, rtol=1e-4, atol=1e-4)
    with draft_linears.drafting():
        got = layer.cpu_linear(x, layer.weight, layer.bias)
    assert draft_linears.copies()["calls"] == before["calls"] + 1
    if kind == "int8":
        q, s = quantize_int8(w)  # the copy is packed: the reference rounds x as the kernel does
        torch.testing.assert_close(got, reference.weight_only_linear(x, pack_int8(q), s, b), rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(got, reference.weight_only_linear(x, w.half(), None, b), rtol=1e-4, atol=1e-4)
    assert not torch.equal(got, exact) and (got - exact).abs().max() < 0.05 * exact.abs().max()


def test_tied_parameter_is_copied_once(dispatch):
    fn, set_cfg = dispatch
    set_cfg(_config("int8"))
    shared = nn.Parameter(torch.randn(96, 64), requires_grad=False)
    before = draft_linears.copies()
    fn(_layer(shared), False)  # the input embedding keeps its weight
    head = _layer(shared)
    fn(head, False)
    after = draft_linears.copies()
    assert after["linears"] == before["linears"] + 2
    assert after["bytes"] - before["bytes"] == 96 * 64 + 96 * 4  # int8 + one float32 scale per 64
    with torch.no_grad():
        shared.mul_(2)  # reloaded in place: a new copy, with the new values
    fn(head, False)
    assert draft_linears.copies()["bytes"] - after["bytes"] == 96 * 64 + 96 * 4
    x = torch.randn(2, 64)
    with draft_linears.drafting():
        got = head.cpu_linear(x, head.weight, None)
    q, s = quantize_int8(shared)
    torch.testing.assert_close(got, reference.weight_only_linear(x, pack_int8(q), s), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cfg", [None, _config(None), _config("int8", proposer="some.other.Proposer")])
def test_no_copy_unless_a_vegas_engine_asks(dispatch, cfg):
    fn, set_cfg = dispatch
    set_cfg(cfg)
    layer = _layer(torch.randn(32, 64))
    before = draft_linears.copies()
    fn(layer, True)
    assert draft_linears.copies()["linears"] == before["linears"]
    x = torch.randn(2, 64)
    with draft_linears.drafting():
        layer.cpu_linear(x, layer.weight, None)
    assert draft_linears.copies()["calls"] == before["calls"]
