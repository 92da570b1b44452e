// The zoo's bugs tested by replay: the engine schedule a several-sequence
// dump records (iter{N}.* and each sequence's step tokens) is run again
// through the impl's continuous-batching engine, once with each bug of the
// zoo that applies (the batch bugs and the model's), and the bug that
// reproduces the first divergent sequence's diverging names is named. It needs none of the names the fingerprints read
// (positions, probabilities, kv.*), so it names the bug from a cut-down dump
// too (layer outputs and logits).
#pragma once
#include <memory>
#include <string>

#include "bisect/pipeline.h"
#include "compare/batch_report.h"
#include "impl/batch_engine.h"

namespace llmdiff::bisect {

// The noise floor's second honest run for a batch: the candidate's schedule
// replayed through the clean continuous-batching engine (the same sequences
// sharing the same calls, so that what batching changes in the arithmetic,
// e.g. the shapes of the packed matmuls, is in the floor), recording the
// candidate's names, with the candidate's declared precision profile. Null
// when the engine cannot run it (a sampling or padded candidate, a schedule
// it refuses); `why` then says why.
std::shared_ptr<const TensorSource> clean_batch_replay(const ModelOracles& m, const TensorSource& cand,
                                                      std::string* why);

// When the first divergent sequence of `b` has no bug named: the replay of
// every bug of the zoo. One that reproduces all its diverging names (each within
// twice its noise-floor threshold) becomes its diagnosis (basis "batch
// replay"); several that do are listed as equally supported.
void explain_batch_by_replay(const ModelOracles& m, const TensorSource& cand, compare::BatchBisect& b);

}  // namespace llmdiff::bisect
