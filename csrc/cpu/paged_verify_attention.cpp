// CPU kernel of vegas::paged_verify_attention: the attention output of every query of a packed
// batch over a paged KV cache (vLLM's layout) AND the attention mass that the newest queries of
// each request put on every page, in one pass over the cache -- Vegas's verification, where the
// selection signal comes with the verification attention (arXiv 2602.07223) instead of a second
// pass (vegas::paged_block_scores) after the engine's own kernel.
//
// Work units: (request r, KV head g, block of queries, split of the tokens). The rows of a unit
// are its queries x the G query heads of g. A unit walks its split in chunks of ~kChunkTokens
// whole pages (online softmax, FlashAttention-style): the chunk's scores of all rows (page by
// page, tokens in lanes from the [D, page_size] key pages, kept in L1/L2), each row's running max,
// exp and sum, the per-page sums of the scored rows relative to the running max after the chunk
// (kept with it), then P V (head_dim in lanes from the [page_size, D] value pages). A second,
// small pass per (request, KV head) combines the splits (flash-decoding) into the output and the
// row's log-sum-exp, and normalizes each page sum by exp(chunk max - lse) (with one split, each
// scored unit does this itself at its end, from sums in its thread's cache): the same scores as
// paged_block_scores (each row's probabilities summed per page), so a proposer's selection does
// not change. The last min(q_len, num_queries) queries of a request form one block (the scored
// rows); earlier queries (a prefill chunk) go in blocks of at most kMaxRows rows. Other layouts
// and bf16 / fp16 caches are converted page by page into fp32 scratch in the layout above.
// score_block_size b != page_size (b = 1: per-token scores for token-granular drafts): the sums
// are kept per fine block of f = gcd(b, page_size) tokens, which never straddles a chunk (f
// divides the page size, chunks are whole pages), and the combine adds them into blocks of b.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include "checks.h"
#include "cpu/combine.h"
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

constexpr int64_t kMaxRows = 48;        // rows of an unscored query block (a prefill chunk's queries)
constexpr int64_t kChunkTokens = 256;   // tokens per online-softmax step (rounded to whole pages)

struct Unit {
  int64_t r, g, i0, i1;  // request, KV head, its queries [i0, i1)
  bool scored;           // the request's last min(q_len, num_queries) queries
};

struct Dims {
  int64_t T, Hq, Hkv, G, D, ps, P;
  int64_t qs_t, qs_h, qs_d;
  int64_t ks_p, ks_h, ks_t, ks_d;
  int64_t vs_p, vs_h, vs_t, vs_d;
};

float* grow(std::vector<float>& v, int64_t n) {
  if (v.size() < size_t(n)) v.resize(n);
  return v.data();
}

struct ThreadBuf {
  std::vector<float> qf, s, kbuf, vbuf, acc, m, l, bsum;
};

// Adds one scored row's mass to the score blocks sc: its fine-block sums bsr (each chunk's
// relative to the row's running max after that chunk, mcr[c * nsc]) times exp(max - lse).
void add_row_mass(float* sc, const float* bsr, const float* mcr, int64_t nsc, float lse, int64_t L, int64_t ch,
                  int64_t f, int64_t sb) {
  for (int64_t c = 0; c * ch < L; ++c) {
    const float w = std::exp(mcr[c * nsc] - lse);
    if (!(w > 0.f)) continue;  // the row's max grew far past this chunk's: no mass
    const int64_t j1 = std::min(ceil_div(L, f), (c + 1) * ch / f);
    if (f == sb)
      for (int64_t j = c * ch / f; j < j1; ++j) sc[j] += bsr[j] * w;
    else
      for (int64_t j = c * ch / f; j < j1; ++j) sc[j * f / sb] += bsr[j] * w;
  }
}

