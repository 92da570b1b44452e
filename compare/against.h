// One engine, two configurations: the same requests served by one engine
// under two settings (batch 1 vs N, chunk sizes, prefix cache cold vs warm,
// speculative decoding on vs off, ring vs paged cache, ...), each side
// already bisected against the float64 truth with its own noise floor
// (bisect/against.h runs that). This file pairs the two sides' sequences by
// their prompts and gives each pair one verdict:
//
//  - legitimate: both sides within their noise floors. Then the first place
//    where the two differ at all (bit for bit), in the order of (position,
//    layer, site), the largest difference as a multiple of the noise-floor
//    threshold of its name (the RMSE of A - B over the place against the
//    RMSE an honest run may reach there), and a greedy flip (the `generated` tokens
//    differ) settled by the float64 margin between the two tokens as a
//    near-tie;
//  - a bug in A, in B, or in both: the side that fails its bisection, said
//    with its own headline (compare/bisect_result.h), or a greedy flip
//    beyond the rounding noise (the side whose token is the lower in
//    float64).
//
// The two sides' forward calls may be cut differently (chunks, verify calls
// of k + 1 rows, prefix-cache hits), so values are compared per position:
// row t of a call is position P + t (docs/DUMP_FORMAT.md, "Serving
// features"). Renderers: compare/against_report.h.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "compare/batch_report.h"
#include "compare/bisect_result.h"
#include "compare/sampling_check.h"
#include "dumps/contract/dump.h"

