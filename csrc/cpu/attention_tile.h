// CPU attention main loop on raw pointers (no torch includes), shared by
// verify_attention and sparse_draft_attention.
//
// This header has no include guard on purpose: isa.h includes it once per instruction
// set (baseline, AVX2+FMA, AVX-512), each time under its own `#pragma GCC target` and
// VEGAS_ISA namespace with its vector width VEGAS_VW and register count VEGAS_NREGS,
// and picks one at run time. Only raw-pointer code lives here.
//
// Layout of one task: R = Q * group query rows of one KV head (row r = i * group + hh,
// query i, query head hh of the group), all sharing each K/V tile they read. The rows
// live in the lanes of the vectors ("rows in lanes", padded to Rp = a multiple of the
// vector width), so one K or V element loaded from the cache serves every row:
//   QK: S^T[t, r] = sum_d K[t, d] * Qs^T[d, r]   -- K[t, d] broadcast, Qs^T packed once
//       per task ([D, Rp], pre-scaled), an MT-token x NV-vector block of scores held in
//       registers (a GEMM micro-kernel with the cache row-major as it is: no packing of
//       K for fp32 caches).
//   PV: acc[r, d] = alpha[r] * acc[r, d] + sum_t P^T[t, r] * V[t, d]   -- MR rows x ND
//       head_dim vectors in registers, P broadcast, V rows read as vectors; with AVX2 the
//       transposed form acc^T[d, r] += V[t, d] * P^T[t, r] instead (pv_t_block: V broadcast,
//       P rows read as vectors, the accumulator kept [D, Rp] for the task).
// Online softmax (FlashAttention, Dao et al. 2022) in fp32, vertical over the rows: the
// running max, sum, and the per-block probability sums (verification's block scores)
// are all row vectors. With few rows (plain decoding and drafting, R = the GQA group; AVX-512:
// R <= 8, R * D <= 384; AVX2: R <= 4) the tile runs with tokens in lanes instead (see qk_few).
// bf16 / fp16 caches are converted to fp32 one tile at a time.
// Tokens are visited in ascending order wherever causality can mask them, so each row's
// visible tokens are a prefix of the tile.
#ifndef VEGAS_ISA
#error "define VEGAS_ISA before including attention_tile.h"
#endif
#ifndef VEGAS_VW
#error "define VEGAS_VW (floats per vector) before including attention_tile.h"
#endif
#ifndef VEGAS_NREGS
#error "define VEGAS_NREGS (vector registers) before including attention_tile.h"
#endif
#ifndef VEGAS_F16C
#define VEGAS_F16C 0
#endif
#ifndef VEGAS_X86_VEC  // x86 intrinsics of this width may be used (8: AVX2+FMA, 16: AVX-512); 0: none
#define VEGAS_X86_VEC 0
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

namespace vegas {
namespace cpu {
namespace VEGAS_ISA {

constexpr int VW = VEGAS_VW;
// Unaligned, aliasing-safe loads/stores on GCC/Clang vector extensions.
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4), may_alias));
typedef uint16_t vhu __attribute__((vector_size(VW * 2), aligned(2), may_alias));
typedef int32_t viu __attribute__((vector_size(VW * 4), aligned(4), may_alias));
static inline vf ld(const float* p) { return *reinterpret_cast<const vfu*>(p); }
static inline void st(float* p, vf x) { *reinterpret_cast<vfu*>(p) = x; }
// x - (+0) == x for every x (unlike 0 + x, which turns -0 into +0), so this folds to a
// single broadcast (from memory where x is loaded).
static inline vf splat(float x) { return x - vf{}; }

// Register blocking of the two micro-kernels (accumulators <= registers - 4).
constexpr bool kWide = VEGAS_NREGS >= 32;
// AVX2+FMA (16 registers, broadcasts from memory as costly as a vector load): QK blocks of 3 row
// vectors x 4 tokens and the transposed P V (pv_t_block), 3 row vectors x 4 head_dim elements,
// both 4 broadcasts per 12 FMAs. Measured on one AMD EPYC (Zen 3) core, 64 tokens x D 64 from L1:
// QK 3x4 90 GFLOP/s against 84 for 2x6 then 1x8 (R = 21 rows), P V 3x4 transposed 76 against 67
// for 6 rows x 2 vectors. The AVX-512 and baseline builds keep the blocks below (not measured
// against these).
constexpr bool kAvx2Blocks = VEGAS_X86_VEC == 8;
constexpr int kQkMaxNV = (kWide || kAvx2Blocks) ? 3 : 2;  // row vectors per QK block
constexpr int kPvMR = 6;                 // rows per PV block
constexpr int kPvND = kWide ? 4 : 2;     // head_dim vectors per PV block
constexpr bool kPvT = kAvx2Blocks;       // P V into the transposed accumulator (pv_t_block)

// Row vectors of the next QK / transposed-P V block, `rem` of them left: at most kQkMaxNV; with
// the AVX2 blocks 4 left go as 2 + 2, not 3 + 1 (one row vector takes a broadcast per FMA).
inline int row_block(int rem) { return kAvx2Blocks && rem == 4 ? 2 : std::min(kQkMaxNV, rem); }

// The K / V rows read next (see attend) are prefetched into L2 (prefetcht1), not L1: the tile
// being computed (its K and V, 16 KB each at D 64, the scores and the packed queries) already
// fills most of a 48 KB L1, and prefetching the next one on top of it evicted lines before their
// use. Measured (with the next tile's K and V as the targets) against prefetcht0 on one AVX-512
// core, fp32, SmolLM2 / Llama-3-8B shapes at 8K and 32K (bench/results/kernels_xeon_avx512/ab_l2_prefetch_grid.md):
// verify_attention 1.01-1.09x faster at Q = 7, 1.05-1.28x at Q = 1; in a torch-free
// microbenchmark of this loop, prefetchnta or no prefetch were slower than either. Only the
// AVX-512 build was measured; the AVX2 and baseline builds use the same hint. On an AMD Zen 4
// core prefetcht0 was also slower in the op at Q = 1-5 and no faster at Q = 7-9 (SmolLM2 batch 4,
// 8K, K/V from DRAM; python -m bench.ab_trees_cpu), though it helped the torch-free loop there.
// The prefetches go out one line (or a few) at a time through the compute, never as a burst: a
// QK step asks for one row's line (qk_block: the first MT head_dim steps of each line; the pair
// QK: MT / 8 rows per pair step; the few-rows QK: the rows i = r (mod R) in row r's pass, one
// line per step) and a P V token step for its share of the next rows' lines in row-major order
// (PassPrefetch). On one Intel Xeon core (AVX-512), K/V from DRAM on huge pages
// (bench/cpu_attend_microbench.cpp, 8K tokens, 160 / 80 / 40 KV heads), against a burst of all
// rows' lines at the start of each line or 16-token group, step by step: the few-rows QK 1.21x
// faster at Q = 1 (R 3, D 64), 1.24x at R 4, D 64, 1.14x at R 8, D 32; then qk_block 1.19x at R 4,
// D 128 (Llama-3 decoding), 1.12x at R 28, D 128, 1.17x at R 27, D 64; then the row-major P V
// 1.04-1.10x at Q 5-9; the pair QK 1.05x at R 21, D 64 (unrolled: a per-step bound cost 5 % in
// cache). A burst of prefetches that DRAM cannot serve at once holds up the loads behind it.
constexpr int kPrefetchLocality = 2;

