// Synthetic checkpoints: presets, the deterministic weight generator and the
// streaming, atomic checkpoint writer.
#include "synth/synth.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <thread>

#include "dumps/base/errors.h"
#include "dumps/base/files.h"
#include "dumps/base/threads.h"

namespace llmdiff::synth {

namespace fs = std::filesystem;
using nlohmann::json;

// --- presets -----------------------------------------------------------------

namespace {

// Fields every config of a family carries (transformers 4.51.3 defaults as
// save_pretrained writes them).
json llama_base() {
  return json{{"architectures", json::array({"LlamaForCausalLM"})},
              {"attention_bias", false},
              {"attention_dropout", 0.0},
              {"hidden_act", "silu"},
              {"initializer_range", 0.02},
              {"mlp_bias", false},
              {"model_type", "llama"},
              {"pretraining_tp", 1},
              {"rope_scaling", nullptr},
              {"transformers_version", "4.51.3"},
              {"use_cache", true}};
}

json qwen2_base() {
  return json{{"architectures", json::array({"Qwen2ForCausalLM"})},
              {"attention_dropout", 0.0},
              {"hidden_act", "silu"},
              {"initializer_range", 0.02},
              {"model_type", "qwen2"},
              {"rope_scaling", nullptr},
              {"transformers_version", "4.51.3"},
              {"use_cache", true},
              {"use_sliding_window", false}};
}

json qwen3_base() {
  return json{{"architectures", json::array({"Qwen3ForCausalLM"})},
              {"attention_bias", false},
              {"attention_dropout", 0.0},
              {"hidden_act", "silu"},
              {"initializer_range", 0.02},
              {"model_type", "qwen3"},
              {"rope_scaling", nullptr},
              {"transformers_version", "4.51.3"},
              {"use_cache", true},
              {"use_sliding_window", false}};
}

json qwen3_moe_base() {
  return json{{"architectures", json::array({"Qwen3MoeForCausalLM"})},
              {"attention_bias", false},
              {"attention_dropout", 0.0},
              {"decoder_sparse_step", 1},
              {"hidden_act", "silu"},
              {"initializer_range", 0.02},
              {"mlp_only_layers", json::array()},
              {"model_type", "qwen3_moe"},
              {"norm_topk_prob", true},
              {"output_router_logits", false},
              {"rope_scaling", nullptr},
              {"router_aux_loss_coef", 0.001},
              {"transformers_version", "4.51.3"},
              {"use_cache", true},
              {"use_sliding_window", false}};
}

json deepseek_v3_base() {
  return json{{"architectures", json::array({"DeepseekV3ForCausalLM"})},
              {"attention_bias", false},
              {"attention_dropout", 0.0},
              {"hidden_act", "silu"},
              {"initializer_range", 0.02},
              {"model_type", "deepseek_v3"},
              {"pretraining_tp", 1},
              {"rope_interleave", true},
              {"rope_scaling", nullptr},
              {"transformers_version", "4.51.3"},
              {"use_cache", true}};
}

json with(json base, const json& fields) {
  base.update(fields);
  return base;
}

// What DeepSeek-V2-Lite's two presets share (deepseek-v2-lite and its
// narrowed copy): the counts, the routing, MLA without q_lora, yarn; the
// presets add the widths.
json deepseek_v2_lite_base() {
  return with(deepseek_v3_base(),
              {{"first_k_dense_replace", 1},
               {"max_position_embeddings", 163840},
               {"n_group", 1},
               {"n_routed_experts", 64},
               {"n_shared_experts", 2},
               {"norm_topk_prob", false},
               {"num_attention_heads", 16},
               {"num_experts_per_tok", 6},
               {"num_key_value_heads", 16},
               {"q_lora_rank", nullptr},
               {"rms_norm_eps", 1e-06},
               {"rope_scaling", json{{"beta_fast", 32},
                                     {"beta_slow", 1},
                                     {"factor", 40},
                                     {"mscale", 0.707},
                                     {"mscale_all_dim", 0.707},
                                     {"original_max_position_embeddings", 4096},
                                     {"type", "yarn"}}},
               {"rope_theta", 10000},
               {"routed_scaling_factor", 1.0},
               {"scoring_func", "softmax"},
               {"tie_word_embeddings", false},
               {"topk_group", 1},
               {"topk_method", "greedy"}});
}

json llama3_rope(double factor, int64_t original) {
  return json{{"factor", factor},
              {"high_freq_factor", 4.0},
              {"low_freq_factor", 1.0},
              {"original_max_position_embeddings", original},
              {"rope_type", "llama3"}};
}

struct PresetDef {
  SynthPreset info;
  json config;
};

// The configs of the published checkpoints (their config.json values), and
// small models of the same families for tests.
const std::vector<PresetDef>& preset_defs() {
  static const std::vector<PresetDef> defs = [] {
    std::vector<PresetDef> d;
    d.push_back({{"tinyllama-1.1b", "TinyLlama-1.1B: Llama, 22 layers, hidden 2048, GQA 32/4, vocab 32000, untied"},
                 with(llama_base(), {{"bos_token_id", 1},
                                     {"eos_token_id", 2},
                                     {"head_dim", 64},
                                     {"hidden_size", 2048},
                                     {"intermediate_size", 5632},
                                     {"max_position_embeddings", 2048},
                                     {"num_attention_heads", 32},
                                     {"num_hidden_layers", 22},
                                     {"num_key_value_heads", 4},
                                     {"rms_norm_eps", 1e-05},
                                     {"rope_theta", 10000.0},
                                     {"tie_word_embeddings", false},
                                     {"torch_dtype", "bfloat16"},
                                     {"vocab_size", 32000}})});
    d.push_back({{"llama-3.2-1b", "Llama-3.2-1B: 16 layers, hidden 2048, GQA 32/8, vocab 128256, llama3 rope x32, tied"},
                 with(llama_base(), {{"bos_token_id", 128000},
                                     {"eos_token_id", 128001},
                                     {"head_dim", 64},
                                     {"hidden_size", 2048},
                                     {"intermediate_size", 8192},
                                     {"max_position_embeddings", 131072},
                                     {"num_attention_heads", 32},
                                     {"num_hidden_layers", 16},
                                     {"num_key_value_heads", 8},
                                     {"rms_norm_eps", 1e-05},
                                     {"rope_scaling", llama3_rope(32.0, 8192)},
                                     {"rope_theta", 500000.0},
                                     {"tie_word_embeddings", true},
                                     {"torch_dtype", "bfloat16"},
                                     {"vocab_size", 128256}})});
    d.push_back({{"llama-3.1-8b", "Llama-3.1-8B: 32 layers, hidden 4096, GQA 32/8, vocab 128256, llama3 rope x8, untied"},
                 with(llama_base(), {{"bos_token_id", 128000},
                                     {"eos_token_id", 128001},
                                     {"head_dim", 128},
                                     {"hidden_size", 4096},
                                     {"intermediate_size", 14336},
                                     {"max_position_embeddings", 131072},
                                     {"num_attention_heads", 32},
                                     {"num_hidden_layers", 32},
                                     {"num_key_value_heads", 8},
                                     {"rms_norm_eps", 1e-05},
                                     {"rope_scaling", llama3_rope(8.0, 8192)},
                                     {"rope_theta", 500000.0},
                                     {"tie_word_embeddings", false},
                                     {"torch_dtype", "bfloat16"},
                                     {"vocab_size", 128256}})});
    d.push_back({{"llama-3.1-70b",
                  "Llama-3.1-70B: 80 layers (--layers N for fewer), hidden 8192, GQA 64/8, vocab 128256, llama3 rope x8, "
                  "untied"},
                 with(llama_base(), {{"bos_token_id", 128000},
                                     {"eos_token_id", 128001},
                                     {"head_dim", 128},
                                     {"hidden_size", 8192},
                                     {"intermediate_size", 28672},
                                     {"max_position_embeddings", 131072},
                                     {"num_attention_heads", 64},
                                     {"num_hidden_layers", 80},
                                     {"num_key_value_heads", 8},
                                     {"rms_norm_eps", 1e-05},
                                     {"rope_scaling", llama3_rope(8.0, 8192)},
                                     {"rope_theta", 500000.0},
                                     {"tie_word_embeddings", false},
                                     {"torch_dtype", "bfloat16"},
                                     {"vocab_size", 128256}})});
    d.push_back({{"qwen3-0.6b", "Qwen3-0.6B: 28 layers, hidden 1024, GQA 16/8, head_dim 128, q/k norm, vocab 151936, tied"},
                 with(qwen3_base(), {{"bos_token_id", 151643},
                                     {"eos_token_id", 151645},
                                     {"head_dim", 128},
                                     {"hidden_size", 1024},
                                     {"intermediate_size", 3072},
                                     {"max_position_embeddings", 40960},
                                     {"max_window_layers", 28},
                                     {"num_attention_heads", 16},
                                     {"num_hidden_layers", 28},
                                     {"num_key_value_heads", 8},
                                     {"rms_norm_eps", 1e-06},
                                     {"rope_theta", 1000000.0},
                                     {"sliding_window", nullptr},
                                     {"tie_word_embeddings", true},
                                     {"torch_dtype", "bfloat16"},
                                     {"vocab_size", 151936}})});
    d.push_back({{"qwen2.5-0.5b", "Qwen2.5-0.5B: 24 layers, hidden 896, GQA 14/2, q/k/v bias, vocab 151936, tied"},
                 with(qwen2_base(), {{"bos_token_id", 151643},
                                     {"eos_token_id", 151643},
                                     {"hidden_size", 896},
                                     {"intermediate_size", 4864},
                                     {"max_position_embeddings", 32768},
                                     {"max_window_layers", 24},
                                     {"num_attention_heads", 14},
                                     {"num_hidden_layers", 24},
                                     {"num_key_value_heads", 2},
                                     {"rms_norm_eps", 1e-06},
                                     {"rope_theta", 1000000.0},
                                     {"sliding_window", 32768},
                                     {"tie_word_embeddings", true},
                                     {"torch_dtype", "bfloat16"},
                                     {"vocab_size", 151936}})});
    d.push_back({{"qwen2.5-1.5b", "Qwen2.5-1.5B: 28 layers, hidden 1536, GQA 12/2, q/k/v bias, vocab 151936, tied"},
                 with(qwen2_base(), {{"bos_token_id", 151643},
                                     {"eos_token_id", 151643},
                                     {"hidden_size", 1536},
                                     {"intermediate_size", 8960},
                                     {"max_position_embeddings", 131072},
                                     {"max_window_layers", 28},
                                     {"num_attention_heads", 12},
                                     {"num_hidden_layers", 28},
                                     {"num_key_value_heads", 2},
                                     {"rms_norm_eps", 1e-06},
                                     {"rope_theta", 1000000.0},
                                     {"sliding_window", 131072},
                                     {"tie_word_embeddings", true},
                                     {"torch_dtype", "bfloat16"},
                                     {"vocab_size", 151936}})});
    // Small models for tests and quick runs.
    d.push_back({{"tiny-llama", "small Llama: 4 layers, hidden 512, GQA 8/2, vocab 4096, untied"},
                 with(llama_base(), {{"bos_token_id", 1},
                                     {"eos_token_id", 2},
                                     {"head_dim", 64},
                                     {"hidden_size", 512},
                                     {"intermediate_size", 1536},
                                     {"max_position_embeddings", 2048},
                                     {"num_attention_heads", 8},
                                     {"num_hidden_layers", 4},
                                     {"num_key_value_heads", 2},
                                     {"rms_norm_eps", 1e-05},
                                     {"rope_theta", 10000.0},
                                     {"tie_word_embeddings", false},
                                     {"torch_dtype", "float32"},
                                     {"vocab_size", 4096}})});
    d.push_back({{"tiny-llama3", "small Llama 3: 2 layers, hidden 256, MQA 4/1, llama3 rope x8, vocab 2048, tied"},
                 with(llama_base(), {{"bos_token_id", 1},
                                     {"eos_token_id", 2},
                                     {"head_dim", 64},
                                     {"hidden_size", 256},
                                     {"intermediate_size", 704},
                                     {"max_position_embeddings", 4096},
                                     {"num_attention_heads", 4},
                                     {"num_hidden_layers", 2},
                                     {"num_key_value_heads", 1},
                                     {"rms_norm_eps", 1e-05},
                                     {"rope_scaling", llama3_rope(8.0, 256)},
                                     {"rope_theta", 500000.0},
                                     {"tie_word_embeddings", true},
                                     {"torch_dtype", "float32"},
                                     {"vocab_size", 2048}})});
    d.push_back({{"qwen3-30b-a3b", "Qwen3-30B-A3B: 48 MoE layers, hidden 2048, GQA 32/4, head_dim 128, 128 experts "
                                   "(top 8, F 768), vocab 151936, untied"},
                 with(qwen3_moe_base(), {{"bos_token_id", 151643},
                                         {"eos_token_id", 151645},
                                         {"head_dim", 128},
                                         {"hidden_size", 2048},
                                         {"intermediate_size", 6144},
                                         {"max_position_embeddings", 40960},
                                         {"max_window_layers", 48},
                                         {"moe_intermediate_size", 768},
                                         {"num_attention_heads", 32},
                                         {"num_experts", 128},
                                         {"num_experts_per_tok", 8},
                                         {"num_hidden_layers", 48},
                                         {"num_key_value_heads", 4},
                                         {"rms_norm_eps", 1e-06},
                                         {"rope_theta", 1000000.0},
                                         {"sliding_window", nullptr},
                                         {"tie_word_embeddings", false},
                                         {"torch_dtype", "bfloat16"},
                                         {"vocab_size", 151936}})});
    d.push_back({{"deepseek-v2-lite", "DeepSeek-V2-Lite as deepseek_v3: 27 layers (first dense), hidden 2048, MLA "
                                      "16 heads (kv_lora 512, nope 128, rope 64, v 128, no q_lora), 64 experts (top 6 "
                                      "by softmax, greedy, F 1408) + 2 shared, yarn x40, vocab 102400"},
                 with(deepseek_v2_lite_base(),
                      {{"bos_token_id", 100000},
                       {"eos_token_id", 100001},
                       {"head_dim", 64},
                       {"hidden_size", 2048},
                       {"intermediate_size", 10944},
                       {"kv_lora_rank", 512},
                       {"moe_intermediate_size", 1408},
                       {"num_hidden_layers", 27},
                       {"qk_nope_head_dim", 128},
                       {"qk_rope_head_dim", 64},
                       {"torch_dtype", "bfloat16"},
                       {"v_head_dim", 128},
                       {"vocab_size", 102400}})});
    d.push_back({{"tiny-qwen3-moe", "small Qwen3-MoE: 2 layers, hidden 256, GQA 4/2, head_dim 64, 16 experts (top 4, "
                                    "F 128), vocab 4096, tied"},
                 with(qwen3_moe_base(), {{"bos_token_id", 1},
                                         {"eos_token_id", 2},
                                         {"head_dim", 64},
                                         {"hidden_size", 256},
                                         {"intermediate_size", 512},
                                         {"max_position_embeddings", 4096},
                                         {"max_window_layers", 2},
                                         {"moe_intermediate_size", 128},
                                         {"num_attention_heads", 4},
                                         {"num_experts", 16},
                                         {"num_experts_per_tok", 4},
                                         {"num_hidden_layers", 2},
                                         {"num_key_value_heads", 2},
                                         {"rms_norm_eps", 1e-06},
                                         {"rope_theta", 1000000.0},
                                         {"sliding_window", nullptr},
                                         {"tie_word_embeddings", true},
                                         {"torch_dtype", "float32"},
                                         {"vocab_size", 4096}})});
    d.push_back({{"tiny-deepseek", "small DeepSeek-V3: 3 layers (first dense), hidden 256, MLA 8 heads (q_lora 128, "
                                   "kv_lora 64, nope 32, rope 16, v 32), 16 experts in 4 groups (top 4 of 2 groups, F "
                                   "128) + 1 shared, yarn x4, vocab 4096"},
                 with(deepseek_v3_base(),
                      {{"bos_token_id", 0},
                       {"eos_token_id", 1},
                       {"first_k_dense_replace", 1},
                       {"head_dim", 16},
                       {"hidden_size", 256},
                       {"intermediate_size", 512},
                       {"kv_lora_rank", 64},
                       {"max_position_embeddings", 16384},
                       {"moe_intermediate_size", 128},
                       {"n_group", 4},
                       {"n_routed_experts", 16},
                       {"n_shared_experts", 1},
                       {"norm_topk_prob", true},
                       {"num_attention_heads", 8},
                       {"num_experts_per_tok", 4},
                       {"num_hidden_layers", 3},
                       {"num_key_value_heads", 8},
                       {"q_lora_rank", 128},
                       {"qk_nope_head_dim", 32},
                       {"qk_rope_head_dim", 16},
                       {"rms_norm_eps", 1e-06},
                       {"rope_scaling", json{{"beta_fast", 32},
                                             {"beta_slow", 1},
                                             {"factor", 4},
                                             {"mscale", 1.0},
                                             {"mscale_all_dim", 1.0},
                                             {"original_max_position_embeddings", 4096},
                                             {"rope_type", "yarn"}}},
                       {"rope_theta", 10000},
                       {"routed_scaling_factor", 2.5},
                       {"tie_word_embeddings", false},
                       {"topk_group", 2},
                       {"torch_dtype", "float32"},
                       {"v_head_dim", 32},
                       {"vocab_size", 4096}})});
    // The two MoE checkpoints above at narrow widths: the same counts and
    // routing (experts, top-k, shared experts, leading dense layer, gating,
    // MLA without q_lora, yarn with mscale), for tests of the whole path.
    d.push_back({{"tiny-deepseek-v2-lite", "DeepSeek-V2-Lite narrowed: 3 layers (first dense), hidden 256, MLA 16 heads "
                                           "(kv_lora 64, nope 32, rope 16, v 32, no q_lora), 64 experts (top 6 by "
                                           "softmax, greedy, F 64) + 2 shared, yarn x40, vocab 4096"},
                 with(deepseek_v2_lite_base(),
                      {{"bos_token_id", 0},
                       {"eos_token_id", 1},
                       {"head_dim", 16},
                       {"hidden_size", 256},
                       {"intermediate_size", 512},
                       {"kv_lora_rank", 64},
                       {"moe_intermediate_size", 64},
                       {"num_hidden_layers", 3},
                       {"qk_nope_head_dim", 32},
                       {"qk_rope_head_dim", 16},
                       {"torch_dtype", "float32"},
                       {"v_head_dim", 32},
                       {"vocab_size", 4096}})});
    d.push_back({{"tiny-qwen3-30b-a3b", "Qwen3-30B-A3B narrowed: 2 MoE layers, hidden 256, GQA 16/2, head_dim 32, 128 "
                                        "experts (top 8, F 64), vocab 4096, untied"},
                 with(qwen3_moe_base(), {{"bos_token_id", 1},
                                         {"eos_token_id", 2},
                                         {"head_dim", 32},
                                         {"hidden_size", 256},
                                         {"intermediate_size", 768},
                                         {"max_position_embeddings", 40960},
                                         {"max_window_layers", 2},
                                         {"moe_intermediate_size", 64},
                                         {"num_attention_heads", 16},
                                         {"num_experts", 128},
                                         {"num_experts_per_tok", 8},
                                         {"num_hidden_layers", 2},
                                         {"num_key_value_heads", 2},
                                         {"rms_norm_eps", 1e-06},
                                         {"rope_theta", 1000000.0},
                                         {"sliding_window", nullptr},
                                         {"tie_word_embeddings", false},
                                         {"torch_dtype", "float32"},
                                         {"vocab_size", 4096}})});
    d.push_back({{"tiny-qwen2", "small Qwen2: 3 layers, hidden 384, GQA 6/2, q/k/v bias, vocab 4096, tied"},
                 with(qwen2_base(), {{"bos_token_id", 1},
                                     {"eos_token_id", 2},
                                     {"hidden_size", 384},
                                     {"intermediate_size", 1024},
                                     {"max_position_embeddings", 4096},
                                     {"max_window_layers", 3},
                                     {"num_attention_heads", 6},
                                     {"num_hidden_layers", 3},
                                     {"num_key_value_heads", 2},
                                     {"rms_norm_eps", 1e-06},
                                     {"rope_theta", 1000000.0},
                                     {"sliding_window", 4096},
                                     {"tie_word_embeddings", true},
                                     {"torch_dtype", "float32"},
                                     {"vocab_size", 4096}})});
    d.push_back({{"tiny-qwen3", "small Qwen3: 4 layers, hidden 256, GQA 4/2, head_dim 128, q/k norm, vocab 4096, tied"},
                 with(qwen3_base(), {{"bos_token_id", 1},
                                     {"eos_token_id", 2},
                                     {"head_dim", 128},
                                     {"hidden_size", 256},
                                     {"intermediate_size", 768},
                                     {"max_position_embeddings", 4096},
                                     {"max_window_layers", 4},
                                     {"num_attention_heads", 4},
                                     {"num_hidden_layers", 4},
                                     {"num_key_value_heads", 2},
                                     {"rms_norm_eps", 1e-06},
                                     {"rope_theta", 1000000.0},
                                     {"sliding_window", nullptr},
                                     {"tie_word_embeddings", true},
                                     {"torch_dtype", "float32"},
                                     {"vocab_size", 4096}})});
    return d;
  }();
  return defs;
}

}  // namespace

const std::vector<SynthPreset>& synth_presets() {
  static const std::vector<SynthPreset> presets = [] {
    std::vector<SynthPreset> p;
    for (const auto& d : preset_defs()) p.push_back(d.info);
    return p;
  }();
  return presets;
}

std::string synth_preset_config(const std::string& name) {
  for (const auto& d : preset_defs())
    if (d.info.name == name) return d.config.dump(2) + "\n";
  std::string known;
  for (const auto& d : preset_defs()) known += (known.empty() ? "" : ", ") + d.info.name;
  throw UsageError("unknown preset '" + name + "' (known: " + known + ")");
}

// --- weights -----------------------------------------------------------------

std::vector<SynthTensor> synth_tensor_plan(const ModelConfig& cfg, const SynthScales& s) {
  const int64_t D = cfg.hidden_size, F = cfg.intermediate_size, V = cfg.vocab_size;
  const int64_t Dh = cfg.head_dim, Q = cfg.q_dim(), KV = cfg.kv_dim();
  const double lin_d = s.linear / std::sqrt(double(D));  // Linear with `in` = D
  const double lin_q = s.linear / std::sqrt(double(Q));  // o_proj
  const double lin_f = s.linear / std::sqrt(double(F));  // down_proj
  const double emb = s.logit / std::sqrt(double(D));
  std::vector<SynthTensor> plan;
  auto norm = [&](const std::string& name, int64_t n, double mean = 1.0) {
    plan.push_back({name, {n}, mean, s.norm_jitter});
  };
  auto linear = [&](const std::string& name, int64_t out, int64_t in) {
    plan.push_back({name, {out, in}, 0.0, s.linear / std::sqrt(double(in))});
  };
  auto mlp = [&](const std::string& p, int64_t f, bool mixtral) {  // gate, up, down (Mixtral: w1, w3, w2)
    linear(p + (mixtral ? "w1.weight" : "gate_proj.weight"), f, D);
    linear(p + (mixtral ? "w3.weight" : "up_proj.weight"), f, D);
    linear(p + (mixtral ? "w2.weight" : "down_proj.weight"), D, f);
  };
  const MlaConfig& mla = cfg.mla;
  const MoeConfig& moe = cfg.moe;
  plan.push_back({"model.embed_tokens.weight", {V, D}, 0.0, emb});
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    if (mla.enabled) {  // DeepseekV3Attention
      const int64_t H = cfg.num_attention_heads, Rkv = mla.kv_lora_rank;
      if (mla.q_lora_rank > 0) {
        linear(p + "self_attn.q_a_proj.weight", mla.q_lora_rank, D);
        norm(p + "self_attn.q_a_layernorm.weight", mla.q_lora_rank);
        linear(p + "self_attn.q_b_proj.weight", H * mla.qk_head_dim(), mla.q_lora_rank);
      } else {
        linear(p + "self_attn.q_proj.weight", H * mla.qk_head_dim(), D);
      }
      linear(p + "self_attn.kv_a_proj_with_mqa.weight", Rkv + mla.qk_rope_head_dim, D);
      norm(p + "self_attn.kv_a_layernorm.weight", Rkv);
      linear(p + "self_attn.kv_b_proj.weight", H * (mla.qk_nope_head_dim + mla.v_head_dim), Rkv);
      linear(p + "self_attn.o_proj.weight", D, cfg.ctx_dim());
    } else {
      plan.push_back({p + "self_attn.q_proj.weight", {Q, D}, 0.0, lin_d});
      if (cfg.qkv_bias) plan.push_back({p + "self_attn.q_proj.bias", {Q}, 0.0, s.bias});
      plan.push_back({p + "self_attn.k_proj.weight", {KV, D}, 0.0, lin_d});
      if (cfg.qkv_bias) plan.push_back({p + "self_attn.k_proj.bias", {KV}, 0.0, s.bias});
      plan.push_back({p + "self_attn.v_proj.weight", {KV, D}, 0.0, lin_d});
      if (cfg.qkv_bias) plan.push_back({p + "self_attn.v_proj.bias", {KV}, 0.0, s.bias});
      plan.push_back({p + "self_attn.o_proj.weight", {D, Q}, 0.0, lin_q});
      if (cfg.o_bias) plan.push_back({p + "self_attn.o_proj.bias", {D}, 0.0, s.bias});
      if (cfg.qk_norm) {
        // Per-head q/k RMSNorm resets q and k to unit RMS; weights of mean
        // `linear` give the scores the spread the projections give elsewhere.
        norm(p + "self_attn.q_norm.weight", Dh, s.linear);
        norm(p + "self_attn.k_norm.weight", Dh, s.linear);
      }
    }
    if (moe.is_moe_layer(i)) {
      const bool mixtral = cfg.family == Family::Mixtral;
      const std::string block = p + (mixtral ? "block_sparse_moe." : "mlp.");
      linear(block + "gate.weight", moe.num_experts, D);
      if (moe.correction_bias) plan.push_back({block + "gate.e_score_correction_bias", {moe.num_experts}, 0.0, s.bias});
      for (int64_t e = 0; e < moe.num_experts; ++e)
        mlp(block + "experts." + std::to_string(e) + ".", moe.intermediate_size, mixtral);
      if (moe.shared_intermediate_size > 0)
        mlp(block + (moe.shared_gate ? "shared_expert." : "shared_experts."), moe.shared_intermediate_size, false);
      if (moe.shared_gate) linear(block + "shared_expert_gate.weight", 1, D);
    } else {
      plan.push_back({p + "mlp.gate_proj.weight", {F, D}, 0.0, lin_d});
      plan.push_back({p + "mlp.up_proj.weight", {F, D}, 0.0, lin_d});
      plan.push_back({p + "mlp.down_proj.weight", {D, F}, 0.0, lin_f});
    }
    norm(p + "input_layernorm.weight", D);
    norm(p + "post_attention_layernorm.weight", D);
  }
  norm("model.norm.weight", D);
  if (!cfg.tie_word_embeddings) plan.push_back({"lm_head.weight", {V, D}, 0.0, emb});
  return plan;
}

