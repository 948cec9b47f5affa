// CPU attention main loop on raw pointers (no torch includes), shared by
// verify_attention and sparse_draft_attention.
//
// This header has no include guard on purpose: a kernel .cpp includes it twice,
// once for the baseline ISA and once under `#pragma GCC target("avx2,fma")`, each
// time with a different VEGAS_ISA namespace, and picks one at run time
// (see cpu_dispatch.h). Only raw-pointer code lives here.
//
// Layout of one task: R = Q * group query rows of one KV head (row r = i * group + hh,
// query i, query head hh of the group), all sharing each K/V tile they read.
// Online softmax (FlashAttention, Dao et al. 2022) in fp32; scores of a tile are
// s[r][t] = (scale * q_r) . k_t; per-row visible tokens are a prefix of the tile
// (tokens are visited in ascending order wherever causality can mask them).
#ifndef VEGAS_ISA
#error "define VEGAS_ISA before including attention_tile.h"
#endif

#include "cpu/attention_types.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace vegas {
namespace cpu {
namespace VEGAS_ISA {

// exp(x) for x <= 0 (Cephes polynomial, rel. error ~2e-7), branch-free so loops vectorize.
// Inputs below -87 flush to ~0 (masked tokens never reach it: they are skipped).
static inline float vexp(float x) {
  x = std::max(x, -87.0f);
  x = std::min(x, 88.0f);
  const float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(fx) + 127) << 23;
  float p;
  std::memcpy(&p, &e, sizeof(p));
  return y * p;
}

template <typename T>
static inline float to_f(T x) {
  return static_cast<float>(x);
}

// 8-float vectors (GCC/Clang vector extensions): one AVX register in the AVX2 build,
// two SSE registers in the baseline build. Unaligned, aliasing-safe loads/stores.
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
static inline v8 ld8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
static inline void st8(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }

// s[i, 0:kTile] = q[i, :] . kT[:, 0:kTile] for NR rows; 16 tokens x NR rows of
// accumulators live in registers across the head_dim loop.
template <int NR>
static inline void qk_rows(const float* q, int D, const float* kT, float* s) {
  for (int t0 = 0; t0 < kTile; t0 += 16) {
    v8 a[NR][2];
    for (int i = 0; i < NR; ++i) a[i][0] = a[i][1] = v8{};
    for (int d = 0; d < D; ++d) {
      const v8 k0 = ld8(kT + d * kTile + t0);
      const v8 k1 = ld8(kT + d * kTile + t0 + 8);
      for (int i = 0; i < NR; ++i) {
        const float qd = q[i * D + d];
        a[i][0] += qd * k0;
        a[i][1] += qd * k1;
      }
    }
    for (int i = 0; i < NR; ++i) {
      st8(s + i * kTile + t0, a[i][0]);
      st8(s + i * kTile + t0 + 8, a[i][1]);
    }
  }
}

// acc[i, :] += sum_{t < ntok} p[i, t] * vt[t, :] for NR rows; 16 head_dim lanes x NR rows
// of accumulators in registers across the token loop.
template <int NR>
static inline void pv_rows(const float* p, const float* vt, int D, int ntok, float* acc) {
  int d0 = 0;
  for (; d0 + 16 <= D; d0 += 16) {
    v8 a[NR][2];
    for (int i = 0; i < NR; ++i) {
      a[i][0] = ld8(acc + i * D + d0);
      a[i][1] = ld8(acc + i * D + d0 + 8);
    }
    for (int t = 0; t < ntok; ++t) {
      const v8 v0 = ld8(vt + t * D + d0);
      const v8 v1 = ld8(vt + t * D + d0 + 8);
      for (int i = 0; i < NR; ++i) {
        const float pi = p[i * kTile + t];
        a[i][0] += pi * v0;
        a[i][1] += pi * v1;
      }
    }
    for (int i = 0; i < NR; ++i) {
      st8(acc + i * D + d0, a[i][0]);
      st8(acc + i * D + d0 + 8, a[i][1]);
    }
  }
  for (; d0 < D; ++d0)
    for (int i = 0; i < NR; ++i) {
      float x = acc[i * D + d0];
      for (int t = 0; t < ntok; ++t) x += p[i * kTile + t] * vt[t * D + d0];
      acc[i * D + d0] = x;
    }
}

// Attend R rows to n tokens -- token i is list[i], or first + i when list is null --
// updating the online-softmax state m[R], l[R], acc[R, D] (acc un-normalized,
// relative to m). k/v point at token 0 of this KV head; stride_t is the token stride.
template <typename T>
void attend(const Rows& rows, const T* k, const T* v, int64_t stride_t, const int64_t* list,
            int64_t first, int64_t n, const Scratch& ws, float* m, float* l, float* acc,
            const BlockSums* blk) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int R = rows.R;
  const int D = rows.D;
  std::vector<int> nvs(R);
  for (int64_t i0 = 0, tile = 0; i0 < n; i0 += kTile, ++tile) {
    const int nt = static_cast<int>(std::min<int64_t>(kTile, n - i0));
    if (list)
      for (int j = 0; j < nt; ++j) ws.tok[j] = list[i0 + j];
    else
      for (int j = 0; j < nt; ++j) ws.tok[j] = first + i0 + j;
    for (int j = 0; j < nt; ++j) {
      const T* kr = k + ws.tok[j] * stride_t;
      const T* vr = v + ws.tok[j] * stride_t;
      for (int d = 0; d < D; ++d) ws.kT[d * kTile + j] = to_f(kr[d]);
      float* vrow = ws.vt + j * D;
      for (int d = 0; d < D; ++d) vrow[d] = to_f(vr[d]);
    }
    bool straddle = false;
    if (blk) {
      for (int j = 0; j < nt; ++j)
        ws.bo[j] = static_cast<int32_t>(ws.tok[j] / blk->block_size - blk->block0);
      straddle = (ws.tok[0] % blk->block_size) != 0;
    }
    // 1. scores of all rows (columns >= nt hold stale but finite values; never used)
    int r = 0;
    for (; r + 4 <= R; r += 4) qk_rows<4>(rows.q + r * D, D, ws.kT, ws.s + r * kTile);
    for (; r < R; ++r) qk_rows<1>(rows.q + r * D, D, ws.kT, ws.s + r * kTile);
    // 2. online softmax per row; s becomes p, zero past the row's visible prefix
    for (r = 0; r < R; ++r) {
      float* s = ws.s + r * kTile;
      int nv = nt;
      while (nv > 0 && ws.tok[nv - 1] > rows.pos[r]) --nv;
      nvs[r] = nv;
      for (int j = nv; j < kTile; ++j) s[j] = 0.f;
      if (nv == 0) {
        if (blk) blk->mt[r * blk->ntiles + tile] = m[r];
        continue;
      }
      float mx = kNegInf;
      for (int j = 0; j < nv; ++j) mx = std::max(mx, s[j]);
      const float m_old = m[r];
      const float m_new = std::max(m_old, mx);
      const float alpha = (m_old == kNegInf) ? 0.f : std::exp(m_old - m_new);
      float sum = 0.f;
      for (int j = 0; j < nv; ++j) {
        const float p = vexp(s[j] - m_new);
        s[j] = p;
        sum += p;
      }
      l[r] = l[r] * alpha + sum;
      if (alpha != 1.f) {
        float* ar = acc + r * D;
        for (int d = 0; d < D; ++d) ar[d] *= alpha;
      }
      m[r] = m_new;
      if (blk) {
        float* br = blk->bsum + r * blk->nb;
        if (straddle) br[ws.bo[0]] *= alpha;
        for (int j = 0; j < nv; ++j) br[ws.bo[j]] += s[j];
        blk->mt[r * blk->ntiles + tile] = m_new;
      }
    }
    // 3. acc += P V, 4 rows at a time over the longest visible prefix of the 4
    for (r = 0; r + 4 <= R; r += 4) {
      const int ntok = std::max(std::max(nvs[r], nvs[r + 1]), std::max(nvs[r + 2], nvs[r + 3]));
      if (ntok > 0) pv_rows<4>(ws.s + r * kTile, ws.vt, D, ntok, acc + r * D);
    }
    for (; r < R; ++r)
      if (nvs[r] > 0) pv_rows<1>(ws.s + r * kTile, ws.vt, D, nvs[r], acc + r * D);
  }
}

}  // namespace VEGAS_ISA
}  // namespace cpu
}  // namespace vegas
