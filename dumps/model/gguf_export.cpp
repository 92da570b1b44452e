// HF checkpoint -> GGUF (dumps/model/gguf_export.h): the tensor plan (names,
// shapes, how each is filled from the weights), the metadata of each
// architecture, and the type of each tensor (converter, then llama-quantize).
#include "dumps/model/gguf_export.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <regex>

#include "dumps/base/errors.h"
#include "dumps/formats/gguf.h"
#include "dumps/model/gguf_model.h"
#include "dumps/model/weights.h"

namespace llmdiff {

// ------------------------------------------------------------- GgufQuant

namespace {

struct MixtureInfo {
  GgufQuant::Mixture mixture;
  const char* name;
  GgmlType type;       // llama_ftype_get_default_type
  uint32_t file_type;  // llama_ftype
};

const std::vector<MixtureInfo>& mixtures() {
  using M = GgufQuant::Mixture;
  static const std::vector<MixtureInfo> list = {
      {M::Q3_K_S, "Q3_K_S", GgmlType::Q3_K, 11}, {M::Q3_K_M, "Q3_K_M", GgmlType::Q3_K, 12},
      {M::Q3_K_L, "Q3_K_L", GgmlType::Q3_K, 13}, {M::Q4_K_S, "Q4_K_S", GgmlType::Q4_K, 14},
      {M::Q4_K_M, "Q4_K_M", GgmlType::Q4_K, 15}, {M::Q5_K_S, "Q5_K_S", GgmlType::Q5_K, 16},
      {M::Q5_K_M, "Q5_K_M", GgmlType::Q5_K, 17},
  };
  return list;
}

// llama_ftype of a file whose matrices are all `t` (llama-quantize --pure
// writes its file type's number: Q4_K is Q4_K_M's default type).
uint32_t pure_file_type(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return 0;
    case GgmlType::F16: return 1;
    case GgmlType::Q4_0: return 2;
    case GgmlType::Q4_1: return 3;
    case GgmlType::Q8_0: return 7;
    case GgmlType::Q5_0: return 8;
    case GgmlType::Q5_1: return 9;
    case GgmlType::Q2_K: return 10;
    case GgmlType::Q3_K: return 12;
    case GgmlType::Q4_K: return 15;
    case GgmlType::Q5_K: return 17;
    case GgmlType::Q6_K: return 18;
    case GgmlType::BF16: return 32;
    default: return 0;
  }
}

}  // namespace

std::string gguf_quant_names() {
  std::string s = ggml_supported_types();
  for (const MixtureInfo& m : mixtures()) s += std::string(", ") + m.name;
  return s;
}

GgufQuant GgufQuant::parse(const std::string& name) {
  GgufQuant q;
  for (const MixtureInfo& m : mixtures())
    if (name == m.name) {
      q.mixture = m.mixture;
      q.type = m.type;
      return q;
    }
  for (uint32_t t = 0; t < 64; ++t)
    if (ggml_type_supported(t) && ggml_type_name(t) == name) {
      q.type = GgmlType(t);
      return q;
    }
  throw UsageError("unknown GGUF type '" + name + "' (supported: " + gguf_quant_names() + ")");
}

std::string GgufQuant::name() const {
  for (const MixtureInfo& m : mixtures())
    if (m.mixture == mixture) return m.name;
  return ggml_type_name(uint32_t(type));
}

uint32_t GgufQuant::file_type() const {
  for (const MixtureInfo& m : mixtures())
    if (m.mixture == mixture) return m.file_type;
  return pure_file_type(type);
}

