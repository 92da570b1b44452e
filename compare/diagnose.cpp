// The diagnosis loop (compare/diagnose.h): the clean run as the baseline,
// each hypothesis' replay (screened at the first divergent name), the
// parameter search off the grid, local recomputes, the ranking.
#include "compare/diagnose.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>

#include "compare/metrics.h"
#include "compare/parallel.h"
#include "compare/tolerance.h"
#include "dumps/base/errors.h"
#include "dumps/contract/sites.h"

namespace llmdiff::compare {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

// Share of the diverging names a hypothesis run must reproduce (and of all
// names it must agree on) to count as supported.
constexpr double kReplaySupport = 0.9;
// A hypothesis run agrees with the candidate at a name when their RMSE is
// within this many noise-floor thresholds: two honest implementations differ
// by about sqrt(2) times one's rounding noise.
constexpr double kReplayAgreeFactor = 2.0;
// ... and, at a diverging name, within this fraction of the clean model's
// RMSE against the candidate (the hypothesis must explain the divergence,
// not merely sit within the noise of a small one).
constexpr double kBeatClean = 0.5;

std::string num(double v) {
  char buf[32];
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (std::isnan(v)) return "nan";
  std::snprintf(buf, sizeof buf, "%.2g", v);
  return buf;
}

// The threshold at which a hypothesis run agrees with the candidate at
// `name`: kReplayAgreeFactor x the global noise-floor threshold when the
// diff was judged by the noise floor, else nullopt (then allclose decides).
std::optional<double> agree_threshold(const TensorComparison* cmp) {
  if (!cmp || cmp->judgement.metric != "rmse vs float64" || !std::isfinite(cmp->judgement.threshold)) return std::nullopt;
  return kReplayAgreeFactor * cmp->judgement.threshold;
}

}  // namespace

Agreement agreement(const TensorData& hyp, const TensorData& cand, const TensorComparison* cmp, ComputeDType dtype) {
  Agreement a;
  if (hyp.shape != cand.shape) return a;
  if (hyp.is_int && cand.is_int) {
    a.agree = hyp.i == cand.i;
    a.rmse = a.agree ? 0.0 : kInf;
    return a;
  }
  std::vector<float> h = hyp.floats(), c = cand.floats();
  int64_t bad = 0;
  a.rmse = rmse(h.data(), c.data(), int64_t(h.size()), &bad);
  if (bad) {
    a.rmse = kInf;
    return a;
  }
  if (auto t = agree_threshold(cmp)) {
    // A shape mismatch against the reference leaves no noise level there:
    // borrow the floor of the candidate's own scale.
    a.threshold = cmp->shape_match ? *t : kReplayAgreeFactor * noise_floor_abs(rms(c.data(), int64_t(c.size())));
    a.agree = a.rmse <= a.threshold;
    return a;
  }
  Tolerance tol = cmp ? cmp->tolerance : default_tolerance(dtype);
  AllcloseResult r = allclose(c.data(), h.data(), int64_t(h.size()), tol);
  a.threshold = tol.atol;
  a.agree = r.pass();
  return a;
}

namespace {

std::string describe_hypothesis(const Hypothesis& h, const HypothesisRunner* runner) {
  if (!h.value) return h.bug;
  std::string what = runner ? runner->parameter(h.bug) : "";
  if (what.empty()) what = h.bug;
  std::string s = what + " = " + value_str(*h.value);
  if (runner)
    if (auto c = runner->configured(h.bug)) s += ", config says " + value_str(*c);
  return s;
}

}  // namespace

ComputeDType candidate_dtype(const TensorSource& cand, std::string* source) {
  if (auto d = manifest_dtype(cand.manifest())) {
    if (source) *source = "manifest";
    return *d;
  }
  if (source) *source = "default (no manifest dtype)";
  return ComputeDType::Float32;
}

// ---------------------------------------------------------------------------
// Diagnosis

