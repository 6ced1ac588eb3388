// Building blocks for CompLL's C++ target, run on the threads of cpu_pool.h. Element values come from lazily
// evaluated lambdas `f(i)`, so elementwise chains fuse into the loops below.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#define HP_BITCOPY(dst, src, n) std::memcpy((dst), (src), (n))
#define HP_FN static inline
#include "hp_constants.h"
#include "common.h"
#include "host.h"
#include "cpu_pool.h"

static_assert(sizeof(float) == 4 && sizeof(double) == 8, "IEEE floats expected");

namespace hp {

template <class T>
using buffer = std::vector<T>;

// SUM_CHUNK, GRAIN, GROUP_LIMIT and the rest come from compll/constants.py (hp_constants.h).
// Group loops count in 32 bits, bounded by GROUP_LIMIT: a 64-bit bound made GCC load the
// elements one by one.

inline float canonical(float x) { return hp_isnan(x) ? HP_NAN : x; }

// ---- fused passes -------------------------------------------------------------------------
// hp::fused(len, op1, op2, ...) runs several loop operations over the same elements in
// one parallel pass, chunk by chunk (SUM_CHUNK elements, which fit in L1/L2), so the
// input is read from memory once. Each op has start(len, chunks), chunk(lo, hi, c) and
// finish(). Chunks are also the unit of the defined float-sum order.
//
// Inside a chunk, element loops count in 32 bits: a codec call holds fewer than 2^32
// elements (the kernels refuse more), and with a 64-bit counter every vectorised loop
// carried 64-bit index lanes, which doubled the cost of the counter-based RNG.

// Packed arrays that a pass reads are unpacked chunk by chunk into L1-resident bytes,
// so element functions read st.p[k][i - st.lo]: a contiguous, vectorisable load.
// Blockwise f32 arrays that the pass expands (one value per block of xblock[k] elements;
// 0: one value for all) are likewise filled into L1 per chunk: st.ex(k, i) is a contiguous
// load where reading value i / B was a gather that stopped the loops vectorising.
struct Unpacks {
  const uint8_t* src[MAX_STAGED];
  uint32_t bits[MAX_STAGED];
  int count;
  const uint8_t* xsrc[MAX_STAGED];
  uint64_t xblock[MAX_STAGED];
  int xcount;
};
struct Stage {
  const uint8_t* p[MAX_STAGED];
  const float* x[MAX_STAGED];
  uint64_t lo;
  uint8_t get(int k, uint64_t i) const { return p[k][i - lo]; }
  float ex(int k, uint64_t i) const { return x[k][i - lo]; }
};
// One block of a chunk, for passes whose expanded arrays share one block size: each is a
// single value here, which the element loops keep in a register (no staging, no gather).
struct BlockStage : Stage {
  float xv[MAX_STAGED];
  float ex(int k, uint64_t) const { return xv[k]; }
};

inline void expand_chunk(float* dst, const uint8_t* src, uint64_t block, uint64_t lo,
                         uint64_t hi) {
  for (uint64_t i = lo; i < hi;) {
    const uint64_t k = block ? i / block : 0;
    const uint64_t end = block ? std::min(hi, (k + 1) * block) : hi;
    float v;
    std::memcpy(&v, src + 4 * k, 4);
    std::fill(dst + (i - lo), dst + (end - lo), v);
    i = end;
  }
}

template <uint32_t BITS>
inline void unpack_bits(uint8_t* dst, const uint8_t* s, uint64_t len) {
  constexpr uint32_t per = 8 / BITS, mask = (1u << BITS) - 1u;
  const uint64_t full = len / per;
  if (BITS == 2) {  // one input byte -> one 32-bit word of four outputs
    for (uint64_t b = 0; b < full; ++b) {
      const uint32_t x = s[b];
      const uint32_t w = (x & 3u) | ((x << 6) & 0x300u) | ((x << 12) & 0x30000u) |
                         ((x << 18) & 0x3000000u);
      std::memcpy(dst + 4 * b, &w, 4);
    }
  } else if (BITS == 4) {
    for (uint64_t b = 0; b < full; ++b) {
      const uint16_t x = s[b];
      const uint16_t w = (uint16_t)((x & 0xFu) | ((x << 4) & 0xF00u));
      std::memcpy(dst + 2 * b, &w, 2);
    }
  } else if (BITS == 1) {  // one input byte -> one 64-bit word of eight 0/1 bytes
    for (uint64_t b = 0; b < full; ++b) {
      // Copy the byte into every byte, keep bit k in byte k, then carry a non-zero byte
      // into its top bit (no byte overflows into the next) and move that to bit 0.
      const uint64_t t = ((uint64_t)s[b] * 0x0101010101010101ull) & 0x8040201008040201ull;
      const uint64_t w = ((t + 0x7F7F7F7F7F7F7F7Full) >> 7) & 0x0101010101010101ull;
      std::memcpy(dst + 8 * b, &w, 8);
    }
  } else {
    for (uint64_t b = 0; b < full; ++b)
      for (uint32_t k = 0; k < per; ++k) dst[b * per + k] = (uint8_t)((s[b] >> (k * BITS)) & mask);
  }
  for (uint64_t i = full * per; i < len; ++i)
    dst[i] = (uint8_t)((s[i / per] >> ((i % per) * BITS)) & mask);
}

inline void unpack_chunk(uint8_t* dst, const uint8_t* src, uint64_t lo, uint64_t hi,
                         uint32_t bits) {
  const uint8_t* s = src + lo * bits / 8;  // lo is a multiple of SUM_CHUNK: byte aligned
  const uint64_t len = hi - lo;
  switch (bits) {
    case 1: unpack_bits<1>(dst, s, len); break;
    case 2: unpack_bits<2>(dst, s, len); break;
    case 4: unpack_bits<4>(dst, s, len); break;
    default: std::memcpy(dst, s, len);
  }
}

// pro(lo, hi) runs first on each chunk: a blockwise reduction fused into the pass
// computes the values of the chunk's blocks there, while its elements are in cache, so
// the input is read from memory once (blocks divide SUM_CHUNK, so no block spans chunks).
// BLOCKS (the renderer's choice): the ops need no more than their elements (stores,
// packs, the output) and every expanded array has one block size that divides a chunk
// and holds whole bytes of packed bits (a multiple of 8). Then they run block by block,
// each expanded array one value per block.
template <bool BLOCKS, class Pro, class... Ops>
void fused_pro(uint64_t len, Pro pro, Unpacks u, Ops&&... ops) {
  const int64_t chunks = (int64_t)((len + SUM_CHUNK - 1) / SUM_CHUNK);
  (ops.start(len, chunks), ...);
  const uint64_t bs = u.xcount > 0 ? u.xblock[0] : 0;
  parallel((int)std::min<int64_t>(team_size(), chunks), [&](int t, int nt) {
    alignas(64) uint8_t staged[MAX_STAGED][SUM_CHUNK];
    std::vector<float> expanded((size_t)u.xcount * SUM_CHUNK);
    const auto [first, last] = static_range(chunks, t, nt);
    for (int64_t c = first; c < last; ++c) {
      const uint64_t lo = (uint64_t)c * SUM_CHUNK;
      const uint64_t hi = std::min(len, lo + SUM_CHUNK);
      pro(lo, hi);
      Stage st;
      st.lo = lo;
      for (int k = 0; k < u.count; ++k) {
        unpack_chunk(staged[k], u.src[k], lo, hi, u.bits[k]);
        st.p[k] = staged[k];
      }
      if constexpr (BLOCKS && (std::decay_t<Ops>::split && ...)) {
        if (bs > 0) {
          BlockStage b;
          static_cast<Stage&>(b) = st;
          for (uint64_t s = lo; s < hi; s += bs) {
            const uint64_t e = std::min(hi, s + bs);
            for (int k = 0; k < u.xcount; ++k) std::memcpy(&b.xv[k], u.xsrc[k] + 4 * (s / bs), 4);
            (ops.chunk(s, e, c, b), ...);
          }
          continue;
        }
      }
      for (int k = 0; k < u.xcount; ++k) {
        expand_chunk(expanded.data() + (size_t)k * SUM_CHUNK, u.xsrc[k], u.xblock[k], lo, hi);
        st.x[k] = expanded.data() + (size_t)k * SUM_CHUNK;
      }
      (ops.chunk(lo, hi, c, st), ...);
    }
  });
  (ops.finish(), ...);
}

template <bool BLOCKS = false, class... Ops>
void fused(uint64_t len, Unpacks u, Ops&&... ops) {
  fused_pro<BLOCKS>(len, [](uint64_t, uint64_t) {}, u, std::forward<Ops>(ops)...);
}

// Reductions and packings evaluate elements into an L1-resident buffer first: that loop
// vectorises (element functions are branch-free expressions), and the reduction or
// packing that follows reads contiguous values.
template <class T, class F, class S>
inline void eval_chunk(T* buf, uint64_t lo, uint64_t hi, const F& f, const S& st) {
  for (uint32_t i = (uint32_t)lo; i < (uint32_t)hi; ++i) buf[i - lo] = (T)f(i, st);
}

typedef double hp_d8 __attribute__((vector_size(64)));
typedef float hp_f8 __attribute__((vector_size(32)));
typedef uint32_t hp_u8 __attribute__((vector_size(32)));

// A reduction that watches g (the non-finite flag without a residual) keeps, beside its
// own lanes, the largest magnitude's bits of the eight elements of g at the same index;
// a magnitude's bits reach the exponent's all-ones only for an infinity or a NaN.
struct Watch {
  const float* g = nullptr;  // null: not watching
  uint32_t* flag = nullptr;
  hp_u8 top{};
  template <class I>
  void vec(I at) {
    hp_u8 u;
    std::memcpy(&u, g + at, 32);
    u &= 0x7FFFFFFFu;
    top = top > u ? top : u;
  }
  template <class I>
  void one(I at) {
    const uint32_t m = hp_f2u(g[at]) & 0x7FFFFFFFu;
    top[0] = top[0] > m ? top[0] : m;
  }
  void done() const {
    uint32_t m = 0;
    for (int l = 0; l < 8; ++l) m = top[l] > m ? top[l] : m;
    if (m >= 0x7F800000u) __atomic_store_n(flag, 1u, __ATOMIC_RELAXED);
  }
};
typedef uint8_t hp_u8x32 __attribute__((vector_size(32)));
typedef char hp_i8x32 __attribute__((vector_size(32)));

// Reductions evaluate SUB_BLOCK elements at a time into a buffer that stays in L1, then
// reduce it: loads of the next block overlap the arithmetic on this one (a whole chunk
// evaluated first made the two phases take turns).

// Float sum in the defined order (compll/interpreter.py _sum_f32): lane l = i mod 32
// within a chunk; per SUB_BLOCK, each lane adds its 16 elements in f32 and the partial is
// widened into the lane's f64 total; adjacent lanes combine pairwise up a tree; chunks
// add in order; the total rounds once to f32. The 32 lanes are four 8-wide vectors.
//
// DIRECT (the renderer's choice, for element functions of loads, +, -, *, comparisons,
// abs and selects) fills each vector from f itself, 8 calls the compiler turns into vector
// operations, and saves the staging buffer's store and reload. Other functions (the RNG,
// casts, divisions) only vectorise as a loop, so they are staged.
// One chunk of SumF32: the f64 total of f over [lo, hi) in the defined order, lanes
// counted from lo.
// I is the DIRECT loops' index: 32 bits in fused passes (see above); blockwise reductions
// use 64, with which GCC keeps the eight loads of a vector one load inside their loop.
template <bool DIRECT, class I = uint32_t, bool WATCH = false, class F, class S>
inline double sum_chunk(const F f, uint64_t lo, uint64_t hi, const S& st,
                        Watch* watch = nullptr) {
  hp_d8 acc[4];
  for (hp_d8& a : acc) a = hp_d8{0, 0, 0, 0, 0, 0, 0, 0};
  for (uint64_t s = lo; s < hi; s += SUB_BLOCK) {
    const uint64_t len = std::min<uint64_t>(SUB_BLOCK, hi - s);
    hp_f8 p[4];
    for (hp_f8& v : p) v = hp_f8{0, 0, 0, 0, 0, 0, 0, 0};
    const uint64_t whole = len / 32 * 32;
    if constexpr (DIRECT) {
      const I s32 = (I)s;
      for (I j = 0; j < (I)whole; j += 32) {
        for (int k = 0; k < 4; ++k) {
          hp_f8 x;
          for (I l = 0; l < 8; ++l) x[l] = f(s32 + j + 8 * k + l, st);
          p[k] += x;
          if constexpr (WATCH) watch->vec(s32 + j + 8 * k);
        }
      }
      // Only the chunk's last block can end in a partial group of 32: its elements
      // come last in their lanes.
      for (I l = 0; whole + l < len; ++l) {
        p[l / 8][l % 8] += f(s32 + (I)whole + l, st);
        if constexpr (WATCH) watch->one(s32 + (I)whole + l);
      }
    } else {
      alignas(64) float buf[SUB_BLOCK];
      eval_chunk(buf, s, s + len, f, st);
      for (uint64_t j = 0; j < whole; j += 32) {
        for (int k = 0; k < 4; ++k) {
          hp_f8 x;
          std::memcpy(&x, buf + j + 8 * k, 32);
          p[k] += x;
        }
      }
      for (uint64_t l = 0; whole + l < len; ++l) p[l / 8][l % 8] += buf[whole + l];
    }
    for (int k = 0; k < 4; ++k) acc[k] += __builtin_convertvector(p[k], hp_d8);
  }
  // The lane tree's first two levels in vectors (lane 8k + m is acc[k][m]): the same
  // pairwise adds, which a scalar tree made as costly as a small block's elements.
  const hp_d8 w0 = __builtin_shufflevector(acc[0], acc[1], 0, 2, 4, 6, 8, 10, 12, 14) +
                   __builtin_shufflevector(acc[0], acc[1], 1, 3, 5, 7, 9, 11, 13, 15);
  const hp_d8 w1 = __builtin_shufflevector(acc[2], acc[3], 0, 2, 4, 6, 8, 10, 12, 14) +
                   __builtin_shufflevector(acc[2], acc[3], 1, 3, 5, 7, 9, 11, 13, 15);
  const hp_d8 v = __builtin_shufflevector(w0, w1, 0, 2, 4, 6, 8, 10, 12, 14) +
                  __builtin_shufflevector(w0, w1, 1, 3, 5, 7, 9, 11, 13, 15);
  double lane[8];
  for (int m = 0; m < 8; ++m) lane[m] = v[m];
  for (int width = 4; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) lane[l] = lane[2 * l] + lane[2 * l + 1];
  return lane[0];
}

template <class F, bool DIRECT>
struct SumF32 {
  static constexpr bool split = false;  // may run block by block
  F f;
  float* out;
  const float* watch;  // g, when this sum also flags it (DIRECT only)
  uint32_t* flag;
  std::vector<double> part;
  void start(uint64_t, int64_t chunks) { part.assign((size_t)chunks, 0.0); }
  template <class S>
  void chunk(uint64_t lo, uint64_t hi, int64_t c, const S& st) {
    if constexpr (DIRECT) {
      if (watch) {
        Watch w{watch, flag};
        part[(size_t)c] = sum_chunk<DIRECT, uint32_t, true>(this->f, lo, hi, st, &w);
        w.done();
        return;
      }
    }
    part[(size_t)c] = sum_chunk<DIRECT>(this->f, lo, hi, st);
  }
  void finish() {
    double total = 0.0;
    for (double p : part) total += p;
    *out = canonical((float)total);
  }
};
template <bool DIRECT = false, class F>
SumF32<F, DIRECT> sum_f32(F f, float* out, const float* watch = nullptr,
                          uint32_t* flag = nullptr) {
  return {f, out, watch, flag, {}};
}

// Integer and bool sums wrap modulo 2^32: every CompLL integer type has at most 32 bits,
// so these are the low bits of the interpreter's exact sum. No buffer: the loop vectorises.
template <class T, class F>
struct SumInt {
  static constexpr bool split = false;  // may run block by block
  F f;
  T* out;
  std::vector<uint32_t> part;
  void start(uint64_t, int64_t chunks) { part.assign((size_t)chunks, 0u); }
  template <class S>
  void chunk(uint64_t lo, uint64_t hi, int64_t c, const S& st) {
    const F f = this->f;
    uint32_t s = 0;
    for (uint32_t i = (uint32_t)lo; i < (uint32_t)hi; ++i) s += (uint32_t)f(i, st);
    part[(size_t)c] = s;
  }
  void finish() {
    uint32_t total = 0;
    for (uint32_t p : part) total += p;
    *out = (T)total;
  }
};
template <class T, class F>
SumInt<T, F> sum_int(F f, T* out) { return {f, out, {}}; }

// max/min over floats ignore NaN; a zero result is +0; all-NaN gives the canonical NaN;
// empty gives -inf / +inf. MIN and MAX say which the op computes: both (minmax8's min and
// max of the gradient, ``minmax_f32``) share one evaluation of f. DIRECT as for SumF32.
inline hp_f8 hp_vmin(hp_f8 v, hp_f8 a) { return v < a ? v : a; }
inline hp_f8 hp_vmax(hp_f8 v, hp_f8 a) { return v > a ? v : a; }

// One chunk of ExtremeF32: the NaN-ignoring min (MIN) and max (MAX) of f over [lo, hi)
// into bmin / bmax (still +-inf when every element is NaN); returns whether all are NaN.
template <bool MIN, bool MAX, bool DIRECT, class I = uint32_t, bool WATCH = false, class F,
          class S>
inline bool extreme_chunk(const F f, uint64_t lo, uint64_t hi, const S& st, float& min_out,
                          float& max_out, Watch* watch = nullptr) {
  // Four independent 8-lane accumulators per result, so the loop runs at load speed
  // rather than at the latency of one chain of compares. A NaN never wins a
  // comparison, so it is skipped with no extra work; max/min of the rest is order-free
  // (a zero result is made +0 at the end).
  hp_f8 mn[4], mx[4];
  for (int k = 0; k < 4; ++k) {
    mn[k] = hp_f8{HP_INF, HP_INF, HP_INF, HP_INF, HP_INF, HP_INF, HP_INF, HP_INF};
    mx[k] = -mn[k];
  }
  float bmin = HP_INF, bmax = -HP_INF;
  auto group = [&](const hp_f8& v, int k) {
    if constexpr (MIN) mn[k] = hp_vmin(v, mn[k]);
    if constexpr (MAX) mx[k] = hp_vmax(v, mx[k]);
  };
  auto one = [&](float x) {
    if constexpr (MIN) bmin = hp_fmin(bmin, x);
    if constexpr (MAX) bmax = hp_fmax(bmax, x);
  };
  if constexpr (DIRECT) {
    I i = (I)lo;
    const I lim = (I)std::min<uint64_t>(hi, GROUP_LIMIT);
    for (; i + 32 <= lim; i += 32) {
      for (int k = 0; k < 4; ++k) {
        hp_f8 v;
        for (I l = 0; l < 8; ++l) v[l] = f(i + 8 * k + l, st);
        group(v, k);
        if constexpr (WATCH) watch->vec(i + 8 * k);
      }
    }
    for (; i < (I)hi; ++i) {
      one((float)f(i, st));
      if constexpr (WATCH) watch->one(i);
    }
  } else {
    alignas(64) float buf[SUB_BLOCK];
    for (uint64_t s = lo; s < hi; s += SUB_BLOCK) {
      const uint64_t len = std::min<uint64_t>(SUB_BLOCK, hi - s);
      eval_chunk(buf, s, s + len, f, st);
      uint64_t j = 0;
      for (; j + 32 <= len; j += 32) {
        for (int k = 0; k < 4; ++k) {
          hp_f8 v;
          std::memcpy(&v, buf + j + 8 * k, 32);
          group(v, k);
        }
      }
      for (; j < len; ++j) one(buf[j]);
    }
  }
  // The accumulators hold no NaN (a NaN never wins), so they combine lane by lane first.
  const hp_f8 vmn = hp_vmin(hp_vmin(mn[0], mn[1]), hp_vmin(mn[2], mn[3]));
  const hp_f8 vmx = hp_vmax(hp_vmax(mx[0], mx[1]), hp_vmax(mx[2], mx[3]));
  for (int l = 0; l < 8; ++l) {
    if constexpr (MIN) bmin = hp_fmin(bmin, vmn[l]);
    if constexpr (MAX) bmax = hp_fmax(bmax, vmx[l]);
  }
  // Only a chunk whose results are still the initial values can be all NaN: count then.
  uint64_t nans = 0;
  if ((!MIN || bmin == HP_INF) && (!MAX || bmax == -HP_INF))
    for (uint64_t i = lo; i < hi; ++i) nans += hp_isnan((float)f(i, st));
  min_out = bmin;
  max_out = bmax;
  return nans == hi - lo;
}

template <bool MIN, bool MAX, class F, bool DIRECT>
struct ExtremeF32 {
  static constexpr bool split = false;  // may run block by block
  F f;
  float* lo_out;  // when MIN
  float* hi_out;  // when MAX
  const float* watch;  // g, when this reduction also flags it (DIRECT only)
  uint32_t* flag;
  std::vector<float> lo_part, hi_part;
  std::vector<uint8_t> all_nan;
  void start(uint64_t, int64_t chunks) {
    lo_part.assign((size_t)chunks, HP_INF);
    hi_part.assign((size_t)chunks, -HP_INF);
    all_nan.assign((size_t)chunks, 1);
  }
  template <class S>
  void chunk(uint64_t lo, uint64_t hi, int64_t c, const S& st) {
    if constexpr (DIRECT) {
      if (watch) {
        Watch w{watch, flag};
        all_nan[(size_t)c] = extreme_chunk<MIN, MAX, DIRECT, uint32_t, true>(
            this->f, lo, hi, st, lo_part[(size_t)c], hi_part[(size_t)c], &w);
        w.done();
        return;
      }
    }
    all_nan[(size_t)c] = extreme_chunk<MIN, MAX, DIRECT>(this->f, lo, hi, st,
                                                       lo_part[(size_t)c], hi_part[(size_t)c]);
  }
  void finish() {
    float bmin = HP_INF, bmax = -HP_INF;
    bool nan_only = !lo_part.empty();
    for (size_t c = 0; c < lo_part.size(); ++c) {
      bmin = hp_fmin(bmin, lo_part[c]);
      bmax = hp_fmax(bmax, hi_part[c]);
      nan_only = nan_only && all_nan[c];
    }
    if constexpr (MIN) *lo_out = nan_only ? HP_NAN : (bmin == 0.0f ? 0.0f : bmin);
    if constexpr (MAX) *hi_out = nan_only ? HP_NAN : (bmax == 0.0f ? 0.0f : bmax);
  }
};
template <bool IS_MAX, bool DIRECT = false, class F>
ExtremeF32<!IS_MAX, IS_MAX, F, DIRECT> extreme_f32(F f, float* out,
                                                   const float* watch = nullptr,
                                                   uint32_t* flag = nullptr) {
  return {f, IS_MAX ? nullptr : out, IS_MAX ? out : nullptr, watch, flag, {}, {}, {}};
}
template <bool DIRECT = false, class F>
ExtremeF32<true, true, F, DIRECT> minmax_f32(F f, float* lo, float* hi,
                                             const float* watch = nullptr,
                                             uint32_t* flag = nullptr) {
  return {f, lo, hi, watch, flag, {}, {}, {}};
}

template <bool IS_MAX, class T, class F>
struct ExtremeInt {
  static constexpr bool split = false;  // may run block by block
  F f;
  T* out;
  std::vector<T> part;
  static T init() { return IS_MAX ? std::numeric_limits<T>::min() : std::numeric_limits<T>::max(); }
  void start(uint64_t, int64_t chunks) { part.assign((size_t)chunks, init()); }
  template <class S>
  void chunk(uint64_t lo, uint64_t hi, int64_t c, const S& st) {
    alignas(64) T buf[SUM_CHUNK];
    eval_chunk(buf, lo, hi, f, st);
    T best = init();
    for (uint64_t i = 0; i < hi - lo; ++i) best = IS_MAX ? (buf[i] > best ? buf[i] : best)
                                                         : (buf[i] < best ? buf[i] : best);
    part[(size_t)c] = best;
  }
  void finish() {
    T best = init();
    for (T p : part) best = IS_MAX ? (p > best ? p : best) : (p < best ? p : best);
    *out = best;
  }
};
template <bool IS_MAX, class T, class F>
ExtremeInt<IS_MAX, T, F> extreme_int(F f, T* out) { return {f, out, {}}; }

// Bit packing a chunk (little-endian: element i at bit i*BITS). Chunks start at
// multiples of SUM_CHUNK elements, so at whole 64-bit words.
// Evaluate f over [lo, hi) into dst[i - lo] as bytes (masked), and with WATCH also the
// largest magnitude's bits of watch[lo, hi): the non-finite flag of g in the same loop.
template <bool WATCH, class F, class S>
inline uint32_t bytes_of(uint8_t* dst, uint8_t mask, uint64_t lo, uint64_t hi, const F& f,
                         const S& st, const float* watch) {
  uint32_t top = 0;
  for (uint32_t i = (uint32_t)lo; i < (uint32_t)hi; ++i) {
    dst[i - lo] = (uint8_t)((uint8_t)f(i, st) & mask);
    if constexpr (WATCH) {
      const uint32_t m = hp_f2u(watch[i]) & 0x7FFFFFFFu;
      top = m > top ? m : top;
    }
  }
  return top;
}

inline void raise_if(uint32_t top, uint32_t* flag) {
  if (top >= 0x7F800000u) __atomic_store_n(flag, 1u, __ATOMIC_RELAXED);
}

template <int BITS, class F>
struct Pack {
  static constexpr bool split = true;  // may run block by block
  uint8_t* dst;
  F f;
  const float* watch;  // g, when this pack also flags it
  uint32_t* flag;
  void start(uint64_t, int64_t) {}
  template <class S>
  void chunk(uint64_t lo, uint64_t hi, int64_t, const S& st) {
    constexpr uint32_t per = 8 / BITS;  // elements per byte
    constexpr uint8_t mask = (uint8_t)((1u << BITS) - 1u);
    const uint64_t len = hi - lo;
    uint8_t* out = dst + lo * BITS / 8;
    const F f = this->f;
    if (BITS == 8) {  // straight into the payload (a bounce buffer cost a memcpy per chunk)
      if (watch)
        raise_if(bytes_of<true>(out, 0xFF, lo, hi, f, st, watch), flag);
      else
        bytes_of<false>(out, 0xFF, lo, hi, f, st, watch);
      return;
    }
    alignas(64) uint8_t v[SUM_CHUNK + 64];
    // one vectorised loop from element values to masked bytes
    if (watch)
      raise_if(bytes_of<true>(v, mask, lo, hi, f, st, watch), flag);
    else
      bytes_of<false>(v, mask, lo, hi, f, st, watch);
    for (uint64_t i = len; i < len + 64; ++i) v[i] = 0;
    uint64_t b = 0;
#ifdef __AVX2__
    if (BITS == 1) {  // 32 bits at a time: move each 0/1 byte's bit 0 to the sign bit
      for (; (b + 4) * 8 <= len; b += 4) {
        hp_u8x32 x;  // the builtin behind _mm256_movemask_epi8: <immintrin.h> alone takes
        std::memcpy(&x, v + b * 8, 32);  // about a second to parse, a fifth of a build
        const uint32_t bits = (uint32_t)__builtin_ia32_pmovmskb256((hp_i8x32)(x << 7));
        std::memcpy(out + b, &bits, 4);
      }
    }
#endif
    if (BITS == 2 || BITS == 4) {  // per output byte, one 32- or 16-bit word of inputs
      const uint64_t whole = len / per;
      for (; b < whole; ++b) {
        if (BITS == 2) {
          uint32_t w;
          std::memcpy(&w, v + 4 * b, 4);
          out[b] = (uint8_t)((w & 0x3u) | ((w >> 6) & 0xCu) | ((w >> 12) & 0x30u) |
                             ((w >> 18) & 0xC0u));
        } else {
          uint16_t w;
          std::memcpy(&w, v + 2 * b, 2);
          out[b] = (uint8_t)((w & 0xFu) | ((w >> 4) & 0xF0u));
        }
      }
    }
    const uint64_t bytes = (len * BITS + 7) / 8;
    for (; b < bytes; ++b) {
      uint8_t byte = 0;
      for (uint32_t k = 0; k < per; ++k) byte |= (uint8_t)(v[b * per + k] << (k * BITS));
      out[b] = byte;
    }
  }
  void finish() {}
};
template <int BITS, class F>
Pack<BITS, F> pack(uint8_t* dst, F f, const float* watch = nullptr, uint32_t* flag = nullptr) {
  return {dst, f, watch, flag};
}

// Store a lazily computed array of T into a payload section (8-byte aligned).
template <class T, class F>
struct Store {
  static constexpr bool split = true;  // may run block by block
  uint8_t* dst;
  F f;
  const float* watch;  // g, when this store also flags it
  uint32_t* flag;
  void start(uint64_t, int64_t) {}
  template <class S>
  void chunk(uint64_t lo, uint64_t hi, int64_t, const S& st) {
    T* out = reinterpret_cast<T*>(dst) + lo;
    if (!watch) {
      eval_chunk(out, lo, hi, f, st);
      return;
    }
    const F f = this->f;
    const float* w = watch;
    uint32_t top = 0;
    for (uint32_t i = (uint32_t)lo; i < (uint32_t)hi; ++i) {
      out[i - lo] = (T)f(i, st);
      const uint32_t m = hp_f2u(w[i]) & 0x7FFFFFFFu;
      top = m > top ? m : top;
    }
    raise_if(top, flag);
  }
  void finish() {}
};
template <class T, class F>
Store<T, F> store(uint8_t* dst, F f, const float* watch = nullptr, uint32_t* flag = nullptr) {
  return {dst, f, watch, flag};
}

// The decoded tensor: out[i] = scale * f(i), or out[i] += scale * f(i) when
// accumulating (a scale of 1 multiplies nothing, so values stay bit-exact), or, with
// feedback (error feedback's residual), out[i] += scale * f(i), set to 0 if not finite.
template <class F>
struct WriteOut {
  static constexpr bool split = true;  // may run block by block
  float* out;
  int accumulate;
  float scale;
  int feedback;
  F f;
  void start(uint64_t, int64_t) {}
  template <class S>
  void chunk(uint64_t lo, uint64_t hi, int64_t, const S& st) {
    const F f = this->f;  // a local copy: stores to out cannot alias its captures
    float* const o = this->out;
    const float s = scale;
    const uint32_t l32 = (uint32_t)lo, h32 = (uint32_t)hi;
    if (feedback) {
      for (uint32_t i = l32; i < h32; ++i) {
        const float v = o[i] + s * f(i, st);
        o[i] = hp_isfinite(v) ? v : 0.0f;
      }
    } else if (s == 1.0f) {
      if (accumulate) {
        for (uint32_t i = l32; i < h32; ++i) o[i] = o[i] + f(i, st);
      } else {
        for (uint32_t i = l32; i < h32; ++i) o[i] = f(i, st);
      }
    } else if (accumulate) {
      for (uint32_t i = l32; i < h32; ++i) o[i] = o[i] + s * f(i, st);
    } else {
      for (uint32_t i = l32; i < h32; ++i) o[i] = s * f(i, st);
    }
  }
  void finish() {}
};
template <class F>
WriteOut<F> write_out(float* out, int accumulate, float scale, int feedback, F f) {
  return {out, accumulate, scale, feedback, f};
}

// What an encoder does to r first when a deferred residual update is owed: settle(lo, hi)
// subtracts the previous payload's values from r[lo..hi), chunk by chunk, inside the pass
// that then adds g there (the encoder's first pass over r: r is read and written once
// per step instead of twice). The default owes nothing. A function pointer, not a template
// parameter: the encoder is compiled once, and it is called once per chunk.
struct Settle {
  void (*fn)(const void*, uint64_t, uint64_t) = nullptr;
  const void* ctx = nullptr;
  void operator()(uint64_t lo, uint64_t hi) const {
    if (fn) fn(ctx, lo, hi);
  }
  template <class F>
  static Settle of(const F& f) {
    return {[](const void* c, uint64_t lo, uint64_t hi) { (*static_cast<const F*>(c))(lo, hi); },
            &f};
  }
};

// r[i] += g[i], in parallel (error feedback adds the gradient into its residual), each
// chunk settled first.
inline void add_into(float* r, const float* g, uint64_t n, const Settle& settle = Settle{}) {
  const int64_t chunks = (int64_t)((n + SUM_CHUNK - 1) / SUM_CHUNK);
  parallel_for(chunks, [&](int64_t c) {
    const uint64_t lo = (uint64_t)c * SUM_CHUNK, hi = std::min(n, lo + SUM_CHUNK);
    settle(lo, hi);
    for (uint32_t i = (uint32_t)lo; i < (uint32_t)hi; ++i) r[i] = r[i] + g[i];
  });
}

// ---- the encoder's first read of g, and the non-finite flag -------------------------------
// The encoder's first read of its input adds g into the residual r (error feedback) and
// notes whether any value it leaves for the encoder, r + g or g, is NaN or infinite:
// the payload header then carries NONFINITE (mark_nonfinite) and every decoder writes NaN
// (poison), so the signal crosses any codec. With a residual the flag reads what the add
// just wrote; without one, the last op of the pass reads the chunk the other ops brought
// into cache (CheckInput): a first op would wait on memory with nothing to overlap.
struct Flag {
  uint32_t v = 0;
  uint32_t* ptr() { return &v; }
};

// Whether x[lo..hi) holds a NaN or an infinity: the largest magnitude's bits reach the
// exponent's all-ones (an integer max: associative, so the loop vectorises).
inline bool any_nonfinite(const float* x, uint64_t lo, uint64_t hi) {
  uint32_t top = 0;
  for (uint32_t i = (uint32_t)lo; i < (uint32_t)hi; ++i) {
    const uint32_t m = hp_f2u(x[i]) & 0x7FFFFFFFu;
    top = m > top ? m : top;
  }
  return top >= 0x7F800000u;
}

// Chunks run on several threads; any that finds a non-finite value stores the same 1 (a
// relaxed atomic store, no read-modify-write).
inline void raise_flag(uint32_t* flag) { __atomic_store_n(flag, 1u, __ATOMIC_RELAXED); }

// One chunk of the take: settle, add, flag the sum; without r, flag g.
inline void take_chunk(float* r, const float* g, uint32_t* flag, const Settle& settle,
                       uint64_t lo, uint64_t hi) {
  if (!r) {
    if (any_nonfinite(g, lo, hi)) raise_flag(flag);
    return;
  }
  settle(lo, hi);
  uint32_t top = 0;
  for (uint32_t i = (uint32_t)lo; i < (uint32_t)hi; ++i) {
    const float v = r[i] + g[i];
    r[i] = v;
    const uint32_t m = hp_f2u(v) & 0x7FFFFFFFu;
    top = m > top ? m : top;
  }
  if (top >= 0x7F800000u) raise_flag(flag);
}

// The take as a loop of its own (encoders whose first read of g is not a pass over n);
// without r it flags g only when checks (else a later pass does, CheckInput).
inline void take_input(float* r, const float* g, uint64_t n, uint32_t* flag, bool checks,
                       const Settle& settle = Settle{}) {
  if (!r && !checks) return;
  const int64_t chunks = (int64_t)((n + SUM_CHUNK - 1) / SUM_CHUNK);
  parallel_for(chunks, [&](int64_t c) {
    const uint64_t lo = (uint64_t)c * SUM_CHUNK;
    take_chunk(r, g, flag, settle, lo, std::min(n, lo + SUM_CHUNK));
  });
}

// The take as the first op of the encoder's first pass over its input: each chunk is
// settled and added while the pass holds it in cache, and the ops after it read the sum.
struct TakeInput {
  static constexpr bool split = true;  // may run block by block
  float* r;
  const float* g;
  uint32_t* flag;
  Settle settle;
  void start(uint64_t, int64_t) {}
  template <class S>
  void chunk(uint64_t lo, uint64_t hi, int64_t, const S&) {
    if (r) take_chunk(r, g, flag, settle, lo, hi);
  }
  void finish() {}
};
inline TakeInput take_input_op(float* r, const float* g, uint32_t* flag,
                               const Settle& settle = Settle{}) {
  return {r, g, flag, settle};
}

// The pass's last op: the flag of g when there is no residual.
struct CheckInput {
  static constexpr bool split = true;  // may run block by block
  const float* r;
  const float* g;
  uint32_t* flag;
  void start(uint64_t, int64_t) {}
  template <class S>
  void chunk(uint64_t lo, uint64_t hi, int64_t, const S&) {
    if (!r && any_nonfinite(g, lo, hi)) raise_flag(flag);
  }
  void finish() {}
};
inline CheckInput check_input_op(const float* r, const float* g, uint32_t* flag) {
  return {r, g, flag};
}

// The header of a payload just written says whether its values held a NaN or an inf.
inline void mark_nonfinite(uint8_t* out, const Flag& f) {
  if (f.v) std::memcpy(out + 12, &NONFINITE, 4);
}

// A NONFINITE payload's decode: NaN in every element (the canonical NaN, so every rank
// holds the same bits whatever out held), or with feedback, a residual's update, 0: the
// sum with NaN is not finite, and error feedback drops what is not.
inline int poison(float* out, uint64_t n, int feedback) {
  const float v = feedback ? 0.0f : HP_NAN;
  parallel_for((int64_t)n, [&](int64_t i) { out[i] = v; }, n >= BATCH_SMALL);
  return 0;
}

// A decoder's last step, its output pass (the whole of it for every shipped decoder). With
// Now, it runs here. Otherwise the decoder is settling a residual (accumulate, scale -1,
// feedback) for the encoder that then(range) runs: the pass is handed over as range(lo,
// hi), which that encoder calls on every chunk of r just before it reads the chunk.
// Elements are computed by the same functions either way, so r ends bit for bit the same.
struct Now {};

// The pass's ops on elements [lo, hi), in the calling thread (lo a multiple of 8, so
// packed bits start on a byte).
template <class Op>
void run_range(uint64_t lo, uint64_t hi, const Unpacks& u, Op op) {
  static_assert(Op::split, "only element-wise ops run on a range");
  thread_local std::vector<uint8_t> staged((size_t)MAX_STAGED * SUM_CHUNK);
  thread_local std::vector<float> expanded((size_t)MAX_STAGED * SUM_CHUNK);
  for (uint64_t s = lo; s < hi; s += SUM_CHUNK) {
    const uint64_t e = std::min(hi, s + SUM_CHUNK);
    Stage st;
    st.lo = s;
    for (int k = 0; k < u.count; ++k) {
      uint8_t* dst = staged.data() + (size_t)k * SUM_CHUNK;
      unpack_chunk(dst, u.src[k], s, e, u.bits[k]);
      st.p[k] = dst;
    }
    for (int k = 0; k < u.xcount; ++k) {
      float* dst = expanded.data() + (size_t)k * SUM_CHUNK;
      expand_chunk(dst, u.xsrc[k], u.xblock[k], s, e);
      st.x[k] = dst;
    }
    op.chunk(s, e, (int64_t)(s / SUM_CHUNK), st);
  }
}

template <bool BLOCKS = false, class Then, class Op>
void finish(Then& then, uint64_t len, Unpacks u, Op op) {
  if constexpr (std::is_same_v<std::decay_t<Then>, Now>) {
    fused<BLOCKS>(len, u, op);
  } else {
    then([=](uint64_t lo, uint64_t hi) { run_range(lo, hi, u, op); });
  }
}

// Materialise a lazy array (used when a packed array is bound to a name).
template <int BITS, class F>
void pack_all(uint8_t* dst, uint64_t len, F f) {
  fused(len, Unpacks{{}, {}, 0}, pack<BITS>(dst, f));
}

// Stream compaction in index order, one pass over the input: each block compacts into
// its own small buffers while its elements are in cache, then blocks are copied to
// their offsets (for sparse results the copy is tiny).
// The kept indices of one block [lo, hi) into sc; with WATCH also the non-finite flag of
// watch[lo, hi), in the predicate's loop.
template <bool WATCH, class P>
inline uint64_t filter_block(uint64_t lo, uint64_t hi, const P& pred, uint32_t* sc,
                             const float* watch, uint32_t* flag) {
  uint64_t cnt = 0;
  uint32_t top = 0;
  // The predicate of 64 elements at a time into bytes (a loop that vectorises); only
  // a group with a kept element is compacted, branch-free: always write, advance if
  // kept. Sparse selections (dgc, top-k candidates) skip nearly every group.
  alignas(64) uint8_t keep[64];
  uint32_t i = (uint32_t)lo;
  const uint32_t lim = (uint32_t)std::min<uint64_t>(hi, GROUP_LIMIT);
  for (; i + 64 <= lim; i += 64) {
    const uint32_t end = i + 64;
    for (uint32_t j = i; j < end; ++j) keep[j - i] = pred(j) ? 1 : 0;
    if constexpr (WATCH) {  // the group is in L1 now; a loop of its own vectorises
      for (uint32_t j = i; j < end; ++j) {
        const uint32_t m = hp_f2u(watch[j]) & 0x7FFFFFFFu;
        top = m > top ? m : top;
      }
    }
    uint64_t w[8];
    std::memcpy(w, keep, 64);
    if ((w[0] | w[1] | w[2] | w[3] | w[4] | w[5] | w[6] | w[7]) == 0) continue;
    for (uint32_t j = 0; j < 64; ++j) {
      sc[cnt] = i + j;
      cnt += keep[j];
    }
  }
  for (; i < (uint32_t)hi; ++i) {
    sc[cnt] = i;
    cnt += pred(i) ? 1 : 0;
    if constexpr (WATCH) {
      const uint32_t m = hp_f2u(watch[i]) & 0x7FFFFFFFu;
      top = m > top ? m : top;
    }
  }
  if constexpr (WATCH) raise_if(top, flag);
  return cnt;
}

template <class T, class V, class P>
void filter(uint64_t len, V val, P pred, std::vector<uint32_t>* idx, std::vector<T>* out,
            const float* watch = nullptr, uint32_t* flag = nullptr) {
  const int64_t blocks = (int64_t)((len + GRAIN - 1) / GRAIN);
  std::vector<std::vector<uint32_t>> bidx((size_t)blocks);
  parallel((int)std::min<int64_t>(team_size(), blocks), [&](int t, int nt) {
    std::vector<uint32_t> scratch((size_t)GRAIN);
    const auto [first, last] = static_range(blocks, t, nt);
    for (int64_t b = first; b < last; ++b) {
      const uint64_t lo = (uint64_t)b * GRAIN, hi = std::min(len, lo + GRAIN);
      uint32_t* sc = scratch.data();
      const uint64_t cnt = watch ? filter_block<true>(lo, hi, pred, sc, watch, flag)
                                 : filter_block<false>(lo, hi, pred, sc, watch, flag);
      bidx[(size_t)b].assign(sc, sc + cnt);
    }
  });
  std::vector<uint64_t> start((size_t)blocks + 1, 0);
  for (int64_t b = 0; b < blocks; ++b) start[(size_t)b + 1] = start[(size_t)b] + bidx[(size_t)b].size();
  if (idx) idx->resize((size_t)start[(size_t)blocks]);
  out->resize((size_t)start[(size_t)blocks]);
  parallel_for(blocks, [&](int64_t b) {
    const std::vector<uint32_t>& bi = bidx[(size_t)b];
    const size_t at = (size_t)start[(size_t)b];
    if (idx && !bi.empty()) std::memcpy(idx->data() + at, bi.data(), bi.size() * sizeof(uint32_t));
    T* o = out->data() + at;
    for (size_t j = 0; j < bi.size(); ++j) o[j] = val(bi[j]);
  });
}

template <class K>
std::vector<double> keys_of(uint64_t len, K key) {
  std::vector<double> k((size_t)len);
  parallel_for((int64_t)len, [&](int64_t i) { k[(size_t)i] = (double)key((uint64_t)i); });
  return k;
}

template <class T, class V, class K>
void sort(uint64_t len, V val, K key, bool descending, std::vector<uint32_t>* idx,
          std::vector<T>* out) {
  std::vector<double> k = keys_of(len, key);
  std::vector<uint32_t> order((size_t)len);
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(), Ranked{k.data(), descending});
  out->resize((size_t)len);
  for (uint64_t i = 0; i < len; ++i) (*out)[i] = val(order[i]);
  if (idx) *idx = std::move(order);
}

