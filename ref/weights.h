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
class LayerByLayerWeights {
 public:
  LayerByLayerWeights(const ModelWeights& w, torch::ScalarType st, int slots = 2);
  torch::ScalarType st() const { return st_; }
  size_t num_layers() const { return w_.layers.size(); }
  LayerTensors layer(int l);  // tensor handles (cheap to copy)
  torch::Tensor embed, final_norm, lm_head;  // lm_head: embed itself when tied
  int64_t conversions() const { return conversions_; }  // layers converted so far

 private:
  struct Slot {
    int layer = -1;
    int64_t used = 0;
    LayerTensors w;
  };
  const ModelWeights& w_;
  torch::ScalarType st_;
  std::vector<Slot> slots_;
  int64_t clock_ = 0, conversions_ = 0;
};

}  // namespace llmdiff::ref
