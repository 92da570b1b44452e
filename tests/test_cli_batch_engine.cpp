// The impl's continuous-batching engine end to end: eight requests of
// different lengths arriving at different engine iterations, prompts in
// chunks of 3 beside the decodes of the others, a paged KV cache of blocks
// of 4. Clean, every sequence matches the reference running it alone within
// the noise floor. With each batch bug of the zoo, bisect names the first
// sequence that went wrong, its step and engine iteration, the op, and the
// bug: from a full dump (fingerprints: positions, probabilities, the paged
// bookkeeping, the gathered cache) and from one cut down to tokens, layer
// outputs, logits and the iterations (a replay of the batch's schedule).
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "dumps/zoo/bugs.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/sequences.h"
#include "dumps/model/config.h"
#include "tests/cli_runner.h"
#include "tests/support.h"

using namespace llmdiff;
using namespace llmdiff::testing;

namespace {

// 8 requests: PROMPT@JOIN:DECODE.
const char* kRequests =
    "1,5,9,13,17,21,25@0:3;2,6,10@0:4;3,7,11,15,19,23,27,31,35@1:2;4,8@1:5;40,41,42,43,44@2:3;"
    "50,51,52,53,54,55,56,57@3:2;60,61,62@4:1;70,71,72,73@6:3";
const char* kCutDown = "seq*.step*.tokens,seq*.step*.layers.*.out,seq*.step*.logits,seq*.generated,iter*";

// 4 requests for the MoE and MLA models: joining at iterations 0, 1 and 2,
// prompts in chunks beside the others' decodes.
const char* kFewRequests = "1,5,9,13,17,21,25@0:3;2,6,10@0:4;3,7,11,15,19@1:2;40,41,42,43@2:3";

std::string batch_dump(const std::string& model, const std::string& bug, bool cut, const char* requests = kRequests,
                       const std::vector<std::string>& extra = {}) {
  std::string tag;
  for (const std::string& e : extra) tag += "-" + e;
  const std::string out = temp_path("batch-" + model + "-" + (bug.empty() ? "clean" : bug) + (cut ? "-cut" : "") +
                                    tag + (requests == kRequests ? "" : "-few") + ".safetensors");
  std::vector<std::string> args = {"dump",    "--engine",     "impl", "--model", golden_model(model),
                                   "--batch", requests,       "--chunk", "3",    "--block-size",
                                   "4",       "--threads",    "1",    "--out",   out};
  if (!bug.empty()) args.insert(args.end(), {"--inject", bug});
  if (cut) args.insert(args.end(), {"--sites", kCutDown});
  args.insert(args.end(), extra.begin(), extra.end());
  const CliRun r = run_cli(args);
  EXPECT_EQ(r.code, 0) << r.error;
  return out;
}

}  // namespace

TEST(CliBatchEngine, EightSequencesJoiningAtDifferentIterationsMatchTheReferenceAlone) {
  for (const std::string model : {"llama-gqa", "qwen3-qknorm", "qwen2-bias", "llama3-mqa-scaled"}) {
    SCOPED_TRACE(model);
    const std::string path = batch_dump(model, "", false);
    DumpFile d(path);
    EXPECT_EQ(d.manifest().extra.at("kv_cache"), "{\"kind\": \"paged\", \"block_size\": 4, \"num_blocks\": 25}");
    // Chunked prefill beside decodes: iteration 1 holds seq0's second chunk,
    // seq1's first decode and the first chunks of seq2 and seq3.
    EXPECT_EQ(d.get("iter1.seqs").i, (std::vector<int64_t>{0, 1, 2, 3}));
    EXPECT_EQ(d.get("iter1.num_tokens").i, (std::vector<int64_t>{3, 1, 3, 2}));
    // (Element by element: GCC 12 miscompiles this test's braced list {1, 1, 0, 0} of int64_t.)
    const std::vector<int64_t> steps = d.get("iter1.seq_steps").i;
    ASSERT_EQ(steps.size(), 4u);
    EXPECT_TRUE(steps[0] == 1 && steps[1] == 1 && steps[2] == 0 && steps[3] == 0);
    EXPECT_EQ(d.get("seq7.step0.positions").i, (std::vector<int64_t>{0, 1, 2}));
    int code = -1;
    const auto j = bisect_json(model, path, &code);
    EXPECT_EQ(code, 0) << j.dump(1).substr(0, 4000);
    ASSERT_EQ(j["sequences"].size(), 8u);
    for (const auto& s : j["sequences"]) EXPECT_TRUE(s["ok"].get<bool>()) << s["bisect"]["diagnosis"].dump(1);
  }
}

