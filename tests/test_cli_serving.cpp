// The impl as a serving engine (dump --batch with --prefix-cache,
// --speculative, --bucket) end to end, and bisect of its dumps
// (docs/DUMP_FORMAT.md, "Serving features"): clean runs of every feature
// match the reference running each sequence alone on dense, MoE and MLA
// models; each serving bug of the zoo is localised at its producer (the
// cache rows a prefix hit served, the positions or context after a verify
// call, the accepted count, the attention that read padding rows) and
// named, from full dumps (fingerprints) and from dumps cut down to layer
// outputs, logits and the engine's bookkeeping (a replay of the schedule).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"
#include "dumps/zoo/bugs.h"
#include "tests/cli_runner.h"
#include "tests/serving_requests.h"
#include "tests/support.h"

using namespace llmdiff;
using namespace llmdiff::testing;

namespace {

const char* kCutDown =
    "seq*.step*.tokens,seq*.step*.layers.*.out,seq*.step*.logits,seq*.generated,iter*,seq*.step*.kv.cached_prefix,"
    "seq*.step*.spec.*";

struct ServingRun {
  const char* name;
  const char* requests;
  std::vector<std::string> flags;
};

std::string serve(const std::string& model, const ServingRun& r, const std::string& bug, bool cut) {
  const std::string out =
      temp_path("serving-" + model + "-" + r.name + "-" + (bug.empty() ? "clean" : bug) + (cut ? "-cut" : "") + ".st");
  std::vector<std::string> args = {"dump", "--engine", "impl", "--model", golden_model(model), "--batch", r.requests,
                                   "--block-size", "4", "--threads", "1", "--out", out};
  args.insert(args.end(), r.flags.begin(), r.flags.end());
  if (!bug.empty()) args.insert(args.end(), {"--inject", bug});
  if (cut) args.insert(args.end(), {"--sites", kCutDown});
  const CliRun c = run_cli(args);
  EXPECT_EQ(c.code, 0) << c.error;
  return out;
}

const ServingRun kPrefix{"prefix", kPrefixPartial, {"--chunk", "3", "--prefix-cache"}};
const ServingRun kPrefixStaleRun{"prefix-stale", kPrefixStale, {"--chunk", "3", "--prefix-cache"}};
const ServingRun kNgram{"ngram", kSpecRequests, {"--chunk", "4", "--speculative", "ngram", "--spec-k", "3"}};
const ServingRun kDraft{"draft", kSpecRequests, {"--chunk", "4", "--speculative", "draft", "--spec-k", "3"}};
const ServingRun kBucketRun{"bucket", kBucket, {"--chunk", "4", "--bucket", "8"}};

}  // namespace

TEST(CliServing, EveryFeatureServedCleanMatchesTheReferenceOnDenseMoeAndMla) {
  for (const std::string model : {"llama-gqa", "qwen3-moe", "deepseek-v3-mla"})
    for (const ServingRun& r : {kPrefix, kPrefixStaleRun, kNgram, kDraft, kBucketRun}) {
      SCOPED_TRACE(model + " " + r.name);
      const std::string path = serve(model, r, "", false);
      int code = -1;
      const auto j = bisect_json(model, path, &code);
      EXPECT_EQ(code, 0) << j.dump(1).substr(0, 3000);
      for (const auto& s : j["sequences"]) EXPECT_TRUE(s["ok"].get<bool>()) << s["bisect"]["finding"].dump(1);
    }
}

