// Several sequences in one dump: HF's left-padded batched generation
// (batch.safetensors of llama-gqa and qwen3-qknorm, three prompts of
// different lengths, stripped to seq{b}.*). Each sequence reads as a
// single-sequence dump (SequenceView), bisect judges each against the
// reference running it alone and says which sequence went wrong first, in
// which engine iteration, and whether the others of that iteration did.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sequences.h"
#include "dumps/sampling/sampling.h"
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

// One sequence of the batch wrong at layer 0's attn.k_rope from its first
// decode step on (left-padded behind the others' longer prompts): its
// signatures across names say that only k fails there, q passes, and only
// at its decode steps, in JSON and in the Markdown report.
TEST(CliBatch, OnlyKAtTheDecodeStepsOfOneSequenceIsSaidAcrossNames) {
  for (const std::string& model : kBatchModels) {
    SCOPED_TRACE(model);
    const std::string path = changed_batch(model, "batch-k-decode", [](MemoryDump& d) {
      for (int s = 1; d.has("seq1.step" + std::to_string(s) + ".tokens"); ++s)
        scale(d, "seq1.step" + std::to_string(s) + ".layers.0.attn.k_rope", 1.5f);
    });
    int code = -1;
    const auto j = bisect_json(model, path, &code);
    EXPECT_EQ(code, 1);
    const auto& s1 = j["sequences"][1]["bisect"];
    ASSERT_EQ(s1["localised_at"], "step1.layers.0.attn.k_rope") << s1.dump(1);
    const int64_t prompt = DumpFile(path).shape("seq1.step0.tokens")[0];
    const std::vector<std::string> words = {
        "attn.k_rope fails locally at layer 0 (steps 1, 2 and 3 of 4) while attn.q_rope passes there: only k is "
        "wrong, q is right",
        "attn.k_rope at layer 0 fails locally at 3 of 4 forward calls (steps 1, 2 and 3) and passes at step 0: every "
        "decode step (T = 1), never the prefill (T = " + std::to_string(prompt) + ")"};
    const std::string md = temp_path("batch-k-decode.md");
    const CliRun report = run_cli({"bisect", "--model", golden_model(model), path, "--threads", "1", "--report", md});
    EXPECT_EQ(report.code, 1) << report.error;
    const std::string markdown = read_text(md);
    for (const std::string& w : words) {
      bool in_json = false;
      for (const auto& g : s1["diagnosis"]["signatures"])
        in_json = in_json || (g["kind"] == "only-some" && g["name"] == "step1.layers.0.attn.k_rope" &&
                              g["detail"].get<std::string>().find(w) != std::string::npos);
      EXPECT_TRUE(in_json) << w << "\n" << s1["diagnosis"]["signatures"].dump(1);
      EXPECT_NE(markdown.find(w), std::string::npos) << w;
    }
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

namespace {

TensorData int_tensor(const std::string& name, std::vector<int64_t> v) {
  TensorData t;
  t.name = name;
  t.shape = {int64_t(v.size())};
  t.is_int = true;
  t.stored = DType::I64;
  t.i = std::move(v);
  return t;
}

// HF's llama-gqa batch with the bookkeeping of a paged cache of block size 2
// added (blocks handed out in engine order, never shared), then `spoil`.
std::string paged_batch(const std::string& stem, const std::function<void(MemoryDump&)>& spoil) {
  return changed_golden("llama-gqa", "batch", stem, [&](MemoryDump& d) {
    d.mutable_manifest().extra["kv_cache"] = R"({"kind": "paged", "block_size": 2, "num_blocks": 64})";
    std::map<int64_t, std::vector<int64_t>> tables;
    std::map<int64_t, int64_t> held;
    int64_t next_block = 0;
    for (int n = 0; d.has("iter" + std::to_string(n) + ".seqs"); ++n) {
      const std::string it = "iter" + std::to_string(n) + ".";
      const std::vector<int64_t> seqs = d.get(it + "seqs").i, steps = d.get(it + "seq_steps").i;
      for (size_t r = 0; r < seqs.size(); ++r) {
        const std::string p = "seq" + std::to_string(seqs[r]) + ".step" + std::to_string(steps[r]) + ".";
        const int64_t T = d.shape(p + "tokens")[0], P = held[seqs[r]], S = P + T;
        std::vector<int64_t>& table = tables[seqs[r]];
        while (int64_t(table.size()) * 2 < S) table.push_back(next_block++);
        std::vector<int64_t> slots;
        for (int64_t pos = P; pos < S; ++pos) slots.push_back(table[size_t(pos / 2)] * 2 + pos % 2);
        d.put(int_tensor(p + "kv.block_table", table));
        d.put(int_tensor(p + "kv.slot_mapping", slots));
        d.put(int_tensor(p + "kv.context_len", {S}));
        held[seqs[r]] = S;
      }
    }
    spoil(d);
  });
}

std::string notes_of(const nlohmann::json& j) {
  std::string all;
  for (const auto& n : j["notes"]) all += n.get<std::string>() + "\n";
  for (const auto& s : j["sequences"])
    for (const auto& n : s["bisect"]["notes"])
      all += "seq" + std::to_string(s["seq"].get<int>()) + ": " + n.get<std::string>() + "\n";
  return all;
}

}  // namespace

TEST(CliBatch, APagedCachesBookkeepingIsCheckedAndItsFaultsNamed) {
  int code = -1;
  const auto clean = bisect_json("llama-gqa", paged_batch("paged-clean", [](MemoryDump&) {}), &code);
  EXPECT_EQ(code, 0);
  EXPECT_EQ(notes_of(clean), "");

  const auto spoiled = bisect_json("llama-gqa", paged_batch("paged-spoiled", [](MemoryDump& d) {
    // seq1 step 2 writes its token one slot further on; seq2 step 3 reads
    // one position too many; seq2's first block at step 3 is seq0's.
    TensorData slots = d.get("seq1.step2.kv.slot_mapping");
    slots.i[0] += 1;
    d.put(slots);
    TensorData ctx = d.get("seq2.step3.kv.context_len");
    ctx.i[0] += 1;
    d.put(ctx);
    TensorData table = d.get("seq2.step3.kv.block_table");
    table.i[0] = d.get("seq0.step3.kv.block_table").i[0];
    d.put(table);
  }), &code);
  const std::string notes = notes_of(spoiled);
  EXPECT_NE(notes.find("seq1: paged KV cache (slot-mapping), step 2: kv.slot_mapping writes position"),
            std::string::npos) << notes;
  EXPECT_NE(notes.find("every slot of this call off by 1"), std::string::npos) << notes;
  EXPECT_NE(notes.find("seq2: paged KV cache (context-length), step 3: kv.context_len"), std::string::npos) << notes;
  EXPECT_NE(notes.find("one too long (attention reads a stale slot)"), std::string::npos) << notes;
  EXPECT_NE(notes.find("paged KV cache (block-shared), engine iteration 3: block"), std::string::npos) << notes;
  EXPECT_NE(notes.find("in the block tables of seq0 (step 3) and seq2 (step 3)"), std::string::npos) << notes;

  // A malformed kv_cache manifest is an input error naming the key.
  const std::string bad = paged_batch("paged-bad", [](MemoryDump& d) {
    d.mutable_manifest().extra["kv_cache"] = R"({"kind": "paged"})";
  });
  const CliRun r = run_cli({"bisect", "--model", golden_model("llama-gqa"), bad, "--threads", "1"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("kv_cache"), std::string::npos) << r.error;
  EXPECT_NE(r.error.find("block_size"), std::string::npos) << r.error;
}

TEST(CliKvRing, ARingCacheThatWrappedIsTheFindingFromTheStepItWraps) {
  // HF's llama-gqa decode: S = 5, 6, 7, 8 over its four calls. A ring of 6
  // wraps at step 2; an engine reading only its last 6 keys there differs
  // from HF (simulated: that step's attention output changed).
  auto ring_dump = [](const std::string& stem, int capacity, const std::string& spoil) {
    return changed_golden("llama-gqa", "decode", stem, [&](MemoryDump& d) {
      d.mutable_manifest().extra["kv_cache"] = R"({"kind": "ring", "capacity": )" + std::to_string(capacity) + "}";
      if (!spoil.empty()) scale(d, spoil, 1.3f);
    });
  };
  auto bisect_of = [](const std::string& path) {
    const CliRun r = run_cli({"bisect", "--model", golden_model("llama-gqa"), path, "--json", "--threads", "1"});
    EXPECT_EQ(r.code, 1) << r.error << r.out;
    return nlohmann::json::parse(r.out);
  };
  auto notes = [](const nlohmann::json& j) {
    std::string all;
    for (const auto& n : j["notes"]) all += n.get<std::string>() + "\n";
    return all;
  };
  const auto wrapped = bisect_of(ring_dump("ring-wrapped", 6, "step2.layers.0.attn.ctx"));
  EXPECT_EQ(wrapped["diagnosis"]["basis"], "kv-ring") << wrapped["diagnosis"].dump(1);
  EXPECT_TRUE(wrapped["diagnosis"]["bug"].is_null());
  const std::string ev = wrapped["diagnosis"]["evidence"];
  EXPECT_NE(ev.find("the error starts at step 2 (step2.layers.0.attn.ctx)"), std::string::npos) << ev;
  EXPECT_NE(ev.find("ring KV cache of capacity 6"), std::string::npos) << ev;
  EXPECT_NE(notes(wrapped).find("at step 2 the sequence holds 7 positions, so positions < 1 were overwritten"),
            std::string::npos)
      << notes(wrapped);
  const CliRun text = run_cli({"bisect", "--model", golden_model("llama-gqa"),
                               ring_dump("ring-text", 6, "step2.layers.0.attn.ctx"), "--threads", "1"});
  EXPECT_NE(text.out.find("a ring KV cache that wrapped, not a bug of the model's ops"), std::string::npos)
      << text.out;

  // Wrong before the wrap: a bug as usual, the wrap still noted.
  const auto early = bisect_of(ring_dump("ring-early", 6, "step1.layers.0.attn.ctx"));
  EXPECT_NE(early["diagnosis"]["basis"], "kv-ring");
  EXPECT_NE(notes(early).find("ring KV cache of capacity 6"), std::string::npos);

  // A ring as long as the sequence never wraps.
  const auto roomy = bisect_of(ring_dump("ring-roomy", 8, "step2.layers.0.attn.ctx"));
  EXPECT_NE(roomy["diagnosis"]["basis"], "kv-ring");
  EXPECT_EQ(notes(roomy).find("ring KV cache"), std::string::npos) << notes(roomy);
}

// The impl's own ring cache (dump --kv-ring C) replaying HF's decode (S = 5,
// 6, 7, 8): a ring of 6 wraps at step 2, its cache sites hold the ring's six
// slots, and bisect names the wrap at step 2, not a bug; a ring of 8 never
// wraps and passes.
TEST(CliKvRing, ImplRingCacheWrapsAndIsNamed) {
  const std::string model = golden_model("llama-gqa"), replay = golden_dump("llama-gqa", "decode");
  auto ring_run = [&](int capacity) {
    const std::string out = temp_path("impl-ring" + std::to_string(capacity) + ".safetensors");
    const CliRun d = run_cli({"dump", "--engine", "impl", "--kv-ring", std::to_string(capacity), "--model", model,
                              "--replay", replay, "--out", out});
    EXPECT_EQ(d.code, 0) << d.error;
    return out;
  };
  const std::string wrapped = ring_run(6);
  const DumpFile w(wrapped);
  EXPECT_EQ(w.manifest().extra.at("kv_cache"), R"({"kind": "ring", "capacity": 6})");
  EXPECT_EQ(w.shape("step1.layers.0.attn.k_cache"), (Shape{2, 6, 16}));
  EXPECT_EQ(w.shape("step3.layers.0.attn.k_cache"), (Shape{2, 6, 16}));
  // Slot j holds position p = j mod 6: at step 3 (S = 8) slot 0 is position 6, slot 2 position 2.
  const TensorData ring = w.get("step3.layers.0.attn.k_cache"), full = DumpFile(replay).get("step3.layers.0.attn.k_cache");
  for (int64_t d = 0; d < 16; ++d) {
    EXPECT_NEAR(ring.f[size_t(0 * 16 + d)], full.f[size_t(6 * 16 + d)], 1e-4);
    EXPECT_NEAR(ring.f[size_t(2 * 16 + d)], full.f[size_t(2 * 16 + d)], 1e-4);
  }
  CliRun r = run_cli({"bisect", "--model", model, wrapped, "--json"});
  ASSERT_EQ(r.code, 1) << r.error;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["diagnosis"]["basis"], "kv-ring") << j["diagnosis"].dump(1);
  EXPECT_EQ(j["localised_at"].get<std::string>().rfind("step2.", 0), 0u) << j["localised_at"];
  EXPECT_NE(j["diagnosis"]["evidence"].get<std::string>().find("positions < 1 overwritten"), std::string::npos);
  r = run_cli({"bisect", "--model", model, ring_run(8)});
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(run_cli({"dump", "--engine", "ref", "--kv-ring", "6", "--model", model, "--replay", replay, "--out",
                     temp_path("ref-ring.safetensors")})
                .code,
            2);
}

TEST(CliBatch, EachSequencesSamplerIsCheckedOnItsOwnLogits) {
  // Two impl runs that sample, one with the sampler bug that applies the
  // temperature twice, written as seq0 and seq1 of one dump with their own
  // sampling parameters: the forward passes match, seq1's sampler fails.
  const std::string params = "temperature=0.7,top_k=40,top_p=0.9,seed=1";
  auto sampled = [&](const std::string& stem, const std::vector<std::string>& extra) {
    const std::string out = temp_path(stem) + ".st";
    std::vector<std::string> args = {"dump", "--engine", "impl", "--model", golden_model("llama-gqa"),
                                     "--tokens", "307,215,327,320,379", "--decode", "3", "--sample", params,
                                     "--out", out};
    args.insert(args.end(), extra.begin(), extra.end());
    const CliRun r = run_cli(args);
    EXPECT_EQ(r.code, 0) << r.error;
    return out;
  };
  const DumpFile good(sampled("batch-sample-good", {}));
  const DumpFile bad(sampled("batch-sample-bad", {"--inject", "sampler-temperature-twice"}));
  MemoryDump batch("two samplers");
  batch.mutable_manifest() = good.manifest();
  batch.mutable_manifest().extra.erase(sampling_manifest_key());
  for (int b = 0; b < 2; ++b) {
    const DumpFile& src = b == 0 ? good : bad;
    set_manifest_sampling(batch.mutable_manifest(), *manifest_sampling(src.manifest(), src.label()), b);
    for (const auto& n : src.names()) {
      TensorData t = src.get(n);
      if (n != "rope.inv_freq") t.name = sequence_prefix(b) + n;
      batch.put(t);
    }
  }
  const std::string path = temp_path("batch-sample") + ".st";
  batch.save(path);

  const CliRun r = run_cli({"bisect", "--model", golden_model("llama-gqa"), path, "--json", "--threads", "1"});
  EXPECT_EQ(r.code, 1) << r.error << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j["first_divergent_sequence"].is_null()) << r.out;  // the forward passes agree
  ASSERT_TRUE(j.contains("sampling"));
  EXPECT_EQ(j["sampling"]["verdict"], "fail");
  ASSERT_EQ(j["sampling"]["sequences"].size(), 2u);
  for (const auto& s : j["sampling"]["sequences"]) {
    bool all_pass = true;
    for (const auto& st : s["steps"]) all_pass = all_pass && st["pass"].get<bool>();
    EXPECT_EQ(all_pass, s["seq"] == 0) << s.dump(1);
    EXPECT_EQ(s["params_from"], "manifest 'sampling.seq" + std::to_string(s["seq"].get<int>()) + "'");
  }
  EXPECT_EQ(j["exit_code"], 1);
}

TEST(CliBatch, EngineOrderFollowsTheIterationsOfAContinuousBatch) {
  // The same sequences rescheduled as a continuous-batching engine runs
  // them: seq0 alone first, seq1 joining at iteration 1, seq2 at 2, each
  // leaving after its 4 steps. seq0 wrong at its step 3 (iteration 3) and
  // seq2 at its step 0 (iteration 2): seq2 went wrong first.
  const std::string path = changed_golden("llama-gqa", "batch", "batch-continuous", [](MemoryDump& d) {
    for (int n = 0; n < 4; ++n)
      for (const char* f : {"seqs", "seq_steps", "num_tokens"}) d.erase("iter" + std::to_string(n) + "." + f);
    for (int n = 0; n < 6; ++n) {
      std::vector<int64_t> seqs, steps, tokens;
      for (int b = 0; b < 3; ++b) {
        const int step = n - b;
        if (step < 0 || step > 3) continue;
        seqs.push_back(b);
        steps.push_back(step);
        tokens.push_back(d.shape("seq" + std::to_string(b) + ".step" + std::to_string(step) + ".tokens")[0]);
      }
      const std::string it = "iter" + std::to_string(n) + ".";
      d.put(int_tensor(it + "seqs", seqs));
      d.put(int_tensor(it + "seq_steps", steps));
      d.put(int_tensor(it + "num_tokens", tokens));
    }
    scale(d, "seq0.step3.layers.0.mlp.down", 1.5f);
    scale(d, "seq2.step0.layers.1.attn.ctx", 1.5f);
  });
  int code = -1;
  const auto j = bisect_json("llama-gqa", path, &code);
  EXPECT_EQ(code, 1);
  EXPECT_EQ(j["first_divergent_sequence"], 2) << j.dump(1);
  EXPECT_EQ(j["sequences"][2]["step"], 0);
  EXPECT_EQ(j["sequences"][2]["iteration"], 2);
  EXPECT_EQ(j["sequences"][0]["step"], 3);
  EXPECT_EQ(j["sequences"][0]["iteration"], 3);
  EXPECT_TRUE(j["sequences"][1]["ok"].get<bool>());
  // In iteration 2 seq0 ran its step 2 and seq1 its step 1: both still right.
  EXPECT_EQ(j["iteration_unaffected"], (std::vector<int>{0, 1}));
  EXPECT_TRUE(j["iteration_affected"].empty());
}

TEST(CliBatch, IterationsThatNameMissingOrDisorderedStepsAreInputErrors) {
  struct Case {
    std::string stem, tensor, words;
    std::function<void(MemoryDump&)> spoil;
  };
  const std::vector<Case> cases = {
      {"iter-missing-step", "iter1.seq_steps", "names step 9 of seq1",
       [](MemoryDump& d) { d.put(int_tensor("iter1.seq_steps", {1, 9, 1})); }},
      {"iter-tokens", "iter0.num_tokens", "gives seq0 2 tokens at its step 0",
       [](MemoryDump& d) {
         TensorData t = d.get("iter0.num_tokens");
         t.i[0] = 2;
         d.put(t);
       }},
      {"iter-twice", "iter2.seqs", "lists seq0 twice",
       [](MemoryDump& d) { d.put(int_tensor("iter2.seqs", {0, 0, 2})); }},
      {"iter-order", "iter3.seq_steps", "runs step 1 of seq2 after its step 2",
       [](MemoryDump& d) { d.put(int_tensor("iter3.seq_steps", {3, 3, 1})); }},
      {"iter-length", "iter1.seq_steps", "has 2 entries",
       [](MemoryDump& d) { d.put(int_tensor("iter1.seq_steps", {1, 1})); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.stem);
    const std::string path = changed_golden("llama-gqa", "batch", c.stem, c.spoil);
    const CliRun r = run_cli({"bisect", "--model", golden_model("llama-gqa"), path, "--threads", "1"});
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.error.find(c.tensor), std::string::npos) << r.error;
    EXPECT_NE(r.error.find(c.words), std::string::npos) << r.error;
  }
}
