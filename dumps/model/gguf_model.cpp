// GGUF metadata -> HF config.json (the read side of dumps/model/gguf_model.h).
#include "dumps/model/gguf_model.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sys/stat.h>

#include "dumps/base/errors.h"

namespace llmdiff {

using ordered_json = nlohmann::ordered_json;

bool is_gguf_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return bool(in.read(magic, 4)) && std::string(magic, 4) == "GGUF";
}

std::string gguf_supported_architectures() {
  return "llama (with experts: mixtral), qwen2, qwen3, qwen2moe, qwen3moe, deepseek2";
}

double gguf_f32_decimal(double v) {
  const float f = float(v);
  for (int digits = 1; digits <= 9; ++digits) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.*g", digits, double(f));
    const double d = std::strtod(buf, nullptr);
    if (float(d) == f) return d;
  }
  return double(f);
}

std::vector<double> gguf_llama3_rope_factors(double base, int64_t dim, double factor, double low, double high,
                                             double old_ctx) {
  const double low_wavelen = old_ctx / low, high_wavelen = old_ctx / high;
  std::vector<double> out;
  for (int64_t i = 0; i < dim; i += 2) {
    const double freq = 1.0 / std::pow(base, double(i) / double(dim));
    const double wavelen = 2 * M_PI / freq;
    if (wavelen < high_wavelen) {
      out.push_back(1.0);
    } else if (wavelen > low_wavelen) {
      out.push_back(factor);
    } else {
      const double smooth = (old_ctx / wavelen - low) / (high - low);
      out.push_back(1.0 / ((1 - smooth) / factor + smooth));
    }
  }
  return out;
}

namespace {

// HF's llama3 rope_scaling from the factors llama.cpp stored: the published
// checkpoints' parameters are tried (factor = the largest factor); none
// fitting is an error rather than a guess.
ordered_json fit_llama3_scaling(const GgufFile& f, const GgufTensorInfo& t, double base, int64_t dim) {
  const std::vector<float> stored = f.to_f32(t);
  if (int64_t(stored.size()) != dim / 2)
    throw FormatError(f.path(), t.name, "has " + std::to_string(stored.size()) + " factors, expected head_dim/2 = " +
                                            std::to_string(dim / 2));
  double factor = 0;
  for (float v : stored) factor = std::max(factor, double(v));
  // The factors depend on old_ctx/low and old_ctx/high only: the published
  // low/high pairs first, then the context lengths (powers of two).
  const std::pair<double, double> low_high[] = {{1, 4}, {1, 2}, {1, 8}, {0.5, 4}, {2, 4}, {1, 16}};
  for (const auto& [low, high] : low_high)
    for (int p = 4; p <= 21; ++p) {
      const double old_ctx = std::ldexp(1.0, p);
      const std::vector<double> want = gguf_llama3_rope_factors(base, dim, factor, low, high, old_ctx);
      bool fits = true;
      for (size_t i = 0; i < want.size() && fits; ++i)
        fits = std::fabs(double(stored[i]) - want[i]) <= 1e-5 * std::fabs(want[i]);
      if (fits)
        return ordered_json{{"rope_type", "llama3"},
                            {"factor", gguf_f32_decimal(factor)},
                            {"low_freq_factor", low},
                            {"high_freq_factor", high},
                            {"original_max_position_embeddings", int64_t(old_ctx)}};
    }
  throw ConfigError(f.path(), "rope_freqs.weight matches no llama3 rope scaling (factor " + std::to_string(factor) +
                                  "): only HF's llama3 rope_scaling is supported as rope factors");
}

std::string storage_torch_dtype(const GgufFile& f) {
  const GgufTensorInfo* e = f.find("token_embd.weight");
  if (!e) throw MissingTensorError(f.path(), "token_embd.weight");
  // Block types dequantise to float32; the reference computes at float32.
  switch (e->type) {
    case GgmlType::F16: return "float16";
    case GgmlType::BF16: return "bfloat16";
    default: return "float32";
  }
}

// The metadata of one architecture ("{arch}.KEY"), typed and checked.
struct Meta {
  const GgufFile& f;
  std::string arch;

