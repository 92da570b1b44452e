#include "dumps/formats/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "dumps/base/files.h"
#include "dumps/base/errors.h"

namespace llmdiff {

void release_pages(const void* data, size_t bytes) {
  if (!data || bytes == 0) return;
  static const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes + page - 1) & ~(page - 1);
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);  // advice: failure is harmless
}

using ojson = nlohmann::ordered_json;

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// ---------------------------------------------------------------- MappedFile

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    throw IoError(path, std::string("cannot stat: ") + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError(path, "not a regular file");
  }
  size_ = size_t(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      throw IoError(path, std::string("cannot mmap: ") + std::strerror(e));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

// ------------------------------------------------------------------- parsing

namespace {

constexpr uint64_t kMaxHeader = 100ull * 1000 * 1000;

TensorInfo parse_entry(const std::string& file, const std::string& name, const ojson& v,
                       uint64_t data_size) {
  auto fail = [&](const std::string& what) { return FormatError(file, name, what); };
  if (!v.is_object()) throw fail("header entry is not an object");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!v.contains(key)) throw fail(std::string("header entry lacks '") + key + "'");
  TensorInfo t;
  t.name = name;
  if (!v["dtype"].is_string()) throw fail("dtype is not a string");
  auto dt = parse_dtype(v["dtype"].get<std::string>());
  if (!dt) throw fail("unknown dtype '" + v["dtype"].get<std::string>() +
                      "' (supported: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL)");
  t.dtype = *dt;
  const ojson& shape = v["shape"];
  if (!shape.is_array()) throw fail("shape is not an array");
  uint64_t count = 1;
  for (const auto& d : shape) {
    if (!d.is_number_integer()) throw fail("shape " + shape.dump() + " has a non-integer dimension");
    if (d.is_number_unsigned() ? d.get<uint64_t>() > uint64_t(INT64_MAX) : d.get<int64_t>() < 0)
      throw fail("shape " + shape.dump() + " has a negative or oversized dimension");
    uint64_t dim = d.get<uint64_t>();
    if (dim != 0 && count > UINT64_MAX / dim) throw fail("shape " + shape.dump() + " overflows");
    count *= dim;
    t.shape.push_back(int64_t(dim));
  }
  uint64_t nbytes;
  if (__builtin_mul_overflow(count, uint64_t(dtype_size(t.dtype)), &nbytes) || count > uint64_t(INT64_MAX))
    throw fail("shape " + shape.dump() + " overflows");
  const ojson& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
    throw fail("data_offsets must be two non-negative integers");
  t.begin = off[0].get<uint64_t>();
  t.end = off[1].get<uint64_t>();
  if (t.begin > t.end) throw fail("data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "] are reversed");
  if (t.end > data_size)
    throw fail("data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
               "] out of bounds: data region has " + std::to_string(data_size) + " bytes");
  if (t.end - t.begin != nbytes)
    throw fail("byte length " + std::to_string(t.end - t.begin) + " != " + std::to_string(nbytes) +
               " = product of shape " + shape_str(t.shape) + " x " + std::to_string(dtype_size(t.dtype)) +
               " (" + dtype_name(t.dtype) + ")");
  return t;
}

}  // namespace

ParsedHeader parse_safetensors(const uint8_t* bytes, size_t size, const std::string& file) {
  if (size == 0) throw FormatError(file, "", "empty file (no safetensors header)");
  if (size < 8) throw FormatError(file, "", "truncated: " + std::to_string(size) + " bytes, the header length needs 8");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > kMaxHeader)
    throw FormatError(file, "", "header length " + std::to_string(n) + " exceeds the 100 MB limit");
  if (n > size - 8)
    throw FormatError(file, "", "header length " + std::to_string(n) + " runs past the end of the file (" +
                                    std::to_string(size) + " bytes)");
  ParsedHeader out;
  out.data_start = size_t(8 + n);
  const uint64_t data_size = size - out.data_start;
  const char* text = reinterpret_cast<const char*>(bytes + 8);

  // Duplicate keys at the top level would be silently merged by the parser:
  // catch them while parsing.
  std::set<std::string> seen;
  std::string duplicate;
  ojson::parser_callback_t cb = [&](int depth, ojson::parse_event_t ev, ojson& parsed) {
    if (ev == ojson::parse_event_t::key && depth == 1) {
      const std::string key = parsed.get<std::string>();
      if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  ojson header;
  try {
    header = ojson::parse(text, text + n, cb);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(file, "", std::string("header is not valid JSON: ") + e.what());
  }
  if (!duplicate.empty()) throw FormatError(file, duplicate, "duplicate tensor name in header");
  if (!header.is_object()) throw FormatError(file, "", "header is not a JSON object");

  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) throw FormatError(file, "__metadata__", "__metadata__ is not a map");
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string())
          throw FormatError(file, "__metadata__", "metadata value of '" + m.key() + "' is not a string");
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    out.tensors.push_back(parse_entry(file, it.key(), it.value(), data_size));
  }
  // No two tensors may share bytes.
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : out.tensors)
    if (t.end > t.begin) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->begin < by_offset[i - 1]->end)
      throw FormatError(file, by_offset[i]->name, "data overlaps tensor '" + by_offset[i - 1]->name + "'");
  return out;
}

