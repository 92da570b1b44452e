// Bisection and diagnosis of a candidate dump against the reference model:
// where it first diverges (globally, judged by the noise floor), which op is
// wrong by itself (local errors, teacher forcing), and which bug of the zoo
// the evidence supports.
//
// compare/ reaches the reference and the engines only through the abstract
// runners declared here; bisect/pipeline.cpp implements them with the libtorch
// ref (ref/) and the plain C++ impl (impl/). Which bug a fingerprint points at
// is the zoo registry's word (dumps/zoo/bugs.h), not a name written here.
//
// Evidence for a hypothesis H comes from three places:
//  - replay: the whole scenario re-run with H switched on; H is supported
//    when that run reproduces the candidate (within the noise) at the first
//    divergent site and at nearly every site, where the reference does not;
//  - local recompute: the candidate's own inputs pushed through the
//    reference ops modified as H says (e.g. RoPE with adjacent pairs); H is
//    supported when it removes every local failure and adds none;
//  - fingerprints: cheap tests of the divergence pattern (logits wrong while
//    final_norm matches, positions that restart at 0, ...), reported as
//    corroboration, or alone when no run reproduces the candidate.
#pragma once
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "compare/compare.h"
#include "compare/signatures.h"
#include "compare/local_error.h"
#include "compare/noise_floor.h"
#include "dumps/contract/engine.h"

namespace llmdiff::compare {

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
  // A copy of the runner on `threads` threads (nullptr: it cannot be split).
  virtual std::unique_ptr<HypothesisRunner> with_threads(int threads) const { return nullptr; }
};

// The evidence gathered for one hypothesis.
struct HypothesisEvidence {
  Hypothesis hypothesis;
  // Replay: the hypothesis run against the candidate at every name both hold.
  bool replayed = false;
  int replay_compared = 0, replay_agree = 0;  // all names
  int failing_compared = 0, failing_agree = 0;  // names where the candidate diverges from the reference
  bool replay_focus_agree = false;            // at the first divergent site
  double replay_focus_rmse = 0;               // hypothesis run vs candidate there
  double replay_focus_threshold = 0;
  std::string replay_first_disagreement;      // first name (canonical order) where the run differs
  double replay_log_error = 0;                // mean log10(rmse/threshold) over failing names (ranking)
  // Local recompute under the hypothesis.
  bool local_tested = false;
  size_t local_failures = 0;                  // local failures under the hypothesis
  size_t local_fixed = 0, local_new = 0;      // clean failures now passing / clean passes now failing
  bool local_focus_pass = false;              // the first local failure passes under the hypothesis
  double local_focus_max_abs = 0, local_focus_rmse = 0;
  bool supported_by_replay = false, supported_by_local = false;
  bool supported() const { return supported_by_replay || supported_by_local; }
  double score = 0;                           // larger is better (ranking only)
  std::string summary;                        // one line with the numbers
};

struct Fingerprint {
  Fingerprint(std::string b, std::string e, bool d, std::optional<double> v = std::nullopt)
      : bug(std::move(b)), evidence(std::move(e)), decisive(d), value(v) {}
  std::string bug;       // zoo name
  std::string evidence;  // one line with the numbers
  bool decisive = false; // exact structural evidence (enough to name the bug alone)
  std::optional<double> value;  // a parameter the fingerprint fitted (rope-theta from rope.inv_freq)
};

