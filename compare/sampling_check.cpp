#include "compare/sampling_check.h"
#include "dumps/contract/sequences.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "compare/report.h"
#include "compare/sampler_search.h"
#include "dumps/zoo/bugs.h"
#include "dumps/contract/engine.h"
#include "dumps/base/errors.h"

namespace llmdiff::compare {

namespace {

// ------------------------------------------------------------ dump access

// The sequences of a dump: "seq{b}." prefixes, or one unprefixed sequence.
std::vector<std::pair<int, std::string>> sequences_of(const TensorSource& d) {
  std::vector<std::pair<int, std::string>> out;
  for (int b : dump_sequences(d)) out.push_back({b, sequence_prefix(b)});
  if (out.empty()) out.push_back({-1, ""});
  return out;
}

// The largest step number under `prefix` (-1 when none).
int last_step(const TensorSource& d, const std::string& prefix) {
  int last = -1;
  for (const std::string& n : d.names()) {
    if (n.compare(0, prefix.size() + 4, prefix + "step") != 0) continue;
    size_t i = prefix.size() + 4, j = i;
    while (j < n.size() && std::isdigit(static_cast<unsigned char>(n[j]))) ++j;
    if (j > i && j < n.size() && n[j] == '.') last = std::max(last, std::stoi(n.substr(i, j - i)));
  }
  return last;
}

bool has_sample(const TensorSource& d, const std::string& prefix, int step) {
  for (const char* site : {"sample.scores", "sample.probs", "sample.u", "sample.token"})
    if (d.has(prefix + step_name(step, site))) return true;
  return false;
}

std::optional<TensorData> get_if(const TensorSource& d, const std::string& name) {
  if (!d.has(name)) return std::nullopt;
  return d.get(name);
}

// ------------------------------------------------------------ agreement

bool finite_or_neg_inf(float v) { return std::isfinite(v) || v == -INFINITY; }

// scores: the -inf sets must be equal and the finite values close; probs:
// every value close (an exact 0 is an ordinary value there).
VectorAgreement agree(const std::optional<TensorData>& cand, const std::vector<float>& ref, const Tolerance& tol,
                      bool filtered, const std::string& what) {
  VectorAgreement a;
  for (float r : ref) a.kept += std::isfinite(r) ? 1 : 0;
  if (!cand) {
    a.problem = "no " + what;
    return a;
  }
  if (cand->is_int || cand->shape != Shape{int64_t(ref.size())}) {
    a.problem = what + " has shape " + shape_str(cand->shape) + (cand->is_int ? " (integer)" : "") + ", expected [" +
                std::to_string(ref.size()) + "]";
    return a;
  }
  const std::vector<float>& c = cand->f;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!finite_or_neg_inf(c[i]) || (!filtered && !std::isfinite(c[i]))) {
      a.problem = what + " holds " + std::to_string(c[i]) + " at id " + std::to_string(i);
      return a;
    }
    const bool cf = std::isfinite(c[i]), rf = std::isfinite(ref[i]);
    if (cf != rf) {
      (cf ? a.kept_only_cand : a.kept_only_ref) += 1;
      if (a.first_set_difference < 0) a.first_set_difference = int64_t(i);
      continue;
    }
    if (!cf) continue;
    const double d = std::fabs(double(c[i]) - double(ref[i]));
    if (d > a.max_abs || a.max_abs_at < 0) a.max_abs = d, a.max_abs_at = int64_t(i);
    if (ref[i] != 0) a.max_rel = std::max(a.max_rel, d / std::fabs(double(ref[i])));
    if (d > tol.atol + tol.rtol * std::fabs(double(ref[i]))) ++a.out_of_tolerance;
  }
  return a;
}

bool identical(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i])) return false;
  return true;
}

// ------------------------------------------------------------ one step

// What a pipeline (HF's, or a sampler bug's) computes at one step.
struct Expected {
  std::vector<float> scores, probs;
};

Expected run_pipeline(const SamplingParams& p, const std::vector<float>& next_logits,
                      const std::vector<int64_t>& history, const SamplerPipeline& pipeline) {
  Expected e;
  e.scores = process_scores(p, next_logits, history, pipeline);
  e.probs = sample_probs(p, e.scores, next_logits, history, pipeline);
  return e;
}

