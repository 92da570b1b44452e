// The passes of a bisection (bisect/schedule.h), stage by stage:
// run_passes (the reference runs, the clean run, the candidate's local
// recompute, in thread lanes), compare, check_weights_dtype, judge_locally,
// note_findings, then the explainers with the diagnosis gathered on demand.
#include "bisect/schedule.h"

#include <algorithm>
#include <future>

#include "bisect/ggml_rounding.h"
#include "compare/cross_signatures.h"
#include "compare/heatmap.h"
#include "compare/noise_floor.h"
#include "compare/paged_kv.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sites.h"

namespace llmdiff::bisect {

using compare::BisectResult;
using compare::HypothesisRunner;
using compare::LocalOracle;
using compare::Recomputed;
using Done = std::function<void(const std::string&)>;

namespace {

// `mine` on this thread while `other` runs on a thread of its own; returns
// other's result. An exception of either is thrown once both are done.
template <class Mine, class Other>
auto beside(Mine&& mine, Other&& other) {
  auto theirs = std::async(std::launch::async, std::forward<Other>(other));
  try {
    mine();
  } catch (...) {
    theirs.wait();
    throw;
  }
  return theirs.get();
}

// The whole-run dumps every bisection starts from.
struct Passes {
  std::shared_ptr<MemoryDump> ref;              // the reference at the candidate's dtype
  std::shared_ptr<MemoryDump> truth;            // the reference in float64 (noise floor)
  std::shared_ptr<const TensorSource> clean;    // the clean hypothesis engine (may be null)
  std::unique_ptr<Recomputed> cand_local;       // the candidate recomputed in float64 (may be null)
  std::string clean_failed;                     // why the clean run could not be made
};

// The clean hypothesis run (a second honest implementation for the noise
// floor, and the baseline of the diagnosis), the reference at the
// candidate's dtype, the float64 truth and the candidate's local recompute.
// Alone, the clean run goes first (the BLAS threads of the reference runs
// would compete with its own). Independent passes run side by side, each on
// part of the cores, when the runners can be split (on 2 cores a pass alone
// leaves one idle through its serial work): in two lanes of two passes when
// all four are made, else in pairs (the clean run beside the reference at
// the candidate's dtype, the float64 truth beside the local recompute).
Passes run_passes(const TensorSource& cand, const BisectResult& r, const std::vector<std::string>& wanted,
                  const ReferenceRunner& reference, const LocalOracle* oracle, const HypothesisRunner* hypotheses,
                  const BisectOptions& opt, const Done& done) {
  Passes p;
  p.clean = opt.clean;
  const int threads = reference.threads();
  const int half = threads / 2, rest = threads - threads / 2;
  auto run_clean = [&](const HypothesisRunner& h) {
    try {
      p.clean = h.run(compare::Hypothesis{}, r.scenario, cand.names());
    } catch (const Error& e) {
      p.clean_failed = std::string("the clean hypothesis engine could not replay the candidate: ") + e.what();
    }
  };
  const bool make_clean = !p.clean && hypotheses && (opt.noise_floor || opt.diagnose);
  const bool local = opt.local && oracle;
  std::unique_ptr<ReferenceRunner> ref_part = half > 0 ? reference.with_threads(half) : nullptr;
  std::unique_ptr<HypothesisRunner> clean_part = make_clean && ref_part ? hypotheses->with_threads(rest) : nullptr;
  std::unique_ptr<LocalOracle> oracle_part =
      opt.noise_floor && local && ref_part ? oracle->with_threads(half) : nullptr;
  std::unique_ptr<ReferenceRunner> truth_part = oracle_part ? reference.with_threads(rest) : nullptr;
  const std::string ref_phase = std::string("reference run in ") + compute_dtype_name(r.dtype);
  auto run_truth = [&](const ReferenceRunner& runner) {
    p.truth = runner.run(r.scenario, ComputeDType::Float64, wanted);
  };
  if (clean_part && truth_part) {
    // Four passes in two lanes: the clean run then the truth, beside the
    // reference at the candidate's dtype then the local recompute, so that
    // the lanes' work is about even (paired otherwise, the reference's thread
    // would wait for the clean run; docs/PERFORMANCE.md has the figures).
    beside(
        [&] {
          p.ref = ref_part->run(r.scenario, r.dtype, wanted);
          p.cand_local = oracle_part->recompute(cand, ComputeDType::Float64);
        },
        [&] {
          run_clean(*clean_part);
          run_truth(*truth_part);
        });
    done("clean run of the hypothesis engine, then the reference run in float64, beside the " + ref_phase +
         ", then the local recompute of the candidate");
    return p;
  }
  if (clean_part) {
    beside([&] { p.ref = ref_part->run(r.scenario, r.dtype, wanted); }, [&] { run_clean(*clean_part); });
    done("clean run of the hypothesis engine beside the " + ref_phase);
  } else {
    if (make_clean) {
      run_clean(*hypotheses);
      if (p.clean_failed.empty()) done("clean run of the hypothesis engine");
    }
    p.ref = reference.run(r.scenario, r.dtype, wanted);
    done(ref_phase);
  }
  if (truth_part) {
    p.cand_local = beside([&] { run_truth(*truth_part); },
                          [&] { return oracle_part->recompute(cand, ComputeDType::Float64); });
    done("reference run in float64 beside the local recompute of the candidate");
  } else if (opt.noise_floor) {
    run_truth(reference);
    done("reference run in float64");
  }
  return p;
}

// A float32 candidate that diverges, judged again at the dtype its weights
// are stored in (an engine rounding its matmul inputs to it): first the
// first divergent name alone (the reference computes only what it needs;
// when it fails as 16-bit too, the whole comparison would, and the 16-bit
// run of every name is not made), then every name; and, where it diverges
// as float32, the candidate's error against the 16-bit run's.
compare::WeightsDtypeCheck check_weights_dtype(const TensorSource& cand, const BisectResult& r, ComputeDType low,
                                               const ReferenceRunner& reference,
                                               const compare::CompareOptions& co,
                                               const std::shared_ptr<MemoryDump>& truth,
                                               const std::vector<std::string>& wanted) {
  compare::WeightsDtypeCheck c;
  c.dtype = low;
  compare::CompareOptions lo = co;
  lo.explain_layouts = false;
  bool first_fails_too = false;
  if (const compare::TensorComparison* first = r.global.first()) {
    std::shared_ptr<MemoryDump> one = reference.run(r.scenario, low, {first->name});
    auto criterion = std::make_shared<compare::NoiseFloorCriterion>(truth, low);
    criterion->set_reference(one);
    lo.criterion = criterion;
    const compare::DiffResult as_low_first = compare::compare_dumps(*one, cand, lo);
    first_fails_too = !as_low_first.tensors.empty() && as_low_first.failing() > 0;
  }
  if (first_fails_too) return c;
  std::shared_ptr<MemoryDump> at_low = reference.run(r.scenario, low, wanted);
  auto criterion = std::make_shared<compare::NoiseFloorCriterion>(truth, low);
  criterion->set_reference(at_low);
  lo.criterion = criterion;
  c.within_noise = compare::compare_dumps(*at_low, cand, lo).ok();
  std::vector<double> ratios;
  for (const compare::TensorComparison& t : r.global.tensors) {
    if (t.pass || t.is_int || !t.shape_match || ratios.size() >= 64) continue;
    if (!truth->has(t.name) || !at_low->has(t.name)) continue;
    const TensorData tr = truth->get(t.name), lw = at_low->get(t.name), cd = cand.get(t.name);
    if (tr.shape != cd.shape || lw.shape != cd.shape) continue;
    const double low_err = compare::rmse(lw.f.data(), tr.f.data(), tr.numel());
    if (low_err > 0) ratios.push_back(compare::rmse(cd.f.data(), tr.f.data(), tr.numel()) / low_err);
  }
  std::sort(ratios.begin(), ratios.end());
  if (!ratios.empty()) c.median_ratio = ratios[ratios.size() / 2];
  return c;
}

// What the local verdicts leave behind for the diagnosis: the reference's
// ops on the candidate's inputs and the clean run's local noise, both made
// on demand.
struct LocalState {
  std::optional<compare::RefOnDemand> ref_ops;
  compare::SecondNoise second_local;
};

// cand_local: the candidate's sites recomputed in float64 from its own
// inputs; ref_ops: the same sites by the reference's ops at the candidate's
// dtype, from the same inputs, made where a verdict needs them. The
// reference's local noise at a site is ref_ops against cand_local: the
// rounding the reference makes on the very inputs judged.
void judge_locally(const TensorSource& cand, const WindowSource* view, const LocalOracle* oracle, Passes& p,
                   const std::vector<std::string>& sites, BisectResult& r, LocalState& st, const Done& done) {
  const Done* progress = &done;
  if (!p.cand_local) {
    p.cand_local = oracle->recompute(cand, ComputeDType::Float64);
    done("local recompute of the candidate");
  }
  const ComputeDType dtype = r.dtype;
  st.ref_ops.emplace([&cand, progress, oracle, dtype](const std::vector<std::string>& names) {
    std::unique_ptr<Recomputed> made = oracle->recompute(cand, dtype, nullptr, &names);
    (*progress)(std::string("the reference's ops in ") + compute_dtype_name(dtype) + " on the candidate's inputs at " +
                std::to_string(names.size()) + " sites");
    return made;
  });
  // The clean run's own local noise: the candidate's recompute when the
  // candidate is that run, else the clean run recomputed at the sites whose
  // verdict needs it (those failing on the reference's noise). A shard's
  // run also reads the candidate's inputs (tokens, the boundary).
  const std::shared_ptr<const TensorSource> clean = p.clean;
  if (clean.get() == &cand) {
    st.second_local = compare::SecondNoise(compare::local_noise(cand, *p.cand_local));
  } else if (clean) {
    auto fill = [&cand, progress, clean, view, oracle](const std::vector<std::string>& names) {
      const compare::SubsetSource subset(*clean, cand.names());
      const std::unique_ptr<Recomputed> own =
          view ? oracle->recompute(WithShardInputs(subset, *view), ComputeDType::Float64, nullptr, &names)
               : oracle->recompute(subset, ComputeDType::Float64, nullptr, &names);
      compare::LocalNoise n = compare::local_noise(subset, *own);
      (*progress)("local recompute of the clean run at " + std::to_string(names.size()) + " sites");
      return n;
    };
    st.second_local = compare::SecondNoise(fill);
  }
  r.local = compare::judge_local(cand, *p.cand_local, nullptr, p.cand_local.get(), r.dtype, sites,
                                 clean ? &st.second_local : nullptr, &*st.ref_ops);
  done("local verdicts at " + std::to_string(r.local.sites.size()) + " sites");
  // Step tokens are the run's inputs; sample.* the sampler's (judged by
  // compare/sampling_check.h); kv.* a paged cache's bookkeeping (checked
  // by compare/paged_kv.h); rows the list of a row subset (dumps/contract/rows.h).
  std::vector<std::string> missing;
  for (const auto& n : r.local.not_recomputed) {
    const std::string site = parse_name(n).site;
    if (site != site_name(Site::Tokens) && site != site_name(Site::Rows) && n.find("sample.") == std::string::npos &&
        n.find(".kv.") == std::string::npos)
      missing.push_back(n);
  }
  if (!missing.empty())
    r.notes.push_back(std::to_string(missing.size()) +
                      " candidate names have no local recompute (their inputs are not in the dump and cannot be "
                      "derived), e.g. " + missing.front());
}

// Findings that are notes whatever the verdict: the first non-finite values
// the reference does not have, a paged cache's bookkeeping, a ring cache
// that wraps (also evidence for the explainers), a 16-bit KV cache.
void note_findings(const TensorSource& cand, BisectResult& r) {
  for (const compare::TensorComparison& t : r.global.tensors)
    if (t.metrics.cand_nonfinite.total() > t.metrics.ref_nonfinite.total()) {
      r.notes.push_back("the candidate's first non-finite values are at " + t.name + ": " +
                        compare::nonfinite_words(t.metrics.cand_nonfinite, t.cand_shape) + " (the reference has " +
                        std::to_string(t.metrics.ref_nonfinite.total()) + ")");
      break;
    }
  for (const compare::PagedKvFinding& f : compare::check_paged_sequence(cand))
    r.notes.push_back("paged KV cache (" + f.kind + "), " + f.text);
  r.evidence.ring = compare::ring_wrap(cand);
  if (r.evidence.ring) r.notes.push_back(r.evidence.ring->text);
  if (r.local.ran) r.evidence.kv_cache = kv_cache_rounding(r.local);
}

// bisect() of `cand` (a shard's view of the candidate when `view` is set).
BisectResult bisect_source(const TensorSource& cand, const WindowSource* view, const LayerWindow& window,
                           const ReferenceRunner& reference, const LocalOracle* oracle,
                           const HypothesisRunner* hypotheses, const BisectOptions& opt, const compare::Gather& more) {
  const Done done = [&](const std::string& what) {
    if (opt.progress) opt.progress(what);
  };
  BisectResult r;
  r.candidate_label = cand.label();
  r.model = cand.manifest().model;
  r.scenario = replay_scenario(cand);
  r.scenario.layers = window;
  r.scenario.emit_generated = r.scenario.emit_generated && window.finishes();  // the greedy picks need the head
  r.layers = window;
  r.dtype = compare::candidate_dtype(cand, &r.dtype_source);
  r.reference = reference.describe();
  // The reference records what the candidate holds, plus the logits the
  // fingerprints read.
  std::vector<std::string> wanted = cand.names();
  if (window.finishes()) {
    wanted.push_back("step*." + std::string(site_name(Site::Logits)));
    wanted.push_back("step*." + std::string(site_name(Site::NextLogits)));
  }
  Passes p = run_passes(cand, r, wanted, reference, oracle, hypotheses, opt, done);
  if (!p.clean_failed.empty()) r.notes.push_back(p.clean_failed);
  compare::CompareOptions co = opt.compare;
  co.dtype = r.dtype;
  if (opt.noise_floor) {
    auto criterion = std::make_shared<compare::NoiseFloorCriterion>(p.truth, r.dtype, p.clean);
    criterion->set_reference(p.ref);
    criterion->set_candidate(&cand);
    co.criterion = criterion;
    r.noise_floor = true;
    if (p.clean) r.second_noise = p.clean->label();
  }
  r.global = compare::compare_dumps(*p.ref, cand, co);
  done("comparison");
  if (opt.noise_floor && !r.global.ok() && r.dtype == ComputeDType::Float32)
    if (const std::optional<ComputeDType> low = reference.weights_dtype()) {
      r.evidence.weights_dtype = check_weights_dtype(cand, r, *low, reference, co, p.truth, wanted);
      done(std::string("comparison at the weights' dtype (") + compute_dtype_name(*low) + ")");
    }
  co.criterion.reset();  // the float64 truth (a dump's worth of memory) is not needed any more
  p.truth.reset();

  LocalState st;
  if (opt.local && oracle) judge_locally(cand, view, oracle, p, co.sites, r, st, done);
  compare::note_routing_flips(r);
  note_findings(cand, r);

  const LocalOracle* diagnosis_oracle = opt.local ? oracle : nullptr;
  const compare::Gather gather = [&](compare::Need need, BisectResult& res) {
    if (need != compare::Need::Diagnosis) return more ? more(need, res) : false;
    if (!opt.diagnose) return false;
    compare::DiagnoseInputs in;
    in.cand = &cand;
    in.ref = p.ref.get();
    in.global = &res.global;
    in.local = &res.local;
    in.oracle = diagnosis_oracle;
    in.local_ref = st.ref_ops ? &*st.ref_ops : nullptr;
    in.cand_local = p.cand_local.get();
    in.second_local = p.clean && st.ref_ops ? &st.second_local : nullptr;
    in.runner = hypotheses;
    in.clean = p.clean.get();
    in.scenario = res.scenario;
    in.dtype = res.dtype;
    in.sites = co.sites;
    in.progress = opt.progress;
    res.diagnosis = compare::diagnose(in);
    res.diagnosis.signatures = compare::signatures_at(compare::signature_sites(res), cand, *p.ref, diagnosis_oracle);
    // Where the error is among the names, after what each name's values look like.
    if (const std::optional<std::string> at = res.localised_at())
      for (compare::ErrorSignature& s : compare::cross_name_signatures(*at, res.local, res.global, res.scenario))
        res.diagnosis.signatures.push_back(std::move(s));
    res.evidence.diagnosed = true;
    done("diagnosis: error signatures");
    return true;
  };
  // Nothing diverges: the diagnosis is empty and costs nothing, and is made
  // all the same, so that every diagnosed bisection reports its phase.
  if (!r.localised_at() && gather(compare::Need::Diagnosis, r)) r.evidence.gathered.push_back(compare::Need::Diagnosis);
  compare::explain(r, gather);
  if (const std::optional<std::string> at = r.localised_at()) r.heatmap = compare::error_heatmap(*at, *p.ref, cand);
  if (!r.heatmap) r.heatmap = r.global.heatmap;
  return r;
}

}  // namespace

BisectResult bisect(const TensorSource& cand, const ReferenceRunner& reference, const LocalOracle* oracle,
                    const HypothesisRunner* hypotheses, const BisectOptions& opt, const compare::Gather& more) {
  if (opt.layers.whole()) return bisect_source(cand, nullptr, opt.layers, reference, oracle, hypotheses, opt, more);
  if (opt.clean) throw UsageError("bisect: a shard of the layers makes its own clean run");
  LayerWindow window = opt.layers;
  window.boundary = &cand;  // the residual stream entering the shard: the candidate's
  check_boundary(window, cand);
  const WindowSource view(cand, window);
  if (view.names().empty())
    throw UsageError(cand.label() + ": no name of the candidate belongs to layers " + window.str() +
                     " (a shard analyses the names of its layers)");
  return bisect_source(view, &view, window, reference, oracle, hypotheses, opt, more);
}

}  // namespace llmdiff::bisect
