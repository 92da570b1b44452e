#include "dumps/model/weights.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <sys/stat.h>

#include "dumps/base/errors.h"
#include "dumps/formats/gguf.h"
#include "dumps/model/gguf_model.h"

namespace llmdiff {

namespace {
bool file_exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}
}  // namespace

ModelWeights::~ModelWeights() = default;

ModelWeights::ModelWeights(const std::string& model_dir, const ModelConfig& cfg) : cfg_(cfg), dir_(model_dir) {
  const std::string single = model_dir + "/model.safetensors";
  const std::string index = model_dir + "/model.safetensors.index.json";
  std::vector<std::pair<std::string, std::string>> map;  // tensor -> file
  if (is_gguf_file(model_dir)) {
    gguf_ = std::make_unique<GgufFile>(model_dir);
  } else if (file_exists(single)) {
    files_.push_back(std::make_unique<SafetensorsFile>(single));
    for (const auto& t : files_[0]->tensors()) name_to_file_.emplace_back(t.name, 0);
  } else if (file_exists(index)) {
    std::ifstream in(index, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(ss.str());
    } catch (const nlohmann::json::exception& e) {
      throw FormatError(index, "", std::string("not valid JSON: ") + e.what());
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw FormatError(index, "", "lacks a 'weight_map' object");
    std::map<std::string, size_t> file_index;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) throw FormatError(index, it.key(), "weight_map entry is not a file name");
      const std::string shard = it.value().get<std::string>();
      if (shard.find('/') != std::string::npos || shard == "..")
        throw FormatError(index, it.key(), "shard name '" + shard + "' is not a plain file name");
      auto [pos, inserted] = file_index.emplace(shard, files_.size());
      if (inserted) files_.push_back(std::make_unique<SafetensorsFile>(model_dir + "/" + shard));
      if (!files_[pos->second]->find(it.key()))
        throw MissingTensorError(model_dir + "/" + shard, it.key());
      name_to_file_.emplace_back(it.key(), pos->second);
    }
  } else {
    throw IoError(model_dir, "no model.safetensors or model.safetensors.index.json, and not a GGUF file");
  }
  std::sort(name_to_file_.begin(), name_to_file_.end());

  const int64_t D = cfg.hidden_size, F = cfg.intermediate_size, V = cfg.vocab_size, Dh = cfg.head_dim;
  const int64_t QD = cfg.q_dim(), KD = cfg.kv_dim(), Hq = cfg.num_attention_heads;
  const MlaConfig& mla = cfg.mla;
  const MoeConfig& moe = cfg.moe;
  // HF's MLP module names: LlamaMLP / Qwen*MLP / DeepseekV3MLP (gate_proj,
  // up_proj, down_proj) or Mixtral's experts (w1 = gate, w3 = up, w2 = down).
  auto mlp_at = [&](const std::string& p, int64_t f, bool mixtral) {
    MlpWeights m;
    m.gate = require(p + (mixtral ? "w1.weight" : "gate_proj.weight"), {f, D});
    m.up = require(p + (mixtral ? "w3.weight" : "up_proj.weight"), {f, D});
    m.down = require(p + (mixtral ? "w2.weight" : "down_proj.weight"), {D, f});
    return m;
  };
  embed = require("model.embed_tokens.weight", {V, D});
  final_norm = require("model.norm.weight", {D});
  if (cfg.tie_word_embeddings) {
    lm_head = embed;
    lm_head_tied = true;
  } else {
    lm_head = require("lm_head.weight", {V, D});
  }
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LayerWeights L;
    L.input_norm = require(p + "input_layernorm.weight", {D});
    L.post_attn_norm = require(p + "post_attention_layernorm.weight", {D});
    if (mla.enabled) {  // DeepseekV3Attention
      const int64_t Rq = mla.q_lora_rank, Rkv = mla.kv_lora_rank, Dr = mla.qk_rope_head_dim;
      if (Rq > 0) {
        L.q_a = require(p + "self_attn.q_a_proj.weight", {Rq, D});
        L.q_a_norm = require(p + "self_attn.q_a_layernorm.weight", {Rq});
        L.q = require(p + "self_attn.q_b_proj.weight", {Hq * mla.qk_head_dim(), Rq});
      } else {
        L.q = require(p + "self_attn.q_proj.weight", {Hq * mla.qk_head_dim(), D});
      }
      L.kv_a = require(p + "self_attn.kv_a_proj_with_mqa.weight", {Rkv + Dr, D});
      L.kv_a_norm = require(p + "self_attn.kv_a_layernorm.weight", {Rkv});
      L.kv_b = require(p + "self_attn.kv_b_proj.weight", {Hq * (mla.qk_nope_head_dim + mla.v_head_dim), Rkv});
      L.o = require(p + "self_attn.o_proj.weight", {D, cfg.ctx_dim()});
    } else {
      L.q = require(p + "self_attn.q_proj.weight", {QD, D});
      L.k = require(p + "self_attn.k_proj.weight", {KD, D});
      L.v = require(p + "self_attn.v_proj.weight", {KD, D});
      L.o = require(p + "self_attn.o_proj.weight", {D, QD});
    }
    if (cfg.qkv_bias) {
      L.q_bias = require(p + "self_attn.q_proj.bias", {QD});
      L.k_bias = require(p + "self_attn.k_proj.bias", {KD});
      L.v_bias = require(p + "self_attn.v_proj.bias", {KD});
    }
    if (cfg.o_bias) L.o_bias = require(p + "self_attn.o_proj.bias", {D});
    if (cfg.qk_norm) {
      L.q_norm = require(p + "self_attn.q_norm.weight", {Dh});
      L.k_norm = require(p + "self_attn.k_norm.weight", {Dh});
    }
    if (!moe.is_moe_layer(i)) {
      L.mlp = mlp_at(p + "mlp.", F, false);
    } else {
      const bool mixtral = cfg.family == Family::Mixtral;
      const std::string block = p + (mixtral ? "block_sparse_moe." : "mlp.");
      const int64_t E = moe.num_experts;
      L.router = require(block + "gate.weight", {E, D});
      if (moe.correction_bias) L.router_bias = require(block + "gate.e_score_correction_bias", {E});
      for (int64_t e = 0; e < E; ++e)
        L.experts.push_back(mlp_at(block + "experts." + std::to_string(e) + ".", moe.intermediate_size, mixtral));
      if (moe.shared_intermediate_size > 0)
        // Qwen2MoeSparseMoeBlock.shared_expert, DeepseekV3MoE.shared_experts
        L.shared = mlp_at(block + (moe.shared_gate ? "shared_expert." : "shared_experts."),
                          moe.shared_intermediate_size, false);
      if (moe.shared_gate) L.shared_gate = require(block + "shared_expert_gate.weight", {1, D});
    }
    layers.push_back(std::move(L));
  }
}

