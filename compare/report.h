// Renderers of diff and regress results: a readable table, JSON (schema in
// compare/README.md), Markdown and JUnit XML. Data in compare.h/regress.h,
// presentation here.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "compare/compare.h"
#include "compare/regress.h"

namespace llmdiff::compare {

inline constexpr const char* kDiffSchema = "llmdiff.diff/1";
inline constexpr const char* kRegressSchema = "llmdiff.regress/1";

// Numbers for humans: "0", "1.23e-05" (`digits` after the point), "inf", "nan".
std::string fmt_num(double v, int digits = 3);
// A number for JSON, which has no Inf/NaN: finite values as numbers, the
// others as fmt_num's strings "inf", "-inf", "nan".
nlohmann::json json_num(double v);

struct TableOptions {
  bool all = false;  // every tensor and every trace row (default: failing tensors, passing ones counted)
};
std::string render_diff_table(const DiffResult& r, const TableOptions& opt = {});
std::string render_diff_markdown(const DiffResult& r);
nlohmann::json diff_to_json(const DiffResult& r);
std::string render_diff_json(const DiffResult& r);  // diff_to_json, indented, newline-terminated

std::string render_regress_table(const RegressionReport& r, bool verbose = false);
nlohmann::json regress_to_json(const RegressionReport& r);
std::string render_regress_json(const RegressionReport& r);
// JUnit XML: one <testsuite> per engine, one <testcase> per model/scenario,
// a <failure> (policy violated) or <error> (engine could not run) with the numbers.
std::string render_regress_junit(const RegressionReport& r);

// Escapes &, <, >, " and ' (and drops control characters XML 1.0 forbids).
std::string xml_escape(const std::string& s);
// A Markdown table cell: '|' escaped, newlines flattened to spaces.
std::string md_cell(const std::string& s);


}  // namespace llmdiff::compare
