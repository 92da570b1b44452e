// The sampler (dumps/sampling/sampling.h) against HF's own `generate`: the golden
// sample dumps' processed scores and probabilities are reproduced bit for
// bit from their next_logits; the sampling check passes them, and names each
// sampler bug of the zoo from a candidate whose sample.* it changed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

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

// The golden with its sample.scores / sample.probs recomputed by a sampler
// with `faults`; a drawn token the faulty distribution excludes becomes that
// distribution's most probable one (what such an engine could have drawn).
std::string with_sampler(const std::string& golden, const zoo::SamplerFaults& faults, bool* departs) {
  const DumpFile in(golden);
  const SamplingParams p = *manifest_sampling(in.manifest(), golden);
  const std::string out_path = temp_path("sampler") + ".st";
  DumpWriter out(out_path);
  out.mutable_manifest() = in.manifest();
  *departs = false;
  for (const std::string& name : in.names()) {
    TensorData t = in.get(name);
    const CanonName c = parse_name(name);
    if (c.site == "sample.scores" || c.site == "sample.probs" || c.site == "sample.token") {
      const std::vector<float> logits = in.get(step_name(c.step, "next_logits")).f;
      const std::vector<float> scores = process_scores(p, logits, history(in, c.step), faults);
      const std::vector<float> probs = sample_probs(scores, logits, faults);
      if (c.site == "sample.token") {
        if (probs[size_t(t.i[0])] == 0.0f)
          t.i[0] = int64_t(std::max_element(probs.begin(), probs.end()) - probs.begin());
      } else {
        const std::vector<float>& v = c.site == "sample.scores" ? scores : probs;
        if (!same_bits(v, t.f)) *departs = true;
        t.f = v;
      }
    }
    if (t.is_int) out.on_i64(name, t.shape, t.i.data());
    else out.on_f32(name, t.shape, t.f.data());
  }
  out.finish();
  return out_path;
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
      // The drawn token has probability > 0.
      const int64_t token = d.get(step_name(s, "sample.token")).i[0];
      EXPECT_GT(d.get(step_name(s, "sample.probs")).f[size_t(token)], 0.0f);
      ++checked;
    }
    EXPECT_EQ(checked, 4);
    const SamplingCheck c = check_sampling(d);
    EXPECT_EQ(c.verdict, SamplingCheck::Verdict::Pass) << render_sampling_check(c);
    EXPECT_EQ(c.checked_steps(), 4);
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
      const std::string cand = with_sampler(golden_dump(model, "sample"), f, &departs);
      const SamplingCheck c = check_sampling(DumpFile(cand));
      if (!departs) {
        // Same scores and probabilities as HF on these logits: nothing to see.
        EXPECT_EQ(c.verdict, SamplingCheck::Verdict::Pass) << render_sampling_check(c);
        continue;
      }
      EXPECT_EQ(c.verdict, SamplingCheck::Verdict::Fail) << render_sampling_check(c);
      ASSERT_FALSE(c.explained_by.empty()) << render_sampling_check(c);
      EXPECT_EQ(c.explained_by.front().bug, info->name) << render_sampling_check(c);
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
