// The error heatmap (compare/heatmap.h) on hand-made tensors, and the HTML
// report of a diff (compare/report_html.h) on a golden dump against a copy
// whose error starts at a known name: the names, the escaped strings from the
// input, the chart and heatmap data and no reference to the network.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "compare/compare.h"
#include "compare/heatmap.h"
#include "compare/report.h"
#include "compare/report_html.h"
#include "tests/test_compare_helpers.h"

using namespace llmdiff;
using namespace llmdiff::compare;
using namespace llmdiff::testing;

namespace {

// Copies `src`, adds `delta` to one element of `first` and scales every
// later float tensor by 1.01 (an error that propagates downstream).
void perturb_from(const TensorSource& src, MemoryDump& d, const std::string& first, float delta) {
  copy_into(src, d);
  NameOrder before;
  for (const auto& n : src.names()) {
    TensorData t = src.get(n);
    if (t.is_int || before(n, first)) continue;
    if (n == first)
      t.f[t.f.size() / 2] += delta;
    else
      for (auto& v : t.f) v *= 1.01f;
    d.put(t);
  }
}

}  // namespace

TEST(CompareHtml, HeatmapOfAttentionSiteIsHeadsByPositions) {
  const int64_t H = 4, T = 300, X = 8;
  std::vector<float> a(size_t(H * T * X)), b;
  for (size_t k = 0; k < a.size(); ++k) a[k] = float(k % 17) * 0.25f;
  b = a;
  b[size_t((2 * T + 150) * X + 5)] += 0.5f;                   // head 2, position 150
  b[size_t((1 * T + 7) * X + 1)] -= 0.125f;                   // head 1, position 7
  b[0] = std::numeric_limits<float>::quiet_NaN();             // head 0, position 0
  const std::string name = "step0.layers.3.attn.q_rope";
  std::optional<ErrorHeatmap> h = error_heatmap(float_tensor(name, {H, T, X}, a), float_tensor(name, {H, T, X}, b));
  ASSERT_TRUE(h);
  EXPECT_EQ(h->row_label, "head");
  EXPECT_EQ(h->col_label, "position");
  EXPECT_EQ(h->inner, X);
  EXPECT_EQ(h->row_step, 1);
  EXPECT_EQ(h->col_step, 3);  // ceil(300 / 128)
  EXPECT_EQ(h->rows, H);
  EXPECT_EQ(h->cols, 100);
  ASSERT_EQ(h->values.size(), size_t(H * 100));
  EXPECT_FLOAT_EQ(h->values[size_t(2 * 100 + 50)], 0.5f);
  EXPECT_FLOAT_EQ(h->values[size_t(1 * 100 + 2)], 0.125f);
  EXPECT_TRUE(std::isinf(h->values[0]));
  EXPECT_EQ(h->nonfinite, 1);
  EXPECT_FLOAT_EQ(float(h->max), 0.5f);
  EXPECT_EQ(h->max_row, 2);
  EXPECT_EQ(h->max_col, 50);
  int zeros = 0;
  for (float v : h->values) zeros += v == 0.0f;
  EXPECT_EQ(zeros, H * 100 - 3);
}

TEST(CompareHtml, HeatmapDownsamplesLargeMatrices) {
  const int64_t R = 200, C = 1000;
  std::vector<float> a(size_t(R * C), 1.0f), b = a;
  b[size_t(199 * C + 999)] = 4.0f;  // the last element: the last cell
  b[size_t(5 * C + 17)] = 1.5f;     // row 5 -> cell row 1, column 17 -> cell column 2
  std::optional<ErrorHeatmap> h =
      error_heatmap(float_tensor("step1.logits", {R, C}, a), float_tensor("step1.logits", {R, C}, b));
  ASSERT_TRUE(h);
  EXPECT_EQ(h->row_label, "position");
  EXPECT_EQ(h->row_step, 4);
  EXPECT_EQ(h->col_step, 8);
  EXPECT_EQ(h->rows, 50);
  EXPECT_EQ(h->cols, 125);
  EXPECT_FLOAT_EQ(h->values.back(), 3.0f);
  EXPECT_FLOAT_EQ(h->values[size_t(1 * 125 + 2)], 0.5f);
  EXPECT_EQ(h->max_row, 49);
  EXPECT_EQ(h->max_col, 124);
  // Shapes that differ have no heatmap; integers do.
  EXPECT_FALSE(error_heatmap(float_tensor("x", {2, 3}, std::vector<float>(6)), float_tensor("x", {3, 2}, std::vector<float>(6))));
  std::optional<ErrorHeatmap> ints = error_heatmap(int_tensor("step0.tokens", {3}, {1, 2, 3}), int_tensor("step0.tokens", {3}, {1, 9, 3}));
  ASSERT_TRUE(ints);
  EXPECT_EQ(ints->rows, 1);
  EXPECT_EQ(ints->cols, 3);
  EXPECT_FLOAT_EQ(ints->values[1], 7.0f);
}

