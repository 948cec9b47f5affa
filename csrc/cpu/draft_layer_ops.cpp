// CPU kernels of the lean draft forward's per-layer ops (python/vegas_ext/draft_forward.py).
//
// vegas::rope_kv_write: RoPE on a layer's new queries and keys and the write of
// the rotated keys and the values into the KV cache, in one call. A draft step of a small model
// otherwise spends ~20 tensor ops per layer on this (HF's rotate_half rotation of q and k, two
// indexed writes, a contiguous copy of q): ~50 us of dispatch for a few KB of data
// (python/vegas_ext/draft_forward.py, issue 33).
//
// Rotation (transformers' apply_rotary_pos_emb, "rotate_half" layout), per head vector x of D:
//   out[j] = x[j] * cos[j] + (j < D/2 ? -x[j + D/2] : x[j - D/2]) * sin[j]
// with the two products rounded before the sum (no FMA), as the tensor ops round them.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "checks.h"

namespace vegas {
namespace cpu {
namespace {

// the products rounded separately, as x * cos + rotate_half(x) * sin rounds them in PyTorch
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rotate(const T* x, const T* c, const T* s, T* out, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t j = 0; j < h; ++j) {
    const float a = static_cast<float>(static_cast<T>(static_cast<float>(x[j]) * static_cast<float>(c[j])));
    const float b = static_cast<float>(static_cast<T>(-static_cast<float>(x[j + h]) * static_cast<float>(s[j])));
    out[j] = static_cast<T>(a + b);
  }
  for (int64_t j = h; j < D; ++j) {
    const float a = static_cast<float>(static_cast<T>(static_cast<float>(x[j]) * static_cast<float>(c[j])));
    const float b = static_cast<float>(static_cast<T>(static_cast<float>(x[j - h]) * static_cast<float>(s[j])));
    out[j] = static_cast<T>(a + b);
  }
}
#pragma GCC pop_options

void check_heads(const char* op, const at::Tensor& t, const char* name, int64_t B, int64_t Q,
                 int64_t D, const at::Tensor& q) {
  TORCH_CHECK(t.dim() == 4 && t.size(0) == B && t.size(1) == Q && t.size(3) == D, op, ": ", name,
              " must have shape [B, Q, H, D] = [", B, ", ", Q, ", H, ", D, "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), op, ": ", name, " dtype (", t.scalar_type(),
              ") must equal q dtype (", q.scalar_type(), ")");
  TORCH_CHECK(t.stride(3) == 1, op, ": ", name, " must be contiguous in head_dim (stride(-1) == 1)");
  check_same_device(op, q, "q", t, name);
}

at::Tensor rope_kv_write_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                             at::Tensor& v_cache, const at::Tensor& write_pos) {
  const char* op = "vegas::rope_kv_write";
  TORCH_CHECK(q.dim() == 4, op, ": q must be 4-D [B, Q, H_q, D], got shape ", q.sizes());
  TORCH_CHECK(is_attn_dtype(q.scalar_type()), op, ": q must be float32, bfloat16 or float16, got ",
              q.scalar_type());
  const int64_t B = q.size(0), Q = q.size(1), Hq = q.size(2), D = q.size(3);
  TORCH_CHECK(D > 0 && D % 2 == 0, op, ": head_dim D must be even and positive, got ", D);
  TORCH_CHECK(q.stride(3) == 1, op, ": q must be contiguous in head_dim (stride(-1) == 1)");
  check_heads(op, k, "k", B, Q, D, q);
  check_heads(op, v, "v", B, Q, D, q);
  const int64_t Hkv = k.size(2);
  TORCH_CHECK(v.size(2) == Hkv, op, ": v must have the heads of k (", Hkv, "), got ", v.size(2));
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{cos, "cos"}, {sin, "sin"}}) {
    TORCH_CHECK(t.dim() == 3 && t.size(0) == B && t.size(1) == Q && t.size(2) == D, op, ": ", name,
                " must have shape [B, Q, D] = [", B, ", ", Q, ", ", D, "], got ", t.sizes());
    TORCH_CHECK(t.scalar_type() == q.scalar_type(), op, ": ", name, " dtype (", t.scalar_type(),
                ") must equal q dtype (", q.scalar_type(), ")");
    TORCH_CHECK(t.stride(2) == 1, op, ": ", name, " must be contiguous in its last dimension");
    check_same_device(op, q, "q", t, name);
  }
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{k_cache, "k_cache"}, {v_cache, "v_cache"}}) {
    TORCH_CHECK(t.dim() == 4 && t.size(0) == B && t.size(1) == Hkv && t.size(3) == D, op, ": ", name,
                " must have shape [B, H_kv, S, D] = [", B, ", ", Hkv, ", S, ", D, "], got ", t.sizes());
    TORCH_CHECK(t.scalar_type() == q.scalar_type(), op, ": ", name, " dtype (", t.scalar_type(),
                ") must equal q dtype (", q.scalar_type(), ")");
    TORCH_CHECK(t.stride(3) == 1, op, ": ", name, " must be contiguous in head_dim (stride(-1) == 1)");
    check_same_device(op, q, "q", t, name);
  }
  TORCH_CHECK(v_cache.size(2) == k_cache.size(2), op, ": v_cache must have the length of k_cache (",
              k_cache.size(2), "), got ", v_cache.size(2));
  const int64_t S = k_cache.size(2);
  TORCH_CHECK(write_pos.dim() == 2 && write_pos.size(0) == B && write_pos.size(1) == Q, op,
              ": write_pos must have shape [B, Q] = [", B, ", ", Q, "], got ", write_pos.sizes());
  TORCH_CHECK(write_pos.scalar_type() == at::kLong, op, ": write_pos must be int64, got ",
              write_pos.scalar_type());
  check_same_device(op, q, "q", write_pos, "write_pos");
  const at::Tensor wp = write_pos.contiguous();
  const int64_t* pos = wp.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * Q; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < S, op, ": write_pos[", i / Q, ", ", i % Q, "] = ", pos[i],
                " must lie in [0, S) = [0, ", S, ")");

  at::Tensor out = at::empty({B, Q, Hq, D}, q.options());
  if (B * Q == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rope_kv_write", [&] {
    const scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    const scalar_t *cp = cos.data_ptr<scalar_t>(), *sp = sin.data_ptr<scalar_t>();
    scalar_t *kc = k_cache.data_ptr<scalar_t>(), *vc = v_cache.data_ptr<scalar_t>(), *op_ = out.data_ptr<scalar_t>();
    // rows (b, t) are independent: threads only for prefill-sized calls
    at::parallel_for(0, B * Q, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / Q, t = r % Q, p = pos[r];
        const scalar_t* c = cp + b * cos.stride(0) + t * cos.stride(1);
        const scalar_t* s = sp + b * sin.stride(0) + t * sin.stride(1);
        for (int64_t h = 0; h < Hq; ++h)
          rotate(qp + b * q.stride(0) + t * q.stride(1) + h * q.stride(2), c, s, op_ + ((r * Hq) + h) * D, D);
        for (int64_t h = 0; h < Hkv; ++h) {
          rotate(kp + b * k.stride(0) + t * k.stride(1) + h * k.stride(2), c, s,
                 kc + b * k_cache.stride(0) + h * k_cache.stride(1) + p * k_cache.stride(2), D);
          const scalar_t* src = vp + b * v.stride(0) + t * v.stride(1) + h * v.stride(2);
          scalar_t* dst = vc + b * v_cache.stride(0) + h * v_cache.stride(1) + p * v_cache.stride(2);
          std::copy(src, src + D, dst);
        }
      }
    });
  });
  return out;
}

