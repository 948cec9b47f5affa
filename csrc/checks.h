// Input validation shared by the CPU and CUDA launchers of the vegas ops.
// Every failure names the argument and what was expected.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace vegas {

// Sizes of one attention call. Tensors: q [B, Q, H_q, D]; k/v cache [B, H_kv, S, D].
struct AttnDims {
  int64_t B, Q, Hq, Hkv, S, D, group;  // group = H_q / H_kv (GQA ratio)
  // effective_block_size(block_size, S): the block length every launcher computes with
  // (same blocks, same block indices and scores as the caller's block_size).
  int64_t block_size;
};

// Overflow-safe ceil(a / b) for a >= 0, b >= 1 (block_size may be as large as INT64_MAX).
inline int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// A block longer than the cache holds the whole cache: compute with that length, so
// huge block sizes neither overflow nor allocate (block indices and scores are unchanged:
// ceil(S / block_size) = 1 either way). Shared by the CPU and CUDA launchers and applied
// before any limit check or narrowing; block_size >= 1.
inline int64_t effective_block_size(int64_t block_size, int64_t S) {
  return std::min<int64_t>(block_size, std::max<int64_t>(S, 1));
}

// Saturating arithmetic on non-negative int64 (INT64_MAX on overflow), for size limits
// that must not wrap: e.g. sat_add(sat_mul(K, block_size), S) < INT32_MAX.
inline int64_t sat_add(int64_t a, int64_t b) {
  return a > INT64_MAX - b ? INT64_MAX : a + b;
}
inline int64_t sat_mul(int64_t a, int64_t b) {
  return (a != 0 && b > INT64_MAX / a) ? INT64_MAX : a * b;
}

inline bool is_attn_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

inline void check_same_device(const char* op, const at::Tensor& ref, const char* ref_name,
                              const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on the same device as ",
              ref_name, " (", ref.device(), "), got ", t.device());
}

inline void check_int32_vector(const char* op, const at::Tensor& t, const char* name, int64_t B) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == B, op, ": ", name, " must have shape [B] = [", B,
              "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kInt, op, ": ", name, " must be int32, got ",
              t.scalar_type());
}

// Shape / dtype / device checks for (q, k_cache, v_cache, seq_lens); no reads of values.
inline AttnDims check_attention_inputs(const char* op, const at::Tensor& q,
                                       const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& seq_lens, int64_t block_size,
                                       double scale) {
  TORCH_CHECK(q.dim() == 4, op, ": q must be 4-D [B, Q, H_q, D], got shape ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4, op, ": k_cache must be 4-D [B, H_kv, S, D], got shape ",
              k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), op,
              ": v_cache must have the shape of k_cache ", k_cache.sizes(), ", got ",
              v_cache.sizes());
  TORCH_CHECK(is_attn_dtype(q.scalar_type()), op,
              ": q must be float32, bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), op, ": k_cache dtype (",
              k_cache.scalar_type(), ") must equal q dtype (", q.scalar_type(), ")");
  TORCH_CHECK(v_cache.scalar_type() == q.scalar_type(), op, ": v_cache dtype (",
              v_cache.scalar_type(), ") must equal q dtype (", q.scalar_type(), ")");
  check_same_device(op, q, "q", k_cache, "k_cache");
  check_same_device(op, q, "q", v_cache, "v_cache");
  check_same_device(op, q, "q", seq_lens, "seq_lens");
  AttnDims d;
  d.B = q.size(0);
  d.Q = q.size(1);
  d.Hq = q.size(2);
  d.D = q.size(3);
  d.Hkv = k_cache.size(1);
  d.S = k_cache.size(2);
  TORCH_CHECK(k_cache.size(0) == d.B, op, ": k_cache batch size (", k_cache.size(0),
              ") must equal q batch size (", d.B, ")");
  TORCH_CHECK(k_cache.size(3) == d.D, op, ": k_cache head_dim (", k_cache.size(3),
              ") must equal q head_dim (", d.D, ")");
  TORCH_CHECK(d.D > 0, op, ": head_dim must be positive, got ", d.D);
  TORCH_CHECK(d.Hkv > 0 && d.Hq > 0 && d.Hq % d.Hkv == 0, op,
              ": the number of query heads H_q (", d.Hq,
              ") must be a positive multiple of the number of KV heads H_kv (", d.Hkv, ")");
  TORCH_CHECK(d.Q >= 1, op, ": q must hold at least one query (Q >= 1), got Q = ", d.Q);
  TORCH_CHECK(d.Q <= d.S, op, ": Q (", d.Q, ") must not exceed the cache length S (", d.S,
              ")");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, op,
              ": k_cache and v_cache must be contiguous in head_dim (stride(-1) == 1)");
  TORCH_CHECK(block_size >= 1, op, ": block_size must be >= 1, got ", block_size);
  TORCH_CHECK(std::isfinite(scale) && scale > 0, op,
              ": scale must be a positive finite float, got ", scale);
  check_int32_vector(op, seq_lens, "seq_lens", d.B);
  d.group = d.Hq / d.Hkv;
  d.block_size = effective_block_size(block_size, d.S);
  return d;
}

