// compare/metrics: every metric against hand-computed values.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "compare/metrics.h"

using namespace llmdiff;
using namespace llmdiff::compare;

namespace {
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInfF = std::numeric_limits<float>::infinity();

// ref b = [1, 2, 3, 4], cand a = [1, 2.5, 2, 4]: a-b = [0, 0.5, -1, 0].
const std::vector<float> kRef{1, 2, 3, 4};
const std::vector<float> kCand{1, 2.5f, 2, 4};
}  // namespace

TEST(CompareMetrics, FloatMetricsHandComputed) {
  FloatMetrics m = float_metrics(kRef.data(), kCand.data(), 4, ComputeDType::Float32);
  EXPECT_EQ(m.count, 4);
  EXPECT_EQ(m.finite_pairs, 4);
  EXPECT_DOUBLE_EQ(m.max_abs, 1.0);
  EXPECT_EQ(m.max_abs_at, 2);
  EXPECT_DOUBLE_EQ(m.ref_at_max_abs, 3.0);
  EXPECT_DOUBLE_EQ(m.cand_at_max_abs, 2.0);
  EXPECT_DOUBLE_EQ(m.max_rel, 1.0 / 3.0);  // |2-3|/3 beats |2.5-2|/2
  EXPECT_EQ(m.max_rel_at, 2);
  EXPECT_DOUBLE_EQ(m.mean_abs, 1.5 / 4);
  EXPECT_DOUBLE_EQ(m.rmse, std::sqrt(1.25 / 4));  // sum d^2 = 0.25 + 1
  EXPECT_DOUBLE_EQ(m.nmse, 1.25 / 30);            // sum b^2 = 1+4+9+16
  EXPECT_NEAR(m.sqnr_db, 10 * std::log10(24.0), 1e-12);
  // sum ab = 1+5+6+16 = 28, sum a^2 = 27.25, sum b^2 = 30
  EXPECT_NEAR(m.cosine, 28 / std::sqrt(27.25 * 30), 1e-15);
  EXPECT_DOUBLE_EQ(m.ref_max_abs, 4.0);
  EXPECT_DOUBLE_EQ(m.cand_max_abs, 4.0);
  EXPECT_EQ(m.nonfinite_mismatch, 0);
}

TEST(CompareMetrics, IdenticalAndZeroTensors) {
  FloatMetrics same = float_metrics(kRef.data(), kRef.data(), 4, ComputeDType::Float32);
  EXPECT_EQ(same.max_abs, 0);
  EXPECT_EQ(same.nmse, 0);
  EXPECT_TRUE(std::isinf(same.sqnr_db) && same.sqnr_db > 0);
  EXPECT_DOUBLE_EQ(same.cosine, 1.0);
  EXPECT_EQ(same.max_ulp, 0);

  std::vector<float> zeros(4, 0.0f);
  FloatMetrics zz = float_metrics(zeros.data(), zeros.data(), 4, ComputeDType::Float32);
  EXPECT_EQ(zz.nmse, 0);
  EXPECT_EQ(zz.cosine, 1);
  // Reference all zero, candidate not: NMSE infinite, cosine 0.
  FloatMetrics zr = float_metrics(zeros.data(), kRef.data(), 4, ComputeDType::Float32);
  EXPECT_TRUE(std::isinf(zr.nmse));
  EXPECT_EQ(zr.cosine, 0);
  EXPECT_EQ(zr.max_rel, 0);  // b == 0 everywhere: no relative error defined
}

