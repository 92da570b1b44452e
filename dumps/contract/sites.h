// The site table of the llm-dump/1 format (shared/spec/DUMP_FORMAT.md): every
// canonical site once, with its name, its place in a step's order, whether it
// holds integers, which models have it and the shape the spec prescribes.
// Names, the canonical order (names.h), the shapes a checker expects and the
// ref's applicability are all derived from this one table; code names a site
// by its Site value (site_name(Site::AttnQ) == "attn.q"), not by a literal.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dumps/contract/names.h"
#include "dumps/formats/safetensors.h"
#include "dumps/model/config.h"

namespace llmdiff {

enum class Site : uint8_t {
  // per step, before the layers
  Tokens, Positions, RopeCos, RopeSin, Mask, Embed,
  // per layer (the GQA table with the MLA and MoE tables merged in, each table's order kept)
  AttnNorm, AttnQA, AttnQANorm, AttnQ, AttnK, AttnV, AttnKvA, AttnKvANorm, AttnKv, AttnQNorm, AttnKNorm, AttnKPe,
  AttnQRope, AttnKRope, AttnLatentCache, AttnKPeCache, AttnKCache, AttnVCache, AttnKRep, AttnVRep, AttnScores,
  AttnProbs, AttnCtx, AttnOut, AttnResidual, MlpNorm, MlpGate, MlpUp, MlpAct, MlpDown, MoeRouterLogits,
  MoeRouterProbs, MoeTopkIds, MoeTopkWeights, MoeExpertOut, MoeRouted, MoeShared, MoeOut, Out,
  // per step, after the layers
  FinalNorm, LastHidden, Logits, NextLogits,
  // per step, outside the forward pass's order: row subsets, the paged cache's bookkeeping, sampling
  Rows, KvBlockTable, KvSlotMapping, KvContextLen, SampleScores, SampleProbs, SampleU, SampleToken,
  // serving features: a prefix-cache hit, the writer of each block, speculative verify calls
  KvCachedPrefix, KvBlockSource, SpecDraft, SpecAccepted,
};

enum class SiteScope {
  BeforeLayers,  // step{N}.<site>, before the layers
  Layer,         // step{N}.layers.{i}.<site>
  AfterLayers,   // step{N}.<site>, after the layers
  Record,        // step{N}.<site>, ordered after the forward's sites by name
};

// Which models compute a site (per layer for layer sites).
enum class Presence {
  Always,
  Gqa,         // grouped-query attention (not MLA)
  GqaQkNorm,   // Qwen3's per-head q/k norms
  MlaQLora,    // MLA with a q_lora_rank bottleneck
  Mla,         // multi-head latent attention
  DenseMlp,    // a dense MLP layer
  Moe,         // a mixture-of-experts layer
  MoeShared,   // a MoE layer with a shared expert
};

struct SiteInfo {
  Site id;
  const char* name;  // "attn.q"
  SiteScope scope;
  bool integer;      // I64 (tokens, positions, moe.topk_ids, ...)
  Presence presence;
  // The axis of the call's T tokens ([T, ...]: 0; head-major [H, T, ...]: 1;
  // -1: not per token, e.g. the caches, last_hidden, next_logits).
  int token_axis;
  // The axis of the S cached positions (mask: 1, scores/probs: 2, GQA caches
  // [H, S, Dh]: 1, MLA's latent caches [S, ...]: 0; -1: none).
  int key_axis;
};

const std::vector<SiteInfo>& site_table();  // in canonical order
const SiteInfo& site_info(Site s);
const char* site_name(Site s);
std::optional<Site> find_site(const std::string& name);  // nullopt: not a site of the table

// The KV caches, what attention stores across calls (possibly at a lower
// precision than it computes): attn.k_cache, attn.v_cache and MLA's
// attn.latent_cache, attn.k_pe_cache.
bool is_kv_cache(Site s);

// Whether layer `layer` of the model computes `site` (false for attn.k on an
// MLA model, mlp.gate on a MoE layer, ...); step sites: always.
bool model_has_site(const ModelConfig& m, int64_t layer, Site s);
// The same by name; a name outside the table counts as present.
bool model_has_layer_site(const ModelConfig& m, int64_t layer, const std::string& site);

// The spec's shape of a canonical name for a step of T tokens with S = P + T
// positions in the cache, and `generated` tokens; nullopt for a name the
// model does not have or that is not canonical.
std::optional<Shape> spec_shape(const CanonName& c, const ModelConfig& m, int64_t T, int64_t S, int64_t generated);

// Whether a site holds integers (I64): tokens, positions, moe.topk_ids, generated, ...
bool integer_site(const std::string& site);

// Full names of a site: "step0.mask", "step0.layers.1.attn.q".
std::string step_name(int step, Site s);
std::string layer_name(int step, int layer, Site s);
// The residual stream entering layer `layer` at `step`: step{N}.embed for
// layer 0, else the layer before's out.
std::string layer_input_name(int step, int layer);

}  // namespace llmdiff
