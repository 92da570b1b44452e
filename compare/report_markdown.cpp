// Markdown report of a diff (`llmdiff diff --report FILE.md`): the whole
// picture in one file, every tensor listed.
#include <cmath>
#include <cstdio>

#include "compare/report.h"

namespace llmdiff::compare {

namespace {
std::string code(const std::string& s) { return "`" + md_cell(s) + "`"; }

std::string fixed(double v, int digits) {
  if (!std::isfinite(v)) return fmt_num(v);
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string result_word(const TensorComparison& t) {
  if (!t.judgement.judged && t.pass) return "info";
  if (t.pass) return "PASS";
  return t.shape_match ? "**FAIL**" : "**FAIL (shape)**";
}

void tensor_table(std::string& out, const std::vector<const TensorComparison*>& rows) {
  out += "| name | shape | max abs | NMSE | cosine | max ulp | min atol | min rtol | rtol / atol | result |\n";
  out += "|---|---|--:|--:|--:|--:|--:|--:|--:|---|\n";
  for (const TensorComparison* t : rows) {
    bool flt = t->shape_match && !t->is_int;
    std::string shape = shape_str(t->ref_shape);
    if (!t->shape_match) shape += " vs " + shape_str(t->cand_shape);
    out += "| " + code(t->name) + " | " + md_cell(shape) + " | " + (t->shape_match ? fmt_num(t->max_abs()) : "-") + " | " +
           (flt ? fmt_num(t->metrics.nmse) : "-") + " | " + (flt ? fixed(t->metrics.cosine, 7) : "-") + " | " +
           (flt ? std::to_string(t->metrics.max_ulp) : "-") + " | " + (flt ? fmt_num(t->allclose.min_atol) : "-") + " | " +
           (flt ? fmt_num(t->allclose.min_rtol) : "-") + " | " +
           (t->is_int ? "exact" : fmt_num(t->tolerance.rtol) + " / " + fmt_num(t->tolerance.atol)) + " | " +
           result_word(*t) + " |\n";
  }
}

void side(std::string& out, const char* title, const SideSummary& s) {
  const Manifest& m = s.manifest;
  out += "| " + std::string(title) + " | " + code(s.label) + " | " + md_cell(m.producer) + " | " + md_cell(m.model) + " | " +
         md_cell(m.scenario) + " | " + std::to_string(s.steps) + " | " + md_cell(m.dtype) + " | " + std::to_string(s.tensors) +
         " |\n";
}
}  // namespace

std::string render_diff_markdown(const DiffResult& r) {
  std::string out = "# llmdiff diff report\n\n";
  out += "| side | dump | producer | model | scenario | steps | dtype | tensors |\n|---|---|---|---|---|--:|---|--:|\n";
  side(out, "reference", r.ref);
  side(out, "candidate", r.cand);
  out += "\nCompute dtype for tolerances and ULPs: **" + std::string(compute_dtype_name(r.dtype)) + "** (" + r.dtype_source +
         "); default tolerance " + r.base_tolerance.str() + "; criterion `" + r.criterion + "`.\n";
  for (const auto& o : r.overrides) out += "- override `--tol " + o.text + "`\n";
  if (!r.sites.empty()) {
    out += "- sites:";
    for (const auto& s : r.sites) out += " `" + s + "`";
    out += "\n";
  }
  for (const auto& n : r.notes) out += "- note: " + n + "\n";

  out += "\n## Result\n\n";
  if (r.tensors.empty())
    out += "No tensors compared.\n";
  else if (r.ok())
    out += "Within tolerance: " + std::to_string(r.tensors.size()) + " of " + std::to_string(r.tensors.size()) + " tensors.\n";
  else
    out += "Diverges: " + std::to_string(r.failing()) + " of " + std::to_string(r.tensors.size()) +
           " tensors outside tolerance.\n";
  out += "\nNames only in the reference: " + std::to_string(r.only_in_ref.size()) +
         "; only in the candidate: " + std::to_string(r.only_in_cand.size()) + ".\n";

  out += "\n## First divergence\n\n";
  if (const TensorComparison* f = r.first()) {
    out += code(f->name) + " " + shape_str(f->ref_shape) + "\n\n";
    if (!f->shape_match) {
      out += "- shape " + shape_str(f->cand_shape) + " in the candidate\n";
    } else if (f->is_int) {
      out += "- " + std::to_string(f->ints.mismatches) + " of " + std::to_string(f->ints.count) + " values differ\n";
    } else {
      const auto& m = f->metrics;
      out += "- max abs " + fmt_num(m.max_abs) + " at " + index_str(unravel(m.max_abs_at, f->ref_shape)) + " (candidate " +
             fmt_num(m.cand_at_max_abs) + ", reference " + fmt_num(m.ref_at_max_abs) + ")\n";
      out += "- NMSE " + fmt_num(m.nmse) + ", SQNR " + fixed(m.sqnr_db, 1) + " dB, cosine " + fixed(m.cosine, 7) +
             ", max rel " + fmt_num(m.max_rel) + ", max ulp " + std::to_string(m.max_ulp) + "\n";
      out += "- " + f->judgement.metric + " " + fmt_num(f->judgement.value) + " > " + fmt_num(f->judgement.threshold) +
             "; " + std::to_string(f->allclose.failing) + " of " + std::to_string(f->allclose.count) +
             " elements outside " + f->tolerance.str() + "; would pass with atol >= " + fmt_num(f->allclose.min_atol) +
             " or rtol >= " + fmt_num(f->allclose.min_rtol) + "\n";
    }
    for (const auto& n : f->notes) out += "- note: " + n + "\n";
    for (const auto& fd : f->findings) out += std::string("- finding (") + finding_kind_name(fd.kind) + "): " + fd.summary + "\n";
  } else {
    out += "None.\n";
  }

  std::vector<const TensorComparison*> failing, all;
  for (const auto& t : r.tensors) {
    all.push_back(&t);
    if (!t.pass) failing.push_back(&t);
  }
  if (!failing.empty()) {
    out += "\n## Failing tensors\n\n";
    tensor_table(out, failing);
    for (const TensorComparison* t : failing) {
      if (t->notes.empty() && t->findings.empty() && !t->logits) continue;
      out += "\n" + code(t->name) + ":\n";
      if (t->logits)
        out += "- argmax agrees on " + std::to_string(t->logits->argmax_agree) + "/" + std::to_string(t->logits->rows) +
               " rows, top-" + std::to_string(t->logits->topk) + " overlap " + fixed(t->logits->topk_overlap, 3) +
               ", KL mean " + fmt_num(t->logits->kl_mean) + "\n";
      for (const auto& n : t->notes) out += "- note: " + n + "\n";
      for (const auto& fd : t->findings) out += std::string("- finding (") + finding_kind_name(fd.kind) + "): " + fd.summary + "\n";
    }
  }

  if (!r.only_in_ref.empty() || !r.only_in_cand.empty()) {
    out += "\n## Names only one side holds\n\n";
    for (const auto& n : r.only_in_ref) out += "- " + code(n) + ": only in the reference (missing in the candidate)\n";
    for (const auto& n : r.only_in_cand) out += "- " + code(n) + ": only in the candidate\n";
  }

  if (!r.layer_trace.empty()) {
    out += "\n## Per-layer error trace\n\nWorst error over each group's sites; key = the group's output (`embed`, "
           "`layers.{i}.out`, `logits`).\n\n";
    out += "| step | group | sites | failing | worst NMSE | at | worst max abs | at | key NMSE | key max abs |\n";
    out += "|--:|---|--:|--:|--:|---|--:|---|--:|--:|\n";
    for (const auto& g : r.layer_trace)
      out += "| " + std::to_string(g.step) + " | " + g.label() + " | " + std::to_string(g.compared) + " | " +
             std::to_string(g.failing) + " | " + fmt_num(g.worst_nmse) + " | " + code(g.worst_nmse_site) + " | " +
             fmt_num(g.worst_max_abs) + " | " + code(g.worst_max_abs_site) + " | " +
             (g.has_key ? fmt_num(g.key_nmse) : "-") + " | " + (g.has_key ? fmt_num(g.key_max_abs) : "-") + " |\n";
  }

  const GreedyAgreement& g = r.greedy;
  if (!g.steps.empty() || g.has_generated) {
    out += "\n## Greedy tokens\n\n";
    if (!g.steps.empty()) {
      out += "| step | reference | candidate |\n|--:|--:|--:|\n";
      for (const auto& s : g.steps)
        out += "| " + std::to_string(s.step) + " | " + std::to_string(s.ref_token) + " | " + std::to_string(s.cand_token) +
               " |\n";
      out += "\n" + (g.first_divergent_step < 0 ? std::string("All steps agree.")
                                                : "First differs at step " + std::to_string(g.first_divergent_step) + ".") +
             "\n";
    }
    if (g.has_generated) {
      auto list = [](const std::vector<int64_t>& v) {
        std::string s;
        for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
        return "[" + s + "]";
      };
      out += "\n`generated`: reference " + list(g.ref_generated) + ", candidate " + list(g.cand_generated) + ": " +
             (g.first_generated_mismatch < 0 ? std::string("identical")
                                             : "first differs at index " + std::to_string(g.first_generated_mismatch)) +
             ".\n";
    }
  }

  out += "\n## All tensors\n\n";
  tensor_table(out, all);
  return out;
}

}  // namespace llmdiff::compare