namespace {


inline uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t s = a ^ (b * 0xd1b54a32d192ed03ULL);
  splitmix64(s);
  return splitmix64(s);
}

uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

constexpr int64_t kBlock = int64_t(1) << 16;  // values per independently seeded block (even)

// Values [0, n) of one block: pairs of standard normals by Box-Muller, in
// double precision (sqrt/log/cos/sin of the C library), then affine + rounding.
template <typename Store>
void fill_block(uint64_t block_seed, int64_t n, double mean, double scale, Store store) {
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  constexpr double k2m53 = 1.0 / 9007199254740992.0;  // 2^-53
  uint64_t state = block_seed;
  for (int64_t i = 0; i < n; i += 2) {
    const double u1 = double((splitmix64(state) >> 11) + 1) * k2m53;  // (0, 1]
    const double u2 = double(splitmix64(state) >> 11) * k2m53;        // [0, 1)
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double a = kTwoPi * u2;
    store(i, float(mean + scale * (r * std::cos(a))));
    if (i + 1 < n) store(i + 1, float(mean + scale * (r * std::sin(a))));
  }
}

void fill_range(uint64_t stream, const SynthTensor& t, DType dtype, void* out, int64_t b, int64_t n) {
  const int64_t begin = b * kBlock, len = std::min(kBlock, n - begin);
  const uint64_t seed = mix(stream, uint64_t(b));
  switch (dtype) {
    case DType::F32: {
      float* o = static_cast<float*>(out) + begin;
      fill_block(seed, len, t.mean, t.scale, [o](int64_t i, float v) { o[i] = v; });
      break;
    }
    case DType::BF16: {
      uint16_t* o = static_cast<uint16_t*>(out) + begin;
      fill_block(seed, len, t.mean, t.scale, [o](int64_t i, float v) { o[i] = f32_to_bf16(v); });
      break;
    }
    case DType::F16: {
      uint16_t* o = static_cast<uint16_t*>(out) + begin;
      fill_block(seed, len, t.mean, t.scale, [o](int64_t i, float v) { o[i] = f32_to_f16(v); });
      break;
    }
    default:
      throw UsageError(std::string("synthetic weights must be F32, BF16 or F16, not ") + dtype_name(dtype));
  }
}

}  // namespace

