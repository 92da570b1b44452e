// The golden model: a libtorch re-statement of HuggingFace transformers
// 4.51.3's eager Llama / Qwen2 / Qwen3 forward, op for op.
#pragma once
#include <memory>

#include "dumps/model/config.h"
#include "dumps/contract/engine.h"
#include "dumps/model/weights.h"

namespace llmdiff::ref {

struct RefOptions {
  ComputeDType dtype = ComputeDType::Float32;  // callers default it to the checkpoint's torch_dtype
  int threads = 0;                             // 0: all cores
};

// libtorch's (process-wide) threads for work in `dtype` on `threads` cores
// (0: all): float32/float64 give every thread to OpenBLAS and one to
// libtorch's own loops (whose idle OpenMP workers would spin against BLAS);
// 16-bit dtypes, whose matmuls are libtorch's loops, give them all to libtorch.
void use_threads(int threads, ComputeDType dtype);

// Throws UsageError / ConfigError for a config or dtype the ref cannot run.
// Sets the threads with use_threads(opt.threads, opt.dtype). The engine runs
// the decoder graph of ref/graph.h one forward call at a time; each layer's
// weights are converted to the compute dtype on its first call and kept
// (used in place from the mmap when stored in that dtype). It stands for one
// loaded HF model: reset() starts a fresh DynamicCache, while model state
// (dynamic-NTK RoPE growth) persists as it does in HF.
std::unique_ptr<Engine> make_ref_engine(const Model& model, const RefOptions& opt);

}  // namespace llmdiff::ref
