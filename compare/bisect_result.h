// Everything a bisection found, as data: the comparison against the
// reference, the local errors, the zoo's diagnosis, the evidence the
// explainers read, the verdict (a Finding), and what is checked beside the
// forward pass (the sampler, the quantisation). Made by bisect/ (the
// passes), explained by compare/explain.h, rendered by
// compare/bisect_report.h, report_html.h and report.h (JUnit).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "compare/compare.h"
#include "compare/diagnose.h"
#include "compare/evidence.h"
#include "compare/finding.h"
#include "compare/heatmap.h"
#include "compare/local_error.h"
#include "compare/quant_error.h"
#include "compare/sampling_check.h"
#include "dumps/contract/engine.h"
#include "dumps/contract/layer_window.h"

namespace llmdiff::compare {

struct BisectResult {
  std::string candidate_label, model;
  Scenario scenario;                          // the candidate's forward calls, as replayed
  LayerWindow layers;                         // the shard analysed (end < 0: no --layers, the model)
  ComputeDType dtype = ComputeDType::Float32; // the candidate's compute dtype
  std::string dtype_source;                   // "manifest", "default (no manifest dtype)"
  std::string reference;                      // the reference runner's description
  bool noise_floor = false;
  std::string second_noise;                   // the second honest run in the noise floor ("" when none)
  DiffResult global;                          // candidate vs reference at dtype
  LocalReport local;                          // candidate's local errors
  Diagnosis diagnosis;                        // the zoo's hypotheses, fingerprints, error signatures
  Evidence evidence;                          // what else the explainers read
  Finding finding;                            // the verdict (compare/explain.h)
  std::vector<std::string> notes;
  // `moe.topk_ids` names whose expert choices differ from the reference's
  // only at near-ties (NoiseFloorCriterion::judge_routing): reported, not
  // divergences. With no local failure, names diverging only after the first
  // of them follow from it (the tokens ran other experts), and the candidate
  // passes (flips_explain).
  std::vector<std::string> routing_flips;
  bool flips_explain = false;
  // The error where it originates (localised_at(); else global.heatmap:
  // the first diverging name whose shapes agree), for the HTML report.
  std::optional<ErrorHeatmap> heatmap;
  // A candidate that samples: its sampler checked on its own next_logits
  // (compare/sampling_check.h); a failing sampler fails the result.
  std::optional<SamplingCheck> sampling;
  // `--source`: how much of the divergence, layer by layer, the
  // quantisation of the model's weights alone explains (compare/quant_error.h).
  std::optional<QuantErrorReport> quantisation;

  // The first divergent name (global), the first local failure.
  std::optional<std::string> first_divergence() const;
  std::optional<std::string> first_local_failure() const;
  // Where the error originates: the first local failure, else the first divergence.
  std::optional<std::string> localised_at() const;
  bool ok() const;              // the forward pass: no divergence (beyond near-tie routing flips), no local failure
  bool sampler_fails() const;   // the sampler check ran and fails
  int exit_code() const { return ok() && !sampler_fails() ? 0 : 1; }
};

// The verdict in one line, as every format leads with it: "No divergence:
// 12 names within the noise floor, ..." or "Divergence, localised at X.
// Diagnosis: <headline of the finding>".
std::string headline(const BisectResult& r);
// The same from its parts (`merge` has them as JSON): `local_recomputed`
// nullopt when no local errors were computed.
// `flipped_at`: the first routing flip at a near-tie that explains the
// divergences after it ("" when none); `sampler_finding`: what explains the
// sampler's failure (compare/sampling_check.h sampling_finding; "" when nothing).
std::string verdict_headline(const Finding& f, bool ok, size_t compared, bool noise_floor,
                             std::optional<size_t> local_recomputed, const std::string& localised_at,
                             bool sampler_fails, const std::string& flipped_at = "",
                             const std::string& sampler_finding = "");

// Expert choices that differ from the reference's only at near-ties: one
// note per routing site (the comparison's judgement); with every op right on
// its own inputs, names that diverge only after the first such flip
// (canonical order) follow from it, and the result passes.
void note_routing_flips(BisectResult& r);

// The names whose error signatures a diagnosis reports: the localised site,
// then the first failing float names (at most four in all).
std::vector<std::string> signature_sites(const BisectResult& r);

}  // namespace llmdiff::compare
