// The vectorised, chunked and threaded metric passes against a plain
// element-by-element computation written here: random data with and without
// NaN/Inf, every ULP grid, chunk-boundary sizes, ties, several thread
// counts; logits metrics; layout search on a near miss; and compare_dumps on
// golden data through the in-place and the copying paths.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>

#include "compare/compare.h"
#include "compare/layout.h"
#include "compare/metrics.h"
#include "compare/noise_floor.h"
#include "compare/parallel.h"
#include "dumps/base/dtype.h"
#include "tests/test_compare_helpers.h"

using namespace llmdiff;
using namespace llmdiff::compare;
using namespace llmdiff::testing;

namespace {
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInfF = std::numeric_limits<float>::infinity();
const double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------- reference

bool same_special(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b;
}

// The definitions of metrics.h, one element after the other.
PairMetrics reference_metrics(const std::vector<float>& ref, const std::vector<float>& cand, ComputeDType grid,
                              const Tolerance& tol) {
  PairMetrics out;
  FloatMetrics& m = out.metrics;
  AllcloseResult& r = out.allclose;
  const int64_t n = int64_t(ref.size());
  m.count = r.count = n;
  m.ulp_dtype = grid;
  r.tol = tol;
  double s_abs = 0, s_sq = 0, s_bb = 0, s_aa = 0, s_ab = 0;
  auto count = [](float v, int64_t i, NonFiniteCounts& c) {
    if (std::isnan(v)) {
      if (c.nan++ == 0) c.first_nan = i;
    } else if (v > 0) {
      ++c.pos_inf;
    } else {
      ++c.neg_inf;
    }
  };
  for (int64_t i = 0; i < n; ++i) {
    const float fa = cand[size_t(i)], fb = ref[size_t(i)];
    double ratio, need_atol, need_rtol;
    bool fail;
    if (!std::isfinite(fa) || !std::isfinite(fb)) {
      if (!std::isfinite(fa)) count(fa, i, m.cand_nonfinite);
      if (!std::isfinite(fb)) count(fb, i, m.ref_nonfinite);
      fail = !same_special(fa, fb);
      if (fail && m.nonfinite_mismatch++ == 0) m.first_nonfinite_mismatch = i;
      ratio = need_atol = need_rtol = fail ? kInf : 0.0;
    } else {
      const double a = fa, b = fb, ad = std::fabs(a - b), ab = std::fabs(b);
      if (m.max_abs_at < 0 || ad > m.max_abs) {
        m.max_abs = ad;
        m.max_abs_at = i;
        m.ref_at_max_abs = b;
        m.cand_at_max_abs = a;
      }
      if (ab > 0 && (m.max_rel_at < 0 || ad / ab > m.max_rel)) {
        m.max_rel = ad / ab;
        m.max_rel_at = i;
      }
      m.ref_max_abs = std::max(m.ref_max_abs, ab);
      m.cand_max_abs = std::max(m.cand_max_abs, std::fabs(a));
      m.max_ulp = std::max(m.max_ulp, ulp_distance(fa, fb, grid));
      ++m.finite_pairs;
      s_abs += ad;
      s_sq += (a - b) * (a - b);
      s_bb += b * b;
      s_aa += a * a;
      s_ab += a * b;
      const double bound = tol.atol + tol.rtol * ab;
      fail = !(ad <= bound);
      ratio = bound > 0 ? ad / bound : (ad > 0 ? kInf : 0.0);
      need_atol = std::max(0.0, ad - tol.rtol * ab);
      need_rtol = ad <= tol.atol ? 0.0 : (ab > 0 ? (ad - tol.atol) / ab : kInf);
    }
    if (fail && r.failing++ == 0) r.first_fail = i;
    if (r.worst_at < 0 || ratio > r.worst_ratio) {
      r.worst_ratio = ratio;
      r.worst_at = i;
    }
    r.min_atol = std::max(r.min_atol, need_atol);
    r.min_rtol = std::max(r.min_rtol, need_rtol);
  }
  r.fraction = n ? double(n - r.failing) / double(n) : 1.0;
  if (m.finite_pairs) {
    m.mean_abs = s_abs / double(m.finite_pairs);
    m.rmse = std::sqrt(s_sq / double(m.finite_pairs));
  }
  m.nmse = s_bb > 0 ? s_sq / s_bb : (s_sq > 0 ? kInf : 0.0);
  m.sqnr_db = s_sq > 0 ? (s_bb > 0 ? 10 * std::log10(s_bb / s_sq) : -kInf) : kInf;
  m.cosine = (s_aa == 0 && s_bb == 0) ? 1 : (s_aa == 0 || s_bb == 0) ? 0 : s_ab / std::sqrt(s_aa * s_bb);
  return out;
}

// Equal up to the rounding of a sum's order.
void expect_close(double want, double got, const std::string& what) {
  if (std::isinf(want) || std::isnan(want) || want == 0) {
    EXPECT_EQ(std::isnan(want), std::isnan(got)) << what;
    if (!std::isnan(want)) {
      EXPECT_EQ(want, got) << what;
    }
    return;
  }
  EXPECT_NEAR(got, want, 1e-11 * std::fabs(want)) << what;
}

void expect_counts(const NonFiniteCounts& want, const NonFiniteCounts& got, const std::string& what) {
  EXPECT_EQ(want.nan, got.nan) << what;
  EXPECT_EQ(want.pos_inf, got.pos_inf) << what;
  EXPECT_EQ(want.neg_inf, got.neg_inf) << what;
  EXPECT_EQ(want.first_nan, got.first_nan) << what;
}

// Maxima and indices exactly (a product-and-sum bound may round differently
// by one unit in the last place when the compiler fuses it); sums up to
// their order.
void expect_matches(const PairMetrics& want, const PairMetrics& got, const std::string& what) {
  const FloatMetrics &a = want.metrics, &b = got.metrics;
  EXPECT_EQ(a.count, b.count) << what;
  EXPECT_EQ(a.finite_pairs, b.finite_pairs) << what;
  EXPECT_EQ(a.max_abs, b.max_abs) << what;
  EXPECT_EQ(a.max_abs_at, b.max_abs_at) << what;
  EXPECT_EQ(a.ref_at_max_abs, b.ref_at_max_abs) << what;
  EXPECT_EQ(a.cand_at_max_abs, b.cand_at_max_abs) << what;
  EXPECT_EQ(a.max_rel, b.max_rel) << what;
  EXPECT_EQ(a.max_rel_at, b.max_rel_at) << what;
  EXPECT_EQ(a.ref_max_abs, b.ref_max_abs) << what;
  EXPECT_EQ(a.cand_max_abs, b.cand_max_abs) << what;
  EXPECT_EQ(a.max_ulp, b.max_ulp) << what;
  EXPECT_EQ(a.ulp_dtype, b.ulp_dtype) << what;
  expect_counts(a.ref_nonfinite, b.ref_nonfinite, what + " ref non-finite");
  expect_counts(a.cand_nonfinite, b.cand_nonfinite, what + " cand non-finite");
  EXPECT_EQ(a.nonfinite_mismatch, b.nonfinite_mismatch) << what;
  EXPECT_EQ(a.first_nonfinite_mismatch, b.first_nonfinite_mismatch) << what;
  expect_close(a.mean_abs, b.mean_abs, what + " mean_abs");
  expect_close(a.rmse, b.rmse, what + " rmse");
  expect_close(a.nmse, b.nmse, what + " nmse");
  expect_close(a.cosine, b.cosine, what + " cosine");
  if (std::isinf(a.sqnr_db))
    EXPECT_EQ(a.sqnr_db, b.sqnr_db) << what;
  else
    EXPECT_NEAR(a.sqnr_db, b.sqnr_db, 1e-9) << what;

  const AllcloseResult &x = want.allclose, &y = got.allclose;
  EXPECT_EQ(x.count, y.count) << what;
  EXPECT_EQ(x.failing, y.failing) << what;
  EXPECT_EQ(x.first_fail, y.first_fail) << what;
  EXPECT_EQ(x.fraction, y.fraction) << what;
  EXPECT_DOUBLE_EQ(x.worst_ratio, y.worst_ratio) << what;
  EXPECT_EQ(x.worst_at, y.worst_at) << what;
  EXPECT_DOUBLE_EQ(x.min_atol, y.min_atol) << what;
  EXPECT_DOUBLE_EQ(x.min_rtol, y.min_rtol) << what;
}

// Bit for bit (the same computation, split differently over threads).
void expect_identical(const PairMetrics& a, const PairMetrics& b, const std::string& what) {
  auto same = [](double x, double y) { return std::memcmp(&x, &y, sizeof x) == 0; };
  const FloatMetrics &m = a.metrics, &k = b.metrics;
  for (auto [x, y] : {std::pair{m.max_abs, k.max_abs}, {m.max_rel, k.max_rel}, {m.mean_abs, k.mean_abs},
                      {m.rmse, k.rmse}, {m.nmse, k.nmse}, {m.sqnr_db, k.sqnr_db}, {m.cosine, k.cosine},
                      {m.ref_max_abs, k.ref_max_abs}, {m.cand_max_abs, k.cand_max_abs},
                      {a.allclose.worst_ratio, b.allclose.worst_ratio}, {a.allclose.min_atol, b.allclose.min_atol},
                      {a.allclose.min_rtol, b.allclose.min_rtol}})
    EXPECT_TRUE(same(x, y)) << what << ": " << x << " vs " << y;
  EXPECT_EQ(m.max_abs_at, k.max_abs_at) << what;
  EXPECT_EQ(m.max_rel_at, k.max_rel_at) << what;
  EXPECT_EQ(m.max_ulp, k.max_ulp) << what;
  EXPECT_EQ(m.nonfinite_mismatch, k.nonfinite_mismatch) << what;
  EXPECT_EQ(a.allclose.failing, b.allclose.failing) << what;
  EXPECT_EQ(a.allclose.first_fail, b.allclose.first_fail) << what;
  EXPECT_EQ(a.allclose.worst_at, b.allclose.worst_at) << what;
}

// A reference tensor and a candidate close to it: most elements within
// float32 tolerance, some not, a few exact zeros and exact matches, values
// spanning the half-precision subnormal and overflow ranges, and a repeated
// largest error (so "first index" matters).
struct Pair {
  std::vector<float> ref, cand;
};
Pair random_pair(int64_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> val(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  Pair p;
  p.ref.resize(size_t(n));
  p.cand.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    float b = val(g);
    const float pick = u(g);
    if (pick < 0.02f) b = 0;
    else if (pick < 0.04f) b *= 1e-6f;  // below half's normal range
    else if (pick < 0.05f) b *= 1e5f;   // beyond half's largest value
    float a = b + b * 1e-6f * val(g) + 3e-6f * val(g);
    if (u(g) < 0.1f) a = b;
    p.ref[size_t(i)] = b;
    p.cand[size_t(i)] = a;
  }
  if (n >= 8) {
    // The largest error twice: at n/3 and again later.
    for (int64_t i : {n / 3, n - 2}) {
      p.ref[size_t(i)] = 1.0f;
      p.cand[size_t(i)] = 1e6f;
    }
  }
  return p;
}

// NaN/Inf sprinkled at seeded positions (`where` of them), on one side or
// both, matching or not.
void add_nonfinite(Pair& p, int where, uint32_t seed) {
  std::mt19937 g(seed);
  const float specials[] = {kNaN, kInfF, -kInfF};
  for (int k = 0; k < where && !p.ref.empty(); ++k) {
    const size_t i = g() % p.ref.size();
    const float s = specials[g() % 3];
    switch (g() % 4) {
      case 0: p.ref[i] = s; break;                      // reference only
      case 1: p.cand[i] = s; break;                     // candidate only
      case 2: p.ref[i] = p.cand[i] = s; break;          // both, same value
      default: p.ref[i] = s, p.cand[i] = -kInfF; break;  // both, different
    }
  }
}

const ComputeDType kGrids[] = {ComputeDType::Float32, ComputeDType::BFloat16, ComputeDType::Float16,
                               ComputeDType::Float64};
}  // namespace