// The candidate's step as read from the dump.
struct StepInput {
  int step = 0;
  std::vector<float> next_logits;
  std::vector<int64_t> history;
  std::optional<TensorData> scores, probs;
  std::optional<float> u;
  int64_t token = -1;
  std::string problem;
};

// Judges the candidate's token against a pipeline's probabilities.
void judge_token(const SamplingParams& p, const Expected& e, const StepInput& in, SamplingStepCheck& out) {
  out.token = in.token;
  out.u = in.u;
  const int64_t V = int64_t(e.probs.size());
  if (in.token < 0 || in.token >= V) {
    out.token_ok = false;
    out.token_note = "outside the vocabulary [0, " + std::to_string(V) + ")";
    return;
  }
  out.ref_prob = e.probs[size_t(in.token)];
  if (!p.do_sample) {
    out.expected_token = argmax_first(e.scores);
    out.token_ok = in.token == out.expected_token;
    out.token_note = out.token_ok ? "greedy argmax" : "greedy argmax is " + std::to_string(out.expected_token);
    return;
  }
  if (in.u) {
    out.expected_token = pick_inverse_cdf(e.probs, *in.u);
    out.token_ok = in.token == out.expected_token;
    if (out.token_ok) {
      out.token_note = "inverse CDF at u";
    } else if (in.probs && in.probs->shape == Shape{V} && out.probs.pass() &&
               in.token == pick_inverse_cdf(in.probs->f, *in.u)) {
      // u sits on a CDF boundary that the tolerated probability differences move.
      out.token_ok = true;
      out.token_note = "inverse CDF at u of the candidate's probs (u on a boundary within tolerance)";
    } else {
      out.token_note = "inverse CDF at u picks " + std::to_string(out.expected_token);
    }
    return;
  }
  out.token_ok = out.ref_prob > 0;
  out.token_note = out.token_ok ? "in the support" : "outside the support (reference probability 0)";
}

SamplingStepCheck judge_step(const SamplingParams& p, const StepInput& in, const SamplingTolerance& tol,
                             const SamplerPipeline& pipeline = {}) {
  SamplingStepCheck out;
  out.step = in.step;
  out.problem = in.problem;
  if (!in.problem.empty()) {
    out.token = in.token;
    out.u = in.u;
    return out;
  }
  const Expected e = run_pipeline(p, in.next_logits, in.history, pipeline);
  out.scores = agree(in.scores, e.scores, tol.scores, true, "sample.scores");
  out.probs = agree(in.probs, e.probs, tol.probs, false, "sample.probs");
  judge_token(p, e, in, out);
  return out;
}

// Reads step `step` of the sequence under `prefix`; `history` already holds
// the tokens of the steps before it.
StepInput read_step(const TensorSource& d, const std::string& prefix, int step, const std::vector<int64_t>& history) {
  StepInput in;
  in.step = step;
  in.history = history;
  auto name = [&](const char* site) { return prefix + step_name(step, site); };
  if (auto t = get_if(d, name("sample.token"))) {
    if (t->is_int && t->numel() == 1) in.token = t->i[0];
    else in.problem = "sample.token is not one integer (" + shape_str(t->shape) + ")";
  } else {
    in.problem = "no sample.token";
  }
  if (auto u = get_if(d, name("sample.u"))) {
    if (!u->is_int && u->numel() == 1 && u->f[0] >= 0 && u->f[0] < 1) in.u = u->f[0];
    else in.problem = "sample.u is not one float in [0, 1)";
  }
  in.scores = get_if(d, name("sample.scores"));
  in.probs = get_if(d, name("sample.probs"));
  if (auto nl = get_if(d, name("next_logits"))) {
    if (!nl->is_int && nl->shape.size() == 1) in.next_logits = nl->f;
    else in.problem = "next_logits has shape " + shape_str(nl->shape);
  } else {
    in.problem = "no next_logits: the sampler's input is unknown";
  }
  return in;
}

