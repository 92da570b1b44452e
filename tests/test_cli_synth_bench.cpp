// llmdiff bench on a synthetic checkpoint: per-engine children report their
// own peak memory and failures, and the command's JSON holds both engines'
// figures, agreeing greedy tokens and a complete end-to-end diff. Nothing here
// asserts a speed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "bench/support.h"
#include "bisect/engines.h"
#include "synth/synth.h"
#include "dumps/base/errors.h"
#include "dumps/model/weights.h"
#include "dumps/zoo/bugs.h"
#include "tests/cli_runner.h"
#include "tests/support.h"

using namespace llmdiff;
using namespace llmdiff::cli;
using namespace llmdiff::bench;
using namespace llmdiff::synth;

TEST(CliSynthBench, ChildReturnsItsOutputAndItsOwnPeakRss) {
  const int64_t parent_before = proc_status_bytes("VmHWM");
  ASSERT_GT(parent_before, 0);
  const size_t bytes = size_t(256) << 20;
  const ChildOutcome out = run_in_child([bytes] {
    std::vector<char> big(bytes);
    for (size_t i = 0; i < big.size(); i += 4096) big[i] = char(i);  // touch every page
    return std::string("touched ") + std::to_string(int(big[4096 * 3]));
  });
  ASSERT_TRUE(out.ok) << out.failure;
  EXPECT_EQ(out.output, "touched " + std::to_string(int(char(4096 * 3))));
  EXPECT_GE(out.maxrss_bytes, int64_t(bytes));
  // The child's pages never counted in this process.
  EXPECT_LT(proc_status_bytes("VmHWM") - parent_before, int64_t(bytes / 2));
}

TEST(CliSynthBench, ChildFailuresAreReported) {
  const ChildOutcome thrown = run_in_child([]() -> std::string { throw UsageError("no such engine"); });
  EXPECT_FALSE(thrown.ok);
  EXPECT_EQ(thrown.failure, "no such engine");
  const ChildOutcome killed = run_in_child([]() -> std::string {
    std::raise(SIGKILL);
    return "unreachable";
  });
  EXPECT_FALSE(killed.ok);
  EXPECT_NE(killed.failure.find("signal 9"), std::string::npos) << killed.failure;
}

TEST(CliSynthBench, Statistics) {
  const Stat odd = stat_of({5.0, 1.0, 3.0});
  EXPECT_EQ(odd.min, 1.0);
  EXPECT_EQ(odd.median, 3.0);
  EXPECT_EQ(odd.max, 5.0);
  const Stat even = stat_of({4.0, 1.0, 2.0, 10.0});
  EXPECT_EQ(even.median, 3.0);
  const BandwidthResult bw = measure_read_bandwidth(2, size_t(16) << 20, 2);
  EXPECT_EQ(bw.all_gbs.size(), 2u);
  EXPECT_EQ(bw.buffer_bytes, size_t(16) << 20);
  EXPECT_TRUE(std::isfinite(bw.best_gbs) && bw.best_gbs > 0);
}

// A tiny-llama checkpoint in a temporary directory, removed with the object.
struct TinyLlama {
  TinyLlama(const std::string& stem, DType dtype, uint64_t seed) : dir(llmdiff::testing::temp_path(stem)) {
    SynthOptions so;
    so.config_json = synth_preset_config("tiny-llama");
    so.dtype = dtype;
    so.seed = seed;
    synth = write_synth_checkpoint(dir, so);
  }
  ~TinyLlama() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  std::string dir;
  SynthResult synth;
};

