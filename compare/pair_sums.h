// The sums behind rmse(), rms() and diff_stats() (compare/noise_floor.h)
// over float arrays, made in blocks of 32 pairs with eight double lanes (GCC
// vector extensions): a dump's tensors are judged several times over, and a
// scalar double sum is one dependent add per element (the comparison of a
// 1B model's dump spent half its time there). A block holding NaN or Inf
// goes through the scalar rule, pair by pair. Sums are per lane, then lanes
// in a fixed order: the result depends on the array only, never on threads.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace llmdiff::compare::pair_sums {

typedef float v8f __attribute__((vector_size(32)));
typedef double v8d __attribute__((vector_size(64)));
typedef uint32_t v8u __attribute__((vector_size(32)));

constexpr int64_t kBlock = 32;

// Whether any of 8 floats is NaN or Inf (exponent all ones).
inline v8u nonfinite(v8f v) {
  v8u u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x7f800000u) == 0x7f800000u;
}

inline bool any(v8u m) {
  uint32_t r = 0;
  for (int l = 0; l < 8; ++l) r |= m[l];
  return r != 0;
}

inline double total(const v8d (&acc)[4]) {
  const v8d s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  double t = 0;
  for (int l = 0; l < 8; ++l) t += s[l];
  return t;
}

// Runs `block(x, y, i)` on each block of 32 pairs without NaN/Inf (x, y: 4 x
// 8 floats of a and b from offset i) and `pair(i)` on every pair of the other
// blocks and of the tail.
template <class Block, class Pair>
void for_blocks(const float* a, const float* b, int64_t n, Block&& block, Pair&& pair) {
  int64_t i = 0;
  if (b) {
    for (; i + kBlock <= n; i += kBlock) {
      v8f x[4], y[4];
      std::memcpy(x, a + i, sizeof x);
      std::memcpy(y, b + i, sizeof y);
      const v8u bad = nonfinite(x[0]) | nonfinite(x[1]) | nonfinite(x[2]) | nonfinite(x[3]) | nonfinite(y[0]) |
                      nonfinite(y[1]) | nonfinite(y[2]) | nonfinite(y[3]);
      if (!any(bad)) {
        block(x, y, i);
        continue;
      }
      for (int64_t k = i; k < i + kBlock; ++k) pair(k);
    }
  } else {
    for (; i + kBlock <= n; i += kBlock) {
      v8f x[4];
      std::memcpy(x, a + i, sizeof x);
      if (!any(nonfinite(x[0]) | nonfinite(x[1]) | nonfinite(x[2]) | nonfinite(x[3]))) {
        block(x, x, i);
        continue;
      }
      for (int64_t k = i; k < i + kBlock; ++k) pair(k);
    }
  }
  for (; i < n; ++i) pair(i);
}

inline v8d wide(v8f v) { return __builtin_convertvector(v, v8d); }

}  // namespace llmdiff::compare::pair_sums
