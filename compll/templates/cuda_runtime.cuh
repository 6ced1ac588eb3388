// CUDA building blocks for CompLL's GPU target. The generated host code is the same as
// the C++ target's: scalars live on the host, arrays are device pointers, and element
// functions are extended __device__ lambdas that kernels call per element. Every
// reduction keeps the interpreter's order (see cpu_runtime.h), so results are the same
// bits as on the CPU.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#define HP_BITCOPY(dst, src, n) memcpy((dst), (src), (n))
#define HP_FN static __host__ __device__ inline
#include "hp_constants.h"
#include "common.h"
#include "host.h"

// Every launch goes through this macro: a real launch on the caller's stream under nvcc,
// the emulator's (compll/templates/emu/cuda_runtime.h) when built as host C++.
#ifndef HP_LAUNCH
#define HP_LAUNCH(kernel, grid, block) kernel<<<(grid), (block), 0, ::hp::stream()>>>
#endif

namespace hp {

constexpr int THREADS = 256;

// The stream every launch, copy and allocation of a call goes to: the caller's, set per
// thread by hp_set_stream (0, the legacy default stream, until then). A call ends with
// one synchronization of that stream, not of the device, so other streams (the
// framework's backward pass) keep running.
inline cudaStream_t& stream_slot() {
  static thread_local cudaStream_t s = 0;
  return s;
}
inline cudaStream_t stream() { return stream_slot(); }

// The first CUDA error of a call; the exported functions report it.
inline char* error_text() {
  static thread_local char text[256] = {0};
  return text;
}
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess && error_text()[0] == 0)
    std::snprintf(error_text(), 256, "%s: %s", what, cudaGetErrorString(e));
}
inline bool failed() { return error_text()[0] != 0; }

// The most blocks a grid-stride launch gets; its loops cover the rest. The emulator
// lowers it, so that the loops stride at the sizes its tests can afford.
#ifndef HP_GRID_CAP
#define HP_GRID_CAP (65535ull * 8)
#endif
inline unsigned blocks_for(uint64_t n) {
  const uint64_t b = (n + THREADS - 1) / THREADS;
  return (unsigned)std::max<uint64_t>(1, std::min<uint64_t>(b, HP_GRID_CAP));
}

// A device array owned by the host code, like std::vector on the CPU.
template <class T>
class buffer {
 public:
  buffer() = default;
  explicit buffer(uint64_t n) { resize(n); }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  buffer(buffer&& o) noexcept { *this = std::move(o); }
  buffer& operator=(buffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(size_, o.size_);
    return *this;
  }
  ~buffer() {
    if (ptr_) cudaFreeAsync(ptr_, stream());
  }
  void resize(uint64_t n) {  // zero-filled; contents are not kept
    if (ptr_) cudaFreeAsync(ptr_, stream());
    ptr_ = nullptr;
    size_ = n;
    if (n) {
      check(cudaMallocAsync(&ptr_, n * sizeof(T), stream()), "cudaMallocAsync");
      check(cudaMemsetAsync(ptr_, 0, n * sizeof(T), stream()), "cudaMemset");
    }
  }
  T* data() const { return ptr_; }
  uint64_t size() const { return size_; }

 private:
  T* ptr_ = nullptr;
  uint64_t size_ = 0;
};

template <class T>
std::vector<T> to_host(const T* p, uint64_t n) {
  std::vector<T> h((size_t)n);
  if (n) {
    check(cudaMemcpyAsync(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost, stream()),
          "copy to host");
    check(cudaStreamSynchronize(stream()), "copy to host");
  }
  return h;
}
template <class T>
void to_device(T* p, const std::vector<T>& h) {
  if (!h.empty())
    check(cudaMemcpyAsync(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice, stream()),
          "copy to device");
}

