#include "bisect/batch_replay.h"

#include <cmath>
#include <cstdio>

#include "compare/paged_kv.h"
#include "compare/signature_finders.h"
#include "dumps/zoo/bugs.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sequences.h"

namespace llmdiff::bisect {

namespace {

// How well a replay reproduces the candidate's diverging names of one
// sequence (compare::agreement, as a diagnosis judges its replays).
struct Reproduction {
  int compared = 0, agree = 0;
  double worst = 0;  // largest rmse / threshold
};

Reproduction reproduction(const TensorSource& cand, const TensorSource& hyp, const compare::SequenceBisect& s) {
  Reproduction r;
  const std::string prefix = sequence_prefix(s.seq);
  for (const compare::TensorComparison& t : s.result.global.tensors) {
    if (t.pass || !hyp.has(prefix + t.name)) continue;
    const compare::Agreement a = compare::agreement(hyp.get(prefix + t.name), cand.get(prefix + t.name), &t,
                                                    s.result.dtype);
    r.compared++;
    r.agree += a.agree;
    if (std::isfinite(a.rmse) && a.threshold > 0) r.worst = std::max(r.worst, a.rmse / a.threshold);
  }
  return r;
}

}  // namespace

std::shared_ptr<const TensorSource> clean_batch_replay(const ModelOracles& m, const TensorSource& cand,
                                                      std::string* why) {
  for (const auto& [key, value] : cand.manifest().extra)
    if (key.rfind("sampling", 0) == 0 || key.rfind("padding", 0) == 0) {
      *why = "the candidate declares '" + key + "', which the clean continuous-batching replay does not make";
      return nullptr;
    }
  const compare::KvCacheLayout layout = compare::manifest_kv_cache(cand.manifest(), cand.label());
  impl::BatchEngineOptions o;
  o.threads = m.threads;
  o.block_size = layout.kind == "paged" && layout.block_size > 0 ? layout.block_size : 16;
  o.precision = PrecisionProfile::from_manifest(cand.manifest().extra, cand.label());
  auto clean = std::make_shared<MemoryDump>("impl continuous batching (clean), the candidate's schedule");
  clean->spill();
  clean->set_filter(cand.names());
  try {
    impl::BatchEngine(m.model, o).replay(impl::schedule_of(cand), *clean);
  } catch (const UsageError& e) {
    *why = e.what();
    return nullptr;
  }
  return clean;
}

void explain_batch_by_replay(const ModelOracles& m, const TensorSource& cand, compare::BatchBisect& b) {
  if (!b.first) return;
  compare::SequenceBisect& s = b.sequences[*b.first];
  compare::Diagnosis& d = s.result.diagnosis;
  if (d.bug || s.result.ok()) return;
  const impl::BatchSchedule schedule = impl::schedule_of(cand);
  const compare::KvCacheLayout layout = compare::manifest_kv_cache(cand.manifest(), cand.label());
  std::vector<std::string> record;
  for (const compare::TensorComparison& t : s.result.global.tensors)
    if (!t.pass) record.push_back(sequence_prefix(s.seq) + t.name);
  if (record.empty()) return;
  // Every bug of the zoo that applies: the batch bugs, and the model's
  // (parameterised ones once per value of their grid).
  std::vector<compare::Hypothesis> hypotheses;
  for (const zoo::BugInfo* info : zoo::batch_bugs()) hypotheses.push_back({info->name, std::nullopt});
  for (const compare::Hypothesis& h : m.hypotheses.hypotheses()) hypotheses.push_back(h);
  const PrecisionProfile precision = PrecisionProfile::from_manifest(cand.manifest().extra, cand.label());
  std::vector<std::pair<compare::Hypothesis, Reproduction>> fits;
  std::string tried;
  for (const compare::Hypothesis& h : hypotheses) {
    const zoo::BugInfo* info = zoo::find_bug(h.bug);
    if (!info || (info->needs_padding && !cand.manifest().extra.count("padding"))) continue;
    impl::BatchEngineOptions o;
    o.threads = m.threads;
    o.block_size = layout.kind == "paged" && layout.block_size > 0 ? layout.block_size : 16;
    o.precision = precision;
    o.bugs = {zoo::BugSpec{info->bug, h.value}};
    MemoryDump hyp("impl continuous batching --inject " + h.str());
    hyp.set_filter(record);
    try {
      impl::BatchEngine(m.model, o).replay(schedule, hyp);
    } catch (const UsageError&) {
      continue;  // the schedule cannot run with this bug (e.g. beyond the model's positions)
    }
    const Reproduction r = reproduction(cand, hyp, s);
    tried += (tried.empty() ? "" : "; ") + h.str() + " " + std::to_string(r.agree) + "/" + std::to_string(r.compared);
    if (r.compared > 0 && r.agree == r.compared) fits.push_back({h, r});
  }
  if (fits.empty()) {
    d.evidence += "; replaying the batch's " + std::to_string(schedule.iterations.size()) +
                  " engine iterations with each bug of the zoo reproduces none of them (diverging names reproduced: " +
                  tried + ")";
    return;
  }
  const auto& [h, r] = fits.front();
  d.bug = h;
  d.description = zoo::find_bug(h.bug)->description;
  d.basis = "batch replay";
  d.ambiguous.clear();
  for (size_t k = 1; k < fits.size(); ++k) d.ambiguous.push_back(fits[k].first.str());
  d.evidence = "replaying the batch's " + std::to_string(schedule.iterations.size()) +
               " engine iterations through the continuous-batching engine with " + h.str() + " reproduces seq" +
               std::to_string(s.seq) + "'s " + std::to_string(r.compared) + " diverging names (worst " +
               compare::sig::num(r.worst) + " of the agreement threshold); per bug: " + tried;
}

}  // namespace llmdiff::bisect
