// An HF checkpoint written as GGUF the way llama.cpp writes it: metadata and
// tensor names as convert_hf_to_gguf.py writes them for the architecture
// (dumps/model/gguf_model.h, gguf_names.h: llama's q/k rows permuted,
// experts merged into [E, rows, cols] tensors, MLA's kv_b split for the
// absorbed form or joint), and each tensor's type as the converter
// (--outtype) and then llama-quantize (src/llama-quant.cpp, without an
// importance matrix) choose it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dumps/formats/ggml_types.h"

namespace llmdiff {

class ModelWeights;

// What a tensor of the export is quantised to.
//  - a ggml type (F32, F16, BF16, Q8_0, Q4_0, ..., Q6_K): every matrix in
//    that type, as the converter's --outtype or llama-quantize --pure do;
//  - a llama-quantize file type with its mixture (Q3_K_S, Q3_K_M, Q3_K_L,
//    Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M): llama-quantize's per-tensor choice
//    (llama_tensor_get_type): the output matrix Q6_K, attn_v / attn_kv_b and
//    ffn_down (dense, routed and shared) of the layers use_more_bits picks
//    one step up (Q4_K_M: Q6_K), with 8 experts attn_v / attn_k Q8_0 and
//    attn_output Q5_K, ...
// Either way 1-D tensors, routers (ffn_gate_inp, ffn_gate_inp_shexp) and
// biases stay F32, and a matrix whose rows are not a whole number of the
// type's blocks falls back as llama-quantize does (Q4_K -> Q5_0, Q5_K ->
// Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0; then F16).
struct GgufQuant {
  enum class Mixture { None, Q3_K_S, Q3_K_M, Q3_K_L, Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M };
  GgmlType type = GgmlType::F16;  // the matrices' type (a mixture's default type)
  Mixture mixture = Mixture::None;
  // From a name: a supported ggml type or a mixture; throws UsageError listing both.
  static GgufQuant parse(const std::string& name);
  std::string name() const;
  // general.file_type: llama.cpp's llama_ftype of the file.
  uint32_t file_type() const;
};
// The names GgufQuant::parse accepts, for messages and --help.
std::string gguf_quant_names();

struct GgufExportOptions {
  GgufQuant quant;
  // MLA: kv_b_proj as one attn_kv_b tensor (llama.cpp's converters before
  // the absorbed form, read by llama.cpp without MLA's compressed cache)
  // instead of attn_k_b + attn_v_b.
  bool kv_b_joint = false;
};

// Writes the weights as GGUF v3 at `path` (atomically). Returns each tensor
// written with its type ("blk.0.attn_q.weight Q4_K", ...). Throws
// UsageError for a model llama.cpp's format does not express (an
// architecture it lacks, Qwen-MoE dense layers, MLA without
// rope_interleave, ...).
std::vector<std::string> write_gguf(const ModelWeights& w, const std::string& path, const GgufExportOptions& opt);

}  // namespace llmdiff