namespace {

// Ranking: supported by both kinds of evidence, then by one; then the share
// of diverging names reproduced; then the smaller error.
double score_of(const HypothesisEvidence& e) {
  double s = 0;
  if (e.supported_by_replay) s += 4;
  if (e.supported_by_local) s += 4;
  if (e.failing_compared > 0) s += 2.0 * double(e.failing_agree) / double(e.failing_compared);
  if (e.replay_focus_agree) s += 1;
  if (e.local_tested && e.local_focus_pass) s += 1;
  if (e.local_tested) s -= 0.5 * double(e.local_new);
  if (e.replayed && std::isfinite(e.replay_log_error)) s -= 0.01 * std::clamp(e.replay_log_error, -10.0, 10.0);
  return s;
}

std::string replay_summary(const HypothesisEvidence& e, const std::string& focus) {
  std::string s = "replay with " + e.hypothesis.str() + " reproduces the candidate at " +
                  std::to_string(e.replay_agree) + "/" + std::to_string(e.replay_compared) + " names (" +
                  std::to_string(e.failing_agree) + "/" + std::to_string(e.failing_compared) + " of the diverging ones)";
  if (!focus.empty())
    s += "; " + focus + ": rmse " + num(e.replay_focus_rmse) + (e.replay_focus_agree ? " <= " : " > ") +
         num(e.replay_focus_threshold);
  if (!e.replay_first_disagreement.empty()) s += "; first disagreement " + e.replay_first_disagreement;
  if (e.replay_from_step > 0)
    s += "; run from step " + std::to_string(e.replay_from_step) + " on the candidate's caches of the calls before it";
  return s;
}

std::string local_summary(const HypothesisEvidence& e, const std::string& focus, const LocalSite* clean) {
  std::string s = focus + " recomputed from the candidate's own inputs with " + e.hypothesis.str() + ": max err " +
                  num(e.local_focus_max_abs);
  if (clean) s += " (reference op: max err " + num(clean->max_abs) + ")";
  s += "; local failures " + std::to_string(e.local_failures) + " (fixed " + std::to_string(e.local_fixed) +
       ", new " + std::to_string(e.local_new) + ")";
  return s;
}

// What the evidence gathering shares.
struct Context {
  explicit Context(const DiagnoseInputs& i) : in(i) {}
  const DiagnoseInputs& in;
  const LocalReport* local = nullptr;  // the clean local report (null when not computed)
  std::string global_focus, local_focus;
  std::vector<std::string> cand_names;
  std::vector<const TensorComparison*> cand_cmp;  // the global comparison of each of cand_names (or null)
  std::map<std::string, double> clean_rmse;  // the clean model's run vs the candidate, per name
  int first_step = 0;                         // the candidate's first forward call
  // The first local failure recomputed at float32 from the candidate's own
  // inputs with the reference's ops: what the screen compares each
  // hypothesis' recompute with (made on the first screen).
  std::unique_ptr<Recomputed> screen_clean;
  bool screen_clean_made = false;
};

// Replays the scenario with `e.hypothesis` and compares every name. A
// hypothesis is first screened at the first divergent name alone (a run that
// stops there, a fraction of the scenario): one that does not reproduce the
// candidate there is judged on that name, without the full replay.
void replay_evidence(const Context& cx, HypothesisEvidence& e) {
  const DiagnoseInputs& in = cx.in;
  const TensorComparison* focus = in.global->find(cx.global_focus);
  // A hypothesis that changes no call before the first divergent one starts
  // there, on the candidate's own caches (the calls before it match the
  // reference, so the clean model's would be theirs): no prefill run again.
  Scenario sc = in.scenario;
  if (!cx.global_focus.empty()) {
    const int start = in.runner->replay_start(e.hypothesis, in.scenario, *in.cand);
    if (start > 0 && start <= parse_name(cx.global_focus).step) {
      sc.resume = {start, in.cand};
      e.replay_from_step = start;
    }
  }
  if (focus && in.cand->has(cx.global_focus)) {
    std::unique_ptr<MemoryDump> probe;
    try {
      probe = in.runner->run(e.hypothesis, sc, {cx.global_focus});
    } catch (const Error& err) {
      e.summary = "replay with " + e.hypothesis.str() + " failed: " + err.what();
      return;
    }
    if (probe->has(cx.global_focus)) {
      Agreement ag = agreement(probe->get(cx.global_focus), in.cand->get(cx.global_focus), focus, in.dtype);
      if (!ag.agree) {
        e.replayed = true;
        e.replay_compared = e.failing_compared = 1;
        e.replay_first_disagreement = cx.global_focus;
        e.replay_focus_rmse = ag.rmse;
        e.replay_focus_threshold = ag.threshold;
        e.replay_log_error =
            ag.threshold > 0 ? std::log10(std::max(ag.rmse, 1e-30) / ag.threshold) : 10.0;
        return;
      }
    }
  }
  std::unique_ptr<MemoryDump> run;
  try {
    run = in.runner->run(e.hypothesis, sc, cx.cand_names);
  } catch (const Error& err) {
    e.summary = "replay with " + e.hypothesis.str() + " failed: " + err.what();
    return;
  }
  e.replayed = true;
  // Every name's agreement, several names at a time (each reads its own
  // tensors through const get()); tallied below in canonical order.
  std::vector<std::optional<Agreement>> agreed(cx.cand_names.size());
  ThreadPool pool;
  pool.parallel_for(int64_t(cx.cand_names.size()), [&](int64_t k) {
    const std::string& name = cx.cand_names[size_t(k)];
    if (!in.sites.empty() && !any_site_glob_match(in.sites, name)) return;
    const TensorComparison* cmp = cx.cand_cmp[size_t(k)];
    if (!cmp || !run->has(name)) return;
    agreed[size_t(k)] = agreement(run->get(name), in.cand->get(name), cmp, in.dtype);
  });
  double log_sum = 0;
  int log_n = 0;
  for (size_t k = 0; k < cx.cand_names.size(); ++k) {
    if (!agreed[k]) continue;
    const std::string& name = cx.cand_names[k];
    const TensorComparison* cmp = cx.cand_cmp[k];
    Agreement ag = *agreed[k];
    if (!cmp->pass) {
      auto c = cx.clean_rmse.find(name);
      if (c != cx.clean_rmse.end()) {
        // Where the clean run already reproduces the candidate, its divergence
        // from the reference is no bug's doing (e.g. the candidate rounds like
        // the hypothesis engine): such a name is evidence for no hypothesis.
        if (c->second <= ag.threshold) continue;
        // Elsewhere the hypothesis must reproduce the divergence clearly
        // better than the clean run does.
        if (ag.agree && std::isfinite(c->second) && !(ag.rmse <= kBeatClean * c->second)) ag.agree = false;
      }
    }
    ++e.replay_compared;
    if (ag.agree)
      ++e.replay_agree;
    else if (e.replay_first_disagreement.empty())
      e.replay_first_disagreement = name;
    if (!cmp->pass) {
      ++e.failing_compared;
      if (ag.agree) ++e.failing_agree;
      log_sum += ag.threshold > 0 ? std::log10(std::max(ag.rmse, 1e-30) / ag.threshold) : (ag.agree ? -10.0 : 10.0);
      ++log_n;
    }
    if (name == cx.global_focus) {
      e.replay_focus_agree = ag.agree;
      e.replay_focus_rmse = ag.rmse;
      e.replay_focus_threshold = ag.threshold;
    }
  }
  e.replay_log_error = log_n ? log_sum / log_n : 0.0;
  e.supported_by_replay = e.failing_compared > 0 && e.replay_focus_agree &&
                          e.failing_agree >= kReplaySupport * e.failing_compared &&
                          e.replay_agree >= kReplaySupport * e.replay_compared;
}

// Recomputes the candidate's sites with the hypothesis' ops.
void local_evidence(const Context& cx, HypothesisEvidence& e) {
  const DiagnoseInputs& in = cx.in;
  if (!cx.local || !in.oracle || !in.cand_local || !in.local_ref || cx.local->failing() == 0 ||
      !in.oracle->supports(e.hypothesis))
    return;
  LocalReport lh = analyse_local_variant(*in.oracle, *in.cand, *in.cand_local, *cx.local, nullptr, in.dtype,
                                         in.sites, e.hypothesis, in.cand_local, in.second_local, in.local_ref);
  e.local_tested = true;
  e.local_failures = lh.failing();
  e.local_fixed = e.local_new = 0;
  for (const auto& s : cx.local->sites) {
    const LocalSite* t = lh.find(s.name);
    const bool now = t ? t->pass : s.pass;
    if (!s.pass && now) ++e.local_fixed;
    if (s.pass && !now) ++e.local_new;
  }
  if (const LocalSite* t = lh.find(cx.local_focus)) {
    e.local_focus_pass = t->pass;
    e.local_focus_max_abs = t->max_abs;
    e.local_focus_rmse = t->noise.cand_rmse;
  }
  e.supported_by_local = e.local_focus_pass && e.local_new == 0 && e.local_failures == 0;
}

// The screen before any replay, for a first local failure after the first
// forward call (where a replay must run every call before it to get there):
// that site alone recomputed from the candidate's own inputs with the
// hypothesis' ops (no run of the scenario), at float32 (op_unchanged_under).
// When the hypothesis leaves that op exactly as the reference computes it,
// it does not act on the op that is wrong there: it is not replayed, and its
// summary says so. Hypotheses the local oracle cannot recompute, those that
// change that op at all (a wrong parameter value too) and first local
// failures in the first layer of the first call (whose replay is short) are
// replayed as before.
bool screened_out_locally(Context& cx, HypothesisEvidence& e) {
  const DiagnoseInputs& in = cx.in;
  if (cx.local_focus.empty() || !in.oracle || !in.cand_local || !in.oracle->supports(e.hypothesis)) return false;
  // A replay to a first local failure in the first call before its second
  // layer (the inputs, the mask, RoPE's table, layer 0) is short: it is
  // replayed as before. After the layers (last_hidden, logits) it is not.
  const CanonName focus = parse_name(cx.local_focus);
  const bool after_layers = focus.kind == CanonName::Kind::Step &&
                            (focus.site == site_name(Site::FinalNorm) || focus.site == site_name(Site::LastHidden) ||
                             focus.site == site_name(Site::Logits) || focus.site == site_name(Site::NextLogits));
  const bool early = focus.kind == CanonName::Kind::Layer ? focus.layer == 0 : !after_layers;
  if (focus.step <= cx.first_step && early) return false;
  const LocalSite* clean = cx.local->find(cx.local_focus);
  if (!clean || clean->pass) return false;
  try {
    if (!cx.screen_clean_made) {
      cx.screen_clean_made = true;
      const std::vector<std::string> one = {cx.local_focus};
      cx.screen_clean = in.oracle->recompute(*in.cand, ComputeDType::Float32, nullptr, &one);
    }
    if (!cx.screen_clean || !op_unchanged_under(*in.oracle, *in.cand, *cx.screen_clean, cx.local_focus,
                                                e.hypothesis, ComputeDType::Float32))
      return false;
  } catch (const Error&) {
    return false;  // the recompute cannot judge it: the replay does
  }
  e.screened_out = true;
  e.summary = "not replayed: " + cx.local_focus + " recomputed from the candidate's own inputs with " +
              e.hypothesis.str() + " is the reference op's value (local rmse " + num(clean->noise.cand_rmse) +
              "): it does not act on the op that is wrong there";
  return true;
}

// The hypothesis run's RMSE against the candidate at the first divergent
// name (inf when it cannot run or the shapes differ): the objective of the
// parameter search.
double focus_error(const Context& cx, const Hypothesis& h) {
  std::unique_ptr<MemoryDump> run;
  try {
    run = cx.in.runner->run(h, cx.in.scenario, {cx.global_focus});
  } catch (const Error&) {
    return kInf;
  }
  if (!run->has(cx.global_focus)) return kInf;
  TensorData a = run->get(cx.global_focus), b = cx.in.cand->get(cx.global_focus);
  if (a.shape != b.shape) return kInf;
  std::vector<float> x = a.floats(), y = b.floats();
  int64_t bad = 0;
  const double e = rmse(x.data(), y.data(), int64_t(x.size()), &bad);
  return bad ? kInf : e;
}

double round_sig(double v, int digits) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.*g", digits, v);
  return std::strtod(buf, nullptr);
}

