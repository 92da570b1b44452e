// A shard of a model's decoder layers (`llmdiff bisect --layers A:B`).
//
// A shard analyses the layers [first, end) on their own: every forward call
// of the scenario runs through those layers only, the residual stream
// entering `first` read from the candidate's dump (step{N}.layers.{first-1}.out)
// instead of computed from the layers below. It needs those layers' weights
// only (and the embedding for the shard starting at 0, the final norm and the
// head for the shard ending at the last layer).
//
// The names of a dump are split between the shards so that every name
// belongs to exactly one: a layer's names to the shard holding the layer;
// the step sites before the layers (tokens ... embed), rope.inv_freq, a
// paged cache's kv.* and any name outside the canonical tables to the shard
// starting at layer 0; the sites after the layers (final_norm ...
// next_logits), a sampler's sample.* and `generated` to the shard ending at
// the last layer.
#pragma once
#include <set>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"

namespace llmdiff {

struct LayerWindow {
  int first = 0;
  int end = -1;         // one past the last layer; -1: the whole model (no shard)
  int num_layers = 0;   // the model's
  // The dump the boundary's residual stream is read from (first > 0).
  const TensorSource* boundary = nullptr;

  bool whole() const { return end < 0 || (first == 0 && end >= num_layers); }
  bool starts() const { return first == 0; }            // holds the sites before the layers
  bool finishes() const { return whole() || end >= num_layers; }  // holds the sites after them
  bool has_layer(int layer) const { return whole() || (layer >= first && layer < end); }
  // The name the residual stream entering layer `first` has at `step`.
  std::string boundary_name(int step) const;
  std::string str() const;  // "A:B"
};

// "A:B" (layers A to B-1; "A:" through the last) of a model with
// `num_layers` layers. Throws UsageError for a malformed or empty range.
LayerWindow parse_layer_window(const std::string& text, int num_layers);

// Whether `name` belongs to the window's analysis (see the file comment).
bool in_window(const LayerWindow& w, const std::string& name);

// The residual stream entering layer `first` of every step of `dump`,
// checked to be there (a shard is teacher-forced from it). Throws
// MissingTensorError naming the first one absent.
void check_boundary(const LayerWindow& w, const TensorSource& dump);

// A dump as a shard sees it: names() lists the window's names; has() and
// get() also reach what the window's ops read from the dump, namely the step
// sites before the layers (tokens, positions, mask ...), rope.inv_freq,
// `generated` (which calls were greedy) and the residual stream entering the
// window.
class WindowSource : public TensorSource {
 public:
  WindowSource(const TensorSource& base, const LayerWindow& w);
  const std::string& label() const override { return base_.label(); }
  const Manifest& manifest() const override { return base_.manifest(); }
  std::vector<std::string> names() const override { return names_; }
  bool has(const std::string& name) const override;
  Shape shape(const std::string& name) const override;
  TensorData get(const std::string& name) const override;
  // Read by the window's ops but not one of its names.
  bool is_input(const std::string& name) const { return !index_.count(name) && has(name); }

 private:
  bool readable(const std::string& name) const;
  const TensorSource& base_;
  LayerWindow window_;
  std::vector<std::string> names_;  // canonical order
  std::set<std::string> index_;
};

// A run over a shard (the reference's, the clean engine's) with the inputs
// it consumed without recording them, read from the shard's view of the
// candidate: what recomputing that run's sites from its own values needs.
class WithShardInputs : public TensorSource {
 public:
  WithShardInputs(const TensorSource& run, const WindowSource& inputs) : run_(run), inputs_(inputs) {}
  const std::string& label() const override { return run_.label(); }
  const Manifest& manifest() const override { return run_.manifest(); }
  std::vector<std::string> names() const override { return run_.names(); }
  bool has(const std::string& name) const override { return run_.has(name) || inputs_.is_input(name); }
  Shape shape(const std::string& name) const override {
    return run_.has(name) ? run_.shape(name) : inputs_.shape(name);
  }
  TensorData get(const std::string& name) const override {
    return run_.has(name) ? run_.get(name) : inputs_.get(name);
  }

 private:
  const TensorSource& run_;
  const WindowSource& inputs_;
};

}  // namespace llmdiff
