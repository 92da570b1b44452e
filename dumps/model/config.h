// HF config.json -> ModelConfig for the decoder families llmdiff supports.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace llmdiff {

// The model_type families; mistral loads as Llama, qwen2_moe / qwen3_moe as
// their dense family with a MoE block.
enum class Family { Llama, Qwen2, Qwen3, Mixtral, DeepseekV3 };
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

// The mixture-of-experts block of mixtral, qwen2_moe, qwen3_moe and
// deepseek_v3 (MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock,
// Qwen3MoeSparseMoeBlock, DeepseekV3MoE of transformers 4.51.3).
struct MoeConfig {
  enum class Scoring { Softmax, Sigmoid };
  int64_t num_experts = 0;            // E routed experts; 0: a dense model
  int64_t top_k = 0;                  // K experts per token (num_experts_per_tok)
  int64_t intermediate_size = 0;      // each expert's F (moe_intermediate_size; mixtral: intermediate_size)
  Scoring scoring = Scoring::Softmax;  // softmax over E (mixtral, qwen*) or sigmoid per expert (deepseek_v3)
  bool norm_topk_prob = false;        // renormalise the K chosen weights (mixtral: always)
  double routed_scaling_factor = 1.0;  // deepseek_v3: weights scaled after renormalisation
  int64_t n_group = 1, topk_group = 1;  // deepseek_v3 group-limited choice
  bool correction_bias = false;       // deepseek_v3 e_score_correction_bias steers the choice
  int64_t shared_intermediate_size = 0;  // shared expert's F; 0: none
  bool shared_gate = false;           // qwen2_moe: sigmoid(shared_expert_gate(x)) scales the shared expert
  // Which layers are MoE: i >= first_k_dense (deepseek_v3), i not in
  // mlp_only_layers and (i+1) % sparse_step == 0 (qwen*_moe).
  int64_t first_k_dense = 0, sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  bool enabled() const { return num_experts > 0; }
  bool is_moe_layer(int64_t layer) const;
};

// Multi-head latent attention (DeepseekV3Attention): the keys and values of
// every head come from one low-rank latent; one rope part is shared by all heads.
struct MlaConfig {
  bool enabled = false;
  int64_t q_lora_rank = 0;      // Rq; 0: q_proj straight from the hidden state
  int64_t kv_lora_rank = 0;     // Rkv
  int64_t qk_nope_head_dim = 0;  // Dn
  int64_t qk_rope_head_dim = 0;  // Dr (= head_dim, the RoPE tables' width)
  int64_t v_head_dim = 0;       // Dv
  bool rope_interleave = true;  // rope dims reordered pairs -> halves before rotate-half RoPE
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
};

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
  MoeConfig moe;
  MlaConfig mla;
  std::string torch_dtype = "float32";
  std::string raw_json;         // config.json text, for dump manifests

  // q_proj / k_proj / v_proj widths (GQA attention; MLA has its own sizes).
  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  // The width of attention's context, o_proj's input: Hq*Dh, or Hq*Dv for MLA.
  int64_t ctx_dim() const { return num_attention_heads * (mla.enabled ? mla.v_head_dim : head_dim); }
  // The attention softmax scaling: Dh^-0.5; MLA (Dn+Dr)^-0.5, times mscale^2
  // with yarn's mscale_all_dim (DeepseekV3Attention.__init__).
  double attn_scaling() const;
  ComputeDType default_dtype() const;  // from torch_dtype
};

// Parses config.json text; `source` names the file in errors. Throws
// ConfigError for malformed JSON, missing/ill-typed fields, an unknown
// model_type or an unsupported value (listing what is supported).
ModelConfig parse_config(const std::string& json_text, const std::string& source);
ModelConfig load_config(const std::string& model_dir_or_file);

}  // namespace llmdiff
