// The golden model as an Engine: the decoder graph of ref/graph.h run one
// forward call at a time with a DynamicCache (the graph keeps each layer's
// cache between calls), as LlamaForCausalLM.forward / Qwen2ForCausalLM /
// Qwen3ForCausalLM of transformers 4.51.3 run under generate().
#include "ref/ref_engine.h"
#include "dumps/base/threads.h"

#include <dlfcn.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "ref/graph.h"
#include "ref/ops.h"
#include "ref/weights.h"

namespace llmdiff::ref {

namespace {

class RefEngine : public Engine {
 public:
  RefEngine(const Model& model, ComputeDType dtype)
      : model_(model), cfg_(model_.config), dtype_(dtype) {
    if (!model_.weights) throw UsageError("the ref needs a model with weights");
    check_model(cfg_, *model_.weights);
    torch::NoGradGuard no_grad;
    const torch::ScalarType st = ops::torch_dtype(dtype_);
    // Every layer converted once, on its first call, and kept (weights whose
    // stored dtype is the compute dtype are used in place from the mmap).
    weights_ = std::make_unique<LayerByLayerWeights>(*model_.weights, st, /*budget=*/0);
    // LlamaRotaryEmbedding.__init__: inv_freq from the config, seq_len unset.
    rope_ = std::make_unique<RopeState>(cfg_, st == torch::kDouble ? torch::kDouble : torch::kFloat);
    reset();
  }

  // A fresh DynamicCache on the same model. The dynamic-NTK state of the
  // rotary module (dynamic_rope_update) belongs to the model, not to the
  // cache, so it persists, as in HF; a new engine is a freshly loaded model.
  void reset() override {
    graph_.reset();
    graph_ = std::make_unique<Graph>(cfg_, *weights_, GraphOptions{}, nullptr, rope_.get());
  }

  // A row of HF's left-padded batch: the graph masks the pads as keys and
  // gives them position 1 (GraphOptions::left_pad), until the next reset().
  void set_left_padding(int64_t pad) override {
    if (pad < 0) throw UsageError("left padding must be >= 0");
    if (graph_->steps() != 0) throw UsageError("left padding is set before a sequence's first call");
    GraphOptions o;
    o.left_pad = pad;
    graph_.reset();
    graph_ = std::make_unique<Graph>(cfg_, *weights_, o, nullptr, rope_.get());
  }

  // A verify call's rejected drafts: DynamicCache.crop (Graph::rollback).
  void rollback(int64_t positions) override { graph_->rollback(positions); }

  std::string producer() const override { return ref::producer(dtype_); }
  std::string dtype_name() const override { return compute_dtype_name(dtype_); }

  std::vector<float> forward(const std::vector<int64_t>& tokens, int step, Observer& obs) override {
    if (step != graph_->steps())
      throw UsageError("forward: step " + std::to_string(step) + " after " + std::to_string(graph_->steps()) +
                       " calls since the cache was emptied");
    try {
      return forward_impl(tokens, obs);
    } catch (const c10::Error& e) {
      throw Error(cfg_.source + ": step " + std::to_string(step) + ": libtorch: " + e.what_without_backtrace());
    }
  }

 private:
  std::vector<float> forward_impl(const std::vector<int64_t>& tokens, Observer& obs) {
    torch::NoGradGuard no_grad;
    graph_->add_step(tokens);
    const int s = graph_->steps() - 1;
    // What the observer records, next_logits (returned) and each layer's
    // KV cache (read by the next call; MLA's latent and k_pe caches too, so
    // that a later call can report them).
    std::vector<std::string> names;
    for (std::string& n : graph_->names(s, s + 1)) {
      const SiteName c = parse_site_name(n);
      const bool needed = c.id && (*c.id == Site::NextLogits || is_kv_cache(*c.id));
      if (needed || obs.wants(n)) names.push_back(std::move(n));
    }
    graph_->run(names, obs, nullptr, /*keep_caches=*/true);
    torch::Tensor next = graph_->value(step_name(s, Site::NextLogits)).to(torch::kFloat).contiguous();  // [V]
    graph_->keep_only_caches();
    return std::vector<float>(next.data_ptr<float>(), next.data_ptr<float>() + next.numel());
  }

  Model model_;  // keeps the weight maps alive
  const ModelConfig& cfg_;
  ComputeDType dtype_;
  std::unique_ptr<LayerByLayerWeights> weights_;
  std::unique_ptr<RopeState> rope_;
  std::unique_ptr<Graph> graph_;
};

}  // namespace

// libtorch's own parallel loops run on an OpenMP team whose idle workers spin,
// which on a few cores starves OpenBLAS's threads (sgemm/dgemm have their own
// pool, and lose the cores the spinning workers hold). float32/float64 work
// is nearly all BLAS calls: they get every thread and the elementwise ops
// one. bfloat16/float16 matmuls are libtorch's own loops: those keep
// libtorch's threads (and OpenBLAS sits idle).
void use_threads(int threads, ComputeDType dtype) {
  threads = resolve_threads(threads);
  using SetThreads = void (*)(int);
  static const auto openblas = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  const bool blas_bound = dtype == ComputeDType::Float32 || dtype == ComputeDType::Float64;
  if (openblas && blas_bound) {  // one thread too: a pass beside another calls BLAS from its own thread
    at::set_num_threads(1);
    openblas(threads);
  } else {
    at::set_num_threads(threads);
  }
}

std::unique_ptr<Engine> make_ref_engine(const Model& model, const RefOptions& opt) {
  if (opt.threads < 0) throw UsageError("--threads must be >= 0, got " + std::to_string(opt.threads));
  use_threads(opt.threads, opt.dtype);
  try {
    return std::make_unique<RefEngine>(model, opt.dtype);
  } catch (const c10::Error& e) {
    throw Error(model.config.source + ": libtorch: " + e.what_without_backtrace());
  }
}

}  // namespace llmdiff::ref