TEST(CompareFastPath, FiniteDataMatchesThePlainDefinition) {
  const Tolerance tols[] = {Tolerance{}, Tolerance{0, 0}, Tolerance{1e-2, 0}, Tolerance{0, 1e-3}};
  uint32_t seed = 1;
  for (int64_t n : {0, 1, 5, 8, 4095, 4096, 4097, 3 * 4096 + 17, 140001}) {
    const Pair p = random_pair(n, seed++);
    for (ComputeDType grid : kGrids)
      for (const Tolerance& tol : tols) {
        const std::string what = "n=" + std::to_string(n) + " grid " + compute_dtype_name(grid) + " " + tol.str();
        expect_matches(reference_metrics(p.ref, p.cand, grid, tol),
                       pair_metrics(p.ref.data(), p.cand.data(), n, grid, tol), what);
      }
  }
}

TEST(CompareFastPath, NonFiniteDataMatchesThePlainDefinition) {
  uint32_t seed = 100;
  for (int64_t n : {1, 7, 4096, 4097, 140001}) {
    for (int where : {1, 3, 200}) {
      Pair p = random_pair(n, seed++);
      add_nonfinite(p, where, seed++);
      for (ComputeDType grid : kGrids) {
        const std::string what = "n=" + std::to_string(n) + " with " + std::to_string(where) + " NaN/Inf, grid " +
                                 compute_dtype_name(grid);
        const PairMetrics want = reference_metrics(p.ref, p.cand, grid, Tolerance{});
        expect_matches(want, pair_metrics(p.ref.data(), p.cand.data(), n, grid, Tolerance{}), what);
        // The public single-purpose entry points give the same.
        expect_matches(PairMetrics{want.metrics, reference_metrics(p.ref, p.cand, ComputeDType::Float32,
                                                                   Tolerance{}).allclose},
                       PairMetrics{float_metrics(p.ref.data(), p.cand.data(), n, grid),
                                   allclose(p.ref.data(), p.cand.data(), n, Tolerance{})},
                       what + " (float_metrics, allclose)");
      }
    }
  }
  // Only non-finite values, and a tolerance outside [0, inf) (plain path throughout).
  Pair all{std::vector<float>(5000, kNaN), std::vector<float>(5000, kInfF)};
  expect_matches(reference_metrics(all.ref, all.cand, ComputeDType::Float32, Tolerance{}),
                 pair_metrics(all.ref.data(), all.cand.data(), 5000, ComputeDType::Float32, Tolerance{}), "all NaN");
  const Pair p = random_pair(9000, 7);
  const Tolerance odd{kInf, 1e-5};
  expect_matches(reference_metrics(p.ref, p.cand, ComputeDType::Float32, odd),
                 pair_metrics(p.ref.data(), p.cand.data(), 9000, ComputeDType::Float32, odd), "infinite rtol");
}

