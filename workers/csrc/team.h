// A parallel loop for the native ops that does not wait for a thread which holds no work, and a
// way to run a whole sequence of ops (a decoder layer) as ONE OpenMP parallel region.
//
// Why: a batch-1 decode step of a 231M model is ~60 matrix passes and as many small serial ops.
// With at::parallel_for each pass is its own parallel region: a fork, a static half of the work
// per thread, and a join that waits for the other thread to finish its half. On a machine shared
// with other jobs that thread is often descheduled for a time slice, and every join waits for it.
//
// Here the work of a loop is handed out in claims (runs of items) from one atomic word; whoever
// is free takes the next claim, and the loop is over when every item is done, not when every
// thread has checked in. A thread that never got to run simply takes no claim:
//
//   Team::run(program)        one region. The calling thread runs program(); the others serve
//                             its loops until it returns. Outside of a program:
//   Team::parallel_for(n, g, fn)   inside a program: post the loop to the team, take claims too,
//                             wait for the claimed ones; outside: a one-loop program.
//
//   claim word (64 bits):  [ generation : 24 | claims in this loop : 20 | next claim : 20 ]
//
// A claim is taken by compare-and-swap on the whole word, so a thread still holding the word of
// an earlier loop can never take a claim of the next one (its generation no longer matches).
// Which thread computes an item never changes what is computed: results are the same bits as a
// serial loop over the items.
//
// A loop whose items fit in one claim, one thread, or an enclosing parallel region (the caller is
// already a team or torch thread) runs inline, as at::parallel_for does.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace thinkserve {

class Team {
 public:
  template <typename Program>
  static void run(Program&& program) {
    const int threads = at::get_num_threads();
    if (threads <= 1 || at::in_parallel_region() || current_ != nullptr) {
      program();
      return;
    }
    Team team;
    team.threads_ = threads;
    std::exception_ptr error;
#pragma omp parallel num_threads(threads)
    {
      if (omp_get_thread_num() == 0) {
        current_ = &team;
        try {
          program();
        } catch (...) {
          error = std::current_exception();
        }
        current_ = nullptr;
        team.stop_.store(true, std::memory_order_release);
      } else {
        team.serve();
      }
    }
    if (error) std::rethrow_exception(error);
    if (team.error_) std::rethrow_exception(team.error_);
  }

  // fn(lo, hi) over [0, n), claims of at least `grain` items (at most 8 claims per thread).
  template <typename Fn>
  static void parallel_for(int64_t n, int64_t grain, const Fn& fn) {
    if (n <= 0) return;
    const int threads = current_ != nullptr ? current_->threads_ : at::get_num_threads();
    if (n <= std::max<int64_t>(grain, 1) || threads <= 1 || (current_ == nullptr && at::in_parallel_region())) {
      fn(0, n);
      return;
    }
    if (current_ == nullptr) {
      run([&] { parallel_for(n, grain, fn); });
      return;
    }
    current_->loop(n, std::max<int64_t>({grain, 1, n / (8 * threads)}), fn);
  }

 private:
  static constexpr int kBits = 20;
  static constexpr uint64_t kMask = (uint64_t{1} << kBits) - 1;

  // Run by the program's thread: publish the loop, take claims, wait until every item is done.
  template <typename Fn>
  void loop(int64_t n, int64_t per_claim, const Fn& fn) {
    while ((n + per_claim - 1) / per_claim > static_cast<int64_t>(kMask)) per_claim *= 2;
    const uint64_t claims = (n + per_claim - 1) / per_claim;
    n_ = n;
    per_claim_ = per_claim;
    fn_ = &fn;
    call_ = [](const void* f, int64_t lo, int64_t hi) { (*static_cast<const Fn*>(f))(lo, hi); };
    done_.store(0, std::memory_order_relaxed);
    generation_ = (generation_ + 1) & ((uint64_t{1} << (64 - 2 * kBits)) - 1);
    word_.store((generation_ << (2 * kBits)) | (claims << kBits), std::memory_order_release);
    while (take()) {
    }
    // Only claimed items are left: spin, never yield. Yielding here handed the core to another
    // job for a time slice (512 MiB one-row GEMM, 2 threads, load 10: 40 against 50 GB/s).
    while (done_.load(std::memory_order_acquire) < n) pause();
    if (error_) {  // a serving thread's exception ends the program
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

  // Take one claim of the current loop and run it; false when none is left.
  bool take() {
    uint64_t w = word_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t claims = (w >> kBits) & kMask, next = w & kMask;
      if (next >= claims) return false;
      if (word_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        // The loop cannot end (nor the next be posted) before this claim is counted done, so
        // its fields are this loop's.
        const int64_t lo = static_cast<int64_t>(next) * per_claim_, hi = std::min(n_, lo + per_claim_);
        try {
          call_(fn_, lo, hi);
        } catch (...) {
          if (!error_flag_.exchange(true)) error_ = std::current_exception();
        }
        done_.fetch_add(hi - lo, std::memory_order_release);
        return true;
      }
    }
  }

  void serve() {
    for (int spins = 0; !stop_.load(std::memory_order_acquire);) {
      if (take()) {
        spins = 0;
      } else {
        relax(spins++);
      }
    }
  }

  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#endif
  }

  // A serving thread with nothing to do spins a while (the program's serial ops between two loops
  // take microseconds), then gives its core away on each try: on a machine with more runnable
  // threads than cores, the program's thread may be waiting for this core.
  static void relax(int spins) {
    if (spins < kSpinsBeforeYield) {
      pause();
    } else {
      std::this_thread::yield();
    }
  }
  static constexpr int kSpinsBeforeYield = 1 << 14;

  std::atomic<uint64_t> word_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> error_flag_{false};
  std::exception_ptr error_;
  int threads_ = 1;
  uint64_t generation_ = 0;
  int64_t n_ = 0, per_claim_ = 1;
  const void* fn_ = nullptr;
  void (*call_)(const void*, int64_t, int64_t) = nullptr;

  static inline thread_local Team* current_ = nullptr;  // the team whose program this thread runs
};

}  // namespace thinkserve
