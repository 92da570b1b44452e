// Tensor parallelism end to end: `llmdiff dump --tp R` (the impl over R
// ranks, each rank's names under rank{r}.) bisected by `llmdiff bisect`,
// which reads the dump unsharded and judges each rank on its own. A
// correct run over 2 and 4 ranks passes on every golden model; each
// tensor-parallel bug of the zoo is localised where it is made (the
// all-reduce after o_proj or after the MLP/MoE block, the rank's kv-head
// shard) and named with the rank from a full dump, and named by replay from
// one cut down to layer outputs and logits; a malformed tensor-parallel
// dump is an input error naming the file and the tensor.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"
#include "dumps/contract/ranks.h"
#include "dumps/model/config.h"
#include "tests/cli_runner.h"
#include "tests/support.h"

using namespace llmdiff;
using namespace llmdiff::testing;

namespace {

// Tokens, layer outputs (`?`: not attn.out or moe.out, rank r's partial
// sums) and logits: replicated names, written under rank0. only.
const char* kCutDown = "rank*.step*.tokens,rank*.step*.layers.?.out,rank*.step*.logits,rank*.generated";
const char* kRequests = "1,5,9,13,17,21,25@0:3;2,6,10@0:4;3,7,11,15,19@1:2;40,41,42,43@2:3";

const char* kCutDownBatch =
    "rank*.seq*.step*.tokens,rank*.seq*.step*.layers.?.out,rank*.seq*.step*.logits,rank*.seq*.generated,rank*.iter*";

std::string tp_dump(const std::string& model, int ranks, const std::string& bug, bool cut, bool batch = false) {
  const std::string out = temp_path("tp-" + model + "-" + std::to_string(ranks) + "-" + (bug.empty() ? "clean" : bug) +
                                    (cut ? "-cut" : "") + (batch ? "-batch" : "") + ".safetensors");
  std::vector<std::string> args = {"dump", "--engine", "impl", "--model", golden_model(model),
                                   "--tp", std::to_string(ranks), "--threads", "1", "--out", out};
  if (batch)
    args.insert(args.end(), {"--batch", kRequests, "--chunk", "3", "--block-size", "4"});
  else
    args.insert(args.end(), {"--replay", golden_dump(model, "decode")});
  if (!bug.empty()) args.insert(args.end(), {"--inject", bug});
  if (cut) args.insert(args.end(), {"--sites", batch ? kCutDownBatch : kCutDown});
  const CliRun r = run_cli(args);
  EXPECT_EQ(r.code, 0) << r.error;
  return out;
}

// A copy of a dump with `change` applied, written to a fresh file.
std::string changed(const std::string& path, const std::string& stem, const std::function<void(MemoryDump&)>& change) {
  const DumpFile file(path);
  MemoryDump d(stem);
  for (const std::string& n : file.names()) d.put(file.get(n));
  d.mutable_manifest() = file.manifest();
  change(d);
  const std::string out = temp_path(stem + ".safetensors");
  d.save(out);
  return out;
}

}  // namespace

TEST(CliTensorParallel, ACorrectRunOverTwoOrFourRanksPassesOnEveryGoldenModel) {
  for (const std::string& model : golden_models()) {
    for (const int R : {2, 4}) {
      SCOPED_TRACE(model + " over " + std::to_string(R) + " ranks");
      const std::string path = tp_dump(model, R, "", false);
      EXPECT_EQ(DumpFile(path).manifest().extra.at("tensor_parallel"), "{\"ranks\":" + std::to_string(R) + "}");
      int code = -1;
      const auto j = bisect_json(model, path, &code);
      EXPECT_EQ(code, 0) << j["headline"] << j["first_divergence"];
      EXPECT_NE(j["noise_second_run"].get<std::string>().find("over " + std::to_string(R) + " ranks"),
                std::string::npos)
          << j["noise_second_run"];
    }
  }
}

// The noise floor's second run is made over the candidate's ranks, which
// makes the same partial sums: an impl candidate over R ranks is then that
// run itself. Its reduction order is float32 rounding all the same: the
// unsharded run written as a single-rank dump passes against the
// single-rank clean impl too.
TEST(CliTensorParallel, TheReductionOrderOfFourRanksIsWithinTheSingleRankNoiseFloor) {
  for (const std::string model : {"llama3-mqa-scaled", "qwen3-moe", "deepseek-v3-mla"}) {
    SCOPED_TRACE(model);
    const DumpFile tp(tp_dump(model, 4, "", false));
    const RankView view(tp, load_config(golden_model(model)));
    MemoryDump whole("unsharded");
    for (const std::string& n : view.names()) whole.put(view.get(n));
    whole.mutable_manifest() = view.manifest();
    EXPECT_EQ(whole.manifest().extra.count("tensor_parallel"), 0u);
    const std::string path = temp_path("tp-unsharded-" + model + ".safetensors");
    whole.save(path);
    int code = -1;
    const auto j = bisect_json(model, path, &code);
    EXPECT_EQ(code, 0) << j["headline"];
    EXPECT_EQ(j["noise_second_run"].get<std::string>().find("ranks"), std::string::npos) << j["noise_second_run"];
  }
}