// Value check of seq_lens (host copy): every length in [Q, S].
inline void check_seq_lens_values(const char* op, const int32_t* lens, const AttnDims& d) {
  for (int64_t b = 0; b < d.B; ++b) {
    TORCH_CHECK(lens[b] >= d.Q && lens[b] <= d.S, op, ": seq_lens[", b, "] = ", lens[b],
                " must lie in [Q, S] = [", d.Q, ", ", d.S, "]");
  }
}

inline void check_query_weights(const char* op, const at::Tensor& q,
                                const c10::optional<at::Tensor>& w, const AttnDims& d) {
  if (!w.has_value()) return;
  const auto& t = *w;
  TORCH_CHECK(t.dim() == 1 && t.size(0) == d.Q, op, ": query_weights must have shape [Q] = [",
              d.Q, "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": query_weights must be float32, got ",
              t.scalar_type());
  check_same_device(op, q, "q", t, "query_weights");
}

inline void check_draft_inputs(const char* op, const at::Tensor& q,
                               const at::Tensor& block_indices, const at::Tensor& tail_start,
                               const AttnDims& d) {
  TORCH_CHECK(block_indices.dim() == 3 && block_indices.size(0) == d.B &&
                  block_indices.size(1) == d.Hkv,
              op, ": block_indices must have shape [B, H_kv, K] = [", d.B, ", ", d.Hkv,
              ", K], got ", block_indices.sizes());
  TORCH_CHECK(block_indices.scalar_type() == at::kInt, op,
              ": block_indices must be int32, got ", block_indices.scalar_type());
  check_same_device(op, q, "q", block_indices, "block_indices");
  check_same_device(op, q, "q", tail_start, "tail_start");
  check_int32_vector(op, tail_start, "tail_start", d.B);
}

// Value checks of the draft inputs (host copies): tail_start in [0, seq_lens-Q], block
// indices in [-1, num_blocks), no duplicate index in a row.
inline void check_draft_values(const char* op, const int32_t* lens, const int32_t* tail,
                               const int32_t* idx, int64_t K, const AttnDims& d,
                               int64_t block_size) {
  const int64_t nblocks = ceil_div(d.S, block_size);
  std::vector<uint8_t> seen(static_cast<size_t>(nblocks), 0);
  for (int64_t b = 0; b < d.B; ++b) {
    TORCH_CHECK(tail[b] >= 0 && tail[b] <= lens[b] - d.Q, op, ": tail_start[", b, "] = ",
                tail[b], " must lie in [0, seq_lens[", b, "] - Q] = [0, ", lens[b] - d.Q, "]");
    for (int64_t g = 0; g < d.Hkv; ++g) {
      const int32_t* row = idx + (b * d.Hkv + g) * K;
      for (int64_t i = 0; i < K; ++i) {
        const int32_t j = row[i];
        TORCH_CHECK(j >= -1 && j < nblocks, op, ": block_indices[", b, ", ", g, ", ", i,
                    "] = ", j, " must be -1 (unused) or a block index in [0, ceil(S / block_size)) = [0, ",
                    nblocks, ")");
        if (j >= 0) {
          TORCH_CHECK(!seen[j], op, ": block_indices[", b, ", ", g,
                      "] holds block ", j, " twice; indices must be unique per row");
          seen[j] = 1;
        }
      }
      for (int64_t i = 0; i < K; ++i)
        if (row[i] >= 0) seen[row[i]] = 0;
    }
  }
}