// Exact top-k: the k best under (key descending, NaN last, lower index first),
// returned in index order. A strided sample bounds the threshold from below so the
// exact selection runs on a few candidates; if too few pass, all elements compete.
// With watch, also the non-finite flag of watch[0, len) (g, which the candidates' scan
// reads whole; a loop of its own where that scan does not run).
template <class T, class V, class K>
void topk(uint64_t len, int64_t kk, V val, K key, std::vector<uint32_t>* idx,
          std::vector<T>* out, const float* watch = nullptr, uint32_t* flag = nullptr) {
  const uint64_t k = kk <= 0 ? 0 : std::min<uint64_t>((uint64_t)kk, len);
  std::vector<uint32_t> cand;
  bool watched = false;
  if (k > 0 && len > 65536 && k * 8 < len) {
    const uint64_t samples = std::min<uint64_t>(len, 16384), stride = len / samples;
    std::vector<double> s((size_t)samples);
    for (uint64_t j = 0; j < samples; ++j) s[j] = (double)key(j * stride);
    const double thr = topk_threshold(s, k, len);
    if (thr == thr) {
      std::vector<uint32_t> picked;
      // thr is one of the sampled keys, so a float key compares exactly as a float (no
      // conversion to double per element).
      using KeyT = decltype(key(0));
      if constexpr (std::is_same_v<KeyT, float>) {
        const float t = (float)thr;
        filter<uint32_t>(
            len, [](uint64_t i) { return (uint32_t)i; },
            [=](uint64_t i) { return key(i) >= t; }, nullptr, &picked, watch, flag);
      } else {
        filter<uint32_t>(
            len, [](uint64_t i) { return (uint32_t)i; },
            [=](uint64_t i) { return (double)key(i) >= thr; }, nullptr, &picked, watch, flag);
      }
      watched = true;
      if (picked.size() >= k) cand = std::move(picked);
    }
  }
  if (watch && !watched) take_input(nullptr, watch, len, flag, true);
  if (cand.empty()) {
    cand.resize((size_t)len);
    std::iota(cand.begin(), cand.end(), 0u);
  }
  std::vector<double> ck(cand.size());
  parallel_for((int64_t)cand.size(),
               [&](int64_t j) { ck[(size_t)j] = (double)key(cand[(size_t)j]); });
  std::vector<uint32_t> chosen = select_top(cand, ck, k);
  out->resize(chosen.size());
  for (size_t j = 0; j < chosen.size(); ++j) (*out)[j] = val(chosen[j]);
  if (idx) *idx = std::move(chosen);
}

