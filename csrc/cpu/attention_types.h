// Plain structs shared by the CPU attention main loop (attention_tile.h) and the
// op launchers. Raw pointers only.
#pragma once

#include <cstddef>
#include <cstdint>

namespace vegas {
namespace cpu {

constexpr int kTile = 64;  // tokens per K/V tile

// One task's query rows.
struct Rows {
  int R;              // number of rows
  int D;              // head_dim
  const float* q;     // [R, D] fp32, already multiplied by the softmax scale
  const int64_t* pos; // [R] last token index each row may attend to (causal limit)
};

// Scratch for one task (sizes for R rows, head_dim D).
struct Scratch {
  float* kt;     // [kTile, D]  K tile converted to fp32 (bf16 / fp16 caches only)
  float* vt;     // [kTile, D]  V tile converted to fp32 (bf16 / fp16 caches only)
  float* s;      // [R, kTile]  scores, then probabilities
  int64_t* tok;  // [kTile]     token index of each tile column
  int32_t* bo;   // [kTile]     block of each tile column, relative to BlockSums::block0
  static size_t floats(int R, int D) { return size_t(2) * D * kTile + size_t(R) * kTile; }
};

// Optional per-row, per-block probability sums (verification's block scores).
// bsum[r, j - block0] holds sum over the tile-visited tokens of block j of
// exp(s - m_ref), where m_ref = mt[r, tile] of the last tile that touched block j.
struct BlockSums {
  float* bsum;        // [R, nb]
  int64_t nb;
  int64_t block0;     // first block of this task
  int64_t block_size;
  float* mt;          // [R, ntiles] running max of each row after each tile
  int64_t ntiles;
};

}  // namespace cpu
}  // namespace vegas
