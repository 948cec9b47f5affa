// Standalone microbenchmark of the CPU attention main loop (csrc/cpu/attention_tile.h)
// without torch in the loop: one verification pass of Q queries x G query heads per KV head
// over S tokens of T distinct KV heads (fp32 caches, block scores of block size bs), one
// thread, on the widest instruction set the processor has (VEGAS_CPU_ISA=avx2|base forces a
// narrower one). Prints the median wall-clock time of `iters` passes and the achieved GFLOP/s
// (4 * Q * G * S * D * T: QK and PV). What the op adds around it (query loading, the finish
// step that combines splits and normalizes the block scores, thread dispatch) is left out;
// bench/bench_kernels_cpu.py times the op itself.
//
//   TI=$(python -c "import torch,os;print(os.path.dirname(torch.__file__)+'/include')")
//   g++ -O3 -std=c++20 -ffp-contract=fast -Wno-psabi -Icsrc -I$TI bench/cpu_attend_microbench.cpp -o /tmp/attend_mb
//   /tmp/attend_mb 7 3 64 8192 1 30 12    # Q G D S bs iters T: SmolLM2 at batch 4, Q = 7
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cpu/isa.h"

using namespace vegas::cpu;

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s Q G D S block_size iters T\n", argv[0]);
    return 2;
  }
  const int Q = std::atoi(argv[1]), G = std::atoi(argv[2]), D = std::atoi(argv[3]);
  const int64_t S = std::atoll(argv[4]), bs = std::atoll(argv[5]);
  const int iters = std::atoi(argv[6]), T = std::atoi(argv[7]);
  if (Q < 1 || G < 1 || D < 1 || S < Q || bs < 1 || iters < 1 || T < 1) {
    std::fprintf(stderr, "Q, G, D, block_size, iters, T must be >= 1 and S >= Q\n");
    return 2;
  }
  const int R = Q * G;
  const int Rp = VEGAS_ISA_CALL(row_pad, R);
  std::vector<float> k(size_t(T) * S * D), v(size_t(T) * S * D), q(size_t(R) * D);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = (i * 2654435761u % 1000) * 0.001f - 0.5f;
    v[i] = (i * 40503u % 1000) * 0.001f - 0.5f;
  }
  for (size_t i = 0; i < q.size(); ++i) q[i] = ((i * 7919u) % 1000) * 0.0005f - 0.25f;
  TaskBuffers tb(R, Rp, D);
  for (int r = 0; r < R; ++r) {
    for (int e = 0; e < D; ++e) tb.qf[r * D + e] = q[r * D + e];
    tb.pos[r] = static_cast<int32_t>(S - Q + r / G);
  }
  VEGAS_ISA_CALL(pack_queries, tb.qf.data(), R, D, tb.qt.data());
  const int64_t ntiles = (S + kTile - 1) / kTile;
  std::vector<float> m(Rp), l(Rp), acc(size_t(Rp) * D), bsum(size_t(R) * (S / bs + 1) + Rp), mt(size_t(Rp) * ntiles);
  std::vector<double> ts;
  for (int it = 0; it < iters; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int t = 0; t < T; ++t) {
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      BlockSums blk{bsum.data(), 0, bs, mt.data()};
      VEGAS_ISA_CALL(attend<float>, tb.rows(), k.data() + size_t(t) * S * D, v.data() + size_t(t) * S * D, D, D,
                     nullptr, 0, S, tb.ws(), m.data(), l.data(), acc.data(), &blk);
    }
    ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  const double med = ts[ts.size() / 2];
  std::printf("%s Q=%d G=%d D=%d S=%lld bs=%lld T=%d: median %.3f ms, %.1f GFLOP/s (acc0 %g, l0 %g)\n", cpu_isa_name(),
              Q, G, D, static_cast<long long>(S), static_cast<long long>(bs), T, med * 1e3,
              4.0 * R * S * D * T / med * 1e-9, acc[0], l[0]);
  return 0;
}
