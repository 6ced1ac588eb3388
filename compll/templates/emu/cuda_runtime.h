// cuda-emu: the subset of CUDA that CompLL's generated kernels use, executed on the CPU.
//
// The CUDA target's own source and runtime headers (cuda_runtime.cuh, cuda_blocks.cuh,
// cuda_kernel.cu.j2) compile as host C++ against this header, which stands in for
// <cuda_runtime.h>:
//
// - __global__, __device__, __host__ and extended device lambdas are plain C++;
// - a launch (HP_LAUNCH, which is <<<grid, block, 0, stream>>> under nvcc) runs its
//   blocks one after another and each block's threads as fibers on the calling thread,
//   under a deterministic scheduler: a fiber runs until it exits or reaches
//   __syncthreads or __ballot_sync, and a barrier or a warp's vote releases once every
//   thread it concerns has arrived. __shared__ storage is shared by a block's fibers;
//   blockIdx, threadIdx and friends are the running fiber's;
// - a launch site whose first block met no barrier and no vote runs its threads as
//   plain calls from then on (a fiber costs some 30 ns a switch there and back);
// - cudaMalloc'd memory is host memory, filled with 0xFF bytes (a float NaN, an integer's
//   all ones) so that reads of memory nothing wrote show in the results; copies and
//   memsets are synchronous, streams are tokens;
// - faults a GPU would hide or hang on are errors of the launch, reported by
//   cudaGetLastError: a barrier reached by some of a block's threads while others exited
//   (or wait at another barrier), a vote naming a lane that exited, a block whose threads
//   all wait on something that never comes, an empty grid;
// - HIPRESS_EMU_ORDER=reverse runs blocks, and the threads between two barriers, in
//   reverse order: a kernel that reads what another thread writes without a barrier
//   between (a race) then computes something else, which differential tests catch.
//
// What it cannot show: nvcc's code generation, the real warp scheduler and memory model,
// asynchrony, resource limits and speed (docs/compll.md).
//
// -DHP_EMU_UNCHECKED builds the same scheduler without its checks (zeroed allocations,
// one order, every wait released, lenient votes and grids): what a naive emulator would
// do, so that tests can show each check is what catches its fault.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <atomic>
#include <memory>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

// Fibers switch by a few instructions on x86-64; elsewhere (or with -DHP_EMU_UCONTEXT)
// by ucontext's swapcontext, which also saves the signal mask by a system call.
#if !defined(HP_EMU_UCONTEXT) && !defined(__x86_64__)
#define HP_EMU_UCONTEXT 1
#endif
#ifdef HP_EMU_UCONTEXT
#include <ucontext.h>
#endif
// AddressSanitizer is told of every stack switch, so it checks the fibers' stacks too.
#if defined(__SANITIZE_ADDRESS__)
#define HP_EMU_ASAN 1
#include <sanitizer/common_interface_defs.h>
#endif

#define HP_CUDA_EMU 1
// Grid-stride launches get at most 64 blocks (the GPU build: half a million), so that
// their loops stride in tests of a few thousand elements and cover each thread's
// second and later elements; the results do not depend on the grid.
#define HP_GRID_CAP 64ull
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static thread_local  // a block's fibers share one OS thread's copy

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3() = default;
  dim3(unsigned a, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}  // NOLINT
};

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

typedef int cudaError_t;
typedef void* cudaStream_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2,
       cudaErrorLaunchFailure = 719, cudaErrorInvalidConfiguration = 9 };
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                      cudaMemcpyDeviceToDevice, cudaMemcpyDefault };

