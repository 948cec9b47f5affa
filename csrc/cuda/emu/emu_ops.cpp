// Host-C++ build of the vegas CUDA kernels against the software emulation
// (emu_runtime.h), exposing the three ops on CPU tensors so tests can compare the
// kernels' logic -- tensor-core and SIMT paths, splits, block-score slots, top-k
// radix select -- with the PyTorch references without a GPU. Built on demand by
// tests/test_cuda_ops.py (torch.utils.cpp_extension.load). The host logic is the same
// ops_host.h the CUDA launchers use; only the backend differs.
#include <torch/extension.h>

#include "cuda/ops_host.h"

namespace {

using vegas::cuda::Grid3;

struct EmuBackend {
  bool simt = false;
  int sms = 4;
  bool checks = true;
  int min_tiles = 1;
  int min_tiles_per_split() const { return min_tiles; }
  bool value_checks() const { return checks; }
  bool force_simt() const { return simt; }
  int num_sms() const { return sms; }
  at::Tensor to_host(const at::Tensor& t) const { return t.to(at::kCPU); }
  template <class... KArgs, class... Args>
  void launch(void (*kernel)(KArgs...), Grid3 grid, int threads, size_t smem, Args... args) {
    TORCH_CHECK(grid.y <= 65535 && grid.z <= 65535, "emu: grid.y / grid.z above CUDA's limit");
    TORCH_CHECK(threads <= 1024, "emu: more than 1024 threads");
    TORCH_CHECK(smem <= 227 * 1024, "emu: dynamic shared memory above sm90's 227 KiB: ", smem);
    vegas_emu::launch(vegas_emu::Dim3{unsigned(grid.x), unsigned(grid.y), unsigned(grid.z)},
                      vegas_emu::Dim3{unsigned(threads), 1, 1}, smem,
                      [&] { kernel(args...); });
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_attention_emu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seq_lens,
    int64_t block_size, double scale, const c10::optional<at::Tensor>& qw, bool simt,
    int64_t sms, bool checks, int64_t min_tiles) {
  EmuBackend be{simt, int(sms), checks, int(min_tiles)};
  return vegas::cuda::verify_attention_impl(be, q, k, v, seq_lens, block_size, scale, qw);
}

at::Tensor sparse_draft_attention_emu(const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const at::Tensor& idx,
                                      const at::Tensor& tail, const at::Tensor& seq_lens,
                                      int64_t block_size, double scale, bool simt, int64_t sms,
                                      bool checks, int64_t min_tiles) {
  EmuBackend be{simt, int(sms), checks, int(min_tiles)};
  return vegas::cuda::sparse_draft_attention_impl(be, q, k, v, idx, tail, seq_lens, block_size,
                                                  scale);
}

at::Tensor block_topk_emu(const at::Tensor& scores, const at::Tensor& k, const at::Tensor& nc,
                          int64_t max_k, int64_t sinks, bool checks) {
  EmuBackend be{false, 4, checks};
  return vegas::cuda::block_topk_impl(be, scores, k, nc, max_k, sinks);
}

bool mma_path(const at::Tensor& q, const at::Tensor& k) {
  const auto dt = q.scalar_type();
  const int64_t D = q.size(-1);
  return (dt == at::kBFloat16 || dt == at::kHalf) && (D == 64 || D == 80 || D == 96 || D == 128) &&
         vegas::cuda::rows_16b_aligned(k);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("verify_attention", &verify_attention_emu);
  m.def("sparse_draft_attention", &sparse_draft_attention_emu);
  m.def("block_topk", &block_topk_emu);
  m.def("mma_path", &mma_path);
}