// rmse, rms and diff_stats (compare/noise_floor.h) against their definitions
// written element by element: sizes around the 32-pair blocks, NaN/Inf in
// some blocks (alike on both sides, or on one side only), ties of the
// maximum.
TEST(CompareFastPath, NoiseSumsMatchThePlainDefinition) {
  std::mt19937 gen(11);
  std::normal_distribution<float> normal;
  for (int64_t n : {0, 1, 7, 31, 32, 33, 64, 95, 1000, 4099}) {
    for (int specials = 0; specials < 3; ++specials) {
      SCOPED_TRACE("n " + std::to_string(n) + ", specials " + std::to_string(specials));
      std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        b[size_t(i)] = normal(gen);
        a[size_t(i)] = b[size_t(i)] + 1e-3f * normal(gen);
      }
      if (specials > 0 && n > 5) {
        a[3] = b[3] = kNaN;           // alike: skipped
        a[size_t(n - 1)] = b[size_t(n - 1)] = -kInfF;
      }
      if (specials > 1 && n > 40) {
        a[40] = kInfF;                // one side only: a mismatch
        b[size_t(n / 2)] = kNaN;
      }
      double sum = 0, sq = 0, num = 0, den = 0, mx = 0;
      int64_t count = 0, finite = 0, bad = 0, at = -1;
      for (int64_t i = 0; i < n; ++i) {
        const float x = a[size_t(i)], y = b[size_t(i)];
        if (std::isfinite(y)) sq += double(y) * double(y), ++finite;
        if (std::isfinite(x) && std::isfinite(y)) {
          const double d = double(x) - double(y);
          sum += d * d, ++count;
          num += d * d, den += double(y) * double(y);
          if (std::fabs(d) > mx && mx != kInf) mx = std::fabs(d), at = i;
        } else if (!same_special(x, y)) {
          ++bad;
          mx = kInf, at = i;
        }
      }
      int64_t got_bad = -1;
      const double e = rmse(a.data(), b.data(), n, &got_bad);
      EXPECT_EQ(got_bad, bad);
      EXPECT_NEAR(e, count ? std::sqrt(sum / double(count)) : 0.0, 1e-12 * e);
      const double r = rms(b.data(), n);
      EXPECT_NEAR(r, finite ? std::sqrt(sq / double(finite)) : 0.0, 1e-12 * r);
      double got_max = -1, got_nmse = -1;
      int64_t got_at = -2;
      diff_stats(a.data(), b.data(), n, &got_max, &got_at, &got_nmse);
      EXPECT_EQ(got_max, mx);
      EXPECT_EQ(got_at, at);
      EXPECT_NEAR(got_nmse, den > 0 ? num / den : 0.0, 1e-12 * got_nmse);
    }
  }
  // Ties: the first offset that reaches the maximum, whichever lane holds it.
  std::vector<float> a(100, 1.0f), b(100, 1.0f);
  a[70] = a[37] = a[90] = 3.0f;
  double mx = 0, nmse = 0;
  int64_t at = -1;
  diff_stats(a.data(), b.data(), 100, &mx, &at, &nmse);
  EXPECT_EQ(mx, 2.0);
  EXPECT_EQ(at, 37);
  diff_stats(b.data(), b.data(), 100, &mx, &at, &nmse);
  EXPECT_EQ(mx, 0.0);
  EXPECT_EQ(at, -1);
  EXPECT_EQ(nmse, 0.0);
}