struct Unpacks {
  const uint8_t* src[MAX_STAGED];
  uint32_t bits[MAX_STAGED];
  int count;
};
// On the GPU packed arrays are read in place (no staging pass).
struct Stage {
  const uint8_t* src[MAX_STAGED];
  uint32_t bits[MAX_STAGED];
  __device__ uint8_t get(int k, uint64_t i) const { return hp_unpack(src[k], i, bits[k]); }
};
inline Stage stage_of(const Unpacks& u) {
  Stage st{};
  for (int k = 0; k < u.count; ++k) {
    st.src[k] = u.src[k];
    st.bits[k] = u.bits[k];
  }
  return st;
}

// ---- kernels -------------------------------------------------------------------------------
// One thread per (chunk, lane): lane l of a chunk adds elements l, l+32, ... in order,
// in f32 within each block of SUM_BLOCK elements and in f64 across blocks
// (compll/interpreter.py _sum_f32); a warp's loads are contiguous.
constexpr uint64_t SUM_BLOCK = SUB_BLOCK;
template <class F>
__global__ void k_sum_lanes(uint64_t len, F f, Stage st, double* lanes) {
  const uint64_t t = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
  const uint64_t chunk = t / SUM_LANES, lane = t % SUM_LANES;
  const uint64_t lo = chunk * SUM_CHUNK;
  if (lo >= len) return;
  const uint64_t hi = lo + SUM_CHUNK < len ? lo + SUM_CHUNK : len;
  double acc = 0.0;
  for (uint64_t b = lo; b < hi; b += SUM_BLOCK) {
    const uint64_t e = b + SUM_BLOCK < hi ? b + SUM_BLOCK : hi;
    float partial = 0.0f;
    for (uint64_t i = b + lane; i < e; i += SUM_LANES) partial += (float)f(i, st);
    acc += (double)partial;
  }
  lanes[t] = acc;
}

// Adjacent lanes add pairwise up a tree, as on the CPU.
__global__ inline void k_combine_lanes(uint64_t chunks, const double* lanes, double* part) {
  const uint64_t c = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
  if (c >= chunks) return;
  double l[SUM_LANES];
  for (uint64_t k = 0; k < SUM_LANES; ++k) l[k] = lanes[c * SUM_LANES + k];
  for (uint64_t width = SUM_LANES / 2; width >= 1; width /= 2)
    for (uint64_t k = 0; k < width; ++k) l[k] = l[2 * k] + l[2 * k + 1];
  part[c] = l[0];
}

// A thread block's values (and all-NaN flags) combined up a tree into vals[0], nans[0].
template <class T, class Combine>
__device__ void tree_reduce(T* vals, int* nans, T acc, int nan_only, Combine combine) {
  vals[threadIdx.x] = acc;
  nans[threadIdx.x] = nan_only;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if ((int)threadIdx.x < s) {
      vals[threadIdx.x] = combine(vals[threadIdx.x], vals[threadIdx.x + s]);
      nans[threadIdx.x] &= nans[threadIdx.x + s];
    }
    __syncthreads();
  }
}

// Per-chunk partials of order-free reductions: one block per chunk.
template <class T, class F, class Combine>
__global__ void k_chunk_reduce(uint64_t len, F f, Stage st, T init, Combine combine, T* part,
                               int* all_nan) {
  __shared__ T vals[THREADS];
  __shared__ int nans[THREADS];
  const uint64_t lo = blockIdx.x * SUM_CHUNK;
  const uint64_t hi = lo + SUM_CHUNK < len ? lo + SUM_CHUNK : len;
  T acc = init;
  int nan_only = 1;
  for (uint64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const T v = (T)f(i, st);
    acc = combine(acc, v);
    nan_only &= (v != v);
  }
  tree_reduce(vals, nans, acc, nan_only, combine);
  if (threadIdx.x == 0) {
    part[blockIdx.x] = vals[0];
    if (all_nan) all_nan[blockIdx.x] = nans[0];
  }
}

template <class T, class F>
__global__ void k_store(T* out, uint64_t len, F f, Stage st) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < len;
       i += (uint64_t)gridDim.x * blockDim.x)
    out[i] = f(i, st);
}

