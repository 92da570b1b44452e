// Several sequences in one dump (docs/DUMP_FORMAT.md, "Several sequences"):
// each sequence's names under `seq{b}.` in single-sequence canonical form,
// engine iterations under `iter{N}.`. A SequenceView reads one sequence as
// a single-sequence dump, so that every command that works on one sequence
// (bisect, regress, diff) works on each sequence of a batch.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"

namespace llmdiff {

// "seq{b}."
std::string sequence_prefix(int b);
// b when `name` starts with "seq{b}." (at most 9 digits), else -1; `rest`,
// when given, is set to where the name after the prefix starts.
int sequence_of(const std::string& name, size_t* rest = nullptr);
// The b of every `seq{b}.` prefix in the dump, ascending; empty for a
// single-sequence dump.
std::vector<int> dump_sequences(const TensorSource& d);

// Sequence b of a several-sequence dump as a single-sequence dump: its names
// without the prefix, the model-wide names (rope.inv_freq) as they are, its
// own step count and its own sampling parameters (manifest key
// sampling.seq{b}, else the dump-wide ones). Engine iterations (`iter*`) are
// not part of it. The source must outlive the view.
class SequenceView final : public TensorSource {
 public:
  SequenceView(const TensorSource& source, int b);
  int sequence() const { return b_; }
  const std::string& label() const override { return label_; }
  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> names() const override { return names_; }
  bool has(const std::string& name) const override;
  Shape shape(const std::string& name) const override;
  TensorData get(const std::string& name) const override;

 private:
  std::string full(const std::string& name) const;  // the source's name of `name`, "" when not ours
  const TensorSource& src_;
  int b_;
  std::string label_;
  Manifest manifest_;
  std::vector<std::string> names_;  // canonical order
};

// The engine iteration (iter{N}) that ran step `step` of sequence b; nullopt
// when the dump has no iteration names or none lists it. Throws FormatError
// when an iteration's seqs and seq_steps differ in length.
std::optional<int> engine_iteration(const TensorSource& d, int b, int step);
// Iteration N's sequences with their step in it, in the engine's row order
// (empty when the dump has no iter{N}.seqs).
std::vector<std::pair<int, int>> iteration_members(const TensorSource& d, int iteration);

// Checks the engine iterations against the sequences: iter{N}.seqs,
// seq_steps and num_tokens of one length, every (sequence, step) they name
// present (its step{n}.tokens) with that many tokens, no sequence twice in
// one iteration, each sequence's steps in increasing iterations. Throws
// FormatError naming the iteration tensor.
void validate_iterations(const TensorSource& d);

}  // namespace llmdiff
