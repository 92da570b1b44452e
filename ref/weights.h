// A checkpoint's weights as libtorch tensors of one compute dtype: what the
// decoder graph (ref/graph.h) multiplies with.
#pragma once
#include <torch/torch.h>

#include <vector>

#include "dumps/weights.h"

namespace llmdiff::ref {

// A weight as a tensor of dtype `st`: the mmapped bytes themselves when the
// stored dtype is `st`, else a converted copy (made once). Undefined for an
// absent optional weight. Throws FormatError for a stored dtype other than
// F32, BF16 or F16.
torch::Tensor weight_tensor(const WeightView& w, torch::ScalarType st);

// One decoder layer's weights as tensors of the compute dtype. Absent
// optional weights stay undefined.
struct LayerTensors {
  torch::Tensor input_norm, post_attn_norm;      // [D]
  torch::Tensor q, k, v, o;                      // [Hq*Dh, D], [Hkv*Dh, D] x2, [D, Hq*Dh]
  torch::Tensor q_bias, k_bias, v_bias, o_bias;  // undefined when absent
  torch::Tensor q_norm, k_norm;                  // [Dh], Qwen3 only
  torch::Tensor gate, up, down;                  // [F, D], [F, D], [D, F]
};

// A checkpoint's weights for the decoder graph (ref/graph.h), which goes
// layer by layer: the embedding, final norm and lm_head converted once, the
// layers on demand into `slots` reused slots (a layer-major pass needs two;
// the step-by-step engine one per layer). Tensors may alias the checkpoint's
// mmap (stored in the compute dtype): the ModelWeights must outlive them. A
// 1B model is 8.8 GB in float64; two of its layers, 0.8 GB. A slot's buffers are
// overwritten in place only when nobody else holds them (a Layer returned by
// layer() keeps its tensors alive and intact).
//
// Memory stays bounded by what a pass needs, not by the checkpoint: the
// mmapped pages of a layer are handed back to the kernel once the layer is
// converted (or, used in place, once its slot takes another layer); the
// embedding is read row by row (only the tokens' rows are converted); an
// lm_head whose converted copy would pass `whole_limit` bytes is converted
// and applied a block of vocabulary rows at a time, for each call.
class LayerByLayerWeights {
 public:
  LayerByLayerWeights(const ModelWeights& w, torch::ScalarType st, int slots = 2,
                      int64_t whole_limit = int64_t(256) << 20);
  torch::ScalarType st() const { return st_; }
  size_t num_layers() const { return w_.layers.size(); }
  LayerTensors layer(int l);  // tensor handles (cheap to copy)
  int64_t conversions() const { return conversions_; }  // layers converted so far
  torch::Tensor final_norm;  // [D]

  // nn.Embedding: rows `ids` [T] (int64) of the table -> [T, D].
  torch::Tensor embed_rows(const torch::Tensor& ids);
  // lm_head: x [T, D] @ W^T -> [T, V], W the lm_head (the embedding itself
  // when tied) or, with `embed_matrix`, the embedding.
  torch::Tensor head(const torch::Tensor& x, bool embed_matrix = false);

 private:
  struct Slot {
    int layer = -1;
    int64_t used = 0;
    bool in_place = false;
    LayerTensors w;
  };
  // The [V, D] matrix `v` as a whole tensor of st_ (in place, or converted
  // once when at most whole_limit_ bytes); undefined: apply it by blocks.
  torch::Tensor whole(const WeightView& v, torch::Tensor& cache);
  const ModelWeights& w_;
  torch::ScalarType st_;
  int64_t whole_limit_;
  std::vector<Slot> slots_;
  int64_t clock_ = 0, conversions_ = 0;
  torch::Tensor embed_whole_, head_whole_;
};

}  // namespace llmdiff::ref
