// Building blocks of the HTML reports (compare/report_html.h): escaping,
// sortable tables, the page shell with its inline style and script, and the
// chart and heatmap sections whose data the script draws.
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "compare/compare.h"
#include "compare/heatmap.h"
#include "compare/local_error.h"

namespace llmdiff::compare::html {

// Escapes &, <, >, " and ' for text and attribute values; drops control
// characters other than tab and newline.
std::string esc(const std::string& s);
// A number as the text reports write it (fmt_num), escaped.
std::string num(double v, int digits = 3);

// A table whose rows sort by clicking a header. Each cell holds escaped
// HTML and, for numeric columns, the value sorted by.
class Table {
 public:
  Table(std::string id, std::vector<std::string> headers);
  // Starts a row; `css` classes it ("fail", "pass").
  Table& row(const std::string& css = "");
  Table& text(const std::string& raw);              // escaped text
  Table& code(const std::string& raw);              // escaped, monospaced
  Table& number(double v, int digits = 3);          // fmt_num, sorted by value
  Table& count(long long v);                        // an integer, sorted by value
  std::string str() const;
  bool empty() const { return rows_.empty(); }

 private:
  std::string id_;
  std::vector<std::string> headers_;
  std::vector<std::string> rows_;
};

// One definition-list entry: a term and its escaped-HTML description.
std::string entry(const std::string& term, const std::string& html);

// The error-growth chart over a comparison's names: error / threshold per
// name (canonical order, every step), the local ratio where `local` has the
// name; `first` and `local_first` are marked. Data plus the SVG it is drawn in.
std::string chart_section(const DiffResult& global, const LocalReport* local);
// The heatmap section (a note when there is none).
std::string heatmap_section(const std::optional<ErrorHeatmap>& h);

// The whole page: doctype, head (title, inline style), `body`, inline script.
std::string page(const std::string& title, const std::string& body);

// JSON text safe inside <script type="application/json">.
std::string script_json(const nlohmann::json& j);

extern const char* const kStyle;   // inline CSS (compare/html_assets.cpp)
extern const char* const kScript;  // inline JS (compare/html_assets.cpp)

}  // namespace llmdiff::compare::html
