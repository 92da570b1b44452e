// config.json -> ModelConfig: every golden config, defaults, rope scaling
// types, and malformed configs (ConfigError naming the file).
#include <gtest/gtest.h>

#include <cmath>

#include "dumps/model/config.h"
#include "dumps/base/errors.h"
#include "tests/support.h"
#include "tests/test_dumps_helpers.h"

namespace llmdiff {
namespace {

using namespace llmdiff::testing;
using json = nlohmann::json;

const char* kSource = "/models/tiny/config.json";

// The MoE / MLA goldens: routing and latent-attention fields as their
// config.json writes them, and which layers are MoE.
TEST(Config, MoeAndMlaGoldensParseToTheirValues) {
  const ModelConfig q = load_config(golden_model("qwen3-moe"));
  EXPECT_EQ(q.family, Family::Qwen3);
  EXPECT_TRUE(q.qk_norm);
  EXPECT_EQ(q.moe.num_experts, 8);
  EXPECT_EQ(q.moe.top_k, 2);
  EXPECT_EQ(q.moe.intermediate_size, 48);
  EXPECT_TRUE(q.moe.norm_topk_prob);
  EXPECT_EQ(q.moe.scoring, MoeConfig::Scoring::Softmax);
  EXPECT_EQ(q.moe.shared_intermediate_size, 0);
  EXPECT_TRUE(q.moe.is_moe_layer(0) && q.moe.is_moe_layer(1));
  EXPECT_FALSE(q.mla.enabled);
  EXPECT_EQ(q.head_dim, 32);

  const ModelConfig x = load_config(golden_model("mixtral-gqa"));
  EXPECT_EQ(x.family, Family::Mixtral);
  EXPECT_EQ(x.moe.num_experts, 4);
  EXPECT_EQ(x.moe.intermediate_size, 96);
  EXPECT_TRUE(x.moe.norm_topk_prob);  // always, in MixtralSparseMoeBlock
  EXPECT_EQ(x.sliding_window, 0);

  const ModelConfig d = load_config(golden_model("deepseek-v3-mla"));
  EXPECT_EQ(d.family, Family::DeepseekV3);
  EXPECT_TRUE(d.mla.enabled);
  EXPECT_EQ(d.mla.q_lora_rank, 32);
  EXPECT_EQ(d.mla.kv_lora_rank, 32);
  EXPECT_EQ(d.mla.qk_nope_head_dim, 16);
  EXPECT_EQ(d.mla.qk_rope_head_dim, 8);
  EXPECT_EQ(d.mla.v_head_dim, 16);
  EXPECT_TRUE(d.mla.rope_interleave);
  EXPECT_EQ(d.head_dim, 8);  // the RoPE tables' width
  EXPECT_EQ(d.ctx_dim(), 4 * 16);
  EXPECT_DOUBLE_EQ(d.attn_scaling(), 1.0 / std::sqrt(24.0));
  EXPECT_EQ(d.moe.scoring, MoeConfig::Scoring::Sigmoid);
  EXPECT_EQ(d.moe.num_experts, 8);
  EXPECT_EQ(d.moe.n_group, 2);
  EXPECT_EQ(d.moe.topk_group, 1);
  EXPECT_DOUBLE_EQ(d.moe.routed_scaling_factor, 2.5);
  EXPECT_EQ(d.moe.shared_intermediate_size, 32);
  EXPECT_FALSE(d.moe.is_moe_layer(0));
  EXPECT_TRUE(d.moe.is_moe_layer(1) && d.moe.is_moe_layer(2));
}

// Defaults of the MoE config classes (transformers 4.51.3), yarn's mscale in
// the MLA scaling, and clear errors for what is not supported.
TEST(Config, MoeDefaultsScalingAndUnsupportedVariants) {
  auto parse = [](const std::string& body) { return parse_config(body, "config.json"); };
  const std::string base = R"("hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
      "num_attention_heads": 4, "vocab_size": 100)";
  const ModelConfig q2 = parse(R"({"model_type": "qwen2_moe", "head_dim": 8, "mlp_only_layers": [1],
      "decoder_sparse_step": 2, )" + base + "}");
  EXPECT_EQ(q2.head_dim, 16);  // hidden_size // heads, whatever head_dim says
  EXPECT_TRUE(q2.qkv_bias);
  EXPECT_EQ(q2.moe.num_experts, 60);
  EXPECT_EQ(q2.moe.top_k, 4);
  EXPECT_EQ(q2.moe.shared_intermediate_size, 5632);
  EXPECT_TRUE(q2.moe.shared_gate);
  EXPECT_FALSE(q2.moe.norm_topk_prob);
  EXPECT_EQ(q2.sliding_window, 0);
  EXPECT_FALSE(q2.moe.is_moe_layer(0));  // (0+1) % 2 != 0
  EXPECT_FALSE(q2.moe.is_moe_layer(1));  // mlp_only_layers
  EXPECT_TRUE(q2.moe.is_moe_layer(3));
  const ModelConfig ds = parse(R"({"model_type": "deepseek_v3", "q_lora_rank": null, "kv_lora_rank": 16,
      "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 8, "n_group": 2,
      "topk_group": 1, "num_experts_per_tok": 2, "max_position_embeddings": 4096,
      "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                       "original_max_position_embeddings": 4096}, )" + base + "}");
  EXPECT_EQ(ds.mla.q_lora_rank, 0);
  EXPECT_EQ(ds.moe.first_k_dense, 3);
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(ds.attn_scaling(), std::pow(12.0, -0.5) * m * m, 1e-15);
  EXPECT_THROW(parse(R"({"model_type": "deepseek_v3", "num_key_value_heads": 2, )" + base + "}"), ConfigError);
  // greedy (DeepSeek-V2-Lite's remote code, a deepseek2 GGUF without
  // exp_probs_b): no correction bias, no group limit; softmax scores only with it.
  const ModelConfig greedy = parse(R"({"model_type": "deepseek_v3", "topk_method": "greedy", "scoring_func": "softmax",
      "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": false, )" + base + "}");
  EXPECT_EQ(greedy.moe.scoring, MoeConfig::Scoring::Softmax);
  EXPECT_FALSE(greedy.moe.correction_bias);
  EXPECT_TRUE(ds.moe.correction_bias);
  EXPECT_EQ(ds.moe.scoring, MoeConfig::Scoring::Sigmoid);
  EXPECT_THROW(parse(R"({"model_type": "deepseek_v3", "topk_method": "greedy", )" + base + "}"), ConfigError);
  EXPECT_THROW(parse(R"({"model_type": "deepseek_v3", "scoring_func": "softmax", )" + base + "}"), ConfigError);
  EXPECT_THROW(parse(R"({"model_type": "deepseek_v3", "topk_method": "group_limited_greedy", )" + base + "}"),
               ConfigError);
  EXPECT_THROW(parse(R"({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3, )" + base + "}"),
               ConfigError);
  EXPECT_THROW(parse(R"({"model_type": "qwen3_moe", "mlp_only_layers": "all", )" + base + "}"), ConfigError);
}

