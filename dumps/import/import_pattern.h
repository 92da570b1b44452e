// Name patterns of `llmdiff import` mappings: literal text with {capture}s,
// each capture a run of digits ("Qcur-{layer}", "step{step}/ffn_out-{layer}").
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace llmdiff::import {

using Captures = std::map<std::string, int64_t>;

class Pattern {
 public:
  // Throws UsageError on an unclosed or empty {capture}, or one named twice.
  static Pattern compile(const std::string& text);
  // Whether `name` matches; fills `caps`.
  bool match(const std::string& name, Captures& caps) const;
  // Throws UsageError when `templ` uses a capture this pattern lacks.
  void check_template(const std::string& templ) const;
  bool captures(const std::string& name) const;
  const std::string& text() const { return text_; }

 private:
  struct Part {
    bool capture = false;
    std::string text;  // literal text, or the capture's name
  };
  bool match_from(size_t part, const std::string& name, size_t pos, Captures& caps) const;
  std::string text_;
  std::vector<Part> parts_;
};

// `templ` with each {capture} replaced by its value.
std::string substitute(const std::string& templ, const Captures& caps);

}  // namespace llmdiff::import
