// The independent implementation: plain C++ (no libtorch, no BLAS), weights
// read in their stored dtype from the mmap, f32 activations, threaded kernels.
#pragma once
#include <memory>
#include <vector>

#include "dumps/config.h"
#include "dumps/engine.h"
#include "dumps/weights.h"
#include "dumps/bugs.h"

namespace llmdiff::impl {

struct ImplOptions {
  int threads = 0;            // 0: all cores
  int64_t max_seq = 0;        // KV capacity; 0: config.max_position_embeddings
  std::vector<zoo::BugSpec> bugs;  // the bug zoo; empty = correct model
  // Hand each layer's mapped weight pages back to the kernel once the layer
  // is done (ModelWeights::release_layer): resident memory stays at about
  // one layer of the checkpoint instead of all of it, for a few page faults
  // per call (the pages come back from the page cache).
  bool release_weights = false;
};

// Throws UsageError when a bug cannot apply to the model.
std::unique_ptr<Engine> make_impl_engine(const Model& model, const ImplOptions& opt);

}  // namespace llmdiff::impl
