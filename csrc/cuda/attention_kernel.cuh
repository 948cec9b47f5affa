// Split-KV attention main loops shared by vegas::verify_attention and
// vegas::sparse_draft_attention (raw pointers, no torch includes), plus the kernels that
// merge the splits. The work decomposition is described in attention_params.h.
//
// A "token map" (VerifyMap in verify_attention_kernel.cuh, DraftMap in
// sparse_draft_attention_kernel.cuh) turns a position of the virtual token sequence
// of one (batch, KV head) into a cache position, or -1 for a slot that holds no token.
// Interface:
//   void init(const AttnParams&, int b, int g);  int L;  (seq_len, clamped to [0, S])
//   int length() const;   int token(int v) const;   static constexpr bool kBlockScores;
// Values that could be out of range when the host-side value checks are skipped (the
// default on CUDA, and always under CUDA-graph capture) are clamped or masked there, so
// no kernel reads outside the cache; attn_merge_kernel / attn_slot_scores_kernel then poison
// (NaN) every output of a row whose seq_len (or tail_start) is out of range.
//
// Numerics: scores q.k accumulate in fp32 (fp16 inputs whose products pass 65504 stay
// finite), are multiplied by scale * log2(e) and kept in base 2; online softmax in fp32
// (FlashAttention-2, Dao 2023); the tensor-core path rounds the probabilities to the
// input type for the P.V product, as FlashAttention does.
//
// STATUS: compiled for sm80 / sm90 and checked with the software emulation in
// csrc/cuda/emu against the PyTorch reference; the main loops ran on an H200
// (bench/results/gpu_h200). The wave-filling split plan and attn_merge_kernel (which replaced
// attn_lse_kernel and the out part of attn_combine_kernel) are compiled for sm_90 and
// emulator-checked, not yet run on a GPU.
#pragma once

#include "cuda/attention_params.h"
#include "cuda/device_utils.cuh"

namespace vegas {
namespace cuda {

// ---------------------------------------------------------------------------
// Block-score slots of one 16-token step u (tokens [16u, 16u + 16)) of `nrows` rows:
// for each block overlapping the step, log2(sum over its tokens in the step of
// exp2(s - m)) + m, i.e. the log2-sum-exp of the block's scores there (-inf if none).
// pb: [nrows][kStep + 1] probabilities exp2(s - m_row) (0 where masked); mb: [nrows] m.
// Called by all 32 lanes of a warp.
// ---------------------------------------------------------------------------
VEGAS_DEVICE void write_block_slots(const AttnParams& p, const float* pb, const float* mb,
                                    int nrows, int row0, int bg, int u, int lane) {
  const int bs = p.block_size;
  const int t0 = u * kStep;
  const int blk0 = t0 / bs;
  const int nlb = (t0 + kStep - 1) / bs - blk0 + 1;  // <= p.spt
  for (int idx = lane; idx < nrows * nlb; idx += 32) {
    const int r = idx / nlb;
    const int lb = idx - r * nlb;
    const int row = row0 + r;
    if (row >= p.R) continue;
    const int64_t blk = int64_t(blk0) + lb;
    const int lo = static_cast<int>(blk * bs > t0 ? blk * bs - t0 : 0);
    const int64_t end = (blk + 1) * bs - t0;
    const int hi = end < kStep ? static_cast<int>(end) : kStep;
    float sum = 0.f;
    for (int t = lo; t < hi; ++t) sum += pb[r * (kStep + 1) + t];
    const float m = mb[r];
    p.slots[((int64_t(bg) * p.R + row) * p.nsub + u) * p.spt + lb] =
        sum > 0.f ? m + fast_log2(sum) : kNegInf;
  }
}

// ---------------------------------------------------------------------------
// The work of one CTA of the split-KV kernels: grid x = batch row * Hkv + KV head,
// y = split, z = row group. Initializes the token map of (b, g) and gives the split's
// range [vt0, vt1) of `tile`-token tiles of the virtual sequence (same formula as the
// host's split planning in ops_host.h: ceil(tiles / nsplit), at least min_tiles).
// ---------------------------------------------------------------------------
struct CtaWork {
  int bg, b, g, sp, z;
  int L, vlen, vt0, vt1;
};

template <class Map>
VEGAS_DEVICE CtaWork cta_work(const AttnParams& p, Map& map, int tile) {
  CtaWork w;
  w.bg = block_x();
  w.sp = block_y();
  w.z = block_z();
  w.b = w.bg / p.Hkv;
  w.g = w.bg - w.b * p.Hkv;
  map.init(p, w.b, w.g);
  w.L = map.L;
  w.vlen = map.length();
  const int nvt = idiv_up(w.vlen, tile);
  const int tps = imax(idiv_up(nvt, p.nsplit), p.min_tiles);
  w.vt0 = imin(nvt, w.sp * tps);
  w.vt1 = imin(nvt, w.vt0 + tps);
  return w;
}

// ---------------------------------------------------------------------------
// Tensor-core path (bf16 / fp16, D in {64, 80, 96, 128}; K/V rows 16-byte aligned).
// Warp = 16 query rows; per 16-token step: S = Q K^T with mma.m16n8k16 (Q fragments
// held in registers for the whole pass, K via ldmatrix), online softmax on the
// accumulator fragments, O += P V (P re-packed from the accumulators as the A operand,
// V via ldmatrix.trans). K/V tiles of 64 tokens are double-buffered with cp.async.
// ---------------------------------------------------------------------------
template <typename T, int D, class Map>
VEGAS_GLOBAL void VEGAS_LAUNCH_BOUNDS2(128, kAttnCtasPerSm) attn_mma_kernel(const AttnParams p) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16 on the tensor-core path");
  constexpr int TILE = kMmaTile;
  constexpr int LDS = D + 8;  // smem row stride (elements): 16-byte aligned, conflict-free
  constexpr int NKS = D / 16;
  constexpr int NDN = D / 8;
  constexpr int CH = D / 8;  // 16-byte chunks per token row