TEST(Config, EveryGoldenConfigParsesToItsValues) {
  for (const auto& model : golden_models()) {
    SCOPED_TRACE(model);
    const std::string path = golden_model(model) + "/config.json";
    const std::string text = read_text(path);
    const json j = json::parse(text);
    const ModelConfig c = load_config(golden_model(model));
    EXPECT_EQ(c.source, path);
    EXPECT_EQ(c.raw_json, text);
    EXPECT_EQ(c.model_type, j["model_type"].get<std::string>());
    if (!c.moe.enabled()) {
      EXPECT_EQ(family_name(c.family), j["model_type"].get<std::string>());
    }
    EXPECT_EQ(c.hidden_size, j["hidden_size"].get<int64_t>());
    EXPECT_EQ(c.intermediate_size, j["intermediate_size"].get<int64_t>());
    EXPECT_EQ(c.num_hidden_layers, j["num_hidden_layers"].get<int64_t>());
    EXPECT_EQ(c.num_attention_heads, j["num_attention_heads"].get<int64_t>());
    EXPECT_EQ(c.num_key_value_heads, j["num_key_value_heads"].get<int64_t>());
    EXPECT_EQ(c.head_dim, j.value("head_dim", j["hidden_size"].get<int64_t>() / j["num_attention_heads"].get<int64_t>()));
    EXPECT_EQ(c.vocab_size, j["vocab_size"].get<int64_t>());
    EXPECT_EQ(c.max_position_embeddings, j["max_position_embeddings"].get<int64_t>());
    EXPECT_EQ(c.rms_norm_eps, j["rms_norm_eps"].get<double>());
    EXPECT_EQ(c.rope_theta, j["rope_theta"].get<double>());
    EXPECT_EQ(c.tie_word_embeddings, j["tie_word_embeddings"].get<bool>());
    EXPECT_EQ(c.attention_bias, j.value("attention_bias", false));
    EXPECT_EQ(c.torch_dtype, j["torch_dtype"].get<std::string>());
    EXPECT_EQ(c.q_dim(), c.num_attention_heads * c.head_dim);
    EXPECT_EQ(c.kv_dim(), c.num_key_value_heads * c.head_dim);
    // Family-derived structure.
    EXPECT_EQ(c.qkv_bias, c.family == Family::Qwen2);
    EXPECT_FALSE(c.o_bias);
    EXPECT_EQ(c.qk_norm, c.family == Family::Qwen3);
    const bool moe_qwen = c.model_type == "qwen2_moe" || c.model_type == "qwen3_moe";
    EXPECT_EQ(c.sliding_window, c.family == Family::Llama || c.family == Family::DeepseekV3 ||
                                        j["sliding_window"].is_null() || (moe_qwen && !j["use_sliding_window"].get<bool>())
                                    ? 0
                                    : j["sliding_window"].get<int64_t>());
    if (!j.contains("rope_scaling") || j["rope_scaling"].is_null()) {
      EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::Default);
    } else {
      const json& r = j["rope_scaling"];
      EXPECT_EQ(rope_type_name(c.rope_scaling.type), r["rope_type"].get<std::string>());
      EXPECT_EQ(c.rope_scaling.factor, r["factor"].get<double>());
      EXPECT_EQ(c.rope_scaling.low_freq_factor, r["low_freq_factor"].get<double>());
      EXPECT_EQ(c.rope_scaling.high_freq_factor, r["high_freq_factor"].get<double>());
      EXPECT_EQ(c.rope_scaling.original_max_position_embeddings,
                r["original_max_position_embeddings"].get<int64_t>());
    }
    EXPECT_EQ(compute_dtype_name(c.default_dtype()), c.torch_dtype);
    // The file itself can be named too.
    EXPECT_EQ(load_config(path).hidden_size, c.hidden_size);
  }
  // The set covers every family and rope scaling of the golden data.
  EXPECT_EQ(load_config(golden_model("qwen2-bias")).family, Family::Qwen2);
  EXPECT_EQ(load_config(golden_model("qwen3-qknorm")).family, Family::Qwen3);
  EXPECT_EQ(load_config(golden_model("qwen3-qknorm")).head_dim, 32);  // explicit, != hidden/heads
  EXPECT_EQ(load_config(golden_model("llama3-mqa-scaled")).rope_scaling.type, RopeScaling::Type::Llama3);
  EXPECT_EQ(load_config(golden_model("llama-mha-bf16")).default_dtype(), ComputeDType::BFloat16);
}

