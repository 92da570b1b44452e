#include "bisect/pipeline.h"
#include "dumps/contract/rows.h"
#include "bisect/batch_replay.h"
#include "bisect/ggml_rounding.h"
#include "compare/sampling_check.h"
#include "dumps/contract/padding.h"
#include "dumps/contract/consistency.h"
#include "dumps/base/memory.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>

#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sequences.h"
#include "dumps/contract/sites.h"
#include "dumps/base/threads.h"
#include "dumps/zoo/bugs.h"
#include "impl/impl_engine.h"
#include "ref/ops.h"
#include "ref/graph.h"
#include "ref/ref_engine.h"
#include "ref/weights.h"

namespace llmdiff::bisect {

namespace ops = ref::ops;

namespace {

// Thrown by a SelectiveDump that may end the run early, once it holds every
// wanted name: the rest of the scenario is not needed.
struct AllRecorded {};

// A MemoryDump that records the wanted names: exact names by a set lookup
// (a bisection asks for every name of the candidate), patterns by glob.
// With `stop_when_complete`, a list of exact names ends the run (AllRecorded)
// as soon as the last of them is recorded: a hypothesis judged at one site
// of step 0 costs part of one forward call, not the scenario.
class SelectiveDump : public MemoryDump {
 public:
  SelectiveDump(std::string label, const std::vector<std::string>& wanted, bool stop_when_complete = false)
      : MemoryDump(std::move(label)) {
    all_ = wanted.empty();
    for (const auto& w : wanted) {
      if (w.find_first_of("*?") == std::string::npos)
        exact_.insert(w);
      else
        globs_.push_back(w);
    }
    stop_ = stop_when_complete && !all_ && globs_.empty();
    pending_ = exact_;
    // Bookkeeping a candidate may carry and no engine records (its row list).
    for (auto it = pending_.begin(); it != pending_.end();)
      it = parse_name(*it).site == site_name(Site::Rows) ? pending_.erase(it) : std::next(it);
  }
  bool wants(const std::string& name) const override {
    return all_ || exact_.count(name) || any_glob_match(globs_, name);
  }
  void on_f32(const std::string& name, const Shape& shape, const float* data) override {
    MemoryDump::on_f32(name, shape, data);
    recorded(name);
  }
  void on_i64(const std::string& name, const Shape& shape, const int64_t* data) override {
    MemoryDump::on_i64(name, shape, data);
    recorded(name);
  }

