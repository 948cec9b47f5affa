// Host side of the vegas CUDA ops: input checks, launch plan, workspace, kernel choice
// and launches, written once against a small "backend" interface so the same code runs
// with the real CUDA backend (csrc/cuda/cuda_backend.h, used by the TORCH_LIBRARY_IMPL
// launchers) and with the software emulation backend (csrc/cuda/emu/emu_ops.cpp).
//
// Backend interface:
//   bool value_checks();          // run the checks that copy values to the host (a sync)
//   bool force_simt();            // use the SIMT kernels even where mma applies
//   int num_sms();
//   int64_t smem_per_sm();        // shared memory per multiprocessor, bytes (launch plan)
//   int min_tiles_per_split();    // kMinTilesPerSplit; the emulation lowers it to test splits
//   int paged_chunk_tokens();     // kPagedChunkTokens; the emulation lowers it to test chunks
//   at::Tensor to_host(const at::Tensor&);
//   void launch(kernel, Grid3 grid, int threads, size_t smem, args...);
//
// Where the checks run. Shapes, dtypes, devices, strides and the scalar arguments are
// checked here on the host from tensor metadata (no device access, every call). Values
// held in device tensors (seq_lens, tail_start, block_indices, k, num_candidates) are
// checked on the host only when value_checks() is on -- off by default on CUDA
// (VEGAS_CUDA_VALUE_CHECKS=1 turns them on, never during CUDA-graph capture), since each
// check is a blocking device-to-host copy. Without them the kernels guard on the device
// and never read outside the cache: a row whose seq_lens is outside [Q, S] (or, for the
// draft, whose tail_start is outside [0, seq_lens - Q]) gets NaN in all its outputs
// (out, lse, block_scores); block indices outside [0, ceil(S / block_size)) select
// nothing; a block index repeated in a row is attended twice (only the host check sees
// it); block_topk clamps negative k / num_candidates to 0; paged_block_scores gives NaN pages
// to a request whose query_start_loc pair or seq_len is out of range, and NaN scores (never a
// read) to the tokens of a page id outside [0, num_pages) (paged_block_scores_kernel.cuh).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>

#include "checks.h"
#include "cuda/attention_params.h"
#include "cuda/block_topk_kernel.cuh"
#include "cuda/paged_block_scores_kernel.cuh"
#include "cuda/sparse_draft_attention_kernel.cuh"
#include "cuda/verify_attention_kernel.cuh"

namespace vegas {
namespace cuda {

struct Grid3 {
  int64_t x, y, z;
};

inline bool rows_16b_aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 &&
         t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0;
}

inline bool env_flag(const char* name, bool dflt) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return dflt;
  return !(std::strcmp(v, "0") == 0 || std::strcmp(v, "false") == 0 || std::strcmp(v, "no") == 0);
}

// The host-side value checks (device-to-host copies) run only when asked for.
inline bool value_checks_requested() { return env_flag("VEGAS_CUDA_VALUE_CHECKS", false); }

// Index-width limits of the kernels (int32 positions), on the effective block size
// d.block_size and in saturating arithmetic, so no size can wrap past a check.
inline void check_cuda_limits(const char* op, const AttnDims& d, int64_t K) {
  const int64_t bs = d.block_size;
  TORCH_CHECK(d.D <= 256, op, ": head_dim must be <= 256 for the CUDA kernels, got ", d.D);
  TORCH_CHECK(sat_add(sat_add(d.S, sat_mul(2, bs)), kMmaTile) < INT32_MAX, op,
              ": S + 2 * min(block_size, S) must be below 2^31 - 64 for the CUDA kernels, got S = ",
              d.S, ", block_size = ", bs);
  TORCH_CHECK(sat_add(sat_add(sat_mul(K, bs), d.S), kMmaTile) < INT32_MAX, op,
              ": K * min(block_size, S) + S must be below 2^31 - 64 for the CUDA kernels, got K = ",
              K, ", block_size = ", bs, ", S = ", d.S);
  TORCH_CHECK(sat_mul(d.B, d.Hkv) < INT32_MAX && sat_mul(sat_mul(d.B, d.Q), d.Hq) < INT32_MAX, op,
              ": batch x heads too large for the CUDA kernels");
  TORCH_CHECK(sat_mul(d.Q, d.group) <= 65535LL * 16, op, ": Q * (H_q / H_kv) = ",
              sat_mul(d.Q, d.group), " rows per KV head exceed the CUDA kernels' limit of ",
              65535LL * 16);
}

