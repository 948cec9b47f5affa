// Block-score pass of vegas::verify_attention for small blocks (ScoreMode::kScorePass,
// block_size < 16; raw pointers, no torch includes). Runs after attn_merge_kernel, with the
// final base-2 log-sum-exp lse2_r of every query row r known, so the probabilities are
// exact at once and can be summed over the rows in registers:
//   block_scores[b, g, j] = sum_{tokens t of block j, t < seq_len} sum_r w(r) *
//                           2^(s_rt - lse2_r) * [t <= pos_r]
// with s_rt = q_r . k_t * scale * log2(e). Nothing of size [R, S] is stored: each warp
// reduces its 16 tokens over all R rows, the CTA then sums the tokens of each block
// (a block cut by a tile boundary carries its partial sum into the next tile; chunks
// hold whole blocks), and every block is written once, in a fixed order (deterministic).
// Costs one more read of K (no V) compared with the slots of the main loop, which at
// block_size 1 would be R * S floats per (batch row, KV head).
//
// A row whose seq_len lies outside [Q, S] gets NaN block scores (device-side guard of
// the unchecked values, as attn_merge_kernel poisons its lse).
//
// STATUS: compiled for sm80 / sm90 and checked with the software emulation in
// csrc/cuda/emu against the PyTorch reference; ran on an H200 (bench/results/gpu_h200).
#pragma once

#include "cuda/attention_params.h"
#include "cuda/device_utils.cuh"

