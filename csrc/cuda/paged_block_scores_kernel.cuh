// Kernels of vegas::paged_block_scores (raw pointers, no torch includes): the attention mass
// that the newest queries of each request put on every page of a vLLM-style paged KV cache,
// without the attention output. Semantics of the CPU kernel (csrc/cpu/paged_block_scores.cpp):
// per (request r, KV head g) the last n = min(q_len, num_queries) queries of r and the G query
// heads of g give n * G rows, row i * G + hh = (query q_end - n + i, head g * G + hh); row
// i sees the tokens t < seq_len - n + i + 1 (causal); its softmax over them is summed per page.
//
// Two passes over the keys, both on a grid (R * H_kv, nchunks): CTA (bg, y) owns the pages
// [y * ppc, (y + 1) * ppc) of request r = bg / H_kv, i.e. the tokens [y * ppc * ps, ...).
//   1. paged_stats_kernel: per row, the base-2 max m and sum l = sum 2^(s - m) of the scaled
//      scores s = q . k * scale * log2(e) over the chunk's visible tokens -> workspace
//      [R * H_kv, rows_cap, nchunks] (m and l).
//   2. paged_scores_kernel: every CTA merges the stats of its rows over the request's chunks
//      into lse2 (same order in every CTA: deterministic), recomputes the scores of its chunk
//      and sums 2^(s - lse2) over the rows per token, then per page (shared memory), and
//      writes its pages once (no atomics). Pages past seq_len and requests without queries
//      get 0.
// Thread = token (a CTA tile is kThreads consecutive tokens), RPT rows per pass held in
// registers (rows beyond RPT: more passes over the keys); the queries of the RPT rows are
// staged in shared memory as fp32, pre-scaled; each thread reads its token's key row from
// global memory (16-byte loads when the rows are contiguous and aligned). fp32 accumulation.
//
// Device-side guards (the values are checked on the host only with
// VEGAS_CUDA_VALUE_CHECKS=1): a request whose query_start_loc pair or seq_len is out of range
// (qsl[r] < 0, qsl[r+1] < qsl[r], qsl[r+1] > T, seq_len outside [q_len, max_pages * ps]) gets
// NaN on all its pages; a page id outside [0, num_pages) is never read: its tokens score NaN,
// which poisons the rows that see them. No key outside the cache is read.
//
// Registers (ptxas -v, 128 threads, sm80 / sm90): 27-108 for RPT <= 16 and for pass 2 at
// RPT = 32 (80-90), 168 for pass 1 at RPT = 32 (m, l and s of 32 rows), where ptxas spills up to
// 36 bytes (bf16/fp16 strided path: a few row sums reloaded once per token, none in the head-dim
// loop); some small variants spill 4-16 bytes (in the SASS checked: one value stored before the
// loops, reloaded after). __launch_bounds__(128, 1) removes the pass-1 spills at 181-224
// registers, i.e. 2 instead of 3 CTAs per SM -- to be decided by a GPU measurement.
//
// STATUS: compiled for sm80 / sm90, emulator-checked (csrc/cuda/emu); ran on an H200
// (bench/results/gpu_h200).
#pragma once

#include <type_traits>

#include "cuda/device_utils.cuh"