template <typename T, class Map>
using AttnKernel = void (*)(AttnParams);

template <typename T, class Map>
AttnKernel<T, Map> pick_mma_kernel(int64_t D) {
  if constexpr (sizeof(T) == 2) {
    switch (D) {
      case 64: return &attn_mma_kernel<T, 64, Map>;
      case 80: return &attn_mma_kernel<T, 80, Map>;
      case 96: return &attn_mma_kernel<T, 96, Map>;
      case 128: return &attn_mma_kernel<T, 128, Map>;
      default: return nullptr;
    }
  } else {
    (void)D;
    return nullptr;
  }
}

template <typename T>
using ScoreKernel = void (*)(ScoreParams);

template <typename T>
ScoreKernel<T> pick_score_kernel(bool mma, int64_t D) {
  if constexpr (sizeof(T) == 2) {
    if (mma) {
      switch (D) {
        case 64: return &block_scores_mma_kernel<T, 64>;
        case 80: return &block_scores_mma_kernel<T, 80>;
        case 96: return &block_scores_mma_kernel<T, 96>;
        case 128: return &block_scores_mma_kernel<T, 128>;
        default: return nullptr;
      }
    }
  }
  (void)D;
  return mma ? nullptr : &block_scores_simt_kernel<T>;
}

inline bool mma_applies(at::ScalarType dt, int64_t D, bool k_aligned, bool v_aligned) {
  return (dt == at::kBFloat16 || dt == at::kHalf) && (D == 64 || D == 80 || D == 96 || D == 128) &&
         k_aligned && v_aligned;
}

// The launch plan of one attention call (verify: K = 0, with_scores; draft: K selected
// blocks). Depends on shapes, dtype, kernel path and the device's SM count and shared
// memory per SM only.
inline AttnPlan plan_attention(const AttnDims& d, int64_t K, bool with_scores, bool mma,
                               int esize, int num_sms, int min_tiles,
                               int64_t smem_per_sm = kDefaultSmemPerSm) {
  const int64_t R = d.Q * d.group;
  const int64_t vmax = with_scores ? d.S : K * d.block_size + d.S;
  return make_attn_plan(d.B, d.Hkv, R, d.D, d.S, vmax, d.block_size, mma, with_scores, esize,
                        num_sms, min_tiles, smem_per_sm);
}