  VEGAS_DYNAMIC_SMEM(smem);
  const int tid = thread_x();
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int nthreads = block_dim_x();
  const int warps = p.rg * p.ns;
  T* kv_s = reinterpret_cast<T*>(smem);  // [stage][K|V][TILE][LDS]
  int* tok_s = reinterpret_cast<int*>(smem + size_t(2) * 2 * TILE * LDS * sizeof(T));  // [3][TILE]
  float* pbuf = reinterpret_cast<float*>(tok_s + 3 * TILE);  // [warps][16][kStep + 1]
  float* mbuf = pbuf + warps * 16 * (kStep + 1);               // [warps][16]

  Map map;
  const CtaWork w = cta_work(p, map, TILE);
  const int bg = w.bg, sp = w.sp, b = w.b, g = w.g, L = w.L, vlen = w.vlen, vt0 = w.vt0, vt1 = w.vt1;
  const int rgi = warp / p.ns;
  const int st = warp - rgi * p.ns;
  const int row0 = (w.z * p.rg + rgi) * 16;
  const bool warp_active = row0 < p.R;

  const int gq = lane >> 2, tq = lane & 3;
  const int rA = row0 + gq, rB = rA + 8;
  const bool okA = rA < p.R, okB = rB < p.R;
  const int posA = L - p.Q + (okA ? rA / p.G : 0);
  const int posB = L - p.Q + (okB ? rB / p.G : 0);

  // Q fragments (A operand), raw (unscaled) values.
  const T* qp = static_cast<const T*>(p.q);
  const T* qA = okA ? qp + ((int64_t(b) * p.Q + rA / p.G) * p.Hq + g * p.G + rA % p.G) * D : qp;
  const T* qB = okB ? qp + ((int64_t(b) * p.Q + rB / p.G) * p.Hq + g * p.G + rB % p.G) * D : qp;
  uint32_t qa[NKS][4];
#pragma unroll
  for (int ks = 0; ks < NKS; ++ks) {
    const int c = ks * 16 + 2 * tq;
    qa[ks][0] = okA ? load_pair(qA + c) : 0u;
    qa[ks][1] = okB ? load_pair(qB + c) : 0u;
    qa[ks][2] = okA ? load_pair(qA + c + 8) : 0u;
    qa[ks][3] = okB ? load_pair(qB + c + 8) : 0u;
  }

