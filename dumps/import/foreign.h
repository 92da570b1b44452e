// An engine's own tensors, as `llmdiff import` reads them: a safetensors
// file, a NumPy .npz archive, a directory of .npy files (one array per file,
// named by its path below the directory without ".npy", '/' between
// folders), or one .npy file. Values are widened like a dump's (floats to
// float32, integers to int64).
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"

namespace llmdiff {

class ForeignTensors {
 public:
  // Throws IoError / FormatError naming the path.
  explicit ForeignTensors(const std::string& path);
  ~ForeignTensors();
  ForeignTensors(const ForeignTensors&) = delete;
  ForeignTensors& operator=(const ForeignTensors&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<std::string>& names() const { return names_; }  // as stored
  bool has(const std::string& name) const { return index_.count(name) != 0; }
  // The file a tensor comes from: the path itself, or its .npy in a directory.
  std::string file_of(const std::string& name) const;
  // The stored shape (cheap: no values read).
  Shape shape(const std::string& name) const;
  TensorData get(const std::string& name) const;  // MissingTensorError when absent

 private:
  struct Impl;
  std::string path_;
  std::vector<std::string> names_;
  std::map<std::string, size_t> index_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace llmdiff
