// Renderers of bisection results (compare/bisect_result.h): a readable
// table, JSON (schema "llmdiff.bisect/1", documented in compare/README.md),
// a Markdown bisection report and JUnit XML. Each says the verdict with
// compare/finding.h's headline() and explanation() (the HTML report,
// compare/report_html.h, and `merge`, compare/merge.h, too).
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "compare/bisect_result.h"

namespace llmdiff::compare {

inline constexpr const char* kBisectSchema = "llmdiff.bisect/1";

struct BisectTableOptions {
  bool all = false;     // every local site and every hypothesis (default: failing sites, top hypotheses)
  int hypotheses = 5;   // hypotheses listed when !all
};
std::string render_bisect_table(const BisectResult& r, const BisectTableOptions& opt = {});
nlohmann::json bisect_to_json(const BisectResult& r);
std::string render_bisect_json(const BisectResult& r);  // bisect_to_json, indented, newline-terminated
std::string render_bisect_markdown(const BisectResult& r);
// One <testsuite>: a <testcase> for the forward pass (a <failure> whose
// message is headline(r) when it diverges) and one for the sampler when it
// was checked; the finding's headline as a property.
std::string render_bisect_junit(const BisectResult& r);

// One-line texts the renderers share, each with its numbers and thresholds:
// the criterion, a global divergence ("rmse vs float64 1.2e-01 > threshold
// 3.1e-07 (max err ...)"), a local verdict ("local rmse ... > ...").
std::string bisect_criterion_text(const BisectResult& r);
std::string divergence_line(const TensorComparison& t);
std::string local_error_line(const LocalSite& s);
// An error signature: how well it fits, " (partial fit 0.31)" ("" when it
// is decisive or says where the error is rather than what: kind
// "only-some"); and the whole line, "NAME: KIND (partial fit F): DETAIL".
std::string signature_fit_note(const ErrorSignature& g);
std::string signature_line(const ErrorSignature& g);

}  // namespace llmdiff::compare