template <class T>
inline T load(const uint8_t* p, uint64_t i) {
  T v;
  std::memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}

// Check every index of a scatter before anything is written, so a bad payload
// leaves the caller's buffer as it was.
template <class I>
bool check_indices(uint64_t len, uint64_t size, I index, char* err, uint64_t errcap) {
  for (uint64_t j = 0; j < len; ++j) {
    const int64_t ix = (int64_t)index(j);
    if (ix < 0 || (uint64_t)ix >= size) return index_error(err, errcap, ix, size);
  }
  return true;
}

// out[index(j)] += value(j) in order of j, skipping indices outside [0, size).
template <class T, class I, class V>
void scatter_add(T* out, uint64_t size, uint64_t len, I index, V value) {
  for (uint64_t j = 0; j < len; ++j) {
    const int64_t ix = (int64_t)index(j);
    if (ix >= 0 && (uint64_t)ix < size) out[ix] = out[ix] + value(j);
  }
}

// Whether index(0..len) strictly increases: every element is then scattered at most once.
template <class I>
bool increasing(uint64_t len, I index) {
  for (uint64_t j = 1; j < len; ++j)
    if ((int64_t)index(j) <= (int64_t)index(j - 1)) return false;
  return true;
}

// A decoded scatter: zeros plus values in index order, scaled, added to out when
// accumulating (the interpreter's out + scale * (0 + v1 + v2 ...)), with feedback as in
// WriteOut. With indices that strictly increase (every sparse encoder's), adding
// into out touches only the scattered elements plus one pass for what the formula does
// to the others: out + scale * 0 turns -0 into +0 when scale > 0, and feedback zeroes
// non-finite values; with repeated indices the values are summed in a zeroed scratch.
template <class I, class V>
void scatter_out(float* out, uint64_t n, int accumulate, float scale, int feedback,
                 uint64_t len, I index, V value) {
  const float zero = scale * 0.0f;  // what an element without a value gets (added)
  if (!accumulate && !feedback) {
    if (increasing(len, index)) {  // every element once: scale * 0, or scale * (0 + v)
      std::fill(out, out + n, zero);
      for (uint64_t j = 0; j < len; ++j) {
        const int64_t ix = (int64_t)index(j);
        if (ix >= 0 && (uint64_t)ix < n) out[ix] = scale * (0.0f + (float)value(j));
      }
      return;
    }
    std::memset(out, 0, n * sizeof(float));
    scatter_add(out, n, len, index, value);
    if (scale != 1.0f)
      fused(n, Unpacks{{}, {}, 0},
            write_out(out, 0, scale, 0, [=](uint64_t i, const auto&) { return out[i]; }));
    return;
  }
  // Feedback zeroes what is not finite after the add, so an element's value must go in
  // before any zeroing: the scattered elements first, then a pass over the rest, which
  // must leave finite values as they are (zero is -0).
  const bool sparse = hp_isfinite(scale) && scale != 0.0f &&
                      (!feedback || std::signbit(zero)) && increasing(len, index);
  if (sparse) {
    if (!feedback && !std::signbit(zero)) {
      // x + (+0) turns -0 into +0 and leaves the rest: done first, a value's sum is then
      // the same as from -0 (scale > 0 never makes scale * (0 + v) a -0)
      parallel_for((int64_t)n, [&](int64_t i) { out[i] = out[i] + zero; });
    }
    for (uint64_t j = 0; j < len; ++j) {
      const int64_t ix = (int64_t)index(j);
      if (ix < 0 || (uint64_t)ix >= n) continue;
      const float w = out[ix] + scale * (0.0f + (float)value(j));
      out[ix] = feedback && !hp_isfinite(w) ? 0.0f : w;
    }
    if (feedback) {
      parallel_for((int64_t)n, [&](int64_t i) {
        if (!hp_isfinite(out[i])) out[i] = 0.0f;
      });
    }
    return;
  }
  std::vector<float> tmp((size_t)n, 0.0f);
  scatter_add(tmp.data(), n, len, index, value);
  const float* t = tmp.data();
  fused(n, Unpacks{{}, {}, 0},
        write_out(out, 1, scale, feedback, [=](uint64_t i, const auto&) { return t[i]; }));
}

