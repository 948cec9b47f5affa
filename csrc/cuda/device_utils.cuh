// Device helpers shared by the vegas CUDA kernels: element types, conversions, warp
// shuffles, cp.async, ldmatrix and mma.sync wrappers.
//
// Raw pointers only, no torch includes. The kernel headers include this file and
// nothing CUDA-specific beyond it, so the same kernel source also compiles as host
// C++ against the software emulation in csrc/cuda/emu/emu_runtime.h (VEGAS_EMULATE):
// one std::thread per CUDA thread, real barriers for __syncthreads / warp ops, and
// mma/ldmatrix emulated element by element from the PTX ISA fragment layouts. That
// emulation is how the kernels' indexing and numerics were checked on a GPU-less
// machine; it is not a substitute for running them on hardware.
#pragma once

#include <cstdint>

#ifdef VEGAS_EMULATE
#include "cuda/emu/emu_runtime.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

namespace vegas {
namespace cuda {

#ifdef VEGAS_EMULATE
#define VEGAS_DEVICE inline
#define VEGAS_GLOBAL inline
#define VEGAS_LAUNCH_BOUNDS(n)
#define VEGAS_LAUNCH_BOUNDS2(n, m)
#define VEGAS_DYNAMIC_SMEM(name) unsigned char* name = ::vegas_emu::dynamic_smem()
using bf16_t = ::vegas_emu::bf16;
using half_t = ::vegas_emu::half;
#else
#define VEGAS_DEVICE __device__ __forceinline__
#define VEGAS_GLOBAL __global__
#define VEGAS_LAUNCH_BOUNDS(n) __launch_bounds__(n)
#define VEGAS_LAUNCH_BOUNDS2(n, m) __launch_bounds__(n, m)  // m: min. resident CTAs per SM
#define VEGAS_DYNAMIC_SMEM(name)                                  \
  extern __shared__ __align__(16) unsigned char vegas_smem_raw[]; \
  unsigned char* name = vegas_smem_raw
using bf16_t = __nv_bfloat16;
using half_t = __half;
#endif

constexpr float kNegInf = -__builtin_huge_valf();
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------
// conversions
// ---------------------------------------------------------------------------
VEGAS_DEVICE float to_float(float x) { return x; }
#ifdef VEGAS_EMULATE
VEGAS_DEVICE float to_float(bf16_t x) { return ::vegas_emu::bf16_to_float(x); }
VEGAS_DEVICE float to_float(half_t x) { return ::vegas_emu::half_to_float(x); }
#else
VEGAS_DEVICE float to_float(bf16_t x) { return __bfloat162float(x); }
VEGAS_DEVICE float to_float(half_t x) { return __half2float(x); }
#endif

template <typename T>
VEGAS_DEVICE T from_float(float x);
template <>
VEGAS_DEVICE float from_float<float>(float x) {
  return x;
}
#ifdef VEGAS_EMULATE
template <>
VEGAS_DEVICE bf16_t from_float<bf16_t>(float x) {
  return ::vegas_emu::float_to_bf16(x);
}
template <>
VEGAS_DEVICE half_t from_float<half_t>(float x) {
  return ::vegas_emu::float_to_half(x);
}
#else
template <>
VEGAS_DEVICE bf16_t from_float<bf16_t>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
VEGAS_DEVICE half_t from_float<half_t>(float x) {
  return __float2half_rn(x);
}
#endif

// Bits of a 16-bit element.
template <typename T>
VEGAS_DEVICE uint16_t bits16(T x) {
  static_assert(sizeof(T) == 2, "16-bit type expected");
  uint16_t u;
  __builtin_memcpy(&u, &x, 2);
  return u;
}

// Two floats rounded to T (16-bit), packed lo | hi << 16 (the mma fragment order). On the
// GPU one paired conversion (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32) instead of two.
template <typename T>
VEGAS_DEVICE uint32_t pack2(float lo, float hi);
#ifdef VEGAS_EMULATE
template <>
VEGAS_DEVICE uint32_t pack2<bf16_t>(float lo, float hi) {
  return uint32_t(bits16(from_float<bf16_t>(lo))) | (uint32_t(bits16(from_float<bf16_t>(hi))) << 16);
}
template <>
VEGAS_DEVICE uint32_t pack2<half_t>(float lo, float hi) {
  return uint32_t(bits16(from_float<half_t>(lo))) | (uint32_t(bits16(from_float<half_t>(hi))) << 16);
}
#else
template <>
VEGAS_DEVICE uint32_t pack2<bf16_t>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (low half), .y = hi
  uint32_t u;
  __builtin_memcpy(&u, &v, 4);
  return u;
}
template <>
VEGAS_DEVICE uint32_t pack2<half_t>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  uint32_t u;
  __builtin_memcpy(&u, &v, 4);
  return u;
}
#endif