namespace {

// --------------------------------------------------------------- the plan

// One tensor of the file: its GGUF name, row-major shape (ne reversed) and
// values, made slab by slab (an expert, an MLA head at a time).
struct Planned {
  std::string name;
  Shape shape;
  int64_t slabs = 1;
  std::function<void(int64_t slab, float* dst)> fill;
};

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// A weight as stored by llama.cpp's converter: llama's q/k rows (and bias
// elements) permuted so each head's rotary pairs are adjacent.
Planned plain(const ModelConfig& c, const WeightView& v, const std::string& name) {
  Planned p;
  p.name = name;
  p.shape = v.shape;
  p.fill = [&c, &v](int64_t, float* dst) {
    const int64_t rows = v.rows(), cols = v.cols();
    int64_t heads = 0;
    if (!gguf_rows_permuted(c, v.name, &heads)) return v.rows_f32(0, rows, dst);
    std::vector<float> hf(size_t(rows * cols));
    v.rows_f32(0, rows, hf.data());
    // A bias permutes its elements as a weight its rows.
    const int64_t n = v.shape.size() == 1 ? v.numel() : rows, width = v.shape.size() == 1 ? 1 : cols;
    for (int64_t r = 0; r < n; ++r)
      std::copy_n(&hf[size_t(r * width)], width, dst + gguf_permuted_row(r, n, heads) * width);
  };
  return p;
}

// A layer's routed experts' `part` (gate, up or down) merged: [E, rows, cols].
Planned merged_experts(const LayerWeights& L, const std::string& name, WeightView MlpWeights::*part) {
  const WeightView& first = L.experts.front().*part;
  Planned p;
  p.name = name;
  p.shape = {int64_t(L.experts.size()), first.shape[0], first.shape[1]};
  p.slabs = int64_t(L.experts.size());
  p.fill = [&L, part](int64_t e, float* dst) {
    const WeightView& v = L.experts[size_t(e)].*part;
    v.rows_f32(0, v.rows(), dst);
  };
  return p;
}

// MLA's kv_b_proj [H*(Dn+Dv), Rkv] split as convert_hf_to_gguf.py
// DeepseekV2Model does: k_b = each head's Dn key rows transposed [H, Rkv, Dn],
// v_b = each head's Dv value rows [H, Dv, Rkv].
std::vector<Planned> split_kv_b(const ModelConfig& c, const WeightView& kv_b, const GgufLocation& loc) {
  const int64_t H = c.num_attention_heads, Dn = c.mla.qk_nope_head_dim, Dv = c.mla.v_head_dim;
  const int64_t Rkv = c.mla.kv_lora_rank;
  Planned k, v;
  k.name = loc.k_b_name;
  k.shape = {H, Rkv, Dn};
  k.slabs = H;
  k.fill = [&kv_b, Dn, Dv, Rkv](int64_t h, float* dst) {
    std::vector<float> rows(size_t(Dn * Rkv));  // [Dn, Rkv]
    kv_b.rows_f32(h * (Dn + Dv), Dn, rows.data());
    for (int64_t i = 0; i < Dn; ++i)
      for (int64_t r = 0; r < Rkv; ++r) dst[r * Dn + i] = rows[size_t(i * Rkv + r)];  // [Rkv, Dn]
  };
  v.name = loc.v_b_name;
  v.shape = {H, Dv, Rkv};
  v.slabs = H;
  v.fill = [&kv_b, Dn, Dv](int64_t h, float* dst) { kv_b.rows_f32(h * (Dn + Dv) + Dn, Dv, dst); };
  return {k, v};
}

std::vector<Planned> plan_tensors(const ModelWeights& w, const GgufExportOptions& opt) {
  const ModelConfig& c = w.config();
  std::vector<Planned> plan;
  plan.push_back(plain(c, w.embed, "token_embd.weight"));
  plan.push_back(plain(c, w.final_norm, "output_norm.weight"));
  if (!w.lm_head_tied) plan.push_back(plain(c, w.lm_head, "output.weight"));
  for (const LayerWeights& L : w.layers)
    for (const WeightView* v : L.views()) {
      if (!*v) continue;
      const GgufLocation loc = gguf_locate(v->name);
      if (loc.name.empty()) throw UsageError("GGUF export: no GGUF name for '" + v->name + "'");
      if (loc.expert > 0) continue;  // written with expert 0's
      if (loc.expert == 0) {
        WeightView MlpWeights::*part = ends_with(loc.name, "ffn_gate_exps.weight") ? &MlpWeights::gate
                                       : ends_with(loc.name, "ffn_up_exps.weight") ? &MlpWeights::up
                                                                                   : &MlpWeights::down;
        plan.push_back(merged_experts(L, loc.name, part));
      } else if (loc.kv_b && !opt.kv_b_joint) {
        for (Planned& p : split_kv_b(c, *v, loc)) plan.push_back(std::move(p));
      } else {
        plan.push_back(plain(c, *v, loc.name));
      }
    }
  return plan;
}

// ------------------------------------------------------ each tensor's type

// llama-quantize's broad categories (llama-quant.cpp tensor_get_category).
enum class Category { TokenEmbd, AttnQ, AttnK, AttnV, AttnOutput, FfnUp, FfnGate, FfnDown, Output, Other };

Category category(const std::string& n) {
  auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
  if (n == "output.weight") return Category::Output;
  if (n == "token_embd.weight") return Category::TokenEmbd;
  if (has("attn_qkv.weight") || has("attn_kv_b.weight") || has("attn_v.weight")) return Category::AttnV;
  if (has("attn_k.weight")) return Category::AttnK;
  if (has("attn_q.weight")) return Category::AttnQ;
  if (has("attn_output.weight")) return Category::AttnOutput;
  if (has("ffn_up")) return Category::FfnUp;
  if (has("ffn_gate")) return Category::FfnGate;
  if (has("ffn_down")) return Category::FfnDown;
  return Category::Other;
}

int layer_of(const std::string& n) {
  int layer = -1;
  return std::sscanf(n.c_str(), "blk.%d.", &layer) == 1 ? layer : -1;
}

// llama-quantize's fallback when a row is not a whole number of blocks
// (tensor_type_fallback).
GgmlType fallback_type(GgmlType t, int64_t cols) {
  if (cols % ggml_block_size(t) == 0) return t;
  GgmlType f;
  switch (t) {
    case GgmlType::Q4_K: f = GgmlType::Q5_0; break;
    case GgmlType::Q5_K: f = GgmlType::Q5_1; break;
    case GgmlType::Q6_K: f = GgmlType::Q8_0; break;
    case GgmlType::Q2_K:
    case GgmlType::Q3_K: f = GgmlType::Q4_0; break;
    default: f = GgmlType::F16; break;
  }
  return cols % ggml_block_size(f) == 0 ? f : GgmlType::F16;
}

class TypeChoice {
 public:
  TypeChoice(const ModelConfig& c, const std::string& arch, const GgufQuant& q, const std::vector<Planned>& plan)
      : q_(q), n_layer_(int(c.num_hidden_layers)), n_expert_(std::max<int64_t>(1, c.moe.num_experts)) {
    tied_ = std::none_of(plan.begin(), plan.end(), [](const Planned& p) { return p.name == "output.weight"; });
    // llm_type 70B: a llama of 80 layers with grouped kv heads.
    is_70b_ = arch == "llama" && !c.moe.enabled() && c.num_hidden_layers == 80 &&
              c.num_attention_heads != c.num_key_value_heads;
    // attn_v-like tensors counted in llama.cpp's weights_map order: by layer, then by name.
    std::vector<std::pair<int, std::string>> v;
    for (const Planned& p : plan)
      if (category(p.name) == Category::AttnV) v.emplace_back(layer_of(p.name), p.name);
    std::sort(v.begin(), v.end());
    for (size_t i = 0; i < v.size(); ++i) attn_v_index_[v[i].second] = int(i);
  }

