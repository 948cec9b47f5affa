"""vegas_ext.pack_linear_weights: the model's fp32 CPU linears on oneDNN-packed weights."""
from __future__ import annotations

import copy
import io
import pickle
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vegas_ext
from vegas_ext.packed_linear import PACKED_MIN_ROWS, PackedLinear, can_pack, pack_linear_weights, unpack_linear_weights

from decode_utils import FAMILIES, first_diff, hf_greedy, make_model, make_prompts, one_thread  # noqa: F401

pytestmark = [pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN"),
              pytest.mark.usefixtures("one_thread")]

def _policy(gamma):
    """``gamma_policy`` for a parametrized γ: an int is the γ of every iteration."""
    return "auto" if gamma == "auto" else "fixed"



@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 7), (5, 7), (3, 4, 7), (2, 3, 7, 7)])
@pytest.mark.parametrize("features", [(7, 13), (64, 1), (96, 200)])
def test_packed_linear_matches_linear(shape, features, bias):
    fin, fout = features
    torch.manual_seed(0)
    lin = nn.Linear(fin, fout, bias=bias)
    p = PackedLinear(lin, min_rows=1)  # every row count through the packed weights
    x = torch.randn(*shape[:-1], fin)
    with torch.no_grad():
        ref = lin(x)
        y = p(x)
    assert y.shape == ref.shape and y.dtype == torch.float32
    # fp32, a different summation order: within a few ulps of the accumulated magnitude
    bound = 8 * torch.finfo(torch.float32).eps * (x.abs() @ lin.weight.abs().T + (lin.bias.abs() if bias else 0))
    assert ((y - ref).abs() <= bound + 1e-30).all(), (y - ref).abs().max()


