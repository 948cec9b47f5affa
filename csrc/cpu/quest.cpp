// CPU kernels of the Quest selection ops (Quest: "Query-Aware Sparsity for Efficient
// Long-Context LLM Inference", Tang et al., arXiv 2406.10774), used as a rival of Vegas's
// verification-guided selection.
//
// block_minmax_update: for each row b, recompute key_min / key_max [B, H_kv, N, D] of the
//   blocks [start[b] / block_size, ceil(seq_lens[b] / block_size)) from the valid tokens
//   [j*bs, min((j+1)*bs, seq_lens[b])) of the KV cache (appends and rollbacks alike).
// quest_block_scores: score[b, g, j] = sum over the queries and the query heads of group g
//   of sum_d max(q_d * max_d, q_d * min_d) -- an upper bound of q.k over block j -- for
//   j < num_blocks[b]; -inf beyond.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <vector>

#include "checks.h"
#include "cpu/parallel.h"

namespace vegas {
namespace cpu {
namespace {

void check_meta(const char* op, const at::Tensor& kmin, const at::Tensor& kmax, int64_t B,
                int64_t Hkv, int64_t D) {
  TORCH_CHECK(kmin.dim() == 4 && kmin.size(0) == B && kmin.size(1) == Hkv && kmin.size(3) == D, op,
              ": key_min must have shape [B, H_kv, N, D] = [", B, ", ", Hkv, ", N, ", D, "], got ",
              kmin.sizes());
  TORCH_CHECK(kmax.sizes() == kmin.sizes(), op, ": key_max must have the shape of key_min ",
              kmin.sizes(), ", got ", kmax.sizes());
  TORCH_CHECK(is_attn_dtype(kmin.scalar_type()) && kmax.scalar_type() == kmin.scalar_type(), op,
              ": key_min and key_max must share one dtype among float32, bfloat16, float16, got ",
              kmin.scalar_type(), " and ", kmax.scalar_type());
  TORCH_CHECK(kmin.is_contiguous() && kmax.is_contiguous(), op,
              ": key_min and key_max must be contiguous");
}

template <typename T, typename M>
void minmax_impl(M* kmin, M* kmax, const T* k, const int32_t* lens, const int32_t* start,
                 int64_t B, int64_t Hkv, int64_t N, int64_t D, int64_t sb, int64_t sh,
                 int64_t st, int64_t bs) {
  at::parallel_for(0, B * Hkv, parallel_grain(B * Hkv, bs * D), [&](int64_t begin, int64_t end) {
    std::vector<float> mn(D), mx(D);
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / Hkv, g = bg % Hkv;
      const int64_t L = lens[b];
      const int64_t j_end = std::min<int64_t>(N, ceil_div(L, bs));
      for (int64_t j = start[b] / bs; j < j_end; ++j) {
        std::fill(mn.begin(), mn.end(), std::numeric_limits<float>::infinity());
        std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
        const int64_t t1 = std::min<int64_t>((j + 1) * bs, L);
        for (int64_t t = j * bs; t < t1; ++t) {
          const T* kr = k + b * sb + g * sh + t * st;
          for (int64_t d = 0; d < D; ++d) {
            const float x = static_cast<float>(kr[d]);
            mn[d] = x < mn[d] ? x : mn[d];
            mx[d] = x > mx[d] ? x : mx[d];
          }
        }
        M* o1 = kmin + (bg * N + j) * D;
        M* o2 = kmax + (bg * N + j) * D;
        for (int64_t d = 0; d < D; ++d) {
          o1[d] = static_cast<M>(mn[d]);
          o2[d] = static_cast<M>(mx[d]);
        }
      }
    }
  });
}

void block_minmax_update_cpu(at::Tensor& key_min, at::Tensor& key_max, const at::Tensor& k_cache,
                             const at::Tensor& seq_lens, const at::Tensor& start,
                             int64_t block_size) {
  const char* op = "vegas::block_minmax_update";
  TORCH_CHECK(k_cache.dim() == 4, op, ": k_cache must be 4-D [B, H_kv, S, D], got shape ",
              k_cache.sizes());
  TORCH_CHECK(is_attn_dtype(k_cache.scalar_type()), op,
              ": k_cache must be float32, bfloat16 or float16, got ", k_cache.scalar_type());
  TORCH_CHECK(k_cache.stride(3) == 1, op, ": k_cache must be contiguous in head_dim");
  TORCH_CHECK(block_size >= 1, op, ": block_size must be >= 1, got ", block_size);
  const int64_t B = k_cache.size(0), Hkv = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3);
  check_meta(op, key_min, key_max, B, Hkv, D);
  TORCH_CHECK(key_min.size(2) == ceil_div(S, block_size), op,
              ": key_min must have N = ceil(S / block_size) = ", ceil_div(S, block_size),
              " blocks, got ", key_min.size(2));
  check_same_device(op, k_cache, "k_cache", key_min, "key_min");
  check_same_device(op, k_cache, "k_cache", key_max, "key_max");
  check_same_device(op, k_cache, "k_cache", seq_lens, "seq_lens");
  check_same_device(op, k_cache, "k_cache", start, "start");
  check_int32_vector(op, seq_lens, "seq_lens", B);
  check_int32_vector(op, start, "start", B);
  const at::Tensor lens_t = seq_lens.contiguous(), start_t = start.contiguous();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  const int32_t* st = start_t.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= S, op, ": seq_lens[", b, "] = ", lens[b],
                " must lie in [0, S] = [0, ", S, "]");
    TORCH_CHECK(st[b] >= 0, op, ": start[", b, "] = ", st[b], " must be >= 0");
  }
  const int64_t N = key_min.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "minmax_k", [&] {
    using KT = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_min.scalar_type(), "minmax_m", [&] {
      minmax_impl<KT, scalar_t>(key_min.data_ptr<scalar_t>(), key_max.data_ptr<scalar_t>(),
                                k_cache.data_ptr<KT>(), lens, st, B, Hkv, N, D,
                                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                effective_block_size(block_size, S));
    });
  });
}

