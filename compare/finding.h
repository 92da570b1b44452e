// The verdict of a bisection: what the result means, as one typed value.
//
// A Finding is made by the ordered explainers of compare/explain.h from the
// evidence a bisection gathered, and every renderer (text, Markdown, HTML,
// JSON, JUnit, `merge`) says it through headline() and explanation() here,
// so that the formats cannot disagree. The JSON object (finding_to_json) is
// read back by finding_from_json (`llmdiff merge` renders the shards' verdict
// from it).
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "compare/layout.h"
#include "compare/local_error.h"
#include "compare/signatures.h"
#include "dumps/model/config.h"

namespace llmdiff::compare {

enum class FindingKind {
  Passes,        // no divergence: nothing to explain
  ZooBug,        // a bug of the zoo, with the basis of its evidence
  Precision,     // not a bug: a precision the candidate should declare
  Layout,        // not a bug: the engine's own layout of the values
  RingWrap,      // not a bug of the model's ops: a ring KV cache that wrapped
  Signature,     // no bug of the zoo: an error signature characterises the divergence
  NothingFits,   // a divergence no explanation fits (the closest, with the numbers)
  NotDiagnosed,  // a divergence whose hypotheses were not tested (--no-diagnose)
};

// What names a bug of the zoo.
enum class BugBasis {
  Replay,          // the scenario re-run with the bug reproduces the candidate
  LocalRecompute,  // the candidate's own inputs through the bug's ops remove every local failure
  Both,            // replay and local recompute
  Fingerprint,     // exact structural evidence alone
  BatchReplay,     // the batch's engine schedule re-run with the batch bug
};

// The precision to declare.
enum class Declaration {
  ComputeDtype,  // manifest "dtype"
  KvCache,       // manifest "precision": {"kv_cache": ...}
  Profile,       // manifest "precision": a whole profile (its JSON)
};

struct Finding {
  FindingKind kind = FindingKind::NothingFits;
  std::string focus;     // the site it is about: the localised site ("" when it passes)
  std::string evidence;  // the numbers behind it, or why nothing fits

  // ZooBug
  Hypothesis bug;
  BugBasis basis = BugBasis::Replay;
  std::string description;             // what the bug does (the zoo's one line)
  std::vector<std::string> ambiguous;  // other hypotheses the evidence supports equally well

  // Precision
  Declaration declare = Declaration::ComputeDtype;
  ComputeDType dtype = ComputeDType::Float32;  // ComputeDtype, KvCache: the type to declare
  std::string profile;                         // Profile: the manifest JSON of the profile

  // Layout: the transform after which every diverging name matches.
  LayoutFinding layout;

  // RingWrap
  int wrap_step = -1;     // the step whose sequence first outgrows the ring
  int64_t capacity = 0;   // the ring's capacity

  // Signature: the decisive signature at the focus.
  ErrorSignature signature;
};

const char* kind_name(FindingKind k);  // "passes", "zoo-bug", "precision", "layout", "kv-ring", ...
const char* bug_basis_name(BugBasis b);        // "replay", "local recompute", "replay + local recompute", ...
const char* declaration_name(Declaration d);   // "dtype", "kv_cache", "profile"

// The bug of the zoo the finding names (a ZooBug); nullopt otherwise.
std::optional<Hypothesis> named_bug(const Finding& f);

// The words every format leads with: "rope-interleaved (evidence: replay)",
// "precision, not a bug: declare bfloat16", "a ring KV cache that wrapped,
// not a bug of the model's ops (capacity 6, at step 2)", "no bug of the zoo
// fits", ...
std::string headline(const Finding& f);
// The evidence, with its numbers.
const std::string& explanation(const Finding& f);
// The `diagnosis.basis` of llmdiff.bisect/1 (kept for compatibility):
// the bug's basis, "precision", "layout", "kv-ring", "signature"; nullopt
// when it passes or nothing fits.
std::optional<std::string> basis_label(const Finding& f);

// {"kind", "headline", "explanation", "focus", ...the kind's own fields}
// (compare/README.md, "finding"); finding_from_json reads it back (throws
// nlohmann::json exceptions on a malformed object).
nlohmann::json finding_to_json(const Finding& f);
Finding finding_from_json(const nlohmann::json& j);

}  // namespace llmdiff::compare
