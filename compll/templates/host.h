// Host-side pieces shared by the C++ and CUDA runtimes: the payload header
// (compll/payload.py), error messages, and top-k selection among candidates.
#pragma once

#include "hp_constants.h"

namespace hp {

inline int fail(char* err, uint64_t errcap, const char* fmt, unsigned long long a = 0,
                unsigned long long b = 0) {
  std::snprintf(err, errcap, fmt, a, b);
  return 1;
}

inline bool index_error(char* err, uint64_t errcap, int64_t ix, uint64_t size) {
  std::snprintf(err, errcap, "payload index %lld is outside the tensor of %llu elements",
                (long long)ix, (unsigned long long)size);
  return false;
}

// The header bytes (HEADER + 8 * nsec) of a payload, in host memory.
inline void fill_header(uint8_t* h, uint32_t nsec, uint32_t algo, uint64_t n, uint32_t seed,
                        uint32_t step, const uint64_t* sizes) {
  h[0] = 'H';
  h[1] = 'P';
  h[2] = FORMAT_VERSION;
  h[3] = (uint8_t)nsec;
  std::memcpy(h + 4, &algo, 4);
  const uint32_t n32 = (uint32_t)n, flags = 0;  // NONFINITE is set after the encode
  std::memcpy(h + 8, &n32, 4);
  std::memcpy(h + 12, &flags, 4);
  std::memcpy(h + 16, &seed, 4);
  std::memcpy(h + 20, &step, 4);
  std::memcpy(h + HEADER, sizes, 8 * nsec);
}

// Validate the fixed header fields of a payload of `size` bytes whose first
// min(size, HEADER + 8 * nsec) bytes are at h (host memory); fill sizes, seed, step and
// flags. On a mismatch, return false with a message in err, before any section is read.
inline bool parse_header(const uint8_t* h, uint64_t size, uint32_t algo, uint64_t n,
                         uint32_t nsec, uint64_t* sizes, uint32_t* seed, uint32_t* step,
                         uint32_t* flags, char* err, uint64_t errcap) {
  if (n > MAX_ELEMENTS) {
    fail(err, errcap, TOO_MANY);
    return false;
  }
  if (size < HEADER) {
    fail(err, errcap, "payload of %llu bytes is shorter than the 24-byte header", size);
    return false;
  }
  if (h[0] != 'H' || h[1] != 'P') {
    fail(err, errcap, "not a HiPress payload (bad magic)");
    return false;
  }
  if (h[2] != FORMAT_VERSION) {
    fail(err, errcap, "payload format version %llu is not supported (this HiPress reads %llu)",
         h[2], FORMAT_VERSION);
    return false;
  }
  uint32_t got_algo, got_n;
  std::memcpy(&got_algo, h + 4, 4);
  std::memcpy(&got_n, h + 8, 4);
  std::memcpy(flags, h + 12, 4);
  std::memcpy(seed, h + 16, 4);
  std::memcpy(step, h + 20, 4);
  if (got_algo != algo) {
    fail(err, errcap, "payload was written by another algorithm or parameter set");
    return false;
  }
  if (got_n != n) {
    fail(err, errcap, "payload holds %llu elements but %llu were requested", got_n, n);
    return false;
  }
  if (*flags & ~NONFINITE) {
    fail(err, errcap, "payload flags %#llx are not ones this HiPress writes", *flags);
    return false;
  }
  if (h[3] != nsec) {
    fail(err, errcap, "payload has %llu sections; this algorithm writes %llu", h[3], nsec);
    return false;
  }
  if (size < HEADER + 8ull * nsec) {
    fail(err, errcap, "payload of %llu bytes is shorter than its header", size);
    return false;
  }
  std::memcpy(sizes, h + HEADER, 8 * nsec);
  return true;
}

// The length a payload's header declares, from its first min(avail, HEADER + 8 * 255)
// bytes at h (host memory): how a receiver finds where one payload of a message ends and
// the next begins. False, with a message, if the header is not one or claims more than avail.
inline bool framed(const uint8_t* h, uint64_t avail, uint64_t* total, char* err,
                   uint64_t errcap) {
  if (avail < HEADER) {
    fail(err, errcap, "%llu bytes cannot hold a 24-byte header", avail);
    return false;
  }
  if (h[0] != 'H' || h[1] != 'P' || h[2] != FORMAT_VERSION) {
    fail(err, errcap, "not a HiPress payload (bad magic or version)");
    return false;
  }
  const uint32_t nsec = h[3];
  uint64_t t = HEADER + 8ull * nsec;
  if (avail < t) {
    fail(err, errcap, "%llu bytes cannot hold a %llu-byte header", avail, t);
    return false;
  }
  for (uint32_t k = 0; k < nsec; ++k) {
    uint64_t size;
    std::memcpy(&size, h + HEADER + 8 * k, 8);
    if (size > avail) {
      fail(err, errcap, "a section claims %llu bytes but only %llu arrived", size, avail);
      return false;
    }
    t += hp_pad8(size);
  }
  if (t > avail) {
    fail(err, errcap, "the header declares %llu bytes but only %llu arrived", t, avail);
    return false;
  }
  *total = t;
  return true;
}

// One segment of a batched call (compll/loaders.py ENCODE_ITEM and DECODE_ITEM mirror
// these layouts). An encode item writes its payload to out[0..cap) and reports its size;
// flags bit 0 (FEEDBACK): with a residual r, also subtract what the payload decodes to
// from r, as error feedback does after every encode. With keep (the CPU's batches; 0:
// none), that subtraction is deferred to the next encode's first pass over r: keep holds
// [u64 size | payload], the payload r still owes (size 0: none), and each encode first
// settles it, then leaves its own there. A decode item reads p[0..size) into out.
struct EncItem {
  const float* g;
  float* r;
  uint64_t n;
  uint8_t* out;
  uint64_t cap;
  int64_t size;
  uint32_t step;
  uint32_t flags;
  uint8_t* keep;
};
struct DecItem {
  const uint8_t* p;
  uint64_t size;
  uint64_t n;
  float* out;
};

// Sizes come from the payload: check each against the buffer before adding, so a
// forged size cannot overflow the total.
inline bool check_total(uint64_t size, uint32_t nsec, const uint64_t* sizes, char* err,
                        uint64_t errcap) {
  uint64_t total = HEADER + 8ull * nsec;
  for (uint32_t k = 0; k < nsec; ++k) {
    if (sizes[k] > size) {
      fail(err, errcap, "payload is %llu bytes but a section claims %llu", size, sizes[k]);
      return false;
    }
    total += hp_pad8(sizes[k]);
  }
  if (total != size) {
    fail(err, errcap, "payload is %llu bytes but its header describes %llu", size, total);
    return false;
  }
  return true;
}

// The ranking of sort: keys widen to double; NaN goes last in both directions.
struct Ranked {
  const double* key;
  bool descending;
  bool operator()(uint32_t a, uint32_t b) const {
    const double ka = key[a], kb = key[b];
    if (ka != ka) return false;
    if (kb != kb) return true;
    return descending ? ka > kb : ka < kb;
  }
};

// Top-k: a lower bound on the k-th largest key from a strided sample of `len` keys.
// Candidates at or above it are a superset of the top k when at least k pass.
// Returns NaN when no bound can be given (all elements must then compete).
inline double topk_threshold(std::vector<double>& sample, uint64_t k, uint64_t len) {
  const uint64_t samples = sample.size();
  const uint64_t r = std::min<uint64_t>(samples - 1, (2 * k * samples) / len + 16);
  std::nth_element(sample.begin(), sample.begin() + (int64_t)r, sample.end(),
                   [](double a, double b) {
                     if (a != a) return false;
                     if (b != b) return true;
                     return a > b;
                   });
  return sample[(size_t)r];
}

// The k best candidates (key descending, NaN last, lower index first), in index order.
inline std::vector<uint32_t> select_top(const std::vector<uint32_t>& cand,
                                        const std::vector<double>& ck, uint64_t k) {
  std::vector<uint32_t> pos(cand.size());
  std::iota(pos.begin(), pos.end(), 0u);
  auto better = [&](uint32_t a, uint32_t b) {
    const double ka = ck[a], kb = ck[b];
    if (ka != ka) return (kb != kb) && cand[a] < cand[b];
    if (kb != kb) return true;
    if (ka != kb) return ka > kb;
    return cand[a] < cand[b];
  };
  if (k < pos.size()) std::nth_element(pos.begin(), pos.begin() + (int64_t)k, pos.end(), better);
  pos.resize((size_t)std::min<uint64_t>(k, pos.size()));
  std::vector<uint32_t> chosen(pos.size());
  for (size_t j = 0; j < pos.size(); ++j) chosen[j] = cand[pos[j]];
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

}  // namespace hp