void synth_fill(uint64_t seed, const SynthTensor& t, DType dtype, void* out, int threads) {
  if (dtype != DType::F32 && dtype != DType::BF16 && dtype != DType::F16)
    throw UsageError(std::string("synthetic weights must be F32, BF16 or F16, not ") + dtype_name(dtype));
  const int64_t n = numel(t.shape);
  const uint64_t stream = mix(seed, fnv1a64(t.name));
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  int nt = resolve_threads(threads);
  nt = int(std::min<int64_t>(nt, blocks));
  if (nt <= 1) {
    for (int64_t b = 0; b < blocks; ++b) fill_range(stream, t, dtype, out, b, n);
    return;
  }
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t b; (b = next.fetch_add(1)) < blocks;) fill_range(stream, t, dtype, out, b, n);
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < nt; ++i) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
}

// --- checkpoints -------------------------------------------------------------

const char* torch_dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    default: throw UsageError(std::string("no torch_dtype for ") + dtype_name(t));
  }
}

DType parse_storage_dtype(const std::string& text) {
  std::string s;
  for (char c : text) s += char(std::tolower(static_cast<unsigned char>(c)));
  if (s == "f32" || s == "float32" || s == "fp32" || s == "float") return DType::F32;
  if (s == "bf16" || s == "bfloat16") return DType::BF16;
  if (s == "f16" || s == "float16" || s == "fp16" || s == "half") return DType::F16;
  throw UsageError("unsupported weight dtype '" + text + "' (use f32, bf16 or f16)");
}