// out[i] = scale * f(i), or out[i] += scale * f(i); a scale of 1 multiplies nothing.
// With feedback (error feedback's residual): out[i] += scale * f(i), 0 if not finite.
template <class F>
__global__ void k_write_out(float* out, uint64_t len, int accumulate, float scale,
                            int feedback, F f, Stage st) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < len;
       i += (uint64_t)gridDim.x * blockDim.x) {
    const float v = scale == 1.0f ? f(i, st) : __fmul_rn(scale, f(i, st));
    if (feedback) {
      const float w = __fadd_rn(out[i], v);
      out[i] = hp_isfinite(w) ? w : 0.0f;
    } else {
      out[i] = accumulate ? __fadd_rn(out[i], v) : v;
    }
  }
}

template <class F>
__global__ void k_pack1(uint8_t* dst, uint64_t len, F f, Stage st) {
  const uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
  const bool bit = i < len ? ((uint64_t)f(i, st) & 1u) != 0 : false;
  const unsigned word = __ballot_sync(0xFFFFFFFFu, bit);
  const uint64_t base = i - (threadIdx.x & 31);
  if ((threadIdx.x & 31) == 0 && base < len) {
    const uint64_t bytes = (len - base) >= 32 ? 4 : ((len - base) + 7) / 8;
    for (uint64_t b = 0; b < bytes; ++b) dst[base / 8 + b] = (uint8_t)(word >> (8 * b));
  }
}

// 2/4/8-bit packing: one output byte per thread.
template <int BITS, class F>
__global__ void k_pack(uint8_t* dst, uint64_t len, F f, Stage st) {
  constexpr uint32_t per = 8 / BITS, mask = (1u << BITS) - 1u;
  const uint64_t bytes = (len * BITS + 7) / 8;
  for (uint64_t b = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; b < bytes;
       b += (uint64_t)gridDim.x * blockDim.x) {
    uint32_t byte = 0;
    for (uint32_t k = 0; k < per; ++k) {
      const uint64_t i = b * per + k;
      if (i < len) byte |= ((uint32_t)((uint64_t)f(i, st) & mask)) << (k * BITS);
    }
    dst[b] = (uint8_t)byte;
  }
}

template <class T, class F>
__global__ void k_materialize(T* out, uint64_t len, F f) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < len;
       i += (uint64_t)gridDim.x * blockDim.x)
    out[i] = f(i);
}

// ---- stream compaction: count per tile, exclusive prefix on the host, ordered write ----
constexpr int TILE = THREADS * 4;