TEST(CompareFastPath, UlpGridsAtTheirEdges) {
  // Rounding ties, the half-precision subnormal and overflow edges, float32
  // extremes: every pair on every grid, one element at a time.
  const float edges[] = {0.0f, -0.0f, 1.0f, -1.0f - 0x1p-8f,
                         // bfloat16 spacing at 1 is 2^-7, half's 2^-10: ties to even both ways, and not ties
                         1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-7f, 1.0f + 3 * 0x1p-9f,
                         1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 1.0f + 3 * 0x1p-12f,
                         // half: largest finite 65504, overflow from 65520; normal from 2^-14, subnormal step 2^-24
                         65504.0f, 65505.0f, 65519.0f, 65520.0f, 65536.0f, -70000.0f, 0x1p-14f, 0x1p-14f - 0x1p-25f,
                         0x1p-24f, 0x1p-25f, 0x1.8p-25f, 3 * 0x1p-26f, -0x1p-20f,
                         // float32 extremes (the largest rounds to infinity in bfloat16)
                         std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                         std::numeric_limits<float>::min(), std::numeric_limits<float>::denorm_min(), 3.3895314e38f};
  for (ComputeDType grid : kGrids)
    for (float x : edges)
      for (float y : edges) {
        const int64_t got = pair_metrics(&x, &y, 1, grid, Tolerance{}).metrics.max_ulp;
        EXPECT_EQ(got, ulp_distance(y, x, grid)) << x << " vs " << y << " on " << compute_dtype_name(grid);
      }
}

