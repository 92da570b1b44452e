// safetensors reader (mmap, zero-copy, fully validated) and streaming writer
// (atomic: temporary file then rename; deterministic bytes).
// Format: 8-byte little-endian header length N, N bytes of JSON header,
// then the data region; offsets in the header are relative to the data region.
#pragma once
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dumps/base/dtype.h"

namespace llmdiff {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "[4, 7, 16]"
int64_t numel(const Shape& s);

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte offsets in the data region
  int64_t numel() const { return llmdiff::numel(shape); }
  size_t nbytes() const { return size_t(end - begin); }
};

// A read-only memory map of a whole file.
// Hands the pages of [data, data + bytes) of a read-only mapping back to the
// kernel (madvise MADV_DONTNEED, widened to whole pages): the process's
// resident memory drops, and a later read faults them in again from the page
// cache or the file. For large inputs read once (weights converted a layer at
// a time, dumps compared tensor by tensor).
void release_pages(const void* data, size_t bytes);

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

class SafetensorsFile {
 public:
  // Maps and validates `path`; throws IoError / FormatError naming the file and tensor.
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const { return file_->path(); }
  // Tensors in the order of the header (file order).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;  // nullptr if absent
  const TensorInfo& at(const std::string& name) const;    // MissingTensorError if absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Zero-copy pointer to the tensor's bytes (valid while this object lives).
  const void* data(const TensorInfo& t) const { return file_->data() + data_start_ + t.begin; }
  // Values converted to float32 (a copy).
  std::vector<float> to_f32(const TensorInfo& t) const;
  std::vector<int64_t> to_i64(const TensorInfo& t) const;

 private:
  std::shared_ptr<MappedFile> file_;
  size_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// Parses and validates a header from raw bytes; used by SafetensorsFile and by
// tests. `file` only names the source in errors.
struct ParsedHeader {
  size_t data_start = 0;
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
};
ParsedHeader parse_safetensors(const uint8_t* bytes, size_t size, const std::string& file);

// Streaming writer: tensors are added one at a time and their bytes go straight
// to a temporary file; finish() writes header + data to `path.tmp.XXXX` and
// renames it onto `path`. Destroying an unfinished writer removes the
// temporaries, so a half-written file never appears under the final name.
// The header lists tensors in the order they were added; the same content
// added in the same order gives the same bytes.
class SafetensorsWriter {
 public:
  explicit SafetensorsWriter(std::string path);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  void set_metadata(const std::string& key, const std::string& value);
  // Throws FormatError on a duplicate name or a byte count that does not match.
  void add(const std::string& name, DType dtype, const Shape& shape, const void* data, size_t nbytes);
  void add_f32(const std::string& name, const Shape& shape, const float* data);
  void add_i64(const std::string& name, const Shape& shape, const int64_t* data);
  bool has(const std::string& name) const;
  void finish();
  const std::string& path() const { return path_; }

 private:
  std::string path_, data_tmp_;
  FILE* data_ = nullptr;
  uint64_t offset_ = 0;
  bool finished_ = false;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace llmdiff
