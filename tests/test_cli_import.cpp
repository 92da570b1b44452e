// `llmdiff import` end to end: HF goldens and an impl candidate re-laid as
// llama.cpp's graph shows them (tests/llama_cpp_export.h), imported with the
// bundled llama.cpp mapping, then diffed and bisected.
#include <gtest/gtest.h>

#include <filesystem>
#include <vector>

#include "cli_runner.h"
#include "dumps/model/config.h"
#include "dumps/contract/dump.h"
#include "llama_cpp_export.h"
#include "support.h"

namespace llmdiff {
namespace {

using testing::run_cli;

struct Exported {
  std::vector<std::string> files;
  std::string tokens;
};

Exported export_llama_cpp(const std::string& model, const std::string& dump_path, const std::string& stem,
                          const testing::LlamaCppExport& o) {
  const std::string dir = testing::temp_path(stem);
  std::filesystem::create_directories(dir);
  const DumpFile d(dump_path);
  const ModelConfig cfg = load_config(testing::golden_model(model));
  return {testing::write_llama_cpp_export(d, cfg, dir, o), testing::tokens_argument(d)};
}

std::vector<std::string> import_args(const std::string& model, const Exported& e, const std::string& out) {
  std::vector<std::string> a = {"import", "--model", testing::golden_model(model), "--mapping", "llama.cpp",
                                "--tokens", e.tokens, "--out", out};
  a.insert(a.end(), e.files.begin(), e.files.end());
  return a;
}

// Every name the llama.cpp graph shows comes back equal to HF's, through
// each model family's rules: llama (permuted q/k rows, transposed V cache),
// qwen3 (q/k norms, rotate-half RoPE, V cache untransposed), qwen2 (biases).
TEST(CliImport, LlamaCppExportOfGoldensImportsToTheSameValues) {
  struct Case {
    const char* model;
    const char* scenario;
    bool v_cont, flash_attn, early;
  };
  const std::vector<Case> cases = {
      {"llama-gqa", "decode", false, false, false},  {"qwen3-qknorm", "chunked", true, false, false},
      {"qwen2-bias", "decode", false, false, false}, {"llama-gqa", "chunked", false, true, false},
      {"llama-gqa", "decode", false, false, true},   {"qwen2-bias", "chunked", false, false, true}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.model) + "/" + c.scenario + (c.flash_attn ? " flash attention" : "") +
                 (c.early ? " early-2025 names" : ""));
    testing::LlamaCppExport o;
    o.v_cont = c.v_cont;
    o.flash_attn = c.flash_attn;
    o.early_2025 = c.early;
    if (c.flash_attn) o.pad = 256;
    const std::string golden = testing::golden_dump(c.model, c.scenario);
    const std::string stem =
        std::string(c.model) + "-" + c.scenario + (c.flash_attn ? "-fa" : "") + (c.early ? "-early" : "");
    const Exported e = export_llama_cpp(c.model, golden, "lc-" + stem, o);
    const std::string out = testing::temp_path("imported-" + stem + ".safetensors");
    const auto r = run_cli(import_args(c.model, e, out));
    ASSERT_EQ(r.code, 0) << r.error << r.out;
    EXPECT_EQ(r.out.find("not imported"), std::string::npos) << r.out;  // every node mapped or ignored
    const DumpFile imported(out), want(golden);
    EXPECT_EQ(imported.manifest().scenario, want.manifest().scenario);
    int checked = 0;
    for (const std::string& n : imported.names()) {
      ASSERT_TRUE(want.has(n)) << n;
      const TensorData a = imported.get(n), b = want.get(n);
      ASSERT_EQ(a.shape, b.shape) << n;
      if (a.is_int) {
        EXPECT_EQ(a.i, b.i) << n;
      } else {
        EXPECT_LE(testing::max_abs_diff(a, b), 1e-6 * std::max(1.0, testing::max_abs(b))) << n;
      }
      ++checked;
    }
    // What llama.cpp's graph never shows: positions, rope tables, the mask
    // (inputs), repeat_kv (broadcast inside the product).
    for (const std::string& n : want.names())
      if (!imported.has(n)) {
        const std::string site = parse_name(n).site;
        EXPECT_TRUE(site == "positions" || site == "rope.cos" || site == "rope.sin" || site == "mask" ||
                    site == "attn.k_rep" || site == "attn.v_rep" || n == "rope.inv_freq" || n == "generated" ||
                    (c.flash_attn && (site == "attn.scores" || site == "attn.probs")) ||
                    (site == "attn.out" && std::string(c.model) != "llama-gqa" && !c.early))
            << n << " not imported";
      }
    EXPECT_GE(checked, 80);
    const auto d = run_cli({"diff", golden, out});
    EXPECT_EQ(d.code, 0) << d.out << d.error;
  }
}

