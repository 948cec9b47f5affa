// CUDA launcher of vegas::sparse_draft_attention (TORCH_LIBRARY_IMPL(vegas, CUDA)).
// Kernels: sparse_draft_attention_kernel.cuh / attention_kernel.cuh; host: ops_host.h.
// STATUS: compiled for sm80 / sm90, emulator-checked; ran on an H200 (bench/results/gpu_h200).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/cuda_backend.h"

namespace vegas {
namespace cuda {
namespace {

at::Tensor sparse_draft_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& block_indices,
                                       const at::Tensor& tail_start, const at::Tensor& seq_lens,
                                       int64_t block_size, double scale) {
  const c10::cuda::CUDAGuard guard(q.device());
  CudaBackend be(q);
  return sparse_draft_attention_impl(be, q, k_cache, v_cache, block_indices, tail_start,
                                     seq_lens, block_size, scale);
}

}  // namespace
}  // namespace cuda
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CUDA, m) {
  m.impl("sparse_draft_attention", &vegas::cuda::sparse_draft_attention_cuda);
}
