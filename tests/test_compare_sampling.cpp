// The sampler (dumps/sampling/sampling.h) against HF's own `generate`: the golden
// sample dumps' processed scores and probabilities are reproduced bit for
// bit from their next_logits; the sampling check passes them, and names each
// sampler bug of the zoo from a candidate whose sample.* it changed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "compare/sampler_search.h"
#include "compare/sampling_check.h"
#include "dumps/zoo/bugs.h"
#include "dumps/contract/dump.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/sampling/sampling.h"
#include "tests/support.h"

using namespace llmdiff;
using namespace llmdiff::compare;
using llmdiff::testing::golden_dump;
using llmdiff::testing::resampled_dump;
using llmdiff::testing::temp_path;

namespace {

const char* const kSampleGoldens[] = {"llama-gqa", "qwen2-bias"};

// Every token fed through step `step` (generate's input_ids at that step).
std::vector<int64_t> history(const TensorSource& d, int step) {
  std::vector<int64_t> h;
  for (int s = 0; s <= step; ++s) {
    const TensorData t = d.get(step_name(s, "tokens"));
    h.insert(h.end(), t.i.begin(), t.i.end());
  }
  return h;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

// HF's processors on the golden's own next_logits give HF's output_scores
// and the distribution it drew from, bit for bit.
TEST(Sampling, ReproducesHfGenerateBitForBit) {
  for (const char* model : kSampleGoldens) {
    SCOPED_TRACE(model);
    const DumpFile d(golden_dump(model, "sample"));
    const std::optional<SamplingParams> p = manifest_sampling(d.manifest(), d.label());
    ASSERT_TRUE(p);
    EXPECT_TRUE(p->do_sample);
    int checked = 0;
    for (int s = 0; s < d.num_steps(); ++s) {
      if (!d.has(step_name(s, "sample.scores"))) continue;
      const std::vector<float> logits = d.get(step_name(s, "next_logits")).f;
      const std::vector<float> scores = process_scores(*p, logits, history(d, s));
      EXPECT_TRUE(same_bits(scores, d.get(step_name(s, "sample.scores")).f)) << "step " << s;
      EXPECT_TRUE(same_bits(sample_probs(scores, logits), d.get(step_name(s, "sample.probs")).f)) << "step " << s;
      // HF's pipeline spelled out as a SamplerPipeline computes the same bits.
      const SamplerPipeline hf;
      EXPECT_TRUE(same_bits(process_scores(*p, logits, history(d, s), hf), scores)) << "step " << s;
      EXPECT_TRUE(same_bits(sample_probs(*p, scores, logits, history(d, s), hf), d.get(step_name(s, "sample.probs")).f))
          << "step " << s;
      // The drawn token has probability > 0.
      const int64_t token = d.get(step_name(s, "sample.token")).i[0];
      EXPECT_GT(d.get(step_name(s, "sample.probs")).f[size_t(token)], 0.0f);
      ++checked;
    }
    EXPECT_EQ(checked, 4);
    const SamplingCheck c = check_sampling(d);
    EXPECT_EQ(c.verdict, SamplingCheck::Verdict::Pass) << render_sampling_check(c);
    EXPECT_EQ(c.checked_steps(), 4);
    // A clean sampler: no search for another pipeline.
    EXPECT_FALSE(c.search);
    EXPECT_TRUE(c.pipelines.empty());
  }
}

// Each sampler bug that changes the distribution on the goldens' logits is
// caught and named; none is claimed for HF's own output.
TEST(Sampling, NamesEachSamplerBug) {
  int named = 0;
  for (const zoo::BugInfo* info : zoo::sampler_bugs()) {
    for (const char* model : kSampleGoldens) {
      SCOPED_TRACE(std::string(info->name) + " on " + model);
      zoo::SamplerFaults f;
      f.*(info->sampler_fault) = true;
      bool departs = false;
      const std::string cand =
          resampled_dump(golden_dump(model, "sample"), SamplerPipeline::from_faults(f), "sampler", &departs);
      const SamplingCheck c = check_sampling(DumpFile(cand));
      if (!departs) {
        // Same scores and probabilities as HF on these logits: nothing to see.
        EXPECT_EQ(c.verdict, SamplingCheck::Verdict::Pass) << render_sampling_check(c);
        continue;
      }
      EXPECT_EQ(c.verdict, SamplingCheck::Verdict::Fail) << render_sampling_check(c);
      ASSERT_FALSE(c.explained_by.empty()) << render_sampling_check(c);
      EXPECT_EQ(c.explained_by.front().bug, info->name) << render_sampling_check(c);
      // A zoo bug is named as such: no search beyond the zoo.
      EXPECT_FALSE(c.search) << render_sampling_check(c);
      EXPECT_EQ(sampling_finding(c), "explained by " + std::string(info->name));
      ++named;
    }
  }
  // Every sampler bug departs on at least one golden.
  EXPECT_GE(named, int(zoo::sampler_bugs().size()));
}

TEST(Sampling, ParametersParseAndRoundTrip) {
  const SamplingParams p = SamplingParams::parse("temperature=0.7,top_k=40,top_p=0.9,min_p=0.05,seed=3");
  EXPECT_TRUE(p.do_sample);
  EXPECT_EQ(p.temperature, 0.7);
  EXPECT_EQ(p.top_k, 40);
  EXPECT_EQ(p.top_p, 0.9);
  EXPECT_EQ(*p.min_p, 0.05);
  EXPECT_EQ(*p.seed, 3u);
  EXPECT_EQ(SamplingParams::parse(p.str()), p);
  EXPECT_EQ(SamplingParams::from_json(p.to_json()), p);
  // HF's defaults for absent keys: top_k 50, greedy without do_sample.
  const SamplingParams j = SamplingParams::from_json(R"({"temperature": 0.5})");
  EXPECT_FALSE(j.do_sample);
  EXPECT_EQ(j.top_k, 50);
  EXPECT_FALSE(j.scales());  // temperature acts only when sampling
  EXPECT_THROW(SamplingParams::parse("temperature=0").validate(), UsageError);
  EXPECT_THROW(SamplingParams::parse("top_p=1.5").validate(), UsageError);
  EXPECT_THROW(SamplingParams::parse("topk=4"), UsageError);
  EXPECT_THROW(SamplingParams::from_json("{\"top_k\": \"many\"}"), UsageError);
}

TEST(Sampling, InverseCdfPicksAndStreams) {
  const std::vector<float> probs = {0.0f, 0.25f, 0.0f, 0.5f, 0.25f};
  EXPECT_EQ(pick_inverse_cdf(probs, 0.0f), 1);
  EXPECT_EQ(pick_inverse_cdf(probs, 0.2499f), 1);
  EXPECT_EQ(pick_inverse_cdf(probs, 0.25f), 3);
  EXPECT_EQ(pick_inverse_cdf(probs, 0.7499f), 3);
  EXPECT_EQ(pick_inverse_cdf(probs, 0.75f), 4);
  EXPECT_EQ(pick_inverse_cdf(probs, 0.9999999f), 4);
  EXPECT_THROW(pick_inverse_cdf(std::vector<float>(4, 0.0f), 0.5f), Error);
  UniformStream a(7), b(7), c(8);
  for (int i = 0; i < 100; ++i) {
    const float u = a.next();
    EXPECT_GE(u, 0.0f);
    EXPECT_LT(u, 1.0f);
    EXPECT_EQ(u, b.next());
  }
  EXPECT_NE(UniformStream(7).next(), c.next());
}

// ------------------------------------------------------------ pipeline search

namespace {
using St = SamplerStage;
const std::vector<St> kLlamaStages = {St::Penalty, St::Temperature, St::TopK, St::TopP};

SamplerPipeline with_order(std::vector<St> order) {
  SamplerPipeline s;
  s.order = std::move(order);
  return s;
}
}  // namespace

// The space around HF's pipeline on temperature and top-p: 1 order move,
// 3 temperature rules, 4 top-p rules and 3 draws are the 11 single
// departures; two of them combine into 42 more (the swap with temperature
// never applied is the single departure "temperature not applied" again).
TEST(SamplerSearch, SpaceCountsEachPipelineOnce) {
  const std::vector<St> acting = {St::Temperature, St::TopP};
  const std::vector<SamplerPipeline> one = pipeline_space(acting, 1);
  const std::vector<SamplerPipeline> two = pipeline_space(acting, 2);
  EXPECT_EQ(one.size(), 11u);
  EXPECT_EQ(two.size(), 11u + 42u);
  int last = 1;
  for (size_t i = 0; i < two.size(); ++i) {
    const int n = departure_count(two[i], acting);
    EXPECT_GE(n, last) << pipeline_str(two[i], acting);  // fewest departures first
    EXPECT_LE(n, 2);
    last = n;
    EXPECT_EQ(two[i], normalised(two[i], acting));
    for (size_t j = 0; j < i; ++j) EXPECT_NE(two[i], two[j]) << pipeline_str(two[i], acting);
  }
  // A temperature never applied has no order of its own.
  SamplerPipeline never = with_order({St::Penalty, St::TopP, St::Temperature, St::TopK, St::MinP});
  never.temperature = SamplerPipeline::Temperature::Never;
  EXPECT_EQ(departure_count(never, acting), 1);
  EXPECT_EQ(pipeline_departures(never, acting), std::vector<std::string>{"temperature not applied"});
  // Only temperature acting: its 3 rules and the draw from raw logits.
  EXPECT_EQ(pipeline_space({St::Temperature}, 3).size(), 4u + 3u);
  EXPECT_TRUE(pipeline_space({}, 2).empty());
  // Every zoo sampler bug is a single departure on the stages it needs.
  const std::vector<St> all = {St::Penalty, St::Temperature, St::TopK, St::TopP, St::MinP};
  const std::vector<SamplerPipeline> space = pipeline_space(all, 1);
  for (const zoo::BugInfo* bug : zoo::sampler_bugs()) {
    zoo::SamplerFaults f;
    f.*(bug->sampler_fault) = true;
    const SamplerPipeline s = SamplerPipeline::from_faults(f);
    EXPECT_EQ(departure_count(s, all), 1) << bug->name;
    EXPECT_EQ(zoo_sampler_bug(s, all), bug);
    EXPECT_NE(std::find(space.begin(), space.end(), normalised(s, all)), space.end()) << bug->name;
  }
  EXPECT_EQ(zoo_sampler_bug(SamplerPipeline{}, all), nullptr);
}

TEST(SamplerSearch, DeparturesInWords) {
  const SamplerPipeline top_p_first = with_order({St::Penalty, St::TopP, St::Temperature, St::TopK, St::MinP});
  EXPECT_EQ(pipeline_departures(top_p_first, kLlamaStages),
            std::vector<std::string>{"top-p applied before temperature and top-k"});
  EXPECT_EQ(departure_count(top_p_first, kLlamaStages), 1);
  EXPECT_EQ(zoo_sampler_bug(top_p_first, kLlamaStages), nullptr);
  EXPECT_EQ(pipeline_str(top_p_first, kLlamaStages),
            "repetition penalty > top-p > temperature > top-k; token from the softmax of the scores");
  // The zoo's top-p-before-temperature moves temperature behind both filters.
  zoo::SamplerFaults f;
  f.top_p_before_temperature = true;
  EXPECT_EQ(pipeline_departures(SamplerPipeline::from_faults(f), kLlamaStages),
            std::vector<std::string>{"temperature applied after top-k and top-p"});
  // A stage that does not act is neither moved nor named.
  EXPECT_TRUE(pipeline_departures(with_order({St::MinP, St::Penalty, St::Temperature, St::TopK, St::TopP}),
                                  kLlamaStages)
                  .empty());
  SamplerPipeline two = top_p_first;
  two.penalty = SamplerPipeline::Penalty::MultiplyAll;
  EXPECT_EQ(departure_count(two, kLlamaStages), 2);
  EXPECT_EQ(pipeline_departures(two, kLlamaStages),
            (std::vector<std::string>{"top-p applied before temperature and top-k",
                                      "repetition penalty multiplies every seen token's logit (positive ones too, "
                                      "raising them)"}));
  EXPECT_EQ(pipeline_str(two, kLlamaStages),
            "repetition penalty (multiplies all) > top-p > temperature > top-k; token from the softmax of the scores");
}

// A candidate whose sampler runs a pipeline outside the zoo, on HF's own
// logits: the check fails, no zoo bug fits, and the search names exactly
// the departure (every pipeline of as few departures that reproduces the
// steps: a penalty that multiplies the positive seen logits fits both rules
// that do, when every seen token's logit is positive).
TEST(SamplerSearch, NamesAPipelineOutsideTheZoo) {
  struct Case {
    const char* model;
    SamplerPipeline pipeline;
    std::vector<std::vector<std::string>> found;  // each pipeline's departures
  };
  auto rule = [](auto field, auto value) {
    SamplerPipeline s;
    s.*field = value;
    return s;
  };
  using P = SamplerPipeline;
  const std::string multiply = "repetition penalty multiplies every seen token's logit (positive ones too, raising them)";
  const std::string inverted =
      "repetition penalty's sign rule inverted (negative logits divided, positive ones multiplied: repetition rewarded)";
  const std::vector<Case> cases = {
      {"qwen2-bias", with_order({St::Penalty, St::MinP, St::Temperature, St::TopK, St::TopP}),
       {{"min-p applied before temperature, top-k and top-p"}}},
      {"llama-gqa", rule(&P::top_p, P::TopP::Complement),
       {{"top-p compares the cumulative mass with top_p instead of 1 - top_p (a mass of about 1 - top_p kept)"}}},
      {"llama-gqa", rule(&P::temperature, P::Temperature::Multiplied),
       {{"scores multiplied by the temperature instead of divided"}}},
      {"llama-gqa", rule(&P::probs, P::Probs::Unfiltered),
       {{"the token drawn from the softmax of the penalised and scaled scores before the filters (top-k, top-p, "
         "min-p ignored in the draw)"}}},
      {"llama-gqa", rule(&P::penalty, P::Penalty::MultiplyAll), {{multiply}, {inverted}}},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(std::string(k.model) + ": " + k.found.front().front());
    bool departs = false;
    const std::string cand = resampled_dump(golden_dump(k.model, "sample"), k.pipeline, "pipeline", &departs);
    ASSERT_TRUE(departs);
    const SamplingCheck c = check_sampling(DumpFile(cand));
    ASSERT_EQ(c.verdict, SamplingCheck::Verdict::Fail) << render_sampling_check(c);
    EXPECT_TRUE(c.explained_by.empty()) << render_sampling_check(c);
    ASSERT_TRUE(c.search);
    EXPECT_EQ(c.search->searched_up_to, 1);
    EXPECT_FALSE(c.search->budget_spent);
    ASSERT_EQ(c.pipelines.size(), k.found.size()) << render_sampling_check(c);
    for (size_t i = 0; i < k.found.size(); ++i) {
      EXPECT_EQ(c.pipelines[i].departures, k.found[i]);
      EXPECT_EQ(c.pipelines[i].zoo_bug, "");
      EXPECT_GT(c.pipelines[i].steps_departing, 0);
    }
    const int n = c.failing_steps();
    const std::string finding = "the sampler's pipeline: " + k.found.front().front() + " (reproduces " +
                                (n == 1 ? std::string("the 1 failing step") : "all " + std::to_string(n) + " failing steps") +
                                ")";
    EXPECT_EQ(sampling_finding(c), finding);
    EXPECT_NE(render_sampling_check(c).find(finding), std::string::npos) << render_sampling_check(c);
    const nlohmann::json j = sampling_check_to_json(c);
    EXPECT_EQ(j["pipelines"][0]["departures"], nlohmann::json(k.found.front()));
    EXPECT_TRUE(j["pipelines"][0]["zoo_bug"].is_null());
    EXPECT_EQ(j["search"]["max_departures"], 2);
  }
}

// A departure that computes what a zoo bug computes on these logits is
// named as the zoo bug: top-p moved before temperature and top-k keeps no
// fewer tokens than top-k on the golden's logits, as the zoo's
// sampler-top-k-after-top-p does.
TEST(SamplerSearch, AZooBugIsNamedAsSuch) {
  bool departs = false;
  const std::string cand = resampled_dump(golden_dump("llama-gqa", "sample"),
                                          with_order({St::Penalty, St::TopP, St::Temperature, St::TopK, St::MinP}),
                                          "zoo", &departs);
  const SamplingCheck c = check_sampling(DumpFile(cand));
  ASSERT_EQ(c.verdict, SamplingCheck::Verdict::Fail);
  ASSERT_FALSE(c.explained_by.empty());
  EXPECT_EQ(c.explained_by.front().bug, "sampler-top-k-after-top-p");
  EXPECT_FALSE(c.search);
  EXPECT_EQ(sampling_finding(c), "explained by sampler-top-k-after-top-p");
}

// The search is bounded: with no budget it is not run, and with a budget
// smaller than the single departures it says so.
TEST(SamplerSearch, BudgetBoundsTheSearch) {
  SamplerPipeline multiplied;
  multiplied.temperature = SamplerPipeline::Temperature::Multiplied;
  bool departs = false;
  const DumpFile cand(resampled_dump(golden_dump("llama-gqa", "sample"), multiplied, "budget", &departs));
  SamplingCheckOptions none;
  none.search_budget = 0;
  EXPECT_FALSE(check_sampling(cand, none).search);
  SamplingCheckOptions small;
  small.search_budget = 3;
  const SamplingCheck c = check_sampling(cand, small);
  ASSERT_TRUE(c.search);
  EXPECT_TRUE(c.search->budget_spent);
  EXPECT_EQ(c.search->tried, 3);
  EXPECT_EQ(c.search->searched_up_to, 0);
  EXPECT_TRUE(c.pipelines.empty());
  EXPECT_NE(render_sampling_check(c).find("the search budget spent"), std::string::npos) << render_sampling_check(c);
}