// Sets each step's fed_ok: its token is the next step's first token and the
// matching entry of `generated` (the k-th sampling step draws generated[k]).
void check_fed(const TensorSource& d, const std::string& prefix, std::vector<SamplingStepCheck>& steps) {
  const std::optional<TensorData> generated = get_if(d, prefix + "generated");
  for (size_t k = 0; k < steps.size(); ++k) {
    SamplingStepCheck& s = steps[k];
    std::string note;
    bool any = false, ok = true;
    if (auto next = get_if(d, prefix + step_name(s.step + 1, "tokens")); next && next->is_int && !next->i.empty()) {
      any = true;
      if (next->i[0] != s.token) ok = false, note = "step " + std::to_string(s.step + 1) + " feeds " + std::to_string(next->i[0]);
    }
    if (generated && generated->is_int && k < generated->i.size()) {
      any = true;
      if (generated->i[k] != s.token) {
        ok = false;
        note += std::string(note.empty() ? "" : "; ") + "generated[" + std::to_string(k) + "] = " + std::to_string(generated->i[k]);
      }
    }
    if (any) s.fed_ok = ok, s.fed_note = note;
  }
}

// ------------------------------------------------------------ bugs

struct SequenceInputs {
  SamplingParams params;
  std::vector<StepInput> steps;
};

// How closely a pipeline reproduces the candidate.
struct PipelineFit {
  int steps_departing = 0;     // steps where it departs from HF's pipeline on these logits
  double scores_max_abs = 0;   // worst over the steps: its scores vs the candidate's
  double probs_max_abs = 0;
};

// The pipeline reproduces every step of every sequence: scores and probs
// within tolerance, the token consistent with its probabilities, and it
// departs from HF's at some step (a pipeline that computes HF's on these
// logits is no evidence). Most pipelines fail at the first step judged.
std::optional<PipelineFit> try_pipeline(const SamplerPipeline& pipeline, const std::vector<SequenceInputs>& seqs,
                                        const SamplingTolerance& tol) {
  PipelineFit fit;
  for (const SequenceInputs& s : seqs) {
    for (const StepInput& in : s.steps) {
      if (!in.problem.empty()) return std::nullopt;
      const SamplingStepCheck c = judge_step(s.params, in, tol, pipeline);
      if (!c.scores.pass() || !c.probs.pass() || !c.token_ok) return std::nullopt;
      fit.scores_max_abs = std::max(fit.scores_max_abs, c.scores.max_abs);
      fit.probs_max_abs = std::max(fit.probs_max_abs, c.probs.max_abs);
      const Expected hf = run_pipeline(s.params, in.next_logits, in.history, {});
      const Expected other = run_pipeline(s.params, in.next_logits, in.history, pipeline);
      if (!identical(hf.scores, other.scores) || !identical(hf.probs, other.probs)) ++fit.steps_departing;
    }
  }
  if (fit.steps_departing == 0) return std::nullopt;
  return fit;
}

std::optional<SamplerBugMatch> try_bug(const zoo::BugInfo& bug, const std::vector<SequenceInputs>& seqs,
                                       const SamplingTolerance& tol) {
  zoo::SamplerFaults f;
  f.*(bug.sampler_fault) = true;
  const std::optional<PipelineFit> fit = try_pipeline(SamplerPipeline::from_faults(f), seqs, tol);
  if (!fit) return std::nullopt;
  return SamplerBugMatch{bug.name, bug.description, fit->steps_departing, fit->scores_max_abs, fit->probs_max_abs};
}

std::vector<SamplerBugMatch> explain(const std::vector<SequenceInputs>& seqs, const SamplingTolerance& tol) {
  std::vector<SamplerBugMatch> out;
  for (const zoo::BugInfo* bug : zoo::sampler_bugs())
    if (auto m = try_bug(*bug, seqs, tol)) out.push_back(*m);
  std::stable_sort(out.begin(), out.end(), [](const SamplerBugMatch& a, const SamplerBugMatch& b) {
    return std::max(a.scores_max_abs, a.probs_max_abs) < std::max(b.scores_max_abs, b.probs_max_abs);
  });
  return out;
}