 private:
  void recorded(const std::string& name) {
    if (stop_ && pending_.erase(name) && pending_.empty()) throw AllRecorded{};
  }
  bool all_ = true, stop_ = false;
  std::set<std::string> exact_, pending_;
  std::vector<std::string> globs_;
};

// Converted weights a layer-major pass holds at once, in bytes: one layer,
// but no more than 2 GiB (and never less than the largest matrix). A 1.1B
// layer is 0.4 GB in float64, an 8B one 1.75 GB; a 70B layer (6.9 GB) is
// held a matrix or two at a time (its largest is 1.9 GB).
int64_t weight_budget(const ModelWeights& w, ComputeDType dtype) {
  if (w.layers.empty()) return 0;
  const int64_t esize = int64_t(c10::elementSize(ops::torch_dtype(dtype)));
  int64_t layer = 0, largest = 0;
  for (const LayerWeights& L : w.layers) {  // layers differ: dense and MoE
    int64_t bytes = 0;
    for (const WeightView* v : L.views()) {
      bytes += v->numel() * esize;
      largest = std::max(largest, v->numel() * esize);
    }
    layer = std::max(layer, bytes);
  }
  return std::max(largest, std::min(layer, int64_t(2) << 30));
}

}  // namespace

// ---------------------------------------------------------------------------
// RefRunner

RefRunner::RefRunner(const Model& model, std::string model_dir, int threads)
    : model_(model), dir_(std::move(model_dir)), threads_(threads) {}
RefRunner::~RefRunner() = default;

std::optional<ComputeDType> RefRunner::weights_dtype() const {
  switch (model_.weights->storage_dtype()) {
    case DType::BF16: return ComputeDType::BFloat16;
    case DType::F16: return ComputeDType::Float16;
    default: return std::nullopt;
  }
}

std::unique_ptr<MemoryDump> RefRunner::run(const Scenario& sc, ComputeDType dtype,
                                           const std::vector<std::string>& wanted) const {
  auto dump = std::make_unique<SelectiveDump>(std::string("ref ") + compute_dtype_name(dtype), wanted);
  dump->spill();  // a whole run's activations: in the page cache, not in the process
  dump->mutable_manifest() = make_manifest(ref::producer(dtype), compute_dtype_name(dtype), model_, dir_, sc);
  ref::use_threads(threads_, dtype);
  if (sc.decode > 0) {
    if (!sc.layers.whole()) throw UsageError("ref: a shard of the layers replays a dump's calls, it does not decode");
    // Greedy decoding needs each call's logits before the next call: the
    // engine, call by call.
    ref::RefOptions o;
    o.dtype = dtype;
    o.threads = threads_;
    std::unique_ptr<Engine> engine = ref::make_ref_engine(model_, o);
    run_scenario(*engine, sc, *dump);
    return dump;
  }
  // Every call's tokens are known: layer-major, each layer's weights
  // converted once (within weight_budget) for every forward call, and the
  // projections of all calls one matrix product. HF runs each decode call's
  // products alone, each streaming the whole weight: stacked, they are the
  // same products up to the dtype's rounding (the ref engine is HF's numbers
  // bit for bit; this run is a reference at the candidate's dtype, judged by
  // its own distance to the float64 truth).
  ref::check_model(model_.config, *model_.weights);
  ref::LayerByLayerWeights w(*model_.weights, ops::torch_dtype(dtype), weight_budget(*model_.weights, dtype));
  ref::GraphOptions go;
  go.batch_steps = true;
  go.left_pad = sc.left_pad;  // a row of a left-padded batch: its pads run in front of step 0
  go.window = sc.layers;      // a shard: its layers only, from the boundary's residual stream
  if (!sc.layers.whole() && sc.left_pad > 0) throw UsageError("ref: a shard of the layers of a left-padded row");
  ref::Graph graph(model_.config, w, go);
  // A prefix-cache hit: the graph's step 0 runs the hit's tokens, reported by
  // no name; the graph's step k + 1 is the scenario's step k.
  const int shift = sc.cached_prefix.empty() ? 0 : 1;
  if (shift && (sc.left_pad > 0 || !sc.layers.whole()))
    throw UsageError("ref: a prefix-cache hit in a row of a left-padded batch or a shard of the layers");
  if (shift) graph.add_step(sc.cached_prefix);
  for (int s = 0; s < int(sc.steps.size()); ++s) {
    graph.add_step(fed_tokens(sc, s));
    const auto r = sc.rollback.find(s);
    if (r == sc.rollback.end()) continue;
    graph.mark_verify(s + shift);
    if (r->second > 0) graph.rollback(r->second);
  }
  if (sc.emit_generated) graph.set_generated(sc.first_generating_step + shift);
  // The float64 truth judges computed values: not the inputs (tokens) nor
  // the greedy picks (generated), which the candidate's dtype decides.
  const bool truth = dtype == ComputeDType::Float64;
  LeftPadStripper stripped(*dump, sc.left_pad);  // reports the sequence's own rows and keys
  StepShift out(stripped, shift);
  std::vector<std::string> names;
  for (auto& n : graph.names(0, graph.steps())) {
    const CanonName c = parse_name(n);
    if (truth && (c.kind == CanonName::Kind::Generated || (c.kind == CanonName::Kind::Step && c.site == site_name(Site::Tokens))))
      continue;
    if (out.wants(n)) names.push_back(std::move(n));
  }
  try {
    graph.run(names, out);
  } catch (const c10::Error& e) {
    throw Error(model_.config.source + ": libtorch: " + e.what_without_backtrace());
  }
  return dump;
}

int RefRunner::threads() const { return resolve_threads(threads_); }

// Two passes beside each other hold two layers' converted weights and read
// two parts of the checkpoint at once: worth it for layers of at most 1 GiB
// in float64, where they run faster; beyond, the two layers cost memory and
// no time (docs/PERFORMANCE.md has the figures).
std::unique_ptr<ReferenceRunner> RefRunner::with_threads(int threads) const {
  if (weight_budget(*model_.weights, ComputeDType::Float64) > (int64_t(1) << 30)) return nullptr;
  return std::make_unique<RefRunner>(model_, dir_, threads);
}

std::string RefRunner::describe() const {
  return "llmdiff ref (libtorch, HF transformers 4.51.3 eager numerics) on " + dir_;
}

// ---------------------------------------------------------------------------
// ImplHypothesisRunner

ImplHypothesisRunner::ImplHypothesisRunner(const Model& model, int threads, PrecisionProfile precision)
    : model_(model), threads_(threads), precision_(precision) {}

// Every bug of the zoo that applies to the model; a parameterised bug once
// per value of its grid.
std::vector<compare::Hypothesis> ImplHypothesisRunner::hypotheses() const {
  std::vector<compare::Hypothesis> out;
  const ModelConfig& cfg = model_.config;
  for (const auto& info : zoo::all_bugs()) {
    if (!info.acts_on_model() || !zoo::bug_inapplicable_reason(info.bug, cfg).empty()) continue;
    if (info.takes_value()) {
      for (double v : info.grid(cfg)) out.push_back({info.name, v});
    } else {
      out.push_back({info.name, std::nullopt});
    }
  }
  return out;
}

bool ImplHypothesisRunner::acts_in(const std::string& bug, const Scenario& sc) const {
  const zoo::BugInfo* info = zoo::find_bug(bug);
  return !info || !info->needs_padding || sc.left_pad > 0;
}

// A bug acting only on calls with cached positions starts at call 1 when
// the candidate recorded every layer's caches of call 0 at the length the
// scenario says (contiguous, as ImplEngine::resume reads them).
int ImplHypothesisRunner::replay_start(const compare::Hypothesis& h, const Scenario& sc,
                                       const TensorSource& cand) const {
  const zoo::BugInfo* info = zoo::find_bug(h.bug);
  if (!info || !info->needs_cached_positions || sc.steps.size() < 2 || sc.left_pad > 0 ||
      !sc.cached_prefix.empty() || !sc.layers.whole() || !sc.rollback.empty() || sc.sampling)
    return 0;
  const int start = 1;
  const ModelConfig& c = model_.config;
  const int64_t S = int64_t(sc.steps[0].size());
  std::vector<Site> sites{Site::AttnKCache, Site::AttnVCache};
  if (c.mla.enabled) {
    sites.push_back(Site::AttnLatentCache);
    sites.push_back(Site::AttnKPeCache);
  }
  for (int layer = 0; layer < int(c.num_hidden_layers); ++layer)
    for (Site site : sites) {
      const std::string name = layer_name(start - 1, layer, site);
      if (!cand.has(name)) return 0;
      const Shape shape = cand.shape(name);
      const int key_axis = site_info(site).key_axis;
      if (int(shape.size()) <= key_axis || shape[size_t(key_axis)] != S) return 0;
    }
  return start;
}

std::vector<std::pair<std::string, std::string>> ImplHypothesisRunner::inapplicable() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& info : zoo::all_bugs()) {
    if (!info.acts_on_model()) continue;
    std::string why = zoo::bug_inapplicable_reason(info.bug, model_.config);
    if (!why.empty()) out.emplace_back(info.name, why);
  }
  return out;
}

