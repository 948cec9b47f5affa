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

// Attend R rows to n tokens -- token i is list[i], or first + i when list is null --
// updating the online-softmax state m[R], l[R], acc[R, D] (acc un-normalized,
// relative to m). k/v point at token 0 of this KV head; stride_t is the token stride.
template <typename T>
void attend(const Rows& rows, const T* k, const T* v, int64_t stride_t, const int64_t* list,
            int64_t first, int64_t n, const Scratch& ws, float* m, float* l, float* acc,
            const BlockSums* blk) {
  const int R = rows.R;
  const int D = rows.D;
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
    for (int r = 0; r < R; ++r) {
      int nv = nt;
      while (nv > 0 && ws.tok[nv - 1] > rows.pos[r]) --nv;
      if (nv == 0) {
        if (blk) blk->mt[r * blk->ntiles + tile] = m[r];
        continue;
      }
      float* s = ws.s + r * kTile;
      for (int j = 0; j < kTile; ++j) s[j] = 0.f;
      const float* qr = rows.q + r * D;
      for (int d = 0; d < D; ++d) {
        const float qd = qr[d];
        const float* kd = ws.kT + d * kTile;
        for (int j = 0; j < kTile; ++j) s[j] += qd * kd[j];
      }
      float mx = -std::numeric_limits<float>::infinity();
      for (int j = 0; j < nv; ++j) mx = std::max(mx, s[j]);
      const float m_old = m[r];
      const float m_new = std::max(m_old, mx);
      const float alpha = (m_old == -std::numeric_limits<float>::infinity())
                              ? 0.f
                              : std::exp(m_old - m_new);
      float sum = 0.f;
      for (int j = 0; j < nv; ++j) {
        const float p = vexp(s[j] - m_new);
        s[j] = p;
        sum += p;
      }
      l[r] = l[r] * alpha + sum;
      float* ar = acc + r * D;
      if (alpha != 1.f)
        for (int d = 0; d < D; ++d) ar[d] *= alpha;
      for (int j = 0; j < nv; ++j) {
        const float p = s[j];
        const float* vrow = ws.vt + j * D;
        for (int d = 0; d < D; ++d) ar[d] += p * vrow[d];
      }
      m[r] = m_new;
      if (blk) {
        float* br = blk->bsum + r * blk->nb;
        if (straddle) br[ws.bo[0]] *= alpha;
        for (int j = 0; j < nv; ++j) br[ws.bo[j]] += s[j];
        blk->mt[r * blk->ntiles + tile] = m_new;
      }
    }
  }
}

}  // namespace VEGAS_ISA
}  // namespace cpu
}  // namespace vegas
