// Table, JSON and Markdown renderings of a bisection. The JSON schema is
// documented in compare/README.md ("Bisect JSON"); fields are only ever
// added, never renamed or removed, without bumping the schema version.
#include "compare/bisect_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "compare/cross_signatures.h"
#include "compare/quant_error.h"
#include "compare/report.h"
#include "compare/sampling_check.h"

namespace llmdiff::compare {

namespace {
std::string num_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}
}  // namespace

namespace {
using nlohmann::json;

json opt_str(const std::optional<std::string>& s) { return s ? json(*s) : json(nullptr); }

std::string pad(const std::string& s, size_t w) { return s.size() >= w ? s + " " : s + std::string(w - s.size(), ' '); }

std::string steps_text(const Scenario& sc) {
  std::string t;
  for (const auto& s : sc.steps) t += (t.empty() ? "" : ", ") + std::to_string(s.size());
  return std::to_string(sc.steps.size()) + " forward call" + (sc.steps.size() == 1 ? "" : "s") + " (T = " + t + ")";
}

std::string criterion_text(const BisectResult& r) {
  if (r.noise_floor) {
    char m[16];
    std::snprintf(m, sizeof m, "%g", noise_multiplier(r.dtype));
    if (!r.second_noise.empty())
      return std::string("noise floor: RMSE vs the float64 reference <= ") + m + " x the larger RMSE of the reference at " +
             compute_dtype_name(r.dtype) + " and the clean " + r.second_noise + " (float32) + floor";
    return std::string("noise floor: RMSE vs the float64 reference <= ") + m + " x the reference's own " +
           compute_dtype_name(r.dtype) + " RMSE + floor";
  }
  return "allclose at " + r.global.base_tolerance.str();
}

// "rmse 1.2e-01 > 2 x 3.1e-08 + 2.4e-07 (max err 5.3e-01)" for a divergence.
std::string divergence_text(const TensorComparison& t) {
  std::string s;
  if (!t.shape_match) return "shape " + shape_str(t.cand_shape) + " vs reference " + shape_str(t.ref_shape);
  if (t.is_int) {
    return std::to_string(t.ints.mismatches) + " of " + std::to_string(t.ints.count) + " values differ (first: " +
           std::to_string(t.ints.cand_value) + " where the reference has " + std::to_string(t.ints.ref_value) + ")";
  }
  if (t.judgement.metric == "rmse vs float64")
    s = "rmse vs float64 " + fmt_num(t.judgement.value, 2) + " > threshold " + fmt_num(t.judgement.threshold, 2);
  else
    s = t.judgement.metric + " " + fmt_num(t.judgement.value, 2) + " > " + fmt_num(t.judgement.threshold, 2);
  s += " (max err " + fmt_num(t.metrics.max_abs, 2) + ", nmse " + fmt_num(t.metrics.nmse, 2) + ")";
  return s;
}

std::string local_text(const LocalSite& s) {
  if (!s.shape_match) return s.note;
  if (s.is_int) return s.note.empty() ? "exact" : s.note;
  std::string t = "local rmse " + fmt_num(s.noise.cand_rmse, 2) + (s.pass ? " <= " : " > ") +
                  fmt_num(s.noise.threshold(), 2) + " (reference's local rmse " + fmt_num(s.noise.ref_rmse, 2) +
                  "), max err " + fmt_num(s.max_abs, 2);
  return t;
}

std::string hyp_support(const HypothesisEvidence& e) {
  if (e.supported_by_replay && e.supported_by_local) return "replay + local";
  if (e.supported_by_replay) return "replay";
  if (e.supported_by_local) return "local";
  return "no";
}

std::string ratio(int a, int b) { return std::to_string(a) + "/" + std::to_string(b); }

json hypothesis_json(const HypothesisEvidence& e) {
  json j = {{"hypothesis", e.hypothesis.str()},
            {"bug", e.hypothesis.bug},
            {"value", e.hypothesis.value ? json(*e.hypothesis.value) : json(nullptr)},
            {"supported", e.supported()},
            {"supported_by", json::array()},
            {"score", json_num(e.score)},
            {"replay", nullptr},
            {"local", nullptr},
            {"summary", e.summary}};
  if (e.supported_by_replay) j["supported_by"].push_back("replay");
  if (e.supported_by_local) j["supported_by"].push_back("local");
  if (e.replayed)
    j["replay"] = {{"compared", e.replay_compared},
                   {"agree", e.replay_agree},
                   {"diverging_compared", e.failing_compared},
                   {"diverging_agree", e.failing_agree},
                   {"focus_agree", e.replay_focus_agree},
                   {"focus_rmse", json_num(e.replay_focus_rmse)},
                   {"focus_threshold", json_num(e.replay_focus_threshold)},
                   {"from_step", e.replay_from_step},
                   {"first_disagreement", e.replay_first_disagreement.empty() ? json(nullptr)
                                                                              : json(e.replay_first_disagreement)}};
  if (e.local_tested)
    j["local"] = {{"failures", e.local_failures},
                  {"fixed", e.local_fixed},
                  {"new", e.local_new},
                  {"focus_pass", e.local_focus_pass},
                  {"focus_max_abs", json_num(e.local_focus_max_abs)},
                  {"focus_rmse", json_num(e.local_focus_rmse)}};
  return j;
}

json local_site_json(const LocalSite& s) {
  return {{"name", s.name},
          {"source", s.source},
          {"pass", s.pass},
          {"kind", s.is_int ? "int" : "float"},
          {"shape_match", s.shape_match},
          {"cand_shape", json(s.cand_shape)},
          {"local_shape", json(s.local_shape)},
          {"rmse", json_num(s.noise.cand_rmse)},
          {"ref_rmse", s.has_ref_noise ? json_num(s.noise.ref_rmse) : json(nullptr)},
          {"threshold", json_num(s.noise.threshold())},
          {"max_abs", json_num(s.max_abs)},
          {"nmse", json_num(s.nmse)},
          {"int_mismatches", s.int_mismatches},
          {"note", s.note}};
}

}  // namespace

