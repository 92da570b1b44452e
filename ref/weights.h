// A checkpoint's weights as libtorch tensors of one compute dtype: what the
// decoder graph (ref/graph.h) multiplies with.
#pragma once
#include <torch/torch.h>

#include <vector>

#include "dumps/model/weights.h"

namespace llmdiff::ref {

// A weight as a tensor of dtype `st`: the mmapped bytes themselves when the
// stored dtype is `st`, else a converted copy (made once). Undefined for an
// absent optional weight. Throws FormatError for a stored dtype other than
// F32, BF16 or F16.
torch::Tensor weight_tensor(const WeightView& w, torch::ScalarType st);

// A checkpoint's weights for the decoder graph (ref/graph.h), converted to
// the compute dtype as the graph asks for them, a matrix at a time.
// Tensors may alias the checkpoint's mmap (stored in the compute dtype): the
// ModelWeights must outlive them.
//
// Memory stays bounded by what a pass needs, not by the checkpoint:
//  - layer weights are held within `budget` bytes (0: all kept, as the
//    step-by-step engine needs); the least recently used go first, and a
//    converted buffer of the shape wanted that nobody else holds is reused
//    (no fresh pages to zero). A held tensor keeps its values. A pass that
//    goes layer by layer, site by site, converts each matrix once: an 8B
//    layer is 1.75 GB in float64, a 70B layer 6.9 GB, its largest matrix
//    1.9 GB;
//  - the mapped pages of a weight are handed back to the kernel once it is
//    converted (or, used in place, once it leaves the budget);
//  - the embedding is read row by row (only the tokens' rows are converted);
//    an lm_head whose converted copy would pass `whole_limit` bytes is
//    converted and applied a block of vocabulary rows at a time, each call.
class LayerByLayerWeights {
 public:
  LayerByLayerWeights(const ModelWeights& w, torch::ScalarType st, int64_t budget = 0,
                      int64_t whole_limit = int64_t(256) << 20);
  torch::ScalarType st() const { return st_; }
  size_t num_layers() const { return w_.layers.size(); }
  // Layer `l`'s weights in place. Throws UsageError for a layer out of range.
  const LayerWeights& layer(int l) const;
  // A weight of one of layer(l)'s views, e.g. weight(layer(l).q) or
  // weight(layer(l).experts[e].down), converted (undefined when the
  // checkpoint lacks an optional one).
  torch::Tensor weight(const WeightView& v);
  int64_t conversions() const { return conversions_; }  // matrices converted so far
  torch::Tensor final_norm;  // [D]

  // nn.Embedding: rows `ids` [T] (int64) of the table -> [T, D].
  torch::Tensor embed_rows(const torch::Tensor& ids);
  // lm_head: x [T, D] @ W^T -> [T, V], W the lm_head (the embedding itself
  // when tied) or, with `embed_matrix`, the embedding.
  torch::Tensor head(const torch::Tensor& x, bool embed_matrix = false);

 private:
  struct Entry {
    const WeightView* view = nullptr;
    torch::Tensor t;
    int64_t bytes = 0, used = 0;
    bool in_place = false;
  };
  // The [V, D] matrix `v` as a whole tensor of st_ (in place, or converted
  // once when at most whole_limit_ bytes); undefined: apply it by blocks.
  torch::Tensor whole(const WeightView& v, torch::Tensor& cache);
  const ModelWeights& w_;
  torch::ScalarType st_;
  int64_t budget_, whole_limit_;
  std::vector<Entry> held_;
  int64_t held_bytes_ = 0, clock_ = 0, conversions_ = 0;
  torch::Tensor embed_whole_, head_whole_;
};

}  // namespace llmdiff::ref
