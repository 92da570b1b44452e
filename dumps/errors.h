// Typed errors of llmdiff. Libraries throw these with context (file, tensor,
// expected vs actual); only `main` maps them to exit codes.
#pragma once
#include <stdexcept>
#include <string>

namespace llmdiff {

// Base of every error llmdiff reports as "bad input" (exit code 2).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
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
