// Torch-free main loop of vegas::weight_only_linear: y[M, N] = x[M, K] . W[N, K]^T (+ bias)
// with W stored as fp16 or as int8 with one fp32 scale per group of `gs` weights along K,
// fp32 activations and fp32 accumulation. No include guard on purpose: the launcher
// (weight_only_linear.cpp) includes it three times -- baseline ISA (scalar), AVX2+FMA+F16C
// (8 lanes) and AVX-512 (16 lanes) -- each in its own VEGAS_ISA namespace, and picks one at
// run time (VEGAS_CPU_ISA caps it, see isa.h).
//
// Few rows (a decoding step's 1-16) make this a weight-streaming problem: each weight is
// read from memory once, converted in registers and used for every row, so the rate is set
// by the bytes per weight (2 or 1 + 4 / gs) against the memory's read bandwidth. Tiles of
// NB weight rows x MB activation rows keep NB * MB accumulators in registers; the NB rows'
// weights are streamed from memory for the first MB rows and from L1 for the next ones.
#ifndef VEGAS_ISA
#error "define VEGAS_ISA before including weight_only_linear_tile.h"
#endif
#ifndef VEGAS_WOL_VW
#error "define VEGAS_WOL_VW (0 = scalar, 8 = AVX2, 16 = AVX-512) before including weight_only_linear_tile.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace vegas {
namespace cpu {
namespace VEGAS_ISA {
namespace wol {

// IEEE binary16 bits -> float (scalar tails and the baseline path; no F16C needed).
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);  // normal: rebias 15 -> 127
  } else if (man == 0) {
    bits = sign;  // +-0
  } else {  // subnormal: normalize
    exp = 113;
    while (!(man & 0x400u)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline float wval(const uint16_t* w, int64_t k) { return half_to_float(w[k]); }
static inline float wval(const int8_t* w, int64_t k) { return static_cast<float>(w[k]); }

#if VEGAS_WOL_VW == 16
constexpr int W = 16;
using V = __m512;
static inline V vzero() { return _mm512_setzero_ps(); }
static inline V vx(const float* p) { return _mm512_loadu_ps(p); }
static inline V vw(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline V vw(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
static inline V vset(float s) { return _mm512_set1_ps(s); }
static inline float vsum(V v) { return _mm512_reduce_add_ps(v); }
constexpr int MB_MAX = 4, NB_MAX = 4;  // 16 accumulators + 4 weights + 1 row of 32 zmm
#elif VEGAS_WOL_VW == 8
constexpr int W = 8;
using V = __m256;
static inline V vzero() { return _mm256_setzero_ps(); }
static inline V vx(const float* p) { return _mm256_loadu_ps(p); }
static inline V vw(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline V vw(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
static inline V vset(float s) { return _mm256_set1_ps(s); }
static inline float vsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
constexpr int MB_MAX = 2, NB_MAX = 4;  // 8 accumulators + 4 weights + row + scales of 16 ymm
#else
constexpr int W = 0;
constexpr int MB_MAX = 4, NB_MAX = 4;
#endif

// Software prefetch distance in bytes ahead of the tile being read. The weights of a tile are
// one contiguous span (NB rows of K), consumed at NB * W weights per step; a few KB ahead keeps
// enough lines in flight for one core to stream from DRAM near its rate (the hardware
// prefetchers alone ramp up too slowly on 4 interleaved row streams of a few hundred bytes;
// measured on a 49152 x 576 int8 weight, 1 row: 4.6 -> 8-9.6 G weights/s, 2-32 KB alike).
constexpr int64_t kPrefetchAhead = 8192;

// One tile: rows [0, MB) of x (row stride ldx) against weight rows [0, NB) (row stride K;
// int8: scales row stride ng, gs weights per scale), written to y (row stride ldy). With
// `prefetch`, the NB * K weights that lie kPrefetchAhead bytes further are prefetched meanwhile.
template <typename WT, int MB, int NB>
static inline void tile(const float* x, int64_t ldx, const WT* w, int64_t K, const float* sc,
                        int64_t ng, int64_t gs, const float* bias, float* y, int64_t ldy,
                        bool prefetch) {
  constexpr bool q8 = sizeof(WT) == 1;
  float acc[MB][NB];
  int64_t k = 0;
#if VEGAS_WOL_VW
  {
    V a[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n) a[m][n] = vzero();
    const int64_t kv = K - K % W;  // full vectors; gs is a multiple of W, so no vector straddles groups
    // per vector step NB * W weights of the tile are read: prefetch as many bytes, kPrefetchAhead on
    const char* pf = reinterpret_cast<const char*>(w) + kPrefetchAhead;
    constexpr int64_t step_bytes = int64_t(NB) * W * sizeof(WT);
    while (k < kv) {
      const int64_t kend = q8 ? std::min<int64_t>(kv, (k / gs + 1) * gs) : kv;
      V s[NB];
      if constexpr (q8)
        for (int n = 0; n < NB; ++n) s[n] = vset(sc[n * ng + k / gs]);
      for (; k < kend; k += W) {
        if (prefetch) {
          for (int64_t b = 0; b < step_bytes; b += 64) __builtin_prefetch(pf + b, 0, 3);
          pf += step_bytes;
        }
        V wv[NB];
        for (int n = 0; n < NB; ++n) {
          wv[n] = vw(w + n * K + k);
          if constexpr (q8) wv[n] = vmul(wv[n], s[n]);
        }
        for (int m = 0; m < MB; ++m) {
          const V xv = vx(x + m * ldx + k);
          for (int n = 0; n < NB; ++n) a[m][n] = vfma(xv, wv[n], a[m][n]);
        }
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n) acc[m][n] = vsum(a[m][n]);
  }
#else
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = 0.f;
#endif
  for (; k < K; ++k) {  // the K % W tail (all of K on the baseline path)
    float wk[NB];
    for (int n = 0; n < NB; ++n) {
      wk[n] = wval(w + n * K, k);
      if constexpr (q8) wk[n] *= sc[n * ng + k / gs];
    }
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n) acc[m][n] += x[m * ldx + k] * wk[n];
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) y[m * ldy + n] = acc[m][n] + (bias ? bias[n] : 0.f);
}

template <typename WT, int NB>
static inline void rows_tile(const float* x, int64_t M, int64_t ldx, const WT* w, int64_t K,
                             const float* sc, int64_t ng, int64_t gs, const float* bias, float* y,
                             int64_t ldy) {
  int64_t m = 0;
  for (; m + MB_MAX <= M; m += MB_MAX)  // the first chunk streams the weights; the next ones hit L1
    tile<WT, MB_MAX, NB>(x + m * ldx, ldx, w, K, sc, ng, gs, bias, y + m * ldy, ldy, m == 0);
  const int64_t r = M - m;
  const float* xr = x + m * ldx;
  float* yr = y + m * ldy;
  if constexpr (MB_MAX >= 4) {
    if (r == 3) return tile<WT, 3, NB>(xr, ldx, w, K, sc, ng, gs, bias, yr, ldy, m == 0);
  }
  if constexpr (MB_MAX >= 3) {
    if (r == 2) return tile<WT, 2, NB>(xr, ldx, w, K, sc, ng, gs, bias, yr, ldy, m == 0);
  }
  if (r == 1) tile<WT, 1, NB>(xr, ldx, w, K, sc, ng, gs, bias, yr, ldy, m == 0);
}

// Output columns [n0, n1) of y [M, N] (row stride N) for all M rows of x [M, K] (contiguous).
// WT = uint16_t (fp16 bits; sc unused) or int8_t (sc [N, ng] fp32, gs weights per scale,
// gs a multiple of 16). bias: [N] or nullptr.
template <typename WT>
inline void weight_only_linear_cols(const float* x, int64_t M, int64_t K, const WT* w, const float* sc,
                                    int64_t ng, int64_t gs, const float* bias, float* y, int64_t N,
                                    int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NB_MAX <= n1; n += NB_MAX)
    rows_tile<WT, NB_MAX>(x, M, K, w + n * K, K, sc ? sc + n * ng : nullptr, ng, gs,
                          bias ? bias + n : nullptr, y + n, N);
  for (; n < n1; ++n)
    rows_tile<WT, 1>(x, M, K, w + n * K, K, sc ? sc + n * ng : nullptr, ng, gs,
                     bias ? bias + n : nullptr, y + n, N);
}

// ---------------------------------------------------------------------------------------------
// int8 weights in the packed layout [ceil(N/16), ceil(K/2), 16, 2] (element [b, j, l, t] =
// W[16b + l, 2j + t], zeros past N and K) against x rounded to int16 per (row, group). One vector
// step multiplies a pair of x's columns, broadcast, by the same pair of columns of 16 weight rows
// and adds both products into one int32 lane per output row (AVX-512 VNNI vpdpwssd, else vpmaddwd
// + vpaddd): the weights are never converted to float and no horizontal sums are left, a third of
// the row-major path's vector instructions per weight and row; that path is compute-bound from 4
// rows on a core that splits 512-bit work (Zen 4). At each group's end its int32 sums are scaled
// (weight scale x x's step) into fp32 accumulators; integer sums are exact, so every ISA path gives
// the same bits. A block's weights are one contiguous stream, read 16 rows x 2 columns a step.
constexpr int kPackRows = 16;
// 128 pairs x 2 x 127 x 32767 < 2^31: a longer group flushes its int32 sums in chunks of this many pairs
constexpr int64_t kMaxPairsPerFlush = 128;

// x [M, K] fp32 (contiguous) -> xq [M, 2 * ceil(K / 2)] int16 (K odd: a 0 pads each row) and
// xs [M, ng] fp32: each (row, group of gs) is rounded to nearest-even multiples of its step
// max |x| / 32767 (0 for an all-zero group; NaN where the group holds an inf or NaN, so the output
// turns NaN as a float product would).
inline void quantize_rows_i16(const float* x, int64_t M, int64_t K, int64_t gs, int16_t* xq, float* xs) {
  const int64_t ng = (K + gs - 1) / gs, Kp = (K + 1) / 2 * 2;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    int16_t* qr = xq + m * Kp;
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t k0 = g * gs, k1 = std::min(K, k0 + gs);
      float amax = 0.f, nonfinite = 0.f;  // x - x: 0, or NaN for inf / NaN
      int64_t k = k0;
#if VEGAS_WOL_VW == 16
      __m512 vmax = _mm512_setzero_ps(), vnf = _mm512_setzero_ps();
      for (; k < k1; k += 16) {
        const __mmask16 mk = k1 - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (k1 - k)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(mk, xr + k);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
        vnf = _mm512_add_ps(vnf, _mm512_sub_ps(v, v));
      }
      amax = _mm512_reduce_max_ps(vmax);
      nonfinite = _mm512_reduce_add_ps(vnf);
#else
      for (; k < k1; ++k) {
        amax = std::max(amax, std::fabs(xr[k]));
        nonfinite += xr[k] - xr[k];
      }
#endif
      const bool finite = nonfinite == 0.f;
      float inv = finite && amax > 0.f ? 32767.f / amax : 0.f;
      if (!(inv <= 3.4e38f)) inv = 0.f;  // max |x| below ~1e-34: the group counts as zero
      xs[m * ng + g] = amax / 32767.f + nonfinite;
      k = k0;
#if VEGAS_WOL_VW == 16
      const __m512 vinv = _mm512_set1_ps(inv);
      for (; k < k1; k += 16) {
        const __mmask16 mk = k1 - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (k1 - k)) - 1);
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, xr + k), vinv));
        _mm256_mask_storeu_epi16(qr + k, mk, finite ? _mm512_cvtsepi32_epi16(q) : _mm256_setzero_si256());
      }
#else
      for (; k < k1; ++k) qr[k] = finite ? static_cast<int16_t>(std::nearbyint(xr[k] * inv)) : int16_t(0);
#endif
    }
    if (Kp > K) qr[K] = 0;
  }
}