// The pipelines of the fewest departures from HF's that reproduce the
// candidate (compare/sampler_search.h), on the stages any sequence's
// parameters make act.
void search(const std::vector<SequenceInputs>& seqs, const SamplingCheckOptions& opt, SamplingCheck& out) {
  std::vector<SamplingParams> params;
  for (const SequenceInputs& s : seqs) params.push_back(s.params);
  const std::vector<SamplerStage> acting = acting_stages(params);
  std::vector<std::pair<SamplerPipeline, PipelineFit>> fits;
  const PipelineSearch found = search_pipelines(
      acting,
      [&](const SamplerPipeline& pipeline) {
        std::optional<PipelineFit> fit = try_pipeline(pipeline, seqs, opt.tol);
        if (fit) fits.push_back({pipeline, *fit});
        return fit.has_value();
      },
      opt.search_departures, opt.search_budget);
  out.search = SamplerSearchSummary{opt.search_departures, found.searched_up_to, found.tried, found.budget_spent};
  for (const SamplerPipeline& pipeline : found.found) {
    const auto at = std::find_if(fits.begin(), fits.end(), [&](const auto& f) { return f.first == pipeline; });
    const zoo::BugInfo* bug = zoo_sampler_bug(pipeline, acting);
    SamplerPipelineMatch m;
    m.pipeline = pipeline_str(pipeline, acting);
    m.departures = pipeline_departures(pipeline, acting);
    m.zoo_bug = bug ? bug->name : "";
    m.steps_departing = at->second.steps_departing;
    m.scores_max_abs = at->second.scores_max_abs;
    m.probs_max_abs = at->second.probs_max_abs;
    out.pipelines.push_back(std::move(m));
  }
}

// ------------------------------------------------------------ rendering

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

std::string describe(const VectorAgreement& a) {
  if (!a.problem.empty()) return "FAIL: " + a.problem;
  std::string s = a.pass() ? "ok" : "FAIL";
  if (a.kept_only_cand || a.kept_only_ref) {
    s += ": keeps " + std::to_string(a.kept_only_cand) + " id(s) HF removes, removes " + std::to_string(a.kept_only_ref) +
         " HF keeps (first id " + std::to_string(a.first_set_difference) + ");";
  }
  s += " max abs " + num(a.max_abs) + " rel " + num(a.max_rel);
  if (a.out_of_tolerance) s += ", " + std::to_string(a.out_of_tolerance) + " out of tolerance";
  return s;
}

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i) s += (i ? sep : "") + items[i];
  return s;
}

std::string pipeline_finding(const SamplerPipelineMatch& m, int failing_steps) {
  if (!m.zoo_bug.empty()) return "explained by " + m.zoo_bug;
  return "the sampler's pipeline: " + join(m.departures, "; ") + " (reproduces " +
         (failing_steps == 1 ? std::string("the 1 failing step") : "all " + std::to_string(failing_steps) + " failing steps") +
         ")";
}

// The search's finding: each pipeline found, named by its departures (as
// the zoo's bug when it is one), or the bound searched without one.
std::string render_search(const SamplingCheck& c) {
  std::string s = "no sampler bug of the zoo reproduces the candidate";
  if (!c.search) return s + "\n";
  const SamplerSearchSummary& q = *c.search;
  if (c.pipelines.empty()) {
    s += ", nor any sampler pipeline of up to " + std::to_string(q.budget_spent ? q.searched_up_to : q.max_departures) +
         " departure(s) from HF's (" + std::to_string(q.tried) + " tried" +
         (q.budget_spent ? ", the search budget spent" : "") + ")\n";
    return s;
  }
  s += "; " + std::to_string(q.tried) + " sampler pipeline(s) of up to " + std::to_string(q.searched_up_to) +
       " departure(s) from HF's tried\n";
  for (size_t i = 0; i < c.pipelines.size(); ++i) {
    const SamplerPipelineMatch& m = c.pipelines[i];
    s += std::string(i == 0 ? "" : "also fits: ") + pipeline_finding(m, c.failing_steps()) + "\n";
    s += "  " + m.pipeline + "; scores within " + num(m.scores_max_abs) + ", probs within " + num(m.probs_max_abs) +
         ", departs from HF at " + std::to_string(m.steps_departing) + " step(s)\n";
  }
  return s;
}

