// The threads of CompLL's C++ target: a pool whose idle threads sleep.
//
// Not OpenMP, for two reasons. OpenMP's idle threads spin for milliseconds after every
// parallel region (libgomp's default wait policy), on the cores the framework's backward
// pass needs; and its thread count is a per-thread setting, while the engine calls the
// kernels from threads of its own. Here the count is one number, set by hp_set_threads
// before every call (compll/parallelism.py chooses it), and a thread between regions spins
// only for a few microseconds before it sleeps on a condition variable. The pool and the
// count are statics of inline functions, which GCC makes unique in the process: every
// algorithm's library shares them.
#pragma once

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <utility>

namespace hp {

// Threads for the next regions: hp_set_threads's value, or the cores this process may run
// on when it was never set.
inline std::atomic<int>& thread_setting() {
  static std::atomic<int> n{0};
  return n;
}

inline int allowed_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

inline int team_size() {
  const int n = thread_setting().load(std::memory_order_relaxed);
  return n > 0 ? n : allowed_cores();
}

// Set while a thread runs its part of a region: a region inside it runs on that thread
// alone (as OpenMP's nested regions do by default).
inline thread_local bool in_team = false;

// Iterations [lo, hi) of n for thread t of nt: contiguous blocks, the first n % nt one
// longer (OpenMP's schedule(static)).
inline std::pair<int64_t, int64_t> static_range(int64_t n, int t, int nt) {
  const int64_t q = n / nt, r = n % nt;
  const int64_t lo = t * q + std::min<int64_t>(t, r);
  return {lo, lo + q + (t < r ? 1 : 0)};
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Pool {
 public:
  using Fn = void (*)(void*, int, int);

  // The process's pool. Never destroyed: its threads sleep until the process ends. A
  // child process after fork() has none of them and starts a pool of its own.
  static Pool& get() {
    static bool once = [] {
      pthread_atfork(nullptr, nullptr, [] { slot() = new Pool(); });
      return true;
    }();
    (void)once;
    return *slot();
  }

  // fn(ctx, t, nth) for t in [0, nth), t = 0 on the calling thread. False, with nothing
  // run, when another thread's region holds the pool (the caller then runs alone).
  bool run(int nth, Fn fn, void* ctx) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    grow(nth - 1);
    {
      std::lock_guard<std::mutex> lock(m_);
      fn_ = fn;
      ctx_ = ctx;
      nth_ = nth;
      pending_.store(nth - 1, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    in_team = true;
    fn(ctx, 0, nth);
    in_team = false;
    // The others finish about when the caller does: a short spin, then sleep.
    for (int i = 0; pending_.load(std::memory_order_acquire) != 0; ++i) {
      if (i < kSpin) {
        cpu_relax();
        continue;
      }
      std::unique_lock<std::mutex> lock(m_);
      done_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
      break;
    }
    return true;
  }

  // Worker threads started so far (the caller of a region is not one of them).
  int workers() const { return workers_.load(std::memory_order_relaxed); }

 private:
  // About 10-50 microseconds of pause instructions: long enough to catch the next pass of
  // the same kernel call, short enough that no core is held once the call returns.
  static constexpr int kSpin = 2048;

  static Pool*& slot() {
    static Pool* pool = new Pool();
    return pool;
  }

  // Start workers up to n, before the region is announced: each waits for the region after
  // the last one it could have seen.
  void grow(int n) {
    const uint64_t now = gen_.load(std::memory_order_relaxed);
    while (workers_.load(std::memory_order_relaxed) < n) {
      const int id = workers_.fetch_add(1, std::memory_order_relaxed) + 1;
      std::thread([this, id, now] { loop(id, now); }).detach();
    }
  }

  void loop(int id, uint64_t seen) {
    for (;;) {
      for (int i = 0; i < kSpin && gen_.load(std::memory_order_acquire) == seen; ++i)
        cpu_relax();
      Fn fn;
      void* ctx;
      int nth;
      {
        std::unique_lock<std::mutex> lock(m_);
        wake_.wait(lock, [&] { return gen_.load(std::memory_order_relaxed) != seen; });
        // The region's fields and its number together, under the lock that set them.
        seen = gen_.load(std::memory_order_relaxed);
        fn = fn_;
        ctx = ctx_;
        nth = nth_;
      }
      if (id >= nth) continue;
      in_team = true;
      fn(ctx, id, nth);
      in_team = false;
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(m_);
        done_.notify_all();
      }
    }
  }

  std::mutex busy_;  // one region at a time
  std::mutex m_;
  std::condition_variable wake_, done_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> workers_{0};
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  int nth_ = 1;
};

// f(t, nth) on a team of up to nth threads (fewer when nested, or when another thread's
// region holds the pool: then f(0, 1) on the caller).
template <class F>
void parallel(int nth, F&& f) {
  using G = std::remove_reference_t<F>;
  if (nth > 1 && !in_team &&
      Pool::get().run(nth, [](void* c, int t, int n) { (*static_cast<G*>(c))(t, n); }, &f))
    return;
  f(0, 1);
}

// body(i) for i in [0, n), in contiguous blocks over the team (when cond).
template <class Body>
void parallel_for(int64_t n, Body&& body, bool cond = true) {
  const int nth = cond ? (int)std::min<int64_t>(team_size(), n) : 1;
  parallel(nth, [&](int t, int nt) {
    const auto [lo, hi] = static_range(n, t, nt);
    for (int64_t i = lo; i < hi; ++i) body(i);
  });
}

// body(i) for i in [0, n), each thread taking the next index when it is free (for
// iterations of very different cost).
template <class Body>
void parallel_dynamic(int64_t n, Body&& body) {
  std::atomic<int64_t> next{0};
  parallel((int)std::min<int64_t>(team_size(), n), [&](int, int) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) body(i);
  });
}

}  // namespace hp
