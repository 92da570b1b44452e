// llmdiff inspect PATH: a dump, a safetensors file, a model directory or a GGUF model.
// Prints the manifest or config, then one line per tensor in canonical order
// with its statistics. --json prints the same as JSON.
#include <fmt/core.h>
#include <sys/stat.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "dumps/contract/dump.h"
#include "dumps/formats/gguf.h"
#include "dumps/model/gguf_model.h"
#include "dumps/model/weights.h"

namespace llmdiff::cli {

struct InspectOptions {
  std::string path;
  bool json = false;
};

namespace {

struct TensorStats {
  std::string name, dtype;
  Shape shape;
  double min = 0, max = 0, mean = 0, std = 0;
  int64_t nan = 0, inf = 0, finite = 0;
};

// Statistics over the finite values of n elements of type t (double accumulation).
TensorStats tensor_stats(const std::string& name, DType t, const Shape& shape, const void* data) {
  TensorStats s;
  s.name = name;
  s.dtype = dtype_name(t);
  s.shape = shape;
  const size_t n = size_t(numel(shape));
  double lo = std::numeric_limits<double>::infinity(), hi = -lo, sum = 0, sumsq = 0;
  for (size_t i = 0; i < n; ++i) {
    double v = load_as_double(data, t, i);
    if (std::isnan(v)) { ++s.nan; continue; }
    if (std::isinf(v)) { ++s.inf; continue; }
    ++s.finite;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    sum += v;
  }
  if (s.finite > 0) {
    s.min = lo;
    s.max = hi;
    s.mean = sum / double(s.finite);
    for (size_t i = 0; i < n; ++i) {
      double v = load_as_double(data, t, i);
      if (std::isfinite(v)) sumsq += (v - s.mean) * (v - s.mean);
    }
    s.std = std::sqrt(sumsq / double(s.finite));
  }
  return s;
}

nlohmann::ordered_json stats_json(const TensorStats& s) {
  nlohmann::ordered_json j;
  j["name"] = s.name;
  j["dtype"] = s.dtype;
  j["shape"] = s.shape;
  j["min"] = s.min;
  j["max"] = s.max;
  j["mean"] = s.mean;
  j["std"] = s.std;
  j["nan"] = s.nan;
  j["inf"] = s.inf;
  return j;
}

void print_table(const std::vector<TensorStats>& rows) {
  size_t w = 4;
  for (const auto& r : rows) w = std::max(w, r.name.size());
  fmt::print("{:<{}}  {:<4}  {:<16}  {:>12}  {:>12}  {:>12}  {:>12}  {:>5}  {:>5}\n", "name", w, "type", "shape", "min",
             "max", "mean", "std", "nan", "inf");
  for (const auto& r : rows)
    fmt::print("{:<{}}  {:<4}  {:<16}  {:>12.5g}  {:>12.5g}  {:>12.5g}  {:>12.5g}  {:>5}  {:>5}\n", r.name, w, r.dtype,
               shape_str(r.shape), r.min, r.max, r.mean, r.std, r.nan, r.inf);
}

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

nlohmann::ordered_json config_json(const ModelConfig& c) {
  nlohmann::ordered_json j;
  j["model_type"] = c.model_type;
  j["family"] = family_name(c.family);
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["rope_type"] = rope_type_name(c.rope_scaling.type);
  j["rope_factor"] = c.rope_scaling.factor;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["qkv_bias"] = c.qkv_bias;
  j["o_bias"] = c.o_bias;
  j["qk_norm"] = c.qk_norm;
  j["sliding_window"] = c.sliding_window;
  j["torch_dtype"] = c.torch_dtype;
  return j;
}

// A GGUF metadata value for display: scalars as they are, arrays by element
// type and length (a vocabulary has tens of thousands of entries).
nlohmann::ordered_json gguf_value_json(const GgufValue& v) {
  using T = GgufValue::Type;
  if (v.is_array()) return "array of " + std::to_string(v.array_size());
  if (v.type == T::String) return v.s;
  if (v.type == T::Bool) return v.i != 0;
  if (v.is_float()) return v.f;
  return v.i;
}

int run_inspect(const InspectOptions& o) {
  nlohmann::ordered_json out;
  std::vector<TensorStats> rows;
  if (is_gguf_file(o.path)) {
    Model m = Model::load(o.path);  // validates the metadata and every weight
    const GgufFile& g = *m.weights->gguf();
    out["kind"] = "gguf-model";
    out["path"] = o.path;
    out["config"] = config_json(m.config);
    out["weight_bytes"] = m.weights->total_bytes();
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    meta["version"] = g.version();
    for (const auto& [k, v] : g.metadata()) meta[k] = gguf_value_json(v);
    out["metadata"] = meta;
    for (const GgufTensorInfo& t : g.tensors()) {
      const std::vector<float> values = g.to_f32(t);  // dequantised
      TensorStats s = tensor_stats(t.name, DType::F32, t.shape(), values.data());
      s.dtype = ggml_type_name(uint32_t(t.type));
      rows.push_back(s);
    }
  } else if (is_dir(o.path)) {
    Model m = Model::load(o.path);  // validates config and every weight
    out["kind"] = "model";
    out["path"] = o.path;
    out["config"] = config_json(m.config);
    out["weight_bytes"] = m.weights->total_bytes();
    for (const auto& f : m.weights->files())
      for (const auto& t : f->tensors()) rows.push_back(tensor_stats(t.name, t.dtype, t.shape, f->data(t)));
    std::stable_sort(rows.begin(), rows.end(),
                     [](const TensorStats& a, const TensorStats& b) { return NameOrder{}(a.name, b.name); });
  } else {
    DumpFile d(o.path);
    out["kind"] = d.is_llm_dump() ? "llm-dump" : "safetensors";
    out["path"] = o.path;
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : d.file().metadata()) meta[k] = v;
    out["metadata"] = meta;
    for (const auto& name : d.names()) {
      const TensorInfo& t = d.file().at(name);
      rows.push_back(tensor_stats(name, t.dtype, t.shape, d.file().data(t)));
    }
  }
  if (o.json) {
    out["tensors"] = nlohmann::ordered_json::array();
    for (const auto& r : rows) out["tensors"].push_back(stats_json(r));
    fmt::print("{}\n", out.dump(2));
    return 0;
  }
  fmt::print("{} {}\n", out["kind"].get<std::string>(), o.path);
  if (out.contains("config")) {
    for (auto it = out["config"].begin(); it != out["config"].end(); ++it)
      fmt::print("  {:<24} {}\n", it.key(), it.value().dump());
    fmt::print("  {:<24} {}\n", "weight_bytes", out["weight_bytes"].dump());
    if (out.contains("metadata")) {
      fmt::print("GGUF metadata\n");
      for (auto it = out["metadata"].begin(); it != out["metadata"].end(); ++it)
        fmt::print("  {:<40} {}\n", it.key(), it.value().is_string() ? it.value().get<std::string>() : it.value().dump());
    }
  } else {
    for (auto it = out["metadata"].begin(); it != out["metadata"].end(); ++it) {
      std::string v = it.value().get<std::string>();
      if (it.key() == "config" && v.size() > 60) {
        // Print the config compactly on one line.
        try {
          v = nlohmann::json::parse(v).dump();
        } catch (const std::exception&) {
        }
      }
      fmt::print("  {:<10} {}\n", it.key(), v);
    }
  }
  fmt::print("{} tensors\n", rows.size());
  print_table(rows);
  return 0;
}

}  // namespace

void setup_inspect(CLI::App& app, Action& action) {
  auto opt = std::make_shared<InspectOptions>();
  CLI::App* sub = app.add_subcommand("inspect", "Show the manifest/config and per-tensor statistics of a dump, "
                                                "a safetensors file, a model directory or a GGUF model");
  sub->add_option("path", opt->path, "dump, safetensors file, HF model directory or GGUF file")->required();
  sub->add_flag("--json", opt->json, "print JSON instead of a table");
  sub->callback([opt, &action] { action = [opt] { return run_inspect(*opt); }; });
}

}  // namespace llmdiff::cli
