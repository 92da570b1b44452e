// The verdict of a bisection, made by ONE ordered list of explainers.
//
// Each explainer reads the result's data (comparison, local errors, the
// zoo's diagnosis, compare/evidence.h) and either says what the divergence
// means (a Finding, compare/finding.h) or passes; the first that speaks is
// the verdict. The order is the precedence:
//
//   passes               nothing diverges
//   ring wrap            the error starts where a ring KV cache wrapped
//   weights dtype        a float32 candidate computing at its weights' 16-bit dtype
//   KV cache             a 16-bit KV cache by design (llama.cpp's F16 cache)
//   tensor parallel      a rank's shard or an all-reduce of a tensor-parallel candidate (exact), or its replay
//   zoo bug by runs      a hypothesis the replay and/or local recompute support
//   zoo bug by fingerprint  decisive structural evidence alone
//   block reuse          a paged block in two live sequences' tables (batches)
//   batch replay         a batch bug whose schedule replay reproduces the sequence
//   rounding profile     the clean engine with a precision profile's roundings reproduces it
//   layout               every diverging name matches after one layout transform
//   signature            a decisive error signature at the localised site
//   nothing fits         the closest hypotheses with their numbers (or: not diagnosed)
//
// Evidence that costs engine runs is gathered only when an explainer that
// reads it is reached (Need, `Gather`), by the caller that has the engines
// (bisect/): a precision declaration or a ring wrap skips the hypothesis
// replays, a named bug the rounding probe.
#pragma once
#include <functional>
#include <optional>
#include <vector>

#include "compare/bisect_result.h"
#include "compare/evidence.h"
#include "compare/finding.h"

namespace llmdiff::compare {

using ExplainerFn = std::optional<Finding> (*)(const BisectResult& r);
struct Explainer {
  const char* name;
  Need needs;          // evidence gathered before it runs (Need::Nothing: only the result's data)
  ExplainerFn explain;
};
// Every explainer, in the order of precedence above.
const std::vector<Explainer>& explainers();

// Gathers the evidence of `need` into `r` (its diagnosis or its evidence);
// false when it cannot or is not asked to (the explainers reading it then
// pass, and it may be asked again on a later explain()).
using Gather = std::function<bool(Need, BisectResult&)>;

// Runs the explainers in order and sets r.finding to the first finding,
// its focus the localised site. Gathers what they need through `gather`
// (may be empty: only what `r` holds). Running it again after adding
// evidence (a batch's, compare/batch_report.h) gives the verdict with it.
void explain(BisectResult& r, const Gather& gather = {});

// The explainers, each on its own (in the list's order).
std::optional<Finding> explain_passes(const BisectResult& r);
std::optional<Finding> explain_ring_wrap(const BisectResult& r);
std::optional<Finding> explain_weights_dtype(const BisectResult& r);
std::optional<Finding> explain_kv_cache(const BisectResult& r);
std::optional<Finding> explain_tensor_parallel(const BisectResult& r);
std::optional<Finding> explain_zoo_by_runs(const BisectResult& r);
std::optional<Finding> explain_zoo_by_fingerprint(const BisectResult& r);
std::optional<Finding> explain_block_reuse(const BisectResult& r);
std::optional<Finding> explain_batch_replay(const BisectResult& r);
std::optional<Finding> explain_rounding_profile(const BisectResult& r);
std::optional<Finding> explain_layout(const BisectResult& r);
std::optional<Finding> explain_signature(const BisectResult& r);
std::optional<Finding> explain_nothing_fits(const BisectResult& r);  // always a finding: the last word

}  // namespace llmdiff::compare
