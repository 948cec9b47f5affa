// CPU kernel of vegas::weight_only_linear: y = x . W^T (+ bias) for few rows of fp32
// activations against weights stored in fewer bytes -- fp16, or int8 with one fp32 scale per
// group of `group_size` weights along K (symmetric: w ~= q * scale) -- with fp32 accumulation.
// Vegas's draft forwards use it (python/vegas_ext/draft_weights.py): a decoding step streams
// every weight once, so reading 1-2 bytes per weight instead of 4 cuts the draft's linears.
// The main loop is torch-free (weight_only_linear_tile.h); this file checks the inputs and
// splits the output columns over threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/isa.h"

#define VEGAS_ISA isa_base
#define VEGAS_WOL_VW 0
#include "cpu/weight_only_linear_tile.h"
#undef VEGAS_WOL_VW
#undef VEGAS_ISA
#ifdef VEGAS_HAVE_X86_PATHS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define VEGAS_ISA isa_avx2
#define VEGAS_WOL_VW 8
#include "cpu/weight_only_linear_tile.h"
#undef VEGAS_WOL_VW
#undef VEGAS_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
#define VEGAS_ISA isa_avx512
#define VEGAS_WOL_VW 16
#include "cpu/weight_only_linear_tile.h"
#undef VEGAS_WOL_VW
#undef VEGAS_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512vnni,avx2,fma,f16c")
#define VEGAS_ISA isa_avx512vnni
#define VEGAS_WOL_VW 16
#define VEGAS_WOL_VNNI 1
#include "cpu/weight_only_linear_tile.h"
#undef VEGAS_WOL_VNNI
#undef VEGAS_WOL_VW
#undef VEGAS_ISA
#pragma GCC pop_options
#endif