inline void check_topk_inputs(const char* op, const at::Tensor& scores, const at::Tensor& k,
                              const at::Tensor& num_candidates, int64_t max_k,
                              int64_t num_sink_blocks, int64_t num_recent_blocks) {
  TORCH_CHECK(scores.dim() == 3, op, ": block_scores must be 3-D [B, H, N], got shape ",
              scores.sizes());
  TORCH_CHECK(scores.scalar_type() == at::kFloat, op, ": block_scores must be float32, got ",
              scores.scalar_type());
  check_same_device(op, scores, "block_scores", k, "k");
  check_same_device(op, scores, "block_scores", num_candidates, "num_candidates");
  check_int32_vector(op, k, "k", scores.size(0));
  check_int32_vector(op, num_candidates, "num_candidates", scores.size(0));
  TORCH_CHECK(max_k >= 0, op, ": max_k must be >= 0, got ", max_k);
  TORCH_CHECK(max_k <= (int64_t)INT32_MAX, op, ": max_k must fit in int32, got ", max_k);
  TORCH_CHECK(num_sink_blocks >= 0, op, ": num_sink_blocks must be >= 0, got ", num_sink_blocks);
  TORCH_CHECK(num_recent_blocks >= 0, op, ": num_recent_blocks must be >= 0, got ", num_recent_blocks);
}

inline void check_topk_values(const char* op, const int32_t* k, const int32_t* ncand, int64_t B) {
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(k[b] >= 0, op, ": k[", b, "] = ", k[b], " must be >= 0");
    TORCH_CHECK(ncand[b] >= 0, op, ": num_candidates[", b, "] = ", ncand[b], " must be >= 0");
  }
}

// Sizes of one paged_block_scores call: q [T, H_q, D]; key_cache [num_pages, H_kv, page_size, D]
// (any strides); block_table [R, max_pages].
struct PagedShape {
  int64_t R, T, Hq, Hkv, G, D, page_size, max_pages, num_pages;
};

// Shape / dtype / device / scalar checks of paged_block_scores (no reads of values); shared by
// the CPU and CUDA launchers, so both raise the same messages.
inline PagedShape check_paged_inputs(const char* op, const at::Tensor& q, const at::Tensor& key_cache,
                                     const at::Tensor& block_table, const at::Tensor& seq_lens,
                                     const at::Tensor& query_start_loc, int64_t num_queries,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3, op, ": q must be 3-D [T, H_q, D], got shape ", q.sizes());
  TORCH_CHECK(key_cache.dim() == 4, op,
              ": key_cache must be 4-D [num_pages, H_kv, page_size, D], got shape ",
              key_cache.sizes());
  TORCH_CHECK(is_attn_dtype(q.scalar_type()), op, ": q must be float32, bfloat16 or float16, got ",
              q.scalar_type());
  TORCH_CHECK(key_cache.scalar_type() == q.scalar_type(), op, ": key_cache dtype (",
              key_cache.scalar_type(), ") must equal q dtype (", q.scalar_type(), ")");
  check_same_device(op, q, "q", key_cache, "key_cache");
  check_same_device(op, q, "q", block_table, "block_table");
  check_same_device(op, q, "q", seq_lens, "seq_lens");
  check_same_device(op, q, "q", query_start_loc, "query_start_loc");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt, op,
              ": block_table must be int32 [R, max_pages], got ", block_table.scalar_type(), " ",
              block_table.sizes());
  const int64_t R = block_table.size(0);
  check_int32_vector(op, seq_lens, "seq_lens", R);
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == R + 1 &&
                  query_start_loc.scalar_type() == at::kInt,
              op, ": query_start_loc must be int32 of shape [R + 1] = [", R + 1, "], got ",
              query_start_loc.scalar_type(), " ", query_start_loc.sizes());
  TORCH_CHECK(q.size(2) == key_cache.size(3), op, ": key_cache head_dim (", key_cache.size(3),
              ") must equal q head_dim (", q.size(2), ")");
  const int64_t Hq = q.size(1), Hkv = key_cache.size(1);
  TORCH_CHECK(Hkv > 0 && Hq > 0 && Hq % Hkv == 0, op, ": the number of query heads H_q (", Hq,
              ") must be a positive multiple of the number of KV heads H_kv (", Hkv, ")");
  TORCH_CHECK(num_queries >= 1, op, ": num_queries must be >= 1, got ", num_queries);
  TORCH_CHECK(std::isfinite(scale) && scale > 0, op, ": scale must be a positive finite float, got ",
              scale);
  TORCH_CHECK(key_cache.size(2) >= 1, op, ": page_size (key_cache.size(2)) must be >= 1");
  return PagedShape{R, q.size(0), Hq, Hkv, Hq / Hkv, q.size(2), key_cache.size(2),
                    block_table.size(1), key_cache.size(0)};
}

// score_block_size of paged_verify_attention: tokens per score (None: page_size), >= 1.
inline int64_t paged_score_block_size(const char* op, std::optional<int64_t> score_block_size,
                                      int64_t page_size) {
  const int64_t b = score_block_size.value_or(page_size);
  TORCH_CHECK(b >= 1, op, ": score_block_size must be >= 1 (or None for page_size), got ", b);
  return b;
}

