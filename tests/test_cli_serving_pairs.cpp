// The serving features' acceptance test: on the impl's own runs of the
// golden models (dense, MoE, MLA), configuration pairs that differ only in
// how the work is cut (batch 1 vs 2, 8 and 16; chunk 3 vs 8 vs 64; prefix
// cache cold vs warm; tensor parallelism over 1, 2 and 4 ranks; speculative
// decoding off vs n-gram vs draft model; a ring cache that does not wrap vs
// the paged one; bucket padding; every feature at once) are judged
// legitimate by `llmdiff bisect A --against B`, every sequence of each pair;
// with a serving or tensor-parallel bug injected in B the pair is a bug in
// B, named. One test per pair, each pair's feature checked on the dumps to
// have acted (a pair whose feature never acted compares a configuration
// with itself).
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <ostream>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "dumps/contract/dump.h"
#include "dumps/zoo/bugs.h"
#include "tests/cli_runner.h"
#include "tests/serving_requests.h"
#include "tests/support.h"

using namespace llmdiff;
using namespace llmdiff::testing;

namespace {

// What B's configuration changes against A's; each is checked on the dumps.
// Combined: the prefix cache, speculative decoding, ranks and buckets at once.
enum class Feature { Batch, Chunk, Prefix, TensorParallel, Speculative, Ring, Bucket, Combined };

// One side: `llmdiff dump --engine impl` flags after --model (one thread).
struct Side {
  std::string tag;
  std::vector<std::string> flags;
};

struct ServingPair {
  std::string name;  // the test's name
  std::string model;
  Feature feature;
  Side a, b;
  size_t pairs;     // sequences aligned by prompt
  std::string bug;  // injected in B (empty: a legitimate pair)
  int buggy = 0;    // with a bug: B's sequence whose bisection names it
};

// The prompt every request of a batch pair shares.
const std::string kShared = "3,14,15,92,65";

std::string join(const std::vector<std::string>& parts, const char* sep) {
  std::string s;
  for (const std::string& p : parts) s += (s.empty() ? "" : sep) + p;
  return s;
}

// n requests sharing kShared, each followed by a token of its own, with 2 to
// 4 decode calls: served one at a time (each joining when the one before
// has left: a batch of 1) or together (joining at iterations 0 and 1, the
// second's prompt beside the first's decodes).
std::string sharing(int n, bool one_at_a_time) {
  std::vector<std::string> requests;
  int join_at = 0;
  for (int i = 0; i < n; ++i) {
    const int decode = 2 + i % 3;
    const int at = one_at_a_time ? join_at : i % 2;
    requests.push_back(kShared + "," + std::to_string(100 + i) + "@" + std::to_string(at) + ":" +
                       std::to_string(decode));
    join_at += 1 + decode;  // its prompt's call, then its decodes
  }
  return join(requests, ";");
}

// Two prompts of 17 and 11 tokens: 6 and 4 calls in chunks of 3, 3 and 2 in
// chunks of 8, one each in chunks of 64.
const std::string kLong = "7,11,19,23,29,31,37,41,43,47,53,59,61,67,71,73,79@0:2;4,8,15,16,23,42,5,9,26,53,58@2:2";
// Three prompts of 3, 5 and 4 tokens (the second kShared), chunks of 2.
const std::string kThree = "2,7,18:2;" + kShared + ":3;9,9,8,1:1";

Side batch(const std::string& tag, const std::string& requests, std::vector<std::string> flags = {}) {
  std::vector<std::string> f = {"--batch", requests, "--block-size", "4"};
  f.insert(f.end(), flags.begin(), flags.end());
  return {tag, f};
}

// kShared alone through the single-sequence engine, 3 decode calls.
Side single(const std::string& tag, std::vector<std::string> flags = {}) {
  std::vector<std::string> f = {"--tokens", kShared, "--decode", "3"};
  f.insert(f.end(), flags.begin(), flags.end());
  return {tag, f};
}

Side chunked(int c) { return batch("chunk" + std::to_string(c), kLong, {"--chunk", std::to_string(c)}); }
Side tp_batch(int r) {
  return batch("tp" + std::to_string(r), sharing(4, false), {"--chunk", "3", "--tp", std::to_string(r)});
}
// kSpecRequests with the decodes of a model whose tokens repeat late: the
// n-gram proposer finds a continuation only after 8 of them.
const std::string kSpecLonger = "1,2,3,4,1,2,3,4,1,2@0:12;5,6,7,5,6,7,5@1:12";
Side spec(const std::string& proposer, const std::string& requests = kSpecRequests,
          std::vector<std::string> flags = {}) {
  std::vector<std::string> f = {"--chunk", "4"};
  if (!proposer.empty()) f.insert(f.end(), {"--speculative", proposer, "--spec-k", "3"});
  f.insert(f.end(), flags.begin(), flags.end());
  return batch(proposer.empty() ? "spec-off" : proposer, requests, f);
}
Side prefix(const char* requests, bool warm) {
  std::vector<std::string> f = {"--chunk", "3"};
  if (warm) f.push_back("--prefix-cache");
  return batch(warm ? "warm" : "cold", requests, f);
}
Side ring(std::vector<std::string> chunks = {}) {
  std::vector<std::string> f = {"--kv-ring", "16"};  // more than the 8 positions: it does not wrap
  f.insert(f.end(), chunks.begin(), chunks.end());
  return single("ring", f);
}
Side paged_three() { return batch("paged", kThree, {"--chunk", "2"}); }
Side bucketed(int64_t bucket) {
  std::vector<std::string> f = {"--chunk", "4"};
  if (bucket > 0) f.insert(f.end(), {"--bucket", std::to_string(bucket)});
  return batch("bucket" + std::to_string(bucket), kBucket, f);
}
Side with_bug(Side s, const std::string& bug) {
  s.tag += "-" + bug;
  s.flags.insert(s.flags.end(), {"--inject", bug});
  return s;
}

ServingPair legit(const std::string& model, const std::string& what, Feature f, Side a, Side b, size_t pairs) {
  std::string name = model + "_" + what;
  std::replace(name.begin(), name.end(), '-', '_');
  return {name, model, f, std::move(a), std::move(b), pairs, "", 0};
}

std::vector<ServingPair> legitimate_pairs() {
  using F = Feature;
  const Side off = spec(""), ngram = spec("ngram"), draft = spec("draft");
  std::vector<ServingPair> p;
  for (const auto& [model, n] : std::vector<std::pair<std::string, int>>{{"llama-gqa", 2},
                                                                         {"llama-gqa", 8},
                                                                         {"llama-gqa", 16},
                                                                         {"qwen3-qknorm", 16},
                                                                         {"llama3-mqa-scaled", 8},
                                                                         {"qwen3-moe", 8},
                                                                         {"deepseek-v3-mla", 2},
                                                                         {"deepseek-v3-mla", 16}})
    p.push_back(legit(model, "batch1_vs_" + std::to_string(n), F::Batch, batch("batch1", sharing(n, true)),
                      batch("batch" + std::to_string(n), sharing(n, false)), size_t(n)));
  for (const auto& [model, a, b] : std::vector<std::tuple<std::string, int, int>>{{"llama-gqa", 3, 8},
                                                                                  {"llama-gqa", 8, 64},
                                                                                  {"qwen3-qknorm", 3, 64},
                                                                                  {"qwen3-moe", 3, 8},
                                                                                  {"deepseek-v3-mla", 8, 64},
                                                                                  {"deepseek-v3-mla", 3, 64}})
    p.push_back(
        legit(model, "chunk" + std::to_string(a) + "_vs_" + std::to_string(b), F::Chunk, chunked(a), chunked(b), 2));
  for (const auto& [model, requests, what] : std::vector<std::tuple<std::string, const char*, std::string>>{
           {"llama-gqa", kPrefixPartial, "partial_block"},
           {"qwen3-qknorm", kPrefixStale, "whole_blocks"},
           {"qwen3-moe", kPrefixPartial, "partial_block"},
           {"deepseek-v3-mla", kPrefixPartial, "partial_block"}})
    p.push_back(
        legit(model, "prefix_cold_vs_warm_" + what, F::Prefix, prefix(requests, false), prefix(requests, true), 3));
  // Batched over ranks; single sequences over ranks (qwen3-qknorm, llama3-mqa-scaled: its one kv head replicated).
  for (const auto& [model, a, b] : std::vector<std::tuple<std::string, int, int>>{
           {"llama-gqa", 1, 2}, {"llama-gqa", 1, 4}, {"qwen3-moe", 1, 2}, {"deepseek-v3-mla", 1, 4}})
    p.push_back(legit(model, "tp" + std::to_string(a) + "_vs_" + std::to_string(b) + "_batched", F::TensorParallel,
                      tp_batch(a), tp_batch(b), 4));
  p.push_back(legit("qwen3-qknorm", "tp2_vs_4_single", F::TensorParallel, single("tp2", {"--tp", "2"}),
                    single("tp4", {"--tp", "4"}), 1));
  p.push_back(
      legit("llama3-mqa-scaled", "tp1_vs_4_single", F::TensorParallel, single("tp1"), single("tp4", {"--tp", "4"}), 1));
  // The n-gram proposer on the models whose greedy tokens repeat (on
  // llama-gqa's they never do: it proposes nothing); the draft model of 2
  // layers on deepseek-v3-mla (of 1, every draft is rejected).
  for (const auto& [model, a, b, what] : std::vector<std::tuple<std::string, Side, Side, std::string>>{
           {"llama-gqa", off, draft, "off_vs_draft"},
           {"qwen3-qknorm", off, ngram, "off_vs_ngram"},
           {"qwen3-qknorm", ngram, draft, "ngram_vs_draft"},
           {"llama3-mqa-scaled", off, draft, "off_vs_draft"},
           {"qwen3-moe", off, ngram, "off_vs_ngram"},
           {"qwen3-moe", off, draft, "off_vs_draft"},
           {"deepseek-v3-mla", off, spec("draft", kSpecRequests, {"--draft-layers", "2"}), "off_vs_draft"},
           {"deepseek-v3-mla", spec("", kSpecLonger), spec("ngram", kSpecLonger), "off_vs_ngram"}})
    p.push_back(legit(model, "spec_" + what, F::Speculative, a, b, 2));
  // A ring (not MLA's: its cache is the latent) against the paged batch.
  for (const auto& [model, chunks] :
       std::vector<std::pair<std::string, std::vector<std::string>>>{{"llama-gqa", {}},
                                                                     {"qwen3-qknorm", {"--chunks", "2,3"}},
                                                                     {"llama3-mqa-scaled", {}},
                                                                     {"qwen3-moe", {"--chunks", "3,2"}}})
    p.push_back(legit(model, "ring_vs_paged", F::Ring, ring(chunks), paged_three(), 1));
  p.push_back(legit("llama-gqa", "bucket_off_vs_8", F::Bucket, bucketed(0), bucketed(8), 3));
  p.push_back(legit("deepseek-v3-mla", "bucket_off_vs_8", F::Bucket, bucketed(0), bucketed(8), 3));
  // Every feature at once against none: a warm prefix cache (whole blocks),
  // draft-model verify calls, 2 ranks and buckets of 8 against plain calls.
  for (const std::string model : {"llama-gqa", "qwen3-moe", "deepseek-v3-mla"})
    p.push_back(legit(model, "plain_vs_every_feature", F::Combined, batch("plain", kPrefixStale, {"--chunk", "3"}),
                      batch("every", kPrefixStale,
                            {"--chunk", "3", "--prefix-cache", "--speculative", "draft", "--draft-layers", "2",
                             "--spec-k", "2", "--tp", "2", "--bucket", "8"}),
                      3));
  return p;
}

// Each serving bug in B, A the same requests with the feature off (the TP
// bugs: over 1 rank).
std::vector<ServingPair> bug_pairs() {
  using F = Feature;
  auto bug = [](const std::string& model, const std::string& name, F f, const Side& a, const Side& b, size_t pairs,
                int buggy) {
    std::string test = model + "_" + name;
    std::replace(test.begin(), test.end(), '-', '_');
    return ServingPair{test, model, f, a, with_bug(b, name), pairs, name, buggy};
  };
  return {
      bug("llama-gqa", "prefix-hash-last-block", F::Prefix, prefix(kPrefixStale, false), prefix(kPrefixStale, true), 3,
          2),
      bug("qwen3-moe", "prefix-hash-last-block", F::Prefix, prefix(kPrefixStale, false), prefix(kPrefixStale, true), 3,
          2),
      bug("llama-gqa", "prefix-shared-write", F::Prefix, prefix(kPrefixPartial, false), prefix(kPrefixPartial, true), 3,
          0),
      bug("llama-gqa", "spec-rollback-missing", F::Speculative, spec(""), spec("draft"), 2, 0),
      bug("deepseek-v3-mla", "spec-rollback-missing", F::Speculative, spec(""), spec("draft"), 2, 0),
      bug("llama-gqa", "spec-context-rejected", F::Speculative, spec(""), spec("draft"), 2, 0),
      bug("llama-gqa", "spec-accept-off-by-one", F::Speculative, spec(""), spec("draft"), 2, 0),
      bug("llama-gqa", "bucket-pad-leak", F::Bucket, bucketed(0), bucketed(8), 3, 0),
      bug("llama3-mqa-scaled", "tp-allreduce-missing", F::TensorParallel, tp_batch(1), tp_batch(2), 4, 0),
      bug("qwen3-moe", "tp-allreduce-twice", F::TensorParallel, tp_batch(1), tp_batch(4), 4, 0),
      bug("llama-gqa", "tp-kv-heads-split", F::TensorParallel, tp_batch(1), tp_batch(4), 4, 0),
  };
}

std::string dump_side(const ServingPair& p, const Side& s, const char* which) {
  const std::string out = temp_path("pairs-" + p.name + "-" + which + "-" + s.tag + ".safetensors");
  std::vector<std::string> cmd = {"dump",      "--engine", "impl",  "--model", golden_model(p.model),
                                  "--threads", "1",        "--out", out};
  cmd.insert(cmd.end(), s.flags.begin(), s.flags.end());
  const CliRun r = run_cli(cmd);
  EXPECT_EQ(r.code, 0) << r.error;
  return out;
}

// Over the names of a dump ending in `suffix`: the largest element count
// (count) or the largest value of an integer tensor.
int64_t largest(const DumpFile& d, const std::string& suffix, bool count) {
  int64_t m = 0;
  for (const std::string& n : d.names()) {
    if (n.size() < suffix.size() || n.compare(n.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    const TensorData t = d.get(n);
    m = std::max(m, count ? int64_t(t.i.size()) : (t.i.empty() ? 0 : *std::max_element(t.i.begin(), t.i.end())));
  }
  return m;
}

std::string manifest_extra(const DumpFile& d, const std::string& key) {
  const auto it = d.manifest().extra.find(key);
  return it == d.manifest().extra.end() ? "" : it->second;
}

// The feature acted in B as the pair says (and A differs): a pair whose
// feature never acted would compare a configuration with itself.
void expect_feature_acted(const ServingPair& p, const std::string& a_path, const std::string& b_path,
                          const nlohmann::json& j) {
  const DumpFile a(a_path), b(b_path);
  switch (p.feature) {
    case Feature::Batch:  // one sequence per call against several
      EXPECT_EQ(largest(a, ".seqs", true), 1);
      EXPECT_GT(largest(b, ".seqs", true), 1);
      break;
    case Feature::Chunk:  // A's prompt chunks shorter than B's
      EXPECT_LT(largest(a, ".tokens", true), largest(b, ".tokens", true));
      break;
    case Feature::Prefix: {  // B served a cached prefix, A none
      int64_t served = 0;
      for (const auto& s : j["b"]["sequences"]) served = std::max<int64_t>(served, s["cached_prefix"].get<int64_t>());
      for (const auto& s : j["a"]["sequences"]) EXPECT_EQ(s["cached_prefix"], 0);
      EXPECT_GT(served, 0);
      break;
    }
    case Feature::TensorParallel:
      EXPECT_NE(manifest_extra(a, "tensor_parallel"), manifest_extra(b, "tensor_parallel"));
      EXPECT_NE(manifest_extra(b, "tensor_parallel"), "");
      break;
    case Feature::Speculative:  // B made verify calls and kept drafts; A is another proposer or none
      EXPECT_GT(largest(b, ".spec.draft", true), 0);
      if (p.bug.empty()) {
        EXPECT_GT(largest(b, ".spec.accepted", false), 0);
      }
      EXPECT_NE(manifest_extra(a, "speculative"), manifest_extra(b, "speculative"));
      break;
    case Feature::Ring:
      EXPECT_NE(manifest_extra(a, "kv_cache").find("\"ring\""), std::string::npos);
      EXPECT_NE(manifest_extra(b, "kv_cache").find("\"paged\""), std::string::npos);
      break;
    case Feature::Bucket:
      EXPECT_EQ(largest(a, ".padded_rows", false), 0);
      EXPECT_GT(largest(b, ".padded_rows", false), 0);
      break;
    case Feature::Combined:
      EXPECT_GT(largest(b, ".kv.cached_prefix", true), 0);
      EXPECT_GT(largest(b, ".spec.draft", true), 0);
      EXPECT_GT(largest(b, ".padded_rows", false), 0);
      EXPECT_NE(manifest_extra(b, "tensor_parallel"), "");
      break;
  }
}

// Both sides dumped, then `bisect --against` (JSON) with its exit code.
nlohmann::json judge(const ServingPair& p, int* code, std::string* a, std::string* b) {
  *a = dump_side(p, p.a, "a");
  *b = dump_side(p, p.b, "b");
  const CliRun r =
      run_cli({"bisect", "--model", golden_model(p.model), *a, "--against", *b, "--json", "--threads", "1"});
  *code = r.code;
  EXPECT_TRUE(r.code == 0 || r.code == 1) << r.error;
  return nlohmann::json::parse(r.out);
}

void PrintTo(const ServingPair& p, std::ostream* os) { *os << p.name; }

std::string pair_name(const ::testing::TestParamInfo<ServingPair>& info) { return info.param.name; }

class CliServingPairs : public ::testing::TestWithParam<ServingPair> {};
class CliServingPairsBug : public ::testing::TestWithParam<ServingPair> {};

}  // namespace

TEST_P(CliServingPairs, EveryPairIsLegitimate) {
  const ServingPair& p = GetParam();
  int code = -1;
  std::string a, b;
  const nlohmann::json j = judge(p, &code, &a, &b);
  EXPECT_EQ(code, 0) << j["headline"];
  ASSERT_EQ(j["pairs"].size(), p.pairs) << j["headline"];
  for (const auto& pair : j["pairs"]) {
    EXPECT_EQ(pair["verdict"], "legitimate") << pair["headline"];
    EXPECT_GT(pair["compared"].get<int>(), 0) << pair["headline"];
  }
  for (const char* side : {"a", "b"})
    for (const auto& s : j[side]["sequences"]) EXPECT_TRUE(s["ok"].get<bool>()) << side << " " << s["headline"];
  EXPECT_EQ(j["headline"].get<std::string>().rfind("legitimate: ", 0), 0u) << j["headline"];
  expect_feature_acted(p, a, b, j);
}

TEST_P(CliServingPairsBug, IsABugInBNamed) {
  const ServingPair& p = GetParam();
  int code = -1;
  std::string a, b;
  const nlohmann::json j = judge(p, &code, &a, &b);
  EXPECT_EQ(code, 1) << j["headline"];
  ASSERT_EQ(j["pairs"].size(), p.pairs) << j["headline"];
  for (const auto& s : j["a"]["sequences"]) EXPECT_TRUE(s["ok"].get<bool>()) << "a " << s["headline"];
  bool named = false;
  for (const auto& pair : j["pairs"]) {
    EXPECT_NE(pair["verdict"], "bug-in-a") << pair["headline"];
    EXPECT_NE(pair["verdict"], "bug-in-both") << pair["headline"];
    if (pair["b"] != p.buggy) continue;
    named = true;
    EXPECT_EQ(pair["verdict"], "bug-in-b") << pair["headline"];
    const auto& seq = j["b"]["sequences"][size_t(p.buggy)];
    EXPECT_EQ(seq["seq"], p.buggy);
    EXPECT_FALSE(seq["ok"].get<bool>());
    EXPECT_EQ(seq["bisect"]["finding"]["bug"], p.bug) << seq["bisect"]["finding"].dump(1).substr(0, 2000);
    EXPECT_EQ(pair["headline"], "a bug in B: " + seq["headline"].get<std::string>());
  }
  EXPECT_TRUE(named) << "no pair holds seq" << p.buggy << " of B";
  EXPECT_NE(j["headline"].get<std::string>().find("a bug in B"), std::string::npos) << j["headline"];
  expect_feature_acted(p, a, b, j);
}

INSTANTIATE_TEST_SUITE_P(, CliServingPairs, ::testing::ValuesIn(legitimate_pairs()), pair_name);
INSTANTIATE_TEST_SUITE_P(, CliServingPairsBug, ::testing::ValuesIn(bug_pairs()), pair_name);

// The acceptance count: at least 25 legitimate pairs over dense, MoE and MLA
// models, every kind of pair present, and a bug pair for each bug of the
// zoo that acts only with a serving feature or over ranks.
TEST(CliServingPairsCoverage, TwentyFivePairsOverEveryKindAndModelFamily) {
  const std::vector<ServingPair> legit = legitimate_pairs(), bugs = bug_pairs();
  EXPECT_GE(legit.size(), 25u);
  std::set<Feature> kinds;
  std::set<std::string> models, names, injected;
  for (const ServingPair& p : legit) {
    kinds.insert(p.feature);
    models.insert(p.model);
    EXPECT_TRUE(names.insert(p.name).second) << p.name;
  }
  EXPECT_EQ(kinds.size(), 8u);
  for (const char* m : {"llama-gqa", "qwen3-moe", "deepseek-v3-mla"}) EXPECT_TRUE(models.count(m)) << m;
  for (const ServingPair& p : bugs) {
    injected.insert(p.bug);
    EXPECT_TRUE(names.insert(p.name).second) << p.name;
  }
  // Every bug of a serving feature or of tensor parallelism in the zoo.
  for (const zoo::BugInfo& info : zoo::all_bugs()) {
    if (info.feature != zoo::Feature::None || info.tp_fault) {
      EXPECT_TRUE(injected.count(info.name)) << info.name;
    }
  }
}
