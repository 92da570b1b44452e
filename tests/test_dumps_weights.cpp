// HF checkpoints: every golden model loads with the config's shapes; sharded
// checkpoints; tied vs untied lm_head; missing tensors, wrong shapes and
// unsupported dtypes give typed errors naming the tensor.
#include <gtest/gtest.h>

#include <cstring>

#include "dumps/model/config.h"
#include "dumps/base/errors.h"
#include "dumps/formats/safetensors.h"
#include "dumps/model/weights.h"
#include "tests/support.h"
#include "tests/test_dumps_helpers.h"

namespace llmdiff {
namespace {

using namespace llmdiff::testing;
using ojson = nlohmann::ordered_json;

// One tensor of a checkpoint, copied out of its file.
struct Tensor {
  std::string name;
  DType dtype;
  Shape shape;
  Bytes bytes;
};

std::vector<Tensor> golden_tensors(const std::string& model) {
  SafetensorsFile f(golden_model(model) + "/model.safetensors");
  std::vector<Tensor> out;
  for (const auto& t : f.tensors()) {
    const auto* p = static_cast<const uint8_t*>(f.data(t));
    out.push_back({t.name, t.dtype, t.shape, Bytes(p, p + t.nbytes())});
  }
  return out;
}

void write_weights(const std::string& path, const std::vector<Tensor>& tensors) {
  SafetensorsWriter w(path);
  w.set_metadata("format", "pt");
  for (const auto& t : tensors) w.add(t.name, t.dtype, t.shape, t.bytes.data(), t.bytes.size());
  w.finish();
}

// A model directory with the given config text and a single-file checkpoint.
std::string model_dir(const std::string& stem, const std::string& config, const std::vector<Tensor>& tensors) {
  const std::string dir = fresh_dir(stem);
  write_text(dir + "/config.json", config);
  write_weights(dir + "/model.safetensors", tensors);
  return dir;
}

std::string golden_config(const std::string& model) { return read_text(golden_model(model) + "/config.json"); }

std::string with_config(const std::string& model, const std::function<void(ojson&)>& f) {
  ojson j = ojson::parse(golden_config(model));
  f(j);
  return j.dump(2);
}

std::vector<Tensor> without(std::vector<Tensor> ts, const std::string& name) {
  ts.erase(std::remove_if(ts.begin(), ts.end(), [&](const Tensor& t) { return t.name == name; }), ts.end());
  return ts;
}

Tensor& find(std::vector<Tensor>& ts, const std::string& name) {
  for (auto& t : ts)
    if (t.name == name) return t;
  throw std::runtime_error("no tensor " + name);
}

// Checks every view of `w` against the config's shapes and against the bytes
// of the golden checkpoint.
void check_model(const ModelWeights& w, const std::string& golden) {
  const ModelConfig& c = w.config();
  const int64_t D = c.hidden_size, F = c.intermediate_size, V = c.vocab_size, Dh = c.head_dim;
  const int64_t QD = c.q_dim(), KD = c.kv_dim();
  const auto ref = golden_tensors(golden);
  auto same_bytes = [&](const WeightView& v) {
    for (const auto& t : ref)
      if (t.name == v.name)
        return v.dtype == t.dtype && v.shape == t.shape && std::memcmp(v.data, t.bytes.data(), t.bytes.size()) == 0;
    return false;
  };
  EXPECT_EQ(w.embed.shape, (Shape{V, D}));
  EXPECT_EQ(w.final_norm.shape, Shape{D});
  EXPECT_EQ(w.lm_head.shape, (Shape{V, D}));
  EXPECT_TRUE(same_bytes(w.embed));
  EXPECT_TRUE(same_bytes(w.final_norm));
  EXPECT_EQ(w.lm_head_tied, c.tie_word_embeddings);
  if (c.tie_word_embeddings) {
    EXPECT_EQ(w.lm_head.data, w.embed.data);
  } else {
    EXPECT_EQ(w.lm_head.name, "lm_head.weight");
    EXPECT_NE(w.lm_head.data, w.embed.data);
    EXPECT_TRUE(same_bytes(w.lm_head));
  }
  ASSERT_EQ(int64_t(w.layers.size()), c.num_hidden_layers);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    SCOPED_TRACE("layer " + std::to_string(i));
    const LayerWeights& L = w.layers[i];
    const std::string p = "model.layers." + std::to_string(i) + ".";
    EXPECT_EQ(L.input_norm.shape, Shape{D});
    EXPECT_EQ(L.post_attn_norm.shape, Shape{D});
    // Every view is the stored tensor of its name, bytes and all.
    for (const WeightView* v : L.views())
      if (*v) {
        EXPECT_TRUE(same_bytes(*v)) << v->name;
      }
    if (c.mla.enabled) {
      const MlaConfig& a = c.mla;
      EXPECT_EQ(L.q.name, p + "self_attn.q_b_proj.weight");
      EXPECT_EQ(L.q.shape, (Shape{c.num_attention_heads * a.qk_head_dim(), a.q_lora_rank}));
      EXPECT_EQ(L.kv_a.shape, (Shape{a.kv_lora_rank + a.qk_rope_head_dim, D}));
      EXPECT_EQ(L.kv_b.shape, (Shape{c.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank}));
      EXPECT_EQ(L.o.shape, (Shape{D, c.ctx_dim()}));
      EXPECT_FALSE(L.k || L.v);
    } else {
      EXPECT_EQ(L.q.shape, (Shape{QD, D}));
      EXPECT_EQ(L.k.shape, (Shape{KD, D}));
      EXPECT_EQ(L.v.shape, (Shape{KD, D}));
      EXPECT_EQ(L.o.shape, (Shape{D, QD}));
      EXPECT_EQ(L.q.name, p + "self_attn.q_proj.weight");
      EXPECT_FALSE(L.q_a || L.kv_a || L.kv_b);
    }
    if (c.moe.is_moe_layer(int64_t(i))) {
      const int64_t Fe = c.moe.intermediate_size;
      EXPECT_FALSE(L.mlp.gate);
      EXPECT_EQ(L.router.shape, (Shape{c.moe.num_experts, D}));
      EXPECT_EQ(bool(L.router_bias), c.moe.correction_bias);
      ASSERT_EQ(int64_t(L.experts.size()), c.moe.num_experts);
      for (const MlpWeights& e : L.experts) {
        EXPECT_EQ(e.gate.shape, (Shape{Fe, D}));
        EXPECT_EQ(e.down.shape, (Shape{D, Fe}));
      }
      EXPECT_EQ(L.experts[1].up.name, p + (c.family == Family::Mixtral ? "block_sparse_moe.experts.1.w3.weight"
                                                                         : "mlp.experts.1.up_proj.weight"));
      EXPECT_EQ(bool(L.shared.gate), c.moe.shared_intermediate_size > 0);
    } else {
      EXPECT_EQ(L.mlp.gate.shape, (Shape{F, D}));
      EXPECT_EQ(L.mlp.up.shape, (Shape{F, D}));
      EXPECT_EQ(L.mlp.down.shape, (Shape{D, F}));
      EXPECT_EQ(L.mlp.down.name, p + "mlp.down_proj.weight");
      EXPECT_TRUE(L.experts.empty());
      EXPECT_FALSE(L.router);
    }
    EXPECT_EQ(bool(L.q_bias), c.qkv_bias);
    EXPECT_EQ(bool(L.k_bias), c.qkv_bias);
    EXPECT_EQ(bool(L.v_bias), c.qkv_bias);
    if (c.qkv_bias) {
      EXPECT_EQ(L.q_bias.shape, Shape{QD});
      EXPECT_EQ(L.k_bias.shape, Shape{KD});
      EXPECT_EQ(L.v_bias.shape, Shape{KD});
      EXPECT_TRUE(same_bytes(L.k_bias));
    }
    EXPECT_EQ(bool(L.o_bias), c.o_bias);
    EXPECT_EQ(bool(L.q_norm), c.qk_norm);
    EXPECT_EQ(bool(L.k_norm), c.qk_norm);
    if (c.qk_norm) {
      EXPECT_EQ(L.q_norm.shape, Shape{Dh});
      EXPECT_EQ(L.k_norm.shape, Shape{Dh});
      EXPECT_TRUE(same_bytes(L.q_norm));
    }
  }
  // Every stored byte is a weight the model uses, counted once.
  size_t stored = 0;
  for (const auto& t : ref) stored += t.bytes.size();
  EXPECT_EQ(w.total_bytes(), stored);
  EXPECT_EQ(w.storage_dtype(), ref.front().dtype);
}

TEST(Weights, EveryGoldenCheckpointLoadsWithTheConfigsShapes) {
  for (const auto& model : golden_models()) {
    SCOPED_TRACE(model);
    const Model m = Model::load(golden_model(model));
    ASSERT_TRUE(m.weights);
    EXPECT_EQ(m.weights->dir(), golden_model(model));
    EXPECT_EQ(m.weights->config().hidden_size, m.config.hidden_size);
    check_model(*m.weights, model);
    EXPECT_EQ(m.weights->embed.file, golden_model(model) + "/model.safetensors");
    EXPECT_EQ(m.weights->storage_dtype(), model == "llama-mha-bf16" ? DType::BF16 : DType::F32);
    // Any tensor by HF name; absent ones give an empty view.
    EXPECT_EQ(m.weights->find("model.norm.weight").data, m.weights->final_norm.data);
    EXPECT_FALSE(m.weights->find("model.layers.99.mlp.up_proj.weight"));
  }
}

TEST(Weights, TiedAndUntiedLmHead) {
  // Untied config, checkpoint without lm_head.weight: missing.
  const std::string untied = model_dir("untied-missing", golden_config("llama-gqa"),
                                       without(golden_tensors("llama-gqa"), "lm_head.weight"));
  expect_error<MissingTensorError>([&] { Model::load(untied); }, {untied + "/model.safetensors", "'lm_head.weight'"});
  // The same checkpoint is fine once the config ties the embeddings.
  const std::string tied =
      model_dir("tied", with_config("llama-gqa", [](ojson& j) { j["tie_word_embeddings"] = true; }),
                without(golden_tensors("llama-gqa"), "lm_head.weight"));
  Model m = Model::load(tied);
  EXPECT_TRUE(m.weights->lm_head_tied);
  EXPECT_EQ(m.weights->lm_head.data, m.weights->embed.data);
  // A tied config ignores a stored lm_head.weight (HF ties it to the embedding).
  const std::string tied_with_head = model_dir(
      "tied-extra", with_config("llama-gqa", [](ojson& j) { j["tie_word_embeddings"] = true; }), golden_tensors("llama-gqa"));
  m = Model::load(tied_with_head);
  EXPECT_EQ(m.weights->lm_head.data, m.weights->embed.data);
}

TEST(Weights, MissingTensorNamesTheTensor) {
  for (const std::string name : {"model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight", "model.norm.weight",
                                 "model.layers.0.input_layernorm.weight"}) {
    const std::string dir = model_dir("missing", golden_config("llama-gqa"), without(golden_tensors("llama-gqa"), name));
    expect_error<MissingTensorError>([&] { Model::load(dir); }, {dir + "/model.safetensors", "'" + name + "'"});
  }
  // Family-specific tensors: Qwen2 biases, Qwen3 q/k norms, Llama attention_bias.
  std::string dir = model_dir("qwen2-nobias", golden_config("qwen2-bias"),
                              without(golden_tensors("qwen2-bias"), "model.layers.1.self_attn.v_proj.bias"));
  expect_error<MissingTensorError>([&] { Model::load(dir); }, {"'model.layers.1.self_attn.v_proj.bias'"});
  dir = model_dir("qwen3-nonorm", golden_config("qwen3-qknorm"),
                  without(golden_tensors("qwen3-qknorm"), "model.layers.0.self_attn.k_norm.weight"));
  expect_error<MissingTensorError>([&] { Model::load(dir); }, {"'model.layers.0.self_attn.k_norm.weight'"});
  dir = model_dir("llama-bias", with_config("llama-gqa", [](ojson& j) { j["attention_bias"] = true; }),
                  golden_tensors("llama-gqa"));
  expect_error<MissingTensorError>([&] { Model::load(dir); }, {"'model.layers.0.self_attn.q_proj.bias'"});
}

TEST(Weights, WrongShapeNamesTensorExpectedAndActual) {
  // The config says 4 kv heads, the checkpoint has 2: k_proj is [64, 64] vs [32, 64].
  std::string dir = model_dir("kv-heads", with_config("llama-gqa", [](ojson& j) { j["num_key_value_heads"] = 4; }),
                              golden_tensors("llama-gqa"));
  expect_error<ShapeError>([&] { Model::load(dir); },
                           {dir + "/model.safetensors", "'model.layers.0.self_attn.k_proj.weight'",
                            "expected shape [64, 64]", "got [32, 64]"});
  // A transposed matrix in the file.
  auto ts = golden_tensors("llama-gqa");
  Tensor& down = find(ts, "model.layers.1.mlp.down_proj.weight");
  down.shape = {down.shape[1], down.shape[0]};
  dir = model_dir("transposed", golden_config("llama-gqa"), ts);
  expect_error<ShapeError>([&] { Model::load(dir); },
                           {"'model.layers.1.mlp.down_proj.weight'", "expected shape [64, 160]", "got [160, 64]"});
  // The vocabulary of the config disagrees with the embedding.
  dir = model_dir("vocab", with_config("qwen3-qknorm", [](ojson& j) { j["vocab_size"] = 385; }),
                  golden_tensors("qwen3-qknorm"));
  expect_error<ShapeError>([&] { Model::load(dir); },
                           {"'model.embed_tokens.weight'", "expected shape [385, 64]", "got [384, 64]"});
}

TEST(Weights, StorageDtypes) {
  // F16 storage is supported.
  auto ts = golden_tensors("llama-gqa");
  for (auto& t : ts) {
    std::vector<float> f(t.bytes.size() / 4);
    std::memcpy(f.data(), t.bytes.data(), t.bytes.size());
    Bytes h(f.size() * 2);
    for (size_t i = 0; i < f.size(); ++i) {
      const uint16_t v = f32_to_f16(f[i]);
      std::memcpy(h.data() + 2 * i, &v, 2);
    }
    t.dtype = DType::F16;
    t.bytes = h;
  }
  std::string dir = model_dir("f16", golden_config("llama-gqa"), ts);
  Model m = Model::load(dir);
  EXPECT_EQ(m.weights->storage_dtype(), DType::F16);
  EXPECT_EQ(m.weights->layers[1].mlp.up.dtype, DType::F16);

  // F64 (or integer) weights are not.
  ts = golden_tensors("llama-gqa");
  Tensor& n = find(ts, "model.layers.0.post_attention_layernorm.weight");
  std::vector<double> d(n.bytes.size() / 4);
  for (size_t i = 0; i < d.size(); ++i) {
    float v;
    std::memcpy(&v, n.bytes.data() + 4 * i, 4);
    d[i] = v;
  }
  n.dtype = DType::F64;
  n.bytes.assign(reinterpret_cast<const uint8_t*>(d.data()), reinterpret_cast<const uint8_t*>(d.data() + d.size()));
  dir = model_dir("f64", golden_config("llama-gqa"), ts);
  expect_error<FormatError>([&] { Model::load(dir); },
                            {"'model.layers.0.post_attention_layernorm.weight'", "F64", "F32, BF16, F16"});
  ts = golden_tensors("llama-gqa");
  Tensor& e = find(ts, "model.norm.weight");
  e.dtype = DType::I32;
  dir = model_dir("i32", golden_config("llama-gqa"), ts);
  expect_error<FormatError>([&] { Model::load(dir); }, {"'model.norm.weight'", "I32"});
}

TEST(Weights, NoCheckpointIsAnIoError) {
  const std::string dir = fresh_dir("no-weights");
  write_text(dir + "/config.json", golden_config("llama-gqa"));
  expect_error<IoError>([&] { Model::load(dir); }, {dir, "model.safetensors"});
}

// --------------------------------------------------------------- sharding

// Writes `tensors` as two shards plus model.safetensors.index.json listing
// `index_map` (tensor -> shard; defaults to where each tensor was written).
std::string sharded_dir(const std::string& stem, const std::string& model, std::map<std::string, std::string>* override_map = nullptr,
                        const std::string* skip_in_shard = nullptr) {
  const std::string dir = fresh_dir(stem);
  write_text(dir + "/config.json", golden_config(model));
  const auto ts = golden_tensors(model);
  const std::string s1 = "model-00001-of-00002.safetensors", s2 = "model-00002-of-00002.safetensors";
  std::vector<Tensor> a, b;
  ojson map = ojson::object();
  size_t total = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    const bool first = i < ts.size() / 2;
    map[ts[i].name] = first ? s1 : s2;
    total += ts[i].bytes.size();
    if (skip_in_shard && ts[i].name == *skip_in_shard) continue;
    (first ? a : b).push_back(ts[i]);
  }
  if (override_map)
    for (const auto& [k, v] : *override_map) map[k] = v;
  write_weights(dir + "/" + s1, a);
  write_weights(dir + "/" + s2, b);
  ojson index = {{"metadata", {{"total_size", total}}}, {"weight_map", map}};
  write_text(dir + "/model.safetensors.index.json", index.dump(2));
  return dir;
}