// scatter_out as a decoder's last step (see finish). Settling, with strictly increasing
// indices: range(lo, hi) adds the values whose indices fall in [lo, hi) and zeroes what is
// not finite there, as scatter_out's sparse path does over the whole tensor; otherwise the
// scatter runs whole first and the encoder owes nothing more.
template <class Then, class I, class V>
void finish_scatter(Then& then, float* out, uint64_t n, int accumulate, float scale,
                    int feedback, uint64_t len, I index, V value) {
  if constexpr (std::is_same_v<std::decay_t<Then>, Now>) {
    scatter_out(out, n, accumulate, scale, feedback, len, index, value);
  } else {
    const bool sparse = accumulate && feedback && hp_isfinite(scale) && scale != 0.0f &&
                        std::signbit(scale * 0.0f) && increasing(len, index);
    if (!sparse) {
      scatter_out(out, n, accumulate, scale, feedback, len, index, value);
      then([](uint64_t, uint64_t) {});
      return;
    }
    then([=](uint64_t lo, uint64_t hi) {
      uint64_t a = 0, b = len;  // the first j with index(j) >= lo
      while (a < b) {
        const uint64_t m = a + (b - a) / 2;
        if (index(m) < (int64_t)lo) a = m + 1; else b = m;
      }
      for (uint64_t j = a; j < len; ++j) {
        const int64_t ix = (int64_t)index(j);
        if (ix >= (int64_t)hi) break;
        if (ix < 0) continue;
        const float w = out[ix] + scale * (0.0f + (float)value(j));
        out[ix] = hp_isfinite(w) ? w : 0.0f;
      }
      for (uint64_t i = lo; i < hi; ++i)
        if (!hp_isfinite(out[i])) out[i] = 0.0f;
    });
  }
}