std::unique_ptr<MemoryDump> ImplHypothesisRunner::run(const compare::Hypothesis& h, const Scenario& sc,
                                                      const std::vector<std::string>& wanted) const {
  impl::ImplOptions o;
  o.threads = threads_;
  o.release_weights = weight_policy(model_, memory_budget_).stream;  // as `dump` holds the checkpoint
  o.precision = precision_;
  if (!h.bug.empty()) {
    zoo::BugSpec spec = zoo::parse_bug(h.bug);
    spec.value = h.value;
    o.bugs.push_back(spec);
  }
  // Room for every forward call of the scenario, whatever the config says.
  int64_t total = 0;
  for (const auto& s : sc.steps) total += int64_t(s.size());
  o.max_seq = std::max<int64_t>(total + sc.left_pad + sc.decode, model_.config.max_position_embeddings);
  auto engine = impl::make_impl_engine(model_, o);
  auto dump = std::make_unique<SelectiveDump>(h.bug.empty() ? "impl" : "impl with " + h.str(), wanted, true);
  dump->spill();  // the clean run and full replays hold every name of the candidate
  try {
    run_scenario(*engine, sc, *dump);
  } catch (const AllRecorded&) {
    // Every wanted name is there: the rest of the scenario is skipped, and
    // the pages of the layer it stopped in are handed back as the forward
    // call would have.
    if (o.release_weights) model_.weights->release_all();
  }
  return dump;
}

