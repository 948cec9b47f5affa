// Kernels of vegas::verify_attention (raw pointers, no torch includes): the shared
// split-KV main loops of attention_kernel.cuh over the token map below, then
// attn_merge_kernel merges the splits into out / lse. Block scores, by block size:
// * block_size >= 16: per-block partial log-sum-exps ("slots") kept in the main loop,
//   normalised by attn_slot_scores_kernel:
//     block_scores[b, g, j] = sum_r w(r) * sum_{steps u over block j} 2^(slot[r, u, j] - lse2_r)
// * block_size < 16: the block-score pass of block_scores_kernel.cuh, after the lse.
// No [Q, S] probability matrix is written. Source of the method: Vegas, arXiv 2602.07223.
//
// STATUS: compiled, emulator-checked (csrc/cuda/emu); ran on an H200 (bench/results/gpu_h200).
#pragma once

#include "cuda/attention_kernel.cuh"
#include "cuda/block_scores_kernel.cuh"

namespace vegas {
namespace cuda {

// Verification: the virtual token sequence is the cache itself, positions [0, seq_len).
struct VerifyMap {
  static constexpr bool kBlockScores = true;
  int L;
  VEGAS_DEVICE void init(const AttnParams& p, int b, int /*g*/) {
    const int len = p.seq_lens[b];
    L = len < 0 ? 0 : (len > p.S ? p.S : len);  // clamped: values are unchecked under graph capture
  }
  VEGAS_DEVICE int length() const { return L; }
  VEGAS_DEVICE int token(int v) const { return v < L ? v : -1; }
};

}  // namespace cuda
}  // namespace vegas