namespace vegas {
namespace cpu {
namespace {

// Weight bytes per parallel task: a few hundred KB, so a small linear (a decoding step's
// k/v projection) stays on the calling thread, where a fork/join would cost more than it saves.
constexpr int64_t kTaskWeightBytes = int64_t(1) << 18;

// The packed int8 layout [ceil(N/16), ceil(K/2), 16, 2] (N from the scales): x rounded to int16 per
// (row, group) once, then threads split the 16-row blocks.
void packed_int8_linear(const float* xp, int64_t M, int64_t K, const at::Tensor& weight, const float* scp,
                        int64_t N, int64_t ng, int64_t group_size, const float* bp, float* yp) {
  const int64_t Kh = (K + 1) / 2, nb = ceil_div(N, int64_t(16));
  thread_local std::vector<int16_t> xq;  // the calling thread's; kept: ~200 calls per draft step
  thread_local std::vector<float> xs;
  xq.resize(M * 2 * Kh);
  xs.resize(M * ng);
  int16_t* qp = xq.data();
  float* sp = xs.data();
  VEGAS_ISA_CALL(wol::quantize_rows_i16, xp, M, K, group_size, qp, sp);
  const int8_t* wp = weight.data_ptr<int8_t>();
  const int64_t grain = std::max<int64_t>(2, (kTaskWeightBytes / std::max<int64_t>(1, 32 * Kh) + 1) / 2 * 2);
  at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
#ifdef VEGAS_HAVE_X86_PATHS
    if (cpu_avx512_vnni())
      return isa_avx512vnni::wol::packed_int8_blocks(qp, sp, M, K, wp, scp, ng, group_size, bp, yp, N, b0, b1);
#endif
    VEGAS_ISA_CALL(wol::packed_int8_blocks, qp, sp, M, K, wp, scp, ng, group_size, bp, yp, N, b0, b1);
  });
}

at::Tensor weight_only_linear_cpu(const at::Tensor& x, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& scales,
                                  const std::optional<at::Tensor>& bias, int64_t group_size) {
  const char* op = "vegas::weight_only_linear";
  const bool packed = weight.dim() == 4;
  TORCH_CHECK(weight.dim() == 2 || packed, op,
              ": weight must be 2-D [N, K] or packed int8 [ceil(N / 16), ceil(K / 2), 16, 2], got shape ",
              weight.sizes());
  TORCH_CHECK(!packed || weight.scalar_type() == at::kChar, op, ": a packed (4-D) weight must be int8, got ",
              weight.scalar_type());
  TORCH_CHECK(!packed || (scales.has_value() && scales->dim() == 2), op,
              ": a packed int8 weight needs scales [N, ceil(K / group_size)] float32 (N: the output size)");
  const int64_t N = packed ? scales->size(0) : weight.size(0);
  const int64_t K = packed ? (x.dim() >= 1 ? x.size(-1) : 0) : weight.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, op, ": x must have shape [..., K] with K = weight.size(1) = ",
              K, ", got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  const bool q8 = weight.scalar_type() == at::kChar;
  TORCH_CHECK(q8 || weight.scalar_type() == at::kHalf, op,
              ": weight must be float16 or int8, got ", weight.scalar_type());
  TORCH_CHECK(weight.is_contiguous(), op, ": weight must be contiguous");
  check_same_device(op, x, "x", weight, "weight");
  int64_t ng = 0;
  if (q8) {
    TORCH_CHECK(group_size >= 16 && group_size % 16 == 0, op,
                ": group_size must be a positive multiple of 16, got ", group_size);
    ng = ceil_div(K, group_size);
    TORCH_CHECK(scales.has_value(), op, ": scales [N, ceil(K / group_size)] = [", N, ", ", ng,
                "] float32 are required with an int8 weight");
    const at::Tensor& s = *scales;
    TORCH_CHECK(s.dim() == 2 && s.size(0) == N && s.size(1) == ng, op,
                ": scales must have shape [N, ceil(K / group_size)] = [", N, ", ", ng, "], got ",
                s.sizes());
    TORCH_CHECK(s.scalar_type() == at::kFloat, op, ": scales must be float32, got ", s.scalar_type());
    TORCH_CHECK(s.is_contiguous(), op, ": scales must be contiguous");
    check_same_device(op, x, "x", s, "scales");
    TORCH_CHECK(!packed || (weight.size(0) == ceil_div(N, int64_t(16)) && weight.size(1) == (K + 1) / 2 &&
                            weight.size(2) == 16 && weight.size(3) == 2),
                op, ": a packed int8 weight must have shape [ceil(N / 16), ceil(K / 2), 16, 2] = [",
                ceil_div(N, int64_t(16)), ", ", (K + 1) / 2, ", 16, 2] (N = scales.size(0), K = x.size(-1)), got ",
                weight.sizes());
  } else {
    TORCH_CHECK(!scales.has_value(), op, ": scales must be None with a float16 weight");
  }
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N, op, ": bias must have shape [N] = [", N, "], got ",
                b.sizes());
    TORCH_CHECK(b.scalar_type() == at::kFloat, op, ": bias must be float32, got ", b.scalar_type());
    check_same_device(op, x, "x", b, "bias");
  }

  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x.options());
  const int64_t M = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);  // rows
  if (M == 0 || N == 0) return y;
  const at::Tensor xc = x.contiguous();
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  const float* xp = xc.data_ptr<float>();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  const float* sp = q8 ? scales->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  if (packed) {
    packed_int8_linear(xp, M, K, weight, sp, N, ng, group_size, bp, yp);
    return y;
  }
  const int64_t row_bytes = std::max<int64_t>(1, K * weight.element_size());
  const int64_t grain = std::max<int64_t>(4, (kTaskWeightBytes / row_bytes + 3) / 4 * 4);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (q8)
      VEGAS_ISA_CALL(wol::weight_only_linear_cols<int8_t>, xp, M, K, weight.data_ptr<int8_t>(), sp, ng,
                     group_size, bp, yp, N, n0, n1);
    else
      VEGAS_ISA_CALL(wol::weight_only_linear_cols<uint16_t>, xp, M, K,
                     reinterpret_cast<const uint16_t*>(weight.data_ptr<at::Half>()), nullptr, 0, 1, bp,
                     yp, N, n0, n1);
  });
  return y;
}

}  // namespace
}  // namespace cpu
}  // namespace vegas

TORCH_LIBRARY_IMPL(vegas, CPU, m) {
  m.impl("weight_only_linear", &vegas::cpu::weight_only_linear_cpu);
}
