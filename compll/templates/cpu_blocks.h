// Blockwise reductions for CompLL's C++ target: reduce(x, op, key=, block=B) gives one
// value per block of B elements (the last block may be short; B = 0 is one block of all).
// Each block reduces as an array of its own (compll/interpreter.py block_reduce): a float
// sum's chunks and lanes count from the block's first element, and extremes follow
// ExtremeF32's rules (NaN ignored, zero is +0, all-NaN the canonical NaN, empty -+inf).
#pragma once

#include "cpu_runtime.h"

namespace hp {

inline uint64_t blocks(uint64_t len, uint64_t b) { return b ? (len + b - 1) / b : 1; }
// Segments per block: a block's chunks of at most SUM_CHUNK elements (at least one).
inline uint64_t per_block(uint64_t len, uint64_t b) {
  return std::max<uint64_t>(1, ((b ? b : len) + SUM_CHUNK - 1) / SUM_CHUNK);
}

// An array of one value per block, evaluated once (expand reads it per element).
template <class T, class F>
buffer<T> materialize(uint64_t len, F f) {
  buffer<T> out((size_t)len);
  parallel_for((int64_t)len, [&](int64_t i) { out[(size_t)i] = (T)f((uint64_t)i); },
               len > GRAIN);
  return out;
}

// Work is split into segments, a block's chunks of at most SUM_CHUNK elements, so many
// small blocks and a few large ones both spread over the threads. seg(k, c, lo, hi)
// reduces chunk c of block k; fold(k, chunks) combines a block's chunk results in order.
template <class Seg, class Fold>
inline void each_block(uint64_t len, uint64_t b, Seg seg, Fold fold) {
  const uint64_t count = blocks(len, b), size = b ? b : len, per = per_block(len, b);
  if (per == 1) {  // a block is one segment: no index arithmetic per segment
    parallel_for((int64_t)count, [&](int64_t k) {
      const uint64_t lo = (uint64_t)k * size;
      seg((uint64_t)k, 0, lo, std::min(len, lo + size));
    });
  } else {
    parallel_for((int64_t)(count * per), [&](int64_t s) {
      const uint64_t k = (uint64_t)s / per, c = (uint64_t)s % per;
      const uint64_t start = k * size, end = std::min(len, start + size);
      const uint64_t lo = std::min(end, start + c * SUM_CHUNK);
      seg(k, c, lo, std::min(end, lo + SUM_CHUNK));
    });
  }
  parallel_for((int64_t)count, [&](int64_t k) { fold((uint64_t)k, per); },
               count > GRAIN / 64);
}

template <class F>
struct Plain {  // a block function f(i) in the (i, Stage) shape of the chunk reductions
  F f;
  template <class S>
  auto operator()(uint64_t i, const S&) const { return f(i); }
};

template <bool DIRECT = false, class F>
void block_sum_f32(uint64_t len, uint64_t b, F f, float* out) {
  const uint64_t per = per_block(len, b);
  std::vector<double> part(blocks(len, b) * per, 0.0);
  const Plain<F> fs{f};
  each_block(
      len, b,
      [&](uint64_t k, uint64_t c, uint64_t lo, uint64_t hi) {
        part[k * per + c] = lo < hi ? sum_chunk<DIRECT, uint64_t>(fs, lo, hi, Stage{}) : 0.0;
      },
      [&](uint64_t k, uint64_t chunks) {
        double total = 0.0;
        for (uint64_t c = 0; c < chunks; ++c) total += part[k * per + c];
        out[k] = canonical((float)total);
      });
}

template <class T, class F>
void block_sum_int(uint64_t len, uint64_t b, F f, T* out) {
  const uint64_t per = per_block(len, b);
  std::vector<uint32_t> part(blocks(len, b) * per, 0u);
  each_block(
      len, b,
      [&](uint64_t k, uint64_t c, uint64_t lo, uint64_t hi) {
        uint32_t s = 0;
        for (uint64_t i = lo; i < hi; ++i) s += (uint32_t)f(i);
        part[k * per + c] = s;
      },
      [&](uint64_t k, uint64_t chunks) {
        uint32_t total = 0;
        for (uint64_t c = 0; c < chunks; ++c) total += part[k * per + c];
        out[k] = (T)total;
      });
}

// The min (into lo, when MIN) and max (into hi, when MAX) of every block.
template <bool MIN, bool MAX, bool DIRECT, class F>
void block_extremes_f32(uint64_t len, uint64_t b, F f, float* lo_out, float* hi_out) {
  const uint64_t per = per_block(len, b);
  const uint64_t n = blocks(len, b) * per;
  std::vector<float> mins(n, HP_INF), maxs(n, -HP_INF);
  std::vector<uint8_t> nan_only(n, 1);
  const Plain<F> fs{f};
  each_block(
      len, b,
      [&](uint64_t k, uint64_t c, uint64_t lo, uint64_t hi) {
        const uint64_t j = k * per + c;
        if (lo < hi)
          nan_only[j] = extreme_chunk<MIN, MAX, DIRECT, uint64_t>(fs, lo, hi, Stage{}, mins[j],
                                                                   maxs[j]);
      },
      [&](uint64_t k, uint64_t chunks) {
        // An empty trailing segment keeps the identities and its all-NaN flag of 1, so it
        // changes nothing; only an empty array (one block of none) is no NaN.
        float mn = HP_INF, mx = -HP_INF;
        bool nan = len > 0;
        for (uint64_t c = 0; c < chunks; ++c) {
          const uint64_t j = k * per + c;
          mn = hp_fmin(mn, mins[j]);
          mx = hp_fmax(mx, maxs[j]);
          nan = nan && nan_only[j];
        }
        if constexpr (MIN) lo_out[k] = nan ? HP_NAN : (mn == 0.0f ? 0.0f : mn);
        if constexpr (MAX) hi_out[k] = nan ? HP_NAN : (mx == 0.0f ? 0.0f : mx);
      });
}
template <bool IS_MAX, bool DIRECT = false, class F>
void block_extreme_f32(uint64_t len, uint64_t b, F f, float* out) {
  block_extremes_f32<!IS_MAX, IS_MAX, DIRECT>(len, b, f, out, out);
}
template <bool DIRECT = false, class F>
void block_minmax_f32(uint64_t len, uint64_t b, F f, float* lo, float* hi) {
  block_extremes_f32<true, true, DIRECT>(len, b, f, lo, hi);
}

template <bool IS_MAX, class T, class F>
void block_extreme_int(uint64_t len, uint64_t b, F f, T* out) {
  const T init = IS_MAX ? std::numeric_limits<T>::min() : std::numeric_limits<T>::max();
  const uint64_t per = per_block(len, b);
  std::vector<T> part(blocks(len, b) * per, init);
  each_block(
      len, b,
      [&](uint64_t k, uint64_t c, uint64_t lo, uint64_t hi) {
        T best = init;
        for (uint64_t i = lo; i < hi; ++i) {
          const T v = (T)f(i);
          best = IS_MAX ? (v > best ? v : best) : (v < best ? v : best);
        }
        part[k * per + c] = best;
      },
      [&](uint64_t k, uint64_t chunks) {
        T best = init;
        for (uint64_t c = 0; c < chunks; ++c) {
          const T v = part[k * per + c];
          best = IS_MAX ? (v > best ? v : best) : (v < best ? v : best);
        }
        out[k] = best;
      });
}

// Blocks [k0, k1) alone, for a fused pass's prologue (hp::fused_pro): the same values
// as the whole-array forms above when a block is one segment (b divides SUM_CHUNK).
template <bool DIRECT = false, class F>
void block_sum_f32_range(uint64_t len, uint64_t b, uint64_t k0, uint64_t k1, F f,
                         float* out) {
  const Plain<F> fs{f};
  for (uint64_t k = k0; k < k1; ++k) {
    const uint64_t lo = k * b, hi = std::min(len, lo + b);
    out[k] = canonical((float)(lo < hi ? sum_chunk<DIRECT, uint64_t>(fs, lo, hi, Stage{}) : 0.0));
  }
}

template <class T, class F>
void block_sum_int_range(uint64_t len, uint64_t b, uint64_t k0, uint64_t k1, F f, T* out) {
  for (uint64_t k = k0; k < k1; ++k) {
    uint32_t s = 0;
    for (uint64_t i = k * b, hi = std::min(len, k * b + b); i < hi; ++i) s += (uint32_t)f(i);
    out[k] = (T)s;
  }
}

template <bool MIN, bool MAX, bool DIRECT, class F>
void block_extremes_f32_range(uint64_t len, uint64_t b, uint64_t k0, uint64_t k1, F f,
                              float* lo_out, float* hi_out) {
  const Plain<F> fs{f};
  for (uint64_t k = k0; k < k1; ++k) {
    const uint64_t lo = k * b, hi = std::min(len, lo + b);
    float mn = HP_INF, mx = -HP_INF;
    const bool nan = lo < hi ? extreme_chunk<MIN, MAX, DIRECT, uint64_t>(fs, lo, hi, Stage{},
                                                                         mn, mx)
                             : len > 0;
    if constexpr (MIN) lo_out[k] = nan ? HP_NAN : (mn == 0.0f ? 0.0f : mn);
    if constexpr (MAX) hi_out[k] = nan ? HP_NAN : (mx == 0.0f ? 0.0f : mx);
  }
}
template <bool IS_MAX, bool DIRECT = false, class F>
void block_extreme_f32_range(uint64_t len, uint64_t b, uint64_t k0, uint64_t k1, F f,
                             float* out) {
  block_extremes_f32_range<!IS_MAX, IS_MAX, DIRECT>(len, b, k0, k1, f, out, out);
}
template <bool DIRECT = false, class F>
void block_minmax_f32_range(uint64_t len, uint64_t b, uint64_t k0, uint64_t k1, F f,
                            float* lo, float* hi) {
  block_extremes_f32_range<true, true, DIRECT>(len, b, k0, k1, f, lo, hi);
}

template <bool IS_MAX, class T, class F>
void block_extreme_int_range(uint64_t len, uint64_t b, uint64_t k0, uint64_t k1, F f,
                             T* out) {
  for (uint64_t k = k0; k < k1; ++k) {
    T best = IS_MAX ? std::numeric_limits<T>::min() : std::numeric_limits<T>::max();
    for (uint64_t i = k * b, hi = std::min(len, k * b + b); i < hi; ++i) {
      const T v = (T)f(i);
      best = IS_MAX ? (v > best ? v : best) : (v < best ? v : best);
    }
    out[k] = best;
  }
}

// A lazy array of one value per block, evaluated for blocks [k0, k1) (a prologue's).
template <class T, class F>
void fill_range(T* out, uint64_t k0, uint64_t k1, F f) {
  for (uint64_t k = k0; k < k1; ++k) out[k] = (T)f(k);
}

}  // namespace hp
