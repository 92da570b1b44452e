// Typed errors of llmdiff. Libraries throw these with context (file, tensor,
// expected vs actual); only `main` maps them to exit codes.
#pragma once
#include <stdexcept>
#include <string>

namespace llmdiff {

// `text` with every byte outside printable ASCII written as \xNN: what an
// error message shows of names, keys and excerpts that come from an input
// file, so a malformed file never puts raw bytes on a terminal.
inline std::string printable(const std::string& text) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7f) {
      out += ch;
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

// Base of every error llmdiff reports as "bad input" (exit code 2). The
// message is made printable() whatever it quotes.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(printable(what)) {}
};

// A file could not be opened, read, mapped or written.
class IoError : public Error {
 public:
  IoError(const std::string& file, const std::string& what)
      : Error(file + ": " + what), file_(file) {}
  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

// A safetensors file (or llm-dump) is malformed. `tensor` is empty when the
// problem is not tied to one tensor (e.g. the header length).
class FormatError : public Error {
 public:
  FormatError(const std::string& file, const std::string& tensor, const std::string& what)
      : Error(file + (tensor.empty() ? "" : ": tensor '" + tensor + "'") + ": " + what),
        file_(file),
        tensor_(tensor) {}
  const std::string& file() const { return file_; }
  const std::string& tensor() const { return tensor_; }

 private:
  std::string file_, tensor_;
};

// config.json is malformed or asks for something llmdiff does not support.
class ConfigError : public Error {
 public:
  ConfigError(const std::string& file, const std::string& what) : Error(file + ": " + what) {}
};

// A tensor has the wrong shape (weights vs config, or a dump vs the spec).
class ShapeError : public Error {
 public:
  ShapeError(const std::string& file, const std::string& tensor, const std::string& expected,
             const std::string& actual)
      : Error(file + ": tensor '" + tensor + "': expected shape " + expected + ", got " + actual) {}
};

// A required tensor is absent.
class MissingTensorError : public Error {
 public:
  MissingTensorError(const std::string& file, const std::string& tensor)
      : Error(file + ": missing tensor '" + tensor + "'") {}
};

// The user asked for something invalid (bad option value, inapplicable bug...).
class UsageError : public Error {
 public:
  using Error::Error;
};

}  // namespace llmdiff
