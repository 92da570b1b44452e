// compare/ bisection pieces on synthetic data: the noise-floor criterion
// (honest rounding passes, an RMSNorm-eps-sized systematic error fails),
// local-error judgement, fingerprints (the pipeline with in-memory runners:
// tests/test_bisect_pipeline.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>

#include "compare/bisect_report.h"
#include "compare/diagnose.h"
#include "compare/local_error.h"
#include "compare/noise_floor.h"
#include "dumps/base/errors.h"
#include "tests/test_compare_helpers.h"
#include "tests/test_diag_toys.h"

using namespace llmdiff;
using namespace llmdiff::compare;
using llmdiff::testing::float_tensor;
using llmdiff::testing::fired;
using llmdiff::testing::int_tensor;
using llmdiff::testing::toy_dump;
using llmdiff::testing::toy_scenario;

namespace {

// Deterministic normal samples (splitmix64 + Box-Muller).
class Normal {
 public:
  explicit Normal(uint64_t seed) : s_(seed) {}
  double operator()() {
    const double u1 = (double(next() >> 11) + 0.5) / 9007199254740992.0;
    const double u2 = (double(next() >> 11) + 0.5) / 9007199254740992.0;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  uint64_t s_;
};

std::vector<double> normals(size_t n, uint64_t seed) {
  Normal g(seed);
  std::vector<double> v(n);
  for (double& x : v) x = g();
  return v;
}

// float32 rounding of x * (1 + rel), which is what an honest float32 op adds.
std::vector<float> to_f32(const std::vector<double>& x, double rel = 0.0) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = float(x[i] * (1.0 + rel));
  return out;
}

// An RMSNorm of unit-scale rows evaluated with eps_used instead of eps_true:
// y = x * rsqrt(mean(x^2) + eps) per row of `cols`.
std::vector<double> rmsnorm(const std::vector<double>& x, size_t cols, double eps) {
  std::vector<double> y(x.size());
  for (size_t r = 0; r < x.size() / cols; ++r) {
    double ss = 0;
    for (size_t c = 0; c < cols; ++c) ss += x[r * cols + c] * x[r * cols + c];
    const double k = 1.0 / std::sqrt(ss / double(cols) + eps);
    for (size_t c = 0; c < cols; ++c) y[r * cols + c] = x[r * cols + c] * k;
  }
  return y;
}

// Adds float32-scale noise of `ulps` float32 epsilons (relative) to the
// double values, then rounds to float32: a stand-in for an implementation's
// own rounding in the op.
std::vector<float> noisy_f32(const std::vector<double>& x, double ulps, uint64_t seed) {
  Normal g(seed);
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = float(x[i] * (1.0 + ulps * kFloat32Eps * g()));
  return out;
}

std::shared_ptr<MemoryDump> dump_with(const std::string& label, const std::vector<TensorData>& tensors,
                                      const std::string& dtype = "float32") {
  auto d = std::make_shared<MemoryDump>(label);
  d->mutable_manifest().dtype = dtype;
  for (const auto& t : tensors) d->put(t);
  return d;
}

}  // namespace

// ---------------------------------------------------------------------------
// Noise floor

TEST(NoiseFloor, MultiplierAndFloorFollowTheDtype) {
  EXPECT_EQ(noise_multiplier(ComputeDType::Float32), 2.0);
  EXPECT_EQ(noise_multiplier(ComputeDType::Float64), 2.0);
  EXPECT_EQ(noise_multiplier(ComputeDType::BFloat16), 3.0);
  EXPECT_EQ(noise_multiplier(ComputeDType::Float16), 3.0);
  EXPECT_DOUBLE_EQ(noise_floor_abs(2.0), 2.0 * kNoiseFloorEps * kFloat32Eps);
  EXPECT_EQ(noise_floor_abs(0.0), 0.0);
}

