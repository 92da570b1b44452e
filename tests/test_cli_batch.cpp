// Several sequences in one dump: HF's left-padded batched generation
// (batch.safetensors of llama-gqa and qwen3-qknorm, three prompts of
// different lengths, stripped to seq{b}.*). Each sequence reads as a
// single-sequence dump (SequenceView), bisect judges each against the
// reference running it alone and says which sequence went wrong first, in
// which engine iteration, and whether the others of that iteration did.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "dumps/dump.h"
#include "dumps/errors.h"
#include "dumps/names.h"
#include "dumps/sequences.h"
#include "tests/cli_runner.h"
#include "tests/support.h"

using namespace llmdiff;
using namespace llmdiff::testing;

namespace {

const std::vector<std::string> kBatchModels = {"llama-gqa", "qwen3-qknorm"};

// HF's batch dump of `model` with `change` applied, written to a file.
std::string changed_batch(const std::string& model, const std::string& stem,
                          const std::function<void(MemoryDump&)>& change) {
  return changed_golden(model, "batch", stem, change);
}

void scale(MemoryDump& d, const std::string& name, float by) {
  TensorData t = d.get(name);
  for (float& v : t.f) v *= by;
  d.put(t);
}

nlohmann::json bisect_json(const std::string& model, const std::string& dump, int* code) {
  const CliRun r = run_cli({"bisect", "--model", golden_model(model), dump, "--json", "--threads", "1"});
  *code = r.code;
  EXPECT_TRUE(r.code == 0 || r.code == 1) << r.error << r.out;
  return nlohmann::json::parse(r.out);
}

}  // namespace

TEST(SequenceView, ReadsOneSequenceOfHfsBatchAsASingleSequenceDump) {
  for (const std::string& model : kBatchModels) {
    SCOPED_TRACE(model);
    DumpFile batch(golden_dump(model, "batch"));
    const DumpFile alone(golden_dump(model, "decode"));
    ASSERT_EQ(dump_sequences(batch), (std::vector<int>{0, 1, 2}));
    EXPECT_TRUE(dump_sequences(alone).empty());
    for (int b : dump_sequences(batch)) {
      SequenceView v(batch, b);
      EXPECT_EQ(v.sequence(), b);
      EXPECT_EQ(v.num_steps(), 4);
      EXPECT_EQ(v.manifest().steps, 4);
      // The names of a single-sequence dump of the same scenario, in order.
      std::vector<std::string> want = alone.names();
      EXPECT_EQ(v.names(), want);
      EXPECT_TRUE(v.has("rope.inv_freq"));
      EXPECT_FALSE(v.has("iter0.seqs"));
      EXPECT_FALSE(v.has("seq0.step0.tokens"));
      const TensorData t = v.get("step0.tokens");
      EXPECT_EQ(t.name, "step0.tokens");
      EXPECT_EQ(t.i, batch.get(sequence_prefix(b) + "step0.tokens").i);
      EXPECT_EQ(v.shape("step1.layers.0.attn.q"), batch.shape(sequence_prefix(b) + "step1.layers.0.attn.q"));
      EXPECT_THROW(v.get("step9.tokens"), MissingTensorError);
      // A static HF batch runs every sequence in every call: iteration n is step n.
      for (int step = 0; step < 4; ++step) EXPECT_EQ(engine_iteration(batch, b, step), step);
      EXPECT_FALSE(engine_iteration(batch, b, 4).has_value());
    }
    EXPECT_EQ(iteration_members(batch, 1), (std::vector<std::pair<int, int>>{{0, 1}, {1, 1}, {2, 1}}));
    EXPECT_THROW(SequenceView(batch, 3), MissingTensorError);
    EXPECT_FALSE(engine_iteration(alone, 0, 0).has_value());
  }
}

