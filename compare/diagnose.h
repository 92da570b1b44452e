// The zoo's diagnosis of a candidate that diverges: every hypothesis (a bug
// of the zoo, with its parameter) tested against the candidate, best first.
// The verdict it supports is made from this evidence by compare/explain.h.
//
// compare/ reaches the engines only through the abstract runners declared
// here (HypothesisRunner) and in local_error.h (LocalOracle); bisect/
// implements them with the libtorch ref (ref/) and the plain C++ impl
// (impl/), and schedules the runs (bisect/schedule.h). Which bug a
// fingerprint points at is the zoo registry's word (dumps/zoo/bugs.h), not
// a name written here.
//
// Evidence for a hypothesis H comes from three places:
//  - replay: the whole scenario re-run with H switched on; H is supported
//    when that run reproduces the candidate (within the noise) at the first
//    divergent site and at nearly every site, where the reference does not;
//  - local recompute: the candidate's own inputs pushed through the
//    reference ops modified as H says (e.g. RoPE with adjacent pairs); H is
//    supported when it removes every local failure and adds none;
//  - fingerprints (compare/fingerprints.h): cheap tests of the divergence
//    pattern, reported as corroboration, or alone when no run reproduces
//    the candidate.
#pragma once
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "compare/compare.h"
#include "compare/fingerprints.h"
#include "compare/local_error.h"
#include "compare/noise_floor.h"
#include "compare/signatures.h"
#include "dumps/contract/engine.h"

