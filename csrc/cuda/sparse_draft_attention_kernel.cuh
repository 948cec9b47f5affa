// Kernels of vegas::sparse_draft_attention (raw pointers, no torch includes): the shared
// split-KV main loops of attention_kernel.cuh over the token map below -- the selected
// blocks of the row's KV head (tokens before tail_start only), then the tail
// [tail_start, seq_len) -- so each selected block is read once for all query heads of
// its group and all queries; causality (only the tail can be masked) is applied per row.
// Source of the method: Vegas, arXiv 2602.07223.
//
// STATUS: compiled, emulator-checked (csrc/cuda/emu); ran on an H200 (bench/results/gpu_h200).
#pragma once

#include "cuda/attention_kernel.cuh"

namespace vegas {
namespace cuda {

// Virtual position v < K * block_size: slot i = v / block_size of block_indices[b, g],
// offset v % block_size in that block; -1 entries, indices outside [0, nblocks) and
// tokens at or past tail_start are empty slots. Then the tail, densely.
struct DraftMap {
  static constexpr bool kBlockScores = false;
  const int32_t* row;
  int L, tail, sel, bs, nblocks;
  VEGAS_DEVICE void init(const AttnParams& p, int b, int g) {
    const int len = p.seq_lens[b];
    L = len < 0 ? 0 : (len > p.S ? p.S : len);
    const int ts = p.tail_start[b];
    tail = ts < 0 ? 0 : (ts > L ? L : ts);  // clamped: unchecked under graph capture
    bs = p.block_size;
    nblocks = p.nblocks;
    sel = p.K * bs;
    row = p.block_indices + (int64_t(b) * p.Hkv + g) * p.K;
  }
  VEGAS_DEVICE int length() const { return sel + (L - tail); }
  VEGAS_DEVICE int token(int v) const {
    if (v < sel) {
      const int i = v / bs;
      const int blk = row[i];
      if (blk < 0 || blk >= nblocks) return -1;
      const int t = blk * bs + (v - i * bs);
      return t < tail ? t : -1;
    }
    const int t = tail + (v - sel);
    return t < L ? t : -1;
  }
};

}  // namespace cuda
}  // namespace vegas