json minimal(const std::string& type = "llama") {
  return json{{"model_type", type},        {"hidden_size", 64},      {"intermediate_size", 128},
              {"num_hidden_layers", 2},    {"num_attention_heads", 4}, {"vocab_size", 100}};
}

ModelConfig parse(const json& j) { return parse_config(j.dump(), kSource); }

TEST(Config, DefaultsFollowTheTransformersConfigClasses) {
  const ModelConfig c = parse(minimal());
  EXPECT_EQ(c.family, Family::Llama);
  EXPECT_EQ(c.num_key_value_heads, 4);  // = heads
  EXPECT_EQ(c.head_dim, 16);            // = hidden / heads
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::Default);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_EQ(c.torch_dtype, "float32");
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(parse(minimal("qwen2")).max_position_embeddings, 32768);
  EXPECT_TRUE(parse(minimal("qwen2")).qkv_bias);
  EXPECT_TRUE(parse(minimal("qwen3")).qk_norm);
  // HF's Qwen2/Qwen3/Mistral config classes default sliding_window to 4096
  // (the mask applies it even with use_sliding_window false); null means none.
  EXPECT_EQ(parse(minimal("qwen2")).sliding_window, 4096);
  EXPECT_EQ(parse(minimal("mistral")).sliding_window, 4096);
  json nw = minimal("qwen3");
  nw["sliding_window"] = nullptr;
  EXPECT_EQ(parse(nw).sliding_window, 0);
  // Explicit nulls count as absent.
  json j = minimal();
  j["num_key_value_heads"] = nullptr;
  j["rope_scaling"] = nullptr;
  EXPECT_EQ(parse(j).num_key_value_heads, 4);
}

