// Tolerances of a diff: defaults per compute dtype (torch.testing's), global
// --rtol/--atol overrides and per-name glob overrides ("GLOB=atol:1e-4").
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "dumps/model/config.h"
#include "dumps/contract/dump.h"

namespace llmdiff::compare {

// allclose tolerance: |cand - ref| <= atol + rtol * |ref| elementwise.
struct Tolerance {
  double rtol = 1.3e-6;
  double atol = 1e-5;
  std::string str() const;  // "rtol 1.3e-06 atol 1e-05"
};

// torch.testing.assert_close defaults: float32 1.3e-6/1e-5, bfloat16 1.6e-2/1e-5,
// float16 1e-3/1e-5, float64 1e-7/1e-7.
Tolerance default_tolerance(ComputeDType d);

// The coarser of two compute dtypes (the one with the larger default rtol):
// float64 < float32 < float16 < bfloat16.
ComputeDType coarser_dtype(ComputeDType a, ComputeDType b);

// A manifest's `dtype`, or nullopt when absent or not a dtype llmdiff knows.
std::optional<ComputeDType> manifest_dtype(const Manifest& m);

// One --tol override: a name glob and the fields it sets.
struct ToleranceOverride {
  std::string glob;
  std::optional<double> rtol, atol;
  std::string text;  // as given, for reports
};

// Parses "GLOB=SPEC" with SPEC one or more comma-separated "atol:X" / "rtol:X"
// (X a finite number >= 0). Throws UsageError naming the problem.
ToleranceOverride parse_tolerance_override(const std::string& text);

// Full name without its "step{N}." prefix ("step0.layers.1.attn.q" ->
// "layers.1.attn.q"); the name itself when it has none.
std::string strip_step_prefix(const std::string& name);

// Glob match ("*" any run, "?" one char) of a full name, or of the name with
// its "step{N}." prefix removed, so "layers.*.attn.probs" matches every step.
bool site_glob_match(const std::string& glob, const std::string& name);
bool any_site_glob_match(const std::vector<std::string>& globs, const std::string& name);

// Splits "a,b,c" into globs (empty pieces dropped).
std::vector<std::string> split_list(const std::string& csv);

// Resolves the tolerance of each name: the dtype default, then the global
// overrides, then every matching per-name override in order (so the last
// matching override wins for each field it sets).
class TolerancePolicy {
 public:
  TolerancePolicy() = default;
  TolerancePolicy(ComputeDType dtype, std::optional<double> rtol, std::optional<double> atol,
                  std::vector<ToleranceOverride> overrides);

  ComputeDType dtype() const { return dtype_; }
  const Tolerance& base() const { return base_; }  // default + global overrides
  const std::vector<ToleranceOverride>& overrides() const { return overrides_; }
  // `source`, when given, receives where the value came from
  // ("float32 default", "--rtol/--atol", "--tol GLOB=SPEC").
  Tolerance resolve(const std::string& name, std::string* source = nullptr) const;

 private:
  ComputeDType dtype_ = ComputeDType::Float32;
  Tolerance base_;
  std::string base_source_ = "float32 default";
  std::vector<ToleranceOverride> overrides_;
};

}  // namespace llmdiff::compare
