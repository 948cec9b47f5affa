// CUDA launcher of vegas::paged_block_scores (TORCH_LIBRARY_IMPL(vegas, CUDA)). Kernels:
// paged_block_scores_kernel.cuh; host logic (checks, launch plan): ops_host.h.
// STATUS: compiled for sm80 / sm90, emulator-checked; ran on an H200 (bench/results/gpu_h200).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/cuda_backend.h"

namespace vegas {
namespace cuda {
namespace {

at::Tensor paged_block_scores_cuda(const at::Tensor& q, const at::Tensor& key_cache,
                                   const at::Tensor& block_table, const at::Tensor& seq_lens,
                                   const at::Tensor& query_start_loc, int64_t num_queries,
                                   double scale) {
  const c10::cuda::CUDAGuard guard(q.device());
  CudaBackend be(q);
  return paged_block_scores_impl(be, q, key_cache, block_table, seq_lens, query_start_loc,
                                 num_queries, scale);
}

}  // namespace
}  // namespace cuda
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CUDA, m) {
  m.impl("paged_block_scores", &vegas::cuda::paged_block_scores_cuda);
}