#if VEGAS_WOL_VW
#if VEGAS_WOL_VW == 16
using VI = __m512i;
constexpr int kHalves = 1;              // vectors per 16-row block
constexpr int PMB_MAX = 8;             // rows a tile: 8 int32 + 8 fp32 accumulators + 1 weight + 1 x of 32 zmm
static inline VI vizero() { return _mm512_setzero_si512(); }
// one step of a block: 16 rows x 2 columns of int8 -> 32 int16 (row-major pairs)
static inline VI pw(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline VI pairx(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
static inline VI dot2(VI acc, VI x, VI w) {
#if VEGAS_WOL_VNNI
  return _mm512_dpwssd_epi32(acc, x, w);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w));
#endif
}
static inline V vcvt(VI a) { return _mm512_cvtepi32_ps(a); }
static inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
// the scales of rows [0, min(rows, 16)) of a block for one group: p[lane * ng], 0 past `rows`
static inline V scales_of(const float* p, int64_t ng, int64_t rows) {
  const __mmask16 mk = rows >= 16 ? __mmask16(0xffff) : __mmask16((1u << rows) - 1);
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(int32_t(ng)));
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk, idx, p, 4);
}
#else
using VI = __m256i;
constexpr int kHalves = 2;
constexpr int PMB_MAX = 3;             // rows a tile: 6 int32 + 6 fp32 accumulators + 2 weights + 1 x of 16 ymm
static inline VI vizero() { return _mm256_setzero_si256(); }
static inline VI pw(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline VI pairx(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
static inline VI dot2(VI acc, VI x, VI w) { return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w)); }
static inline V vcvt(VI a) { return _mm256_cvtepi32_ps(a); }
static inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
static inline V scales_of(const float* p, int64_t ng, int64_t rows) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 mk = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(std::max<int64_t>(rows, 0))), lane));
  return _mm256_mask_i32gather_ps(_mm256_setzero_ps(), p, _mm256_mullo_epi32(lane, _mm256_set1_epi32(int32_t(ng))), mk, 4);
}
#endif

