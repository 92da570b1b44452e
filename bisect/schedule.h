// The passes of a bisection and their schedule: the reference runs (at the
// candidate's dtype and the float64 truth), the clean hypothesis engine's
// run, the candidate's local recompute, the comparison at the weights'
// 16-bit dtype, the local verdicts, and the evidence the explainers ask for
// (compare/explain.h), with independent passes in thread lanes beside each
// other. compare/ judges what these runs produce; this file decides which
// runs are made, in what order and on which threads.
//
// The runners are abstract (RefRunner, RefLocalOracle and
// ImplHypothesisRunner of bisect/pipeline.h implement them with the model;
// tests give tables of dumps).
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "compare/bisect_result.h"
#include "compare/diagnose.h"
#include "compare/explain.h"
#include "dumps/contract/engine.h"
#include "dumps/contract/layer_window.h"

namespace llmdiff::bisect {

// Runs the reference model over a scenario at a compute dtype.
class ReferenceRunner {
 public:
  virtual ~ReferenceRunner() = default;
  // Records the names matching `wanted` (globs; empty = every name).
  virtual std::unique_ptr<MemoryDump> run(const Scenario& sc, ComputeDType dtype,
                                          const std::vector<std::string>& wanted = {}) const = 0;
  virtual std::string describe() const = 0;  // producer text for reports
  // The 16-bit dtype the model's weights are stored in (bfloat16, float16),
  // nullopt when float32: an engine that computes with them may round its
  // matmul inputs to it whatever its manifest says.
  virtual std::optional<ComputeDType> weights_dtype() const { return std::nullopt; }
  // The threads a run uses, and a copy of the runner that uses `threads`
  // instead (nullptr: it cannot be split, or splitting does not pay for this
  // model). Two independent passes then run beside each other, each on part
  // of the cores: one pass's serial work leaves a core idle that the other
  // fills.
  virtual int threads() const { return 1; }
  virtual std::unique_ptr<ReferenceRunner> with_threads(int threads) const { return nullptr; }
};

struct BisectOptions {
  compare::CompareOptions compare;  // tolerances, --sites; its criterion is set by bisect()
  bool noise_floor = true;          // judge by the noise floor (else allclose)
  bool local = true;                // local errors (teacher forcing)
  bool diagnose = true;             // test the bug hypotheses
  // The hypothesis engine's clean run over the candidate's forward calls
  // when the caller already has it (`llmdiff run` without --inject: the
  // candidate itself); null: bisect() makes it.
  std::shared_ptr<const TensorSource> clean;
  // A shard (dumps/contract/layer_window.h): only the window's names are
  // analysed, every run going through its layers alone from the candidate's
  // residual stream entering it (teacher-forced at the boundary). Whole by
  // default.
  LayerWindow layers;
  // Called as each phase of the pipeline ends, with a line naming it (the
  // caller adds timings); may be empty.
  std::function<void(const std::string&)> progress;
  // bisect_candidate (bisect/pipeline.h): check the sampler of a candidate
  // that samples (bisect_batch checks every sequence's at once instead).
  bool check_sampling = true;
  // bisect_candidate: the full-precision checkpoint a quantised model was
  // made from (`--source`); the result then holds the quantisation table.
  std::string source;
};

// The whole pipeline: replays the candidate's forward calls through the
// reference (at its dtype and, for the noise floor, in float64) and through
// the clean hypothesis runner (the noise floor's second honest run, and the
// diagnosis' baseline), compares, computes local errors, and explains the
// result (compare/explain.h), gathering the diagnosis only if the
// explainers reach it. `oracle` and `hypotheses` may be null (then no local
// errors / no replay evidence). `more` gathers what this pipeline cannot
// (Need::Rounding, Need::BatchReplay: engines of the model); may be empty.
compare::BisectResult bisect(const TensorSource& cand, const ReferenceRunner& reference,
                             const compare::LocalOracle* oracle, const compare::HypothesisRunner* hypotheses,
                             const BisectOptions& opt, const compare::Gather& more = {});

}  // namespace llmdiff::bisect