template <class P>
__global__ void k_count(uint64_t len, P pred, uint32_t* counts) {
  const uint64_t lo = (uint64_t)blockIdx.x * TILE;
  int c = 0;
  for (int k = 0; k < 4; ++k) {
    const uint64_t i = lo + (uint64_t)threadIdx.x * 4 + k;
    c += (i < len && pred(i)) ? 1 : 0;
  }
  __shared__ int sums[THREADS];
  sums[threadIdx.x] = c;
  __syncthreads();
  for (int s = THREADS / 2; s > 0; s >>= 1) {
    if ((int)threadIdx.x < s) sums[threadIdx.x] += sums[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) counts[blockIdx.x] = (uint32_t)sums[0];
}

template <class T, class V, class P>
__global__ void k_compact(uint64_t len, V val, P pred, const uint64_t* start, uint32_t* idx,
                          T* out) {
  __shared__ int scan[THREADS];
  const uint64_t lo = (uint64_t)blockIdx.x * TILE;
  bool keep[4];
  int c = 0;
  for (int k = 0; k < 4; ++k) {
    const uint64_t i = lo + (uint64_t)threadIdx.x * 4 + k;
    keep[k] = i < len && pred(i);
    c += keep[k];
  }
  scan[threadIdx.x] = c;
  __syncthreads();
  for (int s = 1; s < THREADS; s <<= 1) {  // inclusive Hillis-Steele scan of thread counts
    const int add = (int)threadIdx.x >= s ? scan[threadIdx.x - s] : 0;
    __syncthreads();
    scan[threadIdx.x] += add;
    __syncthreads();
  }
  uint64_t pos = start[blockIdx.x] + (uint64_t)(scan[threadIdx.x] - c);
  for (int k = 0; k < 4; ++k) {
    const uint64_t i = lo + (uint64_t)threadIdx.x * 4 + k;
    if (keep[k]) {
      if (idx) idx[pos] = (uint32_t)i;
      out[pos] = val(i);
      ++pos;
    }
  }
}

// ---- fused passes: on the GPU each op of a pass is its own kernel ------------------------
template <class... Ops>
void fused(uint64_t len, Unpacks u, Ops&&... ops) {
  const Stage st = stage_of(u);
  (ops.run(len, st), ...);
}

template <class F>
struct SumF32 {
  F f;
  float* out;
  void run(uint64_t len, const Stage& st) {
    const uint64_t chunks = (len + SUM_CHUNK - 1) / SUM_CHUNK;
    double total = 0.0;
    if (chunks) {
      buffer<double> lanes(chunks * SUM_LANES), part(chunks);
      HP_LAUNCH(k_sum_lanes, blocks_for(chunks * SUM_LANES), THREADS)(len, f, st, lanes.data());
      HP_LAUNCH(k_combine_lanes, blocks_for(chunks), THREADS)(chunks, lanes.data(), part.data());
      check(cudaGetLastError(), "sum kernel");
      for (double p : to_host(part.data(), chunks)) total += p;
    }
    const float r = (float)total;
    *out = hp_isnan(r) ? HP_NAN : r;
  }
};
template <class F>
SumF32<F> sum_f32(F f, float* out) { return {f, out}; }

struct AddI64 {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a + b; }
};
template <bool IS_MAX>
struct ExtremeOp {
  __device__ float operator()(float a, float b) const { return IS_MAX ? hp_fmax(a, b) : hp_fmin(a, b); }
};
template <bool IS_MAX, class T>
struct ExtremeIntOp {
  __device__ T operator()(T a, T b) const { return IS_MAX ? (b > a ? b : a) : (b < a ? b : a); }
};

template <class T, class F>
struct SumInt {
  F f;
  T* out;
  void run(uint64_t len, const Stage& st) {
    const uint64_t chunks = (len + SUM_CHUNK - 1) / SUM_CHUNK;
    uint64_t total = 0;
    if (chunks) {
      buffer<int64_t> part(chunks);
      auto wide = [f = f] __device__(uint64_t i, const Stage& s) { return (int64_t)f(i, s); };
      HP_LAUNCH(k_chunk_reduce, (unsigned)chunks, THREADS)(len, wide, st, (int64_t)0, AddI64{},
                                                   part.data(), (int*)nullptr);
      check(cudaGetLastError(), "sum kernel");
      for (int64_t p : to_host(part.data(), chunks)) total += (uint64_t)p;
    }
    *out = (T)(uint32_t)total;
  }
};
template <class T, class F>
SumInt<T, F> sum_int(F f, T* out) { return {f, out}; }

template <bool IS_MAX, class F>
struct ExtremeF32 {
  F f;
  float* out;
  void run(uint64_t len, const Stage& st) {
    const uint64_t chunks = (len + SUM_CHUNK - 1) / SUM_CHUNK;
    float best = IS_MAX ? -HP_INF : HP_INF;
    bool nan_only = chunks > 0;
    if (chunks) {
      buffer<float> part(chunks);
      buffer<int> nans(chunks);
      auto as_f = [f = f] __device__(uint64_t i, const Stage& s) { return (float)f(i, s); };
      HP_LAUNCH(k_chunk_reduce, (unsigned)chunks, THREADS)(len, as_f, st, IS_MAX ? -HP_INF : HP_INF,
                                                   ExtremeOp<IS_MAX>{}, part.data(), nans.data());
      check(cudaGetLastError(), "max/min kernel");
      const std::vector<float> p = to_host(part.data(), chunks);
      const std::vector<int> a = to_host(nans.data(), chunks);
      for (uint64_t c = 0; c < chunks; ++c) {
        best = IS_MAX ? hp_fmax(best, p[c]) : hp_fmin(best, p[c]);
        nan_only = nan_only && a[c];
      }
    }
    *out = nan_only ? HP_NAN : (best == 0.0f ? 0.0f : best);
  }
};
template <bool IS_MAX, class F>
ExtremeF32<IS_MAX, F> extreme_f32(F f, float* out) { return {f, out}; }

