// Where the forward calls of one sequence sit (docs/DUMP_FORMAT.md): each
// call's P (positions cached before it) and T (its tokens). P is the tokens
// of the calls before it, unless a serving feature says otherwise:
//  - a prefix-cache hit (step0.kv.cached_prefix, H tokens): step 0 starts
//    at P = H, the hit's positions computed by an earlier request;
//  - a speculative verify call (step{n}.spec.draft, spec.accepted): its
//    rejected drafts' positions are rolled back, so the next call starts at
//    P + 1 + accepted, not P + T.
#pragma once
#include <cstdint>
#include <map>
#include <vector>

#include "dumps/contract/dump.h"

namespace llmdiff {

struct CallSpan {
  int64_t P = 0, T = 0;
  int64_t rollback = 0;  // positions dropped from the cache's end after the call
};

// From each call's tokens, the hit's length and the rollbacks by step.
std::vector<CallSpan> call_spans(const std::vector<std::vector<int64_t>>& steps, int64_t prefix,
                                 const std::map<int, int64_t>& rollback);

// A single-sequence dump's (or SequenceView's) serving names: the tokens of
// its prefix-cache hit (empty without one), and the positions each verify
// call rolls back (T - 1 - accepted, by step). Throws FormatError naming the
// tensor for one that is not an integer tensor of the format's shape.
std::vector<int64_t> cached_prefix(const TensorSource& d);
std::map<int, int64_t> spec_rollbacks(const TensorSource& d);
std::vector<CallSpan> call_spans(const TensorSource& d);
// Whether the dump holds speculative verify calls (spec.draft or
// spec.accepted at some step): its `generated` are not one argmax per call.
bool speculative(const TensorSource& d);

}  // namespace llmdiff
