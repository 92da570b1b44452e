// The bisect pipeline: the model-backed implementations of compare/'s
// bisection interfaces,
//  - RefRunner: the libtorch ref over a scenario at a compute dtype;
//  - RefLocalOracle: every site of a dump recomputed through the ref's
//    decoder graph (ref/graph.h) from that dump's own inputs (teacher
//    forcing), optionally with the ops changed as a bug hypothesis says;
//  - ImplHypothesisRunner: the plain C++ impl with one zoo bug switched on.
// and the pipeline shared by `llmdiff bisect`, `llmdiff run` and the bench
// (the passes it schedules: bisect/schedule.h).
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bisect/engines.h"
#include "bisect/schedule.h"
#include "compare/batch_report.h"
#include "compare/noise_floor.h"
#include "compare/diagnose.h"
#include "compare/quant_error.h"
#include "dumps/contract/engine.h"
#include "dumps/model/weights.h"

namespace llmdiff::bisect {

class RefRunner : public ReferenceRunner {
 public:
  RefRunner(const Model& model, std::string model_dir, int threads);
  ~RefRunner() override;
  std::unique_ptr<MemoryDump> run(const Scenario& sc, ComputeDType dtype,
                                  const std::vector<std::string>& wanted = {}) const override;
  std::string describe() const override;
  std::optional<ComputeDType> weights_dtype() const override;
  int threads() const override;
  std::unique_ptr<ReferenceRunner> with_threads(int threads) const override;

 private:
  const Model& model_;
  std::string dir_;
  int threads_;
};

class RefLocalOracle : public compare::LocalOracle {
 public:
  RefLocalOracle(const Model& model, int threads);
  ~RefLocalOracle() override;
  std::unique_ptr<compare::Recomputed> recompute(const TensorSource& dump, ComputeDType dtype,
                                                 const compare::Hypothesis* h = nullptr,
                                                 const std::vector<std::string>* only = nullptr) const override;
  bool supports(const compare::Hypothesis& h) const override;
  std::unique_ptr<compare::LocalOracle> with_threads(int threads) const override;
  std::vector<int> layer_kinds() const override;
  std::optional<std::vector<float>> changed_projection(const TensorSource& dump, const std::string& name,
                                                       compare::ProjectionChange change,
                                                       int64_t max_rows) const override;

 private:
  const Model& model_;
  int threads_;
};

class ImplHypothesisRunner : public compare::HypothesisRunner {
 public:
  // `precision`: the candidate's declared roundings, applied to every run
  // (the clean run is then the noise floor's second run with the same design).
  ImplHypothesisRunner(const Model& model, int threads, PrecisionProfile precision = {});
  std::vector<compare::Hypothesis> hypotheses() const override;
  std::vector<std::pair<std::string, std::string>> inapplicable() const override;
  std::unique_ptr<MemoryDump> run(const compare::Hypothesis& h, const Scenario& sc,
                                  const std::vector<std::string>& wanted) const override;
  std::optional<double> configured(const std::string& bug) const override;
  std::string parameter(const std::string& bug) const override;
  std::string description(const std::string& bug) const override;
  bool acts_in(const std::string& bug, const Scenario& sc) const override;
  int replay_start(const compare::Hypothesis& h, const Scenario& sc, const TensorSource& cand) const override;
  std::unique_ptr<compare::HypothesisRunner> with_threads(int threads) const override;
  // A checkpoint larger than `bytes` is streamed layer by layer by every run
  // (0: the default budget, bisect/engines.h weight_policy).
  void set_memory_budget(int64_t bytes) { memory_budget_ = bytes; }

 private:
  const Model& model_;
  int threads_;
  PrecisionProfile precision_;
  int64_t memory_budget_ = 0;
};

// A model directory loaded with the three runners.
struct ModelOracles {
  ModelOracles(const std::string& model_dir, int threads);
  ModelOracles(const ModelOracles&) = delete;
  ModelOracles& operator=(const ModelOracles&) = delete;
  std::string dir;
  int threads;
  Model model;
  RefRunner reference;
  RefLocalOracle oracle;
  ImplHypothesisRunner hypotheses;
  // The impl's runs (the candidate's, the clean run, every replay) stream a
  // checkpoint larger than this layer by layer (0: the default budget, half
  // the memory available; bisect/engines.h weight_policy).
  int64_t memory_budget = 0;
  void set_memory_budget(int64_t bytes) {
    memory_budget = bytes;
    hypotheses.set_memory_budget(bytes);
  }
};

// bisect() of bisect/schedule.h with the model's runners; the rounding
// probe of a quantised model (bisect/ggml_rounding.h) gathered when the
// explainers reach it; the sampler check of a candidate that samples
// (opt.check_sampling) and the quantisation table of opt.source added.
// `more` gathers evidence the pipeline does not know (a tensor-parallel
// candidate's rank checks, bisect/tensor_parallel.h); may be empty.
compare::BisectResult bisect_candidate(const ModelOracles& m, const TensorSource& cand, BisectOptions opt,
                                       const compare::Gather& more = {});

// bisect_candidate() of each sequence of a several-sequence dump
// (dumps/contract/sequences.h), each against the reference running it alone, ordered
// and summarised by compare::summarise_batch; the first divergent sequence
// explained again with the batch's evidence (the schedule's replay with each
// batch bug, bisect/batch_replay.h), every sequence's sampler checked.
compare::BatchBisect bisect_batch(const ModelOracles& m, const TensorSource& cand, BisectOptions opt);
// The same with the noise floor's clean batch given (null: none; `no_clean`
// then says why, or is empty for the clean impl running each sequence
// alone), and `more(b)` gathering evidence for sequence b (may be empty).
compare::BatchBisect bisect_batch(const ModelOracles& m, const TensorSource& cand, BisectOptions opt,
                                  std::shared_ptr<const TensorSource> clean, const std::string& no_clean,
                                  const std::function<compare::Gather(int seq)>& more);

// `llmdiff run`'s candidate: the impl (with eo.inject's bugs) over `sc`,
// recording the names matching `record` (full-name globs; empty: every site).
std::unique_ptr<MemoryDump> run_impl_candidate(const ModelOracles& m, const Scenario& sc, const EngineOptions& eo,
                                               const std::vector<std::string>& record = {});
// bisect_candidate() of such a candidate. Without injected bugs it is the
// clean impl run itself (the impl is deterministic for any thread count): the
// pipeline makes no second one.
compare::BisectResult bisect_impl_candidate(const ModelOracles& m, const MemoryDump& cand, bool bugs_injected,
                                            BisectOptions opt);

// How much of `cand`'s divergence (a run of m's quantised checkpoint) the
// quantisation alone explains: the reference in float64 on the
// full-precision checkpoint `source` (a model directory or GGUF file of the
// same shapes) and on m's dequantised weights, over the candidate's forward
// calls (compare/quant_error.h). Throws UsageError when the shapes differ.
compare::QuantErrorReport quantisation_report(const ModelOracles& m, const std::string& source,
                                              const TensorSource& cand);

}  // namespace llmdiff::bisect