// Shared by verify (Map = VerifyMap) and the draft (Map = DraftMap). Every size comes
// from d (block size already clamped: d.block_size <= S).
template <class Map, class Backend>
void run_attention(Backend& be, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& lens, const AttnDims& d, double scale,
                   const int32_t* block_indices, const int32_t* tail_start, int64_t K,
                   at::Tensor& out, float* lse, float* block_scores, const float* qw) {
  const int64_t R = d.Q * d.group;
  const int64_t bs = d.block_size;
  const int64_t nblocks = ceil_div(d.S, bs);
  const at::ScalarType dt = q.scalar_type();
  const bool mma_ok =
      mma_applies(dt, d.D, rows_16b_aligned(k), rows_16b_aligned(v)) && !be.force_simt();
  const AttnPlan plan = plan_attention(d, K, Map::kBlockScores, mma_ok,
                                       static_cast<int>(q.element_size()), be.num_sms(),
                                       be.min_tiles_per_split(), be.smem_per_sm());
  TORCH_INTERNAL_ASSERT(plan.np >= 1 && plan.np <= kMaxSplits);
  at::Tensor ws = at::empty({plan.workspace_bytes() / 4}, q.options().dtype(at::kFloat));
  float* wp = ws.data_ptr<float>();
  const bool slots = plan.scores == ScoreMode::kSlots;

  AttnParams a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.k_sb = k.stride(0);
  a.k_sh = k.stride(1);
  a.k_st = k.stride(2);
  a.v_sb = v.stride(0);
  a.v_sh = v.stride(1);
  a.v_st = v.stride(2);
  a.seq_lens = lens.data_ptr<int32_t>();
  a.B = static_cast<int>(d.B);
  a.Q = static_cast<int>(d.Q);
  a.Hq = static_cast<int>(d.Hq);
  a.Hkv = static_cast<int>(d.Hkv);
  a.G = static_cast<int>(d.group);
  a.S = static_cast<int>(d.S);
  a.D = static_cast<int>(d.D);
  a.R = static_cast<int>(R);
  a.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  a.block_size = static_cast<int>(bs);
  a.nblocks = static_cast<int>(nblocks);
  a.block_indices = block_indices;
  a.tail_start = tail_start;
  a.K = static_cast<int>(K);
  fill_plan(a, plan);
  a.part_m = wp;
  a.part_l = wp + plan.n_part_ml;
  a.part_o = wp + 2 * plan.n_part_ml;
  a.slots = slots ? wp + 2 * plan.n_part_ml + plan.n_part_o : nullptr;
  float* lse2 = wp + 2 * plan.n_part_ml + plan.n_part_o + plan.n_slots;

  CombineParams c{};
  c.tail_start = tail_start;
  c.part_m = a.part_m;
  c.part_l = a.part_l;
  c.part_o = a.part_o;
  c.slots = a.slots;
  c.out = out.data_ptr();
  c.lse = lse;
  c.block_scores = slots ? block_scores : nullptr;
  c.query_weights = qw;
  c.seq_lens = a.seq_lens;
  c.B = a.B;
  c.Q = a.Q;
  c.Hq = a.Hq;
  c.Hkv = a.Hkv;
  c.G = a.G;
  c.R = a.R;
  c.D = a.D;
  c.S = a.S;
  c.np = plan.np;
  c.block_size = a.block_size;
  c.nblocks = a.nblocks;
  c.spt = plan.spt;
  c.nsub = plan.nsub;

  ScoreParams sp{};
  if (plan.scores == ScoreMode::kScorePass) {
    sp.q = a.q;
    sp.k = a.k;
    sp.k_sb = a.k_sb;
    sp.k_sh = a.k_sh;
    sp.k_st = a.k_st;
    sp.seq_lens = a.seq_lens;
    sp.lse2 = lse2;
    sp.query_weights = qw;
    sp.block_scores = block_scores;
    sp.B = a.B;
    sp.Q = a.Q;
    sp.Hq = a.Hq;
    sp.Hkv = a.Hkv;
    sp.G = a.G;
    sp.S = a.S;
    sp.D = a.D;
    sp.R = a.R;
    sp.rpad = plan.sc_rpad;
    sp.scale_log2 = a.scale_log2;
    sp.block_size = a.block_size;
    sp.nblocks = a.nblocks;
    sp.min_bpc = plan.sc_min_bpc;
  }

  const Grid3 grid{d.B * d.Hkv, plan.nsplit, plan.nz};
  const int threads = 32 * plan.warps;
  auto go = [&](auto tag) {
    using T = decltype(tag);
    AttnKernel<T, Map> kern =
        plan.mma ? pick_mma_kernel<T, Map>(d.D) : &attn_simt_kernel<T, Map>;
    TORCH_INTERNAL_ASSERT(kern != nullptr);
    // 2 or 3 launches: main loop, merge (lse + out), block scores (score pass or slots)
    be.launch(kern, grid, threads, plan.smem, a);
    be.launch(&attn_merge_kernel<T>, Grid3{d.B * d.Hkv, plan.merge_chunks, 1}, 32 * kMergeRows,
              plan.merge_smem, c, lse2);
    if (plan.scores == ScoreMode::kScorePass) {
      ScoreKernel<T> sk = pick_score_kernel<T>(plan.mma, d.D);
      TORCH_INTERNAL_ASSERT(sk != nullptr);
      be.launch(sk, Grid3{d.B * d.Hkv, plan.sc_chunks, 1}, kScoreThreads, plan.sc_smem, sp);
    } else if (slots) {
      be.launch(&attn_slot_scores_kernel, Grid3{d.B * d.Hkv, plan.combine_chunks, 1},
                plan.combine_threads, 0, c, static_cast<const float*>(lse2));
    }
  };
  switch (dt) {
    case at::kFloat: go(float{}); break;
    case at::kBFloat16: go(bf16_t{}); break;
    case at::kHalf: go(half_t{}); break;
    default: TORCH_CHECK(false, "vegas CUDA attention: unsupported dtype ", dt);
  }
}