template <typename T>
void paged_verify_impl(const T* q, const T* kc, const T* vc, const int32_t* bt, const int32_t* lens,
                       const int32_t* qsl, int64_t R, int64_t num_queries, float scale, const Dims& d,
                       int64_t sb, float* outf, float* scores) {
  const int64_t G = d.G, D = d.D, ps = d.ps, P = d.P, Hq = d.Hq;
  const int64_t f = std::gcd(sb, ps);   // fine block: divides the page size and score blocks
  const int64_t nf = ceil_div(P * ps, f);  // fine blocks of the longest table
  const int64_t nb = ceil_div(P * ps, sb);  // score blocks (the output's last dimension)
  // units and the longest range of keys a unit reads
  std::vector<Unit> units;
  int64_t max_len = 0, nsc = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t ql = qsl[r + 1] - qsl[r];
    if (ql <= 0) continue;
    max_len = std::max<int64_t>(max_len, lens[r]);
    const int64_t n = std::min<int64_t>(ql, num_queries);
    nsc = std::max(nsc, n * G);
    for (int64_t g = 0; g < d.Hkv; ++g) {
      units.push_back({r, g, ql - n, ql, true});
      const int64_t qb = std::max<int64_t>(1, kMaxRows / G);
      for (int64_t i0 = 0; i0 < ql - n; i0 += qb) units.push_back({r, g, i0, std::min(i0 + qb, ql - n), false});
    }
  }
  if (units.empty()) return;  // no request has a query: no output row to write, no mass
  // Chunks of about kChunkTokens whole pages: a chunk's scores of every row stay in L1/L2 while
  // they are made, exponentiated, summed per page and multiplied by V (online softmax over chunks).
  const int64_t ch = std::max<int64_t>(1, kChunkTokens / ps) * ps;
  const int64_t nsplit = choose_num_splits(static_cast<int64_t>(units.size()), max_len, at::get_num_threads());
  const int64_t split_len = ceil_div(ceil_div(max_len, nsplit), ch) * ch;  // whole chunks
  const int64_t ss = ch + 2 * kMaxLanes;                                    // row stride of the scores
  const int64_t nrow = d.T * Hq;                                            // one state per (token, head)
  const int64_t nch = ceil_div(P * ps, ch);                                 // chunks of the longest table
  const int64_t nsc1 = std::max<int64_t>(nsc, 1);
  // Grow-only buffers of the calling thread, reused across calls (a fresh allocation of this size
  // is page-faulted in on every call); every entry the combine reads is written first.
  thread_local std::vector<float> m_buf, l_buf, acc_buf, bsum_buf, mc_buf;
  float* m_all = grow(m_buf, nsplit * nrow);
  float* l_all = grow(l_buf, nsplit * nrow);
  float* acc_all = grow(acc_buf, nsplit * nrow * D);
  // One split: a scored unit sees all its keys, knows its rows' lse at its end and adds their mass
  // to the scores itself, from fine sums in its thread's cache (per-token sums of every request in
  // one buffer, 8 MB at 8K x 4, cost more to write and read back than the attention's own work).
  const bool fused = nsplit == 1;
  float* bsum = fused ? nullptr : grow(bsum_buf, R * d.Hkv * nsc1 * nf);  // [R * Hkv, nsc, nf]: fine sums
  float* mc = grow(mc_buf, R * d.Hkv * nch * nsc1);    // [R * Hkv, nch, nsc]: running max after chunk
  const bool k_direct = std::is_same_v<T, float> && d.ks_t == 1;
  const bool v_direct = std::is_same_v<T, float> && d.vs_d == 1;

  parallel_tasks(
      static_cast<int64_t>(units.size()) * nsplit, kMaxRows * split_len, [] { return 0; },
      [&](int&, int64_t task) {
        thread_local ThreadBuf tb;  // reused across calls, like the buffers above
        const Unit& u = units[task / nsplit];
        const int64_t sp = task % nsplit;
        const int64_t L = lens[u.r], ql = qsl[u.r + 1] - qsl[u.r], pos0 = L - ql;
        const int64_t rows = (u.i1 - u.i0) * G;
        const int64_t t0 = sp * split_len;
        const int64_t te = std::min<int64_t>({L, t0 + split_len, pos0 + u.i1});  // keys [t0, te) read
        const int64_t tq0 = qsl[u.r] + u.i0;                                       // first query token
        auto state = [&](int64_t rr) {  // index of row rr's (token, head) state
          return sp * nrow + (tq0 + rr / G) * Hq + u.g * G + rr % G;
        };
        const int64_t bg = u.r * d.Hkv + u.g;
        float* bs = fused ? grow(tb.bsum, nsc * nf) : bsum + bg * nsc * nf;
        float* mcr = mc + bg * nch * nsc;
        tb.m.assign(rows, -std::numeric_limits<float>::infinity());
        tb.l.assign(rows, 0.f);
        if (te > t0) {
          tb.qf.resize(rows * D);
          for (int64_t rr = 0; rr < rows; ++rr) {
            const T* src = q + (tq0 + rr / G) * d.qs_t + (u.g * G + rr % G) * d.qs_h;
            for (int64_t e = 0; e < D; ++e) tb.qf[rr * D + e] = static_cast<float>(src[e * d.qs_d]) * scale;
          }
          if (tb.s.size() < size_t(rows * ss)) tb.s.resize(rows * ss);
          if (!k_direct && tb.kbuf.size() < size_t(D * ps)) tb.kbuf.resize(D * ps);
          if (!v_direct && tb.vbuf.size() < size_t(D * ps)) tb.vbuf.resize(D * ps);
          tb.acc.assign(rows * D, 0.f);
        }
        float* s = tb.s.data();
        const int32_t* pages = bt + u.r * P;
        const int R32 = static_cast<int>(rows), D32 = static_cast<int>(D);
        for (int64_t c0 = t0; c0 < te; c0 += ch) {
          const int64_t c1 = std::min(c0 + ch, te);
          // QK, page by page
          for (int64_t j = c0 / ps; j * ps < c1; ++j) {
            const int64_t tp = j * ps, nt = std::min<int64_t>(ps, c1 - tp);
            const T* kp = kc + int64_t(pages[j]) * d.ks_p + u.g * d.ks_h;
            const float* kf;
            int64_t kd;
            if (k_direct) {
              kf = reinterpret_cast<const float*>(kp);
              kd = d.ks_d;
            } else {
              for (int64_t e = 0; e < D; ++e)
                for (int64_t t = 0; t < nt; ++t) tb.kbuf[e * ps + t] = static_cast<float>(kp[t * d.ks_t + e * d.ks_d]);
              kf = tb.kbuf.data();
              kd = ps;
            }
            VEGAS_ISA_CALL(pvt_qk_page, tb.qf.data(), R32, D32, kf, kd, static_cast<int>(nt), s + (tp - c0), ss);
          }
          // online softmax per row (causal: query i sees tokens < pos0 + i + 1), page sums
          for (int64_t rr = 0; rr < rows; ++rr) {
            const int64_t vis = std::min<int64_t>(pos0 + u.i0 + rr / G + 1, c1) - c0;
            float* sr = s + rr * ss;
            const float alpha = VEGAS_ISA_CALL(pvt_online_row, sr, vis, c1 - c0, &tb.m[rr], &tb.l[rr]);
            if (alpha != 1.f)
              for (int64_t e = 0; e < D; ++e) tb.acc[rr * D + e] *= alpha;
            if (u.scored) {
              mcr[(c0 / ch) * nsc + rr] = tb.m[rr];
              float* bsr = bs + rr * nf;
              if (f == 1) {
                std::copy(sr, sr + (c1 - c0), bsr + c0);
              } else {
                for (int64_t j = c0 / f; j * f < c1; ++j) {
                  float p = 0.f;
                  for (int64_t t = j * f; t < std::min<int64_t>((j + 1) * f, c1); ++t) p += sr[t - c0];
                  bsr[j] = p;
                }
              }
            }
          }
          // P V, page by page
          for (int64_t j = c0 / ps; j * ps < c1; ++j) {
            const int64_t tp = j * ps, nt = std::min<int64_t>(ps, c1 - tp);
            const T* vp = vc + int64_t(pages[j]) * d.vs_p + u.g * d.vs_h;
            const float* vf_;
            int64_t vt;
            if (v_direct) {
              vf_ = reinterpret_cast<const float*>(vp);
              vt = d.vs_t;
            } else {
              for (int64_t t = 0; t < nt; ++t)
                for (int64_t e = 0; e < D; ++e) tb.vbuf[t * D + e] = static_cast<float>(vp[t * d.vs_t + e * d.vs_d]);
              vf_ = tb.vbuf.data();
              vt = D;
            }
            VEGAS_ISA_CALL(pvt_pv_page, s + (tp - c0), ss, R32, vf_, vt, static_cast<int>(nt), tb.acc.data(), D32);
          }
        }
        for (int64_t rr = 0; rr < rows; ++rr) {
          m_all[state(rr)] = tb.m[rr];
          l_all[state(rr)] = tb.l[rr];
          if (te > t0) std::copy(tb.acc.data() + rr * D, tb.acc.data() + (rr + 1) * D, acc_all + state(rr) * D);
        }
        if (fused && u.scored && te > t0)
          for (int64_t rr = 0; rr < rows; ++rr) {
            const float lse = split_lse(&tb.m[rr], &tb.l[rr], 1, 1);
            if (std::isfinite(lse)) add_row_mass(scores + bg * nb, bs + rr * nf, mcr + rr, nsc, lse, L, ch, f, sb);
          }
      });

  // combine the splits per (request, KV head): output rows, then the scored rows' block sums
  parallel_tasks(
      R * d.Hkv, nsplit * std::max<int64_t>(nsc, 1) * (D + nf), [] { return 0; },
      [&](int&, int64_t task) {
        const int64_t r = task / d.Hkv, g = task % d.Hkv;
        const int64_t ql = qsl[r + 1] - qsl[r], L = lens[r];
        if (ql <= 0) return;
        const int64_t n = std::min<int64_t>(ql, num_queries);
        const float* bs = fused ? nullptr : bsum + task * nsc * nf;
        for (int64_t i = 0; i < ql; ++i)
          for (int64_t hh = 0; hh < G; ++hh) {
            const int64_t idx = (qsl[r] + i) * Hq + g * G + hh;
            const float lse = combine_row(m_all + idx, l_all + idx, acc_all + idx * D, nsplit,
                                          nrow, D, outf + idx * D);
            // unscored, a poisoned row (no mass), or scored by its unit already
            if (fused || i < ql - n || !std::isfinite(lse)) continue;
            const int64_t rr = (i - (ql - n)) * G + hh;
            add_row_mass(scores + task * nb, bs + rr * nf, mc + task * nch * nsc + rr, nsc, lse, L, ch, f, sb);
          }
      });
}

