// The threads of CompLL's C++ target: a pool whose idle threads sleep.
//
// Not OpenMP, for two reasons. OpenMP's idle threads spin for milliseconds after every
// parallel region (libgomp's default wait policy), on the cores the framework's backward
// pass needs; and its thread count is a per-thread setting, while the engine calls the
// kernels from threads of its own. Here the count is one number, set by hp_set_threads
// before every call (compll/parallelism.py chooses it), and a thread between regions spins
// only for a few microseconds before it sleeps on a condition variable. The pool and the
// count are statics of inline functions, which GCC makes unique in the process: every
// algorithm's library shares them. POSIX threads and GCC's atomic builtins, not <thread>,
// <mutex> and <atomic>: those headers cost every kernel build a third more time.
#pragma once

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <cstdint>
#include <type_traits>

namespace hp {

// Threads for the next regions: hp_set_threads's value (0: never set).
inline int& thread_setting() {
  static int n = 0;
  return n;
}

inline int allowed_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    return n > 0 ? n : 1;
  }
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

// The threads a region takes: the setting, or the cores this process may run on.
inline int team_size() {
  const int n = __atomic_load_n(&thread_setting(), __ATOMIC_RELAXED);
  return n > 0 ? n : allowed_cores();
}

// Set while a thread runs its part of a region: a region inside it runs on that thread
// alone (as OpenMP's nested regions do by default).
inline thread_local bool in_team = false;

