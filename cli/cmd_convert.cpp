// llmdiff convert: an HF checkpoint written as GGUF, quantised the way
// llama.cpp's llama-quantize does (without an importance matrix), so that a
// quantised engine can be checked against the exact function of its weights
// and the quantisation error measured against the source.
#include <fmt/core.h>

#include <map>

#include "cli/commands.h"
#include "dumps/base/errors.h"
#include "dumps/model/gguf_model.h"
#include "dumps/model/weights.h"

namespace llmdiff::cli {

namespace {

struct ConvertOptions {
  std::string model;        // --model: HF model directory
  std::string out;          // --out FILE.gguf
  std::string type = "F16";  // --type: ggml type of the matrices
};

int run_convert(const ConvertOptions& o) {
  const GgmlType type = parse_ggml_type(o.type);
  const Model m = Model::load(o.model);
  const std::vector<std::string> written = write_gguf(*m.weights, o.out, type);
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
      "convert", "Write an HF checkpoint as GGUF (llama.cpp's names and q/k row order), matrices quantised to --type");
  sub->add_option("--model", opt->model, "HF model directory (config.json + safetensors)")->required();
  sub->add_option("--out", opt->out, "Output GGUF file")->required();
  sub->add_option("--type", opt->type,
                  "ggml type of the 2-D weights: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, "
                  "Q6_K (1-D weights stay F32; rows not a whole number of blocks fall back as llama-quantize does)")
      ->capture_default_str();
  sub->callback([opt, &action] { action = [opt] { return run_convert(*opt); }; });
}

}  // namespace llmdiff::cli