// The one forward serves every model: MoE (softmax routing, Qwen3-MoE and
// Mixtral) and MLA (DeepSeek-V3, naive and absorbed) batches match the
// reference running each sequence alone.
TEST(CliBatchEngine, MoeAndMlaBatchesMatchTheReferenceAloneSequenceBySequence) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> runs = {
      {"qwen3-moe", {}}, {"mixtral-gqa", {}}, {"deepseek-v3-mla", {}}, {"deepseek-v3-mla", {"--mla", "absorbed"}}};
  for (const auto& [model, extra] : runs) {
    SCOPED_TRACE(model + (extra.empty() ? "" : " " + extra.back()));
    const std::string path = batch_dump(model, "", false, kFewRequests, extra);
    DumpFile d(path);
    EXPECT_EQ(d.get("iter1.seqs").i, (std::vector<int64_t>{0, 1, 2}));
    EXPECT_EQ(d.get("iter1.num_tokens").i, (std::vector<int64_t>{3, 1, 3}));
    int code = -1;
    const auto j = bisect_json(model, path, &code);
    EXPECT_EQ(code, 0) << j.dump(1).substr(0, 4000);
    ASSERT_EQ(j["sequences"].size(), 4u);
    for (const auto& s : j["sequences"]) EXPECT_TRUE(s["ok"].get<bool>()) << s["bisect"]["diagnosis"].dump(1);
  }
}

// Every bug of the zoo that changes the forward pass acts in the batched
// engine too, through the same forward: injected into a batch of a dense, a
// MoE and an MLA model, each is localised in a sequence and named.
TEST(CliBatchEngine, EachModelBugInABatchIsLocalisedAndNamed) {
  for (const std::string model : {"qwen2-bias", "qwen3-moe", "deepseek-v3-mla"}) {
    const ModelConfig cfg = load_config(golden_model(model));
    for (const zoo::BugInfo& info : zoo::all_bugs()) {
      if (!info.acts_on_model() || info.needs_padding || !zoo::bug_inapplicable_reason(info.bug, cfg).empty())
        continue;
      SCOPED_TRACE(model + " " + info.name);
      int code = -1;
      const auto j = bisect_json(model, batch_dump(model, info.name, false, kFewRequests), &code);
      EXPECT_EQ(code, 1);
      ASSERT_TRUE(j["first_divergent_sequence"].is_number()) << j.dump(1).substr(0, 2000);
      const auto& s = j["sequences"][j["first_divergent_sequence"].get<size_t>()];
      EXPECT_TRUE(s["bisect"]["localised_at"].is_string()) << s["bisect"].dump(1).substr(0, 2000);
      const auto& d = s["bisect"]["diagnosis"];
      ASSERT_TRUE(d["bug"].is_string()) << d.dump(1).substr(0, 3000);
      EXPECT_EQ(d["bug"].get<std::string>().substr(0, std::string(info.name).size()), info.name) << d.dump(1);
    }
  }
}