inline void put_bytes(uint8_t* dst, const void* src, uint64_t n) { std::memcpy(dst, src, n); }
inline void copy_bytes(uint8_t* dst, const uint8_t* src, uint64_t n) { std::memcpy(dst, src, n); }
inline void zero_bytes(uint8_t* dst, uint64_t n) { std::memset(dst, 0, n); }
template <class T>
inline T get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// ---- batches: a chunk's segments in one call ---------------------------------------------
// Segments under BATCH_SMALL elements run one per thread (their own passes then run on that
// thread alone: a parallel region inside a parallel loop has one thread); larger ones run
// after them, one at a time, each parallel inside.

template <class Size, class Run>
void for_segments(uint64_t count, Size size_of, Run run) {
  std::vector<uint64_t> small, large;
  for (uint64_t i = 0; i < count; ++i) (size_of(i) < BATCH_SMALL ? small : large).push_back(i);
  if (small.size() > 1) {
    parallel_dynamic((int64_t)small.size(), [&](int64_t j) { run(small[(size_t)j]); });
  } else if (!small.empty()) {
    run(small[0]);
  }
  for (uint64_t i : large) run(i);
}

// What the encoders report when a batch fails (set before returning -1).
inline const char*& last_error() {
  static const char* text = TOO_MANY;
  return text;
}

