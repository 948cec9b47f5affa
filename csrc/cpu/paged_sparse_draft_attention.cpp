// CPU kernel of vegas::paged_sparse_draft_attention: the paged twin of sparse_draft_attention at
// block size 1. Each query head attends to its KV head's selected tokens before tail_start plus
// every tail token [tail_start, seq_len), causally, exact softmax, reading the tokens through the
// block table of a vLLM-style paged cache (token-granular drafts inside vLLM, issue 32).
//
// Work units: (request r, KV head g, block of at most kMaxRows query rows). A unit walks a virtual
// token list -- the selected tokens (ascending), then the tail (ascending) -- so causality only
// ever cuts a suffix of it. Per chunk of kChunk virtual tokens it runs paged_verify_attention's
// micro-kernels: QK, the online softmax per row (FlashAttention-style), P V. On vLLM's fp32 CPU
// cache (keys [D, page_size], values [page_size, D]) they read each run of >= kMinRun consecutive
// tokens of one page (the tail, clusters of selected tokens) straight from the cache; shorter runs,
// other layouts and bf16 / fp16 caches are gathered into fp32 [D, chunk] keys and [chunk, D]
// values first (a lone token's QK straight from a key page would be D dependent scalar FMAs per
// row). Either way a lone selected token pulls D cache lines of keys in vLLM's layout.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "checks.h"
#include "cpu/isa.h"

#define VEGAS_ISA isa_base
#include "cpu/paged_verify_tile.h"
#undef VEGAS_ISA
#ifdef VEGAS_HAVE_X86_PATHS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define VEGAS_ISA isa_avx2
#include "cpu/paged_verify_tile.h"
#undef VEGAS_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
#define VEGAS_ISA isa_avx512
#include "cpu/paged_verify_tile.h"
#undef VEGAS_ISA
#pragma GCC pop_options
#endif

