// Small helpers shared by the tests of dumps/ (files, raw safetensors bytes,
// error expectations). Header-only; included by tests/test_dumps*.cpp.
#pragma once
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "dumps/base/errors.h"
#include "tests/support.h"

namespace llmdiff::testing {

using Bytes = std::vector<uint8_t>;

inline Bytes read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void write_bytes(const std::string& path, const Bytes& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

inline void write_text(const std::string& path, const std::string& s) { write_bytes(path, Bytes(s.begin(), s.end())); }

inline bool path_exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

// Entry names of a directory (without "." and ".."), sorted.
inline std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) throw std::runtime_error("cannot open " + dir);
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

// A fresh, empty directory under the per-process temp dir.
inline std::string fresh_dir(const std::string& stem) {
  static int counter = 0;
  std::string dir = temp_path(stem + "-" + std::to_string(counter++));
  ::mkdir(dir.c_str(), 0700);
  return dir;
}

// The 8-byte little-endian header length a safetensors file starts with.
inline uint64_t header_length(const Bytes& b) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | b.at(size_t(i));
  return n;
}

inline void put_header_length(Bytes& b, uint64_t n) {
  for (int i = 0; i < 8; ++i) b.at(size_t(i)) = uint8_t(n >> (8 * i));
}

// Splits a safetensors file into its header text and data region (trusting
// only the length prefix; used to build malformed variants of valid files).
struct RawFile {
  std::string header;
  Bytes data;
};
inline RawFile split_raw(const Bytes& b) {
  uint64_t n = header_length(b);
  RawFile r;
  r.header.assign(b.begin() + 8, b.begin() + 8 + long(n));
  r.data.assign(b.begin() + 8 + long(n), b.end());
  return r;
}

// Assembles a file from header text and data; the length prefix is the text's.
inline Bytes assemble(const std::string& header, const Bytes& data) {
  Bytes b(8 + header.size() + data.size());
  put_header_length(b, header.size());
  std::copy(header.begin(), header.end(), b.begin() + 8);
  std::copy(data.begin(), data.end(), b.begin() + 8 + long(header.size()));
  return b;
}

// The header of a valid file as ordered JSON (insertion order kept).
inline nlohmann::ordered_json header_json(const Bytes& b) {
  return nlohmann::ordered_json::parse(split_raw(b).header);
}

// Runs `fn`, expects it to throw exactly an error of type E (or a subclass)
// whose message contains every string of `parts`; returns the message.
template <class E>
std::string expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const E& e) {
    std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    return msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return "";
  }
  ADD_FAILURE() << "no exception thrown";
  return "";
}

}  // namespace llmdiff::testing
