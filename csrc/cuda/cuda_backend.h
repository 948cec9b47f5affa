// The CUDA backend of csrc/cuda/ops_host.h: current stream (so CUDA graphs capture the
// launches), launch-error checks, opt-in shared memory above 48 KiB. Nothing here
// synchronizes with the device by default: the value checks that copy seq_lens /
// tail_start / block indices / k / num_candidates (/ query_start_loc, seq_lens and
// block_table of paged_block_scores) to the host run only with
// VEGAS_CUDA_VALUE_CHECKS=1 (a debugging aid: one blocking copy per checked tensor) and
// never while the stream is capturing a CUDA graph; otherwise the kernels' device-side
// guards apply (ops_host.h). VEGAS_CUDA_FORCE_SIMT=1 uses the SIMT kernels even where
// the tensor-core ones apply (for testing both paths on one GPU).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cuda/ops_host.h"

namespace vegas {
namespace cuda {

struct CudaBackend {
  cudaStream_t stream;
  bool capturing;
  explicit CudaBackend(const at::Tensor& t)
      : stream(c10::cuda::getCurrentCUDAStream(t.get_device()).stream()),
        capturing(c10::cuda::currentStreamCaptureStatusMayInitCtx() !=
                  c10::cuda::CaptureStatus::None) {}

  bool value_checks() const { return !capturing && value_checks_requested(); }
  bool force_simt() const { return env_flag("VEGAS_CUDA_FORCE_SIMT", false); }
  // A device attribute of the current device, looked up once per device and attribute slot.
  template <int Slot>
  static int cached_attr(cudaDeviceAttr attr) {
    static std::atomic<int> cache[64];
    int dev = 0;
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    if (dev < 0 || dev >= 64) return query_attr(dev, attr);
    int n = cache[dev].load(std::memory_order_relaxed);
    if (n == 0) {
      n = query_attr(dev, attr);
      cache[dev].store(n, std::memory_order_relaxed);
    }
    return n;
  }
  static int query_attr(int dev, cudaDeviceAttr attr) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, attr, dev));
    return n;
  }
  int num_sms() const { return cached_attr<0>(cudaDevAttrMultiProcessorCount); }
  // shared memory per multiprocessor (bytes): resident CTAs in the attention launch plan
  int64_t smem_per_sm() const { return cached_attr<1>(cudaDevAttrMaxSharedMemoryPerMultiprocessor); }
  // largest dynamic shared memory one CTA may opt in to (bytes): block_topk's key cache
  int64_t smem_optin() const { return cached_attr<2>(cudaDevAttrMaxSharedMemoryPerBlockOptin); }
  int min_tiles_per_split() const { return kMinTilesPerSplit; }
  int paged_chunk_tokens() const { return kPagedChunkTokens; }
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
