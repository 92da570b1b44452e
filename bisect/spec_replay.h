// A sequence decoded speculatively, as a bisection replays it
// (docs/DUMP_FORMAT.md, "Serving features", "Speculative decoding"): a
// verify call feeds the last accepted token and k drafts (T = k + 1,
// step{n}.spec.accepted drafts kept) and keeps the rows 0 .. accepted, the
// rest rolled back, so that the next call starts at P + 1 + accepted. The
// reference decodes one token per call and rolls nothing back: this view
// presents each verify call as the one-token calls of its kept rows, row j
// at position P + j, holding the call's row j of every per-token tensor, its
// caches, repeated keys and values, scores and probabilities cut to the
// P + j + 1 positions that row sees, its last_hidden and next_logits
// (final_norm and logits row j). Every replay then runs exactly the
// positions the engine kept; the rolled-back rows are read by nothing and
// not judged. A verify call's paged bookkeeping (kv.*) and the spec.*
// records are left out of the view (its context length is the whole
// call's).
#pragma once
#include <set>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"

namespace llmdiff::bisect {

// Whether `seq` holds a verify call (a step{n}.spec.accepted).
bool has_verify_calls(const TensorSource& seq);

class SpecSplitView final : public TensorSource {
 public:
  // Throws FormatError on malformed spec.accepted (compare/against.h's
  // timeline), UsageError for a verify call holding a row subset.
  explicit SpecSplitView(const TensorSource& seq);
  const std::string& label() const override { return src_.label(); }
  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> names() const override { return names_; }
  bool has(const std::string& name) const override { return known_.count(name) > 0; }
  Shape shape(const std::string& name) const override { return get(name).shape; }
  TensorData get(const std::string& name) const override;
  // "verify calls 1, 3 split into the one-token calls of their kept rows (steps 1..2, ...)"
  std::string note() const;

 private:
  struct Piece {
    int step = 0;       // the source's step
    int64_t row = -1;   // the kept row of a verify call it holds; -1: the whole call
    int64_t start = 0;  // its position P
    int64_t tokens = 0; // the source call's T
  };
  // The source name of `name` at piece p's step; "" when the source lacks it.
  std::string at_source(const std::string& name, const Piece& p) const;
  const TensorSource& src_;
  std::vector<Piece> pieces_;  // by view step
  Manifest manifest_;
  std::vector<std::string> names_;  // canonical order
  std::set<std::string> known_;
  std::vector<int> verify_steps_;
};

}  // namespace llmdiff::bisect
