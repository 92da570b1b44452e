// The bisect and diff pages of the HTML report: verdict, first divergence
// and first local failure, diagnosis with its evidence, the error-growth
// chart, the heatmap and sortable tables (pieces in compare/html_page.h).
#include "compare/report_html.h"

#include <limits>

#include "compare/bisect_report.h"
#include "compare/html_page.h"
#include "compare/quant_error.h"
#include "compare/report.h"
#include "compare/sampling_check.h"

namespace llmdiff::compare {

using html::esc;
using html::entry;
using html::num;
using html::Table;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::string code(const std::string& s) { return "<code>" + esc(s) + "</code>"; }

std::string result_word(const TensorComparison& t) {
  if (!t.judgement.judged && t.pass) return "info";
  if (t.pass) return "pass";
  return t.shape_match ? "FAIL" : "FAIL (shape)";
}

// Every failing name of a comparison (all of them with `all`), sortable.
std::string tensor_table(const DiffResult& r, bool all) {
  Table t("tensors", {"name", "shape", "max abs", "NMSE", "cosine", "metric", "value", "threshold", "value / threshold",
                      "result"});
  for (const TensorComparison& c : r.tensors) {
    if (c.pass && !all) continue;
    const bool flt = c.shape_match && !c.is_int;
    std::string shape = shape_str(c.ref_shape);
    if (!c.shape_match) shape += " vs " + shape_str(c.cand_shape);
    t.row(c.pass ? "pass" : "fail").code(c.name).text(shape);
    t.number(c.max_abs());
    if (flt)
      t.number(c.nmse()).number(c.metrics.cosine, 7);
    else
      t.text("-").text("-");
    if (c.is_int) {
      t.text("exact").count(c.ints.mismatches).count(0).number(c.ints.mismatches ? kInf : 0);
    } else {
      const double ratio = c.judgement.threshold > 0 ? c.judgement.value / c.judgement.threshold : kInf;
      t.text(c.judgement.metric).number(c.judgement.value).number(c.judgement.threshold).number(ratio);
    }
    t.text(result_word(c));
  }
  if (t.empty()) return "<p>None.</p>\n";
  return t.str();
}

std::string list(const std::vector<std::string>& items) {
  if (items.empty()) return "";
  std::string o = "<ul>\n";
  for (const auto& s : items) o += "<li>" + esc(s) + "</li>\n";
  return o + "</ul>\n";
}

std::string diagnosis_section(const BisectResult& r) {
  const Diagnosis& d = r.diagnosis;
  const Finding& f = r.finding;
  std::string o = "<section id=\"diagnosis\"><h2>Diagnosis</h2>\n";
  if (f.kind == FindingKind::Passes) return o + "<p>Nothing to diagnose.</p></section>\n";
  o += "<dl class=\"facts\">\n" + entry("focus", code(f.focus));
  o += entry("finding", "<strong>" + esc(headline(f)) + "</strong>");
  if (f.kind == FindingKind::ZooBug) {
    o += entry("bug", code(f.bug.str()));
    o += entry("evidence from", esc(bug_basis_name(f.basis)));
    if (!f.description.empty()) o += entry("what it does", esc(f.description));
  }
  o += entry("evidence", esc(explanation(f)));
  if (!f.ambiguous.empty()) {
    std::string a;
    for (const auto& s : f.ambiguous) a += (a.empty() ? "" : ", ") + code(s);
    o += entry("equally supported", a);
  }
  o += "</dl>\n";
  if (!d.fingerprints.empty()) {
    o += "<h3>Fingerprints</h3>\n<ul>\n";
    for (const auto& f : d.fingerprints)
      o += "<li>" + code(f.bug) + (f.decisive ? " (decisive)" : "") + ": " + esc(f.evidence) + "</li>\n";
    o += "</ul>\n";
  }
  if (!d.signatures.empty()) {
    o += "<h3>Error signatures</h3>\n";
    Table t("signatures", {"name", "kind", "fit (rmse left / before)", "decisive", "detail"});
    for (const auto& s : d.signatures)
      t.row().code(s.name).text(s.kind).number(s.fit).text(s.decisive ? "yes" : "no").text(s.detail);
    o += t.str();
  }
  return o + "</section>\n";
}

std::string hypotheses_section(const Diagnosis& d) {
  if (d.ranked.empty()) return "";
  Table t("hypotheses", {"rank", "hypothesis", "supported by", "replay agree", "of", "diverging agree", "of",
                         "focus rmse", "focus threshold", "local failures", "fixed", "new", "score", "summary"});
  int rank = 0;
  for (const HypothesisEvidence& e : d.ranked) {
    const std::string by = e.supported_by_replay && e.supported_by_local ? "replay + local"
                           : e.supported_by_replay                       ? "replay"
                           : e.supported_by_local                        ? "local"
                                                                         : "no";
    t.row(e.supported() ? "supported" : "").count(++rank).code(e.hypothesis.str()).text(by);
    if (e.replayed)
      t.count(e.replay_agree).count(e.replay_compared).count(e.failing_agree).count(e.failing_compared)
          .number(e.replay_focus_rmse).number(e.replay_focus_threshold);
    else
      t.text("-").text("-").text("-").text("-").text("-").text("-");
    if (e.local_tested)
      t.count((long long)e.local_failures).count((long long)e.local_fixed).count((long long)e.local_new);
    else
      t.text("-").text("-").text("-");
    t.number(e.score).text(e.summary);
  }
  return "<section id=\"hypotheses\"><h2>Hypotheses tested</h2>\n<p class=\"note\">Best first; click a header to "
         "sort.</p>\n" + t.str() + "</section>\n";
}

std::string local_section(const LocalReport& l) {
  if (!l.ran) return "<section id=\"local\"><h2>Local failures</h2>\n<p>Not computed.</p></section>\n";
  Table t("local", {"site", "local rmse", "threshold", "ratio", "reference local rmse", "max err", "recomputed from",
                    "verdict"});
  for (const LocalSite& s : l.sites) {
    if (s.pass) continue;
    t.row("fail").code(s.name);
    if (s.shape_match && !s.is_int) {
      t.number(s.noise.cand_rmse).number(s.noise.threshold()).number(s.noise.ratio());
      if (s.has_ref_noise)
        t.number(s.noise.ref_rmse);
      else
        t.text("-");
      t.number(s.max_abs);
    } else {
      t.text("-").text("-").text("-").text("-").text("-");
    }
    t.code(s.source).text(s.note.empty() ? "FAIL" : "FAIL: " + s.note);
  }
  std::string o = "<section id=\"local\"><h2>Local failures</h2>\n<p class=\"note\">" + std::to_string(l.failing()) +
                  " of " + std::to_string(l.sites.size()) +
                  " sites fail when recomputed with the reference's op from the candidate's own inputs (float64).</p>\n";
  return o + (t.empty() ? std::string("<p>None.</p>\n") : t.str()) + "</section>\n";
}

}  // namespace