TEST(NoiseFloor, HonestFloat32RoundingPassesAndRmsnormEpsFails) {
  // attn_norm of unit-scale rows (embeddings ~ N(0,1)), D = 64, 8 rows.
  const size_t D = 64;
  std::vector<double> x = normals(8 * D, 1);
  std::vector<double> truth = rmsnorm(x, D, 1e-6);
  std::vector<float> t32 = to_f32(truth);
  std::vector<float> ref = noisy_f32(truth, 0.5, 2);   // the reference's own rounding
  std::vector<float> cand = noisy_f32(truth, 0.7, 3);  // another honest implementation, a bit worse
  NoiseStats honest = noise_stats(t32.data(), ref.data(), cand.data(), int64_t(t32.size()), ComputeDType::Float32);
  EXPECT_TRUE(honest.pass()) << honest.str();
  EXPECT_LT(honest.ratio(), 0.6);

  // The same rows normalised with eps = 1e-5 instead of 1e-6: NMSE ~ 2e-11.
  std::vector<float> wrong = noisy_f32(rmsnorm(x, D, 1e-5), 0.7, 3);
  double num = 0, den = 0;
  for (size_t i = 0; i < t32.size(); ++i) {
    num += (double(wrong[i]) - t32[i]) * (double(wrong[i]) - t32[i]);
    den += double(t32[i]) * t32[i];
  }
  EXPECT_GT(num / den, 5e-12);
  EXPECT_LT(num / den, 1e-10);
  NoiseStats bug = noise_stats(t32.data(), ref.data(), wrong.data(), int64_t(t32.size()), ComputeDType::Float32);
  EXPECT_FALSE(bug.pass()) << bug.str();
  EXPECT_GT(bug.ratio(), 3.0);
}

TEST(NoiseFloor, ExactOpsNeedNoBitEquality) {
  // The reference reproduces the truth exactly (a copy); a candidate one
  // float32 ulp off on some elements passes through the floor, a 1e-5
  // relative error does not.
  std::vector<double> truth = normals(256, 7);
  std::vector<float> t32 = to_f32(truth);
  std::vector<float> cand = t32;
  for (size_t i = 0; i < cand.size(); i += 3) cand[i] = std::nextafter(cand[i], 10.0f);
  NoiseStats s = noise_stats(t32.data(), t32.data(), cand.data(), int64_t(t32.size()), ComputeDType::Float32);
  EXPECT_EQ(s.ref_rmse, 0.0);
  EXPECT_TRUE(s.pass()) << s.str();
  std::vector<float> off = to_f32(truth, 1e-5);
  EXPECT_FALSE(noise_stats(t32.data(), t32.data(), off.data(), int64_t(t32.size()), ComputeDType::Float32).pass());
}

TEST(NoiseFloor, NonFiniteCandidateFails) {
  std::vector<float> t = {1, 2, 3, 4}, r = t, c = t;
  c[2] = std::nanf("");
  NoiseStats s = noise_stats(t.data(), r.data(), c.data(), 4, ComputeDType::Float32);
  EXPECT_FALSE(s.finite);
  EXPECT_FALSE(s.pass());
  EXPECT_TRUE(std::isinf(s.ratio()));
  // ... unless the reference at dtype shows the same non-finite value.
  r[2] = std::nanf("");
  EXPECT_TRUE(noise_stats(t.data(), r.data(), c.data(), 4, ComputeDType::Float32).pass());
}

TEST(NoiseFloor, SixteenBitCandidatesGetALargerMultiplier) {
  std::vector<double> truth = normals(512, 11);
  std::vector<float> t32 = to_f32(truth);
  // bfloat16-sized noise (2^-8 relative): the candidate 2.5x the reference's.
  std::vector<float> ref = noisy_f32(truth, 0.25 * 32768, 12), cand = noisy_f32(truth, 0.625 * 32768, 13);
  EXPECT_FALSE(noise_stats(t32.data(), ref.data(), cand.data(), 512, ComputeDType::Float32).pass());
  EXPECT_TRUE(noise_stats(t32.data(), ref.data(), cand.data(), 512, ComputeDType::BFloat16).pass());
}