TEST(CompareFastPath, FirstIndexOfTiedMaximaAcrossChunks) {
  // Equal largest errors in two chunks and twice within one: the first wins.
  std::vector<float> ref(3 * 4096, 1.0f), cand(3 * 4096, 1.0f);
  for (size_t i : {size_t(5000), size_t(4100), size_t(9000), size_t(4103)}) cand[i] = 3.0f;
  PairMetrics m = pair_metrics(ref.data(), cand.data(), int64_t(ref.size()), ComputeDType::Float32, Tolerance{});
  EXPECT_EQ(m.metrics.max_abs_at, 4100);
  EXPECT_EQ(m.metrics.max_rel_at, 4100);
  EXPECT_EQ(m.allclose.worst_at, 4100);
  EXPECT_EQ(m.allclose.first_fail, 4100);
  EXPECT_EQ(m.allclose.failing, 4);
  // No error at all: every maximum sits at the first element.
  PairMetrics z = pair_metrics(ref.data(), ref.data(), int64_t(ref.size()), ComputeDType::Float32, Tolerance{});
  EXPECT_EQ(z.metrics.max_abs_at, 0);
  EXPECT_EQ(z.metrics.max_rel_at, 0);
  EXPECT_EQ(z.allclose.worst_at, 0);
  EXPECT_EQ(z.allclose.first_fail, -1);
  // A NaN chunk before the tie: positions still in flat order.
  cand[10] = kNaN;
  PairMetrics w = pair_metrics(ref.data(), cand.data(), int64_t(ref.size()), ComputeDType::Float32, Tolerance{});
  EXPECT_EQ(w.metrics.max_abs_at, 4100);
  EXPECT_EQ(w.allclose.first_fail, 10);
  EXPECT_TRUE(std::isinf(w.allclose.worst_ratio));
  EXPECT_EQ(w.allclose.worst_at, 10);
}

