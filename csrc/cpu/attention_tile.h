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
#include <type_traits>
#include <vector>

namespace vegas {
namespace cpu {
namespace VEGAS_ISA {

// 8-float vectors (GCC/Clang vector extensions): one AVX register in the AVX2 build,
// two SSE registers in the baseline build. Unaligned, aliasing-safe loads/stores.
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
static inline v8 ld8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
static inline void st8(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }
static inline v8 splat(float x) { return v8{} + x; }

#if defined(__clang__)
#define VEGAS_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define VEGAS_SHUF(a, b, ...) __builtin_shuffle(a, b, v8i{__VA_ARGS__})
#endif

// exp(x) of 8 lanes for x <= 0 (Cephes polynomial, rel. error ~2e-7); below -87 the
// result is ~1e-38 (masked tokens never get here: they are zeroed separately).
static inline v8 vexp8(v8 x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  x = x > splat(88.f) ? splat(88.f) : x;
  v8 fx = x * 1.44269504088896341f + 0.5f;
  v8 fl = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8);  // trunc
  fl = fl > fx ? fl - 1.f : fl;                                           // floor
  v8 r = x - fl * 0.693359375f;
  r = r - fl * -2.12194440e-4f;
  v8 y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const v8i e = (__builtin_convertvector(fl, v8i) + 127) << 23;
  return y * reinterpret_cast<const v8&>(e);
}

template <typename T>
static inline float to_f(T x) {
  return static_cast<float>(x);
}

static inline float hmax8(v8 a) {
  float m = a[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, a[i]);
  return m;
}
static inline float hsum8(v8 a) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += a[i];
  return s;
}

// Lane i of the result = sum of the 8 lanes of a[i] (a transpose-and-add tree).
static inline v8 hsum8x8(const v8* a) {
  v8 t[4], u[2];
  for (int i = 0; i < 4; ++i)
    t[i] = VEGAS_SHUF(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           VEGAS_SHUF(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)
    u[i] = VEGAS_SHUF(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           VEGAS_SHUF(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return VEGAS_SHUF(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         VEGAS_SHUF(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// s[0:nt] = q . k_j for the tile's token rows krow[j] (row-major, fp32): 8 tokens at a
// time, 8 accumulators reduced by one transpose-add tree; no transpose of K needed.
static inline void qk_row(const float* q, int D, const float* const* krow, int nt, float* s) {
  const int D8 = D & ~7;
  for (int j0 = 0; j0 < nt; j0 += 8) {
    const int nj = std::min(8, nt - j0);
    v8 a[8];
    for (int j = 0; j < 8; ++j) a[j] = v8{};
    const float* kr[8];
    for (int j = 0; j < 8; ++j) kr[j] = krow[j0 + std::min(j, nj - 1)];
    for (int d = 0; d < D8; d += 8) {
      const v8 qd = ld8(q + d);
      for (int j = 0; j < 8; ++j) a[j] += qd * ld8(kr[j] + d);
    }
    v8 r = hsum8x8(a);
    for (int d = D8; d < D; ++d)
      for (int j = 0; j < 8; ++j) r[j] += q[d] * kr[j][d];
    if (nj == 8)
      st8(s + j0, r);
    else
      for (int j = 0; j < nj; ++j) s[j0 + j] = r[j];
  }
}

// acc[i, :] += sum_{t < ntok} p[i, t] * vrow[t][:] for NR rows; 16 head_dim lanes x NR
// rows of accumulators in registers across the token loop.
template <int NR>
static inline void pv_rows(const float* p, const float* const* vrow, int D, int ntok, float* acc) {
  int d0 = 0;
  for (; d0 + 16 <= D; d0 += 16) {
    v8 a[NR][2];
    for (int i = 0; i < NR; ++i) {
      a[i][0] = ld8(acc + i * D + d0);
      a[i][1] = ld8(acc + i * D + d0 + 8);
    }
    for (int t = 0; t < ntok; ++t) {
      const v8 v0 = ld8(vrow[t] + d0);
      const v8 v1 = ld8(vrow[t] + d0 + 8);
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
      for (int t = 0; t < ntok; ++t) x += p[i * kTile + t] * vrow[t][d0];
      acc[i * D + d0] = x;
    }
}

// Row pointers of the tile's K and V as fp32: the cache itself for fp32, else a
// converted copy in the scratch buffers.
template <typename T>
static inline void load_tile(const T* k, const T* v, int64_t k_st, int64_t v_st, const int64_t* tok,
                             int nt, int D, const Scratch& ws, const float** krow,
                             const float** vrow) {
  if constexpr (std::is_same_v<T, float>) {
    for (int j = 0; j < nt; ++j) {
      krow[j] = k + tok[j] * k_st;
      vrow[j] = v + tok[j] * v_st;
    }
  } else {
    for (int j = 0; j < nt; ++j) {
      const T* kr = k + tok[j] * k_st;
      const T* vr = v + tok[j] * v_st;
      float* kd = ws.kt + j * D;
      float* vd = ws.vt + j * D;
      for (int d = 0; d < D; ++d) kd[d] = to_f(kr[d]);
      for (int d = 0; d < D; ++d) vd[d] = to_f(vr[d]);
      krow[j] = kd;
      vrow[j] = vd;
    }
  }
}

// Attend R rows to n tokens -- token i is list[i], or first + i when list is null --
// updating the online-softmax state m[R], l[R], acc[R, D] (acc un-normalized,
// relative to m). k/v point at token 0 of this KV head; k_st / v_st are their token strides.
// NaN or +inf scores poison the row (l becomes NaN), so they propagate like the reference.
template <typename T>
void attend(const Rows& rows, const T* k, const T* v, int64_t k_st, int64_t v_st, const int64_t* list,
            int64_t first, int64_t n, const Scratch& ws, float* m, float* l, float* acc,
            const BlockSums* blk) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int R = rows.R;
  const int D = rows.D;
  std::vector<int> nvs(R);
  const float* krow[kTile];
  const float* vrow[kTile];
  for (int64_t i0 = 0, tile = 0; i0 < n; i0 += kTile, ++tile) {
    const int nt = static_cast<int>(std::min<int64_t>(kTile, n - i0));
    if (list)
      for (int j = 0; j < nt; ++j) ws.tok[j] = list[i0 + j];
    else
      for (int j = 0; j < nt; ++j) ws.tok[j] = first + i0 + j;
    load_tile(k, v, k_st, v_st, ws.tok, nt, D, ws, krow, vrow);
    bool straddle = false;
    if (blk) {
      for (int j = 0; j < nt; ++j)
        ws.bo[j] = static_cast<int32_t>(ws.tok[j] / blk->block_size - blk->block0);
      straddle = (ws.tok[0] % blk->block_size) != 0;
    }
    for (int r = 0; r < R; ++r) {
      float* s = ws.s + r * kTile;
      int nv = nt;
      while (nv > 0 && ws.tok[nv - 1] > rows.pos[r]) --nv;
      nvs[r] = nv;
      if (nv == 0) {
        for (int j = 0; j < kTile; ++j) s[j] = 0.f;
        if (blk) blk->mt[r * blk->ntiles + tile] = m[r];
        continue;
      }
      qk_row(rows.q + r * D, D, krow, nv, s);
      for (int j = nv; j < kTile; ++j) s[j] = kNegInf;
      // online softmax; p = 0 past the visible prefix (exp(-inf) flushed by the select)
      v8 mx8 = ld8(s);
      for (int j = 8; j < kTile; j += 8) {
        const v8 b = ld8(s + j);
        mx8 = mx8 > b ? mx8 : b;
      }
      const float m_old = m[r];
      const float m_new = std::max(m_old, hmax8(mx8));
      const float alpha = (m_old == kNegInf) ? 0.f : std::exp(m_old - m_new);
      v8 sum8 = v8{};
      for (int j = 0; j < kTile; j += 8) {
        const v8 x = ld8(s + j);
        v8 p = vexp8(x - m_new);
        p = x == splat(kNegInf) ? v8{} : p;
        st8(s + j, p);
        sum8 += p;
      }
      l[r] = l[r] * alpha + hsum8(sum8);
      if (alpha != 1.f) {
        float* ar = acc + r * D;
        for (int d = 0; d < D; ++d) ar[d] *= alpha;
      }
      m[r] = m_new;
      if (blk) {
        float* br = blk->bsum + r * blk->nb;
        if (straddle) br[ws.bo[0]] *= alpha;
        if (!list && blk->block_size >= 8) {
          // contiguous tokens: sum whole block segments
          for (int j = 0; j < nv;) {
            const int b = ws.bo[j];
            const int64_t seg_end_tok = (b + blk->block0 + 1) * blk->block_size;
            const int e = static_cast<int>(std::min<int64_t>(nv, j + (seg_end_tok - ws.tok[j])));
            float acc_s = 0.f;
            for (int t = j; t < e; ++t) acc_s += s[t];
            br[b] += acc_s;
            j = e;
          }
        } else {
          for (int j = 0; j < nv; ++j) br[ws.bo[j]] += s[j];
        }
        blk->mt[r * blk->ntiles + tile] = m_new;
      }
    }
    // acc += P V, 4 rows at a time over the longest visible prefix of the 4
    int r = 0;
    for (; r + 4 <= R; r += 4) {
      const int ntok = std::max(std::max(nvs[r], nvs[r + 1]), std::max(nvs[r + 2], nvs[r + 3]));
      if (ntok > 0) pv_rows<4>(ws.s + r * kTile, vrow, D, ntok, acc + r * D);
    }
    for (; r < R; ++r)
      if (nvs[r] > 0) pv_rows<1>(ws.s + r * kTile, vrow, D, nvs[r], acc + r * D);
  }
}

}  // namespace VEGAS_ISA
}  // namespace cpu
}  // namespace vegas
