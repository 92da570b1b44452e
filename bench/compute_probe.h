// The machine's matrix-product throughput as the bisection's passes meet it:
// libtorch's float32 and float64 products (OpenBLAS) of the passes' shape,
// on one thread, on every thread in one product, and as one product per
// thread side by side (as the passes' lanes run, bisect/schedule.cpp): side
// by side is twice one thread where the cores multiply independently, and
// no more than one thread where they share one core's vector units. The
// compute floor of a bisection follows from the best of these rates.
#pragma once
#include <cstdint>

namespace llmdiff::bench {

struct GemmRate {
  double one = 0;           // GFLOP/s, one thread
  double one_product = 0;   // GFLOP/s, `threads` threads in one product
  double side_by_side = 0;  // GFLOP/s summed over `threads` products at once, one thread each
  double best() const;
};

struct ComputeProbe {
  int threads = 0;
  GemmRate f32, f64;
};

// Products [m, k] x [n, k]^T, as a projection of m rows. Each figure the
// best of three timed passes of at least 0.2 s. Run it in a
// process of its own (it sets the BLAS's and libtorch's threads).
ComputeProbe measure_products(int64_t m, int64_t k, int64_t n, int threads);

}  // namespace llmdiff::bench
