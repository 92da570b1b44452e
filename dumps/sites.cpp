#include "dumps/sites.h"

namespace llmdiff {

bool model_has_layer_site(const ModelConfig& m, int64_t layer, const std::string& s) {
  const bool mla = m.mla.enabled, moe = m.moe.is_moe_layer(layer);
  if (s == "attn.k" || s == "attn.v" || s == "attn.k_rep" || s == "attn.v_rep") return !mla;
  if (s == "attn.q_norm" || s == "attn.k_norm") return !mla && m.qk_norm;
  if (s == "attn.q_a" || s == "attn.q_a_norm") return mla && m.mla.q_lora_rank > 0;
  if (s == "attn.kv_a" || s == "attn.kv_a_norm" || s == "attn.kv" || s == "attn.k_pe" || s == "attn.latent_cache" ||
      s == "attn.k_pe_cache")
    return mla;
  if (s.compare(0, 4, "mlp.") == 0) return !moe;
  if (s == "moe.shared") return moe && m.moe.shared_intermediate_size > 0;
  if (s.compare(0, 4, "moe.") == 0) return moe;
  return true;
}

bool integer_site(const std::string& s) {
  return s == "tokens" || s == "positions" || s == "moe.topk_ids" || s == "generated";
}

std::optional<Shape> spec_shape(const CanonName& c, const ModelConfig& m, int64_t T, int64_t S, int64_t generated) {
  const int64_t D = m.hidden_size, F = m.intermediate_size, V = m.vocab_size, Dh = m.head_dim;
  const int64_t Hq = m.num_attention_heads, Hkv = m.num_key_value_heads;
  using K = CanonName::Kind;
  if (c.kind == K::InvFreq) return Shape{Dh / 2};
  if (c.kind == K::Generated) return Shape{generated};
  const std::string& s = c.site;
  if (c.kind == K::Step) {
    if (s == "tokens" || s == "positions") return Shape{T};
    if (s == "rope.cos" || s == "rope.sin") return Shape{T, Dh};
    if (s == "mask") return Shape{T, S};
    if (s == "embed" || s == "final_norm") return Shape{T, D};
    if (s == "last_hidden") return Shape{D};
    if (s == "logits") return Shape{T, V};
    if (s == "next_logits") return Shape{V};
    return std::nullopt;
  }
  if (c.kind != K::Layer || site_rank(s) < 0 || !model_has_layer_site(m, c.layer, s)) return std::nullopt;
  if (s == "attn.scores" || s == "attn.probs") return Shape{Hq, T, S};
  if (m.mla.enabled) {
    const MlaConfig& a = m.mla;
    const int64_t Dn = a.qk_nope_head_dim, Dr = a.qk_rope_head_dim, Dv = a.v_head_dim;
    if (s == "attn.q_a" || s == "attn.q_a_norm") return Shape{T, a.q_lora_rank};
    if (s == "attn.q") return Shape{T, Hq * (Dn + Dr)};
    if (s == "attn.kv_a") return Shape{T, a.kv_lora_rank + Dr};
    if (s == "attn.kv_a_norm") return Shape{T, a.kv_lora_rank};
    if (s == "attn.kv") return Shape{T, Hq * (Dn + Dv)};
    if (s == "attn.k_pe") return Shape{T, Dr};
    if (s == "attn.q_rope" || s == "attn.k_rope") return Shape{Hq, T, Dn + Dr};
    if (s == "attn.latent_cache") return Shape{S, a.kv_lora_rank};
    if (s == "attn.k_pe_cache") return Shape{S, Dr};
    if (s == "attn.k_cache") return Shape{Hq, S, Dn + Dr};
    if (s == "attn.v_cache") return Shape{Hq, S, Dv};
    if (s == "attn.ctx") return Shape{T, Hq * Dv};
  } else {
    if (s == "attn.q" || s == "attn.q_norm" || s == "attn.ctx") return Shape{T, Hq * Dh};
    if (s == "attn.k" || s == "attn.v" || s == "attn.k_norm") return Shape{T, Hkv * Dh};
    if (s == "attn.q_rope") return Shape{Hq, T, Dh};
    if (s == "attn.k_rope") return Shape{Hkv, T, Dh};
    if (s == "attn.k_cache" || s == "attn.v_cache") return Shape{Hkv, S, Dh};
    if (s == "attn.k_rep" || s == "attn.v_rep") return Shape{Hq, S, Dh};
  }
  const int64_t E = m.moe.num_experts, Kx = m.moe.top_k;
  if (s == "mlp.gate" || s == "mlp.up" || s == "mlp.act") return Shape{T, F};
  if (s == "moe.router_logits" || s == "moe.router_probs") return Shape{T, E};
  if (s == "moe.topk_ids" || s == "moe.topk_weights") return Shape{T, Kx};
  if (s == "moe.expert_out") return Shape{T, Kx, D};
  // attn_norm, attn.out, attn_residual, mlp_norm, mlp.down, moe.routed, moe.shared, moe.out, out
  return Shape{T, D};
}

}  // namespace llmdiff
