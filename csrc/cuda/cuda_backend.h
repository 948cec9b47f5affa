// The CUDA backend of csrc/cuda/ops_host.h: current stream (so CUDA graphs capture the
// launches), launch-error checks, opt-in shared memory above 48 KiB, and the value
// checks that copy seq_lens / tail_start / block indices / k to the host -- skipped
// while the stream is capturing a CUDA graph (a device->host copy would break the
// capture); the kernels then clamp or mask out-of-range values instead of reading out
// of bounds. VEGAS_CUDA_VALUE_CHECKS=0 skips those copies (and their host sync) always.
// VEGAS_CUDA_FORCE_SIMT=1 uses the SIMT kernels even where the tensor-core ones apply
// (for testing both paths on one GPU).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdlib>
#include <cstring>

#include "cuda/ops_host.h"

namespace vegas {
namespace cuda {

inline bool env_flag(const char* name, bool dflt) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return dflt;
  return !(std::strcmp(v, "0") == 0 || std::strcmp(v, "false") == 0 || std::strcmp(v, "no") == 0);
}

struct CudaBackend {
  cudaStream_t stream;
  bool capturing;
  explicit CudaBackend(const at::Tensor& t)
      : stream(c10::cuda::getCurrentCUDAStream(t.get_device()).stream()),
        capturing(c10::cuda::currentStreamCaptureStatusMayInitCtx() !=
                  c10::cuda::CaptureStatus::None) {}

  bool value_checks() const { return !capturing && env_flag("VEGAS_CUDA_VALUE_CHECKS", true); }
  bool force_simt() const { return env_flag("VEGAS_CUDA_FORCE_SIMT", false); }
  int num_sms() const {
    int dev = 0, n = 0;
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }
  int min_tiles_per_split() const { return kMinTilesPerSplit; }
  at::Tensor to_host(const at::Tensor& t) const { return t.to(at::kCPU); }

  template <class... KArgs, class... Args>
  void launch(void (*kernel)(KArgs...), Grid3 grid, int threads, size_t smem, Args... args) {
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    }
    const dim3 g(static_cast<unsigned>(grid.x), static_cast<unsigned>(grid.y),
                 static_cast<unsigned>(grid.z));
    kernel<<<g, threads, smem, stream>>>(args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace cuda
}  // namespace vegas