std::string render_bisect_html(const BisectResult& r) {
  std::string b = "<h1>llmdiff bisect report</h1>\n<p class=\"note\">" + code(r.candidate_label) + " &middot; model " +
                  esc(r.model.empty() ? "?" : r.model) + " &middot; scenario " + esc(r.scenario.name) + " (" +
                  std::to_string(r.scenario.steps.size()) + " forward calls) &middot; compute dtype " +
                  esc(compute_dtype_name(r.dtype)) + " (" + esc(r.dtype_source) + ")</p>\n";
  b += "<div class=\"verdict " + std::string(r.exit_code() == 0 ? "ok" : "bad") + "\" id=\"verdict\">" +
       esc(headline(r)) + "</div>\n";
  b += "<dl class=\"facts\">\n" + entry("reference", esc(r.reference)) + entry("criterion", esc(bisect_criterion_text(r)));
  if (const TensorComparison* t = r.global.first())
    b += entry("first divergence", code(t->name) + " " + esc(divergence_line(*t)));
  else
    b += entry("first divergence", "none (" + std::to_string(r.global.tensors.size()) + " names compared)");
  if (!r.local.ran)
    b += entry("first local failure", "not computed");
  else if (const LocalSite* s = r.local.first())
    b += entry("first local failure", code(s->name) + " " + esc(local_error_line(*s)) + "; recomputed from " + code(s->source));
  else
    b += entry("first local failure", "none (" + std::to_string(r.local.sites.size()) + " sites recomputed)");
  b += entry("compared", std::to_string(r.global.tensors.size()) + " names, " + std::to_string(r.global.failing()) +
                             " diverge");
  b += "</dl>\n" + diagnosis_section(r);
  b += html::chart_section(r.global, &r.local) + html::heatmap_section(r.heatmap);
  b += hypotheses_section(r.diagnosis) + local_section(r.local);
  b += "<section id=\"diverging\"><h2>Names that diverge</h2>\n" + tensor_table(r.global, false) + "</section>\n";
  if (r.sampling)
    b += "<section id=\"sampling\"><h2>Sampler</h2>\n<pre>" + esc(render_sampling_check(*r.sampling)) + "</pre></section>\n";
  if (r.quantisation)
    b += "<section id=\"quantisation\"><h2>Quantisation</h2>\n<pre>" + esc(render_quant_error(*r.quantisation)) +
         "</pre></section>\n";
  std::vector<std::string> notes = r.notes;
  for (const auto& n : r.global.notes) notes.push_back(n);
  for (const auto& [bug, why] : r.diagnosis.inapplicable) notes.push_back("not tested: " + bug + ": " + why);
  if (!notes.empty()) b += "<section id=\"notes\"><h2>Notes</h2>\n" + list(notes) + "</section>\n";
  return html::page("llmdiff bisect: " + r.candidate_label, b);
}