std::vector<const WeightView*> LayerWeights::views() const {
  std::vector<const WeightView*> all = {&input_norm, &post_attn_norm, &q,     &k,        &v,      &o,
                                      &q_bias,     &k_bias,         &v_bias, &o_bias,   &q_norm, &k_norm,
                                      &q_a,        &q_a_norm,       &kv_a,  &kv_a_norm, &kv_b,   &mlp.gate,
                                      &mlp.up,     &mlp.down,       &router, &router_bias};
  for (const MlpWeights& e : experts) all.insert(all.end(), {&e.gate, &e.up, &e.down});
  all.insert(all.end(), {&shared.gate, &shared.up, &shared.down, &shared_gate});
  return all;
}

WeightView ModelWeights::find(const std::string& name) const {
  if (gguf_) return find_gguf(name);
  auto it = std::lower_bound(name_to_file_.begin(), name_to_file_.end(), std::make_pair(name, size_t(0)),
                             [](const auto& a, const auto& b) { return a.first < b.first; });
  if (it == name_to_file_.end() || it->first != name) return {};
  const SafetensorsFile& f = *files_[it->second];
  const TensorInfo& t = f.at(name);
  WeightView w;
  w.name = name;
  w.file = f.path();
  w.dtype = t.dtype;
  w.shape = t.shape;
  w.data = f.data(t);
  if (w.data == nullptr || t.nbytes() == 0) {
    // A zero-sized weight cannot be a real parameter of these models.
    throw FormatError(f.path(), name, "empty tensor " + shape_str(t.shape));
  }
  return w;
}