// ---------------------------------------------------------------------------
// JSON

namespace {

// The `diagnosis` object: the zoo's evidence, and the finding's words in
// the keys llmdiff.bisect/1 has always had.
json diagnosis_json(const BisectResult& r) {
  const Diagnosis& d = r.diagnosis;
  const Finding& f = r.finding;
  const bool bug = f.kind == FindingKind::ZooBug;
  const std::optional<std::string> basis = basis_label(f);
  json dj = {{"needed", f.kind != FindingKind::Passes},
             {"focus", f.focus.empty() ? json(nullptr) : json(f.focus)},
             {"bug", bug ? json(f.bug.bug) : json(nullptr)},
             {"value", bug && f.bug.value ? json(*f.bug.value) : json(nullptr)},
             {"hypothesis", bug ? json(f.bug.str()) : json(nullptr)},
             {"description", bug ? json(f.description) : json(nullptr)},
             {"basis", basis ? json(*basis) : json(nullptr)},
             {"evidence", explanation(f)},
             {"ambiguous", bug ? f.ambiguous : std::vector<std::string>{}},
             {"hypotheses", json::array()},
             {"fingerprints", json::array()},
             {"signatures", json::array()},
             {"inapplicable", json::array()}};
  for (const auto& e : d.ranked) dj["hypotheses"].push_back(hypothesis_json(e));
  for (const auto& fp : d.fingerprints)
    dj["fingerprints"].push_back({{"bug", fp.bug}, {"evidence", fp.evidence}, {"decisive", fp.decisive}});
  for (const auto& p : d.inapplicable) dj["inapplicable"].push_back({{"bug", p.first}, {"reason", p.second}});
  for (const auto& g : d.signatures)
    dj["signatures"].push_back(
        {{"name", g.name}, {"kind", g.kind}, {"detail", g.detail}, {"fit", g.fit}, {"decisive", g.decisive},
         {"recomputed", g.recomputed}});
  return dj;
}

// What the finding declares, in the keys llmdiff.bisect/1 has always had.
json declared(const Finding& f, Declaration d) {
  if (f.kind != FindingKind::Precision || f.declare != d) return nullptr;
  return d == Declaration::Profile ? json::parse(f.profile) : json(compute_dtype_name(f.dtype));
}

}  // namespace