  GgmlType operator()(const Planned& p) const {
    const int64_t cols = p.shape.back();
    const bool forced_f32 = p.shape.size() == 1 || !ends_with(p.name, ".weight") ||
                            ends_with(p.name, "ffn_gate_inp.weight") || ends_with(p.name, "ffn_gate_inp_shexp.weight");
    if (forced_f32) return GgmlType::F32;  // the converter keeps these in float32
    if (!ggml_is_quantized(q_.type)) return q_.type;  // the converter's --outtype
    // llama-quantize: matrices of ggml_n_dims >= 2 (a [1, D] gate is 1-D to ggml).
    if (p.shape.size() == 2 && p.shape[0] == 1) return GgmlType::F32;
    const GgmlType t = q_.mixture == GgufQuant::Mixture::None ? q_.type : mixture_type(p.name, cols);
    return fallback_type(t, cols);
  }

 private:
  static bool use_more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

  // llama_tensor_get_type_impl for the K-quant file types (no imatrix).
  GgmlType mixture_type(const std::string& name, int64_t cols) const {
    using M = GgufQuant::Mixture;
    const M f = q_.mixture;
    GgmlType t = q_.type;
    const Category cat = category(name);
    if (cat == Category::Output || (tied_ && cat == Category::TokenEmbd)) {
      if (cols % ggml_block_size(t) != 0) return GgmlType::Q8_0;
      return t != GgmlType::Q8_0 ? GgmlType::Q6_K : t;
    }
    if (cat == Category::TokenEmbd) return t;
    if (cat == Category::AttnV) {
      const int i = attn_v_index_.at(name), n = int(attn_v_index_.size());
      if (f == M::Q3_K_M) t = i < 2 ? GgmlType::Q5_K : GgmlType::Q4_K;
      else if (f == M::Q3_K_L) t = GgmlType::Q5_K;
      else if ((f == M::Q4_K_M || f == M::Q5_K_M) && use_more_bits(i, n)) t = GgmlType::Q6_K;
      else if (f == M::Q4_K_S && i < 4) t = GgmlType::Q5_K;
      if (is_70b_ && (t == GgmlType::Q3_K || t == GgmlType::Q4_K)) t = GgmlType::Q5_K;
      if (n_expert_ == 8) t = GgmlType::Q8_0;
      return t;
    }
    if (cat == Category::AttnK) return n_expert_ == 8 ? GgmlType::Q8_0 : t;
    if (cat == Category::FfnDown) {
      const int i = layer_of(name), n = n_layer_;
      if (f == M::Q3_K_M) t = i < n / 16 ? GgmlType::Q5_K : GgmlType::Q4_K;
      else if (f == M::Q3_K_L) t = GgmlType::Q5_K;
      else if ((f == M::Q4_K_M || f == M::Q5_K_M) && use_more_bits(i, n)) t = GgmlType::Q6_K;
      else if (f == M::Q4_K_S && i < n / 8) t = GgmlType::Q5_K;
      return t;
    }
    if (cat == Category::AttnOutput) {
      if (n_expert_ == 8) {
        if (f == M::Q3_K_S || f == M::Q3_K_M || f == M::Q4_K_S || f == M::Q4_K_M) t = GgmlType::Q5_K;
      } else if (f == M::Q3_K_M) {
        t = GgmlType::Q4_K;
      } else if (f == M::Q3_K_L) {
        t = GgmlType::Q5_K;
      }
      return t;
    }
    return t;
  }

