// Shards of one bisection (bisect --layers A:B --json, each run from the
// candidate's residual stream entering its first layer) joined by `llmdiff
// merge` give the whole run's verdict, first divergence, first local failure
// and diagnosis, on every golden model: an impl candidate with an injected
// bug over the golden decode scenario (5 prompt tokens and 3 decode steps),
// and HF's own decode dump, which passes. A shard past layer 0 localises and
// names the bug on its own. Ranges that do not tile the model, parts that are
// no shard results, a several-sequence candidate and a candidate without the
// residual stream a shard starts from are input errors.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dumps/model/config.h"
#include "dumps/contract/names.h"
#include "dumps/base/files.h"
#include "tests/cli_runner.h"
#include "tests/support.h"

using namespace llmdiff;
using namespace llmdiff::testing;
using nlohmann::json;

namespace {

int layers_of(const std::string& model) {
  return int(load_config(golden_model(model)).num_hidden_layers);
}

// bisect --layers RANGE --json of `dump`, written to a file: its path.
std::string shard(const std::string& model, const std::string& dump, const std::string& range, json* out) {
  const CliRun r = run_cli({"bisect", "--model", golden_model(model), dump, "--layers", range, "--json",
                            "--threads", "1"});
  EXPECT_TRUE(r.code == 0 || r.code == 1) << range << ": " << r.error << r.out;
  *out = json::parse(r.out);
  EXPECT_EQ(out->at("exit_code").get<int>(), r.code);
  static int written = 0;
  const std::string path = temp_path("shard-" + std::to_string(written++) + ".json");
  write_file_atomic(path, r.out);
  return path;
}

std::vector<std::string> failing_sites(const json& j) {
  std::vector<std::string> v;
  if (j["local"].is_object())
    for (const json& s : j["local"]["failing_sites"]) v.push_back(s["name"].get<std::string>());
  return v;
}

// The whole run and the merge of shards [0, 1) and [1, L) agree.
json expect_merge_equals_whole(const std::string& model, const std::string& dump) {
  int code = -1;
  const json whole = bisect_json(model, dump, &code);
  const int L = layers_of(model);
  json a, b;
  const std::string pa = shard(model, dump, "0:1", &a), pb = shard(model, dump, "1:" + std::to_string(L), &b);
  EXPECT_EQ(a["layers"]["end"], 1);
  EXPECT_EQ(b["layers"]["first"], 1);
  const CliRun m = run_cli({"merge", pb, pa, "--json"});  // in any order
  EXPECT_TRUE(m.code == 0 || m.code == 1) << m.error << m.out;
  const json merged = json::parse(m.out);
  EXPECT_EQ(m.code, code);
  for (const char* key : {"ok", "exit_code", "first_divergence", "first_local_failure", "localised_at"})
    EXPECT_EQ(merged[key], whole[key]) << model << ": " << key;
  EXPECT_EQ(merged["diagnosis"]["bug"], whole["diagnosis"]["bug"]) << model;
  EXPECT_EQ(merged["diagnosis"]["hypothesis"], whole["diagnosis"]["hypothesis"]) << model;
  EXPECT_EQ(merged["diagnosis"]["focus"], whole["diagnosis"]["focus"]) << model;
  // Every site is recomputed from the candidate's own inputs either way.
  EXPECT_EQ(failing_sites(merged), failing_sites(whole)) << model;
  EXPECT_EQ(merged["local"]["recomputed"], whole["local"]["recomputed"]) << model;
  // Each name is compared in one shard.
  EXPECT_EQ(merged["compared"], whole["compared"]) << model;
  EXPECT_EQ(merged["shards"].size(), 2u);
  return b;
}

class Shards : public ::testing::TestWithParam<std::string> {};

TEST_P(Shards, MergeOfTwoShardsIsTheWholeRunOfACandidateWithABug) {
  const std::string model = GetParam();
  // RoPE on adjacent pairs (MLA's own layout is its config's rope_interleave).
  const std::string bug = load_config(golden_model(model)).mla.enabled ? "mla-rope-layout" : "rope-interleaved";
  const std::string cand = temp_path("rope-" + model + ".safetensors");
  const CliRun d = run_cli({"dump", "--engine", "impl", "--model", golden_model(model), "--replay",
                            golden_dump(model, "decode"), "--inject", bug, "--threads", "1", "--out", cand});
  ASSERT_EQ(d.code, 0) << d.error;
  const json second = expect_merge_equals_whole(model, cand);
  EXPECT_EQ(second["exit_code"], 1);
  // The shard past layer 0 starts from the candidate's own (already wrong)
  // residual stream, and still finds the bug where it acts in its layers.
  ASSERT_TRUE(second["first_local_failure"].is_string()) << second.dump(1);
  const CanonName c = parse_name(second["first_local_failure"].get<std::string>());
  EXPECT_EQ(c.layer, 1);
  EXPECT_EQ(second["diagnosis"]["bug"], bug) << second["diagnosis"]["evidence"];
}

TEST_P(Shards, MergeOfTwoShardsOfHuggingFacesOwnDumpPasses) {
  const std::string model = GetParam();
  const json second = expect_merge_equals_whole(model, golden_dump(model, "decode"));
  EXPECT_TRUE(second["ok"].get<bool>()) << second["first_divergence"] << second["first_local_failure"];
}

INSTANTIATE_TEST_SUITE_P(AllGolden, Shards, ::testing::ValuesIn(golden_models()),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

TEST(OneShard, AllLayersInOneShardIsTheWholeRun) {
  const std::string dump = golden_dump("qwen3-qknorm", "chunked");
  int code = -1;
  const json whole = bisect_json("qwen3-qknorm", dump, &code);
  json one;
  const std::string p = shard("qwen3-qknorm", dump, "0:", &one);
  EXPECT_EQ(one["layers"]["end"], 2);
  const CliRun m = run_cli({"merge", p, "--json"});
  ASSERT_EQ(m.code, code) << m.error;
  const json merged = json::parse(m.out);
  for (const char* key : {"ok", "compared", "diverging", "first_divergence", "first_local_failure"})
    EXPECT_EQ(merged[key], whole[key]) << key;
  EXPECT_EQ(merged["diff"]["tensors"], whole["diff"]["tensors"]);
}

TEST(ShardErrors, RangesThatDoNotTileTheModelAreRefused) {
  const std::string dump = golden_dump("llama-gqa", "decode");
  json a, b;
  const std::string pa = shard("llama-gqa", dump, "0:1", &a), pb = shard("llama-gqa", dump, "1:2", &b);
  CliRun r = run_cli({"merge", pb});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("no shard holds layers 0:1"), std::string::npos) << r.error;
  r = run_cli({"merge", pa, pa, pb});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("overlap"), std::string::npos) << r.error;
  // A whole run's JSON is no shard.
  int code = -1;
  const std::string whole = temp_path("whole.json");
  write_file_atomic(whole, bisect_json("llama-gqa", dump, &code).dump());
  r = run_cli({"merge", whole, pb});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("not a shard"), std::string::npos) << r.error;
  // Shards of another candidate.
  json c;
  const std::string pc = shard("llama-gqa", golden_dump("llama-gqa", "prefill"), "1:2", &c);
  r = run_cli({"merge", pa, pc});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("not shards of one bisection"), std::string::npos) << r.error;
  // Parts that cannot be read, or are no JSON (the message gives the offset, not the bytes).
  r = run_cli({"merge", temp_path("absent.json")});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("cannot open"), std::string::npos) << r.error;
  const std::string garbage = temp_path("garbage.json");
  write_file_atomic(garbage, "{\"schema\": \x01");
  r = run_cli({"merge", garbage, pa});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("not JSON (syntax error at byte"), std::string::npos) << r.error;
  EXPECT_EQ(r.error.find('\x01'), std::string::npos);
  // A several-sequence candidate is bisected whole.
  r = run_cli({"bisect", "--model", golden_model("llama-gqa"), golden_dump("llama-gqa", "batch"), "--layers", "0:1"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("several-sequence"), std::string::npos) << r.error;
  for (const char* range : {"2:1", "0:3", "1", "a:2", "1:1"}) {
    r = run_cli({"bisect", "--model", golden_model("llama-gqa"), dump, "--layers", range, "--json"});
    EXPECT_EQ(r.code, 2) << range;
    EXPECT_NE(r.error.find("--layers"), std::string::npos) << r.error;
  }
}

TEST(ShardErrors, AShardNeedsTheResidualStreamEnteringIt) {
  const std::string dump = changed_golden("llama-gqa", "decode", "no-boundary", [](MemoryDump& d) {
    d.erase("step2.layers.0.out");
  });
  const CliRun r = run_cli({"bisect", "--model", golden_model("llama-gqa"), dump, "--layers", "1:2", "--json"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("step2.layers.0.out"), std::string::npos) << r.error;
  // The shard starting at layer 0 does not read it.
  const CliRun s = run_cli({"bisect", "--model", golden_model("llama-gqa"), dump, "--layers", "0:1", "--json",
                            "--threads", "1"});
  EXPECT_EQ(s.code, 0) << s.error;
}

}  // namespace
