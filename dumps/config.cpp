#include "dumps/config.h"

#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <sys/stat.h>

#include "dumps/errors.h"

namespace llmdiff {

using json = nlohmann::json;

const char* family_name(Family f) {
  switch (f) {
    case Family::Llama: return "llama";
    case Family::Qwen2: return "qwen2";
    case Family::Qwen3: return "qwen3";
  }
  return "?";
}

const char* rope_type_name(RopeScaling::Type t) {
  switch (t) {
    case RopeScaling::Type::Default: return "default";
    case RopeScaling::Type::Linear: return "linear";
    case RopeScaling::Type::Dynamic: return "dynamic";
    case RopeScaling::Type::Llama3: return "llama3";
    case RopeScaling::Type::Yarn: return "yarn";
  }
  return "?";
}

const char* compute_dtype_name(ComputeDType d) {
  switch (d) {
    case ComputeDType::Float32: return "float32";
    case ComputeDType::BFloat16: return "bfloat16";
    case ComputeDType::Float16: return "float16";
    case ComputeDType::Float64: return "float64";
  }
  return "?";
}

ComputeDType parse_compute_dtype(const std::string& s) {
  if (s == "float32" || s == "f32" || s == "fp32" || s == "float") return ComputeDType::Float32;
  if (s == "bfloat16" || s == "bf16") return ComputeDType::BFloat16;
  if (s == "float16" || s == "f16" || s == "fp16" || s == "half") return ComputeDType::Float16;
  if (s == "float64" || s == "f64" || s == "fp64" || s == "double") return ComputeDType::Float64;
  throw UsageError("unknown dtype '" + s + "' (supported: float32, bfloat16, float16, float64)");
}

ComputeDType ModelConfig::default_dtype() const { return parse_compute_dtype(torch_dtype); }

namespace {

struct Reader {
  const json& j;
  const std::string& src;

  bool present(const char* key) const { return j.contains(key) && !j[key].is_null(); }
  [[noreturn]] void fail(const std::string& what) const { throw ConfigError(src, what); }

  int64_t get_int(const char* key, std::optional<int64_t> dflt, int64_t min_value = 1) const {
    if (!present(key)) {
      if (dflt) return *dflt;
      fail(std::string("missing required field '") + key + "'");
    }
    const json& v = j[key];
    if (!v.is_number_integer()) fail(std::string("field '") + key + "' must be an integer, got " + v.dump());
    int64_t x = v.get<int64_t>();
    if (x < min_value) fail(std::string("field '") + key + "' must be >= " + std::to_string(min_value) + ", got " + v.dump());
    return x;
  }
  double get_num(const char* key, double dflt, bool positive = true) const {
    if (!present(key)) return dflt;
    const json& v = j[key];
    if (!v.is_number()) fail(std::string("field '") + key + "' must be a number, got " + v.dump());
    double x = v.get<double>();
    if (positive && !(x > 0)) fail(std::string("field '") + key + "' must be > 0, got " + v.dump());
    return x;
  }
  bool get_bool(const char* key, bool dflt) const {
    if (!present(key)) return dflt;
    if (!j[key].is_boolean()) fail(std::string("field '") + key + "' must be true or false, got " + j[key].dump());
    return j[key].get<bool>();
  }
  std::string get_str(const char* key, const std::string& dflt) const {
    if (!present(key)) return dflt;
    if (!j[key].is_string()) fail(std::string("field '") + key + "' must be a string, got " + j[key].dump());
    return j[key].get<std::string>();
  }
};

RopeScaling parse_rope_scaling(const json& rs, const std::string& src) {
  RopeScaling out;
  if (rs.is_null()) return out;
  if (!rs.is_object()) throw ConfigError(src, "rope_scaling must be an object or null, got " + rs.dump());
  Reader r{rs, src};
  std::string type = r.get_str("rope_type", r.get_str("type", ""));
  if (type.empty()) throw ConfigError(src, "rope_scaling lacks 'rope_type' (or legacy 'type')");
  auto need = [&](const char* key) {
    if (!r.present(key)) throw ConfigError(src, "rope_scaling of type '" + type + "' requires '" + key + "'");
  };
  if (type == "default") {
    out.type = RopeScaling::Type::Default;
  } else if (type == "linear" || type == "dynamic") {
    out.type = type == "linear" ? RopeScaling::Type::Linear : RopeScaling::Type::Dynamic;
    need("factor");
    out.factor = r.get_num("factor", 1.0);
  } else if (type == "llama3") {
    out.type = RopeScaling::Type::Llama3;
    for (const char* k : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) need(k);
    out.factor = r.get_num("factor", 1.0);
    out.low_freq_factor = r.get_num("low_freq_factor", 1.0);
    out.high_freq_factor = r.get_num("high_freq_factor", 4.0);
    out.original_max_position_embeddings = r.get_int("original_max_position_embeddings", std::nullopt);
    if (out.high_freq_factor <= out.low_freq_factor)
      throw ConfigError(src, "rope_scaling llama3: high_freq_factor must exceed low_freq_factor");
  } else if (type == "yarn") {
    out.type = RopeScaling::Type::Yarn;
    need("factor");
    out.factor = r.get_num("factor", 1.0);
    out.beta_fast = r.get_num("beta_fast", 32.0);
    out.beta_slow = r.get_num("beta_slow", 1.0);
    out.mscale = r.get_num("mscale", 0.0, false);
    out.mscale_all_dim = r.get_num("mscale_all_dim", 0.0, false);
    out.has_attention_factor = r.present("attention_factor");
    out.attention_factor = r.get_num("attention_factor", 0.0);
    out.original_max_position_embeddings = r.get_int("original_max_position_embeddings", 0);
  } else {
    throw ConfigError(src, "unsupported rope_scaling type '" + type +
                               "' (supported: default, linear, dynamic, llama3, yarn)");
  }
  return out;
}

}  // namespace

ModelConfig parse_config(const std::string& text, const std::string& src) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw ConfigError(src, std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object()) throw ConfigError(src, "config must be a JSON object");
  Reader r{j, src};
  ModelConfig c;
  c.source = src;
  c.raw_json = text;
  c.model_type = r.get_str("model_type", "");
  if (c.model_type == "llama" || c.model_type == "mistral") c.family = Family::Llama;
  else if (c.model_type == "qwen2") c.family = Family::Qwen2;
  else if (c.model_type == "qwen3") c.family = Family::Qwen3;
  else
    throw ConfigError(src, "unsupported model_type '" + c.model_type + "' (supported: llama, mistral, qwen2, qwen3)");

