// CPU kernel of vegas::paged_block_scores: the attention mass that the newest queries of each
// request put on every page of a paged KV cache (vLLM's layout), without computing the
// attention output -- the selection signal of Vegas (arXiv 2602.07223) for an engine whose
// own attention kernel returns neither scores nor a log-sum-exp.
//
// Per (request r, KV head g): the last n = min(q_len, num_queries) queries of r and the G
// query heads of g give n * G rows. Each row's scaled scores against the keys it may see
// (causal: query i at position seq_len - q_len + i sees tokens t <= that position) are
// computed once (each key row is read once for all rows), then normalized by the row's own
// log-sum-exp and summed per logical page. The kernel proper is torch-free (raw pointers,
// strides in elements); the launcher below checks inputs and dispatches dtypes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "checks.h"
#include "cpu/isa.h"
#include "cpu/paged_scores_types.h"

// The same three ISA builds as isa.h, each in the namespace where isa.h compiled
// attention_tile.h (whose vector helpers the tile uses).
#define VEGAS_ISA isa_base
#include "cpu/paged_scores_tile.h"
#undef VEGAS_ISA
#ifdef VEGAS_HAVE_X86_PATHS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define VEGAS_ISA isa_avx2
#include "cpu/paged_scores_tile.h"
#undef VEGAS_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
#define VEGAS_ISA isa_avx512
#include "cpu/paged_scores_tile.h"
#undef VEGAS_ISA
#pragma GCC pop_options
#endif

namespace vegas {
namespace cpu {
namespace {

template <typename T>
void paged_block_scores_kernel(float* out, const T* q, const T* k, const int32_t* block_table,
                               int64_t bt_stride, const int32_t* seq_lens, const int32_t* qsl,
                               int64_t num_queries, float scale, const PagedDims& d) {
  const int64_t tasks = d.R * d.Hkv;
  int64_t work = 0;
  for (int64_t r = 0; r < d.R; ++r) work = std::max<int64_t>(work, seq_lens[r]);
  at::parallel_for(0, tasks, parallel_grain(tasks, work * d.G * d.D / 16), [&](int64_t begin, int64_t end) {
    std::vector<float> qf, s;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / d.Hkv, g = task % d.Hkv;
      const int64_t q_len = qsl[r + 1] - qsl[r];
      float* o = out + task * d.max_pages;
      const int64_t n = std::min<int64_t>(q_len, num_queries);
      if (n <= 0 || seq_lens[r] <= 0) {
        for (int64_t j = 0; j < d.max_pages; ++j) o[j] = 0.f;
        continue;
      }
      VEGAS_ISA_CALL(scores_one<T>, o, q, k, block_table + r * bt_stride, seq_lens[r], qsl[r], q_len,
                     n, scale, d, g, qf, s);
    }
  });
}

at::Tensor paged_block_scores_cpu(const at::Tensor& q, const at::Tensor& key_cache,
                                  const at::Tensor& block_table, const at::Tensor& seq_lens,
                                  const at::Tensor& query_start_loc, int64_t num_queries,
                                  double scale) {
  const char* op = "vegas::paged_block_scores";
  const PagedShape sh = check_paged_inputs(op, q, key_cache, block_table, seq_lens,
                                           query_start_loc, num_queries, scale);
  const at::Tensor bt = block_table.contiguous(), lens_t = seq_lens.contiguous(),
                   qsl_t = query_start_loc.contiguous();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  const int32_t* qsl = qsl_t.data_ptr<int32_t>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  check_paged_values(op, qsl, lens, btp, sh);
  const int64_t R = sh.R, Hq = sh.Hq, Hkv = sh.Hkv, P = sh.max_pages, ps = sh.page_size;
  PagedDims d{R, Hq, Hkv, Hq / Hkv, q.size(2), ps, P, q.stride(0), q.stride(1), q.stride(2),
              key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.stride(3)};
  auto out = at::empty({R, Hkv, P}, q.options().dtype(at::kFloat));
  if (R == 0 || P == 0) return out.zero_();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_block_scores", [&] {
    paged_block_scores_kernel<scalar_t>(out.data_ptr<float>(), q.data_ptr<scalar_t>(),
                                        key_cache.data_ptr<scalar_t>(), btp, P, lens, qsl,
                                        num_queries, static_cast<float>(scale), d);
  });
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CPU, m) {
  m.impl("paged_block_scores", &vegas::cpu::paged_block_scores_cpu);
}