TEST(CompareFastPath, ResultsDoNotDependOnTheThreadCount) {
  Pair p = random_pair(300007, 11);
  add_nonfinite(p, 5, 12);
  const int64_t n = int64_t(p.ref.size());
  for (ComputeDType grid : kGrids) {
    const PairMetrics alone = pair_metrics(p.ref.data(), p.cand.data(), n, grid, Tolerance{});
    for (int threads : {1, 2, 3, 5}) {
      ThreadPool pool(threads);
      expect_identical(alone, pair_metrics(p.ref.data(), p.cand.data(), n, grid, Tolerance{}, &pool),
                       std::string(compute_dtype_name(grid)) + " on " + std::to_string(threads) + " threads");
    }
  }
}

TEST(CompareFastPath, ThreadPoolRunsEveryTaskOnceAndPassesErrorsOn) {
  ThreadPool pool(3);
  EXPECT_EQ(pool.size(), 3);
  std::vector<int> hits(1000, 0);
  pool.parallel_for(1000, [&](int64_t k) { ++hits[size_t(k)]; });
  for (int h : hits) EXPECT_EQ(h, 1);
  EXPECT_THROW(pool.parallel_for(10, [](int64_t k) {
                 if (k == 7) throw std::runtime_error("task 7");
               }),
               std::runtime_error);
  pool.parallel_for(4, [&](int64_t k) { hits[size_t(k)] = 5; });  // usable after an error
  EXPECT_EQ(hits[3], 5);
}

namespace {
// Logits metrics the plain way: argmax and top-k by sorting, KL from
// log-softmax rows with std::exp.
LogitsMetrics reference_logits(const std::vector<float>& ref, const std::vector<float>& cand, int64_t rows,
                               int64_t cols) {
  LogitsMetrics m;
  m.rows = rows;
  m.cols = cols;
  m.topk = int(std::min<int64_t>(5, cols));
  double overlap = 0, kl_sum = 0;
  auto top = [&](const float* v) {
    std::vector<int64_t> idx(static_cast<size_t>(cols));
    for (int64_t i = 0; i < cols; ++i) idx[size_t(i)] = i;
    auto key = [v](int64_t i) { return std::isnan(v[i]) ? -std::numeric_limits<float>::infinity() : v[i]; };
    std::stable_sort(idx.begin(), idx.end(), [&](int64_t x, int64_t y) { return key(x) > key(y); });
    idx.resize(size_t(m.topk));
    return idx;
  };
  auto log_softmax = [&](const float* v) {
    double mx = -kInf, s = 0;
    for (int64_t i = 0; i < cols; ++i) mx = std::max(mx, double(v[i]));
    for (int64_t i = 0; i < cols; ++i) s += std::exp(double(v[i]) - mx);
    std::vector<double> out(static_cast<size_t>(cols));
    for (int64_t i = 0; i < cols; ++i) out[size_t(i)] = double(v[i]) - (mx + std::log(s));
    return out;
  };
  for (int64_t r = 0; r < rows; ++r) {
    const float* b = ref.data() + r * cols;
    const float* a = cand.data() + r * cols;
    const int64_t ia = argmax(a, cols), ib = argmax(b, cols);
    if (ia == ib) {
      ++m.argmax_agree;
    } else if (m.first_argmax_mismatch < 0) {
      m.first_argmax_mismatch = r;
      m.ref_argmax = ib;
      m.cand_argmax = ia;
    }
    if (m.first_argmax_mismatch < 0) {
      m.ref_argmax = ib;
      m.cand_argmax = ia;
    }
    const auto ta = top(a), tb = top(b);
    int common = 0;
    for (int64_t x : ta) common += std::count(tb.begin(), tb.end(), x) ? 1 : 0;
    overlap += double(common) / m.topk;
    const auto lp = log_softmax(b), lq = log_softmax(a);
    double kl = 0;
    for (int64_t i = 0; i < cols; ++i) {
      const double p = std::exp(lp[size_t(i)]);
      if (p > 0) kl += p * (lp[size_t(i)] - lq[size_t(i)]);
    }
    kl = kl < 0 ? 0 : kl;
    kl_sum += kl;
    if (!(kl <= m.kl_max)) m.kl_max = kl;
  }
  m.topk_overlap = overlap / double(rows);
  m.kl_mean = kl_sum / double(rows);
  return m;
}

void expect_logits(const LogitsMetrics& want, const LogitsMetrics& got, const std::string& what) {
  EXPECT_EQ(want.argmax_agree, got.argmax_agree) << what;
  EXPECT_EQ(want.first_argmax_mismatch, got.first_argmax_mismatch) << what;
  EXPECT_EQ(want.ref_argmax, got.ref_argmax) << what;
  EXPECT_EQ(want.cand_argmax, got.cand_argmax) << what;
  EXPECT_EQ(want.topk, got.topk) << what;
  EXPECT_DOUBLE_EQ(want.topk_overlap, got.topk_overlap) << what;
  for (auto [x, y] : {std::pair{want.kl_mean, got.kl_mean}, {want.kl_max, got.kl_max}}) {
    if (std::isnan(x))
      EXPECT_TRUE(std::isnan(y)) << what;
    else
      EXPECT_NEAR(y, x, 1e-9 * x + 1e-14) << what;
  }
}
}  // namespace

