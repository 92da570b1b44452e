// The HF decoder graph, described once and executed every way llmdiff needs.
//
// Graph names each canonical site of the llm-dump/1 format (step sites,
// `layers.N.*`, `generated`) and says from which sites and by which op of
// ref/ops.h it is computed: the description of LlamaForCausalLM /
// Qwen2ForCausalLM / Qwen3ForCausalLM of transformers 4.51.3 (eager
// attention, DynamicCache). One executor evaluates it on demand, memoised:
//
//  - free-running forward (Inputs::Tokens): every site from the step tokens
//    alone, at float32 / bfloat16 / float16 / float64. The ref engine is this
//    graph run one forward call at a time (it needs each call's logits to
//    pick the next token); a scenario whose tokens are all known (a replay)
//    runs layer-major: each layer's weights converted once, every forward
//    call of the scenario through that layer, then dropped;
//  - teacher-forced recompute (Inputs::Dump): a site that a dump holds is
//    read from it, the others recomputed, so each op is judged on the
//    candidate's own inputs (local errors);
//  - hypothesis variants: a bug of the zoo (dumps/zoo/bugs.h) changes the config
//    (applied before the graph is built) or swaps an op (zoo::Faults).
//
// Numbers are those of HF's eager path: each op is the same libtorch call
// sequence on the same layouts (ref/ops.h). With `batch_steps` the
// projections of all forward calls are one matrix product (rows stacked):
// fewer passes over the weights, equal up to the dtype's rounding; off, each
// call has its own product as in HF, bit for bit.
#pragma once
#include <torch/torch.h>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dumps/zoo/bugs.h"
#include "dumps/model/config.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/layer_window.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sites.h"
#include "dumps/model/weights.h"
#include "ref/ops.h"
#include "ref/weights.h"

namespace llmdiff::ref {

// Throws ConfigError for a config the graph cannot run, or whose shapes are
// not those the checkpoint's weights were loaded for (or that lacks weights
// the config asks for: biases, q/k norms).
void check_model(const ModelConfig& cfg, const ModelWeights& weights);

// The rotary module's state (LlamaRotaryEmbedding with dynamic_rope_update):
// the inverse frequencies in use and the longest sequence seen. It belongs
// to the model, not to the cache: for rope type "dynamic" the frequencies
// grow with a call's sequence length past max_position_embeddings, are kept
// for shorter calls, and return to the original ones for a call shorter than
// max_position_embeddings. Other types never change.
class RopeState {
 public:
  RopeState(const ModelConfig& cfg, torch::ScalarType dtype);  // float32 (HF) or float64 (truth)
  // dynamic_rope_update for a call whose largest position is seq_len-1; the
  // frequencies that call uses.
  const ops::RopeInit& update(int64_t seq_len);

 private:
  const ModelConfig& cfg_;
  torch::ScalarType dtype_;
  ops::RopeInit original_, current_;
  int64_t max_seq_len_cached_ = 0;
};

// A name parsed once: CanonName's kind, step, layer and site text, and the
// site of the table (dumps/contract/sites.h) it names. `id` is nullopt for
// rope.inv_freq, `generated`, and a name whose site is not in the table or
// not of its scope (a layer site named at step level, or the reverse).
struct SiteName : CanonName {
  std::optional<Site> id;
};
SiteName parse_site_name(const std::string& name);

enum class Inputs {
  Tokens,  // free-running: every site from the step tokens
  Dump,    // teacher-forced: sites the dump holds are read from it
};

struct GraphOptions {
  Inputs inputs = Inputs::Tokens;
  zoo::Faults faults;        // op substitutions of a bug hypothesis (all false: HF)
  bool batch_steps = false;  // one product per projection over all calls (see the file comment)
  // A left-padded row of HF's batched generate: the first `left_pad` tokens
  // of step 0 are padding, masked as keys for every query
  // (_prepare_4d_causal_attention_mask_with_cache_position with an
  // attention_mask), at position 1, the real tokens at 0, 1, ...
  // (attention_mask.cumsum(-1) - 1, pads set to 1). The caller strips the
  // pad rows and key columns from what it reports (dumps/contract/padding.h).
  int64_t left_pad = 0;
  // A shard of the layers (Inputs::Tokens, dumps/contract/layer_window.h): the
  // residual stream entering window.first is read from window.boundary, the
  // layers below it are never computed.
  LayerWindow window;
};

class Graph {
 public:
  // `cfg` with any config-level substitution already applied; `w` at the
  // compute dtype. Inputs::Dump reads the forward calls (step tokens,
  // `generated`) and the teacher-forced inputs from `dump`, which must
  // outlive the graph. `rope` (optional) carries the rotary state across
  // graphs of one model, as the ref engine needs; else the graph has its own.
  Graph(ModelConfig cfg, LayerByLayerWeights& w, const GraphOptions& opt, const TensorSource* dump = nullptr,
        RopeState* rope = nullptr);
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // Appends a forward call (Inputs::Tokens): step steps() at the positions
  // after the calls before it. Throws UsageError for an empty call or a token
  // outside the vocabulary.
  void add_step(const std::vector<int64_t>& tokens);
  int steps() const { return int(tokens_.size()); }
  // Drops the last `positions` positions of the cache after the last call
  // (a speculative verify call's rejected drafts, DynamicCache.crop): the
  // next call continues after the ones kept. Throws UsageError for more than
  // the cache holds.
  void rollback(int64_t positions);
  // Step `step` is a speculative verify call (its tokens the last accepted
  // one and the drafts): it has the site spec.accepted, the drafts the
  // argmax of its logits rows agrees with.
  void mark_verify(int step);
  // Free-running: the `generated` site holds the argmax of next_logits of
  // every step from `first_step` on.
  void set_generated(int first_step);