// llama.cpp's output-row pruning: the last layer's feed-forward and the
// logits exist for the last token only. They are imported as row subsets
// (step0.rows), and diff and bisect compare the rows present: the golden
// itself passes, a candidate with a bug is still localised and named.
TEST(CliImport, OutputRowPruningImportsRowSubsetsThatEveryCommandCompares) {
  testing::LlamaCppExport o;
  o.prune_output_rows = true;
  const std::string model = testing::golden_model("llama-gqa");
  const std::string golden = testing::golden_dump("llama-gqa", "prefill");
  const Exported e = export_llama_cpp("llama-gqa", golden, "lc-pruned", o);
  const std::string out = testing::temp_path("imported-pruned.safetensors");
  const auto r = run_cli(import_args("llama-gqa", e, out));
  ASSERT_EQ(r.code, 0) << r.error;
  const DumpFile imported(out), want(golden);
  const int64_t T = int64_t(want.get("step0.tokens").i.size());
  EXPECT_EQ(imported.get("step0.rows").i, std::vector<int64_t>{T - 1});
  const TensorData last = imported.get("step0.layers.1.out");
  EXPECT_EQ(last.shape, (Shape{1, 64}));
  EXPECT_EQ(last.rows, std::vector<int64_t>{T - 1});
  EXPECT_EQ(imported.get("step0.logits").shape, (Shape{1, 384}));
  EXPECT_EQ(imported.get("step0.layers.0.out").shape, (Shape{T, 64}));  // every row before the last layer
  EXPECT_TRUE(imported.get("step0.layers.0.out").rows.empty());
  EXPECT_LE(testing::max_abs_diff(imported.get("step0.next_logits"), want.get("step0.next_logits")), 1e-6);
  // diff: the rows present, said so.
  const auto d = run_cli({"diff", golden, out, "--json"});
  EXPECT_EQ(d.code, 0) << d.out.substr(0, 3000) << d.error;
  EXPECT_NE(d.out.find("compared on the 1 token rows the candidate holds (" + std::to_string(T - 1) + ")"),
            std::string::npos);
  // bisect of HF's own values: no divergence, no local failure.
  auto b = run_cli({"bisect", "--model", model, out, "--json"});
  EXPECT_EQ(b.code, 0) << b.out.substr(0, 3000) << b.error;
  // An engine with a bug in the pruned layer's feed-forward.
  const std::string cand = testing::temp_path("pruned-cand.safetensors");
  ASSERT_EQ(run_cli({"dump", "--engine", "impl", "--inject", "gate-up-swap", "--model", model, "--replay", golden,
                     "--out", cand})
                .code,
            0);
  const Exported ec = export_llama_cpp("llama-gqa", cand, "lc-pruned-cand", o);
  const std::string out2 = testing::temp_path("imported-pruned-cand.safetensors");
  ASSERT_EQ(run_cli(import_args("llama-gqa", ec, out2)).code, 0);
  b = run_cli({"bisect", "--model", model, out2, "--json"});
  ASSERT_EQ(b.code, 1) << b.error;
  const nlohmann::json j = nlohmann::json::parse(b.out);
  EXPECT_EQ(j["localised_at"], "step0.layers.0.mlp.act") << b.out.substr(0, 2000);
  EXPECT_EQ(j["diagnosis"]["bug"], "gate-up-swap") << j["diagnosis"].dump();
}

// The user's path end to end: an engine with a bug, its llama.cpp-style
// export imported, then bisected: localised at the RoPE and named.
TEST(CliImport, ImportedCandidateWithABugIsBisectedAndNamed) {
  const std::string model = testing::golden_model("llama-gqa");
  const std::string cand = testing::temp_path("imp-cand.safetensors");
  const auto d = run_cli({"dump", "--engine", "impl", "--inject", "rope-interleaved", "--model", model, "--tokens",
                          "215,379,300,280,301", "--decode", "3", "--out", cand});
  ASSERT_EQ(d.code, 0) << d.error;
  const Exported e = export_llama_cpp("llama-gqa", cand, "lc-cand", {});
  const std::string out = testing::temp_path("imported-cand.safetensors");
  ASSERT_EQ(run_cli(import_args("llama-gqa", e, out)).code, 0);
  const auto b = run_cli({"bisect", "--model", model, out, "--json"});
  ASSERT_EQ(b.code, 1) << b.error << b.out;
  const nlohmann::json j = nlohmann::json::parse(b.out);
  EXPECT_EQ(j["localised_at"], "step0.layers.0.attn.q_rope") << b.out.substr(0, 2000);
  EXPECT_EQ(j["diagnosis"]["bug"], "rope-interleaved") << j["diagnosis"].dump();
}

// Errors name the file, the tensor and the rule.
TEST(CliImport, MismatchedShapesAndMissingTokensAreErrorsNamingTheRule) {
  const std::string golden = testing::golden_dump("llama-gqa", "prefill");
  const Exported e = export_llama_cpp("llama-gqa", golden, "lc-err", {});
  // Another model's config: the shapes do not fit.
  auto r = run_cli(import_args("qwen3-qknorm", e, testing::temp_path("x.safetensors")));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("step0.safetensors"), std::string::npos) << r.error;
  EXPECT_NE(r.error.find("llama.cpp (bundled) rule"), std::string::npos) << r.error;
  // No tokens and no rule for them.
  std::vector<std::string> a = import_args("llama-gqa", e, testing::temp_path("y.safetensors"));
  a.erase(a.begin() + 5, a.begin() + 7);
  r = run_cli(a);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("no tokens"), std::string::npos) << r.error;
  EXPECT_FALSE(std::filesystem::exists(testing::temp_path("y.safetensors")));
}

}  // namespace
}  // namespace llmdiff