json bisect_to_json(const BisectResult& r) {
  json steps = json::array();
  for (const auto& s : r.scenario.steps) steps.push_back(s.size());
  const Finding& f = r.finding;
  json j = {{"schema", kBisectSchema},
            {"candidate", r.candidate_label},
            {"model", r.model},
            {"reference", r.reference},
            {"dtype", compute_dtype_name(r.dtype)},
            {"dtype_source", r.dtype_source},
            {"scenario", {{"name", r.scenario.name}, {"tokens_per_step", steps}, {"generated", r.scenario.emit_generated}}},
            {"criterion", r.noise_floor ? "noise-floor" : "allclose"},
            {"noise_second_run", r.second_noise.empty() ? json(nullptr) : json(r.second_noise)},
            {"ok", r.ok()},
            {"exit_code", r.exit_code()},
            {"first_divergence", opt_str(r.first_divergence())},
            {"first_local_failure", opt_str(r.first_local_failure())},
            {"localised_at", opt_str(r.localised_at())},
            {"compared", r.global.tensors.size()},
            {"diverging", r.global.failing()},
            {"local", nullptr},
            {"finding", finding_to_json(f)},
            {"headline", headline(r)},
            {"diagnosis", diagnosis_json(r)},
            {"notes", r.notes},
            {"declare_dtype", declared(f, Declaration::ComputeDtype)},
            {"declare_kv_cache", declared(f, Declaration::KvCache)},
            {"declare_precision", declared(f, Declaration::Profile)},
            {"layout", f.kind == FindingKind::Layout ? json{{"kind", finding_kind_name(f.layout.kind)},
                                                            {"rope", f.layout.rope},
                                                            {"summary", f.layout.summary}}
                                                      : json(nullptr)},
            {"diff", diff_to_json(r.global)}};
  // A shard (bisect --layers): its layers, [first, end) of num_layers.
  j["layers"] = r.layers.end < 0 ? json(nullptr)  // --layers given (0:L too: a one-shard merge)
                                 : json{{"first", r.layers.first}, {"end", r.layers.end},
                                        {"num_layers", r.layers.num_layers}};
  if (r.local.ran) {
    json failing = json::array();
    for (const auto& s : r.local.sites)
      if (!s.pass) failing.push_back(local_site_json(s));
    j["local"] = {{"recomputed", r.local.sites.size()},
                  {"failing", r.local.failing()},
                  {"first_failure", r.local.first() ? local_site_json(*r.local.first()) : json(nullptr)},
                  {"failing_sites", failing},
                  {"not_recomputed", r.local.not_recomputed}};
  }
  if (r.sampling) j["sampling"] = sampling_check_to_json(*r.sampling);
  if (r.quantisation) j["quantisation"] = quant_error_to_json(*r.quantisation);
  return j;
}

std::string render_bisect_json(const BisectResult& r) { return bisect_to_json(r).dump(2) + "\n"; }

// ---------------------------------------------------------------------------
// Table