std::string describe_step(const SamplingStepCheck& s) {
  std::string line = "  step " + std::to_string(s.step) + ": ";
  if (!s.problem.empty()) return line + "FAIL: " + s.problem;
  line += "token " + std::to_string(s.token);
  if (s.u) line += " (u " + num(*s.u) + ")";
  line += s.token_ok ? " ok, " : " FAIL, ";
  line += s.token_note + ", p " + num(s.ref_prob);
  if (s.fed_ok && !*s.fed_ok) line += "; FAIL not the token fed on: " + s.fed_note;
  line += "\n    scores (" + std::to_string(s.scores.kept) + " kept by HF): " + describe(s.scores);
  line += "\n    probs: " + describe(s.probs);
  return line;
}

}  // namespace

std::string sampling_finding(const SamplingCheck& c) {
  if (!c.explained_by.empty()) return "explained by " + c.explained_by.front().bug;
  if (!c.pipelines.empty()) return pipeline_finding(c.pipelines.front(), c.failing_steps());
  return "";
}

int SamplingCheck::checked_steps() const {
  int n = 0;
  for (const auto& s : sequences) n += int(s.steps.size());
  return n;
}

int SamplingCheck::failing_steps() const {
  int n = 0;
  for (const auto& s : sequences)
    for (const auto& st : s.steps) n += st.pass() ? 0 : 1;
  return n;
}

SamplingCheck check_sampling(const TensorSource& cand, const SamplingCheckOptions& opt) {
  SamplingCheck out;
  out.label = cand.label();
  std::vector<SequenceInputs> inputs;
  for (const auto& [seq, prefix] : sequences_of(cand)) {
    SequenceSamplingCheck sc;
    sc.seq = seq;
    sc.prefix = prefix;
    SequenceInputs si;
    std::vector<int64_t> history;
    std::string history_problem;
    for (int step = 0; step <= last_step(cand, prefix); ++step) {
      if (auto t = get_if(cand, prefix + step_name(step, "tokens")); t && t->is_int) {
        history.insert(history.end(), t->i.begin(), t->i.end());
      } else if (history_problem.empty()) {
        history_problem = "step " + std::to_string(step) + " has no tokens: the history is unknown";
      }
      if (!has_sample(cand, prefix, step)) continue;
      StepInput in = read_step(cand, prefix, step, history);
      if (in.problem.empty()) in.problem = history_problem;
      si.steps.push_back(std::move(in));
    }
    if (si.steps.empty()) continue;
    if (opt.params) {
      sc.params = *opt.params;
      sc.params_from = "given";
    } else if (auto p = manifest_sampling(cand.manifest(), cand.label(), seq)) {
      sc.params = *p;
      const bool own = cand.manifest().extra.count(sampling_manifest_key(seq)) > 0;
      sc.params_from = "manifest '" + sampling_manifest_key(own ? seq : -1) + "'";
    } else {
      throw UsageError(cand.label() + ": " + prefix + "sample.* tensors but no sampling parameters (the manifest has "
                       "no 'sampling' key): give them");
    }
    si.params = sc.params;
    for (const StepInput& in : si.steps) {
      try {
        sc.steps.push_back(judge_step(sc.params, in, opt.tol));
      } catch (const Error& e) {
        StepInput bad = in;
        bad.problem = e.what();
        sc.steps.push_back(judge_step(sc.params, bad, opt.tol));
      }
    }
    check_fed(cand, prefix, sc.steps);
    out.sequences.push_back(std::move(sc));
    inputs.push_back(std::move(si));
  }
  if (out.checked_steps() == 0) {
    out.verdict = SamplingCheck::Verdict::NothingToCheck;
    return out;
  }
  out.verdict = out.failing_steps() == 0 ? SamplingCheck::Verdict::Pass : SamplingCheck::Verdict::Fail;
  if (out.verdict == SamplingCheck::Verdict::Fail && opt.try_bugs) {
    try {
      out.explained_by = explain(inputs, opt.tol);
      if (out.explained_by.empty() && opt.search_budget > 0) search(inputs, opt, out);
    } catch (const Error&) {
      // a step whose inputs the pipeline refuses (ids outside the vocabulary) fits no bug or pipeline either
    }
  }
  return out;
}