// A parameterised bug whose grid holds no exact value: the value between
// the best grid point's neighbours (log scale) that best reproduces the
// first divergent name, by a scan and a golden-section search.
std::optional<Hypothesis> refine_parameter(const Context& cx, const std::string& bug,
                                           const std::vector<HypothesisEvidence>& tested) {
  std::vector<std::pair<double, double>> grid;  // value, focus rmse
  for (const auto& e : tested)
    if (e.hypothesis.bug == bug && e.hypothesis.value && *e.hypothesis.value > 0 && e.replayed)
      grid.emplace_back(*e.hypothesis.value, e.replay_focus_rmse);
  if (grid.empty()) return std::nullopt;
  std::sort(grid.begin(), grid.end());
  size_t best = 0;
  for (size_t k = 1; k < grid.size(); ++k)
    if (grid[k].second < grid[best].second) best = k;
  if (!std::isfinite(grid[best].second)) return std::nullopt;
  // The grid's whole range, on a log scale: the error is not unimodal over
  // it (the config's own value, left out of the grid, sits in between).
  const double lo = std::log(grid.front().first), hi = std::log(grid.back().first);
  auto f = [&](double x) { return focus_error(cx, Hypothesis{bug, std::exp(x)}); };
  // Coarse scan (~6 points per decade), then golden-section search around the best point.
  const int kScan = std::clamp(int((hi - lo) / std::log(10.0) * 6), 8, 72);
  double best_x = std::log(grid[best].first), best_f = grid[best].second;
  for (int k = 0; k <= kScan; ++k) {
    const double x = lo + (hi - lo) * k / kScan, fx = f(x);
    if (fx < best_f) best_f = fx, best_x = x;
  }
  const double step = (hi - lo) / kScan;
  double v = std::exp(golden_section_min(f, best_x - step, best_x + step, 30));
  // Prefer a round value when it fits as well.
  double chosen = v, chosen_f = kInf;
  for (int digits : {2, 3, 4, 6}) {
    const double r = round_sig(v, digits), fr = focus_error(cx, Hypothesis{bug, r});
    if (fr < chosen_f * 0.999) chosen = r, chosen_f = fr;
  }
  for (const auto& gp : grid)
    if (gp.first == chosen) return std::nullopt;  // nothing new
  return Hypothesis{bug, chosen};
}

}  // namespace

