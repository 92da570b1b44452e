#include "dumps/model/gguf_model.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sys/stat.h>

#include "dumps/base/errors.h"
#include "dumps/model/weights.h"

namespace llmdiff {

using ordered_json = nlohmann::ordered_json;

bool is_gguf_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return bool(in.read(magic, 4)) && std::string(magic, 4) == "GGUF";
}

std::string gguf_supported_architectures() { return "llama, qwen2, qwen3"; }

namespace {

// The shortest decimal that reads back as the same float32: GGUF stores eps
// and rope bases as f32, HF's config.json as decimals (1e-05, not
// 9.99999975e-06). HF adds them to float32 tensors, where both are the same
// float32.
double f32_decimal(double v) {
  const float f = float(v);
  for (int digits = 1; digits <= 9; ++digits) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.*g", digits, double(f));
    const double d = std::strtod(buf, nullptr);
    if (float(d) == f) return d;
  }
  return double(f);
}

// llama.cpp's llama-3 rope factors (convert_hf_to_gguf.py
// LlamaModel.generate_extra_tensors, written as rope_freqs.weight) for the
// given rope_scaling parameters.
std::vector<double> llama3_rope_factors(double base, int64_t dim, double factor, double low, double high,
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
      const std::vector<double> want = llama3_rope_factors(base, dim, factor, low, high, old_ctx);
      bool fits = true;
      for (size_t i = 0; i < want.size() && fits; ++i)
        fits = std::fabs(double(stored[i]) - want[i]) <= 1e-5 * std::fabs(want[i]);
      if (fits)
        return ordered_json{{"rope_type", "llama3"},
                            {"factor", f32_decimal(factor)},
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

}  // namespace

std::string gguf_config_json(const GgufFile& f) {
  const std::string arch = f.get_string("general.architecture", "");
  if (arch.empty()) throw ConfigError(f.path(), "no general.architecture");
  if (arch != "llama" && arch != "qwen2" && arch != "qwen3")
    throw ConfigError(f.path(), "unsupported GGUF architecture '" + arch + "' (supported: " +
                                    gguf_supported_architectures() + ")");
  const std::string a = arch + ".";
  auto required = [&](const std::string& key) {
    if (!f.has(a + key)) throw ConfigError(f.path(), "missing metadata key '" + a + key + "'");
    const GgufValue* v = f.get(a + key);
    if (v->is_array())
      throw ConfigError(f.path(), "metadata key '" + a + key + "' is a per-layer array; only uniform layers are supported");
    return f.get_int(a + key, 0);
  };
  const GgufTensorInfo* embd = f.find("token_embd.weight");
  if (!embd) throw MissingTensorError(f.path(), "token_embd.weight");
  if (embd->ne.size() != 2) throw FormatError(f.path(), embd->name, "token_embd.weight is not 2-D");

  const int64_t D = required("embedding_length");
  const int64_t L = required("block_count");
  const int64_t H = required("attention.head_count");
  const int64_t Hkv = f.has(a + "attention.head_count_kv") ? required("attention.head_count_kv") : H;
  if (H <= 0 || D <= 0) throw ConfigError(f.path(), "embedding_length and attention.head_count must be positive");
  const int64_t Dh = f.has(a + "attention.key_length") ? required("attention.key_length") : D / H;
  if (f.has(a + "attention.value_length") && required("attention.value_length") != Dh)
    throw ConfigError(f.path(), a + "attention.value_length differs from key_length: unsupported");
  if (f.has(a + "rope.dimension_count") && required("rope.dimension_count") != Dh)
    throw ConfigError(f.path(), a + "rope.dimension_count " + std::to_string(required("rope.dimension_count")) +
                                    " differs from the head size " + std::to_string(Dh) +
                                    ": partial rotary is not supported");
  const double base = f.get_float(a + "rope.freq_base", 10000.0);

  ordered_json j;
  j["architectures"] = {arch == "llama" ? "LlamaForCausalLM" : arch == "qwen2" ? "Qwen2ForCausalLM" : "Qwen3ForCausalLM"};
  j["model_type"] = arch;
  j["hidden_size"] = D;
  j["intermediate_size"] = required("feed_forward_length");
  j["num_hidden_layers"] = L;
  j["num_attention_heads"] = H;
  j["num_key_value_heads"] = Hkv;
  j["head_dim"] = Dh;
  j["vocab_size"] = embd->ne[1];
  j["max_position_embeddings"] = f.has(a + "context_length") ? required("context_length") : 2048;
  j["rms_norm_eps"] = f32_decimal(f.get_float(a + "attention.layer_norm_rms_epsilon", 1e-6));
  j["rope_theta"] = f32_decimal(base);
  j["tie_word_embeddings"] = f.find("output.weight") == nullptr;
  if (arch == "llama") {
    j["attention_bias"] = f.find("blk.0.attn_q.bias") != nullptr;
    j["mlp_bias"] = false;
  }
  if (arch != "llama") {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
  }
  // rope scaling: metadata (linear, yarn) or llama-3's factors tensor.
  const std::string type = f.get_string(a + "rope.scaling.type", "none");
  const double factor = f.get_float(a + "rope.scaling.factor", 1.0);
  if (const GgufTensorInfo* freqs = f.find("rope_freqs.weight")) {
    j["rope_scaling"] = fit_llama3_scaling(f, *freqs, base, Dh);
  } else if (type == "linear" && factor != 1.0) {
    j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", f32_decimal(factor)}};
  } else if (type == "yarn") {
    ordered_json rs = {{"rope_type", "yarn"}, {"factor", f32_decimal(factor)}};
    if (f.has(a + "rope.scaling.original_context_length"))
      rs["original_max_position_embeddings"] = f.get_int(a + "rope.scaling.original_context_length", 0);
    j["rope_scaling"] = rs;
  } else if (type != "none" && type != "linear") {
    throw ConfigError(f.path(), "unsupported rope scaling type '" + type + "' (supported: none, linear, yarn, llama3 factors)");
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["torch_dtype"] = storage_torch_dtype(f);
  j["gguf"] = {{"file", f.path()}, {"version", f.version()}, {"architecture", arch}};
  return j.dump(2);
}

ModelConfig gguf_config(const GgufFile& f) { return parse_config(gguf_config_json(f), f.path()); }

std::string gguf_tensor_name(const std::string& hf) {
  static const std::vector<std::pair<std::string, std::string>> top = {
      {"model.embed_tokens.weight", "token_embd.weight"},
      {"model.norm.weight", "output_norm.weight"},
      {"lm_head.weight", "output.weight"},
  };
  for (const auto& [h, g] : top)
    if (hf == h) return g;
  static const std::vector<std::pair<std::string, std::string>> layer = {
      {"input_layernorm.weight", "attn_norm.weight"},
      {"post_attention_layernorm.weight", "ffn_norm.weight"},
      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.o_proj.weight", "attn_output.weight"},
      {"self_attn.q_proj.bias", "attn_q.bias"},
      {"self_attn.k_proj.bias", "attn_k.bias"},
      {"self_attn.v_proj.bias", "attn_v.bias"},
      {"self_attn.o_proj.bias", "attn_output.bias"},
      {"self_attn.q_norm.weight", "attn_q_norm.weight"},
      {"self_attn.k_norm.weight", "attn_k_norm.weight"},
      {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"},
  };
  static const std::regex layer_re(R"(model\.layers\.(\d+)\.(.+))");
  std::smatch m;
  if (!std::regex_match(hf, m, layer_re)) return "";
  for (const auto& [h, g] : layer)
    if (m[2] == h) return "blk." + m[1].str() + "." + g;
  return "";
}

bool gguf_rows_permuted(const ModelConfig& cfg, const std::string& hf, int64_t* heads) {
  if (cfg.family != Family::Llama) return false;
  auto ends = [&](const std::string& s) { return hf.size() > s.size() && hf.compare(hf.size() - s.size(), s.size(), s) == 0; };
  if (ends("self_attn.q_proj.weight") || ends("self_attn.q_proj.bias")) {
    *heads = cfg.num_attention_heads;
    return true;
  }
  if (ends("self_attn.k_proj.weight") || ends("self_attn.k_proj.bias")) {
    *heads = cfg.num_key_value_heads;
    return true;
  }
  return false;
}

int64_t gguf_permuted_row(int64_t r, int64_t rows, int64_t heads) {
  // HF row r = h*Dh + half*(Dh/2) + j  <->  stored row h*Dh + 2j + half.
  const int64_t dh = rows / heads, h = r / dh, i = r % dh;
  const int64_t half = i / (dh / 2), j = i % (dh / 2);
  return h * dh + 2 * j + half;
}

// ----------------------------------------------------------------- writer

GgmlType parse_ggml_type(const std::string& s) {
  for (uint32_t t = 0; t < 64; ++t)
    if (ggml_type_supported(t) && ggml_type_name(t) == s) return GgmlType(t);
  throw UsageError("unknown or unsupported GGUF type '" + s + "' (supported: " + ggml_supported_types() + ")");
}

namespace {

// The type llama-quantize falls back to when a row is not a whole number of
// blocks (llama-quant.cpp, "tensor cols are not divisible by the block size").
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

}  // namespace

std::vector<std::string> write_gguf(const ModelWeights& w, const std::string& path, GgmlType type) {
  const ModelConfig& c = w.config();
  const std::string arch = c.model_type == "mistral" ? "llama" : c.model_type;
  if (arch != "llama" && arch != "qwen2" && arch != "qwen3")
    throw UsageError("GGUF export supports " + gguf_supported_architectures() + ", not '" + c.model_type + "'");
  if (c.rope_scaling.type == RopeScaling::Type::Dynamic)
    throw UsageError("GGUF export: dynamic rope scaling is not supported (supported: none, linear, yarn, llama3)");
  GgufWriter g(path);
  const std::string a = arch + ".";
  g.set_string("general.architecture", arch);
  g.set_string("general.name", "llmdiff export");
  g.set_u32(a + "context_length", uint32_t(c.max_position_embeddings));
  g.set_u32(a + "embedding_length", uint32_t(c.hidden_size));
  g.set_u32(a + "block_count", uint32_t(c.num_hidden_layers));
  g.set_u32(a + "feed_forward_length", uint32_t(c.intermediate_size));
  g.set_u32(a + "attention.head_count", uint32_t(c.num_attention_heads));
  g.set_u32(a + "attention.head_count_kv", uint32_t(c.num_key_value_heads));
  g.set_u32(a + "attention.key_length", uint32_t(c.head_dim));
  g.set_u32(a + "attention.value_length", uint32_t(c.head_dim));
  g.set_u32(a + "rope.dimension_count", uint32_t(c.head_dim));
  g.set_f32(a + "rope.freq_base", float(c.rope_theta));
  g.set_f32(a + "attention.layer_norm_rms_epsilon", float(c.rms_norm_eps));
  if (c.rope_scaling.type == RopeScaling::Type::Linear) {
    g.set_string(a + "rope.scaling.type", "linear");
    g.set_f32(a + "rope.scaling.factor", float(c.rope_scaling.factor));
  } else if (c.rope_scaling.type == RopeScaling::Type::Yarn) {
    g.set_string(a + "rope.scaling.type", "yarn");
    g.set_f32(a + "rope.scaling.factor", float(c.rope_scaling.factor));
    if (c.rope_scaling.original_max_position_embeddings > 0)
      g.set_u32(a + "rope.scaling.original_context_length", uint32_t(c.rope_scaling.original_max_position_embeddings));
  }
  write_vocab(g, c.vocab_size);

  std::vector<std::string> written;
  std::vector<float> buf, permuted;
  auto add = [&](const WeightView& v) {
    if (!v) return;
    const std::string name = gguf_tensor_name(v.name);
    const int64_t rows = v.rows(), cols = v.cols();
    buf.resize(size_t(rows * cols));
    v.rows_f32(0, rows, buf.data());
    int64_t heads = 0;
    if (gguf_rows_permuted(c, v.name, &heads)) {
      // A bias permutes its elements as a weight its rows.
      const int64_t n = v.shape.size() == 1 ? v.numel() : rows, width = v.shape.size() == 1 ? 1 : cols;
      permuted.resize(buf.size());
      for (int64_t r = 0; r < n; ++r)
        std::copy_n(&buf[size_t(r * width)], width, &permuted[size_t(gguf_permuted_row(r, n, heads) * width)]);
      buf.swap(permuted);
    }
    const GgmlType t = v.shape.size() == 1 ? GgmlType::F32 : fallback_type(type, cols);
    g.add_tensor_f32(name, t, v.shape, buf.data());
    written.push_back(name + " " + ggml_type_name(uint32_t(t)));
  };
  if (c.rope_scaling.type == RopeScaling::Type::Llama3) {
    // convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: the factors
    // computed in double, stored as float32.
    const RopeScaling& rs = c.rope_scaling;
    const std::vector<double> factors = llama3_rope_factors(c.rope_theta, c.head_dim, rs.factor, rs.low_freq_factor,
                                                            rs.high_freq_factor, double(rs.original_max_position_embeddings));
    const std::vector<float> f32(factors.begin(), factors.end());
    g.add_tensor_f32("rope_freqs.weight", GgmlType::F32, {int64_t(f32.size())}, f32.data());
    written.push_back("rope_freqs.weight F32");
  }
  add(w.embed);
  add(w.final_norm);
  if (!w.lm_head_tied) add(w.lm_head);
  for (const LayerWeights& L : w.layers)
    for (const WeightView* v : L.views()) {
      if (!*v) continue;
      if (gguf_tensor_name(v->name).empty())
        throw UsageError("GGUF export: no GGUF name for '" + v->name + "' (mixture-of-experts and MLA models are not supported)");
      add(*v);
    }
  g.finish();
  return written;
}

}  // namespace llmdiff
