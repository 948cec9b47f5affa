// CPU kernel of vegas::block_topk. Per (row b, head h): sink blocks [0, num_sink_blocks)
// first (as many as fit), then the num_recent_blocks last eligible blocks (as many as fit),
// then the highest-scoring remaining eligible blocks of [0, min(num_candidates[b], N));
// c = min(k[b], max_k, eligible) in all. Order: higher
// score first, NaN below every number (-inf included), ties to the lower index -- a total
// order, so every device and run picks the same set. Output ascending, -1 padded.
// Selection: a radix select on order-preserving integer keys of the float bits (digits
// of 11, 11 and 10 bits, each pass over the candidates left in the threshold's bucket),
// then one ascending scan that keeps every key above the threshold and the lowest-index
// ties at it -- O(N) per row, no sort. With AVX-512 the passes over all N keys (the keys
// themselves, the first compaction, the final scan) run 16 keys at a time (compress stores);
// only the histogram stays scalar. Same keys, threshold and output either way.
// Source: Vegas, arXiv 2602.07223 (top-k of verification block scores).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "checks.h"
#include "cpu/isa.h"
#include "cpu/parallel.h"

namespace vegas {
namespace cpu {
namespace {

// Order-preserving key: a > b as scores (NaN below every number, -0 == +0) iff key(a) >
// key(b). NaN maps to 0, below -inf's key.
inline uint32_t score_key(float x) {
  if (std::isnan(x)) return 0u;
  if (x == 0.f) x = 0.f;  // -0 ties with +0
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#ifdef VEGAS_HAVE_X86_PATHS
// The AVX-512 forms of select_top's passes over all keys. Measured on one Intel Xeon core
// (AVX-512), all 30 layers of SmolLM2 at 8K, batch 4, 1-token blocks (360 rows of 8,192 scores, 410
// taken, 2 threads): 3.6 ms against 11.0 for the scalar passes; one thread, in a decode iteration
// at γ 6: 3.6-3.8 ms (0.42-0.44 % of it) against 10.2 (1.2 %)
// (bench/results/kernels_xeon_avx512/block_topk.md).
#define VEGAS_TOPK_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,popcnt")))

// keys[0:j] = score_key(s[0:j]) for the whole 16-key groups of n; returns j (select_top does the rest)
VEGAS_TOPK_AVX512 int64_t keys_avx512(const float* s, int64_t n, uint32_t* keys) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_loadu_ps(s + j);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_OQ);
    const __m512i u = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~zero), _mm512_castps_si512(x));  // -0 -> +0
    // negative: ~u; otherwise u with the sign bit set
    const __m512i key = _mm512_xor_si512(u, _mm512_or_si512(_mm512_srai_epi32(u, 31), sign));
    _mm512_storeu_si512(keys + j, _mm512_maskz_mov_epi32(static_cast<__mmask16>(~nan), key));
  }
  return j;
}

// cand[0:w] = the ascending j < j_end with (keys[j] & pmask) == prefix, j_end the whole 16-key
// groups of n; returns w and sets j_end (select_top does the rest).
VEGAS_TOPK_AVX512 int64_t compact_avx512(const uint32_t* keys, int64_t n, uint32_t pmask, uint32_t prefix,
                                         int32_t* cand, int64_t& j_end) {
  const __m512i pm = _mm512_set1_epi32(static_cast<int>(pmask)), pre = _mm512_set1_epi32(static_cast<int>(prefix));
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  int64_t w = 0, j = 0;
  for (; j + 16 <= n; j += 16, idx = _mm512_add_epi32(idx, step)) {
    const __mmask16 m = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_loadu_si512(keys + j), pm), pre);
    _mm512_mask_compressstoreu_epi32(cand + w, m, idx);
    w += __builtin_popcount(m);
  }
  j_end = j;
  return w;
}