TEST(NoiseFloor, TheNoiseIsTheLargerOfTwoHonestRuns) {
  // A matmul output accumulated in one sequential chain: ~2.5x the blocked
  // reference's rounding (measured at K = 2048); the clean impl sums the same way.
  std::vector<double> truth = normals(4096, 41);
  std::vector<float> t32 = to_f32(truth);
  std::vector<float> ref = noisy_f32(truth, 20.0, 42);
  std::vector<float> sequential = noisy_f32(truth, 55.0, 43);  // the candidate: 2.75x the reference
  std::vector<float> impl = noisy_f32(truth, 50.0, 44);        // the second honest run
  const int64_t n = int64_t(t32.size());
  NoiseStats alone = noise_stats(t32.data(), ref.data(), sequential.data(), n, ComputeDType::Float32);
  EXPECT_FALSE(alone.pass()) << alone.str();
  EXPECT_LT(alone.second_rmse, 0.0);
  NoiseStats both = noise_stats(t32.data(), ref.data(), sequential.data(), n, ComputeDType::Float32, impl.data());
  EXPECT_TRUE(both.pass()) << both.str();
  EXPECT_GT(both.second_rmse, 2.0 * both.ref_rmse);
  EXPECT_EQ(both.noise(), both.second_rmse);
  EXPECT_DOUBLE_EQ(both.threshold(), 2.0 * both.second_rmse + both.floor);
  // A systematic error of 3e-5 relative still fails with both.
  std::vector<float> off = noisy_f32([&] {
    std::vector<double> v = truth;
    for (double& x : v) x *= 1.0 + 3e-5;
    return v;
  }(), 55.0, 45);
  EXPECT_FALSE(noise_stats(t32.data(), ref.data(), off.data(), n, ComputeDType::Float32, impl.data()).pass());
  // A second run with non-finite values says nothing of the noise.
  impl[7] = std::nanf("");
  EXPECT_LT(noise_stats(t32.data(), ref.data(), sequential.data(), n, ComputeDType::Float32, impl.data()).second_rmse, 0.0);
}

// Greedy picks are judged against float64: a pick the reference at dtype
// flips is right when it is the float64 argmax, undecidable at a near-tie
// (float64 gap within the rounding noise), wrong otherwise.
TEST(NoiseFloor, GreedyPicksAreJudgedAgainstFloat64WithNearTiesUndecidable) {
  auto logits = [](std::vector<float> v) { return float_tensor("step0.next_logits", {3}, std::move(v)); };
  auto truth = dump_with("truth", {logits({0.0f, 1.0f, 1.0000001f}), int_tensor("generated", {1}, {2})}, "float64");
  auto ref = dump_with("ref", {logits({0.0f, 1.0000002f, 1.0f}), int_tensor("generated", {1}, {1})});
  auto criterion = std::make_shared<NoiseFloorCriterion>(truth, ComputeDType::Float32);
  criterion->set_reference(ref);
  CompareOptions o;
  o.criterion = criterion;
  o.sites = {"generated"};
  auto judged = [&](int64_t pick) {
    auto cand = dump_with("cand", {int_tensor("generated", {1}, {pick})});
    return *compare_dumps(*ref, *cand, o).find("generated");
  };
  const TensorComparison agrees = judged(2);  // the float64 argmax
  EXPECT_TRUE(agrees.pass);
  EXPECT_NE(agrees.judgement.note.find("float64 argmax"), std::string::npos);
  auto ref_near = dump_with("ref", {logits({0.0f, 1.0f, 1.0000002f}), int_tensor("generated", {1}, {2})});
  criterion->set_reference(ref_near);
  const auto near = compare_dumps(*ref_near, *dump_with("cand", {int_tensor("generated", {1}, {1})}), o);
  ASSERT_NE(near.find("generated"), nullptr);
  EXPECT_TRUE(near.find("generated")->pass);  // gap 1e-7 within 2 x noise 1e-7
  EXPECT_NE(near.find("generated")->judgement.note.find("near-tie"), std::string::npos);
  const auto wrong = compare_dumps(*ref_near, *dump_with("cand", {int_tensor("generated", {1}, {0})}), o);
  EXPECT_FALSE(wrong.find("generated")->pass);  // a gap of 1.0: a wrong pick
  // Without the reference's logits the criterion does not rule: exact.
  CompareOptions plain;
  plain.criterion = std::make_shared<NoiseFloorCriterion>(truth, ComputeDType::Float32);
  plain.sites = {"generated"};
  EXPECT_FALSE(compare_dumps(*ref_near, *dump_with("cand", {int_tensor("generated", {1}, {1})}), plain)
                   .find("generated")
                   ->pass);
}

