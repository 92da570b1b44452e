// Renderers of a comparison of two configurations (compare/against.h): a
// readable table, JSON (schema "llmdiff.against/1", docs/AGAINST.md), a
// Markdown report and a self-contained HTML page. Each says every pair's
// verdict through headline(AgainstResult, SequencePair) and the whole
// through headline(AgainstResult); a side with a bug is shown with its own
// bisection (compare/bisect_report.h, report_html.h).
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "compare/against.h"
#include "compare/bisect_report.h"

namespace llmdiff::compare {

inline constexpr const char* kAgainstSchema = "llmdiff.against/1";

// The pairs, then the full bisection table of the first side with a bug
// (`opt.all`: of every sequence with one).
std::string render_against_table(const AgainstResult& r, const BisectTableOptions& opt = {});
nlohmann::json against_to_json(const AgainstResult& r);
std::string render_against_markdown(const AgainstResult& r);
std::string render_against_html(const AgainstResult& r);

}  // namespace llmdiff::compare
