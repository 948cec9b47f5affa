"""The typed wrappers of vegas_ext.ops (issue 31): real signatures for help() / IDEs, and a Python
int accepted wherever the op takes one value per batch row, on the compiled kernel and the
reference fallback alike."""
from __future__ import annotations

import inspect
import math

import pytest
import torch

from vegas_ext import ops

from op_utils import make_inputs, random_selection

# wrapper -> (parameter names, defaults, per-row parameters)
SIGNATURES = {
    "verify_attention": (["q", "k_cache", "v_cache", "seq_lens", "block_size", "scale", "query_weights"],
                         {"query_weights": None}, {"seq_lens"}),
    "block_topk": (["block_scores", "k", "num_candidates", "max_k", "num_sink_blocks", "num_recent_blocks"],
                   {"num_sink_blocks": 0, "num_recent_blocks": 0}, {"k", "num_candidates"}),
    "sparse_draft_attention": (["q", "k_cache", "v_cache", "block_indices", "tail_start", "seq_lens", "block_size",
                                "scale"], {}, {"tail_start", "seq_lens"}),
    "block_minmax_update": (["key_min", "key_max", "k_cache", "seq_lens", "start", "block_size"], {},
                            {"seq_lens", "start"}),
    "quest_block_scores": (["q", "key_min", "key_max", "num_blocks"], {}, {"num_blocks"}),
    "paged_block_scores": (["q", "key_cache", "block_table", "seq_lens", "query_start_loc", "num_queries", "scale"],
                           {}, {"seq_lens"}),
    "paged_verify_attention": (["q", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc",
                                "num_queries", "scale", "score_block_size"], {"score_block_size": None},
                               {"seq_lens"}),
    "paged_sparse_draft_attention": (["q", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc",
                                      "token_indices", "tail_start", "scale"], {}, {"seq_lens", "tail_start"}),
}


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_wrapper_shows_its_real_signature(name):
    fn = getattr(ops, name)
    names, defaults, per_row = SIGNATURES[name]
    sig = inspect.signature(fn, eval_str=True)
    assert list(sig.parameters) == names
    for p in sig.parameters.values():
        assert p.kind is p.POSITIONAL_OR_KEYWORD, p
        assert p.annotation is not p.empty, p  # every argument annotated
        assert p.default == defaults.get(p.name, p.empty), p
        if p.name in per_row:
            assert p.annotation == (torch.Tensor | int) or set(p.annotation.__args__) == {torch.Tensor, int}, p
    assert sig.return_annotation is not sig.empty
    assert fn.__name__ == name and "Args:" in fn.__doc__
    assert all(n in inspect.getdoc(fn) for n in names)  # each argument documented


# ------------------------------------------------------------------ int vs tensor: same result
def _rows(t):
    return int(t.shape[0])


def _cases():
    """name -> (positional args with per-row tensors holding one value each)."""
    B, Q, Hq, Hkv, D, S, bs = 3, 2, 4, 2, 32, 40, 4
    q, k, v, _ = make_inputs(B, Q, Hq, Hkv, D, S, torch.float32)
    lens = torch.full((B,), 37, dtype=torch.int32)
    idx = random_selection(B, Hkv, math.ceil(S / bs), 3)
    nblk = math.ceil(S / bs)
    kmin = torch.zeros(B, Hkv, nblk, D)
    kmax = torch.zeros(B, Hkv, nblk, D)
    T, ps, NP = 5, 8, 12
    qp = torch.randn(T, Hq, D, generator=torch.Generator().manual_seed(3))
    kc = torch.randn(NP, Hkv, ps, D, generator=torch.Generator().manual_seed(4))
    bt = torch.arange(NP, dtype=torch.int32).view(2, 6)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    full = lambda n, v: torch.full((n,), v, dtype=torch.int32)  # noqa: E731
    return {
        "verify_attention": ((q, k, v, lens, bs, D ** -0.5), {"seq_lens": 37}),
        "block_topk": ((torch.rand(B, Hkv, 50, generator=torch.Generator().manual_seed(2)), full(B, 6),
                        full(B, 30), 8, 1), {"k": 6, "num_candidates": 30}),
        "sparse_draft_attention": ((q[:, :1].contiguous(), k, v, idx, full(B, 33), full(B, 36), bs, D ** -0.5),
                                   {"tail_start": 33, "seq_lens": 36}),
        "block_minmax_update": ((kmin, kmax, k, full(B, 37), full(B, 0), bs), {"seq_lens": 37, "start": 0}),
        "quest_block_scores": ((q, kmin + torch.rand_like(kmin), kmax + 1, full(B, 7)), {"num_blocks": 7}),
        "paged_block_scores": ((qp, kc, bt, full(2, 40), qsl, 3, D ** -0.5), {"seq_lens": 40}),
        "paged_verify_attention": ((qp, kc, kc.flip(0), bt, full(2, 40), qsl, 3, D ** -0.5), {"seq_lens": 40}),
        "paged_sparse_draft_attention": ((qp, kc, kc.flip(0), bt, full(2, 40), qsl,
                                          torch.tensor([[[1, 5, 9], [0, 2, -1]]] * 2, dtype=torch.int32),
                                          full(2, 30), D ** -0.5), {"seq_lens": 40, "tail_start": 30}),
    }


