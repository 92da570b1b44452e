// The bisect pipeline (bisect/schedule.h) with in-memory runners on toy
// dumps: the hypothesis whose run reproduces the candidate is named, the
// numbers are shown when nothing fits, an identical candidate needs no
// diagnosis, and the renderers carry the same conclusions.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "bisect/schedule.h"
#include "compare/bisect_report.h"
#include "dumps/contract/sites.h"
#include "tests/test_diag_toys.h"

using namespace llmdiff;
using namespace llmdiff::compare;
using llmdiff::bisect::BisectOptions;
using llmdiff::bisect::ReferenceRunner;
using llmdiff::testing::float_tensor;
using llmdiff::testing::int_tensor;
using llmdiff::testing::TableRunner;
using llmdiff::testing::toy_dump;

namespace {

// A reference runner returning stored dumps per dtype.
class TableReference : public ReferenceRunner {
 public:
  std::map<ComputeDType, std::shared_ptr<MemoryDump>> runs;
  std::unique_ptr<MemoryDump> run(const Scenario&, ComputeDType d, const std::vector<std::string>&) const override {
    return std::make_unique<MemoryDump>(*runs.at(d));
  }
  std::string describe() const override { return "table reference"; }
};

}  // namespace

TEST(BisectPipeline, ThePipelineNamesTheHypothesisWhoseRunReproducesTheCandidate) {
  auto ref = toy_dump(false, false, false, 1.0f);
  auto cand = toy_dump(true, false, false, 1.0f);   // positions restart at 0
  auto other = toy_dump(false, true, false, 1.0f);  // a different bug's run
  TableReference reference;
  reference.runs[ComputeDType::Float32] = ref;
  reference.runs[ComputeDType::Float64] = ref;
  TableRunner runner;
  runner.runs[""] = ref;
  runner.runs["rope-position-reset"] = cand;
  runner.runs["mask-square"] = other;
  BisectOptions opt;
  BisectResult r = bisect::bisect(*cand, reference, nullptr, &runner, opt);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.exit_code(), 1);
  EXPECT_EQ(r.first_divergence().value_or(""), "step1.positions");
  EXPECT_FALSE(r.first_local_failure());  // no oracle: no local errors
  EXPECT_EQ(r.localised_at().value_or(""), "step1.positions");
  ASSERT_TRUE(named_bug(r.finding));
  EXPECT_EQ(named_bug(r.finding)->bug, "rope-position-reset");
  EXPECT_EQ(r.finding.basis, BugBasis::Replay);
  EXPECT_NE(r.finding.evidence.find("reproduces the candidate"), std::string::npos);
  ASSERT_EQ(r.diagnosis.ranked.size(), 2u);
  EXPECT_TRUE(r.diagnosis.ranked[0].supported_by_replay);
  EXPECT_FALSE(r.diagnosis.ranked[1].supported());
  EXPECT_EQ(r.diagnosis.inapplicable.size(), 1u);

  // Renderings carry the same conclusions.
  nlohmann::json j = bisect_to_json(r);
  EXPECT_EQ(j["schema"], kBisectSchema);
  EXPECT_EQ(j["first_divergence"], "step1.positions");
  EXPECT_TRUE(j["first_local_failure"].is_null());
  EXPECT_EQ(j["diagnosis"]["bug"], "rope-position-reset");
  EXPECT_FALSE(j["diagnosis"]["evidence"].get<std::string>().empty());
  EXPECT_EQ(j["exit_code"], 1);
  EXPECT_EQ(j["diagnosis"]["hypotheses"].size(), 2u);
  std::string table = render_bisect_table(r);
  EXPECT_NE(table.find("first divergence      step1.positions"), std::string::npos);
  EXPECT_NE(table.find("rope-position-reset (evidence: replay)"), std::string::npos);
  std::string md = render_bisect_markdown(r);
  EXPECT_NE(md.find("# llmdiff bisection report"), std::string::npos);
  EXPECT_NE(md.find("**Localised at `step1.positions`**"), std::string::npos);
}

TEST(BisectPipeline, WhenNothingFitsTheBugIsNullAndTheNumbersAreShown) {
  auto ref = toy_dump(false, false, false, 1.0f);
  auto cand = toy_dump(false, false, false, 1.0f);
  cand->put(float_tensor("step0.final_norm", {3, 2}, {9, 9, 9, 9, 9, 9}));  // no hypothesis makes this
  TableReference reference;
  reference.runs[ComputeDType::Float32] = ref;
  reference.runs[ComputeDType::Float64] = ref;
  TableRunner runner;
  runner.runs[""] = ref;
  runner.runs["mask-square"] = toy_dump(false, true, false, 1.0f);
  BisectResult r = bisect::bisect(*cand, reference, nullptr, &runner, BisectOptions{});
  EXPECT_EQ(r.first_divergence().value_or(""), "step0.final_norm");
  EXPECT_FALSE(named_bug(r.finding));
  EXPECT_NE(r.finding.evidence.find("no hypothesis of the bug zoo fits"), std::string::npos);
  EXPECT_NE(r.finding.evidence.find("replay with mask-square"), std::string::npos);
  nlohmann::json j = bisect_to_json(r);
  EXPECT_TRUE(j["diagnosis"]["bug"].is_null());
  EXPECT_EQ(j["first_divergence"], "step0.final_norm");
}

