// The ref against HF transformers' own dumps (tests/golden): every tensor of
// every model and scenario, the float64 truth mode, and the consistency of
// decode / chunked calls with one-call prefills.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/model/weights.h"
#include "ref/ref_engine.h"
#include "ref/weights.h"
#include "dumps/base/errors.h"
#include "tests/support.h"

namespace llmdiff {
namespace {

using testing::golden_dump;
using testing::golden_model;
using testing::golden_models;

const std::vector<std::string> kScenarios = {"prefill", "decode", "chunked"};

struct Case {
  std::string model, scenario;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.model << "/" << c.scenario; }

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (const auto& m : golden_models())
    for (const auto& s : kScenarios) out.push_back({m, s});
  return out;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string n = info.param.model + "_" + info.param.scenario;
  for (char& c : n)
    if (!isalnum(static_cast<unsigned char>(c))) c = '_';
  return n;
}

// Runs the golden dump's forward calls through the ref into memory.
MemoryDump replay(const Model& model, const TensorSource& golden, ComputeDType dtype) {
  ref::RefOptions opt;
  opt.threads = 1;  // as HF produced the goldens
  opt.dtype = dtype;
  auto engine = ref::make_ref_engine(model, opt);
  MemoryDump mem("ref");
  run_scenario(*engine, replay_scenario(golden), mem);
  return mem;
}

// Largest |ref - hf| / (atol + rtol * |hf|) over the elements (<= 1 passes).
double tolerance_ratio(const TensorData& ref, const TensorData& hf, double atol, double rtol) {
  double worst = 0;
  for (size_t k = 0; k < hf.f.size(); ++k) {
    const double d = std::fabs(double(ref.f[k]) - double(hf.f[k]));
    if (std::isnan(d)) return INFINITY;
    worst = std::max(worst, d / (atol + rtol * std::fabs(double(hf.f[k]))));
  }
  return worst;
}

class RefGolden : public ::testing::TestWithParam<Case> {};

// Every tensor HF dumped, recomputed by the ref in the checkpoint's dtype.
// float32: max |err| <= 1e-5 * max(1, max|HF|) per tensor. bfloat16: the
// same greedy tokens and torch.testing's bf16 tolerance elementwise.
TEST_P(RefGolden, EveryTensorMatchesHF) {
  const Case& c = GetParam();
  Model model = Model::load(golden_model(c.model));
  DumpFile golden(golden_dump(c.model, c.scenario));
  const ComputeDType dtype = model.config.default_dtype();
  const bool bf16 = dtype == ComputeDType::BFloat16;
  MemoryDump mem = replay(model, golden, dtype);

  std::set<std::string> golden_names;
  for (const auto& n : golden.names()) golden_names.insert(n);
  for (const auto& n : mem.names()) EXPECT_TRUE(golden_names.count(n)) << "ref emits " << n << ", HF does not";

  std::string worst_name;
  double worst_ratio = -1, worst_err = 0;
  int exact = 0, total = 0;
  for (const auto& name : golden.names()) {
    ASSERT_TRUE(mem.has(name)) << "ref does not emit " << name;
    TensorData hf = golden.get(name);
    TensorData rf = mem.get(name);
    ASSERT_EQ(rf.shape, hf.shape) << name;
    ++total;
    if (hf.is_int) {
      ASSERT_TRUE(rf.is_int) << name;
      EXPECT_EQ(rf.i, hf.i) << name;  // tokens, positions, generated
      if (rf.i == hf.i) ++exact;
      continue;
    }
    const double err = testing::max_abs_diff(rf, hf);
    if (err == 0) ++exact;
    double ratio;
    if (bf16) {
      ratio = tolerance_ratio(rf, hf, 1e-5, 1.6e-2);
      EXPECT_LE(ratio, 1.0) << name << ": max |err| " << err;
    } else {
      const double bound = 1e-5 * std::max(1.0, testing::max_abs(hf));
      ratio = err / bound;
      EXPECT_LE(err, bound) << name;
    }
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst_name = name;
      worst_err = err;
    }
  }
  if (worst_err == 0) worst_name = "(none: all equal)";
  std::printf("[ref vs HF] %-18s %-8s %-8s worst %-34s max|err| %.3g (%.3g of tolerance); %d/%d tensors bit-exact\n",
              c.model.c_str(), c.scenario.c_str(), compute_dtype_name(dtype), worst_name.c_str(), worst_err,
              worst_ratio, exact, total);
}

