// Sampling end to end: `dump --sample` draws with HF's processors in both
// engines, `bisect` checks a sampling candidate's sampler on its own logits
// (passing HF's own generate output and the engines' draws) and names a
// sampler bug of the zoo without calling the model wrong.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "dumps/contract/dump.h"
#include "dumps/sampling/sampling.h"
#include "tests/cli_runner.h"
#include "tests/support.h"

using namespace llmdiff;
using llmdiff::testing::golden_dump;
using llmdiff::testing::golden_model;
using llmdiff::testing::run_cli;
using llmdiff::testing::temp_path;

namespace {
const char* kParams = "temperature=0.7,top_k=40,top_p=0.9,repetition_penalty=1.3,seed=1";
const char* kPrompt = "307,215,327,320,379";
}  // namespace

TEST(CliSampling, HfGenerateOutputBisectsClean) {
  for (const char* model : {"llama-gqa", "qwen2-bias"}) {
    SCOPED_TRACE(model);
    const auto r = run_cli({"bisect", "--model", golden_model(model), golden_dump(model, "sample")});
    EXPECT_EQ(r.code, 0) << r.out << r.error;
    EXPECT_NE(r.out.find("PASS: 4 sampling step(s) agree with HF's processors"), std::string::npos) << r.out;
  }
}

TEST(CliSampling, EnginesSampleAndASamplerBugIsNamed) {
  for (const char* engine : {"ref", "impl"}) {
    SCOPED_TRACE(engine);
    const std::string out = temp_path(std::string("sample-") + engine) + ".st";
    const auto d = run_cli({"dump", "--engine", engine, "--model", golden_model("llama-gqa"), "--tokens", kPrompt,
                            "--decode", "3", "--sample", kParams, "--out", out});
    ASSERT_EQ(d.code, 0) << d.error;
    const DumpFile f(out);
    EXPECT_EQ(f.manifest().scenario, "sample");
    EXPECT_EQ(*manifest_sampling(f.manifest(), out), SamplingParams::parse(kParams));
    for (int s = 0; s < 4; ++s) {
      EXPECT_TRUE(f.has("step" + std::to_string(s) + ".sample.u"));
      EXPECT_TRUE(f.has("step" + std::to_string(s) + ".sample.scores"));
    }
    const auto b = run_cli({"bisect", "--model", golden_model("llama-gqa"), out});
    EXPECT_EQ(b.code, 0) << b.out << b.error;
    EXPECT_NE(b.out.find("inverse CDF at u"), std::string::npos) << b.out;
  }
  const std::string buggy = temp_path("sample-bug") + ".st";
  ASSERT_EQ(run_cli({"dump", "--engine", "impl", "--model", golden_model("llama-gqa"), "--tokens", kPrompt,
                     "--decode", "3", "--sample", kParams, "--inject", "sampler-temperature-twice", "--out", buggy})
                .code,
            0);
  const auto b = run_cli({"bisect", "--model", golden_model("llama-gqa"), buggy});
  EXPECT_EQ(b.code, 1) << b.error;
  // The model is right: no divergence of the forward pass, the sampler named.
  EXPECT_NE(b.out.find("RESULT: no divergence"), std::string::npos) << b.out;
  EXPECT_NE(b.out.find("explained by sampler-temperature-twice"), std::string::npos) << b.out;
  // The same in JSON: the sampler's check is a field and sets the exit code.
  const auto j = run_cli({"bisect", "--model", golden_model("llama-gqa"), buggy, "--json"});
  EXPECT_EQ(j.code, 1) << j.error;
  const nlohmann::json doc = nlohmann::json::parse(j.out);
  EXPECT_EQ(doc["exit_code"], 1);
  EXPECT_EQ(doc["ok"], true) << "the forward pass is right";
  EXPECT_EQ(doc["sampling"]["verdict"], "fail");
  EXPECT_GT(doc["sampling"]["failing_steps"].get<int>(), 0);
  EXPECT_EQ(doc["sampling"]["explained_by"][0]["bug"], "sampler-temperature-twice");
  const auto clean = run_cli({"bisect", "--model", golden_model("llama-gqa"), golden_dump("llama-gqa", "sample"), "--json"});
  EXPECT_EQ(clean.code, 0) << clean.error;
  EXPECT_EQ(nlohmann::json::parse(clean.out)["sampling"]["verdict"], "pass");

  // A sampler bug needs a sampling run; the ref takes no bugs.
  EXPECT_EQ(run_cli({"dump", "--engine", "impl", "--model", golden_model("llama-gqa"), "--tokens", kPrompt,
                     "--inject", "sampler-temperature-twice", "--out", temp_path("never") + ".st"})
                .code,
            2);
  EXPECT_EQ(run_cli({"dump", "--engine", "impl", "--model", golden_model("llama-gqa"), "--tokens", kPrompt,
                     "--sample", "temperature=-1", "--out", temp_path("never") + ".st"})
                .code,
            2);
}

