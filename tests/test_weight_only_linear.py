"""vegas::weight_only_linear (the draft forwards' low-precision linears): the CPU kernel against
the plain-PyTorch reference on odd shapes, every ISA path, fp16, int8 and packed int8 weights, with
and without bias; the int8 quantizer and packer; opcheck; bad input naming the argument."""
import pytest
import torch

from vegas_ext import ops, reference
from vegas_ext.draft_weights import INT8_GROUP_SIZE, pack_int8, quantize_int8

from op_utils import run_with_isa

ERR = (RuntimeError, ValueError)
# (M, N, K): 1-16 rows, K not a multiple of 64 or 16 (tails), N odd and not a multiple of 4, K = 0
SHAPES = [(1, 1, 1), (1, 7, 100), (2, 33, 64), (3, 5, 13), (4, 576, 576), (5, 9, 200), (7, 130, 65),
          (8, 31, 1536), (13, 3, 47), (16, 64, 576), (1, 4, 0), (17, 6, 130)]


def _case(M, N, K, fmt, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.05
    b = torch.randn(N, generator=g) if bias else None
    if fmt == "fp16":
        return x, w.half(), None, b
    q, s = quantize_int8(w, INT8_GROUP_SIZE)
    return x, q, s, b


def _bound(x, weight, scales, gs=INT8_GROUP_SIZE):
    """fp32 summation error bound of a K-term dot product per output: K * eps * sum |x||w|."""
    wd = reference.weight_only_linear(torch.eye(weight.shape[1]), weight, scales, None, gs).T.abs()  # [N, K]
    return (x.abs() @ wd.T) * (weight.shape[1] + 1) * 1.2e-7 + 1e-6


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("fmt", ["fp16", "int8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}N{}K{}".format(*s))
def test_matches_reference(shape, fmt, bias):
    x, w, s, b = _case(*shape, fmt, bias)
    y = ops.weight_only_linear(x, w, s, b)
    # exact products of the dequantized weights, summed in float64
    exact = torch.nn.functional.linear(x.double(), reference.weight_only_linear(
        torch.eye(w.shape[1]), w, s).T.double(), None if b is None else b.double())
    assert y.shape == (shape[0], shape[1]) and y.dtype == torch.float32
    assert ((y.double() - exact).abs() <= _bound(x, w, s).double()).all()


def _rounding_bound(x, weight, scales, gs=INT8_GROUP_SIZE):
    """What the packed path's rounding of x (half a step of max |x| / 32767 per row and group) adds:
    sum_k |W[n, k]| * step(k) / 2 per output, plus the fp32 bound."""
    K = x.shape[-1]
    step = _steps(x, gs)
    wd = reference.weight_only_linear(torch.eye(K), weight, scales, None, gs).T.abs()  # [N, K]
    return (step / 2) @ wd.T * 1.001 + _bound(x, weight, scales, gs)


def _steps(x, gs=INT8_GROUP_SIZE):
    """[M, K]: the int16 step of each x (max |x| / 32767 of its row's group)."""
    M, K = x.shape
    ng = -(-K // gs)
    step = torch.nn.functional.pad(x.abs(), (0, ng * gs - K)).view(M, ng, gs).amax(-1) / 32767
    return step.repeat_interleave(gs, 1)[:, :K]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}N{}K{}".format(*s))
def test_packed_matches_reference(shape, bias):
    x, q, s, b = _case(*shape, "int8", bias)
    y = ops.weight_only_linear(x, pack_int8(q), s, b)
    exact = torch.nn.functional.linear(x.double(), reference.weight_only_linear(
        torch.eye(q.shape[1]), q, s).T.double(), None if b is None else b.double())
    assert y.shape == (shape[0], shape[1]) and y.dtype == torch.float32
    assert ((y.double() - exact).abs() <= _rounding_bound(x, q, s).double()).all()
    # the rounding is what it says: the reference (x on its int16 grid) up to summation order, and
    # so is the row-major kernel on that grid
    st = _steps(x)
    xr = torch.where(st > 0, torch.round(x / torch.where(st > 0, st, 1)) * st, 0)
    assert ((y - reference.weight_only_linear(x, pack_int8(q), s, b)).abs() <= 2 * _bound(xr, q, s)).all()
    assert ((y - ops.weight_only_linear(xr, q, s, b)).abs() <= 2 * _bound(xr, q, s)).all()


@pytest.mark.parametrize("gs", [16, 32, 512])
def test_packed_group_sizes(gs):
    """Groups of 16 and 32 pairs and of 256 (flushed in int32 chunks of 128 pairs: no overflow at
    full-scale weights and x)."""
    g = torch.Generator().manual_seed(gs)
    x, w = torch.randn(5, 1100, generator=g), torch.randn(37, 1100, generator=g)
    x[:, :600] = x[:, :600].sign() * 3.0  # every x at its group's max: int16 +-32767
    w[:, :600] = w[:, :600].sign()  # every weight at +-127
    q, s = quantize_int8(w, gs)
    y = ops.weight_only_linear(x, pack_int8(q), s, None, gs)
    exact = reference.weight_only_linear(x.double(), q, s.double(), None, gs)
    assert ((y.double() - exact).abs() <= _rounding_bound(x, q, s, gs).double()).all()


@pytest.mark.parametrize("isa", ["default", "base", "avx2"])
def test_packed_nonfinite_and_tiny_x(isa, tmp_path):
    """An inf or NaN in x makes its row NaN; a group of denormal-sized x counts as zero (within
    the bound); on every path (the scalar ones forced in a fresh process)."""
    x, q, s, b = _case(4, 21, 130, "int8", True, seed=7)
    x[1, 70], x[2, 5] = float("inf"), float("nan")
    x[3, 64:128] = 1e-40
    torch.save((x, q, s, b), tmp_path / "case.pt")
    code = """
import torch
from vegas_ext import ops
from vegas_ext.draft_weights import pack_int8
x, q, s, b = torch.load({path!r})
torch.save(ops.weight_only_linear(x, pack_int8(q), s, b), {out!r})
print("ok")
"""
    fields = dict(path=str(tmp_path / "case.pt"), out=str(tmp_path / "y.pt"))
    if isa == "default":
        exec(code.format(**fields))
    else:
        run_with_isa(code, isa, **fields)
    y = torch.load(tmp_path / "y.pt")
    assert torch.isnan(y[1:3]).all() and torch.isfinite(y[[0, 3]]).all()
    ref = reference.weight_only_linear(x, pack_int8(q), s, b)
    assert torch.isnan(ref[1:3]).all() and torch.isfinite(ref[[0, 3]]).all()
    rows = [0, 3]
    exact = reference.weight_only_linear(x[rows].double(), q, s.double(), b.double())
    assert ((y[rows].double() - exact).abs() <= _rounding_bound(x[rows], q, s).double() + 1e-30).all()


def test_pack_int8_layout():
    q = torch.arange(-60, 65, dtype=torch.int8)[:17 * 7].view(17, 7)
    p = pack_int8(q)
    assert p.shape == (2, 4, 16, 2) and p.dtype == torch.int8 and p.is_contiguous()
    assert p[0, 1, 3, 0] == q[3, 2] and p[0, 1, 3, 1] == q[3, 3] and p[1, 2, 0, 1] == q[16, 5]
    assert p[1, :, 1:].abs().sum() == 0 and p[:, 3, :, 1].abs().sum() == 0  # padding: rows past 17, column 7
    with pytest.raises(ValueError, match="q: expected a 2-D int8"):
        pack_int8(q.float())


def test_leading_dims_and_strided_x():
    x, w, s, b = _case(6, 37, 130, "int8", True, seed=3)
    x3 = x.view(2, 3, 130)
    y = ops.weight_only_linear(x3, w, s, b)
    assert y.shape == (2, 3, 37)
    torch.testing.assert_close(y, reference.weight_only_linear(x3, w, s, b), atol=1e-5, rtol=1e-5)
    xt = torch.randn(130, 6).T  # rows not contiguous
    torch.testing.assert_close(ops.weight_only_linear(xt, w, s, b), reference.weight_only_linear(xt, w, s, b),
                               atol=1e-5, rtol=1e-5)


def test_group_size_32_and_128():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 200, generator=g), torch.randn(11, 200, generator=g)
    for gs in (16, 32, 128):
        q, s = quantize_int8(w, gs)
        torch.testing.assert_close(ops.weight_only_linear(x, q, s, None, gs),
                                   reference.weight_only_linear(x, q, s, None, gs), atol=1e-4, rtol=1e-5)


def test_quantize_int8_values():
    w = torch.tensor([[1.0, -2.0, 0.5] + [0.0] * 61 + [4.0], [0.0] * 65])
    q, s = quantize_int8(w, 64)
    assert q.dtype == torch.int8 and q.shape == (2, 65) and s.shape == (2, 2)
    torch.testing.assert_close(s, torch.tensor([[2.0 / 127, 4.0 / 127], [0.0, 0.0]]))
    assert q[0, :3].tolist() == [64, -127, 32] and q[0, 64].item() == 127 and q[1].abs().sum().item() == 0
    # the round trip is within half a step of every weight
    g = torch.Generator().manual_seed(2)
    w = torch.randn(9, 150, generator=g)
    q, s = quantize_int8(w, 64)
    back = reference.weight_only_linear(torch.eye(150), q, s).T
    assert ((back - w).abs() <= s.repeat_interleave(64, 1)[:, :150] * 0.5 + 1e-7).all()


@pytest.mark.parametrize("isa", ["base", "avx2", "avx512"])
def test_packed_isa_paths_give_the_same_bits(isa, tmp_path):
    """Integer sums are exact and every path scales a group the same way: each ISA the processor
    has (here: forced in a fresh process) gives the default path's bits."""
    cases = [_case(M, N, K, "int8", True, seed=M) for M, N, K in [(1, 7, 100), (3, 9, 13), (9, 33, 130), (16, 5, 576)]]
    torch.save(cases, tmp_path / "cases.pt")
    run_with_isa("""
import torch
from vegas_ext import ops
from vegas_ext.draft_weights import pack_int8
cases = torch.load({path!r})
torch.save([ops.weight_only_linear(x, pack_int8(q), s, b) for x, q, s, b in cases], {out!r})
print("ok")
""", isa, path=str(tmp_path / "cases.pt"), out=str(tmp_path / "out.pt"))
    for (x, q, s, b), y in zip(cases, torch.load(tmp_path / "out.pt")):
        assert torch.equal(y, ops.weight_only_linear(x, pack_int8(q), s, b))


@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_narrower_isa_paths(isa):
    run_with_isa("""
import sys; sys.path.insert(0, {tests!r})
import torch
from vegas_ext import ops, reference
from vegas_ext.draft_weights import quantize_int8
for (M, N, K) in [(1, 7, 100), (3, 9, 13), (5, 33, 130), (16, 5, 576), (2, 4, 8)]:
    g = torch.Generator().manual_seed(M)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    q, s = quantize_int8(w)
    for wt, sc in ((w.half(), None), (q, s)):
        torch.testing.assert_close(ops.weight_only_linear(x, wt, sc, b), reference.weight_only_linear(x, wt, sc, b),
                                   atol=2e-4, rtol=1e-5)
print("ok")
""", isa)


@pytest.mark.parametrize("packed", [False, True], ids=["rowmajor", "packed"])
def test_threads_split_columns_same_result(packed):
    x, w, s, b = _case(4, 2051, 576, "int8", True, seed=4)
    w = pack_int8(w) if packed else w
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.weight_only_linear(x, w, s, b)
        torch.set_num_threads(2)
        two = ops.weight_only_linear(x, w, s, b)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)  # each column is one thread's dot product, whatever the split


