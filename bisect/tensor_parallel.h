// A tensor-parallel candidate (docs/DUMP_FORMAT.md, "Tensor parallelism":
// the manifest's tensor_parallel, rank r's names under rank{r}.) bisected:
//  - unsharded from the model's config (RankView, dumps/contract/ranks.h),
//    so that every analysis of a single-rank dump runs on it unchanged;
//  - the noise floor's second honest run made the same way: the clean impl
//    over the candidate's ranks (impl/tensor_parallel.h), unsharded. Its
//    o_proj and down projections are sums of R partial sums added in rank
//    order, as the candidate's are, so the rounding that order brings is in
//    the floor (the reference and the float64 truth compute each product
//    in one piece);
//  - judged rank by rank (compare/tensor_parallel.h): the all-reduces from
//    the candidate's own partial sums, each rank's kv-head shard against
//    the clean run's; where no rank check speaks (a dump cut down to layer
//    outputs and logits), the candidate's calls replayed over its ranks
//    with each tensor-parallel bug of the zoo.
// Single-sequence and several-sequence candidates alike.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bisect/pipeline.h"
#include "compare/batch_report.h"
#include "dumps/contract/ranks.h"
#include "dumps/zoo/bugs.h"

namespace llmdiff::bisect {

// The candidate's forward calls (a several-sequence candidate: its engine
// schedule through the continuous-batching engine) through the impl over
// its ranks, with `bug` switched on (none: the clean run), with its declared
// precision profile, recording the canonical names `wanted` of every rank;
// read back unsharded. Throws UsageError when the impl cannot run them
// (the bug cannot act over these ranks, a sampling or padded batch).
std::shared_ptr<const RankView> rank_replay(const ModelOracles& m, const RankView& cand,
                                            const std::optional<zoo::BugSpec>& bug,
                                            const std::vector<std::string>& wanted);

// The rank checks of sequence `prefix` ("seq{b}." or "") of the candidate
// against `clean` (may be null: the kv-head check is then skipped), and,
// when they find nothing, the replay with each tensor-parallel bug against
// the result's diverging names.
compare::TensorParallelEvidence rank_evidence(const ModelOracles& m, const RankView& cand, const RankView* clean,
                                              const std::string& prefix, const compare::BisectResult& r);

// bisect_candidate() / bisect_batch() of a tensor-parallel candidate.
// Throws as RankView does for a malformed one (a rank missing, a shard of
// the wrong width).
compare::BisectResult bisect_tensor_parallel(const ModelOracles& m, const TensorSource& cand, BisectOptions opt);
compare::BatchBisect bisect_tensor_parallel_batch(const ModelOracles& m, const TensorSource& cand,
                                                  BisectOptions opt);

}  // namespace llmdiff::bisect
