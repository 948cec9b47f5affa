// Per-(request, KV head) main loop of vegas::paged_block_scores on raw pointers (no torch
// includes). No include guard on purpose: paged_block_scores.cpp includes it twice, for the
// baseline ISA, AVX2+FMA and AVX-512, each in its own VEGAS_ISA namespace right after isa.h
// compiled attention_tile.h there (whose VW-lane helpers vf, ld, st, splat, vexp it uses), and
// picks one at run time.
#ifndef VEGAS_ISA
#error "define VEGAS_ISA before including paged_scores_tile.h"
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/paged_scores_types.h"

namespace vegas {
namespace cpu {
namespace VEGAS_ISA {

// VW key elements p[0], p[stride], ... as fp32 lanes.
template <typename T>
static inline vf paged_load(const T* p, int64_t stride) {
  if constexpr (std::is_same_v<T, float>) {
    if (stride == 1) return ld(p);
  }
  vf x;
  for (int l = 0; l < VW; ++l) x[l] = static_cast<float>(p[l * stride]);
  return x;
}

// One (request, KV head) task: writes out[0 .. max_pages). Uses the VW-lane helpers of
// attention_tile.h (vf, ld, st, splat, vexp), compiled in the same VEGAS_ISA namespace.
template <typename T>
inline void scores_one(float* out, const T* q, const T* k, const int32_t* pages, int64_t seq_len,
                       int64_t q_begin, int64_t q_len, int64_t n, float scale, const PagedDims& d,
                       int64_t g, std::vector<float>& qf, std::vector<float>& s) {
  const int64_t D = d.D, G = d.G, rows = n * G, ps = d.page_size;
  // rows r = i * G + hh: query q_begin + q_len - n + i, head g * G + hh (pre-scaled, fp32)
  qf.assign(rows * D, 0.f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t hh = 0; hh < G; ++hh) {
      const T* src = q + (q_begin + q_len - n + i) * d.qs_t + (g * G + hh) * d.qs_h;
      float* dst = qf.data() + (i * G + hh) * D;
      for (int64_t e = 0; e < D; ++e) dst[e] = static_cast<float>(src[e * d.qs_d]) * scale;
    }
  // Scores of every row against every key of the request; causality is applied when they are
  // normalized (row r sees tokens [0, visible)), so masked entries are never read.
  s.assign(rows * seq_len, 0.f);
  const int64_t first_pos = seq_len - n;  // position of the first scored query
  const int64_t npages = paged_ceil_div(seq_len, ps);
  for (int64_t j = 0; j < npages; ++j) {
    const T* kp = k + int64_t(pages[j]) * d.ks_p + g * d.ks_h;
    const int64_t t0 = j * ps, nt = std::min<int64_t>(ps, seq_len - t0);
    int64_t t = 0;
    // VW tokens at a time: lanes = tokens, one FMA per (row, dim); made for vLLM's CPU cache,
    // where a page's keys are stored [D, page_size] (tokens contiguous), works for any strides.
    for (; t + VW <= nt; t += VW)
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = qf.data() + r * D;
        vf acc = vf{};
        for (int64_t e = 0; e < D; ++e) acc += splat(qr[e]) * paged_load(kp + t * d.ks_t + e * d.ks_d, d.ks_t);
        st(s.data() + r * seq_len + t0 + t, acc);
      }
    for (; t < nt; ++t)
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = qf.data() + r * D;
        const T* kr = kp + t * d.ks_t;
        float acc = 0.f;
        for (int64_t e = 0; e < D; ++e) acc += qr[e] * static_cast<float>(kr[e * d.ks_d]);
        s[r * seq_len + t0 + t] = acc;
      }
  }
  for (int64_t j = 0; j < d.max_pages; ++j) out[j] = 0.f;
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s.data() + r * seq_len;
    const int64_t visible = first_pos + r / G + 1;  // tokens [0, visible)
    float m = kPagedNegInf;
    for (int64_t t = 0; t < visible; ++t) m = sr[t] > m ? sr[t] : m;
    if (!std::isfinite(m)) continue;  // a NaN/inf row contributes nothing
    // p = exp(s - m) in place, l = sum p
    vf lv = vf{};
    int64_t t = 0;
    for (; t + VW <= visible; t += VW) {
      const vf pv = vexp(ld(sr + t) - splat(m));
      st(sr + t, pv);
      lv += pv;
    }
    double l = 0.0;
    for (int lane = 0; lane < VW; ++lane) l += lv[lane];
    for (; t < visible; ++t) {
      sr[t] = std::exp(sr[t] - m);
      l += sr[t];
    }
    const float inv = static_cast<float>(1.0 / l);
    for (int64_t j = 0; j * ps < visible; ++j) {
      const int64_t t1 = std::min<int64_t>((j + 1) * ps, visible);
      float p = 0.f;
      for (int64_t u = j * ps; u < t1; ++u) p += sr[u];
      out[j] += p * inv;
    }
  }
}

}  // namespace VEGAS_ISA
}  // namespace cpu
}  // namespace vegas
