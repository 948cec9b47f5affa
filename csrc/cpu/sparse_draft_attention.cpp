// CPU kernel of vegas::sparse_draft_attention: each query row of KV head g attends to
// the tokens of g's selected blocks that lie before tail_start, plus every tail token
// [tail_start, seq_len), causally, with an exact softmax over that set.
//
// Per (batch, KV head) the visited tokens are gathered into one index list (selected
// blocks first, then the ascending tail, so causal masking only ever cuts a suffix of a
// tile), split across threads when the batch is small, and combined flash-decoding
// style. Each selected block is read once for all query heads of its group.
// Source: Vegas, arXiv 2602.07223 (drafting over verification-selected blocks).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "checks.h"
#include "cpu/combine.h"
#include "cpu/isa.h"

namespace vegas {
namespace cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
void draft_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const int32_t* idx, int64_t K, const int32_t* tail, const int32_t* lens,
                const AttnDims& d, int64_t block_size, double scale, at::Tensor& out) {
  const int64_t bs = effective_block_size(block_size, d.S);
  const int64_t B = d.B, Q = d.Q, Hkv = d.Hkv, G = d.group, D = d.D;
  const int R = static_cast<int>(Q * G);
  const int64_t kb = k_cache.stride(0), kh = k_cache.stride(1), kt = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vh = v_cache.stride(1), vt = v_cache.stride(2);

  // token lists, per (b, g)
  std::vector<std::vector<int64_t>> lists(B * Hkv);
  int64_t max_n = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < Hkv; ++g) {
      auto& lst = lists[b * Hkv + g];
      const int32_t* row = idx + (b * Hkv + g) * K;
      for (int64_t i = 0; i < K; ++i) {
        if (row[i] < 0) continue;
        const int64_t s0 = int64_t(row[i]) * bs;
        const int64_t s1 = std::min<int64_t>(s0 + bs, tail[b]);
        for (int64_t t = s0; t < s1; ++t) lst.push_back(t);
      }
      for (int64_t t = tail[b]; t < lens[b]; ++t) lst.push_back(t);
      max_n = std::max<int64_t>(max_n, lst.size());
    }
  const int64_t nsplit = choose_num_splits(B * Hkv, max_n, at::get_num_threads(), 256);
  const int64_t split_len = std::max<int64_t>(1, ceil_div(max_n, nsplit));

  const int Rp = VEGAS_ISA_CALL(row_pad, R);
  std::vector<float> m_all(B * Hkv * nsplit * Rp, kNegInf), l_all(B * Hkv * nsplit * Rp, 0.f);
  std::vector<float> acc_all(B * Hkv * nsplit * Rp * D, 0.f);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();

  parallel_tasks(
      B * Hkv * nsplit, kGatheredTokenWork * R * split_len, [&] { return TaskBuffers(R, Rp, static_cast<int>(D)); },
      [&](TaskBuffers& tb, int64_t task) {
        const int64_t sp = task % nsplit, bg = task / nsplit;
        const int64_t b = bg / Hkv, g = bg % Hkv;
        const auto& lst = lists[bg];
        const int64_t i0 = sp * split_len;
        const int64_t i1 = std::min<int64_t>(lst.size(), i0 + split_len);
        if (i0 >= i1) return;
        tb.load_queries(qp, b, g, Q, G, d.Hq, float(scale), lens[b]);
        VEGAS_ISA_CALL(pack_queries, tb.qf.data(), R, static_cast<int>(D), tb.qt.data());
        const int64_t base = task * Rp;
        const Rows rows = tb.rows();
        const Scratch ws = tb.ws();
        VEGAS_ISA_CALL(attend<T>, rows, kp + b * kb + g * kh, vp + b * vb + g * vh, kt, vt,
                       lst.data() + i0, 0, i1 - i0, ws, m_all.data() + base, l_all.data() + base,
                       acc_all.data() + base * D, nullptr);
      });

  at::Tensor out32 = q.scalar_type() == at::kFloat ? out : at::empty(out.sizes(), out.options().dtype(at::kFloat));
  float* outf = out32.data_ptr<float>();
  at::parallel_for(0, B * Hkv, parallel_grain(B * Hkv, R * D), [&](int64_t begin, int64_t end) {
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / Hkv, g = bg % Hkv;
      for (int r = 0; r < R; ++r) {
        const int64_t i = r / G, hh = r % G;
        const int64_t idx0 = bg * nsplit * Rp + r;
        combine_row(m_all.data() + idx0, l_all.data() + idx0, acc_all.data() + idx0 * D, nsplit,
                    Rp, D, outf + ((b * Q + i) * d.Hq + g * G + hh) * D);
      }
    }
  });
  if (q.scalar_type() != at::kFloat) out.copy_(out32);
}

at::Tensor sparse_draft_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& block_indices,
                                      const at::Tensor& tail_start, const at::Tensor& seq_lens,
                                      int64_t block_size, double scale) {
  const char* op = "vegas::sparse_draft_attention";
  AttnDims d = check_attention_inputs(op, q_in, k_cache, v_cache, seq_lens, block_size, scale);
  check_draft_inputs(op, q_in, block_indices, tail_start, d);
  const at::Tensor lens_t = seq_lens.contiguous();
  const at::Tensor tail_t = tail_start.contiguous();
  const at::Tensor idx_t = block_indices.contiguous();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  check_seq_lens_values(op, lens, d);
  const int64_t K = idx_t.size(2);
  check_draft_values(op, lens, tail_t.data_ptr<int32_t>(), idx_t.data_ptr<int32_t>(), K, d,
                     block_size);
  const at::Tensor q = q_in.contiguous();
  auto out = at::empty({d.B, d.Q, d.Hq, d.D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "sparse_draft_attention_cpu", [&] {
    draft_impl<scalar_t>(q, k_cache, v_cache, idx_t.data_ptr<int32_t>(), K,
                         tail_t.data_ptr<int32_t>(), lens, d, block_size, scale, out);
  });
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CPU, m) {
  m.impl("sparse_draft_attention", &vegas::cpu::sparse_draft_attention_cpu);
}