TEST(CliSynthBench, CommandReportsBothEnginesAndTheEndToEndDiff) {
  const TinyLlama model("bench_tiny_llama", DType::F32, 2);
  const std::string& dir = model.dir;
  const SynthResult& synth = model.synth;

  const llmdiff::testing::CliRun run =
      llmdiff::testing::run_cli({"bench", "--model", dir, "--prompt", "12", "--decode", "3", "--repeats", "2",
                                 "--bandwidth-mib", "16", "--e2e", "--e2e-decode", "2", "--json"});
  ASSERT_EQ(run.code, 0) << run.out << run.error;
  const auto j = nlohmann::json::parse(run.out);

  EXPECT_EQ(j["weight_bytes"].get<uint64_t>(), synth.data_bytes);
  EXPECT_EQ(j["parameters"].get<uint64_t>(), synth.parameters);
  ASSERT_EQ(j["engines"].size(), 2u);
  for (const auto& e : j["engines"]) {
    ASSERT_FALSE(e.contains("error")) << e.dump();
    EXPECT_EQ(e["prefill_tok_s"].size(), 2u);
    EXPECT_EQ(e["decode_ms_per_token"].size(), 2u);
    EXPECT_EQ(e["generated"].size(), 4u);  // the prefill's token + 3 decoded
    // Every weight page is read, and the engine's own RSS holds them.
    EXPECT_GE(e["peak_rss_bytes"].get<int64_t>(), int64_t(synth.data_bytes)) << e["engine"];
    EXPECT_GT(e["decode_bound_ms"].get<double>(), 0.0);
    EXPECT_GT(e["bandwidth_gbs"].get<double>(), 0.0);
    EXPECT_LE(e["bandwidth_gbs"].get<double>(), j["bandwidth"]["best_gbs"].get<double>());
    EXPECT_NEAR(e["decode_bound_ms"].get<double>(),
                e["decode_bytes_per_token"].get<double>() / e["bandwidth_gbs"].get<double>() * 1e-6,
                1e-9 * e["decode_bound_ms"].get<double>());
    EXPECT_GE(e["prefill"]["best_tok_s"].get<double>(), e["prefill"]["median_tok_s"].get<double>());
    EXPECT_GE(e["prefill"]["median_tok_s"].get<double>(), e["prefill"]["worst_tok_s"].get<double>());
    EXPECT_LE(e["decode"]["best_ms"].get<double>(), e["decode"]["median_ms"].get<double>());
    EXPECT_LE(e["decode"]["median_ms"].get<double>(), e["decode"]["worst_ms"].get<double>());
    // best and worst are the extremes of the repeats reported beside them.
    const auto dm = e["decode_ms_per_token"].get<std::vector<double>>();
    EXPECT_EQ(e["decode"]["best_ms"].get<double>(), *std::min_element(dm.begin(), dm.end()));
    EXPECT_EQ(e["decode"]["worst_ms"].get<double>(), *std::max_element(dm.begin(), dm.end()));
  }
  // Each engine ran in a process of its own.
  EXPECT_NE(j["engines"][0]["pid"], j["engines"][1]["pid"]);
  for (const auto& e : j["engines"]) EXPECT_NE(e["pid"].get<int64_t>(), int64_t(::getpid()));
  // Both compute float32 on a float32 checkpoint: the same greedy tokens.
  EXPECT_EQ(j["engines"][0]["generated"], j["engines"][1]["generated"]);

  const auto& e2e = j["e2e"];
  ASSERT_FALSE(e2e.contains("error")) << e2e.dump();
  EXPECT_EQ(e2e["steps"].get<int>(), 3);
  EXPECT_EQ(e2e["ref"]["tensors"], e2e["impl"]["tensors"]);
  EXPECT_EQ(e2e["compared"], e2e["ref"]["tensors"]);
  EXPECT_EQ(e2e["only_in_ref"].get<int>(), 0);
  EXPECT_EQ(e2e["only_in_impl"].get<int>(), 0);
  EXPECT_GT(e2e["ref"]["dump_bytes"].get<uint64_t>(), 0u);
  EXPECT_FALSE(e2e.contains("note")) << e2e["note"];
  // `llmdiff run` with its defaults on the same forward calls: the clean impl
  // passes, every site compared and recomputed, each phase timed.
  const auto& full = e2e["run"];
  ASSERT_FALSE(full.contains("error")) << full.dump();
  EXPECT_EQ(full["exit_code"].get<int>(), 0) << full.dump();
  EXPECT_EQ(full["diverging"].get<int>(), 0);
  EXPECT_EQ(full["local_failing"].get<int>(), 0);
  EXPECT_EQ(full["compared"], e2e["impl"]["tensors"]);
  std::vector<std::string> phases;
  double sum = 0;
  for (const auto& p : full["phases"]) {
    phases.push_back(p["phase"]);
    sum += p["seconds"].get<double>();
  }
  // Each pass named by a phase of its own, or by passes run side by side
  // ("A beside the B", lanes "A, then B, beside the C, then D").
  auto names_pass = [](std::string p, const std::string& want) {
    for (const std::string sep : {", beside the ", " beside the ", ", then the "})
      for (size_t at; (at = p.find(sep)) != std::string::npos;) p.replace(at, sep.size(), "|");
    return ("|" + p + "|").find("|" + want + "|") != std::string::npos;
  };
  for (const std::string want : {"candidate run (impl)", "reference run in float32", "reference run in float64",
                                 "comparison", "local recompute of the candidate", "diagnosis: error signatures"})
    EXPECT_TRUE(std::any_of(phases.begin(), phases.end(), [&](const std::string& p) { return names_pass(p, want); }))
        << want;
  EXPECT_LE(sum, full["seconds"].get<double>() + 1e-6);
  EXPECT_GT(full["peak_rss_bytes"].get<int64_t>(), 0);
}

