// Which canonical sites a model has, and the shape the llm-dump/1 spec
// prescribes for each (shared/spec/DUMP_FORMAT.md): GQA or MLA attention,
// Qwen3's q/k norms, dense MLP or MoE block per layer.
#pragma once
#include <optional>
#include <string>

#include "dumps/config.h"
#include "dumps/names.h"
#include "dumps/safetensors.h"

namespace llmdiff {

// Whether layer `layer` of the model computes `site` (a layer site of
// names.h): false for attn.k on an MLA model, mlp.gate on a MoE layer, ...
bool model_has_layer_site(const ModelConfig& m, int64_t layer, const std::string& site);

// The spec's shape of a canonical name for a step of T tokens with S = P + T
// positions in the cache, and `generated` tokens; nullopt for a name the
// model does not have or that is not canonical.
std::optional<Shape> spec_shape(const CanonName& c, const ModelConfig& m, int64_t T, int64_t S, int64_t generated);

// Whether a site holds integers (I64): tokens, positions, moe.topk_ids,
// generated.
bool integer_site(const std::string& site);

}  // namespace llmdiff
