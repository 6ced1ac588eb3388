// Blockwise reductions for CompLL's CUDA target (see cpu_blocks.h for the semantics).
// The work is cut into segments, a block's chunks of at most SUM_CHUNK elements; every
// segment reduces in the order of cuda_runtime.cuh's whole-array kernels, then one thread
// per block combines its segments in order, so the bits equal the CPU's. Results stay on
// the device: one value per block, an array of the kernel.
#pragma once

#include "cuda_runtime.cuh"

namespace hp {

inline uint64_t blocks(uint64_t len, uint64_t b) { return b ? (len + b - 1) / b : 1; }

// Segment s of blocks of `size` elements, `per` segments each: [lo, hi), maybe empty.
struct Segments {
  uint64_t len, size, per, count;
  __host__ __device__ void range(uint64_t s, uint64_t* lo, uint64_t* hi) const {
    const uint64_t k = s / per, c = s % per;
    const uint64_t start = k * size, end = start + size < len ? start + size : len;
    *lo = start + c * SUM_CHUNK < end ? start + c * SUM_CHUNK : end;
    *hi = *lo + SUM_CHUNK < end ? *lo + SUM_CHUNK : end;
  }
};
inline Segments segments(uint64_t len, uint64_t b) {
  const uint64_t size = b ? b : len;
  const uint64_t per = std::max<uint64_t>(1, (size + SUM_CHUNK - 1) / SUM_CHUNK);
  return {len, size, per, blocks(len, b) * per};
}

// One thread per (segment, lane), as k_sum_lanes per chunk.
// Grid-stride loops throughout: a block size of 1 makes as many segments as elements.
template <class F>
__global__ void k_block_sum_lanes(Segments sg, F f, double* lanes) {
  for (uint64_t t = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; t < sg.count * SUM_LANES;
       t += (uint64_t)gridDim.x * blockDim.x) {
    const uint64_t s = t / SUM_LANES, lane = t % SUM_LANES;
    uint64_t lo, hi;
    sg.range(s, &lo, &hi);
    double acc = 0.0;
    for (uint64_t b = lo; b < hi; b += SUM_BLOCK) {
      const uint64_t e = b + SUM_BLOCK < hi ? b + SUM_BLOCK : hi;
      float partial = 0.0f;
      for (uint64_t i = b + lane; i < e; i += SUM_LANES) partial += (float)f(i);
      acc += (double)partial;
    }
    lanes[t] = acc;
  }
}

// Per block: each segment's lanes pairwise up a tree (as k_combine_lanes), segments in order.
__global__ inline void k_block_sum_finish(Segments sg, const double* lanes, float* out) {
  for (uint64_t k = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; k < sg.count / sg.per;
       k += (uint64_t)gridDim.x * blockDim.x) {
    double total = 0.0;
    for (uint64_t c = 0; c < sg.per; ++c) {
      double l[SUM_LANES];
      for (uint64_t j = 0; j < SUM_LANES; ++j) l[j] = lanes[(k * sg.per + c) * SUM_LANES + j];
      for (uint64_t width = SUM_LANES / 2; width >= 1; width /= 2)
        for (uint64_t j = 0; j < width; ++j) l[j] = l[2 * j] + l[2 * j + 1];
      total += l[0];
    }
    const float r = (float)total;
    out[k] = hp_isnan(r) ? HP_NAN : r;
  }
}

template <bool DIRECT = false, class F>
void block_sum_f32(uint64_t len, uint64_t b, F f, float* out) {
  const Segments sg = segments(len, b);
  if (!sg.count) return;
  buffer<double> lanes(sg.count * SUM_LANES);
  HP_LAUNCH(k_block_sum_lanes, blocks_for(sg.count * SUM_LANES), THREADS)(sg, f, lanes.data());
  HP_LAUNCH(k_block_sum_finish, blocks_for(sg.count / sg.per), THREADS)(sg, lanes.data(), out);
  check(cudaGetLastError(), "block sum kernel");
}

// Order-free reductions: one thread block per segment, then one thread per block.
template <class T, class F, class Combine>
__global__ void k_segment_reduce(Segments sg, F f, T init, Combine combine, T* part,
                                 int* all_nan) {
  __shared__ T vals[THREADS];
  __shared__ int nans[THREADS];
  for (uint64_t seg = blockIdx.x; seg < sg.count; seg += gridDim.x) {
    uint64_t lo, hi;
    sg.range(seg, &lo, &hi);
    T acc = init;
    int nan_only = 1;
    for (uint64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      const T v = (T)f(i);
      acc = combine(acc, v);
      nan_only &= (v != v);
    }
    tree_reduce(vals, nans, acc, nan_only, combine);
    if (threadIdx.x == 0) {
      part[seg] = vals[0];
      if (all_nan) all_nan[seg] = nans[0];
    }
    __syncthreads();  // vals is reused by the next segment
  }
}
inline unsigned segment_grid(uint64_t count) {
  return (unsigned)std::min<uint64_t>(count, HP_GRID_CAP * 2);
}

// FLOAT: NaN-ignoring extremes, zero as +0, a block of NaN only gives the canonical NaN.
template <bool FLOAT, class T, class Combine>
__global__ void k_segment_finish(Segments sg, const T* part, const int* all_nan, T init,
                                 Combine combine, T* out) {
  for (uint64_t k = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; k < sg.count / sg.per;
       k += (uint64_t)gridDim.x * blockDim.x) {
    // An empty trailing segment holds the identity and an all-NaN flag of 1, so it
    // changes nothing; only an empty array (one block of none) is no NaN.
    T acc = init;
    bool nan = FLOAT && sg.len > 0;
    for (uint64_t c = 0; c < sg.per; ++c) {
      acc = combine(acc, part[k * sg.per + c]);
      if (FLOAT) nan = nan && all_nan[k * sg.per + c];
    }
    if constexpr (FLOAT) {
      out[k] = nan ? (T)HP_NAN : (acc == (T)0 ? (T)0 : acc);
    } else {
      out[k] = acc;
    }
  }
}

template <class T, class F>
void block_sum_int(uint64_t len, uint64_t b, F f, T* out) {
  const Segments sg = segments(len, b);
  if (!sg.count) return;
  buffer<int64_t> part(sg.count);
  auto wide = [f] __device__(uint64_t i) { return (int64_t)(uint32_t)f(i); };
  HP_LAUNCH(k_segment_reduce, segment_grid(sg.count), THREADS)(sg, wide, (int64_t)0, AddI64{}, part.data(),
                                                    (int*)nullptr);
  buffer<int64_t> total(sg.count / sg.per);
  HP_LAUNCH(k_segment_finish<false>, blocks_for(sg.count / sg.per), THREADS)(
      sg, part.data(), (const int*)nullptr, (int64_t)0, AddI64{}, total.data());
  auto narrow = [t = total.data()] __device__(uint64_t k) { return (T)(uint32_t)t[k]; };
  HP_LAUNCH(k_materialize, blocks_for(sg.count / sg.per), THREADS)(out, sg.count / sg.per, narrow);
  check(cudaGetLastError(), "block sum kernel");
}

template <bool IS_MAX, bool DIRECT = false, class F>
void block_extreme_f32(uint64_t len, uint64_t b, F f, float* out) {
  const Segments sg = segments(len, b);
  if (!sg.count) return;
  const float init = IS_MAX ? -HP_INF : HP_INF;
  buffer<float> part(sg.count);
  buffer<int> nans(sg.count);
  auto as_f = [f] __device__(uint64_t i) { return (float)f(i); };
  HP_LAUNCH(k_segment_reduce, segment_grid(sg.count), THREADS)(sg, as_f, init, ExtremeOp<IS_MAX>{},
                                                    part.data(), nans.data());
  HP_LAUNCH(k_segment_finish<true>, blocks_for(sg.count / sg.per), THREADS)(
      sg, part.data(), nans.data(), init, ExtremeOp<IS_MAX>{}, out);
  check(cudaGetLastError(), "block max/min kernel");
}

template <bool DIRECT = false, class F>
void block_minmax_f32(uint64_t len, uint64_t b, F f, float* lo, float* hi) {
  block_extreme_f32<false>(len, b, f, lo);
  block_extreme_f32<true>(len, b, f, hi);
}

template <bool IS_MAX, class T, class F>
void block_extreme_int(uint64_t len, uint64_t b, F f, T* out) {
  const Segments sg = segments(len, b);
  if (!sg.count) return;
  const T init = IS_MAX ? std::numeric_limits<T>::min() : std::numeric_limits<T>::max();
  buffer<T> part(sg.count);
  HP_LAUNCH(k_segment_reduce, segment_grid(sg.count), THREADS)(sg, f, init, ExtremeIntOp<IS_MAX, T>{},
                                                    part.data(), (int*)nullptr);
  HP_LAUNCH(k_segment_finish<false>, blocks_for(sg.count / sg.per), THREADS)(
      sg, part.data(), (const int*)nullptr, init, ExtremeIntOp<IS_MAX, T>{}, out);
  check(cudaGetLastError(), "block max/min kernel");
}

}  // namespace hp