std::string render_sampling_check(const SamplingCheck& c) {
  std::string s = "sampling check of " + c.label + "\n";
  if (c.verdict == SamplingCheck::Verdict::NothingToCheck) return s + "no step holds sample.* tensors: nothing to check\n";
  for (const SequenceSamplingCheck& seq : c.sequences) {
    s += (seq.seq >= 0 ? "sequence " + std::to_string(seq.seq) + ", " : std::string()) + "parameters (" +
         seq.params_from + "): " + seq.params.str() + "\n";
    for (const SamplingStepCheck& st : seq.steps) s += describe_step(st) + "\n";
  }
  if (c.verdict == SamplingCheck::Verdict::Pass) {
    s += "PASS: " + std::to_string(c.checked_steps()) + " sampling step(s) agree with HF's processors\n";
    return s;
  }
  s += "FAIL: " + std::to_string(c.failing_steps()) + " of " + std::to_string(c.checked_steps()) +
       " sampling step(s) disagree with HF's processors on the candidate's own logits\n";
  if (c.explained_by.empty()) return s + render_search(c);
  for (size_t i = 0; i < c.explained_by.size(); ++i) {
    const SamplerBugMatch& m = c.explained_by[i];
    s += std::string(i == 0 ? "explained by " : "also fits ") + m.bug + " (" + m.description + "): reproduces every step " +
         "(scores within " + num(m.scores_max_abs) + ", probs within " + num(m.probs_max_abs) + "), departs from HF at " +
         std::to_string(m.steps_departing) + " step(s)\n";
  }
  return s;
}

}  // namespace llmdiff::compare

namespace llmdiff::compare {

nlohmann::json sampling_check_to_json(const SamplingCheck& c) {
  using nlohmann::json;
  const char* verdict = c.verdict == SamplingCheck::Verdict::Pass   ? "pass"
                        : c.verdict == SamplingCheck::Verdict::Fail ? "fail"
                                                                    : "nothing to check";
  json j = {{"verdict", verdict},
            {"finding", sampling_finding(c)},
            {"checked_steps", c.checked_steps()},
            {"failing_steps", c.failing_steps()},
            {"sequences", json::array()},
            {"explained_by", json::array()}};
  for (const SequenceSamplingCheck& q : c.sequences) {
    json steps = json::array();
    for (const SamplingStepCheck& s : q.steps) {
      std::string problem = s.problem;
      if (problem.empty() && !s.scores.pass()) problem = s.scores.problem.empty() ? "scores differ" : s.scores.problem;
      if (problem.empty() && !s.probs.pass()) problem = s.probs.problem.empty() ? "probs differ" : s.probs.problem;
      if (problem.empty() && !s.token_ok) problem = s.token_note;
      if (problem.empty() && !s.fed_ok.value_or(true)) problem = s.fed_note;
      steps.push_back({{"step", s.step},
                       {"pass", s.pass()},
                       {"token", s.token},
                       {"expected_token", s.expected_token},
                       {"scores_max_abs", json_num(s.scores.max_abs)},
                       {"probs_max_abs", json_num(s.probs.max_abs)},
                       {"problem", problem.empty() ? json(nullptr) : json(problem)}});
    }
    j["sequences"].push_back({{"seq", q.seq}, {"params_from", q.params_from}, {"steps", steps}});
  }
  for (const SamplerBugMatch& b : c.explained_by)
    j["explained_by"].push_back({{"bug", b.bug},
                                 {"description", b.description},
                                 {"steps_departing", b.steps_departing},
                                 {"scores_max_abs", json_num(b.scores_max_abs)},
                                 {"probs_max_abs", json_num(b.probs_max_abs)}});
  j["search"] = nullptr;
  if (c.search)
    j["search"] = {{"max_departures", c.search->max_departures},
                   {"searched_up_to", c.search->searched_up_to},
                   {"tried", c.search->tried},
                   {"budget_spent", c.search->budget_spent}};
  j["pipelines"] = json::array();
  for (const SamplerPipelineMatch& m : c.pipelines)
    j["pipelines"].push_back({{"pipeline", m.pipeline},
                              {"departures", m.departures},
                              {"zoo_bug", m.zoo_bug.empty() ? json(nullptr) : json(m.zoo_bug)},
                              {"steps_departing", m.steps_departing},
                              {"scores_max_abs", json_num(m.scores_max_abs)},
                              {"probs_max_abs", json_num(m.probs_max_abs)}});
  return j;
}

}  // namespace llmdiff::compare