TEST(NoiseFloor, CriterionUsesTheSecondHonestRun) {
  std::vector<double> y = normals(4 * 64, 51);
  auto truth = dump_with("truth", {float_tensor("step0.layers.0.attn.q", {4, 64}, to_f32(y))}, "float64");
  auto ref = dump_with("ref", {float_tensor("step0.layers.0.attn.q", {4, 64}, noisy_f32(y, 20.0, 52))});
  auto cand = dump_with("cand", {float_tensor("step0.layers.0.attn.q", {4, 64}, noisy_f32(y, 55.0, 53))});
  auto impl = dump_with("impl", {float_tensor("step0.layers.0.attn.q", {4, 64}, noisy_f32(y, 55.0, 54))});
  CompareOptions o;
  o.criterion = std::make_shared<NoiseFloorCriterion>(truth, ComputeDType::Float32);
  EXPECT_EQ(compare_dumps(*ref, *cand, o).failing(), 1u);
  o.criterion = std::make_shared<NoiseFloorCriterion>(truth, ComputeDType::Float32, impl);
  DiffResult r = compare_dumps(*ref, *cand, o);
  EXPECT_EQ(r.failing(), 0u);
  ASSERT_NE(r.find("step0.layers.0.attn.q"), nullptr);
  EXPECT_GT(r.find("step0.layers.0.attn.q")->judgement.threshold, 0.0);
}

TEST(NoiseFloor, CriterionJudgesCompareDumpsAgainstTheFloat64Run) {
  std::vector<double> x = normals(4 * 64, 21);
  std::vector<double> y = rmsnorm(x, 64, 1e-6);
  auto truth = dump_with("truth", {float_tensor("step0.embed", {4, 64}, to_f32(x)),
                                   float_tensor("step0.layers.0.attn_norm", {4, 64}, to_f32(y))},
                         "float64");
  auto ref = dump_with("ref", {float_tensor("step0.embed", {4, 64}, to_f32(x)),
                               float_tensor("step0.layers.0.attn_norm", {4, 64}, noisy_f32(y, 0.5, 22)),
                               float_tensor("step0.layers.0.mlp_norm", {4, 64}, to_f32(y))});
  auto cand = dump_with("cand", {float_tensor("step0.embed", {4, 64}, to_f32(x)),
                                 float_tensor("step0.layers.0.attn_norm", {4, 64}, noisy_f32(rmsnorm(x, 64, 1e-5), 0.5, 23)),
                                 float_tensor("step0.layers.0.mlp_norm", {4, 64}, to_f32(y))});
  CompareOptions o;
  o.criterion = std::make_shared<NoiseFloorCriterion>(truth, ComputeDType::Float32);
  DiffResult r = compare_dumps(*ref, *cand, o);
  EXPECT_EQ(r.criterion, "noise-floor");
  ASSERT_NE(r.first(), nullptr);
  EXPECT_EQ(r.first()->name, "step0.layers.0.attn_norm");
  EXPECT_EQ(r.first()->judgement.metric, "rmse vs float64");
  const TensorComparison* embed = r.find("step0.embed");
  ASSERT_NE(embed, nullptr);
  EXPECT_TRUE(embed->pass);
  // The float64 run lacks mlp_norm: judged by allclose, with a note saying so.
  const TensorComparison* mlp = r.find("step0.layers.0.mlp_norm");
  ASSERT_NE(mlp, nullptr);
  EXPECT_TRUE(mlp->pass);
  EXPECT_NE(mlp->judgement.note.find("noise floor unavailable"), std::string::npos);
}

// ---------------------------------------------------------------------------
// Local errors