TEST(CompareMetrics, UlpDistanceInComputeDtypeGrid) {
  float one = 1.0f;
  EXPECT_EQ(ulp_distance(one, std::nextafter(one, 2.0f), ComputeDType::Float32), 1);
  EXPECT_EQ(ulp_distance(one, std::nextafter(std::nextafter(one, 0.0f), 0.0f), ComputeDType::Float32), 2);
  EXPECT_EQ(ulp_distance(0.0f, -0.0f, ComputeDType::Float32), 0);
  // The smallest positive and negative subnormals are 2 apart (through zero).
  float tiny = std::numeric_limits<float>::denorm_min();
  EXPECT_EQ(ulp_distance(tiny, -tiny, ComputeDType::Float32), 2);
  // bfloat16 has 7 fraction bits: 1 and 1 + 2^-7 are neighbours.
  EXPECT_EQ(ulp_distance(1.0f, 1.0f + 0.0078125f, ComputeDType::BFloat16), 1);
  EXPECT_EQ(ulp_distance(1.0f, 1.0f + 4 * 0.0078125f, ComputeDType::BFloat16), 4);
  // 1 + 2^-9 rounds to 1 on the bfloat16 grid but is 2^14 float32 ulps away.
  EXPECT_EQ(ulp_distance(1.0f, 1.0f + 0.001953125f, ComputeDType::BFloat16), 0);
  EXPECT_EQ(ulp_distance(1.0f, 1.0f + 0.001953125f, ComputeDType::Float32), 1 << 14);
  // float16 has 10 fraction bits.
  EXPECT_EQ(ulp_distance(1.0f, 1.0f + 0.0009765625f, ComputeDType::Float16), 1);
  EXPECT_EQ(ulp_distance(-2.0f, 2.0f, ComputeDType::BFloat16), 2 * 0x4000);
  // float64 falls back to the float32 grid (dumps store float32).
  EXPECT_EQ(ulp_distance(one, std::nextafter(one, 2.0f), ComputeDType::Float64), 1);
  EXPECT_EQ(ulp_distance(kNaN, 1.0f, ComputeDType::Float32), -1);

  std::vector<float> r{1.0f, 2.0f}, c{1.0f + 0.0078125f, 2.0f + 3 * 0.015625f};  // 1 and 3 ulps (spacing 2^-6 above 2)
  EXPECT_EQ(float_metrics(r.data(), c.data(), 2, ComputeDType::BFloat16).max_ulp, 3);
}

TEST(CompareMetrics, NonFiniteCountsAndFirstNaN) {
  std::vector<float> ref{1, 2, kNaN, kInfF, -kInfF};
  std::vector<float> cand{kNaN, 2, kNaN, kInfF, kInfF};
  FloatMetrics m = float_metrics(ref.data(), cand.data(), 5, ComputeDType::Float32);
  EXPECT_EQ(m.cand_nonfinite.nan, 2);
  EXPECT_EQ(m.cand_nonfinite.first_nan, 0);
  EXPECT_EQ(m.cand_nonfinite.pos_inf, 2);
  EXPECT_EQ(m.ref_nonfinite.nan, 1);
  EXPECT_EQ(m.ref_nonfinite.first_nan, 2);
  EXPECT_EQ(m.ref_nonfinite.pos_inf, 1);
  EXPECT_EQ(m.ref_nonfinite.neg_inf, 1);
  // Position 0 (NaN vs 1) and 4 (+Inf vs -Inf) mismatch; NaN/NaN and +Inf/+Inf agree.
  EXPECT_EQ(m.nonfinite_mismatch, 2);
  EXPECT_EQ(m.first_nonfinite_mismatch, 0);
  EXPECT_EQ(m.finite_pairs, 1);
  EXPECT_EQ(m.max_abs, 0);

  AllcloseResult a = allclose(ref.data(), cand.data(), 5, Tolerance{1e-3, 1e-3});
  EXPECT_EQ(a.failing, 2);
  EXPECT_EQ(a.first_fail, 0);
  EXPECT_TRUE(std::isinf(a.worst_ratio));
  EXPECT_TRUE(std::isinf(a.min_atol));
  EXPECT_FALSE(a.pass());
}

