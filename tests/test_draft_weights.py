"""generate(draft_weights=...): the draft forwards' linears read a low-precision copy of the weights
(vegas_ext.draft_weights), the verification the model's own -- so greedy output stays plain greedy
token for token, and sampling keeps the target distribution; the copy is cached beside the model, remade
when a weight changes, and the linears are restored after the call."""
from __future__ import annotations

import pytest
import torch

import vegas_ext
from vegas_ext import draft_weights as dwm, model_state
from vegas_ext.packed_linear import pack_linear_weights

from decode_utils import first_diff, hf_greedy, make_model, make_prompts, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

KW = dict(num_speculative_tokens=4, gamma_policy="fixed", sparse_attn_ratio=0.1, sparse_attn_min_tokens=8, block_size=4)


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("kind", ["fp16", "int8"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])  # qwen2: q/k/v with bias
def test_greedy_equals_plain_greedy(family, kind):
    model = make_model(family)
    ids, mask = make_prompts(model.config.vocab_size, [40, 23, 31])
    ref = hf_greedy(model, ids, mask, 24, eos_token_id=[])
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=24, eos_token_id=[], draft_weights=kind, **KW)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    s = out.stats
    assert s["draft_weights"] == kind and s["num_draft_tokens"] > 0 and s["num_accepted_tokens"] > 0
    n_w = sum(m.weight.numel() for m in _linears(model))
    if kind == "fp16":
        assert s["draft_weights_bytes"] == 2 * n_w and s["draft_weights_format"] == "fp16"
    else:
        n_s = sum(-(-m.in_features // 64) * m.out_features for m in _linears(model))
        n_q = sum(-(-m.out_features // 16) * 16 * -(-m.in_features // 2) * 2 for m in _linears(model))
        assert s["draft_weights_bytes"] == n_q + 4 * n_s  # packed int8 (16-row blocks) + fp32 scales; biases shared
        assert s["draft_weights_format"] == "int8-g64"
    # the wrappers are gone after the call
    assert all("forward" not in m.__dict__ for m in _linears(model))


def test_packed_linears_greedy_equals_plain_greedy():
    model = make_model("llama", seed=3)
    ids, mask = make_prompts(model.config.vocab_size, [50, 50], seed=4)
    ref = hf_greedy(model, ids, mask, 20, eos_token_id=[])
    pack_linear_weights(model, min_rows=1)
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=20, eos_token_id=[], draft_weights="int8", **KW)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    assert out.stats["draft_weights_bytes"] > 0 and out.stats["num_draft_tokens"] > 0


def test_drafts_use_the_copy_and_verification_does_not():
    """With the copy broken on purpose (int8 scales zeroed: every draft linear outputs 0) the drafts
    are garbage and nearly all rejected, yet the output is still plain greedy's: the verification
    never reads the copy, and the draft does."""
    model = make_model("llama", seed=5)
    ids, mask = make_prompts(model.config.vocab_size, [60, 45], seed=6)
    ref = hf_greedy(model, ids, mask, 30, eos_token_id=[])
    good = vegas_ext.generate(model, ids, mask, max_new_tokens=30, eos_token_id=[], draft_weights="int8", **KW)
    dw = dwm.draft_weights_for(model, "int8")
    for c in dw._copies.values():
        c.scales.zero_()
    bad = vegas_ext.generate(model, ids, mask, max_new_tokens=30, eos_token_id=[], draft_weights="int8", **KW)
    assert torch.equal(bad.sequences, ref), first_diff(bad.sequences, ref)
    assert good.stats["draft_acceptance_rate"] > 0.2
    assert bad.stats["draft_acceptance_rate"] < good.stats["draft_acceptance_rate"] / 2


def test_copy_is_cached_and_remade_after_a_weight_edit():
    model = make_model("llama", seed=7)
    ids, mask = make_prompts(model.config.vocab_size, [30], seed=8)
    vegas_ext.generate(model, ids, mask, max_new_tokens=8, eos_token_id=[], draft_weights="fp16", **KW)
    dw = model_state.get(model, "draft_weights")
    lin = model.model.layers[0].mlp.down_proj
    before = dw._copies[id(lin)].weight
    vegas_ext.generate(model, ids, mask, max_new_tokens=8, eos_token_id=[], draft_weights="fp16", **KW)
    assert model_state.get(model, "draft_weights") is dw and dw._copies[id(lin)].weight is before  # reused
    with torch.no_grad():
        lin.weight.mul_(-1.5)  # in place: the version counter moves
    ref = hf_greedy(model, ids, mask, 16, eos_token_id=[])
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=16, eos_token_id=[], draft_weights="fp16", **KW)
    assert torch.equal(out.sequences, ref)
    now = dw._copies[id(lin)].weight
    assert now is not before and torch.equal(now, lin.weight.detach().half())
    # another kind replaces the cached one
    vegas_ext.generate(model, ids, mask, max_new_tokens=4, eos_token_id=[], draft_weights="int8", **KW)
    assert model_state.get(model, "draft_weights").kind == "int8"


def test_plain_decoding_makes_no_copy():
    model = make_model("llama", seed=9)
    ids, mask = make_prompts(model.config.vocab_size, [20], seed=9)
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=6, sparse_attn_algorithm="full", draft_weights="int8")
    assert out.stats["draft_weights_bytes"] == 0 and model_state.get(model, "draft_weights") is None


@pytest.mark.parametrize("bad", ["int4", "bf16", "INT8", True, 8])
def test_bad_values_are_refused(bad):
    model = make_model("llama", seed=1)
    ids, mask = make_prompts(model.config.vocab_size, [10])
    with pytest.raises(ValueError, match="draft_weights"):
        vegas_ext.generate(model, ids, mask, max_new_tokens=4, draft_weights=bad)
    if bad == "int4":
        with pytest.raises(ValueError, match="60-61 %"):
            vegas_ext.generate(model, ids, mask, max_new_tokens=4, draft_weights=bad)


def test_quantize_int8_bad_input():
    with pytest.raises(ValueError, match="weight"):
        dwm.quantize_int8(torch.zeros(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="group_size"):
        dwm.quantize_int8(torch.zeros(3, 4), 0)


def test_sampling_with_int8_drafts_matches_target_distribution():
    """Speculative sampling with q from the int8 draft: the emitted tokens follow the exact joint
    distribution of the fp32 target (chi-square over 5000 seeded rows, as test_spec_sampling)."""
    from test_spec_sampling import K_NEW, P_MIN, PROMPT, V_SMALL, _exact_joint, _small_model, chi2_pvalue

    model = _small_model()
    prompt = torch.randint(0, V_SMALL, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    warpers = vegas_ext.decode.make_warpers(1.0, 0, 1.0)
    joint = _exact_joint(model, prompt, warpers)
    out = vegas_ext.generate(model, prompt.expand(5000, -1), max_new_tokens=K_NEW, num_speculative_tokens=3,
                             gamma_policy="fixed",
                             sparse_attn_ratio=0.01, sparse_attn_min_tokens=0, block_size=4, do_sample=True,
                             eos_token_id=[], generator=torch.Generator().manual_seed(1), draft_weights="int8")
    assert 0.05 < out.stats["draft_acceptance_rate"] < 0.95
    new = out.sequences[:, PROMPT:]
    counts = torch.bincount((new * torch.tensor([V_SMALL**2, V_SMALL, 1])).sum(1), minlength=V_SMALL**K_NEW)
    pv = chi2_pvalue(counts, joint)
    assert pv > P_MIN, f"chi-square p-value {pv:.2e}"


# ---------------------------------------------------------------- the CUDA kinds (issue 47)

_CUDA = torch.cuda.is_available()
_SM89 = _CUDA and dwm.fp8_unsupported("cuda") is None
needs_cuda = pytest.mark.skipif(not _CUDA, reason="needs a CUDA device (bench/gpu_check.sh runs it)")
needs_sm89 = pytest.mark.skipif(not _SM89, reason="needs a CUDA GPU of compute capability >= 8.9 (fp8)")


def _cuda_bytes(model, kind):
    """Bytes of the CUDA copies of ``kind`` for an fp32 model (biases shared except under fp16)."""
    lins = _linears(model)
    n_w = sum(m.weight.numel() for m in lins)
    if kind == "fp16":
        return 2 * (n_w + sum(m.bias.numel() for m in lins if m.bias is not None))
    return n_w + 4 * sum(m.out_features for m in lins)  # 1-byte weights + one fp32 scale per row


@pytest.mark.parametrize("kind,tol", [("fp16", 2.0**-11), ("int8", None), ("fp8", 2.0**-4)])
def test_quantization_round_trip_bounds(kind, tol):
    """Each kind's copy dequantizes to within its rounding bound: fp16 half an ulp (2**-11 relative),
    int8 half a step of its scale, fp8 e4m3 2**-4 relative (3 mantissa bits) above the smallest
    normal and 2**-10 of the row's scale below it; zero rows stay zero."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 200, generator=g) * torch.logspace(-4, 1, 200)  # columns over 5 decades
    w[3] = 0
    if kind == "fp16":
        q, _ = dwm.weight_copy(w, "fp16")
        assert q.dtype == torch.float16 and ((q.float() - w).abs() <= tol * w.abs() + 2.0**-25).all()
    elif kind == "int8":
        for gs in (dwm.INT8_GROUP_SIZE, w.shape[1]):  # CPU groups of 64; CUDA one group per row
            q, s = dwm.quantize_int8(w, gs)
            deq = q.float() * s.repeat_interleave(gs, 1)[:, : w.shape[1]]
            step = s.repeat_interleave(gs, 1)[:, : w.shape[1]]
            assert q.dtype == torch.int8 and q.abs().max() <= 127
            assert ((deq - w).abs() <= step / 2 * (1 + 1e-5)).all() and (deq[3] == 0).all()
    else:
        q, s = dwm.quantize_fp8(w)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (48,) and s[3] == 0
        deq = q.float() * s[:, None]
        assert (q.float().abs().amax(1)[s > 0] == dwm.FP8_MAX).all()  # the row's max maps onto 448
        bound = tol * w.abs() + 2.0**-10 * s[:, None]
        assert ((deq - w).abs() <= bound * (1 + 1e-5)).all() and (deq[3] == 0).all()
        xq, xs = dwm.quantize_fp8_rows(w[:5])
        assert ((xq.float() * xs - w[:5]).abs() <= tol * w[:5].abs() + 2.0**-10 * xs).all()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_cuda_kernels_numerics_on_cpu(kind):
    """The ops the CUDA copies call (torch._weight_int8pack_mm, torch._scaled_mm row-wise) also run
    on CPU: their result is the dequantized product, within the activation rounding for fp8."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(192, 576, generator=g) * 0.05, torch.randn(7, 576, generator=g)
    if kind == "int8":
        q, s = dwm.quantize_int8(w, w.shape[1])
        y = dwm.int8_channel_linear(x, q, s.view(-1))
        ref = x @ (q.float() * s).T
        assert y.dtype == torch.float32 and torch.allclose(y, ref, atol=1e-4, rtol=1e-5)
    else:
        q, s = dwm.quantize_fp8(w)
        y = dwm.fp8_linear(x, q, s)
        xq, xs = dwm.quantize_fp8_rows(x)
        ref = (xq.float() * xs) @ (q.float() * s[:, None]).T
        assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), ref, atol=1e-2 * ref.abs().max(), rtol=2**-7)
        assert (y.float() - x @ w.T).abs().max() < 0.1 * (x @ w.T).abs().max()  # fp8 on both sides: ~4 %


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_cuda_code_path_greedy_equals_plain_greedy_on_cpu(kind, monkeypatch):
    """The CUDA copies' code path (copy layout, reshapes, bias, format, bytes), run on CPU through
    the same ops' CPU kernels by forcing the copy mode: greedy stays plain greedy, drafts accepted."""
    monkeypatch.setattr(dwm, "_copy_mode", lambda w, k: k)
    monkeypatch.setattr(dwm, "fp8_unsupported", lambda device: None)
    monkeypatch.setattr(vegas_ext.decode, "lean_draft", lambda *a, **k: None)  # the lean forward is CPU-op only
    model = make_model("qwen2", seed=12)  # q/k/v with bias
    ids, mask = make_prompts(model.config.vocab_size, [40, 25], seed=13)
    ref = hf_greedy(model, ids, mask, 20, eos_token_id=[])
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=20, eos_token_id=[], draft_weights=kind, **KW)
    dw = model_state.get(model, "draft_weights")
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    assert out.stats["num_accepted_tokens"] > 0
    assert out.stats["draft_weights_format"] == {"int8": "int8-per-channel", "fp8": "fp8-e4m3-per-channel"}[kind]
    assert out.stats["draft_weights_bytes"] == _cuda_bytes(model, kind)
    assert all(c.mode == kind for c in dw._copies.values()) and not dw._fused  # never fused into CPU-op groups