  std::string key(const std::string& k) const { return arch + "." + k; }
  bool has(const std::string& k) const { return f.has(key(k)); }
  [[noreturn]] void fail(const std::string& what) const { throw ConfigError(f.path(), what); }
  int64_t required(const std::string& k) const {
    if (!has(k)) fail("missing metadata key '" + key(k) + "'");
    return scalar(k);
  }
  int64_t optional(const std::string& k, int64_t fallback) const { return has(k) ? scalar(k) : fallback; }
  double real(const std::string& k, double fallback) const { return f.get_float(key(k), fallback); }
  int64_t scalar(const std::string& k) const {
    const GgufValue* v = f.get(key(k));
    if (v->is_array())
      fail("metadata key '" + key(k) + "' is a per-layer array; only uniform layers are supported");
    return f.get_int(key(k), 0);
  }
  // A count that must be positive.
  int64_t positive(const std::string& k) const {
    const int64_t v = required(k);
    if (v <= 0) fail("metadata key '" + key(k) + "' must be positive, got " + std::to_string(v));
    return v;
  }
  // A tensor's ne[dim], or `fallback` when the tensor is absent or smaller.
  int64_t tensor_dim(const std::string& name, size_t dim, int64_t fallback) const {
    const GgufTensorInfo* t = f.find(name);
    return t && t->ne.size() > dim ? t->ne[dim] : fallback;
  }
};

const char* hf_class(const std::string& model_type) {
  if (model_type == "llama") return "LlamaForCausalLM";
  if (model_type == "mixtral") return "MixtralForCausalLM";
  if (model_type == "qwen2") return "Qwen2ForCausalLM";
  if (model_type == "qwen2_moe") return "Qwen2MoeForCausalLM";
  if (model_type == "qwen3") return "Qwen3ForCausalLM";
  if (model_type == "qwen3_moe") return "Qwen3MoeForCausalLM";
  return "DeepseekV3ForCausalLM";
}

// rope_scaling: metadata (linear, yarn) or llama-3's factors tensor.
ordered_json rope_scaling_json(const Meta& m, double base, int64_t rope_dim) {
  const GgufFile& f = m.f;
  const std::string type = f.get_string(m.key("rope.scaling.type"), "none");
  const double factor = m.real("rope.scaling.factor", 1.0);
  if (const GgufTensorInfo* freqs = f.find("rope_freqs.weight")) return fit_llama3_scaling(f, *freqs, base, rope_dim);
  if (type == "linear" && factor != 1.0)
    return ordered_json{{"rope_type", "linear"}, {"factor", gguf_f32_decimal(factor)}};
  if (type == "yarn") {
    ordered_json rs = {{"rope_type", "yarn"}, {"factor", gguf_f32_decimal(factor)}};
    if (m.has("rope.scaling.original_context_length"))
      rs["original_max_position_embeddings"] = m.scalar("rope.scaling.original_context_length");
    if (m.has("rope.scaling.yarn_beta_fast")) rs["beta_fast"] = gguf_f32_decimal(m.real("rope.scaling.yarn_beta_fast", 32));
    if (m.has("rope.scaling.yarn_beta_slow")) rs["beta_slow"] = gguf_f32_decimal(m.real("rope.scaling.yarn_beta_slow", 1));
    if (m.has("rope.scaling.yarn_attn_factor"))
      rs["attention_factor"] = gguf_f32_decimal(m.real("rope.scaling.yarn_attn_factor", 1));
    if (m.arch == "deepseek2" && m.has("rope.scaling.yarn_log_multiplier")) {
      // convert_hf_to_gguf.py DeepseekV2Model writes 0.1 * mscale_all_dim
      // (a float32 of a double product); llama.cpp assumes mscale equals it
      // (its scaling multiplies q.k by the square of one mscale, as
      // DeepseekV3Attention does when mscale == mscale_all_dim).
      const float stored = float(m.real("rope.scaling.yarn_log_multiplier", 0));
      double mscale = double(stored) / 0.1;
      for (int digits = 1; digits <= 9; ++digits) {  // the shortest decimal the converter could have read
        char buf[40];
        std::snprintf(buf, sizeof buf, "%.*g", digits, double(stored) / 0.1);
        const double d = std::strtod(buf, nullptr);
        if (float(0.1 * d) == stored) {
          mscale = d;
          break;
        }
      }
      rs["mscale"] = mscale;
      rs["mscale_all_dim"] = mscale;
    }
    return rs;
  }
  if (type != "none" && type != "linear")
    m.fail("unsupported rope scaling type '" + type + "' (supported: none, linear, yarn, llama3 factors)");
  return nullptr;
}

// llama / qwen2 / qwen3 attention: head sizes from key_length (else D/H),
// full rotary.
int64_t gqa_head_dim(const Meta& m, int64_t D, int64_t H) {
  const int64_t Dh = m.has("attention.key_length") ? m.required("attention.key_length") : D / H;
  if (m.has("attention.value_length") && m.required("attention.value_length") != Dh)
    m.fail(m.key("attention.value_length") + " differs from key_length: unsupported");
  if (m.has("rope.dimension_count") && m.required("rope.dimension_count") != Dh)
    m.fail(m.key("rope.dimension_count") + " " + std::to_string(m.required("rope.dimension_count")) +
           " differs from the head size " + std::to_string(Dh) + ": partial rotary is not supported");
  return Dh;
}

// The routed experts' intermediate size: expert_feed_forward_length, else
// the merged tensors' rows (older converters wrote no key).
int64_t expert_ffn(const Meta& m, int64_t first_moe) {
  if (m.has("expert_feed_forward_length")) return m.positive("expert_feed_forward_length");
  const int64_t rows = m.tensor_dim("blk." + std::to_string(first_moe) + ".ffn_gate_exps.weight", 1, 0);
  if (rows <= 0) m.fail("missing metadata key '" + m.key("expert_feed_forward_length") + "'");
  return rows;
}

// Mixtral (llama with experts), Qwen2-MoE, Qwen3-MoE: every layer routed,
// softmax over the experts.
void softmax_moe_fields(const Meta& m, ordered_json& j) {
  const std::string mt = j["model_type"].get<std::string>();
  const int64_t E = m.positive("expert_count"), K = m.positive("expert_used_count");
  if (mt == "mixtral") {
    j["num_local_experts"] = E;
    j["num_experts_per_tok"] = K;
    j["intermediate_size"] = m.has("expert_feed_forward_length") ? m.positive("expert_feed_forward_length")
                                                                  : j["intermediate_size"].get<int64_t>();
    j["router_jitter_noise"] = 0.0;
    return;
  }
  j["num_experts"] = E;
  j["num_experts_per_tok"] = K;
  j["moe_intermediate_size"] = expert_ffn(m, 0);
  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = ordered_json::array();
  // llama.cpp renormalises the chosen weights for qwen3moe and not for
  // qwen2moe (its graphs hard-code it); expert_weights_norm, when written
  // (llmdiff's export of a checkpoint that differs), says otherwise.
  j["norm_topk_prob"] = m.optional("expert_weights_norm", mt == "qwen3_moe" ? 1 : 0) != 0;
  if (mt == "qwen2_moe") {
    int64_t Fs = m.optional("expert_shared_feed_forward_length", 0);
    if (Fs <= 0) Fs = m.tensor_dim("blk.0.ffn_gate_shexp.weight", 1, 0);
    if (Fs <= 0) m.fail("missing metadata key '" + m.key("expert_shared_feed_forward_length") + "'");
    j["shared_expert_intermediate_size"] = Fs;
  }
}

// deepseek2: multi-head latent attention and DeepSeek's MoE as transformers'
// deepseek_v3 config. llama.cpp's own reading (src/models/deepseek2.cpp):
// key_length_mla / value_length_mla present = the split kv_b of the absorbed
// form (then key_length = kv_lora_rank + rope dims, value_length =
// kv_lora_rank, head_count_kv = 1); absent = the joint attn_kv_b (key_length
// = nope + rope dims, value_length = v_head_dim).
void deepseek_fields(const Meta& m, ordered_json& j) {
  const GgufFile& f = m.f;
  const int64_t H = j["num_attention_heads"].get<int64_t>();
  const int64_t Dr = m.positive("rope.dimension_count");
  const int64_t Rkv = m.positive("attention.kv_lora_rank");
  const bool split = m.has("attention.key_length_mla") || m.has("attention.value_length_mla");
  int64_t Dqk, Dv;
  if (split) {
    Dqk = m.positive("attention.key_length_mla");
    Dv = m.positive("attention.value_length_mla");
    if (m.has("attention.key_length") && m.required("attention.key_length") != Rkv + Dr)
      m.fail(m.key("attention.key_length") + " " + std::to_string(m.required("attention.key_length")) +
             " is not kv_lora_rank + rope.dimension_count = " + std::to_string(Rkv + Dr) + " (the MLA latent)");
  } else {
    Dqk = m.positive("attention.key_length");
    Dv = m.optional("attention.value_length", Dqk - Dr);
  }
  if (Dqk <= Dr) m.fail("the query/key head (" + std::to_string(Dqk) + ") must exceed the rope dims (" + std::to_string(Dr) + ")");
  j["num_key_value_heads"] = H;  // every head has its own keys and values once kv_b expands the latent
  j["head_dim"] = Dr;
  j["qk_nope_head_dim"] = Dqk - Dr;
  j["qk_rope_head_dim"] = Dr;
  j["v_head_dim"] = Dv;
  j["kv_lora_rank"] = Rkv;
  // q through the rank-Rq bottleneck when the file has attn_q_a.
  const int64_t Rq = m.optional("attention.q_lora_rank", m.tensor_dim("blk.0.attn_q_a.weight", 1, 0));
  if (Rq > 0 && !f.find("blk.0.attn_q.weight")) j["q_lora_rank"] = Rq;
  else j["q_lora_rank"] = nullptr;
  j["rope_interleave"] = true;  // llama.cpp ropes deepseek2's adjacent pairs (rope type NORM), as HF with rope_interleave

  const int64_t L = j["num_hidden_layers"].get<int64_t>();
  if (!m.has("expert_count")) m.fail("deepseek2 without experts (no '" + m.key("expert_count") + "') is not supported");
  const int64_t dense = m.optional("leading_dense_block_count", 0);
  if (dense < 0 || dense > L) m.fail(m.key("leading_dense_block_count") + " " + std::to_string(dense) + " is outside 0.." + std::to_string(L));
  j["first_k_dense_replace"] = dense;
  const int64_t E = m.positive("expert_count");
  j["n_routed_experts"] = E;
  j["num_experts_per_tok"] = m.positive("expert_used_count");
  j["moe_intermediate_size"] = expert_ffn(m, dense);
  j["n_shared_experts"] = m.optional("expert_shared_count", 0);
  if (dense == 0 && !m.has("feed_forward_length")) j["intermediate_size"] = j["moe_intermediate_size"];
  j["routed_scaling_factor"] = gguf_f32_decimal(m.real("expert_weights_scale", 1.0));
  j["norm_topk_prob"] = m.optional("expert_weights_norm", 0) != 0;
  // expert_gating_func: 1 softmax, 2 sigmoid; absent: softmax (DeepSeek-V2
  // GGUFs written before the key), sigmoid for GLM-4.7 Lite (llama.cpp's
  // exception: 47 or 48 layers and a vocabulary of 154880).
  int64_t gating = m.optional("expert_gating_func", 0);
  if (gating == 0) gating = (L == 47 || L == 48) && j["vocab_size"].get<int64_t>() == 154880 ? 2 : 1;
  if (gating != 1 && gating != 2)
    m.fail(m.key("expert_gating_func") + " " + std::to_string(gating) + " is not softmax (1) or sigmoid (2)");
  const int64_t G = m.optional("expert_group_count", 1), Gk = m.optional("expert_group_used_count", G);
  if (G <= 0 || Gk <= 0 || Gk > G || E % G != 0)
    m.fail(m.key("expert_group_count") + " " + std::to_string(G) + " / " + m.key("expert_group_used_count") + " " +
           std::to_string(Gk) + " do not divide the " + std::to_string(E) + " experts");
  j["n_group"] = G;
  j["topk_group"] = Gk;
  const bool bias = f.find("blk." + std::to_string(dense) + ".exp_probs_b.bias") != nullptr;
  j["scoring_func"] = gating == 2 ? "sigmoid" : "softmax";
  if (bias || Gk < G) {
    // DeepSeek-V3's noaux_tc: sigmoid scores, choice on score + bias within the best groups.
    if (gating != 2)
      m.fail("softmax expert gating with " + std::string(bias ? "exp_probs_b" : "group-limited choice") +
             " is not expressible as transformers' deepseek_v3 (its noaux_tc routing scores by sigmoid)");
    if (!bias)
      m.fail("group-limited expert choice without blk." + std::to_string(dense) +
             ".exp_probs_b.bias is not expressible as transformers' deepseek_v3 (noaux_tc adds the bias)");
    j["topk_method"] = "noaux_tc";
  } else {
    j["topk_method"] = "greedy";
  }
}

}  // namespace

