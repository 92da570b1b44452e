#include "dumps/import/import_pattern.h"

#include <cctype>
#include <set>

#include "dumps/base/errors.h"

namespace llmdiff::import {

namespace {

// The {capture} names of a template, in order; throws on a malformed one.
std::vector<std::pair<size_t, size_t>> braces(const std::string& text) {
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t p = 0; p < text.size(); ++p) {
    if (text[p] == '}') throw UsageError("\"" + text + "\": '}' without '{'");
    if (text[p] != '{') continue;
    const size_t e = text.find('}', p);
    if (e == std::string::npos) throw UsageError("\"" + text + "\": unclosed '{'");
    const std::string name = text.substr(p + 1, e - p - 1);
    if (name.empty()) throw UsageError("\"" + text + "\": empty {}");
    for (char c : name)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_')
        throw UsageError("\"" + text + "\": capture {" + name + "} is not a plain name");
    out.emplace_back(p, e);
    p = e;
  }
  return out;
}

}  // namespace

Pattern Pattern::compile(const std::string& text) {
  Pattern p;
  p.text_ = text;
  size_t at = 0;
  std::set<std::string> seen;
  for (const auto& [b, e] : braces(text)) {
    if (b > at) p.parts_.push_back({false, text.substr(at, b - at)});
    const std::string name = text.substr(b + 1, e - b - 1);
    if (!seen.insert(name).second) throw UsageError("\"" + text + "\": capture {" + name + "} twice");
    if (!p.parts_.empty() && p.parts_.back().capture)
      throw UsageError("\"" + text + "\": two captures with nothing between them");
    p.parts_.push_back({true, name});
    at = e + 1;
  }
  if (at < text.size()) p.parts_.push_back({false, text.substr(at)});
  return p;
}

bool Pattern::match_from(size_t part, const std::string& name, size_t pos, Captures& caps) const {
  if (part == parts_.size()) return pos == name.size();
  const Part& p = parts_[part];
  if (!p.capture) return name.compare(pos, p.text.size(), p.text) == 0 && match_from(part + 1, name, pos + p.text.size(), caps);
  size_t e = pos;
  while (e < name.size() && std::isdigit(static_cast<unsigned char>(name[e])) && e - pos < 12) ++e;
  for (size_t end = e; end > pos; --end) {  // longest digits first, shorter if the rest needs them
    if (match_from(part + 1, name, end, caps)) {
      caps[p.text] = std::stoll(name.substr(pos, end - pos));
      return true;
    }
  }
  return false;
}

bool Pattern::match(const std::string& name, Captures& caps) const {
  Captures c;
  if (!match_from(0, name, 0, c)) return false;
  for (auto& [k, v] : c) caps[k] = v;
  return true;
}

bool Pattern::captures(const std::string& name) const {
  for (const Part& p : parts_)
    if (p.capture && p.text == name) return true;
  return false;
}

void Pattern::check_template(const std::string& templ) const {
  for (const auto& [b, e] : braces(templ)) {
    const std::string name = templ.substr(b + 1, e - b - 1);
    if (!captures(name)) throw UsageError("\"" + templ + "\" uses {" + name + "}, which \"" + text_ + "\" does not capture");
  }
}

std::string substitute(const std::string& templ, const Captures& caps) {
  std::string out;
  size_t at = 0;
  for (const auto& [b, e] : braces(templ)) {
    out += templ.substr(at, b - at);
    out += std::to_string(caps.at(templ.substr(b + 1, e - b - 1)));
    at = e + 1;
  }
  return out + templ.substr(at);
}

}  // namespace llmdiff::import
