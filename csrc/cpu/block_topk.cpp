// CPU kernel of vegas::block_topk. Per (row b, head h): sink blocks [0, num_sink_blocks)
// first (as many as fit), then the highest-scoring remaining eligible blocks
// [0, min(num_candidates[b], N)); c = min(k[b], max_k, eligible) in all. Order: higher
// score first, NaN below every number (-inf included), ties to the lower index -- a total
// order, so every device and run picks the same set. Output ascending, -1 padded.
// Source: Vegas, arXiv 2602.07223 (top-k of verification block scores).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "checks.h"
#include "cpu/isa.h"

namespace vegas {
namespace cpu {
namespace {

at::Tensor block_topk_cpu(const at::Tensor& scores_in, const at::Tensor& k_in,
                          const at::Tensor& ncand_in, int64_t max_k, int64_t num_sink_blocks) {
  const char* op = "vegas::block_topk";
  check_topk_inputs(op, scores_in, k_in, ncand_in, max_k, num_sink_blocks);
  const at::Tensor scores = scores_in.contiguous();
  const at::Tensor kt = k_in.contiguous();
  const at::Tensor nt = ncand_in.contiguous();
  const int64_t B = scores.size(0), H = scores.size(1), N = scores.size(2);
  const int32_t* kk = kt.data_ptr<int32_t>();
  const int32_t* nc = nt.data_ptr<int32_t>();
  check_topk_values(op, kk, nc, B);
  auto out = at::full({B, H, max_k}, -1, scores.options().dtype(at::kInt));
  if (max_k == 0 || B * H == 0) return out;
  const float* sp = scores.data_ptr<float>();
  int32_t* op_ = out.data_ptr<int32_t>();
  at::parallel_for(0, B * H, parallel_grain(B * H, N, /*min_work=*/int64_t(1) << 18), [&](int64_t begin, int64_t end) {
    std::vector<int32_t> cand;
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / H;
      const float* s = sp + row * N;
      int32_t* o = op_ + row * max_k;
      const int64_t elig = std::min<int64_t>(nc[b], N);
      const int64_t c = std::min<int64_t>({int64_t(kk[b]), max_k, elig});
      const int64_t sinks = std::min<int64_t>(num_sink_blocks, c);
      for (int64_t j = 0; j < sinks; ++j) o[j] = static_cast<int32_t>(j);
      const int64_t rest = c - sinks;
      if (rest <= 0) continue;
      cand.resize(elig - sinks);
      for (int64_t j = sinks; j < elig; ++j) cand[j - sinks] = static_cast<int32_t>(j);
      auto better = [s](int32_t a, int32_t b2) {
        const float x = s[a], y = s[b2];
        const bool nx = std::isnan(x), ny = std::isnan(y);
        if (nx != ny) return ny;  // the number outranks NaN
        if (!nx && x != y) return x > y;
        return a < b2;
      };
      if (rest < static_cast<int64_t>(cand.size()))
        std::nth_element(cand.begin(), cand.begin() + rest, cand.end(), better);
      std::sort(cand.begin(), cand.begin() + rest);
      std::copy(cand.begin(), cand.begin() + rest, o + sinks);
    }
  });
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CPU, m) {
  m.impl("block_topk", &vegas::cpu::block_topk_cpu);
}
