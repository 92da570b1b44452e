#include "bisect/batch_replay.h"

#include <cmath>
#include <cstdio>

#include "compare/paged_kv.h"
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

// The replaying engine as the candidate's ran: its paged cache's block size
// and precision, and the serving features its schedule uses (a prefix
// cache, speculative verify calls, padded buckets), so that their bugs can
// act in a replay.
impl::BatchEngineOptions replay_options(const ModelOracles& m, const TensorSource& cand,
                                        const impl::BatchSchedule& schedule) {
  const compare::KvCacheLayout layout = compare::manifest_kv_cache(cand.manifest(), cand.label());
  impl::BatchEngineOptions o;
  o.threads = m.threads;
  o.block_size = layout.kind == "paged" && layout.block_size > 0 ? layout.block_size : 16;
  o.precision = PrecisionProfile::from_manifest(cand.manifest().extra, cand.label());
  for (const auto& calls : schedule.iterations)
    for (const impl::BatchCall& c : calls) {
      if (!c.cached_prefix.empty()) o.prefix_cache = true;
      if (c.rollback > 0 || c.verify) o.speculative = "ngram";
    }
  for (int64_t p : schedule.padded_rows)
    if (p > 0) o.bucket = 1;
  return o;
}

}  // namespace

std::shared_ptr<const TensorSource> clean_batch_replay(const ModelOracles& m, const TensorSource& cand,
                                                      std::string* why) {
  for (const auto& [key, value] : cand.manifest().extra)
    if (key.rfind("sampling", 0) == 0 || key.rfind("padding", 0) == 0) {
      *why = "the candidate declares '" + key + "', which the clean continuous-batching replay does not make";
      return nullptr;
    }
  const impl::BatchSchedule schedule = impl::schedule_of(cand);
  const impl::BatchEngineOptions o = replay_options(m, cand, schedule);
  auto clean = std::make_shared<MemoryDump>("impl continuous batching (clean), the candidate's schedule");
  clean->spill();
  clean->set_filter(cand.names());
  try {
    impl::BatchEngine(m.model, o).replay(schedule, *clean);
  } catch (const UsageError& e) {
    *why = e.what();
    return nullptr;
  }
  return clean;
}

std::optional<compare::BatchReplayEvidence> batch_replay_evidence(const ModelOracles& m, const TensorSource& cand,
                                                                  const compare::SequenceBisect& s) {
  if (s.result.ok()) return std::nullopt;
  const impl::BatchSchedule schedule = impl::schedule_of(cand);
  std::vector<std::string> record;
  for (const compare::TensorComparison& t : s.result.global.tensors)
    if (!t.pass) record.push_back(sequence_prefix(s.seq) + t.name);
  if (record.empty()) return std::nullopt;
  compare::BatchReplayEvidence e;
  e.seq = s.seq;
  e.iterations = schedule.iterations.size();
  // Every bug of the zoo that applies: the batch bugs, and the model's
  // (parameterised ones once per value of their grid).
  std::vector<compare::Hypothesis> hypotheses;
  for (const zoo::BugInfo* info : zoo::batch_bugs()) hypotheses.push_back({info->name, std::nullopt});
  for (const compare::Hypothesis& h : m.hypotheses.hypotheses()) hypotheses.push_back(h);
  const bool padded = cand.manifest().extra.count("padding") > 0;
  for (const compare::Hypothesis& h : hypotheses) {
    const zoo::BugInfo* info = zoo::find_bug(h.bug);
    if (!info || (info->needs_padding && !padded)) continue;
    impl::BatchEngineOptions o = replay_options(m, cand, schedule);
    const zoo::Feature f = info->feature;
    if ((f == zoo::Feature::PrefixCache && !o.prefix_cache) || (f == zoo::Feature::Speculative && o.speculative.empty()) ||
        (f == zoo::Feature::BucketPadding && o.bucket == 0))
      continue;  // the candidate does not use the feature the bug acts in
    o.bugs = {zoo::BugSpec{info->bug, h.value}};
    MemoryDump hyp("impl continuous batching --inject " + h.str());
    hyp.set_filter(record);
    try {
      impl::BatchEngine(m.model, o).replay(schedule, hyp);
    } catch (const UsageError&) {
      continue;  // the schedule cannot run with this bug (e.g. beyond the model's positions)
    }
    const Reproduction r = reproduction(cand, hyp, s);
    e.tried += (e.tried.empty() ? "" : "; ") + h.str() + " " + std::to_string(r.agree) + "/" + std::to_string(r.compared);
    if (r.compared > 0 && r.agree == r.compared) {
      if (e.fits.empty()) {
        e.compared = r.compared;
        e.worst = r.worst;
      }
      e.fits.push_back(h.bug);
      e.values.push_back(h.value);
      e.descriptions.push_back(info->description);
    }
  }
  return e;
}

}  // namespace llmdiff::bisect
