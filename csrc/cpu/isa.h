// Compiles the CPU main loop (attention_tile.h) three times -- baseline ISA (8-float
// vectors as SSE pairs), AVX2+FMA (8 floats, 16 registers) and AVX-512 (16 floats, 32
// registers) -- and picks one at run time, so a wheel built anywhere runs everywhere and
// still uses the widest FMA the processor has. VEGAS_CPU_ISA=base|avx2|avx512 (read
// once; avx512: without VNNI) forces a narrower path, e.g. to test it; a path the
// processor lacks is never used.
#pragma once

#include "cpu/parallel.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define VEGAS_HAVE_X86_PATHS 1
#include <immintrin.h>
#endif

#define VEGAS_ISA isa_base
#define VEGAS_VW 8
#define VEGAS_NREGS 16
#define VEGAS_F16C 0
#define VEGAS_X86_VEC 0
#include "cpu/attention_tile.h"
#undef VEGAS_ISA
#undef VEGAS_VW
#undef VEGAS_NREGS
#undef VEGAS_F16C
#undef VEGAS_X86_VEC

#ifdef VEGAS_HAVE_X86_PATHS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define VEGAS_ISA isa_avx2
#define VEGAS_VW 8
#define VEGAS_NREGS 16
#define VEGAS_F16C 8
#define VEGAS_X86_VEC 8
#include "cpu/attention_tile.h"
#undef VEGAS_ISA
#undef VEGAS_VW
#undef VEGAS_NREGS
#undef VEGAS_F16C
#undef VEGAS_X86_VEC
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
#define VEGAS_ISA isa_avx512
#define VEGAS_VW 16
#define VEGAS_NREGS 32
#define VEGAS_F16C 16
#define VEGAS_X86_VEC 16
#include "cpu/attention_tile.h"
#undef VEGAS_ISA
#undef VEGAS_VW
#undef VEGAS_NREGS
#undef VEGAS_F16C
#undef VEGAS_X86_VEC
#pragma GCC pop_options
#endif

namespace vegas {
namespace cpu {

// clang-format off
enum class Isa { base = 0, avx2 = 1, avx512 = 2 };
// clang-format on

// The widest path this processor runs, capped by VEGAS_CPU_ISA when set.
inline Isa cpu_isa() {
  static const Isa isa = [] {
    Isa best = Isa::base;
#ifdef VEGAS_HAVE_X86_PATHS
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::avx2;
    if (best == Isa::avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
      best = Isa::avx512;
#endif
    const char* env = std::getenv("VEGAS_CPU_ISA");
    Isa want = best;
    if (env && std::strcmp(env, "base") == 0) want = Isa::base;
    if (env && std::strcmp(env, "avx2") == 0) want = Isa::avx2;
    return static_cast<int>(want) < static_cast<int>(best) ? want : best;
  }();
  return isa;
}

inline const char* cpu_isa_name() {
  switch (cpu_isa()) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "base";
  }
}

// Whether the AVX-512 path may also use VNNI (vpdpwssd: weight_only_linear's packed int8 weights);
// VEGAS_CPU_ISA=avx512 keeps AVX-512 without it.
inline bool cpu_avx512_vnni() {
  static const bool vnni = [] {
#ifdef VEGAS_HAVE_X86_PATHS
    const char* env = std::getenv("VEGAS_CPU_ISA");
    return cpu_isa() == Isa::avx512 && __builtin_cpu_supports("avx512vnni") &&
           !(env && std::strcmp(env, "avx512") == 0);
#else
    return false;
#endif
  }();
  return vnni;
}

// Calls fn(args...) from the chosen ISA namespace.
#ifdef VEGAS_HAVE_X86_PATHS
#define VEGAS_ISA_CALL(fn, ...)                         \
  (::vegas::cpu::cpu_isa() == ::vegas::cpu::Isa::avx512 \
       ? ::vegas::cpu::isa_avx512::fn(__VA_ARGS__)      \
   : ::vegas::cpu::cpu_isa() == ::vegas::cpu::Isa::avx2 \
       ? ::vegas::cpu::isa_avx2::fn(__VA_ARGS__)        \
       : ::vegas::cpu::isa_base::fn(__VA_ARGS__))
#else
#define VEGAS_ISA_CALL(fn, ...) ::vegas::cpu::isa_base::fn(__VA_ARGS__)
#endif

}  // namespace cpu
}  // namespace vegas