// Two consecutive 16-bit elements of global memory, packed (2-byte loads: no alignment
// assumption beyond the element's).
template <typename T>
VEGAS_DEVICE uint32_t load_pair(const T* p) {
  return uint32_t(bits16(p[0])) | (uint32_t(bits16(p[1])) << 16);
}

VEGAS_DEVICE float fast_exp2(float x) {
#ifdef VEGAS_EMULATE
  return ::vegas_emu::exp2f_(x);
#else
  return exp2f(x);
#endif
}
VEGAS_DEVICE float fast_log2(float x) {
#ifdef VEGAS_EMULATE
  return ::vegas_emu::log2f_(x);
#else
  return log2f(x);
#endif
}

VEGAS_DEVICE float fmax_(float a, float b) { return a > b ? a : b; }

// ---------------------------------------------------------------------------
// synchronisation and warp collectives (full warps only)
// ---------------------------------------------------------------------------
VEGAS_DEVICE void block_sync() {
#ifdef VEGAS_EMULATE
  ::vegas_emu::syncthreads();
#else
  __syncthreads();
#endif
}
VEGAS_DEVICE void warp_sync() {
#ifdef VEGAS_EMULATE
  ::vegas_emu::syncwarp();
#else
  __syncwarp();
#endif
}
VEGAS_DEVICE float shfl_xor(float v, int mask) {
#ifdef VEGAS_EMULATE
  return ::vegas_emu::shfl_xor(v, mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}
VEGAS_DEVICE int shfl_up_int(int v, int delta) {
#ifdef VEGAS_EMULATE
  return ::vegas_emu::shfl_up(v, delta);
#else
  return __shfl_up_sync(0xffffffffu, v, delta);
#endif
}
VEGAS_DEVICE int shfl_int(int v, int src) {
#ifdef VEGAS_EMULATE
  return ::vegas_emu::shfl(v, src);
#else
  return __shfl_sync(0xffffffffu, v, src);
#endif
}
// Mask of the lanes whose v equals this lane's (all 32 lanes must call it).
VEGAS_DEVICE uint32_t match_any(int v) {
#ifdef VEGAS_EMULATE
  return ::vegas_emu::match_any(v);
#else
  return __match_any_sync(0xffffffffu, v);
#endif
}
// Mask of the lanes whose pred is true (all 32 lanes must call it).
VEGAS_DEVICE uint32_t ballot(bool pred) {
#ifdef VEGAS_EMULATE
  return ::vegas_emu::ballot(pred);
#else
  return __ballot_sync(0xffffffffu, pred);
#endif
}
#ifdef VEGAS_EMULATE
VEGAS_DEVICE int popc(uint32_t m) { return __builtin_popcount(m); }
VEGAS_DEVICE int lowest_lane(uint32_t m) { return __builtin_ctz(m); }  // m != 0
#else
VEGAS_DEVICE int popc(uint32_t m) { return __popc(m); }
VEGAS_DEVICE int lowest_lane(uint32_t m) { return __ffs(m) - 1; }  // m != 0
#endif
VEGAS_DEVICE void atomic_add_shared(int* p, int v) {
#ifdef VEGAS_EMULATE
  ::vegas_emu::atomic_add(p, v);
#else
  atomicAdd(p, v);
#endif
}

VEGAS_DEVICE int thread_x() {
#ifdef VEGAS_EMULATE
  return ::vegas_emu::tid().x;
#else
  return threadIdx.x;
#endif
}
VEGAS_DEVICE int block_dim_x() {
#ifdef VEGAS_EMULATE
  return ::vegas_emu::bdim().x;
#else
  return blockDim.x;
#endif
}
VEGAS_DEVICE int block_x() {
#ifdef VEGAS_EMULATE
  return ::vegas_emu::bid().x;
#else
  return blockIdx.x;
#endif
}
VEGAS_DEVICE int block_y() {
#ifdef VEGAS_EMULATE
  return ::vegas_emu::bid().y;
#else
  return blockIdx.y;
#endif
}
VEGAS_DEVICE int block_z() {
#ifdef VEGAS_EMULATE
  return ::vegas_emu::bid().z;
#else
  return blockIdx.z;
#endif
}
VEGAS_DEVICE int grid_x() {
#ifdef VEGAS_EMULATE
  return ::vegas_emu::gdim().x;
#else
  return gridDim.x;
#endif
}
VEGAS_DEVICE int grid_y() {
#ifdef VEGAS_EMULATE
  return ::vegas_emu::gdim().y;
#else
  return gridDim.y;
#endif
}

// ---------------------------------------------------------------------------
// cp.async (sm80+): 16-byte global -> shared copies, committed / waited in groups
// ---------------------------------------------------------------------------
VEGAS_DEVICE void cp_async16(void* smem, const void* gmem) {
#ifdef VEGAS_EMULATE
  if (reinterpret_cast<uintptr_t>(smem) % 16 || reinterpret_cast<uintptr_t>(gmem) % 16)
    ::vegas_emu::fail("cp.async address not 16-byte aligned");
  __builtin_memcpy(smem, gmem, 16);
#else
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
#endif
}
VEGAS_DEVICE void cp_async_commit() {
#ifndef VEGAS_EMULATE
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
VEGAS_DEVICE void cp_async_wait() {
#ifndef VEGAS_EMULATE
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}
VEGAS_DEVICE void store_zero16(void* smem) {
  uint32_t* p = static_cast<uint32_t*>(smem);
  p[0] = 0u;
  p[1] = 0u;
  p[2] = 0u;
  p[3] = 0u;
}

// ---------------------------------------------------------------------------
// ldmatrix (8x8 b16 matrices; lane i gives the address of row i % 8 of matrix i / 8)
// ---------------------------------------------------------------------------
VEGAS_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row_addr) {
#ifdef VEGAS_EMULATE
  ::vegas_emu::ldmatrix(r, 4, false, row_addr);
#else
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(row_addr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
#endif
}
VEGAS_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_addr) {
#ifdef VEGAS_EMULATE
  ::vegas_emu::ldmatrix(r, 4, true, row_addr);
#else
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(row_addr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
#endif
}

// ---------------------------------------------------------------------------
// mma.sync m16n8k16, fp32 accumulate: d += a (16x16, row) * b (16x8, col)
// Fragments (PTX ISA, g = lane / 4, t = lane % 4):
//   a[0]: (g, 2t..2t+1)  a[1]: (g+8, 2t..)  a[2]: (g, 2t+8..)  a[3]: (g+8, 2t+8..)
//   b[0]: (k = 2t..2t+1, n = g)            b[1]: (k = 2t+8.., n = g)
//   d[0..1]: (g, 2t..2t+1)                 d[2..3]: (g+8, 2t..2t+1)
// ---------------------------------------------------------------------------
template <typename T>
VEGAS_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
VEGAS_DEVICE void mma_16816<bf16_t>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
#ifdef VEGAS_EMULATE
  ::vegas_emu::mma_16816(d, a, b0, b1, /*is_bf16=*/true);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
template <>
VEGAS_DEVICE void mma_16816<half_t>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
#ifdef VEGAS_EMULATE
  ::vegas_emu::mma_16816(d, a, b0, b1, /*is_bf16=*/false);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

VEGAS_DEVICE int imin(int a, int b) { return a < b ? a : b; }
VEGAS_DEVICE int imax(int a, int b) { return a > b ? a : b; }
VEGAS_DEVICE int idiv_up(int a, int b) { return (a + b - 1) / b; }

}  // namespace cuda
}  // namespace vegas