TEST(BisectPipeline, AnIdenticalCandidateNeedsNoDiagnosis) {
  auto ref = toy_dump(false, false, false, 1.0f);
  TableReference reference;
  reference.runs[ComputeDType::Float32] = ref;
  reference.runs[ComputeDType::Float64] = ref;
  TableRunner runner;
  runner.runs[""] = ref;
  BisectResult r = bisect::bisect(*toy_dump(false, false, false, 1.0f), reference, nullptr, &runner, BisectOptions{});
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.exit_code(), 0);
  EXPECT_EQ(r.finding.kind, FindingKind::Passes);
  EXPECT_FALSE(named_bug(r.finding));
  nlohmann::json j = bisect_to_json(r);
  EXPECT_TRUE(j["first_divergence"].is_null());
  EXPECT_TRUE(j["diagnosis"]["bug"].is_null());
  EXPECT_EQ(j["ok"], true);
}

// ---------------------------------------------------------------------------
// Routing flips at near-ties

namespace {

// A local oracle under which every op of the candidate is right on its own
// inputs: each site recomputed is the candidate's own value.
class OwnValuesOracle : public LocalOracle {
 public:
  std::unique_ptr<Recomputed> recompute(const TensorSource& dump, ComputeDType, const Hypothesis*,
                                        const std::vector<std::string>* only) const override {
    auto r = std::make_unique<Recomputed>();
    for (const std::string& n : only ? *only : dump.names()) {
      if (!dump.has(n) || parse_name(n).site == site_name(Site::Tokens)) continue;
      r->values.put(dump.get(n));
      r->source[n] = "its own inputs";
    }
    return r;
  }
  bool supports(const Hypothesis&) const override { return false; }
};

std::shared_ptr<MemoryDump> dump_with(const std::string& label, const std::vector<TensorData>& tensors,
                                      const std::string& dtype = "float32") {
  auto d = std::make_shared<MemoryDump>(label);
  d->mutable_manifest().dtype = dtype;
  for (const auto& t : tensors) d->put(t);
  return d;
}

// One MoE layer, one token, 4 experts, top 1: the router's scores, the
// choice, the chosen expert's output and the layer output.
std::shared_ptr<MemoryDump> moe_run(const std::string& label, std::vector<float> probs, int64_t chosen, float out,
                                    const std::string& dtype = "float32") {
  return dump_with(label,
                   {int_tensor("step0.tokens", {1}, {3}), float_tensor("step0.layers.0.moe.router_probs", {1, 4}, probs),
                    int_tensor("step0.layers.0.moe.topk_ids", {1, 1}, {chosen}),
                    float_tensor("step0.layers.0.moe.expert_out", {1, 1, 2}, {out, -out}),
                    float_tensor("step0.layers.0.out", {1, 2}, {1.0f + out, 1.0f - out})},
                   dtype);
}

}  // namespace

// The candidate's scores are within rounding noise of the reference's and it
// chose expert 1 where the reference chose 0 (its scores 8e-6 apart): a flip
// at a near-tie, reported, not a divergence; the names after
// it differ (another expert ran) and follow from it, every op being right on
// its own inputs: the candidate passes. Scores far from the reference's, and
// a choice no honest run made, are a divergence.
TEST(BisectPipeline, RoutingFlipsAtNearTiesAreReportedNotDivergences) {
  TableReference reference;
  reference.runs[ComputeDType::Float64] = moe_run("truth", {0.400002f, 0.399998f, 0.1f, 0.1f}, 0, 0.5f, "float64");
  reference.runs[ComputeDType::Float32] = moe_run("ref", {0.400004f, 0.399996f, 0.1f, 0.1f}, 0, 0.5f);
  TableRunner runner;
  runner.runs[""] = moe_run("clean", {0.400000f, 0.400001f, 0.1f, 0.1f}, 1, 0.9f);
  const OwnValuesOracle oracle;
  BisectOptions opt;
  opt.diagnose = false;
  {
    const auto cand = moe_run("cand", {0.400001f, 0.400002f, 0.1f, 0.1f}, 1, -0.7f);
    const BisectResult r = bisect::bisect(*cand, reference, &oracle, &runner, opt);
    EXPECT_TRUE(r.ok()) << render_bisect_table(r);
    EXPECT_EQ(r.exit_code(), 0);
    EXPECT_TRUE(r.flips_explain);
    EXPECT_EQ(r.routing_flips, std::vector<std::string>{"step0.layers.0.moe.topk_ids"});
    EXPECT_GT(r.global.failing(), 0u);  // expert_out and out: another expert's values
    const std::string table = render_bisect_table(r);
    EXPECT_NE(table.find("no divergence beyond routing flips at near-ties"), std::string::npos) << table;
    EXPECT_NE(table.find("routing flip at a near-tie, undecidable (1 of 1 tokens): token 0: expert 1 for 0"),
              std::string::npos)
        << table;
  }
  {
    const auto cand = moe_run("far", {0.2f, 0.1f, 0.6f, 0.1f}, 2, -0.7f);  // no honest run chose expert 2
    const BisectResult r = bisect::bisect(*cand, reference, &oracle, &runner, opt);
    EXPECT_FALSE(r.ok());
    EXPECT_FALSE(r.flips_explain);
    EXPECT_TRUE(r.routing_flips.empty());
    EXPECT_EQ(r.exit_code(), 1);
  }
}
