// GGUF reader and writer. The reader mirrors the checks of ggml's
// gguf_init_from_file (ggml/src/gguf.cpp) and adds llmdiff's own (ne > 0,
// n_dims >= 1, offsets inside the file); every length read from the file is
// checked against the bytes that remain before anything is allocated for it.
#include "dumps/formats/gguf.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <exception>
#include <set>
#include <thread>
#include <utility>

#include "dumps/base/errors.h"
#include "dumps/base/threads.h"
#include "dumps/base/files.h"

namespace llmdiff {

namespace {

constexpr uint32_t kDefaultAlignment = 32;  // GGUF_DEFAULT_ALIGNMENT
constexpr int kMaxDims = 4;                 // GGML_MAX_DIMS
constexpr size_t kMaxName = 64;             // GGML_MAX_NAME, terminator included
constexpr size_t kMaxShown = 80;            // bytes of a name shown in messages
const char* const kAlignmentKey = "general.alignment";

using VType = GgufValue::Type;

// A name or key from the file made safe for messages: printable ASCII kept,
// every other byte (and the quote and backslash) as \xNN, cut at 80 bytes.
std::string escape(const std::string& s) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  const size_t shown = std::min(s.size(), kMaxShown);
  for (size_t i = 0; i < shown; ++i) {
    const auto c = uint8_t(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out += char(c);
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  if (shown < s.size()) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

std::string key_label(const std::string& key) { return "metadata key '" + escape(key) + "'"; }

const char* value_type_name(uint32_t t) {
  static const char* names[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                "bool", "string", "array", "u64", "i64", "f64"};
  return t < 13 ? names[t] : "unknown";
}

bool is_power_of_two(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

// The smallest number of bytes one element of value type `t` takes in a file
// (a string: its 8-byte length); 0 for an unknown type.
size_t min_value_bytes(uint32_t t) {
  switch (VType(t)) {
    case VType::U8: case VType::I8: case VType::Bool: return 1;
    case VType::U16: case VType::I16: return 2;
    case VType::U32: case VType::I32: case VType::F32: return 4;
    case VType::U64: case VType::I64: case VType::F64: case VType::String: return 8;
    case VType::Array: return 12;  // element type + count
  }
  return 0;
}

// ------------------------------------------------------------------ reading

// A bounds-checked little-endian cursor over the file's bytes. `where` says
// what is being read and `tensor` which tensor (escaped), for messages.
class Reader {
 public:
  Reader(const uint8_t* p, size_t size, const std::string& file) : p_(p), size_(size), file_(file) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }
  std::string where, tensor;

  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError(file_, tensor, where.empty() ? what : where + ": " + what);
  }

  void need(uint64_t n, const char* item) const {
    if (n > remaining())
      fail("truncated: " + std::string(item) + " at byte " + std::to_string(pos_) + " needs " +
           std::to_string(n) + " bytes, the file has " + std::to_string(remaining()) + " left");
  }

  uint64_t uint(int bytes, const char* item) {
    need(uint64_t(bytes), item);
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p_[pos_ + size_t(i)];
    pos_ += size_t(bytes);
    return v;
  }
  uint32_t u32(const char* item) { return uint32_t(uint(4, item)); }
  uint64_t u64(const char* item) { return uint(8, item); }

  std::string str(const char* item) {
    const uint64_t n = u64(item);
    if (n > remaining())
      fail("truncated: " + std::string(item) + " of " + std::to_string(n) + " bytes at byte " +
           std::to_string(pos_) + " runs past the end of the file (" + std::to_string(remaining()) + " bytes left)");
    std::string s(reinterpret_cast<const char*>(p_ + pos_), size_t(n));
    pos_ += size_t(n);
    return s;
  }

  const uint8_t* bytes() const { return p_; }

 private:
  const uint8_t* p_;
  size_t size_, pos_ = 0;
  const std::string& file_;
};

float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
double bits_to_f64(uint64_t u) {
  double f;
  std::memcpy(&f, &u, 8);
  return f;
}

// One integer of type `t` (U8..I64, Bool) as int64; u64 beyond INT64_MAX and
// bools other than 0/1 are rejected.
int64_t read_int(Reader& r, VType t) {
  switch (t) {
    case VType::U8: return int64_t(r.uint(1, "a u8 value"));
    case VType::I8: return int8_t(uint8_t(r.uint(1, "an i8 value")));
    case VType::U16: return int64_t(r.uint(2, "a u16 value"));
    case VType::I16: return int16_t(uint16_t(r.uint(2, "an i16 value")));
    case VType::U32: return int64_t(r.uint(4, "a u32 value"));
    case VType::I32: return int32_t(uint32_t(r.uint(4, "an i32 value")));
    case VType::I64: return int64_t(r.uint(8, "an i64 value"));
    case VType::U64: {
      const uint64_t v = r.uint(8, "a u64 value");
      if (v > uint64_t(INT64_MAX)) r.fail("u64 value " + std::to_string(v) + " exceeds INT64_MAX");
      return int64_t(v);
    }
    case VType::Bool: {
      const uint64_t v = r.uint(1, "a bool value");
      if (v > 1) r.fail("bool value " + std::to_string(v) + " is neither 0 nor 1");
      return int64_t(v);
    }
    default: break;
  }
  r.fail("internal: not an integer type");
}

double read_float(Reader& r, VType t) {
  if (t == VType::F32) return bits_to_f32(r.u32("an f32 value"));
  return bits_to_f64(r.u64("an f64 value"));
}

bool is_int_type(VType t) {
  return t == VType::U8 || t == VType::I8 || t == VType::U16 || t == VType::I16 || t == VType::U32 ||
         t == VType::I32 || t == VType::U64 || t == VType::I64 || t == VType::Bool;
}
bool is_float_type(VType t) { return t == VType::F32 || t == VType::F64; }

VType read_value_type(Reader& r, const char* item) {
  const uint32_t t = r.u32(item);
  if (min_value_bytes(t) == 0) r.fail("unknown value type " + std::to_string(t) + " (GGUF defines 0..12)");
  return VType(t);
}

void read_array(Reader& r, GgufValue& v) {
  v.elem_type = read_value_type(r, "the array element type");
  if (v.elem_type == VType::Array) r.fail("arrays of arrays are not supported");
  const uint64_t count = r.u64("the array length");
  // Bounded by the bytes left before anything is reserved.
  if (count > r.remaining() / min_value_bytes(uint32_t(v.elem_type)))
    r.fail("array of " + std::to_string(count) + " " + value_type_name(uint32_t(v.elem_type)) +
           " elements runs past the end of the file (" + std::to_string(r.remaining()) + " bytes left)");
  const auto n = size_t(count);
  if (is_int_type(v.elem_type)) {
    v.ints.reserve(n);
    for (size_t i = 0; i < n; ++i) v.ints.push_back(read_int(r, v.elem_type));
  } else if (is_float_type(v.elem_type)) {
    v.floats.reserve(n);
    for (size_t i = 0; i < n; ++i) v.floats.push_back(read_float(r, v.elem_type));
  } else {
    v.strings.reserve(n);
    for (size_t i = 0; i < n; ++i) v.strings.push_back(r.str("an array string"));
  }
}

GgufValue read_value(Reader& r) {
  GgufValue v;
  v.type = read_value_type(r, "the value type");
  if (v.type == VType::Array) read_array(r, v);
  else if (v.type == VType::String) v.s = r.str("a string value");
  else if (is_float_type(v.type)) v.f = read_float(r, v.type);
  else v.i = read_int(r, v.type);
  return v;
}

void read_header(Reader& r, ParsedGguf& out, uint64_t* n_tensors, uint64_t* n_kv) {
  r.where = "header";
  r.need(4, "the magic");
  const uint8_t* m = r.bytes();
  if (std::memcmp(m, "GGUF", 4) != 0)
    r.fail("bad magic '" + escape(std::string(reinterpret_cast<const char*>(m), 4)) + "', expected 'GGUF'");
  r.uint(4, "the magic");
  out.version = r.u32("the version");
  if (out.version == 1) r.fail("GGUF version 1 is not supported (only versions 2 and 3)");
  if (out.version != 2 && out.version != 3) {
    const bool swapped = (out.version & 0xffff) == 0 && out.version != 0;
    r.fail("unsupported GGUF version " + std::to_string(out.version) + " (only versions 2 and 3)" +
           (swapped ? "; a big-endian file?" : ""));
  }
  *n_tensors = r.u64("the tensor count");
  *n_kv = r.u64("the metadata count");
  // Each metadata entry takes at least 13 bytes, each tensor entry 32.
  const uint64_t left = r.remaining();
  if (*n_tensors > left / 32)
    r.fail("tensor count " + std::to_string(*n_tensors) + " is more than the " + std::to_string(left) +
           " remaining bytes can describe");
  if (*n_kv > (left - *n_tensors * 32) / 13)
    r.fail("metadata count " + std::to_string(*n_kv) + " is more than the " + std::to_string(left) +
           " remaining bytes can hold");
}

void read_metadata(Reader& r, uint64_t n_kv, ParsedGguf& out) {
  for (uint64_t i = 0; i < n_kv; ++i) {
    r.where = "metadata entry " + std::to_string(i);
    std::string key = r.str("the key");
    if (key.empty()) r.fail("empty key");
    r.where = key_label(key);
    if (out.kv.count(key)) r.fail("duplicate key");
    GgufValue v = read_value(r);
    out.kv.emplace(std::move(key), std::move(v));
  }
  r.where.clear();
  auto it = out.kv.find(kAlignmentKey);
  if (it != out.kv.end()) {
    r.where = key_label(kAlignmentKey);
    if (it->second.type != VType::U32)
      r.fail(std::string("must be a u32, not ") + value_type_name(uint32_t(it->second.type)));
    if (!is_power_of_two(uint64_t(it->second.i)))
      r.fail("alignment " + std::to_string(it->second.i) + " is not a power of two");
    out.alignment = size_t(it->second.i);
    r.where.clear();
  }
}

// ne[0..n_dims) with every dimension > 0 and the element count within int64.
void read_shape(Reader& r, GgufTensorInfo& t) {
  const uint32_t n_dims = r.u32("the number of dimensions");
  if (n_dims < 1 || n_dims > uint32_t(kMaxDims))
    r.fail("n_dims " + std::to_string(n_dims) + " is outside 1.." + std::to_string(kMaxDims));
  int64_t count = 1;
  for (uint32_t d = 0; d < n_dims; ++d) {
    const uint64_t ne = r.u64("a dimension");
    if (ne == 0 || ne > uint64_t(INT64_MAX))
      r.fail("dimension " + std::to_string(d) + " has " + std::to_string(ne) + " elements (must be 1..INT64_MAX)");
    if (__builtin_mul_overflow(count, int64_t(ne), &count)) r.fail("the element count overflows int64");
    t.ne.push_back(int64_t(ne));
  }
}

void read_type_and_size(Reader& r, GgufTensorInfo& t) {
  const uint32_t type = r.u32("the ggml type");
  const int64_t block = ggml_block_size(GgmlType(type));
  if (block == 0) {
    const std::string name = ggml_type_name(type);
    r.fail((name.rfind("type ", 0) == 0 ? "unknown ggml type " + std::to_string(type)
                                        : "ggml type " + std::to_string(type) + " (" + name + ") is not supported") +
           " (supported: " + ggml_supported_types() + ")");
  }
  t.type = GgmlType(type);
  if (t.ne[0] % block != 0)
    r.fail("ne[0] = " + std::to_string(t.ne[0]) + " is not a multiple of the block size " + std::to_string(block) +
           " of " + ggml_type_name(type));
  uint64_t bytes = 0;
  bool overflow = __builtin_mul_overflow(uint64_t(t.ne[0] / block), uint64_t(ggml_type_size(t.type)), &bytes);
  for (size_t d = 1; d < t.ne.size(); ++d) overflow = overflow || __builtin_mul_overflow(bytes, uint64_t(t.ne[d]), &bytes);
  if (overflow || bytes > SIZE_MAX) r.fail("the byte size of shape " + shape_str(t.ne) + " overflows");
  t.nbytes = size_t(bytes);
}

void read_tensor_infos(Reader& r, uint64_t n_tensors, ParsedGguf& out) {
  std::set<std::string> seen;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    r.where = "tensor entry " + std::to_string(i);
    GgufTensorInfo t;
    t.name = r.str("the tensor name");
    r.where.clear();
    r.tensor = escape(t.name);
    if (!seen.insert(t.name).second) r.fail("duplicate tensor name");
    read_shape(r, t);
    read_type_and_size(r, t);
    t.offset = r.u64("the data offset");
    if (t.offset % out.alignment != 0)
      r.fail("data offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
             std::to_string(out.alignment));
    out.tensors.push_back(std::move(t));
    r.tensor.clear();
  }
}

// The data region starts at the first aligned byte after the tensor entries;
// every tensor's bytes must lie inside it.
void check_data_region(Reader& r, size_t size, ParsedGguf& out) {
  const uint64_t a = out.alignment;
  const uint64_t start = (uint64_t(r.pos()) + a - 1) / a * a;
  if (out.tensors.empty()) {
    out.data_start = size_t(std::min<uint64_t>(start, size));
    return;
  }
  if (start > size)
    r.fail("truncated: the data region starts at byte " + std::to_string(start) + " but the file has " +
           std::to_string(size) + " bytes");
  out.data_start = size_t(start);
  const uint64_t data_size = size - start;
  for (const auto& t : out.tensors) {
    if (t.offset > data_size || t.nbytes > data_size - t.offset) {
      r.tensor = escape(t.name);
      r.fail("data at offset " + std::to_string(t.offset) + " (" + std::to_string(t.nbytes) +
             " bytes) runs past the end of the file: the data region has " + std::to_string(data_size) + " bytes");
    }
  }
  // No two tensors share bytes (ggml's writer lays them out one after the
  // other; an overlap is a corrupt table, not a layout).
  std::vector<const GgufTensorInfo*> by_offset;
  for (const auto& t : out.tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const GgufTensorInfo* x, const GgufTensorInfo* y) { return x->offset < y->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const GgufTensorInfo& prev = *by_offset[i - 1];
    const GgufTensorInfo& t = *by_offset[i];
    if (prev.nbytes > 0 && t.offset < prev.offset + prev.nbytes) {
      r.tensor = escape(t.name);
      r.fail("data at offset " + std::to_string(t.offset) + " overlaps tensor '" + escape(prev.name) + "' (offset " +
             std::to_string(prev.offset) + ", " + std::to_string(prev.nbytes) + " bytes)");
    }
  }
}

}  // namespace

ParsedGguf parse_gguf(const uint8_t* bytes, size_t size, const std::string& file) {
  if (size == 0) throw FormatError(file, "", "empty file (no GGUF header)");
  Reader r(bytes, size, file);
  ParsedGguf out;
  uint64_t n_tensors = 0, n_kv = 0;
  read_header(r, out, &n_tensors, &n_kv);
  read_metadata(r, n_kv, out);
  read_tensor_infos(r, n_tensors, out);
  check_data_region(r, size, out);
  return out;
}

// ---------------------------------------------------------------- GgufValue

bool GgufValue::is_integer() const { return is_int_type(type); }
bool GgufValue::is_float() const { return is_float_type(type); }

size_t GgufValue::array_size() const {
  if (!is_array()) return 0;
  if (is_int_type(elem_type)) return ints.size();
  if (is_float_type(elem_type)) return floats.size();
  return strings.size();
}

int64_t GgufTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  return n;
}

