// Kernels and host logic of vegas::paged_verify_attention on CUDA (raw pointers in the kernels;
// the host part takes at::Tensors and a Backend as ops_host.h does, so the emulation in
// csrc/cuda/emu runs the same code). Semantics of the CPU kernel
// (csrc/cpu/paged_verify_attention.cpp): every packed query's causal attention over its request's
// pages, and the per-page probability mass of the last min(q_len, num_queries) queries.
//
// 1. paged_verify_chunk_kernel, grid (R * H_kv, nchunks): CTA (bg, y) owns the tokens
//    [y * ppc * ps, ...) of request r = bg / H_kv. Per pass of kPvRows rows (queries x the G heads
//    of KV head g): the queries staged in shared memory (fp32, scaled by scale * log2 e); thread =
//    token computes the rows' scores of its token (key row read once for all rows) into shared
//    memory, masked causally; warp = row takes the chunk's max m, p = 2^(s - m) in place and
//    l = sum p, and for the scored rows the per-page sums of p; thread = (row, head_dim element)
//    sums p * V over the chunk. m, l, the un-normalized output and the page sums go to workspaces
//    indexed by (token, query head), so the combine needs no per-request layout.
// 2. paged_verify_combine_kernel, grid (R * H_kv): warp = row merges its chunks (flash-decoding)
//    into the fp32 output and lse2; then thread = page sums the scored rows' page sums times
//    2^(m_chunk - lse2) (rows whose lse is not finite add nothing, as on CPU).
// fp32 accumulation; base-2 exponentials. Device-side guards: a request whose query_start_loc /
// seq_len are out of range is skipped (its scores are NaN, its output rows stay zero); a page id
// outside [0, num_pages) is never read (its tokens score NaN). The host checks the values only
// with VEGAS_CUDA_VALUE_CHECKS=1 (no sync otherwise).
//
// STATUS: compiled with nvcc 13 for sm80 / sm90 and emulator-checked; ran on an H200
// (bench/results/gpu_h200): correct, but 25-100x slower than verify_attention on the same tokens.
// A simple SIMT design (no tensor cores, scalar loads): correctness first.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <tuple>

#include "checks.h"
#include "cuda/ops_host.h"