// o[0:w] = j0 + j for the ascending j < j_end with keys[j] > t, or keys[j] == t and j <= cut (at
// most `rest` of them), j_end the whole 16-key groups of n; returns w and sets j_end (select_top
// does the rest).
VEGAS_TOPK_AVX512 int64_t emit_avx512(const uint32_t* keys, int64_t n, uint32_t t, int64_t cut, int64_t j0,
                                      int64_t rest, int32_t* o, int64_t& j_end) {
  const __m512i tv = _mm512_set1_epi32(static_cast<int>(t)), cv = _mm512_set1_epi32(static_cast<int32_t>(cut));
  const __m512i base = _mm512_set1_epi32(static_cast<int32_t>(j0));
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  int64_t w = 0, j = 0;
  for (; j + 16 <= n; j += 16, idx = _mm512_add_epi32(idx, step)) {
    const __m512i kv = _mm512_loadu_si512(keys + j);
    uint32_t m = _mm512_cmpgt_epu32_mask(kv, tv) | (_mm512_cmpeq_epi32_mask(kv, tv) & _mm512_cmple_epi32_mask(idx, cv));
    while (w + __builtin_popcount(m) > rest) m &= ~(1u << (31 - __builtin_clz(m)));  // never (memory safety)
    _mm512_mask_compressstoreu_epi32(o + w, static_cast<__mmask16>(m), _mm512_add_epi32(idx, base));
    w += __builtin_popcount(m);
  }
  j_end = j;
  return w;
}
#endif

// Writes to o, ascending, the `rest` highest-ranked of blocks [j0, j1) of row s (higher
// key first, ties to the lower index); 0 < rest <= j1 - j0. keys / cand: scratch.
void select_top(const float* s, int64_t j0, int64_t j1, int64_t rest, std::vector<uint32_t>& keys,
                std::vector<int32_t>& cand, int32_t* o) {
#ifdef VEGAS_HAVE_X86_PATHS
  const bool avx512 = cpu_isa() == Isa::avx512;
#else
  constexpr bool avx512 = false;
#endif
  const int64_t n = j1 - j0;
  if (rest == n) {
    for (int64_t j = 0; j < n; ++j) o[j] = static_cast<int32_t>(j0 + j);
    return;
  }
  keys.resize(n);
  cand.resize(n);
  // Radix select of the threshold key T: count(key > T) < rest <= count(key >= T).
  // Pass 0 (top 11 bits) histograms all keys, 4 interleaved histograms so that runs of
  // equal digits do not serialize on one counter; passes 1-2 (11 and 10 bits) only the
  // candidates left in the chosen bucket, compacted without branches.
  constexpr int kShift[3] = {21, 10, 0};
  constexpr int kBits[3] = {11, 11, 10};
  uint32_t hist4[4][2048];
  uint32_t* hist = hist4[0];
  uint32_t prefix = 0, pmask = 0;  // high bits of T fixed so far
  int64_t need = rest;             // how many of the keys matching the prefix to take
  int64_t m = n;                   // candidates matching the prefix (after pass 0: in cand)
  for (int pass = 0; pass < 3; ++pass) {
    const int sh = kShift[pass];
    const uint32_t nb = 1u << kBits[pass], dm = nb - 1;
    uint32_t dgt = nb - 1;
    if (pass == 0) {
      std::memset(hist4, 0, sizeof hist4);
      int64_t j = 0;
#ifdef VEGAS_HAVE_X86_PATHS
      if (avx512) {  // the keys of whole 16-key groups first, then their histogram
        const int64_t jk = keys_avx512(s + j0, n, keys.data());
        for (; j < jk; j += 4)
          for (int u = 0; u < 4; ++u) ++hist4[u][keys[j + u] >> sh];
      }
#endif
      for (; j + 4 <= n; j += 4)
        for (int u = 0; u < 4; ++u) {
          const uint32_t kj = score_key(s[j0 + j + u]);
          keys[j + u] = kj;
          ++hist4[u][kj >> sh];
        }
      for (; j < n; ++j) {
        keys[j] = score_key(s[j0 + j]);
        ++hist4[0][keys[j] >> sh];
      }
      for (;; --dgt) {  // the top `need` lie in buckets >= dgt (the 4 histograms summed as read)
        const uint32_t h = hist4[0][dgt] + hist4[1][dgt] + hist4[2][dgt] + hist4[3][dgt];
        if (h >= need) break;
        need -= h;
      }
    } else {
      std::fill(hist, hist + nb, 0u);
      for (int64_t i = 0; i < m; ++i) ++hist[(keys[cand[i]] >> sh) & dm];
      for (;; --dgt) {  // the top `need` lie in buckets >= dgt
        if (hist[dgt] >= need) break;
        need -= hist[dgt];
      }
    }
    prefix |= dgt << sh;
    pmask |= dm << sh;
    if (pass == 0) {
      int64_t w = 0, j = 0;
#ifdef VEGAS_HAVE_X86_PATHS
      if (avx512) w = compact_avx512(keys.data(), n, pmask, prefix, cand.data(), j);
#endif
      for (; j < n; ++j) {
        cand[w] = static_cast<int32_t>(j);
        w += (keys[j] & pmask) == prefix;
      }
      m = w;
    } else if (pass == 1) {
      int64_t w = 0;
      for (int64_t i = 0; i < m; ++i) {
        const int32_t j = cand[i];
        cand[w] = j;
        w += (keys[j] & pmask) == prefix;
      }
      m = w;
    }
  }
  // prefix == T: take every key above it and the `need` lowest-index keys equal to it, i.e.
  // the ties at indices <= cut (cand holds, ascending, every index whose key shares T's top
  // 21 bits, so every tie).
  int64_t cut = -1;
  for (int64_t i = 0, seen = 0; i < m && seen < need; ++i)
    if (keys[cand[i]] == prefix) {
      cut = cand[i];
      ++seen;
    }
  // exactly `rest` keys qualify: rest - need above T and need ties
  int64_t w = 0, j = 0;
#ifdef VEGAS_HAVE_X86_PATHS
  if (avx512) w = emit_avx512(keys.data(), n, prefix, cut, j0, rest, o, j);
#endif
  for (; j < n && w < rest; ++j) {
    const uint32_t kj = keys[j];
    o[w] = static_cast<int32_t>(j0 + j);
    w += (kj > prefix) | ((kj == prefix) & (j <= cut));
  }
}

