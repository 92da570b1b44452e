// A tensor-parallel candidate judged rank by rank (docs/DUMP_FORMAT.md,
// "Tensor parallelism"; the unsharded view of dumps/contract/ranks.h). The
// bisection runs on the unsharded view like any other; these checks read
// each rank's own tensors and name a bug of the zoo with the rank:
//  - the all-reduce: at each residual (attn_residual after o_proj, out
//    after the MLP/MoE block), rank 0's stream minus the stream entering
//    the block must be the sum of every rank's partial sum (attn.out;
//    mlp.down or moe.out) in rank order. Where it is not, what it is: rank
//    0's own partial sum (the all-reduce is missing) or k times the sum
//    (reduced twice: R times; added twice: 2 times). The candidate's own
//    values only: no run is needed.
//  - the kv heads: with fewer kv heads than ranks each rank's attn.k and
//    attn.v hold the one kv head its query heads read (r*Hkv/R). Each rank's
//    shard is matched against every kv head of a clean run over the same
//    ranks (made from the same inputs: at the first divergence they agree).
// The first check that finds something speaks; a check that finds a wrong
// residual or shard that no bug explains says nothing (the bisection's own
// verdict stands).
#pragma once
#include <optional>
#include <string>

#include "compare/evidence.h"
#include "dumps/contract/ranks.h"
#include "dumps/model/config.h"

namespace llmdiff::compare {

struct RankFinding {
  std::string bug;   // the zoo's
  std::string at;    // the canonical name where it shows (without `prefix`)
  int rank = -1;     // the rank it is about (-1: every rank)
  std::string text;  // what was measured
};

// The first residual (in step, layer order) whose all-reduce is wrong, and
// the bug it fits; nullopt when every one is right, or the first wrong one
// fits no bug. `prefix`: the sequence's "seq{b}." in a several-sequence
// dump, else "". `dtype`: the candidate's compute dtype (its rounding).
std::optional<RankFinding> check_all_reduce(const RankView& cand, const std::string& prefix, ComputeDType dtype);

// With Hkv < R: the first attn.k or attn.v where a rank holds another kv
// head than its query heads read, against `clean` (the same calls over the
// same ranks); nullopt otherwise.
std::optional<RankFinding> check_kv_heads(const RankView& cand, const RankView& clean, const std::string& prefix,
                                          ComputeDType dtype);

// Both checks, the first that finds a bug into `e` (bug, at, rank, text).
void judge_ranks(const RankView& cand, const RankView* clean, const std::string& prefix, ComputeDType dtype,
                 TensorParallelEvidence& e);

}  // namespace llmdiff::compare