// Workspace bytes of one call (the at::empty in run_attention), from shapes only: for
// tests, benchmarks and capacity planning. op: "verify_attention" or
// "sparse_draft_attention"; K: selected blocks (draft); block_size as passed (clamped here).
inline int64_t attention_workspace_bytes(const std::string& op, int64_t B, int64_t Q, int64_t Hq,
                                         int64_t Hkv, int64_t D, int64_t S, int64_t block_size,
                                         int64_t K, at::ScalarType dt, bool aligned, int num_sms,
                                         int min_tiles = kMinTilesPerSplit,
                                         int64_t smem_per_sm = kDefaultSmemPerSm) {
  TORCH_CHECK(op == "verify_attention" || op == "sparse_draft_attention",
              "attention_workspace_bytes: op must be verify_attention or sparse_draft_attention, got ",
              op);
  TORCH_CHECK(B >= 0 && Q >= 1 && Hkv >= 1 && Hq % Hkv == 0 && S >= Q && block_size >= 1 && K >= 0,
              "attention_workspace_bytes: invalid sizes");
  AttnDims d{B, Q, Hq, Hkv, S, D, Hq / Hkv, effective_block_size(block_size, S)};
  const bool mma = mma_applies(dt, D, aligned, aligned);
  const int esize = static_cast<int>(c10::elementSize(dt));
  return plan_attention(d, K, op == "verify_attention", mma, esize, num_sms, min_tiles, smem_per_sm)
      .workspace_bytes();
}

template <class Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_attention_impl(
    Backend& be, const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& seq_lens, int64_t block_size, double scale,
    const c10::optional<at::Tensor>& query_weights) {
  const char* op = "vegas::verify_attention";
  const AttnDims d =
      check_attention_inputs(op, q_in, k_cache, v_cache, seq_lens, block_size, scale);
  check_query_weights(op, q_in, query_weights, d);
  check_cuda_limits(op, d, 0);
  const at::Tensor lens = seq_lens.contiguous();
  if (be.value_checks()) {
    const at::Tensor h = be.to_host(lens);
    check_seq_lens_values(op, h.data_ptr<int32_t>(), d);
  }
  const at::Tensor q = q_in.contiguous();
  at::Tensor qw_t;
  if (query_weights.has_value()) qw_t = query_weights->contiguous();
  const int64_t N = ceil_div(d.S, d.block_size);
  at::Tensor out = at::empty({d.B, d.Q, d.Hq, d.D}, q.options());
  at::Tensor lse = at::empty({d.B, d.Hq, d.Q}, q.options().dtype(at::kFloat));
  at::Tensor scores = at::empty({d.B, d.Hkv, N}, q.options().dtype(at::kFloat));
  if (d.B == 0) return {out, lse, scores};
  run_attention<VerifyMap>(be, q, k_cache, v_cache, lens, d, scale, nullptr, nullptr, 0, out,
                           lse.data_ptr<float>(), scores.data_ptr<float>(),
                           qw_t.defined() ? qw_t.data_ptr<float>() : nullptr);
  return {out, lse, scores};
}