// ------------------------------------------------------------ SafetensorsFile

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(std::make_shared<MappedFile>(path)) {
  ParsedHeader h = parse_safetensors(file_->data(), file_->size(), path);
  data_start_ = h.data_start;
  tensors_ = std::move(h.tensors);
  metadata_ = std::move(h.metadata);
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafetensorsFile::at(const std::string& name) const {
  const TensorInfo* t = find(name);
  if (!t) throw MissingTensorError(path(), name);
  return *t;
}

std::vector<float> SafetensorsFile::to_f32(const TensorInfo& t) const {
  std::vector<float> out(size_t(t.numel()));
  convert_to_f32(data(t), t.dtype, out.size(), out.data());
  return out;
}

std::vector<int64_t> SafetensorsFile::to_i64(const TensorInfo& t) const {
  std::vector<int64_t> out(size_t(t.numel()));
  const void* p = data(t);
  if (out.empty()) return out;
  if (t.dtype == DType::I64) {
    std::memcpy(out.data(), p, out.size() * 8);
  } else {
    // Float values are truncated toward zero and saturated (NaN gives 0), so
    // that no value makes the conversion undefined.
    for (size_t i = 0; i < out.size(); ++i) {
      const double v = load_as_double(p, t.dtype, i);
      if (std::isnan(v)) out[i] = 0;
      else if (v >= 9223372036854775807.0) out[i] = INT64_MAX;
      else if (v <= -9223372036854775808.0) out[i] = INT64_MIN;
      else out[i] = int64_t(v);
    }
  }
  return out;
}

// ---------------------------------------------------------- SafetensorsWriter

namespace {
std::string temp_name(const std::string& path, const char* tag) {
  static std::atomic<unsigned> counter{0};
  return path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++) + tag;
}
}  // namespace

SafetensorsWriter::SafetensorsWriter(std::string path) : path_(std::move(path)) {
  data_tmp_ = temp_name(path_, ".data");
  data_ = std::fopen(data_tmp_.c_str(), "wb+");
  if (!data_) throw IoError(path_, std::string("cannot create temporary file: ") + std::strerror(errno));
}

SafetensorsWriter::~SafetensorsWriter() {
  if (data_) std::fclose(data_);
  if (!data_tmp_.empty()) std::remove(data_tmp_.c_str());
}

namespace {
// JSON strings must be valid UTF-8: the header could not be written otherwise.
bool valid_utf8(const std::string& s) {
  try {
    (void)ojson(s).dump();
    return true;
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}
}  // namespace

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) {
  if (!valid_utf8(key) || !valid_utf8(value))
    throw FormatError(path_, "__metadata__", "metadata key or value is not valid UTF-8");
  metadata_[key] = value;
}

bool SafetensorsWriter::has(const std::string& name) const { return index_.count(name) != 0; }

void SafetensorsWriter::add(const std::string& name, DType dtype, const Shape& shape, const void* data,
                            size_t nbytes) {
  if (finished_) throw IoError(path_, "tensor '" + name + "' added after finish()");
  if (name.empty() || name == "__metadata__" || !valid_utf8(name))
    throw FormatError(path_, name, "invalid tensor name");
  if (has(name)) throw FormatError(path_, name, "duplicate tensor name");
  uint64_t count = 1, expected = 0;
  for (int64_t d : shape) {
    if (d < 0) throw FormatError(path_, name, "negative dimension in shape " + shape_str(shape));
    if (__builtin_mul_overflow(count, uint64_t(d), &count))
      throw FormatError(path_, name, "shape " + shape_str(shape) + " overflows");
  }
  if (__builtin_mul_overflow(count, uint64_t(dtype_size(dtype)), &expected) || expected != nbytes)
    throw FormatError(path_, name, "byte count " + std::to_string(nbytes) + " does not match shape " +
                                       shape_str(shape) + " of " + dtype_name(dtype));
  if (nbytes && std::fwrite(data, 1, nbytes, data_) != nbytes)
    throw IoError(path_, "write failed for tensor '" + name + "': " + std::strerror(errno));
  TensorInfo t{name, dtype, shape, offset_, offset_ + nbytes};
  offset_ += nbytes;
  index_[name] = tensors_.size();
  tensors_.push_back(std::move(t));
}

void SafetensorsWriter::add_f32(const std::string& name, const Shape& shape, const float* data) {
  add(name, DType::F32, shape, data, size_t(numel(shape)) * 4);
}

void SafetensorsWriter::add_i64(const std::string& name, const Shape& shape, const int64_t* data) {
  add(name, DType::I64, shape, data, size_t(numel(shape)) * 8);
}

void SafetensorsWriter::finish() {
  if (finished_) return;
  ojson header = ojson::object();
  if (!metadata_.empty()) {
    ojson meta = ojson::object();
    for (const auto& [k, v] : metadata_) meta[k] = v;
    header["__metadata__"] = meta;
  }
  for (const auto& t : tensors_) {
    ojson e = ojson::object();
    e["dtype"] = dtype_name(t.dtype);
    e["shape"] = t.shape;
    e["data_offsets"] = {t.begin, t.end};
    header[t.name] = e;
  }
  std::string text = header.dump();
  while (text.size() % 8) text += ' ';
  AtomicFile out(path_);  // fsynced and renamed into place on commit
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(text.size()) >> (8 * i));
  out.write(len, 8);
  out.write(text.data(), text.size());
  if (std::fflush(data_) != 0 || std::fseek(data_, 0, SEEK_SET) != 0)
    throw IoError(path_, std::string("cannot read the temporary data back: ") + std::strerror(errno));
  std::vector<char> buf(1 << 20);
  uint64_t left = offset_;
  while (left > 0) {
    const size_t n = std::fread(buf.data(), 1, size_t(std::min<uint64_t>(buf.size(), left)), data_);
    if (n == 0) throw IoError(path_, std::string("cannot read the temporary data back: ") + std::strerror(errno));
    out.write(buf.data(), n);
    left -= n;
  }
  out.commit();
  std::fclose(data_);
  data_ = nullptr;
  std::remove(data_tmp_.c_str());
  data_tmp_.clear();
  finished_ = true;
}

}  // namespace llmdiff