namespace vegas {
namespace cuda {

constexpr int kPvThreads = 128;
constexpr int kPvWarps = kPvThreads / 32;
constexpr int kPvRows = 16;          // rows per pass (their scores: kPvRows x chunk tokens, shared memory)
constexpr int kPvChunkTokens = 256;  // tokens per chunk (rounded to whole pages, at least one)

struct PvParams {
  const void* q;
  const void* k;
  const void* v;
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int32_t* qsl;
  float* out;     // [T * Hq, D] fp32
  float* scores;  // [R * Hkv, P]
  float* ws_m;    // [T * Hq, nchunks]
  float* ws_l;    // [T * Hq, nchunks]
  float* ws_acc;  // [T * Hq, nchunks, D]
  float* ws_b;    // [R * Hkv, rows_sc, P] page sums of the scored rows
  float* ws_lse;  // [T * Hq]
  int64_t bt_stride;
  int64_t qs_t, qs_h, qs_d;
  int64_t ks_p, ks_h, ks_t, ks_d;
  int64_t vs_p, vs_h, vs_t, vs_d;
  int64_t num_pages;
  int T, Hq, Hkv, G, D, page_size, P;
  int num_queries;  // clamped to T
  int rows_sc;      // min(T, num_queries) * G
  int nchunks, ppc, ct;  // chunks, pages per chunk, tokens per chunk
  float scale_log2;
};

struct PvReq {
  int r, g, qb, ql, L, n;
  bool bad;
};

VEGAS_DEVICE PvReq pv_req(const PvParams& p, int bg) {
  PvReq w;
  w.r = bg / p.Hkv;
  w.g = bg - w.r * p.Hkv;
  w.qb = p.qsl[w.r];
  const int qe = p.qsl[w.r + 1];
  const int L = p.seq_lens[w.r];
  w.bad = w.qb < 0 || qe < w.qb || qe > p.T || L < qe - w.qb || int64_t(L) > int64_t(p.P) * p.page_size;
  w.ql = w.bad ? 0 : qe - w.qb;
  w.L = w.bad ? 0 : L;
  w.n = imin(w.ql, p.num_queries);
  return w;
}

template <typename T>
VEGAS_GLOBAL void VEGAS_LAUNCH_BOUNDS(kPvThreads) paged_verify_chunk_kernel(const PvParams p) {
  VEGAS_DYNAMIC_SMEM(smem);
  float* qs = reinterpret_cast<float*>(smem);  // [kPvRows][D]
  float* S = qs + kPvRows * p.D;               // [kPvRows][ct]
  const int bg = block_x(), y = block_y();
  const PvReq w = pv_req(p, bg);
  const int tid = thread_x(), lane = tid & 31, warp = tid >> 5;
  const int rows = w.ql * p.G, sc0 = (w.ql - w.n) * p.G;  // rows >= sc0 are scored
  const int c0 = y * p.ct, c1 = imin(c0 + p.ct, w.L), nt = c1 - c0;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const int32_t* pages = p.block_table + int64_t(w.r) * p.bt_stride;
  for (int rt0 = 0; rt0 < rows; rt0 += kPvRows) {
    const int nr = imin(kPvRows, rows - rt0);
    if (nt <= 0) {  // a chunk past the request's end: an empty state per row
      for (int rr = tid; rr < nr; rr += kPvThreads) {
        const int row = rt0 + rr;
        const int64_t st = int64_t(w.qb + row / p.G) * p.Hq + w.g * p.G + row % p.G;
        p.ws_m[st * p.nchunks + y] = kNegInf;
        p.ws_l[st * p.nchunks + y] = 0.f;
      }
      continue;
    }
    for (int idx = tid; idx < nr * p.D; idx += kPvThreads) {
      const int rr = idx / p.D, e = idx - rr * p.D, row = rt0 + rr;
      const T* src = q + int64_t(w.qb + row / p.G) * p.qs_t + int64_t(w.g * p.G + row % p.G) * p.qs_h;
      qs[idx] = to_float(src[int64_t(e) * p.qs_d]) * p.scale_log2;
    }
    block_sync();
    // scores, thread = token
    for (int t = tid; t < nt; t += kPvThreads) {
      const int tok = c0 + t;
      const int32_t page = pages[tok / p.page_size];
      float acc[kPvRows];
#pragma unroll
      for (int rr = 0; rr < kPvRows; ++rr) acc[rr] = 0.f;
      if (page < 0 || page >= p.num_pages) {
#pragma unroll
        for (int rr = 0; rr < kPvRows; ++rr) acc[rr] = __builtin_nanf("");
      } else {
        const T* kr = k + int64_t(page) * p.ks_p + int64_t(w.g) * p.ks_h + int64_t(tok % p.page_size) * p.ks_t;
        for (int e = 0; e < p.D; ++e) {
          const float kx = to_float(kr[int64_t(e) * p.ks_d]);
#pragma unroll
          for (int rr = 0; rr < kPvRows; ++rr)
            if (rr < nr) acc[rr] += qs[rr * p.D + e] * kx;
        }
      }
#pragma unroll
      for (int rr = 0; rr < kPvRows; ++rr)
        if (rr < nr) {
          const int row = rt0 + rr;
          const bool vis = tok <= w.L - w.ql + row / p.G;
          S[rr * p.ct + t] = vis ? acc[rr] : kNegInf;
        }
    }
    block_sync();
    // softmax numerators per row, warp = row
    for (int rr = warp; rr < nr; rr += kPvWarps) {
      const int row = rt0 + rr;
      const int64_t st = int64_t(w.qb + row / p.G) * p.Hq + w.g * p.G + row % p.G;
      float* s = S + rr * p.ct;
      float m = kNegInf;  // a NaN score is skipped here and makes l NaN below (the row is poisoned)
      for (int t = lane; t < nt; t += 32) m = fmax_(m, s[t]);
      for (int o = 16; o >= 1; o >>= 1) m = fmax_(m, shfl_xor(m, o));
      float l = 0.f;
      for (int t = lane; t < nt; t += 32) {
        const float x = s[t];
        const float e = x == kNegInf ? 0.f : fast_exp2(x - m);  // NaN x or m: NaN
        s[t] = e;
        l += e;
      }
      for (int o = 16; o >= 1; o >>= 1) l += shfl_xor(l, o);
      if (lane == 0) {
        p.ws_m[st * p.nchunks + y] = m;
        p.ws_l[st * p.nchunks + y] = m == kNegInf ? 0.f : l;
      }
      if (row >= sc0) {
        float* b = p.ws_b + (int64_t(bg) * p.rows_sc + (row - sc0)) * p.P;
        const int j0 = c0 / p.page_size;
        for (int j = lane; j * p.page_size < nt; j += 32) {
          float sum = 0.f;
          for (int t = j * p.page_size; t < imin((j + 1) * p.page_size, nt); ++t) sum += s[t];
          b[j0 + j] = sum;
        }
      }
    }
    block_sync();
    // P V, thread = (row, head_dim element)
    for (int idx = tid; idx < nr * p.D; idx += kPvThreads) {
      const int rr = idx / p.D, d = idx - rr * p.D, row = rt0 + rr;
      const int64_t st = int64_t(w.qb + row / p.G) * p.Hq + w.g * p.G + row % p.G;
      const float* s = S + rr * p.ct;
      float acc = 0.f;
      for (int t = 0; t < nt; ++t) {
        const float pt = s[t];
        if (pt == 0.f) continue;  // masked or underflowed: V not read
        const int tok = c0 + t;
        const int32_t page = pages[tok / p.page_size];
        const float vx = (page < 0 || page >= p.num_pages)
                             ? __builtin_nanf("")
                             : to_float(v[int64_t(page) * p.vs_p + int64_t(w.g) * p.vs_h +
                                          int64_t(tok % p.page_size) * p.vs_t + int64_t(d) * p.vs_d]);
        acc += pt * vx;
      }
      p.ws_acc[(st * p.nchunks + y) * p.D + d] = acc;
    }
    block_sync();  // qs and S are rewritten by the next pass
  }
}

VEGAS_GLOBAL void VEGAS_LAUNCH_BOUNDS(kPvThreads) paged_verify_combine_kernel(const PvParams p) {
  const int bg = block_x();
  const PvReq w = pv_req(p, bg);
  const int tid = thread_x(), lane = tid & 31, warp = tid >> 5;
  float* sc = p.scores + int64_t(bg) * p.P;
  if (w.bad) {
    for (int j = tid; j < p.P; j += kPvThreads) sc[j] = __builtin_nanf("");
    return;
  }
  const int rows = w.ql * p.G, sc0 = (w.ql - w.n) * p.G;
  for (int row = warp; row < rows; row += kPvWarps) {
    const int64_t st = int64_t(w.qb + row / p.G) * p.Hq + w.g * p.G + row % p.G;
    const float* m = p.ws_m + st * p.nchunks;
    const float* l = p.ws_l + st * p.nchunks;
    // every lane merges all chunks (few): the same lse2 in every lane
    float M = kNegInf;
    bool poisoned = false;
    for (int y = 0; y < p.nchunks; ++y) {
      if (l[y] == 0.f) continue;
      if (!(l[y] > 0.f) || m[y] != m[y] || l[y] != l[y] || m[y] == -kNegInf) poisoned = true;
      else M = fmax_(M, m[y]);
    }
    float tot = 0.f;
    if (!poisoned)
      for (int y = 0; y < p.nchunks; ++y)
        if (l[y] > 0.f) tot += l[y] * fast_exp2(m[y] - M);
    const float lse2 = poisoned ? __builtin_nanf("") : M + fast_log2(tot);
    for (int d = lane; d < p.D; d += 32) {
      float o = 0.f;
      if (poisoned) o = __builtin_nanf("");
      else
        for (int y = 0; y < p.nchunks; ++y)
          if (l[y] > 0.f) o += p.ws_acc[(st * p.nchunks + y) * p.D + d] * fast_exp2(m[y] - lse2);
      p.out[st * p.D + d] = o;
    }
    if (lane == 0) p.ws_lse[st] = lse2;
  }
  block_sync();  // ws_lse of this request's rows, written above, read below
  const int npg = (w.L + p.page_size - 1) / p.page_size;
  for (int j = tid; j < p.P; j += kPvThreads) {
    float acc = 0.f;
    if (j < npg)
      for (int row = sc0; row < rows; ++row) {
        const int64_t st = int64_t(w.qb + row / p.G) * p.Hq + w.g * p.G + row % p.G;
        const float lse2 = p.ws_lse[st];
        if (!(lse2 > kNegInf && lse2 < -kNegInf)) continue;  // poisoned or empty row: no mass
        const float b = p.ws_b[(int64_t(bg) * p.rows_sc + (row - sc0)) * p.P + j];
        if (b == 0.f) continue;
        acc += b * fast_exp2(p.ws_m[st * p.nchunks + j / p.ppc] - lse2);
      }
    sc[j] = acc;
  }
}

// ---------------------------------------------------------------------------
// host side
// ---------------------------------------------------------------------------
inline void check_pv_value_cache(const char* op, const at::Tensor& kc, const at::Tensor& vc) {
  TORCH_CHECK(vc.dim() == 4 && vc.sizes() == kc.sizes(), op,
              ": value_cache must have key_cache's shape [num_pages, H_kv, page_size, D] = ", kc.sizes(),
              ", got ", vc.sizes());
  TORCH_CHECK(vc.scalar_type() == kc.scalar_type(), op, ": value_cache dtype (", vc.scalar_type(),
              ") must equal q dtype (", kc.scalar_type(), ")");
  check_same_device(op, kc, "key_cache", vc, "value_cache");
}

template <class Backend>
std::tuple<at::Tensor, at::Tensor> paged_verify_attention_impl(Backend& be, const at::Tensor& q,
                                                               const at::Tensor& key_cache,
                                                               const at::Tensor& value_cache,
                                                               const at::Tensor& block_table,
                                                               const at::Tensor& seq_lens,
                                                               const at::Tensor& query_start_loc,
                                                               int64_t num_queries, double scale,
                                                               int64_t chunk_tokens = kPvChunkTokens) {
  const char* op = "vegas::paged_verify_attention";
  const PagedShape s = check_paged_inputs(op, q, key_cache, block_table, seq_lens, query_start_loc,
                                          num_queries, scale);
  check_pv_value_cache(op, key_cache, value_cache);
  TORCH_CHECK(s.D <= 256, op, ": head_dim must be <= 256 for the CUDA kernel, got ", s.D);
  TORCH_CHECK(sat_mul(sat_mul(s.max_pages, s.page_size), 2) < INT32_MAX && s.T < INT32_MAX / 2 &&
                  sat_mul(s.T, s.Hq) < INT32_MAX,
              op, ": too many tokens / pages for the CUDA kernel");
  const at::Tensor bt = block_table.contiguous(), lens = seq_lens.contiguous(), qsl = query_start_loc.contiguous();
  if (be.value_checks()) {
    const at::Tensor hq = be.to_host(qsl), hl = be.to_host(lens), hb = be.to_host(bt);
    check_paged_values(op, hq.data_ptr<int32_t>(), hl.data_ptr<int32_t>(), hb.data_ptr<int32_t>(), s);
  }
  at::Tensor out = at::zeros({s.T, s.Hq, s.D}, q.options().dtype(at::kFloat));
  at::Tensor scores = at::zeros({s.R, s.Hkv, s.max_pages}, q.options().dtype(at::kFloat));
  if (s.R == 0 || s.max_pages == 0 || s.T == 0) return {q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type()), scores};
  // chunks of whole pages; longer ones where the per-chunk workspace would pass 256 MiB
  int64_t ppc = std::max<int64_t>(1, std::max<int64_t>(chunk_tokens, 1) / s.page_size);
  auto ws_floats = [&](int64_t pc) { return sat_mul(s.T * s.Hq, sat_mul(ceil_div(s.max_pages, pc), s.D + 2)); };
  while (ppc < s.max_pages && ws_floats(ppc) > (int64_t(64) << 20)) ppc *= 2;
  ppc = std::min<int64_t>(ppc, s.max_pages);
  const int64_t nchunks = ceil_div(s.max_pages, ppc);
  TORCH_CHECK(nchunks <= 65535, op, ": max_pages = ", s.max_pages, " needs more than 65535 chunks");
  const int64_t nq = std::min<int64_t>(num_queries, s.T), rows_sc = nq * s.G;
  const int64_t n_st = s.T * s.Hq;
  const int64_t n_ws = n_st * nchunks * (s.D + 2) + s.R * s.Hkv * rows_sc * s.max_pages + n_st;
  at::Tensor ws = at::empty({std::max<int64_t>(n_ws, 1)}, q.options().dtype(at::kFloat));
  PvParams p{};
  p.q = q.data_ptr();
  p.k = key_cache.data_ptr();
  p.v = value_cache.data_ptr();
  p.block_table = bt.data_ptr<int32_t>();
  p.seq_lens = lens.data_ptr<int32_t>();
  p.qsl = qsl.data_ptr<int32_t>();
  p.out = out.data_ptr<float>();
  p.scores = scores.data_ptr<float>();
  p.ws_m = ws.data_ptr<float>();
  p.ws_l = p.ws_m + n_st * nchunks;
  p.ws_acc = p.ws_l + n_st * nchunks;
  p.ws_b = p.ws_acc + n_st * nchunks * s.D;
  p.ws_lse = p.ws_b + s.R * s.Hkv * rows_sc * s.max_pages;
  p.bt_stride = bt.stride(0);
  p.qs_t = q.stride(0);
  p.qs_h = q.stride(1);
  p.qs_d = q.stride(2);
  p.ks_p = key_cache.stride(0);
  p.ks_h = key_cache.stride(1);
  p.ks_t = key_cache.stride(2);
  p.ks_d = key_cache.stride(3);
  p.vs_p = value_cache.stride(0);
  p.vs_h = value_cache.stride(1);
  p.vs_t = value_cache.stride(2);
  p.vs_d = value_cache.stride(3);
  p.num_pages = s.num_pages;
  p.T = static_cast<int>(s.T);
  p.Hq = static_cast<int>(s.Hq);
  p.Hkv = static_cast<int>(s.Hkv);
  p.G = static_cast<int>(s.G);
  p.D = static_cast<int>(s.D);
  p.page_size = static_cast<int>(s.page_size);
  p.P = static_cast<int>(s.max_pages);
  p.num_queries = static_cast<int>(nq);
  p.rows_sc = static_cast<int>(rows_sc);
  p.nchunks = static_cast<int>(nchunks);
  p.ppc = static_cast<int>(ppc);
  p.ct = static_cast<int>(ppc * s.page_size);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  const size_t smem = size_t(kPvRows) * (s.D + p.ct) * sizeof(float);
  const Grid3 grid{s.R * s.Hkv, nchunks, 1};
  switch (q.scalar_type()) {
    case at::kFloat: be.launch(&paged_verify_chunk_kernel<float>, grid, kPvThreads, smem, p); break;
    case at::kBFloat16: be.launch(&paged_verify_chunk_kernel<bf16_t>, grid, kPvThreads, smem, p); break;
    case at::kHalf: be.launch(&paged_verify_chunk_kernel<half_t>, grid, kPvThreads, smem, p); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", q.scalar_type());
  }
  be.launch(&paged_verify_combine_kernel, Grid3{s.R * s.Hkv, 1, 1}, kPvThreads, 0, p);
  return {q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type()), scores};
}

}  // namespace cuda
}  // namespace vegas
