// Row subsets (docs/DUMP_FORMAT.md, "Row subsets"): a dump holding some
// per-token tensors for only some token rows (step{N}.rows) is diffed and
// bisected on the rows present; a malformed row list is an input error.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/rows.h"
#include "support.h"

namespace llmdiff {
namespace {

using testing::run_cli;

// HF's prefill of llama-gqa with layer 1's attention probabilities (head
// major), its feed-forward and the logits kept for rows {1, 3} only.
std::string subset_golden(const std::string& stem, const std::vector<int64_t>& rows, float perturb = 0,
                          bool declared = true, bool cut_probs = true) {
  const DumpFile hf(testing::golden_dump("llama-gqa", "prefill"));
  MemoryDump out("subset");
  out.mutable_manifest() = hf.manifest();
  for (const std::string& n : hf.names()) {
    TensorData t = hf.get(n);
    const std::string site = parse_name(n).site;
    const bool cut = n.find("layers.1.mlp") != std::string::npos ||
                     (cut_probs && n.find("layers.1.attn.probs") != std::string::npos) || n == "step0.logits";
    if (cut) t = select_rows(t, rows, *token_axis(site));
    if (cut && perturb != 0 && n == "step0.layers.1.mlp.down") t.f[3] += perturb;
    t.rows.clear();
    out.put(std::move(t));
  }
  TensorData r;
  r.name = "step0.rows";
  r.is_int = true;
  r.stored = DType::I64;
  r.i = rows;
  r.shape = {int64_t(rows.size())};
  if (declared) out.put(r);
  // Streamed as an engine writes (a MemoryDump's save reads its tensors
  // back, row list checked).
  const std::string path = testing::temp_path(stem + ".safetensors");
  DumpWriter w(path);
  w.mutable_manifest() = hf.manifest();
  for (const std::string& n : out.names()) {
    const TensorData* t = out.find(n);
    if (t->is_int)
      w.on_i64(n, t->shape, t->i.data());
    else
      w.on_f32(n, t->shape, t->f.data());
  }
  w.finish();
  return path;
}

TEST(CliRows, SubsetsAreComparedOnTheirRows) {
  const std::string golden = testing::golden_dump("llama-gqa", "prefill");
  const std::string sub = subset_golden("rows-13", {1, 3});
  const DumpFile d(sub);
  EXPECT_EQ(d.get("step0.layers.1.mlp.act").rows, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(d.get("step0.layers.1.attn.probs").shape, (Shape{4, 2, 7}));
  EXPECT_TRUE(d.get("step0.layers.1.attn.ctx").rows.empty());
  auto r = run_cli({"diff", golden, sub, "--json"});
  ASSERT_EQ(r.code, 0) << r.out.substr(0, 2000) << r.error;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  int noted = 0;
  for (const auto& t : j["tensors"]) {
    for (const auto& note : t["notes"])
      if (note.get<std::string>().find("compared on the 2 token rows the candidate holds (1, 3)") != std::string::npos)
        ++noted;
  }
  EXPECT_EQ(noted, 7);  // probs, mlp_norm, gate, up, act, down, logits
  // A wrong value in a held row is found there.
  const std::string bad = subset_golden("rows-13-bad", {1, 3}, 0.5f);
  r = run_cli({"diff", golden, bad, "--json"});
  ASSERT_EQ(r.code, 1) << r.error;
  EXPECT_EQ(nlohmann::json::parse(r.out)["first_divergence"], "step0.layers.1.mlp.down");
  // bisect: HF's own values pass, the perturbed row is localised.
  const std::string model = testing::golden_model("llama-gqa");
  r = run_cli({"bisect", "--model", model, sub, "--json"});
  EXPECT_EQ(r.code, 0) << r.out.substr(0, 3000) << r.error;
  r = run_cli({"bisect", "--model", model, bad, "--json", "--no-diagnose"});
  ASSERT_EQ(r.code, 1) << r.error;
  EXPECT_EQ(nlohmann::json::parse(r.out)["localised_at"], "step0.layers.1.mlp.down");
}

TEST(CliRows, MalformedRowListIsAnInputError) {
  const std::string golden = testing::golden_dump("llama-gqa", "prefill");
  const std::string sub = subset_golden("rows-31", {3, 1});
  const auto r = run_cli({"diff", golden, sub});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("step0.rows"), std::string::npos) << r.error;
  EXPECT_NE(r.error.find("ascending"), std::string::npos) << r.error;
}

// An engine that prunes a step's last layer to its last row and writes the
// shorter tensors without step0.rows (llama.cpp's output pruning): read as
// that row subset, HF's values pass with a note saying so; a wrong value in
// the row is localised there, not called a length bug; shorter tensors that
// disagree on their row count are read as they are.
TEST(CliRows, UndeclaredLastRowsAreReadAsARowSubset) {
  const std::string model = testing::golden_model("llama-gqa");
  const std::string pruned = subset_golden("rows-last-undeclared", {5, 6}, 0, false, false);
  auto r = run_cli({"bisect", "--model", model, pruned, "--json"});
  ASSERT_EQ(r.code, 0) << r.out.substr(0, 3000) << r.error;
  nlohmann::json j = nlohmann::json::parse(r.out);
  bool noted = false;
  for (const auto& n : j["notes"])
    noted = noted || n.get<std::string>() ==
                         "step0: 6 tensors hold the last 2 of the step's 7 rows, without step0.rows: compared as that "
                         "row subset";
  EXPECT_TRUE(noted) << j["notes"].dump();

  const std::string bad = subset_golden("rows-last-undeclared-bad", {5, 6}, 0.5f, false, false);
  r = run_cli({"bisect", "--model", model, bad, "--json"});
  ASSERT_EQ(r.code, 1) << r.error;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["localised_at"], "step0.layers.1.mlp.down");

  // Not the last rows: rows {1, 3} read as the last two disagree with the reference there.
  const std::string inner = subset_golden("rows-13-undeclared", {1, 3}, 0, false, false);
  r = run_cli({"bisect", "--model", model, inner, "--json"});
  EXPECT_EQ(r.code, 1) << r.error;
  // An attention cut short is no output pruning: read as it is, a length finding.
  const std::string attention = subset_golden("rows-last-undeclared-probs", {5, 6}, 0, false, true);
  r = run_cli({"bisect", "--model", model, attention, "--json"});
  ASSERT_EQ(r.code, 1) << r.error;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["localised_at"], "step0.layers.1.attn.probs");
  EXPECT_TRUE(j["notes"].empty() || j["notes"].dump().find("without step0.rows") == std::string::npos) << j["notes"];
}

}  // namespace
}  // namespace llmdiff