namespace {

// A GGUF tensor's values' type as a view holds it: F32/F16/BF16 as a dtype,
// a supported block type in `quant`.
void set_stored_type(WeightView& w, const GgufFile& f, const GgufTensorInfo& t) {
  switch (t.type) {
    case GgmlType::F32: w.dtype = DType::F32; break;
    case GgmlType::F16: w.dtype = DType::F16; break;
    case GgmlType::BF16: w.dtype = DType::BF16; break;
    default:
      if (!ggml_type_supported(uint32_t(t.type)) || !ggml_is_quantized(t.type))
        throw FormatError(f.path(), t.name, "unsupported tensor type " + ggml_type_name(uint32_t(t.type)) +
                                                " (supported: " + ggml_supported_types() + ")");
      w.dtype = DType::F32;
      w.quant = t.type;
  }
}

std::string ne_str(const GgufTensorInfo& t) {
  std::string s = "ne {";
  for (size_t i = 0; i < t.ne.size(); ++i) s += (i ? ", " : "") + std::to_string(t.ne[i]);
  return s + "}";
}

}  // namespace

WeightView ModelWeights::find_gguf(const std::string& name) const {
  const GgufLocation loc = gguf_locate(name);
  if (loc.kv_b && !gguf_->find(loc.name) && gguf_->find(loc.k_b_name)) return gguf_kv_b(name, loc);
  const GgufTensorInfo* t = loc.name.empty() ? nullptr : gguf_->find(loc.name);
  if (!t) return {};
  WeightView w;
  w.name = name;
  w.stored_name = loc.name;
  w.file = gguf_->path();
  w.shape = t->shape();
  set_stored_type(w, *gguf_, *t);
  w.data = gguf_->data(*t);
  if (loc.expert >= 0) {
    // Expert e of a merged tensor ne {cols, rows, E}: the contiguous block e, in place.
    const int64_t E = cfg_.moe.num_experts;
    if (t->ne.size() != 3 || t->ne[2] != E)
      throw ShapeError(w.file, loc.name, "3-D ne {cols, rows, " + std::to_string(E) + "} (" + std::to_string(E) +
                                             " experts: expert_count)", ne_str(*t));
    if (loc.expert >= E) return {};
    w.shape = {t->ne[1], t->ne[0]};
    w.stored_name = loc.name + " expert " + std::to_string(loc.expert);
    w.data = static_cast<const uint8_t*>(w.data) + size_t(loc.expert) * w.bytes();
    return w;
  }
  static const std::string gate = ".mlp.shared_expert_gate.weight";
  if (t->ne.size() == 1 && name.size() > gate.size() && name.compare(name.size() - gate.size(), gate.size(), gate) == 0)
    w.shape = {1, t->ne[0]};  // Qwen2-MoE's [1, D] gate, stored 1-D by some converters
  int64_t heads = 0;
  if (gguf_rows_permuted(cfg_, name, &heads) && w.shape.size() == 2) {
    // llama.cpp stored each head's rotary pairs adjacent: the rows are read
    // through the permutation, in place.
    if (heads <= 0 || w.rows() % heads != 0 || (w.rows() / heads) % 2 != 0)
      throw ShapeError(w.file, loc.name, "rows a multiple of 2 x " + std::to_string(heads) + " heads", shape_str(w.shape));
    w.interleaved_heads = heads;
  } else if (gguf_rows_permuted(cfg_, name, &heads)) {
    // A bias's elements, put back in HF's order once (a copy of one row).
    auto [it, fresh] = owned_.try_emplace(loc.name);
    if (fresh) {
      const bool vec = w.shape.size() == 1;
      const int64_t n = vec ? w.numel() : w.rows();
      const size_t width = vec ? dtype_size(w.dtype) : w.row_bytes();
      if (heads <= 0 || n % heads != 0 || (n / heads) % 2 != 0)
        throw ShapeError(w.file, loc.name, "rows a multiple of 2 x " + std::to_string(heads) + " heads", shape_str(w.shape));
      if (vec && w.quantized()) throw FormatError(w.file, loc.name, "a quantised bias is not supported");
      it->second.resize(size_t(n) * width);
      const auto* src = static_cast<const uint8_t*>(w.data);
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(&it->second[size_t(r) * width], src + size_t(gguf_permuted_row(r, n, heads)) * width, width);
    }
    w.data = it->second.data();
    w.owned = true;
  }
  return w;
}