TEST(WeightsSharded, TwoShardCopyOfEveryGoldenCheckpointLoads) {
  for (const auto& model : golden_models()) {
    SCOPED_TRACE(model);
    const std::string dir = sharded_dir("sharded-" + model, model);
    const Model m = Model::load(dir);
    check_model(*m.weights, model);
    // Views point into the shard that holds them.
    EXPECT_EQ(m.weights->embed.file, dir + "/model-00001-of-00002.safetensors");
    EXPECT_EQ(m.weights->layers.back().o.file, dir + "/model-00002-of-00002.safetensors");
  }
}

TEST(WeightsSharded, IndexErrorsAreTyped) {
  // A shard that lacks a tensor the index lists.
  const std::string gone = "model.layers.1.mlp.up_proj.weight";
  std::string dir = sharded_dir("shard-missing", "llama-gqa", nullptr, &gone);
  expect_error<MissingTensorError>([&] { Model::load(dir); },
                                   {dir + "/model-00002-of-00002.safetensors", "'" + gone + "'"});
  // The index does not list a tensor the config needs.
  {
    dir = sharded_dir("index-missing", "llama-gqa");
    ojson idx = ojson::parse(read_text(dir + "/model.safetensors.index.json"));
    idx["weight_map"].erase("model.layers.0.self_attn.o_proj.weight");
    write_text(dir + "/model.safetensors.index.json", idx.dump());
    expect_error<MissingTensorError>([&] { Model::load(dir); },
                                     {dir + "/model.safetensors.index.json", "'model.layers.0.self_attn.o_proj.weight'"});
  }
  // A listed shard that does not exist.
  std::map<std::string, std::string> m = {{"model.norm.weight", "model-00003-of-00002.safetensors"}};
  dir = sharded_dir("shard-absent", "llama-gqa", &m);
  expect_error<IoError>([&] { Model::load(dir); }, {dir + "/model-00003-of-00002.safetensors"});
  // A shard name that escapes the directory.
  m = {{"model.norm.weight", "../model.safetensors"}};
  dir = sharded_dir("shard-escape", "llama-gqa", &m);
  expect_error<FormatError>([&] { Model::load(dir); }, {"model.safetensors.index.json", "'model.norm.weight'"});
  // A malformed index.
  dir = sharded_dir("index-bad", "llama-gqa");
  write_text(dir + "/model.safetensors.index.json", "{\"weight_map\": {");
  expect_error<FormatError>([&] { Model::load(dir); }, {dir + "/model.safetensors.index.json", "JSON"});
  write_text(dir + "/model.safetensors.index.json", "{\"metadata\": {}}");
  expect_error<FormatError>([&] { Model::load(dir); }, {dir + "/model.safetensors.index.json", "weight_map"});
  write_text(dir + "/model.safetensors.index.json", "{\"weight_map\": {\"model.norm.weight\": 3}}");
  expect_error<FormatError>([&] { Model::load(dir); }, {"'model.norm.weight'"});
  // A malformed shard is reported as such.
  dir = sharded_dir("shard-corrupt", "llama-gqa");
  write_text(dir + "/model-00002-of-00002.safetensors", "garbage!");
  expect_error<FormatError>([&] { Model::load(dir); }, {dir + "/model-00002-of-00002.safetensors"});
}

}  // namespace
}  // namespace llmdiff
