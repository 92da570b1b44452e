#include "compare/serving_fingerprints.h"

#include <algorithm>
#include <string>

#include "compare/signature_finders.h"
#include "dumps/contract/sites.h"
#include "dumps/zoo/bugs.h"

namespace llmdiff::compare {

namespace {

std::string named(zoo::Signature s) { return zoo::bug_with_signature(s).name; }

// The argmax of row r of logits [T, V].
int64_t row_argmax(const TensorData& logits, int64_t r) {
  const int64_t V = logits.shape[1];
  const float* row = &logits.f[size_t(r * V)];
  return int64_t(std::max_element(row, row + V) - row);
}

}  // namespace

int64_t rejected_before(const Scenario& sc, int step) {
  if (step <= 0) return 0;
  const auto r = sc.rollback.find(step - 1);
  return r == sc.rollback.end() ? 0 : r->second;
}

void spec_accepted_miscounted(const FingerprintScene& s, std::vector<Fingerprint>& out) {
  for (const auto& [step, rejected] : s.scenario.rollback) {
    const std::string acc = step_name(step, Site::SpecAccepted), lg = step_name(step, Site::Logits);
    if (!s.failing(acc) || !s.cand.has(lg)) continue;
    const TensorData a = s.cand.get(acc), logits = s.cand.get(lg);
    const std::vector<int64_t>& tokens = s.scenario.steps[size_t(step)];
    const int64_t T = int64_t(tokens.size());
    if (!a.is_int || a.i.size() != 1 || logits.is_int || logits.shape.size() != 2 || logits.shape[0] != T) continue;
    // The drafts the candidate's own logits agree with.
    int64_t agree = 0;
    while (agree + 1 < T && row_argmax(logits, agree) == tokens[size_t(agree + 1)]) ++agree;
    if (a.i[0] != agree + 1) continue;
    out.push_back({named(zoo::Signature::AcceptedMiscounted),
                   acc + " = " + std::to_string(a.i[0]) + " where the candidate's own logits agree with " +
                       std::to_string(agree) + " of its " + std::to_string(T - 1) + " drafts: draft " +
                       std::to_string(agree + 1) + " (token " + std::to_string(tokens[size_t(agree + 1)]) +
                       ") is not the argmax of logits row " + std::to_string(agree) + " (" +
                       std::to_string(row_argmax(logits, agree)) + ")",
                   true});
    return;
  }
}

void spec_rollback_missing(const FingerprintScene& s, std::vector<Fingerprint>& out) {
  for (int step = 1; step < int(s.past.size()); ++step) {
    const int64_t rejected = rejected_before(s.scenario, step);
    const std::string name = step_name(step, Site::Positions);
    if (rejected == 0 || !s.failing(name)) continue;
    const TensorData p = s.cand.get(name);
    if (!p.is_int || p.i.empty() || p.i[0] != s.past[size_t(step)] + rejected) continue;
    out.push_back({named(zoo::Signature::RollbackMissing),
                   name + " starts at " + std::to_string(p.i[0]) + " where the sequence keeps " +
                       std::to_string(s.past[size_t(step)]) + " positions after step " + std::to_string(step - 1) +
                       "'s verify call: its " + std::to_string(rejected) +
                       " rejected drafts were not rolled back",
                   true});
    return;
  }
}

void spec_context_rejected(const FingerprintScene& s, std::vector<Fingerprint>& out) {
  for (int step = 1; step < int(s.past.size()); ++step) {
    const int64_t rejected = rejected_before(s.scenario, step);
    if (rejected == 0) continue;
    const int64_t S = s.past[size_t(step)] + int64_t(s.scenario.steps[size_t(step)].size());
    for (Site site : {Site::Mask, Site::KvContextLen}) {
      const std::string name = step_name(step, site);
      if (!s.cand.has(name)) continue;
      const TensorData t = s.cand.get(name);
      const int64_t read = site == Site::Mask ? (t.shape.size() == 2 ? t.shape[1] : -1)
                                              : (t.is_int && t.i.size() == 1 ? t.i[0] : -1);
      if (read != S + rejected) continue;
      out.push_back({named(zoo::Signature::ContextCountsRejected),
                     name + " covers " + std::to_string(read) + " positions where the sequence holds " +
                         std::to_string(S) + ": the " + std::to_string(rejected) + " drafts step " +
                         std::to_string(step - 1) + "'s verify call rolled back are still in the context length",
                     true});
      return;
    }
  }
}

}  // namespace llmdiff::compare