std::string gguf_config_json(const GgufFile& f) {
  const std::string arch = f.get_string("general.architecture", "");
  if (arch.empty()) throw ConfigError(f.path(), "no general.architecture");
  if (arch == "glm4moe")
    throw ConfigError(f.path(), "unsupported GGUF architecture 'glm4moe': GLM-4 MoE ropes part of each head "
                                "(partial_rotary_factor 0.5) and stores next-token-prediction layers, which "
                                "transformers 4.51.3 and llmdiff's stages do not express (supported: " +
                                    gguf_supported_architectures() + ")");
  if (arch != "llama" && arch != "qwen2" && arch != "qwen3" && arch != "qwen2moe" && arch != "qwen3moe" &&
      arch != "deepseek2")
    throw ConfigError(f.path(), "unsupported GGUF architecture '" + arch + "' (supported: " +
                                    gguf_supported_architectures() + ")");
  const Meta m{f, arch};
  const GgufTensorInfo* embd = f.find("token_embd.weight");
  if (!embd) throw MissingTensorError(f.path(), "token_embd.weight");
  if (embd->ne.size() != 2) throw FormatError(f.path(), embd->name, "token_embd.weight is not 2-D");

  const int64_t D = m.positive("embedding_length");
  const int64_t blocks = m.positive("block_count");
  // deepseek2 may count its next-token-prediction layers among the blocks.
  const int64_t L = blocks - (arch == "deepseek2" ? m.optional("nextn_predict_layers", 0) : 0);
  if (L <= 0) m.fail(m.key("nextn_predict_layers") + " leaves no decoder layer of the " + std::to_string(blocks) + " blocks");
  const int64_t H = m.positive("attention.head_count");
  const int64_t Hkv = m.has("attention.head_count_kv") ? m.positive("attention.head_count_kv") : H;
  const double base = m.real("rope.freq_base", 10000.0);
  const bool experts = m.optional("expert_count", 0) > 0;

  std::string model_type = arch == "qwen2moe" ? "qwen2_moe" : arch == "qwen3moe" ? "qwen3_moe"
                           : arch == "deepseek2"                                 ? "deepseek_v3"
                                                                                 : arch;
  if (arch == "llama" && experts) model_type = "mixtral";
  if ((arch == "qwen2moe" || arch == "qwen3moe") && !experts) m.fail("missing metadata key '" + m.key("expert_count") + "'");
  if ((arch == "qwen2" || arch == "qwen3") && experts)
    m.fail(m.key("expert_count") + " is set: a dense " + arch + " has no experts (MoE models are " + arch + "moe)");

  ordered_json j;
  j["architectures"] = {hf_class(model_type)};
  j["model_type"] = model_type;
  j["hidden_size"] = D;
  j["num_hidden_layers"] = L;
  j["num_attention_heads"] = H;
  j["num_key_value_heads"] = Hkv;
  j["vocab_size"] = embd->ne[1];
  j["max_position_embeddings"] = m.optional("context_length", 2048);
  j["rms_norm_eps"] = gguf_f32_decimal(m.real("attention.layer_norm_rms_epsilon", 1e-6));
  j["rope_theta"] = gguf_f32_decimal(base);
  j["tie_word_embeddings"] = f.find("output.weight") == nullptr;
  if (m.has("feed_forward_length")) j["intermediate_size"] = m.positive("feed_forward_length");
  else if (!experts) m.fail("missing metadata key '" + m.key("feed_forward_length") + "'");
  else j["intermediate_size"] = expert_ffn(m, 0);
  int64_t rope_dim;
  if (arch == "deepseek2") {
    deepseek_fields(m, j);
    rope_dim = j["qk_rope_head_dim"].get<int64_t>();
  } else {
    rope_dim = gqa_head_dim(m, D, H);
    j["head_dim"] = rope_dim;
    if (arch == "qwen2moe" && rope_dim * H != D)
      m.fail("qwen2moe's attention uses hidden_size / heads = " + std::to_string(D / H) + " per head, but " +
             m.key("attention.key_length") + " says " + std::to_string(rope_dim));
    if (experts) softmax_moe_fields(m, j);
  }
  if (model_type == "llama") {
    j["attention_bias"] = f.find("blk.0.attn_q.bias") != nullptr;
    j["mlp_bias"] = false;
  }
  if (model_type == "mixtral" && f.find("blk.0.attn_q.bias"))
    throw FormatError(f.path(), "blk.0.attn_q.bias", "Mixtral's attention has no bias");
  if (model_type == "mixtral") j["sliding_window"] = nullptr;
  if (arch == "qwen2" || arch == "qwen3" || arch == "qwen2moe" || arch == "qwen3moe") {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
  }
  j["rope_scaling"] = rope_scaling_json(m, base, rope_dim);
  j["torch_dtype"] = storage_torch_dtype(f);
  j["gguf"] = {{"file", f.path()}, {"version", f.version()}, {"architecture", arch}};
  return j.dump(2);
}

ModelConfig gguf_config(const GgufFile& f) { return parse_config(gguf_config_json(f), f.path()); }

GgmlType parse_ggml_type(const std::string& s) {
  for (uint32_t t = 0; t < 64; ++t)
    if (ggml_type_supported(t) && ggml_type_name(t) == s) return GgmlType(t);
  throw UsageError("unknown or unsupported GGUF type '" + s + "' (supported: " + ggml_supported_types() + ")");
}

}  // namespace llmdiff
