// llmdiff import --model DIR --mapping MAP --out DUMP INPUT...: an engine's own
// tensors (safetensors, .npz, a directory of .npy) as an llm-dump/1 file,
// through a mapping file or a bundled mapping (dumps/import/import.h, docs/IMPORT.md).
#include <fmt/core.h>

#include <filesystem>

#include "cli/commands.h"
#include "cli/common.h"
#include "dumps/model/config.h"
#include "dumps/base/errors.h"
#include "dumps/import/import.h"

namespace llmdiff::cli {

namespace {

struct ImportCliOptions {
  std::string model;                // --model: the model the engine ran (config.json)
  std::string mapping;              // --mapping: a JSON/TOML file or a bundled name
  std::vector<std::string> inputs;  // the engine's files, one per forward call unless the rules capture {step}
  std::string out;                  // --out
  std::string tokens;               // --tokens "1,2,3;4;5": each forward call's input ids
  std::string dtype = "float32";    // --dtype: the engine's compute dtype
  std::string producer;             // --producer
  std::string precision;            // --precision: the engine's designed roundings
  bool quiet = false;
};

// "1,2,3;4;5" -> {{1,2,3},{4},{5}}.
std::vector<std::vector<int64_t>> parse_steps(const std::string& text) {
  std::vector<std::vector<int64_t>> out;
  if (text.empty()) return out;
  size_t at = 0;
  for (;;) {
    const size_t e = text.find(';', at);
    out.push_back(parse_int_list(text.substr(at, e == std::string::npos ? std::string::npos : e - at), "--tokens"));
    if (e == std::string::npos) break;
    at = e + 1;
  }
  return out;
}

int run_import(const ImportCliOptions& o) {
  if (o.dtype != "float32" && o.dtype != "bfloat16" && o.dtype != "float16")
    throw UsageError("--dtype " + o.dtype + ": float32, bfloat16 or float16");
  const ModelConfig cfg = load_config(o.model);
  const import::Mapping mapping = import::Mapping::load(o.mapping);
  import::ImportOptions io;
  io.tokens = parse_steps(o.tokens);
  io.dtype = o.dtype;
  io.producer = o.producer;
  io.precision = o.precision;
  io.model_name = std::filesystem::path(o.model).filename().string();
  if (io.model_name.empty()) io.model_name = std::filesystem::path(o.model).parent_path().filename().string();
  MemoryDump dump("import");
  dump.spill();
  const import::ImportSummary s = import::import_tensors(o.inputs, mapping, cfg, io, dump);
  dump.save(o.out);
  fmt::print("{}: {} tensors, {} forward call(s), from {} input(s) with mapping {}\n", o.out, s.tensors, s.steps,
             o.inputs.size(), mapping.source);
  if (o.quiet) return 0;
  auto some = [](const std::vector<std::string>& v) {
    std::string t;
    for (size_t k = 0; k < v.size() && k < 8; ++k) t += (k ? ", " : "") + v[k];
    return t + (v.size() > 8 ? ", ..." : "");
  };
  if (!s.unmatched_rules.empty())
    fmt::print("  {} rule(s) matched no tensor: {}\n", s.unmatched_rules.size(), some(s.unmatched_rules));
  if (!s.skipped.empty()) {
    fmt::print("  {} match(es) skipped:\n", s.skipped.size());
    for (size_t k = 0; k < s.skipped.size() && k < 8; ++k) fmt::print("    {}\n", s.skipped[k]);
    if (s.skipped.size() > 8) fmt::print("    ...\n");
  }
  if (!s.unmapped.empty())
    fmt::print("  {} input tensor(s) not imported (no rule, not in the mapping's ignore list): {}\n",
               s.unmapped.size(), some(s.unmapped));
  return 0;
}

}  // namespace

void setup_import(CLI::App& app, Action& action) {
  auto opt = std::make_shared<ImportCliOptions>();
  CLI::App* sub = app.add_subcommand(
      "import", "Convert an engine's own tensors (safetensors, .npz, a directory of .npy) into an llm-dump/1 file "
                "with a mapping (docs/IMPORT.md)");
  sub->add_option("inputs", opt->inputs,
                  "The engine's files: one per forward call in order, or any number when the mapping captures {step}")
      ->required();
  sub->add_option("--model", opt->model, "The model the engine ran: HF model directory or GGUF file")->required();
  sub->add_option("--mapping", opt->mapping, "Mapping file (JSON or TOML) or a bundled mapping: llama.cpp")
      ->required();
  sub->add_option("--out", opt->out, "Output dump (written atomically)")->required();
  sub->add_option("--tokens", opt->tokens,
                  "Input ids of each forward call, calls separated by ';' (\"1,2,3;4;5\"); "
                  "needed unless a rule maps the tokens");
  sub->add_option("--dtype", opt->dtype, "The engine's compute dtype: float32, bfloat16, float16")
      ->capture_default_str();
  sub->add_option("--producer", opt->producer, "Manifest producer text (default: llmdiff import and the mapping)");
  sub->add_option("--precision", opt->precision,
                  "The engine's designed roundings for the manifest (e.g. kv_cache=f16 for llama.cpp's default "
                  "float16 cache; see dump --precision)");
  sub->add_flag("--quiet", opt->quiet, "Print only the summary line");
  sub->callback([opt, &action] { action = [opt] { return run_import(*opt); }; });
}

}  // namespace llmdiff::cli
