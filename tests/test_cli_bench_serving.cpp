// llmdiff bench --serving N on a golden model: N requests sharing the first
// half of their prompt served by the continuous-batching engine under each
// serving feature, each in a child of its own; the features' counts (prefix
// hits, drafts proposed and accepted, padded rows) follow from the schedule,
// and every configuration is set against the baseline.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/cli_runner.h"
#include "tests/support.h"

using namespace llmdiff::testing;

namespace {

// 4 requests of 16 prompt tokens (8 shared) + 6 decode tokens each.
constexpr int kRequests = 4, kPrompt = 16, kDecode = 6;

std::vector<std::string> serving_args(bool json) {
  std::vector<std::string> a = {"bench",
                                "--model",
                                golden_model("qwen3-qknorm"),
                                "--engines",
                                "none",
                                "--prompt",
                                std::to_string(kPrompt),
                                "--decode",
                                std::to_string(kDecode),
                                "--repeats",
                                "1",
                                "--threads",
                                "1",
                                "--bandwidth-mib",
                                "16",
                                "--serving",
                                std::to_string(kRequests)};
  if (json) a.push_back("--json");
  return a;
}

}  // namespace

TEST(CliBenchServing, EachFeatureIsCountedAndSetAgainstTheBaseline) {
  const CliRun r = run_cli(serving_args(true));
  ASSERT_EQ(r.code, 0) << r.error << r.out;
  const nlohmann::json s = nlohmann::json::parse(r.out)["serving"];
  EXPECT_EQ(s["requests"], kRequests);
  EXPECT_EQ(s["shared_prefix"], kPrompt / 2);
  const auto& rows = s["configurations"];
  ASSERT_EQ(rows.size(), 6u);
  const std::vector<std::string> names = {"baseline", "prefix-cache", "spec-ngram", "spec-draft", "bucket", "tp2"};
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& c = rows[i];
    SCOPED_TRACE(names[i]);
    ASSERT_FALSE(c.contains("error")) << c["error"];
    EXPECT_EQ(c["configuration"], names[i]);
    EXPECT_EQ(c["prompt_tokens"], kRequests * kPrompt);
    EXPECT_EQ(c["generated_tokens"], kRequests * (kDecode + 1));  // each request its decode calls' tokens and one more
    EXPECT_GT(c["wall_s"].get<double>(), 0);
    EXPECT_GT(c["decode_tok_s"].get<double>(), 0);
    EXPECT_GT(c["decode_tokens"].get<int64_t>(), 0);
    EXPECT_GT(c["peak_rss_bytes"].get<int64_t>(), 0);
    EXPECT_NEAR(c["wall_over_baseline"].get<double>() * rows[0]["wall_s"].get<double>(), c["wall_s"].get<double>(),
                1e-9);
    EXPECT_TRUE(c["same_tokens_as_baseline"].is_boolean());
    // Only the configuration's own feature acts.
    const bool prefix = names[i] == "prefix-cache", spec = names[i].rfind("spec-", 0) == 0,
               bucket = names[i] == "bucket";
    if (!prefix) {
      EXPECT_EQ(c["prefix_hit_tokens"], 0);
    }
    if (!spec) {
      EXPECT_TRUE(c["acceptance"].is_null());
    }
    if (!bucket) {
      EXPECT_EQ(c["padded_rows"], 0);
    }
  }
  const auto& base = rows[0];
  EXPECT_EQ(base["same_tokens_as_baseline"], true);
  EXPECT_EQ(base["time_saved_s"], 0.0);
  // Every iteration from 2 on decodes a token of each sequence: all tokens
  // but the prompts' (iterations 0 and 1) and seq0's first decode (iteration 1).
  EXPECT_EQ(base["decode_tokens"], kRequests * kDecode - 1);

  // The prefix cache: requests 1..3 are served request 0's shared half.
  const auto& prefix = rows[1];
  EXPECT_EQ(prefix["prefix_hit_tokens"], (kRequests - 1) * (kPrompt / 2));
  EXPECT_GT(prefix["hit_rate"].get<double>(), 0);
  EXPECT_DOUBLE_EQ(prefix["hit_rate"].get<double>(), double((kRequests - 1) * (kPrompt / 2)) / (kRequests * kPrompt));
  EXPECT_DOUBLE_EQ(prefix["time_saved_s"].get<double>(), base["wall_s"].get<double>() - prefix["wall_s"].get<double>());

  // Speculative decoding: drafts verified, a share of them kept.
  for (const size_t i : {2u, 3u}) {
    const auto& c = rows[i];
    SCOPED_TRACE(names[i]);
    EXPECT_GT(c["drafts_proposed"].get<int64_t>(), 0);
    EXPECT_LE(c["drafts_accepted"].get<int64_t>(), c["drafts_proposed"].get<int64_t>());
    const double a = c["acceptance"].get<double>();
    EXPECT_GE(a, 0.0);
    EXPECT_LE(a, 1.0);
    EXPECT_DOUBLE_EQ(a, double(c["drafts_accepted"].get<int64_t>()) / c["drafts_proposed"].get<double>());
    EXPECT_GT(c["decode_speedup"].get<double>(), 0);
  }

  // Buckets of 16: every call's rows padded up to a multiple of 16.
  const auto& bucket = rows[4];
  EXPECT_GT(bucket["padded_rows"].get<int64_t>(), 0);
  EXPECT_EQ((bucket["rows"].get<int64_t>()) % 16, 0) << bucket.dump(1);
  EXPECT_DOUBLE_EQ(bucket["padding_overhead"].get<double>(),
                   double(bucket["padded_rows"].get<int64_t>()) /
                       double(bucket["rows"].get<int64_t>() - bucket["padded_rows"].get<int64_t>()));
}

TEST(CliBenchServing, TheTableNamesEveryConfigurationAndTooFewRequestsIsAUsageError) {
  const CliRun text = run_cli(serving_args(false));
  ASSERT_EQ(text.code, 0) << text.error;
  EXPECT_NE(text.out.find("impl serving features: 4 requests of 16 prompt tokens (the first 8 shared by all)"),
            std::string::npos)
      << text.out;
  for (const char* setting : {"--prefix-cache", "--speculative ngram --spec-k 4",
                              "--speculative draft --spec-k 4 --draft-layers 1", "--bucket 16", "--tp 2"})
    EXPECT_NE(text.out.find(setting), std::string::npos) << setting;
  EXPECT_NE(text.out.find("hit 37.5% (24 of 64 tokens)"), std::string::npos) << text.out;
  std::vector<std::string> one = serving_args(false);
  one.back() = "1";
  const CliRun r = run_cli(one);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("--serving needs at least 2 requests"), std::string::npos) << r.error;
}