namespace vegas {
namespace cuda {

constexpr int kPagedThreads = 128;         // tokens per tile, one per thread
constexpr int kPagedWarps = kPagedThreads / 32;
constexpr int kPagedMaxChunkPages = 2048;  // per-page accumulators of a CTA (shared memory)
constexpr int kPagedChunkTokens = 512;     // default tokens per chunk (rounded to pages)
constexpr int kPagedMaxCtas = 16384;       // grid size above which chunks get longer

struct PagedParams {
  const void* q;
  const void* k;
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int32_t* qsl;
  float* out;   // [R * H_kv, P]
  float* ws_m;  // [R * H_kv, rows_cap, nchunks]
  float* ws_l;
  int64_t bt_stride;
  int64_t qs_t, qs_h, qs_d;        // q strides (elements)
  int64_t ks_p, ks_h, ks_t, ks_d;  // key_cache strides (elements)
  int64_t num_pages;               // key_cache.size(0)
  int T, Hkv, G, D, ldq;           // ldq: D rounded up to 8 (staged query rows)
  int page_size, P;                // P = max_pages
  int num_queries;                 // clamped to T (only min(q_len, num_queries) matters)
  int rows_cap;                    // min(T, num_queries) * G >= rows of every valid request
  int nchunks, ppc;                // chunks per request, pages per chunk
  float scale_log2;
};

// The request of CTA (bg, y) and the token range of its chunk; uniform over the CTA.
struct PagedCta {
  int bg, r, g, y;
  int L, n, rows, q0;  // q0: token index of the first scored query
  bool bad;
  int c0, c1;          // tokens [c0, c1) of this chunk that exist (c1 <= L)
  int j0;              // first page of the chunk
};

VEGAS_DEVICE PagedCta paged_cta(const PagedParams& p) {
  PagedCta w;
  w.bg = block_x();
  w.r = w.bg / p.Hkv;
  w.g = w.bg - w.r * p.Hkv;
  w.y = block_y();
  const int qb = p.qsl[w.r], qe = p.qsl[w.r + 1];
  const int L = p.seq_lens[w.r];
  const int64_t cap = int64_t(p.P) * p.page_size;
  w.bad = qb < 0 || qe < qb || qe > p.T || L < qe - qb || int64_t(L) > cap;
  const int q_len = w.bad ? 0 : qe - qb;
  w.L = w.bad ? 0 : L;
  w.n = imin(q_len, p.num_queries);
  w.rows = w.n * p.G;
  w.q0 = qe - w.n;
  w.j0 = w.y * p.ppc;
  const int64_t c0 = int64_t(w.j0) * p.page_size;
  const int64_t c1 = c0 + int64_t(p.ppc) * p.page_size;
  w.c0 = c0 < w.L ? int(c0) : w.L;
  w.c1 = c1 < w.L ? int(c1) : w.L;
  if (w.rows == 0) w.c1 = w.c0;  // nothing to score
  return w;
}

// 16 bytes, for vector loads from global and shared memory (LDG.128 / LDS.128 on the GPU).
struct alignas(16) Vec16 {
  uint32_t u[4];
};
struct alignas(16) Float4 {
  float v[4];
};

VEGAS_DEVICE float lo16_to_float(uint32_t w, bool bf16) {
  const uint32_t h = w & 0xffffu;
  if (bf16) {
    const uint32_t u = h << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
  }
  half_t x;
  const uint16_t hs = static_cast<uint16_t>(h);
  __builtin_memcpy(&x, &hs, 2);
  return to_float(x);
}

// Eight key elements kr[e * sd], e in [d0, d0 + 8) (zero at e >= D), as fp32. VEC: the row is
// contiguous (sd == 1), 16-byte aligned and D is a multiple of 16 / sizeof(T).
template <typename T, bool VEC>
VEGAS_DEVICE void load_k8(const T* kr, int64_t sd, int d0, int D, float (&x)[8]) {
  if constexpr (VEC) {
    if constexpr (sizeof(T) == 4) {
      const Vec16 a = *reinterpret_cast<const Vec16*>(kr + d0);
      const Vec16 b = *reinterpret_cast<const Vec16*>(kr + d0 + 4);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        __builtin_memcpy(&x[e], &a.u[e], 4);
        __builtin_memcpy(&x[4 + e], &b.u[e], 4);
      }
    } else {
      const Vec16 a = *reinterpret_cast<const Vec16*>(kr + d0);
      constexpr bool bf = !std::is_same_v<T, half_t>;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        x[2 * e] = lo16_to_float(a.u[e], bf);
        x[2 * e + 1] = lo16_to_float(a.u[e] >> 16, bf);
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = d0 + e < D ? to_float(kr[int64_t(d0 + e) * sd]) : 0.f;
  }
}

// Stages the queries of rows [rt0, rt0 + RPT) (zero beyond w.rows and in the padding dims),
// pre-scaled by scale * log2(e), as qs[i * ldq + d]. Followed by a block_sync by the caller.
template <typename T, int RPT>
VEGAS_DEVICE void paged_stage_queries(const PagedParams& p, const PagedCta& w, int rt0,
                                      float* qs) {
  const T* q = static_cast<const T*>(p.q);
  for (int e = thread_x(); e < RPT * p.ldq; e += block_dim_x()) {
    const int i = e / p.ldq;
    const int d = e - i * p.ldq;
    const int row = rt0 + i;
    float v = 0.f;
    if (row < w.rows && d < p.D) {
      const int qi = w.q0 + row / p.G;
      const int h = w.g * p.G + row % p.G;
      v = to_float(q[int64_t(qi) * p.qs_t + int64_t(h) * p.qs_h + int64_t(d) * p.qs_d]) *
          p.scale_log2;
    }
    qs[e] = v;
  }
}

// s[i] = scaled score of token tok against staged row i (NaN for a page id outside the cache).
template <typename T, int RPT, bool VEC>
VEGAS_DEVICE void paged_token_scores(const PagedParams& p, const PagedCta& w, int tok,
                                     const float* qs, float (&s)[RPT]) {
  const int jp = tok / p.page_size;
  const int slot = tok - jp * p.page_size;
  const int page = p.block_table[int64_t(w.r) * p.bt_stride + jp];
#pragma unroll
  for (int i = 0; i < RPT; ++i) s[i] = 0.f;
  if (page < 0 || int64_t(page) >= p.num_pages) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) s[i] = __builtin_nanf("");
    return;
  }
  const T* kr = static_cast<const T*>(p.k) + int64_t(page) * p.ks_p + int64_t(w.g) * p.ks_h +
                int64_t(slot) * p.ks_t;
  for (int d0 = 0; d0 < p.D; d0 += 8) {
    float kx[8];
    load_k8<T, VEC>(kr, p.ks_d, d0, p.D, kx);
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const Float4 a = *reinterpret_cast<const Float4*>(qs + i * p.ldq + d0);
      const Float4 b = *reinterpret_cast<const Float4*>(qs + i * p.ldq + d0 + 4);
      float acc = s[i];
#pragma unroll
      for (int e = 0; e < 4; ++e) acc += a.v[e] * kx[e];
#pragma unroll
      for (int e = 0; e < 4; ++e) acc += b.v[e] * kx[4 + e];
      s[i] = acc;
    }
  }
}