namespace hp_emu {

//: the last error and its text (cudaGetLastError returns and clears the code)
inline thread_local cudaError_t last_error = cudaSuccess;
inline thread_local char error_text[512] = {0};

inline void fail(cudaError_t code, const char* fmt, const char* a = "", unsigned long long b = 0,
                 unsigned long long c = 0) {
  if (last_error != cudaSuccess) return;  // the first fault of a call is the one to see
  last_error = code;
  std::snprintf(error_text, sizeof error_text, fmt, a, b, c);
}

#ifdef HP_EMU_UNCHECKED
constexpr bool kChecks = false;
#else
constexpr bool kChecks = true;
#endif

inline bool reverse_order() {
  const char* order = std::getenv("HIPRESS_EMU_ORDER");
  return kChecks && order != nullptr && std::strcmp(order, "reverse") == 0;
}

// ---- fibers --------------------------------------------------------------------------------

#ifdef HP_EMU_UCONTEXT
struct Context {
  ucontext_t uc;
  void* fake = nullptr;  // AddressSanitizer's state of this stack while switched away
  const void* bottom = nullptr;
  size_t size = 0;
};
#else
// Callee-saved registers and the stack pointer: a switch is a few instructions (ucontext's
// swapcontext makes a system call for the signal mask, 50 times as slow).
extern "C" void hp_emu_switch(void** save, void* load);
__asm__(R"(
  .pushsection .text
  .weak hp_emu_switch
  .type hp_emu_switch,@function
hp_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size hp_emu_switch, .-hp_emu_switch
  .popsection
)");
struct Context {
  void* sp = nullptr;
  void* fake = nullptr;  // AddressSanitizer's state of this stack while switched away
  const void* bottom = nullptr;
  size_t size = 0;
};
#endif

// A fiber's stack, mapped with a guard page below it so that an overflow faults at once
// instead of writing over a neighbour's stack.
class Stack {
 public:
  Stack() = default;
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  Stack(Stack&& o) noexcept { *this = std::move(o); }
  Stack& operator=(Stack&& o) noexcept {
    std::swap(base_, o.base_);
    std::swap(size_, o.size_);
    std::swap(page_, o.page_);
    return *this;
  }
  ~Stack() {
    if (base_ != nullptr) munmap(base_, size_);
  }
  bool empty() const { return base_ == nullptr; }
  void allocate(size_t usable) {
    const size_t page = page_ = (size_t)sysconf(_SC_PAGESIZE);
    size_ = usable + page;
    void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "cuda-emu: cannot map a fiber stack of %zu bytes\n", size_);
      std::abort();
    }
    mprotect(p, page, PROT_NONE);
    base_ = static_cast<unsigned char*>(p);
  }
  unsigned char* data() const { return base_ + page_; }
  size_t size() const { return size_ - page_; }

 private:
  unsigned char* base_ = nullptr;
  size_t size_ = 0, page_ = 0;
};

enum class State { Runnable, Barrier, Vote, Done };

struct Fiber {
  Context ctx;
  Stack stack;
  State state = State::Done;
  const char* site = nullptr;  // the barrier it waits at
  int line = 0;
  unsigned mask = 0;           // the vote's lanes
  bool vote = false;           // its predicate
  unsigned result = 0;         // the vote's outcome
};

struct Block {
  Context scheduler;
  std::vector<Fiber> fibers;
  int current = -1;
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
  bool synced = false;  // a barrier or a vote happened in this launch
};

// Each host thread's scheduler. A plain pointer, so that reading it is one load (a
// thread_local object with a constructor is reached through an initialization check);
// the owner frees it when its thread ends.
inline thread_local Block* block_ptr = nullptr;
inline Block& block_of_thread() {
  static thread_local std::unique_ptr<Block> owner;
  owner.reset(new Block());
  return *(block_ptr = owner.get());
}
inline Block& current_block() {
  Block* b = block_ptr;
  return b != nullptr ? *b : block_of_thread();
}
#ifdef HP_EMU_ASAN
constexpr size_t kStack = 512 * 1024;  // instrumented frames are several times larger
#else
constexpr size_t kStack = 64 * 1024;
#endif

// `from` is left (for good when `finished`), `to` resumed; when `from` runs again, the
// context that switched to it is `back` (its stack's bounds are learnt there).
inline void switch_to(Context& from, Context& to, Context* back, bool finished = false) {
#ifdef HP_EMU_ASAN
  __sanitizer_start_switch_fiber(finished ? nullptr : &from.fake, to.bottom, to.size);
#else
  (void)back;
  (void)finished;
#endif
#ifdef HP_EMU_UCONTEXT
  swapcontext(&from.uc, &to.uc);
#else
  hp_emu_switch(&from.sp, to.sp);
#endif
#ifdef HP_EMU_ASAN
  __sanitizer_finish_switch_fiber(from.fake, back ? &back->bottom : nullptr,
                                  back ? &back->size : nullptr);
#endif
}

