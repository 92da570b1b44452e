// Name-by-name comparison of two dumps (reference vs candidate): per-tensor
// metrics and verdicts, names only one side holds, the first divergence in
// canonical order, a per-layer error trace and greedy-token agreement.
// Results are plain data; compare/report.h renders them.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "compare/heatmap.h"
#include "compare/layout.h"
#include "compare/metrics.h"
#include "compare/tolerance.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/names.h"

namespace llmdiff::compare {

struct TensorComparison;

// A criterion's verdict on one float pair of equal shapes.
struct Judgement {
  bool judged = true;      // false: the criterion does not rule on this name (informational, counts as pass)
  bool pass = true;
  std::string metric;      // what `value` measures, e.g. "allclose ratio", "max_abs", "nmse"
  double value = 0;        // the measured value
  double threshold = 0;    // pass iff value <= threshold (as the criterion defines it)
  std::string note;        // optional explanation for reports
};

// Pluggable pass/fail rule for float tensors (integer tensors are always
// compared exactly, shape mismatches always fail). The comparison's metrics,
// allclose result and tolerance are filled before judge() is called; the raw
// values are there for criteria that need more (e.g. a noise floor).
class Criterion {
 public:
  virtual ~Criterion() = default;
  virtual std::string name() const = 0;  // for reports, e.g. "allclose"
  virtual Judgement judge(const TensorData& ref, const TensorData& cand, const TensorComparison& cmp) const = 0;
  // Integer tensors that differ: a criterion may rule that the difference is
  // not a divergence (e.g. greedy picks at a near-tie); nullopt: it does not
  // rule, the difference fails.
  virtual std::optional<Judgement> judge_ints(const TensorData& ref, const TensorData& cand,
                                              const TensorComparison& cmp) const {
    return std::nullopt;
  }
};

// The default: every element within |a-b| <= atol + rtol*|b| at the name's
// tolerance; value = the worst ratio |a-b| / (atol + rtol*|b|), threshold 1.
class AllcloseCriterion : public Criterion {
 public:
  std::string name() const override { return "allclose"; }
  Judgement judge(const TensorData& ref, const TensorData& cand, const TensorComparison& cmp) const override;
};

// Float32 rounding of a correct engine judged without a model: an error is
// large or small against the tensor's scale, not each element's (an
// accumulation's error follows the sum of |terms|, not the result). Passes
// iff max|a-b| <= `scale` x max(1, max|reference|) (1e-5: the regression
// policy's float32 rule). `llmdiff diff`'s float32/float64 default; with a
// model at hand the noise floor of `bisect` is the sharper judge.
class ScaledMaxCriterion : public Criterion {
 public:
  explicit ScaledMaxCriterion(double scale = 1e-5) : scale_(scale) {}
  std::string name() const override;
  Judgement judge(const TensorData& ref, const TensorData& cand, const TensorComparison& cmp) const override;

 private:
  double scale_;
};

struct CompareOptions {
  std::optional<double> rtol, atol;               // global overrides of the dtype default
  std::vector<ToleranceOverride> overrides;       // per-name (--tol), in order
  std::optional<ComputeDType> dtype;              // else the coarser of the manifests' dtypes (float32 if none)
  std::vector<std::string> sites;                 // name globs to compare (with or without "step{N}."); empty = all
  std::shared_ptr<const Criterion> criterion;     // null = AllcloseCriterion
  bool explain_layouts = true;                    // search layout findings for failing names
  int threads = 0;                                // threads of the metric passes (0: all cores); results do not depend on it
};

struct TensorComparison {
  std::string name;
  CanonName parsed;
  Shape ref_shape, cand_shape;
  DType ref_stored = DType::F32, cand_stored = DType::F32;
  bool is_int = false;        // both sides integer: compared exactly
  bool shape_match = true;
  Tolerance tolerance;
  std::string tolerance_source;      // "float32 default", "--rtol/--atol", "--tol GLOB=SPEC"
  FloatMetrics metrics;               // float pairs with equal shapes
  AllcloseResult allclose;            // at `tolerance`
  std::optional<LogitsMetrics> logits;  // logits / next_logits
  IntMetrics ints;                    // integer pairs with equal shapes
  Judgement judgement;                // the criterion's verdict (floats) or the exact comparison (ints)
  bool pass = false;
  std::vector<LayoutFinding> findings;  // layout explanations (never make a name pass)
  std::vector<std::string> notes;

