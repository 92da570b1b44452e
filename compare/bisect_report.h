// Renderers of bisection results (compare/diagnose.h): a readable table,
// JSON (schema "llmdiff.bisect/1", documented in compare/README.md) and a
// Markdown bisection report.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "compare/diagnose.h"

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

// One-line texts the renderers share, each with its numbers and thresholds:
// the criterion, a global divergence ("rmse vs float64 1.2e-01 > threshold
// 3.1e-07 (max err ...)"), a local verdict ("local rmse ... > ...").
std::string bisect_criterion_text(const BisectResult& r);
std::string divergence_line(const TensorComparison& t);
std::string local_error_line(const LocalSite& s);

}  // namespace llmdiff::compare