std::unique_ptr<compare::HypothesisRunner> ImplHypothesisRunner::with_threads(int threads) const {
  auto copy = std::make_unique<ImplHypothesisRunner>(model_, threads, precision_);
  copy->set_memory_budget(memory_budget_);
  return copy;
}

std::optional<double> ImplHypothesisRunner::configured(const std::string& bug) const {
  const zoo::BugInfo* info = zoo::find_bug(bug);
  if (!info || !info->takes_value()) return std::nullopt;
  return info->configured(model_.config);
}

std::string ImplHypothesisRunner::parameter(const std::string& bug) const {
  const zoo::BugInfo* info = zoo::find_bug(bug);
  return info && info->parameter ? info->parameter : "";
}

std::string ImplHypothesisRunner::description(const std::string& bug) const {
  const zoo::BugInfo* info = zoo::find_bug(bug);
  return info ? info->description : "";
}

// ---------------------------------------------------------------------------
// RefLocalOracle

namespace {

// How a bug hypothesis changes the reference graph, as the zoo defines it:
// config-level changes go to `cfg`, the rest to the Faults (all false: the
// reference). Throws UsageError for an unknown or inapplicable bug.
zoo::Faults variant_of(const compare::Hypothesis& h, ModelConfig& cfg) {
  zoo::BugSpec spec = zoo::parse_bug(h.bug);
  spec.value = h.value;
  zoo::check_bugs({spec}, cfg);
  return zoo::apply_bugs({spec}, cfg);
}

}  // namespace

RefLocalOracle::RefLocalOracle(const Model& model, int threads) : model_(model), threads_(threads) {}
RefLocalOracle::~RefLocalOracle() = default;

// The dump's sites recomputed through the reference graph, teacher-forced:
// layer by layer, two layers' weights converted at a time, the projections of
// all forward calls in one product.
std::unique_ptr<compare::Recomputed> RefLocalOracle::recompute(const TensorSource& dump, ComputeDType dtype,
                                                               const compare::Hypothesis* h,
                                                               const std::vector<std::string>* only) const {
  auto out = std::make_unique<compare::Recomputed>();
  out->values.spill();
  ModelConfig cfg = model_.config;
  ref::GraphOptions go;
  go.inputs = ref::Inputs::Dump;
  go.batch_steps = true;
  if (h) go.faults = variant_of(*h, cfg);
  ref::use_threads(threads_, dtype);
  ref::LayerByLayerWeights w(*model_.weights, ops::torch_dtype(dtype), weight_budget(*model_.weights, dtype));
  ref::Graph graph(cfg, w, go, &dump);
  try {
    graph.run(only ? *only : dump.names(), out->values, &out->source);
  } catch (const c10::Error& e) {
    throw Error(model_.config.source + ": libtorch: " + e.what_without_backtrace());
  }
  return out;
}

// The graph's layers differ only in their feed-forward block (ref/graph.cpp):
// dense or mixture of experts.
std::vector<int> RefLocalOracle::layer_kinds() const {
  std::vector<int> kinds;
  for (int64_t l = 0; l < model_.config.num_hidden_layers; ++l)
    kinds.push_back(model_.config.moe.is_moe_layer(l) ? 1 : 0);
  return kinds;
}

std::unique_ptr<compare::LocalOracle> RefLocalOracle::with_threads(int threads) const {
  return std::make_unique<RefLocalOracle>(model_, threads);
}