TEST(CliBatchEngine, EachBatchBugIsLocalisedToItsSequenceStepAndOpAndNamed) {
  struct Case {
    const char* bug;
    int seq, step, iteration;
    const char* at;           // localised at, full dump
    int cut_seq, cut_step;    // first divergent sequence and step in the cut-down dump
  };
  // Where each bug first shows, from the schedule: seq1 is the first that
  // has another sequence's rows before it (iteration 0); every sequence's
  // slots and context are wrong from its first call; seq0's prompt blocks
  // are freed after iteration 2 and given to seq2 in iteration 3; seq0's
  // cache holds two full blocks from step 3. A cut-down dump shows a bug
  // where it changes a layer's output: shifted positions keep relative
  // positions within a call (seq1 is shifted by 3 in its prefill and by
  // another amount at step 2), swapped blocks change nothing for a decode
  // query that attends all of them (seq2's chunk at step 2 is the first
  // causal call over two full blocks).
  const Case cases[] = {
      {"batch-positions", 1, 0, 0, "step0.positions", 1, 2},
      {"packed-cross-attention", 1, 0, 0, "step0.layers.0.attn.probs", 1, 0},
      {"slot-mapping-off-by-one", 0, 0, 0, "step0.layers.0.attn.k_cache", 0, 0},
      {"context-len-plus-one", 0, 0, 0, "step0.mask", 0, 0},
      {"block-reuse-early", 0, 3, 3, "step3.layers.0.attn.k_cache", 0, 3},
      {"block-table-order", 0, 3, 3, "step3.layers.0.attn.k_cache", 2, 2},
  };
  std::set<std::string> covered;
  for (const Case& c : cases) {
    covered.insert(c.bug);
    for (const bool cut : {false, true}) {
      SCOPED_TRACE(std::string(c.bug) + (cut ? " (cut down)" : " (full)"));
      int code = -1;
      const auto j = bisect_json("llama-gqa", batch_dump("llama-gqa", c.bug, cut), &code);
      EXPECT_EQ(code, 1);
      const int want_seq = cut ? c.cut_seq : c.seq;
      ASSERT_EQ(j["first_divergent_sequence"], want_seq) << j.dump(1).substr(0, 3000);
      const auto& s = j["sequences"][size_t(want_seq)];
      EXPECT_EQ(s["step"], cut ? c.cut_step : c.step);
      if (!cut) {
        EXPECT_EQ(s["iteration"], c.iteration);
        EXPECT_EQ(s["bisect"]["localised_at"], c.at);
      }
      const auto& d = s["bisect"]["diagnosis"];
      EXPECT_EQ(d["bug"], c.bug) << d.dump(1);
      EXPECT_EQ(d["basis"], cut ? "batch replay" : "fingerprint") << d.dump(1);
      EXPECT_TRUE(d["ambiguous"].empty()) << d.dump(1);
    }
  }
  // The serving features' bugs are covered by test_cli_serving.cpp.
  for (const zoo::BugInfo* info : zoo::batch_bugs())
    if (info->feature == zoo::Feature::None) EXPECT_TRUE(covered.count(info->name)) << info->name;
}

