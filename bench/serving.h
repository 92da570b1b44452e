// llmdiff bench --serving N: the cost of each serving feature of the impl's
// continuous-batching engine (impl/batch_engine.h). N requests of --prompt
// tokens, the first half of every prompt shared, each decoding --decode
// tokens: request 0 arrives at iteration 0, the others at iteration 1 (after
// it computed the shared prefix). The same requests are served under each
// configuration (the baseline, the prefix cache, speculative decoding with
// the n-gram and the draft-model proposer, bucket padding, two ranks), each
// in a child of its own, best of --repeats; each is set against the
// baseline (docs/BENCH_JSON.md, "serving").
#pragma once
#include <nlohmann/json.hpp>

#include "bench/bench.h"

namespace llmdiff::bench {

// The configurations' figures and their comparison with the baseline (a
// child that failed: its row holds "error" and *failed is set).
nlohmann::json bench_serving(const BenchOptions& o, bool* failed);

// The table of bench_serving's result.
void print_serving(const nlohmann::json& serving);

}  // namespace llmdiff::bench
