// Work-splitting policy of the CPU kernels (how many parts, when to stay on the calling
// thread); no vector code, so kernels that need only this do not build the main loop.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
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
// (a draft step over a few hundred tokens) run on the calling thread, since a fork/join
// costs more than it saves there and, on a busy machine, a descheduled worker stalls the
// join (measured: a sparse draft call 0.5 ms single-threaded vs 15 ms with 2 threads on a
// loaded 2-core machine).
// `min_work` is the total below which one thread runs everything (default: 64K row-tokens,
// about 0.1 ms of attention work).
inline int64_t parallel_grain(int64_t tasks, int64_t work, int64_t min_work = int64_t(1) << 16) {
  return tasks * work < min_work ? std::max<int64_t>(tasks, 1) : 1;
}

// A persistent helper-thread pool whose join never waits for a thread that has not
// started: the calling thread claims tasks from a shared counter too, and returns once every
// task is done -- waiting only for tasks a helper has already claimed. On a busy machine
// where the OS runs a helper late, the caller simply does that helper's share (a fork/join
// such as OpenMP's waits for every thread to arrive, measured at 10-30 ms per call on a
// loaded 2-core machine for a 3 ms kernel).
class TaskPool {
 public:
  // 0 on a calling thread, i + 1 on helper i.
  static int& slot() {
    thread_local int s = 0;
    return s;
  }

  static TaskPool& get() {
    static TaskPool* pool = new TaskPool();  // never destroyed: helpers outlive exit handlers
    return *pool;
  }

  // Runs body(task) for task in [0, ntasks) on the caller plus up to `helpers` helper threads.
  // Returns false (nothing run) when another call holds the pool.
  template <typename Body>
  bool run(int64_t ntasks, int helpers, Body& body) {
    std::unique_lock<std::mutex> busy(submit_, std::try_to_lock);
    if (!busy.owns_lock() || ntasks >= kMaxTasks) return false;
    ensure_helpers(helpers);
    const uint64_t gen = ((state_.load() >> 40) + 1) & 0xffffffu;
    body_.store(&body);
    call_.store(&invoke<Body>);
    done_.store(0);
    wanted_.store(helpers);
    {
      std::lock_guard<std::mutex> lk(m_);
      state_.store(gen << 40 | uint64_t(ntasks) << 20);  // generation, ntasks, next task 0
    }
    cv_.notify_all();
    int64_t mine = 0;
    for (int64_t t; (t = claim(gen)) >= 0; ++mine) body(t);
    done_.fetch_add(mine);
    while (done_.load() < ntasks) std::this_thread::yield();  // only claimed tasks remain
    return true;
  }

 private:
  template <typename Body>
  static void invoke(void* b, int64_t t) { (*static_cast<Body*>(b))(t); }

  static constexpr int64_t kMaxTasks = int64_t(1) << 20;

  // Next task of generation gen, or -1 when none is left or the generation has moved on.
  // The task count lives in the same word, so a claim never mixes two calls' jobs.
  int64_t claim(uint64_t gen) {
    uint64_t s = state_.load();
    for (;;) {
      const int64_t next = int64_t(s & 0xfffffu), n = int64_t((s >> 20) & 0xfffffu);
      if ((s >> 40) != gen || next >= n) return -1;
      if (state_.compare_exchange_weak(s, s + 1)) return next;
    }
  }

  void ensure_helpers(int n) {
    while (int(threads_.size()) < n) {
      const int id = int(threads_.size());
      threads_.emplace_back([this, id] { helper(id); });
      threads_.back().detach();
    }
  }

  void helper(int id) {
    slot() = id + 1;
    uint64_t seen = 0;
    for (;;) {
      uint64_t gen;
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return (state_.load() >> 40) != seen; });
        gen = state_.load() >> 40;
      }
      seen = gen;
      if (id >= wanted_.load()) continue;
      // Read the job, then claim: a successful claim proves that generation gen still had
      // tasks left, so the caller had not finished it -- nor begun writing the next job --
      // when the job was read; and the caller waits for every claimed task.
      void* b = body_.load();
      void (*call)(void*, int64_t) = call_.load();
      int64_t mine = 0;
      for (int64_t t; (t = claim(gen)) >= 0; ++mine) call(b, t);
      done_.fetch_add(mine);
    }
  }

  std::mutex submit_, m_;
  std::condition_variable cv_;
  std::atomic<uint64_t> state_{0};  // generation << 40 | ntasks << 20 | next task
  std::atomic<void*> body_{nullptr};
  std::atomic<void (*)(void*, int64_t)> call_{nullptr};
  std::atomic<int64_t> done_{0};
  std::atomic<int> wanted_{0};
  std::vector<std::thread> threads_;
};

// Runs fn(state, task) for task in [0, ntasks): on the calling thread alone when the
// total work (ntasks * work_per_task row-tokens) is below parallel_grain's threshold or one
// intra-op thread is set, else on the caller plus at::get_num_threads() - 1 TaskPool helpers
// pulling tasks from one counter. make() builds the scratch state of each thread that takes
// a task (on its first one).
template <typename Make, typename Fn>
void parallel_tasks(int64_t ntasks, int64_t work_per_task, Make make, Fn fn) {
  if (ntasks <= 0) return;
  using State = decltype(make());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), ntasks);
  if (threads > 1 && parallel_grain(ntasks, work_per_task) == 1 && !at::in_parallel_region() &&
      ntasks < (int64_t(1) << 31)) {
    std::vector<std::unique_ptr<State>> states(threads);  // slot 0: the caller; i: helper i - 1
    auto body = [&](int64_t t) {
      auto& st = states[TaskPool::slot()];
      if (!st) st = std::make_unique<State>(make());
      fn(*st, t);
    };
    if (TaskPool::get().run(ntasks, static_cast<int>(threads - 1), body)) return;
  }
  State st = make();
  for (int64_t t = 0; t < ntasks; ++t) fn(st, t);
}

}  // namespace cpu
}  // namespace vegas
