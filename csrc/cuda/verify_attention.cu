// CUDA launcher of vegas::verify_attention (TORCH_LIBRARY_IMPL(vegas, CUDA)). Kernels:
// verify_attention_kernel.cuh / attention_kernel.cuh; host logic: ops_host.h.
// STATUS: compiled for sm80 / sm90, emulator-checked; ran on an H200 (bench/results/gpu_h200)
// before the small-batch split plan and merge kernel (emulator-checked, not yet on a GPU).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/cuda_backend.h"

namespace vegas {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_attention_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& seq_lens, int64_t block_size, double scale,
    const c10::optional<at::Tensor>& query_weights) {
  const c10::cuda::CUDAGuard guard(q.device());
  CudaBackend be(q);
  return verify_attention_impl(be, q, k_cache, v_cache, seq_lens, block_size, scale,
                               query_weights);
}

}  // namespace
}  // namespace cuda
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CUDA, m) {
  m.impl("verify_attention", &vegas::cuda::verify_attention_cuda);
}