TEST(CliServing, TheFeaturesLeaveTheirNamesInTheDump) {
  {
    DumpFile d(serve("llama-gqa", kPrefix, "", false));
    EXPECT_NE(d.manifest().extra.at("kv_cache").find("\"prefix_cache\": true"), std::string::npos);
    // seq2's prompt matches seq0's for 6 positions: served, then computed from position 6.
    EXPECT_EQ(d.get("seq2.step0.kv.cached_prefix").i, (std::vector<int64_t>{1, 5, 9, 13, 17, 21}));
    EXPECT_EQ(d.get("seq2.step0.positions").i, (std::vector<int64_t>{6}));
    EXPECT_EQ(d.get("seq2.step0.kv.block_source").i.front(), 0);  // its first block is seq0's
  }
  {
    DumpFile d(serve("llama-gqa", kDraft, "", false));
    EXPECT_EQ(d.manifest().extra.at("speculative"), "{\"proposer\": \"draft-model\", \"k\": 3, \"draft_layers\": 1}");
    int verify = 0;
    for (const std::string& n : d.names())
      if (n.find("spec.accepted") != std::string::npos) ++verify;
    EXPECT_GT(verify, 2);
  }
  {
    DumpFile d(serve("llama-gqa", kBucketRun, "", false));
    EXPECT_EQ(d.get("iter0.padded_rows").i, (std::vector<int64_t>{4}));  // seq0's 4-token chunk padded to 8
  }
}

TEST(CliServing, EachServingBugIsLocalisedAtItsProducerAndNamed) {
  struct Case {
    const char* bug;
    ServingRun run;
    int seq;
    const char* at;  // localised at, full dump
  };
  const Case cases[] = {
      {"prefix-hash-last-block", kPrefixStaleRun, 2, "step0.layers.1.attn.k_cache"},
      {"prefix-shared-write", kPrefix, 0, "step4.layers.0.attn.k_cache"},
      {"spec-rollback-missing", kDraft, 0, "step4.positions"},
      {"spec-context-rejected", kDraft, 0, "step4.mask"},
      {"spec-accept-off-by-one", kDraft, 0, "step3.spec.accepted"},
      {"bucket-pad-leak", kBucketRun, 0, "step0.layers.0.attn.probs"},
  };
  std::set<std::string> covered;
  for (const Case& c : cases) {
    covered.insert(c.bug);
    for (const bool cut : {false, true}) {
      SCOPED_TRACE(std::string(c.bug) + (cut ? " (cut down)" : " (full)"));
      int code = -1;
      const auto j = bisect_json("llama-gqa", serve("llama-gqa", c.run, c.bug, cut), &code);
      EXPECT_EQ(code, 1);
      ASSERT_EQ(j["first_divergent_sequence"], c.seq) << j.dump(1).substr(0, 3000);
      const auto& s = j["sequences"][size_t(c.seq)]["bisect"];
      if (!cut) EXPECT_EQ(s["localised_at"], c.at);
      EXPECT_EQ(s["finding"]["bug"], c.bug) << s["finding"].dump(1);
      EXPECT_EQ(s["finding"]["basis"], cut && std::string(c.bug) != "spec-accept-off-by-one" ? "batch replay"
                                                                                                : "fingerprint");
    }
  }
  for (const zoo::BugInfo& info : zoo::all_bugs())
    if (info.feature != zoo::Feature::None) EXPECT_TRUE(covered.count(info.name)) << info.name;
}

TEST(CliServing, ServingBugsOnMoeAndMlaModelsAreNamed) {
  const std::pair<const char*, ServingRun> cases[] = {{"prefix-hash-last-block", kPrefixStaleRun},
                                               {"spec-rollback-missing", kDraft},
                                               {"bucket-pad-leak", kBucketRun}};
  for (const std::string model : {"qwen3-moe", "deepseek-v3-mla"})
    for (const auto& [bug, run] : cases) {
      SCOPED_TRACE(model + " " + bug);
      int code = -1;
      const auto j = bisect_json(model, serve(model, run, bug, false), &code);
      EXPECT_EQ(code, 1);
      ASSERT_TRUE(j["first_divergent_sequence"].is_number()) << j.dump(1).substr(0, 2000);
      const auto& s = j["sequences"][j["first_divergent_sequence"].get<size_t>()]["bisect"];
      EXPECT_EQ(s["finding"]["bug"], bug) << s["finding"].dump(1);
    }
}

TEST(CliServing, AServingBugNeedsItsFeature) {
  const std::string out = temp_path("serving-usage.st");
  const CliRun r = run_cli({"dump", "--engine", "impl", "--model", golden_model("llama-gqa"), "--batch", "1,2,3",
                            "--inject", "spec-rollback-missing", "--out", out});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("acts only with speculative decoding on"), std::string::npos) << r.error;
}
