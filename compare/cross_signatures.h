// Error signatures across names (kind "only-some"): where the error is among
// the names, from a bisection's own verdicts rather than from any tensor's
// values. Each says which part of the localised op's work fails and which
// passes, and what the failing part has in common when the dump makes it
// clear:
//
//  - siblings: the op's sibling sites at the same layer (q/k/v and their
//             norms, rotations, caches and repeats; MLA's q and kv paths;
//             mlp.gate/mlp.up), e.g. "attn.k_rope fails locally at layer 0
//             (every step) while attn.q_rope passes there: only k is wrong,
//             q is right";
//  - steps:   the forward calls at which the localised site fails and those
//             at which it passes (decode steps T = 1 vs the prefill, calls
//             attending to more than N keys, speculative verify calls, a
//             chunked prefill's later chunks);
//  - layers:  the layers at which the site fails and those at which it
//             passes at every step (MoE vs dense layers).
//
// Verdicts are the local ones (an op wrong on its own inputs) where the
// localised site was recomputed; otherwise the global ones, and then only
// the siblings at the localised step and layer are read (a global
// divergence spreads to later steps and layers through the cache and the
// residual stream). These characterise; they explain none of the error's
// values (fit 1) and are never decisive, so they never make the finding.
#pragma once
#include <string>
#include <vector>

#include "compare/compare.h"
#include "compare/local_error.h"
#include "compare/signatures.h"
#include "dumps/contract/engine.h"

namespace llmdiff::compare {

inline constexpr const char* kOnlySomeKind = "only-some";

// The "only-some" signatures at `at` (the localised name), from the local
// report (when it ran and judged `at`) or else the global comparison;
// `sc`: the candidate's forward calls, for what failing calls share.
// Empty when nothing separates failing from passing names.
std::vector<ErrorSignature> cross_name_signatures(const std::string& at, const LocalReport& local,
                                                  const DiffResult& global, const Scenario& sc);

}  // namespace llmdiff::compare
