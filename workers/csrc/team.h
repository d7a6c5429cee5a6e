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
// Reading ahead: a batch-1 step's loops depend on each other (a projection needs the previous
// one's output, and the serial ops between them: norms, rope, attention), so a helper that has
// no claim left in a loop used to wait for the next. Yet the next weight does not depend on
// anything: a loop may post, with itself, an offer for a later loop (its `key`, the first items
// and the bytes they read). A helper that runs out of claims takes the offer and reads those bytes
// into its own cache while the other threads finish the loop and run the serial ops; when the
// keyed loop is posted, its first items are that helper's (the claims start after them) and it
// runs them first, from its cache. If it has not begun them when the program's thread runs out
// of claims (descheduled, say), the program's thread runs them itself, so a taken offer costs no
// more waiting than a claim. An offer no loop takes is withdrawn at the program's end.
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

  // A read-ahead offer (see "Reading ahead" above): the first `items` items of the next loop
  // posted with this `key` read the `bytes` from `begin`.
  struct Ahead {
    const void* key = nullptr;
    int64_t items = 0;
    const char* begin = nullptr;
    int64_t bytes = 0;
  };

  // fn(lo, hi) over [0, n), claims of at least `grain` items, shrinking towards the end. Inside a
  // program, `key` names the loop for a read-ahead offer made by an earlier loop, and `next` (if
  // any) is this loop's offer for a later one.
  template <typename Fn>
  static void parallel_for(int64_t n, int64_t grain, const Fn& fn, const void* key = nullptr,
                           const Ahead* next = nullptr) {
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
    team->loop(n, std::max<int64_t>(grain, 1), fn, key, next);
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
  // An offer no loop took back is withdrawn (a helper holding it lets it go).
  void end() {
    offer_.store(kNone, std::memory_order_seq_cst);
    active_.store(false, std::memory_order_release);
  }

  // Run by the program's thread: publish the loop, take claims, wait until every item is done.
  template <typename Fn>
  void loop(int64_t n, int64_t grain, const Fn& fn, const void* key, const Ahead* next) {
    const int64_t unit = (n + static_cast<int64_t>(kMask) - 1) / static_cast<int64_t>(kMask);
    const uint64_t units = (n + unit - 1) / unit;
    // This loop's offer: untaken, it is withdrawn; taken, the first units are the taker's (it
    // has read them ahead), posted below; the claims start after them.
    uint64_t reserved_units = 0, reserved_seq = 0;
    int64_t reserved = 0;
    uint64_t offer = offer_.load(std::memory_order_seq_cst);
    const bool mine = key != nullptr && state(offer) != kNone && offer_key_.load(std::memory_order_relaxed) == key;
    if (mine) {
      if (state(offer) == kOpen && offer_.compare_exchange_strong(offer, kNone, std::memory_order_seq_cst)) offer = kNone;
      if (state(offer) == kTaken) {
        reserved_seq = offer >> kStateBits;
        reserved_units = std::min<uint64_t>(units / 2, (offer_items_.load(std::memory_order_relaxed) + unit - 1) / unit);
        reserved = std::min<int64_t>(n, static_cast<int64_t>(reserved_units) * unit);
      }
    }
    n_ = n;
    unit_ = unit;
    min_units_.store(static_cast<uint64_t>((grain + unit - 1) / unit), std::memory_order_relaxed);
    share_.store(static_cast<uint64_t>(2 * threads_), std::memory_order_relaxed);
    fn_ = &fn;
    call_ = [](const void* f, int64_t lo, int64_t hi) { (*static_cast<const Fn*>(f))(lo, hi); };
    done_.store(0, std::memory_order_relaxed);
    generation_ = (generation_ + 1) & ((uint64_t{1} << (64 - 2 * kBits)) - 1);
    word_.store((generation_ << (2 * kBits)) | (units << kBits) | reserved_units, std::memory_order_release);
    if (reserved_units > 0) {
      run_items_.store(reserved, std::memory_order_relaxed);
      run_.store((reserved_seq << kStateBits) | kPosted, std::memory_order_seq_cst);
    }
    if (mine) offer_.store(kNone, std::memory_order_seq_cst);  // taken and posted, or withdrawn
    if (next != nullptr && next->key != nullptr && next->items > 0) {
      if (state(offer_.load(std::memory_order_relaxed)) != kNone) offer_.store(kNone, std::memory_order_seq_cst);
      offer_key_.store(next->key, std::memory_order_relaxed);
      offer_items_.store(next->items, std::memory_order_relaxed);
      offer_begin_.store(next->begin, std::memory_order_relaxed);
      offer_bytes_.store(next->bytes, std::memory_order_relaxed);
      offer_.store((++offer_seq_ << kStateBits) | kOpen, std::memory_order_seq_cst);
    }
    while (take()) {
    }
    // The reserved units, if their taker has not begun them (it may be descheduled): run here.
    if (reserved_units > 0) {
      uint64_t posted = (reserved_seq << kStateBits) | kPosted;
      if (run_.compare_exchange_strong(posted, (reserved_seq << kStateBits) | kStolen, std::memory_order_seq_cst))
        run_claim(0, reserved);
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
        run_claim(static_cast<int64_t>(next) * unit_, std::min(n_, static_cast<int64_t>(next + size) * unit_));
        return true;
      }
    }
  }

  // Items [lo, hi) of the current loop, counted done (a claim's exception ends the program).
  void run_claim(int64_t lo, int64_t hi) {
    try {
      call_(fn_, lo, hi);
    } catch (...) {
      if (!error_flag_.exchange(true)) error_ = std::current_exception();
    }
    done_.fetch_add(hi - lo, std::memory_order_release);
  }

  // A helper that read ahead the first units of a loop runs them once the loop is posted (before
  // any claim: they are in its cache). `held` is the offer it holds (its sequence number; 0: none).
  bool run_reserved(uint64_t& held) {
    if (held == 0) return false;
    uint64_t r = run_.load(std::memory_order_seq_cst);
    if (r == ((held << kStateBits) | kPosted)) {
      const bool won = run_.compare_exchange_strong(r, (held << kStateBits) | kRunning, std::memory_order_seq_cst);
      held = 0;
      if (won) run_claim(0, run_items_.load(std::memory_order_relaxed));
      return won;
    }
    if ((r >> kStateBits) == held) {
      held = 0;  // the program's thread ran them
    } else if (offer_.load(std::memory_order_seq_cst) != ((held << kStateBits) | kTaken) &&
               (run_.load(std::memory_order_seq_cst) >> kStateBits) != held) {
      held = 0;  // withdrawn: no loop took it
    }
    return false;
  }

  // A helper with no claim to take: take an open offer and read its bytes into this core's cache,
  // a kilobyte at a time, until its loop is posted (or the offer is withdrawn). True if it did.
  bool take_offer(uint64_t& held) {
    if (held != 0) return false;
    uint64_t o = offer_.load(std::memory_order_seq_cst);
    if (state(o) != kOpen) return false;
    // Not while the loop posted with the offer has claims left (take() may have read the word
    // before that loop was posted; it is posted before its offer).
    const uint64_t w = word_.load(std::memory_order_seq_cst);
    if ((w & kMask) < ((w >> kBits) & kMask)) return false;
    const char* begin = offer_begin_.load(std::memory_order_relaxed);
    const int64_t bytes = offer_bytes_.load(std::memory_order_relaxed);
    const uint64_t taken = (o & ~kStateMask) | kTaken;
    if (!offer_.compare_exchange_strong(o, taken, std::memory_order_seq_cst)) return false;
    held = taken >> kStateBits;
    for (int64_t at = 0; at < bytes && offer_.load(std::memory_order_relaxed) == taken; at += kTouchBlock)
      touch(begin + at, std::min<int64_t>(kTouchBlock, bytes - at));
    return true;
  }

  // Reads [p, p + bytes) (whole 64-byte lines) so that it is in this core's cache.
  static void touch(const char* p, int64_t bytes) {
#if defined(__AVX512F__)
    __m512i acc = _mm512_setzero_si512();
    for (int64_t i = 0; i + 64 <= bytes; i += 64)
      acc = _mm512_or_si512(acc, _mm512_loadu_si512(reinterpret_cast<const void*>(p + i)));
    asm volatile("" : : "v"(acc));
#else
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
#endif
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
    uint64_t held = 0;  // the read-ahead offer this helper holds (its sequence number), 0: none
    for (int spins = 0;;) {
      const bool serving = index < participants_.load(std::memory_order_relaxed);
      if (serving && (run_reserved(held) || take() || take_offer(held))) {
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
  // read-ahead (offer_ and run_: [sequence number : 61 | state : 3]; the fields written before
  // an offer is opened, and read by a helper before it takes it)
  static constexpr int kStateBits = 3;
  static constexpr uint64_t kStateMask = (uint64_t{1} << kStateBits) - 1;
  static constexpr uint64_t kNone = 0, kOpen = 1, kTaken = 2;        // offer_
  static constexpr uint64_t kPosted = 3, kRunning = 4, kStolen = 5;  // run_
  static constexpr int64_t kTouchBlock = 1024;
  static uint64_t state(uint64_t word) { return word & kStateMask; }
  std::atomic<uint64_t> offer_{kNone}, run_{kNone};
  std::atomic<const void*> offer_key_{nullptr};
  std::atomic<const char*> offer_begin_{nullptr};
  std::atomic<int64_t> offer_items_{0}, offer_bytes_{0}, run_items_{0};
  uint64_t offer_seq_ = 0;  // offers made (the program's thread)
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
