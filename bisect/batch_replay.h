// The zoo's bugs tested by replay: the engine schedule a several-sequence
// dump records (iter{N}.* and each sequence's step tokens) is run again
// through the impl's continuous-batching engine, once with each bug of the
// zoo that applies (the batch bugs and the model's), against the first
// divergent sequence's diverging names: evidence for the explainers
// (compare/explain.h, "batch replay"). It needs none of the names the fingerprints read
// (positions, probabilities, kv.*), so it names the bug from a cut-down dump
// too (layer outputs and logits).
#pragma once
#include <memory>
#include <optional>
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

// The replay of every bug of the zoo against sequence `s` (the first
// divergent one): those that reproduce all its diverging names, each within
// twice its noise-floor threshold, and the numbers of every one tried.
// nullopt when the sequence gives nothing to replay (nothing diverges).
std::optional<compare::BatchReplayEvidence> batch_replay_evidence(const ModelOracles& m, const TensorSource& cand,
                                                                  const compare::SequenceBisect& s);

}  // namespace llmdiff::bisect
