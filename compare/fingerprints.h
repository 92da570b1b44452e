// Fingerprints: cheap structural tests of a divergence's pattern, each
// pointing at a bug of the zoo through the registry's signature
// (dumps/zoo/bugs.h): final_norm right and logits wrong -> the head;
// next_logits = the reference's logits row 0; positions restarting at 0; a
// square or all-ones mask; a cache of this call's length; k_rep tiled;
// act = silu(up) * gate; scores a constant multiple; inv_freq of another
// theta or unscaled; q/k/v off by a constant row; and the batch bugs'
// (compare/batch_fingerprints.h). They corroborate a replay, and name the
// bug alone only when decisive and nothing else fits (compare/explain.h).
//
// Each test is one finder of the table `fingerprint_finders()`, run in its
// order; a finder adds at most a few fingerprints.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "compare/compare.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/model/config.h"

namespace llmdiff::compare {

struct Fingerprint {
  Fingerprint(std::string b, std::string e, bool d, std::optional<double> v = std::nullopt)
      : bug(std::move(b)), evidence(std::move(e)), decisive(d), value(v) {}
  std::string bug;       // zoo name
  std::string evidence;  // one line with the numbers
  bool decisive = false; // exact structural evidence (enough to name the bug alone)
  std::optional<double> value;  // a parameter the fingerprint fitted (rope-theta from rope.inv_freq)
};

// What every finder reads.
struct FingerprintScene {
  const TensorSource& cand;
  const TensorSource& ref;          // the reference at the candidate's dtype
  const DiffResult& global;         // candidate vs reference
  const Scenario& scenario;         // the candidate's forward calls
  std::vector<int64_t> past;        // positions cached before each step
  std::optional<ModelConfig> cfg;   // from either manifest's config
  bool failing(const std::string& name) const;  // compared, and fails
  bool passing(const std::string& name) const;  // compared, and passes
  bool fired(const std::string& bug) const;     // an earlier finder pointed at `bug`
  const std::vector<Fingerprint>* found = nullptr;  // what the finders before found
};

using FingerprintFinder = void (*)(const FingerprintScene& s, std::vector<Fingerprint>& out);
struct FingerprintFinderEntry {
  const char* name;  // what it tests
  FingerprintFinder find;
};
// Every finder, in the order they run.
const std::vector<FingerprintFinderEntry>& fingerprint_finders();

// The model config of the first of the two manifests that holds a readable one.
std::optional<ModelConfig> manifest_config(const TensorSource& a, const TensorSource& b);
// Positions cached before each step of `sc`.
std::vector<int64_t> past_lengths(const Scenario& sc);

// The fingerprints that fire on this candidate.
std::vector<Fingerprint> fingerprints(const TensorSource& cand, const TensorSource& ref, const DiffResult& global,
                                      const Scenario& sc);

}  // namespace llmdiff::compare