TEST(Config, ExplicitHeadDimIsHonouredByEveryFamily) {
  for (const std::string type : {"llama", "mistral", "qwen2", "qwen3"}) {
    json j = minimal(type);
    j["head_dim"] = 32;  // != hidden_size / heads = 16
    const ModelConfig c = parse(j);
    EXPECT_EQ(c.head_dim, 32) << type;
    EXPECT_EQ(c.q_dim(), 128) << type;
    EXPECT_EQ(c.kv_dim(), 128) << type;
  }
}

TEST(Config, MistralLoadsAsLlama) {
  json j = minimal("mistral");
  j["num_key_value_heads"] = 2;
  j["sliding_window"] = 4096;
  const ModelConfig c = parse(j);
  EXPECT_EQ(c.family, Family::Llama);
  EXPECT_EQ(c.model_type, "mistral");
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.qk_norm);
}

TEST(Config, AttentionBiasPerFamily) {
  json j = minimal("llama");
  j["attention_bias"] = true;
  ModelConfig c = parse(j);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.o_bias);
  j["model_type"] = "qwen3";
  c = parse(j);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.o_bias);
  EXPECT_TRUE(c.qk_norm);
  j["model_type"] = "qwen2";  // Qwen2: q/k/v always biased, o_proj never
  c = parse(j);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
}

TEST(Config, RopeScalingTypesWithAllTheirFields) {
  json j = minimal();
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  ModelConfig c = parse(j);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::Linear);
  EXPECT_EQ(c.rope_scaling.factor, 2.0);

  j["rope_scaling"] = {{"type", "dynamic"}, {"factor", 4}};  // legacy key, integer factor
  c = parse(j);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::Dynamic);
  EXPECT_EQ(c.rope_scaling.factor, 4.0);

  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  c = parse(j);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::Llama3);
  EXPECT_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);

  j["rope_scaling"] = {{"rope_type", "yarn"},     {"factor", 4.0},  {"original_max_position_embeddings", 2048},
                       {"beta_fast", 16.0},       {"beta_slow", 2.0}, {"mscale", 0.707},
                       {"mscale_all_dim", 1.0},   {"attention_factor", 1.25}};
  c = parse(j);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::Yarn);
  EXPECT_EQ(c.rope_scaling.factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 2048);
  EXPECT_EQ(c.rope_scaling.beta_fast, 16.0);
  EXPECT_EQ(c.rope_scaling.beta_slow, 2.0);
  EXPECT_EQ(c.rope_scaling.mscale, 0.707);
  EXPECT_EQ(c.rope_scaling.mscale_all_dim, 1.0);
  EXPECT_TRUE(c.rope_scaling.has_attention_factor);
  EXPECT_EQ(c.rope_scaling.attention_factor, 1.25);

  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  c = parse(j);
  EXPECT_EQ(c.rope_scaling.beta_fast, 32.0);
  EXPECT_EQ(c.rope_scaling.beta_slow, 1.0);
  EXPECT_FALSE(c.rope_scaling.has_attention_factor);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 0);

  j["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_EQ(parse(j).rope_scaling.type, RopeScaling::Type::Default);
}