at::Tensor block_topk_cpu(const at::Tensor& scores_in, const at::Tensor& k_in,
                          const at::Tensor& ncand_in, int64_t max_k, int64_t num_sink_blocks,
                          int64_t num_recent_blocks) {
  const char* op = "vegas::block_topk";
  check_topk_inputs(op, scores_in, k_in, ncand_in, max_k, num_sink_blocks, num_recent_blocks);
  const at::Tensor scores = scores_in.contiguous();
  const at::Tensor kt = k_in.contiguous();
  const at::Tensor nt = ncand_in.contiguous();
  const int64_t B = scores.size(0), H = scores.size(1), N = scores.size(2);
  const int32_t* kk = kt.data_ptr<int32_t>();
  const int32_t* nc = nt.data_ptr<int32_t>();
  check_topk_values(op, kk, nc, B);
  // -1 past each row's count, filled by the row's task while it holds the row (one pass, not two)
  auto out = at::empty({B, H, max_k}, scores.options().dtype(at::kInt));
  if (max_k == 0 || B * H == 0) return out;
  const float* sp = scores.data_ptr<float>();
  int32_t* op_ = out.data_ptr<int32_t>();
  // tasks of kRows rows; one thread below 2^18 scores in all (parallel_grain's 2^16 units
  // of attention work, a score costing about a quarter of one)
  constexpr int64_t kRows = 8;
  const int64_t ntasks = ceil_div(B * H, kRows);
  const int64_t work = std::max<int64_t>(1, kRows * N / 4);
  parallel_tasks(
      ntasks, work, [] { return std::pair<std::vector<uint32_t>, std::vector<int32_t>>(); },
      [&](std::pair<std::vector<uint32_t>, std::vector<int32_t>>& buf, int64_t task) {
        for (int64_t row = task * kRows; row < std::min(B * H, (task + 1) * kRows); ++row) {
          const int64_t b = row / H;
          int32_t* o = op_ + row * max_k;
          const int64_t elig = std::min<int64_t>(nc[b], N);
          const int64_t c = std::min<int64_t>({int64_t(kk[b]), max_k, elig});
          const int64_t sinks = std::min<int64_t>(num_sink_blocks, c);
          // the recent blocks [elig - recent, elig) close the ascending output
          const int64_t recent = std::min<int64_t>(num_recent_blocks, c - sinks);
          for (int64_t j = 0; j < sinks; ++j) o[j] = static_cast<int32_t>(j);
          for (int64_t j = 0; j < recent; ++j) o[c - recent + j] = static_cast<int32_t>(elig - recent + j);
          if (c > sinks + recent)
            select_top(sp + row * N, sinks, elig - recent, c - sinks - recent, buf.first, buf.second, o + sinks);
          std::fill(o + std::max<int64_t>(c, 0), o + max_k, -1);
        }
      });
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CPU, m) {
  m.impl("block_topk", &vegas::cpu::block_topk_cpu);
}
