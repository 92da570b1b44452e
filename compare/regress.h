// Regression checks of the engines against golden HF dumps: the explicit
// regression policy (what "still agrees with HF" means per model dtype and
// engine), the criteria implementing it, golden-tree discovery and the
// per-case results that the regress renderers print. Running the engines is
// the caller's business (cli/cmd_regress.cpp): compare/ only sees dumps.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "compare/compare.h"
#include "compare/tolerance.h"
#include "dumps/model/config.h"

namespace llmdiff::compare {

// Ref and Impl: llmdiff's own engines, replayed in process. External: the
// user's engine, run by a command template or read from a directory of its
// dumps (bisect/external.h); judged like the impl, except that the names it
// does not dump are listed, not failed (an engine dumps what it can observe)
// unless the policy says external_all_names=1.
enum class EngineKind { Ref, Impl, External };
const char* engine_kind_name(EngineKind e);   // "ref", "impl", "external"
EngineKind parse_engine_kind(const std::string& s);  // throws UsageError

// The agreed bounds, by model dtype (config torch_dtype) and engine.
//  - float32 models, both engines: every float tensor within
//    max|a-b| <= f32_abs * max(1, max|HF|) (a per-tensor scaled absolute bound).
//  - bfloat16 (float16) models, ref (computes in the model dtype like HF):
//    allclose at bf16_ref (f16_ref), torch.testing's defaults for the dtype.
//  - bfloat16 / float16 models, impl (float32 compute from low-precision
//    weights, so intermediates legitimately differ from HF's rounded ones):
//    generated tokens identical and logits / next_logits NMSE <= lowp_impl_nmse;
//    other float tensors are reported but not judged.
// In every case integer tensors (tokens, positions, generated) must be equal,
// shapes must match, and (require_all_names) every name of the HF dump must
// be present in the engine's dump.
struct RegressionPolicy {
  double f32_abs = 1e-5;
  Tolerance bf16_ref{1.6e-2, 1e-5};
  Tolerance f16_ref{1e-3, 1e-5};
  double lowp_impl_nmse = 1e-3;
  bool require_all_names = true;
  bool external_all_names = false;

  // Sets one field from "KEY=VALUE" (keys: f32_abs, bf16_ref_rtol,
  // bf16_ref_atol, f16_ref_rtol, f16_ref_atol, lowp_impl_nmse,
  // require_all_names=0|1, external_all_names=0|1). Throws UsageError.
  void set(const std::string& key_value);
  static const std::vector<std::string>& keys();
  // One line describing the rule applied to (engine, model dtype).
  std::string describe(EngineKind engine, ComputeDType model_dtype) const;
};

// max|a-b| <= factor * max(1, max|ref|); value = max abs, threshold = the bound.
class ScaledMaxAbsCriterion : public Criterion {
 public:
  explicit ScaledMaxAbsCriterion(double factor) : factor_(factor) {}
  std::string name() const override;
  Judgement judge(const TensorData& ref, const TensorData& cand, const TensorComparison& cmp) const override;

 private:
  double factor_;
};

// Judges only logits / next_logits: NMSE <= bound. Other names are informational.
class LogitsNmseCriterion : public Criterion {
 public:
  explicit LogitsNmseCriterion(double bound) : bound_(bound) {}
  std::string name() const override;
  Judgement judge(const TensorData& ref, const TensorData& cand, const TensorComparison& cmp) const override;

 private:
  double bound_;
};

// The compare options (tolerance, criterion) realising the policy for one case.
CompareOptions regression_options(const RegressionPolicy& p, EngineKind engine, ComputeDType model_dtype);

// A model directory of a golden tree and its HF dumps.
struct GoldenModel {
  std::string name;                // directory name
  std::string dir;
  std::vector<std::string> dumps;  // *.safetensors other than model*.safetensors, sorted
};
// Every directory holding config.json under `root` (root itself included,
// model directories are not descended into), sorted by path. Throws
// UsageError when `root` is not a directory or holds no model.
std::vector<GoldenModel> discover_golden(const std::string& root);

struct RegressionCase {
  std::string model, scenario;     // scenario: the dump's file stem
  std::string dump;                // HF dump path
  EngineKind engine = EngineKind::Ref;
  std::string engine_name;         // an external engine's name (empty: engine_kind_name)
  ComputeDType model_dtype = ComputeDType::Float32;
  std::string rule;                // RegressionPolicy::describe
  bool pass = false;
  std::string error;               // the engine could not run the case (then no diff)
  std::optional<DiffResult> diff;
  // The judged tensor closest to (or furthest past) its threshold; empty
  // when every judged value is 0 (bit-exact agreement).
  std::string worst_name, worst_metric;
  double worst_value = 0, worst_threshold = 0;
  std::vector<std::string> failures;  // one line per failing name, numbers included
  std::vector<std::string> missing;   // HF names the engine's dump lacks (failures unless the policy allows)
  double seconds = 0;
  std::string id() const { return model + "/" + scenario; }
  std::string engine_label() const { return engine_name.empty() ? engine_kind_name(engine) : engine_name; }
};
// Fills pass / worst / failures from c.diff (or c.error).
void evaluate_case(RegressionCase& c, const RegressionPolicy& p);

struct RegressionReport {
  std::string golden;
  RegressionPolicy policy;
  std::vector<RegressionCase> cases;
  size_t failing() const;
  bool ok() const { return failing() == 0 && !cases.empty(); }
};

}  // namespace llmdiff::compare
