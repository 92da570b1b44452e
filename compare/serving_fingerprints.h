// Fingerprints of the zoo's speculative-decoding bugs: what a verify call's
// bookkeeping leaves in a dump (docs/DUMP_FORMAT.md, "Speculative
// decoding"), each exact structural evidence and a finder of
// compare/fingerprints.h's table:
// - spec.accepted other than the drafts the candidate's own logits rows
//   agree with (its argmax after the token before each draft);
// - the call after a verify call continuing after the rejected drafts (its
//   positions start `rejected` later than the positions kept);
// - the call after it reading the rejected drafts' positions as well (its
//   mask and caches `rejected` positions longer than the sequence holds).
// The prefix cache's faults show across sequences (compare/prefix_blocks.h).
#pragma once
#include <vector>

#include "compare/fingerprints.h"

namespace llmdiff::compare {

void spec_accepted_miscounted(const FingerprintScene& s, std::vector<Fingerprint>& out);
void spec_rollback_missing(const FingerprintScene& s, std::vector<Fingerprint>& out);
void spec_context_rejected(const FingerprintScene& s, std::vector<Fingerprint>& out);

// The drafts the verify call before `step` rejected (0 when it is not after one).
int64_t rejected_before(const Scenario& sc, int step);

}  // namespace llmdiff::compare