struct Diagnosis {
  bool needed = false;                      // something diverged
  std::string focus;                        // the site diagnosed (first local failure, else first divergence)
  std::optional<Hypothesis> bug;            // the bug the evidence supports; nullopt when nothing fits
  std::string description;                  // what that bug does (the zoo's one line)
  std::string evidence;                     // the evidence for it, or why nothing fits (with the numbers)
  std::string basis;                        // "replay", "local recompute", "replay + local recompute", "fingerprint"
  std::vector<HypothesisEvidence> ranked;   // every hypothesis tested, best first
  std::vector<Fingerprint> fingerprints;    // those that fired
  std::vector<std::pair<std::string, std::string>> inapplicable;  // bug, reason
  std::vector<std::string> ambiguous;       // other hypotheses the evidence supports equally well
  // What the error looks like at the focus and the first failing names
  // (compare/signatures.h), best first per name.
  std::vector<ErrorSignature> signatures;
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

struct BisectOptions {
  CompareOptions compare;        // tolerances, --sites; its criterion is set by bisect()
  bool noise_floor = true;       // judge by the noise floor (else allclose)
  bool local = true;             // local errors (teacher forcing)
  bool diagnose = true;          // test the bug hypotheses
  // The hypothesis engine's clean run over the candidate's forward calls
  // when the caller already has it (`llmdiff run` without --inject: the
  // candidate itself); null: bisect() makes it.
  std::shared_ptr<const TensorSource> clean;
  // A shard (dumps/contract/layer_window.h): only the window's names are analysed,
  // every run going through its layers alone from the candidate's residual
  // stream entering it (teacher-forced at the boundary). Whole by default.
  LayerWindow layers;
  // Called as each phase of the pipeline ends, with a line naming it (the
  // caller adds timings); may be empty.
  std::function<void(const std::string&)> progress;
};

// Everything a bisection found (rendered by compare/bisect_report.h).
struct BisectResult {
  std::string candidate_label, model;
  Scenario scenario;                          // the candidate's forward calls, as replayed
  LayerWindow layers;                         // the shard analysed (end < 0: no --layers, the model)
  ComputeDType dtype = ComputeDType::Float32; // the candidate's compute dtype
  std::string dtype_source;                   // "manifest", "default (no manifest dtype)"
  std::string reference;                      // the reference runner's description
  bool noise_floor = false;
  std::string second_noise;                   // the second honest run in the noise floor ("" when none)
  DiffResult global;                          // candidate vs reference at dtype
  LocalReport local;                          // candidate's local errors
  Diagnosis diagnosis;
  std::vector<std::string> notes;
  // Set when a float32 candidate that diverges is within the noise floor
  // judged at the weights' 16-bit dtype: the dtype to declare.
  std::optional<ComputeDType> declare_dtype;
  // Set when a candidate that diverges has no local failure and stores its
  // KV cache rounded to a 16-bit type (llama.cpp's default F16 cache)
  // without declaring it: the cache type to declare (manifest `precision`).
  std::optional<ComputeDType> declare_kv_cache;
  // A precision profile (its manifest JSON) that explains the divergence:
  // the candidate rounds as ggml does for the model's quantised weights.
  std::optional<std::string> declare_precision;
  // `moe.topk_ids` names whose expert choices differ from the reference's
  // only at near-ties (NoiseFloorCriterion::judge_routing): reported, not
  // divergences. With no local failure, names diverging only after the first
  // of them follow from it (the tokens ran other experts), and the candidate
  // passes (flips_explain).
  std::vector<std::string> routing_flips;
  bool flips_explain = false;
  // Set when no bug fits and every diverging name matches the reference
  // after one and the same layout transform (an engine's own layout, e.g.
  // llama.cpp's q/k rows permuted for interleaved RoPE): that transform.
  std::optional<LayoutFinding> layout;
  // The error where it originates (localised_at(); else global.heatmap:
  // the first diverging name whose shapes agree), for the HTML report.
  std::optional<ErrorHeatmap> heatmap;
  // The first divergent name (global), the first local failure.
  std::optional<std::string> first_divergence() const;
  std::optional<std::string> first_local_failure() const;
  // Where the error originates: the first local failure, else the first divergence.
  std::optional<std::string> localised_at() const;
  bool ok() const;  // no divergence (beyond near-tie routing flips) and no local failure
  int exit_code() const { return ok() ? 0 : 1; }
};

// The candidate's compute dtype: its manifest's, float32 when absent.
ComputeDType candidate_dtype(const TensorSource& cand, std::string* source = nullptr);

// The cheap fingerprints (see the file comment) that fire on this candidate.
std::vector<Fingerprint> fingerprints(const TensorSource& cand, const TensorSource& ref, const DiffResult& global,
                                      const Scenario& sc);

// Tests every hypothesis of `runner` by replay (plus values fitted by
// fingerprints and, when no grid value of a parameterised bug reproduces the
// candidate, a value searched between the grid points) and, where the oracle
// supports it, by local recompute; picks the best supported one.
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

// The whole pipeline: replays the candidate's forward calls through the
// reference (at its dtype and, for the noise floor, in float64) and through
// the clean hypothesis runner (the noise floor's second honest run, and the
// diagnosis' baseline), compares, computes local errors and diagnoses. `oracle` and `hypotheses` may be null
// (then no local errors / no replay evidence).
BisectResult bisect(const TensorSource& cand, const ReferenceRunner& reference, const LocalOracle* oracle,
                    const HypothesisRunner* hypotheses, const BisectOptions& opt);

}  // namespace llmdiff::compare