inline void fiber_main() {
  Block& b = current_block();
#ifdef HP_EMU_ASAN
  // the first entry: finish the scheduler's switch here, learning its stack
  __sanitizer_finish_switch_fiber(nullptr, &b.scheduler.bottom, &b.scheduler.size);
#endif
  b.body(b.arg);
  b.fibers[(size_t)b.current].state = State::Done;
  switch_to(b.fibers[(size_t)b.current].ctx, b.scheduler, nullptr, true);
  std::abort();  // a finished fiber is never resumed
}

#ifndef HP_EMU_UCONTEXT
extern "C" inline void hp_emu_trampoline() { fiber_main(); }
#endif

// `color` staggers the stacks' tops: page-aligned tops all fall in one set of the L1
// cache, and 256 fibers taking turns would evict each other's frames at every switch.
inline void start_fiber(Fiber& f, size_t color) {
  if (f.stack.empty()) f.stack.allocate(kStack);
  f.ctx.bottom = f.stack.data();
  f.ctx.size = f.stack.size();
  f.ctx.fake = nullptr;
#ifdef HP_EMU_UCONTEXT
  getcontext(&f.ctx.uc);
  f.ctx.uc.uc_stack.ss_sp = f.stack.data();
  f.ctx.uc.uc_stack.ss_size = f.stack.size();
  f.ctx.uc.uc_link = nullptr;
  makecontext(&f.ctx.uc, fiber_main, 0);
#else
  uintptr_t top = reinterpret_cast<uintptr_t>(f.stack.data()) + f.stack.size() -
                  (color % 64) * 64;
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                                            // keeps the entry aligned
  *--sp = reinterpret_cast<void*>(&hp_emu_trampoline);        // where `ret` goes
  for (int k = 0; k < 6; ++k) *--sp = nullptr;                // rbp rbx r12 r13 r14 r15
  f.ctx.sp = sp;
#endif
  f.state = State::Runnable;
}

inline void resume(Block& b, int t) {
  b.current = t;
  threadIdx = dim3((unsigned)t);
  switch_to(b.scheduler, b.fibers[(size_t)t].ctx, nullptr);
}

// Called by a fiber: wait for the scheduler to release it.
inline void yield(Block& b) {
  switch_to(b.fibers[(size_t)b.current].ctx, b.scheduler, &b.scheduler);
}

inline bool in_fiber() { return current_block().current >= 0; }

// A warp's vote: every voting lane gets the predicates of the lanes its mask names.
inline void release_vote(Block& b, int w, int end) {
  unsigned bits = 0;
  for (int t = w; t < end; ++t) {
    const Fiber& f = b.fibers[(size_t)t];
    if (f.state == State::Vote && f.vote) bits |= 1u << (t - w);
  }
  for (int t = w; t < end; ++t) {
    Fiber& f = b.fibers[(size_t)t];
    if (f.state != State::Vote) continue;
    f.result = bits & f.mask;
    f.state = State::Runnable;
  }
}