  c.hidden_size = r.get_int("hidden_size", std::nullopt);
  c.intermediate_size = r.get_int("intermediate_size", std::nullopt);
  c.num_hidden_layers = r.get_int("num_hidden_layers", std::nullopt);
  c.num_attention_heads = r.get_int("num_attention_heads", std::nullopt);
  c.num_key_value_heads = r.get_int("num_key_value_heads", c.num_attention_heads);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    throw ConfigError(src, "num_attention_heads (" + std::to_string(c.num_attention_heads) +
                               ") must be a multiple of num_key_value_heads (" + std::to_string(c.num_key_value_heads) + ")");
  // Every family's attention reads config.head_dim when config.json has it
  // (Qwen2Attention inherits LlamaAttention's getattr in transformers 4.51).
  if (r.present("head_dim")) {
    c.head_dim = r.get_int("head_dim", std::nullopt);
  } else {
    if (c.hidden_size % c.num_attention_heads != 0)
      throw ConfigError(src, "hidden_size must be a multiple of num_attention_heads when head_dim is not given");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.head_dim % 2 != 0) throw ConfigError(src, "head_dim must be even for RoPE, got " + std::to_string(c.head_dim));
  c.vocab_size = r.get_int("vocab_size", std::nullopt);
  const int64_t default_max_pos = c.family == Family::Llama ? (c.model_type == "mistral" ? 4096 * 32 : 2048) : 32768;
  c.max_position_embeddings = r.get_int("max_position_embeddings", default_max_pos);
  c.rms_norm_eps = r.get_num("rms_norm_eps", 1e-6);
  c.rope_theta = r.get_num("rope_theta", 10000.0);
  c.rope_scaling = parse_rope_scaling(j.contains("rope_scaling") ? j["rope_scaling"] : json(), src);
  c.tie_word_embeddings = r.get_bool("tie_word_embeddings", false);
  c.attention_bias = r.get_bool("attention_bias", false);
  c.qkv_bias = c.family == Family::Qwen2 ? true : c.attention_bias;
  c.o_bias = c.family == Family::Qwen2 ? false : c.attention_bias;
  c.qk_norm = c.family == Family::Qwen3;
  if (c.family == Family::Qwen2 || c.family == Family::Qwen3 || c.model_type == "mistral")
    // The config classes default to 4096 when the key is absent; null means none.
    c.sliding_window = !j.contains("sliding_window") ? 4096
                       : j["sliding_window"].is_null() ? 0
                                                        : r.get_int("sliding_window", std::nullopt);

  const std::string act = r.get_str("hidden_act", "silu");
  if (act != "silu") throw ConfigError(src, "unsupported hidden_act '" + act + "' (supported: silu)");
  if (r.get_bool("mlp_bias", false)) throw ConfigError(src, "unsupported mlp_bias = true (supported: false)");
  if (r.present("partial_rotary_factor") && r.get_num("partial_rotary_factor", 1.0) != 1.0)
    throw ConfigError(src, "unsupported partial_rotary_factor " + j["partial_rotary_factor"].dump() + " (supported: 1.0)");
  if (r.get_int("pretraining_tp", 1) != 1)
    throw ConfigError(src, "unsupported pretraining_tp " + j["pretraining_tp"].dump() + " (supported: 1)");
  c.torch_dtype = r.get_str("torch_dtype", "float32");
  if (c.torch_dtype != "float32" && c.torch_dtype != "bfloat16" && c.torch_dtype != "float16")
    throw ConfigError(src, "unsupported torch_dtype '" + c.torch_dtype + "' (supported: float32, bfloat16, float16)");
  return c;
}

ModelConfig load_config(const std::string& path) {
  struct stat st {};
  std::string file = path;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) file = path + "/config.json";
  std::ifstream in(file, std::ios::binary);
  if (!in) throw IoError(file, "cannot open config.json");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_config(ss.str(), file);
}

}  // namespace llmdiff
