// Parallel loops for the native ops on helper threads of our own that the caller never joins, and
// a way to run a whole sequence of ops (every layer of a decode step) as ONE program on them.
//
// Why: a batch-1 decode step of a 231M model is ~60 matrix passes and as many small serial ops.
// With at::parallel_for each pass is its own OpenMP region: a fork, a static half of the work per
// thread, and a join that waits for the other thread to finish its half. Running the step as one
// OpenMP region (this file's previous version) still ended in a join: on a machine shared with
// other jobs the other thread is often descheduled for a time slice, and the region's end waited
// for it to wake and check out (47% of the main thread's samples at batch 1 on 2 threads).
//
// Here the work of a loop is handed out in claims (runs of items) from one atomic word; whoever
// is free takes the next claim, and the loop is over when every item is done, not when every
// thread has checked in. The helpers are persistent threads of this file (threads - 1 of them,
// started on first use); a program never waits for one to arrive or to leave, only for a claim
// one has taken and not finished. A helper that never got to run took no claim and costs nothing:
//
//   Team::run(program)        the calling thread runs program(); the helpers serve its loops
//                             while it runs. Returns when program() does, whatever the helpers
//                             are doing (they spin a while for the next program, then sleep).
//   Team::parallel_for(n, g, fn)   inside a program: post the loop, take claims too, wait for
//                             the claimed ones; outside: a one-loop program.
//
//   claim word (64 bits):  [ generation : 32 | units in this loop : 16 | next unit : 16 ]
//
// (a unit is one item, or several when a loop has more than 65,535.) Claims shrink as the loop
// goes ("guided" self-scheduling): each takes a 2 × threads-th of the units left, never fewer than
// the loop's grain. The first claims are long runs (a thread's share of a weight matrix stays one
// front-to-back stream), the last ones short, so threads finish a loop within a short claim of
// each other. The previous scheme's fixed claims (an eighth of a thread's share, at least 1 MiB
// of weight for a one-row GEMM) could leave one thread idle for most of a claim at the end of
// each of a batch-1 step's ~60 matrix passes: the 58 matrices back to back took 1.09-1.29x the
// time of one long pass over as many bytes on 2 threads, 1.03-1.04x on one. With shrinking claims
// of single panels (gemm.cpp), the best 2-thread step of a 231M model fell from 26.4-27.0 to
// 24.0-24.2 ms in one hold at load 4 (medians within the load's noise).
//
// A claim is taken by compare-and-swap on the whole word, so a helper still holding the word of an
// earlier loop (or program) can never take a claim of the next one: its generation no longer
// matches. Which thread computes an item never changes what is computed: results are the same
// bits as a serial loop over the items, at any thread count.
//
// A loop whose items fit in one claim, one thread, an enclosing parallel region (the caller is a
// torch thread) or a helper's own claim runs inline on the calling thread. A program waits for
// another thread's program to end (they come from Python, under the GIL: never in practice).
//
// Fork: the helpers do not exist in a forked child (Ray forks workers), so the child drops the
// parent's team (it counts helpers and sleepers that are gone) and starts its own on first use.
// The parent's fork waits for a program in flight to end.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <mutex>
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
    if (threads <= 1 || current_ != nullptr || on_helper_ || at::in_parallel_region()) {
      program();
      return;
    }
    Team& team = instance();
    std::lock_guard<std::mutex> busy(team.run_mutex_);  // one program at a time (callers hold the GIL)
    team.begin(threads);
    current_ = &team;
    struct End {
      Team& team;
      ~End() {
        current_ = nullptr;
        team.end();
      }
    } end{team};
    program();
  }

  // fn(lo, hi) over [0, n), claims of at least `grain` items, shrinking towards the end.
  template <typename Fn>
  static void parallel_for(int64_t n, int64_t grain, const Fn& fn) {
    if (n <= 0) return;
    Team* team = current_;
    if (n <= std::max<int64_t>(grain, 1) || (team != nullptr && team->threads_ <= 1) ||
        (team == nullptr && (on_helper_ || at::get_num_threads() <= 1 || at::in_parallel_region()))) {
      fn(0, n);
      return;
    }
    if (team == nullptr) {
      run([&] { parallel_for(n, grain, fn); });
      return;
    }
    team->loop(n, std::max<int64_t>(grain, 1), fn);
  }

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr int kBits = 16;
  static constexpr uint64_t kMask = (uint64_t{1} << kBits) - 1;

  static Team& instance() {
    static std::once_flag once;
    std::call_once(once, [] {
      idle_spin_ = idle_spin_from_environment();  // a bad value throws, and the next call reads it again
      instance_ = new Team();  // never deleted: a helper may touch it until the process ends
      pthread_atfork(&before_fork, &after_fork_in_parent, &after_fork_in_child);
    });
    return *instance_;
  }

  // No program runs while the process forks.
  static void before_fork() { instance_->run_mutex_.lock(); }
  static void after_fork_in_parent() { instance_->run_mutex_.unlock(); }
  // The child has no helpers: a fresh team starts its own on first use. The old one is left as
  // it is (it counts helpers, and sleepers, that do not exist here).
  static void after_fork_in_child() { instance_ = new Team(); }

  // Run by the program's thread before the program: enough helpers, and wake the sleeping ones.
  void begin(int threads) {
    while (static_cast<int>(helpers_) < threads - 1) {
      try {
        std::thread(&Team::serve, this, static_cast<int>(helpers_)).detach();
      } catch (const std::system_error&) {
        break;  // no thread to be had: the program runs on those there are
      }
      ++helpers_;
    }
    threads_ = 1 + std::min(threads - 1, static_cast<int>(helpers_));
    participants_.store(threads_ - 1, std::memory_order_relaxed);
    active_.store(true, std::memory_order_seq_cst);
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    // A helper counts itself asleep before it reads the epoch it sleeps on: either it sees this
    // program's epoch, or this sees it asleep (both seq_cst) and wakes it.
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex(FUTEX_WAKE_PRIVATE, INT32_MAX);
  }

  // Run by the program's thread after the program: every loop is done, so no helper holds a
  // claim; nothing to wait for.
  void end() { active_.store(false, std::memory_order_release); }

  // Run by the program's thread: publish the loop, take claims, wait until every item is done.
  template <typename Fn>
  void loop(int64_t n, int64_t grain, const Fn& fn) {
    const int64_t unit = (n + static_cast<int64_t>(kMask) - 1) / static_cast<int64_t>(kMask);
    const uint64_t units = (n + unit - 1) / unit;
    n_ = n;
    unit_ = unit;
    min_units_.store(static_cast<uint64_t>((grain + unit - 1) / unit), std::memory_order_relaxed);
    share_.store(static_cast<uint64_t>(2 * threads_), std::memory_order_relaxed);
    fn_ = &fn;
    call_ = [](const void* f, int64_t lo, int64_t hi) { (*static_cast<const Fn*>(f))(lo, hi); };
    done_.store(0, std::memory_order_relaxed);
    generation_ = (generation_ + 1) & ((uint64_t{1} << (64 - 2 * kBits)) - 1);
    word_.store((generation_ << (2 * kBits)) | (units << kBits), std::memory_order_release);
    while (take()) {
    }
    // Only claimed items are left: spin, never yield. Yielding here handed the core to another
    // job for a time slice (512 MiB one-row GEMM, 2 threads, load 10: 40 against 50 GB/s).
    while (done_.load(std::memory_order_acquire) < n) pause();
    if (error_flag_.load(std::memory_order_acquire)) {  // a claim's exception ends the program
      auto e = error_;
      error_ = nullptr;
      error_flag_.store(false, std::memory_order_relaxed);
      std::rethrow_exception(e);
    }
  }

  // Take one claim of the current loop and run it; false when none is left.
  bool take() {
    uint64_t w = word_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t units = (w >> kBits) & kMask, next = w & kMask;
      if (next >= units) return false;
      // The sizes may be the next loop's if this one ended since w was read; then the exchange
      // fails (the word has moved on) and the claim is retried on the new word.
      const uint64_t left = units - next;
      const uint64_t size = std::min(left, std::max(min_units_.load(std::memory_order_relaxed),
                                                    left / share_.load(std::memory_order_relaxed)));
      if (word_.compare_exchange_weak(w, w + size, std::memory_order_acq_rel, std::memory_order_acquire)) {
        // The loop cannot end (nor the next be posted) before this claim is counted done, so
        // its fields are this loop's.
        const int64_t lo = static_cast<int64_t>(next) * unit_,
                      hi = std::min(n_, static_cast<int64_t>(next + size) * unit_);
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

  // A helper's life: take claims while programs run; between programs spin a while (the next
  // program, e.g. the LM head after the layers, often follows within microseconds), then sleep
  // until one begins. Helper `index` serves only programs of more than index + 1 threads.
  [[noreturn]] void serve(int index) {
    on_helper_ = true;  // a loop inside a claim runs on this thread
    char name[16];
    std::snprintf(name, sizeof name, "ts-team-%d", index);
    pthread_setname_np(pthread_self(), name);  // what top -H, py-spy and the tests see
    uint32_t seen = epoch_.load(std::memory_order_acquire);
    Clock::time_point idle_since = Clock::now();
    for (int spins = 0;;) {
      const bool serving = index < participants_.load(std::memory_order_relaxed);
      if (serving && take()) {
        spins = 0;
        continue;
      }
      const uint32_t epoch = epoch_.load(std::memory_order_acquire);
      if (serving && (epoch != seen || active_.load(std::memory_order_acquire))) {
        if (epoch != seen) spins = 0;
        seen = epoch;
        relax(spins++);  // in a program: its serial ops between two loops take microseconds
        idle_since = Clock::now();
        continue;
      }
      if (serving) {
        pause();
        if (++spins % 64 != 0 || Clock::now() - idle_since < idle_spin_) continue;
      }
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      for (;;) {
        const uint32_t now = epoch_.load(std::memory_order_seq_cst);
        if (now != seen && index < participants_.load(std::memory_order_relaxed)) break;
        futex(FUTEX_WAIT_PRIVATE, now);  // returns at once if a program has begun since
      }
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
      spins = 0;
    }
  }

  // The helpers sleep on the epoch word itself (a futex: no lock on either side).
  void futex(int op, uint32_t value) {
    static_assert(sizeof(epoch_) == sizeof(uint32_t), "the futex word is the epoch");
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&epoch_), op, value, nullptr, nullptr, 0);
  }

  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#endif
  }

  // A helper with nothing to do in a program spins a while, then gives its core away on each try:
  // on a machine with more runnable threads than cores, the program's thread may be waiting for
  // this core.
  static void relax(int spins) {
    if (spins < kSpinsBeforeYield) {
      pause();
    } else {
      std::this_thread::yield();
    }
  }
  static constexpr int kSpinsBeforeYield = 1 << 14;
  // How long a helper spins after a program before it sleeps. A woken helper often lands on the
  // core of the thread that woke it for a while: batch-1 steps on 2 threads, 3 holds at load 2-7,
  // 1.30-1.35x of the read floor spinning 200 us, 1.27x at 1 ms, 1.15-1.26x at 3 ms; but spinning
  // costs CPU the engine's own Python needs at larger batches (reasoner mix: 3,411-3,771 tok/CPU-s
  // at 200 us, 3,546 at 1 ms, 3,006-3,301 at 3 ms). THINKSERVE_TEAM_SPIN_US overrides it (0: sleep
  // at once), read when the first team starts.
  static constexpr std::chrono::microseconds kIdleSpin{1000};
  static std::chrono::microseconds idle_spin_from_environment() {
    const char* text = std::getenv("THINKSERVE_TEAM_SPIN_US");
    if (text == nullptr || *text == '\0') return kIdleSpin;
    char* end = nullptr;
    errno = 0;
    const long long us = std::strtoll(text, &end, 10);
    TORCH_CHECK(*end == '\0' && errno == 0 && us >= 0 && us <= 1000000,
                "THINKSERVE_TEAM_SPIN_US must be a whole number of microseconds in [0, 1000000], got '", text, "'");
    return std::chrono::microseconds(us);
  }

  // the loop in progress (written by the program's thread, read under a claim)
  std::atomic<uint64_t> word_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<bool> error_flag_{false};
  std::exception_ptr error_;
  uint64_t generation_ = 0;
  int64_t n_ = 0, unit_ = 1;                      // items, and items per unit
  std::atomic<uint64_t> min_units_{1}, share_{2};  // a claim: max(min_units_, units left / share_)
  const void* fn_ = nullptr;
  void (*call_)(const void*, int64_t, int64_t) = nullptr;
  // the program in progress
  int threads_ = 1;                       // the program's thread and the helpers serving it
  std::atomic<int> participants_{0};      // helpers that serve it
  std::atomic<bool> active_{false};
  std::atomic<uint32_t> epoch_{0};        // programs begun (wraps)
  std::mutex run_mutex_;                  // held while a program runs
  // the helpers
  unsigned helpers_ = 0;                  // started (under run_mutex_)
  std::atomic<int> sleepers_{0};

  static inline Team* instance_ = nullptr;
  static inline std::chrono::microseconds idle_spin_{0};
  static inline thread_local Team* current_ = nullptr;  // the team whose program this thread runs
  static inline thread_local bool on_helper_ = false;      // a helper: its loops run inline
};

}  // namespace thinkserve