  GgufQuant q_;
  int n_layer_;
  int64_t n_expert_;
  bool tied_ = false, is_70b_ = false;
  std::map<std::string, int> attn_v_index_;
};

// -------------------------------------------------------------- metadata

// A minimal SentencePiece-style vocabulary so that llama.cpp can load the
// file: the special and byte tokens, then placeholders.
void write_vocab(GgufWriter& g, int64_t V) {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
  for (int64_t i = 0; i < V; ++i) {
    std::string t;
    int32_t type = 1;  // normal
    if (V >= 259 && i < 3) {
      t = i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>";
      type = i == 0 ? 2 : 3;  // unknown, control
    } else if (V >= 259 && i < 259) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "<0x%02X>", unsigned(i - 3));
      t = buf;
      type = 6;  // byte
    } else {
      t = "tok" + std::to_string(i);
    }
    tokens.push_back(t);
    scores.push_back(-float(i));
    types.push_back(type);
  }
  g.set_string("tokenizer.ggml.model", "llama");
  g.set_array_string("tokenizer.ggml.tokens", tokens);
  g.set_array_f32("tokenizer.ggml.scores", scores);
  g.set_array_i32("tokenizer.ggml.token_type", types);
  if (V >= 259) {
    g.set_u32("tokenizer.ggml.unknown_token_id", 0);
    g.set_u32("tokenizer.ggml.bos_token_id", 1);
    g.set_u32("tokenizer.ggml.eos_token_id", 2);
  }
}