// An engine whose sampler multiplies by the temperature (a pipeline outside
// the zoo): its own draws at its own sample.u, every other name the impl
// engine's. bisect finds the model right, no zoo bug, and names the
// departure found by the search, in text and JSON.
TEST(CliSampling, ASamplerPipelineOutsideTheZooIsNamed) {
  const std::string clean = temp_path("sample-clean") + ".st";
  ASSERT_EQ(run_cli({"dump", "--engine", "impl", "--model", golden_model("llama-gqa"), "--tokens", kPrompt,
                     "--decode", "3", "--sample", kParams, "--out", clean})
                .code,
            0);
  SamplerPipeline multiplied;
  multiplied.temperature = SamplerPipeline::Temperature::Multiplied;
  bool departs = false;
  const std::string cand = llmdiff::testing::resampled_dump(clean, multiplied, "sample-multiplied", &departs);
  ASSERT_TRUE(departs);
  const auto b = run_cli({"bisect", "--model", golden_model("llama-gqa"), cand});
  EXPECT_EQ(b.code, 1) << b.out << b.error;
  EXPECT_NE(b.out.find("RESULT: no divergence"), std::string::npos) << b.out;
  EXPECT_NE(b.out.find("no sampler bug of the zoo reproduces the candidate"), std::string::npos) << b.out;
  EXPECT_NE(b.out.find("the sampler's pipeline: scores multiplied by the temperature instead of divided (reproduces all "),
            std::string::npos)
      << b.out;
  const auto j = run_cli({"bisect", "--model", golden_model("llama-gqa"), cand, "--json"});
  EXPECT_EQ(j.code, 1) << j.error;
  const nlohmann::json doc = nlohmann::json::parse(j.out);
  EXPECT_EQ(doc["ok"], true) << "the forward pass is right";
  EXPECT_TRUE(doc["sampling"]["explained_by"].empty());
  ASSERT_EQ(doc["sampling"]["pipelines"].size(), 1u) << doc["sampling"].dump(1);
  EXPECT_EQ(doc["sampling"]["pipelines"][0]["departures"],
            nlohmann::json::array({"scores multiplied by the temperature instead of divided"}));
  EXPECT_EQ(doc["sampling"]["pipelines"][0]["pipeline"],
            "repetition penalty > temperature (multiplied) > top-k > top-p; token from the softmax of the scores");
  EXPECT_GT(doc["sampling"]["search"]["tried"].get<int>(), 0);
  // The headline says it, as every format does.
  EXPECT_NE(doc["headline"].get<std::string>().find("; the sampler fails its check (the sampler's pipeline: scores "
                                                    "multiplied by the temperature instead of divided"),
            std::string::npos)
      << doc["headline"];
  EXPECT_EQ(doc["sampling"]["finding"].get<std::string>().rfind("the sampler's pipeline: ", 0), 0u);
}
