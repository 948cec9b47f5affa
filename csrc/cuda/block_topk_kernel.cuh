// Kernel of vegas::block_topk (raw pointers, no torch includes). One CTA of 1024 threads
// per (row b, head h), all rows in one launch.
//
// Order: higher score first, NaN below every number (-inf included), ties to the lower
// index -- encoded as a 32-bit key that is monotone in the float (NaN -> 0, -0.0 ->
// +0.0), with the index as the tie-break. A 3-pass radix select (11 + 11 + 10 bits,
// 2048-bin shared histogram) finds the key T of the last selected candidate and how many
// candidates with key == T are needed; a final pass in index order takes every key > T and
// the first `need` keys == T, so the output is ascending with no sort. Sinks
// [0, min(num_sink_blocks, c)) come first and the last min(num_recent_blocks, c - sinks)
// eligible blocks last; positions >= c are -1. k / num_candidates are
// clamped at 0 (device-side guard: their values are not checked on the host unless
// VEGAS_CUDA_VALUE_CHECKS=1).
//
// Layout (why it is fast at one row per SM, i.e. small batches): warp w owns a contiguous
// segment of the candidates and its lanes read consecutive keys (coalesced, conflict-free);
// the first pass caches the keys of the first `ncache` candidates in shared memory (all of
// them up to ~55K candidates on sm_90: 32K x 4 B = 128 KiB), so passes 2-3 and the
// compaction read shared memory, not L2. Each thread revisits only its own elements, so the
// cache needs no barrier. The compaction ranks with warp ballots (one count sweep, one
// 32-entry scan over the warps, one write sweep): 2 block barriers instead of the former 2
// block scans per 512 candidates (~130 at 32K), and the bin search is a block scan over the
// 2048 bins instead of one thread walking 256 bins per pass. The H200 measured the former
// kernel at 157 us for 32K candidates x 8 rows (batch 1) and 671 us at 128K.
//
// STATUS: compiled for sm_90, emulator-checked (csrc/cuda/emu); the former design ran on
// an H200 (bench/results/gpu_h200); this one is not yet run on a GPU.
#pragma once

#include "cuda/attention_params.h"
#include "cuda/device_utils.cuh"

