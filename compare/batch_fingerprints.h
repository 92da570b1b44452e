// Fingerprints of the zoo's batch bugs (zoo::BatchFaults): what an engine
// serving several sequences together leaves in one sequence's dump when it
// shares the forward call or the paged KV cache wrongly. Each is exact
// structural evidence, named through the bug registry's signatures, and a
// finder of compare/fingerprints.h's table:
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
#include <vector>

#include "compare/fingerprints.h"

namespace llmdiff::compare {

void batch_positions_shifted(const FingerprintScene& s, std::vector<Fingerprint>& out);
void batch_attention_leak(const FingerprintScene& s, std::vector<Fingerprint>& out);
void batch_paged_bookkeeping(const FingerprintScene& s, std::vector<Fingerprint>& out);
void batch_blocks_out_of_order(const FingerprintScene& s, std::vector<Fingerprint>& out);

}  // namespace llmdiff::compare