@pytest.mark.parametrize("fmt", ["fp16", "int8", "packed"])
def test_opcheck(fmt):
    x, w, s, b = _case(3, 10, 70, "int8" if fmt == "packed" else fmt, True)
    w = pack_int8(w) if fmt == "packed" else w
    torch.library.opcheck(torch.ops.vegas.weight_only_linear.default, (x, w, s, b, 64))


@pytest.mark.parametrize("packed", [False, True], ids=["rowmajor", "packed"])
def test_fallback_matches_kernel(packed):
    """The checked reference path (used where no compiled kernel serves the device)."""
    x, w, s, b = _case(5, 17, 90, "int8", True, seed=6)
    w = pack_int8(w) if packed else w
    torch.testing.assert_close(ops._wol_fallback(x, w, s, b), torch.ops.vegas.weight_only_linear(x, w, s, b),
                               atol=1e-5, rtol=1e-5)


def test_no_grad_through_the_op():
    x, w, s, b = _case(2, 5, 32, "fp16", False)
    with pytest.raises(RuntimeError, match="no backward"):
        ops.weight_only_linear(x.requires_grad_(), w).sum().backward()


@pytest.mark.parametrize("fn", [torch.ops.vegas.weight_only_linear, ops._wol_fallback], ids=["kernel", "fallback"])
def test_bad_input(fn):
    x, q, s, b = _case(2, 6, 70, "int8", True)
    w16 = q.half()
    with pytest.raises(ERR, match="x must have shape"):
        fn(x[:, :69], q, s, b)
    with pytest.raises(ERR, match="x must be float32"):
        fn(x.double(), q, s, b)
    with pytest.raises(ERR, match="weight must be float16 or int8"):
        fn(x, q.float(), s, b)
    with pytest.raises(ERR, match="weight must be 2-D"):
        fn(x, q[None], s, b)
    with pytest.raises(ERR, match="scales .* required"):
        fn(x, q, None, b)
    with pytest.raises(ERR, match="scales must have shape"):
        fn(x, q, s[:, :1].contiguous(), b)
    with pytest.raises(ERR, match="scales must be float32"):
        fn(x, q, s.double(), b)
    with pytest.raises(ERR, match="scales must be None"):
        fn(x, w16, s, b)
    with pytest.raises(ERR, match="bias"):
        fn(x, q, s, b[:5])
    with pytest.raises(ERR, match="bias"):
        fn(x, q, s, b.half())
    with pytest.raises(ERR, match="group_size"):
        fn(x, q, s, b, 24)
    with pytest.raises(ERR, match="group_size"):
        fn(x, q, s, b, 0)
    if fn is not ops._wol_fallback:
        with pytest.raises(ERR, match="weight must be contiguous"):
            fn(x, torch.cat([q, q], 1)[:, ::2], s, b)
    p = pack_int8(q)
    with pytest.raises(ERR, match=r"packed int8 weight must have shape .*\[1, 35, 16, 2\]"):
        fn(x, p[:, :34].contiguous(), s, b)
    with pytest.raises(ERR, match="packed int8 weight must have shape"):
        fn(x, p, torch.cat([s, s, s]), None)  # N = 18: two blocks of 16 rows
    with pytest.raises(ERR, match="packed .* must be int8"):
        fn(x, p.half(), s, b)
    with pytest.raises(ERR, match="packed int8 weight needs scales"):
        fn(x, p, None, b)
    with pytest.raises(ERR, match="weight must be 2-D .* or packed"):
        fn(x, p[0], s, b)