// The GGUF architecture of an HF model_type, or a UsageError saying why
// llama.cpp's format does not express the model.
std::string gguf_arch(const ModelConfig& c) {
  const std::string& mt = c.model_type;
  auto refuse = [&](const std::string& why) { return UsageError("GGUF export of '" + c.source + "': " + why); };
  if (c.rope_scaling.type == RopeScaling::Type::Dynamic)
    throw refuse("dynamic rope scaling is not supported (supported: none, linear, yarn, llama3)");
  if (mt == "llama" || mt == "mistral" || mt == "mixtral") return "llama";
  if (mt == "qwen2" || mt == "qwen3") return mt;
  if (mt == "qwen2_moe" || mt == "qwen3_moe") {
    if (c.moe.sparse_step > 1 || !c.moe.mlp_only_layers.empty())
      throw refuse("llama.cpp's " + mt + " routes every layer: decoder_sparse_step " +
                   std::to_string(c.moe.sparse_step) + " / mlp_only_layers are not expressible");
    return mt == "qwen2_moe" ? "qwen2moe" : "qwen3moe";
  }
  if (mt == "deepseek_v3") {
    if (!c.mla.rope_interleave)
      throw refuse("llama.cpp ropes deepseek2's adjacent pairs: rope_interleave = false is not expressible");
    const RopeScaling& rs = c.rope_scaling;
    if (rs.type == RopeScaling::Type::Yarn && rs.mscale != rs.mscale_all_dim)
      throw refuse("yarn mscale " + std::to_string(rs.mscale) + " != mscale_all_dim " +
                   std::to_string(rs.mscale_all_dim) + ": llama.cpp stores one (rope.scaling.yarn_log_multiplier)");
    if (rs.type != RopeScaling::Type::Default && rs.type != RopeScaling::Type::Yarn)
      throw refuse(std::string("deepseek2 rope scaling ") + rope_type_name(rs.type) + " is not supported (supported: yarn)");
    return "deepseek2";
  }
  throw refuse("model_type '" + mt + "' has no GGUF architecture here (supported: llama, mistral, mixtral, qwen2, "
               "qwen3, qwen2_moe, qwen3_moe, deepseek_v3)");
}

void write_rope_scaling(GgufWriter& g, const std::string& a, const ModelConfig& c, bool deepseek) {
  const RopeScaling& rs = c.rope_scaling;
  if (rs.type == RopeScaling::Type::Linear) {
    g.set_string(a + "rope.scaling.type", "linear");
    g.set_f32(a + "rope.scaling.factor", float(rs.factor));
  } else if (rs.type == RopeScaling::Type::Yarn) {
    g.set_string(a + "rope.scaling.type", "yarn");
    g.set_f32(a + "rope.scaling.factor", float(rs.factor));
    if (rs.original_max_position_embeddings > 0)
      g.set_u32(a + "rope.scaling.original_context_length", uint32_t(rs.original_max_position_embeddings));
    if (rs.has_attention_factor) g.set_f32(a + "rope.scaling.yarn_attn_factor", float(rs.attention_factor));
    g.set_f32(a + "rope.scaling.yarn_beta_fast", float(rs.beta_fast));
    g.set_f32(a + "rope.scaling.yarn_beta_slow", float(rs.beta_slow));
    // DeepseekV2Model: 0.1 * mscale_all_dim (computed in double, stored as f32).
    if (deepseek && rs.mscale_all_dim != 0)
      g.set_f32(a + "rope.scaling.yarn_log_multiplier", float(0.1 * rs.mscale_all_dim));
  }
}

