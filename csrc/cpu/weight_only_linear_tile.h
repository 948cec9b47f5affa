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
#include <cstdint>
#include <cstring>

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

}  // namespace wol
}  // namespace VEGAS_ISA
}  // namespace cpu
}  // namespace vegas
