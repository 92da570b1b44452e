// A sequence served from a prefix cache, as a bisection replays it
// (docs/DUMP_FORMAT.md, "Serving features", "Prefix cache"): its first H
// positions were computed by an earlier request (`step0.kv.cached_prefix`
// [H]), its step 0 holds the tokens after the hit at positions H .., and
// its caches hold all H + T positions. The reference runs the cached prefix
// first, not compared, then the steps: this view presents the sequence so,
// the prefix as a forward call of its own (step 0, its tokens only) and the
// sequence's step n as step n + 1, so that the reference, the float64
// truth, the clean run and the local recompute (which recomputes the
// prefix's caches itself from its tokens, the dump holding none) each
// replay the hit as the format prescribes.
#pragma once
#include <string>
#include <vector>

#include "dumps/contract/dump.h"

namespace llmdiff::bisect {

// Whether `seq` (a single-sequence dump or a sequence's view) was served
// from a prefix cache: it holds step0.kv.cached_prefix.
bool has_prefix_hit(const TensorSource& seq);

class PrefixReplayView final : public TensorSource {
 public:
  // Throws FormatError when step0.kv.cached_prefix is not I64 [H], H > 0.
  explicit PrefixReplayView(const TensorSource& seq);
  const std::string& label() const override { return src_.label(); }
  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> names() const override { return names_; }
  bool has(const std::string& name) const override;
  Shape shape(const std::string& name) const override;
  TensorData get(const std::string& name) const override;
  int64_t prefix_length() const { return int64_t(prefix_.size()); }
  // "its cached prefix of 4 tokens replayed as step 0; the dump's step n is step n + 1 here"
  std::string note() const;

 private:
  std::string source_name(const std::string& name) const;  // "" for the prefix call's tokens and unknown names
  const TensorSource& src_;
  std::vector<int64_t> prefix_;
  Manifest manifest_;
  std::vector<std::string> names_;  // canonical order
};

}  // namespace llmdiff::bisect
