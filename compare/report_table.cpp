// Plain-text tables of diff and regress results (the default output).
#include <algorithm>
#include <cstdio>
#include <set>

#include "compare/report.h"

namespace llmdiff::compare {

namespace {

// Columns padded to their widest cell; rows may carry indented sub-lines.
class TextTable {
 public:
  TextTable(std::vector<std::string> headers, std::vector<bool> right) : headers_(std::move(headers)), right_(std::move(right)) {}
  void row(std::vector<std::string> cells) { rows_.push_back({std::move(cells), {}}); }
  void sub(std::string line) {
    if (!rows_.empty()) rows_.back().subs.push_back(std::move(line));
  }
  bool empty() const { return rows_.empty(); }
  std::string str() const {
    std::vector<size_t> w(headers_.size());
    for (size_t c = 0; c < headers_.size(); ++c) w[c] = headers_[c].size();
    for (const auto& r : rows_)
      for (size_t c = 0; c < r.cells.size() && c < w.size(); ++c) w[c] = std::max(w[c], r.cells[c].size());
    std::string out = line(headers_, w);
    for (const auto& r : rows_) {
      out += line(r.cells, w);
      for (const auto& s : r.subs) out += "    " + s + "\n";
    }
    return out;
  }

 private:
  struct Row {
    std::vector<std::string> cells;
    std::vector<std::string> subs;
  };
  std::string line(const std::vector<std::string>& cells, const std::vector<size_t>& w) const {
    std::string out;
    for (size_t c = 0; c < w.size(); ++c) {
      std::string cell = c < cells.size() ? cells[c] : "";
      std::string pad(w[c] - std::min(w[c], cell.size()), ' ');
      bool last = c + 1 == w.size();
      out += right_[c] ? pad + cell : cell + (last ? "" : pad);
      if (!last) out += "  ";
    }
    while (!out.empty() && out.back() == ' ') out.pop_back();
    return out + "\n";
  }
  std::vector<std::string> headers_;
  std::vector<bool> right_;
  std::vector<Row> rows_;
};

std::string fixed(double v, int digits) {
  if (!std::isfinite(v)) return fmt_num(v);
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string side_block(const char* title, const SideSummary& s) {
  std::string out = std::string(title) + "  " + s.label + "\n";
  std::string pad(std::string(title).size() + 2, ' ');
  const Manifest& m = s.manifest;
  if (!m.producer.empty()) out += pad + "producer: " + m.producer + "\n";
  out += pad + "model " + (m.model.empty() ? "?" : m.model) + ", scenario " + (m.scenario.empty() ? "?" : m.scenario) +
         ", steps " + std::to_string(s.steps) + ", dtype " + (m.dtype.empty() ? "?" : m.dtype) + ", " +
         std::to_string(s.tensors) + " tensors\n";
  return out;
}

std::string tol_cell(const TensorComparison& t) {
  if (t.is_int) return "exact";
  return fmt_num(t.tolerance.rtol) + "/" + fmt_num(t.tolerance.atol);
}

std::string result_word(const TensorComparison& t) {
  if (!t.judgement.judged && t.pass) return "info";
  if (t.pass) return "PASS";
  return t.shape_match ? "FAIL" : "FAIL shape";
}

// Detail lines under a tensor's row.
std::vector<std::string> detail_lines(const TensorComparison& t, bool failing) {
  std::vector<std::string> out;
  if (t.shape_match && !t.is_int && failing) {
    const auto& m = t.metrics;
    const auto& a = t.allclose;
    if (m.max_abs_at >= 0)
      out.push_back("max abs at " + index_str(unravel(m.max_abs_at, t.ref_shape)) + ": candidate " +
                    fmt_num(m.cand_at_max_abs) + ", reference " + fmt_num(m.ref_at_max_abs) + "; max rel " +
                    fmt_num(m.max_rel) + ", max ulp " + std::to_string(m.max_ulp) + " (" +
                    compute_dtype_name(m.ulp_dtype) + "), SQNR " + fixed(m.sqnr_db, 1) + " dB");
    out.push_back(std::to_string(a.failing) + " of " + std::to_string(a.count) + " elements outside " +
                  t.tolerance.str() + (a.first_fail >= 0 ? " (first at " + index_str(unravel(a.first_fail, t.ref_shape)) + ")" : "") +
                  "; passes with atol >= " + fmt_num(a.min_atol) + " or rtol >= " + fmt_num(a.min_rtol));
    if (t.judgement.metric != "allclose ratio")
      out.push_back("criterion: " + t.judgement.metric + " " + fmt_num(t.judgement.value) + " > " +
                    fmt_num(t.judgement.threshold));
  }
  if (t.logits) {
    const auto& l = *t.logits;
    std::string s = "argmax agrees on " + std::to_string(l.argmax_agree) + "/" + std::to_string(l.rows) + " rows";
    if (l.first_argmax_mismatch >= 0)
      s += " (first differing row " + std::to_string(l.first_argmax_mismatch) + ": candidate " +
           std::to_string(l.cand_argmax) + ", reference " + std::to_string(l.ref_argmax) + ")";
    s += ", top-" + std::to_string(l.topk) + " overlap " + fixed(l.topk_overlap, 3) + ", KL mean " + fmt_num(l.kl_mean) +
         " max " + fmt_num(l.kl_max);
    out.push_back(s);
  }
  for (const auto& n : t.notes) out.push_back("note: " + n);
  for (const auto& f : t.findings) out.push_back(std::string("finding (") + finding_kind_name(f.kind) + "): " + f.summary);
  return out;
}

std::string trace_rows(const std::vector<LayerTrace>& rows, TextTable& table) {
  for (const auto& g : rows) {
    table.row({std::to_string(g.step), g.label(), std::to_string(g.compared), std::to_string(g.failing),
               fmt_num(g.worst_nmse), g.worst_nmse_site, fmt_num(g.worst_max_abs), g.worst_max_abs_site,
               g.has_key ? g.key_site : "-", g.has_key ? fmt_num(g.key_nmse) : "-",
               g.has_key ? fmt_num(g.key_max_abs) : "-"});
  }
  return table.str();
}

std::string token_list(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

}  // namespace

std::string render_diff_table(const DiffResult& r, const TableOptions& opt) {
  std::string out = side_block("reference", r.ref) + side_block("candidate", r.cand);
  out += "tolerance  " + std::string(compute_dtype_name(r.dtype)) + " (" + r.dtype_source + "): " +
         r.base_tolerance.str() + "; criterion " + r.criterion + "\n";
  for (const auto& o : r.overrides) out += "           --tol " + o.text + "\n";
  if (!r.sites.empty()) {
    std::string s;
    for (const auto& g : r.sites) s += (s.empty() ? "" : ",") + g;
    out += "sites      " + s + "\n";
  }
  for (const auto& n : r.notes) out += "note: " + n + "\n";
  out += "\n";

  TextTable table({"name", "shape", "max abs", "NMSE", "cosine", "min atol", "rtol/atol", "result"},
                  {false, false, true, true, true, true, true, false});
  size_t hidden = 0;
  for (const auto& t : r.tensors) {
    if (t.pass && !opt.all) {
      ++hidden;
      continue;
    }
    bool ok_shape = t.shape_match;
    bool flt = ok_shape && !t.is_int;
    table.row({t.name, shape_str(t.ref_shape), ok_shape ? fmt_num(t.max_abs()) : "-", flt ? fmt_num(t.metrics.nmse) : "-",
               flt ? fixed(t.metrics.cosine, 7) : "-", flt ? fmt_num(t.allclose.min_atol) : "-", tol_cell(t),
               result_word(t)});
    for (auto& line : detail_lines(t, !t.pass)) table.sub(line);
  }
  if (!table.empty()) out += table.str();
  if (hidden) out += "(" + std::to_string(hidden) + " passing tensors not shown; --all lists every tensor)\n";
  out += "\n";

  auto name_list = [&](const char* title, const std::vector<std::string>& names) {
    out += std::string(title) + ": " + std::to_string(names.size()) + "\n";
    size_t shown = opt.all ? names.size() : std::min<size_t>(names.size(), 20);
    for (size_t i = 0; i < shown; ++i) out += "  " + names[i] + "\n";
    if (shown < names.size()) out += "  ... " + std::to_string(names.size() - shown) + " more (--all lists them)\n";
  };
  name_list("only in reference (missing in candidate)", r.only_in_ref);
  name_list("only in candidate (extra)", r.only_in_cand);
  out += "\n";

  if (const TensorComparison* f = r.first()) {
    out += "first divergence: " + f->name + " " + shape_str(f->ref_shape) + " (";
    if (!f->shape_match)
      out += "shape " + shape_str(f->cand_shape) + " in the candidate";
    else if (f->is_int)
      out += std::to_string(f->ints.mismatches) + " values differ";
    else
      out += "max abs " + fmt_num(f->metrics.max_abs) + ", NMSE " + fmt_num(f->metrics.nmse) + ", " +
             f->judgement.metric + " " + fmt_num(f->judgement.value) + " > " + fmt_num(f->judgement.threshold);
    out += ")\n";
    for (const auto& fd : f->findings) out += std::string("  finding (") + finding_kind_name(fd.kind) + "): " + fd.summary + "\n";
  } else {
    out += "first divergence: none\n";
  }
  out += "\n";

  if (!r.layer_trace.empty()) {
    // By default: every row of the step holding the first divergence (step 0
    // when none), one summary line for each other step.
    int focus = r.first() && r.first()->parsed.step >= 0 ? r.first()->parsed.step : r.layer_trace.front().step;
    std::vector<LayerTrace> rows;
    std::set<int> steps;
    for (const auto& g : r.layer_trace) {
      steps.insert(g.step);
      if (opt.all || g.step == focus) rows.push_back(g);
    }
    out += "per-layer error trace (worst over each group's sites; key = the group's output):\n";
    TextTable tt({"step", "group", "sites", "fail", "worst NMSE", "at", "worst max abs", "at", "key", "key NMSE", "key max abs"},
                 {true, false, true, true, true, false, true, false, false, true, true});
    out += trace_rows(rows, tt);
    if (!opt.all) {
      for (int s : steps) {
        if (s == focus) continue;
        int compared = 0, failing = 0;
        double worst = 0;
        std::string where;
        for (const auto& g : r.layer_trace) {
          if (g.step != s) continue;
          compared += g.compared;
          failing += g.failing;
          if (where.empty() || g.worst_nmse > worst) {
            worst = g.worst_nmse;
            where = g.label() + " " + g.worst_nmse_site;
          }
        }
        out += "  step " + std::to_string(s) + ": " + std::to_string(compared) + " sites, " + std::to_string(failing) +
               " failing, worst NMSE " + fmt_num(worst) + " (" + where + ")\n";
      }
      if (steps.size() > 1) out += "  (--all prints every step's rows)\n";
    }
    out += "\n";
  }

  const GreedyAgreement& g = r.greedy;
  if (!g.steps.empty()) {
    out += "greedy tokens (argmax of next_logits), reference/candidate:";
    for (const auto& s : g.steps)
      out += " step " + std::to_string(s.step) + " " + std::to_string(s.ref_token) + "/" + std::to_string(s.cand_token) + ";";
    out.pop_back();
    out += "\n  " + (g.first_divergent_step < 0 ? std::string("all steps agree")
                                                 : "first differs at step " + std::to_string(g.first_divergent_step)) + "\n";
  }
  if (g.has_generated) {
    out += "generated: reference " + token_list(g.ref_generated) + ", candidate " + token_list(g.cand_generated) + ": " +
           (g.first_generated_mismatch < 0 ? std::string("identical")
                                           : "first differs at index " + std::to_string(g.first_generated_mismatch)) + "\n";
  }
  if (!g.steps.empty() || g.has_generated) out += "\n";

  out += "result: ";
  if (r.tensors.empty())
    out += "no tensors compared";
  else if (r.ok())
    out += "within tolerance (" + std::to_string(r.tensors.size()) + " of " + std::to_string(r.tensors.size()) + " tensors)";
  else
    out += "DIVERGES: " + std::to_string(r.failing()) + " of " + std::to_string(r.tensors.size()) +
           " tensors outside tolerance, first " + r.first()->name;
  if (!r.only_in_ref.empty() || !r.only_in_cand.empty())
    out += "; " + std::to_string(r.only_in_ref.size()) + " names only in the reference, " +
           std::to_string(r.only_in_cand.size()) + " only in the candidate";
  return out + "\n";
}

std::string render_regress_table(const RegressionReport& r, bool verbose) {
  std::string out = "golden: " + r.golden + "\n";
  TextTable t({"model", "scenario", "engine", "dtype", "worst tensor", "metric", "value", "threshold", "time", "result"},
              {false, false, false, false, false, false, true, true, true, false});
  for (const auto& c : r.cases) {
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.2fs", c.seconds);
    if (!c.error.empty()) {
      t.row({c.model, c.scenario, c.engine_label(), compute_dtype_name(c.model_dtype), "-", "-", "-", "-", secs,
             "ERROR"});
    } else {
      bool exact = c.worst_name.empty();
      t.row({c.model, c.scenario, c.engine_label(), compute_dtype_name(c.model_dtype),
             exact ? "(all judged values 0)" : c.worst_name, exact ? "-" : c.worst_metric,
             exact ? "0" : fmt_num(c.worst_value), exact ? "-" : fmt_num(c.worst_threshold), secs,
             c.pass ? "PASS" : "FAIL"});
    }
    if (verbose) t.sub("rule: " + c.rule);
    if (!c.pass) {
      size_t shown = verbose ? c.failures.size() : std::min<size_t>(c.failures.size(), 5);
      for (size_t i = 0; i < shown; ++i) t.sub(c.failures[i]);
      if (shown < c.failures.size()) t.sub("... " + std::to_string(c.failures.size() - shown) + " more failing names");
    }
    if (c.pass && !c.missing.empty() && c.engine == EngineKind::External)
      t.sub(std::to_string(c.missing.size()) + " HF names not in the engine's dump (not judged), e.g. " +
            c.missing.front());
  }
  out += t.str();
  out += "\nregression policy:\n";
  std::set<std::pair<std::string, int>> seen;
  for (const auto& c : r.cases) {
    if (!seen.insert({c.engine_label(), int(c.model_dtype)}).second) continue;
    out += "  " + c.engine_label() + " on " + compute_dtype_name(c.model_dtype) +
           " models: " + c.rule + "\n";
  }
  out += "\nresult: " + std::to_string(r.cases.size() - r.failing()) + " of " + std::to_string(r.cases.size()) +
         " cases pass" + (r.ok() ? "" : " (" + std::to_string(r.failing()) + " failing)") + "\n";
  return out;
}

}  // namespace llmdiff::compare