namespace vegas {
namespace cpu {
namespace {

constexpr int64_t kMaxRows = 48;  // query rows of a unit (drafts have G or G x few)
constexpr int64_t kChunk = 256;   // virtual tokens per online-softmax step (scores stay in L1/L2)
constexpr int64_t kMinRun = 16;   // shortest run read in place (one AVX-512 vector of tokens)

struct Unit {
  int64_t r, g, i0, i1;  // request, KV head, its queries [i0, i1)
};

struct Strides {
  int64_t qs_t, qs_h, qs_d;
  int64_t ks_p, ks_h, ks_t, ks_d;
  int64_t vs_p, vs_h, vs_t, vs_d;
};

struct Run {
  int64_t v, n, page, off;  // virtual tokens [v, v + n) of the chunk: tokens off.. of one page
  bool in_place;            // read from the cache (else gathered into the chunk's buffers at v)
};

struct ThreadBuf {
  std::vector<float> qf, s, kbuf, vbuf, acc, m, l;
  std::vector<int32_t> sel;
  std::vector<Run> runs;
};

template <typename T>
void paged_draft_impl(const T* q, const T* kc, const T* vc, const int32_t* bt, const int32_t* lens,
                      const int32_t* qsl, const int32_t* idx, const int32_t* tail, int64_t K,
                      const PagedShape& sh, const Strides& st, float scale, float* outf) {
  const int64_t G = sh.G, D = sh.D, ps = sh.page_size, P = sh.max_pages, Hq = sh.Hq, Hkv = sh.Hkv;
  std::vector<Unit> units;
  const int64_t qb = std::max<int64_t>(1, kMaxRows / G);
  for (int64_t r = 0; r < sh.R; ++r) {
    const int64_t ql = qsl[r + 1] - qsl[r];
    for (int64_t g = 0; g < Hkv && ql > 0; ++g)
      for (int64_t i0 = 0; i0 < ql; i0 += qb) units.push_back({r, g, i0, std::min(i0 + qb, ql)});
  }
  const int64_t ss = kChunk + 2 * kMaxLanes;  // row stride of the scores
  // fp32 with tokens contiguous in the key pages and head_dim in the value pages: no gather
  const bool direct = std::is_same_v<T, float> && st.ks_t == 1 && st.vs_d == 1;
  parallel_tasks(
      static_cast<int64_t>(units.size()), kMaxRows * (K + kChunk), [] { return 0; },
      [&](int&, int64_t task) {
        thread_local ThreadBuf tb;  // grow-only, reused across calls
        const Unit& u = units[task];
        const int64_t L = lens[u.r], ql = qsl[u.r + 1] - qsl[u.r], pos0 = L - ql, ts = tail[u.r];
        const int64_t rows = (u.i1 - u.i0) * G;
        const int64_t tq0 = qsl[u.r] + u.i0;  // first query token of the unit
        // the selected tokens before the tail (ascending: checked), then the tail
        tb.sel.clear();
        const int32_t* row = idx + (u.r * Hkv + u.g) * K;
        for (int64_t k = 0; k < K; ++k)
          if (row[k] >= 0 && row[k] < ts) tb.sel.push_back(row[k]);
        const int64_t nsel = static_cast<int64_t>(tb.sel.size());
        const int64_t nv = nsel + (pos0 + u.i1 - ts);  // virtual tokens the unit's last query sees
        tb.qf.resize(rows * D);
        for (int64_t rr = 0; rr < rows; ++rr) {
          const T* src = q + (tq0 + rr / G) * st.qs_t + (u.g * G + rr % G) * st.qs_h;
          for (int64_t e = 0; e < D; ++e) tb.qf[rr * D + e] = static_cast<float>(src[e * st.qs_d]) * scale;
        }
        if (tb.s.size() < size_t(rows * ss)) tb.s.resize(rows * ss);
        if (tb.kbuf.size() < size_t(D * kChunk)) tb.kbuf.resize(D * kChunk);
        if (tb.vbuf.size() < size_t(D * kChunk)) tb.vbuf.resize(D * kChunk);
        tb.acc.assign(rows * D, 0.f);
        tb.m.assign(rows, -std::numeric_limits<float>::infinity());
        tb.l.assign(rows, 0.f);
        float* s = tb.s.data();
        float* kb = tb.kbuf.data();
        float* vb = tb.vbuf.data();
        const int32_t* pages = bt + u.r * P;
        const T* kg = kc + u.g * st.ks_h;
        const T* vg = vc + u.g * st.vs_h;
        const int R32 = static_cast<int>(rows), D32 = static_cast<int>(D);
        auto token = [&](int64_t v) { return v < nsel ? int64_t(tb.sel[v]) : ts + (v - nsel); };
        for (int64_t c0 = 0; c0 < nv; c0 += kChunk) {
          const int64_t nt = std::min(kChunk, nv - c0);
          if (direct) {
            // runs of consecutive tokens within one page: long ones in place, short ones gathered,
            // consecutive short ones merged into one gathered segment
            tb.runs.clear();
            for (int64_t v = 0; v < nt;) {
              const int64_t t = token(c0 + v), off = t % ps;
              int64_t n = 1;
              while (v + n < nt && off + n < ps && token(c0 + v + n) == t + n) ++n;
              const T* kp = kg + pages[t / ps] * st.ks_p;
              if (n >= kMinRun) {
                tb.runs.push_back({v, n, pages[t / ps], off, true});
              } else {
                for (int64_t i = 0; i < n; ++i) {
                  const T* ksrc = kp + (off + i);
                  const T* vsrc = vg + pages[t / ps] * st.vs_p + (off + i) * st.vs_t;
                  for (int64_t e = 0; e < D; ++e) kb[e * kChunk + v + i] = static_cast<float>(ksrc[e * st.ks_d]);
                  std::copy(vsrc, vsrc + D, vb + (v + i) * D);
                }
                if (!tb.runs.empty() && !tb.runs.back().in_place && tb.runs.back().v + tb.runs.back().n == v)
                  tb.runs.back().n += n;
                else
                  tb.runs.push_back({v, n, 0, 0, false});
              }
              v += n;
            }
            for (const Run& ru : tb.runs) {
              const float* kf = ru.in_place ? reinterpret_cast<const float*>(kg + ru.page * st.ks_p) + ru.off : kb + ru.v;
              VEGAS_ISA_CALL(pvt_qk_page, tb.qf.data(), R32, D32, kf, ru.in_place ? st.ks_d : kChunk,
                             static_cast<int>(ru.n), s + ru.v, ss);
            }
          } else {
            // gather: token by token, so the D cache lines of a [D, page_size] key page that a
            // run of neighbouring selected tokens shares stay in L1 between them
            for (int64_t v = 0; v < nt; ++v) {
              const int64_t t = token(c0 + v);
              const int64_t pg = pages[t / ps], off = t % ps;
              const T* ksrc = kg + pg * st.ks_p + off * st.ks_t;
              const T* vsrc = vg + pg * st.vs_p + off * st.vs_t;
              for (int64_t e = 0; e < D; ++e) kb[e * kChunk + v] = static_cast<float>(ksrc[e * st.ks_d]);
              for (int64_t e = 0; e < D; ++e) vb[v * D + e] = static_cast<float>(vsrc[e * st.vs_d]);
            }
            VEGAS_ISA_CALL(pvt_qk_page, tb.qf.data(), R32, D32, kb, kChunk, static_cast<int>(nt), s, ss);
          }
          for (int64_t rr = 0; rr < rows; ++rr) {
            // query i sees the selected tokens and the tail up to its own position pos0 + i
            const int64_t vis = std::min<int64_t>(nsel + pos0 + u.i0 + rr / G + 1 - ts, c0 + nt) - c0;
            const float alpha = VEGAS_ISA_CALL(pvt_online_row, s + rr * ss, vis, nt, &tb.m[rr], &tb.l[rr]);
            if (alpha != 1.f)
              for (int64_t e = 0; e < D; ++e) tb.acc[rr * D + e] *= alpha;
          }
          if (direct)
            for (const Run& ru : tb.runs) {
              const float* vf = ru.in_place ? reinterpret_cast<const float*>(vg + ru.page * st.vs_p) + ru.off * st.vs_t
                                            : vb + ru.v * D;
              VEGAS_ISA_CALL(pvt_pv_page, s + ru.v, ss, R32, vf, ru.in_place ? st.vs_t : D, static_cast<int>(ru.n),
                             tb.acc.data(), D32);
            }
          else
            VEGAS_ISA_CALL(pvt_pv_page, s, ss, R32, vb, D, static_cast<int>(nt), tb.acc.data(), D32);
        }
        for (int64_t rr = 0; rr < rows; ++rr) {
          // l > 0: every query sees at least itself; NaN l (a NaN score) poisons the row
          const float inv = 1.f / tb.l[rr];
          float* o = outf + ((tq0 + rr / G) * Hq + u.g * G + rr % G) * D;
          for (int64_t e = 0; e < D; ++e) o[e] = tb.acc[rr * D + e] * inv;
        }
      });
}

at::Tensor paged_sparse_draft_attention_cpu(const at::Tensor& q, const at::Tensor& key_cache,
                                            const at::Tensor& value_cache, const at::Tensor& block_table,
                                            const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                            const at::Tensor& token_indices, const at::Tensor& tail_start,
                                            double scale) {
  const char* op = "vegas::paged_sparse_draft_attention";
  const PagedShape sh = check_paged_inputs(op, q, key_cache, block_table, seq_lens, query_start_loc, 1, scale);
  check_paged_values_cache(op, key_cache, value_cache);
  check_paged_draft_inputs(op, q, token_indices, tail_start, sh);
  const at::Tensor bt = block_table.contiguous(), lens_t = seq_lens.contiguous(),
                   qsl_t = query_start_loc.contiguous(), idx_t = token_indices.contiguous(),
                   tail_t = tail_start.contiguous();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  const int32_t* qsl = qsl_t.data_ptr<int32_t>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int32_t* idx = idx_t.data_ptr<int32_t>();
  const int32_t* tail = tail_t.data_ptr<int32_t>();
  const int64_t K = idx_t.size(2);
  check_paged_values(op, qsl, lens, btp, sh);
  check_paged_draft_values(op, qsl, lens, idx, tail, K, sh);
  const Strides st{q.stride(0), q.stride(1), q.stride(2), key_cache.stride(0),
                   key_cache.stride(1), key_cache.stride(2), key_cache.stride(3), value_cache.stride(0),
                   value_cache.stride(1), value_cache.stride(2), value_cache.stride(3)};
  // every row of a request is written; rows past query_start_loc[R] stay zero
  auto out32 = at::zeros({sh.T, sh.Hq, sh.D}, q.options().dtype(at::kFloat));
  if (sh.R > 0 && sh.max_pages > 0 && sh.T > 0)
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_sparse_draft_attention", [&] {
      paged_draft_impl<scalar_t>(q.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                                 value_cache.data_ptr<scalar_t>(), btp, lens, qsl, idx, tail, K, sh, st,
                                 static_cast<float>(scale), out32.data_ptr<float>());
    });
  return q.scalar_type() == at::kFloat ? out32 : out32.to(q.scalar_type());
}

}  // namespace
}  // namespace cpu
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CPU, m) {
  m.impl("paged_sparse_draft_attention", &vegas::cpu::paged_sparse_draft_attention_cpu);
}