TEST(LocalError, JudgesEachSiteAgainstTheReferencesOwnLocalNoise) {
  std::vector<double> q = normals(64, 31);
  std::vector<float> q32 = to_f32(q);
  // The candidate's q_rope is wrong by itself; its k_rope is honest.
  auto cand = dump_with("cand", {float_tensor("step0.layers.0.attn.q_rope", {1, 4, 16}, to_f32(q, 1e-3)),
                                 float_tensor("step0.layers.0.attn.k_rope", {1, 4, 16}, noisy_f32(q, 0.6, 32)),
                                 int_tensor("step0.positions", {4}, {0, 1, 2, 4}),
                                 float_tensor("step0.mask", {4, 4}, std::vector<float>(16, 1.0f)),
                                 int_tensor("step0.tokens", {4}, {1, 2, 3, 4})});
  Recomputed cl;
  cl.values.put(float_tensor("step0.layers.0.attn.q_rope", {1, 4, 16}, q32));
  cl.values.put(float_tensor("step0.layers.0.attn.k_rope", {1, 4, 16}, q32));
  cl.values.put(int_tensor("step0.positions", {4}, {0, 1, 2, 3}));
  cl.values.put(float_tensor("step0.mask", {4, 5}, std::vector<float>(20, 1.0f)));
  cl.source["step0.layers.0.attn.q_rope"] = "layers.0.attn.q";
  auto ref = dump_with("ref", {float_tensor("step0.layers.0.attn.q_rope", {1, 4, 16}, noisy_f32(q, 0.5, 33)),
                               float_tensor("step0.layers.0.attn.k_rope", {1, 4, 16}, noisy_f32(q, 0.5, 34))});
  Recomputed rl;
  rl.values.put(float_tensor("step0.layers.0.attn.q_rope", {1, 4, 16}, q32));
  rl.values.put(float_tensor("step0.layers.0.attn.k_rope", {1, 4, 16}, q32));

  LocalReport r = judge_local(*cand, cl, ref.get(), &rl, ComputeDType::Float32);
  EXPECT_TRUE(r.ran);
  ASSERT_EQ(r.sites.size(), 4u);
  EXPECT_EQ(r.not_recomputed, std::vector<std::string>{"step0.tokens"});
  ASSERT_NE(r.first(), nullptr);
  EXPECT_EQ(r.first()->name, "step0.positions");  // canonical order: positions, mask, then the layer
  EXPECT_EQ(r.first()->int_mismatches, 1);
  const LocalSite* mask = r.find("step0.mask");
  ASSERT_NE(mask, nullptr);
  EXPECT_FALSE(mask->shape_match);
  EXPECT_FALSE(mask->pass);
  const LocalSite* qr = r.find("step0.layers.0.attn.q_rope");
  ASSERT_NE(qr, nullptr);
  EXPECT_FALSE(qr->pass);
  EXPECT_TRUE(qr->has_ref_noise);
  EXPECT_EQ(qr->source, "layers.0.attn.q");
  EXPECT_GT(qr->noise.ratio(), 10.0);
  const LocalSite* kr = r.find("step0.layers.0.attn.k_rope");
  ASSERT_NE(kr, nullptr);
  EXPECT_TRUE(kr->pass) << kr->note;
  EXPECT_EQ(r.failing(), 3u);

  // Without a reference noise level a float site is reported, not judged.
  LocalReport bare = judge_local(*cand, cl, nullptr, nullptr, ComputeDType::Float32, {"layers.*.attn.*"});
  ASSERT_EQ(bare.sites.size(), 2u);
  EXPECT_TRUE(bare.sites[0].pass);
  EXPECT_NE(bare.sites[0].note.find("no reference noise level"), std::string::npos);
}

