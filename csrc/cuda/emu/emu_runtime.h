// Software emulation of the small part of CUDA the vegas kernels use, so the kernel
// headers (csrc/cuda/*_kernel.cuh) can be compiled as host C++ (-DVEGAS_EMULATE) and
// checked against the PyTorch references on a machine without a GPU.
//
// Model: every CUDA thread of a CTA is a std::thread; __syncthreads is a std::barrier
// over the CTA, __syncwarp and every warp collective (shuffles, ldmatrix, mma.sync) a
// std::barrier over the 32 lanes with an exchange buffer, so divergent collectives
// deadlock here as they would misbehave on hardware. CTAs run one after another.
// mma.m16n8k16 and ldmatrix are computed element by element from the fragment layouts
// of the PTX ISA manual (independent of the kernels' own reading of them). Shared
// memory is filled with NaN bytes before each CTA so reads of unwritten data show up;
// cp.async and ldmatrix addresses are checked for 16-byte alignment.
//
// Limits: no memory model (cp.async completes at issue, so a missing wait is not
// caught), no timing, no register/occupancy limits; a pass here is evidence of correct
// indexing and numerics, not a replacement for a run on hardware.
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

namespace vegas_emu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct bf16 {
  uint16_t x;
};
struct half {
  uint16_t x;
};

inline float bf16_to_float(bf16 h) {
  const uint32_t u = uint32_t(h.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline bf16 float_to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return bf16{0x7fc0};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}
inline float half_to_float(half h) {
  _Float16 v;
  std::memcpy(&v, &h.x, 2);
  return float(v);
}
inline half float_to_half(float f) {
  const _Float16 v = static_cast<_Float16>(f);
  half h;
  std::memcpy(&h.x, &v, 2);
  return h;
}
inline float exp2f_(float x) { return std::exp2(x); }
inline float log2f_(float x) { return std::log2(x); }

// ---------------------------------------------------------------------------
// launch state
// ---------------------------------------------------------------------------
struct Cta {
  explicit Cta(int nthreads, size_t smem_bytes)
      : bar(nthreads), nwarps(nthreads / 32), smem(smem_bytes + 16, 0xFF) {
    for (int w = 0; w < nwarps; ++w) wbar.emplace_back(std::make_unique<std::barrier<>>(32));
    xch.resize(size_t(nwarps) * 32 * 16);
  }
  std::barrier<> bar;
  int nwarps;
  std::vector<std::unique_ptr<std::barrier<>>> wbar;
  std::vector<uint64_t> xch;  // [warp][lane][16]
  std::vector<unsigned char> smem;
};

struct ThreadCtx {
  Cta* cta = nullptr;
  Dim3 tid, bid;
  int lane = 0, warp = 0;
};

inline ThreadCtx& ctx() {
  static thread_local ThreadCtx c;
  return c;
}
inline Dim3& grid_dims() {
  static Dim3 d;
  return d;
}
inline Dim3& block_dims() {
  static Dim3 d;
  return d;
}
inline const Dim3& tid() { return ctx().tid; }
inline const Dim3& bid() { return ctx().bid; }
inline const Dim3& bdim() { return block_dims(); }
inline const Dim3& gdim() { return grid_dims(); }

inline unsigned char* dynamic_smem() {
  unsigned char* p = ctx().cta->smem.data();
  return p + ((16 - reinterpret_cast<uintptr_t>(p) % 16) % 16);
}

inline void syncthreads() { ctx().cta->bar.arrive_and_wait(); }
inline void syncwarp() { ctx().cta->wbar[ctx().warp]->arrive_and_wait(); }
inline uint64_t* xslot(int lane) {
  return ctx().cta->xch.data() + (size_t(ctx().warp) * 32 + lane) * 16;
}

template <class T>
inline T exchange(T v, int src) {
  static_assert(sizeof(T) <= 8, "");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  xslot(ctx().lane)[0] = u;
  syncwarp();
  const uint64_t w = xslot(src)[0];
  syncwarp();
  T r;
  std::memcpy(&r, &w, sizeof(T));
  return r;
}
inline float shfl_xor(float v, int mask) { return exchange(v, ctx().lane ^ mask); }
inline int shfl(int v, int src) { return exchange(v, src & 31); }
inline int shfl_up(int v, int delta) {
  const int src = ctx().lane - delta;
  const int r = exchange(v, src < 0 ? ctx().lane : src);
  return src < 0 ? v : r;
}
inline uint32_t match_any(int v) {
  xslot(ctx().lane)[0] = uint64_t(uint32_t(v));
  syncwarp();
  uint32_t m = 0;
  for (int l = 0; l < 32; ++l)
    if (uint32_t(xslot(l)[0]) == uint32_t(v)) m |= 1u << l;
  syncwarp();
  return m;
}
inline uint32_t ballot(bool pred) {
  xslot(ctx().lane)[0] = pred ? 1u : 0u;
  syncwarp();
  uint32_t m = 0;
  for (int l = 0; l < 32; ++l)
    if (xslot(l)[0] != 0) m |= 1u << l;
  syncwarp();
  return m;
}
inline int lane_id() { return ctx().lane; }
inline void atomic_add(int* p, int v) { std::atomic_ref<int>(*p).fetch_add(v); }

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "vegas_emu: %s\n", what);
  std::abort();
}