INSTANTIATE_TEST_SUITE_P(AllModels, RefGolden, ::testing::ValuesIn(all_cases()), case_name);

// The float64 truth mode agrees with HF's float32 logits to float32 precision.
TEST(RefTruth, Float64AgreesWithFloat32Goldens) {
  for (const auto& m : golden_models()) {
    Model model = Model::load(golden_model(m));
    if (model.config.default_dtype() != ComputeDType::Float32) continue;
    for (const auto& s : kScenarios) {
      DumpFile golden(golden_dump(m, s));
      MemoryDump mem = replay(model, golden, ComputeDType::Float64);
      double worst = 0;
      for (int step = 0; step < golden.num_steps(); ++step) {
        const std::string name = step_name(step, "logits");
        const double e = testing::nmse(mem.get(name), golden.get(name));
        EXPECT_LE(e, 1e-12) << m << " " << s << " " << name;
        worst = std::max(worst, e);
      }
      if (golden.has("generated")) {
        EXPECT_EQ(mem.get("generated").i, golden.get("generated").i) << m << " " << s;
      }
      std::printf("[float64 vs HF float32] %-18s %-8s logits NMSE %.3g\n", m.c_str(), s.c_str(), worst);
    }
  }
}

// The logits of each call of a scenario, as rows of one one-call prefill of
// all the scenario's tokens (float32 ref).
void expect_rows_of_prefill(const std::string& m, const std::string& scenario) {
  Model model = Model::load(golden_model(m));
  DumpFile golden(golden_dump(m, scenario));
  ref::RefOptions opt;
  opt.threads = 1;  // as HF produced the goldens
  opt.dtype = ComputeDType::Float32;
  auto engine = ref::make_ref_engine(model, opt);

  Scenario sc = replay_scenario(golden);
  MemoryDump steps("steps");
  run_scenario(*engine, sc, steps);

  std::vector<int64_t> all;
  for (const auto& t : sc.steps) all.insert(all.end(), t.begin(), t.end());
  MemoryDump full("full");
  Scenario one;
  one.steps = {all};
  run_scenario(*engine, one, full);
  TensorData full_logits = full.get(step_name(0, "logits"));
  const int64_t V = model.config.vocab_size;
  ASSERT_EQ(full_logits.shape, (Shape{int64_t(all.size()), V}));
  const double bound = 1e-5 * testing::max_abs(full_logits);

  int64_t row0 = 0;
  double worst = 0;
  for (size_t s = 0; s < sc.steps.size(); ++s) {
    TensorData logits = steps.get(step_name(int(s), "logits"));
    const int64_t T = int64_t(sc.steps[s].size());
    ASSERT_EQ(logits.shape, (Shape{T, V}));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t v = 0; v < V; ++v) {
        const double e = std::fabs(double(logits.f[size_t(t * V + v)]) - double(full_logits.f[size_t((row0 + t) * V + v)]));
        worst = std::max(worst, e);
      }
    row0 += T;
  }
  EXPECT_LE(worst, bound) << m << " " << scenario;
  std::printf("[%s vs one prefill] %-18s max|err| %.3g (bound %.3g)\n", scenario.c_str(), m.c_str(), worst, bound);
}

TEST(RefConsistency, DecodeStepsEqualPrefillRows) {
  for (const auto& m : golden_models()) expect_rows_of_prefill(m, "decode");
}

TEST(RefConsistency, ChunkedEqualsPrefill) {
  for (const auto& m : golden_models()) expect_rows_of_prefill(m, "chunked");
}

// The engine reports the compute dtype and names itself.
TEST(RefEngineInfo, ProducerAndDtype) {
  Model model = Model::load(golden_model("llama-mha-bf16"));
  ref::RefOptions opt;
  opt.dtype = model.config.default_dtype();
  auto engine = ref::make_ref_engine(model, opt);
  EXPECT_EQ(engine->dtype_name(), "bfloat16");
  EXPECT_NE(engine->producer().find("llmdiff ref (libtorch 1.13"), std::string::npos) << engine->producer();
  EXPECT_NE(engine->producer().find("bfloat16"), std::string::npos);
  opt.dtype = ComputeDType::Float64;
  EXPECT_EQ(ref::make_ref_engine(model, opt)->dtype_name(), "float64");
}