// (m, l) <- merge of two base-2 partial softmax sums. An empty side has m = -inf and l = 0,
// or l = NaN when it saw only NaN scores: added, so the NaN is kept.
VEGAS_DEVICE void merge_ml(float& m, float& l, float m2, float l2) {
  if (m2 == kNegInf) {
    l += l2;
    return;
  }
  if (m == kNegInf) {
    m = m2;
    l += l2;
    return;
  }
  const float mm = fmax_(m, m2);
  l = l * fast_exp2(m - mm) + l2 * fast_exp2(m2 - mm);
  m = mm;
}

// Pass 1: per-row (max, sum) of the chunk -> ws_m / ws_l[(bg * rows_cap + row) * nchunks + y].
template <typename T, int RPT, bool VEC>
VEGAS_GLOBAL void VEGAS_LAUNCH_BOUNDS(kPagedThreads) paged_stats_kernel(const PagedParams p) {
  VEGAS_DYNAMIC_SMEM(smem);
  float* qs = reinterpret_cast<float*>(smem);  // [RPT][ldq]
  float* red = qs + RPT * p.ldq;               // [kPagedWarps][RPT][2]
  const PagedCta w = paged_cta(p);
  if (w.c0 >= w.c1) return;  // uniform: no token of this chunk is scored (pass 2 skips it)
  const int tid = thread_x(), lane = tid & 31, warp = tid >> 5;
  for (int rt0 = 0; rt0 < w.rows; rt0 += RPT) {
    paged_stage_queries<T, RPT>(p, w, rt0, qs);
    block_sync();
    float m[RPT], l[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      m[i] = kNegInf;
      l[i] = 0.f;
    }
    for (int tok = w.c0 + tid; tok < w.c1; tok += kPagedThreads) {
      float s[RPT];
      paged_token_scores<T, RPT, VEC>(p, w, tok, qs, s);
#pragma unroll
      for (int i = 0; i < RPT; ++i) {
        const int row = rt0 + i;
        // row sees tokens t <= L - n + row / G
        if (row < w.rows && tok <= w.L - w.n + row / p.G) {
          if (s[i] > m[i]) {
            l[i] = l[i] * fast_exp2(m[i] - s[i]) + 1.f;
            m[i] = s[i];
          } else {
            l[i] += fast_exp2(s[i] - m[i]);  // NaN s (or NaN page) poisons l
          }
        }
      }
    }
    // merge over the warp, then over the warps
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
#pragma unroll
      for (int o = 16; o >= 1; o >>= 1) {
        const float m2 = shfl_xor(m[i], o);
        const float l2 = shfl_xor(l[i], o);
        merge_ml(m[i], l[i], m2, l2);
      }
      if (lane == 0) {
        red[(warp * RPT + i) * 2] = m[i];
        red[(warp * RPT + i) * 2 + 1] = l[i];
      }
    }
    block_sync();
    if (tid < RPT && rt0 + tid < w.rows) {
      float mm = kNegInf, ll = 0.f;
      for (int wp = 0; wp < kPagedWarps; ++wp)
        merge_ml(mm, ll, red[(wp * RPT + tid) * 2], red[(wp * RPT + tid) * 2 + 1]);
      const int64_t o = (int64_t(w.bg) * p.rows_cap + rt0 + tid) * p.nchunks + w.y;
      p.ws_m[o] = mm;
      p.ws_l[o] = ll;
    }
    block_sync();  // qs and red are rewritten by the next row tile
  }
}

