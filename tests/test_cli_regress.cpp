// llmdiff regress end to end: the golden tree passes under the regression
// policy for both engines; a tree with one perturbed HF tensor fails (exit
// 1) with the name in the report; JUnit XML and JSON outputs are sound.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>

#include "dumps/contract/sequences.h"
#include "tests/test_cli_diff_helpers.h"

using namespace llmdiff;
using namespace llmdiff::testing;
namespace fs = std::filesystem;

namespace {

std::string attr(const std::string& xml, const std::string& tag, const std::string& name) {
  std::smatch m;
  std::regex re("<" + tag + "[^>]* " + name + "=\"([^\"]*)\"");
  return std::regex_search(xml, m, re) ? m[1].str() : "";
}

size_t count(const std::string& hay, const std::string& needle) {
  size_t n = 0;
  for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
  return n;
}

// Open and close tags balance (the XML itself is checked in detail by the
// compare tests; here: the file is complete and consistent).
bool tags_balance(const std::string& xml, const std::string& tag) {
  return count(xml, "<" + tag + " ") + count(xml, "<" + tag + ">") == count(xml, "</" + tag + ">");
}

// A golden tree holding llama-gqa with a copy of its prefill dump in which
// one tensor is perturbed.
std::string perturbed_tree(const std::string& name, const std::string& tensor, float delta) {
  fs::path root = temp_path(name);
  fs::path model = root / "llama-gqa";
  fs::create_directories(model);
  fs::path src = golden_model("llama-gqa");
  for (const char* f : {"config.json", "model.safetensors"})
    fs::copy_file(src / f, model / f, fs::copy_options::overwrite_existing);
  DumpFile hf(golden_dump("llama-gqa", "prefill"));
  MemoryDump copy("perturbed");
  copy.mutable_manifest() = hf.manifest();
  for (const auto& n : hf.names()) {
    TensorData t = hf.get(n);
    if (n == tensor) t.f[t.f.size() / 3] += delta;
    copy.put(t);
  }
  copy.save((model / "prefill.safetensors").string());
  return root.string();
}

}  // namespace

TEST(CliRegress, GoldenTreePassesForBothEngines) {
  std::string junit = temp_path("regress-golden.xml");
  CliRun r = run_cli({"regress", "--golden", golden_dir(), "--junit", junit});
  EXPECT_EQ(r.code, 0) << r.error << r.out;
  // prefill, decode and chunked of every model, the sample dumps of HF's
  // generate, and each sequence of its batched dumps (three each) as a case
  // of its own; each for both engines.
  size_t dumps = 0, sequences = 0;
  for (const std::string& m : golden_models()) {
    for (const char* s : {"prefill", "decode", "chunked", "sample"})
      dumps += std::filesystem::exists(golden_dump(m, s)) ? 1 : 0;
    if (std::filesystem::exists(golden_dump(m, "batch")))
      sequences += dump_sequences(DumpFile(golden_dump(m, "batch"))).size();
  }
  EXPECT_EQ(dumps, golden_models().size() * 3 + 2);
  EXPECT_EQ(sequences, 6u);
  const size_t cases = (dumps + sequences) * 2;
  EXPECT_NE(r.out.find("batch/seq2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("result: " + std::to_string(cases) + " of " + std::to_string(cases) + " cases pass"),
            std::string::npos)
      << r.out;
  std::string xml = read_text(junit);
  EXPECT_EQ(xml.rfind("<?xml", 0), 0u);
  EXPECT_EQ(attr(xml, "testsuites", "tests"), std::to_string(cases));
  EXPECT_EQ(attr(xml, "testsuites", "failures"), "0");
  EXPECT_EQ(attr(xml, "testsuites", "errors"), "0");
  EXPECT_EQ(count(xml, "<testsuite "), 2u);
  EXPECT_EQ(count(xml, "<testcase "), cases);
  EXPECT_TRUE(tags_balance(xml, "testsuites") && tags_balance(xml, "testsuite") && tags_balance(xml, "testcase"));
}

TEST(CliRegress, PerturbedTensorFailsWithItsName) {
  std::string tree = perturbed_tree("regress-perturbed", "step0.layers.1.mlp.up", 0.01f);
  std::string junit = temp_path("regress-perturbed.xml");
  CliRun r = run_cli({"regress", "--golden", tree, "--junit", junit, "--json"});
  EXPECT_EQ(r.code, 1) << r.error;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["schema"], "llmdiff.regress/1");
  EXPECT_EQ(j["ok"], false);
  ASSERT_EQ(j["cases"].size(), 2u);  // prefill x {ref, impl}
  for (const auto& c : j["cases"]) {
    EXPECT_EQ(c["pass"], false);
    EXPECT_EQ(c["first_divergence"], "step0.layers.1.mlp.up");
    EXPECT_EQ(c["worst"]["name"], "step0.layers.1.mlp.up");
    EXPECT_GT(c["worst"]["value"].get<double>(), c["worst"]["threshold"].get<double>());
    ASSERT_FALSE(c["failures"].empty());
    EXPECT_NE(c["failures"][0].get<std::string>().find("step0.layers.1.mlp.up"), std::string::npos);
  }
  std::string xml = read_text(junit);
  EXPECT_EQ(attr(xml, "testsuites", "tests"), "2");
  EXPECT_EQ(attr(xml, "testsuites", "failures"), "2");
  EXPECT_EQ(count(xml, "<failure "), 2u);
  EXPECT_TRUE(tags_balance(xml, "failure") && tags_balance(xml, "testcase"));
  EXPECT_NE(xml.find("step0.layers.1.mlp.up: max_abs"), std::string::npos);

  // The table names the failing tensor; a looser policy lets the case pass.
  CliRun t = run_cli({"regress", "--golden", tree, "--engine", "impl"});
  EXPECT_EQ(t.code, 1);
  EXPECT_NE(t.out.find("FAIL"), std::string::npos);
  EXPECT_NE(t.out.find("step0.layers.1.mlp.up"), std::string::npos);
  CliRun loose = run_cli({"regress", "--golden", tree, "--engine", "impl", "--policy", "f32_abs=0.1"});
  EXPECT_EQ(loose.code, 0) << loose.out;
}