template <typename Tq, typename M>
void scores_impl(float* out, const Tq* q, const M* kmin, const M* kmax, const int32_t* nb,
                 int64_t B, int64_t Q, int64_t Hq, int64_t Hkv, int64_t N, int64_t D) {
  const int64_t G = Hq / Hkv;
  at::parallel_for(0, B * Hkv, parallel_grain(B * Hkv, N * Q * G * D / 8), [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Q * G * D);
    std::vector<float> mn(D), mx(D);
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / Hkv, g = bg % Hkv;
      for (int64_t i = 0; i < Q; ++i)
        for (int64_t hh = 0; hh < G; ++hh)
          for (int64_t d = 0; d < D; ++d)
            qf[(i * G + hh) * D + d] = static_cast<float>(q[((b * Q + i) * Hq + g * G + hh) * D + d]);
      const int64_t nvalid = std::min<int64_t>(N, std::max<int32_t>(nb[b], 0));
      float* o = out + bg * N;
      for (int64_t j = 0; j < nvalid; ++j) {
        const M* a = kmin + (bg * N + j) * D;
        const M* c = kmax + (bg * N + j) * D;
        for (int64_t d = 0; d < D; ++d) {
          mn[d] = static_cast<float>(a[d]);
          mx[d] = static_cast<float>(c[d]);
        }
        float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t r = 0; r < Q * G; ++r) {
          const float* qr = qf.data() + r * D;
          int64_t d = 0;
          for (; d + 8 <= D; d += 8)
            for (int l = 0; l < 8; ++l) {
              const float x = qr[d + l] * mx[d + l], y = qr[d + l] * mn[d + l];
              lanes[l] += x > y ? x : y;
            }
          for (; d < D; ++d) {
            const float x = qr[d] * mx[d], y = qr[d] * mn[d];
            lanes[0] += x > y ? x : y;
          }
        }
        float s = 0.f;
        for (int l = 0; l < 8; ++l) s += lanes[l];
        o[j] = s;
      }
      for (int64_t j = nvalid; j < N; ++j) o[j] = -std::numeric_limits<float>::infinity();
    }
  });
}

at::Tensor quest_block_scores_cpu(const at::Tensor& q_in, const at::Tensor& key_min,
                                  const at::Tensor& key_max, const at::Tensor& num_blocks) {
  const char* op = "vegas::quest_block_scores";
  TORCH_CHECK(q_in.dim() == 4, op, ": q must be 4-D [B, Q, H_q, D], got shape ", q_in.sizes());
  TORCH_CHECK(is_attn_dtype(q_in.scalar_type()), op,
              ": q must be float32, bfloat16 or float16, got ", q_in.scalar_type());
  const int64_t B = q_in.size(0), Q = q_in.size(1), Hq = q_in.size(2), D = q_in.size(3);
  TORCH_CHECK(key_min.dim() == 4, op, ": key_min must be 4-D [B, H_kv, N, D], got shape ",
              key_min.sizes());
  const int64_t Hkv = key_min.size(1), N = key_min.size(2);
  check_meta(op, key_min, key_max, B, Hkv, D);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, op, ": the number of query heads H_q (", Hq,
              ") must be a positive multiple of the number of KV heads H_kv (", Hkv, ")");
  check_same_device(op, q_in, "q", key_min, "key_min");
  check_same_device(op, q_in, "q", key_max, "key_max");
  check_same_device(op, q_in, "q", num_blocks, "num_blocks");
  check_int32_vector(op, num_blocks, "num_blocks", B);
  const at::Tensor q = q_in.contiguous(), nb_t = num_blocks.contiguous();
  auto out = at::empty({B, Hkv, N}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "quest_q", [&] {
    using QT = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_min.scalar_type(), "quest_m", [&] {
      scores_impl<QT, scalar_t>(out.data_ptr<float>(), q.data_ptr<QT>(), key_min.data_ptr<scalar_t>(),
                                key_max.data_ptr<scalar_t>(), nb_t.data_ptr<int32_t>(), B, Q, Hq, Hkv,
                                N, D);
    });
  });
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CPU, m) {
  m.impl("block_minmax_update", &vegas::cpu::block_minmax_update_cpu);
  m.impl("quest_block_scores", &vegas::cpu::quest_block_scores_cpu);
}