Shape GgufTensorInfo::shape() const { return Shape(ne.rbegin(), ne.rend()); }

// ----------------------------------------------------------------- GgufFile

GgufFile::GgufFile(const std::string& path) : file_(std::make_shared<MappedFile>(path)) {
  ParsedGguf p = parse_gguf(file_->data(), file_->size(), path);
  version_ = p.version;
  alignment_ = p.alignment;
  data_start_ = p.data_start;
  kv_ = std::move(p.kv);
  tensors_ = std::move(p.tensors);
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

const GgufTensorInfo* GgufFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const GgufValue* GgufFile::get(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

int64_t GgufFile::get_int(const std::string& key, int64_t fallback) const {
  const GgufValue* v = get(key);
  if (!v) return fallback;
  if (!v->is_integer())
    throw FormatError(path(), "", key_label(key) + ": expected an integer, got " + value_type_name(uint32_t(v->type)));
  return v->i;
}

double GgufFile::get_float(const std::string& key, double fallback) const {
  const GgufValue* v = get(key);
  if (!v) return fallback;
  if (v->is_float()) return v->f;
  if (v->is_integer()) return double(v->i);
  throw FormatError(path(), "", key_label(key) + ": expected a number, got " + value_type_name(uint32_t(v->type)));
}

std::string GgufFile::get_string(const std::string& key, const std::string& fallback) const {
  const GgufValue* v = get(key);
  if (!v) return fallback;
  if (v->type != VType::String)
    throw FormatError(path(), "", key_label(key) + ": expected a string, got " + value_type_name(uint32_t(v->type)));
  return v->s;
}

const void* GgufFile::data(const GgufTensorInfo& t) const { return file_->data() + data_start_ + t.offset; }

std::vector<float> GgufFile::to_f32(const GgufTensorInfo& t) const {
  if (!ggml_type_supported(uint32_t(t.type)))
    throw FormatError(path(), escape(t.name), "ggml type " + ggml_type_name(uint32_t(t.type)) +
                                                  " cannot be read as float32 (supported: " + ggml_supported_types() + ")");
  std::vector<float> out(size_t(t.numel()));
  dequantize_row(t.type, data(t), out.data(), t.numel());
  return out;
}

// --------------------------------------------------------------- GgufWriter

namespace {

void put_u32(std::string& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b += char(uint8_t(v >> (8 * i)));
}
void put_u64(std::string& b, uint64_t v) {
  for (int i = 0; i < 8; ++i) b += char(uint8_t(v >> (8 * i)));
}
void put_str(std::string& b, const std::string& s) {
  put_u64(b, s.size());
  b += s;
}
void put_f32(std::string& b, float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  put_u32(b, u);
}

std::string temp_name(const std::string& path) {
  static std::atomic<unsigned> counter{0};
  return path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++) + ".data";
}

}  // namespace

struct GgufWriter::Impl {
  std::string path, data_tmp;
  size_t alignment = kDefaultAlignment;
  FILE* data = nullptr;
  uint64_t offset = 0;  // bytes in the data temporary: each tensor padded to the alignment
  bool finished = false;
  // Metadata in the order first set: key and encoded value (type + payload).
  std::vector<std::pair<std::string, std::string>> kv;
  std::map<std::string, size_t> kv_index;
  std::string tensor_entries;  // the encoded tensor-info records
  std::set<std::string> names;
  uint64_t n_tensors = 0;

  void check_open(const std::string& what) const {
    if (finished) throw IoError(path, what + " after finish()");
  }
  // A tensor's name, type, ne and byte count checked (throws FormatError).
  void check_tensor(const std::string& name, GgmlType type, const std::vector<int64_t>& ne, size_t nbytes) const;
  void write_data(const std::string& name, const void* bytes, size_t n);
  std::vector<int64_t> check_f32(const std::string& name, GgmlType type, const Shape& shape, int64_t slabs,
                                 size_t* bytes) const;
  // Its tensor-info record, after its bytes were written.
  void record(const std::string& name, GgmlType type, const std::vector<int64_t>& ne, size_t nbytes);

  void set(const std::string& key, std::string encoded) {
    check_open("metadata key '" + escape(key) + "' set");
    if (key.empty()) throw FormatError(path, "", "empty metadata key");
    auto it = kv_index.find(key);
    if (it != kv_index.end()) {
      kv[it->second].second = std::move(encoded);
      return;
    }
    kv_index[key] = kv.size();
    kv.emplace_back(key, std::move(encoded));
  }

  // general.alignment is the writer's: only a u32 of the same value is accepted.
  void check_not_alignment(const std::string& key) const {
    if (key == kAlignmentKey)
      throw FormatError(path, "", key_label(key) + ": set by the writer's alignment (" + std::to_string(alignment) +
                                      "); only set_u32 with that value is accepted");
  }

  void pad_data() {
    static const char zeros[256] = {};
    while (offset % alignment) {
      const size_t n = size_t(std::min<uint64_t>(sizeof zeros, alignment - offset % alignment));
      if (std::fwrite(zeros, 1, n, data) != n) throw IoError(path, std::string("cannot write: ") + std::strerror(errno));
      offset += n;
    }
  }
};

GgufWriter::GgufWriter(std::string path, size_t alignment) : impl_(std::make_unique<Impl>()) {
  impl_->path = std::move(path);
  if (!is_power_of_two(alignment) || alignment > UINT32_MAX)
    throw FormatError(impl_->path, "", "alignment " + std::to_string(alignment) + " is not a power of two within u32");
  impl_->alignment = alignment;
  impl_->data_tmp = temp_name(impl_->path);
  impl_->data = std::fopen(impl_->data_tmp.c_str(), "wb+");
  if (!impl_->data) throw IoError(impl_->path, std::string("cannot create temporary file: ") + std::strerror(errno));
  if (alignment != kDefaultAlignment) {
    std::string v;
    put_u32(v, uint32_t(VType::U32));
    put_u32(v, uint32_t(alignment));
    impl_->set(kAlignmentKey, v);
  }
}

GgufWriter::~GgufWriter() {
  if (impl_->data) std::fclose(impl_->data);
  if (!impl_->data_tmp.empty()) std::remove(impl_->data_tmp.c_str());
}

void GgufWriter::set_u32(const std::string& key, uint32_t v) {
  if (key == kAlignmentKey && v != impl_->alignment) impl_->check_not_alignment(key);
  std::string b;
  put_u32(b, uint32_t(VType::U32));
  put_u32(b, v);
  impl_->set(key, b);
}

void GgufWriter::set_i32(const std::string& key, int32_t v) {
  impl_->check_not_alignment(key);
  std::string b;
  put_u32(b, uint32_t(VType::I32));
  put_u32(b, uint32_t(v));
  impl_->set(key, b);
}

void GgufWriter::set_u64(const std::string& key, uint64_t v) {
  impl_->check_not_alignment(key);
  if (v > uint64_t(INT64_MAX))
    throw FormatError(impl_->path, "", key_label(key) + ": u64 value " + std::to_string(v) +
                                           " exceeds INT64_MAX (readers reject it)");
  std::string b;
  put_u32(b, uint32_t(VType::U64));
  put_u64(b, v);
  impl_->set(key, b);
}

void GgufWriter::set_f32(const std::string& key, float v) {
  impl_->check_not_alignment(key);
  std::string b;
  put_u32(b, uint32_t(VType::F32));
  put_f32(b, v);
  impl_->set(key, b);
}

void GgufWriter::set_bool(const std::string& key, bool v) {
  impl_->check_not_alignment(key);
  std::string b;
  put_u32(b, uint32_t(VType::Bool));
  b += char(v ? 1 : 0);
  impl_->set(key, b);
}

void GgufWriter::set_string(const std::string& key, const std::string& v) {
  impl_->check_not_alignment(key);
  std::string b;
  put_u32(b, uint32_t(VType::String));
  put_str(b, v);
  impl_->set(key, b);
}

// Array: u32 Array, u32 element type, u64 count, elements.
void GgufWriter::set_array_i32(const std::string& key, const std::vector<int32_t>& v) {
  impl_->check_not_alignment(key);
  std::string b;
  put_u32(b, uint32_t(VType::Array));
  put_u32(b, uint32_t(VType::I32));
  put_u64(b, v.size());
  for (int32_t x : v) put_u32(b, uint32_t(x));
  impl_->set(key, b);
}

void GgufWriter::set_array_f32(const std::string& key, const std::vector<float>& v) {
  impl_->check_not_alignment(key);
  std::string b;
  put_u32(b, uint32_t(VType::Array));
  put_u32(b, uint32_t(VType::F32));
  put_u64(b, v.size());
  for (float x : v) put_f32(b, x);
  impl_->set(key, b);
}

void GgufWriter::set_array_string(const std::string& key, const std::vector<std::string>& v) {
  impl_->check_not_alignment(key);
  std::string b;
  put_u32(b, uint32_t(VType::Array));
  put_u32(b, uint32_t(VType::String));
  put_u64(b, v.size());
  for (const auto& s : v) put_str(b, s);
  impl_->set(key, b);
}

void GgufWriter::Impl::check_tensor(const std::string& name, GgmlType type, const std::vector<int64_t>& ne,
                                    size_t nbytes) const {
  check_open("tensor '" + escape(name) + "' added");
  const std::string shown = escape(name);
  auto fail = [&](const std::string& what) { return FormatError(path, shown, what); };
  if (name.empty()) throw fail("empty tensor name");
  if (name.size() >= kMaxName)
    throw fail("name of " + std::to_string(name.size()) + " bytes: ggml reads at most " + std::to_string(kMaxName - 1));
  if (names.count(name)) throw fail("duplicate tensor name");
  if (ne.empty() || ne.size() > size_t(kMaxDims))
    throw fail("n_dims " + std::to_string(ne.size()) + " is outside 1.." + std::to_string(kMaxDims));
  const int64_t block = ggml_block_size(type);
  if (block == 0) throw fail("unknown ggml type " + std::to_string(uint32_t(type)));
  for (int64_t d : ne)
    if (d <= 0) throw fail("dimension " + std::to_string(d) + " is not positive");
  if (ne[0] % block != 0)
    throw fail("ne[0] = " + std::to_string(ne[0]) + " is not a multiple of the block size " + std::to_string(block) +
               " of " + ggml_type_name(uint32_t(type)));
  uint64_t expected = 0;
  bool overflow = __builtin_mul_overflow(uint64_t(ne[0] / block), uint64_t(ggml_type_size(type)), &expected);
  for (size_t d = 1; d < ne.size(); ++d) overflow = overflow || __builtin_mul_overflow(expected, uint64_t(ne[d]), &expected);
  if (overflow || expected != nbytes)
    throw fail("byte count " + std::to_string(nbytes) + " does not match ne of " + ggml_type_name(uint32_t(type)) +
               (overflow ? " (overflows)" : " (" + std::to_string(expected) + " bytes)"));
}

void GgufWriter::Impl::write_data(const std::string& name, const void* bytes, size_t n) {
  if (n && std::fwrite(bytes, 1, n, data) != n)
    throw IoError(path, "write failed for tensor '" + escape(name) + "': " + std::strerror(errno));
}

void GgufWriter::Impl::record(const std::string& name, GgmlType type, const std::vector<int64_t>& ne, size_t nbytes) {
  // Tensor info: name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset.
  put_str(tensor_entries, name);
  put_u32(tensor_entries, uint32_t(ne.size()));
  for (int64_t d : ne) put_u64(tensor_entries, uint64_t(d));
  put_u32(tensor_entries, uint32_t(type));
  put_u64(tensor_entries, offset);
  offset += nbytes;
  pad_data();
  names.insert(name);
  ++n_tensors;
}

void GgufWriter::add_tensor(const std::string& name, GgmlType type, const std::vector<int64_t>& ne,
                            const void* data, size_t nbytes) {
  impl_->check_tensor(name, type, ne, nbytes);
  impl_->write_data(name, data, nbytes);
  impl_->record(name, type, ne, nbytes);
}

namespace {

// `rows` rows of `cols` float32 values quantised to `type` into dst (rows
// independently, split over the cores: the same bytes for any split).
void quantise_rows(GgmlType type, const float* src, int64_t rows, int64_t cols, uint8_t* dst) {
  const size_t row_bytes = ggml_row_bytes(type, cols);
  const int64_t workers = std::min<int64_t>(resolve_threads(0), std::max<int64_t>(1, rows * cols / (1 << 16)));
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> failed(static_cast<size_t>(workers));
  for (int64_t k = 0; k < workers; ++k)
    pool.emplace_back([&, k] {
      const int64_t r0 = rows * k / workers, r1 = rows * (k + 1) / workers;
      try {
        if (r1 > r0) quantize_row(type, src + r0 * cols, dst + size_t(r0) * row_bytes, (r1 - r0) * cols);
      } catch (...) {
        failed[size_t(k)] = std::current_exception();
      }
    });
  for (std::thread& t : pool) t.join();
  for (const std::exception_ptr& e : failed)
    if (e) std::rethrow_exception(e);
}

}  // namespace

// The checks of a float32 tensor to quantise: its ne (reversed shape) and bytes.
std::vector<int64_t> GgufWriter::Impl::check_f32(const std::string& name, GgmlType type, const Shape& shape,
                                                 int64_t slabs, size_t* bytes) const {
  const std::string shown = escape(name);
  if (!ggml_type_supported(uint32_t(type)))
    throw FormatError(path, shown, "cannot quantise to ggml type " + ggml_type_name(uint32_t(type)) +
                                       " (supported: " + ggml_supported_types() + ")");
  if (shape.empty() || shape.size() > size_t(kMaxDims))
    throw FormatError(path, shown, "shape " + shape_str(shape) + " must have 1 to 4 dimensions");
  int64_t count = 1;
  for (int64_t d : shape)
    if (d <= 0 || __builtin_mul_overflow(count, d, &count))
      throw FormatError(path, shown, "shape " + shape_str(shape) + " is empty, negative or overflows");
  if (slabs <= 0 || shape[0] % slabs != 0)
    throw FormatError(path, shown, std::to_string(slabs) + " slabs do not split shape " + shape_str(shape));
  const std::vector<int64_t> ne(shape.rbegin(), shape.rend());
  if (ne[0] % ggml_block_size(type) != 0)
    throw FormatError(path, shown, "last dimension " + std::to_string(ne[0]) + " of shape " + shape_str(shape) +
                                       " is not a multiple of the block size " + std::to_string(ggml_block_size(type)) +
                                       " of " + ggml_type_name(uint32_t(type)));
  if (__builtin_mul_overflow(ggml_row_bytes(type, ne[0]), size_t(count / ne[0]), bytes))
    throw FormatError(path, shown, "shape " + shape_str(shape) + " overflows");
  check_tensor(name, type, ne, *bytes);
  return ne;
}

void GgufWriter::add_tensor_f32(const std::string& name, GgmlType type, const Shape& shape, const float* data) {
  size_t bytes = 0;
  const std::vector<int64_t> ne = impl_->check_f32(name, type, shape, 1, &bytes);
  std::vector<uint8_t> buf(bytes);
  quantise_rows(type, data, numel(shape) / ne[0], ne[0], buf.data());
  impl_->write_data(name, buf.data(), bytes);
  impl_->record(name, type, ne, bytes);
}

void GgufWriter::add_tensor_f32_slabs(const std::string& name, GgmlType type, const Shape& shape, int64_t slabs,
                                      const std::function<void(int64_t, float*)>& fill) {
  size_t bytes = 0;
  const std::vector<int64_t> ne = impl_->check_f32(name, type, shape, slabs, &bytes);
  const int64_t slab_values = numel(shape) / slabs, rows = slab_values / ne[0];
  std::vector<float> values(static_cast<size_t>(slab_values));
  std::vector<uint8_t> buf(bytes / size_t(slabs));
  for (int64_t s = 0; s < slabs; ++s) {
    fill(s, values.data());
    quantise_rows(type, values.data(), rows, ne[0], buf.data());
    impl_->write_data(name, buf.data(), buf.size());
  }
  impl_->record(name, type, ne, bytes);
}

void GgufWriter::set_value(const std::string& key, const GgufValue& v) {
  if (key == kAlignmentKey) {
    if (v.type != VType::U32) impl_->check_not_alignment(key);
    return set_u32(key, uint32_t(v.i));
  }
  auto scalar = [](std::string& b, VType t, const GgufValue& x, size_t i) {
    const bool is_float = t == VType::F32 || t == VType::F64;
    const int64_t iv = is_float || t == VType::String ? 0 : x.is_array() ? x.ints[i] : x.i;
    const double fv = !is_float ? 0 : x.is_array() ? x.floats[i] : x.f;
    switch (t) {
      case VType::U8: case VType::I8: case VType::Bool: b += char(uint8_t(iv)); break;
      case VType::U16: case VType::I16: b += char(uint8_t(iv)); b += char(uint8_t(uint64_t(iv) >> 8)); break;
      case VType::U32: case VType::I32: put_u32(b, uint32_t(iv)); break;
      case VType::U64: case VType::I64: put_u64(b, uint64_t(iv)); break;
      case VType::F32: put_f32(b, float(fv)); break;
      case VType::F64: {
        uint64_t u;
        std::memcpy(&u, &fv, 8);
        put_u64(b, u);
        break;
      }
      case VType::String: put_str(b, x.is_array() ? x.strings[i] : x.s); break;
      case VType::Array: break;
    }
  };
  std::string b;
  put_u32(b, uint32_t(v.type));
  if (v.is_array()) {
    if (v.elem_type == VType::Array)
      throw FormatError(impl_->path, "", key_label(key) + ": arrays of arrays are not supported");
    put_u32(b, uint32_t(v.elem_type));
    put_u64(b, v.array_size());
    for (size_t i = 0; i < v.array_size(); ++i) scalar(b, v.elem_type, v, i);
  } else {
    scalar(b, v.type, v, 0);
  }
  impl_->set(key, b);
}

// File: header, metadata, tensor entries, zero padding to the alignment, then
// the data temporary (already padded after each tensor), as ggml writes it.
void GgufWriter::finish() {
  Impl& w = *impl_;
  if (w.finished) return;
  std::string head = "GGUF";
  put_u32(head, 3);
  put_u64(head, w.n_tensors);
  put_u64(head, w.kv.size());
  for (const auto& [key, value] : w.kv) {
    put_str(head, key);
    head += value;
  }
  head += w.tensor_entries;
  head.append((w.alignment - head.size() % w.alignment) % w.alignment, '\0');
  AtomicFile out(w.path);  // fsynced and renamed into place on commit
  out.write(head.data(), head.size());
  if (std::fflush(w.data) != 0 || std::fseek(w.data, 0, SEEK_SET) != 0)
    throw IoError(w.path, std::string("cannot read the temporary data back: ") + std::strerror(errno));
  std::vector<char> buf(1 << 20);
  uint64_t left = w.offset;
  while (left > 0) {
    const size_t n = std::fread(buf.data(), 1, size_t(std::min<uint64_t>(buf.size(), left)), w.data);
    if (n == 0) throw IoError(w.path, std::string("cannot read the temporary data back: ") + std::strerror(errno));
    out.write(buf.data(), n);
    left -= n;
  }
  out.commit();
  std::fclose(w.data);
  w.data = nullptr;
  std::remove(w.data_tmp.c_str());
  w.data_tmp.clear();
  w.finished = true;
}

}  // namespace llmdiff
