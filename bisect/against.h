// One engine, two configurations (`llmdiff bisect --against`): the same
// requests served by one engine under two settings, each side's dump
// bisected as a candidate of its own against the reference with its own
// noise floor (a single-sequence dump by bisect_candidate, a several-sequence
// one by bisect_batch), then the two paired by prompt and judged by
// compare/against.h, which asks this file for the float64 logits that
// settle a greedy flip.
//
// Each side is bisected as `llmdiff bisect` bisects it: prefix-cache hits
// and speculative verify calls replayed as the format places them, a
// tensor-parallel run (rank{r}. names) unsharded and judged rank by rank
// (bisect/tensor_parallel.h).
#pragma once
#include "bisect/pipeline.h"
#include "compare/against.h"

namespace llmdiff::bisect {

compare::AgainstResult bisect_against(const ModelOracles& m, const TensorSource& a, const TensorSource& b,
                                      const BisectOptions& opt);

// The reference's float64 next_logits after `tokens` fed from an empty cache
// in one call (compare::TruthLogits).
compare::TruthLogits float64_logits(const ModelOracles& m);

}  // namespace llmdiff::bisect
