// What every fuzz target checks of a typed error: its message is printable
// ASCII (names and excerpts from the input escaped, never raw bytes), else
// the input is a finding.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <string>

namespace llmdiff::fuzz {

inline void check_message(const std::string& what) {
  for (unsigned char c : what)
    if (c < 0x20 || c >= 0x7f) {
      std::fprintf(stderr, "error message holds a raw byte 0x%02x: %s\n", c, what.c_str());
      std::abort();
    }
}

}  // namespace llmdiff::fuzz
