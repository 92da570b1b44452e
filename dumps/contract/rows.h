// Row subsets of per-token tensors (docs/DUMP_FORMAT.md, "Row subsets"): a
// step may hold some tensors for only some of its tokens — llama.cpp computes
// the last layer's feed-forward, the final norm and the logits for the output
// tokens only. `step{N}.rows` (I64 [R], ascending) lists those tokens; a
// per-token tensor of that step whose token axis has R entries holds exactly
// them. Readers attach the rows to the tensor (TensorData::rows); whoever
// compares it with a whole tensor takes the same rows of that one.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"

namespace llmdiff {

// The axis of a per-token site that runs over the step's tokens: 0 for
// [T, ...] sites, 1 for head-major ones ([H, T, ...]); nullopt for sites
// that are not per token (caches, repeat_kv, last_hidden, next_logits, ...).
std::optional<int> token_axis(const std::string& site);

// "step3.rows" for "step3.layers.1.out" ("seq1.step3.rows" for a sequence's
// name); empty for a name outside any step.
std::string rows_name_for(const std::string& name);

// Sets t.rows from `src`'s rows of t's step when t's token axis holds R of
// them. Throws FormatError when the rows tensor is malformed (not I64 [R],
// not ascending, negative).
void attach_rows(const TensorSource& src, TensorData& t);

// `full`'s rows `rows` along `axis`.
TensorData select_rows(const TensorData& full, const std::vector<int64_t>& rows, int axis);

// `full` restricted to the rows `part` holds, when `part` holds a subset and
// `full` has every row (more rows than `part` along the token axis, the
// other dims equal); else `full` unchanged.
TensorData rows_like(TensorData full, const TensorData& part);

// A candidate read with the row lists it left out: a step whose per-token
// tensors hold fewer entries along the token axis than the step's tokens,
// all the same number R, all where llama.cpp's output pruning cuts (the last
// layer after its attention's o_proj, and what follows the layers), and no
// step{N}.rows, is read as holding its last R rows (that pruning, written by
// a tool that does not declare the rows): step{N}.rows = [T-R, ..., T-1] is
// added and attached to those tensors, which are then compared with the
// reference's same rows (equal within the floor: a row subset; not: a
// divergence there, as any). Steps that declare their rows, whose shorter
// tensors disagree on R, or that have a shorter tensor elsewhere (an
// attention, an earlier layer: a length finding) are read as they are.
class InferredRowsView final : public TensorSource {
 public:
  explicit InferredRowsView(const TensorSource& src);
  bool inferred() const { return !rows_.empty(); }
  // One line per step whose rows were inferred ("step0: 4 tensors hold the
  // last 1 of the step's 7 rows, without step0.rows: compared as that row subset").
  const std::vector<std::string>& notes() const { return notes_; }
  const std::string& label() const override { return src_.label(); }
  const Manifest& manifest() const override { return src_.manifest(); }
  std::vector<std::string> names() const override { return names_; }
  bool has(const std::string& name) const override;
  Shape shape(const std::string& name) const override;
  TensorData get(const std::string& name) const override;

 private:
  const TensorSource& src_;
  std::map<std::string, std::vector<int64_t>> rows_;  // the inferred step{N}.rows
  std::vector<std::string> names_, notes_;
};

}  // namespace llmdiff