// vegas::add_rms_norm: the residual add and the RMSNorm that follows it (transformers'
// LlamaRMSNorm: weight * x / sqrt(mean(x^2) + eps), in float32), one call instead of ~10 tensor
// ops (F.rms_norm decomposes on CPU). The lean draft forward's norms.
at::Tensor add_rms_norm_cpu(at::Tensor& x, const std::optional<at::Tensor>& residual,
                            const at::Tensor& weight, double eps) {
  const char* op = "vegas::add_rms_norm";
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension [..., N], got a scalar");
  TORCH_CHECK(is_attn_dtype(x.scalar_type()), op, ": x must be float32, bfloat16 or float16, got ",
              x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous (it is updated in place)");
  const int64_t N = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == N, op, ": weight must have shape [N] = [", N,
              "], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight dtype (", weight.scalar_type(),
              ") must equal x dtype (", x.scalar_type(), ")");
  check_same_device(op, x, "x", weight, "weight");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be a finite float >= 0, got ", eps);
  at::Tensor r;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes(), op, ": residual must have the shape of x ", x.sizes(),
                ", got ", residual->sizes());
    TORCH_CHECK(residual->scalar_type() == x.scalar_type(), op, ": residual dtype (",
                residual->scalar_type(), ") must equal x dtype (", x.scalar_type(), ")");
    check_same_device(op, x, "x", *residual, "residual");
    r = residual->contiguous();
  }
  at::Tensor out = at::empty_like(x);
  const int64_t M = N == 0 ? 0 : x.numel() / N;
  if (M == 0) return out;
  const at::Tensor w = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = r.defined() ? r.data_ptr<scalar_t>() : nullptr;
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op_ = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        scalar_t* xr = xp + m * N;
        if (rp != nullptr) {
          const scalar_t* rr = rp + m * N;
          for (int64_t i = 0; i < N; ++i) xr[i] = static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
        }
        float ss = 0.f;
        for (int64_t i = 0; i < N; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(N) + static_cast<float>(eps));
        scalar_t* orow = op_ + m * N;
        for (int64_t i = 0; i < N; ++i)
          orow[i] = static_cast<scalar_t>(static_cast<float>(wp[i]) * static_cast<float>(static_cast<scalar_t>(static_cast<float>(xr[i]) * inv)));
      }
    });
  });
  return out;
}