WeightView ModelWeights::gguf_kv_b(const std::string& name, const GgufLocation& loc) const {
  // kv_b_proj [H*(Dn+Dv), Rkv] from the absorbed form's attn_k_b ne {Dn, Rkv, H}
  // (each head's key rows transposed) and attn_v_b ne {Rkv, Dv, H}: the key
  // part is a transpose, so the matrix is assembled once (float32, or the
  // 16-bit type both share: exact).
  const GgufTensorInfo* kt = gguf_->find(loc.k_b_name);
  const GgufTensorInfo* vt = gguf_->find(loc.v_b_name);
  if (!vt) throw MissingTensorError(gguf_->path(), loc.v_b_name + "' (with " + loc.k_b_name + ", HF '" + name + "')");
  const int64_t H = cfg_.num_attention_heads, Dn = cfg_.mla.qk_nope_head_dim, Dv = cfg_.mla.v_head_dim;
  const int64_t Rkv = cfg_.mla.kv_lora_rank;
  if (kt->ne != std::vector<int64_t>{Dn, Rkv, H})
    throw ShapeError(gguf_->path(), loc.k_b_name, "ne {" + std::to_string(Dn) + ", " + std::to_string(Rkv) + ", " +
                                                      std::to_string(H) + "} (qk_nope, kv_lora_rank, heads)", ne_str(*kt));
  if (vt->ne != std::vector<int64_t>{Rkv, Dv, H})
    throw ShapeError(gguf_->path(), loc.v_b_name, "ne {" + std::to_string(Rkv) + ", " + std::to_string(Dv) + ", " +
                                                      std::to_string(H) + "} (kv_lora_rank, v_head, heads)", ne_str(*vt));
  WeightView k, v;  // each as a [H*rows, cols] matrix of its own type
  for (auto [view, t] : {std::pair<WeightView*, const GgufTensorInfo*>{&k, kt}, {&v, vt}}) {
    view->file = gguf_->path();
    view->name = name;
    view->stored_name = t->name;
    view->shape = {t->ne[2] * t->ne[1], t->ne[0]};
    set_stored_type(*view, *gguf_, *t);
    view->data = gguf_->data(*t);
  }
  WeightView w;
  w.name = name;
  w.stored_name = loc.k_b_name + " + " + loc.v_b_name;
  w.file = gguf_->path();
  w.shape = {H * (Dn + Dv), Rkv};
  const bool same16 = !k.quantized() && !v.quantized() && k.dtype == v.dtype;
  w.dtype = same16 ? k.dtype : DType::F32;
  w.owned = true;
  const auto [slot, fresh] = owned_.try_emplace(w.stored_name);
  std::vector<uint8_t>& bytes = slot->second;
  if (fresh) {
    const size_t es = dtype_size(w.dtype);
    bytes.resize(size_t(w.numel()) * es);
    std::vector<float> kr(size_t(Rkv * Dn)), vr(size_t(Dv * Rkv));  // one head's [Rkv, Dn], [Dv, Rkv]
    std::vector<float> row(static_cast<size_t>(Rkv));
    auto put = [&](int64_t r, const float* values) {  // row r in w's dtype (exact: the values came from it)
      uint8_t* dst = bytes.data() + size_t(r * Rkv) * es;
      for (int64_t c = 0; c < Rkv; ++c) {
        if (w.dtype == DType::F32) {
          std::memcpy(dst + size_t(c) * 4, &values[c], 4);
        } else {
          const uint16_t h = w.dtype == DType::F16 ? f32_to_f16(values[c]) : f32_to_bf16(values[c]);
          std::memcpy(dst + size_t(c) * 2, &h, 2);
        }
      }
    };
    for (int64_t h = 0; h < H; ++h) {
      k.rows_f32(h * Rkv, Rkv, kr.data());
      v.rows_f32(h * Dv, Dv, vr.data());
      for (int64_t i = 0; i < Dn; ++i) {
        for (int64_t r = 0; r < Rkv; ++r) row[size_t(r)] = kr[size_t(r * Dn + i)];
        put(h * (Dn + Dv) + i, row.data());
      }
      for (int64_t j = 0; j < Dv; ++j) put(h * (Dn + Dv) + Dn + j, &vr[size_t(j * Rkv)]);
    }
  }
  w.data = bytes.data();
  return w;
}

