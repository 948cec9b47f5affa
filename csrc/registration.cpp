// The one place where the vegas ops' schemas live.
//
// Kernels: csrc/cpu/<op>.cpp (TORCH_LIBRARY_IMPL(vegas, CPU, m)) and
//          csrc/cuda/<op>.cu (TORCH_LIBRARY_IMPL(vegas, CUDA, m)).
// Fake (meta) kernels and typed wrappers: python/vegas_ext/ops.py.
// Plain-PyTorch references: python/vegas_ext/reference.py.
// Method: Vegas, "Self-Speculative Decoding with Verification-Guided Sparse
// Attention", arXiv 2602.07223.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// A bare module: importing vegas_ext._C runs the static registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",
      "vegas_ext compiled ops (torch.ops.vegas.*)",
      -1,
      nullptr,
  };
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(vegas, m) {
  // Verification attention over the whole KV cache, with the attention mass of
  // every KV block reduced inside the kernel (Vegas's selection signal).
  m.def(
      "verify_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seq_lens, int block_size, "
      "float scale, Tensor? query_weights=None) -> (Tensor out, Tensor lse, Tensor block_scores)");
  // Per-(row, head) top-k of block scores, sink blocks first and the most recent candidates
  // always, ascending output, -1 padding.
  m.def(
      "block_topk(Tensor block_scores, Tensor k, Tensor num_candidates, int max_k, "
      "int num_sink_blocks, int num_recent_blocks=0) -> Tensor");
  // Draft attention over the selected blocks (before the tail) plus the whole tail.
  m.def(
      "sparse_draft_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_indices, "
      "Tensor tail_start, Tensor seq_lens, int block_size, float scale) -> Tensor");
  // Quest (arXiv 2406.10774), the query-aware rival selection: per-block key-wise min / max
  // kept up to date in place, and the upper bound of q.k per block from them.
  m.def(
      "block_minmax_update(Tensor(a!) key_min, Tensor(b!) key_max, Tensor k_cache, "
      "Tensor seq_lens, Tensor start, int block_size) -> ()");
  m.def("quest_block_scores(Tensor q, Tensor key_min, Tensor key_max, Tensor num_blocks) -> Tensor");
  // Attention mass per page of a paged KV cache (vLLM's layout) from the newest queries of
  // each request: the Vegas selection signal where the engine's attention kernel returns none.
  m.def(
      "paged_block_scores(Tensor q, Tensor key_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, int num_queries, float scale) -> Tensor");
  // paged_block_scores' page scores together with the attention output of every query, in one
  // pass over the paged cache (Vegas's verification inside a paged engine); score_block_size
  // (default: the page size) sets the tokens per score, 1 for token-granular selection.
  m.def(
      "paged_verify_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_table, "
      "Tensor seq_lens, Tensor query_start_loc, int num_queries, float scale, "
      "int? score_block_size=None) -> (Tensor out, Tensor block_scores)");
  // Draft attention over a paged cache at token granularity: each query head attends to its KV
  // head's selected tokens before tail_start (block size 1) plus the whole tail, causally.
  m.def(
      "paged_sparse_draft_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_table, "
      "Tensor seq_lens, Tensor query_start_loc, Tensor token_indices, Tensor tail_start, float scale) -> "
      "Tensor");
  // y = x . W^T (+ bias) on fp32 rows against fp16 or int8 weights (group scales), fp32 sums:
  // the low-precision linears of Vegas's draft forwards (python/vegas_ext/draft_weights.py).
  m.def(
      "weight_only_linear(Tensor x, Tensor weight, Tensor? scales=None, Tensor? bias=None, "
      "int group_size=64) -> Tensor");
  // RoPE ("rotate_half" layout) on a layer's new queries and keys, and the write of the rotated
  // keys and the values into the KV cache at per-row positions; returns the rotated queries
  // [B, Q, H_q, D] (contiguous). The lean draft forward's per-layer step (draft_forward.py).
  m.def(
      "rope_kv_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor write_pos) -> Tensor");
  // x += residual (in place, when given), then RMSNorm: weight * x / sqrt(mean(x^2) + eps) over
  // the last dimension, in float32; returns the normed rows (x's shape and dtype).
  m.def("add_rms_norm(Tensor(a!) x, Tensor? residual, Tensor weight, float eps) -> Tensor");
  // silu(gate_up[..., :I]) * gate_up[..., I:] of a fused gate/up projection [..., 2 * I] -> [..., I].
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}
