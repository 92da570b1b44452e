// llmdiff synth: writes an HF checkpoint with random weights of a real model's
// shapes (a preset or a given config.json), streamed tensor by tensor.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "synth/synth.h"
#include "synth/tokenizer.h"
#include "dumps/base/errors.h"
#include "dumps/model/gguf_export.h"
#include "dumps/model/gguf_model.h"
#include "dumps/model/weights.h"

namespace llmdiff::cli {

using namespace synth;

namespace {

struct SynthCmdOptions {
  std::string preset;           // --preset NAME
  std::string config;           // --config FILE (a config.json or a model directory)
  std::string dtype;            // --dtype; empty: the config's torch_dtype
  uint64_t seed = 0;            // --seed
  std::string out;              // --out DIR
  std::string shard_size = "2GB";
  int threads = 0;              // 0: all cores
  bool list = false;            // --list-presets
  bool force = false;           // --force: replace a checkpoint synth did not write
  int layers = 0;               // --layers N: override num_hidden_layers (0: the config's)
  std::string format = "safetensors";  // --format safetensors|gguf
  std::string quant;            // --quant TYPE: ggml type or mixture of a GGUF's matrices (default: --dtype's)
  std::string kv_b = "split";   // --kv-b split|joint: an MLA model's kv_b in the GGUF
  std::string tokenizer;        // --tokenizer sentencepiece|byte-level: toy tokenizer files too
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(path, "cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw IoError(path, "read failed");
  return ss.str();
}

// 1.10 G, 15.5 M, 830 K (decimal units).
std::string scaled(double v, const char* unit) {
  const char* prefix[] = {"", "K", "M", "G", "T"};
  int i = 0;
  while (v >= 1000.0 && i < 4) {
    v /= 1000.0;
    ++i;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, v >= 100.0 || i == 0 ? "%.0f %s%s" : "%.2f %s%s", v, prefix[i], unit);
  return buf;
}

int run_synth(const SynthCmdOptions& o) {
  if (o.list) {
    for (const auto& p : synth_presets()) std::printf("%-16s %s\n", p.name.c_str(), p.description.c_str());
    return 0;
  }
  if (o.preset.empty() == o.config.empty()) throw UsageError("synth: give exactly one of --preset or --config");
  if (o.out.empty()) throw UsageError("synth: --out DIR is required");

  SynthOptions so;
  if (!o.preset.empty()) {
    so.config_json = synth_preset_config(o.preset);
    so.config_source = "preset " + o.preset;
  } else {
    std::string path = o.config;
    std::ifstream probe(path + "/config.json");
    if (probe) path += "/config.json";
    so.config_json = read_text(path);
    so.config_source = path;
  }
  if (o.layers > 0) {
    // The same shapes with fewer (or more) decoder layers: real-size layers
    // of a model too large to write whole.
    nlohmann::json cj = nlohmann::json::parse(so.config_json);
    cj["num_hidden_layers"] = o.layers;
    if (cj.contains("max_window_layers")) cj["max_window_layers"] = o.layers;
    so.config_json = cj.dump(2);
    so.config_source += " with " + std::to_string(o.layers) + " layers";
  }
  const ModelConfig given = parse_config(so.config_json, so.config_source);
  so.dtype = parse_storage_dtype(o.dtype.empty() ? given.torch_dtype : o.dtype);
  so.seed = o.seed;
  so.shard_size = parse_byte_size(o.shard_size);
  so.threads = o.threads;
  so.force = o.force;

  if (o.format != "safetensors" && o.format != "gguf")
    throw UsageError("synth: --format must be safetensors or gguf, not '" + o.format + "'");
  if (!o.quant.empty() && o.format != "gguf") throw UsageError("synth: --quant needs --format gguf");
  if (o.kv_b != "split" && o.kv_b != "joint") throw UsageError("synth: --kv-b must be split or joint, not '" + o.kv_b + "'");
  if (!o.tokenizer.empty() && o.format == "gguf")
    throw UsageError("synth: --tokenizer writes HF tokenizer files beside a safetensors checkpoint, not into a GGUF");
  const std::optional<TokenizerKind> tokenizer =
      o.tokenizer.empty() ? std::nullopt : std::optional<TokenizerKind>(parse_tokenizer_kind(o.tokenizer));
  const bool gguf = o.format == "gguf";
  // A GGUF is converted from a checkpoint written next to it, then removed.
  const std::string hf_dir = gguf ? o.out + ".hf-tmp" : o.out;
  const auto t0 = std::chrono::steady_clock::now();
  if (gguf) so.force = true;
  const SynthResult r = write_synth_checkpoint(hf_dir, so);
  if (gguf) {
    GgufExportOptions eo;
    eo.quant = GgufQuant::parse(!o.quant.empty() ? o.quant : dtype_name(so.dtype));
    eo.kv_b_joint = o.kv_b == "joint";
    {
      const Model m = Model::load(hf_dir);
      write_gguf(*m.weights, o.out, eo);
    }
    std::error_code ec;
    std::filesystem::remove_all(hf_dir, ec);
    std::printf("%s: GGUF, matrices %s\n", o.out.c_str(), eo.quant.name().c_str());
  }
  std::vector<std::string> tokenizer_files;
  if (tokenizer) tokenizer_files = write_toy_tokenizer(o.out, nlohmann::json::parse(r.config.raw_json), *tokenizer);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const ModelConfig& c = r.config;
  std::printf("%s: %s, %lld layers, hidden %lld, intermediate %lld, heads %lld/%lld x %lld, vocab %lld%s\n",
              o.out.c_str(), c.model_type.c_str(), (long long)c.num_hidden_layers, (long long)c.hidden_size,
              (long long)c.intermediate_size, (long long)c.num_attention_heads, (long long)c.num_key_value_heads,
              (long long)c.head_dim, (long long)c.vocab_size, c.tie_word_embeddings ? ", tied embeddings" : "");
  std::printf("wrote %zu tensors, %s parameters, %s %s in %zu file%s, seed %llu (%.1f s, %.0f MB/s)\n", r.tensors,
              scaled(double(r.parameters), "").c_str(), scaled(double(r.data_bytes), "B").c_str(),
              dtype_name(so.dtype), r.files.size(), r.files.size() == 1 ? "" : "s", (unsigned long long)so.seed, secs,
              secs > 0 ? double(r.data_bytes) * 1e-6 / secs : 0.0);
  if (!tokenizer_files.empty()) {
    std::string list;
    for (const auto& f : tokenizer_files) list += (list.empty() ? "" : ", ") + f;
    std::printf("tokenizer (%s, %lld tokens): %s\n", o.tokenizer.c_str(), (long long)c.vocab_size, list.c_str());
  }
  return 0;
}

}  // namespace

void setup_synth(CLI::App& app, Action& action) {
  auto opt = std::make_shared<SynthCmdOptions>();
  CLI::App* sub = app.add_subcommand(
      "synth", "Write an HF checkpoint (config.json + safetensors) with random weights of a real model's shapes");
  sub->add_option("--preset", opt->preset, "Model shapes: tinyllama-1.1b, llama-3.2-1b, qwen3-0.6b, qwen2.5-1.5b, ... "
                                           "(see --list-presets)");
  sub->add_option("--config", opt->config, "A config.json (or a model directory holding one) to take the shapes from");
  sub->add_option("--dtype", opt->dtype, "Weight dtype f32|bf16|f16 (default: the config's torch_dtype)");
  sub->add_option("--seed", opt->seed, "Random seed (same seed, same bytes)")->capture_default_str();
  sub->add_option("--out", opt->out, "Output directory");
  sub->add_option("--shard-size", opt->shard_size,
                  "Most tensor bytes per safetensors file (e.g. 2GB, 500MB); more than one file gives "
                  "model-0000k-of-0000n.safetensors + model.safetensors.index.json")
      ->capture_default_str();
  sub->add_option("--threads", opt->threads, "Generator threads (0: all cores)")->capture_default_str();
  sub->add_option("--layers", opt->layers,
                  "Decoder layers to write instead of the config's (real-size layers of a model too large to write "
                  "whole, e.g. --preset llama-3.1-70b --layers 2)")
      ->check(CLI::PositiveNumber);
  sub->add_option("--format", opt->format,
                  "safetensors (an HF directory in --out) or gguf (a GGUF file in --out, llama.cpp's names)")
      ->capture_default_str();
  sub->add_option("--quant", opt->quant,
                  "GGUF only: ggml type of the matrices, e.g. Q4_K, Q8_0, Q6_K, or llama-quantize's mixture Q4_K_M, "
                  "Q5_K_M, Q3_K_S, ... (default: --dtype); 1-D weights and routers stay F32");
  sub->add_option("--kv-b", opt->kv_b,
                  "GGUF of an MLA model: split (attn_k_b + attn_v_b, llama.cpp's absorbed form) or joint (attn_kv_b)")
      ->capture_default_str();
  sub->add_option("--tokenizer", opt->tokenizer,
                  "Also write a toy tokenizer of the config's vocab_size and special ids: sentencepiece "
                  "(tokenizer.model + tokenizer.json, as Llama 2) or byte-level (tokenizer.json, as GPT-2/Llama 3/Qwen), "
                  "with tokenizer_config.json and special_tokens_map.json");
  sub->add_flag("--list-presets", opt->list, "List the presets and exit");
  sub->add_flag("--force", opt->force, "Replace a checkpoint in --out that synth did not write");
  sub->callback([opt, &action] { action = [opt] { return run_synth(*opt); }; });
}

}  // namespace llmdiff::cli