def _call(name, args, kwargs=None):
    """Runs the wrapper; for the in-place block_minmax_update returns the updated buffers."""
    fn = getattr(ops, name)
    if name == "block_minmax_update":
        args = tuple(a.clone() if i < 2 else a for i, a in enumerate(args))
        fn(*args, **(kwargs or {}))
        return args[0], args[1]
    return fn(*args, **(kwargs or {}))


def _assert_same(a, b):
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["kernel", "fallback"])
@pytest.mark.parametrize("name", list(SIGNATURES))
def test_int_per_row_argument_equals_the_tensor(name, impl, monkeypatch):
    if impl == "fallback":  # the plain-PyTorch path taken where no compiled kernel serves the device
        monkeypatch.setattr(ops, "_use_compiled", lambda op, device: False)
    args, ints = _cases()[name]
    want = _call(name, args)
    names = SIGNATURES[name][0]
    # each per-row argument as an int, positionally and by keyword
    for p, v in ints.items():
        i = names.index(p)
        got = _call(name, args[:i] + (v,) + args[i + 1:])
        _assert_same(got, want)
        kw = dict(zip(names, args))
        kw[p] = v
        if name == "block_minmax_update":
            kw["key_min"], kw["key_max"] = kw["key_min"].clone(), kw["key_max"].clone()
            getattr(ops, name)(**kw)
            _assert_same((kw["key_min"], kw["key_max"]), want)
        else:
            _assert_same(getattr(ops, name)(**kw), want)
    # all of them at once
    all_int = tuple(ints.get(n, a) for n, a in zip(names, args))
    _assert_same(_call(name, all_int), want)


def test_int_argument_errors_name_the_argument():
    args, _ = _cases()["block_topk"]
    with pytest.raises(ValueError, match=r"vegas::block_topk: k = 4294967296 does not fit in int32"):
        ops.block_topk(args[0], 2**32, args[2], 8, 1)
    with pytest.raises(RuntimeError, match=r"k\[0\] = -1 must be >= 0"):
        ops.block_topk(args[0], -1, args[2], 8, 1)
    with pytest.raises(TypeError, match=r"vegas::block_topk: k must be a torch.Tensor, got bool"):
        ops.block_topk(args[0], True, args[2], 8, 1)
    with pytest.raises(TypeError, match=r"num_candidates must be a torch.Tensor, got float"):
        ops.block_topk(args[0], 3, 2.5, 8, 1)
    vargs, _ = _cases()["verify_attention"]
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 41 must lie in \[Q, S\]"):
        ops.verify_attention(*vargs[:3], 41, *vargs[4:])


def test_int_argument_traces_with_torch_compile():
    """A per-row int in the public wrapper compiles without graph breaks."""
    args, _ = _cases()["block_topk"]
    torch._dynamo.reset()
    compiled = torch.compile(lambda s, kk: ops.block_topk(s, kk, 30, 8, 1), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(args[0], args[1]), ops.block_topk(*args), rtol=0, atol=0)
