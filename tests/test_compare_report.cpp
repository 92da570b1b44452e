// Renderers: the table shows failing tensors and counts the rest, JSON
// follows the documented schema, Markdown lists everything, JUnit XML is
// well-formed and escaped, files are written atomically.
#include <gtest/gtest.h>

#include <dirent.h>

#include <nlohmann/json.hpp>
#include <regex>

#include "compare/report.h"
#include "dumps/base/files.h"
#include "dumps/base/errors.h"
#include "tests/test_compare_helpers.h"

using namespace llmdiff;
using namespace llmdiff::compare;
using namespace llmdiff::testing;

namespace {

DiffResult perturbed_diff() {
  static DumpFile ref(golden_dump("llama-gqa", "decode"));
  MemoryDump cand("perturbed");
  copy_into(ref, cand);
  TensorData t = cand.get("step1.layers.1.mlp.up");
  t.f[5] += 0.5f;
  cand.put(t);
  cand.erase("step3.layers.0.attn.v_rep");
  return compare_dumps(ref, cand);
}

size_t count(const std::string& hay, const std::string& needle) {
  size_t n = 0;
  for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
  return n;
}

// Minimal XML well-formedness: tags balance and nest, attributes are quoted,
// no raw '<' or '&' outside markup/entities.
bool xml_well_formed(const std::string& xml, std::string* why) {
  std::vector<std::string> stack;
  size_t i = 0;
  if (xml.rfind("<?xml", 0) == 0) i = xml.find("?>") + 2;
  while (i < xml.size()) {
    if (xml[i] == '&') {
      size_t semi = xml.find(';', i);
      std::string ent = xml.substr(i, semi == std::string::npos ? 0 : semi - i + 1);
      if (ent != "&amp;" && ent != "&lt;" && ent != "&gt;" && ent != "&quot;" && ent != "&apos;") {
        *why = "bad entity at " + std::to_string(i);
        return false;
      }
      i = semi + 1;
      continue;
    }
    if (xml[i] != '<') {
      ++i;
      continue;
    }
    size_t end = i + 1;
    char quote = 0;
    for (; end < xml.size(); ++end) {
      if (quote) {
        if (xml[end] == quote) quote = 0;
        else if (xml[end] == '<') {
          *why = "raw '<' in an attribute";
          return false;
        }
      } else if (xml[end] == '"' || xml[end] == '\'') {
        quote = xml[end];
      } else if (xml[end] == '>') {
        break;
      }
    }
    if (end >= xml.size()) {
      *why = "unterminated tag";
      return false;
    }
    std::string tag = xml.substr(i + 1, end - i - 1);
    if (tag.empty()) {
      *why = "empty tag";
      return false;
    }
    if (tag[0] == '/') {
      std::string name = tag.substr(1);
      if (stack.empty() || stack.back() != name) {
        *why = "mismatched </" + name + ">";
        return false;
      }
      stack.pop_back();
    } else if (tag.back() != '/') {
      stack.push_back(tag.substr(0, tag.find_first_of(" \t\n")));
    }
    i = end + 1;
  }
  if (!stack.empty()) {
    *why = "unclosed <" + stack.back() + ">";
    return false;
  }
  return true;
}

std::string attr(const std::string& xml, const std::string& tag, const std::string& name) {
  std::smatch m;
  std::regex re("<" + tag + "[^>]* " + name + "=\"([^\"]*)\"");
  return std::regex_search(xml, m, re) ? m[1].str() : "";
}

}  // namespace

TEST(CompareReport, TableShowsFailuresCountsPassingAndLocalises) {
  DiffResult r = perturbed_diff();
  std::string t = render_diff_table(r);
  EXPECT_NE(t.find("step1.layers.1.mlp.up"), std::string::npos);
  EXPECT_NE(t.find("FAIL"), std::string::npos);
  EXPECT_NE(t.find("first divergence: step1.layers.1.mlp.up"), std::string::npos);
  EXPECT_NE(t.find("passing tensors not shown"), std::string::npos);
  EXPECT_NE(t.find("step3.layers.0.attn.v_rep"), std::string::npos);  // missing name listed
  EXPECT_NE(t.find("result: DIVERGES"), std::string::npos);
  EXPECT_EQ(t.find("step0.embed "), std::string::npos);  // passing rows hidden by default
  std::string all = render_diff_table(r, TableOptions{true});
  EXPECT_NE(all.find("step0.embed "), std::string::npos);
  EXPECT_GT(count(all, "PASS"), 100u);
  EXPECT_NE(all.find("generated"), std::string::npos);
  EXPECT_NE(all.find("greedy tokens"), std::string::npos);
}

