"""torch.library.opcheck (schema, fake kernel, dispatch) and torch.compile(fullgraph=True)."""
import math

import pytest
import torch

from vegas_ext import ops  # noqa: F401  (registers fakes)

from op_utils import make_inputs, random_selection


def _verify_args(dtype=torch.float32):
    B, Q, Hq, Hkv, D, S, bs = 2, 3, 9, 3, 64, 70, 16
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, dtype)
    return (q, k, v, lens, bs, D ** -0.5, torch.tensor([1.0, 0.0, 1.0]))


def _draft_args():
    B, Q, Hq, Hkv, D, S, bs = 2, 1, 9, 3, 64, 70, 16
    q, k, v, lens = make_inputs(B, Q, Hq, Hkv, D, S, torch.float32)
    idx = random_selection(B, Hkv, math.ceil(S / bs), 3)
    tail = (lens - Q - 2).clamp(min=0).int()
    return (q, k, v, idx, tail, lens, bs, D ** -0.5)


def _topk_args():
    return (torch.rand(3, 4, 50), torch.tensor([3, 9, 0], dtype=torch.int32),
            torch.tensor([50, 20, 7], dtype=torch.int32), 8, 1)


OPS = {
    "verify_attention": (torch.ops.vegas.verify_attention.default, _verify_args),
    "sparse_draft_attention": (torch.ops.vegas.sparse_draft_attention.default, _draft_args),
    "block_topk": (torch.ops.vegas.block_topk.default, _topk_args),
}


@pytest.mark.parametrize("name", list(OPS))
def test_opcheck(name):
    op, make = OPS[name]
    torch.library.opcheck(op, make())


@pytest.mark.parametrize("name", list(OPS))
def test_compile_fullgraph(name):
    op, make = OPS[name]
    args = make()
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True, backend="aot_eager")
    got, want = compiled(*args), op(*args)
    if isinstance(want, tuple):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    else:
        torch.testing.assert_close(got, want)


def test_compile_typed_wrapper_fullgraph():
    """The public wrapper (device dispatch included) traces without graph breaks."""
    args = _verify_args()
    torch._dynamo.reset()
    compiled = torch.compile(ops.verify_attention, fullgraph=True, backend="aot_eager")
    for g, w in zip(compiled(*args), ops.verify_attention(*args)):
        torch.testing.assert_close(g, w)