// bench --bisect: the bisection of an impl candidate with a zoo bug, timed
// phase by phase against the plain impl forward, localised and named.
TEST(CliSynthBench, BisectOfAnInjectedBugIsTimedLocalisedAndNamed) {
  const TinyLlama model("bench_bisect_tiny_llama", DType::BF16, 4);
  const std::string& dir = model.dir;
  const llmdiff::testing::CliRun run =
      llmdiff::testing::run_cli({"bench", "--model", dir, "--prompt", "10", "--engines", "none", "--bandwidth-mib",
                                 "16", "--e2e-decode", "2", "--bisect", "rope-interleaved", "--json"});
  ASSERT_EQ(run.code, 0) << run.out << run.error;
  const auto j = nlohmann::json::parse(run.out);
  EXPECT_TRUE(j["engines"].empty());
  const auto& b = j["bisect"];
  ASSERT_FALSE(b.contains("error")) << b.dump();
  EXPECT_EQ(b["injected"], "rope-interleaved");
  EXPECT_EQ(b["exit_code"].get<int>(), 1);
  EXPECT_EQ(b["localised_at"], "step0.layers.0.attn.q_rope");
  EXPECT_EQ(b["diagnosis"], "rope-interleaved");
  EXPECT_GT(b["plain_forward_seconds"].get<double>(), 0.0);
  EXPECT_GT(b["peak_rss_bytes"].get<int64_t>(), 0);
  double sum = 0;
  bool diagnosed = false;
  for (const auto& p : b["phases"]) {
    sum += p["seconds"].get<double>();
    const std::string phase = p["phase"];
    // The diagnosis phase by phase: the replays, the local recompute with the hypothesis, the signatures.
    diagnosed = diagnosed || phase == "diagnosis: local recompute with rope-interleaved";
  }
  EXPECT_TRUE(diagnosed) << b["phases"].dump();
  EXPECT_LE(sum, b["seconds"].get<double>() + 1e-6);
  // The four passes are one phase (two lanes) or one each; within the bisect.
  EXPECT_GT(b["passes_seconds"].get<double>(), 0.0);
  EXPECT_LE(b["passes_seconds"].get<double>(), b["bisect_seconds"].get<double>() + 1e-6);
  // The products' throughput at the passes' shape, and the passes' compute floor from it.
  const auto& c = j["bisect_compute"];
  ASSERT_FALSE(c.contains("error")) << c.dump();
  EXPECT_EQ(c["shape"], nlohmann::json::array({12, 512, 1536}));  // prompt + decode rows, hidden, intermediate
  for (const char* dt : {"float32_gflops", "float64_gflops"})
    for (const char* how : {"one_thread", "one_product", "side_by_side"}) EXPECT_GT(c[dt][how].get<double>(), 0.0);
  EXPECT_GT(c["pass_flops"].get<double>(), 2.0 * 12 * 4 * 3 * 512 * 1536);  // at least the MLPs of 12 rows
  EXPECT_GT(c["floor_seconds"].get<double>(), 0.0);
  // An unknown bug is a usage error before any work.
  EXPECT_EQ(llmdiff::testing::run_cli({"bench", "--model", dir, "--bisect", "no-such-bug"}).code, 2);
}