TEST(CompareReport, JsonFollowsSchema) {
  DiffResult r = perturbed_diff();
  nlohmann::json j = nlohmann::json::parse(render_diff_json(r));
  EXPECT_EQ(j["schema"], kDiffSchema);
  EXPECT_EQ(j["ok"], false);
  EXPECT_EQ(j["first_divergence"], "step1.layers.1.mlp.up");
  EXPECT_EQ(j["summary"]["compared"], r.tensors.size());
  EXPECT_EQ(j["summary"]["failed"], r.failing());
  EXPECT_EQ(j["only_in_reference"], nlohmann::json::array({"step3.layers.0.attn.v_rep"}));
  EXPECT_EQ(j["tensors"].size(), r.tensors.size());
  EXPECT_EQ(j["dtype"], "float32");
  EXPECT_EQ(j["reference"]["manifest"]["format"], "llm-dump/1");
  const auto& up = *std::find_if(j["tensors"].begin(), j["tensors"].end(),
                                 [](const nlohmann::json& t) { return t["name"] == "step1.layers.1.mlp.up"; });
  EXPECT_EQ(up["pass"], false);
  EXPECT_EQ(up["kind"], "float");
  EXPECT_EQ(up["step"], 1);
  EXPECT_EQ(up["layer"], 1);
  EXPECT_EQ(up["site"], "mlp.up");
  EXPECT_NEAR(up["metrics"]["max_abs"].get<double>(), 0.5, 1e-6);
  EXPECT_EQ(up["metrics"]["max_abs_at"], nlohmann::json::array({0, 5}));
  EXPECT_EQ(up["allclose"]["failing"], 1);
  EXPECT_EQ(up["judgement"]["metric"], "allclose ratio");
  // Non-finite numbers are strings: an identical tensor has SQNR "inf".
  const auto& embed = *std::find_if(j["tensors"].begin(), j["tensors"].end(),
                                    [](const nlohmann::json& t) { return t["name"] == "step0.embed"; });
  EXPECT_EQ(embed["metrics"]["sqnr_db"], "inf");
  const auto& gen = j["tensors"].back();
  EXPECT_EQ(gen["name"], "generated");
  EXPECT_EQ(gen["kind"], "int");
  EXPECT_EQ(gen["int"]["mismatches"], 0);
  EXPECT_TRUE(j["greedy"]["first_divergent_step"].is_null());
  EXPECT_EQ(j["greedy"]["steps"].size(), 4u);
  EXPECT_FALSE(j["layer_trace"].empty());
  EXPECT_EQ(j["layer_trace"][0]["part"], "pre");
}

TEST(CompareReport, MarkdownListsEverything) {
  DiffResult r = perturbed_diff();
  std::string md = render_diff_markdown(r);
  EXPECT_EQ(md.rfind("# llmdiff diff report", 0), 0u);
  EXPECT_NE(md.find("## First divergence"), std::string::npos);
  EXPECT_NE(md.find("`step1.layers.1.mlp.up`"), std::string::npos);
  EXPECT_NE(md.find("## Per-layer error trace"), std::string::npos);
  EXPECT_NE(md.find("## All tensors"), std::string::npos);
  EXPECT_NE(md.find("`step0.embed`"), std::string::npos);
  EXPECT_NE(md.find("only in the reference"), std::string::npos);
}

TEST(CompareReport, JunitIsWellFormedAndEscaped) {
  RegressionReport rep;
  rep.golden = "tests/golden";
  RegressionCase ok;
  ok.model = "llama-gqa";
  ok.scenario = "prefill";
  ok.engine = EngineKind::Ref;
  ok.pass = true;
  ok.worst_name = "step0.logits";
  ok.worst_metric = "max_abs";
  ok.worst_value = 1e-6;
  ok.worst_threshold = 1e-4;
  ok.seconds = 0.25;
  RegressionCase bad = ok;
  bad.engine = EngineKind::Impl;
  bad.pass = false;
  bad.failures = {"step0.layers.0.attn.q: max_abs 1 > 1e-5 (a<b & \"c\" 'd')", "step0.mask: missing"};
  RegressionCase err = ok;
  err.engine = EngineKind::Impl;
  err.scenario = "decode";
  err.pass = false;
  err.error = "engine <impl> failed & stopped";
  err.failures = {"error: " + err.error};
  rep.cases = {ok, bad, err};
  std::string xml = render_regress_junit(rep);
  std::string why;
  EXPECT_TRUE(xml_well_formed(xml, &why)) << why << "\n" << xml;
  EXPECT_EQ(attr(xml, "testsuites", "tests"), "3");
  EXPECT_EQ(attr(xml, "testsuites", "failures"), "1");
  EXPECT_EQ(attr(xml, "testsuites", "errors"), "1");
  EXPECT_EQ(count(xml, "<testsuite "), 2u);
  EXPECT_EQ(count(xml, "<testcase "), 3u);
  EXPECT_EQ(count(xml, "<failure "), 1u);
  EXPECT_EQ(count(xml, "<error "), 1u);
  EXPECT_NE(xml.find("a&lt;b &amp; &quot;c&quot; &apos;d&apos;"), std::string::npos);
  EXPECT_EQ(xml.find("a<b"), std::string::npos);
  EXPECT_EQ(xml_escape(std::string("x\x01y<")), "xy&lt;");

  // The well-formedness check itself rejects broken XML.
  EXPECT_FALSE(xml_well_formed("<a><b></a></b>", &why));
  EXPECT_FALSE(xml_well_formed("<a>x & y</a>", &why));

  nlohmann::json j = regress_to_json(rep);
  EXPECT_EQ(j["schema"], kRegressSchema);
  EXPECT_EQ(j["summary"]["failed"], 2);
  EXPECT_EQ(j["cases"][2]["error"], err.error);
  std::string table = render_regress_table(rep);
  EXPECT_NE(table.find("ERROR"), std::string::npos);
  EXPECT_NE(table.find("1 of 3 cases pass"), std::string::npos);
}

TEST(CompareReport, AtomicWriteLeavesNoTemporaries) {
  std::string path = temp_path("report.md");
  write_file_atomic(path, "first\n");
  write_file_atomic(path, "second\n");
  EXPECT_EQ(read_text(path), "second\n");
  std::string dir = path.substr(0, path.rfind('/'));
  DIR* d = opendir(dir.c_str());
  ASSERT_NE(d, nullptr);
  while (dirent* e = readdir(d)) EXPECT_EQ(std::string(e->d_name).find(".tmp."), std::string::npos) << e->d_name;
  closedir(d);
  EXPECT_THROW(write_file_atomic("/nonexistent-dir/x.md", "x"), IoError);
  EXPECT_EQ(fmt_num(0), "0");
  EXPECT_EQ(fmt_num(1.5e-5), "1.500e-05");
  EXPECT_EQ(fmt_num(std::numeric_limits<double>::infinity()), "inf");
}