std::string render_diff_html(const DiffResult& r) {
  std::string b = "<h1>llmdiff diff report</h1>\n";
  Table sides("sides", {"side", "dump", "producer", "model", "scenario", "steps", "dtype", "tensors"});
  for (const auto* s : {&r.ref, &r.cand})
    sides.row().text(s == &r.ref ? "reference" : "candidate").code(s->label).text(s->manifest.producer)
        .text(s->manifest.model).text(s->manifest.scenario).count(s->steps).text(s->manifest.dtype)
        .count((long long)s->tensors);
  b += sides.str();
  std::string verdict = r.tensors.empty() ? "No tensors compared"
                        : r.ok()          ? "Within tolerance: " + std::to_string(r.tensors.size()) + " of " +
                                       std::to_string(r.tensors.size()) + " tensors"
                                          : "Diverges: " + std::to_string(r.failing()) + " of " +
                                       std::to_string(r.tensors.size()) + " tensors outside tolerance";
  b += "<div class=\"verdict " + std::string(r.ok() ? "ok" : "bad") + "\" id=\"verdict\">" + esc(verdict) + "</div>\n";
  b += "<dl class=\"facts\">\n" + entry("compute dtype", esc(std::string(compute_dtype_name(r.dtype)) + " (" + r.dtype_source + ")"));
  b += entry("criterion", code(r.criterion) + ", default tolerance " + esc(r.base_tolerance.str()));
  for (const auto& o : r.overrides) b += entry("override", code("--tol " + o.text));
  if (const TensorComparison* f = r.first()) {
    std::string d = code(f->name) + " " + esc(shape_str(f->ref_shape)) + ": " + esc(divergence_line(*f));
    if (f->shape_match && !f->is_int)
      d += "; max abs at " + esc(index_str(unravel(f->metrics.max_abs_at, f->ref_shape))) + " (candidate " +
           num(f->metrics.cand_at_max_abs) + ", reference " + num(f->metrics.ref_at_max_abs) + ")";
    for (const auto& fd : f->findings) d += "<br>finding (" + esc(finding_kind_name(fd.kind)) + "): " + esc(fd.summary);
    for (const auto& n : f->notes) d += "<br>note: " + esc(n);
    b += entry("first divergence", d);
  } else {
    b += entry("first divergence", "none");
  }
  const GreedyAgreement& g = r.greedy;
  if (!g.steps.empty())
    b += entry("greedy tokens", g.first_divergent_step < 0 ? "all " + std::to_string(g.steps.size()) + " steps agree"
                                                           : "first differ at step " + std::to_string(g.first_divergent_step));
  b += entry("names on one side", std::to_string(r.only_in_ref.size()) + " only in the reference, " +
                                      std::to_string(r.only_in_cand.size()) + " only in the candidate");
  b += "</dl>\n" + html::chart_section(r, nullptr) + html::heatmap_section(r.heatmap);
  b += "<section id=\"diverging\"><h2>Failing tensors</h2>\n" + tensor_table(r, false) + "</section>\n";
  std::vector<std::string> one_side;
  for (const auto& n : r.only_in_ref) one_side.push_back(n + ": only in the reference");
  for (const auto& n : r.only_in_cand) one_side.push_back(n + ": only in the candidate");
  if (!one_side.empty()) b += "<section id=\"one-side\"><h2>Names only one side holds</h2>\n" + list(one_side) + "</section>\n";
  if (!r.notes.empty()) b += "<section id=\"notes\"><h2>Notes</h2>\n" + list(r.notes) + "</section>\n";
  return html::page("llmdiff diff: " + r.cand.label, b);
}

}  // namespace llmdiff::compare