std::tuple<at::Tensor, at::Tensor> paged_verify_attention_cpu(const at::Tensor& q, const at::Tensor& key_cache,
                                                              const at::Tensor& value_cache,
                                                              const at::Tensor& block_table,
                                                              const at::Tensor& seq_lens,
                                                              const at::Tensor& query_start_loc,
                                                              int64_t num_queries, double scale,
                                                              std::optional<int64_t> score_block_size) {
  const char* op = "vegas::paged_verify_attention";
  const PagedShape sh = check_paged_inputs(op, q, key_cache, block_table, seq_lens, query_start_loc,
                                           num_queries, scale);
  // blocks longer than the table hold all of it (same single score), without overflow
  const int64_t sb = std::min(paged_score_block_size(op, score_block_size, sh.page_size),
                              std::max<int64_t>(sh.max_pages * sh.page_size, 1));
  check_paged_values_cache(op, key_cache, value_cache);
  const at::Tensor bt = block_table.contiguous(), lens_t = seq_lens.contiguous(),
                   qsl_t = query_start_loc.contiguous();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  const int32_t* qsl = qsl_t.data_ptr<int32_t>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  check_paged_values(op, qsl, lens, btp, sh);
  Dims d{sh.T,
         sh.Hq,
         sh.Hkv,
         sh.G,
         sh.D,
         sh.page_size,
         sh.max_pages,
         q.stride(0),
         q.stride(1),
         q.stride(2),
         key_cache.stride(0),
         key_cache.stride(1),
         key_cache.stride(2),
         key_cache.stride(3),
         value_cache.stride(0),
         value_cache.stride(1),
         value_cache.stride(2),
         value_cache.stride(3)};
  // The kernel writes every output row up to query_start_loc[R] and adds each scored row's mass
  // to the scores, which start at zero.
  auto out32 = at::empty({sh.T, sh.Hq, sh.D}, q.options().dtype(at::kFloat));
  auto scores = at::zeros({sh.R, sh.Hkv, ceil_div(sh.max_pages * sh.page_size, sb)}, q.options().dtype(at::kFloat));
  const bool runs = sh.R > 0 && sh.max_pages > 0 && sh.T > 0;
  const int64_t written = runs ? qsl[sh.R] : 0;  // rows past the last request's stay zero
  std::fill(out32.data_ptr<float>() + written * sh.Hq * sh.D, out32.data_ptr<float>() + out32.numel(), 0.f);
  if (runs) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_verify_attention", [&] {
      paged_verify_impl<scalar_t>(q.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                                  value_cache.data_ptr<scalar_t>(), btp, lens, qsl, sh.R, num_queries,
                                  static_cast<float>(scale), d, sb, out32.data_ptr<float>(),
                                  scores.data_ptr<float>());
    });
  }
  if (q.scalar_type() == at::kFloat) return {out32, scores};
  return {out32.to(q.scalar_type()), scores};
}

}  // namespace
}  // namespace cpu
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CPU, m) {
  m.impl("paged_verify_attention", &vegas::cpu::paged_verify_attention_cpu);
}