// Weights converted a matrix at a time within a budget: each as converting it
// alone gives, a buffer reused only when nobody else holds its tensor.
TEST(RefLayerByLayerWeights, SameValuesAsEachWeightConvertedAloneAndBuffersReusedSafely) {
  for (const std::string m : {"llama-gqa", "llama-mha-bf16"}) {
    SCOPED_TRACE(m);
    Model model = Model::load(golden_model(m));
    ASSERT_GE(model.weights->layers.size(), 2u);
    const LayerWeights& L0 = model.weights->layers[0];
    auto whole = [&](const WeightView& w) { return ref::weight_tensor(w, torch::kDouble); };
    // Room for one q matrix at a time.
    const int64_t q_bytes = L0.q.numel() * 8;
    ref::LayerByLayerWeights lw(*model.weights, torch::kDouble, /*budget=*/q_bytes);
    const torch::Tensor ids = torch::tensor(std::vector<int64_t>{3, 0, 7, 3}, torch::kLong);
    const torch::Tensor embed = whole(model.weights->embed);
    const torch::Tensor head = whole(model.weights->lm_head_tied ? model.weights->embed : model.weights->lm_head);
    EXPECT_TRUE(torch::equal(lw.embed_rows(ids), embed.index_select(0, ids)));
    const torch::Tensor x = torch::randn({3, embed.size(1)}, torch::kDouble);
    EXPECT_TRUE(torch::allclose(lw.head(x), torch::matmul(x, head.t()), 1e-12, 1e-12));
    // An lm_head over the size limit is applied a block of rows at a time: the same
    // numbers up to the product's rounding (BLAS blocks a narrower product otherwise).
    ref::LayerByLayerWeights blocks(*model.weights, torch::kDouble, 0, /*whole_limit=*/embed.size(1) * 8 * 5);
    EXPECT_TRUE(torch::allclose(blocks.head(x), lw.head(x), 1e-12, 1e-12));
    EXPECT_TRUE(torch::equal(blocks.embed_rows(ids), lw.embed_rows(ids)));
    EXPECT_TRUE(torch::allclose(blocks.head(x, /*embed_matrix=*/true), torch::matmul(x, embed.t()), 1e-12, 1e-12));
    // Every weight of a layer as converting it alone gives.
    for (int l = 0; l < 2; ++l)
      for (const WeightView* which : model.weights->layers[size_t(l)].views())
        if (*which) {
          EXPECT_TRUE(torch::equal(lw.weight(*which), whole(*which)));
        }
    const int64_t after_all = lw.conversions();
    EXPECT_EQ(after_all, 18);
    const void* buffer = nullptr;
    {
      const torch::Tensor q0 = lw.weight(lw.layer(0).q);
      EXPECT_EQ(q0.scalar_type(), torch::kDouble);
      buffer = q0.data_ptr();
    }
    // Nobody holds layer 0's q: layer 1's q is converted into its buffer.
    const torch::Tensor q1 = lw.weight(lw.layer(1).q);
    EXPECT_TRUE(torch::equal(q1, whole(model.weights->layers[1].q)));
    EXPECT_EQ(q1.data_ptr(), buffer);
    // A weight still held keeps its values when another takes its place.
    const torch::Tensor again0 = lw.weight(lw.layer(0).q);
    EXPECT_TRUE(torch::equal(again0, whole(L0.q)));
    EXPECT_NE(again0.data_ptr(), q1.data_ptr());
    EXPECT_TRUE(torch::equal(q1, whole(model.weights->layers[1].q)));
    // A hit converts nothing; without a budget every weight stays.
    lw.weight(lw.layer(0).q);
    EXPECT_EQ(lw.conversions(), after_all + 3);
    ref::LayerByLayerWeights all(*model.weights, torch::kDouble);
    all.weight(all.layer(0).q);
    all.weight(all.layer(1).q);
    all.weight(all.layer(0).q);
    EXPECT_EQ(all.conversions(), 2);
    EXPECT_THROW(lw.weight(lw.layer(int(model.weights->layers.size())).q), Error);
  }
}

}  // namespace
}  // namespace llmdiff
