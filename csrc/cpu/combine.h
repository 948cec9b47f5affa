// Split-KV combine (flash-decoding): merge the online-softmax states of one query row
// computed over disjoint token ranges into the final output row and log-sum-exp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace vegas {
namespace cpu {

// The log-sum-exp of one query row from its per-split online-softmax states m / l (split sp at
// m[sp * stride], l[sp * stride]); NaN when a split's state is NaN (NaN or +inf among its scores),
// as in the reference. A split that saw no token has l == 0 and is skipped.
inline float split_lse(const float* m, const float* l, int64_t nsplit, int64_t stride) {
  float M = -std::numeric_limits<float>::infinity();
  for (int64_t sp = 0; sp < nsplit; ++sp) {
    const float ls = l[sp * stride], ms = m[sp * stride];
    if (ls == 0.f) continue;
    if (!(ls > 0.f) || !std::isfinite(ms) || !std::isfinite(ls)) return std::numeric_limits<float>::quiet_NaN();
    M = std::max(M, ms);
  }
  float tot = 0.f;
  for (int64_t sp = 0; sp < nsplit; ++sp)
    if (l[sp * stride] > 0.f) tot += l[sp * stride] * std::exp(m[sp * stride] - M);
  return M + std::log(tot);
}

// m/l/acc of split sp live at m[sp * stride], l[sp * stride], acc[sp * stride * D].
// Writes out[0:D] = sum_sp acc_sp * exp(m_sp - lse) and returns lse (natural log).
inline float combine_row(const float* m, const float* l, const float* acc, int64_t nsplit,
                         int64_t stride, int64_t D, float* out) {
  const float lse = split_lse(m, l, nsplit, stride);
  if (std::isnan(lse)) {  // a poisoned row
    for (int64_t e = 0; e < D; ++e) out[e] = lse;
    return lse;
  }
  for (int64_t e = 0; e < D; ++e) out[e] = 0.f;
  for (int64_t sp = 0; sp < nsplit; ++sp) {
    if (!(l[sp * stride] > 0.f)) continue;
    const float w = std::exp(m[sp * stride] - lse);
    const float* a = acc + sp * stride * D;
    for (int64_t e = 0; e < D; ++e) out[e] += w * a[e];
  }
  return lse;
}

}  // namespace cpu
}  // namespace vegas