std::string render_bisect_table(const BisectResult& r, const BisectTableOptions& opt) {
  std::string o;
  const Diagnosis& d = r.diagnosis;
  o += "llmdiff bisect: " + r.candidate_label + "\n";
  o += "  model " + (r.model.empty() ? std::string("?") : r.model) + ", scenario " + r.scenario.name + ": " +
       steps_text(r.scenario) + ", compute dtype " + compute_dtype_name(r.dtype) + " (" + r.dtype_source + ")\n";
  o += "  reference: " + r.reference + "\n";
  o += "  criterion: " + criterion_text(r) + "\n";
  if (r.layers.end >= 0)
    o += "  shard: layers " + r.layers.str() + " of " + std::to_string(r.layers.num_layers) +
         (r.layers.first > 0 ? ", every run from the candidate's residual stream entering layer " +
                                   std::to_string(r.layers.first)
                             : std::string()) +
         " (llmdiff merge joins the shards)\n";
  o += "\n";

  if (r.ok() && r.flips_explain) {
    o += "RESULT: no divergence beyond routing flips at near-ties: " + std::to_string(r.global.failing()) + " of " +
         std::to_string(r.global.tensors.size()) + " names diverge after " + r.routing_flips.front() +
         ", no local failure";
    o += "\n";
  } else if (r.ok()) {
    o += "RESULT: no divergence: " + std::to_string(r.global.tensors.size()) + " names within the " +
         (r.noise_floor ? "noise floor" : "tolerance");
    if (r.local.ran) o += ", " + std::to_string(r.local.sites.size()) + " local recomputes within the noise";
    o += "\n";
  } else {
    o += "RESULT: divergence, localised at " + r.localised_at().value_or("?") + "\n";
  }
  if (const TensorComparison* t = r.global.first())
    o += "  " + pad("first divergence", 22) + pad(t->name, 34) + divergence_text(*t) + "\n";
  else
    o += "  " + pad("first divergence", 22) + "none (" + std::to_string(r.global.tensors.size()) + " names compared)\n";
  if (r.local.ran) {
    if (const LocalSite* s = r.local.first())
      o += "  " + pad("first local failure", 22) + pad(s->name, 34) + local_text(*s) + "; recomputed from " +
           s->source + "\n";
    else
      o += "  " + pad("first local failure", 22) + "none (" + std::to_string(r.local.sites.size()) +
           " sites recomputed from the candidate's own inputs)\n";
  } else {
    o += "  " + pad("first local failure", 22) + "not computed\n";
  }
  o += "  compared " + std::to_string(r.global.tensors.size()) + " names, " + std::to_string(r.global.failing()) +
       " diverge";
  if (!r.global.only_in_ref.empty()) o += "; " + std::to_string(r.global.only_in_ref.size()) + " reference names not in the candidate";
  if (!r.global.only_in_cand.empty()) o += "; " + std::to_string(r.global.only_in_cand.size()) + " candidate names not in the reference";
  o += "\n";

  if (r.local.ran && (r.local.failing() > 0 || opt.all)) {
    o += "\nLocal errors (candidate vs the reference op on its own inputs, float64)" +
         std::string(opt.all ? "" : ", failing sites") + ":\n";
    o += "  " + pad("site", 36) + pad("local rmse", 11) + pad("ref local", 11) + pad("threshold", 11) +
         pad("max err", 11) + "recomputed from\n";
    int shown = 0;
    for (const auto& s : r.local.sites) {
      if (s.pass && !opt.all) continue;
      if (!opt.all && shown++ == 20) {
        o += "  ... " + std::to_string(r.local.failing() - 20) + " more failing sites\n";
        break;
      }
      std::string verdict = s.pass ? "" : "  FAIL";
      if (!s.shape_match || s.is_int) {
        o += "  " + pad(s.name, 36) + s.note + verdict + "\n";
        continue;
      }
      o += "  " + pad(s.name, 36) + pad(fmt_num(s.noise.cand_rmse, 2), 11) +
           pad(s.has_ref_noise ? fmt_num(s.noise.ref_rmse, 2) : "-", 11) + pad(fmt_num(s.noise.threshold(), 2), 11) +
           pad(fmt_num(s.max_abs, 2), 11) + s.source + verdict + "\n";
    }
  }

  const Finding& f = r.finding;
  o += "\nDiagnosis";
  if (f.kind == FindingKind::Passes) {
    o += ": nothing to diagnose\n";
  } else {
    o += " at " + f.focus + ": " + headline(f) + "\n";
    if (f.kind == FindingKind::ZooBug && !f.description.empty()) o += "  the bug: " + f.description + "\n";
    o += "  " + explanation(f) + "\n";
    if (!d.ranked.empty()) {
      o += "\n  Hypotheses tested (best first" + std::string(opt.all ? "" : ", top " + std::to_string(opt.hypotheses)) +
           " of " + std::to_string(d.ranked.size()) + "):\n";
      o += "    " + pad("hypothesis", 24) + pad("replay agree", 14) + pad("diverging", 11) + pad("focus rmse", 11) +
           pad("local fails", 12) + "supported\n";
      int shown = 0;
      for (const auto& e : d.ranked) {
        if (!opt.all && shown++ == opt.hypotheses) break;
        o += "    " + pad(e.hypothesis.str(), 24) +
             pad(e.replayed ? ratio(e.replay_agree, e.replay_compared) : "-", 14) +
             pad(e.replayed ? ratio(e.failing_agree, e.failing_compared) : "-", 11) +
             pad(e.replayed ? fmt_num(e.replay_focus_rmse, 2) : "-", 11) +
             pad(e.local_tested ? std::to_string(e.local_failures) + " (" + std::to_string(e.local_fixed) + "/" +
                                      std::to_string(e.local_new) + ")"
                                : "-",
                 12) +
             hyp_support(e) + "\n";
      }
    }
    if (!d.fingerprints.empty()) {
      o += "\n  Fingerprints:\n";
      for (const auto& f : d.fingerprints)
        o += "    " + f.bug + (f.decisive ? "" : " (hint)") + ": " + f.evidence + "\n";
    }
    if (!d.signatures.empty()) {
      o += "\n  Error signatures:\n";
      for (const auto& g : d.signatures)
        o += "    " + signature_line(g) + "\n";
    }
    if (!d.inapplicable.empty()) {
      o += "\n  Not applicable to this model: ";
      std::string list;
      for (const auto& p : d.inapplicable) list += (list.empty() ? "" : ", ") + p.first;
      o += list + "\n";
    }
  }
  for (const auto& n : r.notes) o += "note: " + n + "\n";
  for (const auto& n : r.global.notes) o += "note: " + n + "\n";
  if (r.sampling) o += "\n" + render_sampling_check(*r.sampling);
  if (r.quantisation) o += "\n" + render_quant_error(*r.quantisation);
  return o;
}