template <class Backend>
at::Tensor sparse_draft_attention_impl(Backend& be, const at::Tensor& q_in,
                                       const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_indices,
                                       const at::Tensor& tail_start, const at::Tensor& seq_lens,
                                       int64_t block_size, double scale) {
  const char* op = "vegas::sparse_draft_attention";
  const AttnDims d =
      check_attention_inputs(op, q_in, k_cache, v_cache, seq_lens, block_size, scale);
  check_draft_inputs(op, q_in, block_indices, tail_start, d);
  const int64_t K = block_indices.size(2);
  check_cuda_limits(op, d, K);
  const at::Tensor lens = seq_lens.contiguous();
  const at::Tensor tail = tail_start.contiguous();
  const at::Tensor idx = block_indices.contiguous();
  if (be.value_checks()) {
    const at::Tensor hl = be.to_host(lens);
    const at::Tensor ht = be.to_host(tail);
    const at::Tensor hi = be.to_host(idx);
    check_seq_lens_values(op, hl.data_ptr<int32_t>(), d);
    check_draft_values(op, hl.data_ptr<int32_t>(), ht.data_ptr<int32_t>(), hi.data_ptr<int32_t>(),
                       K, d, d.block_size);
  }
  const at::Tensor q = q_in.contiguous();
  at::Tensor out = at::empty({d.B, d.Q, d.Hq, d.D}, q.options());
  if (d.B == 0) return out;
  run_attention<DraftMap>(be, q, k_cache, v_cache, lens, d, scale,
                          K > 0 ? idx.data_ptr<int32_t>() : nullptr, tail.data_ptr<int32_t>(), K,
                          out, nullptr, nullptr, nullptr);
  return out;
}

template <class Backend>
at::Tensor block_topk_impl(Backend& be, const at::Tensor& scores_in, const at::Tensor& k_in,
                           const at::Tensor& ncand_in, int64_t max_k, int64_t num_sink_blocks,
                           int64_t num_recent_blocks) {
  const char* op = "vegas::block_topk";
  check_topk_inputs(op, scores_in, k_in, ncand_in, max_k, num_sink_blocks, num_recent_blocks);
  const at::Tensor scores = scores_in.contiguous();
  const at::Tensor kt = k_in.contiguous();
  const at::Tensor nt = ncand_in.contiguous();
  const int64_t B = scores.size(0), H = scores.size(1), N = scores.size(2);
  TORCH_CHECK(N < INT32_MAX && sat_mul(B, H) < INT32_MAX, op,
              ": block_scores too large for the CUDA kernel, got shape ", scores.sizes());
  if (be.value_checks()) {
    const at::Tensor hk = be.to_host(kt);
    const at::Tensor hn = be.to_host(nt);
    check_topk_values(op, hk.data_ptr<int32_t>(), hn.data_ptr<int32_t>(), B);
  }
  at::Tensor out = at::empty({B, H, max_k}, scores.options().dtype(at::kInt));
  if (B * H == 0 || max_k == 0) return out;
  TopkParams p{};
  p.scores = scores.data_ptr<float>();
  p.k = kt.data_ptr<int32_t>();
  p.num_candidates = nt.data_ptr<int32_t>();
  p.out = out.data_ptr<int32_t>();
  p.H = static_cast<int>(H);
  p.N = static_cast<int>(N);
  p.max_k = static_cast<int>(max_k);
  p.num_sink_blocks = static_cast<int>(std::min<int64_t>(num_sink_blocks, INT32_MAX));
  p.num_recent_blocks = static_cast<int>(std::min<int64_t>(num_recent_blocks, INT32_MAX));
  p.ncache = static_cast<int>(topk_cache_keys(N, be.smem_optin()));
  be.launch(&block_topk_kernel, Grid3{B * H, 1, 1}, kTopkThreads,
            kTopkSmemBytes + size_t(p.ncache) * sizeof(uint32_t), p);
  return out;
}

// ---------------------------------------------------------------------------
// paged_block_scores
// ---------------------------------------------------------------------------
// Launch plan of one call, from shapes only (no device values): chunks of ppc pages (about
// chunk_tokens tokens, at most kPagedMaxChunkPages pages), one CTA per (request, KV head,
// chunk) of the largest possible sequence max_pages * page_size (CTAs past a request's
// seq_len only write zeros); chunks grow when the grid would exceed kPagedMaxCtas or the
// workspace 256 MiB. rpt: rows per pass over the keys (4, 8, 16 or 32).
struct PagedPlan {
  int64_t ppc, nchunks, rows_cap;
  int rpt;
  int64_t workspace_bytes() const { return 2 * rows_cap * nchunks * int64_t(sizeof(float)) * bgs; }
  int64_t bgs;  // R * H_kv
};

