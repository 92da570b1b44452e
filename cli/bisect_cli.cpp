#include "cli/bisect_cli.h"

#include <algorithm>
#include <cstdio>
#include <functional>

#include "compare/against_report.h"
#include "compare/bisect_report.h"
#include "compare/report.h"
#include "compare/report_html.h"
#include "dumps/base/files.h"
#include "compare/tolerance.h"

namespace llmdiff::cli {

void add_bisect_cli_options(CLI::App& sub, BisectCliOptions& o) {
  sub.add_option("--tol", o.tol, "per-name tolerance GLOB=atol:X,rtol:Y (repeatable; for --no-noise-floor)");
  sub.add_option("--rtol", o.rtol, "relative tolerance (allclose; for --no-noise-floor)");
  sub.add_option("--atol", o.atol, "absolute tolerance (allclose; for --no-noise-floor)");
  sub.add_option("--sites", o.sites, "compare only names matching these globs, comma separated (e.g. 'layers.*.out,logits')");
  sub.add_flag("--no-noise-floor", o.no_noise_floor,
               "judge by allclose instead of the noise floor (no float64 reference run)");
  sub.add_flag("--no-local", o.no_local, "skip local errors (teacher forcing)");
  sub.add_flag("--no-diagnose", o.no_diagnose, "skip testing the bug hypotheses");
  sub.add_flag("--json", o.json, "print the result as JSON (schema llmdiff.bisect/1, see compare/README.md)");
  sub.add_flag("--all", o.all, "list every local site and every hypothesis tested");
  sub.add_option("--report", o.report, "also write a Markdown bisection report to this file");
  sub.add_option("--html", o.html,
                 "also write a self-contained HTML report to this file (verdict, diagnosis, error-growth chart, "
                 "heatmap of the localised tensor's error, sortable tables)");
  sub.add_option("--junit", o.junit,
                 "also write JUnit XML to this file (a testcase for the forward pass, per sequence of a batch, and "
                 "for the sampler; a failure's message is the verdict's headline)");
  sub.add_option("--threads", o.threads, "threads (default: all cores)")->check(CLI::NonNegativeNumber);
  sub.add_option("--memory-budget", o.memory_budget,
                 "impl runs (the clean run, the replays): a checkpoint larger than this (e.g. 8GB) is streamed layer "
                 "by layer, one layer's pages resident at a time; a smaller one stays resident (default: half the "
                 "memory available when the command starts)");
  sub.add_flag("--verbose", o.verbose,
               "print each phase as it ends, with the elapsed time, peak memory and disk traffic, on stderr");
}

bisect::BisectOptions bisect_options(const BisectCliOptions& o, const PhaseLog* log) {
  bisect::BisectOptions b;
  if (log && log->enabled()) b.progress = [log](const std::string& what) { (*log)(what); };
  b.compare.rtol = o.rtol;
  b.compare.atol = o.atol;
  for (const auto& t : o.tol) b.compare.overrides.push_back(compare::parse_tolerance_override(t));
  b.compare.sites = split_list(o.sites);
  b.noise_floor = !o.no_noise_floor;
  b.local = !o.no_local;
  b.diagnose = !o.no_diagnose;
  return b;
}

namespace {

// How one result is said in each format (junit may be empty: none).
struct Renderers {
  std::function<nlohmann::json()> json;
  std::function<std::string(const compare::BisectTableOptions&)> table;
  std::function<std::string()> markdown, html, junit;
};

// What every bisection prints alike: the Markdown and HTML reports, the
// JUnit XML, the JSON or the table.
int emit_result(int code, const Renderers& to, const BisectCliOptions& o) {
  if (!o.report.empty()) write_file_atomic(o.report, to.markdown());
  if (!o.html.empty()) write_file_atomic(o.html, to.html());
  if (!o.junit.empty() && to.junit) write_file_atomic(o.junit, to.junit());
  std::string text;
  if (o.json) {
    text = to.json().dump(2) + "\n";
  } else {
    compare::BisectTableOptions t;
    t.all = o.all;
    text = to.table(t);
  }
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
  return code;
}

}  // namespace

int emit_bisect(const compare::BisectResult& r, const BisectCliOptions& o) {
  return emit_result(r.exit_code(),
                     {[&] { return compare::bisect_to_json(r); },
                      [&](const compare::BisectTableOptions& t) { return compare::render_bisect_table(r, t); },
                      [&] { return compare::render_bisect_markdown(r); }, [&] { return compare::render_bisect_html(r); },
                      [&] { return compare::render_bisect_junit(r); }},
                     o);
}

int emit_batch_bisect(const compare::BatchBisect& b, const BisectCliOptions& o) {
  const compare::BisectResult& shown = (b.first_divergent() ? b.first_divergent() : &b.sequences.front())->result;
  return emit_result(b.exit_code(),
                     {[&] { return compare::batch_to_json(b); },
                      [&](const compare::BisectTableOptions& t) { return compare::render_batch_table(b, t); },
                      [&] { return compare::render_bisect_markdown(shown); },
                      [&] { return compare::render_bisect_html(shown); }, [&] { return compare::render_batch_junit(b); }},
                     o);
}

int emit_against(const compare::AgainstResult& r, const BisectCliOptions& o) {
  return emit_result(r.exit_code(),
                     {[&] { return compare::against_to_json(r); },
                      [&](const compare::BisectTableOptions& t) { return compare::render_against_table(r, t); },
                      [&] { return compare::render_against_markdown(r); },
                      [&] { return compare::render_against_html(r); }, {}},
                     o);
}

}  // namespace llmdiff::cli
