// Plain structs shared by the CPU attention main loop (attention_tile.h) and the
// op launchers. Raw pointers only.
#pragma once

#include <cstddef>
#include <cstdint>

namespace vegas {
namespace cpu {

constexpr int kTile = 64;      // tokens per K/V tile
constexpr int kMaxLanes = 16;  // widest vector (AVX-512): rows are padded to at most this

// Rows padded to a multiple of the widest vector: an upper bound of every ISA's row_pad,
// used to size buffers.
inline int row_pad_max(int R) { return (R + kMaxLanes - 1) / kMaxLanes * kMaxLanes; }

// One task's query rows, packed for the main loop (Rp = the ISA's row_pad(R)).
struct Rows {
  int R;                // number of rows
  int D;                // head_dim
  const float* qt;      // [D, Rp] fp32: qt[d * Rp + r] = scale * q_r[d], 0 in padded lanes
  const int32_t* pos32; // [Rp] last token index each row may attend to (causal limit); -1 padded
};

// Scratch for one task (sizes for R rows, head_dim D).
struct Scratch {
  float* kt;     // [kTile, D]  K tile converted to fp32 (bf16 / fp16 caches only)
  float* vt;     // [kTile, D]  V tile converted to fp32 (bf16 / fp16 caches only)
  float* s;      // [kTile + 8, Rp]  scores, then probabilities (token-major)
  float* alpha;  // [Rp]  rescale factor of each row in the current tile
  int* nv;       // [R]   visible tokens of each row in the current tile
  static size_t floats(int R, int D) {
    return size_t(2) * D * kTile + size_t(kTile + 8) * row_pad_max(R) + row_pad_max(R);
  }
};

// Optional per-row, per-block probability sums (verification's block scores).
// bsum[(j - block0) * Rp + r] holds, for row r, the sum over the visited tokens of block j
// of exp(s - m_ref), where m_ref = mt[tile * Rp + r] of the last tile that touched block j.
struct BlockSums {
  float* bsum;        // [nb, Rp]
  int64_t block0;     // first block of this task
  int64_t block_size;
  float* mt;          // [ntiles, Rp] running max of each row after each tile
};

}  // namespace cpu
}  // namespace vegas