// vegas::silu_mul: the SiLU-gated product of a fused gate/up projection, silu(gu[..., :I]) *
// gu[..., I:], one call instead of a split, a silu and a mul. The lean draft forward's MLP.
at::Tensor silu_mul_cpu(const at::Tensor& gate_up) {
  const char* op = "vegas::silu_mul";
  TORCH_CHECK(gate_up.dim() >= 1, op, ": gate_up must have at least one dimension [..., 2 * I], got a scalar");
  TORCH_CHECK(is_attn_dtype(gate_up.scalar_type()), op, ": gate_up must be float32, bfloat16 or float16, got ",
              gate_up.scalar_type());
  const int64_t N2 = gate_up.size(-1);
  TORCH_CHECK(N2 % 2 == 0, op, ": gate_up's last dimension must be even (gate and up halves), got ", N2);
  const int64_t I = N2 / 2;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, gate_up.options());
  const int64_t M = N2 == 0 ? 0 : gate_up.numel() / N2;
  if (M == 0 || I == 0) return out;
  const at::Tensor gu = gate_up.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gu.data_ptr<scalar_t>();
    scalar_t* op_ = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        const scalar_t* g = gp + m * N2;
        const scalar_t* u = g + I;
        scalar_t* o = op_ + m * I;
        for (int64_t i = 0; i < I; ++i) {
          const float a = static_cast<float>(g[i]);
          const float s = static_cast<float>(static_cast<scalar_t>(a / (1.f + std::exp(-a))));
          o[i] = static_cast<scalar_t>(s * static_cast<float>(u[i]));
        }
      }
    });
  });
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CPU, m) {
  m.impl("silu_mul", &vegas::cpu::silu_mul_cpu);
  m.impl("rope_kv_write", &vegas::cpu::rope_kv_write_cpu);
  m.impl("add_rms_norm", &vegas::cpu::add_rms_norm_cpu);
}
