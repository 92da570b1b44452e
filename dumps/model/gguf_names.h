// llama.cpp's tensor names for HF parameter names (gguf-py constants.py
// TENSOR_NAMES, as convert_hf_to_gguf.py maps the HF modules), and where an
// HF parameter sits inside them:
//  - experts: llama.cpp merges a layer's routed experts into one tensor per
//    projection (blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps), the
//    expert dimension last in GGUF's order: ne = {cols, rows, E}, i.e. the
//    row-major [E, rows, cols] of torch.stack over the experts. Expert e is
//    the contiguous [rows, cols] block e: read in place, no copy.
//  - MLA's kv_b_proj [H*(Dn+Dv), Rkv]: blk.N.attn_kv_b (older converters), or
//    split for the absorbed form (convert_hf_to_gguf.py DeepseekV2Model since
//    2025): blk.N.attn_k_b ne {Dn, Rkv, H} (each head's key rows transposed,
//    [H, Rkv, Dn] row-major) and blk.N.attn_v_b ne {Rkv, Dv, H} (each head's
//    value rows, [H, Dv, Rkv]).
//  - llama (and Mixtral, converted as llama) q/k rows permuted so that each
//    head's rotary pairs are adjacent (LlamaModel.permute): HF row
//    h*Dh + half*Dh/2 + j is stored at row h*Dh + 2j + half.
#pragma once
#include <cstdint>
#include <string>

#include "dumps/model/config.h"

namespace llmdiff {

struct GgufLocation {
  std::string name;       // GGUF tensor name; "" when the HF name has none
  int64_t expert = -1;    // >= 0: expert `expert`'s block of a merged [E, rows, cols] tensor
  bool kv_b = false;      // MLA kv_b_proj: name is attn_kv_b; split files hold k_b_name / v_b_name
  std::string k_b_name, v_b_name;
};

// Where the HF parameter `hf_name` is in a GGUF file (Mixtral's
// block_sparse_moe.experts.E.w1/w3/w2 and the MoE blocks' mlp.experts.E.*,
// shared experts, routers, DeepSeek's e_score_correction_bias, MLA's
// projections included).
GgufLocation gguf_locate(const std::string& hf_name);

// The GGUF name of an HF parameter name ("" when the model has no such
// name); for a routed expert the merged tensor's name.
std::string gguf_tensor_name(const std::string& hf_name);

// Whether the tensor's rows are stored permuted (llama / mixtral q/k);
// `heads` gets the head count the permutation groups rows by.
bool gguf_rows_permuted(const ModelConfig& cfg, const std::string& hf_name, int64_t* heads);
// Row r of the HF layout <- row gguf_row(r) of the stored one.
int64_t gguf_permuted_row(int64_t r, int64_t rows, int64_t heads);

}  // namespace llmdiff
