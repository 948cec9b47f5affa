// The two FMA micro-kernels of the CPU attention main loop (csrc/cpu/attention_tile.h) alone, on
// one 64-token tile held in L1, against what the core can do with the same instruction mix:
//   qk   qk_pair_rows<3>: scores of R = 21 query rows (SmolLM2 verifying 6 drafts: 7 queries x 3
//        query heads per KV head, padded to 24 lanes-rows) x 64 tokens, D 64;
//   pv   pv_rows<6> x 3 + pv_rows<3>: acc[21, 64] += P[64 tokens, 21] V[64, 64];
//   fma+bcast  a register-blocked loop with the QK block's mix (per step: 8 broadcasts from L1,
//        3 x 8 FMAs into 24 accumulators), no kernel around it: the reachable FMA rate;
//   fma  FMAs on registers only (as bench/fma_peak.cpp): the core's peak.
// Prints GFLOP/s (useful flops: 2 * 21 * 64 * 64 per kernel call) and cycles per token at the
// clock implied by the `fma` row (2 FMA ports x 16 lanes x 2 flops per cycle). The gap between
// a kernel and `fma+bcast` is the kernel's own overhead (for the QK: per 8 tokens the accumulators
// restarted, the pair-to-row permutes and the stores; its 8 K-row pointers measured at ~2 %, see
// bench/results/kernels_xeon_avx512/microkernel_rates.md); the main loop adds the online softmax,
// the block scores and the cache misses on top (bench/cpu_attend_microbench.cpp times that).
// AVX-512 only (the pair QK exists only there).
//
//   TI=$(python -c "import torch,os;print(os.path.dirname(torch.__file__)+'/include')")
//   g++ -O3 -std=c++20 -ffp-contract=fast -Wno-psabi -Icsrc -I$TI bench/cpu_microkernel_rates.cpp -o /tmp/mk_rates
//   /tmp/mk_rates
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "cpu/isa.h"

using namespace vegas::cpu;

namespace {

constexpr int kD = 64, kTok = 64, kR = 21;

template <typename F>
double best_seconds(F f, long reps) {
  double best = 1e30;
  for (int round = 0; round < 5; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < reps; ++i) {
      f();
      asm volatile("" ::: "memory");
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// 24 accumulators, per step 3 vector loads and 8 broadcasts of 64-bit pairs from L1 (rows 256 B
// apart, as K rows at D 64), 24 FMAs: the QK block's instruction mix without the kernel.
__attribute__((target("avx512f"), noinline)) float fma_bcast(const float* buf, long steps, bool loads) {
  __m512 a[24];
  for (int i = 0; i < 24; ++i) a[i] = _mm512_set1_ps(1e-3f * i);
  __m512 q0 = _mm512_set1_ps(0.999f), q1 = _mm512_set1_ps(0.998f), q2 = _mm512_set1_ps(0.997f);
  const __m512 kc = _mm512_set1_ps(1.0001f);
  for (long it = 0; it < steps; ++it) {
    const float* p = buf + (it & 31) * 2;
    if (loads) {
      q0 = _mm512_loadu_ps(p + 2048);
      q1 = _mm512_loadu_ps(p + 2064);
      q2 = _mm512_loadu_ps(p + 2080);
    }
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m512 kb = loads ? _mm512_castpd_ps(_mm512_set1_pd(*reinterpret_cast<const double*>(p + t * kD))) : kc;
      a[3 * t] = _mm512_fmadd_ps(kb, q0, a[3 * t]);
      a[3 * t + 1] = _mm512_fmadd_ps(kb, q1, a[3 * t + 1]);
      a[3 * t + 2] = _mm512_fmadd_ps(kb, q2, a[3 * t + 2]);
    }
  }
  float s = 0.f;
  for (int i = 0; i < 24; ++i) s += _mm512_reduce_add_ps(a[i]);
  return s;
}

}  // namespace

int main() {
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq"))) {
    std::fprintf(stderr, "this benchmark needs AVX-512 (F, VL, BW, DQ); the pair QK exists only there\n");
    return 2;
  }
  std::vector<float> k(kTok * kD), v(kTok * kD), qp(32 * 48), s(kTok * 32), acc(kR * kD), alpha(32, 1.f);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = (i % 7) * 0.01f;
    v[i] = (i % 5) * 0.02f;
  }
  for (size_t i = 0; i < qp.size(); ++i) qp[i] = (i % 3) * 0.01f;
  for (size_t i = 0; i < s.size(); ++i) s[i] = (i % 3) * 0.01f;
  std::vector<float> buf(4096);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = 1e-7f * i;
  const float* krow[kTok];
  const float* vrow[kTok];
  for (int t = 0; t < kTok; ++t) {
    krow[t] = k.data() + t * kD;
    vrow[t] = v.data() + t * kD;
  }
  const long reps = 100000, steps = 20000000;
  const double per_call = 2.0 * kR * kD * kTok;
  float sink = 0.f;
  const double t_fma = best_seconds([&] { sink += fma_bcast(buf.data(), steps, false); }, 1);
  const double t_fb = best_seconds([&] { sink += fma_bcast(buf.data(), steps, true); }, 1);
  const double t_qk = best_seconds([&] { isa_avx512::qk_pair_rows<3>(qp.data(), krow, kTok, kD, 0, 32, s.data()); }, reps);
  const double t_pv = best_seconds(
      [&] {
        for (int r = 0; r < 18; r += 6) isa_avx512::pv_rows<6>(s.data(), 32, r, vrow, kTok, alpha.data(), kD, 0, acc.data());
        isa_avx512::pv_rows<3>(s.data(), 32, 18, vrow, kTok, alpha.data(), kD, 0, acc.data());
      },
      reps);
  const double peak = steps * 24.0 * 32 / t_fma;  // flop/s
  const double ghz = peak / 64 * 1e-9;           // 2 ports x 16 lanes x 2 flops per cycle
  const double fb = steps * 24.0 * 32 / t_fb;
  std::printf("| kernel | GFLOP/s | of fma | cycles / token | ideal cycles / token (its FMAs at 2 per cycle) |\n|---|---:|---:|---:|---:|\n");
  std::printf("| fma (registers only) | %.1f | 1.00 | - | - |\n", peak * 1e-9);
  std::printf("| fma+bcast (QK mix, L1) | %.1f | %.2f | - | - |\n", fb * 1e-9, fb / peak);
  const double qk = per_call * reps / t_qk, pv = per_call * reps / t_pv;
  // QK: 24 lanes-rows x 2 head_dim elements per FMA -> 3 * D / 2 FMAs per token; PV: 21 rows x D / 16 vectors
  std::printf("| qk_pair_rows<3> (R 21, D 64) | %.1f | %.2f | %.1f | %.1f |\n", qk * 1e-9, qk / peak,
              t_qk / reps / kTok * ghz * 1e9, 3.0 * kD / 2 / 2);
  std::printf("| pv_rows (R 21, D 64) | %.1f | %.2f | %.1f | %.1f |\n", pv * 1e-9, pv / peak, t_pv / reps / kTok * ghz * 1e9,
              kR * (kD / 16) / 2.0);
  std::printf("\nclock implied by the fma row: %.2f GHz (sink %g %g %g)\n", ghz, sink, s[5], acc[7]);
  return 0;
}