namespace llmdiff::compare {

// One forward call of a sequence, placed on its positions.
struct PlacedCall {
  int step = 0;
  int64_t start = 0;   // P: positions the cache held before the call
  int64_t tokens = 0;  // T
  int64_t kept = 0;    // rows kept: T, or 1 + spec.accepted for a speculative verify call (the rest rolled back)
  int64_t end() const { return start + tokens; }  // S
};

// Where a sequence's calls put their rows, and its tokens by position.
struct SequenceTimeline {
  int64_t cached_prefix = 0;        // H: positions served from a prefix cache (step0.kv.cached_prefix)
  std::vector<PlacedCall> calls;      // by step
  std::vector<int64_t> tokens;      // the token at each position after every call (rolled-back ones dropped)
  std::vector<int64_t> generated;   // its `generated` (empty when it has none)
  int64_t prompt_length = 0;        // positions before its first generated token
  std::vector<int64_t> prompt() const;
};

// The timeline of a single-sequence dump (or a sequence's view): P of step
// 0 is the cached prefix's length, each later P the previous P + T, or
// P + 1 + accepted after a verify call (step{n}.spec.accepted). The prompt
// is what precedes the first generated token: the tokens up to the last
// position minus the generated tokens fed back (every one but the last).
// Throws FormatError naming the tensor when the bookkeeping is malformed.
SequenceTimeline sequence_timeline(const TensorSource& seq);

// The float64 logits after feeding `tokens` from an empty cache (the
// reference's next_logits in float64), for a greedy flip's margin. Made by
// the caller that has the model (bisect/against.h); may be empty.
using TruthLogits = std::function<std::vector<float>(const std::vector<int64_t>& tokens)>;

// One side as bisected: each sequence (one, seq 0, for a single-sequence
// dump) with the single-sequence view its bisection read (the names of its
// result are the view's) and that bisection.
struct AgainstSideInput {
  std::string label;
  bool several = false;                     // a several-sequence dump (seq{b}. names)
  std::vector<const TensorSource*> views;   // per sequence, the same order as `sequences`
  std::vector<SequenceBisect> sequences;
  std::vector<std::string> notes;           // its bisection's notes across sequences, and how it was read
  std::optional<SamplingCheck> sampling;    // a several-sequence dump that samples: every sequence's sampler
};

struct AgainstSequence {
  SequenceBisect bisect;          // seq, its bisection, its step and iteration of divergence
  std::vector<int64_t> prompt;
  int64_t cached_prefix = 0;      // positions its dump served from a prefix cache
  int calls = 0;                  // its forward calls as bisected (a replayed cached prefix is one)
  int64_t positions = 0;          // the sequence's length after its last call
  std::vector<int64_t> generated;
  bool ok() const { return bisect.result.exit_code() == 0; }
};

struct AgainstSide {
  std::string label;
  bool several = false;
  std::vector<AgainstSequence> sequences;
  std::vector<std::string> notes;
  std::optional<SamplingCheck> sampling;
  bool sampler_fails() const { return sampling && sampling->verdict == SamplingCheck::Verdict::Fail; }
};

enum class PairVerdict { Legitimate, BugInA, BugInB, BugInBoth };
const char* verdict_name(PairVerdict v);  // "legitimate", "bug-in-a", "bug-in-b", "bug-in-both"

// One place both sides computed: a row of a per-token site at one position,
// or a whole tensor that is not per token (caches, last_hidden,
// next_logits) of calls of both sides that end at the same position.
struct PlaceDiff {
  int64_t position = 0;
  int layer = -1;                  // -1: a site outside the layers
  std::string site;
  std::string name_a, name_b;      // the tensors holding it (names of each side's sequence view)
  int64_t row_a = -1, row_b = -1;  // their row along the token axis (-1: the whole tensor)
  bool integer = false;
  int64_t count = 0;               // values compared
  int64_t differing = 0;           // values that differ at all (bit patterns)
  double max_abs = 0;              // max |A - B|
  int64_t at = -1;                 // its index within the place's values
  double value_a = 0, value_b = 0; // the values there
  double rmse = 0;                 // sqrt(mean (A - B)^2) over the place (inf: a non-finite value one side lacks)
  // The larger of the two names' noise-floor thresholds (0: none; integers):
  // the RMSE against float64 an honest run of that tensor may reach.
  double threshold = 0;
  double ratio() const;            // rmse / threshold (inf when there is no threshold and they differ)
  std::string where() const;       // "position 5, layers.1.mlp.down"
};

// The sides' greedy tokens differ at generated[index], both sides within
// their floors: the float64 margin between the two tokens at the position
// whose logits picked them.
struct GreedyFlip {
  int64_t index = 0;                 // into generated
  int64_t position = 0;              // the position whose logits picked the token
  int64_t token_a = 0, token_b = 0;
  bool settled = false;              // the float64 logits were made
  double truth_a = 0, truth_b = 0;   // the two tokens' float64 logits
  int64_t truth_argmax = -1;
  double margin = 0;                 // |truth_a - truth_b|
  std::optional<double> noise;       // the larger of the sides' max |logit - float64| over that row (none: no side holds it)
  double allowed = 0;                // 2 x noise + the floor of the logits' scale: a near-tie's largest margin
  bool near_tie = false;
  std::string str() const;           // the flip with its numbers
};

struct SequencePair {
  size_t a = 0, b = 0;               // indices into each side's sequences
  PairVerdict verdict = PairVerdict::Legitimate;
  // Legitimate pairs (both within their floors) only:
  int64_t common_positions = 0;      // positions whose tokens agree on both sides (inputs identical)
  int64_t compared = 0;              // places compared
  int64_t differing = 0;             // places that differ at all
  std::optional<PlaceDiff> first_difference;  // the first in (position, layer, site) order
  std::optional<PlaceDiff> largest;           // the float place of the largest rmse / threshold
  std::optional<GreedyFlip> flip;
  std::vector<std::string> notes;    // places not comparable, a sampled run's draws, ...
  bool bug_in_a() const { return verdict == PairVerdict::BugInA || verdict == PairVerdict::BugInBoth; }
  bool bug_in_b() const { return verdict == PairVerdict::BugInB || verdict == PairVerdict::BugInBoth; }
};

struct AgainstResult {
  std::string model;
  AgainstSide a, b;
  std::vector<SequencePair> pairs;   // in A's order
  std::vector<size_t> only_a, only_b;  // sequences one side holds (indices into its sequences)
  std::vector<std::string> notes;
  int bugs() const;                  // pairs that are not legitimate
  // 0 when every pair is legitimate (and no side's sampler fails), else 1.
  int exit_code() const;
};

// Pairs the sides' sequences by their prompts (in each side's order when a
// prompt repeats) and judges each pair. `truth` settles greedy flips (may
// be empty: a flip is then reported unsettled). Throws UsageError when no
// sequence of A has a prompt that B holds.
AgainstResult pair_against(AgainstSideInput a, AgainstSideInput b, const TruthLogits& truth = {});

// The verdict of one pair in one line, as every format says it:
// "legitimate: ...", "a bug in B: <B's bisection headline>", ...
std::string headline(const AgainstResult& r, const SequencePair& p);
// The verdict of the whole comparison: the first pair with a bug, else
// what every pair shares.
std::string headline(const AgainstResult& r);
// "seq2 (A) / seq0 (B)" for a pair.
std::string pair_label(const AgainstResult& r, const SequencePair& p);

}  // namespace llmdiff::compare
