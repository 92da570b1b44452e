// Error signatures: what a diverging tensor's error looks like when no bug of
// the zoo explains it, each with its numbers. Computed from the candidate's
// and the reference's values alone (compare/ sees no weights):
//
//  - precision: the reference's values rounded to float16 / bfloat16;
//  - scale:   candidate ~ c x reference, globally, per head or per row;
//             c recognised against common factors (sqrt(D), sqrt(Dh),
//             1/sqrt(Dh), Dh, 1/Dh, their MLA forms);
//  - partial: only some heads, rows (positions) or head-dim halves are wrong;
//  - shift:   rows equal the reference's rows k positions away;
//  - alias:   the tensor equals another canonical tensor of the reference at
//             the same step (its input: the op was skipped; a sibling: k for
//             v; the residual alone).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "dumps/config.h"
#include "dumps/dump.h"

namespace llmdiff::compare {

struct ErrorSignature {
  std::string name;    // the tensor
  std::string kind;    // "precision", "scale", "partial", "shift", "alias"
  std::string detail;  // one line with the numbers
  // How well it explains the error: the RMSE left after the explanation
  // over the RMSE before it (0: exactly; the smaller, the better).
  double fit = 1.0;
  bool decisive = false;  // explains the error to float32 rounding
};

// Least-squares c in a ~ c b (0 when b is all zero), and the RMSE of a - k b.
double fit_scale(const float* a, const float* b, int64_t n);
double scaled_rmse(const float* a, const float* b, int64_t n, double k);

// The signatures of `name` (a float tensor both dumps hold with the same
// shape), best first; empty when none fits. `cfg` (optional) lets scale
// factors be recognised.
std::vector<ErrorSignature> error_signatures(const std::string& name, const TensorSource& cand,
                                             const TensorSource& ref, const std::optional<ModelConfig>& cfg);

}  // namespace llmdiff::compare