template <bool IS_MAX, class T, class F>
struct ExtremeInt {
  F f;
  T* out;
  void run(uint64_t len, const Stage& st) {
    const T init = IS_MAX ? std::numeric_limits<T>::min() : std::numeric_limits<T>::max();
    const uint64_t chunks = (len + SUM_CHUNK - 1) / SUM_CHUNK;
    T best = init;
    if (chunks) {
      buffer<T> part(chunks);
      HP_LAUNCH(k_chunk_reduce, (unsigned)chunks, THREADS)(len, f, st, init, ExtremeIntOp<IS_MAX, T>{},
                                                   part.data(), (int*)nullptr);
      check(cudaGetLastError(), "max/min kernel");
      for (T p : to_host(part.data(), chunks)) best = IS_MAX ? (p > best ? p : best) : (p < best ? p : best);
    }
    *out = best;
  }
};
template <bool IS_MAX, class T, class F>
ExtremeInt<IS_MAX, T, F> extreme_int(F f, T* out) { return {f, out}; }

template <int BITS, class F>
struct Pack {
  uint8_t* dst;
  F f;
  void run(uint64_t len, const Stage& st) {
    if (!len) return;
    if (BITS == 1) {
      HP_LAUNCH(k_pack1, (unsigned)((len + THREADS - 1) / THREADS), THREADS)(dst, len, f, st);
    } else {
      HP_LAUNCH(k_pack<BITS>, blocks_for((len * BITS + 7) / 8), THREADS)(dst, len, f, st);
    }
    check(cudaGetLastError(), "pack kernel");
  }
};
template <int BITS, class F>
Pack<BITS, F> pack(uint8_t* dst, F f) { return {dst, f}; }

template <class T, class F>
struct Store {
  uint8_t* dst;
  F f;
  void run(uint64_t len, const Stage& st) {
    if (!len) return;
    HP_LAUNCH(k_store, blocks_for(len), THREADS)(reinterpret_cast<T*>(dst), len, f, st);
    check(cudaGetLastError(), "store kernel");
  }
};
template <class T, class F>
Store<T, F> store(uint8_t* dst, F f) { return {dst, f}; }

template <class F>
struct WriteOut {
  float* out;
  int accumulate;
  float scale;
  int feedback;
  F f;
  void run(uint64_t len, const Stage& st) {
    if (!len) return;
    HP_LAUNCH(k_write_out, blocks_for(len), THREADS)(out, len, accumulate, scale, feedback, f, st);
    check(cudaGetLastError(), "decode kernel");
  }
};
template <class F>
WriteOut<F> write_out(float* out, int accumulate, float scale, int feedback, F f) {
  return {out, accumulate, scale, feedback, f};
}

__global__ void k_scale_into(float* x, uint64_t n, float s) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x)
    x[i] = __fmul_rn(x[i], s);
}
// x[i] *= s (a batched decode's SCALE_SUM: the mean of the sum).
inline void scale_into(float* x, uint64_t n, float s) {
  if (!n) return;
  HP_LAUNCH(k_scale_into, blocks_for(n), THREADS)(x, n, s);
  check(cudaGetLastError(), "scale kernel");
}