// Find count payloads laid end to end in p[0..size) from their headers: put(i, payload,
// bytes) for each. Returns -1, or the index of the first that does not frame (the last
// when bytes follow it), with the message in err.
template <class Put>
int64_t frame_chain(const uint8_t* p, uint64_t size, uint64_t count, char* err,
                    uint64_t errcap, Put put) {
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t total = 0;
    if (!framed(p, size, &total, err, errcap)) return (int64_t)i;
    put(i, p, total);
    p += total;
    size -= total;
  }
  if (size) {
    fail(err, errcap, "%llu bytes follow the last segment's payload", size);
    return count ? (int64_t)count - 1 : 0;
  }
  return -1;
}

// One item's encode. pre(lo, hi) runs on every chunk of r before the encoder adds g there
// (a merge into g owed first; it runs only with a residual). With feedback and keep, the
// payload keep holds is settled inside the encode (settled(kept, size, item, seed, pre)
// does both), then the new one is kept; without keep, the new payload's values are
// subtracted from r after the encode.
template <class Enc, class Settled, class Dec>
void encode_item(EncItem& it, uint32_t seed, Enc enc, Settled settled, Dec dec,
                 const Settle& pre) {
  const bool fb = (it.flags & FEEDBACK) && it.r;
  if (fb && it.keep) {
    uint64_t owed;
    std::memcpy(&owed, it.keep, 8);
    it.size = owed ? settled(it.keep + 8, owed, it, seed, pre)
                   : enc(it.g, it.r, it.n, seed, it.step, it.out, it.cap, pre);
    // r now holds its sum with g, settled: it owes this payload, or nothing after a failure
    const uint64_t now = it.size >= 0 && (uint64_t)it.size <= it.cap ? (uint64_t)it.size : 0;
    std::memcpy(it.keep + 8, it.out, now);
    std::memcpy(it.keep, &now, 8);
    return;
  }
  it.size = enc(it.g, it.r, it.n, seed, it.step, it.out, it.cap, pre);
  if (it.size >= 0 && (uint64_t)it.size <= it.cap && fb) {
    char err[128];  // a payload this call just wrote always decodes
    dec(it.out, (uint64_t)it.size, it.n, it.r, 1, -1.0f, 1, err, sizeof err);
  }
}