// ---------------------------------------------------------------------------
// Markdown

namespace {
std::string md_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '|') o += "\\|";
    else if (c == '\n') o += "<br>";
    else o += c;
  }
  return o;
}
std::string code(const std::string& s) { return "`" + s + "`"; }
}  // namespace

std::string render_bisect_markdown(const BisectResult& r) {
  const Diagnosis& d = r.diagnosis;
  std::string o = "# llmdiff bisection report\n\n";
  o += "| | |\n|---|---|\n";
  o += "| candidate | " + code(r.candidate_label) + " |\n";
  o += "| model | " + md_escape(r.model) + " |\n";
  o += "| scenario | " + md_escape(r.scenario.name + ": " + steps_text(r.scenario)) + " |\n";
  o += "| compute dtype | " + std::string(compute_dtype_name(r.dtype)) + " (" + r.dtype_source + ") |\n";
  o += "| reference | " + md_escape(r.reference) + " |\n";
  o += "| criterion | " + md_escape(criterion_text(r)) + " |\n";
  o += "| result | **" + md_escape(headline(r)) + "** (exit code " +
       std::to_string(r.exit_code()) + ") |\n\n";

  o += "## Localisation\n\n";
  if (const TensorComparison* t = r.global.first())
    o += "- First divergence (global): " + code(t->name) + ": " + md_escape(divergence_text(*t)) + "\n";
  else
    o += "- First divergence (global): none among " + std::to_string(r.global.tensors.size()) + " names\n";
  if (r.local.ran) {
    if (const LocalSite* s = r.local.first())
      o += "- First local failure (teacher forcing): " + code(s->name) + ": " + md_escape(local_text(*s)) +
           "; recomputed from " + md_escape(s->source) + "\n";
    else
      o += "- First local failure (teacher forcing): none among " + std::to_string(r.local.sites.size()) +
           " recomputed sites\n";
  } else {
    o += "- Local errors: not computed\n";
  }
  if (auto at = r.localised_at()) o += "- **Localised at " + code(*at) + "**\n";
  o += "- " + std::to_string(r.global.tensors.size()) + " names compared, " + std::to_string(r.global.failing()) +
       " diverge\n\n";

  const Finding& f = r.finding;
  o += "## Diagnosis\n\n";
  if (f.kind == FindingKind::Passes) {
    o += "Nothing to diagnose.\n\n";
  } else {
    o += "- Focus: " + code(f.focus) + "\n";
    o += "- Finding: **" + md_escape(headline(f)) + "**\n";
    if (f.kind == FindingKind::ZooBug && !f.description.empty()) o += "- What it does: " + md_escape(f.description) + "\n";
    o += "- Evidence: " + md_escape(explanation(f)) + "\n\n";
    if (!d.ranked.empty()) {
      o += "| hypothesis | replay agree | diverging agree | focus rmse | local failures (fixed/new) | supported |\n";
      o += "|---|---|---|---|---|---|\n";
      int shown = 0;
      for (const auto& e : d.ranked) {
        if (shown++ == 10) break;
        o += "| " + code(e.hypothesis.str()) + " | " + (e.replayed ? ratio(e.replay_agree, e.replay_compared) : "-") +
             " | " + (e.replayed ? ratio(e.failing_agree, e.failing_compared) : "-") + " | " +
             (e.replayed ? fmt_num(e.replay_focus_rmse, 2) : "-") + " | " +
             (e.local_tested ? std::to_string(e.local_failures) + " (" + std::to_string(e.local_fixed) + "/" +
                                   std::to_string(e.local_new) + ")"
                             : "-") +
             " | " + hyp_support(e) + " |\n";
      }
      o += "\n";
    }
    if (!d.fingerprints.empty()) {
      o += "Fingerprints:\n\n";
      for (const auto& f : d.fingerprints)
        o += "- " + code(f.bug) + (f.decisive ? "" : " (hint)") + ": " + md_escape(f.evidence) + "\n";
      o += "\n";
    }
    if (!d.signatures.empty()) {
      o += "Error signatures:\n\n";
      for (const auto& g : d.signatures)
        o += "- " + code(g.name) + ": **" + g.kind + "**" + signature_fit_note(g) + ": " + md_escape(g.detail) + "\n";
      o += "\n";
    }
  }

  if (r.local.ran && r.local.failing() > 0) {
    o += "## Local failures\n\n| site | local rmse | reference local rmse | threshold | max err | recomputed from |\n";
    o += "|---|---|---|---|---|---|\n";
    int shown = 0;
    for (const auto& s : r.local.sites) {
      if (s.pass) continue;
      if (shown++ == 50) break;
      o += "| " + code(s.name) + " | " +
           (s.shape_match && !s.is_int ? fmt_num(s.noise.cand_rmse, 2) : md_escape(s.note)) + " | " +
           (s.has_ref_noise ? fmt_num(s.noise.ref_rmse, 2) : "-") + " | " + fmt_num(s.noise.threshold(), 2) + " | " +
           fmt_num(s.max_abs, 2) + " | " + md_escape(s.source) + " |\n";
    }
    o += "\n";
  }

  o += "## Diverging names (global)\n\n";
  if (r.global.failing() == 0) {
    o += "None.\n\n";
  } else {
    o += "| name | verdict |\n|---|---|\n";
    int shown = 0;
    for (const auto& t : r.global.tensors) {
      if (t.pass) continue;
      if (shown++ == 50) {
        o += "| ... | " + std::to_string(r.global.failing() - 50) + " more |\n";
        break;
      }
      o += "| " + code(t.name) + " | " + md_escape(divergence_text(t)) + " |\n";
    }
    o += "\n";
  }
  if (r.sampling) o += "## Sampler\n\n```\n" + render_sampling_check(*r.sampling) + "```\n\n";
  if (r.quantisation) o += "## Quantisation\n\n```\n" + render_quant_error(*r.quantisation) + "```\n\n";
  if (!r.notes.empty() || !r.global.notes.empty()) {
    o += "## Notes\n\n";
    for (const auto& n : r.notes) o += "- " + md_escape(n) + "\n";
    for (const auto& n : r.global.notes) o += "- " + md_escape(n) + "\n";
  }
  return o;
}

std::string bisect_criterion_text(const BisectResult& r) { return criterion_text(r); }
std::string divergence_line(const TensorComparison& t) { return divergence_text(t); }
std::string local_error_line(const LocalSite& s) { return local_text(s); }

std::string signature_fit_note(const ErrorSignature& g) {
  if (g.decisive || g.kind == kOnlySomeKind) return "";
  return " (partial fit " + num_text(g.fit) + ")";
}

std::string signature_line(const ErrorSignature& g) {
  return g.name + ": " + g.kind + signature_fit_note(g) + ": " + g.detail;
}

}  // namespace llmdiff::compare
