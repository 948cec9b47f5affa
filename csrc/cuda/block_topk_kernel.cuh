// Kernel of vegas::block_topk (raw pointers, no torch includes). One CTA per (row b,
// head h), all rows in one launch.
//
// Order: higher score first, NaN below every number (-inf included), ties to the lower
// index -- encoded as a 32-bit key that is monotone in the float (NaN -> 0, -0.0 ->
// +0.0), with the index as the tie-break. A 4-pass 8-bit radix select finds the key T
// of the last selected candidate and how many candidates with key == T are needed;
// a final pass in index order takes every key > T and the first `need` keys == T,
// so the output is ascending with no sort. Sinks [0, min(num_sink_blocks, c)) come
// first; positions >= c are -1. k / num_candidates are clamped at 0 (device-side guard:
// their values are not checked on the host unless VEGAS_CUDA_VALUE_CHECKS=1).
//
// STATUS: compiled, emulator-checked (csrc/cuda/emu); ran on an H200 (bench/results/gpu_h200).
#pragma once

#include "cuda/attention_params.h"
#include "cuda/device_utils.cuh"

namespace vegas {
namespace cuda {

constexpr int kTopkThreads = 512;
constexpr size_t kTopkSmemBytes = (256 + 32 + 4) * sizeof(int);

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
  int* hist = reinterpret_cast<int*>(smem);  // [256]
  int* ws = hist + 256;                      // [32]
  int* bc = ws + 32;                         // [4]
  const int tid = thread_x();
  const int nth = block_dim_x();
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
  const int rest = c - sinks;
  const int n = elig - sinks;  // candidates after the sinks

  for (int j = tid; j < p.max_k; j += nth) {
    if (j < sinks) o[j] = j;
    else if (j >= c) o[j] = -1;
  }
  if (rest <= 0) return;  // uniform over the CTA
  if (rest >= n) {        // every remaining eligible block is selected
    for (int j = tid; j < n; j += nth) o[sinks + j] = sinks + j;
    return;
  }

  // ---- radix select of the rest-th largest key among [sinks, elig)
  uint32_t prefix = 0u, mask = 0u;
  int remaining = rest;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += nth) hist[i] = 0;
    block_sync();
    // warp-aggregated: the lanes that hit the same bin add once (scores in a narrow
    // range share their first key byte, so the first pass would pile up on few bins)
    for (int base = sinks; base < elig; base += nth) {  // bound uniform over the CTA
      const int j = base + tid;
      int bin = -1;
      if (j < elig) {
        const uint32_t key = topk_key(s[j]);
        if ((key & mask) == prefix) bin = static_cast<int>((key >> shift) & 255u);
      }
      const uint32_t peers = match_any(bin);
      if (bin >= 0 && (tid & 31) == lowest_lane(peers)) atomic_add_shared(&hist[bin], popc(peers));
    }
    block_sync();
    if (tid == 0) {
      int cum = 0, d = 255;
      for (; d > 0; --d) {
        if (cum + hist[d] >= remaining) break;
        cum += hist[d];
      }
      bc[0] = d;
      bc[1] = remaining - cum;
    }
    block_sync();
    prefix |= uint32_t(bc[0]) << shift;
    mask |= 0xFFu << shift;
    remaining = bc[1];
    block_sync();  // bc / hist are rewritten by the next pass
  }
  const uint32_t T = prefix;
  const int need_eq = remaining;  // >= 1 keys equal to T are taken, lowest indices first

  // ---- compaction in index order
  int eq_before = 0, sel_before = 0;
  for (int base = sinks; base < elig; base += nth) {
    const int j = base + tid;
    const bool in = j < elig;
    const uint32_t key = in ? topk_key(s[j]) : 0u;
    const int gt = (in && key > T) ? 1 : 0;
    const int eq = (in && key == T) ? 1 : 0;
    int eq_total, sel_total;
    const int eq_rank = block_exclusive_scan(eq, ws, &eq_total);
    const int sel = (gt || (eq && eq_before + eq_rank < need_eq)) ? 1 : 0;
    const int pos = block_exclusive_scan(sel, ws, &sel_total);
    if (sel) o[sinks + sel_before + pos] = j;
    eq_before += eq_total;
    sel_before += sel_total;
  }
}

}  // namespace cuda
}  // namespace vegas