TEST(CompareMetrics, MultiIndexOfFlatOffsets) {
  EXPECT_EQ(unravel(5, {2, 3}), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(unravel(0, {4, 7, 16}), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(unravel(7 * 16 + 2 * 16 + 5, {4, 7, 16}), (std::vector<int64_t>{1, 2, 5}));
  EXPECT_EQ(index_str({1, 2, 5}), "[1, 2, 5]");
  // A NaN's position is reported as a multi-index by the comparison; the flat offset here:
  std::vector<float> ref(24, 1.0f), cand(24, 1.0f);
  cand[17] = kNaN;
  FloatMetrics m = float_metrics(ref.data(), cand.data(), 24, ComputeDType::Float32);
  EXPECT_EQ(unravel(m.cand_nonfinite.first_nan, {2, 3, 4}), (std::vector<int64_t>{1, 1, 1}));
}

TEST(CompareMetrics, AllcloseAndMinimalTolerances) {
  // bounds 0.1 + 0.1|b| = [0.2, 0.3, 0.4, 0.5] vs |a-b| = [0, 0.5, 1, 0]
  AllcloseResult a = allclose(kRef.data(), kCand.data(), 4, Tolerance{0.1, 0.1});
  EXPECT_EQ(a.failing, 2);
  EXPECT_EQ(a.first_fail, 1);
  EXPECT_DOUBLE_EQ(a.fraction, 0.5);
  EXPECT_NEAR(a.worst_ratio, 1.0 / 0.4, 1e-12);
  EXPECT_EQ(a.worst_at, 2);
  EXPECT_NEAR(a.min_atol, 1.0 - 0.1 * 3, 1e-12);        // max(|a-b| - rtol|b|)
  EXPECT_NEAR(a.min_rtol, (1.0 - 0.1) / 3, 1e-12);      // max((|a-b| - atol)/|b|)
  // The reported minima do pass (with a hair of slack for rounding), anything smaller does not.
  EXPECT_TRUE(allclose(kRef.data(), kCand.data(), 4, Tolerance{0.1, a.min_atol * (1 + 1e-12)}).pass());
  EXPECT_FALSE(allclose(kRef.data(), kCand.data(), 4, Tolerance{0.1, a.min_atol * 0.99}).pass());
  EXPECT_TRUE(allclose(kRef.data(), kCand.data(), 4, Tolerance{a.min_rtol * (1 + 1e-12), 0.1}).pass());
  EXPECT_FALSE(allclose(kRef.data(), kCand.data(), 4, Tolerance{a.min_rtol * 0.99, 0.1}).pass());
  // rtol scales with the reference (b), not the candidate.
  std::vector<float> ten{10}, eleven{11};
  EXPECT_TRUE(allclose(eleven.data(), ten.data(), 1, Tolerance{0.095, 0}).pass());   // 1 <= 0.095 * 11
  EXPECT_FALSE(allclose(ten.data(), eleven.data(), 1, Tolerance{0.095, 0}).pass());  // 1 > 0.095 * 10
  // b == 0 with |a-b| > atol: no rtol helps.
  std::vector<float> z{0}, o{1};
  EXPECT_TRUE(std::isinf(allclose(z.data(), o.data(), 1, Tolerance{0.1, 0.5}).min_rtol));
}

TEST(CompareMetrics, LogitsArgmaxTopkAndKL) {
  // Row 0: candidate swaps the two largest logits; row 1 identical.
  std::vector<float> ref{1, 2, 3, 3, 2, 1};
  std::vector<float> cand{1, 3, 2, 3, 2, 1};
  LogitsMetrics l = logits_metrics(ref.data(), cand.data(), 2, 3);
  EXPECT_EQ(l.rows, 2);
  EXPECT_EQ(l.argmax_agree, 1);
  EXPECT_EQ(l.first_argmax_mismatch, 0);
  EXPECT_EQ(l.ref_argmax, 2);
  EXPECT_EQ(l.cand_argmax, 1);
  EXPECT_EQ(l.topk, 3);
  EXPECT_DOUBLE_EQ(l.topk_overlap, 1.0);
  // KL(p||q) with q = p with its last two entries swapped = (p3 - p2)(log p3 - log p2) = (e^3 - e^2)/(e + e^2 + e^3).
  double e1 = std::exp(1.0), e2 = std::exp(2.0), e3 = std::exp(3.0);
  double kl0 = (e3 - e2) / (e1 + e2 + e3);
  EXPECT_NEAR(l.kl_max, kl0, 1e-12);
  EXPECT_NEAR(l.kl_mean, kl0 / 2, 1e-12);

  // top-5 of 6: {1..5} vs {0..4} share 4.
  std::vector<float> r6{0, 1, 2, 3, 4, 5}, c6{5, 4, 3, 2, 1, 0};
  LogitsMetrics l6 = logits_metrics(r6.data(), c6.data(), 1, 6);
  EXPECT_EQ(l6.topk, 5);
  EXPECT_DOUBLE_EQ(l6.topk_overlap, 0.8);
  EXPECT_EQ(l6.argmax_agree, 0);
  // Ties resolve to the first index, as greedy decoding does.
  std::vector<float> tie{1, 5, 5};
  EXPECT_EQ(argmax(tie.data(), 3), 1);
}

TEST(CompareMetrics, IntegerTensorsExact) {
  std::vector<int64_t> r{1, 2, 3, 4}, c{1, 5, 3, 7};
  IntMetrics m = int_metrics(r.data(), c.data(), 4);
  EXPECT_EQ(m.count, 4);
  EXPECT_EQ(m.mismatches, 2);
  EXPECT_EQ(m.first_mismatch, 1);
  EXPECT_EQ(m.ref_value, 2);
  EXPECT_EQ(m.cand_value, 5);
  EXPECT_EQ(int_metrics(r.data(), r.data(), 4).mismatches, 0);
}
