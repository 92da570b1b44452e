// --html FILE on run, bisect and diff: the report of a zoo bug injected into
// the impl names the bug, the localised site and its heatmap, escapes the
// input's strings and refers to nothing on the network; headless chromium
// renders it (the script draws the chart and the heatmap without an error)
// into a non-blank screenshot.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>

#include "tests/test_cli_diff_helpers.h"

namespace fs = std::filesystem;
using namespace llmdiff;
using namespace llmdiff::testing;

namespace {

const char* const kLocalised = "step0.layers.0.attn.q_rope";

struct Reports {
  std::string run_html, bisect_html, candidate;
  int run_code = -1, bisect_code = -1;
  std::string run_error, bisect_error;
};

// `run --inject rope-interleaved` on llama-gqa's decode scenario with --html
// (its candidate saved), then `bisect --html` on that candidate; made once.
const Reports& reports() {
  static const Reports r = [] {
    Reports x;
    const std::string model = golden_model("llama-gqa"), replay = golden_dump("llama-gqa", "decode");
    x.run_html = temp_path("run-report.html");
    x.bisect_html = temp_path("bisect-report.html");
    x.candidate = temp_path("rope-interleaved.safetensors");
    CliRun a = run_cli({"run", "--model", model, "--replay", replay, "--inject", "rope-interleaved", "--threads", "1",
                        "--out", x.candidate, "--html", x.run_html});
    x.run_code = a.code;
    x.run_error = a.error;
    CliRun b = run_cli({"bisect", "--model", model, x.candidate, "--threads", "1", "--json", "--html", x.bisect_html});
    x.bisect_code = b.code;
    x.bisect_error = b.error;
    return x;
  }();
  return r;
}

void expect_bisect_page(const std::string& page) {
  EXPECT_EQ(page.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(page.find("class=\"verdict bad\""), std::string::npos);
  EXPECT_NE(page.find("Diagnosis: rope-interleaved"), std::string::npos);
  EXPECT_NE(page.find(std::string("<code>") + kLocalised + "</code>"), std::string::npos);
  EXPECT_NE(page.find("id=\"hypotheses\""), std::string::npos);
  EXPECT_NE(page.find("id=\"local\""), std::string::npos);
  EXPECT_NE(page.find("<svg id=\"chart\""), std::string::npos);
  EXPECT_NE(page.find("<canvas id=\"heatmap\""), std::string::npos);
  EXPECT_EQ(page.find("http://"), std::string::npos);
  EXPECT_EQ(page.find("https://"), std::string::npos);
  const nlohmann::json heat = embedded_json(page, "heatmap-data");
  ASSERT_TRUE(heat.is_object());
  EXPECT_EQ(heat["name"], kLocalised);
  EXPECT_EQ(heat["row_label"], "head");
  EXPECT_GT(double(heat["max"]), 0.0);
  const nlohmann::json chart = embedded_json(page, "chart-data");
  ASSERT_TRUE(chart.is_object());
  const int first = chart["first"], local_first = chart["local_first"];
  ASSERT_GE(first, 0);
  ASSERT_GE(local_first, 0);
  EXPECT_EQ(chart["points"][size_t(first)]["n"], kLocalised);
  EXPECT_EQ(chart["points"][size_t(local_first)]["n"], kLocalised);
  EXPECT_GT(double(chart["points"][size_t(local_first)]["lr"]), 1.0);
}

// stdout of a shell command.
std::string capture(const std::string& cmd) {
  std::string out;
  run_command(cmd, &out);
  return out;
}

// Headless chromium with its own profile; its stderr (sandbox, dbus noise) is dropped.
std::string chromium(const std::string& args) {
  const std::string profile = temp_path("chromium-profile");
  return "timeout 90 chromium --headless --no-sandbox --disable-gpu --user-data-dir=" + profile + " " + args +
         " 2>/dev/null";
}

std::string attribute(const std::string& tag, const std::string& name) {
  std::smatch m;
  if (std::regex_search(tag, m, std::regex(" " + name + "=\"([^\"]*)\""))) return m[1];
  return "";
}

}  // namespace

TEST(CliHtml, RunAndBisectWriteTheHtmlReport) {
  const Reports& r = reports();
  ASSERT_EQ(r.run_code, 1) << r.run_error;
  ASSERT_EQ(r.bisect_code, 1) << r.bisect_error;
  {
    SCOPED_TRACE("run --html");
    expect_bisect_page(read_text(r.run_html));
  }
  {
    SCOPED_TRACE("bisect --html");
    const std::string page = read_text(r.bisect_html);
    expect_bisect_page(page);
    EXPECT_NE(page.find(r.candidate), std::string::npos);  // the candidate's path, escaped (nothing to escape)
  }
  for (const auto& e : fs::directory_iterator(fs::path(r.run_html).parent_path()))
    EXPECT_EQ(e.path().filename().string().find(".html.tmp"), std::string::npos) << "temporary left behind";
}

TEST(CliHtml, DiffWritesTheHtmlReport) {
  const std::string g = golden_dump("llama-gqa", "chunked");
  const std::string bug = temp_path("html-kv-overwrite.safetensors");
  write_engine_dump("impl", golden_model("llama-gqa"), g, bug, {"kv-overwrite"});
  const std::string html = temp_path("diff-report.html");
  CliRun r = run_cli({"diff", g, bug, "--json", "--html", html});
  ASSERT_EQ(r.code, 1) << r.error;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  const std::string first = j["first_divergence"];
  const std::string page = read_text(html);
  EXPECT_NE(page.find("<code>" + first + "</code>"), std::string::npos);
  EXPECT_NE(page.find("Diverges: "), std::string::npos);
  // The heatmap: the first diverging name whose shapes agree (the first
  // divergence here is the mask, one cache length off).
  std::string mapped;
  for (const auto& t : j["tensors"])
    if (!t["pass"].get<bool>() && t["shape_match"].get<bool>()) {
      mapped = t["name"];
      break;
    }
  ASSERT_FALSE(mapped.empty());
  EXPECT_EQ(embedded_json(page, "heatmap-data")["name"], mapped);
  EXPECT_EQ(page.find("http://"), std::string::npos);
  EXPECT_EQ(page.find("https://"), std::string::npos);
  // Nothing diverges: the page says so, and there is no heatmap.
  const std::string same = temp_path("diff-same.html");
  ASSERT_EQ(run_cli({"diff", g, g, "--html", same}).code, 0);
  EXPECT_NE(read_text(same).find("class=\"verdict ok\""), std::string::npos);
  EXPECT_EQ(read_text(same).find("id=\"heatmap-data\""), std::string::npos);
}

// scripts/setup.sh installs chromium: its absence is a failure, not a skip.
TEST(CliHtml, HeadlessChromiumRendersTheBisectReport) {
  ASSERT_EQ(std::system("command -v chromium >/dev/null 2>&1"), 0) << "chromium not found (scripts/setup.sh installs it)";
  const Reports& r = reports();
  ASSERT_EQ(r.run_code, 1) << r.run_error;
  const std::string page = read_text(r.run_html);
  const nlohmann::json heat = embedded_json(page, "heatmap-data");
  ASSERT_TRUE(heat.is_object());

  const std::string dom = capture(chromium("--dump-dom " + r.run_html));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(dom, m, std::regex("<body[^>]*>"))) << dom.substr(0, 2000);
  const std::string body = m[0];
  EXPECT_EQ(attribute(body, "data-error"), "") << body;
  EXPECT_EQ(attribute(body, "data-rendered"), "ok") << body;
  const std::string points = attribute(body, "data-points"), cells = attribute(body, "data-cells");
  ASSERT_FALSE(points.empty()) << body;
  ASSERT_FALSE(cells.empty()) << body;
  EXPECT_GT(std::stol(points), 0);
  EXPECT_EQ(std::stol(cells), long(heat["rows"]) * long(heat["cols"]));
  // The chart's markers are in the DOM: one SVG element per point drawn.
  size_t markers = 0;
  for (const char* tag : {"<circle ", "<rect "})
    for (size_t at = dom.find(tag); at != std::string::npos; at = dom.find(tag, at + 1)) ++markers;
  EXPECT_GE(markers, size_t(std::stol(points)));

  const std::string png = temp_path("bisect-report.png");
  capture(chromium("--screenshot=" + png + " --window-size=1200,2000 " + r.run_html));
  ASSERT_TRUE(fs::exists(png)) << "no screenshot";
  const std::string bytes = read_text(png);
  ASSERT_GE(bytes.size(), 24u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  auto be32 = [&](size_t at) {
    return (uint32_t(uint8_t(bytes[at])) << 24) | (uint32_t(uint8_t(bytes[at + 1])) << 16) |
           (uint32_t(uint8_t(bytes[at + 2])) << 8) | uint32_t(uint8_t(bytes[at + 3]));
  };
  EXPECT_EQ(bytes.substr(12, 4), "IHDR");
  EXPECT_EQ(be32(16), 1200u);
  EXPECT_EQ(be32(20), 2000u);
  // A blank 1200x2000 page compresses to a few KB; text, chart and heatmap do not.
  EXPECT_GT(bytes.size(), 40000u) << "screenshot looks blank";
}
