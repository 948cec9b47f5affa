// Plain parameter structs of the vegas CUDA attention kernels (no CUDA, no torch), and the
// host-side launch plan shared by the launchers (csrc/cuda/*.cu) and the software
// emulation harness (csrc/cuda/emu/).
//
// Work decomposition (verify_attention and sparse_draft_attention share it):
//   * Query rows: the R = Q * G query rows of one KV head g (row r = query i = r / G,
//     query head g * G + r % G) are processed together, so every K/V tile loaded to
//     shared memory serves all query heads of the group and all queries (GQA packing).
//     A warp owns `rows_per_warp` rows (16 for the tensor-core path, 8 for the SIMT
//     path); a CTA holds `rg` row groups (<= 4) and the grid's z axis covers the rest.
//   * Tokens: a "virtual" token sequence per (batch, KV head) -- the cache positions
//     [0, seq_len) for verify, the selected blocks then the tail for the draft -- cut
//     into tiles of `tile` tokens. The grid's x axis splits the tiles into `nsplit`
//     contiguous ranges (flash-decoding); inside a CTA, the `ns` warps of a row group
//     ("streams") take the 16-token steps of each tile round-robin.
//   * The streams of a row group are merged in shared memory at the end of the CTA, and
//     the CTA writes one un-normalised online-softmax state (m, l, acc) per row -- np =
//     nsplit partials per row; attn_merge_kernel merges them into out / lse (one warp per
//     row). A split covers at least kMinTilesPerSplit tiles (fewer, larger partials at
//     short lengths).
//   * nsplit (choose_nsplit) fills the device in whole waves: with c resident CTAs per SM
//     (shared memory, capped at kAttnCtasPerSm), it minimises waves * (tiles per split +
//     1 tile for writing and merging the partial). Llama-3-8B shape, batch 1, 32K, H100 /
//     H200 (132 SMs, 75 KB smem -> c = 3, 396 slots): 8 KV heads x 47 splits = 376 CTAs
//     of 11 tiles (352 KB of K/V each), one wave (the old 4 * SMs target gave 512 CTAs:
//     1.3 waves, the last one 30 % full); batch 8: 6 splits (384 CTAs); batch 32: 3 splits
//     (768 CTAs, two waves).
//   * Block scores (verify only), one of two ways (ScoreMode):
//     - kSlots (block_size >= 16): per row and 16-token step u, the log2-sum-exp of the
//       scores of each block overlapping [16u, 16u + 16) -- a self-contained partial
//       log-sum-exp, `spt` slots per step (1 when block_size is a multiple of 16) -- is
//       written to `slots`; attn_slot_scores_kernel turns them into probabilities with the
//       final lse and sums rows and steps. Workspace R * ceil(S / 16) * spt floats per
//       (batch row, KV head): R * S / 16 or R * S / 8.
//     - kScorePass (block_size < 16, where slots would approach the [R, S] probability
//       matrix): no slots; after the merge kernel, block_scores_kernel.cuh recomputes
//       Q.K^T per tile with the final lse, sums the probabilities over the rows and
//       tokens of each block in registers / shared memory and writes block_scores
//       directly (one more read of K, no workspace).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace vegas {
namespace cuda {

constexpr int kStep = 16;      // tokens per online-softmax step (one mma k-step of P.V)
constexpr int kMmaTile = 64;   // tokens per CTA tile, tensor-core path
constexpr int kMinTilesPerSplit = 4;  // a split covers at least this many tiles (partials
                                      // cost R * D floats each: keep them few)
constexpr int kMaxSplits = 128;       // MQA at batch 1 (one KV head) still fills 132 SMs x 3
constexpr int kAttnCtasPerSm = 3;     // the main kernels' __launch_bounds__ minimum (<= 168
                                      // registers: 158-162 used on sm_90, so no spills)
constexpr int kDefaultSmemPerSm = 233472;  // H100 / H200: 228 KiB of shared memory per SM
constexpr int kMergeRows = 4;         // attn_merge_kernel: rows (warps) per CTA
constexpr int kScoreThreads = 128;    // block-score pass: 4 warps, one 16-token step each
constexpr int kScoreTile = 64;        // tokens per tile of the block-score pass
constexpr size_t kMaxScoreSmem = 96 * 1024;  // above this the slots are used instead

// clang-format off
enum class ScoreMode { kNone, kSlots, kScorePass };
// clang-format on

struct AttnParams {
  const void* q;  // [B, Q, Hq, D] contiguous
  const void* k;  // [B, Hkv, S, D], stride(3) == 1
  const void* v;
  int64_t k_sb, k_sh, k_st;  // element strides of k (batch, head, token)
  int64_t v_sb, v_sh, v_st;
  const int32_t* seq_lens;  // [B]
  int B, Q, Hq, Hkv, G, S, D, R;
  float scale_log2;  // softmax scale * log2(e): scores are kept in base 2
  int block_size;
  int nblocks;  // ceil(S / block_size)
  // sparse draft only
  const int32_t* block_indices;  // [B, Hkv, K]
  const int32_t* tail_start;     // [B]
  int K;
  // plan
  int tile, nsplit, ns, rg, rows_per_warp, np, spt, nsub;  // np == nsplit
  int min_tiles;  // a split covers at least this many tiles (kMinTilesPerSplit)
  // workspace
  float* part_m;  // [B * Hkv, np, R]   running max (base 2)
  float* part_l;  // [B * Hkv, np, R]   sum of exp2(s - m)
  float* part_o;  // [B * Hkv, np, R, D] un-normalised output
  float* slots;   // [B * Hkv, R, nsub, spt] block log2-sum-exps (verify), or null
};

struct CombineParams {
  const int32_t* tail_start;  // draft: [B], for the device-side guard; else null
  const float* part_m;
  const float* part_l;
  const float* part_o;
  const float* slots;  // or null (no block scores)
  void* out;           // [B, Q, Hq, D], dtype of q
  float* lse;          // [B, Hq, Q] or null
  float* block_scores; // [B, Hkv, nblocks] or null
  const float* query_weights;  // [Q] or null
  const int32_t* seq_lens;
  int B, Q, Hq, Hkv, G, R, D, S, np, block_size, nblocks, spt, nsub;
};

// Block-score pass (ScoreMode::kScorePass): grid x = batch row * Hkv + KV head, y =
// chunk of whole blocks of the row's valid length (ceil(seq_len / block_size) blocks cut
// into grid_y chunks of at least min_bpc blocks), 128 threads; warp w takes the 16-token
// step w of each 64-token tile.
struct ScoreParams {
  const void* q;  // [B, Q, Hq, D] contiguous
  const void* k;  // [B, Hkv, S, D], stride(3) == 1
  int64_t k_sb, k_sh, k_st;
  const int32_t* seq_lens;     // [B]
  const float* lse2;           // [B * Hkv, R] base-2 log-sum-exp (attn_merge_kernel)
  const float* query_weights;  // [Q] or null
  float* block_scores;         // [B, Hkv, nblocks]
  int B, Q, Hq, Hkv, G, S, D, R, rpad;  // rpad: R rounded up to 16
  float scale_log2;
  int block_size, nblocks, min_bpc;
};

struct TopkParams {
  const float* scores;  // [rows, N] contiguous
  const int32_t* k;     // [B]
  const int32_t* num_candidates;  // [B]
  int32_t* out;         // [rows, max_k]
  int H, N, max_k, num_sink_blocks, num_recent_blocks;
  int ncache;           // candidates whose keys are cached in shared memory (block_topk)
};

inline int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Host-side plan of one attention call.
struct AttnPlan {
  bool mma = false;
  int rows_per_warp = 0, rg = 0, ns = 0, warps = 0, nz = 0;
  int tile = 0, nsplit = 0, np = 0, spt = 0, nsub = 0, min_tiles = kMinTilesPerSplit;
  size_t smem = 0;          // dynamic shared memory of the main kernel, bytes
  int ctas_per_sm = 1;      // resident main-kernel CTAs per SM assumed by choose_nsplit
  int combine_threads = 256, combine_chunks = 1;  // attn_slot_scores_kernel launch
  int merge_chunks = 1;     // attn_merge_kernel: grid y (kMergeRows rows per CTA)
  size_t merge_smem = 0;    // kMergeRows * np floats (the merge factors)
  int64_t n_part_ml = 0, n_part_o = 0, n_slots = 0, n_lse2 = 0;  // workspace floats
  ScoreMode scores = ScoreMode::kNone;
  int sc_chunks = 0, sc_min_bpc = 0, sc_rpad = 0;  // block-score pass launch
  size_t sc_smem = 0;
  // Workspace of one call, bytes: 4 * (2 n_part_ml + n_part_o + n_slots + n_lse2).
  int64_t workspace_bytes() const { return 4 * (2 * n_part_ml + n_part_o + n_slots + n_lse2); }
};

// Shared-memory layout of the tensor-core kernel (bytes), for element size `esize`.
struct MmaSmem {
  size_t kv, tok, pbuf, mbuf, total;
  MmaSmem(int D, int esize, int warps) {
    const size_t lds = size_t(D) + 8;
    kv = 2 /*stages*/ * 2 /*K,V*/ * size_t(kMmaTile) * lds * esize;
    tok = 3 * size_t(kMmaTile) * sizeof(int);  // three token lists (attn_mma_kernel)
    pbuf = size_t(warps) * 16 * (kStep + 1) * sizeof(float);
    mbuf = size_t(warps) * 16 * sizeof(float);
    total = kv + tok + pbuf + mbuf;
  }
};

// Shared-memory layout of the SIMT kernel (bytes).
struct SimtSmem {
  size_t kv, tok, qs, pbuf, mbuf, total;
  SimtSmem(int D, int tile, int warps, int rows) {
    kv = 2 * size_t(tile) * (size_t(D) + 2) * sizeof(float);
    tok = size_t(tile) * sizeof(int);
    qs = size_t(rows) * D * sizeof(float);
    pbuf = size_t(warps) * 8 * (kStep + 1) * sizeof(float);
    mbuf = size_t(warps) * 8 * sizeof(float);
    total = kv + tok + qs + pbuf + mbuf;
  }
};

// Shared memory of the block-score pass (bytes): K tiles (two stages of the input type
// on the tensor-core path, one fp32 tile on the SIMT path), the group's queries, per
// row lse and weight, per token probabilities, two carries.
inline size_t score_smem_bytes(bool mma, int64_t D, int64_t rpad, int esize) {
  const size_t kv = mma ? 2 * size_t(kScoreTile) * size_t(D + 8) * esize
                        : size_t(kScoreTile) * size_t(D + 2) * sizeof(float);
  const size_t qs = mma ? size_t(rpad) * size_t(D + 8) * esize : size_t(rpad) * D * sizeof(float);
  return kv + qs + 2 * size_t(rpad) * sizeof(float) + (kScoreTile + 2) * sizeof(float);
}

// Number of splits of the token tiles of one (batch row, KV head, row group). base: CTAs
// per split (B * Hkv * nz); nvt: tiles of the longest row; slots: CTAs resident at once
// (SMs x CTAs per SM). Cost of n splits, in tile-times of one CTA: waves(n) * (tiles per
// split + 1), the + 1 for writing the (R x D fp32) partial and merging it back, about one
// 64-token bf16 K/V tile at D = 128. The smallest n within 3 % of the least cost: more
// partials (workspace, merge traffic) only for a real gain.
inline int64_t choose_nsplit(int64_t base, int64_t nvt, int64_t slots, int min_tiles) {
  const int64_t cap = std::max<int64_t>(1, std::min<int64_t>(div_up(nvt, min_tiles), kMaxSplits));
  auto cost = [&](int64_t n) {
    const int64_t waves = div_up(base * n, std::max<int64_t>(1, slots));
    return waves * (std::max<int64_t>(div_up(nvt, n), min_tiles) + 1);
  };
  int64_t least = INT64_MAX;
  for (int64_t n = 1; n <= cap; ++n) least = std::min(least, cost(n));
  int64_t n = 1;
  while (cost(n) * 100 > least * 103) ++n;
  return n;
}

// vlen_max: the longest virtual token sequence a row can have (S for verify,
// K * block_size + S for the draft). num_sms / smem_per_sm: multiprocessors of the device
// and their shared memory (bytes). with_scores: verify (block scores wanted). block_size:
// the effective one (<= S).
inline AttnPlan make_attn_plan(int64_t B, int64_t Hkv, int64_t R, int64_t D, int64_t S,
                               int64_t vlen_max, int64_t block_size, bool mma, bool with_scores,
                               int esize, int num_sms, int min_tiles = kMinTilesPerSplit,
                               int64_t smem_per_sm = kDefaultSmemPerSm) {
  AttnPlan p;
  p.min_tiles = std::max(1, min_tiles);
  p.mma = mma;
  p.rows_per_warp = mma ? 16 : 8;
  const int64_t mr = div_up(R, p.rows_per_warp);  // row groups in all
  p.rg = static_cast<int>(std::min<int64_t>(4, mr));
  p.ns = p.rg == 1 ? 4 : (p.rg == 2 ? 2 : 1);
  p.warps = p.rg * p.ns;
  p.nz = static_cast<int>(div_up(mr, p.rg));
  p.tile = mma ? kMmaTile : (D <= 128 ? 64 : 32);
  p.smem = mma ? MmaSmem(static_cast<int>(D), esize, p.warps).total
               : SimtSmem(static_cast<int>(D), p.tile, p.warps, p.rg * 8).total;
  // the runtime reserves 1 KiB of shared memory per CTA
  p.ctas_per_sm = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(kAttnCtasPerSm, smem_per_sm / int64_t(p.smem + 1024))));
  const int64_t nvt_max = std::max<int64_t>(1, div_up(vlen_max, p.tile));
  const int64_t base = B * Hkv * p.nz;
  const int64_t slots = int64_t(std::max(1, num_sms)) * p.ctas_per_sm;
  p.nsplit = static_cast<int>(choose_nsplit(base, nvt_max, slots, p.min_tiles));
  p.np = p.nsplit;  // the streams of a CTA are merged in shared memory
  const int64_t target = 4 * std::max(1, num_sms);
  const int64_t nblocks = div_up(S, block_size);
  if (with_scores) {
    p.sc_rpad = static_cast<int>(div_up(R, 16) * 16);
    p.sc_smem = score_smem_bytes(mma, D, p.sc_rpad, esize);
    p.scores = (block_size < kStep && p.sc_smem <= kMaxScoreSmem) ? ScoreMode::kScorePass
                                                                  : ScoreMode::kSlots;
  }
  const bool with_slots = p.scores == ScoreMode::kSlots;
  if (p.scores == ScoreMode::kScorePass) {
    // chunks of whole blocks, at least min_tiles tiles each, about 4 CTAs per SM in all
    p.sc_min_bpc = static_cast<int>(div_up(int64_t(p.min_tiles) * kScoreTile, block_size));
    const int64_t chunks = std::min<int64_t>(div_up(target, B * Hkv), div_up(nblocks, p.sc_min_bpc));
    p.sc_chunks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(chunks, 65535)));
  }
  p.spt = with_slots ? static_cast<int>(block_size % kStep == 0
                                            ? 1
                                            : std::min<int64_t>(kStep, (kStep - 1) / block_size + 2))
                     : 0;
  p.nsub = static_cast<int>(div_up(S, kStep));
  p.n_part_ml = B * Hkv * p.np * R;
  p.n_part_o = p.n_part_ml * D;
  p.n_slots = with_slots ? B * Hkv * R * int64_t(p.nsub) * p.spt : 0;
  p.n_lse2 = B * Hkv * R;
  // slot scores: one thread per block; merge: one warp per row, rows strided past 65535 CTAs
  p.combine_chunks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(div_up(nblocks, p.combine_threads), 4096)));
  p.merge_chunks = static_cast<int>(std::min<int64_t>(div_up(R, kMergeRows), 65535));
  p.merge_smem = size_t(kMergeRows) * p.np * sizeof(float);
  return p;
}

inline void fill_plan(AttnParams& a, const AttnPlan& p) {
  a.tile = p.tile;
  a.nsplit = p.nsplit;
  a.ns = p.ns;
  a.rg = p.rg;
  a.rows_per_warp = p.rows_per_warp;
  a.np = p.np;
  a.spt = p.spt;
  a.nsub = p.nsub;
  a.min_tiles = p.min_tiles;
}

}  // namespace cuda
}  // namespace vegas
