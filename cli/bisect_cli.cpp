#include "cli/bisect_cli.h"

#include <algorithm>
#include <cstdio>
#include <functional>

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
  sub.add_option("--threads", o.threads, "threads (default: all cores)")->check(CLI::NonNegativeNumber);
  sub.add_flag("--verbose", o.verbose,
               "print each phase as it ends, with the elapsed time, peak memory and disk traffic, on stderr");
}

compare::BisectOptions bisect_options(const BisectCliOptions& o, const PhaseLog* log) {
  compare::BisectOptions b;
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

// What a single-sequence and a batched bisection print alike: `shown`'s
// Markdown and HTML reports, the JSON or the table with the sampler check
// beside it, and the exit code, which counts a failing sampler.
int emit_result(int result_code, const compare::BisectResult& shown, const std::function<nlohmann::json()>& to_json,
                const std::function<std::string(const compare::BisectTableOptions&)>& to_table,
                const BisectCliOptions& o, const compare::SamplingCheck* sampling) {
  const bool sampler_fails = sampling && sampling->verdict == compare::SamplingCheck::Verdict::Fail;
  const int code = std::max(result_code, sampler_fails ? 1 : 0);
  if (!o.report.empty()) write_file_atomic(o.report, compare::render_bisect_markdown(shown));
  if (!o.html.empty()) write_file_atomic(o.html, compare::render_bisect_html(shown));
  std::string text;
  if (o.json) {
    nlohmann::json j = to_json();
    if (sampling) j["sampling"] = compare::sampling_check_to_json(*sampling);
    j["exit_code"] = code;
    text = j.dump(2) + "\n";
  } else {
    compare::BisectTableOptions t;
    t.all = o.all;
    text = to_table(t);
    if (sampling) text += "\n" + compare::render_sampling_check(*sampling);
  }
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
  return code;
}

}  // namespace

int emit_bisect(const compare::BisectResult& r, const BisectCliOptions& o, const compare::SamplingCheck* sampling) {
  return emit_result(
      r.exit_code(), r, [&] { return compare::bisect_to_json(r); },
      [&](const compare::BisectTableOptions& t) { return compare::render_bisect_table(r, t); }, o, sampling);
}

int emit_batch_bisect(const compare::BatchBisect& b, const BisectCliOptions& o,
                      const compare::SamplingCheck* sampling) {
  const compare::SequenceBisect* shown = b.first_divergent() ? b.first_divergent() : &b.sequences.front();
  return emit_result(
      b.exit_code(), shown->result, [&] { return compare::batch_to_json(b); },
      [&](const compare::BisectTableOptions& t) { return compare::render_batch_table(b, t); }, o, sampling);
}

}  // namespace llmdiff::cli
