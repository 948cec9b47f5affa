// Work-splitting policy of the CPU kernels (how many parts, when to stay on the calling
// thread); no vector code, so kernels that need only this do not build the main loop.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace vegas {
namespace cpu {

// Split the tokens of each (batch, KV head) into this many parts so that short batches
// still keep every thread busy (flash-decoding style split-KV): at least 4 tasks per
// thread, and a task count that the threads share evenly where the length allows.
inline int64_t choose_num_splits(int64_t tasks, int64_t max_tokens, int64_t threads,
                                 int64_t min_split_tokens = 512) {
  if (tasks <= 0 || max_tokens <= 0) return 1;
  const int64_t cap = std::max<int64_t>(1, (max_tokens + min_split_tokens - 1) / min_split_tokens);
  int64_t want = std::min(cap, std::max<int64_t>(1, (4 * threads + tasks - 1) / tasks));
  for (int64_t w = want; w <= std::min(cap, 2 * want); ++w)
    if ((tasks * w) % threads == 0) return w;
  return want;
}

// Grain for at::parallel_for over `tasks` tasks of `work` row-tokens each: small problems
// run on the calling thread, since a fork/join costs more than it saves there and, on a busy
// machine, a descheduled worker stalls the join (measured: a sparse draft call 0.5 ms
// single-threaded vs 15 ms with 2 threads on a loaded 2-core machine; a draft call's gathered
// tokens now weigh kGatheredTokenWork: SmolLM2 at batch 1 forks from ~114 tokens per KV head).
// `min_work` is the total below which one thread runs everything (default: 64K row-tokens,
// about 0.1 ms of attention work over streamed tokens; gathered ones weigh kGatheredTokenWork).
inline int64_t parallel_grain(int64_t tasks, int64_t work, int64_t min_work = int64_t(1) << 16) {
  return tasks * work < min_work ? std::max<int64_t>(tasks, 1) : 1;
}

// What parallel_grain counts for one row-token whose K/V rows are gathered by index (a draft's
// selected blocks) instead of streamed: each row is a DRAM miss that no hardware prefetcher
// foresees (~18 ns per row-token on one Zen 4 thread, against the ~1.5 ns the threshold assumes).
// 64, not the ~12 of that ratio, is where the measured calls all fork: at SmolLM2's shapes, 8K,
// 30 layers' caches, on a Zen 4 VM with 2 threads, the op ran 1.15-1.66x faster forked at 32-410
// gathered tokens per KV head (batch 1 and 4, medians of 3 alternating rounds), while at 12 a
// batch-1 8K draft call (410 tokens) stayed on one thread. Above ~1K weighted row-tokens a draft
// call now forks, so on a loaded machine it can stall on a descheduled worker, as the linears
// around it already do. In the decode step: the int8 draft step 1.21x faster at 8K x 4, 1.13x at
// 8K x 1 (bench/results/draft_attention_threads_zen4/).
constexpr int64_t kGatheredTokenWork = 64;

// Runs fn(state, task) for task in [0, ntasks): on the calling thread alone when the
// total work (ntasks * work_per_task row-tokens) is below parallel_grain's threshold or one
// intra-op thread is set, else on ATen's intra-op (OpenMP) threads, each pulling tasks from
// one counter. Those are the threads torch's own ops (the model's linears) have just run on:
// a pool of our own had to wait for them to stop spinning, and an attention call between two
// linears took up to 1.5x its time alone (bench/results/kernels_xeon_avx512/in_forward.md).
// make() builds the scratch state of each thread that takes a task (on its first one).
template <typename Make, typename Fn>
void parallel_tasks(int64_t ntasks, int64_t work_per_task, Make make, Fn fn) {
  if (ntasks <= 0) return;
  using State = decltype(make());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), ntasks);
  if (threads > 1 && parallel_grain(ntasks, work_per_task) == 1 && !at::in_parallel_region()) {
    std::atomic<int64_t> next{0};
    // `threads` slots at grain 1 start one range per thread; whichever range runs drains the
    // shared counter, so tasks go to whichever thread is free and the range bounds are unused
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      std::unique_ptr<State> st;
      for (int64_t t; (t = next.fetch_add(1)) < ntasks;) {
        if (!st) st = std::make_unique<State>(make());
        fn(*st, t);
      }
    });
    return;
  }
  State st = make();
  for (int64_t t = 0; t < ntasks; ++t) fn(st, t);
}

}  // namespace cpu
}  // namespace vegas
