// Compiles the CPU main loop (attention_tile.h) twice -- baseline ISA and AVX2+FMA --
// and picks one at run time, so a wheel built anywhere runs everywhere and still uses
// 256-bit FMA where the processor has it.
#pragma once

#define VEGAS_ISA isa_base
#include "cpu/attention_tile.h"
#undef VEGAS_ISA

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define VEGAS_HAVE_AVX2_PATH 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define VEGAS_ISA isa_avx2
#include "cpu/attention_tile.h"
#undef VEGAS_ISA
#pragma GCC pop_options
#endif

namespace vegas {
namespace cpu {

inline bool use_avx2() {
#ifdef VEGAS_HAVE_AVX2_PATH
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

// Calls FN<T>::run(args...) from the fastest compiled ISA namespace.
#ifdef VEGAS_HAVE_AVX2_PATH
#define VEGAS_ISA_CALL(fn, ...)                 \
  (::vegas::cpu::use_avx2() ? ::vegas::cpu::isa_avx2::fn(__VA_ARGS__) \
                            : ::vegas::cpu::isa_base::fn(__VA_ARGS__))
#else
#define VEGAS_ISA_CALL(fn, ...) ::vegas::cpu::isa_base::fn(__VA_ARGS__)
#endif

// Split the tokens of each (batch, KV head) into this many parts so that short
// batches still keep every thread busy (flash-decoding style split-KV).
inline int64_t choose_num_splits(int64_t tasks, int64_t max_tokens, int64_t threads,
                                 int64_t min_split_tokens = 512) {
  if (tasks <= 0 || max_tokens <= 0) return 1;
  int64_t want = (4 * threads + tasks - 1) / tasks;
  int64_t cap = (max_tokens + min_split_tokens - 1) / min_split_tokens;
  return std::max<int64_t>(1, std::min(want, cap));
}

// Grain for at::parallel_for over `tasks` tasks of `work` row-tokens each: small problems
// (a draft step over a few hundred tokens) run on the calling thread, since a fork/join
// costs more than it saves there and, on a busy machine, a descheduled worker stalls the
// join (measured: a sparse draft call 0.5 ms single-threaded vs 15 ms with 2 threads on a
// loaded 2-core machine).
// `min_work` is the total below which one thread runs everything (default: 64K row-tokens,
// about 0.1 ms of attention work).
inline int64_t parallel_grain(int64_t tasks, int64_t work, int64_t min_work = int64_t(1) << 16) {
  return tasks * work < min_work ? std::max<int64_t>(tasks, 1) : 1;
}

}  // namespace cpu
}  // namespace vegas