// Padded row count: rows live in vector lanes.
inline int row_pad(int R) { return (R + VW - 1) / VW * VW; }

// AVX-512 QK with pairs of head_dim elements in lanes (qk_pair_block): lane 2i + p of group g holds
// row 8g + i, head_dim element 2e + p, so one 16-lane FMA serves 8 rows x 2 elements and the rows
// are padded to a multiple of 8, not 16. Taken where the groups fit one register block and that
// saves lanes or loads: 1 or 3 groups of 8 rows (R = 17-24: 24 lanes instead of 32, e.g. SmolLM2
// verifying 6 drafts, Llama-3 verifying 4; R <= 8 outside the tokens-in-lanes path, e.g. Llama-3
// decoding), and 2 groups (R = 9-16, even D: the same 16 lanes as rows in lanes, but one K
// broadcast per 2 FMAs instead of one per FMA, so the block is no longer bound by its loads).
// Measured on one Intel Xeon core (AVX-512), verify_attention at 2K-8K against rows in lanes
// (bench/results/kernels_xeon_avx512/ab_pair_qk.md, medians of 6 rounds): R = 21, D 64 1.15x
// faster, R = 20, D 128 1.17x, R = 4 and 8 at D 128 1.07-1.11x; 2 groups, in the torch-free loop
// (bench/cpu_attend_microbench.cpp, 2 runs): R = 15, D 64 1.06-1.10x, R = 9, D 64 1.06-1.07x,
// R = 12 and 16 at D 128 1.04-1.08x. An earlier version also took 5 groups (R = 36, blocked
// 2 + 2 + 1): 2-5 % slower than 3 row vectors of 16 lanes, so 5 or more groups keep rows in
// lanes. The packed queries (pack_queries) then take ceil(D / 2) * 2 * row_pad8(R) floats, at most
// the D * Rp of the plain layout while row_pad8(R) <= 8 D and, for 2 groups (row_pad8(R) = Rp),
// D is even.
constexpr bool kPairQk = VEGAS_X86_VEC == 16;
inline int row_pad8(int R) { return (R + 7) / 8 * 8; }
inline bool pair_qk(int R, int D) {
  const int groups = (R + 7) / 8;
  return kPairQk && (groups == 1 || groups == 3 || (groups == 2 && D % 2 == 0)) && row_pad8(R) <= 8 * D;
}

// exp(x) lane-wise (rel. error <= 2e-7), x clamped to [-86.5, 88] (e^x normal); NaN stays NaN.
// Callers zero masked (-inf) lanes separately. Range reduction as in Cephes: n = round(x log2 e),
// r = x - n ln2 in two steps (ln2 split in a short high part and the rest), so r is nearly exact.
// AVX-512: e^r a degree-5 polynomial (a minimax fit of the relative error on [-ln2/2, ln2/2] with
// the constant term 1, so exp(0) = 1 and the mean error is ~-2e-8: 9.1e-8 in exact arithmetic,
// 1.6e-7 measured against double exp in fp32 over x in [-86, 0]) and
// the 2^n scaling one vscalefps: 12 instructions against 20 for the form below, whose polynomial
// has one more term and whose exponent goes in by conversion, add, shift and multiply. Measured in
// the torch-free loop (bench/cpu_attend_microbench.cpp) on one Intel Xeon core, K/V from L2:
// 1.07-1.09x faster at R = 21, D 64, 1.05x at R = 15, 1.02x at R = 28, D 128.
// The other builds: Cephes' polynomial for e^r (rel. error ~2e-7), x clamped to [-87, 88]; on AVX2
// the clamps are single max / min instructions (with the constant first, a NaN lane returns the
// NaN) and the floor one rounding instruction; the baseline build compares and blends. Same values
// either way.
static inline vf vexp(vf x) {
#if VEGAS_X86_VEC == 16
  const __m512 xc = _mm512_min_ps(_mm512_set1_ps(88.f), _mm512_max_ps(_mm512_set1_ps(-86.5f), (__m512)x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(8.290315046906471e-3f), r, _mm512_set1_ps(4.189793020486832e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.666763573884964e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.999915063381195e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(9.999997019767761e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  return (vf)_mm512_scalef_ps(y, n);
#else
#if VEGAS_X86_VEC == 8
  x = (vf)_mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.f), (__m256)x));
  const vf fx = x * 1.44269504088896341f + 0.5f;
  const vf fl = (vf)_mm256_floor_ps((__m256)fx);
#else
  x = x < splat(-87.f) ? splat(-87.f) : x;
  x = x > splat(88.f) ? splat(88.f) : x;
  const vf fx = x * 1.44269504088896341f + 0.5f;
  vf fl = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);  // trunc
  fl = fl > fx ? fl - 1.f : fl;                                         // floor
#endif
  vf r = x - fl * 0.693359375f;
  r = r - fl * -2.12194440e-4f;
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const vi e = (__builtin_convertvector(fl, vi) + 127) << 23;
  return y * (vf)e;  // same-size vector cast: reinterprets the bits
#endif
}

// dst[0:n] = float(src[0:n]).
template <typename T>
static inline void to_f32(const T* src, int n, float* dst) {
  int i = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    for (; i + VW <= n; i += VW) {
      const vu w = __builtin_convertvector(*reinterpret_cast<const vhu*>(s + i), vu) << 16;
      st(dst + i, (vf)w);
    }
  }
#if VEGAS_F16C == 16
  if constexpr (std::is_same_v<T, c10::Half>)
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif VEGAS_F16C == 8
  if constexpr (std::is_same_v<T, c10::Half>)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// S^T rows [t0, t0 + MT) x row vectors [rv0, rv0 + NV): s[t * Rp + r] = sum_d krow[t][d] *