  // Error size that the trace and reports use: max abs / NMSE for floats of
  // equal shape; +inf for a shape mismatch or any integer mismatch.
  double max_abs() const;
  double nmse() const;
};

// Worst error over one group of sites of one step: the model-level sites
// before the layers (tokens .. embed), one layer, or those after
// (final_norm .. next_logits).
struct LayerTrace {
  enum class Part { Pre, Layer, Post };
  int step = 0;
  Part part = Part::Layer;
  int layer = -1;                 // Part::Layer
  int compared = 0, failing = 0;
  double worst_nmse = 0;
  std::string worst_nmse_site;
  double worst_max_abs = 0;
  std::string worst_max_abs_site;
  std::string key_site;           // "embed", "out" or "logits"/"next_logits"
  bool has_key = false;
  double key_nmse = 0, key_max_abs = 0;
  std::string label() const;      // "embed", "layer 3", "head"
};

// Greedy tokens of each step (argmax of step{N}.next_logits, first index on
// ties) and the `generated` lists.
struct StepTokens {
  int step = 0;
  int64_t ref_token = -1, cand_token = -1;  // -1: that side lacks next_logits
};
struct GreedyAgreement {
  std::vector<StepTokens> steps;            // steps where both sides have next_logits
  int first_divergent_step = -1;            // -1: all agree
  bool has_generated = false;               // both sides hold `generated`
  std::vector<int64_t> ref_generated, cand_generated;
  int first_generated_mismatch = -1;        // index into generated (length difference counts)
};

struct SideSummary {
  std::string label;
  Manifest manifest;
  int steps = 0;
  size_t tensors = 0;
};

struct DiffResult {
  SideSummary ref, cand;
  ComputeDType dtype = ComputeDType::Float32;  // tolerances and ULP grid
  std::string dtype_source;                    // "manifests", "--dtype", "default"
  Tolerance base_tolerance;                    // dtype default + global overrides
  std::vector<ToleranceOverride> overrides;
  std::string criterion;                       // the criterion's name
  std::vector<std::string> sites;              // the --sites filter
  std::vector<TensorComparison> tensors;       // names both hold, canonical order
  std::vector<std::string> only_in_ref;        // missing in the candidate
  std::vector<std::string> only_in_cand;       // extra in the candidate
  std::optional<size_t> first_divergence;      // index into `tensors`
  std::vector<LayerTrace> layer_trace;         // by step, then part/layer
  GreedyAgreement greedy;
  std::vector<std::string> notes;              // dump-level remarks (config differences, ...)
  std::optional<ErrorHeatmap> heatmap;         // the error at the first diverging name whose shapes agree

  size_t failing() const;
  size_t passing() const { return tensors.size() - failing(); }
  // No failing name and at least one name compared.
  bool ok() const { return failing() == 0 && !tensors.empty(); }
  const TensorComparison* find(const std::string& name) const;
  const TensorComparison* first() const { return first_divergence ? &tensors[*first_divergence] : nullptr; }
};

// Compares one pair of tensors (the building block of compare_dumps).
struct PairContext {
  Tolerance tolerance;
  std::string tolerance_source;
  ComputeDType dtype = ComputeDType::Float32;  // ULP grid
  LayoutContext layout;
  const Criterion* criterion = nullptr;        // null = AllcloseCriterion
  bool explain_layouts = true;
  ThreadPool* pool = nullptr;                  // spreads large tensors' metric passes (compare/parallel.h); optional
};
TensorComparison compare_tensors(const TensorData& ref, const TensorData& cand, const PairContext& ctx);

// The compute dtype a diff uses: opt.dtype, else the coarser of the manifests'.
ComputeDType diff_dtype(const TensorSource& ref, const TensorSource& cand, const CompareOptions& opt,
                        std::string* source = nullptr);

DiffResult compare_dumps(const TensorSource& ref, const TensorSource& cand, const CompareOptions& opt = {});

// Per-layer trace and greedy agreement from finished comparisons (used by
// compare_dumps; exposed for callers that assemble results themselves).
std::vector<LayerTrace> build_layer_trace(const std::vector<TensorComparison>& tensors);
GreedyAgreement greedy_agreement(const TensorSource& ref, const TensorSource& cand);

}  // namespace llmdiff::compare