TEST(LocalError, ASecondHonestRunRaisesTheLocalNoise) {
  // mlp.down over a long reduction: the candidate sums sequentially (2.75x
  // the blocked reference's local rounding), as does the clean run.
  std::vector<double> y = normals(8 * 256, 61);
  std::vector<float> y32 = to_f32(y);
  auto cand = dump_with("cand", {float_tensor("step0.layers.0.mlp.down", {8, 256}, noisy_f32(y, 55.0, 62))});
  auto ref = dump_with("ref", {float_tensor("step0.layers.0.mlp.down", {8, 256}, noisy_f32(y, 20.0, 63))});
  auto clean = dump_with("clean", {float_tensor("step0.layers.0.mlp.down", {8, 256}, noisy_f32(y, 55.0, 64))});
  Recomputed exact;  // each run's float64 recompute from its own inputs (here: the same values)
  exact.values.put(float_tensor("step0.layers.0.mlp.down", {8, 256}, y32));
  LocalReport alone = judge_local(*cand, exact, ref.get(), &exact, ComputeDType::Float32);
  ASSERT_EQ(alone.sites.size(), 1u);
  EXPECT_FALSE(alone.sites[0].pass) << alone.sites[0].note;

  const LocalNoise noise = local_noise(*clean, exact);
  ASSERT_EQ(noise.count("step0.layers.0.mlp.down"), 1u);
  SecondNoise second(noise);
  EXPECT_GT(noise.at("step0.layers.0.mlp.down"), 2.0 * alone.sites[0].noise.ref_rmse);
  LocalReport both = judge_local(*cand, exact, ref.get(), &exact, ComputeDType::Float32, {}, &second);
  EXPECT_TRUE(both.sites[0].pass) << both.sites[0].note;
  EXPECT_EQ(both.sites[0].noise.second_rmse, noise.at("step0.layers.0.mlp.down"));
  // A candidate wrong by itself (3e-5 relative) still fails.
  std::vector<double> off = y;
  for (double& v : off) v *= 1.0 + 3e-5;
  auto wrong = dump_with("wrong", {float_tensor("step0.layers.0.mlp.down", {8, 256}, noisy_f32(off, 55.0, 65))});
  EXPECT_FALSE(judge_local(*wrong, exact, ref.get(), &exact, ComputeDType::Float32, {}, &second).sites[0].pass);
}

TEST(LocalError, TheSecondRunsNoiseIsMadeOnlyWhereAVerdictNeedsIt) {
  // mlp.down fails on the reference's local noise alone (as above) and
  // passes with the clean run's; mlp.up is within the reference's noise.
  std::vector<double> y = normals(8 * 256, 61), u = normals(8 * 256, 71);
  auto tensors = [&](double down_noise, double up_noise, uint64_t seed) {
    return std::vector<TensorData>{
        float_tensor("step0.layers.0.mlp.up", {8, 256}, noisy_f32(u, up_noise, seed)),
        float_tensor("step0.layers.0.mlp.down", {8, 256}, noisy_f32(y, down_noise, seed + 1))};
  };
  auto cand = dump_with("cand", tensors(55.0, 1.0, 62));
  auto ref = dump_with("ref", tensors(20.0, 1.0, 64));
  auto clean = dump_with("clean", tensors(55.0, 1.0, 66));
  Recomputed exact;
  exact.values.put(float_tensor("step0.layers.0.mlp.up", {8, 256}, to_f32(u)));
  exact.values.put(float_tensor("step0.layers.0.mlp.down", {8, 256}, to_f32(y)));
  std::vector<std::string> asked;
  SecondNoise second([&](const std::vector<std::string>& names) {
    asked.insert(asked.end(), names.begin(), names.end());
    LocalNoise all = local_noise(*clean, exact), out;
    for (const auto& n : names) out[n] = all.at(n);
    return out;
  });
  LocalReport r = judge_local(*cand, exact, ref.get(), &exact, ComputeDType::Float32, {}, &second);
  ASSERT_EQ(r.sites.size(), 2u);
  EXPECT_EQ(asked, std::vector<std::string>{"step0.layers.0.mlp.down"});
  const LocalSite* down = r.find("step0.layers.0.mlp.down");
  ASSERT_NE(down, nullptr);
  EXPECT_TRUE(down->pass) << down->note;
  EXPECT_GT(down->noise.second_rmse, 2.0 * down->noise.ref_rmse);
  EXPECT_TRUE(r.find("step0.layers.0.mlp.up")->pass);
  EXPECT_LT(r.find("step0.layers.0.mlp.up")->noise.second_rmse, 0.0);  // not needed, not made
  EXPECT_FALSE(r.first_failure);
  // A site is asked for once: judging again makes nothing new.
  judge_local(*cand, exact, ref.get(), &exact, ComputeDType::Float32, {}, &second);
  EXPECT_EQ(asked.size(), 1u);
  EXPECT_EQ(second.filled(), 1u);
}