// Value checks of paged_block_scores on host copies: query_start_loc [R + 1], seq_lens [R] and
// block_table [R, max_pages] (row-major): the page ids a request with queries reads.
inline void check_paged_values(const char* op, const int32_t* qsl, const int32_t* lens,
                               const int32_t* bt, const PagedShape& s) {
  const int64_t R = s.R, P = s.max_pages, ps = s.page_size, NP = s.num_pages;
  TORCH_CHECK(qsl[0] == 0 && qsl[R] <= s.T, op, ": query_start_loc must start at 0 and end at ",
              "most at T = ", s.T, ", got [", qsl[0], " .. ", qsl[R], "]");
  for (int64_t r = 0; r < R; ++r) {
    const int64_t ql = int64_t(qsl[r + 1]) - qsl[r];
    TORCH_CHECK(ql >= 0, op, ": query_start_loc must be non-decreasing, got ", qsl[r], " then ",
                qsl[r + 1], " at request ", r);
    TORCH_CHECK(lens[r] >= ql && lens[r] <= P * ps, op, ": seq_lens[", r, "] = ", lens[r],
                " must lie in [q_len, max_pages * page_size] = [", ql, ", ", P * ps, "]");
    if (ql == 0) continue;
    for (int64_t j = 0; j < ceil_div(lens[r], ps); ++j)
      TORCH_CHECK(bt[r * P + j] >= 0 && bt[r * P + j] < NP, op, ": block_table[", r, ", ", j,
                  "] = ", bt[r * P + j], " must lie in [0, num_pages) = [0, ", NP, ")");
  }
}

// value_cache against key_cache (shape, dtype, device): the values of the same pages.
inline void check_paged_values_cache(const char* op, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK(value_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(), op,
              ": value_cache must have key_cache's shape [num_pages, H_kv, page_size, D] = ", key_cache.sizes(),
              ", got ", value_cache.sizes());
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), op, ": value_cache dtype (",
              value_cache.scalar_type(), ") must equal q dtype (", key_cache.scalar_type(), ")");
  check_same_device(op, key_cache, "key_cache", value_cache, "value_cache");
}

// token_indices [R, H_kv, K] int32 and tail_start [R] int32 of paged_sparse_draft_attention.
inline void check_paged_draft_inputs(const char* op, const at::Tensor& q, const at::Tensor& token_indices,
                                     const at::Tensor& tail_start, const PagedShape& s) {
  check_same_device(op, q, "q", token_indices, "token_indices");
  check_same_device(op, q, "q", tail_start, "tail_start");
  TORCH_CHECK(token_indices.dim() == 3 && token_indices.size(0) == s.R && token_indices.size(1) == s.Hkv &&
                  token_indices.scalar_type() == at::kInt,
              op, ": token_indices must be int32 [R, H_kv, K] = [", s.R, ", ", s.Hkv, ", K], got ",
              token_indices.scalar_type(), " ", token_indices.sizes());
  check_int32_vector(op, tail_start, "tail_start", s.R);
}

// Values of paged_sparse_draft_attention (after check_paged_values): tail_start[r] in
// [0, seq_lens[r] - q_len] for a request with queries; each token_indices row holds strictly
// ascending tokens >= 0, then -1 padding only.
inline void check_paged_draft_values(const char* op, const int32_t* qsl, const int32_t* lens, const int32_t* idx,
                                     const int32_t* tail, int64_t K, const PagedShape& s) {
  for (int64_t r = 0; r < s.R; ++r) {
    const int64_t ql = int64_t(qsl[r + 1]) - qsl[r];
    if (ql == 0) continue;
    TORCH_CHECK(tail[r] >= 0 && tail[r] <= lens[r] - ql, op, ": tail_start[", r, "] = ", tail[r],
                " must lie in [0, seq_lens - q_len] = [0, ", lens[r] - ql, "]");
    for (int64_t g = 0; g < s.Hkv; ++g) {
      const int32_t* row = idx + (r * s.Hkv + g) * K;
      for (int64_t k = 0; k < K; ++k) {
        const bool pad_ok = row[k] == -1 && (k + 1 == K || row[k + 1] == -1);
        const bool asc_ok = row[k] >= 0 && (k + 1 == K || row[k + 1] == -1 || row[k + 1] > row[k]);
        TORCH_CHECK(pad_ok || asc_ok, op, ": token_indices[", r, ", ", g, "] must hold strictly ascending ",
                    "tokens >= 0 then -1 padding, got ", row[k], " at ", k,
                    k + 1 < K ? " before " : "", k + 1 < K ? std::to_string(row[k + 1]) : std::string());
      }
    }
  }
}

}  // namespace vegas