namespace {

// The hypotheses to test: the runner's (grids included, those that can act
// in the scenario) and values fitted by fingerprints.
std::vector<Hypothesis> hypotheses_to_test(const DiagnoseInputs& in, const std::vector<Fingerprint>& fingerprints) {
  std::vector<Hypothesis> hyps = in.runner ? in.runner->hypotheses() : std::vector<Hypothesis>{};
  hyps.erase(std::remove_if(hyps.begin(), hyps.end(),
                            [&](const Hypothesis& h) { return !in.runner->acts_in(h.bug, in.scenario); }),
             hyps.end());
  std::set<std::string> known_bugs;
  for (const auto& h : hyps) known_bugs.insert(h.bug);
  for (const auto& f : fingerprints)
    if (f.value && known_bugs.count(f.bug)) {
      Hypothesis h{f.bug, f.value};
      if (std::find(hyps.begin(), hyps.end(), h) == hyps.end()) hyps.push_back(h);
    }
  return hyps;
}

// The clean model's run against the candidate at every name (the baseline
// every hypothesis must beat, in cx.clean_rmse). Returns the numbers when
// it already reproduces the candidate where it diverges and no op is wrong
// by itself: the divergence is rounding that no zoo bug explains, and no
// hypothesis could get credit there (replay_evidence); "" otherwise.
std::string clean_baseline(Context& cx) {
  const DiagnoseInputs& in = cx.in;
  const TensorSource& cand = *in.cand;
  std::unique_ptr<MemoryDump> own;
  if (!in.clean) own = in.runner->run(Hypothesis{}, in.scenario, cx.cand_names);
  const TensorSource* clean = in.clean ? in.clean : own.get();
  // Several names at a time (each reads its own tensors through const get()).
  std::vector<std::optional<double>> errors(cx.cand_names.size());
  ThreadPool pool;
  pool.parallel_for(int64_t(cx.cand_names.size()), [&](int64_t k) {
    const std::string& name = cx.cand_names[size_t(k)];
    if (!clean->has(name)) return;
    TensorData a = clean->get(name), b = cand.get(name);
    double e = kInf;
    if (a.shape == b.shape) {
      if (a.is_int) a.f = a.floats();  // float tensors as they are, without a copy
      if (b.is_int) b.f = b.floats();
      int64_t bad = 0;
      e = rmse(a.f.data(), b.f.data(), int64_t(a.f.size()), &bad);
      if (bad) e = kInf;
    }
    errors[size_t(k)] = e;
  });
  for (size_t k = 0; k < errors.size(); ++k)
    if (errors[k]) cx.clean_rmse[cx.cand_names[k]] = *errors[k];
  const TensorComparison* focus = in.global->find(cx.global_focus);
  if (!cx.local_focus.empty() || !focus || !clean->has(cx.global_focus)) return "";
  const Agreement ag = agreement(clean->get(cx.global_focus), cand.get(cx.global_focus), focus, in.dtype);
  if (!ag.agree) return "";
  return "the clean implementation reproduces the candidate at " + cx.global_focus + " (rmse " + num(ag.rmse) +
         " <= " + num(ag.threshold) + ") and no op fails locally: the divergence from the reference is rounding, " +
         "not a bug of the zoo; no hypothesis was replayed";
}

bool any_replay_support(const Diagnosis& d) {
  return std::any_of(d.ranked.begin(), d.ranked.end(), [](const HypothesisEvidence& e) { return e.supported_by_replay; });
}

// Parameterised bugs off the grid: the value searched, then replayed.
void search_parameters(const Context& cx, const std::vector<Hypothesis>& hyps, Diagnosis& d) {
  std::set<std::string> param_bugs;  // those whose values act on the op that is wrong (not all screened out)
  for (const auto& h : hyps)
    if (h.value) param_bugs.insert(h.bug);
  for (const auto& bug : std::set<std::string>(param_bugs)) {
    bool acts = false;
    for (const auto& e : d.ranked) acts = acts || (e.hypothesis.bug == bug && !e.screened_out);
    if (!acts) param_bugs.erase(bug);
  }
  for (const auto& bug : param_bugs)
    if (auto h = refine_parameter(cx, bug, d.ranked)) {
      HypothesisEvidence e;
      e.hypothesis = *h;
      replay_evidence(cx, e);
      d.ranked.push_back(std::move(e));
    }
}

// Scores, texts in words, the runner's words for each bug; best first.
void rank(const Context& cx, Diagnosis& d) {
  const DiagnoseInputs& in = cx.in;
  for (auto& e : d.ranked) {
    e.score = score_of(e);
    if (e.replayed) e.replay_text = replay_summary(e, cx.global_focus);
    if (e.local_tested)
      e.local_text = local_summary(e, cx.local_focus, cx.local ? cx.local->find(cx.local_focus) : nullptr);
    std::string s = e.replay_text;
    if (!e.local_text.empty()) s += (s.empty() ? "" : "; ") + e.local_text;
    if (!s.empty()) e.summary = s;
    if (in.runner) e.description = in.runner->description(e.hypothesis.bug);
    if (e.hypothesis.value) e.value_text = describe_hypothesis(e.hypothesis, in.runner);
  }
  std::stable_sort(d.ranked.begin(), d.ranked.end(),
                   [](const HypothesisEvidence& a, const HypothesisEvidence& b) { return a.score > b.score; });
}

}  // namespace

