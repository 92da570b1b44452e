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
#include "tests/test_diag_toys.h"

using namespace llmdiff;
using namespace llmdiff::compare;
using llmdiff::bisect::BisectOptions;
using llmdiff::bisect::ReferenceRunner;
using llmdiff::testing::float_tensor;
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

