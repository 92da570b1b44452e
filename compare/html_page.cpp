#include "compare/html_page.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "compare/report.h"

namespace llmdiff::compare::html {

using nlohmann::json;

std::string esc(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (unsigned char ch : s) {
    switch (ch) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default:
        if (ch < 0x20 && ch != '\n' && ch != '\t') break;
        out += char(ch);
    }
  }
  return out;
}

std::string num(double v, int digits) { return esc(fmt_num(v, digits)); }

namespace {

// A sort key for data-v: JavaScript's parseFloat reads "Infinity", "-Infinity", "NaN".
std::string sort_key(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// Four significant digits: the picture needs no more, the file stays small.
json short_num(double v) {
  if (!std::isfinite(v)) return nullptr;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return std::strtod(buf, nullptr);
}

std::string site_of(const CanonName& c, const std::string& name) {
  if (c.kind == CanonName::Kind::Step || c.kind == CanonName::Kind::Layer) return c.site;
  return name;
}

}  // namespace

Table::Table(std::string id, std::vector<std::string> headers) : id_(std::move(id)), headers_(std::move(headers)) {}

Table& Table::row(const std::string& css) {
  rows_.push_back(css.empty() ? "<tr>" : "<tr class=\"" + esc(css) + "\">");
  return *this;
}
Table& Table::text(const std::string& raw) {
  rows_.back() += "<td>" + esc(raw) + "</td>";
  return *this;
}
Table& Table::code(const std::string& raw) {
  rows_.back() += "<td><code>" + esc(raw) + "</code></td>";
  return *this;
}
Table& Table::number(double v, int digits) {
  rows_.back() += "<td class=\"num\" data-v=\"" + sort_key(v) + "\">" + num(v, digits) + "</td>";
  return *this;
}
Table& Table::count(long long v) {
  rows_.back() += "<td class=\"num\" data-v=\"" + std::to_string(v) + "\">" + std::to_string(v) + "</td>";
  return *this;
}

std::string Table::str() const {
  std::string o = "<table class=\"sortable\" id=\"" + esc(id_) + "\"><thead><tr>";
  for (const auto& h : headers_) o += "<th title=\"sort\">" + esc(h) + "</th>";
  o += "</tr></thead><tbody>\n";
  for (const auto& r : rows_) o += r + "</tr>\n";
  return o + "</tbody></table>\n";
}

std::string entry(const std::string& term, const std::string& html) {
  return "<dt>" + esc(term) + "</dt><dd>" + html + "</dd>\n";
}

std::string script_json(const json& j) {
  const std::string text = j.dump(-1, ' ', false, json::error_handler_t::replace);
  std::string out;
  out.reserve(text.size());
  // '<', '>' and '&' occur only inside JSON strings, where \uXXXX means the same.
  for (char c : text) {
    if (c == '<')
      out += "\\u003c";
    else if (c == '>')
      out += "\\u003e";
    else if (c == '&')
      out += "\\u0026";
    else
      out += c;
  }
  return out;
}

std::string chart_section(const DiffResult& global, const LocalReport* local) {
  // Shape: points[k] = {n: name, s: site, st: step, l: layer, r: error / threshold (null: off the scale or
  // not a ratio), f: fails, lr / lf: the local ratio and verdict where the name was recomputed}.
  json points = json::array();
  int first = -1, local_first = -1;
  const LocalSite* lfirst = local && local->ran ? local->first() : nullptr;
  for (size_t k = 0; k < global.tensors.size(); ++k) {
    const TensorComparison& t = global.tensors[k];
    json p = {{"n", t.name}, {"s", site_of(t.parsed, t.name)}, {"st", t.parsed.step}, {"l", t.parsed.layer},
              {"f", !t.pass}};
    // An informational name or an exact integer match has no global ratio
    // to draw ("r" absent), a mismatch no finite one (null).
    if (t.judgement.judged && t.shape_match && t.judgement.threshold > 0)
      p["r"] = short_num(t.judgement.value / t.judgement.threshold);
    else if (!t.pass)
      p["r"] = nullptr;
    if (local && local->ran)
      if (const LocalSite* s = local->find(t.name)) {
        if (s->shape_match && !s->is_int)
          p["lr"] = short_num(s->noise.ratio());
        else if (!s->pass)
          p["lr"] = nullptr;
        p["lf"] = !s->pass;
      }
    if (!p.contains("r") && !p.contains("lr")) continue;  // nothing to draw
    if (global.first_divergence && *global.first_divergence == k) first = int(points.size());
    if (lfirst && lfirst->name == t.name) local_first = int(points.size());
    points.push_back(std::move(p));
  }
  json data = {{"points", points}, {"first", first}, {"local_first", local_first}};
  std::string o = "<section id=\"growth\"><h2>Error growth</h2>\n";
  o += "<p class=\"note\">Each name compared, in canonical order over every step (x), coloured by site: its error over "
       "its threshold (" + esc(global.criterion) + ") on a log scale (y). The dashed line is ratio 1: above it a name "
       "diverges. Filled circles: the global comparison";
  if (local && local->ran) o += "; hollow squares: the local error (the op on the candidate's own inputs) over its noise threshold";
  o += ". Off-scale values (shape or integer mismatches, non-finite) sit in the top row, marked off scale.</p>\n";
  if (points.empty()) {
    o += "<p>No name with an error ratio was compared.</p>\n";
  } else {
    o += "<svg id=\"chart\" viewBox=\"0 0 1100 440\" role=\"img\" aria-label=\"error over threshold per name\"></svg>\n";
    o += "<div id=\"chart-legend\" class=\"legend\"></div>\n";
  }
  o += "<script type=\"application/json\" id=\"chart-data\">" + script_json(data) + "</script>\n</section>\n";
  return o;
}

std::string heatmap_section(const std::optional<ErrorHeatmap>& h) {
  std::string o = "<section id=\"heatmap-section\"><h2>Error heatmap</h2>\n";
  if (!h) return o + "<p>No tensor to map: nothing diverges, or the diverging tensor's shapes differ.</p></section>\n";
  // Shape: values row-major, rows x cols; null for a non-finite cell.
  json values = json::array();
  for (float v : h->values) values.push_back(short_num(v));
  json data = {{"name", h->name},         {"row_label", h->row_label}, {"col_label", h->col_label},
               {"rows", h->rows},         {"cols", h->cols},           {"row_step", h->row_step},
               {"col_step", h->col_step}, {"src_rows", h->src_rows},   {"src_cols", h->src_cols},
               {"max", short_num(h->max)}, {"values", values}};
  o += "<p><code>" + esc(h->name) + "</code> " + esc(shape_str(h->shape)) + ": max |candidate - reference| per cell, " +
       esc(h->row_label) + " (" + std::to_string(h->src_rows) + ") &times; " + esc(h->col_label) + " (" +
       std::to_string(h->src_cols) + ")";
  if (h->inner > 1) o += ", each entry the max over " + std::to_string(h->inner) + " trailing elements";
  if (h->row_step > 1 || h->col_step > 1)
    o += ", downsampled " + std::to_string(h->row_step) + " &times; " + std::to_string(h->col_step) + " per cell";
  o += ". Largest " + num(h->max) + " in cell (" + std::to_string(h->max_row) + ", " + std::to_string(h->max_col) + ")";
  if (h->nonfinite) o += "; " + std::to_string(h->nonfinite) + " cells non-finite";
  o += "; colour on a log scale.</p>\n";
  o += "<canvas id=\"heatmap\" width=\"800\" height=\"300\"></canvas>\n";
  o += "<div class=\"legend\"><canvas id=\"heatmap-legend\" width=\"240\" height=\"14\"></canvas> "
       "<span id=\"heatmap-scale\"></span></div>\n<div id=\"heatmap-tip\" class=\"note\">&nbsp;</div>\n";
  o += "<script type=\"application/json\" id=\"heatmap-data\">" + script_json(data) + "</script>\n</section>\n";
  return o;
}

std::string page(const std::string& title, const std::string& body) {
  std::string o = "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  // Nothing may load from anywhere: the page is its own file.
  o += "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
       "script-src 'unsafe-inline'; img-src data:\">\n";
  o += "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>" + esc(title) + "</title>\n";
  o += "<style>\n" + std::string(kStyle) + "</style>\n</head>\n<body data-rendered=\"no\">\n<main>\n" + body;
  o += "</main>\n<script>\n" + std::string(kScript) + "</script>\n</body>\n</html>\n";
  return o;
}

}  // namespace llmdiff::compare::html