// r[i] += g[i] (error feedback adds the gradient into its residual).
__global__ void k_add_into(float* r, const float* g, uint64_t n) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x)
    r[i] = __fadd_rn(r[i], g[i]);
}
inline void add_into(float* r, const float* g, uint64_t n) {
  if (!n) return;
  HP_LAUNCH(k_add_into, blocks_for(n), THREADS)(r, g, n);
  check(cudaGetLastError(), "add kernel");
}
// ---- the encoder's first read of g, and the non-finite flag (see cpu_runtime.h) ----------
// r[i] += g[i] when there is a residual; any thread that meets a NaN or an infinity in the
// value left for the encoder stores NONFINITE into the flag word (every writer stores the
// same value, so the unordered stores need no atomic), which mark_nonfinite then copies
// into the payload header on the device: no host round trip.
__global__ inline void k_take_input(float* r, const float* g, uint64_t n, uint32_t* flag) {
  uint32_t bad = 0;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x) {
    const float v = r ? __fadd_rn(r[i], g[i]) : g[i];
    if (r) r[i] = v;
    bad |= hp_isfinite(v) ? 0u : 1u;
  }
  if (bad) *flag = NONFINITE;
}
// Without r it flags g only when checks (else a later pass does, CheckInput).
inline void take_input(float* r, const float* g, uint64_t n, uint32_t* flag,
                       bool checks = true) {
  if (!n || (!r && !checks)) return;
  HP_LAUNCH(k_take_input, blocks_for(n), THREADS)(r, g, n, flag);
  check(cudaGetLastError(), "input kernel");
}
// The flag word, in device memory (zeroed when made).
struct Flag {
  buffer<uint32_t> word{1};
  uint32_t* ptr() { return word.data(); }
};
// As ops of a pass (the CPU fuses them into the pass's loop; here each is one more
// kernel): the take with a residual, first; the flag of g without one, last.
struct TakeInput {
  float* r;
  const float* g;
  uint32_t* flag;
  void run(uint64_t len, const Stage&) {
    if (r) take_input(r, g, len, flag);
  }
};
inline TakeInput take_input_op(float* r, const float* g, uint32_t* flag) { return {r, g, flag}; }
struct CheckInput {
  const float* r;
  const float* g;
  uint32_t* flag;
  void run(uint64_t len, const Stage&) {
    if (!r) take_input(nullptr, g, len, flag);
  }
};
inline CheckInput check_input_op(const float* r, const float* g, uint32_t* flag) {
  return {r, g, flag};
}

inline void mark_nonfinite(uint8_t* out, Flag& f) {
  check(cudaMemcpyAsync(out + 12, f.ptr(), 4, cudaMemcpyDeviceToDevice, stream()),
        "copy on device");
}

__global__ inline void k_fill(float* out, uint64_t n, float v) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x)
    out[i] = v;
}
// A NONFINITE payload's decode: NaN everywhere, or 0 for a residual's update (feedback).
inline int poison(float* out, uint64_t n, int feedback) {
  if (n) HP_LAUNCH(k_fill, blocks_for(n), THREADS)(out, n, feedback ? 0.0f : HP_NAN);
  check(cudaGetLastError(), "fill kernel");
  return 0;
}

template <int BITS, class F>
void pack_all(uint8_t* dst, uint64_t len, F f) {
  fused(len, Unpacks{{}, {}, 0}, pack<BITS>(dst, f));
}

// ---- barrier operators ------------------------------------------------------------------
template <class T, class F>
buffer<T> materialize(uint64_t len, F f) {
  buffer<T> out(len);
  if (len) HP_LAUNCH(k_materialize, blocks_for(len), THREADS)(out.data(), len, f);
  check(cudaGetLastError(), "materialize kernel");
  return out;
}

template <class T, class V, class P>
void filter(uint64_t len, V val, P pred, buffer<uint32_t>* idx, buffer<T>* out) {
  const uint64_t tiles = (len + TILE - 1) / TILE;
  if (!tiles) {
    if (idx) idx->resize(0);
    out->resize(0);
    return;
  }
  buffer<uint32_t> counts(tiles);
  HP_LAUNCH(k_count, (unsigned)tiles, THREADS)(len, pred, counts.data());
  check(cudaGetLastError(), "filter count");
  std::vector<uint32_t> c = to_host(counts.data(), tiles);
  std::vector<uint64_t> start(tiles + 1, 0);
  for (uint64_t t = 0; t < tiles; ++t) start[t + 1] = start[t] + c[t];
  buffer<uint64_t> dstart(tiles);
  to_device(dstart.data(), std::vector<uint64_t>(start.begin(), start.end() - 1));
  if (idx) idx->resize(start[tiles]);
  out->resize(start[tiles]);
  HP_LAUNCH(k_compact, (unsigned)tiles, THREADS)(len, val, pred, dstart.data(),
                                          idx ? idx->data() : nullptr, out->data());
  check(cudaGetLastError(), "filter write");
}

