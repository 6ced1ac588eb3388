// CompLL scalar semantics shared by the C++ and CUDA targets. Every function here
// mirrors compll/interpreter.py bit for bit: wrapping 32-bit integers, truncating
// division (0 on division by zero), saturating float-to-int casts (NaN -> 0),
// NaN-ignoring min/max, exact exponent/pow2, f16 conversion with round-to-nearest-even,
// and the counter-based RNG of compll/rng.py.
#pragma once

#ifndef HP_FN
#define HP_FN static inline
#endif

struct hp_f16 {
  uint16_t bits;
};

HP_FN uint32_t hp_f2u(float x) {
  uint32_t u;
  HP_BITCOPY(&u, &x, 4);
  return u;
}
HP_FN float hp_u2f(uint32_t u) {
  float x;
  HP_BITCOPY(&x, &u, 4);
  return x;
}
HP_FN bool hp_isnan(float x) { return x != x; }
HP_FN bool hp_isfinite(float x) { return (hp_f2u(x) & 0x7F800000u) != 0x7F800000u; }

#define HP_INF hp_u2f(0x7F800000u)
#define HP_NAN hp_u2f(0x7FC00000u)

// ---- f16 <-> f32 -----------------------------------------------------------------------
// Round to nearest even; magnitudes from 65520 up become inf; NaN becomes the quiet NaN
// of its sign (0x7E00). Widening is exact; a NaN keeps its payload with the quiet bit set.

