// llmdiff diff end to end: golden HF dumps against themselves and against
// impl dumps (correct and with a zoo bug), JSON and Markdown outputs, exit
// codes 0 / 1 / 2.
#include <gtest/gtest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sys/stat.h>

#include "tests/test_cli_diff_helpers.h"

using namespace llmdiff;
using namespace llmdiff::testing;

namespace {

// The impl's replay of llama-gqa/prefill, written once.
const std::string& impl_prefill() {
  static const std::string path = [] {
    std::string p = temp_path("diff-impl-prefill.safetensors");
    write_engine_dump("impl", golden_model("llama-gqa"), golden_dump("llama-gqa", "prefill"), p);
    return p;
  }();
  return path;
}

}  // namespace

TEST(CliDiff, IdenticalGoldenDumpsExitZero) {
  std::string g = golden_dump("qwen3-qknorm", "decode");
  CliRun r = run_cli({"diff", g, g});
  EXPECT_EQ(r.code, 0) << r.error << r.out;
  EXPECT_NE(r.out.find("result: within tolerance"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("first divergence: none"), std::string::npos);
  EXPECT_NE(r.out.find("all steps agree"), std::string::npos);
}

TEST(CliDiff, ImplDumpAgainstGoldenHF) {
  std::string g = golden_dump("llama-gqa", "prefill");
  CliRun r = run_cli({"diff", g, impl_prefill(), "--json"});
  ASSERT_TRUE(r.code == 0 || r.code == 1) << r.error;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["schema"], "llmdiff.diff/1");
  EXPECT_EQ(j["ok"], r.code == 0);
  EXPECT_EQ(j["summary"]["compared"], DumpFile(g).names().size());
  EXPECT_TRUE(j["only_in_reference"].empty());
  EXPECT_EQ(j["candidate"]["manifest"]["model"], "llama-gqa");
  // The impl agrees with HF to float32 rounding: well inside 1e-4.
  CliRun loose = run_cli({"diff", g, impl_prefill(), "--rtol", "1e-4", "--atol", "1e-4"});
  EXPECT_EQ(loose.code, 0) << loose.out;
  // Greedy token agrees.
  EXPECT_EQ(j["greedy"]["steps"][0]["ref_token"], j["greedy"]["steps"][0]["cand_token"]);
}

// A correct engine's float32 rounding is not a divergence by default: every
// float32 golden model's impl replay passes (elementwise allclose at
// torch's tolerances failed several of them, NMSE ~1e-12); explicit
// tolerances still mean allclose.
TEST(CliDiff, Float32RoundingOfACorrectEnginePassesByDefault) {
  for (const std::string& model : golden_models()) {
    if (load_config(golden_model(model)).torch_dtype != "float32") continue;
    SCOPED_TRACE(model);
    const std::string g = golden_dump(model, "decode");
    const std::string impl = temp_path("diff-impl-" + model + ".safetensors");
    write_engine_dump("impl", golden_model(model), g, impl);
    CliRun r = run_cli({"diff", g, impl});
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("criterion scaled-max"), std::string::npos) << r.out;
    CliRun strict = run_cli({"diff", g, impl, "--rtol", "0", "--atol", "0", "--json"});
    EXPECT_EQ(nlohmann::json::parse(strict.out)["criterion"], "allclose");
  }
}

TEST(CliDiff, ZooBugIsLocalisedAndReported) {
  std::string g = golden_dump("llama-gqa", "chunked");
  std::string bug = temp_path("diff-kv-overwrite.safetensors");
  write_engine_dump("impl", golden_model("llama-gqa"), g, bug, {"kv-overwrite"});
  std::string report = temp_path("diff-report.md");
  CliRun r = run_cli({"diff", g, bug, "--json", "--report", report});
  EXPECT_EQ(r.code, 1) << r.error;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["ok"], false);
  // Step 0 is a plain prefill (nothing to overwrite); the first call that has a past diverges.
  std::string first = j["first_divergence"];
  EXPECT_EQ(first.rfind("step1.", 0), 0u) << first;
  bool cache_finding = false;
  for (const auto& t : j["tensors"])
    for (const auto& f : t["findings"]) cache_finding |= f["kind"] == "cache-length";
  EXPECT_TRUE(cache_finding);
  std::string md = read_text(report);
  EXPECT_NE(md.find("# llmdiff diff report"), std::string::npos);
  EXPECT_NE(md.find("`" + first + "`"), std::string::npos);

  // The table: failing names shown, the rest counted, the trace of the diverging step.
  CliRun t = run_cli({"diff", g, bug});
  EXPECT_EQ(t.code, 1);
  EXPECT_NE(t.out.find("first divergence: " + first), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("passing tensors not shown"), std::string::npos);
  EXPECT_NE(t.out.find("cache holds S'="), std::string::npos);
  EXPECT_NE(t.out.find("result: DIVERGES"), std::string::npos);
}

TEST(CliDiff, SitesFilterAndPerNameTolerance) {
  std::string g = golden_dump("llama-gqa", "prefill");
  CliRun r = run_cli({"diff", g, impl_prefill(), "--sites", "*.logits,*.next_logits", "--json"});
  ASSERT_TRUE(r.code == 0 || r.code == 1) << r.error;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["summary"]["compared"], 2);
  EXPECT_NE(j["tensors"][0]["logits"], nullptr);
  // A zero tolerance on the logits makes them fail unless bit-identical.
  CliRun z = run_cli({"diff", g, impl_prefill(), "--sites", "logits", "--tol", "logits=atol:0,rtol:0", "--json"});
  nlohmann::json jz = nlohmann::json::parse(z.out);
  bool identical = jz["tensors"][0]["metrics"]["max_abs"] == 0;
  EXPECT_EQ(z.code, identical ? 0 : 1);
  EXPECT_EQ(jz["tensors"][0]["tolerance"]["source"], "--tol logits=atol:0,rtol:0");
}

TEST(CliDiff, BadInputIsExitTwo) {
  std::string g = golden_dump("llama-gqa", "prefill");
  EXPECT_EQ(run_cli({"diff", g, temp_path("does-not-exist.safetensors")}).code, 2);
  CliRun bad_tol = run_cli({"diff", g, g, "--tol", "layers.*=atol"});
  EXPECT_EQ(bad_tol.code, 2);
  EXPECT_NE(bad_tol.error.find("--tol"), std::string::npos);
  EXPECT_EQ(run_cli({"diff", g, g, "--dtype", "int7"}).code, 2);
  EXPECT_EQ(run_cli({"diff", g}).code, 2);
  EXPECT_EQ(run_cli({"diff", g, g, "--rtol", "-1"}).code, 2);
}

TEST(CliDiff, BinaryExitCodes) {
  std::string bin = std::string(LLMDIFF_BINARY_DIR) + "/llmdiff";
  struct stat st {};
  if (::stat(bin.c_str(), &st) != 0) GTEST_SKIP() << "llmdiff binary not built: " << bin;
  std::string g = golden_dump("llama-gqa", "prefill");
  auto code = [&](const std::string& args) {
    std::string out;
    return run_binary(args, &out);
  };
  EXPECT_EQ(code("diff " + g + " " + g), 0);
  EXPECT_EQ(code("diff " + g + " " + golden_dump("llama-gqa", "chunked")), 1);
  EXPECT_EQ(code("diff " + g + " /nonexistent.safetensors"), 2);
  EXPECT_EQ(code("diff " + g + " " + g + " --tol bad"), 2);
}
