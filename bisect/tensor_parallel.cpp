// Bisecting a tensor-parallel candidate (bisect/tensor_parallel.h).
#include "bisect/tensor_parallel.h"

#include <cmath>
#include <set>

#include "compare/paged_kv.h"
#include "compare/tensor_parallel.h"
#include "dumps/base/errors.h"
#include "dumps/contract/sequences.h"
#include "impl/batch_engine.h"
#include "impl/impl_engine.h"

namespace llmdiff::bisect {

namespace {

// Records the canonical names `wanted` of every rank (the replicated ones
// under rank0.) into a dump of rank names.
class RankRecorder final : public Observer {
 public:
  RankRecorder(MemoryDump& out, const std::vector<std::string>& wanted)
      : out_(out), wanted_(wanted.begin(), wanted.end()) {}
  bool wants(const std::string& n) const override { return wanted_.count(canonical(n)) > 0; }
  void on_f32(const std::string& n, const Shape& s, const float* d) override { out_.on_f32(ranked(n), s, d); }
  void on_i64(const std::string& n, const Shape& s, const int64_t* d) override { out_.on_i64(ranked(n), s, d); }

 private:
  static std::string canonical(const std::string& n) {
    size_t rest = 0;
    return rank_of(n, &rest) >= 0 ? n.substr(rest) : n;
  }
  static std::string ranked(const std::string& n) { return rank_of(n) >= 0 ? n : rank_prefix(0) + n; }
  MemoryDump& out_;
  std::set<std::string> wanted_;
};

// Whether a replay reproduces every name that diverges in `r`, and how well.
struct Reproduction {
  int compared = 0, agree = 0;
  double worst = 0;  // largest rmse / threshold
};

Reproduction reproduction(const TensorSource& cand, const TensorSource& hyp, const std::string& prefix,
                          const compare::BisectResult& r) {
  Reproduction out;
  for (const compare::TensorComparison& t : r.global.tensors) {
    if (t.pass || !hyp.has(prefix + t.name) || !cand.has(prefix + t.name)) continue;
    const compare::Agreement a = compare::agreement(hyp.get(prefix + t.name), cand.get(prefix + t.name), &t, r.dtype);
    out.compared++;
    out.agree += a.agree;
    if (std::isfinite(a.rmse) && a.threshold > 0) out.worst = std::max(out.worst, a.rmse / a.threshold);
  }
  return out;
}

}  // namespace

std::shared_ptr<const RankView> rank_replay(const ModelOracles& m, const RankView& cand,
                                            const std::optional<zoo::BugSpec>& bug,
                                            const std::vector<std::string>& wanted) {
  const Manifest& manifest = cand.manifest();
  const PrecisionProfile precision = PrecisionProfile::from_manifest(manifest.extra, cand.label());
  auto raw = std::make_shared<MemoryDump>(std::string("impl over ") + std::to_string(cand.ranks()) + " ranks" +
                                          (bug ? " --inject " + bug->str() : std::string(" (clean)")));
  raw->spill();
  RankRecorder record(*raw, wanted);
  if (!dump_sequences(cand).empty()) {
    // A several-sequence candidate: its schedule through the continuous-batching engine.
    for (const auto& [key, value] : manifest.extra)
      if (key.rfind("sampling", 0) == 0 || key.rfind("padding", 0) == 0)
        throw UsageError("the candidate declares '" + key + "', which the continuous-batching replay over its "
                         "ranks does not make");
    const compare::KvCacheLayout layout = compare::manifest_kv_cache(manifest, cand.label());
    impl::BatchEngineOptions o;
    o.threads = m.threads;
    o.block_size = layout.kind == "paged" && layout.block_size > 0 ? layout.block_size : 16;
    o.precision = precision;
    o.tensor_parallel = cand.ranks();
    if (bug) o.bugs = {*bug};
    impl::BatchEngine(m.model, o).replay(impl::schedule_of(cand), record);
  } else {
    const Scenario sc = replay_scenario(cand);
    impl::ImplOptions o;
    o.threads = m.threads;
    o.release_weights = weight_policy(m.model, m.memory_budget).stream;  // as `dump` holds the checkpoint
    o.precision = precision;
    o.tensor_parallel = cand.ranks();
    if (bug) o.bugs = {*bug};
    int64_t total = 0;  // room for every forward call of the scenario
    for (const auto& s : sc.steps) total += int64_t(s.size());
    o.max_seq = std::max<int64_t>(total + sc.left_pad + sc.decode, m.model.config.max_position_embeddings);
    run_scenario(*impl::make_impl_engine(m.model, o), sc, record);
  }
  raw->mutable_manifest() = manifest;  // the candidate's calls, model and declarations
  raw->mutable_manifest().producer = raw->label();
  raw->mutable_manifest().extra[tensor_parallel_key()] = tensor_parallel_json(cand.ranks());
  return std::shared_ptr<const RankView>(new RankView(*raw, cand.config()),
                                         [raw](const RankView* v) { delete v; });  // the view keeps its dump
}

compare::TensorParallelEvidence rank_evidence(const ModelOracles& m, const RankView& cand, const RankView* clean,
                                              const std::string& prefix, const compare::BisectResult& r) {
  compare::TensorParallelEvidence e;
  compare::judge_ranks(cand, clean, prefix, r.dtype, e);
  if (!e.bug.empty()) return e;
  std::vector<std::string> record;
  for (const compare::TensorComparison& t : r.global.tensors)
    if (!t.pass) record.push_back(prefix + t.name);
  if (record.empty()) return e;
  e.replayed = true;
  for (const zoo::BugInfo* info : zoo::tp_bugs()) {
    if (!zoo::bug_inapplicable_reason(info->bug, m.model.config).empty()) continue;
    std::shared_ptr<const RankView> hyp;
    try {
      hyp = rank_replay(m, cand, zoo::BugSpec{info->bug, std::nullopt}, record);
    } catch (const UsageError&) {
      continue;  // the bug cannot act over these ranks (tp-kv-heads-split with a kv head per rank)
    }
    const Reproduction rep = reproduction(cand, *hyp, prefix, r);
    e.tried += (e.tried.empty() ? "" : "; ") + std::string(info->name) + " " + std::to_string(rep.agree) + "/" +
               std::to_string(rep.compared);
    if (rep.compared == 0 || rep.agree < rep.compared) continue;
    if (e.fits.empty()) {
      e.compared = rep.compared;
      e.worst = rep.worst;
    }
    e.fits.push_back(info->name);
    e.descriptions.push_back(info->description);
  }
  return e;
}

namespace {

std::string ranks_note(const RankView& view, const std::string& clean) {
  return "tensor parallel over " + std::to_string(view.ranks()) +
         " ranks: judged unsharded (heads and columns concatenated in rank order, partial sums added in rank order) "
         "and rank by rank; " + clean;
}

}  // namespace

compare::BisectResult bisect_tensor_parallel(const ModelOracles& m, const TensorSource& cand, BisectOptions opt) {
  const RankView view(cand, m.model.config);
  if (!opt.layers.whole()) throw UsageError("--layers: bisect a tensor-parallel candidate whole");
  std::shared_ptr<const RankView> clean;
  std::string clean_note = "the noise floor's second run is the clean impl over the same ranks";
  if (!opt.clean && (opt.noise_floor || opt.diagnose)) {
    try {
      clean = rank_replay(m, view, std::nullopt, view.names());
      opt.clean = clean;
      if (opt.progress) opt.progress("clean run of the impl over " + std::to_string(view.ranks()) + " ranks");
    } catch (const UsageError& e) {
      clean_note = std::string("the clean impl over its ranks could not replay it: ") + e.what();
    }
  }
  const compare::Gather more = [&](compare::Need need, compare::BisectResult& r) {
    if (need != compare::Need::TensorParallel) return false;
    r.evidence.tensor_parallel = rank_evidence(m, view, clean.get(), "", r);
    if (opt.progress) opt.progress("rank checks");
    return true;
  };
  compare::BisectResult r = bisect_candidate(m, view, opt, more);
  r.notes.push_back(ranks_note(view, clean_note));
  return r;
}

compare::BatchBisect bisect_tensor_parallel_batch(const ModelOracles& m, const TensorSource& cand,
                                                  BisectOptions opt) {
  const RankView view(cand, m.model.config);
  if (!opt.layers.whole()) throw UsageError("--layers: bisect a tensor-parallel candidate whole");
  validate_iterations(view);
  std::shared_ptr<const RankView> clean;
  std::string no_clean;
  if (opt.noise_floor || opt.diagnose) {
    try {
      clean = rank_replay(m, view, std::nullopt, view.names());
      if (opt.progress) opt.progress("clean replay of the batch over " + std::to_string(view.ranks()) + " ranks");
    } catch (const UsageError& e) {
      no_clean = e.what();
    }
  }
  const auto more = [&](int b) -> compare::Gather {
    return [&, b](compare::Need need, compare::BisectResult& r) {
      if (need != compare::Need::TensorParallel) return false;
      r.evidence.tensor_parallel = rank_evidence(m, view, clean.get(), sequence_prefix(b), r);
      return true;
    };
  };
  compare::BatchBisect batch = bisect_batch(m, view, opt, clean, no_clean, more);
  batch.notes.push_back(ranks_note(view, clean ? "the noise floor's second run is the clean continuous-batching "
                                                 "engine over the same ranks"
                                               : "no clean run over its ranks: " + no_clean));
  return batch;
}

}  // namespace llmdiff::bisect