// ldmatrix .m8n8 .b16: lane i gives the address of row i % 8 of matrix i / 8.
// Non-transposed: lane l receives M[l / 4][2 (l % 4) + {0, 1}] of each matrix.
// Transposed:     lane l receives M[2 (l % 4) + {0, 1}][l / 4].
inline void ldmatrix(uint32_t* r, int nmat, bool trans, const void* addr) {
  if (reinterpret_cast<uintptr_t>(addr) % 16 != 0) fail("ldmatrix row address not 16-byte aligned");
  const int lane = ctx().lane;
  xslot(lane)[0] = reinterpret_cast<uintptr_t>(addr);
  syncwarp();
  const int g = lane >> 2, t = lane & 3;
  for (int m = 0; m < nmat; ++m) {
    uint16_t lo, hi;
    if (!trans) {
      const uint16_t* row = reinterpret_cast<const uint16_t*>(xslot(m * 8 + g)[0]);
      lo = row[2 * t];
      hi = row[2 * t + 1];
    } else {
      const uint16_t* r0 = reinterpret_cast<const uint16_t*>(xslot(m * 8 + 2 * t)[0]);
      const uint16_t* r1 = reinterpret_cast<const uint16_t*>(xslot(m * 8 + 2 * t + 1)[0]);
      lo = r0[g];
      hi = r1[g];
    }
    r[m] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
  syncwarp();
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: D = A (16x16) * B (16x8) + C, with the
// fragment layouts of the PTX ISA (g = lane / 4, t = lane % 4):
//   A: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B: b0 (k = 2t..2t+1, n = g), b1 (k = 2t+8.., n = g)
//   C/D: c0,c1 (g, 2t..2t+1), c2,c3 (g+8, 2t..2t+1)
inline float elem16(uint32_t word, int hi, bool is_bf16) {
  const uint16_t h = hi ? uint16_t(word >> 16) : uint16_t(word & 0xffffu);
  return is_bf16 ? bf16_to_float(bf16{h}) : half_to_float(half{h});
}
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                      bool is_bf16) {
  const int lane = ctx().lane;
  uint64_t* me = xslot(lane);
  for (int i = 0; i < 4; ++i) me[i] = a[i];
  me[4] = b0;
  me[5] = b1;
  syncwarp();
  float A[16][16], Bm[16][8];
  for (int l = 0; l < 32; ++l) {
    const uint64_t* x = xslot(l);
    const int g = l >> 2, t = l & 3;
    for (int e = 0; e < 2; ++e) {
      A[g][2 * t + e] = elem16(uint32_t(x[0]), e, is_bf16);
      A[g + 8][2 * t + e] = elem16(uint32_t(x[1]), e, is_bf16);
      A[g][2 * t + 8 + e] = elem16(uint32_t(x[2]), e, is_bf16);
      A[g + 8][2 * t + 8 + e] = elem16(uint32_t(x[3]), e, is_bf16);
      Bm[2 * t + e][g] = elem16(uint32_t(x[4]), e, is_bf16);
      Bm[2 * t + 8 + e][g] = elem16(uint32_t(x[5]), e, is_bf16);
    }
  }
  syncwarp();
  const int g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0);
    const int col = 2 * t + (i & 1);
    double acc = d[i];
    for (int k = 0; k < 16; ++k) acc += double(A[row][k]) * double(Bm[k][col]);
    d[i] = float(acc);
  }
}

// Runs kernel() once per thread of every CTA of the grid (CTAs one after another).
template <class F>
void launch(Dim3 grid, Dim3 block, size_t smem, F&& kernel) {
  const int nthreads = int(block.x * block.y * block.z);
  if (nthreads % 32 != 0) fail("block size must be a multiple of 32");
  grid_dims() = grid;
  block_dims() = block;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Cta cta(nthreads, smem);
        std::vector<std::thread> threads;
        threads.reserve(nthreads);
        for (int t = 0; t < nthreads; ++t) {
          threads.emplace_back([&, t] {
            ThreadCtx& c = ctx();
            c.cta = &cta;
            c.tid = Dim3{unsigned(t % block.x), unsigned((t / block.x) % block.y),
                         unsigned(t / (block.x * block.y))};
            c.bid = Dim3{bx, by, bz};
            c.lane = t & 31;
            c.warp = t >> 5;
            kernel();
            // an exited thread no longer takes part in barriers
            cta.wbar[c.warp]->arrive_and_drop();
            cta.bar.arrive_and_drop();
          });
        }
        for (auto& th : threads) th.join();
      }
}

}  // namespace vegas_emu
