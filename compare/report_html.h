// Self-contained HTML reports (`--html FILE` on bisect, run and diff): one
// file with inline CSS, inline data and a small inline script that draws the
// error-growth chart (SVG) and the error heatmap (canvas) and sorts tables;
// no network access, light and dark themes. Renders results only: every
// number comes from the result structs (the heatmap from compare/heatmap.h).
#pragma once
#include <string>

#include "compare/compare.h"
#include "compare/bisect_result.h"

namespace llmdiff::compare {

std::string render_bisect_html(const BisectResult& r);
std::string render_diff_html(const DiffResult& r);

}  // namespace llmdiff::compare