// A malformed variant of the minimal config and what its error must say.
struct BadConfig {
  std::string name;
  std::function<void(json&)> mutate;
  std::vector<std::string> phrases;
};

std::vector<BadConfig> bad_configs() {
  return {
      {"missing hidden_size", [](json& j) { j.erase("hidden_size"); }, {"hidden_size", "missing"}},
      {"missing intermediate_size", [](json& j) { j.erase("intermediate_size"); }, {"intermediate_size"}},
      {"missing num_hidden_layers", [](json& j) { j.erase("num_hidden_layers"); }, {"num_hidden_layers"}},
      {"missing num_attention_heads", [](json& j) { j.erase("num_attention_heads"); }, {"num_attention_heads"}},
      {"missing vocab_size", [](json& j) { j.erase("vocab_size"); }, {"vocab_size"}},
      {"null hidden_size", [](json& j) { j["hidden_size"] = nullptr; }, {"hidden_size"}},
      {"missing model_type", [](json& j) { j.erase("model_type"); },
       {"model_type", "llama, mistral, qwen2, qwen3"}},
      {"unknown model_type", [](json& j) { j["model_type"] = "gpt2"; },
       {"'gpt2'", "llama, mistral, qwen2, qwen3"}},
      {"model_type not a string", [](json& j) { j["model_type"] = 3; }, {"model_type", "string"}},
      {"hidden_size a string", [](json& j) { j["hidden_size"] = "64"; }, {"hidden_size", "integer"}},
      {"hidden_size fractional", [](json& j) { j["hidden_size"] = 64.5; }, {"hidden_size", "integer"}},
      {"hidden_size zero", [](json& j) { j["hidden_size"] = 0; }, {"hidden_size", ">= 1"}},
      {"num_hidden_layers negative", [](json& j) { j["num_hidden_layers"] = -2; }, {"num_hidden_layers"}},
      {"rms_norm_eps a string", [](json& j) { j["rms_norm_eps"] = "1e-5"; }, {"rms_norm_eps", "number"}},
      {"rms_norm_eps negative", [](json& j) { j["rms_norm_eps"] = -1e-5; }, {"rms_norm_eps", "> 0"}},
      {"rope_theta zero", [](json& j) { j["rope_theta"] = 0; }, {"rope_theta"}},
      {"tie_word_embeddings a string", [](json& j) { j["tie_word_embeddings"] = "yes"; },
       {"tie_word_embeddings", "true or false"}},
      {"torch_dtype a number", [](json& j) { j["torch_dtype"] = 16; }, {"torch_dtype", "string"}},
      {"unsupported torch_dtype", [](json& j) { j["torch_dtype"] = "int8"; },
       {"'int8'", "float32, bfloat16, float16"}},
      {"heads not divisible", [](json& j) { j["num_key_value_heads"] = 3; },
       {"num_attention_heads (4)", "num_key_value_heads (3)"}},
      {"hidden not divisible by heads", [](json& j) { j["hidden_size"] = 66; }, {"hidden_size", "num_attention_heads"}},
      {"odd head_dim", [](json& j) { j["head_dim"] = 15; }, {"head_dim", "even"}},
      {"non-silu act", [](json& j) { j["hidden_act"] = "gelu"; }, {"'gelu'", "silu"}},
      {"mlp_bias", [](json& j) { j["mlp_bias"] = true; }, {"mlp_bias"}},
      {"partial rotary", [](json& j) { j["partial_rotary_factor"] = 0.5; }, {"partial_rotary_factor"}},
      {"pretraining_tp", [](json& j) { j["pretraining_tp"] = 2; }, {"pretraining_tp"}},
      {"rope_scaling not an object", [](json& j) { j["rope_scaling"] = 2; }, {"rope_scaling"}},
      {"rope_scaling without type", [](json& j) { j["rope_scaling"] = {{"factor", 2.0}}; },
       {"rope_scaling", "rope_type"}},
      {"unsupported rope type", [](json& j) { j["rope_scaling"] = {{"rope_type", "longrope"}, {"factor", 2.0}}; },
       {"'longrope'", "default, linear, dynamic, llama3, yarn"}},
      {"linear without factor", [](json& j) { j["rope_scaling"] = {{"rope_type", "linear"}}; }, {"'factor'"}},
      {"rope factor a string", [](json& j) { j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", "2"}}; },
       {"factor", "number"}},
      {"llama3 high <= low",
       [](json& j) {
         j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 4.0},
                              {"high_freq_factor", 1.0}, {"original_max_position_embeddings", 8192}};
       },
       {"high_freq_factor", "low_freq_factor"}},
  };
}

