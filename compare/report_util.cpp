// Shared pieces of the renderers: number formatting, XML escaping, atomic writes.
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "compare/report.h"
#include "dumps/errors.h"

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

void write_text_atomic(const std::string& path, const std::string& text) {
  static std::atomic<unsigned> counter{0};
  std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw IoError(path, std::string("cannot create temporary file: ") + std::strerror(errno));
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  ok = std::fflush(f) == 0 && ok;
  ok = ::fsync(::fileno(f)) == 0 && ok;
  int err = errno;
  ok = std::fclose(f) == 0 && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    throw IoError(path, std::string("cannot write: ") + std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
    std::remove(tmp.c_str());
    throw IoError(path, std::string("cannot rename the temporary file into place: ") + std::strerror(err));
  }
}

}  // namespace llmdiff::compare