// Gather the chosen indices' values on the device.
template <class T, class V>
void take(const std::vector<uint32_t>& chosen, V val, buffer<uint32_t>* idx, buffer<T>* out) {
  buffer<uint32_t> dchosen(chosen.size());
  to_device(dchosen.data(), chosen);
  const uint32_t* c = dchosen.data();
  *out = materialize<T>(chosen.size(), [=] __device__(uint64_t j) { return val(c[j]); });
  if (idx) *idx = std::move(dchosen);
}

// Sorting runs on the host (keys are copied back); it is not on any shipped path.
template <class T, class V, class K>
void sort(uint64_t len, V val, K key, bool descending, buffer<uint32_t>* idx, buffer<T>* out) {
  buffer<double> dk = materialize<double>(len, [=] __device__(uint64_t i) { return (double)key(i); });
  const std::vector<double> k = to_host(dk.data(), len);
  std::vector<uint32_t> order((size_t)len);
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(), Ranked{k.data(), descending});
  take<T>(order, val, idx, out);
}

// Exact top-k: a strided sample on the host bounds the threshold, the device compacts the
// candidates, and the host selects among them (all elements when too few pass).
template <class T, class V, class K>
void topk(uint64_t len, int64_t kk, V val, K key, buffer<uint32_t>* idx, buffer<T>* out) {
  const uint64_t k = kk <= 0 ? 0 : std::min<uint64_t>((uint64_t)kk, len);
  std::vector<uint32_t> cand;
  std::vector<double> ck;
  if (k > 0 && len > 65536 && k * 8 < len) {
    const uint64_t samples = std::min<uint64_t>(len, 16384), stride = len / samples;
    buffer<double> ds = materialize<double>(samples, [=] __device__(uint64_t j) {
      return (double)key(j * stride);
    });
    std::vector<double> s = to_host(ds.data(), samples);
    const double thr = topk_threshold(s, k, len);
    if (thr == thr) {
      buffer<uint32_t> pidx;
      buffer<double> pkey;
      filter<double>(
          len, [=] __device__(uint64_t i) { return (double)key(i); },
          [=] __device__(uint64_t i) { return (double)key(i) >= thr; }, &pidx, &pkey);
      if (pkey.size() >= k) {
        cand = to_host(pidx.data(), pidx.size());
        ck = to_host(pkey.data(), pkey.size());
      }
    }
  }
  if (cand.empty()) {
    buffer<double> dk = materialize<double>(len, [=] __device__(uint64_t i) { return (double)key(i); });
    ck = to_host(dk.data(), len);
    cand.resize((size_t)len);
    std::iota(cand.begin(), cand.end(), 0u);
  }
  const std::vector<uint32_t> chosen = select_top(cand, ck, k);
  take<T>(chosen, val, idx, out);
}

template <class I>
bool check_indices(uint64_t len, uint64_t size, I index, char* err, uint64_t errcap) {
  buffer<int64_t> d = materialize<int64_t>(len, index);
  for (int64_t ix : to_host(d.data(), len)) {
    if (ix < 0 || (uint64_t)ix >= size) return index_error(err, errcap, ix, size);
  }
  return true;
}

