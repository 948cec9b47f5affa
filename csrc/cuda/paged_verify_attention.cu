// CUDA launcher of vegas::paged_verify_attention (TORCH_LIBRARY_IMPL(vegas, CUDA)). Kernels and
// host logic: paged_verify_attention_kernel.cuh (shared with the emulation, csrc/cuda/emu).
// STATUS: compiled for sm80 / sm90, emulator-checked; ran on an H200 (bench/results/gpu_h200).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

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
                                                               int64_t num_queries, double scale,
                                                               std::optional<int64_t> score_block_size) {
  // the CUDA kernel sums scores per page only; token-granular scores are CPU-only for now
  TORCH_CHECK(!score_block_size.has_value() || key_cache.dim() != 4 || *score_block_size == key_cache.size(2),
              "vegas::paged_verify_attention: score_block_size must be None or the page size (",
              key_cache.size(2), ") for the CUDA kernel, got ", score_block_size.value_or(0));
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
