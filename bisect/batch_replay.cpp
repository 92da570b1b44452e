#include "bisect/batch_replay.h"

#include <cmath>
#include <cstdio>

#include "compare/paged_kv.h"
#include "dumps/bugs.h"
#include "dumps/errors.h"
#include "dumps/names.h"
#include "dumps/sequences.h"

namespace llmdiff::bisect {

namespace {

std::vector<int64_t> step_tokens(const TensorSource& cand, int seq, int step) {
  const std::string name = sequence_prefix(seq) + step_name(step, "tokens");
  if (!cand.has(name)) throw FormatError(cand.label(), name, "a step of the batch without its tokens");
  return cand.get(name).i;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

// How well a replay reproduces the candidate's diverging names of one sequence.
struct Reproduction {
  int compared = 0, agree = 0;
  double worst = 0;  // largest rmse / threshold
};

Reproduction reproduction(const TensorSource& cand, const TensorSource& hyp, const compare::SequenceBisect& s) {
  Reproduction r;
  const std::string prefix = sequence_prefix(s.seq);
  for (const compare::TensorComparison& t : s.result.global.tensors) {
    if (t.pass) continue;
    const std::string name = prefix + t.name;
    if (!hyp.has(name)) continue;
    const TensorData h = hyp.get(name), c = cand.get(name);
    r.compared++;
    if (h.shape != c.shape) continue;
    if (h.is_int || c.is_int) {
      if (h.is_int && c.is_int && h.i == c.i) r.agree++;
      continue;
    }
    double se = 0, ss = 0;
    for (size_t i = 0; i < h.f.size(); ++i) {
      const double d = double(h.f[i]) - c.f[i];
      se += d * d;
      ss += double(c.f[i]) * c.f[i];
    }
    const double n = double(std::max<size_t>(h.f.size(), 1));
    const double err = std::sqrt(se / n), scale = std::sqrt(ss / n);
    const double threshold = t.judgement.metric == "rmse vs float64" && std::isfinite(t.judgement.threshold) &&
                                     t.shape_match
                                 ? 2.0 * t.judgement.threshold
                                 : 1e-5 * scale + 1e-6;
    if (!std::isfinite(err)) continue;
    r.worst = std::max(r.worst, err / threshold);
    if (err <= threshold) r.agree++;
  }
  return r;
}

}  // namespace

impl::BatchSchedule schedule_of(const TensorSource& cand) {
  impl::BatchSchedule sc;
  const std::vector<int> seqs = dump_sequences(cand);
  if (cand.has("iter0.seqs")) {
    for (int n = 0; cand.has("iter" + std::to_string(n) + ".seqs"); ++n) {
      std::vector<impl::BatchCall> calls;
      for (const auto& [seq, step] : iteration_members(cand, n)) calls.push_back({seq, step_tokens(cand, seq, step)});
      sc.iterations.push_back(std::move(calls));
    }
  } else {
    for (int b : seqs)
      for (int step = 0; cand.has(sequence_prefix(b) + step_name(step, "tokens")); ++step)
        sc.iterations.push_back({{b, step_tokens(cand, b, step)}});
  }
  // Prompt: the calls before the last (generated - 1) ones, which each fed a generated token.
  for (int b : seqs) {
    std::vector<int64_t> lengths;
    for (int step = 0; cand.has(sequence_prefix(b) + step_name(step, "tokens")); ++step)
      lengths.push_back(int64_t(step_tokens(cand, b, step).size()));
    const std::string gen = sequence_prefix(b) + "generated";
    const int64_t g = cand.has(gen) ? cand.shape(gen).empty() ? 0 : cand.shape(gen)[0] : 0;
    const int64_t prompt_calls = g > 0 ? std::max<int64_t>(int64_t(lengths.size()) - (g - 1), 0) : int64_t(lengths.size());
    int64_t len = 0;
    for (int64_t k = 0; k < prompt_calls; ++k) len += lengths[size_t(k)];
    if (size_t(b) >= sc.prompt_len.size()) sc.prompt_len.resize(size_t(b) + 1, 0);
    sc.prompt_len[size_t(b)] = len;
  }
  return sc;
}

std::shared_ptr<const TensorSource> clean_batch_replay(const ModelOracles& m, const TensorSource& cand,
                                                      std::string* why) {
  const ModelConfig& c = m.model.config;
  if (c.mla.enabled || c.moe.enabled()) {
    *why = "the continuous-batching engine runs dense GQA models";
    return nullptr;
  }
  for (const auto& [key, value] : cand.manifest().extra)
    if (key == "precision" || key.rfind("sampling", 0) == 0 || key.rfind("padding", 0) == 0) {
      *why = "the candidate declares '" + key + "', which the clean continuous-batching replay does not make";
      return nullptr;
    }
  const compare::KvCacheLayout layout = compare::manifest_kv_cache(cand.manifest(), cand.label());
  impl::BatchEngineOptions o;
  o.threads = m.threads;
  o.block_size = layout.kind == "paged" && layout.block_size > 0 ? layout.block_size : 16;
  auto clean = std::make_shared<MemoryDump>("impl continuous batching (clean), the candidate's schedule");
  clean->spill();
  clean->set_filter(cand.names());
  try {
    impl::BatchEngine(m.model, o).replay(schedule_of(cand), *clean);
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
  if (d.bug || s.result.ok() || m.model.config.mla.enabled || m.model.config.moe.enabled()) return;
  const impl::BatchSchedule schedule = schedule_of(cand);
  const compare::KvCacheLayout layout = compare::manifest_kv_cache(cand.manifest(), cand.label());
  std::vector<std::string> record;
  for (const compare::TensorComparison& t : s.result.global.tensors)
    if (!t.pass) record.push_back(sequence_prefix(s.seq) + t.name);
  if (record.empty()) return;
  std::vector<std::pair<const zoo::BugInfo*, Reproduction>> fits;
  std::string tried;
  for (const zoo::BugInfo* info : zoo::batch_bugs()) {
    impl::BatchEngineOptions o;
    o.threads = m.threads;
    o.block_size = layout.kind == "paged" && layout.block_size > 0 ? layout.block_size : 16;
    o.bugs = {zoo::BugSpec{info->bug, std::nullopt}};
    MemoryDump hyp("impl continuous batching --inject " + std::string(info->name));
    hyp.set_filter(record);
    try {
      impl::BatchEngine(m.model, o).replay(schedule, hyp);
    } catch (const UsageError&) {
      continue;  // the schedule cannot run with this bug (e.g. beyond the model's positions)
    }
    const Reproduction r = reproduction(cand, hyp, s);
    tried += std::string(tried.empty() ? "" : "; ") + info->name + " " + std::to_string(r.agree) + "/" +
             std::to_string(r.compared);
    if (r.compared > 0 && r.agree == r.compared) fits.push_back({info, r});
  }
  if (fits.empty()) {
    d.evidence += "; replaying the batch's " + std::to_string(schedule.iterations.size()) +
                  " engine iterations with each batch bug reproduces none of them (diverging names reproduced: " +
                  tried + ")";
    return;
  }
  const auto& [info, r] = fits.front();
  d.bug = compare::Hypothesis{info->name, std::nullopt};
  d.description = info->description;
  d.basis = "batch replay";
  d.ambiguous.clear();
  for (size_t k = 1; k < fits.size(); ++k) d.ambiguous.push_back(fits[k].first->name);
  d.evidence = "replaying the batch's " + std::to_string(schedule.iterations.size()) +
               " engine iterations through the continuous-batching engine with " + info->name + " reproduces seq" +
               std::to_string(s.seq) + "'s " + std::to_string(r.compared) + " diverging names (worst " +
               num(r.worst) + " of the agreement threshold); per bug: " + tried;
}

}  // namespace llmdiff::bisect