// Pass 2: per-page sums of 2^(s - lse2_row) over the rows; writes out[bg, j0 .. j0 + ppc).
template <typename T, int RPT, bool VEC>
VEGAS_GLOBAL void VEGAS_LAUNCH_BOUNDS(kPagedThreads) paged_scores_kernel(const PagedParams p) {
  VEGAS_DYNAMIC_SMEM(smem);
  float* qs = reinterpret_cast<float*>(smem);  // [RPT][ldq]
  float* l2s = qs + RPT * p.ldq;               // [RPT]  (-inf: the row adds nothing)
  float* tokp = l2s + RPT;                     // [kPagedThreads]
  float* pg = tokp + kPagedThreads;            // [ppc]
  const PagedCta w = paged_cta(p);
  const int tid = thread_x();
  for (int j = tid; j < p.ppc; j += kPagedThreads) pg[j] = 0.f;
  block_sync();
  if (w.c0 < w.c1) {  // uniform
    const int ps = p.page_size;
    const int chunk_tokens = p.ppc * ps;
    const int nch = (w.L + chunk_tokens - 1) / chunk_tokens;  // chunks of the request with stats
    for (int rt0 = 0; rt0 < w.rows; rt0 += RPT) {
      paged_stage_queries<T, RPT>(p, w, rt0, qs);
      if (tid < RPT) {
        float l2 = kNegInf;
        const int row = rt0 + tid;
        if (row < w.rows) {
          const float* wm = p.ws_m + (int64_t(w.bg) * p.rows_cap + row) * p.nchunks;
          const float* wl = p.ws_l + (int64_t(w.bg) * p.rows_cap + row) * p.nchunks;
          // only the chunks holding tokens this row sees: [0, ceil(visible / chunk_tokens))
          const int vis = w.L - w.n + row / p.G + 1;
          const int nc = imin(nch, (vis + chunk_tokens - 1) / chunk_tokens);
          float mm = kNegInf, ll = 0.f;
          for (int c = 0; c < nc; ++c) merge_ml(mm, ll, wm[c], wl[c]);
          // a row whose max is not finite contributes nothing (as the CPU kernel)
          const bool finite = mm > kNegInf && mm < -kNegInf;
          l2 = finite ? mm + fast_log2(ll) : kNegInf;  // NaN l: NaN lse, NaN pages
        }
        l2s[tid] = l2;
      }
      block_sync();
      for (int base = w.c0; base < w.c1; base += kPagedThreads) {  // uniform bounds
        const int tok = base + tid;
        float acc = 0.f;
        if (tok < w.c1) {
          float s[RPT];
          paged_token_scores<T, RPT, VEC>(p, w, tok, qs, s);
#pragma unroll
          for (int i = 0; i < RPT; ++i) {
            const int row = rt0 + i;
            const float l2 = l2s[i];
            if (l2 != kNegInf && row < w.rows && tok <= w.L - w.n + row / p.G)
              acc += fast_exp2(s[i] - l2);
          }
        }
        tokp[tid] = acc;
        block_sync();
        // pages overlapping tokens [base, te), one thread each
        const int te = imin(base + kPagedThreads, w.c1);
        const int jf = base / ps, jl = (te - 1) / ps;
        for (int j = jf + tid; j <= jl; j += kPagedThreads) {
          const int lo = imax(j * ps, base), hi = imin((j + 1) * ps, te);
          float sum = 0.f;
          for (int t = lo; t < hi; ++t) sum += tokp[t - base];
          pg[j - w.j0] += sum;
        }
        block_sync();  // tokp is rewritten by the next tile
      }
    }
  }
  float* out = p.out + int64_t(w.bg) * p.P;
  const float nan = __builtin_nanf("");
  for (int j = tid; j < p.ppc; j += kPagedThreads) {
    const int jj = w.j0 + j;
    if (jj < p.P) out[jj] = w.bad ? nan : pg[j];
  }
}

}  // namespace cuda
}  // namespace vegas