@pytest.mark.parametrize("bad", ["FP8", "fp8 ", "float8", "e4m3"])
def test_bad_fp8_spellings_are_refused(bad):
    model = make_model("llama", seed=1)
    ids, mask = make_prompts(model.config.vocab_size, [10])
    with pytest.raises(ValueError, match="draft_weights must be one of"):
        vegas_ext.generate(model, ids, mask, max_new_tokens=4, draft_weights=bad)


@pytest.mark.skipif(_SM89, reason="a GPU of compute capability >= 8.9 runs fp8")
def test_fp8_is_refused_where_unsupported():
    """CPU (and pre-sm89 GPUs): fp8 is refused with the argument, the need and the alternatives,
    before any copy is made; the vLLM copies (CPU) refuse it too."""
    model = make_model("llama", seed=2)
    ids, mask = make_prompts(model.config.vocab_size, [30])
    with pytest.raises(ValueError, match=r"draft_weights='fp8' needs .*compute capability >= 8\.9.*on cpu.*'int8'"):
        vegas_ext.generate(model, ids, mask, max_new_tokens=8, draft_weights="fp8", **KW)
    assert model_state.get(model, "draft_weights") is None
    with pytest.raises(ValueError, match="draft_weights='fp8'"):
        dwm.draft_weights_for(model, "fp8")
    with pytest.raises(ValueError, match="draft_weights='fp8'"):
        dwm.weight_copy(model.lm_head.weight, "fp8")
    # plain decoding makes no copy, so nothing to refuse
    out = vegas_ext.generate(model, ids, max_new_tokens=4, sparse_attn_algorithm="full", draft_weights="fp8")
    assert out.stats["draft_weights_bytes"] == 0
    if _CUDA:  # a pre-sm89 GPU names itself
        with pytest.raises(ValueError, match="compute capability"):
            vegas_ext.generate(model.cuda(), ids.cuda(), max_new_tokens=8, draft_weights="fp8", **KW)