// After a batch's encodes: -1 when an item did not fit its cap or failed (its size says
// which; nothing is moved then); else, with compact, the payloads moved end to end from
// items[0].out (the items' buffers lie in that order in one buffer) and their total
// bytes; else 0.
inline int64_t compact_items(EncItem* items, uint64_t count, int compact) {
  for (uint64_t i = 0; i < count; ++i)
    if (items[i].size < 0 || (uint64_t)items[i].size > items[i].cap) return -1;
  if (!compact || count == 0) return 0;
  uint8_t* dst = items[0].out;
  for (uint64_t i = 0; i < count; ++i) {
    if (items[i].out != dst) std::memmove(dst, items[i].out, (size_t)items[i].size);
    items[i].out = dst;
    dst += items[i].size;
  }
  return (int64_t)(dst - items[0].out);
}

// Encode every item (encode_item); then compact_items.
template <class Enc, class Settled, class Dec>
int64_t encode_batch(EncItem* items, uint64_t count, uint32_t seed, int compact, Enc enc,
                     Settled settled, Dec dec) {
  last_error() = TOO_MANY;
  for_segments(count, [&](uint64_t i) { return items[i].n; },
               [&](uint64_t i) { encode_item(items[i], seed, enc, settled, dec, Settle{}); });
  return compact_items(items, count, compact);
}