  float o[NDN][4];
#pragma unroll
  for (int dn = 0; dn < NDN; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
  float mA = kNegInf, mB = kNegInf, lA = 0.f, lB = 0.f;

  const T* kg = static_cast<const T*>(p.k) + int64_t(b) * p.k_sb + int64_t(g) * p.k_sh;
  const T* vg = static_cast<const T*>(p.v) + int64_t(b) * p.v_sb + int64_t(g) * p.v_sh;

  // The token list of tile vt is filled once (one map lookup per token, not per 16-byte
  // chunk) into buffer (vt - vt0) % 3, two tiles ahead of its use: the buffer of the
  // tile being computed and the one being issued are never the one being filled.
  auto fill_tokens = [&](int vt) {
    int* tb = tok_s + ((vt - vt0) % 3) * TILE;
    for (int r = tid; r < TILE; r += nthreads) tb[r] = map.token(vt * TILE + r);
  };
  auto issue = [&](int vt, int stage) {
    T* ks = kv_s + size_t(stage * 2 + 0) * TILE * LDS;
    T* vs = kv_s + size_t(stage * 2 + 1) * TILE * LDS;
    const int* tb = tok_s + ((vt - vt0) % 3) * TILE;
    for (int c = tid; c < TILE * CH; c += nthreads) {
      const int row = c / CH;
      const int ch = c - row * CH;
      const int tok = tb[row];
      if (tok >= 0) {
        cp_async16(ks + row * LDS + ch * 8, kg + int64_t(tok) * p.k_st + ch * 8);
        cp_async16(vs + row * LDS + ch * 8, vg + int64_t(tok) * p.v_st + ch * 8);
      } else {  // zero K and V: masked slots then contribute exactly 0 (never NaN)
        store_zero16(ks + row * LDS + ch * 8);
        store_zero16(vs + row * LDS + ch * 8);
      }
    }
    cp_async_commit();
  };

  if (vt0 < vt1) {  // uniform over the CTA
    fill_tokens(vt0);
    if (vt0 + 1 < vt1) fill_tokens(vt0 + 1);
    block_sync();
    issue(vt0, 0);
  }
  for (int vt = vt0; vt < vt1; ++vt) {
    const int stage = (vt - vt0) & 1;
    if (vt + 1 < vt1) {
      issue(vt + 1, stage ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    block_sync();
    if (warp_active) {
      const T* ks = kv_s + size_t(stage * 2 + 0) * TILE * LDS;
      const T* vs = kv_s + size_t(stage * 2 + 1) * TILE * LDS;
      const int* tk = tok_s + ((vt - vt0) % 3) * TILE;
      for (int q4 = st; q4 < TILE / kStep; q4 += p.ns) {
        const int base = q4 * kStep;
        if (vt * TILE + base >= vlen) break;  // warp-uniform
        // ---- S = Q K^T: 16 rows x 16 tokens (two n-tiles of 8 tokens)
        float s[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
        {
          const int mat = lane >> 3, r8 = lane & 7;
          // matrices: 0 = tokens 0-7 / dims +0, 1 = tokens 0-7 / dims +8,
          //           2 = tokens 8-15 / dims +0, 3 = tokens 8-15 / dims +8
          const T* kaddr = ks + (base + (mat >> 1) * 8 + r8) * LDS + (mat & 1) * 8;
#pragma unroll
          for (int kk = 0; kk < NKS; ++kk) {
            uint32_t kb[4];
            ldmatrix_x4(kb, kaddr + kk * 16);
            mma_16816<T>(s[0], qa[kk], kb[0], kb[1]);
            mma_16816<T>(s[1], qa[kk], kb[2], kb[3]);
          }
        }
        // ---- scale, mask, online softmax (rows gq and gq + 8 of the warp)
        float mxA = kNegInf, mxB = kNegInf;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int tok = tk[base + n * 8 + 2 * tq + (c & 1)];
            const bool up = c >= 2;
            const bool ok = (up ? okB : okA) && tok >= 0 && tok <= (up ? posB : posA);
            s[n][c] = ok ? s[n][c] * p.scale_log2 : kNegInf;
          }
          mxA = fmax_(mxA, fmax_(s[n][0], s[n][1]));
          mxB = fmax_(mxB, fmax_(s[n][2], s[n][3]));
        }
        mxA = fmax_(mxA, shfl_xor(mxA, 1));
        mxA = fmax_(mxA, shfl_xor(mxA, 2));
        mxB = fmax_(mxB, shfl_xor(mxB, 1));
        mxB = fmax_(mxB, shfl_xor(mxB, 2));
        const float mnA = fmax_(mA, mxA), mnB = fmax_(mB, mxB);
        const float alA = mnA == kNegInf ? 1.f : fast_exp2(mA - mnA);
        const float alB = mnB == kNegInf ? 1.f : fast_exp2(mB - mnB);
        float sumA = 0.f, sumB = 0.f;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          s[n][0] = s[n][0] == kNegInf ? 0.f : fast_exp2(s[n][0] - mnA);
          s[n][1] = s[n][1] == kNegInf ? 0.f : fast_exp2(s[n][1] - mnA);
          s[n][2] = s[n][2] == kNegInf ? 0.f : fast_exp2(s[n][2] - mnB);
          s[n][3] = s[n][3] == kNegInf ? 0.f : fast_exp2(s[n][3] - mnB);
          sumA += s[n][0] + s[n][1];
          sumB += s[n][2] + s[n][3];
        }
        lA = lA * alA + sumA;  // per-lane partial; the 4 lanes of a row are summed at the end
        lB = lB * alB + sumB;
        mA = mnA;
        mB = mnB;
#pragma unroll
        for (int dn = 0; dn < NDN; ++dn) {
          o[dn][0] *= alA;
          o[dn][1] *= alA;
          o[dn][2] *= alB;
          o[dn][3] *= alB;
        }
        // ---- O += P V: the S accumulators of the two n-tiles form the A operand
        uint32_t pa[4];
        pa[0] = pack2<T>(s[0][0], s[0][1]);
        pa[1] = pack2<T>(s[0][2], s[0][3]);
        pa[2] = pack2<T>(s[1][0], s[1][1]);
        pa[3] = pack2<T>(s[1][2], s[1][3]);
        {
          const int mat = lane >> 3, r8 = lane & 7;
          // matrices (transposed): 0 = tokens 0-7 / dims +0, 1 = tokens 8-15 / dims +0,
          //                        2 = tokens 0-7 / dims +8, 3 = tokens 8-15 / dims +8
          const T* vaddr = vs + (base + (mat & 1) * 8 + r8) * LDS + (mat >> 1) * 8;
#pragma unroll
          for (int dn = 0; dn < NDN; dn += 2) {
            uint32_t vb[4];
            ldmatrix_x4_trans(vb, vaddr + dn * 8);
            mma_16816<T>(o[dn], pa, vb[0], vb[1]);
            mma_16816<T>(o[dn + 1], pa, vb[2], vb[3]);
          }
        }
        // ---- block-score slots (fp32 probabilities, before rounding); p.slots is null
        // when the block scores come from the block-score pass instead (warp-uniform)
        if (Map::kBlockScores && p.slots != nullptr) {
          float* pb = pbuf + warp * 16 * (kStep + 1);
          float* mb = mbuf + warp * 16;
          const int c0 = 2 * tq;
          pb[gq * (kStep + 1) + c0] = s[0][0];
          pb[gq * (kStep + 1) + c0 + 1] = s[0][1];
          pb[gq * (kStep + 1) + 8 + c0] = s[1][0];
          pb[gq * (kStep + 1) + 8 + c0 + 1] = s[1][1];
          pb[(gq + 8) * (kStep + 1) + c0] = s[0][2];
          pb[(gq + 8) * (kStep + 1) + c0 + 1] = s[0][3];
          pb[(gq + 8) * (kStep + 1) + 8 + c0] = s[1][2];
          pb[(gq + 8) * (kStep + 1) + 8 + c0 + 1] = s[1][3];
          if (tq == 0) {
            mb[gq] = mA;
            mb[gq + 8] = mB;
          }
          warp_sync();
          write_block_slots(p, pb, mb, 16, row0, bg, (vt * TILE + base) / kStep, lane);
          warp_sync();
        }
      }
    }
    if (vt + 2 < vt1) fill_tokens(vt + 2);
    block_sync();  // the stage is refilled by the next iteration's issue
  }

  // ---- merge the streams of each row group in shared memory (warps st > 0 hand their
  // state to st == 0), then one partial per (split, row)
  if (warp_active) {
    lA += shfl_xor(lA, 1);
    lA += shfl_xor(lA, 2);
    lB += shfl_xor(lB, 1);
    lB += shfl_xor(lB, 2);
  }
  constexpr int LDX = D + 2;  // [m, l] after the D outputs
  float* xs = reinterpret_cast<float*>(smem);  // [warps][16][LDX], reuses the K/V stages
  block_sync();
  if (warp_active && st > 0) {
    float* mine = xs + warp * 16 * LDX;
    if (tq == 0) {
      mine[gq * LDX + D] = mA;
      mine[gq * LDX + D + 1] = lA;
      mine[(gq + 8) * LDX + D] = mB;
      mine[(gq + 8) * LDX + D + 1] = lB;
    }
#pragma unroll
    for (int dn = 0; dn < NDN; ++dn) {
      const int col = dn * 8 + 2 * tq;
      mine[gq * LDX + col] = o[dn][0];
      mine[gq * LDX + col + 1] = o[dn][1];
      mine[(gq + 8) * LDX + col] = o[dn][2];
      mine[(gq + 8) * LDX + col + 1] = o[dn][3];
    }
  }
  block_sync();
  if (warp_active && st == 0) {
    for (int so = 1; so < p.ns; ++so) {
      const float* ot = xs + (warp + so) * 16 * LDX;
      const float moA = ot[gq * LDX + D], loA = ot[gq * LDX + D + 1];
      const float moB = ot[(gq + 8) * LDX + D], loB = ot[(gq + 8) * LDX + D + 1];
      const float MA = fmax_(mA, moA), MB = fmax_(mB, moB);
      const float faA = MA == kNegInf ? 0.f : fast_exp2(mA - MA);
      const float foA = MA == kNegInf ? 0.f : fast_exp2(moA - MA);
      const float faB = MB == kNegInf ? 0.f : fast_exp2(mB - MB);
      const float foB = MB == kNegInf ? 0.f : fast_exp2(moB - MB);
      lA = lA * faA + loA * foA;
      lB = lB * faB + loB * foB;
      mA = MA;
      mB = MB;
#pragma unroll
      for (int dn = 0; dn < NDN; ++dn) {
        const int col = dn * 8 + 2 * tq;
        o[dn][0] = o[dn][0] * faA + ot[gq * LDX + col] * foA;
        o[dn][1] = o[dn][1] * faA + ot[gq * LDX + col + 1] * foA;
        o[dn][2] = o[dn][2] * faB + ot[(gq + 8) * LDX + col] * foB;
        o[dn][3] = o[dn][3] * faB + ot[(gq + 8) * LDX + col + 1] * foB;
      }
    }
    const int64_t ml = (int64_t(bg) * p.np + sp) * p.R;
    if (tq == 0) {
      if (okA) {
        p.part_m[ml + rA] = mA;
        p.part_l[ml + rA] = lA;
      }
      if (okB) {
        p.part_m[ml + rB] = mB;
        p.part_l[ml + rB] = lB;
      }
    }
#pragma unroll
    for (int dn = 0; dn < NDN; ++dn) {
      const int col = dn * 8 + 2 * tq;
      if (okA) {
        p.part_o[(ml + rA) * D + col] = o[dn][0];
        p.part_o[(ml + rA) * D + col + 1] = o[dn][1];
      }
      if (okB) {
        p.part_o[(ml + rB) * D + col] = o[dn][2];
        p.part_o[(ml + rB) * D + col + 1] = o[dn][3];
      }
    }
  }
}

// ---------------------------------------------------------------------------
// SIMT path: any dtype (fp32 included), any head_dim <= 256, any alignment (last dim
// contiguous). Warp = 8 query rows; per 16-token step, lane = (token t = lane % 16,
// half h = lane / 16 of the head dims) for Q.K^T, lane = head dims lane + 32k for P.V.
// Tiles are converted to fp32 in shared memory (single stage).
// ---------------------------------------------------------------------------
template <typename T, class Map>
VEGAS_GLOBAL void VEGAS_LAUNCH_BOUNDS2(128, kAttnCtasPerSm) attn_simt_kernel(const AttnParams p) {
  constexpr int RW = 8;   // rows per warp
  constexpr int DPL = 8;  // head dims per lane, max (D <= 256)
  constexpr int LDP = kStep + 1;
  const int D = p.D;
  const int LD = D + 2;
  const int tile = p.tile;

  VEGAS_DYNAMIC_SMEM(smem);
  const int tid = thread_x();
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int nthreads = block_dim_x();
  const int warps = p.rg * p.ns;
  float* Ks = reinterpret_cast<float*>(smem);  // [tile][LD]
  float* Vs = Ks + tile * LD;                  // [tile][LD]
  int* tok_s = reinterpret_cast<int*>(Vs + tile * LD);          // [tile]
  float* qs = reinterpret_cast<float*>(tok_s + tile);           // [rg * RW][D]
  float* pbuf = qs + p.rg * RW * D;                              // [warps][RW][LDP]
  float* mbuf = pbuf + warps * RW * LDP;                         // [warps][RW]

  Map map;
  const CtaWork w = cta_work(p, map, tile);
  const int bg = w.bg, sp = w.sp, b = w.b, g = w.g, L = w.L, vlen = w.vlen, vt0 = w.vt0, vt1 = w.vt1;
  const int rgi = warp / p.ns;
  const int st = warp - rgi * p.ns;
  const int cta_row0 = w.z * p.rg * RW;
  const int row0 = cta_row0 + rgi * RW;
  const bool warp_active = row0 < p.R;

  const T* qp = static_cast<const T*>(p.q);
  for (int e = tid; e < p.rg * RW * D; e += nthreads) {
    const int r = e / D;
    const int d = e - r * D;
    const int row = cta_row0 + r;
    float x = 0.f;
    if (row < p.R)
      x = to_float(qp[((int64_t(b) * p.Q + row / p.G) * p.Hq + g * p.G + row % p.G) * D + d]);
    qs[e] = x;
  }

  float m[RW], l[RW], acc[RW][DPL];
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    m[r] = kNegInf;
    l[r] = 0.f;
#pragma unroll
    for (int k = 0; k < DPL; ++k) acc[r][k] = 0.f;
  }

