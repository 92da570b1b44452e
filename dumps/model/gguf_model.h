// GGUF checkpoints as models: llama.cpp's metadata keys (gguf-py
// constants.py Keys) mapped to HF's config.json. Architectures: llama (and
// mistral, which converts to llama; with experts, Mixtral), qwen2, qwen3,
// qwen2moe, qwen3moe and deepseek2 (DeepSeek-V2/V3 multi-head latent
// attention and MoE, as transformers' deepseek_v3). Tensor names:
// dumps/model/gguf_names.h; writing: dumps/model/gguf_export.h.
#pragma once
#include <string>
#include <vector>

#include "dumps/model/config.h"
#include "dumps/formats/ggml_types.h"
#include "dumps/formats/gguf.h"
#include "dumps/model/gguf_names.h"

namespace llmdiff {

// Whether `path` is a regular file that starts with GGUF's magic.
bool is_gguf_file(const std::string& path);

// The architectures a GGUF model may have, for messages.
std::string gguf_supported_architectures();

// The HF config.json equivalent of a GGUF model's metadata, as JSON text:
// model_type (mixtral for a llama with experts, qwen2_moe, qwen3_moe,
// deepseek_v3 for deepseek2), sizes, eps, rope base and scaling (yarn with
// DeepSeek's mscale from rope.scaling.yarn_log_multiplier), context, vocab
// from token_embd, tie from the absence of output.weight, bias and q/k-norm
// from their tensors; experts (count, top-k, intermediate sizes, gating
// function, renormalisation, routed scaling factor, expert groups, shared
// experts, leading dense layers); MLA ranks and head sizes (joint or split
// kv_b). Throws ConfigError naming the file and key for an unsupported
// architecture or a missing/ill-typed/inconsistent key.
std::string gguf_config_json(const GgufFile& f);
ModelConfig gguf_config(const GgufFile& f);

// A supported ggml type by name ("Q4_K", "F16"); throws UsageError listing them.
GgmlType parse_ggml_type(const std::string& name);

// The shortest decimal that reads back as the same float32: GGUF stores eps,
// rope bases and scales as f32, HF's config.json as decimals (1e-05, not
// 9.99999975e-06). HF adds them to float32 tensors, where both are the same
// float32.
double gguf_f32_decimal(double v);

// llama.cpp's llama-3 rope factors (convert_hf_to_gguf.py
// LlamaModel.generate_extra_tensors, written as rope_freqs.weight) for the
// given rope_scaling parameters, in double.
std::vector<double> gguf_llama3_rope_factors(double base, int64_t dim, double factor, double low, double high,
                                             double old_ctx);

}  // namespace llmdiff