TEST(CliRegress, BadInputIsExitTwo) {
  EXPECT_EQ(run_cli({"regress", "--golden", temp_path("no-such-golden")}).code, 2);
  fs::create_directories(temp_path("empty-golden"));
  EXPECT_EQ(run_cli({"regress", "--golden", temp_path("empty-golden")}).code, 2);
  EXPECT_EQ(run_cli({"regress", "--golden", golden_dir(), "--engine", "torch"}).code, 2);
  EXPECT_EQ(run_cli({"regress", "--golden", golden_dir(), "--policy", "f32_abs=x"}).code, 2);
  EXPECT_EQ(run_cli({"regress"}).code, 2);
}

// The user's engine through a command template: a stand-in (llmdiff's impl
// as a separate process) passes every golden case of llama-gqa, the batch's
// sequences included, and is reported in JUnit under its own name.
// The directories a regress run leaves in TMPDIR (its stderr in r->error).
std::vector<std::string> work_dirs_after(const std::vector<std::string>& args, CliRun* r) {
  const fs::path tmp = temp_path("regress-tmpdir");
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  const char* old = std::getenv("TMPDIR");
  const std::string saved = old ? old : "";
  setenv("TMPDIR", tmp.c_str(), 1);
  ::testing::internal::CaptureStderr();
  *r = run_cli(args);
  r->error += ::testing::internal::GetCapturedStderr();
  if (old)
    setenv("TMPDIR", saved.c_str(), 1);
  else
    unsetenv("TMPDIR");
  std::vector<std::string> dirs;
  for (const auto& e : fs::directory_iterator(tmp)) dirs.push_back(e.path().string());
  return dirs;
}

