#include "dumps/contract/sites.h"

#include <algorithm>
#include <map>

namespace llmdiff {

const std::vector<SiteInfo>& site_table() {
  using S = Site;
  using Sc = SiteScope;
  using P = Presence;
  static const std::vector<SiteInfo> table = {
      {S::Tokens, "tokens", Sc::BeforeLayers, true, P::Always, 0, -1},
      {S::Positions, "positions", Sc::BeforeLayers, true, P::Always, 0, -1},
      {S::RopeCos, "rope.cos", Sc::BeforeLayers, false, P::Always, 0, -1},
      {S::RopeSin, "rope.sin", Sc::BeforeLayers, false, P::Always, 0, -1},
      {S::Mask, "mask", Sc::BeforeLayers, false, P::Always, 0, 1},
      {S::Embed, "embed", Sc::BeforeLayers, false, P::Always, 0, -1},
      {S::AttnNorm, "attn_norm", Sc::Layer, false, P::Always, 0, -1},
      {S::AttnQA, "attn.q_a", Sc::Layer, false, P::MlaQLora, 0, -1},
      {S::AttnQANorm, "attn.q_a_norm", Sc::Layer, false, P::MlaQLora, 0, -1},
      {S::AttnQ, "attn.q", Sc::Layer, false, P::Always, 0, -1},
      {S::AttnK, "attn.k", Sc::Layer, false, P::Gqa, 0, -1},
      {S::AttnV, "attn.v", Sc::Layer, false, P::Gqa, 0, -1},
      {S::AttnKvA, "attn.kv_a", Sc::Layer, false, P::Mla, 0, -1},
      {S::AttnKvANorm, "attn.kv_a_norm", Sc::Layer, false, P::Mla, 0, -1},
      {S::AttnKv, "attn.kv", Sc::Layer, false, P::Mla, 0, -1},
      {S::AttnQNorm, "attn.q_norm", Sc::Layer, false, P::GqaQkNorm, 0, -1},
      {S::AttnKNorm, "attn.k_norm", Sc::Layer, false, P::GqaQkNorm, 0, -1},
      {S::AttnKPe, "attn.k_pe", Sc::Layer, false, P::Mla, 0, -1},
      {S::AttnQRope, "attn.q_rope", Sc::Layer, false, P::Always, 1, -1},
      {S::AttnKRope, "attn.k_rope", Sc::Layer, false, P::Always, 1, -1},
      {S::AttnLatentCache, "attn.latent_cache", Sc::Layer, false, P::Mla, -1, 0},
      {S::AttnKPeCache, "attn.k_pe_cache", Sc::Layer, false, P::Mla, -1, 0},
      {S::AttnKCache, "attn.k_cache", Sc::Layer, false, P::Always, -1, 1},
      {S::AttnVCache, "attn.v_cache", Sc::Layer, false, P::Always, -1, 1},
      {S::AttnKRep, "attn.k_rep", Sc::Layer, false, P::Gqa, -1, 1},
      {S::AttnVRep, "attn.v_rep", Sc::Layer, false, P::Gqa, -1, 1},
      {S::AttnScores, "attn.scores", Sc::Layer, false, P::Always, 1, 2},
      {S::AttnProbs, "attn.probs", Sc::Layer, false, P::Always, 1, 2},
      {S::AttnCtx, "attn.ctx", Sc::Layer, false, P::Always, 0, -1},
      {S::AttnOut, "attn.out", Sc::Layer, false, P::Always, 0, -1},
      {S::AttnResidual, "attn_residual", Sc::Layer, false, P::Always, 0, -1},
      {S::MlpNorm, "mlp_norm", Sc::Layer, false, P::Always, 0, -1},
      {S::MlpGate, "mlp.gate", Sc::Layer, false, P::DenseMlp, 0, -1},
      {S::MlpUp, "mlp.up", Sc::Layer, false, P::DenseMlp, 0, -1},
      {S::MlpAct, "mlp.act", Sc::Layer, false, P::DenseMlp, 0, -1},
      {S::MlpDown, "mlp.down", Sc::Layer, false, P::DenseMlp, 0, -1},
      {S::MoeRouterLogits, "moe.router_logits", Sc::Layer, false, P::Moe, 0, -1},
      {S::MoeRouterProbs, "moe.router_probs", Sc::Layer, false, P::Moe, 0, -1},
      {S::MoeTopkIds, "moe.topk_ids", Sc::Layer, true, P::Moe, 0, -1},
      {S::MoeTopkWeights, "moe.topk_weights", Sc::Layer, false, P::Moe, 0, -1},
      {S::MoeExpertOut, "moe.expert_out", Sc::Layer, false, P::Moe, 0, -1},
      {S::MoeRouted, "moe.routed", Sc::Layer, false, P::Moe, 0, -1},
      {S::MoeShared, "moe.shared", Sc::Layer, false, P::MoeShared, 0, -1},
      {S::MoeOut, "moe.out", Sc::Layer, false, P::Moe, 0, -1},
      {S::Out, "out", Sc::Layer, false, P::Always, 0, -1},
      {S::FinalNorm, "final_norm", Sc::AfterLayers, false, P::Always, 0, -1},
      {S::LastHidden, "last_hidden", Sc::AfterLayers, false, P::Always, -1, -1},
      {S::Logits, "logits", Sc::AfterLayers, false, P::Always, 0, -1},
      {S::NextLogits, "next_logits", Sc::AfterLayers, false, P::Always, -1, -1},
      {S::Rows, "rows", Sc::Record, true, P::Always, -1, -1},
      {S::KvBlockTable, "kv.block_table", Sc::Record, true, P::Always, -1, -1},
      {S::KvSlotMapping, "kv.slot_mapping", Sc::Record, true, P::Always, -1, -1},
      {S::KvContextLen, "kv.context_len", Sc::Record, true, P::Always, -1, -1},
      {S::SampleScores, "sample.scores", Sc::Record, false, P::Always, -1, -1},
      {S::SampleProbs, "sample.probs", Sc::Record, false, P::Always, -1, -1},
      {S::SampleU, "sample.u", Sc::Record, false, P::Always, -1, -1},
      {S::SampleToken, "sample.token", Sc::Record, true, P::Always, -1, -1},
      {S::KvCachedPrefix, "kv.cached_prefix", Sc::Record, true, P::Always, -1, -1},
      {S::KvBlockSource, "kv.block_source", Sc::Record, true, P::Always, -1, -1},
      {S::SpecDraft, "spec.draft", Sc::Record, true, P::Always, -1, -1},
      {S::SpecAccepted, "spec.accepted", Sc::Record, true, P::Always, -1, -1},
  };
  return table;
}

const SiteInfo& site_info(Site s) { return site_table()[size_t(s)]; }

const char* site_name(Site s) { return site_info(s).name; }

std::optional<Site> find_site(const std::string& name) {
  static const std::map<std::string, Site> by_name = [] {
    std::map<std::string, Site> m;
    for (const SiteInfo& i : site_table()) m.emplace(i.name, i.id);
    return m;
  }();
  auto it = by_name.find(name);
  if (it == by_name.end()) return std::nullopt;
  return it->second;
}

bool is_kv_cache(Site s) {
  switch (s) {
    case Site::AttnKCache:
    case Site::AttnVCache:
    case Site::AttnLatentCache:
    case Site::AttnKPeCache: return true;
    default: return false;
  }
}

bool model_has_site(const ModelConfig& m, int64_t layer, Site s) {
  const bool mla = m.mla.enabled;
  switch (site_info(s).presence) {
    case Presence::Always: return true;
    case Presence::Gqa: return !mla;
    case Presence::GqaQkNorm: return !mla && m.qk_norm;
    case Presence::MlaQLora: return mla && m.mla.q_lora_rank > 0;
    case Presence::Mla: return mla;
    case Presence::DenseMlp: return !m.moe.is_moe_layer(layer);
    case Presence::Moe: return m.moe.is_moe_layer(layer);
    case Presence::MoeShared: return m.moe.is_moe_layer(layer) && m.moe.shared_intermediate_size > 0;
  }
  return false;
}

bool model_has_layer_site(const ModelConfig& m, int64_t layer, const std::string& site) {
  const std::optional<Site> s = find_site(site);
  return !s || model_has_site(m, layer, *s);
}

bool integer_site(const std::string& site) {
  if (site == "generated") return true;
  const std::optional<Site> s = find_site(site);
  return s && site_info(*s).integer;
}

std::optional<Shape> spec_shape(const CanonName& c, const ModelConfig& m, int64_t T, int64_t S, int64_t generated) {
  const int64_t D = m.hidden_size, F = m.intermediate_size, V = m.vocab_size, Dh = m.head_dim;
  const int64_t Hq = m.num_attention_heads, Hkv = m.num_key_value_heads;
  using K = CanonName::Kind;
  if (c.kind == K::InvFreq) return Shape{Dh / 2};
  if (c.kind == K::Generated) return Shape{generated};
  if (c.kind != K::Step && c.kind != K::Layer) return std::nullopt;
  const std::optional<Site> found = find_site(c.site);
  if (!found) return std::nullopt;
  const SiteInfo& info = site_info(*found);
  if (info.scope == SiteScope::Record) return std::nullopt;
  if ((c.kind == K::Layer) != (info.scope == SiteScope::Layer)) return std::nullopt;
  if (c.kind == K::Layer && !model_has_site(m, c.layer, info.id)) return std::nullopt;
  // MLA: a query/key head of Dn+Dr, a value head of Dv, every head its own key and value.
  const bool mla = m.mla.enabled;
  const MlaConfig& a = m.mla;
  const int64_t Dk = mla ? a.qk_nope_head_dim + a.qk_rope_head_dim : Dh, Dv = mla ? a.v_head_dim : Dh;
  const int64_t Hk = mla ? Hq : Hkv;
  const int64_t E = m.moe.num_experts, Kx = m.moe.top_k;
  switch (info.id) {
    case Site::Tokens:
    case Site::Positions: return Shape{T};
    case Site::RopeCos:
    case Site::RopeSin: return Shape{T, Dh};
    case Site::Mask: return Shape{T, S};
    case Site::LastHidden: return Shape{D};
    case Site::Logits: return Shape{T, V};
    case Site::NextLogits: return Shape{V};
    case Site::AttnScores:
    case Site::AttnProbs: return Shape{Hq, T, S};
    case Site::AttnQA:
    case Site::AttnQANorm: return Shape{T, a.q_lora_rank};
    case Site::AttnQ:
    case Site::AttnQNorm: return Shape{T, Hq * Dk};
    case Site::AttnK:
    case Site::AttnV:
    case Site::AttnKNorm: return Shape{T, Hkv * Dh};
    case Site::AttnKvA: return Shape{T, a.kv_lora_rank + a.qk_rope_head_dim};
    case Site::AttnKvANorm: return Shape{T, a.kv_lora_rank};
    case Site::AttnKv: return Shape{T, Hq * (a.qk_nope_head_dim + a.v_head_dim)};
    case Site::AttnKPe: return Shape{T, a.qk_rope_head_dim};
    case Site::AttnQRope: return Shape{Hq, T, Dk};
    case Site::AttnKRope: return Shape{Hk, T, Dk};
    case Site::AttnLatentCache: return Shape{S, a.kv_lora_rank};
    case Site::AttnKPeCache: return Shape{S, a.qk_rope_head_dim};
    case Site::AttnKCache: return Shape{Hk, S, Dk};
    case Site::AttnVCache: return Shape{Hk, S, Dv};
    case Site::AttnKRep:
    case Site::AttnVRep: return Shape{Hq, S, Dh};
    case Site::AttnCtx: return Shape{T, Hq * Dv};
    case Site::MlpGate:
    case Site::MlpUp:
    case Site::MlpAct: return Shape{T, F};
    case Site::MoeRouterLogits:
    case Site::MoeRouterProbs: return Shape{T, E};
    case Site::MoeTopkIds:
    case Site::MoeTopkWeights: return Shape{T, Kx};
    case Site::MoeExpertOut: return Shape{T, Kx, D};
    default: return Shape{T, D};  // embed, attn_norm, attn.out, attn_residual, mlp_norm, mlp.down, moe.*, out, final_norm
  }
}

std::string step_name(int step, Site s) { return step_name(step, std::string(site_name(s))); }

std::string layer_name(int step, int layer, Site s) { return layer_name(step, layer, std::string(site_name(s))); }

std::string layer_input_name(int step, int layer) {
  return layer == 0 ? step_name(step, Site::Embed) : layer_name(step, layer - 1, Site::Out);
}

}  // namespace llmdiff