Diagnosis diagnose(const DiagnoseInputs& in) {
  auto done = [&](const std::string& what) {
    if (in.progress) in.progress("diagnosis: " + what);
  };
  Diagnosis d;
  const TensorSource& cand = *in.cand;
  Context cx(in);
  cx.local = in.local && in.local->ran ? in.local : nullptr;
  cx.global_focus = in.global->first() ? in.global->first()->name : "";
  cx.local_focus = cx.local && cx.local->first() ? cx.local->first()->name : "";
  if (cx.local_focus.empty() && cx.global_focus.empty()) return d;  // nothing diverges
  if (in.ref) d.fingerprints = fingerprints(cand, *in.ref, *in.global, in.scenario);
  if (in.runner) d.inapplicable = in.runner->inapplicable();
  cx.cand_names = cand.names();
  cx.first_step = std::numeric_limits<int>::max();
  for (const auto& n : cx.cand_names) {
    const CanonName c = parse_name(n);
    if (c.step >= 0) cx.first_step = std::min(cx.first_step, c.step);
  }
  {
    std::unordered_map<std::string, const TensorComparison*> by_name;
    for (const TensorComparison& t : in.global->tensors) by_name.emplace(t.name, &t);
    for (const auto& n : cx.cand_names) {
      auto it = by_name.find(n);
      cx.cand_cmp.push_back(it == by_name.end() ? nullptr : it->second);
    }
  }
  const std::vector<Hypothesis> hyps = hypotheses_to_test(in, d.fingerprints);
  if (in.runner) {
    try {
      d.clean_reproduces = clean_baseline(cx);
      if (!d.clean_reproduces.empty()) return d;
    } catch (const Error&) {
    }
    done("the clean run against the candidate");
  }
  size_t screened = 0;
  for (const Hypothesis& h : hyps) {
    HypothesisEvidence e;
    e.hypothesis = h;
    if (screened_out_locally(cx, e))
      ++screened;
    else
      replay_evidence(cx, e);
    d.ranked.push_back(std::move(e));
  }
  if (!hyps.empty()) {
    size_t full = 0;
    for (const auto& e : d.ranked)
      if (e.replay_compared > 1) ++full;
    done("replays of " + std::to_string(hyps.size() - screened) + " hypotheses (" + std::to_string(full) +
         " in full; " + std::to_string(screened) + " screened out by the local recompute)");
  }
  if (in.runner && !any_replay_support(d) && !cx.global_focus.empty()) {
    search_parameters(cx, hyps, d);
    done("parameter search");
  }
  // Local evidence: for the hypotheses the replay points at, or for all of
  // them when no replay reproduces the candidate (another implementation's
  // numerics, a dump without the diverging names).
  const bool all_local = !any_replay_support(d);
  for (auto& e : d.ranked)
    if (!e.screened_out && (all_local || e.replay_focus_agree || e.supported_by_replay)) {
      local_evidence(cx, e);
      if (e.local_tested) done("local recompute with " + e.hypothesis.str());
    }
  rank(cx, d);
  return d;
}

std::vector<ErrorSignature> signatures_at(const std::vector<std::string>& names, const TensorSource& cand,
                                          const TensorSource& ref, const LocalOracle* oracle) {
  std::vector<ErrorSignature> out;
  const std::optional<ModelConfig> cfg = manifest_config(ref, cand);
  for (const std::string& n : names)
    for (ErrorSignature& s : error_signatures(n, cand, ref, cfg, oracle)) out.push_back(std::move(s));
  return out;
}

}  // namespace llmdiff::compare