TEST(CliRegress, ExternalEngineByCommandTemplate) {
  const std::string bin = std::string(LLMDIFF_BINARY_DIR) + "/llmdiff";
  const std::string engine = bin + " dump --engine impl --model {model} --tokens {tokens} --chunks {chunks} "
                                   "--decode {decode} --out {out}";
  const std::string junit = temp_path("external.xml");
  CliRun r = run_cli({"regress", "--golden", golden_model("llama-gqa"), "--engine-cmd", engine, "--engine-name",
                      "myengine", "--junit", junit});
  ASSERT_EQ(r.code, 0) << r.out << r.error;
  EXPECT_NE(r.out.find("myengine  float32"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("llama-gqa/sample: a sampling run"), std::string::npos) << r.out;  // said, not hidden
  const std::string xml = read_text(junit);
  // batch/seq0..2, chunked, decode, prefill
  EXPECT_NE(xml.find("<testsuite name=\"myengine\" tests=\"6\" failures=\"0\" errors=\"0\""), std::string::npos)
      << xml;
  EXPECT_TRUE(tags_balance(xml, "testcase"));
  // With a bug: every case fails, exit 1, the failures in JUnit with names.
  r = run_cli({"regress", "--golden", golden_model("llama-gqa"), "--engine-cmd",
               bin + " dump --engine impl --inject rope-theta --model {model} --tokens {tokens} --chunks {chunks} "
                     "--decode {decode} --out {out}",
               "--junit", junit, "--json", "--work-dir", temp_path("regress-failing")});
  ASSERT_EQ(r.code, 1) << r.out << r.error;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["summary"]["failed"], 6);
  EXPECT_EQ(j["cases"][0]["engine"], "external");
  EXPECT_EQ(j["cases"][0]["engine_kind"], "external");
  const std::string bad = read_text(junit);
  EXPECT_NE(bad.find("<testsuite name=\"external\" tests=\"6\" failures=\"6\""), std::string::npos) << bad;
  EXPECT_NE(bad.find("attn.q_rope"), std::string::npos);
  // The default work directory: removed when every case passes, kept (and
  // said where) when one fails, its dumps ready for bisect.
  EXPECT_TRUE(work_dirs_after({"regress", "--golden", golden_model("llama-gqa"), "--engine-cmd", engine}, &r).empty());
  EXPECT_EQ(r.code, 0) << r.error;
  const std::vector<std::string> kept = work_dirs_after(
      {"regress", "--golden", golden_model("llama-gqa"), "--engine-cmd",
       bin + " dump --engine impl --inject rope-theta --model {model} --tokens {tokens} --chunks {chunks} "
             "--decode {decode} --out {out}", "--engine-name", "myengine"}, &r);
  EXPECT_EQ(r.code, 1) << r.error;
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_NE(r.error.find("myengine's dumps and logs are kept in " + kept[0]), std::string::npos) << r.error;
  EXPECT_TRUE(fs::exists(fs::path(kept[0]) / "llama-gqa" / "decode.safetensors"));
}

// An engine that fails, or a template with an unknown placeholder.
TEST(CliRegress, ExternalEngineErrors) {
  CliRun r = run_cli({"regress", "--golden", golden_model("llama-gqa"), "--engine-cmd",
                      "echo cannot load {model} >&2; exit 3", "--json", "--work-dir",
                      temp_path("regress-errors")});
  ASSERT_EQ(r.code, 1) << r.error;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  const std::string err = j["cases"][0]["error"];
  EXPECT_NE(err.find("exited with 3"), std::string::npos) << err;
  EXPECT_NE(err.find("cannot load"), std::string::npos) << err;  // the engine's own words
  r = run_cli({"regress", "--golden", golden_model("llama-gqa"), "--engine-cmd", "myengine --prompt {prompt}"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("unknown placeholder {prompt}"), std::string::npos) << r.error;
  r = run_cli({"regress", "--golden", golden_model("llama-gqa"), "--engine-cmd", "x {out}", "--engine-dumps", "d"});
  EXPECT_EQ(r.code, 2);
}

// Dumps the engine already wrote, one per golden dump: the missing one is
// an error case naming the path, the others are judged.
TEST(CliRegress, ExternalEngineDumpsDirectory) {
  const fs::path dir = temp_path("engine-dumps");
  fs::create_directories(dir / "llama-gqa");
  for (const char* s : {"prefill", "decode"}) {
    CliRun d = run_cli({"dump", "--engine", "impl", "--model", golden_model("llama-gqa"), "--replay",
                        golden_dump("llama-gqa", s), "--out", (dir / "llama-gqa" / (std::string(s) + ".safetensors")).string()});
    ASSERT_EQ(d.code, 0) << d.error;
  }
  CliRun r = run_cli({"regress", "--golden", golden_model("llama-gqa"), "--engine-dumps", dir.string(), "--json"});
  ASSERT_EQ(r.code, 1) << r.error;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  int passed = 0, missing = 0;
  for (const auto& c : j["cases"]) {
    if (c["pass"] == true) ++passed;
    if (!c["error"].is_null() && c["error"].get<std::string>().find("no dump of llama-gqa/") != std::string::npos)
      ++missing;
  }
  EXPECT_EQ(passed, 2) << j.dump(1).substr(0, 3000);
  EXPECT_EQ(missing, 4);  // batch/seq0..2, chunked
}