// Each bug where it is made, named with the rank from a full dump; from a
// dump cut down to layer outputs and logits, by the replay over the ranks.
TEST(CliTensorParallel, EachBugIsLocalisedWhereItIsMadeAndNamedWithTheRank) {
  struct Case {
    const char* bug;
    const char* model;
    int ranks;
    const char* at;     // localised at, full dump
    const char* words;  // in the evidence, full dump
  };
  const Case cases[] = {
      {"tp-kv-heads-split", "llama-gqa", 4, "step0.layers.0.attn.k",
       "rank 1's attn.k holds kv head 1 where its query heads read kv head 0"},
      {"tp-kv-heads-split", "qwen3-moe", 4, "step0.layers.0.attn.k",
       "rank 1's attn.k holds kv head 1 where its query heads read kv head 0"},
      {"tp-allreduce-missing", "llama3-mqa-scaled", 2, "step0.layers.0.attn_residual",
       "step0.layers.0.attn_residual = the residual stream + rank 0's partial sum of attn.out only"},
      {"tp-allreduce-missing", "deepseek-v3-mla", 4, "step0.layers.0.attn_residual",
       "the all-reduce after o_proj is missing"},
      {"tp-allreduce-twice", "qwen3-moe", 4, "step0.layers.0.out",
       "the all-reduce after the MoE block is applied twice (the reduced sum reduced again over the 4 ranks)"},
      {"tp-allreduce-twice", "deepseek-v3-mla", 2, "step0.layers.0.out",
       "step0.layers.0.out = attn_residual + 2 x the sum of the 2 ranks' partial sums of mlp.down"},
  };
  for (const Case& c : cases) {
    for (const bool cut : {false, true}) {
      SCOPED_TRACE(std::string(c.bug) + " on " + c.model + " over " + std::to_string(c.ranks) + " ranks" +
                   (cut ? " (cut down)" : " (full)"));
      int code = -1;
      const auto j = bisect_json(c.model, tp_dump(c.model, c.ranks, c.bug, cut), &code);
      EXPECT_EQ(code, 1);
      const auto& d = j["diagnosis"];
      EXPECT_EQ(d["bug"], c.bug) << j["headline"] << d.dump(1).substr(0, 2000);
      EXPECT_TRUE(d["ambiguous"].empty()) << d.dump(1);
      if (cut) {
        // Only layer outputs: the first layer's is wrong, the replay over
        // the ranks names the bug.
        EXPECT_EQ(j["localised_at"], "step0.layers.0.out");
        EXPECT_EQ(d["basis"], "replay") << d.dump(1);
      } else {
        EXPECT_EQ(j["localised_at"], c.at);
        EXPECT_EQ(j["first_local_failure"], c.at);
        EXPECT_EQ(d["basis"], "fingerprint") << d.dump(1);
        EXPECT_NE(d["evidence"].get<std::string>().find(c.words), std::string::npos) << d["evidence"];
      }
    }
  }
}

// A batch served over 4 ranks: every sequence passes clean; a bug is named
// in the first sequence that goes wrong, by its rank check from a full dump,
// by the replay of the batch's schedule over the ranks from a cut-down one.
TEST(CliTensorParallel, ABatchOverFourRanksIsJudgedSequenceBySequence) {
  int code = -1;
  auto j = bisect_json("qwen3-moe", tp_dump("qwen3-moe", 4, "", false, true), &code);
  EXPECT_EQ(code, 0) << j.dump(1).substr(0, 3000);
  ASSERT_EQ(j["sequences"].size(), 4u);
  j = bisect_json("llama-gqa", tp_dump("llama-gqa", 4, "tp-kv-heads-split", false, true), &code);
  EXPECT_EQ(code, 1);
  ASSERT_EQ(j["first_divergent_sequence"], 0) << j.dump(1).substr(0, 3000);
  const auto& s = j["sequences"][0]["bisect"];
  EXPECT_EQ(s["localised_at"], "step0.layers.0.attn.k");
  EXPECT_EQ(s["diagnosis"]["bug"], "tp-kv-heads-split") << s["diagnosis"].dump(1);
  EXPECT_EQ(s["diagnosis"]["basis"], "fingerprint") << s["diagnosis"].dump(1);
  j = bisect_json("qwen3-moe", tp_dump("qwen3-moe", 4, "tp-allreduce-missing", true, true), &code);
  EXPECT_EQ(code, 1);
  ASSERT_EQ(j["first_divergent_sequence"], 0) << j.dump(1).substr(0, 3000);
  const auto& cut = j["sequences"][0]["bisect"];
  EXPECT_EQ(cut["localised_at"], "step0.layers.0.out");
  EXPECT_EQ(cut["diagnosis"]["bug"], "tp-allreduce-missing") << cut["diagnosis"].dump(1);
  EXPECT_EQ(cut["diagnosis"]["basis"], "replay") << cut["diagnosis"].dump(1);
}

