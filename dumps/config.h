// HF config.json -> ModelConfig for the decoder families llmdiff supports.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace llmdiff {

enum class Family { Llama, Qwen2, Qwen3 };  // mistral loads as Llama
const char* family_name(Family f);

// rope_scaling of config.json (transformers' modeling_rope_utils.py fields).
struct RopeScaling {
  enum class Type { Default, Linear, Dynamic, Llama3, Yarn };
  Type type = Type::Default;
  double factor = 1.0;                        // linear, dynamic, llama3, yarn
  double low_freq_factor = 1.0;               // llama3
  double high_freq_factor = 4.0;              // llama3
  int64_t original_max_position_embeddings = 0;  // llama3, yarn (0: absent)
  double beta_fast = 32.0, beta_slow = 1.0;   // yarn
  double mscale = 0.0, mscale_all_dim = 0.0;  // yarn (0: absent)
  double attention_factor = 0.0;              // yarn (0: absent -> derived)
  bool has_attention_factor = false;
};
const char* rope_type_name(RopeScaling::Type t);

enum class ComputeDType { Float32, BFloat16, Float16, Float64 };
const char* compute_dtype_name(ComputeDType d);  // "float32", ...
ComputeDType parse_compute_dtype(const std::string& s);  // accepts f32/float32/fp32/bf16/... ; throws UsageError

struct ModelConfig {
  std::string source;      // path of config.json (for errors)
  std::string model_type;  // as written ("llama", "mistral", "qwen2", "qwen3")
  Family family = Family::Llama;
  int64_t hidden_size = 0, intermediate_size = 0, num_hidden_layers = 0;
  int64_t num_attention_heads = 0, num_key_value_heads = 0, head_dim = 0;
  int64_t vocab_size = 0, max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // config value (Llama/Qwen3); Qwen2 always has q/k/v bias
  bool qkv_bias = false;        // derived: q/k/v projections carry a bias
  bool o_bias = false;          // derived: o_proj carries a bias (Llama attention_bias)
  bool qk_norm = false;         // derived: Qwen3 per-head q_norm/k_norm
  int64_t sliding_window = 0;   // Qwen2/Qwen3 mask window (HF applies it even when use_sliding_window is false); 0 = none
  std::string torch_dtype = "float32";
  std::string raw_json;         // config.json text, for dump manifests

  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  ComputeDType default_dtype() const;  // from torch_dtype
};

// Parses config.json text; `source` names the file in errors. Throws
// ConfigError for malformed JSON, missing/ill-typed fields, an unknown
// model_type or an unsupported value (listing what is supported).
ModelConfig parse_config(const std::string& json_text, const std::string& source);
ModelConfig load_config(const std::string& model_dir_or_file);

}  // namespace llmdiff