TEST(LocalError, SubsetSourceShowsOnlyTheKeptNames) {
  auto d = dump_with("d", {float_tensor("step0.embed", {1, 2}, {1, 2}), float_tensor("step0.logits", {1, 2}, {3, 4}),
                           int_tensor("step0.tokens", {1}, {5})});
  SubsetSource s(*d, {"step0.logits", "step0.tokens", "step9.nothing"});
  EXPECT_EQ(s.names(), (std::vector<std::string>{"step0.tokens", "step0.logits"}));
  EXPECT_TRUE(s.has("step0.logits"));
  EXPECT_FALSE(s.has("step0.embed"));
  EXPECT_THROW(s.get("step0.embed"), MissingTensorError);
  EXPECT_EQ(s.get("step0.logits").f, (std::vector<float>{3, 4}));
}

TEST(LocalError, HypothesisSpelling) {
  EXPECT_EQ((Hypothesis{"rope-interleaved", std::nullopt}).str(), "rope-interleaved");
  EXPECT_EQ((Hypothesis{"rmsnorm-eps", 1e-5}).str(), "rmsnorm-eps=1e-05");
  EXPECT_EQ((Hypothesis{"rope-theta", 500000.0}).str(), "rope-theta=500000");
}

// ---------------------------------------------------------------------------
// Fingerprints and diagnosis with in-memory runners

TEST(Fingerprints, StructuralPatternsAreRecognised) {
  auto ref = toy_dump(false, false, false, 1.0f);
  Scenario sc = toy_scenario();
  {
    auto cand = toy_dump(true, true, true, 1.0f);
    DiffResult g = compare_dumps(*ref, *cand);
    std::vector<Fingerprint> fps = fingerprints(*cand, *ref, g, sc);
    EXPECT_TRUE(fired(fps, "rope-position-reset"));
    EXPECT_TRUE(fired(fps, "mask-square"));
    EXPECT_TRUE(fired(fps, "kv-overwrite"));
    EXPECT_FALSE(fired(fps, "lm-head"));
  }
  {
    // final_norm identical, logits scaled: a scale of the logits, reported
    // as a hint, not named lm-head (another head matrix would not be a
    // multiple of the reference's logits).
    auto cand = toy_dump(false, false, false, 2.0f);
    DiffResult g = compare_dumps(*ref, *cand);
    std::vector<Fingerprint> fps = fingerprints(*cand, *ref, g, sc);
    EXPECT_FALSE(fired(fps, "lm-head"));
    ASSERT_EQ(fps.size(), 1u);
    EXPECT_NE(fps[0].evidence.find("times 2"), std::string::npos) << fps[0].evidence;
    EXPECT_FALSE(fired(fps, "mask-square"));
    EXPECT_FALSE(fired(fps, "rope-position-reset"));
  }
  {
    // final_norm identical, logits of no relation to the reference's: the head is wrong.
    auto cand = toy_dump(false, false, false, 1.0f);
    for (const auto& n : cand->names())
      if (parse_name(n).site == "logits") {
        TensorData t = cand->get(n);
        std::reverse(t.f.begin(), t.f.end());
        cand->put(t);
      }
    DiffResult g = compare_dumps(*ref, *cand);
    EXPECT_TRUE(fired(fingerprints(*cand, *ref, g, sc), "lm-head"));
  }
  {
    auto same = toy_dump(false, false, false, 1.0f);
    DiffResult g = compare_dumps(*ref, *same);
    EXPECT_TRUE(fingerprints(*same, *ref, g, sc).empty());
  }
}

TEST(Diagnose, CandidateDtypeComesFromTheManifest) {
  MemoryDump d;
  std::string src;
  EXPECT_EQ(candidate_dtype(d, &src), ComputeDType::Float32);
  EXPECT_NE(src.find("default"), std::string::npos);
  d.mutable_manifest().dtype = "bfloat16";
  EXPECT_EQ(candidate_dtype(d, &src), ComputeDType::BFloat16);
  EXPECT_EQ(src, "manifest");
}