// Unsharded, a run over 4 ranks is the single-rank run (diff reads both).
TEST(CliTensorParallel, DiffReadsATensorParallelDumpUnsharded) {
  const std::string one = temp_path("tp-one.safetensors");
  ASSERT_EQ(run_cli({"dump", "--engine", "impl", "--model", golden_model("deepseek-v3-mla"), "--replay",
                     golden_dump("deepseek-v3-mla", "decode"), "--threads", "1", "--out", one})
                .code,
            0);
  const CliRun r = run_cli({"diff", one, tp_dump("deepseek-v3-mla", 4, "", false)});
  EXPECT_EQ(r.code, 0) << r.out;
}

TEST(CliTensorParallel, AMalformedTensorParallelDumpIsAnInputErrorNamingTheFileAndTensor) {
  const std::string good = tp_dump("llama-gqa", 4, "", false);
  auto bisect_error = [](const std::string& path) {
    const CliRun r = run_cli({"bisect", "--model", golden_model("llama-gqa"), path, "--threads", "1"});
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.error.find(path), std::string::npos) << r.error;
    return r.error;
  };
  // A rank's shard missing.
  const std::string missing =
      changed(good, "tp-rank-missing", [](MemoryDump& d) { d.erase("rank2.step1.layers.1.attn.q"); });
  EXPECT_NE(bisect_error(missing).find("missing tensor 'rank2.step1.layers.1.attn.q'"), std::string::npos);
  // A whole rank missing.
  const std::string no_rank = changed(good, "tp-no-rank", [](MemoryDump& d) {
    for (const std::string& n : d.names())
      if (rank_of(n) == 3) d.erase(n);
  });
  EXPECT_NE(bisect_error(no_rank).find("missing tensor 'rank3."), std::string::npos);
  // A shard of the wrong width: rank 1's gate holds 41 columns, not 160/4.
  const std::string wide = changed(good, "tp-wide", [](MemoryDump& d) {
    TensorData t = d.get("rank1.step0.layers.0.mlp.gate");
    t.shape = {t.shape[0], 41};
    t.f.assign(size_t(t.shape[0] * 41), 0.5f);
    d.put(t);
  });
  const std::string e = bisect_error(wide);
  EXPECT_NE(e.find("tensor 'rank1.step0.layers.0.mlp.gate': expected shape [5, 40]"), std::string::npos) << e;
  // Rank 0's shard of another model's width.
  const std::string narrow = changed(good, "tp-narrow", [](MemoryDump& d) {
    TensorData t = d.get("rank0.step0.layers.0.attn.q");
    t.shape = {t.shape[0], 8};
    t.f.resize(size_t(t.shape[0] * 8));
    d.put(t);
  });
  EXPECT_NE(bisect_error(narrow).find("tensor 'rank0.step0.layers.0.attn.q': expected shape [5, 16] (query heads"),
            std::string::npos);
  // A rank beyond the manifest's, and a malformed manifest value.
  const std::string beyond = changed(good, "tp-beyond", [](MemoryDump& d) {
    TensorData t = d.get("rank0.step0.layers.0.attn.q");
    t.name = "rank4.step0.layers.0.attn.q";
    d.put(t);
  });
  EXPECT_NE(bisect_error(beyond).find("tensor 'rank4.step0.layers.0.attn.q': rank 4 of a dump the manifest gives 4"),
            std::string::npos);
  const std::string bad_key = changed(good, "tp-bad-key", [](MemoryDump& d) {
    d.mutable_manifest().extra["tensor_parallel"] = "{\"ranks\": 0}";
  });
  EXPECT_NE(bisect_error(bad_key).find("manifest 'tensor_parallel'"), std::string::npos);
  const std::string three = changed(good, "tp-three", [](MemoryDump& d) {
    d.mutable_manifest().extra["tensor_parallel"] = "{\"ranks\": 3}";
  });
  EXPECT_NE(bisect_error(three).find("3 ranks do not divide the 4 query heads"), std::string::npos);
}

TEST(CliTensorParallel, UsageErrors) {
  const std::string out = temp_path("tp-usage.safetensors");
  auto refused = [&](std::vector<std::string> args, const std::string& words) {
    args.insert(args.end(), {"--out", out});
    const CliRun r = run_cli(args);
    EXPECT_EQ(r.code, 2);
    EXPECT_NE(r.error.find(words), std::string::npos) << r.error;
  };
  const std::string gqa = golden_model("llama-gqa");
  refused({"dump", "--engine", "ref", "--model", gqa, "--tokens", "1,2", "--tp", "2"}, "--tp applies to the impl");
  refused({"dump", "--engine", "impl", "--model", gqa, "--tokens", "1,2", "--tp", "3"},
          "3 ranks do not divide the 4 query heads");
  refused({"dump", "--engine", "impl", "--model", gqa, "--tokens", "1,2", "--inject", "tp-allreduce-twice"},
          "act between ranks");
  refused({"dump", "--engine", "impl", "--model", gqa, "--tokens", "1,2", "--tp", "2", "--inject",
           "tp-kv-heads-split"},
          "ranks outnumber the kv heads");
  const CliRun r = run_cli({"bisect", "--model", gqa, tp_dump("llama-gqa", 2, "", false), "--layers", "0:1"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("bisect a tensor-parallel candidate whole"), std::string::npos) << r.error;
}