// bench --batch: the continuous-batching engine serving 1 and N sequences,
// throughput of all of them together, and its batch invariance: with a
// prompt of more than 8 tokens (the GEMM alone and packed) and 4 decodes per
// iteration (GEMVs), a sequence served among others gets exactly its numbers
// alone.
TEST(CliSynthBench, BatchServesOneAndNSequencesAndIsBatchInvariant) {
  const TinyLlama model("bench_batch_tiny_llama", DType::BF16, 2);
  const llmdiff::testing::CliRun run =
      llmdiff::testing::run_cli({"bench", "--model", model.dir, "--prompt", "9", "--decode", "3", "--repeats", "1",
                                 "--engines", "none", "--bandwidth-mib", "16", "--batch", "4", "--json"});
  ASSERT_EQ(run.code, 0) << run.out << run.error;
  const auto j = nlohmann::json::parse(run.out);
  ASSERT_EQ(j["batch"].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const auto& r = j["batch"][i];
    ASSERT_FALSE(r.contains("error")) << r.dump();
    EXPECT_EQ(r["sequences"], i == 0 ? 1 : 4);
    EXPECT_GT(r["prefill_tok_s"].get<double>(), 0.0);
    EXPECT_GT(r["decode_tok_s"].get<double>(), 0.0);
    EXPECT_GT(r["decode_ms_per_iteration"].get<double>(), 0.0);
    EXPECT_GT(r["peak_rss_bytes"].get<int64_t>(), 0);
  }
  EXPECT_TRUE(j["batch"][0]["invariance"].is_null());
  EXPECT_EQ(j["batch"][1]["invariance"]["prefill_max_rel"].get<double>(), 0.0);
  EXPECT_EQ(j["batch"][1]["invariance"]["decode_max_rel"].get<double>(), 0.0);
  const llmdiff::testing::CliRun text =
      llmdiff::testing::run_cli({"bench", "--model", model.dir, "--prompt", "9", "--decode", "3", "--repeats", "1",
                                 "--engines", "none", "--bandwidth-mib", "16", "--batch", "4"});
  ASSERT_EQ(text.code, 0) << text.error;
  EXPECT_NE(text.out.find("impl continuous batching"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("batch invariance: seq0 served with 3 others vs alone"), std::string::npos) << text.out;
}

// --bisect all: one bisection per zoo bug that changes a single sequence's
// forward pass on this model, each localised and named, and the screen by
// the local recompute named in the phases of a bug first visible in step 1.
TEST(CliSynthBench, BisectAllTimesEveryBugOfTheModelAndNamesEach) {
  const std::string dir = llmdiff::testing::golden_model("llama-gqa");
  const llmdiff::testing::CliRun run =
      llmdiff::testing::run_cli({"bench", "--model", dir, "--prompt", "8", "--engines", "none", "--bandwidth-mib",
                                 "16", "--e2e-decode", "2", "--bisect", "all", "--json"});
  ASSERT_EQ(run.code, 0) << run.out << run.error;
  const auto j = nlohmann::json::parse(run.out);
  const ModelConfig cfg = Model::load(dir).config;
  std::vector<std::string> expected;
  for (const zoo::BugInfo& info : zoo::all_bugs())
    if (info.acts_on_model() && !info.needs_padding && info.feature == zoo::Feature::None &&
        zoo::bug_inapplicable_reason(info.bug, cfg).empty())
      expected.push_back(info.name);
  ASSERT_GE(expected.size(), 10u);
  ASSERT_TRUE(j["bisect"].is_array());
  ASSERT_EQ(j["bisect"].size(), expected.size());
  bool screened = false;
  for (size_t k = 0; k < expected.size(); ++k) {
    const auto& b = j["bisect"][k];
    ASSERT_FALSE(b.contains("error")) << b.dump();
    EXPECT_EQ(b["injected"], expected[k]);
    EXPECT_EQ(b["exit_code"].get<int>(), 1) << expected[k];
    const std::string named = b["diagnosis"];
    EXPECT_TRUE(named == expected[k] || named.rfind(expected[k] + "=", 0) == 0) << expected[k] << ": " << named;
    for (const auto& p : b["phases"])
      if (expected[k] == "mask-square")
        screened = screened || p["phase"].get<std::string>().find("screened out by the local recompute") !=
                                   std::string::npos;
  }
  EXPECT_TRUE(screened);
  const llmdiff::testing::CliRun text =
      llmdiff::testing::run_cli({"bench", "--model", dir, "--prompt", "8", "--engines", "none", "--bandwidth-mib",
                                 "16", "--e2e-decode", "2", "--bisect", "all"});
  ASSERT_EQ(text.code, 0) << text.error;
  EXPECT_NE(text.out.find(std::to_string(expected.size()) + " of " + std::to_string(expected.size()) + " named"),
            std::string::npos)
      << text.out;
}

// `dump` keeps a checkpoint resident when it fits the memory budget and
// streams it layer by layer beyond; the numbers written are the same.
TEST(CliSynthBench, DumpHoldsTheCheckpointByTheMemoryBudgetWithTheSameValues) {
  const std::string dir = llmdiff::testing::golden_model("qwen3-moe");
  const Model model = Model::load(dir);
  const int64_t bytes = int64_t(model.weights->total_bytes());
  ASSERT_GT(bytes, 0);
  EXPECT_FALSE(bisect::weight_policy(model, bytes).stream);
  EXPECT_TRUE(bisect::weight_policy(model, bytes - 1).stream);
  EXPECT_EQ(bisect::weight_policy(model, bytes - 1).str().rfind("streamed layer by layer (", 0), 0u);
  EXPECT_GT(bisect::weight_policy(model, 0).budget_bytes, 0);  // half the memory available

  std::string files[2];
  const char* budgets[2] = {"64GB", "1KB"};
  for (int k = 0; k < 2; ++k) {
    files[k] = llmdiff::testing::temp_path(std::string("budget_") + std::to_string(k) + ".safetensors");
    for (const char* batch : {"", "batch"}) {
      std::vector<std::string> args = {"dump", "--engine", "impl", "--model", dir, "--decode", "3",
                                        "--memory-budget", budgets[k], "--out", files[k] + batch};
      if (*batch) {
        args.insert(args.end(), {"--batch", "1,2,3,4,5;6,7,8"});
      } else {
        args.insert(args.end(), {"--tokens", "1,2,3,4,5,6,7,8"});
      }
      const auto run = llmdiff::testing::run_cli(args);
      ASSERT_EQ(run.code, 0) << run.error;
    }
  }
  EXPECT_EQ(llmdiff::testing::read_text(files[0]), llmdiff::testing::read_text(files[1]));
  EXPECT_EQ(llmdiff::testing::read_text(files[0] + "batch"), llmdiff::testing::read_text(files[1] + "batch"));
  const auto bad = llmdiff::testing::run_cli({"dump", "--engine", "impl", "--model", dir, "--tokens", "1,2",
                                              "--memory-budget", "lots", "--out", files[0]});
  EXPECT_EQ(bad.code, 2);
  // `run` and `bisect` hold the impl's runs (the candidate's, the clean run,
  // the replays) by the same budget: the same verdict either way.
  std::string out[2];
  for (int k = 0; k < 2; ++k) {
    const auto run = llmdiff::testing::run_cli({"run", "--model", dir, "--tokens", "1,2,3,4,5", "--decode", "2",
                                                "--inject", "mask-square", "--memory-budget", budgets[k], "--json"});
    ASSERT_EQ(run.code, 1) << run.out << run.error;
    const auto j = nlohmann::json::parse(run.out);
    out[k] = j["localised_at"].dump() + " " + j["diagnosis"]["bug"].dump();
    EXPECT_EQ(j["diagnosis"]["bug"], "mask-square") << run.out;
  }
  EXPECT_EQ(out[0], out[1]);
  const auto bisect = llmdiff::testing::run_cli({"bisect", "--model", dir, files[0], "--memory-budget", "1KB"});
  EXPECT_EQ(bisect.code, 0) << bisect.out << bisect.error;
  const auto bad_bisect = llmdiff::testing::run_cli({"bisect", "--model", dir, files[0], "--memory-budget", "lots"});
  EXPECT_EQ(bad_bisect.code, 2);
  EXPECT_NE(bad_bisect.error.find("--memory-budget"), std::string::npos) << bad_bisect.error;
}