int64_t WeightView::stored_row(int64_t r) const {
  return interleaved_heads > 0 ? gguf_permuted_row(r, rows(), interleaved_heads) : r;
}

void WeightView::rows_f32(int64_t r0, int64_t n, float* dst) const {
  const int64_t c = cols();
  const auto* bytes = static_cast<const uint8_t*>(data);
  if (interleaved_heads == 0 && !quantized()) {
    convert_to_f32(bytes + size_t(r0) * row_bytes(), dtype, size_t(n * c), dst);
    return;
  }
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = bytes + size_t(stored_row(r0 + r)) * row_bytes();
    if (quantized())
      dequantize_row(quant, row, dst + r * c, c);
    else
      convert_to_f32(row, dtype, size_t(c), dst + r * c);
  }
}

DType ModelWeights::storage_dtype() const { return embed.quantized() ? DType::F32 : embed.dtype; }

WeightView ModelWeights::require(const std::string& name, const Shape& shape) const {
  WeightView w = find(name);
  if (!w) {
    if (gguf_) {
      const GgufLocation loc = gguf_locate(name);
      const std::string stored = loc.kv_b ? loc.name + "' (or '" + loc.k_b_name + "' with '" + loc.v_b_name : loc.name;
      throw MissingTensorError(gguf_->path(), stored.empty() ? name : stored + "' (HF '" + name + "')");
    }
    throw MissingTensorError(files_.size() == 1 ? files_[0]->path() : dir_ + "/model.safetensors.index.json", name);
  }
  if (w.shape != shape) throw ShapeError(w.file, w.label(), shape_str(shape), shape_str(w.shape));
  if (w.dtype != DType::F32 && w.dtype != DType::BF16 && w.dtype != DType::F16)
    throw FormatError(w.file, name, std::string("unsupported weight dtype ") + dtype_name(w.dtype) + " (supported: F32, BF16, F16)");
  return w;
}

WeightView ModelWeights::optional(const std::string& name, const Shape& shape) const {
  if (!find(name)) return {};
  return require(name, shape);
}

size_t ModelWeights::total_bytes() const {
  std::set<const void*> seen;
  size_t total = 0;
  auto add = [&](const WeightView& w) {
    if (w && seen.insert(w.data).second) total += w.bytes();
  };
  add(embed);
  add(final_norm);
  add(lm_head);
  for (const auto& L : layers)
    for (const WeightView* w : L.views()) add(*w);
  return total;
}

Model Model::load(const std::string& dir) {
  Model m;
  m.config = load_config(dir);
  m.weights = std::make_shared<ModelWeights>(dir, m.config);
  return m;
}

void ModelWeights::release_layer(int layer) const {
  if (layer < 0 || size_t(layer) >= layers.size()) return;
  for (const WeightView* v : layers[size_t(layer)].views())
    if (*v && !v->owned) release_pages(v->data, v->bytes());
}

void ModelWeights::release_head() const {
  for (const WeightView* v : {&embed, &lm_head, &final_norm})
    if (*v && !v->owned) release_pages(v->data, v->bytes());
}

void ModelWeights::release_all() const {
  for (size_t l = 0; l < layers.size(); ++l) release_layer(int(l));
  release_head();
}

}  // namespace llmdiff
