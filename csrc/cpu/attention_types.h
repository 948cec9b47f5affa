// Plain structs shared by the CPU attention main loop (attention_tile.h) and the
// op launchers. Raw pointers only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

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
  const float* q;       // [R, D] fp32 row-major: q[r * D + d] = scale * q_r[d] (the few-rows path)
};

// Scratch for one task (sizes for R rows, head_dim D).
struct Scratch {
  float* kt;     // [kTile, D]  K tile converted to fp32 (bf16 / fp16 caches only)
  float* vt;     // [kTile, D]  V tile converted to fp32 (bf16 / fp16 caches only)
  float* s;      // [kTile + 8, Rp]  scores, then probabilities (token-major)
  float* alpha;  // [Rp]  rescale factor of each row in the current tile
  int* nv;       // [R]   visible tokens of each row in the current tile
  float* acct;   // [D, Rp]  the output accumulator transposed (rows in lanes), where the ISA's
                 // P V micro-kernel keeps it so (see pv_t_block)
  static size_t floats(int R, int D) {
    return size_t(2) * D * kTile + size_t(kTile + 8) * row_pad_max(R) + row_pad_max(R) +
           size_t(D) * row_pad_max(R);
  }
};

// One thread's buffers for the tasks of a launcher: the task's query rows (fp32, scaled),
// their causal limits, and the main loop's scratch. Rp = the ISA's row_pad(R).
struct TaskBuffers {
  int R, Rp, D;
  std::vector<float> qf, qt, scratch;
  std::vector<float> row_lse, w, f;  // [Rp] each: a launcher's per-row finishing scratch
  std::vector<int32_t> pos;
  std::vector<int> nv;
  // clang-format off
  TaskBuffers(int R_, int Rp_, int D_)
      : R(R_), Rp(Rp_), D(D_), qf(size_t(R_) * D_), qt(size_t(D_) * Rp_),
        scratch(Scratch::floats(R_, D_), 0.f), row_lse(Rp_, 0.f), w(Rp_, 0.f), f(Rp_, 0.f), pos(Rp_, -1), nv(R_) {}
  // clang-format on
  // Rows r = i * group + hh of KV head g of batch row b: q [B, Q, Hq, D] (contiguous),
  // scaled into qf; row r may attend to tokens <= L - Q + i.
  template <typename T>
  void load_queries(const T* q, int64_t b, int64_t g, int64_t Q, int64_t group, int64_t Hq,
                    float scale, int64_t L) {
    for (int64_t i = 0; i < Q; ++i)
      for (int64_t hh = 0; hh < group; ++hh) {
        const int64_t r = i * group + hh;
        const T* src = q + ((b * Q + i) * Hq + g * group + hh) * D;
        for (int e = 0; e < D; ++e) qf[r * D + e] = static_cast<float>(src[e]) * scale;
        pos[r] = static_cast<int32_t>(L - Q + i);
      }
  }
  Rows rows() const { return Rows{R, D, qt.data(), pos.data(), qf.data()}; }
  Scratch ws() {
    float* sc = scratch.data();
    float* alpha = sc + 2 * D * kTile + (kTile + 8) * Rp;
    return Scratch{sc, sc + D * kTile, sc + 2 * D * kTile, alpha, nv.data(), alpha + Rp};
  }
};

// Optional per-row, per-block probability sums (verification's block scores).
// bsum[(j - block0) * R + r] holds, for row r, the sum over the visited tokens of block j
// of exp(s - m_ref), where m_ref = mt[tile * Rp + r] of the last tile that touched block j.
// Blocks are R floats apart (compact: the block sums are most of the kernel's writes at
// block size 1); the main loop writes whole Rp-lane vectors, so Rp - R floats past the
// last block are scratch too.
struct BlockSums {
  float* bsum;        // [nb, R] (+ Rp - R)
  int64_t block0;     // first block of this task
  int64_t block_size;
  float* mt;          // [ntiles, Rp] running max of each row after each tile
};

}  // namespace cpu
}  // namespace vegas
