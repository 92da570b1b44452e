// attn.ctx recomputed from the candidate's own q, k and v with variants of
// HF's eager attention (LlamaAttention / Qwen2Attention / Qwen3Attention:
// rotate-half RoPE on q and k, scores q k^T / sqrt(Dh), the causal mask,
// softmax in float32, query head h reading kv head h / (Hq / Hkv)): the
// variant that reproduces the candidate names what its attention does
// differently, where only the projections and the context are recorded
// (an engine recorded by module hooks sees nothing inside attention).
//
// Variants, one departure at a time: RoPE with adjacent pairs, on q only or
// k only, on none, on the first R < Dh dims only (R = Dh/2, Dh/4; the
// frequencies theta^(-2i/R) or the model's first R/2); scores scaled by 1,
// 1/Dh or sqrt(Dh); the causal boundary one key later or earlier, or no mask;
// keys and values swapped, or one of them used for both; kv heads tiled
// (h mod Hkv); the softmax of scores rounded to float16 or bfloat16.
// GQA models on a contiguous cache (not MLA, not a ring or rolled-back
// cache); the sequence's positions from the dumps (or 0, 1, ...).
#pragma once
#include <optional>

#include "compare/signature_finders.h"

namespace llmdiff::compare::sig {

void find_attention_variant(Found& f, const TensorData& c, const TensorSource& cand, const TensorSource& ref,
                            const std::optional<ModelConfig>& cfg);

}  // namespace llmdiff::compare::sig