// Branch-free (selects only), so loops over it vectorise. The normal path rounds by
// adding 0xFFF plus the lowest kept mantissa bit (round half to even); subnormal halves
// come out of one float addition against 0.5, which rounds the same way.
HP_FN hp_f16 hp_f32_to_f16(float f) {
  const uint32_t u = hp_f2u(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t x = u & 0x7FFFFFFFu;
  const uint32_t special = x > 0x7F800000u ? 0x7E00u : 0x7C00u;  // NaN or inf
  const uint32_t sub = hp_f2u(hp_u2f(x) + 0.5f) - 0x3F000000u;  // |f| < 2^-14
  const uint32_t normal = (x + 0xC8000FFFu + ((x >> 13) & 1u)) >> 13;  // rebias + round
  const uint32_t mag = x >= 0x47800000u ? special : (x < 0x38800000u ? sub : normal);
  hp_f16 h;
  h.bits = (uint16_t)(sign | mag);
  return h;
}

HP_FN float hp_f16_to_f32(hp_f16 h) {
  const uint32_t b = h.bits;
  const uint32_t sign = (b & 0x8000u) << 16;
  const uint32_t em = (b & 0x7FFFu) << 13;  // exponent and mantissa in float position
  const uint32_t exp = em & 0x0F800000u;
  const uint32_t normal = em + 0x38000000u;  // rebias 15 -> 127
  const uint32_t special = em + 0x70000000u | ((b & 0x3FFu) ? 0x400000u : 0u);  // inf/NaN
  const uint32_t sub = hp_f2u(hp_u2f(em + 0x38800000u) - hp_u2f(0x38800000u));  // renormalise
  const uint32_t mag = exp == 0x0F800000u ? special : (exp == 0 ? sub : normal);
  return hp_u2f(sign | mag);
}

// A select whose operands are both evaluated (as CompLL's `if` defines), which lets
// the optimiser turn it into a branch-free blend.
template <class T>
HP_FN T hp_sel(bool c, T a, T b) {
  return c ? a : b;
}

// ---- casts ------------------------------------------------------------------------------
// Saturating float-to-int casts, written as selects over values that are always in
// range for the conversion, so they vectorise without branches.
HP_FN int32_t hp_f2i32(float x) {
  // NaN and out-of-range values become 0 before the conversion, so it only ever sees
  // values in range; the saturated ends are selected afterwards (cheaper than clamping).
  const int32_t t = (int32_t)(x > -2147483648.0f && x < 2147483648.0f ? x : 0.0f);
  return x >= 2147483648.0f ? 2147483647 : (x <= -2147483648.0f ? (int32_t)0x80000000 : t);
}
HP_FN uint32_t hp_f2u32(float x) {
  const float c = x > 0.0f ? (x < 4294967040.0f ? x : 4294967040.0f) : 0.0f;  // NaN -> 0
  const bool high = c >= 2147483648.0f;  // convert via int32: c - 2^31 is exact up there
  const uint32_t t = (uint32_t)(int32_t)(high ? c - 2147483648.0f : c) + (high ? 0x80000000u : 0u);
  return x >= 4294967296.0f ? 0xFFFFFFFFu : t;
}
HP_FN uint8_t hp_f2u8(float x) {
  const float c = x > 0.0f ? (x < 255.0f ? x : 255.0f) : 0.0f;  // NaN -> 0
  return (uint8_t)(int32_t)c;
}

// ---- wrapping integer arithmetic --------------------------------------------------------
HP_FN int32_t hp_wrap(uint32_t u) { return (int32_t)u; }
HP_FN int32_t hp_add_i32(int32_t a, int32_t b) { return hp_wrap((uint32_t)a + (uint32_t)b); }
HP_FN int32_t hp_sub_i32(int32_t a, int32_t b) { return hp_wrap((uint32_t)a - (uint32_t)b); }
HP_FN int32_t hp_mul_i32(int32_t a, int32_t b) { return hp_wrap((uint32_t)a * (uint32_t)b); }
HP_FN int32_t hp_neg_i32(int32_t a) { return hp_wrap(0u - (uint32_t)a); }
HP_FN int32_t hp_div_i32(int32_t a, int32_t b) {
  if (b == 0) return 0;
  if (b == -1) return hp_neg_i32(a);
  return a / b;
}
HP_FN int32_t hp_mod_i32(int32_t a, int32_t b) {
  if (b == 0 || b == -1) return 0;
  return a % b;
}
HP_FN uint32_t hp_div_u32(uint32_t a, uint32_t b) { return b == 0u ? 0u : a / b; }
HP_FN uint32_t hp_mod_u32(uint32_t a, uint32_t b) { return b == 0u ? 0u : a % b; }
HP_FN int32_t hp_shl_i32(int32_t a, uint32_t b) { return hp_wrap((uint32_t)a << (b & 31u)); }
HP_FN int32_t hp_shr_i32(int32_t a, uint32_t b) { return a >> (b & 31u); }
HP_FN uint32_t hp_shl_u32(uint32_t a, uint32_t b) { return a << (b & 31u); }
HP_FN uint32_t hp_shr_u32(uint32_t a, uint32_t b) { return a >> (b & 31u); }
HP_FN int32_t hp_abs_i32(int32_t a) { return a < 0 ? hp_neg_i32(a) : a; }

// ---- float builtins ---------------------------------------------------------------------
HP_FN float hp_fmax(float a, float b) {
  return hp_isnan(b) ? a : (hp_isnan(a) ? b : (a > b ? a : b));
}
HP_FN float hp_fmin(float a, float b) {
  return hp_isnan(b) ? a : (hp_isnan(a) ? b : (a < b ? a : b));
}
HP_FN float hp_fabs(float a) { return hp_u2f(hp_f2u(a) & 0x7FFFFFFFu); }
HP_FN float hp_sign_f32(float a) { return (float)((a > 0.0f) - (a < 0.0f)); }
HP_FN int32_t hp_exponent(float x) {  // zero and subnormals (field 0) give -127
  return (int32_t)(hp_f2u(x) >> 23 & 0xFFu) - 127;
}
HP_FN uint32_t hp_mantissa(float x) { return hp_f2u(x) & 0x7FFFFFu; }  // the fraction field
HP_FN float hp_pow2(int32_t e) {
  const int32_t c = e < -126 ? -126 : (e > 127 ? 127 : e);
  const float v = hp_u2f((uint32_t)(c + 127) << 23);
  return e < -126 ? 0.0f : (e > 127 ? HP_INF : v);
}

// ---- counter-based RNG (compll/rng.py) ----------------------------------------------------
HP_FN uint32_t hp_mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}
HP_FN uint32_t hp_stream_key(uint32_t seed, uint32_t step, uint32_t stream) {
  uint32_t k0 = hp_mix32(seed * 0x9E3779B9u + 0x7F4A7C15u);
  uint32_t k1 = hp_mix32(k0 ^ (step * 0x85EBCA77u + 0x165667B1u));
  return hp_mix32(k1 ^ (stream * 0xC2B2AE3Du + 0x27D4EB2Fu));
}
HP_FN uint32_t hp_hash(uint32_t key, uint64_t i) {  // a Weyl sequence through one mix
  uint32_t lo = (uint32_t)i, hi = (uint32_t)(i >> 32);
  return hp_mix32(lo * 0x9E3779B9u + hi * 0x85EBCA77u + key);
}
HP_FN float hp_uniform(uint32_t key, uint64_t i) {
  return (float)(hp_hash(key, i) >> 8) * 5.9604644775390625e-8f;
}
HP_FN uint32_t hp_randint(uint32_t key, uint64_t i, uint32_t hi) {
  return (uint32_t)(((uint64_t)hp_hash(key, i) * (uint64_t)hi) >> 32);
}

// ---- packed arrays and payload sections ---------------------------------------------------
HP_FN uint8_t hp_unpack(const uint8_t* data, uint64_t i, uint32_t bits) {
  uint64_t bit = i * bits;
  return (uint8_t)((data[bit >> 3] >> (bit & 7u)) & ((1u << bits) - 1u));
}
HP_FN uint64_t hp_pad8(uint64_t n) { return (n + 7u) & ~(uint64_t)7u; }