// An aggregator's (or a ring hop's) last merge and its re-encode in one call: msg[0..size)
// holds one payload per item, end to end; each item's payload is added to its g (as
// decode_batch with accumulate does), then g is encoded as encode_batch does. With a
// residual, merged(p, size, item, go, err, errcap) hands the merge's output pass to the
// encoder (go(pre)), which runs it on each chunk of g just before adding g to r: one pass
// over g instead of two. Every payload is framed before anything is written. Returns
// as encode_batch, or -1 with *bad the index of the first payload that did not decode (its
// message in err; that item is not encoded).
template <class Enc, class Settled, class Dec, class Merged>
int64_t merge_encode_batch(EncItem* items, uint64_t count, uint32_t seed, int compact,
                           const uint8_t* msg, uint64_t size, char* err, uint64_t errcap,
                           int64_t* bad, Enc enc, Settled settled, Dec dec, Merged merged) {
  last_error() = TOO_MANY;
  *bad = -1;
  std::vector<const uint8_t*> ps((size_t)count);
  std::vector<uint64_t> sizes((size_t)count);
  *bad = frame_chain(msg, size, count, err, errcap,
                     [&](uint64_t i, const uint8_t* p, uint64_t total) {
                       ps[i] = p;
                       sizes[i] = total;
                     });
  if (*bad >= 0) return -1;
  int64_t first = -1;
  Lock failed;
  for_segments(count, [&](uint64_t i) { return items[i].n; }, [&](uint64_t i) {
    EncItem& it = items[i];
    char e[512];
    auto go = [&](const Settle& pre) { encode_item(it, seed, enc, settled, dec, pre); };
    if (merged(ps[i], sizes[i], it, go, e, (uint64_t)sizeof e)) {
      it.size = -1;
      Held held(failed);
      if (first < 0 || (int64_t)i < first) {
        first = (int64_t)i;
        std::snprintf(err, errcap, "%s", e);
      }
    }
  });
  if (first >= 0) {
    *bad = first;
    return -1;
  }
  return compact_items(items, count, compact);
}

// Decode every item (accumulate: 0, 1, or SCALE_SUM: add, then multiply the sum by scale).
// With chained, items[0].p and .size are a whole message holding one
// payload per item end to end: each item's payload is found from the header before it.
// Returns -1, or the index of the first item that failed with its message in err; every
// other item is decoded, a failed one's out is left as it was.
template <class Dec>
int64_t decode_batch(DecItem* items, uint64_t count, int accumulate, float scale, int feedback,
                     int chained, Dec dec, char* err, uint64_t errcap) {
  if (chained && count) {
    const int64_t unframed = frame_chain(items[0].p, items[0].size, count, err, errcap,
                                         [&](uint64_t i, const uint8_t* p, uint64_t total) {
                                           items[i].p = p;
                                           items[i].size = total;
                                         });
    if (unframed >= 0) return unframed;
  }
  int64_t bad = -1;
  Lock failed;
  // accumulate == SCALE_SUM: add, then scale the sum (the mean of an allgather's payloads)
  const int acc = accumulate == SCALE_SUM ? 1 : accumulate;
  const float once = accumulate == SCALE_SUM ? 1.0f : scale;
  for_segments(count, [&](uint64_t i) { return items[i].n; }, [&](uint64_t i) {
    const DecItem& it = items[i];
    char e[512];
    const int rc = dec(it.p, it.size, it.n, it.out, acc, once, feedback, e, sizeof e);
    if (!rc && accumulate == SCALE_SUM) {
      float* const o = it.out;
      parallel_for((int64_t)it.n, [&](int64_t j) { o[j] = o[j] * scale; }, it.n >= BATCH_SMALL);
    }
    if (rc) {
      Held held(failed);
      if (bad < 0 || (int64_t)i < bad) {
        bad = (int64_t)i;
        std::snprintf(err, errcap, "%s", e);
      }
    }
  });
  return bad;
}

// ---- payload header (host.h holds the format) -----------------------------------------
inline void write_header(uint8_t* out, uint32_t nsec, uint32_t algo, uint64_t n, uint32_t seed,
                         uint32_t step, const uint64_t* sizes) {
  fill_header(out, nsec, algo, n, seed, step, sizes);
}

inline bool read_header(const uint8_t* p, uint64_t size, uint32_t algo, uint64_t n,
                        uint32_t nsec, uint64_t* sizes, uint32_t* seed, uint32_t* step,
                        uint32_t* flags, char* err, uint64_t errcap) {
  return parse_header(p, size, algo, n, nsec, sizes, seed, step, flags, err, errcap);
}

}  // namespace hp