TEST(CompareFastPath, LogitsMatchThePlainDefinition) {
  std::mt19937 g(5);
  std::normal_distribution<float> val(0.0f, 4.0f);
  for (int64_t cols : {1, 3, 6, 100, 4099}) {
    const int64_t rows = 21;
    std::vector<float> ref(size_t(rows * cols)), cand(ref.size());
    for (size_t i = 0; i < ref.size(); ++i) {
      ref[i] = std::round(val(g) * 2) / 2;  // coarse values: ties in argmax and top-k
      cand[i] = ref[i] + (i % 3 == 0 ? 0.25f * val(g) : 0.0f);
    }
    // Row 1 identical, row 2 with a NaN in the candidate, row 3 with -inf and +inf.
    std::copy(ref.begin() + cols, ref.begin() + 2 * cols, cand.begin() + cols);
    cand[size_t(2 * cols)] = kNaN;
    ref[size_t(3 * cols)] = -kInfF;
    if (cols > 1) cand[size_t(3 * cols + 1)] = kInfF;
    const std::string what = "cols " + std::to_string(cols);
    const LogitsMetrics want = reference_logits(ref, cand, rows, cols);
    expect_logits(want, logits_metrics(ref.data(), cand.data(), rows, cols), what);
    ThreadPool pool(3);
    const LogitsMetrics a = logits_metrics(ref.data(), cand.data(), rows, cols);
    const LogitsMetrics b = logits_metrics(ref.data(), cand.data(), rows, cols, &pool);
    EXPECT_EQ(std::memcmp(&a.kl_mean, &b.kl_mean, sizeof(double)), 0) << what;
    EXPECT_EQ(a.argmax_agree, b.argmax_agree) << what;
    // Finite rows only: KL agrees closely, and is exactly 0 for equal rows.
    const int64_t clean = 2;
    std::vector<float> r2(ref.begin(), ref.begin() + clean * cols), c2(cand.begin(), cand.begin() + clean * cols);
    expect_logits(reference_logits(r2, c2, clean, cols), logits_metrics(r2.data(), c2.data(), clean, cols), what);
    EXPECT_EQ(logits_metrics(r2.data(), r2.data(), clean, cols).kl_max, 0.0) << what;
  }
}

TEST(CompareFastPath, LayoutSearchRulesOutNearMisses) {
  // [T, H*Dh] q_rope whose candidate is the RoPE re-pairing of the
  // reference: found; the same with one element off: not.
  const int64_t T = 33, H = 4, Dh = 16;
  std::mt19937 g(3);
  std::normal_distribution<float> val(0.0f, 1.0f);
  std::vector<float> ref(size_t(T * H * Dh));
  for (auto& v : ref) v = val(g);
  std::vector<float> cand = rope_repair(ref.data(), int64_t(ref.size()), Dh, true);
  LayoutContext ctx{H, H, Dh};
  const Shape shape{T, H * Dh};
  const std::string name = "step0.layers.0.attn.q_rope";
  auto found = explain_value_mismatch(name, ref.data(), cand.data(), shape, Tolerance{}, ComputeDType::Float32, ctx);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].kind, LayoutFinding::Kind::RopePairing);
  EXPECT_TRUE(found[0].matches);
  // The TensorData form agrees.
  TensorData rt = float_tensor(name, shape, ref), ct = float_tensor(name, shape, cand);
  auto same = explain_value_mismatch(name, rt, ct, Tolerance{}, ComputeDType::Float32, ctx);
  ASSERT_EQ(same.size(), 1u);
  EXPECT_EQ(same[0].summary, found[0].summary);
  // One element off (wherever the sample falls) and the layout no longer matches.
  for (size_t at : {size_t(1000), size_t(ref.size() - 3)}) {
    std::vector<float> off = cand;
    off[at] += 1.0f;
    auto none = explain_value_mismatch(name, ref.data(), off.data(), shape, Tolerance{}, ComputeDType::Float32, ctx);
    EXPECT_TRUE(none.empty()) << at;
  }
}

