// Shared pieces of the renderers: number formatting, XML escaping, atomic writes.
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "compare/report.h"
#include "dumps/base/errors.h"

namespace llmdiff::compare {

std::string fmt_num(double v, int digits) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == 0) return "0";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.*e", digits, v);
  return buf;
}

nlohmann::json json_num(double v) {
  if (std::isfinite(v)) return v;
  return fmt_num(v);
}

std::string md_cell(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|')
      out += "\\|";
    else if (c == '\n')
      out += ' ';
    else
      out += c;
  }
  return out;
}

std::string xml_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (unsigned char ch : s) {
    switch (ch) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        if (ch < 0x20 && ch != '\n' && ch != '\t' && ch != '\r') break;  // not allowed in XML 1.0
        out += char(ch);
    }
  }
  return out;
}

}  // namespace llmdiff::compare