// Releases a barrier every live thread reached, or the votes of warps whose named lanes
// have all voted; false when that is impossible (a fault, reported). Without checks
// everything waiting is released, as a lenient emulator would.
inline bool release(Block& b, const char* kernel) {
  const int n = (int)b.fibers.size();
  int live = 0, at_barrier = 0, voting = 0;
  const Fiber* first = nullptr;
  for (const Fiber& f : b.fibers) {
    if (f.state == State::Done) continue;
    ++live;
    if (f.state == State::Barrier) {
      ++at_barrier;
      if (first == nullptr) first = &f;
    }
    if (f.state == State::Vote) ++voting;
  }
  if (at_barrier > 0 && kChecks) {
    for (const Fiber& f : b.fibers) {
      if (f.state == State::Barrier && (f.line != first->line || f.site != first->site)) {
        fail(cudaErrorLaunchFailure,
             "cuda-emu: %s: threads of one block wait at two different barriers "
             "(lines %llu and %llu): divergent __syncthreads", kernel,
             (unsigned long long)first->line, (unsigned long long)f.line);
        return false;
      }
    }
    if (at_barrier == live && live < n) {
      fail(cudaErrorLaunchFailure,
           "cuda-emu: %s: %llu threads of a block wait at __syncthreads while %llu have "
           "exited: divergent barrier", kernel, (unsigned long long)at_barrier,
           (unsigned long long)(n - live));
      return false;
    }
  }
  if (at_barrier > 0 && at_barrier == live) {
    for (Fiber& f : b.fibers)
      if (f.state == State::Barrier) f.state = State::Runnable;
    return true;
  }
  bool released = false;
  for (int w = 0; voting > 0 && w < n; w += 32) {
    const int end = w + 32 < n ? w + 32 : n;
    unsigned named = 0;
    for (int t = w; t < end; ++t)
      if (b.fibers[(size_t)t].state == State::Vote) named |= b.fibers[(size_t)t].mask;
    if (named == 0) continue;
    bool all = true;
    for (int lane = 0; lane < 32; ++lane) {
      if (!(named >> lane & 1u)) continue;
      const int t = w + lane;
      const bool gone = t >= end || b.fibers[(size_t)t].state == State::Done;
      if (gone && kChecks) {
        fail(cudaErrorLaunchFailure,
             "cuda-emu: %s: __ballot_sync names lane %llu of warp %llu, which has exited "
             "(or does not exist)", kernel, (unsigned long long)lane,
             (unsigned long long)(w / 32));
        return false;
      }
      if (!gone && b.fibers[(size_t)t].state != State::Vote) all = false;
    }
    if (!all) continue;
    release_vote(b, w, end);
    released = true;
  }
  if (released) return true;
  if (!kChecks) {
    for (int w = 0; w < n; w += 32) release_vote(b, w, w + 32 < n ? w + 32 : n);
    for (Fiber& f : b.fibers)
      if (f.state == State::Barrier) f.state = State::Runnable;
    return true;
  }
  fail(cudaErrorLaunchFailure,
       "cuda-emu: %s: every live thread of a block waits (%llu at a barrier, %llu at a "
       "warp vote) and nothing can release them: deadlock", kernel,
       (unsigned long long)at_barrier, (unsigned long long)voting);
  return false;
}

// One block's threads as fibers: each round resumes every runnable thread (in order, or
// reversed) until it exits or waits, then releases what can be released.
inline bool run_fibers(Block& b, unsigned threads, bool reverse, const char* kernel) {
  b.fibers.resize(threads);
  for (size_t k = 0; k < b.fibers.size(); ++k) start_fiber(b.fibers[k], k);
  for (;;) {
    for (unsigned k = 0; k < threads; ++k) {
      const int t = reverse ? (int)(threads - 1 - k) : (int)k;
      if (b.fibers[(size_t)t].state == State::Runnable) resume(b, t);
    }
    bool done = true;
    for (const Fiber& f : b.fibers) done = done && f.state == State::Done;
    if (done) return true;
    if (!release(b, kernel)) return false;
  }
}

// A launch site's mode: 0 unknown (fibers, learning), 1 plain calls, 2 fibers. Several
// host threads may launch from one site.
struct Mode {
  std::atomic<int> value{0};
};

template <class Fn>
struct Launcher {
  dim3 grid, block;
  const char* kernel;
  Mode& mode;
  Fn fn;

  template <class... Args>
  void operator()(Args... args) const {  // arguments by value, as a launch copies them
    if (grid.x == 0 || block.x == 0 || grid.y != 1 || grid.z != 1 || block.y != 1 ||
        block.z != 1) {
      if (!kChecks) return;
      fail(cudaErrorInvalidConfiguration,
           "cuda-emu: %s: launched with a grid of %llu blocks of %llu threads (1-D, "
           "non-empty expected)", kernel, (unsigned long long)grid.x,
           (unsigned long long)block.x);
      return;
    }
    auto call = [&]() { fn(args...); };
    using Call = decltype(call);
    Block& b = current_block();
    if (in_fiber()) {
      fail(cudaErrorLaunchFailure, "cuda-emu: %s: launched from inside a kernel", kernel);
      return;
    }
    const bool reverse = reverse_order();
    gridDim = grid;
    blockDim = block;
    int how = mode.value.load(std::memory_order_relaxed);
    b.synced = false;
    for (unsigned k = 0; k < grid.x; ++k) {
      if (how == 0 && k == 1 && !b.synced) how = 1;  // learnt from the first block
      blockIdx = dim3(reverse ? grid.x - 1 - k : k);
      if (how == 1) {  // no barrier, no vote: the threads as plain calls
        for (unsigned j = 0; j < block.x; ++j) {
          threadIdx = dim3(reverse ? block.x - 1 - j : j);
          call();
        }
        continue;
      }
      b.body = [](void* p) { (*static_cast<Call*>(p))(); };
      b.arg = &call;
      const bool ok = run_fibers(b, block.x, reverse, kernel);
      b.current = -1;
      if (!ok) return;
    }
    if (mode.value.load(std::memory_order_relaxed) == 0)
      mode.value.store(b.synced ? 2 : 1, std::memory_order_relaxed);
  }
};