TEST(CliBatch, HfsBatchedRunMatchesTheReferenceSequenceBySequence) {
  // Left padding changes HF's GEMM shapes (about 1e-6 relative in float32):
  // within the noise floor, every sequence passes.
  for (const std::string& model : kBatchModels) {
    SCOPED_TRACE(model);
    int code = -1;
    const auto j = bisect_json(model, golden_dump(model, "batch"), &code);
    EXPECT_EQ(code, 0) << j.dump(1);
    EXPECT_EQ(j["schema"], "llmdiff.bisect-batch/1");
    ASSERT_EQ(j["sequences"].size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(j["sequences"][i]["seq"], int(i));
      EXPECT_TRUE(j["sequences"][i]["ok"].get<bool>()) << j["sequences"][i]["bisect"].dump(1);
      EXPECT_TRUE(j["sequences"][i]["iteration"].is_null());
    }
    EXPECT_TRUE(j["first_divergent_sequence"].is_null());
    EXPECT_EQ(j["exit_code"], 0);
  }
}

TEST(CliBatch, OneWrongSequenceIsNamedWithItsStepIterationAndTheOthersUnaffected) {
  for (const std::string& model : kBatchModels) {
    SCOPED_TRACE(model);
    const std::string path = changed_batch(model, "batch-seq1", [](MemoryDump& d) {
      scale(d, "seq1.step2.layers.1.mlp.down", 1.5f);
    });
    int code = -1;
    const auto j = bisect_json(model, path, &code);
    EXPECT_EQ(code, 1);
    EXPECT_EQ(j["first_divergent_sequence"], 1);
    const auto& s1 = j["sequences"][1];
    EXPECT_FALSE(s1["ok"].get<bool>());
    EXPECT_EQ(s1["step"], 2);
    EXPECT_EQ(s1["iteration"], 2);
    EXPECT_EQ(s1["bisect"]["localised_at"], "step2.layers.1.mlp.down") << s1["bisect"].dump(1);
    EXPECT_TRUE(j["sequences"][0]["ok"].get<bool>());
    EXPECT_TRUE(j["sequences"][2]["ok"].get<bool>());
    EXPECT_EQ(j["iteration_unaffected"], (std::vector<int>{0, 2}));
    EXPECT_TRUE(j["iteration_affected"].empty());

    const CliRun text = run_cli({"bisect", "--model", golden_model(model), path, "--threads", "1"});
    EXPECT_EQ(text.code, 1) << text.error;
    EXPECT_NE(text.out.find("first divergent sequence: seq1 at step 2 (engine iteration 2)"), std::string::npos)
        << text.out;
    EXPECT_NE(text.out.find("unaffected (seq0, seq2)"), std::string::npos) << text.out;
    EXPECT_NE(text.out.find("== seq1"), std::string::npos) << text.out;
  }
}

TEST(CliBatch, SequencesOfOneIterationGoingWrongTogetherAreReportedTogether) {
  // seq0 and seq2 wrong from iteration 1 on, seq1 right: the first is the
  // earliest in engine order (iteration 1, row 0), seq2 went wrong with it.
  const std::string model = "llama-gqa";
  const std::string path = changed_batch(model, "batch-leak", [](MemoryDump& d) {
    for (int b : {0, 2}) scale(d, "seq" + std::to_string(b) + ".step1.layers.0.attn.ctx", 1.25f);
  });
  int code = -1;
  const auto j = bisect_json(model, path, &code);
  EXPECT_EQ(code, 1);
  EXPECT_EQ(j["first_divergent_sequence"], 0);
  EXPECT_EQ(j["sequences"][0]["iteration"], 1);
  EXPECT_EQ(j["sequences"][2]["iteration"], 1);
  EXPECT_TRUE(j["sequences"][1]["ok"].get<bool>());
  EXPECT_EQ(j["iteration_affected"], (std::vector<int>{2}));
  EXPECT_EQ(j["iteration_unaffected"], (std::vector<int>{1}));
  const CliRun text = run_cli({"bisect", "--model", golden_model(model), path, "--threads", "1"});
  EXPECT_NE(text.out.find("sequences of the same iteration diverge with it (seq2; unaffected: seq1)"),
            std::string::npos)
      << text.out;
}
