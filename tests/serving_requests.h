// Request schedules of the continuous-batching engine under which each
// serving feature (and each of its bugs) acts: shared by the serving tests
// (dump --batch's "PROMPT[@JOIN][:DECODE];..."; with --block-size 4).
#pragma once

namespace llmdiff::testing {

// Two requests with repeated tokens joining at iterations 0 and 1 (an
// n-gram proposer finds continuations; verify calls keep and reject drafts).
inline constexpr const char* kSpecRequests = "1,2,3,4,1,2,3,4,1,2@0:8;5,6,7,5,6,7,5@1:8";
// A third request whose second block of 4 matches the first's and whose first block the second's.
inline constexpr const char* kPrefixStale =
    "2,6,10,14,17,21,25,29,33@0:3;1,5,9,13,40,41,42,43,44@0:3;1,5,9,13,17,21,25,29,50@5:3";
// A request whose prompt matches the first's for 6 positions: a hit ending inside a block.
inline constexpr const char* kPrefixPartial =
    "1,5,9,13,17,21,25,29,33@0:4;2,6,10,14,17,21,25,29,34@3:4;1,5,9,13,17,21,40@4:4";
// Calls of 4, 3 and 2 rows padded to buckets of 8 (with --chunk 4).
inline constexpr const char* kBucket = "1,5,9,13,17@0:4;2,6,10@1:4;3,7@2:3";

}  // namespace llmdiff::testing