  // Every canonical name of steps [first, last) in canonical order (with
  // rope.inv_freq when first is 0, and `generated` when set and last is the
  // end), whether or not the model has the site.
  std::vector<std::string> names(int first, int last) const;

  // Computes `names` (those it can) layer by layer, each layer for every step
  // (a layer reads the layer before and its own earlier steps), site by site
  // within a layer, and reports
  // each that `out` wants; `source`, when given, says what each was computed
  // from. The values of layers two below the one being computed are dropped
  // as it goes, but the KV caches of the last step when `keep_caches`.
  void run(const std::vector<std::string>& names, Observer& out, std::map<std::string, std::string>* source = nullptr,
           bool keep_caches = false);
  // A value computed by run() and still held (undefined otherwise).
  torch::Tensor value(const std::string& name) const;
  // Drops every value but the KV caches of the last step (between calls of
  // a step-by-step forward).
  void keep_only_caches();

 private:
  struct Value {
    torch::Tensor t;                  // undefined: cannot be computed
    std::vector<std::string> direct;  // the op's inputs: "name" (read) or "name*" (computed)
    std::set<std::string> frontier;   // inputs read, transitively
  };
  static std::string describe(const Value& v);
  static std::string short_name(const std::string& name);
  torch::Tensor input(const std::string& name, Value& reads);
  torch::Tensor read(const TensorSource& from, const CanonName& c, const std::string& name, Value& reads);
  const Value* compute(const std::string& name);

  // The site table: which op computes each site from which sites. A stage
  // that does not compute the site asked for answers nullopt.
  struct LayerOp;  // a layer site being computed (graph.cpp)
  Value compute_uncached(const SiteName& c);
  Value step_site(int s, Site site);                 // LlamaModel around the layers, the head
  std::optional<Value> mla_attention(LayerOp& op);   // DeepseekV3Attention
  std::optional<Value> moe_block(LayerOp& op);       // the MoE block of a MoE layer
  Value decoder_layer(LayerOp& op);                  // LlamaDecoderLayer: attention and MLP
  void forget_layers_before(int layer, bool keep_caches);

  int64_t T(int s) const { return int64_t(tokens_[size_t(s)].size()); }
  int64_t P(int s) const { return past_[size_t(s)]; }
  torch::Tensor positions(int s) const;
  std::pair<torch::Tensor, torch::Tensor> rope_table(int s);
  torch::Tensor additive_mask(int s) const;
  bool greedy_step(int s) const;
  template <class NameAt, class Project>
  Value batched_linear(int s, NameAt name_at, Site in, Site out, Project project);

  ModelConfig cfg_;
  LayerByLayerWeights& w_;
  GraphOptions opt_;
  const TensorSource* dump_;
  torch::ScalarType st_, rope_dtype_;
  std::unique_ptr<RopeState> own_rope_;
  RopeState* rope_;
  std::vector<std::vector<int64_t>> tokens_;
  std::vector<int64_t> past_;
  std::vector<int64_t> rollback_;  // positions dropped after each call
  std::set<int> verify_;           // speculative verify calls
  // Inputs::Dump: a prefix-cache hit's length (step 0 starts there; its
  // positions are the dump's own cache rows).
  int64_t prefix_ = 0;
  std::vector<ops::RopeInit> step_rope_;  // the frequencies each call uses
  int first_generating_ = -1;             // -1: no `generated`
  bool sampled_ = false;                  // the dump's tokens were drawn (manifest sampling), not argmaxes
  std::map<std::string, Value> memo_;
  std::set<std::string> in_progress_;
  std::map<std::string, torch::Tensor> dump_cache_;
  std::map<int, std::pair<torch::Tensor, torch::Tensor>> tables_;
};

// The ref's producer text for a manifest.
std::string producer(ComputeDType dtype);

}  // namespace llmdiff::ref