template <class Fn>
Launcher<Fn> make_launcher(dim3 grid, dim3 block, const char* kernel, Mode& mode, Fn fn) {
  return {grid, block, kernel, mode, fn};
}

inline void syncthreads(const char* file, int line) {
  Block& b = current_block();
  if (!in_fiber()) {
    fail(cudaErrorLaunchFailure, "cuda-emu: __syncthreads at %s:%llu in a launch run as "
         "plain calls (its first block met no barrier)", file, (unsigned long long)line);
    return;
  }
  b.synced = true;
  Fiber& f = b.fibers[(size_t)b.current];
  f.state = State::Barrier;
  f.site = file;
  f.line = line;
  yield(b);
}

inline unsigned ballot(unsigned mask, bool pred) {
  Block& b = current_block();
  if (!in_fiber()) {
    fail(cudaErrorLaunchFailure, "cuda-emu: __ballot_sync in a launch run as plain calls%s",
         "");
    return 0;
  }
  b.synced = true;
  Fiber& f = b.fibers[(size_t)b.current];
  f.state = State::Vote;
  f.mask = mask;
  f.vote = pred;
  yield(b);
  return b.fibers[(size_t)b.current].result;
}

}  // namespace hp_emu

#define HP_LAUNCH(kernel, grid, block)                                                     \
  ::hp_emu::make_launcher(                                                                 \
      ::dim3(grid), ::dim3(block), #kernel,                                                \
      []() -> ::hp_emu::Mode& { static ::hp_emu::Mode hp_mode; return hp_mode; }(),        \
      [](auto&&... hp_args) { kernel(hp_args...); })

#define __syncthreads() ::hp_emu::syncthreads(__FILE__, __LINE__)

inline unsigned __ballot_sync(unsigned mask, int pred) { return ::hp_emu::ballot(mask, pred); }

// Round-to-nearest arithmetic: what the host's IEEE float does (no FMA contraction: the
// build passes -ffp-contract=off, as nvcc's --fmad=false does for the GPU).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }

// ---- the runtime API on host memory -------------------------------------------------------

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = ::hp_emu::last_error;
  ::hp_emu::last_error = cudaSuccess;
  return e;
}
inline cudaError_t cudaPeekAtLastError() { return ::hp_emu::last_error; }
inline const char* cudaGetErrorString(cudaError_t e) {
  if (e == cudaSuccess) return "no error";
  if (::hp_emu::error_text[0]) return ::hp_emu::error_text;
  return e == cudaErrorMemoryAllocation ? "out of memory" : "cuda-emu error";
}
inline cudaError_t cudaMallocAsync(void** p, size_t n, cudaStream_t) {
  *p = std::malloc(n ? n : 1);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  // poison: a read of memory nothing wrote is a NaN or all ones
  std::memset(*p, ::hp_emu::kChecks ? 0xFF : 0, n);
  return cudaSuccess;
}
inline cudaError_t cudaMalloc(void** p, size_t n) { return cudaMallocAsync(p, n, nullptr); }
// The typed overloads <cuda_runtime.h> declares for C++.
template <class T>
cudaError_t cudaMallocAsync(T** p, size_t n, cudaStream_t s) {
  return cudaMallocAsync(reinterpret_cast<void**>(p), n, s);
}
template <class T>
cudaError_t cudaMalloc(T** p, size_t n) {
  return cudaMallocAsync(reinterpret_cast<void**>(p), n, nullptr);
}
inline cudaError_t cudaFreeAsync(void* p, cudaStream_t) {
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) { return cudaFreeAsync(p, nullptr); }
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  if (n) std::memset(p, v, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind,
                                   cudaStream_t) {
  if (n) std::memmove(dst, src, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemset(void* p, int v, size_t n) {
  return cudaMemsetAsync(p, v, n, nullptr);
}
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  return cudaMemcpyAsync(dst, src, n, kind, nullptr);
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) {
  // Every emulated call is synchronous; a launch's fault is still pending for the caller.
  return ::hp_emu::last_error;
}
inline cudaError_t cudaDeviceSynchronize() { return ::hp_emu::last_error; }
