#include "dumps/model/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <sys/stat.h>

#include "dumps/base/errors.h"
#include "dumps/model/gguf_model.h"

namespace llmdiff {

using json = nlohmann::json;

const char* family_name(Family f) {
  switch (f) {
    case Family::Llama: return "llama";
    case Family::Qwen2: return "qwen2";
    case Family::Qwen3: return "qwen3";
    case Family::Mixtral: return "mixtral";
    case Family::DeepseekV3: return "deepseek_v3";
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

bool MoeConfig::is_moe_layer(int64_t layer) const {
  if (!enabled() || layer < first_k_dense) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return sparse_step <= 1 || (layer + 1) % sparse_step == 0;
}

namespace {
// yarn_get_mscale of modeling_deepseek_v3.py
double yarn_get_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }
}  // namespace

double ModelConfig::attn_scaling() const {
  if (!mla.enabled) return std::pow(double(head_dim), -0.5);
  double scaling = std::pow(double(mla.qk_head_dim()), -0.5);
  // DeepseekV3Attention.__init__: any rope_scaling with mscale_all_dim, its
  // `factor` as written.
  if (rope_scaling.type != RopeScaling::Type::Default && rope_scaling.mscale_all_dim != 0) {
    const double m = yarn_get_mscale(rope_scaling.factor, rope_scaling.mscale_all_dim);
    scaling = scaling * m * m;
  }
  return scaling;
}

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

// DeepseekV3Config's attention fields.
void parse_mla(const Reader& r, ModelConfig& c) {
  MlaConfig& m = c.mla;
  m.enabled = true;
  // null: q_proj straight from the hidden state (DeepSeek-V2-Lite; later
  // transformers releases, 4.51.3 requires a rank).
  m.q_lora_rank = !r.j.contains("q_lora_rank") ? 1536 : r.present("q_lora_rank") ? r.get_int("q_lora_rank", std::nullopt) : 0;
  m.kv_lora_rank = r.get_int("kv_lora_rank", 512);
  m.qk_nope_head_dim = r.get_int("qk_nope_head_dim", 128);
  m.qk_rope_head_dim = r.get_int("qk_rope_head_dim", 64);
  m.v_head_dim = r.get_int("v_head_dim", 128);
  m.rope_interleave = r.get_bool("rope_interleave", true);
  if (m.qk_rope_head_dim % 2 != 0)
    r.fail("qk_rope_head_dim must be even for RoPE, got " + std::to_string(m.qk_rope_head_dim));
  if (r.present("head_dim") && r.get_int("head_dim", std::nullopt) != m.qk_rope_head_dim)
    r.fail("head_dim (" + r.j["head_dim"].dump() + ") must equal qk_rope_head_dim (" +
           std::to_string(m.qk_rope_head_dim) + ") for deepseek_v3");
  // HF's DeepseekV3Attention repeats nothing: every head has its own key/value.
  const int64_t heads = r.get_int("num_attention_heads", std::nullopt);
  const int64_t kv_heads = r.get_int("num_key_value_heads", heads);
  if (kv_heads != heads)
    r.fail("num_key_value_heads (" + std::to_string(kv_heads) + ") must equal num_attention_heads (" +
           std::to_string(heads) + ") for deepseek_v3 multi-head latent attention");
}

// The MoE fields of each config class (transformers 4.51.3 defaults).
void parse_moe(const Reader& r, ModelConfig& c) {
  MoeConfig& m = c.moe;
  const std::string& mt = c.model_type;
  if (mt == "mixtral") {
    m.num_experts = r.get_int("num_local_experts", 8);
    m.top_k = r.get_int("num_experts_per_tok", 2);
    m.intermediate_size = c.intermediate_size;
    m.norm_topk_prob = true;  // MixtralSparseMoeBlock always renormalises
    if (r.get_num("router_jitter_noise", 0.0, false) != 0.0)
      r.fail("router_jitter_noise only acts in training; an inference config must have 0");
  } else if (mt == "qwen2_moe" || mt == "qwen3_moe") {
    const bool q2 = mt == "qwen2_moe";
    m.num_experts = r.get_int("num_experts", q2 ? 60 : 128);
    m.top_k = r.get_int("num_experts_per_tok", q2 ? 4 : 8);
    m.intermediate_size = r.get_int("moe_intermediate_size", q2 ? 1408 : 768);
    m.norm_topk_prob = r.get_bool("norm_topk_prob", false);
    m.sparse_step = r.get_int("decoder_sparse_step", 1);
    if (q2) {
      m.shared_intermediate_size = r.get_int("shared_expert_intermediate_size", 5632);
      m.shared_gate = true;
    }
  } else if (mt == "deepseek_v3") {
    m.num_experts = r.get_int("n_routed_experts", 256);
    m.top_k = r.get_int("num_experts_per_tok", 8);
    m.intermediate_size = r.get_int("moe_intermediate_size", 2048);
    m.norm_topk_prob = r.get_bool("norm_topk_prob", true);
    m.routed_scaling_factor = r.get_num("routed_scaling_factor", 2.5);
    m.n_group = r.get_int("n_group", 8);
    m.topk_group = r.get_int("topk_group", 4);
    m.shared_intermediate_size = m.intermediate_size * r.get_int("n_shared_experts", 1, 0);
    m.first_k_dense = r.get_int("first_k_dense_replace", 3, 0);
    // transformers 4.51.3's DeepseekV3 routes by noaux_tc: sigmoid scores, the
    // choice steered by e_score_correction_bias within the topk_group best
    // groups. "greedy" (DeepSeek-V2-Lite's remote code, a deepseek2 GGUF
    // without exp_probs_b): the top-k of the scores, no bias, no group limit;
    // with a softmax scoring_func (DeepSeek-V2's) the weights are the softmax
    // probabilities, renormalised with norm_topk_prob and then scaled.
    const std::string method = r.get_str("topk_method", "noaux_tc");
    const std::string scoring = r.get_str("scoring_func", "sigmoid");
    if (scoring != "sigmoid" && scoring != "softmax")
      r.fail("unsupported scoring_func '" + scoring + "' (supported: sigmoid, softmax)");
    m.scoring = scoring == "softmax" ? MoeConfig::Scoring::Softmax : MoeConfig::Scoring::Sigmoid;
    if (method == "noaux_tc") {
      if (scoring != "sigmoid") r.fail("topk_method noaux_tc needs scoring_func sigmoid, got '" + scoring + "'");
      m.correction_bias = true;
    } else if (method == "greedy") {
      if (m.topk_group != m.n_group)
        r.fail("topk_method greedy chooses among all experts: topk_group (" + std::to_string(m.topk_group) +
               ") must equal n_group (" + std::to_string(m.n_group) + ")");
    } else {
      r.fail("unsupported topk_method '" + method + "' (supported: noaux_tc, greedy)");
    }
    if (m.num_experts % m.n_group != 0)
      r.fail("n_routed_experts (" + std::to_string(m.num_experts) + ") must be a multiple of n_group (" +
             std::to_string(m.n_group) + ")");
    if (m.topk_group > m.n_group)
      r.fail("topk_group (" + std::to_string(m.topk_group) + ") exceeds n_group (" + std::to_string(m.n_group) + ")");
    if (m.num_experts / m.n_group < 2) r.fail("each expert group needs at least 2 experts (group score = top-2 sum)");
    if (m.top_k > m.topk_group * (m.num_experts / m.n_group))
      r.fail("num_experts_per_tok exceeds the experts of the topk_group groups kept");
  } else {
    return;
  }
  if (r.present("mlp_only_layers")) {
    const auto& a = r.j["mlp_only_layers"];
    if (!a.is_array()) r.fail("field 'mlp_only_layers' must be a list of layer indices, got " + a.dump());
    for (const auto& x : a) {
      if (!x.is_number_integer()) r.fail("field 'mlp_only_layers' must hold integers, got " + a.dump());
      m.mlp_only_layers.push_back(x.get<int64_t>());
    }
  }
  if (m.top_k > m.num_experts)
    r.fail("num_experts_per_tok (" + std::to_string(m.top_k) + ") exceeds the experts (" +
           std::to_string(m.num_experts) + ")");
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
  const std::string& mt = c.model_type;
  if (mt == "llama" || mt == "mistral") c.family = Family::Llama;
  else if (mt == "qwen2" || mt == "qwen2_moe") c.family = Family::Qwen2;
  else if (mt == "qwen3" || mt == "qwen3_moe") c.family = Family::Qwen3;
  else if (mt == "mixtral") c.family = Family::Mixtral;
  else if (mt == "deepseek_v3") c.family = Family::DeepseekV3;
  else
    throw ConfigError(src, "unsupported model_type '" + mt +
                               "' (supported: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, deepseek_v3)");

  c.hidden_size = r.get_int("hidden_size", std::nullopt);
  c.intermediate_size = r.get_int("intermediate_size", std::nullopt);
  c.num_hidden_layers = r.get_int("num_hidden_layers", std::nullopt);
  c.num_attention_heads = r.get_int("num_attention_heads", std::nullopt);
  c.num_key_value_heads = r.get_int("num_key_value_heads", c.num_attention_heads);
  if (c.family == Family::DeepseekV3) parse_mla(r, c);  // before head_dim: it sets it
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    throw ConfigError(src, "num_attention_heads (" + std::to_string(c.num_attention_heads) +
                               ") must be a multiple of num_key_value_heads (" + std::to_string(c.num_key_value_heads) + ")");
  // Every family's attention reads config.head_dim when config.json has it
  // (Qwen2Attention inherits LlamaAttention's getattr in transformers 4.51).
  if (c.mla.enabled) {
    // DeepseekV3Config: head_dim = qk_rope_head_dim (the RoPE tables' width).
    c.head_dim = c.mla.qk_rope_head_dim;
  } else if (mt == "qwen2_moe") {
    // Qwen2MoeAttention: hidden_size // num_heads, whatever head_dim says.
    if (c.hidden_size % c.num_attention_heads != 0)
      throw ConfigError(src, "hidden_size must be a multiple of num_attention_heads for qwen2_moe");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  } else if (r.present("head_dim")) {
    c.head_dim = r.get_int("head_dim", std::nullopt);
  } else {
    if (c.hidden_size % c.num_attention_heads != 0)
      throw ConfigError(src, "hidden_size must be a multiple of num_attention_heads when head_dim is not given");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.head_dim % 2 != 0) throw ConfigError(src, "head_dim must be even for RoPE, got " + std::to_string(c.head_dim));
  c.vocab_size = r.get_int("vocab_size", std::nullopt);
  const int64_t default_max_pos = mt == "llama" ? 2048 : mt == "mistral" || mt == "mixtral" ? 4096 * 32
                                 : mt == "deepseek_v3"                  ? 4096
                                                                        : 32768;
  c.max_position_embeddings = r.get_int("max_position_embeddings", default_max_pos);
  c.rms_norm_eps = r.get_num("rms_norm_eps", mt == "mixtral" ? 1e-5 : 1e-6);
  c.rope_theta = r.get_num("rope_theta", mt == "mixtral" ? 1e6 : 10000.0);
  c.rope_scaling = parse_rope_scaling(j.contains("rope_scaling") ? j["rope_scaling"] : json(), src);
  c.tie_word_embeddings = r.get_bool("tie_word_embeddings", false);
  c.attention_bias = r.get_bool("attention_bias", false);
  c.qkv_bias = mt == "qwen2_moe" ? r.get_bool("qkv_bias", true) : c.family == Family::Qwen2 ? true : c.attention_bias;
  c.o_bias = c.family == Family::Qwen2 ? false : c.attention_bias;
  if (c.mla.enabled && c.attention_bias)
    throw ConfigError(src, "unsupported attention_bias = true for deepseek_v3 (supported: false)");
  c.qk_norm = c.family == Family::Qwen3;
  if (c.family == Family::Qwen2 || c.family == Family::Qwen3 || mt == "mistral" || mt == "mixtral")
    // The config classes default to 4096 when the key is absent (mixtral:
    // none); null means none.
    // The MoE Qwen configs keep it only with use_sliding_window.
    c.sliding_window = (mt == "qwen2_moe" || mt == "qwen3_moe") && !r.get_bool("use_sliding_window", false) ? 0
                       : !j.contains("sliding_window") ? (mt == "mixtral" ? 0 : 4096)
                       : j["sliding_window"].is_null() ? 0
                                                        : r.get_int("sliding_window", std::nullopt);
  parse_moe(r, c);

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
  if (is_gguf_file(path)) return gguf_config(GgufFile(path));
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