// MB rows of x against one block of 16 output rows (kHalves vectors of W rows): w0 the block's
// weights (one contiguous stream), sc its first row's scales (row stride ng), y / bias at its first
// output row, `rows` of its 16 rows real (the rest is the last block's padding).
// (#pragma GCC unroll: the small fixed loops over rows and vectors unrolled keep the accumulators
// in registers; rolled, GCC kept them in memory and the tile ran at half speed.)
template <int MB>
static inline void packed_tile(const int16_t* xq, int64_t Kh, const float* xs, int64_t ng, int64_t gh,
                               const int8_t* w0, const float* sc, const float* bias, float* y,
                               int64_t ldy, int64_t rows, bool prefetch) {
  constexpr int NV = kHalves;
  V f[MB][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) f[m][v] = vzero();
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t jg = std::min(Kh, (g + 1) * gh);
    for (int64_t j0 = g * gh; j0 < jg; j0 += kMaxPairsPerFlush) {
      const int64_t j1 = std::min(jg, j0 + kMaxPairsPerFlush);
      VI a[MB][NV];
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) a[m][v] = vizero();
      for (int64_t j = j0; j < j1; ++j) {
        if (prefetch) __builtin_prefetch(w0 + j * 32 + kPrefetchAhead, 0, 3);  // 32 bytes a step
        VI wv[NV];
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) wv[v] = pw(w0 + j * 32 + v * 2 * W);
#pragma GCC unroll 16
        for (int m = 0; m < MB; ++m) {
          const VI xv = pairx(xq + m * 2 * Kh + 2 * j);
#pragma GCC unroll 16
          for (int v = 0; v < NV; ++v) a[m][v] = dot2(a[m][v], xv, wv[v]);
        }
      }
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        const V s = scales_of(sc + (v * W) * ng + g, ng, rows - v * W);
#pragma GCC unroll 16
        for (int m = 0; m < MB; ++m) f[m][v] = vfma(vcvt(a[m][v]), vmul(s, vset(xs[m * ng + g])), f[m][v]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) {
      const int64_t r0 = int64_t(v) * W, lanes = std::min<int64_t>(W, rows - r0);
      if (lanes <= 0) continue;
      float* yr = y + m * ldy + r0;
      if (lanes == W) {
        vstore(yr, bias ? vfma(vset(1.f), vx(bias + r0), f[m][v]) : f[m][v]);
      } else {
        alignas(64) float t[W];
        vstore(t, f[m][v]);
        for (int64_t l = 0; l < lanes; ++l) yr[l] = t[l] + (bias ? bias[r0 + l] : 0.f);
      }
    }
}