@needs_cuda
@pytest.mark.parametrize("kind", ["fp16", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_greedy_equals_plain_greedy(kind, dtype):
    """On CUDA: fp16 is a float16 copy (none for a 16-bit model), int8 per-channel through
    torch._weight_int8pack_mm, fp8 through torch._scaled_mm; greedy stays plain greedy."""
    if kind == "fp8" and not _SM89:
        pytest.skip("needs compute capability >= 8.9")
    model = make_model("qwen2", seed=12).to("cuda", dtype)
    ids, mask = make_prompts(model.config.vocab_size, [40, 25], seed=13)
    ids, mask = ids.cuda(), mask.cuda()
    ref = hf_greedy(model, ids, mask, 20, eos_token_id=[])
    out = vegas_ext.generate(model, ids, mask, max_new_tokens=20, eos_token_id=[], draft_weights=kind, **KW)
    assert torch.equal(out.sequences, ref), first_diff(out.sequences, ref)
    s = out.stats
    if kind == "fp16" and dtype == torch.bfloat16:
        assert s["draft_weights_bytes"] == 0  # no copy: float16 is no smaller
        return
    fmt = {"fp16": "fp16", "int8": "int8-per-channel", "fp8": "fp8-e4m3-per-channel"}[kind]
    assert s["draft_weights_format"] == fmt and s["num_accepted_tokens"] > 0
    if dtype == torch.float32:
        assert s["draft_weights_bytes"] == _cuda_bytes(model, kind)


@needs_cuda
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_cuda_draft_linear_matches_reference(kind):
    """The CUDA draft linear against the dequantized product on the same device (bf16 input)."""
    if kind == "fp8" and not _SM89:
        pytest.skip("needs compute capability >= 8.9")
    lin = torch.nn.Linear(576, 1536, bias=True).cuda().bfloat16()
    dw = dwm.DraftWeights(torch.nn.Sequential(lin), kind)
    c = dw.copy_of(lin)
    x = torch.randn(3, 5, 576, device="cuda", dtype=torch.bfloat16)
    y = dw.linear(lin, x, None)
    if kind == "int8":
        ref = x.float() @ (c.weight.float() * c.scales[:, None]).T
    else:
        xq, xs = dwm.quantize_fp8_rows(x.reshape(-1, 576))
        ref = ((xq.float() * xs) @ (c.weight.float() * c.scales[:, None]).T).view(3, 5, -1)
    ref = ref + lin.bias.float()
    assert y.shape == (3, 5, 1536) and y.dtype == torch.bfloat16
    assert (y.float() - ref).abs().max() <= 2e-2 * ref.abs().max()


@needs_cuda
def test_cuda_draft_linear_costs():
    """Times one draft linear per kind at Llama-3-8B's shapes (bf16, 1-32 rows) against the model's
    own bf16 F.linear and reports them as a warning (pytest's summary); asserts only that fp8, which
    reads half the bytes through cuBLASLt / CUTLASS, is not slower than bf16 at the largest shape."""
    import warnings

    def ms(fn, reps=50):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / reps

    lines, worst = [], {}
    for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)):
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        kinds = ["int8"] + (["fp8"] if _SM89 else [])
        copies = {kd: dwm.DraftWeights(torch.nn.Sequential(lin), kd) for kd in kinds}
        for rows in (1, 8, 32):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            base = ms(lambda x=x, w=lin.weight: torch.nn.functional.linear(x, w))
            row = [f"{n}x{k} rows {rows}: bf16 {base * 1e3:.1f} us ({2 * n * k / base / 1e6:.0f} GB/s)"]
            for kd, dw in copies.items():
                t = ms(lambda x=x, dw=dw, lin=lin: dw.linear(lin, x, None))
                row.append(f"{kd} {t * 1e3:.1f} us ({t / base:.2f}x bf16, {n * k / t / 1e6:.0f} GB/s)")
                worst[(kd, n, k, rows)] = t / base
            lines.append("; ".join(row))
        del copies, lin  # free before the next shape (the lm_head shape is 1 GB in bf16)
    warnings.warn("draft linear costs (" + torch.cuda.get_device_name() + "):\n" + "\n".join(lines), stacklevel=1)
    if _SM89:
        assert worst[("fp8", 128256, 4096, 8)] <= 1.0, "\n".join(lines)


def test_draft_weights_leave_packed_linears_packed():
    """Regression: the draft copies' freshness check read ``data_ptr()``, which materializes the
    copy-on-write storage of a packed weight, so every packed linear repacked every iteration."""
    from vegas_ext.packed_linear import PackedLinear, can_pack, pack_linear_weights

    m = make_model("llama")
    if not can_pack(m.lm_head):
        pytest.skip("this PyTorch cannot pack linears (no oneDNN)")
    pack_linear_weights(m, min_rows=1)
    ids, mask = make_prompts(m.config.vocab_size, [60, 45])
    kw = dict(max_new_tokens=16, num_speculative_tokens=3, gamma_policy="fixed", draft_weights="int8",
              eos_token_id=[], pad_token_id=0)
    vegas_ext.generate(m, ids, mask, **kw)
    packed = [mod for mod in m.modules() if isinstance(mod, PackedLinear)]
    before = sum(mod.repacks for mod in packed)
    out = vegas_ext.generate(m, ids, mask, **kw)
    assert sum(mod.repacks for mod in packed) == before and out.stats["num_iterations"] > 1