void expect_config_error(const std::string& text, const std::vector<std::string>& phrases) {
  try {
    parse_config(text, kSource);
    ADD_FAILURE() << "accepted: " << text;
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(kSource, 0), 0u) << msg;  // names the file first
    for (const auto& p : phrases) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

TEST(ConfigErrors, MalformedConfigsAreConfigErrorsNamingTheFile) {
  for (const auto& bad : bad_configs()) {
    SCOPED_TRACE(bad.name);
    json j = minimal();
    bad.mutate(j);
    expect_config_error(j.dump(), bad.phrases);
  }
}

TEST(ConfigErrors, Llama3NeedsAllItsFields) {
  const json full = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                     {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  for (const std::string field : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) {
    SCOPED_TRACE(field);
    json j = minimal();
    j["rope_scaling"] = full;
    j["rope_scaling"].erase(field);
    expect_config_error(j.dump(), {"llama3", "'" + field + "'"});
  }
}

TEST(ConfigErrors, NotJsonOrNotAnObject) {
  expect_config_error("{\"model_type\": \"llama\",", {"JSON"});
  expect_config_error("", {"JSON"});
  expect_config_error("[1, 2]", {"object"});
  expect_config_error("\"llama\"", {"object"});
}

TEST(ConfigErrors, LoadConfigNamesTheFileItRead) {
  const std::string dir = fresh_dir("config-bad");
  json j = minimal();
  j["hidden_act"] = "relu";
  write_text(dir + "/config.json", j.dump(2));
  expect_error<ConfigError>([&] { load_config(dir); }, {dir + "/config.json", "'relu'"});
  const std::string empty = fresh_dir("config-none");
  expect_error<IoError>([&] { load_config(empty); }, {empty + "/config.json"});
  expect_error<IoError>([&] { load_config(empty + "/missing.json"); }, {empty + "/missing.json"});
}

TEST(ComputeDType, SpellingsAndErrors) {
  EXPECT_EQ(parse_compute_dtype("float32"), ComputeDType::Float32);
  EXPECT_EQ(parse_compute_dtype("f32"), ComputeDType::Float32);
  EXPECT_EQ(parse_compute_dtype("fp32"), ComputeDType::Float32);
  EXPECT_EQ(parse_compute_dtype("bf16"), ComputeDType::BFloat16);
  EXPECT_EQ(parse_compute_dtype("bfloat16"), ComputeDType::BFloat16);
  EXPECT_EQ(parse_compute_dtype("fp16"), ComputeDType::Float16);
  EXPECT_EQ(parse_compute_dtype("float64"), ComputeDType::Float64);
  for (ComputeDType d : {ComputeDType::Float32, ComputeDType::BFloat16, ComputeDType::Float16, ComputeDType::Float64})
    EXPECT_EQ(parse_compute_dtype(compute_dtype_name(d)), d);
  expect_error<UsageError>([] { parse_compute_dtype("int8"); }, {"'int8'", "float32, bfloat16, float16, float64"});
  EXPECT_STREQ(rope_type_name(RopeScaling::Type::Yarn), "yarn");
  EXPECT_STREQ(family_name(Family::Qwen3), "qwen3");
}

}  // namespace
}  // namespace llmdiff
