// `llmdiff inspect` on the golden data and on malformed inputs.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dumps/contract/dump.h"
#include "tests/cli_runner.h"
#include "tests/support.h"

using namespace llmdiff;
using namespace llmdiff::testing;

namespace {

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

}  // namespace

TEST(CliInspect, ListsEveryTensorOfAGoldenDumpInCanonicalOrderWithStats) {
  const std::string path = golden_dump("qwen3-qknorm", "decode");
  CliRun r = run_cli({"inspect", path});
  ASSERT_EQ(r.code, 0) << r.error;
  DumpFile d(path);
  const std::vector<std::string> names = d.names();
  size_t at = r.out.find("\nname ");
  ASSERT_NE(at, std::string::npos) << r.out;
  for (const auto& name : names) {
    size_t line = r.out.find("\n" + name + " ", at);
    ASSERT_NE(line, std::string::npos) << name << " missing or out of canonical order";
    at = line + 1;
  }
  EXPECT_NE(r.out.find("llm-dump/1"), std::string::npos);
  EXPECT_NE(r.out.find("nan"), std::string::npos);  // the stats header
}

TEST(CliInspect, JsonHasTheSameTensorsAndTrueStatistics) {
  const std::string path = golden_dump("llama-gqa", "prefill");
  CliRun r = run_cli({"inspect", path, "--json"});
  ASSERT_EQ(r.code, 0) << r.error;
  nlohmann::json doc = nlohmann::json::parse(r.out);
  DumpFile d(path);
  ASSERT_EQ(doc["tensors"].size(), d.names().size());
  for (size_t k = 0; k < d.names().size(); ++k) EXPECT_EQ(doc["tensors"][k]["name"], d.names()[k]);
  // step0.positions of a 7-token prefill: 0..6.
  for (const auto& t : doc["tensors"])
    if (t["name"] == "step0.positions") {
      EXPECT_EQ(t["min"], 0.0);
      EXPECT_EQ(t["max"], 6.0);
      EXPECT_EQ(t["mean"], 3.0);
      EXPECT_EQ(t["nan"], 0);
    }
  EXPECT_EQ(doc["metadata"]["format"], "llm-dump/1");
}

TEST(CliInspect, ModelDirectoryShowsConfigAndWeights) {
  CliRun r = run_cli({"inspect", golden_model("llama-mha-bf16"), "--json"});
  ASSERT_EQ(r.code, 0) << r.error;
  nlohmann::json doc = nlohmann::json::parse(r.out);
  EXPECT_EQ(doc["kind"], "model");
  EXPECT_EQ(doc["config"]["torch_dtype"], "bfloat16");
  EXPECT_EQ(doc["tensors"][0]["dtype"], "BF16");
  bool found = false;
  for (const auto& t : doc["tensors"]) found |= t["name"] == "model.layers.1.mlp.down_proj.weight";
  EXPECT_TRUE(found);
}

TEST(CliInspect, MalformedInputsExitTwoWithOneLineNamingTheFile) {
  std::ifstream in(golden_dump("llama-gqa", "prefill"), std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string good = ss.str();
  std::string bad_json = good;
  bad_json[8] = '[';  // the header's opening brace
  std::string past_eof = good;
  past_eof[6] = '\x7f';  // header length far past the end of the file
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"empty", ""},
      {"truncated-length", good.substr(0, 5)},
      {"truncated-data", good.substr(0, good.size() / 2)},
      {"header-past-eof", past_eof},
      {"bad-json", bad_json},
  };
  for (const auto& [stem, bytes] : cases) {
    const std::string path = temp_path(stem + ".safetensors");
    write_bytes(path, bytes);
    std::string out;
    EXPECT_EQ(run_binary("inspect " + path, &out), 2) << stem << ": " << out;
    EXPECT_NE(out.find(path), std::string::npos) << stem << ": " << out;
    ASSERT_FALSE(out.empty());
    EXPECT_EQ(out.find('\n'), out.size() - 1) << stem << ": not one line: " << out;
  }
  std::string out;
  EXPECT_EQ(run_binary("inspect " + temp_path("does-not-exist.safetensors"), &out), 2) << out;
  const std::string bad_config_dir = temp_path("bad-config");
  std::system(("mkdir -p " + bad_config_dir).c_str());
  write_bytes(bad_config_dir + "/config.json", "{\"model_type\": \"gpt2\"}");
  EXPECT_EQ(run_binary("inspect " + bad_config_dir, &out), 2) << out;
  EXPECT_NE(out.find("config.json"), std::string::npos) << out;
  EXPECT_NE(out.find("supported: llama, mistral, qwen2, qwen3"), std::string::npos) << out;
}
