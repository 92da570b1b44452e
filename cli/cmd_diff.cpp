// llmdiff diff A B [--rtol R] [--atol A] [--tol GLOB=SPEC]... [--dtype D]
//   [--sites GLOB,...] [--json] [--report FILE.md] [--html FILE.html] [--all] [--no-layouts]
// Compares two dumps name by name (A = reference, B = candidate): per-tensor
// metrics against tolerances, names only one side holds, the first
// divergence, the per-layer error trace and greedy-token agreement.
// Exit 0 within tolerance, 1 divergence (or nothing in common), 2 bad input.
#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "cli/common.h"
#include "compare/compare.h"
#include "compare/report.h"
#include "compare/report_html.h"
#include "dumps/model/config.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/ranks.h"
#include "dumps/base/errors.h"

namespace llmdiff::cli {

struct DiffOptions {
  std::string ref, cand;
  double rtol = 0, atol = 0;
  CLI::Option* rtol_opt = nullptr;
  CLI::Option* atol_opt = nullptr;
  std::vector<std::string> tol;
  std::string dtype, sites, report, html;
  bool json = false, all = false, no_layouts = false;
};

namespace {

int run_diff(const DiffOptions& o) {
  compare::CompareOptions co;
  if (o.rtol_opt && o.rtol_opt->count()) co.rtol = o.rtol;
  if (o.atol_opt && o.atol_opt->count()) co.atol = o.atol;
  for (const auto& t : o.tol) co.overrides.push_back(compare::parse_tolerance_override(t));
  if (!o.dtype.empty()) co.dtype = parse_compute_dtype(o.dtype);
  co.sites = compare::split_list(o.sites);
  co.explain_layouts = !o.no_layouts;

  const DumpFile ref_file(o.ref), cand_file(o.cand);
  // A tensor-parallel dump compares unsharded (dumps/contract/ranks.h).
  const std::unique_ptr<RankView> ref_ranks = unsharded(ref_file), cand_ranks = unsharded(cand_file);
  const TensorSource& ref = ref_ranks ? static_cast<const TensorSource&>(*ref_ranks) : ref_file;
  const TensorSource& cand = cand_ranks ? static_cast<const TensorSource&>(*cand_ranks) : cand_file;
  // Without tolerances given, float32 is judged against each tensor's scale
  // (a correct engine's float32 rounding passes); 16-bit dtypes by allclose
  // at their default tolerances.
  const bool tolerances_given = co.rtol || co.atol || !co.overrides.empty();
  const ComputeDType dtype = compare::diff_dtype(ref, cand, co);
  if (!tolerances_given && (dtype == ComputeDType::Float32 || dtype == ComputeDType::Float64))
    co.criterion = std::make_shared<compare::ScaledMaxCriterion>();
  compare::DiffResult r = compare::compare_dumps(ref, cand, co);
  if (o.json) {
    std::fputs(compare::render_diff_json(r).c_str(), stdout);
  } else {
    compare::TableOptions to;
    to.all = o.all;
    std::fputs(compare::render_diff_table(r, to).c_str(), stdout);
  }
  if (!o.report.empty()) write_side_output(o.report, compare::render_diff_markdown(r), "report", o.json);
  if (!o.html.empty()) write_side_output(o.html, compare::render_diff_html(r), "HTML report", o.json);
  if (!o.json && !r.ok())
    std::fputs("note: float rounding and a real bug can look alike by any fixed tolerance; with the model at hand, "
               "`llmdiff bisect --model DIR B` judges each name against a float64 noise floor and names the op\n",
               stdout);
  std::fflush(stdout);
  return r.ok() ? 0 : 1;
}

}  // namespace

void setup_diff(CLI::App& app, Action& action) {
  auto o = std::make_shared<DiffOptions>();
  CLI::App* sub = app.add_subcommand("diff", "Compare two dumps name by name (A = reference, B = candidate) and "
                                             "localise the first divergence");
  sub->add_option("A", o->ref, "reference dump (e.g. the HF golden dump)")->required();
  sub->add_option("B", o->cand, "candidate dump")->required();
  o->rtol_opt = sub->add_option("--rtol", o->rtol, "relative tolerance for every name (default: by compute dtype)")
                    ->check(CLI::NonNegativeNumber);
  o->atol_opt = sub->add_option("--atol", o->atol, "absolute tolerance for every name (default: by compute dtype)")
                    ->check(CLI::NonNegativeNumber);
  sub->add_option("--tol", o->tol, "per-name tolerance GLOB=atol:X[,rtol:Y] (repeatable; the glob matches with or "
                                   "without the step prefix; the last matching one wins)");
  sub->add_option("--dtype", o->dtype, "compute dtype for default tolerances and ULPs (default: the coarser of the "
                                       "manifests' dtypes)");
  sub->add_option("--sites", o->sites, "compare only names matching these globs, comma separated");
  sub->add_flag("--json", o->json, "print the result as JSON (schema llmdiff.diff/1, see compare/README.md)");
  sub->add_option("--report", o->report, "also write a Markdown report to this file");
  sub->add_option("--html", o->html, "also write a self-contained HTML report to this file (error-growth chart, "
                                     "heatmap of the first divergence, sortable tables)");
  sub->add_flag("--all", o->all, "print every tensor and every trace row, not only the failing ones");
  sub->add_flag("--no-layouts", o->no_layouts, "skip the search for layout explanations of mismatches");
  sub->callback([o, &action] { action = [o] { return run_diff(*o); }; });
}

}  // namespace llmdiff::cli
