// CUDA launcher of vegas::paged_verify_attention (TORCH_LIBRARY_IMPL(vegas, CUDA)). Kernels and
// host logic: paged_verify_attention_kernel.cuh (shared with the emulation, csrc/cuda/emu).
// STATUS: compiled for sm80 / sm90, emulator-checked; ran on an H200 (bench/results/gpu_h200).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/cuda_backend.h"
#include "cuda/paged_verify_attention_kernel.cuh"

namespace vegas {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor> paged_verify_attention_cuda(const at::Tensor& q, const at::Tensor& key_cache,
                                                               const at::Tensor& value_cache,
                                                               const at::Tensor& block_table,
                                                               const at::Tensor& seq_lens,
                                                               const at::Tensor& query_start_loc,
                                                               int64_t num_queries, double scale) {
  const c10::cuda::CUDAGuard guard(q.device());
  CudaBackend be(q);
  return paged_verify_attention_impl(be, q, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                                     num_queries, scale);
}

}  // namespace
}  // namespace cuda
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CUDA, m) {
  m.impl("paged_verify_attention", &vegas::cuda::paged_verify_attention_cuda);
}