void write_metadata(GgufWriter& g, const ModelConfig& c, const std::string& arch, const GgufExportOptions& opt) {
  const std::string a = arch + ".";
  const MoeConfig& moe = c.moe;
  const bool deepseek = arch == "deepseek2";
  g.set_string("general.architecture", arch);
  g.set_string("general.name", "llmdiff export");
  g.set_u32("general.file_type", opt.quant.file_type());
  if (ggml_is_quantized(opt.quant.type)) g.set_u32("general.quantization_version", 2);
  g.set_u32(a + "context_length", uint32_t(c.max_position_embeddings));
  g.set_u32(a + "embedding_length", uint32_t(c.hidden_size));
  g.set_u32(a + "block_count", uint32_t(c.num_hidden_layers));
  g.set_u32(a + "feed_forward_length", uint32_t(c.intermediate_size));
  g.set_u32(a + "attention.head_count", uint32_t(c.num_attention_heads));
  // deepseek2 with the split kv_b is MQA over the latent (DeepseekV2Model sets one kv head).
  g.set_u32(a + "attention.head_count_kv", uint32_t(deepseek && !opt.kv_b_joint ? 1 : c.num_key_value_heads));
  g.set_f32(a + "rope.freq_base", float(c.rope_theta));
  g.set_f32(a + "attention.layer_norm_rms_epsilon", float(c.rms_norm_eps));
  if (moe.enabled()) {
    g.set_u32(a + "expert_count", uint32_t(moe.num_experts));
    g.set_u32(a + "expert_used_count", uint32_t(moe.top_k));
  }
  write_rope_scaling(g, a, c, deepseek);
  if (deepseek) {
    const MlaConfig& m = c.mla;
    g.set_u32(a + "expert_group_count", uint32_t(moe.n_group));
    g.set_u32(a + "expert_group_used_count", uint32_t(moe.topk_group));
    g.set_u32(a + "expert_gating_func", moe.scoring == MoeConfig::Scoring::Sigmoid ? 2 : 1);
    g.set_u32(a + "leading_dense_block_count", uint32_t(moe.first_k_dense));
    g.set_u32(a + "vocab_size", uint32_t(c.vocab_size));
    if (m.q_lora_rank > 0) g.set_u32(a + "attention.q_lora_rank", uint32_t(m.q_lora_rank));
    g.set_u32(a + "attention.kv_lora_rank", uint32_t(m.kv_lora_rank));
    if (opt.kv_b_joint) {
      g.set_u32(a + "attention.key_length", uint32_t(m.qk_head_dim()));
      g.set_u32(a + "attention.value_length", uint32_t(m.v_head_dim));
    } else {
      g.set_u32(a + "attention.key_length", uint32_t(m.kv_lora_rank + m.qk_rope_head_dim));
      g.set_u32(a + "attention.value_length", uint32_t(m.kv_lora_rank));
      g.set_u32(a + "attention.key_length_mla", uint32_t(m.qk_head_dim()));
      g.set_u32(a + "attention.value_length_mla", uint32_t(m.v_head_dim));
    }
    g.set_u32(a + "expert_feed_forward_length", uint32_t(moe.intermediate_size));
    g.set_u32(a + "expert_shared_count", uint32_t(moe.intermediate_size > 0 ? moe.shared_intermediate_size / moe.intermediate_size : 0));
    g.set_f32(a + "expert_weights_scale", float(moe.routed_scaling_factor));
    if (moe.norm_topk_prob) g.set_bool(a + "expert_weights_norm", true);
    g.set_u32(a + "rope.dimension_count", uint32_t(m.qk_rope_head_dim));
  } else {
    g.set_u32(a + "attention.key_length", uint32_t(c.head_dim));
    g.set_u32(a + "attention.value_length", uint32_t(c.head_dim));
    g.set_u32(a + "rope.dimension_count", uint32_t(c.head_dim));
    if (arch == "qwen2moe" || arch == "qwen3moe") {
      g.set_u32(a + "expert_feed_forward_length", uint32_t(moe.intermediate_size));
      if (moe.shared_intermediate_size > 0)
        g.set_u32(a + "expert_shared_feed_forward_length", uint32_t(moe.shared_intermediate_size));
      // llama.cpp's graphs renormalise for qwen3moe, not for qwen2moe: the
      // key only where the checkpoint differs (llmdiff reads it back).
      if (moe.norm_topk_prob != (arch == "qwen3moe")) g.set_bool(a + "expert_weights_norm", moe.norm_topk_prob);
    }
  }
  write_vocab(g, c.vocab_size);
}

}  // namespace

std::vector<std::string> write_gguf(const ModelWeights& w, const std::string& path, const GgufExportOptions& opt) {
  const ModelConfig& c = w.config();
  const std::string arch = gguf_arch(c);
  if (opt.kv_b_joint && !c.mla.enabled) throw UsageError("GGUF export: a joint kv_b needs an MLA model (deepseek_v3)");
  std::vector<Planned> plan = plan_tensors(w, opt);
  if (c.rope_scaling.type == RopeScaling::Type::Llama3) {
    // convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: the factors
    // computed in double, stored as float32 (first, as the converter writes them).
    const RopeScaling& rs = c.rope_scaling;
    const std::vector<double> factors =
        gguf_llama3_rope_factors(c.rope_theta, c.head_dim, rs.factor, rs.low_freq_factor, rs.high_freq_factor,
                                 double(rs.original_max_position_embeddings));
    Planned p;
    p.name = "rope_freqs.weight";
    p.shape = {int64_t(factors.size())};
    p.fill = [factors](int64_t, float* dst) { std::copy(factors.begin(), factors.end(), dst); };
    plan.insert(plan.begin(), p);
  }
  const TypeChoice choose(c, arch, opt.quant, plan);
  GgufWriter g(path);
  write_metadata(g, c, arch, opt);
  std::vector<std::string> written;
  for (const Planned& p : plan) {
    const GgmlType t = choose(p);
    g.add_tensor_f32_slabs(p.name, t, p.shape, p.slabs, p.fill);
    written.push_back(p.name + " " + ggml_type_name(uint32_t(t)));
  }
  g.finish();
  return written;
}

}  // namespace llmdiff