def test_default_min_rows_follows_the_cpu_vendor_and_threads(monkeypatch):
    import vegas_ext.packed_linear as pl

    amd = pl.cpu_vendor() == "AuthenticAMD"
    assert PACKED_MIN_ROWS == (2 if amd else 4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert pl.default_min_rows() == PACKED_MIN_ROWS
        torch.set_num_threads(2)
        assert pl.default_min_rows() == (1 if amd else 4)
    finally:
        torch.set_num_threads(threads)
    # the default is read at every call: a single row takes the path of the current thread count
    lin = nn.Linear(64, 32)
    p = PackedLinear(lin)
    assert p.min_rows is None
    x = torch.randn(1, 64)
    with torch.no_grad():
        for rows in (1, 2, 4):
            monkeypatch.setattr(pl, "default_min_rows", lambda r=rows: r)
            packed_path = torch.ops.mkldnn._linear_pointwise(x, p._current(), lin.bias, "none", [], "")
            want = packed_path if rows == 1 else F.linear(x, lin.weight, lin.bias)
            assert torch.equal(p(x), want)
    monkeypatch.setattr("builtins.open", lambda *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    assert pl.cpu_vendor() == ""


def test_few_rows_take_f_linear_and_more_take_the_packed_weights():
    torch.manual_seed(0)
    lin = nn.Linear(576, 192)
    p = PackedLinear(lin, min_rows=4)
    packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach())
    with torch.no_grad():
        for rows in (1, 2, 3):
            x = torch.randn(rows, 576)
            assert torch.equal(p(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        for rows in (4, 7, 28):
            x = torch.randn(rows, 576)
            assert torch.equal(p(x), torch.ops.mkldnn._linear_pointwise(x, packed, lin.bias, "none", [], ""))
        x = torch.randn(2, 2, 576)  # rows are the leading dimensions' product
        assert torch.equal(p(x), torch.ops.mkldnn._linear_pointwise(x, packed, lin.bias, "none", [], ""))


def test_packed_linear_non_contiguous_empty_and_vector_inputs():
    torch.manual_seed(0)
    lin = nn.Linear(16, 5)
    p = PackedLinear(lin, min_rows=1)
    with torch.no_grad():
        x = torch.randn(6, 3, 16).transpose(0, 1)  # non-contiguous
        torch.testing.assert_close(p(x), lin(x), rtol=1e-6, atol=1e-6)
        v = torch.randn(16)
        torch.testing.assert_close(p(v), lin(v), rtol=1e-6, atol=1e-6)
        assert p(torch.randn(0, 16)).shape == (0, 5)


def test_packed_linear_sees_in_place_weight_changes():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    p = PackedLinear(lin, min_rows=1)
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = p(x)
        lin.weight.mul_(-2.0)  # the same parameter: the pack must be redone
        after = p(x)
        torch.testing.assert_close(after, lin(x), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(before, after)


def test_packed_linear_with_grad_falls_back_to_autograd():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    p = PackedLinear(lin)
    x = torch.randn(3, 8, requires_grad=True)
    p(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    torch.testing.assert_close(x.grad, lin.weight.sum(0).expand(3, 8).detach())


@pytest.mark.parametrize("x, match", [
    (torch.randn(3, 9), r"x: expected a float32 CPU tensor \[\.\.\., 8\]"),
    (torch.randn(3, 8, dtype=torch.float64), r"x: expected a float32"),
    (torch.randn(3, 8).to(torch.bfloat16), r"x: expected a float32"),
])
def test_packed_linear_bad_input_names_x(x, match):
    p = PackedLinear(nn.Linear(8, 4))
    with pytest.raises(ValueError, match=match):
        with torch.no_grad():
            p(x)


def test_can_pack_only_fp32_cpu_linears():
    assert can_pack(nn.Linear(4, 4))
    assert not can_pack(nn.Linear(4, 4).to(torch.bfloat16))
    assert not can_pack(nn.Linear(4, 4).double())
    assert not can_pack(nn.Embedding(4, 4))
    assert not can_pack(PackedLinear(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="linear: expected an nn.Linear with a non-empty fp32 CPU weight"):
        PackedLinear(nn.Linear(4, 4).to(torch.bfloat16))
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        pack_linear_weights("not a model")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="min_rows: expected None or an int >= 1"):
            pack_linear_weights(nn.Linear(4, 4), min_rows=bad)
        with pytest.raises(ValueError, match="min_rows: expected None or an int >= 1"):
            PackedLinear(nn.Linear(4, 4), min_rows=bad)


def test_pack_linear_weights_replaces_every_linear_and_keeps_parameters():
    model = make_model("llama", tie_word_embeddings=True)
    n_lin = sum(type(m) is nn.Linear for m in model.modules())
    params = {k: v for k, v in model.state_dict().items()}
    assert pack_linear_weights(model) == n_lin  # 2 layers x 7 + lm_head
    assert n_lin == 2 * 7 + 1
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert pack_linear_weights(model) == 0  # again: nothing left to pack
    after = model.state_dict()
    assert after.keys() == params.keys()
    assert all(after[k] is params[k] or torch.equal(after[k], params[k]) for k in params)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert vegas_ext.pack_linear_weights is pack_linear_weights


def test_pack_linear_weights_leaves_other_dtypes_alone():
    model = make_model("llama").to(torch.bfloat16)
    assert pack_linear_weights(model) == 0
    assert sum(type(m) is nn.Linear for m in model.modules()) == 2 * 7 + 1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("gamma", [1, 4, "auto"])
def test_packed_model_decodes_losslessly(family, gamma):
    """Vegas on the packed model equals HF greedy on the same packed model, token for token, and
    stays close to the unpacked model's logits."""
    model = make_model(family)
    ref_model = copy.deepcopy(model)
    assert pack_linear_weights(model, min_rows=1) > 0  # every forward through the packed weights
    ids, mask = make_prompts(model.config.vocab_size, [40, 57, 23])
    ref = hf_greedy(model, ids, mask, 24, eos_token_id=[])
    with torch.inference_mode():
        out = vegas_ext.generate(model, ids, mask, max_new_tokens=24, num_speculative_tokens=gamma,
                                 gamma_policy=_policy(gamma),
                                 sparse_attn_ratio=0.25, sparse_attn_min_tokens=8, block_size=4, eos_token_id=[])
        assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
        assert out.stats["num_draft_tokens"] > 0 or gamma == "auto"
        torch.testing.assert_close(model(ids, attention_mask=mask).logits,
                                   ref_model(ids, attention_mask=mask).logits, rtol=1e-4, atol=1e-4)


# --- case 006: a packed model computes what its weights say now ----------------------------------

def _close_to_linear(p, x):
    """p(x) against F.linear on p's current weight: fp32, a different summation order."""
    with torch.no_grad():
        ref = torch.nn.functional.linear(x, p.weight, p.bias)
        torch.testing.assert_close(p(x), ref, rtol=1e-5, atol=1e-5)


def _other_packed_weight(w):
    # another packed module's weight storage: copy-on-write too, so only the identity check sees it
    return PackedLinear(nn.Linear(w.shape[1], w.shape[0]), min_rows=1).weight.data


def _load_state_dict(p):
    p.load_state_dict({"weight": torch.randn_like(p.weight), "bias": p.bias.detach().clone()})


def _sgd_step(p):
    opt = torch.optim.SGD([p.weight], lr=10.0)
    with torch.enable_grad():
        p(torch.randn(5, 16)).square().sum().backward()
    opt.step()


_VIEW = {}  # a view of the weight taken before packing (set by the test)

WRITES = {
    ".data.mul_": lambda p: p.weight.data.mul_(-2.0),
    ".data.copy_": lambda p: p.weight.data.copy_(torch.randn_like(p.weight)),
    ".data[row] =": lambda p: p.weight.data.__setitem__(1, 5.0),
    ".data.normal_": lambda p: p.weight.data.normal_(),
    "detach().add_": lambda p: p.weight.detach().add_(1.0),
    "no_grad mul_": lambda p: p.weight.mul_(3.0),
    "nn.init.orthogonal_": lambda p: nn.init.orthogonal_(p.weight),
    "view taken before packing": lambda p: _VIEW["v"].mul_(-1.0),
    "numpy() then write": lambda p: np.multiply(p.weight.detach().numpy(), 2.0, out=p.weight.detach().numpy()),
    "load_state_dict": _load_state_dict,
    "optimizer step": _sgd_step,
    ".data = new tensor": lambda p: setattr(p.weight, "data", torch.randn_like(p.weight)),
    ".data = another packed weight": lambda p: setattr(p.weight, "data", _other_packed_weight(p.weight)),
    "weight = new Parameter": lambda p: setattr(p, "weight", nn.Parameter(torch.randn_like(p.weight))),
    "set_": lambda p: p.weight.set_(torch.randn(p.weight.shape)),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_packed_linear_sees_every_write_to_its_weight(write):
    """Each way of changing the weight, those that do not bump ``weight._version`` included
    (writes through ``.data``): the next call computes with the new values."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    _VIEW["v"] = lin.weight.detach()
    p = PackedLinear(lin, min_rows=1)
    x = torch.randn(5, 16)
    with torch.no_grad():
        before = p(x)
        WRITES[write](p)
        after = p(x)
    _close_to_linear(p, x)  # not the old weight's output
    assert not torch.allclose(before, after, atol=1e-3), "the write changed nothing"
    assert p.repacks == 2  # the pack at construction and the one the write made necessary
    with torch.no_grad():
        p(x)
    assert p.repacks == 2  # no write since: no repack


def test_packed_model_greedy_after_data_edits_equals_unpacked():
    """The handed case: the same ``.data`` edits on a packed and an unpacked copy of a model; HF
    greedy and Vegas on the packed one give the unpacked one's tokens, not the old weights' ones."""
    packed, plain = make_model("llama"), make_model("llama")
    ids, mask = make_prompts(packed.config.vocab_size, [40, 30, 35, 20])
    assert pack_linear_weights(packed, min_rows=1) == 2 * 7 + 1
    before = hf_greedy(packed, ids, mask, 16, eos_token_id=[])
    with torch.no_grad():
        for m in (packed, plain):
            m.lm_head.weight.data.mul_(-1.0)
            m.model.layers[1].mlp.down_proj.weight.data[:, :32] = 0.5
            m.model.layers[0].self_attn.q_proj.weight.data.copy_(m.model.layers[0].self_attn.k_proj.weight.data
                                                                 .repeat(2, 1))
        torch.testing.assert_close(packed(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits,
                                   rtol=1e-5, atol=1e-5)
    ref = hf_greedy(plain, ids, mask, 16, eos_token_id=[])
    assert not torch.equal(ref, before)  # the edits change the tokens
    got = hf_greedy(packed, ids, mask, 16, eos_token_id=[])
    assert torch.equal(got, ref), first_diff(got, ref)
    with torch.inference_mode():
        out = vegas_ext.generate(packed, ids, mask, max_new_tokens=16, num_speculative_tokens=3, gamma_policy="fixed",
                                 sparse_attn_ratio=0.25, sparse_attn_min_tokens=8, block_size=4, eos_token_id=[])
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)


def test_decoding_does_not_repack():
    """HF generate, Vegas, and Vegas with a prefill cache (its weight fingerprint) only read the
    weights: no repack (a repack costs about as much as a few decoding steps)."""
    model = make_model("llama", tie_word_embeddings=True)
    ids, mask = make_prompts(model.config.vocab_size, [20, 12])
    pack_linear_weights(model, min_rows=1)
    packs = [m for m in model.modules() if isinstance(m, PackedLinear)]
    hf_greedy(model, ids, mask, 6, eos_token_id=[])
    pc = {}
    with torch.inference_mode():
        for _ in range(2):
            vegas_ext.generate(model, ids, mask, max_new_tokens=6, eos_token_id=[], prefill_cache=pc)
    model.state_dict()
    model.to("cpu").float().eval()  # no-op moves
    hf_greedy(model, ids, mask, 2, eos_token_id=[])
    assert [m.repacks for m in packs] == [1] * len(packs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_packed_model_after_dtype_change_runs_as_unpacked(dtype):
    """After ``model.to(dtype)`` the linears are ``F.linear`` on the converted weights (the same bits
    as the unpacked model converted alike); back to float32 they are packed again."""
    packed, plain = make_model("llama"), make_model("llama")
    ids, mask = make_prompts(packed.config.vocab_size, [20, 12])
    pack_linear_weights(packed, min_rows=1)
    packed, plain = packed.to(dtype), plain.to(dtype)
    assert all(m._pack is None for m in packed.modules() if isinstance(m, PackedLinear))  # freed at once
    with torch.no_grad():
        assert torch.equal(packed(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits)
    assert torch.equal(hf_greedy(packed, ids, mask, 6, eos_token_id=[]),
                       hf_greedy(plain, ids, mask, 6, eos_token_id=[]))
    packed, plain = packed.float(), plain.float()
    with torch.no_grad():
        torch.testing.assert_close(packed(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits,
                                   rtol=1e-5, atol=1e-5)
    assert all(m.repacks == 2 for m in packed.modules() if isinstance(m, PackedLinear))


def test_packed_linear_with_a_new_weight_of_another_dtype_or_under_autocast_is_f_linear():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    p = PackedLinear(lin, min_rows=1)
    x = torch.randn(5, 16)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, ref = p(x), torch.nn.functional.linear(x, lin.weight, lin.bias)
        assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
        p.weight.data = p.weight.data.double()
        p.bias.data = p.bias.data.double()
        assert torch.equal(p(x.double()), torch.nn.functional.linear(x.double(), p.weight, p.bias))


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_packed_model_copies_and_saves(how):
    """deepcopy, pickle and torch.save/torch.load of a packed model: the same logits, and the copy
    packs (and follows) its own weights."""
    model = make_model("llama", tie_word_embeddings=True)
    ids, mask = make_prompts(model.config.vocab_size, [20, 12])
    pack_linear_weights(model, min_rows=1)
    if how == "deepcopy":
        cp = copy.deepcopy(model)
    elif how == "pickle":
        cp = pickle.loads(pickle.dumps(model))
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        cp = torch.load(buf, weights_only=False)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        assert torch.equal(cp(ids, attention_mask=mask).logits, ref)
        assert cp.lm_head.weight is cp.model.embed_tokens.weight and cp.lm_head.weight is not model.lm_head.weight
        assert isinstance(cp.lm_head, PackedLinear) and cp.lm_head.repacks == 1
        cp.lm_head.weight.data.mul_(2.0)  # the copy's weights are its own
        assert torch.equal(model(ids, attention_mask=mask).logits, ref)
        unpack_linear_weights(model)
        model.lm_head.weight.data.mul_(2.0)
        torch.testing.assert_close(cp(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits,
                                   rtol=1e-5, atol=1e-5)


def test_unpack_linear_weights():
    model = make_model("llama", tie_word_embeddings=True)
    ids, mask = make_prompts(model.config.vocab_size, [20, 12])
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    params = dict(model.named_parameters())
    assert pack_linear_weights(model) == 2 * 7 + 1
    assert unpack_linear_weights(model) == 2 * 7 + 1
    assert unpack_linear_weights(model) == 0
    assert sum(type(m) is nn.Linear for m in model.modules()) == 2 * 7 + 1
    assert all(p is params[k] for k, p in model.named_parameters())  # the same parameters
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, ref)  # nn.Linear again: the same bits
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        unpack_linear_weights("not a model")
    assert vegas_ext.unpack_linear_weights is unpack_linear_weights


def test_linears_with_hooks_or_a_replaced_forward_are_not_packed():
    """Packing a linear replaces the module, which would drop its hooks: such linears stay."""
    model = make_model("llama")
    ids, mask = make_prompts(model.config.vocab_size, [20, 12])
    model.lm_head.register_forward_hook(lambda mod, args, out: out * 2.0)
    q = model.model.layers[0].self_attn.q_proj
    q.forward = lambda x: nn.functional.linear(x, q.weight, q.bias) * 0.5
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    assert pack_linear_weights(model, min_rows=1) == 2 * 7 - 1
    assert type(model.lm_head) is nn.Linear and type(q) is nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("source", ["numpy", "mmap"])
def test_weights_in_memory_torch_does_not_own_are_copied_and_followed(source, tmp_path):
    """A weight over a NumPy array or a file mapping (transformers 5 loads safetensors that way)
    cannot be made copy-on-write: packing gives it memory of its own, and writes are still seen."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    if source == "numpy":
        arr = lin.weight.detach().numpy().copy()
        lin.weight.data = torch.from_numpy(arr)
    else:
        torch.save(lin.weight.detach(), tmp_path / "w.pt")
        lin.weight.data = torch.load(tmp_path / "w.pt", mmap=True)
    with pytest.raises(RuntimeError):
        torch._lazy_clone(lin.weight.detach())
    with torch.inference_mode():
        p = PackedLinear(lin, min_rows=1)
    assert not p.weight.is_inference()  # its own memory is an ordinary tensor: autograd still works
    x = torch.randn(5, 16)
    _close_to_linear(p, x)
    with torch.no_grad():
        p.weight.data.mul_(-1.0)
    _close_to_linear(p, x)
    assert p.repacks == 2
    with torch.no_grad():  # a new such weight after packing: F.linear (no copy made behind the user's back)
        p.weight.data = torch.from_numpy(np.full((8, 16), 0.25, dtype=np.float32))
        y = p(x)
    _close_to_linear(p, x)
    assert p.repacks == 2 and torch.allclose(y, x.sum(-1, keepdim=True) * 0.25 + p.bias, atol=1e-5)


@pytest.mark.parametrize("seed", range(30))  # the race it guards hit ~3 % of rounds
def test_threads_calling_a_packed_linear_after_a_write_repack_it_once(seed):
    """Regression: a thread that read the old cache entry while another repacked saw it as fresh
    (the repack marks the storage copy-on-write again) and computed with the stale weight."""
    torch.manual_seed(seed)
    lin = nn.Linear(256, 128)
    p = PackedLinear(lin, min_rows=1)
    x = torch.randn(8, 256)
    with torch.no_grad():
        lin.weight.data.mul_(-1.0)
        ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
    outs, start = [None] * 8, threading.Barrier(8)

    def run(i):
        start.wait()
        with torch.no_grad():
            outs[i] = p(x)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for y in outs:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert p.repacks == 2


@pytest.mark.slow  # Inductor's C++ compile: ~20-90 s on a shared 2-core machine
def test_torch_compile_of_a_packed_linear_runs_f_linear():
    """Inductor cannot lower the packed op on a non-constant weight ("weight must be a graph
    constant"); compiled, the module is F.linear (Inductor's freezing packs weights itself)."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    f = torch.compile(PackedLinear(lin, min_rows=1))
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(f(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        lin.weight.data.mul_(2.0)
        torch.testing.assert_close(f(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("change", ["data_t", "t_", "as_strided_"])
def test_packed_linear_sees_a_new_view_of_the_same_storage(change):
    """Regression (break test): the weight re-viewed in place (same tensor, same storage, other
    strides) must not keep the old packed copy."""
    m = nn.Sequential(nn.Linear(64, 64))
    if not can_pack(m[0]):
        pytest.skip("this PyTorch cannot pack linears (no oneDNN)")
    pack_linear_weights(m, min_rows=1)
    x = torch.randn(8, 64)
    with torch.no_grad():
        m(x)
        w = m[0].weight
        if change == "data_t":
            w.data = w.data.t()
        elif change == "t_":
            w.t_()
        else:
            w.as_strided_((64, 64), (1, 64))
        torch.testing.assert_close(m(x), torch.nn.functional.linear(x, m[0].weight, m[0].bias), atol=1e-5, rtol=1e-5)


class _Double(nn.Module):
    def forward(self, w):
        return 2 * w


def _prune(m):
    import torch.nn.utils.prune  # noqa: F401  (not loaded by `import torch`)

    torch.nn.utils.prune.l1_unstructured(m, "weight", 0.3)


def _weight_norm(m):
    torch.nn.utils.parametrizations.weight_norm(m)


def _spectral_norm(m):
    torch.nn.utils.parametrizations.spectral_norm(m)


def _parametrize(m):
    torch.nn.utils.parametrize.register_parametrization(m, "weight", _Double())


def _parametrize_bias(m):
    torch.nn.utils.parametrize.register_parametrization(m, "bias", _Double())


@pytest.mark.parametrize("make", [_prune, _weight_norm, _spectral_norm, _parametrize, _parametrize_bias])
def test_packed_linear_with_a_computed_weight_is_nn_linear(make):
    """Pruned or parametrized (weight_norm, spectral_norm, register_parametrization): the weight is no
    plain parameter any more; forward is F.linear on the computed weight, exactly nn.Linear's result."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    ref = copy.deepcopy(lin)
    p = PackedLinear(lin, min_rows=1)
    for m in (p, ref):
        torch.manual_seed(1)  # spectral_norm's random start vectors
        make(m)
    x = torch.randn(6, 16)
    with torch.no_grad():
        for _ in range(2):  # spectral_norm's power iteration updates its vectors in training mode
            assert torch.equal(p(x), ref(x))
            assert torch.equal(p(x[:1]), ref(x[:1]))
    p.eval(), ref.eval()
    with torch.no_grad():
        assert torch.equal(p(x), nn.functional.linear(x, p.weight, p.bias))
        assert torch.equal(p(x), ref(x))
    assert torch.equal(p(x), ref(x))  # with autograd too
    if make is _prune:  # made permanent: a plain parameter again, packed and followed
        torch.nn.utils.prune.remove(p, "weight")
        _close_to_linear(p, x)


def test_min_rows_accepts_numpy_integers_and_refuses_the_rest():
    assert PackedLinear(nn.Linear(4, 4), min_rows=np.int64(3)).min_rows == 3
    assert type(PackedLinear(nn.Linear(4, 4), min_rows=np.int32(2)).min_rows) is int
    for bad in ("2", 2.0, np.bool_(True), np.int64(0), [2]):
        with pytest.raises(ValueError, match="min_rows: expected None or an int >= 1"):
            pack_linear_weights(nn.Sequential(nn.Linear(4, 4)), min_rows=bad)


def test_empty_linears_are_not_packed():
    for lin in (nn.Linear(0, 3), nn.Linear(3, 0)):
        assert not can_pack(lin)
        m = nn.Sequential(lin)
        assert pack_linear_weights(m) == 0
        assert m(torch.randn(2, lin.in_features)).shape == (2, lin.out_features)


def test_a_trainable_bias_keeps_its_gradient():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    lin.weight.requires_grad_(False)  # frozen weight, trained bias
    p = PackedLinear(lin, min_rows=1)
    y = p(torch.randn(5, 16))
    assert y.requires_grad
    y.sum().backward()
    assert torch.equal(lin.bias.grad, torch.full((8,), 5.0))


def test_min_rows_set_after_construction_is_checked_and_takes_effect():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    p = PackedLinear(lin, min_rows=4)
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(p(x), F.linear(x, lin.weight, lin.bias))  # 2 rows < 4: F.linear
        p.min_rows = np.int64(2)
        assert p.min_rows == 2 and type(p.min_rows) is int
        packed = torch.ops.mkldnn._linear_pointwise(x, p._current(), lin.bias, "none", [], "")
        assert torch.equal(p(x), packed)
    for bad in (0, "2", 2.5, True):
        with pytest.raises(ValueError, match="min_rows: expected None or an int >= 1"):
            p.min_rows = bad
    assert p.min_rows == 2  # a refused value leaves the old one
    p.min_rows = None
    assert p.min_rows is None and "min_rows=None" in repr(p)


def test_a_pickle_from_before_the_min_rows_property_loads():
    p = PackedLinear(nn.Linear(8, 4), min_rows=3)
    state = p.__getstate__()
    state["min_rows"] = state.pop("_min_rows")  # how the attribute was stored before
    q = PackedLinear.__new__(PackedLinear)
    q.__setstate__(state)
    assert q.min_rows == 3
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(q(x), p(x))
    # then unchecked: a bad old value falls back to the default with a warning; none at all is None
    state["min_rows"] = 0
    with pytest.warns(UserWarning, match="pickled min_rows=0"):
        q.__setstate__(state)
    assert q.min_rows is None
    del state["min_rows"]
    q.__setstate__(state)
    assert q.min_rows is None
    with torch.no_grad():
        torch.testing.assert_close(q(x), p(x))
