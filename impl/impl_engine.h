// The independent implementation's single-sequence engine: one sequence on a
// contiguous KV cache (or a ring of it) through the one forward of
// impl/forward.h. Plain C++ (no libtorch, no BLAS), weights read in their
// stored dtype from the mmap, f32 activations, threaded kernels.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "dumps/contract/engine.h"
#include "dumps/contract/precision.h"
#include "dumps/model/weights.h"
#include "dumps/zoo/bugs.h"
#include "impl/forward.h"

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
  MlaForm mla = MlaForm::Naive;  // MLA models only
  // Roundings made on purpose (a lower-precision KV cache, rounded or 8-bit
  // matmul inputs), as a candidate's manifest declares them; empty: none.
  PrecisionProfile precision;
  // A ring-buffer KV cache of this many positions (Loom's pos % MaxSeqLen),
  // 0: contiguous. Once a call's S exceeds it, attention reads only the last
  // kv_ring positions (the older ones were overwritten), and the cache sites
  // hold the ring's slots: [Hkv, min(S, kv_ring), Dh], slot j the position
  // p = j mod kv_ring. GQA attention only.
  int64_t kv_ring = 0;
  // Tensor parallelism over this many ranks in one process
  // (impl/tensor_parallel.h): each rank's shards reported under rank{r}.,
  // the replicated names unprefixed (write them through RankZeroNames of
  // dumps/contract/ranks.h); 1: none.
  int tensor_parallel = 1;
};

// Throws UsageError when a bug cannot apply to the model, or is a batch bug
// (those act only where several sequences share a call: batch_engine.h).
std::unique_ptr<Engine> make_impl_engine(const Model& model, const ImplOptions& opt);

}  // namespace llmdiff::impl
