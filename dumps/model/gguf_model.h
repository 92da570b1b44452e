// GGUF checkpoints as models: llama.cpp's metadata keys and tensor names
// mapped to HF's config.json and parameter names, and the reverse (an HF
// checkpoint written as GGUF the way llama.cpp's convert_hf_to_gguf.py and
// llama-quantize write it). Architectures: llama (and mistral, which
// converts to llama), qwen2, qwen3.
//
// llama.cpp's converter permutes the rows of a llama's q_proj / k_proj
// (weights and biases) so that each head's rotary pairs are adjacent
// (convert_hf_to_gguf.py LlamaModel.permute): HF row h*Dh + half*Dh/2 + j is
// stored at GGUF row h*Dh + 2j + half. Loading undoes it, so the reference
// computes HF's function; qwen2/qwen3 are stored unpermuted.
#pragma once
#include <string>
#include <vector>

#include "dumps/model/config.h"
#include "dumps/formats/ggml_types.h"
#include "dumps/formats/gguf.h"

namespace llmdiff {

// Whether `path` is a regular file that starts with GGUF's magic.
bool is_gguf_file(const std::string& path);

// The architectures a GGUF model may have, comma separated.
std::string gguf_supported_architectures();

// The HF config.json equivalent of a GGUF model's metadata (model_type,
// sizes, eps, rope base and scaling, context, vocab from token_embd, tie from
// the absence of output.weight, bias and q/k-norm from their tensors), as
// JSON text. Throws ConfigError naming the file and key for an unsupported
// architecture or a missing/ill-typed key.
std::string gguf_config_json(const GgufFile& f);
ModelConfig gguf_config(const GgufFile& f);

// The GGUF name of an HF parameter name ("" when the model has no such name).
std::string gguf_tensor_name(const std::string& hf_name);
// Whether the tensor's rows are stored permuted (llama q/k); `heads` gets the
// head count the permutation groups rows by.
bool gguf_rows_permuted(const ModelConfig& cfg, const std::string& hf_name, int64_t* heads);
// Row r of the HF layout <- row gguf_row(r) of the stored one.
int64_t gguf_permuted_row(int64_t r, int64_t rows, int64_t heads);

// A supported ggml type by name ("Q4_K", "F16"); throws UsageError listing them.
GgmlType parse_ggml_type(const std::string& name);

// Writes an HF checkpoint's weights as GGUF v3 at `path` (atomically):
// metadata as llama.cpp writes it for the architecture, q/k rows permuted
// for llama, 1-D tensors in F32 and 2-D ones in `type`. As llama-quantize
// does, a matrix whose rows are not a whole number of `type`'s blocks falls
// back to a smaller-block type (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0,
// Q2_K/Q3_K -> Q4_0 here, others -> F16). Returns the type of each tensor
// written ("blk.0.attn_q.weight Q4_K", ...).
class ModelWeights;
std::vector<std::string> write_gguf(const ModelWeights& w, const std::string& path, GgmlType type);

}  // namespace llmdiff
