#include "compare/against_report.h"

#include <cstdio>
#include <sstream>

#include "compare/html_page.h"
#include "compare/report.h"
#include "compare/report_html.h"

namespace llmdiff::compare {

namespace {

std::string side_text(const AgainstSide& s) {
  const size_t n = s.sequences.size();
  return s.label + (s.several ? " (" + std::to_string(n) + " sequence" + (n == 1 ? "" : "s") + ")" : " (one sequence)");
}

std::string largest_text(const SequencePair& p) {
  if (!p.largest) return "-";
  return fmt_num(p.largest->ratio(), 2) + " (" + p.largest->where() + ")";
}

// The sides with a bug, in the order of the pairs: (pair, side A?).
std::vector<std::pair<const SequencePair*, bool>> bug_sides(const AgainstResult& r) {
  std::vector<std::pair<const SequencePair*, bool>> out;
  for (const SequencePair& p : r.pairs) {
    if (p.bug_in_a()) out.emplace_back(&p, true);
    if (p.bug_in_b()) out.emplace_back(&p, false);
  }
  return out;
}

const AgainstSequence& side_seq(const AgainstResult& r, const SequencePair& p, bool side_a) {
  return side_a ? r.a.sequences[p.a] : r.b.sequences[p.b];
}

// "the bug in B: seq0" (a side whose own bisection fails).
std::string bug_title(const AgainstResult& r, const SequencePair& p, bool side_a) {
  return std::string("the bug in ") + (side_a ? "A" : "B") + ": seq" + std::to_string(side_seq(r, p, side_a).bisect.seq);
}

nlohmann::json place_json(const std::optional<PlaceDiff>& d) {
  if (!d) return nullptr;
  return {{"position", d->position},
          {"layer", d->layer >= 0 ? nlohmann::json(d->layer) : nlohmann::json(nullptr)},
          {"site", d->site},
          {"name_a", d->name_a},
          {"name_b", d->name_b},
          {"row_a", d->row_a >= 0 ? nlohmann::json(d->row_a) : nlohmann::json(nullptr)},
          {"row_b", d->row_b >= 0 ? nlohmann::json(d->row_b) : nlohmann::json(nullptr)},
          {"integer", d->integer},
          {"count", d->count},
          {"differing", d->differing},
          {"max_abs", json_num(d->max_abs)},
          {"value_a", json_num(d->value_a)},
          {"value_b", json_num(d->value_b)},
          {"rmse", json_num(d->rmse)},
          {"threshold", d->integer ? nlohmann::json(nullptr) : json_num(d->threshold)},
          {"ratio", d->integer ? nlohmann::json(nullptr) : json_num(d->ratio())}};
}

nlohmann::json flip_json(const std::optional<GreedyFlip>& f) {
  if (!f) return nullptr;
  return {{"index", f->index},
          {"position", f->position},
          {"token_a", f->token_a},
          {"token_b", f->token_b},
          {"settled", f->settled},
          {"truth_a", json_num(f->truth_a)},
          {"truth_b", json_num(f->truth_b)},
          {"truth_argmax", f->truth_argmax},
          {"margin", json_num(f->margin)},
          {"noise", f->noise ? json_num(*f->noise) : nlohmann::json(nullptr)},
          {"allowed", json_num(f->allowed)},
          {"near_tie", f->near_tie},
          {"text", f->str()}};
}

nlohmann::json side_json(const AgainstSide& s) {
  nlohmann::json seqs = nlohmann::json::array();
  for (const AgainstSequence& q : s.sequences) {
    const BisectResult& r = q.bisect.result;
    seqs.push_back({{"seq", q.bisect.seq},
                    {"prompt_length", q.prompt.size()},
                    {"cached_prefix", q.cached_prefix},
                    {"calls", q.calls},
                    {"positions", q.positions},
                    {"generated", q.generated},
                    {"ok", q.ok()},
                    {"headline", headline(r)},
                    {"step", q.bisect.step ? nlohmann::json(*q.bisect.step) : nlohmann::json(nullptr)},
                    {"iteration", q.bisect.iteration ? nlohmann::json(*q.bisect.iteration) : nlohmann::json(nullptr)},
                    {"bisect", bisect_to_json(r)}});
  }
  nlohmann::json j = {{"label", s.label}, {"several", s.several}, {"sequences", seqs}, {"notes", s.notes}};
  if (s.sampling) j["sampling"] = sampling_check_to_json(*s.sampling);
  return j;
}

std::vector<int> seq_numbers(const AgainstSide& s, const std::vector<size_t>& idx) {
  std::vector<int> out;
  for (size_t i : idx) out.push_back(s.sequences[i].bisect.seq);
  return out;
}

std::string md_code(const std::string& s) { return "`" + md_cell(s) + "`"; }

}  // namespace

std::string render_against_table(const AgainstResult& r, const BisectTableOptions& opt) {
  std::ostringstream o;
  o << "llmdiff bisect --against: one engine, two configurations, model " << r.model << "\n";
  o << "  A: " << side_text(r.a) << "\n  B: " << side_text(r.b) << "\n";
  o << "  each side bisected against the float64 truth with its own noise floor; sequences aligned by prompt\n\n";
  o << "A       B       prompt  positions  verdict      first difference                              largest / "
       "threshold\n";
  for (const SequencePair& p : r.pairs) {
    const AgainstSequence &a = r.a.sequences[p.a], &b = r.b.sequences[p.b];
    const std::string first = p.verdict != PairVerdict::Legitimate ? "-"
                              : p.first_difference            ? p.first_difference->where()
                                                              : "none (identical)";
    char line[512];
    std::snprintf(line, sizeof line, "seq%-4d seq%-4d %6zu  %9lld  %-11s  %-44s  %s\n", a.bisect.seq, b.bisect.seq,
                  a.prompt.size(), (long long)std::max(a.positions, b.positions), verdict_name(p.verdict),
                  first.c_str(), largest_text(p).c_str());
    o << line;
  }
  for (size_t i : r.only_a)
    o << "seq" << r.a.sequences[i].bisect.seq << " of A: no sequence of B has its prompt ("
      << r.a.sequences[i].prompt.size() << " tokens)\n";
  for (size_t i : r.only_b)
    o << "seq" << r.b.sequences[i].bisect.seq << " of B: no sequence of A has its prompt ("
      << r.b.sequences[i].prompt.size() << " tokens)\n";
  o << "\nRESULT: " << headline(r) << "\n";
  for (const SequencePair& p : r.pairs) {
    o << "  " << pair_label(r, p) << ": " << headline(r, p) << "\n";
    for (const std::string& n : p.notes) o << "    note: " << n << "\n";
  }
  for (const std::string& n : r.notes) o << "note: " << n << "\n";
  for (const std::string& n : r.a.notes) o << "note (A): " << n << "\n";
  for (const std::string& n : r.b.notes) o << "note (B): " << n << "\n";
  if (r.a.sampling) o << "\nA's sampler:\n" << render_sampling_check(*r.a.sampling);
  if (r.b.sampling) o << "\nB's sampler:\n" << render_sampling_check(*r.b.sampling);
  bool shown = false;
  for (const auto& [p, side_a] : bug_sides(r)) {
    const AgainstSequence& s = side_seq(r, *p, side_a);
    if (s.ok() || (shown && !opt.all)) continue;  // a flip's bug has no bisection to show
    o << "\n== " << bug_title(r, *p, side_a) << "\n" << render_bisect_table(s.bisect.result, opt);
    shown = true;
  }
  return o.str();
}

nlohmann::json against_to_json(const AgainstResult& r) {
  nlohmann::json pairs = nlohmann::json::array();
  for (const SequencePair& p : r.pairs)
    pairs.push_back({{"a", r.a.sequences[p.a].bisect.seq},
                     {"b", r.b.sequences[p.b].bisect.seq},
                     {"verdict", verdict_name(p.verdict)},
                     {"headline", headline(r, p)},
                     {"common_positions", p.common_positions},
                     {"compared", p.compared},
                     {"differing", p.differing},
                     {"first_difference", place_json(p.first_difference)},
                     {"largest", place_json(p.largest)},
                     {"flip", flip_json(p.flip)},
                     {"notes", p.notes}});
  return {{"schema", kAgainstSchema},
          {"model", r.model},
          {"headline", headline(r)},
          {"exit_code", r.exit_code()},
          {"a", side_json(r.a)},
          {"b", side_json(r.b)},
          {"pairs", pairs},
          {"only_in_a", seq_numbers(r.a, r.only_a)},
          {"only_in_b", seq_numbers(r.b, r.only_b)},
          {"notes", r.notes}};
}

std::string render_against_markdown(const AgainstResult& r) {
  std::string o = "# llmdiff: one engine, two configurations\n\n";
  o += "| | |\n|---|---|\n";
  o += "| A | " + md_code(r.a.label) + " |\n| B | " + md_code(r.b.label) + " |\n";
  o += "| model | " + md_cell(r.model) + " |\n";
  o += "| result | **" + md_cell(headline(r)) + "** (exit code " + std::to_string(r.exit_code()) + ") |\n\n";
  o += "Each side is bisected against the float64 truth with its own noise floor; sequences are aligned by their "
       "prompts.\n\n## Pairs\n\n";
  o += "| A | B | prompt | verdict | first difference | largest / threshold | headline |\n";
  o += "|---|---|---|---|---|---|---|\n";
  for (const SequencePair& p : r.pairs) {
    const AgainstSequence &a = r.a.sequences[p.a], &b = r.b.sequences[p.b];
    o += "| seq" + std::to_string(a.bisect.seq) + " | seq" + std::to_string(b.bisect.seq) + " | " +
         std::to_string(a.prompt.size()) + " | " + verdict_name(p.verdict) + " | " +
         (p.first_difference ? md_cell(p.first_difference->where()) : "-") + " | " + md_cell(largest_text(p)) + " | " +
         md_cell(headline(r, p)) + " |\n";
  }
  std::vector<std::string> notes = r.notes;
  for (const SequencePair& p : r.pairs)
    for (const std::string& n : p.notes) notes.push_back(pair_label(r, p) + ": " + n);
  for (const std::string& n : r.a.notes) notes.push_back("A: " + n);
  for (const std::string& n : r.b.notes) notes.push_back("B: " + n);
  if (!notes.empty()) {
    o += "\n## Notes\n\n";
    for (const std::string& n : notes) o += "- " + n + "\n";
  }
  for (const auto& [p, side_a] : bug_sides(r)) {
    const AgainstSequence& s = side_seq(r, *p, side_a);
    if (s.ok()) continue;
    // The side's own report, its headings two levels down.
    std::string report = render_bisect_markdown(s.bisect.result);
    std::string nested;
    std::istringstream lines(report);
    for (std::string line; std::getline(lines, line);) nested += (line.rfind('#', 0) == 0 ? "##" : "") + line + "\n";
    o += "\n## " + bug_title(r, *p, side_a) + "\n\n" + nested;
  }
  return o;
}

std::string render_against_html(const AgainstResult& r) {
  using html::esc;
  std::string b = "<h1>llmdiff: one engine, two configurations</h1>\n<p class=\"note\">A <code>" + esc(r.a.label) +
                  "</code> &middot; B <code>" + esc(r.b.label) + "</code> &middot; model " + esc(r.model) + "</p>\n";
  b += "<section id=\"verdict\"><h2>Verdict</h2>\n<p><strong>" + esc(headline(r)) + "</strong> (exit code " +
       std::to_string(r.exit_code()) +
       ")</p>\n<p class=\"note\">Each side is bisected against the float64 truth with its own noise floor; sequences "
       "are aligned by their prompts.</p></section>\n";
  html::Table t("pairs", {"A", "B", "prompt", "verdict", "first difference", "largest / threshold", "at", "headline"});
  for (const SequencePair& p : r.pairs) {
    const AgainstSequence &a = r.a.sequences[p.a], &s = r.b.sequences[p.b];
    t.row(p.verdict == PairVerdict::Legitimate ? "pass" : "fail")
        .text("seq" + std::to_string(a.bisect.seq))
        .text("seq" + std::to_string(s.bisect.seq))
        .count((long long)a.prompt.size())
        .text(verdict_name(p.verdict))
        .text(p.first_difference ? p.first_difference->where() : "-");
    if (p.largest)
      t.number(p.largest->ratio(), 2).text(p.largest->where());
    else
      t.text("-").text("-");
    t.text(headline(r, p));
  }
  b += "<section id=\"pairs-section\"><h2>Pairs</h2>\n" + t.str() + "</section>\n";
  std::vector<std::string> notes = r.notes;
  for (const SequencePair& p : r.pairs)
    for (const std::string& n : p.notes) notes.push_back(pair_label(r, p) + ": " + n);
  for (const std::string& n : r.a.notes) notes.push_back("A: " + n);
  for (const std::string& n : r.b.notes) notes.push_back("B: " + n);
  if (!notes.empty()) {
    b += "<section id=\"notes\"><h2>Notes</h2>\n<ul>\n";
    for (const std::string& n : notes) b += "<li>" + esc(n) + "</li>\n";
    b += "</ul></section>\n";
  }
  // The first side with a bug: its finding, error-growth chart and heatmap
  // (one chart per page); the others by their headline.
  bool charted = false;
  for (const auto& [p, side_a] : bug_sides(r)) {
    const AgainstSequence& s = side_seq(r, *p, side_a);
    if (s.ok()) continue;
    const BisectResult& res = s.bisect.result;
    b += "<section class=\"side\"><h2>" + esc(bug_title(r, *p, side_a)) + "</h2>\n<p><strong>" + esc(headline(res)) +
         "</strong></p>\n<p>" + esc(explanation(res.finding)) + "</p>\n";
    if (!charted) {
      b += html::chart_section(res.global, res.local.ran ? &res.local : nullptr) + html::heatmap_section(res.heatmap);
      charted = true;
    }
    b += "</section>\n";
  }
  return html::page("llmdiff --against: " + r.a.label + " / " + r.b.label, b);
}

}  // namespace llmdiff::compare
