// Checkpoint weights: an HF model.safetensors or a sharded
// model.safetensors.index.json, or a GGUF file (llama.cpp's format), mmapped,
// looked up by HF name and checked against the config. Views point into the
// maps (a GGUF's routed experts: each expert's block of the merged tensor);
// the only copies are a GGUF llama's q/k biases, put back in HF's order, and
// an MLA kv_b assembled from a GGUF's split attn_k_b / attn_v_b.
#pragma once
#include <array>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dumps/model/config.h"
#include "dumps/formats/ggml_types.h"
#include "dumps/formats/safetensors.h"

namespace llmdiff {

class GgufFile;
struct GgufLocation;

// A weight in place: stored dtype, shape and a pointer into the mmap.
struct WeightView {
  std::string name;  // HF name
  std::string file;  // safetensors or GGUF file it lives in
  std::string stored_name;  // its name in that file (the GGUF name; = name for safetensors)
  DType dtype = DType::F32;  // values' type (F32 for ggml block types)
  // A ggml block type (Q4_K, Q8_0...; see dumps/formats/ggml_types.h): `data` holds
  // the blocks of each row and `dtype` is F32, the dequantised values' type.
  GgmlType quant = GgmlType::F32;
  Shape shape;
  const void* data = nullptr;
  // The bytes are a copy owned by ModelWeights, not pages of a file map:
  // never handed back with release_pages.
  bool owned = false;
  // GGUF llama q/k weights hold each head's rotary pairs interleaved
  // (llama.cpp's converter permutes the rows): HF row r is stored row
  // stored_row(r), read in place through this map. 0: rows in HF's order.
  int64_t interleaved_heads = 0;
  int64_t stored_row(int64_t r) const;
  explicit operator bool() const { return data != nullptr; }
  bool quantized() const { return ggml_is_quantized(quant); }
  int64_t numel() const { return llmdiff::numel(shape); }
  int64_t rows() const { return shape.size() >= 2 ? numel() / shape.back() : 1; }
  int64_t cols() const { return shape.empty() ? 1 : shape.back(); }
  // Stored bytes.
  size_t bytes() const {
    return quantized() ? size_t(rows()) * ggml_row_bytes(quant, cols()) : size_t(numel()) * dtype_size(dtype);
  }
  // Stored bytes of one row (the last dimension).
  size_t row_bytes() const { return quantized() ? ggml_row_bytes(quant, cols()) : size_t(cols()) * dtype_size(dtype); }
  // Rows [r0, r0+n) as float32 (dequantised or widened) into dst[n * cols()].
  void rows_f32(int64_t r0, int64_t n, float* dst) const;
  // The weight's name for messages: "HF name" or "HF name (GGUF name)".
  std::string label() const { return stored_name.empty() || stored_name == name ? name : name + " (" + stored_name + ")"; }
};

// A SwiGLU MLP: down(silu(gate(x)) * up(x)). A dense layer's MLP, a routed
// expert or a shared expert.
struct MlpWeights {
  WeightView gate, up, down;  // [F, D], [F, D], [D, F]
};

struct LayerWeights {
  WeightView input_norm, post_attn_norm;            // [D]
  // GQA attention. MLA: q is q_b_proj [Hq*(Dn+Dr), Rq] (q_proj [.., D] without
  // q_lora_rank) and o is [D, Hq*Dv]; k, v absent.
  WeightView q, k, v, o;                            // [Hq*Dh, D], [Hkv*Dh, D] x2, [D, Hq*Dh]
  WeightView q_bias, k_bias, v_bias, o_bias;        // optional
  WeightView q_norm, k_norm;                        // [Dh], Qwen3 only
  // MLA (deepseek_v3): q_a_proj [Rq, D], q_a_layernorm [Rq] (absent without
  // q_lora_rank), kv_a_proj_with_mqa [Rkv+Dr, D], kv_a_layernorm [Rkv],
  // kv_b_proj [Hq*(Dn+Dv), Rkv].
  WeightView q_a, q_a_norm, kv_a, kv_a_norm, kv_b;
  MlpWeights mlp;                                   // a dense layer's MLP
  // A MoE layer: the router [E, D], deepseek_v3's e_score_correction_bias
  // [E], the routed experts, the shared expert (absent: none) and
  // qwen2_moe's shared_expert_gate [1, D].
  WeightView router, router_bias;
  std::vector<MlpWeights> experts;
  MlpWeights shared;
  WeightView shared_gate;
  // Every weight of the layer, absent optional ones included (test with bool).
  std::vector<const WeightView*> views() const;
};

class ModelWeights {
 public:
  // Loads every tensor the config needs from a model directory or a GGUF
  // file; throws MissingTensorError / ShapeError / FormatError naming the
  // file and tensor. Safetensors weights must be F32, BF16 or F16; GGUF
  // weights any type of ggml_supported_types().
  ModelWeights(const std::string& model_dir_or_gguf, const ModelConfig& cfg);
  ~ModelWeights();
  ModelWeights(const ModelWeights&) = delete;
  ModelWeights& operator=(const ModelWeights&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const std::string& dir() const { return dir_; }
  WeightView embed;                 // [V, D]
  WeightView final_norm;            // [D]
  WeightView lm_head;               // [V, D]; == embed when tied
  bool lm_head_tied = false;
  std::vector<LayerWeights> layers;
  // The stored dtype of the weights (F32 for a GGUF model of block types).
  DType storage_dtype() const;
  bool is_gguf() const { return gguf_ != nullptr; }
  const GgufFile* gguf() const { return gguf_.get(); }
  size_t total_bytes() const;       // bytes of distinct weights
  // Any tensor by HF name (nullptr view if absent).
  WeightView find(const std::string& hf_name) const;
  // Hands the mapped pages of a layer's weights, of the embedding and
  // lm_head, or of every weight back to the kernel (release_pages): a pass
  // that goes layer by layer then holds about one layer of the checkpoint in
  // memory, not all of it. Views stay valid; reading them again faults the
  // pages back in.
  void release_layer(int layer) const;
  void release_head() const;
  void release_all() const;
  // The checkpoint's safetensors files (one, or the shards of the index).
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  WeightView require(const std::string& name, const Shape& shape) const;
  WeightView optional(const std::string& name, const Shape& shape) const;
  WeightView find_gguf(const std::string& hf_name) const;
  // MLA's kv_b_proj assembled from a GGUF's split attn_k_b / attn_v_b.
  WeightView gguf_kv_b(const std::string& hf_name, const GgufLocation& loc) const;
  ModelConfig cfg_;
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::unique_ptr<GgufFile> gguf_;
  // GGUF llama q/k biases with their elements put back in HF's order, and
  // MLA kv_b matrices assembled from split k_b / v_b, by GGUF name.
  mutable std::map<std::string, std::vector<uint8_t>> owned_;
  std::vector<std::pair<std::string, size_t>> name_to_file_;  // sorted by name
};

// A model directory (or GGUF file) loaded as a whole.
struct Model {
  ModelConfig config;
  std::shared_ptr<ModelWeights> weights;
  static Model load(const std::string& dir_or_gguf);
};

}  // namespace llmdiff