uint64_t parse_byte_size(const std::string& text) {
  static const std::regex re(R"(\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*)");
  std::smatch m;
  if (!std::regex_match(text, m, re)) throw UsageError("bad size '" + text + "' (e.g. 2GB, 500MB, 64KiB, 123)");
  const double v = std::stod(m[1].str());
  std::string unit;
  for (char c : m[2].str()) unit += char(std::tolower(static_cast<unsigned char>(c)));
  static const std::map<std::string, double> units = {
      {"", 1.0},      {"b", 1.0},       {"kb", 1e3},          {"mb", 1e6},          {"gb", 1e9},
      {"tb", 1e12},   {"kib", 1024.0},  {"mib", 1048576.0},   {"gib", 1073741824.0}, {"k", 1e3},
      {"m", 1e6},     {"g", 1e9}};
  auto it = units.find(unit);
  if (it == units.end()) throw UsageError("bad size unit in '" + text + "' (B, KB, MB, GB, TB, KiB, MiB, GiB)");
  const double bytes = v * it->second;
  if (bytes < 1.0) throw UsageError("size '" + text + "' must be at least one byte");
  return uint64_t(bytes);
}

namespace {


bool is_weight_file_name(const std::string& name) {
  static const std::regex shard(R"(model-[0-9]+-of-[0-9]+\.safetensors)");
  return name == "model.safetensors" || name == "model.safetensors.index.json" || std::regex_match(name, shard);
}

// Why `root` holds a checkpoint that synth did not write, or "" when it holds
// none or a synthetic one.
std::string foreign_checkpoint(const fs::path& root) {
  std::error_code ec;
  std::vector<fs::path> weights;
  bool has_config = false;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (name == "config.json") has_config = true;
    if (is_weight_file_name(name) && name != "model.safetensors.index.json") weights.push_back(entry.path());
  }
  if (weights.empty()) return has_config ? "a config.json without synthetic weights" : "";
  for (const auto& w : weights) {
    try {
      if (!SafetensorsFile(w.string()).metadata().count(kSynthMetadataKey))
        return w.filename().string() + ", not written by llmdiff synth";
    } catch (const Error&) {
      return w.filename().string() + ", unreadable";
    }
  }
  return "";
}

