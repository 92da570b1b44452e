// Checks a dump's sampler against HF's logits processors (docs/DUMP_FORMAT.md,
// "Sampling"): at every step with step{N}.sample.*, the reference pipeline
// (dumps/sampling/sampling.h) runs on the candidate's OWN next_logits and token
// history, and the candidate's sample.scores, sample.probs and sample.token
// are judged against it. A model that computes other logits is not a sampler
// bug: this check never looks at a reference model. When a step fails, every
// sampler bug of the zoo is tried on the same inputs, and the ones that
// reproduce the candidate are named; when none does, the pipelines around
// HF's (processors reordered, rules varied: compare/sampler_search.h) are
// searched for the one the candidate runs.
//
// History of step N = every token the candidate fed through step N (the
// prompt and the tokens drawn before), i.e. generate's input_ids.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "compare/tolerance.h"
#include "dumps/contract/dump.h"
#include "dumps/sampling/sampling.h"

namespace llmdiff::compare {

// allclose bounds (|cand - ref| <= atol + rtol * |ref|) on the finite scores
// and on the probabilities. Float32 engines that round differently from
// torch stay well inside them; a filter or scaling mistake does not.
struct SamplingTolerance {
  Tolerance scores{1e-5, 1e-5};
  Tolerance probs{1e-4, 1e-8};
};

struct SamplingCheckOptions {
  std::optional<SamplingParams> params;  // overrides the manifest's `sampling`
  SamplingTolerance tol;
  bool try_bugs = true;  // name the zoo's sampler bugs that reproduce a failure
  // When no zoo bug does, the pipelines of up to `search_departures`
  // departures from HF's (compare/sampler_search.h) are judged, at most
  // `search_budget` of them (0: no search).
  int search_departures = 2;
  int search_budget = 4000;
};

// One candidate vector [V] against the recomputed one.
struct VectorAgreement {
  std::string problem;             // missing, wrong shape, NaN/+inf: not comparable ("" when it is)
  int64_t kept_only_cand = 0;      // finite in the candidate, -inf in the reference
  int64_t kept_only_ref = 0;       // -inf in the candidate, finite in the reference
  int64_t first_set_difference = -1;  // the smallest id of either kind
  int64_t kept = 0;                // finite entries of the reference
  int64_t out_of_tolerance = 0;    // finite pairs outside the tolerance
  double max_abs = 0, max_rel = 0; // over finite pairs
  int64_t max_abs_at = -1;
  bool pass() const { return problem.empty() && kept_only_cand == 0 && kept_only_ref == 0 && out_of_tolerance == 0; }
};

struct SamplingStepCheck {
  int step = 0;
  std::string problem;  // the step could not be checked (no next_logits, history...): fails
  VectorAgreement scores, probs;
  std::optional<float> u;      // the candidate's sample.u
  int64_t token = -1;          // the candidate's sample.token (-1: missing)
  // The token the reference picks: pick_inverse_cdf(probs, u) with a u, the
  // argmax when greedy; -1 when only the support can be checked.
  int64_t expected_token = -1;
  float ref_prob = 0;          // the reference probability of the candidate's token
  bool token_ok = false;
  std::string token_note;      // why the token passes or fails
  // The token is the one fed at the next step and listed in `generated`
  // (nullopt: neither exists).
  std::optional<bool> fed_ok;
  std::string fed_note;
  bool pass() const { return problem.empty() && scores.pass() && probs.pass() && token_ok && fed_ok.value_or(true); }
};

struct SequenceSamplingCheck {
  int seq = -1;                // -1: a single-sequence dump
  std::string prefix;          // "" or "seq{b}."
  SamplingParams params;
  std::string params_from;     // "manifest 'sampling'", "manifest 'sampling.seq1'", "given"
  std::vector<SamplingStepCheck> steps;
};

// A sampler bug of the zoo whose pipeline reproduces the candidate at every
// checked step (scores, probs within tolerance, token consistent).
struct SamplerBugMatch {
  std::string bug, description;
  int steps_departing = 0;     // steps where the bug's pipeline departs from HF's on these logits
  double scores_max_abs = 0;   // worst over the steps: the bug's scores vs the candidate's
  double probs_max_abs = 0;
};

// A sampler pipeline found by the search that reproduces every checked step.
struct SamplerPipelineMatch {
  std::string pipeline;                 // pipeline_str: the acting stages in its order, the draw
  std::vector<std::string> departures;  // pipeline_departures: one line per moved stage or rule
  std::string zoo_bug;                  // the zoo's sampler bug with this pipeline ("" when none)
  int steps_departing = 0;
  double scores_max_abs = 0, probs_max_abs = 0;
};

// The search for the candidate's pipeline, run when a step fails and no
// sampler bug of the zoo reproduces the candidate.
struct SamplerSearchSummary {
  int max_departures = 0;  // the bound asked for
  int searched_up_to = 0;  // departure counts searched in full
  int tried = 0;           // pipelines judged
  bool budget_spent = false;
};

struct SamplingCheck {
  enum class Verdict { Pass, Fail, NothingToCheck };
  std::string label;
  std::vector<SequenceSamplingCheck> sequences;
  std::vector<SamplerBugMatch> explained_by;  // best match first; empty when it passes or nothing fits
  // The search (run when explained_by is empty after a failure): the
  // pipelines of the fewest departures that reproduce every step.
  std::optional<SamplerSearchSummary> search;
  std::vector<SamplerPipelineMatch> pipelines;
  Verdict verdict = Verdict::NothingToCheck;
  int checked_steps() const;
  int failing_steps() const;
};

// Throws UsageError when the dump holds sample.* but neither the manifest
// nor `opt` gives parameters, FormatError on a malformed manifest value.
SamplingCheck check_sampling(const TensorSource& cand, const SamplingCheckOptions& opt = {});
// The check as JSON (the "sampling" field of `bisect --json`, documented in
// compare/README.md): verdict, steps checked and failing, per step the
// token, the expected token and the first problem, and the sampler bugs that
// explain a failure.
nlohmann::json sampling_check_to_json(const SamplingCheck& c);

// The finding in one line: "explained by sampler-temperature-twice", "the
// sampler's pipeline: top-p applied before temperature and top-k (reproduces
// all 4 failing steps)"; "" when nothing explains a failure.
std::string sampling_finding(const SamplingCheck& c);

// A few lines per sequence: the parameters, one line per step, the verdict
// and the sampler bugs that explain a failure.
std::string render_sampling_check(const SamplingCheck& c);

}  // namespace llmdiff::compare
