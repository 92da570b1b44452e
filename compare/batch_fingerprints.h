// Fingerprints of the zoo's batch bugs (zoo::BatchFaults): what an engine
// serving several sequences together leaves in one sequence's dump when it
// shares the forward call or the paged KV cache wrongly. Each is exact
// structural evidence, named through the bug registry's signatures:
// - positions that start k != 0 after the cached ones (counted from the
//   batch's padded or packed start);
// - probabilities over the sequence's own keys that sum to less than 1
//   (mass on keys outside the sequence: packed attention not block-diagonal);
// - kv.slot_mapping off from its block table, kv.context_len too long
//   (compare/paged_kv.h);
// - a gathered cache that holds the sequence's blocks in another order.
// A block reused before its sequence finished shows across sequences only
// (compare/batch_report.h).
#pragma once
#include <string>
#include <vector>

#include "compare/compare.h"
#include "dumps/contract/dump.h"

namespace llmdiff::compare {

struct Fingerprint;

// `past[s]`: positions cached before step s.
void batch_fingerprints(const TensorSource& cand, const TensorSource& ref, const DiffResult& global,
                        const std::vector<int64_t>& past, std::vector<Fingerprint>& out);

}  // namespace llmdiff::compare
