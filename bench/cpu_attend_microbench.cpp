// Standalone microbenchmark of the CPU attention main loop (csrc/cpu/attention_tile.h),
// without torch in the loop: one verification pass of Q queries x 3 query heads per KV
// head (SmolLM2's GQA 3), D = 64, S = 8192, block 16, AVX2 path, single thread.
// Deterministic instruction counts: run it under `valgrind --tool=callgrind`.
//
//   TI=$(python -c "import torch,os;print(os.path.dirname(torch.__file__)+'/include')")
//   g++ -O3 -std=c++20 -ffp-contract=fast -Wno-psabi -Icsrc -I$TI bench/cpu_attend_microbench.cpp -o /tmp/attend_mb
//   /tmp/attend_mb 7 30      # Q=7, best of 30
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <random>
#define VEGAS_ISA isa_avx2
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "cpu/attention_tile.h"
#pragma GCC pop_options
using namespace vegas::cpu;
int main(int argc, char** argv) {
  int Q = atoi(argv[1]), G = 3, D = 64; int64_t S = 8192; int iters = atoi(argv[2]);
  int R = Q * G;
  std::mt19937 rng(0); std::normal_distribution<float> nd;
  std::vector<float> k(S * D), v(S * D), q(R * D);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = (i * 2654435761u % 1000) * 0.001f - 0.5f;
    v[i] = (i * 40503u % 1000) * 0.001f - 0.5f;
  }
  for (auto& x : q) x = nd(rng) * 0.125f;
  std::vector<int64_t> pos(R); for (int r = 0; r < R; ++r) pos[r] = S - Q + r / G;
  std::vector<float> scratch(Scratch::floats(R, D), 0.f); std::vector<int64_t> tok(kTile); std::vector<int32_t> bo(kTile);
  std::vector<float> m(R), l(R), acc(R * D), bsum(R * (S / 16)), mt(R * (S / kTile + 1));
  double best = 1e9;
  for (int it = 0; it < iters; ++it) {
    std::fill(m.begin(), m.end(), -INFINITY); std::fill(l.begin(), l.end(), 0.f); std::fill(acc.begin(), acc.end(), 0.f);
    BlockSums blk{bsum.data(), S / 16, 0, 16, mt.data(), S / kTile + 1};
    Rows rows{R, D, q.data(), pos.data()};
    Scratch ws{scratch.data(), scratch.data() + D * kTile, scratch.data() + 2 * D * kTile, tok.data(), bo.data()};
    auto t0 = std::chrono::steady_clock::now();
    for (int g = 0; g < 3; ++g)
      isa_avx2::attend<float>(rows, k.data(), v.data(), D, nullptr, 0, S, ws, m.data(), l.data(), acc.data(), &blk);
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, dt);
  }
  printf("Q=%d best %.3f ms  (acc0 %f)\n", Q, best * 1e3, acc[0]);
}
