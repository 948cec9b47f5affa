// CPU kernel of vegas::verify_attention: causal attention of the Q newest tokens over
// the whole KV cache, with the attention mass of every KV block reduced on the fly.
//
// Phase 1, parallel over (batch, KV head, split of the tokens): each task keeps the
// online-softmax state of its R = Q * group rows and, per row and block, the sum of
// exp(score - running max) with the running max of the last tile that touched the
// block (per-block partial log-sum-exps). Splits start on block boundaries, so each
// block belongs to one split. Phase 2 (`finish`), per (batch, KV head): combine the
// splits into out / lse, then normalize the block sums by the final lse:
//   block_scores[b, g, j] = sum_r w_r * bsum[r, j] * exp(m_ref[r, j] - lse_r).
// With one split per (batch, KV head) -- every thread already busy -- the task that
// attended finishes its (batch, KV head) at once, from a per-thread block-sum buffer
// that is partly still in its core's cache (block size 1 stores R floats per token);
// otherwise phase 2 is a second parallel pass over (batch, KV head). Both run as tasks on
// ATen's intra-op threads (parallel_tasks).
// No [Q, S] probability matrix is formed. Source of the method: Vegas, arXiv 2602.07223.
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

// Grow-only buffer reused across calls by the calling thread: the block sums of a long
// cache are tens of MB, and fresh pages cost more to fault in than the kernel takes to
// fill them.
template <typename T>
T* reuse_buffer(std::vector<T>& buf, size_t n) {
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

template <typename T>
void verify_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const int32_t* lens, const float* qw, const AttnDims& d, int64_t block_size,
                 double scale, at::Tensor& out, at::Tensor& lse, at::Tensor& scores) {
  const int64_t B = d.B, Q = d.Q, Hkv = d.Hkv, G = d.group, D = d.D, S = d.S;
  const int64_t bs = effective_block_size(block_size, S);
  const int R = static_cast<int>(Q * G);
  const int Rp = VEGAS_ISA_CALL(row_pad, R);
  const int64_t N = ceil_div(S, bs);
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max<int64_t>(max_len, lens[b]);
  const int64_t nsplit = choose_num_splits(B * Hkv, max_len, at::get_num_threads());
  // split length: a whole number of blocks
  const int64_t split_len = ceil_div(ceil_div(max_len, nsplit), bs) * bs;
  const int64_t ntiles = ceil_div(split_len, kTile);

  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t kb = k_cache.stride(0), kh = k_cache.stride(1), kt = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vh = v_cache.stride(1), vt = v_cache.stride(2);

  // per (b, g, split): m [Rp], l [Rp], acc [Rp, D], mt [ntiles, Rp], bsum [split blocks, R]
  // (+ Rp - R). Every entry that the finish step reads is written by phase 1 (m / l of empty
  // splits here).
  thread_local std::vector<float> m_buf, l_buf, acc_buf, mt_buf, bsum_buf;
  const int64_t nstate = B * Hkv * nsplit * Rp;
  const int64_t bsum_stride = split_len / bs * R + Rp;  // per split
  float* m_all = reuse_buffer(m_buf, nstate);
  float* l_all = reuse_buffer(l_buf, nstate);
  float* acc_all = reuse_buffer(acc_buf, nstate * D);
  float* mt_all = reuse_buffer(mt_buf, nstate * ntiles);
  // One split per (b, g): each task finishes its own (b, g) right after its attention loop,
  // reading the block sums back from its own thread's buffer while much of it is still in that
  // core's cache, and no second parallel pass runs.
  const bool finish_in_task = nsplit == 1;
  float* bsum_all = finish_in_task ? nullptr : reuse_buffer(bsum_buf, B * Hkv * nsplit * bsum_stride);
  std::fill(m_all, m_all + nstate, kNegInf);
  std::fill(l_all, l_all + nstate, 0.f);

  float* outf = nullptr;
  at::Tensor out32;
  if (q.scalar_type() == at::kFloat) {
    outf = out.data_ptr<float>();
  } else {
    out32 = at::empty(out.sizes(), at::TensorOptions().dtype(at::kFloat));
    outf = out32.data_ptr<float>();
  }
  float* lsep = lse.data_ptr<float>();
  float* scp = scores.data_ptr<float>();

  // Combine the splits of (b, g) into out / lse, then normalize its block sums (split sp's at
  // bsum0 + sp * bsum_stride) by the final lse. row_lse, w, f: Rp floats of scratch each.
  auto finish = [&](int64_t bg, const float* bsum0, float* row_lse, float* w, float* f) {
    const int64_t b = bg / Hkv, g = bg % Hkv;
    const int64_t L = lens[b];
    for (int r = 0; r < Rp; ++r) w[r] = r < R && qw ? qw[r / G] : 1.f;
    for (int r = 0; r < R; ++r) {
      const int64_t i = r / G, hh = r % G;
      const int64_t idx0 = bg * nsplit * Rp + r;
      float* o = outf + ((b * Q + i) * d.Hq + g * G + hh) * D;
      const float lr = combine_row(m_all + idx0, l_all + idx0, acc_all + idx0 * D, nsplit, Rp, D, o);
      row_lse[r] = lr;
      lsep[(b * d.Hq + g * G + hh) * Q + i] = lr;
    }
    // block scores: block j's sums are relative to the running max of the tile that holds
    // its last token, so its factor w_r * exp(m_tile - lse_r) is one per (row, split, tile),
    // shared by the blocks of the tile.
    float* sc = scp + bg * N;
    std::fill(sc + std::min<int64_t>(N, ceil_div(L, bs)), sc + N, 0.f);  // blocks past the row's length
    for (int64_t sp = 0; sp * split_len < L; ++sp) {
      const int64_t t0 = sp * split_len;
      const float* bsum = bsum0 + sp * bsum_stride - (t0 / bs) * R;  // block j at j * R
      const int64_t t_end = std::min<int64_t>(t0 + split_len, L);  // split's tokens [t0, t_end)
      const float* mt = mt_all + (bg * nsplit + sp) * Rp * ntiles;
      auto last_tile = [&](int64_t j) { return (std::min<int64_t>((j + 1) * bs, t_end) - 1 - t0) / kTile; };
      for (int64_t j0 = t0 / bs; j0 * bs < t_end;) {
        // blocks [j0, j1) whose last token lies in the same tile
        const int64_t tile = last_tile(j0);
        int64_t j1 = std::min<int64_t>(ceil_div(t0 + (tile + 1) * kTile, bs), ceil_div(t_end, bs));
        while (j1 > j0 + 1 && last_tile(j1 - 1) != tile) --j1;
        const bool finite = VEGAS_ISA_CALL(block_factors, mt + tile * Rp, row_lse, w, R, f);
        VEGAS_ISA_CALL(block_reduce, bsum + j0 * R, R, f, finite, j1 - j0, sc + j0);
        j0 = j1;
      }
    }
  };

  parallel_tasks(
      B * Hkv * nsplit, R * split_len, [&] { return TaskBuffers(R, Rp, static_cast<int>(D)); },
      [&](TaskBuffers& tb, int64_t task) {
        const int64_t sp = task % nsplit;
        const int64_t bg = task / nsplit;
        const int64_t b = bg / Hkv, g = bg % Hkv;
        const int64_t L = lens[b];
        const int64_t t0 = sp * split_len;
        const int64_t t1 = std::min<int64_t>(L, t0 + split_len);
        // this thread's block sums when the task finishes its (b, g); reused across calls
        thread_local std::vector<float> own_bsum;
        float* bsum = finish_in_task ? reuse_buffer(own_bsum, bsum_stride) : bsum_all + task * bsum_stride;
        if (t0 < t1) {
          tb.load_queries(qp, b, g, Q, G, d.Hq, float(scale), L);
          VEGAS_ISA_CALL(pack_queries, tb.qf.data(), R, static_cast<int>(D), tb.qt.data());
          const int64_t base = task * Rp;
          float* acc = acc_all + base * D;
          std::fill(acc, acc + R * D, 0.f);
          BlockSums blk;
          blk.bsum = bsum;
          blk.block0 = t0 / bs;
          blk.block_size = bs;
          blk.mt = mt_all + base * ntiles;
          const Rows rows = tb.rows();
          const Scratch ws = tb.ws();
          VEGAS_ISA_CALL(attend<T>, rows, kp + b * kb + g * kh, vp + b * vb + g * vh, kt, vt, nullptr, t0,
                         t1 - t0, ws, m_all + base, l_all + base, acc, &blk);
        }
        if (finish_in_task) finish(bg, bsum, tb.row_lse.data(), tb.w.data(), tb.f.data());
      });

  if (!finish_in_task)
    parallel_tasks(
        B * Hkv, R * N, [&] { return std::vector<float>(3 * Rp, 0.f); },  // row_lse | w | f
        [&](std::vector<float>& rs, int64_t bg) {
          finish(bg, bsum_all + bg * nsplit * bsum_stride, rs.data(), rs.data() + Rp, rs.data() + 2 * Rp);
        });
  if (q.scalar_type() != at::kFloat) out.copy_(out32);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_attention_cpu(
    const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& seq_lens, int64_t block_size, double scale,
    const c10::optional<at::Tensor>& query_weights) {
  const char* op = "vegas::verify_attention";
  AttnDims d = check_attention_inputs(op, q_in, k_cache, v_cache, seq_lens, block_size, scale);
  check_query_weights(op, q_in, query_weights, d);
  const at::Tensor lens_t = seq_lens.contiguous();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  check_seq_lens_values(op, lens, d);
  at::Tensor qw_t;
  const float* qw = nullptr;
  if (query_weights.has_value()) {
    qw_t = query_weights->contiguous();
    qw = qw_t.data_ptr<float>();
  }
  const at::Tensor q = q_in.contiguous();
  auto out = at::empty({d.B, d.Q, d.Hq, d.D}, q.options());
  auto lse = at::empty({d.B, d.Hq, d.Q}, q.options().dtype(at::kFloat));
  // not at::zeros: each (b, g) zeroes its blocks past its length itself, while it holds them
  auto scores = at::empty({d.B, d.Hkv, ceil_div(d.S, block_size)}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "verify_attention_cpu", [&] {
    verify_impl<scalar_t>(q, k_cache, v_cache, lens, qw, d, block_size, scale, out, lse, scores);
  });
  return {out, lse, scores};
}

}  // namespace
}  // namespace cpu
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CPU, m) {
  m.impl("verify_attention", &vegas::cpu::verify_attention_cpu);
}