bool RefLocalOracle::supports(const compare::Hypothesis& h) const {
  try {
    ModelConfig cfg = model_.config;
    variant_of(h, cfg);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// ---------------------------------------------------------------------------
// The pipeline

ModelOracles::ModelOracles(const std::string& model_dir, int threads)
    : dir(model_dir),
      threads(threads),
      model(Model::load(model_dir)),
      reference(model, model_dir, threads),
      oracle(model, threads),
      hypotheses(model, threads) {}

namespace {

// A candidate that samples: its sampler against HF's processors applied to
// its own next_logits (a model bug is not a sampler bug), every sequence.
std::optional<compare::SamplingCheck> sampling_check(const TensorSource& cand, const BisectOptions& opt) {
  for (const std::string& n : cand.names())
    if (n.find(".sample.") != std::string::npos) {
      compare::SamplingCheck c = compare::check_sampling(cand);
      if (opt.progress) opt.progress("sampling check");
      return c;
    }
  return std::nullopt;
}

}  // namespace

compare::BisectResult bisect_candidate(const ModelOracles& m, const TensorSource& cand, BisectOptions opt,
                                       const compare::Gather& more) {
  // Between phases, the heap's free memory goes back to the system: each
  // phase frees a model's worth of activations in pieces under the mmap
  // threshold (cli/main.cpp), which glibc would otherwise keep.
  check_dump_against_model(cand, m.model.config);  // another model, tokens outside the vocabulary, ...
  opt.progress = [report = std::move(opt.progress)](const std::string& what) {
    release_free_heap();
    if (report) report(what);
  };
  // The candidate's declared roundings: the clean run and the hypothesis
  // runs make them too; undeclared, a quantised model's are probed.
  const PrecisionProfile precision = PrecisionProfile::from_manifest(cand.manifest().extra, cand.label());
  std::optional<ImplHypothesisRunner> with_precision;
  if (!precision.empty()) with_precision.emplace(m.model, m.threads, precision);
  const ImplHypothesisRunner& hypotheses = with_precision ? *with_precision : m.hypotheses;
  auto probe = [&](compare::Need need, compare::BisectResult& r) {
    if (need != compare::Need::Rounding || !precision.empty()) return false;
    r.evidence.rounding = probe_ggml_rounding(m, cand, r);
    return true;
  };
  const compare::Gather gather = [&](compare::Need need, compare::BisectResult& r) {
    return probe(need, r) || (more && more(need, r));
  };
  // Per-token tensors pruned to a step's last rows without the step's row
  // list (llama.cpp's output pruning) are compared as that row subset.
  const InferredRowsView pruned(cand);
  compare::BisectResult r = bisect(pruned.inferred() ? static_cast<const TensorSource&>(pruned) : cand, m.reference,
                                   &m.oracle, &hypotheses, opt, gather);
  for (const std::string& note : pruned.notes()) r.notes.push_back(note);
  if (!precision.empty()) r.notes.push_back("precision profile declared by the candidate: " + precision.str() +
                                            " (the clean run makes the same roundings)");
  if (r.model.empty()) r.model = dir_name(m.dir);
  // The sampler's names belong to the shard ending at the last layer.
  if (opt.check_sampling && opt.layers.finishes()) r.sampling = sampling_check(cand, opt);
  if (!opt.source.empty()) {
    r.quantisation = quantisation_report(m, opt.source, cand);
    opt.progress("quantisation error against --source");
  }
  return r;
}

compare::BatchBisect bisect_batch(const ModelOracles& m, const TensorSource& cand, BisectOptions opt) {
  validate_iterations(cand);
  // The noise floor's second run: the clean engine running the same batch,
  // else (below) the clean impl running each sequence alone.
  std::string no_batch_clean;
  const std::shared_ptr<const TensorSource> clean =
      opt.noise_floor || opt.diagnose ? clean_batch_replay(m, cand, &no_batch_clean) : nullptr;
  if (clean && opt.progress) opt.progress("clean replay of the batch");
  return bisect_batch(m, cand, opt, clean, no_batch_clean, {});
}

compare::BatchBisect bisect_batch(const ModelOracles& m, const TensorSource& cand, BisectOptions opt,
                                  std::shared_ptr<const TensorSource> clean, const std::string& no_batch_clean,
                                  const std::function<compare::Gather(int seq)>& more) {
  validate_iterations(cand);
  std::vector<compare::SequenceBisect> results;
  for (int b : dump_sequences(cand)) {
    const SequenceView view(cand, b);
    BisectOptions o = opt;
    o.check_sampling = false;  // every sequence's at once, below
    if (opt.progress)
      o.progress = [&opt, b](const std::string& what) { opt.progress("seq" + std::to_string(b) + ": " + what); };
    if (clean) o.clean = std::shared_ptr<const TensorSource>(new SequenceView(*clean, b), [clean](const TensorSource* v) {
      delete v;  // the view keeps the clean batch alive through this deleter's copy of it
    });
    compare::SequenceBisect s;
    s.seq = b;
    s.result = bisect_candidate(m, view, o, more ? more(b) : compare::Gather{});
    if (!clean && !no_batch_clean.empty())
      s.result.notes.push_back("noise floor's second run: the clean impl running the sequence alone (" +
                               no_batch_clean + ")");
    results.push_back(std::move(s));
  }
  if (results.empty())
    throw UsageError(cand.label() + ": no seq{b}. names: a single-sequence dump (bisect it as it is)");
  compare::BatchBisect b = compare::summarise_batch(cand, std::move(results));
  if (b.first && opt.diagnose) {
    compare::SequenceBisect& first = b.sequences[*b.first];
    compare::explain(first.result, [&](compare::Need need, compare::BisectResult& r) {
      if (need != compare::Need::BatchReplay) return false;
      r.evidence.batch_replay = batch_replay_evidence(m, cand, first);
      return true;
    });
  }
  if (opt.check_sampling) b.sampling = sampling_check(cand, opt);
  return b;
}

std::unique_ptr<MemoryDump> run_impl_candidate(const ModelOracles& m, const Scenario& sc, const EngineOptions& eo,
                                               const std::vector<std::string>& record) {
  std::string label = "impl";
  for (size_t k = 0; k < eo.inject.size(); ++k) label += (k == 0 ? " --inject " : ",") + eo.inject[k];
  auto cand = std::make_unique<MemoryDump>(label);
  cand->spill();
  EngineOptions o = eo;
  o.release_weights = weight_policy(m.model, m.memory_budget).stream;  // as `dump` holds the checkpoint
  auto engine = make_engine("impl", m.model, o);
  cand->mutable_manifest() = make_manifest(*engine, m.model, m.dir, sc);
  cand->set_filter(record);
  run_scenario(*engine, sc, *cand);
  return cand;
}

compare::BisectResult bisect_impl_candidate(const ModelOracles& m, const MemoryDump& cand, bool bugs_injected,
                                            BisectOptions opt) {
  if (!bugs_injected) opt.clean = std::shared_ptr<const TensorSource>(&cand, [](const TensorSource*) {});
  return bisect_candidate(m, cand, opt);
}

compare::QuantErrorReport quantisation_report(const ModelOracles& m, const std::string& source,
                                              const TensorSource& cand) {
  const Model src = Model::load(source);
  const ModelConfig &a = src.config, &b = m.model.config;
  auto same = [&](const char* what, int64_t x, int64_t y) {
    if (x != y)
      throw UsageError("--source " + source + " is not the same model as " + m.dir + ": " + what + " " +
                       std::to_string(x) + " vs " + std::to_string(y));
  };
  same("num_hidden_layers", a.num_hidden_layers, b.num_hidden_layers);
  same("hidden_size", a.hidden_size, b.hidden_size);
  same("intermediate_size", a.intermediate_size, b.intermediate_size);
  same("num_attention_heads", a.num_attention_heads, b.num_attention_heads);
  same("num_key_value_heads", a.num_key_value_heads, b.num_key_value_heads);
  same("vocab_size", a.vocab_size, b.vocab_size);
  const Scenario sc = replay_scenario(cand);
  const std::vector<std::string> wanted = {
      "step*.layers.*." + std::string(site_name(Site::Out)), "step*." + std::string(site_name(Site::NextLogits)),
      "step*.layers.*." + std::string(site_name(Site::MoeTopkIds)),
      "step*.layers.*." + std::string(site_name(Site::MoeExpertOut)),
      "step*.layers.*." + std::string(site_name(Site::MoeRouterProbs))};
  RefRunner source_ref(src, source, m.threads);
  const std::unique_ptr<MemoryDump> source_truth = source_ref.run(sc, ComputeDType::Float64, wanted);
  source_truth->set_label("ref float64 on " + source);
  const std::unique_ptr<MemoryDump> quant_truth = m.reference.run(sc, ComputeDType::Float64, wanted);
  quant_truth->set_label("ref float64 on " + m.dir + " (dequantised)");
  compare::QuantErrorReport r = compare::quantisation_error(*source_truth, *quant_truth, cand);
  compare::add_expert_weight_errors(r, *src.weights, *m.model.weights);
  return r;
}

}  // namespace llmdiff::bisect