// qt[d * Rp + r]. Token rows past `last` reuse row `last` (their results are ignored).
// pf != 0: prefetch each row's counterpart pf floats away (tile t's V row; see attend), one
// cache line per 16 d.
template <int NV, int MT>
static inline void qk_block(const float* qt, int Rp, int rv0, const float* const* krow, int t0,
                            int last, int D, int64_t pf, float* s) {
  const float* kr[MT];
  for (int t = 0; t < MT; ++t) kr[t] = krow[std::min(t0 + t, last)];
  vf a[MT][NV];
  for (int t = 0; t < MT; ++t)
    for (int n = 0; n < NV; ++n) a[t][n] = vf{};
  const float* qd = qt + rv0 * VW;
  for (int d0 = 0; d0 < D; d0 += 16) {
    const int d1 = std::min(D, d0 + 16);
    const bool spread = d1 - d0 >= MT;  // one row's line per head_dim step (see kPrefetchLocality)
    if (pf && !spread)
      for (int t = 0; t < MT; ++t) __builtin_prefetch(kr[t] + pf + d0, 0, kPrefetchLocality);
    for (int d = d0; d < d1; ++d, qd += Rp) {
      if (pf && spread && d - d0 < MT) __builtin_prefetch(kr[d - d0] + pf + d0, 0, kPrefetchLocality);
      vf q[NV];
      for (int n = 0; n < NV; ++n) q[n] = ld(qd + n * VW);
      for (int t = 0; t < MT; ++t) {
        const vf kb = splat(kr[t][d]);
        for (int n = 0; n < NV; ++n) a[t][n] += kb * q[n];
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int n = 0; n < NV; ++n) st(s + (t0 + t) * Rp + (rv0 + n) * VW, a[t][n]);
}

template <int NV>
static inline void qk_rows(const float* qt, int Rp, int rv0, const float* const* krow, int ntok,
                           int D, int64_t pf, float* s) {
  constexpr int MT = kWide ? 8 : (NV == 1 ? 8 : (NV == 2 ? 6 : 4));
  for (int t0 = 0; t0 < ntok; t0 += MT) qk_block<NV, MT>(qt, Rp, rv0, krow, t0, ntok - 1, D, pf, s);
}

#if VEGAS_X86_VEC == 16
// The pair layout's QK (see pair_qk): all NG 8-row groups x MT tokens from t0; qp[e * 16 NG +
// g * 16 + 2 i + p] = scaled q of row 8 g + i at head_dim element 2 e + p (0 past R and D); each K
// pair K[t, 2e..2e+1] broadcast as one 64-bit element. The even and odd lanes' partial sums are
// added pairwise into rows-in-lanes score vectors, s[t * Rp + 8 g + i] for a group pair (n, n + 1),
// n even (a missing second group gives zeros: padded rows).
// Token rows past `last` reuse row `last`. An odd D's last element goes into the even lanes only
// (masked), so an infinite K element there cannot meet the zero of an odd lane.
template <int NG, int MT>
static inline void qk_pair_block(const float* qp, const float* const* krow, int t0, int last, int D, int64_t pf,
                                 int Rp, float* s) {
  constexpr int W = 16 * NG;
  const float* kr[MT];
  for (int t = 0; t < MT; ++t) kr[t] = krow[std::min(t0 + t, last)];
  vf a[MT][NG];
  for (int t = 0; t < MT; ++t)
    for (int n = 0; n < NG; ++n) a[t][n] = vf{};
  const float* qe = qp;
  const int D2 = D / 2;
  auto pair_step = [&](int e) __attribute__((always_inline)) {
    vf q[NG];
    for (int n = 0; n < NG; ++n) q[n] = ld(qe + n * VW);
    for (int t = 0; t < MT; ++t) {
      double kp;
      std::memcpy(&kp, kr[t] + 2 * e, sizeof kp);
      const vf kb = (vf)_mm512_castpd_ps(_mm512_set1_pd(kp));
      for (int n = 0; n < NG; ++n) a[t][n] += kb * q[n];
    }
    qe += W;
  };
  int e0 = 0;
  for (; e0 + 8 <= D2; e0 += 8) {  // 8 pairs: one 64-byte line of each K row, MT / 8 rows' lines
                                   // prefetched per pair step (see kPrefetchLocality)
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      if (pf)
        for (int t = j * MT / 8; t < (j + 1) * MT / 8; ++t) __builtin_prefetch(kr[t] + pf + 2 * e0, 0, kPrefetchLocality);
      pair_step(e0 + j);
    }
  }
  if (e0 < D2) {  // a last, shorter line: all rows' at once
    if (pf)
      for (int t = 0; t < MT; ++t) __builtin_prefetch(kr[t] + pf + 2 * e0, 0, kPrefetchLocality);
    for (int e = e0; e < D2; ++e) pair_step(e);
  }
  if (D & 1) {
    vf q[NG];
    for (int n = 0; n < NG; ++n) q[n] = ld(qe + n * VW);
#pragma GCC unroll 16
    for (int t = 0; t < MT; ++t) {
      const __m512 kb = _mm512_set1_ps(kr[t][D - 1]);
      for (int n = 0; n < NG; ++n)
        a[t][n] = (vf)_mm512_mask3_fmadd_ps(kb, (__m512)q[n], (__m512)a[t][n], static_cast<__mmask16>(0x5555));
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  // unrolled (here and for the odd element): otherwise GCC 12, which does not inline this block
  // into the op, indexed a[t][n] on the stack (24 spills, 48 reloads per block)
#pragma GCC unroll 16
  for (int t = 0; t < MT; ++t)
#pragma GCC unroll 4
    for (int n = 0; n < NG; n += 2) {
      const __m512 lo = (__m512)a[t][n];
      const __m512 hi = n + 1 < NG ? (__m512)a[t][n + 1] : _mm512_setzero_ps();
      const vf out = (vf)_mm512_add_ps(_mm512_permutex2var_ps(lo, even, hi), _mm512_permutex2var_ps(lo, odd, hi));
      st(s + (t0 + t) * Rp + n * 8, out);
    }
}

template <int NG>
static inline void qk_pair_rows(const float* qp, const float* const* krow, int ntok, int D, int64_t pf, int Rp,
                                float* s) {
  constexpr int MT = NG == 1 ? 16 : 8;  // 2 groups: 8 (12 tokens measured no faster)
  for (int t0 = 0; t0 < ntok; t0 += MT) qk_pair_block<NG, MT>(qp, krow, t0, ntok - 1, D, pf, Rp, s);
}
#endif

// What one P V pass over a block of rows prefetches (see attend): the rows `off` floats from the
// V rows read (off == 0: none), their lines (of 16 floats, in each pv_block's head_dim range) in
// row-major order shared out over the npass passes over the row blocks, nl / npass lines per
// token step: pass 0 asks for the first rows' lines, so the next tile's first QK block finds
// them early. Measured on one Intel Xeon core (AVX-512), K/V from DRAM on huge pages
// (bench/cpu_attend_microbench.cpp, 8K tokens, 160 or 80 KV heads): against line L of every row
// in pass L % npass (itself 1.02-1.08x faster at Q 5-9 than all lines in the first pass), 1.05x
// at Q 7, G 3, D 64, 1.04-1.06x at Q 5 and 9, 1.10x at Q 7, G 4, D 128; from L2 no change.
// The V rows are `stride` floats apart (contiguous tokens: prefetching is on only there).
struct PassPrefetch {
  int64_t off, stride;
  int pass, npass;
  PassPrefetch(int64_t off_ = 0, int64_t stride_ = 0, int pass_ = 0, int npass_ = 1)
      : off(off_), stride(stride_), pass(pass_), npass(npass_) {}
};

// acc rows [r0, r0 + MR), head_dim vectors [d0, d0 + ND * VW):
//   acc = alpha * acc + sum_{t < ntok} P[t, r] * vrow[t][d],
// P[t, r] = p[t * Rp + r] (token-major, the rows-in-lanes softmax), or, with kRowP,
// p[r * kTile + t] (row-major, the few-rows path). pf: the lines this pass prefetches.
template <int MR, int ND, bool kRowP = false>
static inline void pv_block(const float* p, int Rp, int r0, const float* const* vrow, int ntok,
                            const float* alpha, int d0, int D, PassPrefetch pf, float* acc) {
  // this block's lines of each prefetched row (16 floats each from d0, inside D), and where this
  // pass's share starts: line k = row k / nl, line k % nl for k from pass * ntok * nl / npass on,
  // nl / npass of them per token (the remainder carried in pacc; nl == 0: none), to at most the
  // last row's last line. pp: the next line's address.
  const int nl = pf.off == 0 ? 0 : (std::min(D, d0 + ND * VW) - d0 + 15) / 16;
  const int64_t k0 = int64_t(pf.pass) * ntok * nl, first = nl ? k0 / pf.npass : 0;
  int pc = nl ? static_cast<int>(first % nl) : 0;
  const float* pp = vrow[0] + pf.off + d0 + (nl ? first / nl : 0) * pf.stride + 16 * pc;
  const int64_t row_step = pf.stride - 16 * nl;
  int pacc = static_cast<int>(k0 % pf.npass);
  vf a[MR][ND];
  for (int i = 0; i < MR; ++i) {
    const vf al = splat(alpha[r0 + i]);
    for (int n = 0; n < ND; ++n) a[i][n] = ld(acc + (r0 + i) * D + d0 + n * VW) * al;
  }
  constexpr int rs = kRowP ? kTile : 1;  // row stride of P
  const int ts = kRowP ? 1 : Rp;           // token stride of P
  const float* pt = p + r0 * rs;
  for (int t = 0; t < ntok; ++t, pt += ts) {
    for (pacc += nl; pacc >= pf.npass; pacc -= pf.npass) {
      __builtin_prefetch(pp, 0, kPrefetchLocality);
      pp += 16;
      if (++pc == nl) {
        pc = 0;
        pp += row_step;
      }
    }
    vf v[ND];
    for (int n = 0; n < ND; ++n) v[n] = ld(vrow[t] + d0 + n * VW);
    for (int i = 0; i < MR; ++i) {
      const vf pb = splat(pt[i * rs]);
      for (int n = 0; n < ND; ++n) a[i][n] += pb * v[n];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int n = 0; n < ND; ++n) st(acc + (r0 + i) * D + d0 + n * VW, a[i][n]);
}

template <int MR, bool kRowP = false>
static inline void pv_rows(const float* p, int Rp, int r0, const float* const* vrow, int ntok,
                           const float* alpha, int D, PassPrefetch pf, float* acc) {
  int d0 = 0;
  for (; d0 + kPvND * VW <= D; d0 += kPvND * VW)
    pv_block<MR, kPvND, kRowP>(p, Rp, r0, vrow, ntok, alpha, d0, D, pf, acc);
  if constexpr (kPvND > 2)
    for (; d0 + 2 * VW <= D; d0 += 2 * VW) pv_block<MR, 2, kRowP>(p, Rp, r0, vrow, ntok, alpha, d0, D, pf, acc);
  for (; d0 + VW <= D; d0 += VW) pv_block<MR, 1, kRowP>(p, Rp, r0, vrow, ntok, alpha, d0, D, pf, acc);
  for (; d0 < D; ++d0)
    for (int i = 0; i < MR; ++i) {
      float x = acc[(r0 + i) * D + d0] * alpha[r0 + i];
      for (int t = 0; t < ntok; ++t) x += (kRowP ? p[(r0 + i) * kTile + t] : p[t * Rp + r0 + i]) * vrow[t][d0];
      acc[(r0 + i) * D + d0] = x;
    }
}

template <bool kRowP = false>
static inline void pv_tail(int mr, const float* p, int Rp, int r0, const float* const* vrow, int ntok,
                           const float* alpha, int D, PassPrefetch pf, float* acc) {
  switch (mr) {
    case 1: pv_rows<1, kRowP>(p, Rp, r0, vrow, ntok, alpha, D, pf, acc); break;
    case 2: pv_rows<2, kRowP>(p, Rp, r0, vrow, ntok, alpha, D, pf, acc); break;
    case 3: pv_rows<3, kRowP>(p, Rp, r0, vrow, ntok, alpha, D, pf, acc); break;
    case 4: pv_rows<4, kRowP>(p, Rp, r0, vrow, ntok, alpha, D, pf, acc); break;
    case 5: pv_rows<5, kRowP>(p, Rp, r0, vrow, ntok, alpha, D, pf, acc); break;
    default: break;
  }
}

// The transposed P V: acct[d, r] = alpha[r] * acct[d, r] + sum_{t < ntok} P[t, r] * vrow[t][d]
// for head_dim elements [d0, d0 + MT) and row vectors [rv0, rv0 + NV): rows in lanes, as the
// token-major P of the rows-in-lanes softmax (P[t, r] = p[t * Rp + r]) and alpha come; V[t, d]
// broadcast. acct: [D, Rp]. pf != 0: prefetch the V rows' counterparts pf floats away (the next
// tile's K row; see attend; each 16-float line by the block it starts in).
template <int NV, int MT>
static inline void pv_t_block(const float* p, int Rp, int rv0, const float* const* vrow, int ntok,
                              const float* alpha, int d0, int64_t pf, float* acct) {
  vf a[MT][NV];
  vf al[NV];
  for (int n = 0; n < NV; ++n) al[n] = ld(alpha + (rv0 + n) * VW);
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NV; ++n) a[m][n] = ld(acct + (d0 + m) * Rp + (rv0 + n) * VW) * al[n];
  const float* pt = p + rv0 * VW;
  const int line = (d0 + 15) / 16 * 16 - d0;  // the cache line that starts in this block, if any
  const bool fetch = pf && line < MT;
  for (int t = 0; t < ntok; ++t, pt += Rp) {
    const float* vr = vrow[t] + d0;
    if (fetch) __builtin_prefetch(vr + pf + line, 0, kPrefetchLocality);
    vf pv[NV];
    for (int n = 0; n < NV; ++n) pv[n] = ld(pt + n * VW);
    for (int m = 0; m < MT; ++m) {
      const vf vb = splat(vr[m]);
      for (int n = 0; n < NV; ++n) a[m][n] += vb * pv[n];
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NV; ++n) st(acct + (d0 + m) * Rp + (rv0 + n) * VW, a[m][n]);
}

// pv_t_block over all of head_dim: 12 / NV elements at a time (the loop uses NV = 3), then the
// remainder one by one.
template <int NV>
static inline void pv_t_rows(const float* p, int Rp, int rv0, const float* const* vrow, int ntok,
                             const float* alpha, int D, int64_t pf, float* acct) {
  constexpr int MT = 12 / NV;
  int d0 = 0;
  for (; d0 + MT <= D; d0 += MT) pv_t_block<NV, MT>(p, Rp, rv0, vrow, ntok, alpha, d0, pf, acct);
  for (; d0 < D; ++d0) pv_t_block<NV, 1>(p, Rp, rv0, vrow, ntok, alpha, d0, pf, acct);
}

// One tile's tokens through the task's block sums (per-block sums relative to this tile's max).
// The task starts on a block boundary; a block begun in an earlier tile is rescaled first:
// rescale(bsum) once when the tile starts inside a block, then put(bsum, j, first) for every
// token j < nt of the tile, bsum at its block's R floats, first = j starts that block.
template <typename Rescale, typename Put>
static inline void walk_block_sums(const BlockSums& blk, int R, const int64_t* tok, int nt, Rescale rescale, Put put) {
  const int64_t bs = blk.block_size;
  int64_t off = tok[0] % bs;
  float* bsum = blk.bsum + (tok[0] / bs - blk.block0) * R;
  if (off != 0) rescale(bsum);
  for (int j = 0; j < nt; ++j) {
    put(bsum, j, off == 0);
    if (++off == bs) {
      off = 0;
      bsum += R;
    }
  }
}

#if defined(__clang__)
#define VEGAS_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define VEGAS_SHUF(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif

// Lane i of the result = sum of the lanes of a[i], i < VW (a transpose-and-add tree).
static inline vf hsum_many(const vf* a) {
#if VEGAS_VW == 8
  vf t[4], u[2];
  for (int i = 0; i < 4; ++i)
    t[i] = VEGAS_SHUF(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           VEGAS_SHUF(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)
    u[i] = VEGAS_SHUF(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           VEGAS_SHUF(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return VEGAS_SHUF(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) + VEGAS_SHUF(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
#elif VEGAS_VW == 16
  vf t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // lane 2c: a[2i] pair c; lane 2c+1: a[2i+1] pair c
    t[i] = VEGAS_SHUF(a[2 * i], a[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           VEGAS_SHUF(a[2 * i], a[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  for (int i = 0; i < 4; ++i)  // lane 4c + m: a[4i + m] quad c
    u[i] = VEGAS_SHUF(t[2 * i], t[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           VEGAS_SHUF(t[2 * i], t[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  for (int i = 0; i < 2; ++i)  // lane 8c + m: a[8i + m] octet c
    w[i] = VEGAS_SHUF(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           VEGAS_SHUF(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  return VEGAS_SHUF(w[0], w[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         VEGAS_SHUF(w[0], w[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
#else
#error "hsum_many: VEGAS_VW must be 8 or 16"
#endif
}

// ---- few rows (R <= kFewRows, AVX-512 and AVX2): tokens in lanes ----------------------------
// With few rows (plain decoding and drafting: R = the GQA group, e.g. 3 or 4) most lanes of the
// rows-in-lanes layout would be padding (R = 3 of 16 lanes), and the QK loop would spend a
// vector FMA per head_dim element and token. Here each row is dotted with 16 K rows at a time
// (head_dim in lanes, the K rows read as vectors) and the 16 partial-sum vectors are reduced
// with a transpose-and-add tree, so the scores come out with tokens in lanes; the online
// softmax then runs per row over the tile (row-major P, s[r * kTile + t]), and P V reads P
// row-major. Per 16 tokens and row: D / 16 + ~3 vector ops per token instead of D.
// Taken for R <= 8 rows with R * D <= 384. Measured on one AMD EPYC (Zen 5) core against the
// rows-in-lanes loop, 8K-32K tokens from DRAM (bench/results/kernels_zen5/kernels_grid.md and a
// first grid before the D limit): R = 3, D 64 1.13-1.85x faster (median ~1.2); R = 6, D 64
// 0.77-1.34x (median ~1.05); R = 4, D 128 0.84-1.05x (median ~0.95: memory-bound either way,
// though 1.4x faster from L2) and R = 8, D 128 0.84-0.88x, so these keep the rows-in-lanes loop.
// AVX2 (8 lanes, 8 tokens per score vector) takes it for R <= 4: per 8 tokens and row D + ~14
// vector ops against D per 8 tokens for all rows in lanes, so it pays below ~6 rows; measured on
// one AMD EPYC (Zen 3) core, R = 3, D 64: 1.45x faster from L2, 1.3x at 8K from DRAM.
#if VEGAS_X86_VEC >= 8
#if VEGAS_X86_VEC == 16
constexpr int kFewRows = 8;
constexpr int kFewRowsDims = 384;  // most R * D
#else
constexpr int kFewRows = 4;        // 8 lanes: tokens in lanes pay off for fewer rows (see above)
constexpr int kFewRowsDims = 512;
#endif

// s[r * kTile + t] = q_r . krow[t] for r < R, t < ntok (rounded up to 16; the lanes past ntok
// repeat token ntok - 1). q: [R, D] fp32 row-major, scaled. pf != 0: prefetch the K rows'
// counterparts pf floats away (this tile's V rows; see attend), 16 rows before their scores are
// computed.
static inline void qk_few(const float* q, int R, int D, const float* const* krow, int ntok, int64_t pf,
                          float* s) {
  const int Dv = D / VW;
  const bool tail = D % VW != 0;
#if VEGAS_X86_VEC == 16
  const __mmask16 tmask = static_cast<__mmask16>((1u << (D % VW)) - 1);
  auto load_tail = [&](const float* p) { return (vf)_mm512_maskz_loadu_ps(tmask, p); };
#else
  vi tm;
  for (int i = 0; i < VW; ++i) tm[i] = i < D % VW ? -1 : 0;
  const __m256i tmask = (__m256i)tm;
  auto load_tail = [&](const float* p) { return (vf)_mm256_maskload_ps(p, tmask); };  // no fault past D
#endif
  for (int t0 = 0; t0 < ntok; t0 += VW) {
    const float* kr[VW];
    for (int i = 0; i < VW; ++i) kr[i] = krow[std::min(t0 + i, ntok - 1)];
    for (int r = 0; r < R; ++r) {
      const float* qr = q + r * D;
      vf a[VW];
      for (int i = 0; i < VW; ++i) a[i] = vf{};
      // row r's pass asks for the lines of the rows i = r (mod R), one line of each per step
      // (see kPrefetchLocality); VW floats = one 64-byte line on AVX-512, half of one on AVX2
      for (int e = 0; e < Dv; ++e) {
        if (pf && (e * VW) % 16 == 0)
          for (int i = r; i < VW; i += R) __builtin_prefetch(kr[i] + pf + e * VW, 0, kPrefetchLocality);
        const vf qv = ld(qr + e * VW);
        for (int i = 0; i < VW; ++i) a[i] += qv * ld(kr[i] + e * VW);
      }
      if (pf && tail && (Dv * VW) % 16 == 0)
        for (int i = r; i < VW; i += R) __builtin_prefetch(kr[i] + pf + Dv * VW, 0, kPrefetchLocality);
      if (tail) {
        const vf qv = load_tail(qr + Dv * VW);
        for (int i = 0; i < VW; ++i) a[i] += qv * load_tail(kr[i] + Dv * VW);
      }
      st(s + r * kTile + t0, hsum_many(a));
    }
  }
}

// Masks each row's scores past its visible prefix nvis[r], then the online-softmax update of
// the tile, per row: m, l, alpha (and blk's mt) as in the rows-in-lanes path, p overwrites s.
static inline void softmax_few(int R, const int* nvis, float* s, float* m, float* l, float* alpha,
                               float* mt) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  vi lane;
  for (int i = 0; i < VW; ++i) lane[i] = i;
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * kTile;
    const vi lim = vi{} + nvis[r];
    vf mx = splat(kNegInf);
    for (int v = 0; v < kTile / VW; ++v) {
      vf x = ld(sr + v * VW);
      x = lane + v * VW >= lim ? splat(kNegInf) : x;
      st(sr + v * VW, x);
      mx = x > mx ? x : mx;
    }
    float mxs = kNegInf;
    for (int i = 0; i < VW; ++i) mxs = mx[i] > mxs ? mx[i] : mxs;
    const float m_old = m[r];
    const float m_new = mxs > m_old ? mxs : m_old;
    const float al = m_old == kNegInf ? 0.f : vexp(splat(m_old - m_new))[0];
    const vf mn = splat(m_new);
    vf sum = vf{};
    for (int v = 0; v < kTile / VW; ++v) {
      const vf x = ld(sr + v * VW);
      vf p = vexp(x - mn);
      p = x == splat(kNegInf) ? vf{} : p;
      st(sr + v * VW, p);
      sum += p;
    }
    float ss = 0.f;
    for (int i = 0; i < VW; ++i) ss += sum[i];
    alpha[r] = al;
    l[r] = l[r] * al + ss;
    m[r] = m_new;
    if (mt) mt[r] = m_new;
  }
}

#else
constexpr int kFewRows = 0;
constexpr int kFewRowsDims = 0;
#endif

// Packs the task's query rows for the QK micro-kernel: qt[d * Rp + r] = scale * q_r[d]
// (zero in padded lanes), or, where pair_qk(R, D), the pair layout of qk_pair_block; q row r at
// q + r * D (fp32).
inline void pack_queries(const float* q, int R, int D, float* qt) {
  if (pair_qk(R, D)) {  // qt[e * W + g * 16 + 2 i + p] = q_{8g+i}[2e + p], W = 16 x the 8-row groups
    const int W = row_pad8(R) * 2, D2 = (D + 1) / 2;
    std::fill(qt, qt + size_t(D2) * W, 0.f);
    for (int r = 0; r < R; ++r)
      for (int d = 0; d < D; ++d) qt[(d / 2) * W + (r / 8) * 16 + 2 * (r % 8) + d % 2] = q[r * D + d];
    return;
  }
  const int Rp = row_pad(R);
  for (int d = 0; d < D; ++d)
    for (int r = 0; r < Rp; ++r) qt[d * Rp + r] = r < R ? q[r * D + d] : 0.f;
}

// Attend R rows to n tokens -- token i is list[i], or first + i when list is null --
// updating the online-softmax state m[Rp], l[Rp], acc[R, D] (acc un-normalized,
// relative to m; m = -inf, l = 0, acc = 0 initially). k/v point at token 0 of this KV
// head; k_st / v_st are their token strides. rows.q is the packed qt of pack_queries.
// NaN or +inf scores poison the row (l becomes NaN), so they propagate like the reference.
template <typename T>
void attend(const Rows& rows, const T* k, const T* v, int64_t k_st, int64_t v_st, const int64_t* list,
            int64_t first, int64_t n, const Scratch& ws, float* m, float* l, float* acc,
            const BlockSums* blk) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int R = rows.R;
  const int D = rows.D;
  const int Rp = row_pad(R);
  const int NVall = Rp / VW;
  const bool few = R <= kFewRows && R * D <= kFewRowsDims;  // tokens in lanes (see qk_few)
  const bool pair = !few && pair_qk(R, D);                  // QK on head_dim pairs (see pair_qk)
  // The output accumulates transposed in ws.acct (pv_t_block) where that pays: it computes all
  // Rp lanes (pv_rows computes the R rows) and takes a broadcast per NV FMAs (pv_rows one per 2),
  // so only in blocks of 3 row vectors with at most 1/5 of the lanes padding (R = 21 of 24:
  // SmolLM2's 7 queries x 3 heads). Measured on one Zen 3 core, D 64 from L2: 1.1x faster at
  // R = 21; R = 9 (16 lanes, blocks of 2) ran 1.2-1.5x slower transposed.
  const bool pvt = kPvT && !few && NVall % 3 == 0 && 5 * R >= 4 * Rp;
  if (pvt)
    for (int d = 0; d < D; ++d)
      for (int r = 0; r < Rp; ++r) ws.acct[d * Rp + r] = r < R ? acc[r * D + d] : 0.f;
  int* nvis = ws.nv;
  const float* krow[kTile];
  const float* vrow[kTile];
  int64_t tok[kTile];
  // Contiguous fp32 tokens: the rows to prefetch are a fixed distance from the rows in use. The
  // memory is read in the order the loop uses it (tile t's K, tile t's V, tile t + 1's K, ...),
  // and each phase asks for the next in that order: the QK of tile t for tile t's V (token j's V
  // row is K row j + (v - k) when K and V share a token stride), the P V of tile t for tile t + 1's
  // K. Measured against asking for the next tile's K in the QK and its V in the P V (a whole tile
  // further ahead), on one Intel Xeon core (AVX-512), K/V from DRAM on huge pages
  // (bench/cpu_attend_microbench.cpp, 8K tokens x 160 KV heads): 1.06x faster at Q = 1, 1.08x at
  // Q = 5, 1.04x at Q = 7 (G 3, D 64), 1.02-1.04x at Q = 7, G 4, D 128; 1.02x from L3.
  const bool direct = !list && std::is_same_v<T, float>;
  const bool same_stride = k_st == v_st;
  const int64_t kv_gap = (reinterpret_cast<intptr_t>(v) - reinterpret_cast<intptr_t>(k)) / int64_t(sizeof(T));
  // clang-format off
  const int64_t pf_k = !direct ? 0 : same_stride ? kv_gap : kTile * k_st;
  const int64_t pf_v = !direct ? 0 : same_stride ? kTile * k_st - kv_gap : kTile * v_st;
  // clang-format on
  const int npv = (R + kPvMR - 1) / kPvMR;  // P V passes over the row blocks (see PassPrefetch)
  for (int64_t i0 = 0, tile = 0; i0 < n; i0 += kTile, ++tile) {
    const int nt = static_cast<int>(std::min<int64_t>(kTile, n - i0));
    if (list) {
      for (int j = 0; j < nt; ++j) tok[j] = list[i0 + j];
      // gathered tokens (a draft's selected blocks): no hardware prefetcher foresees them, and
      // from DRAM each row costs a full miss latency. The next tile's rows are known: ask for
      // all of their lines now, so they arrive while this tile is computed.
      const int64_t pa = i0 == 0 ? 0 : i0 + kTile;  // first tile: this one and the next
      const int64_t nn = std::min<int64_t>(i0 == 0 ? 2 * kTile : kTile, n - pa);
      for (int64_t j = 0; j < nn; ++j) {
        const char* kr = reinterpret_cast<const char*>(k + list[pa + j] * k_st);
        const char* vr = reinterpret_cast<const char*>(v + list[pa + j] * v_st);
        for (int64_t o = 0; o < D * int64_t(sizeof(T)); o += 64) {
          __builtin_prefetch(kr + o, 0, kPrefetchLocality);
          __builtin_prefetch(vr + o, 0, kPrefetchLocality);
        }
      }
    } else
      for (int j = 0; j < nt; ++j) tok[j] = first + i0 + j;
    // visible prefix of each row (rows' limits are non-decreasing in r): all of the tile where
    // row 0 sees the tile's last token of a contiguous range (every tile but the causal edge)
    int ntmax = 0;
    if (!list && tok[nt - 1] <= rows.pos32[0]) {
      for (int r = 0; r < R; ++r) nvis[r] = nt;
      ntmax = nt;
    } else
      for (int r = 0; r < R; ++r) {
        int nv = (r > 0) ? nvis[r - 1] : 0;
        while (nv < nt && tok[nv] <= rows.pos32[r]) ++nv;
        nvis[r] = nv;
        ntmax = std::max(ntmax, nv);
      }
    if (ntmax > 0) {
      if constexpr (std::is_same_v<T, float>) {
        for (int j = 0; j < ntmax; ++j) {
          krow[j] = k + tok[j] * k_st;
          vrow[j] = v + tok[j] * v_st;
        }
      } else {
        for (int j = 0; j < ntmax; ++j) {
          float* kd = ws.kt + j * D;
          float* vd = ws.vt + j * D;
          to_f32(k + tok[j] * k_st, D, kd);
          to_f32(v + tok[j] * v_st, D, vd);
          krow[j] = kd;
          vrow[j] = vd;
        }
      }
#if VEGAS_X86_VEC >= 8
      if (few) qk_few(rows.q, R, D, krow, ntmax, pf_k, ws.s);
#endif
#if VEGAS_X86_VEC == 16
      if (pair) {
        if (row_pad8(R) == 24)  // the 3 groups of pair_qk
          qk_pair_rows<3>(rows.qt, krow, ntmax, D, pf_k, Rp, ws.s);
        else if (row_pad8(R) == 16)  // 2 groups
          qk_pair_rows<2>(rows.qt, krow, ntmax, D, pf_k, Rp, ws.s);
        else  // its 1 group
          qk_pair_rows<1>(rows.qt, krow, ntmax, D, pf_k, Rp, ws.s);
      }
#endif
      for (int rv0 = 0; !few && !pair && rv0 < NVall;) {
        const int nv = row_block(NVall - rv0);
        if (nv == 3)
          qk_rows<3>(rows.qt, Rp, rv0, krow, ntmax, D, rv0 == 0 ? pf_k : 0, ws.s);
        else if (nv == 2)
          qk_rows<2>(rows.qt, Rp, rv0, krow, ntmax, D, rv0 == 0 ? pf_k : 0, ws.s);
        else
          qk_rows<1>(rows.qt, Rp, rv0, krow, ntmax, D, rv0 == 0 ? pf_k : 0, ws.s);
        rv0 += nv;
      }
    }
#if VEGAS_X86_VEC >= 8
    if (few) {
      softmax_few(R, nvis, ws.s, m, l, ws.alpha, blk ? blk->mt + tile * Rp : nullptr);
      if (blk)  // row-major P: R scalars per block
        walk_block_sums(
            *blk, R, tok, nt,
            [&](float* b) {  // a zero sum stays zero (a poisoned row's alpha is NaN: see below)
              for (int r = 0; r < R; ++r) b[r] = b[r] == 0.f ? 0.f : b[r] * ws.alpha[r];
            },
            [&](float* b, int j, bool first) {
              if (first)
                for (int r = 0; r < R; ++r) b[r] = ws.s[r * kTile + j];
              else
                for (int r = 0; r < R; ++r) b[r] += ws.s[r * kTile + j];
            });
      int r = 0;
      for (; r + kPvMR <= R; r += kPvMR)
        pv_rows<kPvMR, true>(ws.s, Rp, r, vrow, nvis[r + kPvMR - 1], ws.alpha, D, {pf_v, v_st, r / kPvMR, npv}, acc);
      if (r < R) pv_tail<true>(R - r, ws.s, Rp, r, vrow, nvis[R - 1], ws.alpha, D, {pf_v, v_st, r / kPvMR, npv}, acc);
      continue;
    }
#endif
    // causal mask (and the padded lanes, whose limit is -1), then tokens no row sees. Skipped
    // where every row sees the whole tile (all tiles but the causal edge): the padded lanes then
    // hold the scores of zero queries, and nothing reads their state (their block-sum lanes are
    // overwritten by the next block's first token or lie past the last block; block_reduce and
    // the finish read rows < R only).
    if (nvis[0] < nt) {
      for (int j = 0; j < ntmax; ++j) {
        const vi tj = vi{} + static_cast<int32_t>(tok[j]);
        for (int rv = 0; rv < NVall; ++rv) {
          const vi pv = *reinterpret_cast<const viu*>(rows.pos32 + rv * VW);
          float* s = ws.s + j * Rp + rv * VW;
          st(s, tj > pv ? splat(kNegInf) : ld(s));
        }
      }
      for (int j = ntmax; j < nt; ++j)
        for (int rv = 0; rv < NVall; ++rv) st(ws.s + j * Rp + rv * VW, splat(kNegInf));
    }
    // 1-token blocks (the vegas default) over contiguous tokens: a token's p is its block's sum,
    // stored by the exp pass below as it makes it (AVX-512: R lanes by a masked store), not read
    // back by walk_block_sums. Measured with the whole-tile visibility above and the pointer-stepped
    // P V prefetch (pv_block), on one Intel Xeon core (AVX-512): the torch-free loop
    // (bench/cpu_attend_microbench.cpp, R 21, D 64, K/V in L2) 1.08x faster, verify_attention from
    // DRAM (bench/ab_trees_cpu.py --layers 30, 8K) 1.06-1.08x at Q 5-9 for SmolLM2 batch 4.
#if VEGAS_X86_VEC == 16
    float* const b1 = blk && !list && blk->block_size == 1 ? blk->bsum + (tok[0] - blk->block0) * R : nullptr;
#else
    float* const b1 = nullptr;
#endif
    // online softmax, vertical over the rows: p overwrites s
    for (int rv = 0; rv < NVall; ++rv) {
      // the tile's max in 4 independent chains (one chain waits on max's latency every token:
      // measured 1.02-1.03x faster over the loop at R = 21 and 28)
      vf mx4[4] = {splat(kNegInf), splat(kNegInf), splat(kNegInf), splat(kNegInf)};
      int j = 0;
      for (; j + 4 <= ntmax; j += 4)
        for (int c = 0; c < 4; ++c) {
          const vf x = ld(ws.s + (j + c) * Rp + rv * VW);
          mx4[c] = x > mx4[c] ? x : mx4[c];
        }
      for (; j < ntmax; ++j) {
        const vf x = ld(ws.s + j * Rp + rv * VW);
        mx4[0] = x > mx4[0] ? x : mx4[0];
      }
      const vf mx01 = mx4[1] > mx4[0] ? mx4[1] : mx4[0];
      const vf mx23 = mx4[3] > mx4[2] ? mx4[3] : mx4[2];
      const vf mx = mx23 > mx01 ? mx23 : mx01;
      const vf m_old = ld(m + rv * VW);
      const vf m_new = mx > m_old ? mx : m_old;
      vf alpha = vexp(m_old - m_new);
      alpha = m_old == splat(kNegInf) ? vf{} : alpha;
      st(ws.alpha + rv * VW, alpha);
      vf sum = vf{};
#if VEGAS_X86_VEC == 16
      const __mmask16 b1_lanes = static_cast<__mmask16>(R - rv * VW >= VW ? 0xFFFFu : (1u << (R - rv * VW)) - 1);
#endif
      for (int j = 0; j < nt; ++j) {
        float* s = ws.s + j * Rp + rv * VW;
        const vf x = ld(s);
        vf p = vexp(x - m_new);
        p = x == splat(kNegInf) ? vf{} : p;
        st(s, p);
#if VEGAS_X86_VEC == 16
        if (b1) _mm512_mask_storeu_ps(b1 + j * R + rv * VW, b1_lanes, (__m512)p);
#endif
        sum += p;
      }
      st(l + rv * VW, ld(l + rv * VW) * alpha + sum);
      st(m + rv * VW, m_new);
      if (blk) st(blk->mt + tile * Rp + rv * VW, m_new);
    }
    if (blk && !b1)  // token-major P: whole row vectors per block (Rp - R lanes spill into the next)
      walk_block_sums(
          *blk, R, tok, nt,
          [&](float* b) {  // a block begun in an earlier tile: its sums rescaled, a zero sum kept zero
                           // (a row poisoned by a +inf score has alpha = exp(inf - inf) = NaN, and
                           // its NaN must reach only the blocks it has mass in)
            for (int rv = 0; rv < NVall; ++rv) {
              const vf x = ld(b + rv * VW);
              st(b + rv * VW, x == vf{} ? vf{} : x * ld(ws.alpha + rv * VW));
            }
          },
          [&](float* b, int j, bool first) {
            const float* p = ws.s + j * Rp;
            if (first)
              for (int rv = 0; rv < NVall; ++rv) st(b + rv * VW, ld(p + rv * VW));
            else
              for (int rv = 0; rv < NVall; ++rv) st(b + rv * VW, ld(b + rv * VW) + ld(p + rv * VW));
          });
    // acc = alpha * acc + P V, kPvMR rows at a time over the longest visible prefix of the block
    if (pvt) {  // all rows at once over the longest visible prefix (P is 0 past a row's own;
                // an inf or NaN in V there reaches the rows that do not see it as 0 * inf = NaN,
                // as in the reference's P @ V)
      for (int rv0 = 0; rv0 < NVall; rv0 += 3)
        pv_t_rows<3>(ws.s, Rp, rv0, vrow, ntmax, ws.alpha, D, rv0 == 0 ? pf_v : 0, ws.acct);
      continue;
    }
    int r = 0;
    for (; r + kPvMR <= R; r += kPvMR)
      pv_rows<kPvMR>(ws.s, Rp, r, vrow, nvis[r + kPvMR - 1], ws.alpha, D, {pf_v, v_st, r / kPvMR, npv}, acc);
    if (r < R) pv_tail(R - r, ws.s, Rp, r, vrow, nvis[R - 1], ws.alpha, D, {pf_v, v_st, r / kPvMR, npv}, acc);
  }
  if (pvt)
    for (int r = 0; r < R; ++r)
      for (int d = 0; d < D; ++d) acc[r * D + d] = ws.acct[d * Rp + r];
}

// The factors of the blocks whose last token lies in one tile (see block_reduce): f[r] =
// w[r] * exp(mt[r] - lse[r]) for r < R, where mt is that tile's running max (as std::exp: 0 where
// mt[r] = -inf; NaN stays NaN; mt <= lse for every row that saw a token, so no overflow), and 0 in
// lanes R to row_pad(R). mt, lse, w, f: row_pad(R) floats. Returns whether f[0:R] are all finite.
inline bool block_factors(const float* mt, const float* lse, const float* w, int R, float* f) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int NV = row_pad(R) / VW;
  vi lane;
  for (int i = 0; i < VW; ++i) lane[i] = i;
  vi finite = vi{} == 0;
  for (int rv = 0; rv < NV; ++rv) {
    const vf x = ld(mt + rv * VW);
    vf e = vexp(x - ld(lse + rv * VW)) * ld(w + rv * VW);
    e = (x == splat(kNegInf)) | (lane >= R - rv * VW) ? vf{} : e;
    st(f + rv * VW, e);
    finite &= e - e == vf{};  // false for inf and NaN
  }
  bool all = true;
  for (int i = 0; i < VW; ++i) all = all && finite[i];
  return all;
}

// Block scores of one task's blocks: out[j] = sum_{r < R} f[r] * bsum[j * R + r] for
// j < nblk, where a zero sum contributes zero even when f is not finite (a poisoned row's
// NaN reaches only the blocks it has mass in). f has row_pad(R) lanes, 0 past R where
// `finite` (f[0:R] all finite, as block_factors makes them; the common case): then each block is
// a plain dot product (its sums are finite wherever f is: a row with a NaN or +inf score has a
// NaN lse), with no test for zeros.
inline void block_reduce(const float* bsum, int R, const float* f, bool finite, int64_t nblk, float* out) {
  const int NV = row_pad(R) / VW;
  vi lane;
  for (int i = 0; i < VW; ++i) lane[i] = i;
  vf a[VW];
  const vi last_keep = lane < R - (NV - 1) * VW;  // the last row vector's lanes < R
  for (int64_t j0 = 0; j0 < nblk; j0 += VW) {
    const int nj = static_cast<int>(std::min<int64_t>(VW, nblk - j0));
    for (int c = 0; c < VW; ++c) {
      a[c] = vf{};
      if (c >= nj) continue;
      const float* b = bsum + (j0 + c) * R;
      if (finite) {  // lanes >= R belong to the next block: masked (f is 0 there too)
        for (int rv = 0; rv + 1 < NV; ++rv) a[c] += ld(b + rv * VW) * ld(f + rv * VW);
        const vf x = ld(b + (NV - 1) * VW);
        a[c] += (last_keep ? x : vf{}) * ld(f + (NV - 1) * VW);
        continue;
      }
      for (int rv = 0; rv < NV; ++rv) {
        const vf x = ld(b + rv * VW);  // lanes >= R belong to the next block: masked
        const vi keep = (x != vf{}) & (lane < R - rv * VW);
        a[c] += keep ? x * ld(f + rv * VW) : vf{};
      }
    }
    const vf sums = hsum_many(a);
    if (nj == VW)
      st(out + j0, sums);
    else
      for (int c = 0; c < nj; ++c) out[j0 + c] = sums[c];
  }
}

}  // namespace VEGAS_ISA
}  // namespace cpu
}  // namespace vegas