std::string shard_name(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

}  // namespace

SynthResult write_synth_checkpoint(const std::string& dir, const SynthOptions& opt) {
  // The config as it will be written: the given one with torch_dtype set.
  json cj;
  try {
    cj = json::parse(opt.config_json);
  } catch (const json::exception& e) {
    throw ConfigError(opt.config_source, std::string("not valid JSON: ") + e.what());
  }
  if (!cj.is_object()) throw ConfigError(opt.config_source, "not a JSON object");
  cj["torch_dtype"] = torch_dtype_name(opt.dtype);
  const std::string config_text = cj.dump(2) + "\n";
  SynthResult res;
  res.config = parse_config(config_text, opt.config_source);
  if (opt.shard_size == 0) throw UsageError("--shard-size must be positive");

  // Shards: tensors in plan order, a new shard when the next tensor would
  // overflow a non-empty one.
  const std::vector<SynthTensor> plan = synth_tensor_plan(res.config, opt.scales);
  const size_t esize = dtype_size(opt.dtype);
  std::vector<std::vector<size_t>> shards(1);
  uint64_t in_shard = 0, largest = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    const uint64_t bytes = uint64_t(numel(plan[i].shape)) * esize;
    if (!shards.back().empty() && in_shard + bytes > opt.shard_size) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += bytes;
    res.data_bytes += bytes;
    res.parameters += uint64_t(numel(plan[i].shape));
    largest = std::max(largest, bytes);
  }
  res.tensors = plan.size();

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) throw IoError(dir, "cannot create directory" + (ec ? ": " + ec.message() : ""));
  const fs::path root(dir);
  const std::string foreign = foreign_checkpoint(root);
  if (!foreign.empty() && !opt.force)
    throw UsageError(dir + " holds another checkpoint (" + foreign + "); choose another --out or pass --force to replace it");
  // Until the new config.json lands the directory is not a checkpoint.
  fs::remove(root / "config.json", ec);
  if (ec) throw IoError((root / "config.json").string(), "cannot remove: " + ec.message());

  std::vector<uint8_t> buffer;
  buffer.reserve(size_t(largest));
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file = shards.size() == 1 ? "model.safetensors" : shard_name(s, shards.size());
    SafetensorsWriter writer((root / file).string());
    writer.set_metadata("format", "pt");
    writer.set_metadata(kSynthMetadataKey, std::to_string(opt.seed));
    for (size_t i : shards[s]) {
      const SynthTensor& t = plan[i];
      buffer.resize(size_t(numel(t.shape)) * esize);
      synth_fill(opt.seed, t, opt.dtype, buffer.data(), opt.threads);
      writer.add(t.name, opt.dtype, t.shape, buffer.data(), buffer.size());
      weight_map[t.name] = file;
    }
    writer.finish();
    res.files.push_back(file);
  }
  if (shards.size() > 1) {
    json index = {{"metadata", {{"total_size", res.data_bytes}}}, {"weight_map", weight_map}};
    write_file_atomic((root / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  }

  // Weight files of an earlier checkpoint in this directory would be ambiguous.
  std::set<std::string> keep(res.files.begin(), res.files.end());
  if (shards.size() > 1) keep.insert("model.safetensors.index.json");
  for (const auto& entry : fs::directory_iterator(root)) {
    const std::string name = entry.path().filename().string();
    if (is_weight_file_name(name) && !keep.count(name)) {
      fs::remove(entry.path(), ec);
      if (ec) throw IoError(entry.path().string(), "cannot remove stale weight file: " + ec.message());
    }
  }

  write_file_atomic((root / "config.json").string(), config_text);
  res.config.source = (root / "config.json").string();
  return res;
}

}  // namespace llmdiff::synth
