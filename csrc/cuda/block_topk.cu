// CUDA launcher of vegas::block_topk (TORCH_LIBRARY_IMPL(vegas, CUDA)). Kernel:
// block_topk_kernel.cuh; host logic: ops_host.h.
// STATUS: compiled for sm80 / sm90, emulator-checked; the former kernel ran on an H200
// (bench/results/gpu_h200); the key-caching rewrite is not yet run on a GPU.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/cuda_backend.h"

namespace vegas {
namespace cuda {
namespace {

at::Tensor block_topk_cuda(const at::Tensor& block_scores, const at::Tensor& k,
                           const at::Tensor& num_candidates, int64_t max_k,
                           int64_t num_sink_blocks, int64_t num_recent_blocks) {
  const c10::cuda::CUDAGuard guard(block_scores.device());
  CudaBackend be(block_scores);
  return block_topk_impl(be, block_scores, k, num_candidates, max_k, num_sink_blocks, num_recent_blocks);
}

}  // namespace
}  // namespace cuda
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CUDA, m) {
  m.impl("block_topk", &vegas::cuda::block_topk_cuda);
}