  const T* kg = static_cast<const T*>(p.k) + int64_t(b) * p.k_sb + int64_t(g) * p.k_sh;
  const T* vg = static_cast<const T*>(p.v) + int64_t(b) * p.v_sb + int64_t(g) * p.v_sh;
  const int t = lane & 15, h = lane >> 4;
  float* pb = pbuf + warp * RW * LDP;
  float* mb = mbuf + warp * RW;

  for (int vt = vt0; vt < vt1; ++vt) {
    for (int i = tid; i < tile; i += nthreads) tok_s[i] = map.token(vt * tile + i);
    block_sync();
    for (int e = tid; e < tile * D; e += nthreads) {
      const int r = e / D;
      const int d = e - r * D;
      const int tok = tok_s[r];
      float kx = 0.f, vx = 0.f;
      if (tok >= 0) {
        kx = to_float(kg[int64_t(tok) * p.k_st + d]);
        vx = to_float(vg[int64_t(tok) * p.v_st + d]);
      }
      Ks[r * LD + d] = kx;
      Vs[r * LD + d] = vx;
    }
    block_sync();
    if (warp_active) {
      for (int q4 = st; q4 < tile / kStep; q4 += p.ns) {
        const int base = q4 * kStep;
        if (vt * tile + base >= vlen) break;  // warp-uniform
        const int tok = tok_s[base + t];
        const float* kr = Ks + (base + t) * LD;
#pragma unroll
        for (int r = 0; r < RW; ++r) {
          const float* qr = qs + (rgi * RW + r) * D;
          float a = 0.f;
          for (int d = h; d < D; d += 2) a += qr[d] * kr[d];
          a += shfl_xor(a, 16);
          const int row = row0 + r;
          const int pos = L - p.Q + (row < p.R ? row / p.G : 0);
          float x = (row < p.R && tok >= 0 && tok <= pos) ? a * p.scale_log2 : kNegInf;
          float mx = x;
          mx = fmax_(mx, shfl_xor(mx, 1));
          mx = fmax_(mx, shfl_xor(mx, 2));
          mx = fmax_(mx, shfl_xor(mx, 4));
          mx = fmax_(mx, shfl_xor(mx, 8));
          const float mn = fmax_(m[r], mx);
          const float al = mn == kNegInf ? 1.f : fast_exp2(m[r] - mn);
          const float pr = x == kNegInf ? 0.f : fast_exp2(x - mn);
          float sum = pr;
          sum += shfl_xor(sum, 1);
          sum += shfl_xor(sum, 2);
          sum += shfl_xor(sum, 4);
          sum += shfl_xor(sum, 8);
          l[r] = l[r] * al + sum;
          m[r] = mn;
#pragma unroll
          for (int k = 0; k < DPL; ++k) acc[r][k] *= al;
          if (h == 0) pb[r * LDP + t] = pr;
          if (lane == 0) mb[r] = mn;
        }
        warp_sync();
        for (int tt = 0; tt < kStep; ++tt) {
          const float* vr = Vs + (base + tt) * LD;
#pragma unroll
          for (int k = 0; k < DPL; ++k) {
            const int d = lane + 32 * k;
            if (d < D) {
              const float vd = vr[d];
#pragma unroll
              for (int r = 0; r < RW; ++r) acc[r][k] += pb[r * LDP + tt] * vd;
            }
          }
        }
        if (Map::kBlockScores && p.slots != nullptr)
          write_block_slots(p, pb, mb, RW, row0, bg, (vt * tile + base) / kStep, lane);
        warp_sync();
      }
    }
    block_sync();
  }

