// Bisection of a several-sequence dump (batched, packed or paged engines;
// docs/DUMP_FORMAT.md "Several sequences"): each sequence is bisected as a
// single-sequence dump of its own (dumps/contract/sequences.h) against the reference
// running that sequence alone. This file orders those results the way the
// engine ran them and says which sequence went wrong first, in which engine
// iteration, and whether the other sequences of that iteration went wrong
// with it (a fault shared by the batch: a leak across sequences, padding,
// packing) or not (a fault of that sequence's own rows). Renderers: table and
// JSON (schema "llmdiff.bisect-batch/1", compare/README.md).
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "compare/bisect_report.h"
#include "compare/bisect_result.h"
#include "compare/sampling_check.h"
#include "dumps/contract/dump.h"

namespace llmdiff::compare {

inline constexpr const char* kBatchBisectSchema = "llmdiff.bisect-batch/1";

struct SequenceBisect {
  int seq = 0;
  BisectResult result;
  std::optional<int> step;       // the step of its first divergence (else of its first local failure)
  std::optional<int> iteration;  // the engine iteration that ran that step (dumps with iter* names)
};

struct BatchBisect {
  std::string candidate_label;
  std::vector<SequenceBisect> sequences;  // ascending seq
  std::optional<size_t> first;            // index of the sequence that went wrong first, in engine order
  // The other sequences of the first one's iteration: those whose first
  // divergence is at or before their step in that iteration, and the rest.
  std::vector<int> iteration_affected, iteration_unaffected;
  // Findings across sequences (a paged cache's block in two live sequences' tables).
  std::vector<std::string> notes;
  // A candidate that samples: every sequence's sampler on its own logits and
  // parameters (compare/sampling_check.h); a failing sampler fails the batch.
  std::optional<SamplingCheck> sampling;
  int exit_code() const;  // 0 when every sequence passes and the sampler (if checked) too, else 1
  const SequenceBisect* first_divergent() const { return first ? &sequences[*first] : nullptr; }
};

// Fills step and iteration of each result and the batch verdict; `cand` is
// the several-sequence dump (its iter* names give the engine order; without
// them the order is sequence by sequence). A paged block reused while its
// sequence still reads it is evidence for the first divergent sequence
// (compare/evidence.h BlockReuse), whose finding is explained again with it.
BatchBisect summarise_batch(const TensorSource& cand, std::vector<SequenceBisect> sequences);

std::string render_batch_table(const BatchBisect& b, const BisectTableOptions& opt = {});
nlohmann::json batch_to_json(const BatchBisect& b);
// JUnit XML: one <testcase> per sequence (and one for the sampler), each
// failure's message the sequence's headline (compare/bisect_result.h).
std::string render_batch_junit(const BatchBisect& b);

}  // namespace llmdiff::compare