namespace llmdiff::compare {

// Runs the model with one bug hypothesis switched on.
class HypothesisRunner {
 public:
  virtual ~HypothesisRunner() = default;
  // Every hypothesis worth testing on this model: each zoo bug that applies
  // to it, parameterised bugs once per value of their grid.
  virtual std::vector<Hypothesis> hypotheses() const = 0;
  // Bugs of the zoo that do not apply to this model, with the reason.
  virtual std::vector<std::pair<std::string, std::string>> inapplicable() const = 0;
  // The scenario with `h` switched on (an empty h.bug: the clean model);
  // records only `wanted` (full names) and may end the scenario early once
  // every one of them is recorded.
  virtual std::unique_ptr<MemoryDump> run(const Hypothesis& h, const Scenario& sc,
                                          const std::vector<std::string>& wanted) const = 0;
  // The model's own value of the parameter `bug` changes (config rope_theta
  // for rope-theta); nullopt for a bug without a parameter.
  virtual std::optional<double> configured(const std::string& bug) const = 0;
  // What that parameter is called in words ("rope theta"; empty: none).
  virtual std::string parameter(const std::string& bug) const { return ""; }
  // One line saying what the bug does (empty if unknown).
  virtual std::string description(const std::string& bug) const { return ""; }
  // Whether the bug can change anything in `sc` (one that acts only on a
  // left-padded row does nothing without padding: not worth a replay).
  virtual bool acts_in(const std::string& bug, const Scenario& sc) const { return true; }
  // The first forward call of `sc` a replay of `h` needs to run: a later one
  // than 0 when `h` changes no call before it and `cand` holds the caches
  // the calls before it left, which the run then starts from (teacher-forced:
  // Scenario::resume). 0: the replay runs every call.
  virtual int replay_start(const Hypothesis& h, const Scenario& sc, const TensorSource& cand) const { return 0; }
  // A copy of the runner on `threads` threads (nullptr: it cannot be split).
  virtual std::unique_ptr<HypothesisRunner> with_threads(int threads) const { return nullptr; }
};

// The evidence gathered for one hypothesis.
struct HypothesisEvidence {
  Hypothesis hypothesis;
  std::string description;                    // what the bug does (the runner's word)
  std::string value_text;                     // its parameter in words ("rope theta = 1e+04, config says 5e+05")
  // Replay: the hypothesis run against the candidate at every name both hold.
  bool replayed = false;
  int replay_compared = 0, replay_agree = 0;  // all names
  int failing_compared = 0, failing_agree = 0;  // names where the candidate diverges from the reference
  bool replay_focus_agree = false;            // at the first divergent site
  double replay_focus_rmse = 0;               // hypothesis run vs candidate there
  double replay_focus_threshold = 0;
  std::string replay_first_disagreement;      // first name (canonical order) where the run differs
  double replay_log_error = 0;                // mean log10(rmse/threshold) over failing names (ranking)
  std::string replay_text;                    // the replay's numbers in one line ("" when not replayed)
  // The first call the replay ran (> 0: the calls before it not run, their
  // caches the candidate's own; HypothesisRunner::replay_start).
  int replay_from_step = 0;
  // Not replayed: its ops recomputed at the first local failure leave it as
  // the reference's op does (it does not act there; the summary says so).
  bool screened_out = false;
  // Local recompute under the hypothesis.
  bool local_tested = false;
  size_t local_failures = 0;                  // local failures under the hypothesis
  size_t local_fixed = 0, local_new = 0;      // clean failures now passing / clean passes now failing
  bool local_focus_pass = false;              // the first local failure passes under the hypothesis
  double local_focus_max_abs = 0, local_focus_rmse = 0;
  std::string local_text;                     // the recompute's numbers in one line ("" when not tested)
  bool supported_by_replay = false, supported_by_local = false;
  bool supported() const { return supported_by_replay || supported_by_local; }
  double score = 0;                           // larger is better (ranking only)
  std::string summary;                        // one line with the numbers
};

// What the zoo's hypotheses, fingerprints and error signatures say about a
// divergence: data for the explainers (compare/explain.h) and the reports.
struct Diagnosis {
  std::vector<HypothesisEvidence> ranked;   // every hypothesis tested, best first
  std::vector<Fingerprint> fingerprints;    // those that fired
  std::vector<std::pair<std::string, std::string>> inapplicable;  // bug, reason
  // What the error looks like at the focus and the first failing names
  // (compare/signatures.h), best first per name.
  std::vector<ErrorSignature> signatures;
  // Set when the clean run already reproduces the candidate at the first
  // divergence and no op fails locally (rounding no bug explains; no
  // hypothesis was replayed): the numbers.
  std::string clean_reproduces;
};

// Whether a hypothesis run's tensor `hyp` reproduces the candidate's `cand`:
// rmse within twice the global noise-floor threshold of the name (`cmp`,
// the candidate's comparison there; a shape mismatch borrows the floor of
// the candidate's own scale), else allclose at the dtype's tolerance;
// integers equal.
struct Agreement {
  bool agree = false;
  double rmse = std::numeric_limits<double>::infinity(), threshold = 0;
};
Agreement agreement(const TensorData& hyp, const TensorData& cand, const TensorComparison* cmp, ComputeDType dtype);

// The candidate's compute dtype: its manifest's, float32 when absent.
ComputeDType candidate_dtype(const TensorSource& cand, std::string* source = nullptr);

// Tests every hypothesis of `runner` by replay (plus values fitted by
// fingerprints and, when no grid value of a parameterised bug reproduces the
// candidate, a value searched between the grid points) and, where the oracle
// supports it, by local recompute; ranks them, best first.
struct DiagnoseInputs {
  const TensorSource* cand = nullptr;
  const TensorSource* ref = nullptr;          // reference at the candidate's dtype
  const DiffResult* global = nullptr;
  const LocalReport* local = nullptr;         // may be null / not ran
  const LocalOracle* oracle = nullptr;        // may be null
  const Recomputed* cand_local = nullptr;     // the candidate's float64 recompute (judged in `local`)
  // The reference's ops at `dtype` on the candidate's inputs, made where a
  // verdict needs them: the reference's local noise is this against
  // cand_local (both needed for local evidence).
  RefOnDemand* local_ref = nullptr;
  SecondNoise* second_local = nullptr;        // the clean run's local noise, made on demand (may be null)
  const HypothesisRunner* runner = nullptr;   // may be null
  const TensorSource* clean = nullptr;        // the runner's clean run over the candidate's names, if already made
  Scenario scenario;
  ComputeDType dtype = ComputeDType::Float32;
  std::vector<std::string> sites;             // --sites filter
  std::function<void(const std::string&)> progress;  // told as each part of the diagnosis ends (may be empty)
};
Diagnosis diagnose(const DiagnoseInputs& in);

// The error signatures at `names` (the localised site first, then the first
// failing names), best first per name.
std::vector<ErrorSignature> signatures_at(const std::vector<std::string>& names, const TensorSource& cand,
                                          const TensorSource& ref, const LocalOracle* oracle);

}  // namespace llmdiff::compare