// Iterations [first, last) of n for thread t of nt: contiguous blocks, the first n % nt
// one longer (OpenMP's schedule(static)).
struct Range {
  int64_t first, last;
};
inline Range static_range(int64_t n, int t, int nt) {
  const int64_t q = n / nt, r = n % nt;
  const int64_t first = t * q + (t < r ? t : r);
  return {first, first + q + (t < r ? 1 : 0)};
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A lock for the few critical sections of the runtime (the first failing item of a batch).
class Lock {
 public:
  Lock() { pthread_mutex_init(&m_, nullptr); }
  ~Lock() { pthread_mutex_destroy(&m_); }
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;
  void lock() { pthread_mutex_lock(&m_); }
  void unlock() { pthread_mutex_unlock(&m_); }

 private:
  pthread_mutex_t m_;
};

class Held {
 public:
  explicit Held(Lock& lock) : lock_(lock) { lock_.lock(); }
  ~Held() { lock_.unlock(); }
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;

 private:
  Lock& lock_;
};

class Pool {
 public:
  using Fn = void (*)(void*, int, int);

  // The process's pool. Never destroyed: its threads sleep until the process ends. A
  // child process after fork() has none of them and starts a pool of its own.
  static Pool& get() {
    static const bool once = [] {
      pthread_atfork(nullptr, nullptr, [] { slot() = new Pool(); });
      return true;
    }();
    (void)once;
    return *slot();
  }

  // fn(ctx, t, nth) for t in [0, nth), t = 0 on the calling thread. False, with nothing
  // run, when another thread's region holds the pool (the caller then runs alone).
  bool run(int nth, Fn fn, void* ctx) {
    if (pthread_mutex_trylock(&busy_) != 0) return false;
    grow(nth - 1);
    pthread_mutex_lock(&m_);
    fn_ = fn;
    ctx_ = ctx;
    nth_ = nth;
    __atomic_store_n(&pending_, nth - 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&gen_, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&wake_);
    pthread_mutex_unlock(&m_);
    in_team = true;
    fn(ctx, 0, nth);
    in_team = false;
    // The others finish about when the caller does: a short spin, then sleep.
    for (int i = 0; i < kSpin && __atomic_load_n(&pending_, __ATOMIC_ACQUIRE) != 0; ++i)
      cpu_relax();
    if (__atomic_load_n(&pending_, __ATOMIC_ACQUIRE) != 0) {
      pthread_mutex_lock(&m_);
      while (__atomic_load_n(&pending_, __ATOMIC_ACQUIRE) != 0) pthread_cond_wait(&done_, &m_);
      pthread_mutex_unlock(&m_);
    }
    pthread_mutex_unlock(&busy_);
    return true;
  }

  // Worker threads started so far (the caller of a region is not one of them).
  int workers() const { return __atomic_load_n(&workers_, __ATOMIC_RELAXED); }

 private:
  // About 10-50 microseconds of pause instructions: long enough to catch the next pass of
  // the same kernel call, short enough that no core is held once the call returns.
  static constexpr int kSpin = 2048;

  struct Start {
    Pool* pool;
    int id;
    uint64_t seen;
  };

  Pool() {
    pthread_mutex_init(&busy_, nullptr);
    pthread_mutex_init(&m_, nullptr);
    pthread_cond_init(&wake_, nullptr);
    pthread_cond_init(&done_, nullptr);
  }

  static Pool*& slot() {
    static Pool* pool = new Pool();
    return pool;
  }

  // Start workers up to n, before the region is announced: each waits for the region after
  // the last one it could have seen.
  void grow(int n) {
    const uint64_t now = __atomic_load_n(&gen_, __ATOMIC_RELAXED);
    while (workers() < n) {
      const int id = __atomic_add_fetch(&workers_, 1, __ATOMIC_RELAXED);
      pthread_attr_t attr;
      pthread_attr_init(&attr);
      pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
      pthread_t thread;
      pthread_create(&thread, &attr, &Pool::main, new Start{this, id, now});
      pthread_attr_destroy(&attr);
    }
  }

  static void* main(void* arg) {
    const Start start = *static_cast<Start*>(arg);
    delete static_cast<Start*>(arg);
    start.pool->loop(start.id, start.seen);
    return nullptr;
  }

  void loop(int id, uint64_t seen) {
    for (;;) {
      for (int i = 0; i < kSpin && __atomic_load_n(&gen_, __ATOMIC_ACQUIRE) == seen; ++i)
        cpu_relax();
      pthread_mutex_lock(&m_);
      while (__atomic_load_n(&gen_, __ATOMIC_RELAXED) == seen) pthread_cond_wait(&wake_, &m_);
      // The region's fields and its number together, under the lock that set them.
      seen = __atomic_load_n(&gen_, __ATOMIC_RELAXED);
      const Fn fn = fn_;
      void* const ctx = ctx_;
      const int nth = nth_;
      pthread_mutex_unlock(&m_);
      if (id >= nth) continue;
      in_team = true;
      fn(ctx, id, nth);
      in_team = false;
      if (__atomic_sub_fetch(&pending_, 1, __ATOMIC_ACQ_REL) == 0) {
        pthread_mutex_lock(&m_);
        pthread_cond_broadcast(&done_);
        pthread_mutex_unlock(&m_);
      }
    }
  }

  pthread_mutex_t busy_;  // one region at a time
  pthread_mutex_t m_;
  pthread_cond_t wake_, done_;
  uint64_t gen_ = 0;
  int pending_ = 0;
  int workers_ = 0;
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  int nth_ = 1;
};

// A region's body behind one function: the body is compiled once, called alone or by the
// team (inlined at both places, every kernel's build took a third longer).
template <class G>
__attribute__((noinline)) void trampoline(void* body, int t, int nt) {
  (*static_cast<G*>(body))(t, nt);
}

// f(t, nth) on a team of up to nth threads (fewer when nested, or when another thread's
// region holds the pool: then f(0, 1) on the caller).
template <class F>
void parallel(int nth, F&& f) {
  using G = typename std::remove_reference<F>::type;
  if (nth > 1 && !in_team && Pool::get().run(nth, &trampoline<G>, &f)) return;
  trampoline<G>(&f, 0, 1);
}

// body(i) for i in [0, n), in contiguous blocks over the team (when cond).
template <class Body>
void parallel_for(int64_t n, Body&& body, bool cond = true) {
  const int64_t most = cond ? team_size() : 1;
  parallel((int)(most < n ? most : n), [&](int t, int nt) {
    const Range r = static_range(n, t, nt);
    for (int64_t i = r.first; i < r.last; ++i) body(i);
  });
}

// body(i) for i in [0, n), each thread taking the next index when it is free (for
// iterations of very different cost).
template <class Body>
void parallel_dynamic(int64_t n, Body&& body) {
  int64_t next = 0;
  const int64_t most = team_size();
  parallel((int)(most < n ? most : n), [&](int, int) {
    for (int64_t i; (i = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED)) < n;) body(i);
  });
}

}  // namespace hp