// Scatter with the interpreter's order: values for one index add up on the host in
// order of j, then each distinct index is written once.
template <class T, class I, class V>
void scatter_add(T* out, uint64_t size, uint64_t len, I index, V value) {
  buffer<int64_t> di = materialize<int64_t>(len, index);
  buffer<T> dv = materialize<T>(len, [=] __device__(uint64_t j) { return (T)value(j); });
  const std::vector<int64_t> ix = to_host(di.data(), len);
  const std::vector<T> v = to_host(dv.data(), len);
  std::vector<uint32_t> order((size_t)len);
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return ix[a] < ix[b]; });
  std::vector<uint32_t> where;
  std::vector<T> sums;
  for (size_t p = 0; p < order.size();) {
    const int64_t at = ix[order[p]];
    T s = T(0);
    for (; p < order.size() && ix[order[p]] == at; ++p) s = s + v[order[p]];
    if (at >= 0 && (uint64_t)at < size) {
      where.push_back((uint32_t)at);
      sums.push_back(s);
    }
  }
  buffer<uint32_t> dw(where.size());
  buffer<T> ds(sums.size());
  to_device(dw.data(), where);
  to_device(ds.data(), sums);
  const uint32_t* w = dw.data();
  const T* s = ds.data();
  buffer<int> unused = materialize<int>(where.size(), [=] __device__(uint64_t j) {
    out[w[j]] = out[w[j]] + s[j];
    return 0;
  });
}

template <class I, class V>
void scatter_out(float* out, uint64_t n, int accumulate, float scale, int feedback,
                 uint64_t len, I index, V value) {
  if (!accumulate && !feedback) {
    check(cudaMemsetAsync(out, 0, n * sizeof(float), stream()), "cudaMemset");
    scatter_add(out, n, len, index, value);
    if (scale != 1.0f)
      fused(n, Unpacks{{}, {}, 0},
            write_out(out, 0, scale, 0,
                      [=] __device__(uint64_t i, const Stage&) { return out[i]; }));
    return;
  }
  buffer<float> tmp(n);
  scatter_add(tmp.data(), n, len, index, value);
  const float* t = tmp.data();
  fused(n, Unpacks{{}, {}, 0},
        write_out(out, 1, scale, feedback,
                  [=] __device__(uint64_t i, const Stage&) { return t[i]; }));
}

// ---- payload bytes: device memory, written and read from the host ------------------------
inline void put_bytes(uint8_t* dst, const void* src, uint64_t n) {
  // From pageable host memory the copy returns once src was read: src may go after it.
  if (n) check(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream()), "copy to device");
}
inline void copy_bytes(uint8_t* dst, const uint8_t* src, uint64_t n) {
  if (n) check(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, stream()), "copy on device");
}
inline void zero_bytes(uint8_t* dst, uint64_t n) {
  if (n) check(cudaMemsetAsync(dst, 0, n, stream()), "cudaMemset");
}
template <class T>
inline T get(const uint8_t* p) {
  T v;
  check(cudaMemcpyAsync(&v, p, sizeof(T), cudaMemcpyDeviceToHost, stream()), "copy to host");
  check(cudaStreamSynchronize(stream()), "copy to host");
  return v;
}
template <class T>
__device__ inline T load(const uint8_t* p, uint64_t i) {
  return reinterpret_cast<const T*>(p)[i];  // sections are 8-byte aligned
}

inline void write_header(uint8_t* out, uint32_t nsec, uint32_t algo, uint64_t n, uint32_t seed,
                         uint32_t step, const uint64_t* sizes) {
  std::vector<uint8_t> h(HEADER + 8ull * nsec);
  fill_header(h.data(), nsec, algo, n, seed, step, sizes);
  put_bytes(out, h.data(), h.size());
}

// The header is validated on a host copy of its first bytes.
inline bool read_header(const uint8_t* p, uint64_t size, uint32_t algo, uint64_t n,
                        uint32_t nsec, uint64_t* sizes, uint32_t* seed, uint32_t* step,
                        uint32_t* flags, char* err, uint64_t errcap) {
  const std::vector<uint8_t> h = to_host(p, std::min<uint64_t>(size, HEADER + 8ull * nsec));
  return parse_header(h.data(), size, algo, n, nsec, sizes, seed, step, flags, err, errcap);
}

}  // namespace hp
