// What llama.cpp's CPU backend (ggml) rounds by design, measured on a
// candidate that does not declare it, as evidence for the explainers
// (compare/evidence.h, compare/explain.h):
//  - a KV cache stored in a 16-bit type, whose attention products ggml
//    computes in that type too (q times the cache, the probabilities times
//    V; a flash attention also sums the values in it);
//  - each matmul's inputs rounded to the dot-product type of its weight's
//    type (Q8_K for K-quants, ...), for quantised weights.
#pragma once
#include <optional>

#include "bisect/pipeline.h"
#include "compare/bisect_result.h"
#include "compare/evidence.h"
#include "compare/local_error.h"

namespace llmdiff::bisect {

// The cache type when some local site was stored rounded to a 16-bit type
// (LocalSite::stored_as), with whether every local failure is an attention
// product reading that cache within 8 of its unit roundoffs; nullopt when
// the cache is not 16-bit.
std::optional<compare::KvCacheRounding> kv_cache_rounding(const compare::LocalReport& local);

// The clean impl making ggml's roundings (matmul_input=ggml, and the
// candidate's 16-bit cache type if any) run up to the first local failure,
// and the reference at float32 there, each against the candidate; nullopt
// when the model's weights are not quantised, nothing fails locally or a
// run cannot be made.
std::optional<compare::RoundingProbe> probe_ggml_rounding(const ModelOracles& m, const TensorSource& cand,
                                                          const compare::BisectResult& r);

}  // namespace llmdiff::bisect
