// GGUF reader (versions 2 and 3; mmap, zero-copy, fully validated) and writer
// (atomic; deterministic bytes). Format (little-endian):
//   u32 magic "GGUF", u32 version, u64 n_tensors, u64 n_kv,
//   n_kv x {string key, u32 type, value}, n_tensors x {string name,
//   u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset},
//   padding to `general.alignment` (default 32), then the data region;
//   offsets are relative to the data region and aligned.
//   string = u64 length + bytes (no terminator); array = u32 element type,
//   u64 count, elements. Value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32,
//   6 f32, 7 bool, 8 string, 9 array, 10 u64, 11 i64, 12 f64.
// ne[0] is the fastest-varying dimension: a GGUF tensor with ne = {D, V} is the
// row-major [V, D] matrix of safetensors (shape() gives it in that order).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "dumps/formats/ggml_types.h"
#include "dumps/formats/safetensors.h"  // Shape, MappedFile

namespace llmdiff {

// One metadata value. Arrays hold their elements as a vector of the scalar
// type (arrays of arrays are rejected as unsupported).
struct GgufValue {
  enum class Type : uint32_t {
    U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, Bool = 7,
    String = 8, Array = 9, U64 = 10, I64 = 11, F64 = 12,
  };
  Type type = Type::U32;
  Type elem_type = Type::U32;  // for arrays
  // Scalars: integers in `i` (u64 values beyond INT64_MAX rejected), floats in
  // `f`, bools as 0/1 in `i`, strings in `s`. Arrays: `ints`, `floats` or
  // `strings` by element type.
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<std::string> strings;
  bool is_array() const { return type == Type::Array; }
  bool is_integer() const;  // an integer or bool scalar
  bool is_float() const;    // F32 / F64 scalar
  size_t array_size() const;
};

struct GgufTensorInfo {
  std::string name;
  GgmlType type = GgmlType::F32;
  std::vector<int64_t> ne;  // as stored: ne[0] fastest
  uint64_t offset = 0;      // relative to the data region
  size_t nbytes = 0;
  int64_t numel() const;
  Shape shape() const;      // row-major: reversed ne
};

class GgufFile {
 public:
  // Maps and validates `path`; throws IoError / FormatError naming the file,
  // and the tensor or key at fault. Checks: magic, version 2 or 3, counts and
  // string/array lengths bounded by the file size, known value types, unique
  // keys and tensor names, n_dims 1..4, ne > 0 with no overflow, known ggml
  // type (unknown: named by number), ne[0] a multiple of the block size,
  // offsets aligned to the alignment and [offset, offset+nbytes) inside the
  // data region, `general.alignment` a u32 power of two.
  explicit GgufFile(const std::string& path);

  const std::string& path() const { return file_->path(); }
  uint32_t version() const { return version_; }
  size_t alignment() const { return alignment_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find(const std::string& name) const;
  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  const GgufValue* get(const std::string& key) const;
  // Typed accessors; throw FormatError naming the key when present with the
  // wrong type; `fallback` when absent.
  int64_t get_int(const std::string& key, int64_t fallback) const;
  double get_float(const std::string& key, double fallback) const;  // ints accepted
  std::string get_string(const std::string& key, const std::string& fallback) const;
  bool has(const std::string& key) const { return kv_.count(key) != 0; }
  const void* data(const GgufTensorInfo& t) const;
  // Whole tensor dequantised to float32 (a copy).
  std::vector<float> to_f32(const GgufTensorInfo& t) const;

 private:
  std::shared_ptr<MappedFile> file_;
  uint32_t version_ = 0;
  size_t alignment_ = 32, data_start_ = 0;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t> index_;
};

// Parses and validates from raw bytes (used by GgufFile, tests and the fuzz
// harness). `file` only names the source in errors.
struct ParsedGguf {
  uint32_t version = 0;
  size_t alignment = 32, data_start = 0;
  std::map<std::string, GgufValue> kv;
  std::vector<GgufTensorInfo> tensors;
};
ParsedGguf parse_gguf(const uint8_t* bytes, size_t size, const std::string& file);

// Streaming GGUF v3 writer: metadata first, then tensors added one at a time
// (their bytes go to a temporary file); finish() writes header + aligned data
// through AtomicFile. Same content in the same order gives the same bytes.
class GgufWriter {
 public:
  explicit GgufWriter(std::string path, size_t alignment = 32);
  ~GgufWriter();
  GgufWriter(const GgufWriter&) = delete;
  GgufWriter& operator=(const GgufWriter&) = delete;

  void set_u32(const std::string& key, uint32_t v);
  void set_i32(const std::string& key, int32_t v);
  void set_u64(const std::string& key, uint64_t v);
  void set_f32(const std::string& key, float v);
  void set_bool(const std::string& key, bool v);
  void set_string(const std::string& key, const std::string& v);
  void set_array_i32(const std::string& key, const std::vector<int32_t>& v);
  void set_array_f32(const std::string& key, const std::vector<float>& v);
  void set_array_string(const std::string& key, const std::vector<std::string>& v);
  // `ne` as GGUF stores it (ne[0] fastest); `nbytes` must equal the type's
  // row bytes times the other dims. Throws FormatError on a duplicate name.
  void add_tensor(const std::string& name, GgmlType type, const std::vector<int64_t>& ne,
                  const void* data, size_t nbytes);
  // Quantises a row-major float32 matrix of `shape` (last dim fastest) to `type`.
  void add_tensor_f32(const std::string& name, GgmlType type, const Shape& shape, const float* data);
  // The same, made slab by slab: the leading dimension shape[0] split into
  // `slabs` equal parts (a merged expert tensor [E, rows, cols] expert by
  // expert); fill(s, dst) writes slab s (numel / slabs values) as float32.
  // One slab is in memory at a time; the bytes are add_tensor_f32's.
  void add_tensor_f32_slabs(const std::string& name, GgmlType type, const Shape& shape, int64_t slabs,
                            const std::function<void(int64_t slab, float* dst)>& fill);
  // Any metadata value as the reader holds it (arrays of integers, floats or
  // strings written with their element type).
  void set_value(const std::string& key, const GgufValue& v);
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace llmdiff
