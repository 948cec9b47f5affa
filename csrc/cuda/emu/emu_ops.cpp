// Host-C++ build of the vegas CUDA kernels against the software emulation
// (emu_runtime.h), exposing the CUDA ops (verify / draft attention, top-k, paged block
// scores) on CPU tensors so tests can compare the
// kernels' logic -- tensor-core and SIMT paths, splits, block-score slots, top-k
// radix select -- with the PyTorch references without a GPU. Built on demand by
// tests/test_cuda_ops.py (torch.utils.cpp_extension.load). The host logic is the same
// ops_host.h the CUDA launchers use; only the backend differs.
#include <torch/extension.h>

#include "cuda/ops_host.h"
#include "cuda/paged_verify_attention_kernel.cuh"

namespace {

using vegas::cuda::Grid3;

// Device-to-host copies made by the host logic (each one a blocking sync on a GPU).
int64_t g_host_copies = 0;

struct EmuBackend {
  bool simt = false;
  int sms = 4;
  int checks = -1;  // 1 / 0: value checks on / off; -1: as on CUDA (VEGAS_CUDA_VALUE_CHECKS)
  int min_tiles = 1;
  int chunk_tokens = vegas::cuda::kPagedChunkTokens;
  int64_t smem_sm = vegas::cuda::kDefaultSmemPerSm;
  int64_t optin = 227 * 1024;  // sm_90's per-CTA maximum; tests lower it (block_topk key cache)
  int64_t smem_per_sm() const { return smem_sm; }
  int64_t smem_optin() const { return optin; }
  int min_tiles_per_split() const { return min_tiles; }
  int paged_chunk_tokens() const { return chunk_tokens; }
  bool value_checks() const {
    return checks < 0 ? vegas::cuda::value_checks_requested() : checks != 0;
  }
  bool force_simt() const { return simt; }
  int num_sms() const { return sms; }
  at::Tensor to_host(const at::Tensor& t) const {
    ++g_host_copies;
    return t.to(at::kCPU);
  }
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
    int64_t sms, int64_t checks, int64_t min_tiles) {
  EmuBackend be{simt, int(sms), int(checks), int(min_tiles)};
  return vegas::cuda::verify_attention_impl(be, q, k, v, seq_lens, block_size, scale, qw);
}

at::Tensor sparse_draft_attention_emu(const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const at::Tensor& idx,
                                      const at::Tensor& tail, const at::Tensor& seq_lens,
                                      int64_t block_size, double scale, bool simt, int64_t sms,
                                      int64_t checks, int64_t min_tiles) {
  EmuBackend be{simt, int(sms), int(checks), int(min_tiles)};
  return vegas::cuda::sparse_draft_attention_impl(be, q, k, v, idx, tail, seq_lens, block_size,
                                                  scale);
}

at::Tensor block_topk_emu(const at::Tensor& scores, const at::Tensor& k, const at::Tensor& nc,
                          int64_t max_k, int64_t sinks, int64_t checks, int64_t recent) {
  EmuBackend be{false, 4, int(checks)};
  return vegas::cuda::block_topk_impl(be, scores, k, nc, max_k, sinks, recent);
}

// block_topk with a CTA shared-memory limit of `optin` bytes: only the first
// topk_cache_keys(N, optin) keys of a row are cached, the rest re-read from global memory.
at::Tensor block_topk_optin_emu(const at::Tensor& scores, const at::Tensor& k,
                                const at::Tensor& nc, int64_t max_k, int64_t sinks,
                                int64_t optin) {
  EmuBackend be{false, 4, 0};
  be.optin = optin;
  return vegas::cuda::block_topk_impl(be, scores, k, nc, max_k, sinks, 0);
}

int64_t topk_cache_keys(int64_t n, int64_t optin) { return vegas::cuda::topk_cache_keys(n, optin); }

at::Tensor paged_block_scores_emu(const at::Tensor& q, const at::Tensor& key_cache,
                                  const at::Tensor& block_table, const at::Tensor& seq_lens,
                                  const at::Tensor& query_start_loc, int64_t num_queries,
                                  double scale, int64_t chunk_tokens, int64_t sms, int64_t checks) {
  EmuBackend be{false, int(sms), int(checks)};
  be.chunk_tokens = int(chunk_tokens);
  return vegas::cuda::paged_block_scores_impl(be, q, key_cache, block_table, seq_lens,
                                              query_start_loc, num_queries, scale);
}

std::tuple<at::Tensor, at::Tensor> paged_verify_attention_emu(
    const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& bt,
    const at::Tensor& seq_lens, const at::Tensor& qsl, int64_t num_queries, double scale,
    int64_t chunk_tokens, int64_t checks) {
  EmuBackend be{false, 4, int(checks)};
  return vegas::cuda::paged_verify_attention_impl(be, q, kc, vc, bt, seq_lens, qsl, num_queries,
                                                  scale, chunk_tokens);
}

// The launch plan of paged_block_scores: (pages per chunk, chunks, rows_cap, rows per pass,
// workspace bytes, 16-byte key loads).
std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool> paged_plan(
    const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& block_table,
    int64_t num_queries, int64_t chunk_tokens) {
  const int64_t Hkv = key_cache.size(1);
  const auto pl = vegas::cuda::plan_paged(block_table.size(0), Hkv, q.size(1) / Hkv, q.size(0),
                                          block_table.size(1), key_cache.size(2), num_queries,
                                          chunk_tokens);
  return {pl.ppc, pl.nchunks, pl.rows_cap, pl.rpt, pl.workspace_bytes(),
          vegas::cuda::paged_keys_vectorizable(key_cache)};
}

bool mma_path(const at::Tensor& q, const at::Tensor& k) {
  const bool al = vegas::cuda::rows_16b_aligned(k);
  return vegas::cuda::mma_applies(q.scalar_type(), q.size(-1), al, al);
}

int64_t workspace_bytes(const std::string& op, int64_t B, int64_t Q, int64_t Hq, int64_t Hkv,
                        int64_t D, int64_t S, int64_t block_size, int64_t K,
                        at::ScalarType dtype, bool aligned, int64_t sms, int64_t min_tiles,
                        int64_t smem_per_sm) {
  return vegas::cuda::attention_workspace_bytes(op, B, Q, Hq, Hkv, D, S, block_size, K, dtype,
                                                aligned, int(sms), int(min_tiles), smem_per_sm);
}

// The launch plan of one attention call: (nsplit, CTAs per SM assumed, main-kernel CTAs,
// merge CTAs, kernel launches).
std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> attn_plan(
    const std::string& op, int64_t B, int64_t Q, int64_t Hq, int64_t Hkv, int64_t D, int64_t S,
    int64_t block_size, int64_t K, at::ScalarType dtype, bool aligned, int64_t sms,
    int64_t min_tiles, int64_t smem_per_sm) {
  vegas::AttnDims d{B, Q, Hq, Hkv, S, D, Hq / Hkv, vegas::effective_block_size(block_size, S)};
  const bool mma = vegas::cuda::mma_applies(dtype, D, aligned, aligned);
  const bool verify = op == "verify_attention";
  const auto p = vegas::cuda::plan_attention(d, K, verify, mma, int(c10::elementSize(dtype)),
                                             int(sms), int(min_tiles), smem_per_sm);
  return {p.nsplit, p.ctas_per_sm, B * Hkv * p.nz * p.nsplit, B * Hkv * p.merge_chunks,
          verify ? 3 : 2};
}

// How verify_attention gets its block scores for these sizes: "slots" or "score_pass".
std::string score_mode(int64_t B, int64_t Q, int64_t Hq, int64_t Hkv, int64_t D, int64_t S,
                       int64_t block_size, at::ScalarType dtype, bool aligned) {
  vegas::AttnDims d{B, Q, Hq, Hkv, S, D, Hq / Hkv, vegas::effective_block_size(block_size, S)};
  const bool mma = vegas::cuda::mma_applies(dtype, D, aligned, aligned);
  const auto p = vegas::cuda::plan_attention(d, 0, true, mma, int(c10::elementSize(dtype)), 4, 1);
  return p.scores == vegas::cuda::ScoreMode::kSlots ? "slots" : "score_pass";
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("verify_attention", &verify_attention_emu);
  m.def("sparse_draft_attention", &sparse_draft_attention_emu);
  m.def("block_topk", &block_topk_emu, "", pybind11::arg("scores"), pybind11::arg("k"),
        pybind11::arg("num_candidates"), pybind11::arg("max_k"), pybind11::arg("sinks"), pybind11::arg("checks"),
        pybind11::arg("recent") = 0);
  m.def("paged_block_scores", &paged_block_scores_emu);
  m.def("paged_plan", &paged_plan);
  m.def("paged_verify_attention", &paged_verify_attention_emu);
  m.def("mma_path", &mma_path);
  m.def("workspace_bytes", &workspace_bytes);
  m.def("attn_plan", &attn_plan);
  m.def("block_topk_optin", &block_topk_optin_emu);
  m.def("topk_cache_keys", &topk_cache_keys);
  m.def("score_mode", &score_mode);
  m.def("host_copies", [] { return g_host_copies; });
}
