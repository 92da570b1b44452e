// The product-throughput probe of `llmdiff bench --bisect` (bench/compute_probe.h).
#include "bench/compute_probe.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "dumps/base/threads.h"
#include "ref/ref_engine.h"

namespace llmdiff::bench {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Products of `x` [m, k] with `w` [n, k]^T, repeated for at least `min_s`;
// returns {products, seconds}.
std::pair<int, double> timed_products(const at::Tensor& x, const at::Tensor& w, double min_s) {
  const auto t0 = Clock::now();
  int reps = 0;
  do {
    at::Tensor y = at::linear(x, w);  // [m, n]
    ++reps;
  } while (since(t0) < min_s);
  return {reps, since(t0)};
}

// GFLOP/s of `lanes` products at once, each on a thread of its own (lanes 1:
// this thread), the BLAS on `blas_threads` threads per product; best of three.
double rate(at::ScalarType t, int64_t m, int64_t k, int64_t n, int lanes, int blas_threads) {
  const ComputeDType dtype = t == at::kDouble ? ComputeDType::Float64 : ComputeDType::Float32;
  ref::use_threads(blas_threads, dtype);
  std::vector<at::Tensor> xs, ws;
  for (int l = 0; l < lanes; ++l) {
    xs.push_back(at::randn({m, k}, at::TensorOptions().dtype(t)));  // [m, k]
    ws.push_back(at::randn({n, k}, at::TensorOptions().dtype(t)));  // [n, k]
    at::linear(xs.back(), ws.back());                                // warm-up: the BLAS's buffers
  }
  const double flops = 2.0 * double(m) * double(k) * double(n);
  double best = 0;
  for (int pass = 0; pass < 3; ++pass) {
    std::vector<std::pair<int, double>> done(static_cast<size_t>(lanes));
    const auto t0 = Clock::now();
    std::vector<std::thread> others;
    for (int l = 1; l < lanes; ++l)
      others.emplace_back([&, l] { done[size_t(l)] = timed_products(xs[size_t(l)], ws[size_t(l)], 0.2); });
    done[0] = timed_products(xs[0], ws[0], 0.2);
    for (auto& th : others) th.join();
    const double wall = since(t0);
    int reps = 0;
    for (const auto& d : done) reps += d.first;
    best = std::max(best, flops * reps / wall * 1e-9);
  }
  return best;
}

GemmRate rates(at::ScalarType t, int64_t m, int64_t k, int64_t n, int threads) {
  GemmRate r;
  r.one = rate(t, m, k, n, 1, 1);
  r.one_product = threads > 1 ? rate(t, m, k, n, 1, threads) : r.one;
  r.side_by_side = threads > 1 ? rate(t, m, k, n, threads, 1) : r.one;
  return r;
}

}  // namespace

double GemmRate::best() const { return std::max({one, one_product, side_by_side}); }

ComputeProbe measure_products(int64_t m, int64_t k, int64_t n, int threads) {
  ComputeProbe p;
  p.threads = resolve_threads(threads);
  p.f32 = rates(at::kFloat, m, k, n, p.threads);
  p.f64 = rates(at::kDouble, m, k, n, p.threads);
  return p;
}

}  // namespace llmdiff::bench
