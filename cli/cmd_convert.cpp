// llmdiff convert: an HF checkpoint written as GGUF, quantised the way
// llama.cpp's llama-quantize does (without an importance matrix), so that a
// quantised engine can be checked against the exact function of its weights
// and the quantisation error measured against the source.
#include <fmt/core.h>

#include <map>

#include "cli/commands.h"
#include "dumps/base/errors.h"
#include "dumps/model/gguf_export.h"
#include "dumps/model/weights.h"

namespace llmdiff::cli {

namespace {

struct ConvertOptions {
  std::string model;        // --model: HF model directory
  std::string out;          // --out FILE.gguf
  std::string type = "F16";  // --type: ggml type of the matrices, or a llama-quantize mixture
  std::string kv_b = "split";  // --kv-b: an MLA model's kv_b split (attn_k_b + attn_v_b) or joint (attn_kv_b)
};

int run_convert(const ConvertOptions& o) {
  GgufExportOptions eo;
  eo.quant = GgufQuant::parse(o.type);
  if (o.kv_b != "split" && o.kv_b != "joint") throw UsageError("convert: --kv-b must be split or joint, not '" + o.kv_b + "'");
  eo.kv_b_joint = o.kv_b == "joint";
  const Model m = Model::load(o.model);
  const std::vector<std::string> written = write_gguf(*m.weights, o.out, eo);
  std::map<std::string, int> by_type;
  for (const std::string& w : written) ++by_type[w.substr(w.rfind(' ') + 1)];
  std::string types;
  for (const auto& [t, n] : by_type) types += (types.empty() ? "" : ", ") + std::to_string(n) + " " + t;
  fmt::print("{}: {} tensors ({})\n", o.out, written.size(), types);
  return 0;
}

}  // namespace

void setup_convert(CLI::App& app, Action& action) {
  auto opt = std::make_shared<ConvertOptions>();
  CLI::App* sub = app.add_subcommand(
      "convert", "Write an HF checkpoint as GGUF (llama.cpp's names, merged experts, q/k row order, MLA kv_b), matrices quantised to --type");
  sub->add_option("--model", opt->model, "HF model directory (config.json + safetensors)")->required();
  sub->add_option("--out", opt->out, "Output GGUF file")->required();
  sub->add_option("--type", opt->type,
                  "ggml type of every matrix: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, "
                  "Q6_K (as llama-quantize --pure), or llama-quantize's per-tensor mixture: Q3_K_S, Q3_K_M, Q3_K_L, "
                  "Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M (1-D weights and routers stay F32; rows not a whole number of blocks "
                  "fall back as llama-quantize does)")
      ->capture_default_str();
  sub->add_option("--kv-b", opt->kv_b,
                  "MLA models: split (attn_k_b + attn_v_b, llama.cpp's converter for the absorbed form) or joint "
                  "(attn_kv_b, its earlier converters)")
      ->capture_default_str();
  sub->callback([opt, &action] { action = [opt] { return run_convert(*opt); }; });
}

}  // namespace llmdiff::cli