TEST(CliBatchEngine, TheBatchReportNamesTheBugInText) {
  const std::string path = batch_dump("llama-gqa", "block-reuse-early", false);
  const CliRun r = run_cli({"bisect", "--model", golden_model("llama-gqa"), path, "--threads", "1"});
  EXPECT_EQ(r.code, 1) << r.error;
  EXPECT_NE(r.out.find("first divergent sequence: seq0 at step 3 (engine iteration 3)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Diagnosis at step3.layers.0.attn.k_cache: block-reuse-early"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("block 0 is in the block tables of seq0 (step 3) and seq2 (step 2)"), std::string::npos)
      << r.out;
}

TEST(CliBatchEngine, UsageErrors) {
  const std::string out = temp_path("batch-usage.safetensors");
  const std::string model = golden_model("llama-gqa");
  // The reference does not serve batches; a bug that cannot apply to the
  // model is refused; a batch bug needs the batched engine; a paged cache is not a ring.
  EXPECT_EQ(run_cli({"dump", "--engine", "ref", "--model", model, "--batch", "1,2", "--out", out}).code, 2);
  const CliRun inapplicable = run_cli(
      {"dump", "--engine", "impl", "--model", model, "--batch", "1,2", "--inject", "moe-expert-off-by-one", "--out", out});
  EXPECT_EQ(inapplicable.code, 2);
  EXPECT_NE(inapplicable.error.find("cannot apply"), std::string::npos) << inapplicable.error;
  const CliRun ring =
      run_cli({"dump", "--engine", "impl", "--model", model, "--batch", "1,2", "--kv-ring", "4", "--out", out});
  EXPECT_EQ(ring.code, 2);
  EXPECT_NE(ring.error.find("--kv-ring"), std::string::npos) << ring.error;
  const CliRun single = run_cli({"dump", "--engine", "impl", "--model", model, "--tokens", "1,2", "--inject",
                                 "slot-mapping-off-by-one", "--out", out});
  EXPECT_EQ(single.code, 2);
  EXPECT_NE(single.error.find("continuous-batching engine"), std::string::npos) << single.error;
  // Malformed requests, a pool too small.
  for (const char* bad : {"", "1,x", "1,2@", "1,2:-1", ";", "1,2@1@2"})
    EXPECT_EQ(run_cli({"dump", "--engine", "impl", "--model", model, "--batch", bad, "--out", out}).code, 2) << bad;
  const CliRun pool = run_cli({"dump", "--engine", "impl", "--model", model, "--batch", "1,2,3,4,5;6,7,8,9,10",
                               "--block-size", "2", "--num-blocks", "4", "--out", out});
  EXPECT_EQ(pool.code, 2);
  EXPECT_NE(pool.error.find("blocks of 2 are all in use at engine iteration 0"), std::string::npos) << pool.error;
  EXPECT_FALSE(std::filesystem::exists(out));
}

TEST(CliBatchEngine, TheRefRunsARowOfALeftPaddedBatch) {
  // seq1 of HF's llama-gqa batch: 3 prompt tokens behind 4 pads.
  const std::string model = golden_model("llama-gqa");
  const DumpFile batch(golden_dump("llama-gqa", "batch"));
  const SequenceView hf(batch, 1);
  std::string tokens;
  for (int64_t t : hf.get("step0.tokens").i) tokens += (tokens.empty() ? "" : ",") + std::to_string(t);
  const std::string out = temp_path("ref-left-pad.safetensors");
  const CliRun r = run_cli({"dump", "--engine", "ref", "--model", model, "--tokens", tokens, "--decode", "3",
                            "--left-pad", "4", "--out", out, "--threads", "1"});
  ASSERT_EQ(r.code, 0) << r.error;
  const DumpFile mine(out);
  EXPECT_EQ(mine.get("generated").i, hf.get("generated").i);
  for (const std::string& n : hf.names()) {
    ASSERT_TRUE(mine.has(n)) << n;
    EXPECT_EQ(mine.shape(n), hf.shape(n)) << n;
  }
  EXPECT_EQ(mine.get("step0.positions").i, hf.get("step0.positions").i);
  int code = -1;
  const CliRun b = run_cli({"bisect", "--model", model, out, "--threads", "1"});
  EXPECT_EQ(b.code, 0) << b.out;
  (void)code;
  EXPECT_EQ(mine.manifest().extra.at("padding"), "{\"left\":4,\"pad_token\":0}");
}

TEST(CliBatchEngine, PadKeysLeftOpenInALeftPaddedRowAreLocalisedAndNamed) {
  // The impl runs the row too; with pad-keys-unmasked its queries attend the
  // pads. The reference replays the row behind the same pads (manifest
  // padding), so the clean row passes and the buggy one is named by replay.
  const std::string model = golden_model("qwen3-qknorm");
  for (const bool cut : {false, true}) {
    for (const bool bug : {false, true}) {
      SCOPED_TRACE(std::string(cut ? "cut down" : "full") + (bug ? ", pad-keys-unmasked" : ", clean"));
      const std::string out = temp_path(std::string("impl-pad-") + (bug ? "bug" : "clean") + (cut ? "-cut" : "") +
                                        ".safetensors");
      std::vector<std::string> args = {"dump",     "--engine", "impl", "--model", model, "--tokens", "5,9,2",
                                       "--decode", "3",        "--left-pad", "4", "--pad-token", "7", "--out", out};
      if (bug) args.insert(args.end(), {"--inject", "pad-keys-unmasked"});
      if (cut) args.insert(args.end(), {"--sites", "step*.tokens,step*.positions,step*.layers.*.out,step*.logits,generated"});
      ASSERT_EQ(run_cli(args).code, 0);
      const CliRun r = run_cli({"bisect", "--model", model, out, "--json", "--threads", "1"});
      const auto j = nlohmann::json::parse(r.out);
      if (!bug) {
        EXPECT_EQ(r.code, 0) << j["diagnosis"].dump(1);
        continue;
      }
      EXPECT_EQ(r.code, 1);
      if (!cut) {
        EXPECT_EQ(j["localised_at"], "step0.layers.0.attn.probs") << j["diagnosis"].dump(1);
      }
      EXPECT_EQ(j["diagnosis"]["bug"], "pad-keys-unmasked") << j["diagnosis"].dump(1);
    }
  }
}

TEST(CliBatchEngine, SequencesOfABatchSampleWithTheirOwnDrawsAndSamplerBugsAreNamed) {
  // Every sequence draws with HF's processors, its own seed (seed + b) and
  // token history; bisect checks each on its own logits.
  const std::string model = golden_model("llama-gqa");
  const char* requests = "1,5,9,13,17,21,25@0:3;2,6,10@0:4;3,7,11,15@1:2";
  for (const bool bug : {false, true}) {
    SCOPED_TRACE(bug ? "sampler-top-p-before-temperature" : "clean");
    const std::string out = temp_path(std::string("batch-sample-") + (bug ? "bug" : "clean") + ".safetensors");
    std::vector<std::string> args = {"dump",    "--engine", "impl",        "--model", model,  "--batch", requests,
                                     "--chunk", "3",        "--block-size", "4",      "--out", out,       "--sample",
                                     "temperature=0.7,top_k=40,top_p=0.9,seed=1"};
    if (bug) args.insert(args.end(), {"--inject", "sampler-top-p-before-temperature"});
    ASSERT_EQ(run_cli(args).code, 0);
    const DumpFile d(out);
    EXPECT_NE(d.manifest().extra.at("sampling.seq2").find("\"seed\":3"), std::string::npos);
    EXPECT_TRUE(d.has("seq1.step0.sample.u"));  // seq1's 3 tokens are one call: it draws at step 0
    int code = -1;
    const auto j = bisect_json("llama-gqa", out, &code);
    EXPECT_TRUE(j["first_divergent_sequence"].is_null());  // the forward passes agree
    ASSERT_EQ(j["sampling"]["sequences"].size(), 3u);
    EXPECT_EQ(j["sampling"]["verdict"], bug ? "fail" : "pass") << j["sampling"].dump(1).substr(0, 2000);
    EXPECT_EQ(code, bug ? 1 : 0);
    if (bug) {
      ASSERT_FALSE(j["sampling"]["explained_by"].empty());
      EXPECT_EQ(j["sampling"]["explained_by"][0]["bug"], "sampler-top-p-before-temperature");
    }
  }
}

TEST(CliBatchEngine, AMalformedPaddingKeyIsAnInputErrorNamingIt) {
  // A sequence of HF's decode golden declared as a padded row, the value garbled.
  for (const char* value : {"{\"left\": -1}", "{\"left\": 2, \"side\": 1}", "[2]", "not json"}) {
    SCOPED_TRACE(value);
    const std::string path = changed_golden("llama-gqa", "decode", "bad-padding", [&](MemoryDump& d) {
      d.mutable_manifest().extra["padding"] = value;
    });
    const CliRun r = run_cli({"bisect", "--model", golden_model("llama-gqa"), path, "--threads", "1"});
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.error.find("manifest 'padding'"), std::string::npos) << r.error;
  }
  // --batch gives its requests itself.
  EXPECT_EQ(run_cli({"dump", "--engine", "impl", "--model", golden_model("llama-gqa"), "--batch", "1,2", "--tokens",
                     "3,4", "--out", temp_path("batch-tokens.safetensors")})
                .code,
            2);
}