namespace vegas {
namespace cuda {

constexpr int kTopkThreads = 1024;
constexpr int kTopkBins = 2048;  // 11-bit digits
static_assert(kTopkBins <= 2 * kTopkThreads, "the bin search gives each thread at most 2 bins");
// hist[2048], scan scratch[32], per-warp gt / eq counts and their prefixes [4][32], bc[4]
constexpr size_t kTopkSmemBytes = (kTopkBins + 32 + 4 * 32 + 4) * sizeof(int);

// Keys cached in shared memory for a row of `n` candidates when a CTA may use up to
// `smem_optin` bytes (the remaining keys are re-read from global memory each pass).
inline int64_t topk_cache_keys(int64_t n, int64_t smem_optin) {
  const int64_t room = (smem_optin - int64_t(kTopkSmemBytes)) / int64_t(sizeof(uint32_t));
  return room <= 0 ? 0 : (n < room ? n : room);
}

VEGAS_DEVICE uint32_t topk_key(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if (f != f) return 0u;   // NaN: below everything
  if (f == 0.f) u = 0u;    // -0.0 ties with +0.0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum over the CTA in thread order; *total = the sum of all v.
// ws: 32 ints of shared memory. Every thread of the CTA must call it.
VEGAS_DEVICE int block_exclusive_scan(int v, int* ws, int* total) {
  const int tid = thread_x();
  const int lane = tid & 31, warp = tid >> 5;
  const int nwarps = block_dim_x() >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = shfl_up_int(x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) ws[warp] = x;
  block_sync();
  if (warp == 0) {
    int w = lane < nwarps ? ws[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = shfl_up_int(w, o);
      if (lane >= o) w += y;
    }
    if (lane < nwarps) ws[lane] = w;  // inclusive warp prefixes
  }
  block_sync();
  const int before = warp > 0 ? ws[warp - 1] : 0;
  *total = ws[nwarps - 1];
  block_sync();  // ws is reused by the next call
  return before + x - v;
}

static VEGAS_GLOBAL void VEGAS_LAUNCH_BOUNDS(kTopkThreads) block_topk_kernel(const TopkParams p) {
  VEGAS_DYNAMIC_SMEM(smem);
  int* hist = reinterpret_cast<int*>(smem);  // [kTopkBins]
  int* ws = hist + kTopkBins;                // [32] scan scratch
  int* wgt = ws + 32;                        // [32] keys > T per warp
  int* weq = wgt + 32;                       // [32] keys == T per warp, then their prefix
  int* wsel = weq + 32;                      // [32] prefix of the selected per warp
  int* bc = wsel + 32;                       // [4]
  uint32_t* kc = reinterpret_cast<uint32_t*>(bc + 4);  // [ncache] cached keys
  const int tid = thread_x();
  const int nth = block_dim_x();
  const int lane = tid & 31, warp = tid >> 5;
  const int nwarps = nth >> 5;
  const int row = block_x();
  const int b = row / p.H;
  const int N = p.N;
  const float* s = p.scores + int64_t(row) * N;
  int32_t* o = p.out + int64_t(row) * p.max_k;

  const int nc = p.num_candidates[b];
  const int elig = imin(nc < 0 ? 0 : nc, N);
  const int kb = p.k[b];
  const int c = imin(imin(kb < 0 ? 0 : kb, p.max_k), elig);
  const int sinks = imin(p.num_sink_blocks, c);
  const int recent = imin(p.num_recent_blocks, c - sinks);  // [elig - recent, elig), output last
  const int rest = c - sinks - recent;
  const int n = elig - recent - sinks;  // candidates between the sinks and the recent blocks

  for (int j = tid; j < p.max_k; j += nth) {
    if (j < sinks) o[j] = j;
    else if (j >= c) o[j] = -1;
    else if (j >= c - recent) o[j] = elig - (c - j);
  }
  if (rest <= 0) return;  // uniform over the CTA
  if (rest >= n) {        // every remaining eligible block is selected
    for (int j = tid; j < n; j += nth) o[sinks + j] = sinks + j;
    return;
  }

  // warp w: candidates [w * seg, (w + 1) * seg) after the sinks, 32 per step
  const int seg = idiv_up(idiv_up(n, nwarps), 32) * 32;
  const int e0 = warp * seg;
  const int steps = (imax(0, imin(seg, n - e0)) + 31) / 32;  // uniform over the warp
  const int ncache = p.ncache;
  auto key_at = [&](int e) -> uint32_t {
    return e < ncache ? kc[e] : topk_key(s[sinks + e]);
  };

  // ---- radix select of the rest-th largest key among the candidates
  uint32_t prefix = 0u, mask = 0u;
  int remaining = rest;
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
    const int nbins = pass == 2 ? 1024 : 2048;
    for (int i = tid; i < nbins; i += nth) hist[i] = 0;
    block_sync();
    for (int st = 0; st < steps; ++st) {
      const int e = e0 + st * 32 + lane;
      int bin = -1;
      if (e < n) {
        uint32_t key;
        if (pass == 0) {  // first read: from global memory, cached for the later passes
          key = topk_key(s[sinks + e]);
          if (e < ncache) kc[e] = key;
        } else {
          key = key_at(e);
        }
        if ((key & mask) == prefix) bin = static_cast<int>((key >> shift) & uint32_t(nbins - 1));
      }
      if (ballot(bin >= 0) == 0u) continue;  // warp-uniform: nothing of this step left
      // warp-aggregated: the lanes that hit the same bin add once (scores in a narrow
      // range share their first digit, so the first pass would pile up on few bins)
      const uint32_t peers = match_any(bin);
      if (bin >= 0 && lane == lowest_lane(peers)) atomic_add_shared(&hist[bin], popc(peers));
    }
    block_sync();
    // the bin of the remaining-th largest key: thread t holds bins nbins-1-t*per downwards,
    // an exclusive scan over the threads gives the count of keys in the bins above
    const int per = idiv_up(nbins, nth);
    int h[2] = {0, 0};
    int v = 0;
    for (int u = 0; u < per && u < 2; ++u) {
      const int bin = nbins - 1 - tid * per - u;
      h[u] = bin >= 0 ? hist[bin] : 0;
      v += h[u];
    }
    int total;
    int cum = block_exclusive_scan(v, ws, &total);
    for (int u = 0; u < per && u < 2; ++u) {
      if (cum < remaining && cum + h[u] >= remaining) {  // exactly one thread, one bin
        bc[0] = nbins - 1 - tid * per - u;
        bc[1] = remaining - cum;
      }
      cum += h[u];
    }
    block_sync();
    prefix |= uint32_t(bc[0]) << shift;
    mask |= uint32_t(nbins - 1) << shift;
    remaining = bc[1];
    block_sync();  // bc / hist are rewritten by the next pass
  }
  const uint32_t T = prefix;
  const int need_eq = remaining;  // >= 1 keys equal to T are taken, lowest indices first

  // ---- compaction in index order: per-warp counts, a scan over the warps, ballot ranks
  int cgt = 0, ceq = 0;
  for (int st = 0; st < steps; ++st) {
    const int e = e0 + st * 32 + lane;
    const uint32_t key = e < n ? key_at(e) : 0u;
    cgt += popc(ballot(e < n && key > T));
    ceq += popc(ballot(e < n && key == T));
  }
  if (lane == 0) {
    wgt[warp] = cgt;
    weq[warp] = ceq;
  }
  block_sync();
  if (warp == 0) {
    const int eq_w = lane < nwarps ? weq[lane] : 0;
    int x = eq_w;  // inclusive scan over the warps
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int y = shfl_up_int(x, d);
      if (lane >= d) x += y;
    }
    const int eq_before = x - eq_w;
    const int take = imax(0, imin(need_eq - eq_before, eq_w));
    const int sel_w = lane < nwarps ? wgt[lane] + take : 0;
    int z = sel_w;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int y = shfl_up_int(z, d);
      if (lane >= d) z += y;
    }
    if (lane < nwarps) {
      weq[lane] = eq_before;
      wsel[lane] = z - sel_w;
    }
  }
  block_sync();
  int eq_run = weq[warp], sel_run = wsel[warp];
  const uint32_t lt = (1u << lane) - 1u;
  for (int st = 0; st < steps; ++st) {
    const int e = e0 + st * 32 + lane;
    const uint32_t key = e < n ? key_at(e) : 0u;
    const bool eq = e < n && key == T;
    const uint32_t beq = ballot(eq);
    const bool sel = (e < n && key > T) || (eq && eq_run + popc(beq & lt) < need_eq);
    const uint32_t bsel = ballot(sel);
    if (sel) o[sinks + sel_run + popc(bsel & lt)] = sinks + e;
    eq_run += popc(beq);
    sel_run += popc(bsel);
  }
}

}  // namespace cuda
}  // namespace vegas
