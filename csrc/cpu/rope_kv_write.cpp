// CPU kernel of vegas::rope_kv_write: RoPE on a layer's new queries and keys and the write of
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

}  // namespace
}  // namespace cpu
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CPU, m) {
  m.impl("rope_kv_write", &vegas::cpu::rope_kv_write_cpu);
}
