// Micro-kernels of vegas::paged_verify_attention on raw pointers (no torch includes). No include
// guard on purpose: paged_verify_attention.cpp includes it once per ISA (baseline, AVX2+FMA,
// AVX-512), each in the VEGAS_ISA namespace where isa.h compiled attention_tile.h, whose VW-lane
// helpers (vf, ld, st, splat, vexp, kWide) it uses.
//
// Made for vLLM's CPU_ATTN cache: a page's keys are [D, page_size] (tokens contiguous), its values
// [page_size, D] (head_dim contiguous). So the QK product runs with tokens in lanes (one K vector
// load serves MR query rows: broadcast q, FMA) and the P V product with head_dim in lanes (one V
// vector load serves MR rows: broadcast p, FMA); neither needs the cache repacked.
#ifndef VEGAS_ISA
#error "define VEGAS_ISA before including paged_verify_tile.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace vegas {
namespace cpu {
namespace VEGAS_ISA {

// Register blocks: QK MR rows x NT token vectors, P V MR rows x ND head_dim vectors (AVX-512's
// 32 registers: 12 and 24 accumulators; 16 registers: 8 and 8).
constexpr int kPvQkMR = kWide ? 6 : 4;
constexpr int kPvPvMR = kWide ? 6 : 4;
constexpr int kPvPvND = kWide ? 4 : 2;

// s[m * ss + n * VW + lane] = sum_e q[m * D + e] * k[e * kd + n * VW + lane], m < MR, n < NT.
template <int MR, int NT>
static inline void pvt_qk_block(const float* q, int D, const float* k, int64_t kd, float* s, int64_t ss) {
  vf acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = vf{};
  for (int e = 0; e < D; ++e) {
    vf kv[NT];
    for (int n = 0; n < NT; ++n) kv[n] = ld(k + e * kd + n * VW);
    for (int m = 0; m < MR; ++m) {
      const vf qv = splat(q[m * D + e]);
      for (int n = 0; n < NT; ++n) acc[m][n] += qv * kv[n];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NT; ++n) st(s + m * ss + n * VW, acc[m][n]);
}

template <int NT>
static inline void pvt_qk_rows(const float* q, int R, int D, const float* k, int64_t kd, float* s, int64_t ss) {
  int r = 0;
  for (; r + kPvQkMR <= R; r += kPvQkMR) pvt_qk_block<kPvQkMR, NT>(q + r * D, D, k, kd, s + r * ss, ss);
  const float* qr = q + r * D;
  float* sr = s + r * ss;
  switch (R - r) {
    case 5: pvt_qk_block<5, NT>(qr, D, k, kd, sr, ss); break;
    case 4: pvt_qk_block<4, NT>(qr, D, k, kd, sr, ss); break;
    case 3: pvt_qk_block<3, NT>(qr, D, k, kd, sr, ss); break;
    case 2: pvt_qk_block<2, NT>(qr, D, k, kd, sr, ss); break;
    case 1: pvt_qk_block<1, NT>(qr, D, k, kd, sr, ss); break;
    default: break;
  }
}

// Scores of R rows (q [R, D] fp32, pre-scaled) against nt keys of one page, k[e * kd + t]
// (tokens contiguous): s[r * ss + t] for t < nt.
inline void pvt_qk_page(const float* q, int R, int D, const float* k, int64_t kd, int nt, float* s, int64_t ss) {
  int t = 0;
  for (; t + 2 * VW <= nt; t += 2 * VW) pvt_qk_rows<2>(q, R, D, k + t, kd, s + t, ss);
  for (; t + VW <= nt; t += VW) pvt_qk_rows<1>(q, R, D, k + t, kd, s + t, ss);
  for (; t < nt; ++t)
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int e = 0; e < D; ++e) acc += q[r * D + e] * k[e * kd + t];
      s[r * ss + t] = acc;
    }
}

// acc[m * D + d0 + ...] += sum_{t < nt} p[m * ps + t] * v[t * vt + d0 + ...], m < MR, ND vectors.
template <int MR, int ND>
static inline void pvt_pv_block(const float* p, int64_t ps, const float* v, int64_t vt, int nt, float* acc, int D) {
  vf a[MR][ND];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < ND; ++n) a[m][n] = ld(acc + m * D + n * VW);
  for (int t = 0; t < nt; ++t) {
    vf vv[ND];
    for (int n = 0; n < ND; ++n) vv[n] = ld(v + t * vt + n * VW);
    for (int m = 0; m < MR; ++m) {
      const vf pm = splat(p[m * ps + t]);
      for (int n = 0; n < ND; ++n) a[m][n] += pm * vv[n];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < ND; ++n) st(acc + m * D + n * VW, a[m][n]);
}

template <int MR>
static inline void pvt_pv_rows(const float* p, int64_t ps, const float* v, int64_t vt, int nt, float* acc, int D) {
  int d = 0;
  for (; d + kPvPvND * VW <= D; d += kPvPvND * VW) pvt_pv_block<MR, kPvPvND>(p, ps, v + d, vt, nt, acc + d, D);
  for (; d + VW <= D; d += VW) pvt_pv_block<MR, 1>(p, ps, v + d, vt, nt, acc + d, D);
  for (; d < D; ++d)
    for (int m = 0; m < MR; ++m) {
      float x = acc[m * D + d];
      for (int t = 0; t < nt; ++t) x += p[m * ps + t] * v[t * vt + d];
      acc[m * D + d] = x;
    }
}

// acc[r, :] += sum_{t < nt} p[r * ps + t] * v[t * vt + :] for r < R (v: one page's values,
// head_dim contiguous; acc [R, D] fp32).
inline void pvt_pv_page(const float* p, int64_t ps, int R, const float* v, int64_t vt, int nt, float* acc, int D) {
  int r = 0;
  for (; r + kPvPvMR <= R; r += kPvPvMR) pvt_pv_rows<kPvPvMR>(p + r * ps, ps, v, vt, nt, acc + r * D, D);
  const float* pr = p + r * ps;
  float* ar = acc + r * D;
  switch (R - r) {
    case 5: pvt_pv_rows<5>(pr, ps, v, vt, nt, ar, D); break;
    case 4: pvt_pv_rows<4>(pr, ps, v, vt, nt, ar, D); break;
    case 3: pvt_pv_rows<3>(pr, ps, v, vt, nt, ar, D); break;
    case 2: pvt_pv_rows<2>(pr, ps, v, vt, nt, ar, D); break;
    case 1: pvt_pv_rows<1>(pr, ps, v, vt, nt, ar, D); break;
    default: break;
  }
}

// Online-softmax step of one row over one chunk of its scores s[0, nt): the row sees s[0, n)
// (n <= 0: nothing). m / l: the row's running max and sum, updated; s[0, n) becomes
// exp(s - m_new) (0 for -inf scores), s[n, nt) zero. Returns alpha = exp(m_old - m_new), the
// factor of the row's earlier sums (1 when nothing changed, 0 when there were none). A NaN score
// is skipped by the max and makes l NaN (the row is poisoned); a +inf one gives exp(inf - inf).
inline float pvt_online_row(float* s, int64_t n, int64_t nt, float* m, float* l) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
  vf mv = splat(kNegInf);
  for (; t + VW <= n; t += VW) {
    const vf x = ld(s + t);
    mv = x > mv ? x : mv;
  }
  float cm = kNegInf;
  for (int lane = 0; lane < VW; ++lane) cm = mv[lane] > cm ? mv[lane] : cm;
  for (; t < n; ++t) cm = s[t] > cm ? s[t] : cm;
  const float m_old = *m, m_new = cm > m_old ? cm : m_old;
  float alpha = 1.f;
  if (m_new != m_old) alpha = m_old == kNegInf ? 0.f : std::exp(m_old - m_new);
  double acc = 0.0;
  t = 0;
  if (m_new != kNegInf) {
    vf lv = vf{};
    for (; t + VW <= n; t += VW) {
      const vf x = ld(s + t);
      vf pv = vexp(x - splat(m_new));
      pv = x == splat(kNegInf) ? vf{} : pv;
      st(s + t, pv);
      lv += pv;
    }
    for (int lane = 0; lane < VW; ++lane) acc += lv[lane];
    for (; t < n; ++t) {
      s[t] = s[t] == kNegInf ? 0.f : std::exp(s[t] - m_new);
      acc += s[t];
    }
  }
  for (t = std::max<int64_t>(t, 0); t < nt; ++t) s[t] = 0.f;
  *m = m_new;
  *l = *l * alpha + static_cast<float>(acc);
  return alpha;
}

}  // namespace VEGAS_ISA
}  // namespace cpu
}  // namespace vegas
