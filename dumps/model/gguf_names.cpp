#include "dumps/model/gguf_names.h"

#include <regex>
#include <utility>
#include <vector>

namespace llmdiff {

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() > tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// A layer's HF parameter (after "model.layers.N.") -> its GGUF name (after "blk.N.").
const std::vector<std::pair<std::string, std::string>>& layer_names() {
  static const std::vector<std::pair<std::string, std::string>> table = {
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
      // DeepseekV3Attention (multi-head latent attention)
      {"self_attn.q_a_proj.weight", "attn_q_a.weight"},
      {"self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"},
      {"self_attn.q_b_proj.weight", "attn_q_b.weight"},
      {"self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"},
      {"self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"},
      {"self_attn.kv_b_proj.weight", "attn_kv_b.weight"},
      // dense MLP
      {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"},
      // MoE routers, DeepSeek's correction bias, shared experts
      {"mlp.gate.weight", "ffn_gate_inp.weight"},
      {"block_sparse_moe.gate.weight", "ffn_gate_inp.weight"},
      {"mlp.gate.e_score_correction_bias", "exp_probs_b.bias"},
      {"mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"},
      {"mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"},
      {"mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"},
      {"mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"},
      {"mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"},
      {"mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight"},
      {"mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"},
  };
  return table;
}

// A routed expert's projection (after "experts.E.") -> the merged tensor.
const std::vector<std::pair<std::string, std::string>>& expert_names() {
  static const std::vector<std::pair<std::string, std::string>> table = {
      {"gate_proj.weight", "ffn_gate_exps.weight"}, {"up_proj.weight", "ffn_up_exps.weight"},
      {"down_proj.weight", "ffn_down_exps.weight"}, {"w1.weight", "ffn_gate_exps.weight"},  // Mixtral
      {"w3.weight", "ffn_up_exps.weight"},          {"w2.weight", "ffn_down_exps.weight"},
  };
  return table;
}

}  // namespace

GgufLocation gguf_locate(const std::string& hf) {
  static const std::vector<std::pair<std::string, std::string>> top = {
      {"model.embed_tokens.weight", "token_embd.weight"},
      {"model.norm.weight", "output_norm.weight"},
      {"lm_head.weight", "output.weight"},
  };
  GgufLocation loc;
  for (const auto& [h, g] : top)
    if (hf == h) {
      loc.name = g;
      return loc;
    }
  static const std::regex layer_re(R"(model\.layers\.(\d+)\.(.+))");
  static const std::regex expert_re(R"((?:mlp|block_sparse_moe)\.experts\.(\d+)\.(.+))");
  std::smatch m, e;
  if (!std::regex_match(hf, m, layer_re)) return loc;
  const std::string blk = "blk." + m[1].str() + ".";
  const std::string rest = m[2].str();
  if (std::regex_match(rest, e, expert_re)) {
    for (const auto& [h, g] : expert_names())
      if (e[2] == h) {
        loc.name = blk + g;
        loc.expert = std::stoll(e[1].str());
        return loc;
      }
    return loc;
  }
  for (const auto& [h, g] : layer_names())
    if (rest == h) {
      loc.name = blk + g;
      if (rest == "self_attn.kv_b_proj.weight") {
        loc.kv_b = true;
        loc.k_b_name = blk + "attn_k_b.weight";
        loc.v_b_name = blk + "attn_v_b.weight";
      }
      return loc;
    }
  return loc;
}

std::string gguf_tensor_name(const std::string& hf) { return gguf_locate(hf).name; }

bool gguf_rows_permuted(const ModelConfig& cfg, const std::string& hf, int64_t* heads) {
  // convert_hf_to_gguf.py converts Llama, Mistral and Mixtral with LlamaModel.
  if (cfg.family != Family::Llama && cfg.family != Family::Mixtral) return false;
  if (ends_with(hf, "self_attn.q_proj.weight") || ends_with(hf, "self_attn.q_proj.bias")) {
    *heads = cfg.num_attention_heads;
    return true;
  }
  if (ends_with(hf, "self_attn.k_proj.weight") || ends_with(hf, "self_attn.k_proj.bias")) {
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

}  // namespace llmdiff
