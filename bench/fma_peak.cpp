// The one-core fp32 FMA peak of this processor: 12 independent chains of vector FMAs (the
// widest vectors the compiler targets with -march=native), in registers, no memory traffic.
// bench/bench_kernels_cpu.py --grid compiles and runs it as an anchor beside torch.mm: a BLAS
// may not use the widest vectors on every processor (MKL's sgemm on AMD EPYC runs at ~35 % of
// this peak), so its rate alone can flatter a kernel.
//
//   g++ -O3 -march=native bench/fma_peak.cpp -o /tmp/fma_peak && /tmp/fma_peak   # GFLOP/s, lanes
#include <algorithm>
#include <chrono>
#include <cstdio>

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));

int main() {
  constexpr int kChains = 12;
  vf a[kChains];
  for (int i = 0; i < kChains; ++i) a[i] = vf{} + 0.001f * i;
  vf b = vf{} + 0.9999f, c = vf{} + 1e-6f;
  // 3 rounds of ~0.5 s at 240 GFLOP/s; the fastest is printed (the first rounds of a short run
  // were measured at a third of the peak on a VM that had been idle)
  const long n = 3 * 300000000L * 16 / kLanes;
  double best[3];  // seconds of each round
  for (int round = 0; round < 3; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long it = 0; it < n / 3; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < kChains; ++i) a[i] = a[i] * b + c;  // unrolled: a[] stays in registers
    }
    best[round] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  float sink = 0;
  for (int i = 0; i < kChains; ++i) sink += a[i][0];
  const double s = std::min(best[0], std::min(best[1], best[2]));
  std::printf("%.1f %d %g\n", (n / 3) * double(kChains) * kLanes * 2 / s * 1e-9, kLanes, sink);
  return 0;
}