inline PagedPlan plan_paged(int64_t R, int64_t Hkv, int64_t G, int64_t T, int64_t P, int64_t ps,
                            int64_t num_queries, int64_t chunk_tokens) {
  PagedPlan pl{};
  pl.bgs = R * Hkv;
  pl.rows_cap = std::min(T, num_queries) * G;
  pl.rpt = pl.rows_cap <= 4 ? 4 : pl.rows_cap <= 8 ? 8
                              : pl.rows_cap <= 16  ? 16
                                                   : 32;
  if (P == 0 || pl.bgs == 0) {
    pl.ppc = 1;
    pl.nchunks = 0;
    return pl;
  }
  const int64_t maxp = std::min<int64_t>(P, kPagedMaxChunkPages);
  int64_t ppc = std::min(maxp, std::max<int64_t>(1, ceil_div(std::max<int64_t>(chunk_tokens, 1), ps)));
  if (sat_mul(pl.bgs, ceil_div(P, ppc)) > kPagedMaxCtas) {
    const int64_t target = std::max<int64_t>(1, kPagedMaxCtas / pl.bgs);
    ppc = std::min(maxp, std::max(ppc, ceil_div(P, target)));
  }
  constexpr int64_t kMaxWorkspace = int64_t(256) << 20;
  while (ppc < maxp && sat_mul(sat_mul(2 * sizeof(float), pl.bgs),
                               sat_mul(pl.rows_cap, ceil_div(P, ppc))) > kMaxWorkspace)
    ppc = std::min(maxp, 2 * ppc);
  pl.ppc = ppc;
  pl.nchunks = ceil_div(P, ppc);
  return pl;
}

// Whether the key rows can be read with 16-byte loads: contiguous head_dim (a multiple of 8),
// 16-byte aligned base and page / head / slot strides.
inline bool paged_keys_vectorizable(const at::Tensor& k) {
  const int64_t v = 16 / static_cast<int64_t>(k.element_size());
  return k.size(3) % 8 == 0 && k.stride(3) == 1 && reinterpret_cast<uintptr_t>(k.data_ptr()) % 16 == 0 &&
         k.stride(0) % v == 0 && k.stride(1) % v == 0 && k.stride(2) % v == 0;
}

template <typename T, int RPT, bool VEC, class Backend>
void launch_paged(Backend& be, const PagedParams& prm, int64_t bgs, int64_t nchunks) {
  const size_t q_bytes = size_t(RPT) * prm.ldq * sizeof(float);
  const size_t smem1 = q_bytes + size_t(kPagedWarps) * RPT * 2 * sizeof(float);
  const size_t smem2 = q_bytes + (size_t(RPT) + kPagedThreads + prm.ppc) * sizeof(float);
  const Grid3 grid{bgs, nchunks, 1};
  be.launch(&paged_stats_kernel<T, RPT, VEC>, grid, kPagedThreads, smem1, prm);
  be.launch(&paged_scores_kernel<T, RPT, VEC>, grid, kPagedThreads, smem2, prm);
}

template <typename T, class Backend>
void dispatch_paged(Backend& be, const PagedParams& prm, const PagedPlan& pl, bool vec) {
  auto go = [&](auto rpt_tag) {
    constexpr int RPT = decltype(rpt_tag)::value;
    if (vec) launch_paged<T, RPT, true>(be, prm, pl.bgs, pl.nchunks);
    else launch_paged<T, RPT, false>(be, prm, pl.bgs, pl.nchunks);
  };
  switch (pl.rpt) {
    case 4: go(std::integral_constant<int, 4>{}); break;
    case 8: go(std::integral_constant<int, 8>{}); break;
    case 16: go(std::integral_constant<int, 16>{}); break;
    default: go(std::integral_constant<int, 32>{}); break;
  }
}

