// How much compute one core overlaps with a stream from memory: a bare loop reads a buffer once,
// one 64-byte line at a time, and does F vector FMAs (16 lanes, AVX-512) with each line into 16
// independent accumulators (no latency chain), with no software prefetch and with prefetcht1 a
// fixed number of lines ahead. Its time per line against the same loop on a buffer in L1 (the
// compute alone) and with F = 0 (the stream alone) shows whether memory time and compute time add
// up or overlap. The CPU attention loop (csrc/cpu/attention_tile.h) does ~21 such FMAs per line of
// K/V at Q = 7 on SmolLM2's shape (R = 21 rows, D 64: 5376 flops per 512-byte K+V token), so the
// row F = 21 bounds what any loop with its arithmetic can reach from that memory.
//
//   g++ -O2 -march=native -std=c++17 bench/stream_fma_overlap.cpp -o /tmp/stream_fma_overlap
//   taskset -c 1 /tmp/stream_fma_overlap [MB=1024]     # MB: the streamed buffer (DRAM: >> L3)
//
// Prints ns per line for F in {0, 8, 16, 21, 32, 48}: L1 (compute alone), the buffer without
// prefetch, and with prefetch 16 / 64 / 256 lines ahead. The buffer is on transparent huge pages
// where Linux grants them (madvise), as VegasCache's K/V buffers are. x86-64 Linux, AVX-512F.
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

template <int F>
__attribute__((noinline)) float run(const float* p, size_t nlines, int pf) {
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_set1_ps(0.001f * i);
  const __m512 c = _mm512_set1_ps(0.999f);
  __m512 sum = _mm512_setzero_ps();
  for (size_t l = 0; l < nlines; l += 2) {
    if (pf) {
      _mm_prefetch(reinterpret_cast<const char*>(p + (l + pf) * 16), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p + (l + 1 + pf) * 16), _MM_HINT_T1);
    }
    const __m512 x = _mm512_loadu_ps(p + l * 16), y = _mm512_loadu_ps(p + l * 16 + 16);
    if (F == 0) sum = _mm512_add_ps(sum, _mm512_add_ps(x, y));  // keeps the loads
#pragma GCC unroll 128
    for (int f = 0; f < 2 * F; ++f) a[f & 15] = _mm512_fmadd_ps(a[f & 15], c, (f & 1) ? x : y);
  }
  for (int i = 0; i < 16; ++i) sum = _mm512_add_ps(sum, a[i]);
  return _mm512_reduce_add_ps(sum);
}

template <int F>
void row(const float* big, size_t nbig, const float* small, size_t nsmall) {
  auto ns_per_line = [&](const float* p, size_t n, int reps, int pf) {
    std::vector<double> ts;
    volatile float sink = 0;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      sink = sink + run<F>(p, n, pf);
      ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n * 1e9);
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
  };
  std::printf("| %d | %.2f | %.2f | %.2f | %.2f | %.2f |\n", F, ns_per_line(small, nsmall, 301, 0),
              ns_per_line(big, nbig, 3, 0), ns_per_line(big, nbig, 3, 16), ns_per_line(big, nbig, 3, 64),
              ns_per_line(big, nbig, 3, 256));
}

int main(int argc, char** argv) {
  const long mb = argc > 1 ? std::atol(argv[1]) : 1024;
  if (mb < 1) {
    std::fprintf(stderr, "usage: %s [MB >= 1]\n", argv[0]);
    return 2;
  }
  const size_t nbig = (size_t(mb) << 20) / 64, nsmall = 16384 / 64;  // 16 KB: stays in L1
  // padded: the prefetches run up to 256 lines past the end
  const size_t huge = size_t(2) << 20, bytes = ((nbig + 512) * 64 + huge - 1) / huge * huge;
  float* big = static_cast<float*>(std::aligned_alloc(huge, bytes));
  if (!big) {
    std::fprintf(stderr, "out of memory for %zu bytes\n", bytes);
    return 1;
  }
  const bool thp = madvise(big, bytes, MADV_HUGEPAGE) == 0;
  std::fill(big, big + bytes / sizeof(float), 1.f);
  std::vector<float> small(nsmall * 16 + 256 * 16 + 64, 1.f);
  std::printf("%ld MB streamed (huge pages advised: %s), ns per 64-byte line (median of 3; L1: of 301)\n\n", mb,
              thp ? "yes" : "no");
  std::printf("| FMAs per line | L1 (compute alone) | no prefetch | prefetch 16 ahead | 64 ahead | 256 ahead |\n");
  std::printf("|---|---|---|---|---|---|\n");
  row<0>(big, nbig, small.data(), nsmall);
  row<8>(big, nbig, small.data(), nsmall);
  row<16>(big, nbig, small.data(), nsmall);
  row<21>(big, nbig, small.data(), nsmall);
  row<32>(big, nbig, small.data(), nsmall);
  row<48>(big, nbig, small.data(), nsmall);
  std::free(big);
  return 0;
}