namespace {
// A TensorSource that is neither a DumpFile nor a MemoryDump: compare_dumps
// reads it through get(), i.e. on copies.
class Forwarding : public TensorSource {
 public:
  explicit Forwarding(const TensorSource& base) : base_(base) {}
  const std::string& label() const override { return base_.label(); }
  const Manifest& manifest() const override { return base_.manifest(); }
  std::vector<std::string> names() const override { return base_.names(); }
  bool has(const std::string& n) const override { return base_.has(n); }
  Shape shape(const std::string& n) const override { return base_.shape(n); }
  TensorData get(const std::string& n) const override { return base_.get(n); }

 private:
  const TensorSource& base_;
};

void expect_same_diff(const DiffResult& a, const DiffResult& b, const std::string& what) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size()) << what;
  EXPECT_EQ(a.first_divergence, b.first_divergence) << what;
  EXPECT_EQ(a.failing(), b.failing()) << what;
  for (size_t k = 0; k < a.tensors.size(); ++k) {
    const TensorComparison &x = a.tensors[k], &y = b.tensors[k];
    const std::string w = what + " " + x.name;
    EXPECT_EQ(x.name, y.name) << w;
    EXPECT_EQ(x.pass, y.pass) << w;
    EXPECT_EQ(x.notes, y.notes) << w;
    EXPECT_EQ(x.findings.size(), y.findings.size()) << w;
    EXPECT_EQ(x.ints.mismatches, y.ints.mismatches) << w;
    if (!x.is_int && x.shape_match) expect_identical({x.metrics, x.allclose}, {y.metrics, y.allclose}, w);
    EXPECT_EQ(x.judgement.value, y.judgement.value) << w;
    EXPECT_EQ(x.logits.has_value(), y.logits.has_value()) << w;
    if (x.logits) {
      EXPECT_EQ(x.logits->kl_mean, y.logits->kl_mean) << w;
    }
  }
  EXPECT_EQ(a.greedy.first_divergent_step, b.greedy.first_divergent_step) << what;
  ASSERT_EQ(a.layer_trace.size(), b.layer_trace.size()) << what;
  for (size_t k = 0; k < a.layer_trace.size(); ++k) EXPECT_EQ(a.layer_trace[k].worst_nmse, b.layer_trace[k].worst_nmse);
}
}  // namespace

TEST(CompareFastPath, InPlaceAndCopyingPathsAgreeOnGoldenDumps) {
  const std::string model = golden_models().front();
  DumpFile ref(golden_dump(model, "decode"));
  MemoryDump cand("perturbed");
  copy_into(ref, cand);
  // A relative error that grows along the canonical order, a NaN in one name
  // and a RoPE re-pairing in another: passes, failures, notes and findings.
  int k = 0;
  for (const auto& n : cand.names()) {
    TensorData t = cand.get(n);
    if (t.is_int) continue;
    const float scale = 1.0f + 1e-7f * float(++k);
    for (auto& v : t.f) v *= scale;
    if (n.find("layers.0.mlp.act") != std::string::npos && n.rfind("step0.", 0) == 0) t.f[1] = kNaN;
    if (n.find("layers.1.attn.q_rope") != std::string::npos && n.rfind("step0.", 0) == 0 && !t.shape.empty() &&
        t.shape.back() % 2 == 0)
      t.f = rope_repair(t.f.data(), t.numel(), t.shape.back(), false);
    cand.put(t);
  }
  const DiffResult in_place = compare_dumps(ref, cand);
  EXPECT_GT(in_place.failing(), 0u);
  EXPECT_LT(in_place.failing(), in_place.tensors.size());
  const Forwarding ref_copy(ref), cand_copy(cand);
  expect_same_diff(in_place, compare_dumps(ref_copy, cand_copy), "copying");
  for (int threads : {1, 3}) {
    CompareOptions o;
    o.threads = threads;
    expect_same_diff(in_place, compare_dumps(ref, cand, o), std::to_string(threads) + " threads");
  }
}