TEST(CompareHtml, DiffReportOfAGoldenDumpAndAPerturbedCopy) {
  DumpFile ref(golden_dump("llama-gqa", "decode"));
  const std::string first = "step0.layers.1.attn.q_rope";
  MemoryDump cand("cand");
  perturb_from(ref, cand, first, 0.75f);
  cand.mutable_manifest().producer = "engine <script>alert(\"x\")</script> & 'co'";
  // A name outside the spec (compared, listed last) that must be escaped too.
  MemoryDump ref2("ref");
  copy_into(ref, ref2);
  ref2.put(float_tensor("odd<b>&\"name\"", {2}, {1.0f, 2.0f}));
  cand.put(float_tensor("odd<b>&\"name\"", {2}, {1.0f, 3.0f}));

  const DiffResult r = compare_dumps(ref2, cand);
  ASSERT_TRUE(r.first());
  ASSERT_EQ(r.first()->name, first);
  ASSERT_TRUE(r.heatmap);
  EXPECT_EQ(r.heatmap->name, first);
  EXPECT_EQ(r.heatmap->row_label, "head");
  const std::string page = render_diff_html(r);

  EXPECT_EQ(page.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(page.find("Diverges: "), std::string::npos);
  EXPECT_NE(page.find("<code>" + first + "</code>"), std::string::npos);
  EXPECT_NE(page.find("<svg id=\"chart\""), std::string::npos);
  EXPECT_NE(page.find("<canvas id=\"heatmap\""), std::string::npos);
  EXPECT_NE(page.find("prefers-color-scheme: dark"), std::string::npos);
  EXPECT_NE(page.find("table class=\"sortable\""), std::string::npos);
  // Every string from the input escaped, in the markup and in the data.
  EXPECT_NE(page.find("engine &lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#39;co&#39;"), std::string::npos);
  EXPECT_EQ(page.find("<script>alert"), std::string::npos);
  EXPECT_NE(page.find("odd&lt;b&gt;&amp;&quot;name&quot;"), std::string::npos);
  EXPECT_EQ(page.find("odd<b>"), std::string::npos);
  EXPECT_EQ(page.find("http://"), std::string::npos);
  EXPECT_EQ(page.find("https://"), std::string::npos);
  // Each number with its threshold.
  const TensorComparison& f = *r.first();
  EXPECT_NE(page.find(f.judgement.metric + " " + fmt_num(f.judgement.value, 2) + " &gt; " + fmt_num(f.judgement.threshold, 2)),
            std::string::npos);

  // The chart's data: one point per name with a ratio, the first divergence marked.
  const nlohmann::json chart = embedded_json(page, "chart-data");
  ASSERT_TRUE(chart.is_object());
  size_t with_ratio = 0;
  for (const auto& t : r.tensors) with_ratio += !t.is_int || !t.pass;
  ASSERT_EQ(chart["points"].size(), with_ratio);
  const int at = chart["first"];
  ASSERT_GE(at, 0);
  EXPECT_EQ(chart["points"][size_t(at)]["n"], first);
  EXPECT_GT(double(chart["points"][size_t(at)]["r"]), 1.0);
  EXPECT_EQ(chart["points"].back()["n"], "odd<b>&\"name\"");  // \u003c in the page, the same string once parsed
  const nlohmann::json heat = embedded_json(page, "heatmap-data");
  EXPECT_EQ(heat["name"], first);
  EXPECT_EQ(heat["values"].size(), size_t(heat["rows"]) * size_t(heat["cols"]));
}

TEST(CompareHtml, DiffReportOfIdenticalDumps) {
  DumpFile g(golden_dump("qwen3-qknorm", "prefill"));
  const DiffResult r = compare_dumps(g, g);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r.heatmap);
  const std::string page = render_diff_html(r);
  EXPECT_NE(page.find("Within tolerance: "), std::string::npos);
  EXPECT_NE(page.find("No tensor to map"), std::string::npos);
  EXPECT_EQ(page.find("id=\"heatmap-data\""), std::string::npos);
  EXPECT_EQ(embedded_json(page, "chart-data")["first"], -1);
}