namespace vegas {
namespace cuda {

// The CTA's share: blocks [j0, j1) of the valid ones, tokens [t0, te). Blocks past the
// valid ones (zero, or NaN for a guarded row) are written here, spread over the chunks.
struct ScoreCta {
  int bg, b, g, L;
  int64_t t0, te;
};

VEGAS_DEVICE ScoreCta score_cta(const ScoreParams& p) {
  ScoreCta w;
  w.bg = block_x();
  w.b = w.bg / p.Hkv;
  w.g = w.bg - w.b * p.Hkv;
  const int len = p.seq_lens[w.b];
  const bool bad = len < p.Q || len > p.S;
  w.L = bad ? 0 : len;
  const int64_t nbv = bad ? 0 : (int64_t(w.L) + p.block_size - 1) / p.block_size;
  const int y = block_y(), ny = grid_y();
  const int64_t bpc0 = (nbv + ny - 1) / ny;
  const int64_t bpc = bpc0 > p.min_bpc ? bpc0 : p.min_bpc;
  const int64_t j0 = int64_t(y) * bpc < nbv ? int64_t(y) * bpc : nbv;
  const int64_t j1 = j0 + bpc < nbv ? j0 + bpc : nbv;
  w.t0 = j0 * p.block_size;
  w.te = j1 * p.block_size < w.L ? j1 * p.block_size : w.L;
  float* out = p.block_scores + int64_t(w.bg) * p.nblocks;
  const float fill = bad ? nanf("") : 0.f;
  for (int64_t j = nbv + int64_t(y) * block_dim_x() + thread_x(); j < p.nblocks;
       j += int64_t(ny) * block_dim_x())
    out[j] = fill;
  return w;
}

// The group's queries in shared memory, row r at qs + r * ld, as U (T, or float for the
// SIMT version); padding rows are zero.
template <typename T, typename U>
VEGAS_DEVICE void stage_queries(const ScoreParams& p, const ScoreCta& w, U* qs, int ld) {
  const T* qp = static_cast<const T*>(p.q);
  for (int e = thread_x(); e < p.rpad * p.D; e += block_dim_x()) {
    const int r = e / p.D;
    const int d = e - r * p.D;
    U x = from_float<U>(0.f);
    if (r < p.R) {
      const T v = qp[((int64_t(w.b) * p.Q + r / p.G) * p.Hq + w.g * p.G + r % p.G) * p.D + d];
      if constexpr (sizeof(U) == 4) x = to_float(v);
      else x = v;
    }
    qs[r * ld + d] = x;
  }
}

// Weight and lse of each (padded) row in shared memory; rows that cannot contribute
// (padding, zero weight, no visible token: lse2 = -inf) get weight 0.
VEGAS_DEVICE void stage_row_weights(const ScoreParams& p, int bg, float* l2s, float* wsm) {
  for (int r = thread_x(); r < p.rpad; r += block_dim_x()) {
    float l2 = kNegInf, wt = 0.f;
    if (r < p.R) {
      l2 = p.lse2[int64_t(bg) * p.R + r];
      wt = p.query_weights ? p.query_weights[r / p.G] : 1.f;
      if (l2 == kNegInf) wt = 0.f;
    }
    l2s[r] = l2;
    wsm[r] = wt;
  }
}

// Sums the per-token probabilities tokp of tile `it` (tokens [T0, T1), T1 <= te) into
// the blocks overlapping it; a block continuing past T1 (and past no chunk end) leaves
// its partial sum in carry[it & 1] for the next tile. Called by all threads.
VEGAS_DEVICE void reduce_tile_blocks(const ScoreParams& p, const float* tokp, float* carry,
                                     int64_t T0, int64_t T1, int64_t te, int it, float* out) {
  const int64_t bs = p.block_size;
  const int64_t jf = T0 / bs, jl = (T1 - 1) / bs;
  for (int64_t j = jf + thread_x(); j <= jl; j += block_dim_x()) {
    const int64_t lo = j * bs > T0 ? j * bs : T0;
    const int64_t hi = (j + 1) * bs < T1 ? (j + 1) * bs : T1;
    float s = (j == jf && j * bs < T0) ? carry[(it + 1) & 1] : 0.f;
    for (int64_t t = lo; t < hi; ++t) s += tokp[t - T0];
    if ((j + 1) * bs > T1 && T1 < te) carry[it & 1] = s;
    else out[j] = s;
  }
}

// ---------------------------------------------------------------------------
// Tensor-core version (bf16 / fp16, D in {64, 80, 96, 128}, K rows 16-byte aligned):
// K tiles double-buffered with cp.async; per 16-token step the K fragments are loaded
// once and multiplied with the Q fragments of every 16-row group (ldmatrix from the
// staged queries).
// ---------------------------------------------------------------------------
template <typename T, int D>
VEGAS_GLOBAL void VEGAS_LAUNCH_BOUNDS(kScoreThreads) block_scores_mma_kernel(const ScoreParams p) {
  constexpr int TILE = kScoreTile;
  constexpr int LDS = D + 8;
  constexpr int NKS = D / 16;
  constexpr int CH = D / 8;
  VEGAS_DYNAMIC_SMEM(smem);
  const int tid = thread_x();
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int nthreads = block_dim_x();
  T* kst = reinterpret_cast<T*>(smem);  // [2][TILE][LDS]
  T* qs = kst + 2 * TILE * LDS;          // [rpad][LDS]
  float* l2s = reinterpret_cast<float*>(qs + size_t(p.rpad) * LDS);  // [rpad]
  float* wsm = l2s + p.rpad;                                          // [rpad]
  float* tokp = wsm + p.rpad;                                         // [TILE]
  float* carry = tokp + TILE;                                         // [2]

  const ScoreCta w = score_cta(p);
  stage_queries<T, T>(p, w, qs, LDS);
  stage_row_weights(p, w.bg, l2s, wsm);
  block_sync();
  if (w.t0 >= w.te) return;  // uniform over the CTA

  const T* kg = static_cast<const T*>(p.k) + int64_t(w.b) * p.k_sb + int64_t(w.g) * p.k_sh;
  const int ntile = static_cast<int>((w.te - w.t0 + TILE - 1) / TILE);
  auto issue = [&](int it, int stage) {
    T* ks = kst + size_t(stage) * TILE * LDS;
    const int64_t T0 = w.t0 + int64_t(it) * TILE;
    for (int c = tid; c < TILE * CH; c += nthreads) {
      const int row = c / CH;
      const int ch = c - row * CH;
      if (T0 + row < w.te) cp_async16(ks + row * LDS + ch * 8, kg + (T0 + row) * p.k_st + ch * 8);
      else store_zero16(ks + row * LDS + ch * 8);
    }
    cp_async_commit();
  };

  const int gq = lane >> 2, tq = lane & 3;
  const int mat = lane >> 3, r8 = lane & 7;
  float* out = p.block_scores + int64_t(w.bg) * p.nblocks;
  issue(0, 0);
  for (int it = 0; it < ntile; ++it) {
    const int stage = it & 1;
    if (it + 1 < ntile) {
      issue(it + 1, stage ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    block_sync();
    const int64_t T0 = w.t0 + int64_t(it) * TILE;
    const int64_t T1 = T0 + TILE < w.te ? T0 + TILE : w.te;
    const int base = warp * kStep;
    if (T0 + base < w.te) {  // warp-uniform
      const T* ks = kst + size_t(stage) * TILE * LDS;
      uint32_t kb[NKS][4];
      const T* kaddr = ks + (base + (mat >> 1) * 8 + r8) * LDS + (mat & 1) * 8;
#pragma unroll
      for (int kk = 0; kk < NKS; ++kk) ldmatrix_x4(kb[kk], kaddr + kk * 16);
      float tacc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
      for (int rg = 0; rg < p.rpad; rg += 16) {
        float s[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
        // A fragments: matrices 0 = rows 0-7 / dims +0, 1 = rows 8-15 / dims +0,
        //              2 = rows 0-7 / dims +8, 3 = rows 8-15 / dims +8
        const T* qaddr = qs + (rg + (mat & 1) * 8 + r8) * LDS + (mat >> 1) * 8;
#pragma unroll
        for (int kk = 0; kk < NKS; ++kk) {
          uint32_t qa[4];
          ldmatrix_x4(qa, qaddr + kk * 16);
          mma_16816<T>(s[0], qa, kb[kk][0], kb[kk][1]);
          mma_16816<T>(s[1], qa, kb[kk][2], kb[kk][3]);
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int row = rg + gq + (c >= 2 ? 8 : 0);
          const float wt = wsm[row];
          const float l2 = l2s[row];
          const int64_t pos = int64_t(w.L) - p.Q + row / p.G;
#pragma unroll
          for (int n = 0; n < 2; ++n) {
            const int64_t tok = T0 + base + n * 8 + 2 * tq + (c & 1);
            const bool ok = wt != 0.f && tok < w.te && tok <= pos;
            tacc[n][c & 1] += ok ? wt * fast_exp2(s[n][c] * p.scale_log2 - l2) : 0.f;
          }
        }
      }
      // sum over the 8 row pairs (lanes with the same tq)
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = tacc[n][e];
          x += shfl_xor(x, 4);
          x += shfl_xor(x, 8);
          x += shfl_xor(x, 16);
          tacc[n][e] = x;
        }
      if (gq == 0) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          tokp[base + n * 8 + 2 * tq] = tacc[n][0];
          tokp[base + n * 8 + 2 * tq + 1] = tacc[n][1];
        }
      }
    }
    block_sync();  // tokp complete; the K stage is refilled by the next issue
    reduce_tile_blocks(p, tokp, carry, T0, T1, w.te, it, out);
  }
}

// ---------------------------------------------------------------------------
// SIMT version: any dtype, any head_dim <= 256, any alignment. K tile converted to fp32
// in shared memory (one stage); lane = (token lane % 16, half of the head dims lane / 16).
// ---------------------------------------------------------------------------
template <typename T>
VEGAS_GLOBAL void VEGAS_LAUNCH_BOUNDS(kScoreThreads) block_scores_simt_kernel(const ScoreParams p) {
  constexpr int TILE = kScoreTile;
  const int D = p.D;
  const int LD = D + 2;
  VEGAS_DYNAMIC_SMEM(smem);
  const int tid = thread_x();
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int nthreads = block_dim_x();
  float* Ks = reinterpret_cast<float*>(smem);  // [TILE][LD]
  float* qs = Ks + TILE * LD;                  // [rpad][D]
  float* l2s = qs + p.rpad * D;                // [rpad]
  float* wsm = l2s + p.rpad;                   // [rpad]
  float* tokp = wsm + p.rpad;                  // [TILE]
  float* carry = tokp + TILE;                  // [2]

  const ScoreCta w = score_cta(p);
  stage_queries<T, float>(p, w, qs, D);
  stage_row_weights(p, w.bg, l2s, wsm);
  block_sync();
  if (w.t0 >= w.te) return;  // uniform over the CTA

  const T* kg = static_cast<const T*>(p.k) + int64_t(w.b) * p.k_sb + int64_t(w.g) * p.k_sh;
  const int ntile = static_cast<int>((w.te - w.t0 + TILE - 1) / TILE);
  const int t = lane & 15, h = lane >> 4;
  float* out = p.block_scores + int64_t(w.bg) * p.nblocks;
  for (int it = 0; it < ntile; ++it) {
    const int64_t T0 = w.t0 + int64_t(it) * TILE;
    const int64_t T1 = T0 + TILE < w.te ? T0 + TILE : w.te;
    for (int e = tid; e < TILE * D; e += nthreads) {
      const int r = e / D;
      const int d = e - r * D;
      Ks[r * LD + d] = T0 + r < w.te ? to_float(kg[(T0 + r) * p.k_st + d]) : 0.f;
    }
    block_sync();
    const int base = warp * kStep;
    if (T0 + base < w.te) {  // warp-uniform
      const int64_t tok = T0 + base + t;
      const float* kr = Ks + (base + t) * LD;
      float tacc = 0.f;
      for (int r = 0; r < p.R; ++r) {
        const float* qr = qs + r * D;
        float a = 0.f;
        for (int d = h; d < D; d += 2) a += qr[d] * kr[d];
        a += shfl_xor(a, 16);
        const float wt = wsm[r];
        const bool ok = wt != 0.f && tok < w.te && tok <= int64_t(w.L) - p.Q + r / p.G;
        tacc += ok ? wt * fast_exp2(a * p.scale_log2 - l2s[r]) : 0.f;
      }
      if (h == 0) tokp[base + t] = tacc;
    }
    block_sync();  // tokp complete; Ks is rewritten by the next tile
    reduce_tile_blocks(p, tokp, carry, T0, T1, w.te, it, out);
  }
}

}  // namespace cuda
}  // namespace vegas