  // ---- merge the streams of each row group in shared memory, one partial per split
  const int LDX = D + 2;
  float* xs = reinterpret_cast<float*>(smem);  // [warps][RW][LDX], reuses the K/V tile
  block_sync();
  if (warp_active && st > 0) {
    float* mine = xs + warp * RW * LDX;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      if (lane == 0) {
        mine[r * LDX + D] = m[r];
        mine[r * LDX + D + 1] = l[r];
      }
#pragma unroll
      for (int k = 0; k < DPL; ++k) {
        const int d = lane + 32 * k;
        if (d < D) mine[r * LDX + d] = acc[r][k];
      }
    }
  }
  block_sync();
  if (warp_active && st == 0) {
    for (int so = 1; so < p.ns; ++so) {
      const float* ot = xs + (warp + so) * RW * LDX;
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        const float mo = ot[r * LDX + D], lo = ot[r * LDX + D + 1];
        const float M = fmax_(m[r], mo);
        const float fa = M == kNegInf ? 0.f : fast_exp2(m[r] - M);
        const float fo = M == kNegInf ? 0.f : fast_exp2(mo - M);
        l[r] = l[r] * fa + lo * fo;
        m[r] = M;
#pragma unroll
        for (int k = 0; k < DPL; ++k) {
          const int d = lane + 32 * k;
          if (d < D) acc[r][k] = acc[r][k] * fa + ot[r * LDX + d] * fo;
        }
      }
    }
    const int64_t ml = (int64_t(bg) * p.np + sp) * p.R;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      const int row = row0 + r;
      if (row >= p.R) continue;
      if (lane == 0) {
        p.part_m[ml + row] = m[r];
        p.part_l[ml + row] = l[r];
      }
#pragma unroll
      for (int k = 0; k < DPL; ++k) {
        const int d = lane + 32 * k;
        if (d < D) p.part_o[(ml + row) * D + d] = acc[r][k];
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Merge of the partials. attn_merge_kernel: one warp per query row r of a (batch row, KV
// head) bg; lse2 = log2 sum_p l_p * 2^(m_p) with the lanes over the splits (written to the
// `lse2` workspace [B * Hkv, R], and as natural-log lse to c.lse when given), then
// out = sum_p o_p * 2^(m_p - lse2), the factors staged in shared memory so every partial
// is loaded unconditionally (D / 32 independent loads per split and lane in flight; the
// former one-thread-per-element loop waited on l_p before each load, np = 64 dependent L2
// round trips per element over 4 CTAs per bg at batch 1 -- the likely share of the H200's
// batch-1 gap, an estimate, not measured separately). attn_slot_scores_kernel (slots mode):
// block_scores[j] = sum over rows r of w(r) * sum over the steps u overlapping block j of
// 2^(slot[r, u, j] - lse2[r]).
// Device-side guard: a batch row whose seq_len lies outside [Q, S] (or whose tail_start
// lies outside [0, seq_len - Q], draft) gets NaN lse, out and block scores.
// ---------------------------------------------------------------------------
VEGAS_DEVICE bool row_values_bad(const CombineParams& c, int b) {
  const int len = c.seq_lens[b];
  bool bad = len < c.Q || len > c.S;
  if (c.tail_start) {
    const int ts = c.tail_start[b];
    bad = bad || ts < 0 || ts > len - c.Q;
  }
  return bad;
}

template <typename T>
VEGAS_GLOBAL void VEGAS_LAUNCH_BOUNDS(32 * kMergeRows) attn_merge_kernel(const CombineParams c,
                                                                         float* lse2) {
  constexpr int PPL = kMaxSplits / 32;  // partials per lane
  constexpr int DPL = 8;                // head dims per lane (D <= 256)
  VEGAS_DYNAMIC_SMEM(smem);
  const int lane = thread_x() & 31;
  const int warp = thread_x() >> 5;
  float* fac = reinterpret_cast<float*>(smem) + warp * c.np;  // [np] factors of this warp's row
  const int bg = block_x();
  const int b = bg / c.Hkv;
  const int g = bg - b * c.Hkv;
  const bool bad = row_values_bad(c, b);
  const int64_t qstride = int64_t(c.R);  // between the partials of one row
  T* out = static_cast<T*>(c.out);
  for (int r = block_y() * kMergeRows + warp; r < c.R; r += grid_y() * kMergeRows) {  // warp-uniform
    const int64_t ml = int64_t(bg) * c.np * c.R + r;
    // A split whose running sum is NaN (NaN or +inf among its scores) poisons the row, as in
    // the reference; splits that saw no token (l == 0) are skipped.
    float lv[PPL], mv[PPL];
    float M = kNegInf, flag = 0.f;
#pragma unroll
    for (int i = 0; i < PPL; ++i) {
      const int q = lane + 32 * i;
      lv[i] = 0.f;
      mv[i] = kNegInf;
      if (q < c.np) {
        lv[i] = c.part_l[ml + q * qstride];
        mv[i] = c.part_m[ml + q * qstride];
        if (lv[i] != lv[i] || mv[i] != mv[i] || lv[i] > 3.4e38f) flag = 1.f;
        if (lv[i] > 0.f) M = fmax_(M, mv[i]);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      M = fmax_(M, shfl_xor(M, o));
      flag = fmax_(flag, shfl_xor(flag, o));
    }
    float tot = 0.f;
#pragma unroll
    for (int i = 0; i < PPL; ++i)
      if (lv[i] > 0.f) tot += lv[i] * fast_exp2(mv[i] - M);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) tot += shfl_xor(tot, o);
    const float L2 = (flag > 0.f || bad) ? nanf("") : (tot > 0.f ? M + fast_log2(tot) : kNegInf);
    const int i = r / c.G;
    const int hq = g * c.G + (r - i * c.G);
    if (lane == 0) {
      lse2[int64_t(bg) * c.R + r] = L2;
      if (c.lse) c.lse[(int64_t(b) * c.Hq + hq) * c.Q + i] = L2 * kLn2;
    }
#pragma unroll
    for (int k = 0; k < PPL; ++k) {
      const int q = lane + 32 * k;
      if (q < c.np) fac[q] = lv[k] > 0.f ? fast_exp2(mv[k] - L2) : -1.f;  // -1: skipped split
    }
    warp_sync();
    float acc[DPL];
#pragma unroll
    for (int k = 0; k < DPL; ++k) acc[k] = 0.f;
    if (L2 == L2 && L2 != kNegInf) {  // warp-uniform
      const float* po = c.part_o + ml * c.D;
#pragma unroll 2
      for (int q = 0; q < c.np; ++q) {
        const float f = fac[q];
        const float* pq = po + q * qstride * c.D;
#pragma unroll
        for (int k = 0; k < DPL; ++k) {
          const int d = lane + 32 * k;
          if (d < c.D) {
            const float x = pq[d];
            acc[k] = f >= 0.f ? acc[k] + x * f : acc[k];
          }
        }
      }
    }
    T* orow = out + ((int64_t(b) * c.Q + i) * c.Hq + hq) * c.D;
#pragma unroll
    for (int k = 0; k < DPL; ++k) {
      const int d = lane + 32 * k;
      if (d < c.D) orow[d] = from_float<T>(L2 != L2 ? L2 : acc[k]);  // NaN row: NaN everywhere
    }
    warp_sync();  // fac is rewritten for the warp's next row
  }
}

static VEGAS_GLOBAL void VEGAS_LAUNCH_BOUNDS(256) attn_slot_scores_kernel(const CombineParams c,
                                                                          const float* lse2) {
  const int bg = block_x();
  const int chunk = block_y();
  const int nchunk = grid_y();
  const int tid = thread_x();
  const int nth = block_dim_x();
  const int b = bg / c.Hkv;
  const float* lrow = lse2 + int64_t(bg) * c.R;
  const int bs = c.block_size;
  const bool bad = row_values_bad(c, b);
  int L = c.seq_lens[b];
  L = L < 0 ? 0 : (L > c.S ? c.S : L);
  for (int64_t j = int64_t(chunk) * nth + tid; j < c.nblocks; j += int64_t(nchunk) * nth) {
    const int64_t tlo = j * bs;
    float score = 0.f;
    if (tlo < L) {
      const int64_t thi = (tlo + bs < L ? tlo + bs : L) - 1;
      const int64_t u0 = tlo / kStep, u1 = thi / kStep;
      for (int r = 0; r < c.R; ++r) {
        const float L2 = lrow[r];
        const float w = c.query_weights ? c.query_weights[r / c.G] : 1.f;
        if (L2 == kNegInf || w == 0.f) continue;
        const float* sr = c.slots + (int64_t(bg) * c.R + r) * c.nsub * c.spt;
        float a = 0.f;
        for (int64_t u = u0; u <= u1; ++u) {
          const int64_t lb = j - (u * kStep) / bs;
          a += fast_exp2(sr[u * c.spt + lb] - L2);
        }
        score += w * a;
      }
    }
    c.block_scores[int64_t(bg) * c.nblocks + j] = bad ? nanf("") : score;
  }
}

}  // namespace cuda
}  // namespace vegas