template <class Backend>
at::Tensor paged_block_scores_impl(Backend& be, const at::Tensor& q, const at::Tensor& key_cache,
                                   const at::Tensor& block_table, const at::Tensor& seq_lens,
                                   const at::Tensor& query_start_loc, int64_t num_queries,
                                   double scale) {
  const char* op = "vegas::paged_block_scores";
  const PagedShape s = check_paged_inputs(op, q, key_cache, block_table, seq_lens,
                                          query_start_loc, num_queries, scale);
  TORCH_CHECK(s.D <= 256, op, ": head_dim must be <= 256 for the CUDA kernel, got ", s.D);
  TORCH_CHECK(sat_mul(sat_mul(s.max_pages, s.page_size), 2) < INT32_MAX, op,
              ": max_pages * page_size must be below 2^30 for the CUDA kernel, got ",
              s.max_pages, " * ", s.page_size);
  TORCH_CHECK(s.T < INT32_MAX && sat_mul(s.R, s.Hkv) < INT32_MAX &&
                  sat_mul(std::min(s.T, num_queries), s.G) < INT32_MAX,
              op, ": too many tokens / requests / heads for the CUDA kernel");
  const at::Tensor bt = block_table.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const at::Tensor qsl = query_start_loc.contiguous();
  if (be.value_checks()) {
    const at::Tensor hq = be.to_host(qsl);
    const at::Tensor hl = be.to_host(lens);
    const at::Tensor hb = be.to_host(bt);
    check_paged_values(op, hq.data_ptr<int32_t>(), hl.data_ptr<int32_t>(), hb.data_ptr<int32_t>(), s);
  }
  at::Tensor out = at::empty({s.R, s.Hkv, s.max_pages}, q.options().dtype(at::kFloat));
  if (s.R == 0 || s.max_pages == 0) return out.zero_();
  const PagedPlan pl = plan_paged(s.R, s.Hkv, s.G, s.T, s.max_pages, s.page_size, num_queries,
                                  be.paged_chunk_tokens());
  TORCH_CHECK(pl.nchunks <= 65535, op, ": max_pages = ", s.max_pages,
              " needs more than 65535 chunks in the CUDA kernel");
  at::Tensor ws = at::empty({std::max<int64_t>(pl.workspace_bytes() / 4, 1)},
                            q.options().dtype(at::kFloat));
  PagedParams p{};
  p.q = q.data_ptr();
  p.k = key_cache.data_ptr();
  p.block_table = bt.data_ptr<int32_t>();
  p.seq_lens = lens.data_ptr<int32_t>();
  p.qsl = qsl.data_ptr<int32_t>();
  p.out = out.data_ptr<float>();
  p.ws_m = ws.data_ptr<float>();
  p.ws_l = p.ws_m + pl.bgs * pl.rows_cap * pl.nchunks;
  p.bt_stride = bt.stride(0);
  p.qs_t = q.stride(0);
  p.qs_h = q.stride(1);
  p.qs_d = q.stride(2);
  p.ks_p = key_cache.stride(0);
  p.ks_h = key_cache.stride(1);
  p.ks_t = key_cache.stride(2);
  p.ks_d = key_cache.stride(3);
  p.num_pages = s.num_pages;
  p.T = static_cast<int>(s.T);
  p.Hkv = static_cast<int>(s.Hkv);
  p.G = static_cast<int>(s.G);
  p.D = static_cast<int>(s.D);
  p.ldq = static_cast<int>(ceil_div(s.D, 8) * 8);
  p.page_size = static_cast<int>(s.page_size);
  p.P = static_cast<int>(s.max_pages);
  p.num_queries = static_cast<int>(std::min(num_queries, std::max<int64_t>(s.T, 1)));
  p.rows_cap = static_cast<int>(pl.rows_cap);
  p.nchunks = static_cast<int>(pl.nchunks);
  p.ppc = static_cast<int>(pl.ppc);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  const bool vec = paged_keys_vectorizable(key_cache);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_paged<float>(be, p, pl, vec); break;
    case at::kBFloat16: dispatch_paged<bf16_t>(be, p, pl, vec); break;
    case at::kHalf: dispatch_paged<half_t>(be, p, pl, vec); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace cuda
}  // namespace vegas
