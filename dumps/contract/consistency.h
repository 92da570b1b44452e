// A candidate dump checked against the model it is replayed with, before
// anything runs: what no engine could have produced for that model is an
// error naming the file and the tensor (exit 2), not a divergence.
//
//  - the manifest's config (when the dump carries one) describes the same
//    architecture as the model's config.json: a dump of another model;
//  - every step's tokens lie inside the vocabulary;
//  - no layer index beyond the model's layers.
// Positions (restarting, skipping, shifted, out of order) are what an engine
// computed: the bisection judges them, never an error here.
//
// Shapes that differ from the spec's are left to the comparison: a cache
// of another length or a tensor in the engine's own layout is a finding.
#pragma once
#include "dumps/model/config.h"
#include "dumps/contract/dump.h"

namespace llmdiff {

// Throws ConfigError / FormatError naming the dump and the tensor.
void check_dump_against_model(const TensorSource& dump, const ModelConfig& model);

}  // namespace llmdiff