// Rows of x in chunks of MB (the first chunk streams the block's weights; the next ones hit cache).
template <int MB>
static inline void packed_rows(const int16_t* xq, int64_t M, int64_t Kh, const float* xs, int64_t ng,
                               int64_t gh, const int8_t* w0, const float* sc, const float* bias, float* y,
                               int64_t ldy, int64_t rows, int64_t m = 0) {
  for (; m + MB <= M; m += MB)
    packed_tile<MB>(xq + m * 2 * Kh, Kh, xs + m * ng, ng, gh, w0, sc, bias, y + m * ldy, ldy, rows,
                    m == 0);
  if constexpr (MB > 1) {
    if (m < M) packed_rows<MB - 1>(xq, M, Kh, xs, ng, gh, w0, sc, bias, y, ldy, rows, m);
  }
}
#endif

// Output rows of blocks [b0, b1) of y [M, N] (row stride N) from the packed int8 weight wp
// [ceil(N/16), Kh = ceil(K/2), 16, 2], its scales sc [N, ng] (row-major, gs weights per scale, gs
// even) and x as quantize_rows_i16 left it (xq [M, 2 * Kh], xs [M, ng]). bias: [N] or nullptr.
inline void packed_int8_blocks(const int16_t* xq, const float* xs, int64_t M, int64_t K, const int8_t* wp,
                               const float* sc, int64_t ng, int64_t gs, const float* bias, float* y,
                               int64_t N, int64_t b0, int64_t b1) {
  const int64_t Kh = (K + 1) / 2, gh = gs / 2;
#if VEGAS_WOL_VW
  for (int64_t b = b0; b < b1; ++b) {  // one block (one contiguous stream of weights) at a time
    const int64_t n0 = b * kPackRows, rows = std::min<int64_t>(kPackRows, N - n0);
    packed_rows<PMB_MAX>(xq, M, Kh, xs, ng, gh, wp + b * Kh * 32, sc + n0 * ng, bias ? bias + n0 : nullptr, y + n0,
                         N, rows);
  }
#else
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t l = 0; l < kPackRows && b * kPackRows + l < N; ++l) {
        const int64_t n = b * kPackRows + l;
        const int8_t* wr = wp + b * Kh * 32 + l * 2;
        float f = 0.f;
        for (int64_t g = 0; g < ng; ++g) {
          const int64_t jg = std::min(Kh, (g + 1) * gh);
          for (int64_t j0 = g * gh; j0 < jg; j0 += kMaxPairsPerFlush) {
            int32_t a = 0;
            for (int64_t j = j0; j < std::min(jg, j0 + kMaxPairsPerFlush); ++j)
              a += int32_t(wr[j * 32]) * xq[m * 2 * Kh + 2 * j] + int32_t(wr[j * 32 + 1]) * xq[m * 2 * Kh + 2 * j + 1];
            f = std::fma(static_cast<float>(a), sc[n * ng + g] * xs[m * ng + g], f);
          }
        }
        y[m * N + n] = f + (bias ? bias[n] : 0.f);
      }
#endif
}

}  // namespace wol
}  // namespace VEGAS_ISA
}  // namespace cpu
}  // namespace vegas
