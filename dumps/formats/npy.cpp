#include "dumps/formats/npy.h"

#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <limits>

#include "dumps/base/dtype.h"
#include "dumps/base/errors.h"

namespace llmdiff {

namespace {

uint16_t le16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
uint32_t le32(const uint8_t* p) { return uint32_t(le16(p)) | (uint32_t(le16(p + 2)) << 16); }
uint64_t le64(const uint8_t* p) { return uint64_t(le32(p)) | (uint64_t(le32(p + 4)) << 32); }

// The value of `key` in numpy's header dict literal, as written.
std::string header_value(const std::string& header, const std::string& key, const std::string& file,
                         const std::string& name) {
  const size_t k = header.find("'" + key + "'");
  if (k == std::string::npos) throw FormatError(file, name, "npy header has no '" + key + "': " + header);
  size_t p = header.find(':', k);
  if (p == std::string::npos) throw FormatError(file, name, "npy header malformed: " + header);
  ++p;
  while (p < header.size() && header[p] == ' ') ++p;
  if (p >= header.size()) throw FormatError(file, name, "npy header malformed: " + header);
  const char open = header[p];
  char close = 0;
  if (open == '\'' || open == '"') close = open;
  if (open == '(') close = ')';
  if (open == '[') close = ']';
  if (close) {
    const size_t e = header.find(close, p + 1);
    if (e == std::string::npos) throw FormatError(file, name, "npy header malformed: " + header);
    return header.substr(p, e - p + 1);
  }
  size_t e = p;
  while (e < header.size() && header[e] != ',' && header[e] != '}') ++e;
  return header.substr(p, e - p);
}

struct NpyType {
  DType dtype = DType::F32;
  bool is_float = true;
  bool is_unsigned = false;
  bool raw16 = false;  // '|V2': 16 bits of an unnamed type (bfloat16 saved by ml_dtypes)
  size_t size = 4;
  bool swap = false;
};

NpyType npy_type(const std::string& descr, const std::string& file, const std::string& name) {
  // descr: 'E' + kind + size, e.g. '<f4', '|b1', '>i8'.
  if (descr.size() < 5 || (descr.front() != '\'' && descr.front() != '"'))
    throw FormatError(file, name, "npy dtype " + descr + " is not a plain numeric type (structured arrays are "
                                  "not tensors)");
  const std::string d = descr.substr(1, descr.size() - 2);
  const char order = d[0], kind = d[1];
  const std::string bytes = d.substr(2);
  NpyType t;
  t.swap = order == '>';
  if (order != '<' && order != '>' && order != '|' && order != '=')
    throw FormatError(file, name, "npy dtype " + descr + ": unknown byte order");
  auto is = [&](char k, const char* b) { return kind == k && bytes == b; };
  if (is('f', "8")) t = {DType::F64, true, false, false, 8, t.swap};
  else if (is('f', "4")) t = {DType::F32, true, false, false, 4, t.swap};
  else if (is('f', "2")) t = {DType::F16, true, false, false, 2, t.swap};
  else if (is('i', "8")) t = {DType::I64, false, false, false, 8, t.swap};
  else if (is('i', "4")) t = {DType::I32, false, false, false, 4, t.swap};
  else if (is('i', "2")) t = {DType::I16, false, false, false, 2, t.swap};
  else if (is('i', "1")) t = {DType::I8, false, false, false, 1, false};
  else if (is('u', "1")) t = {DType::U8, false, true, false, 1, false};
  else if (is('b', "1")) t = {DType::BOOL, false, true, false, 1, false};
  else if (is('u', "2")) t = {DType::I16, false, true, false, 2, t.swap};
  else if (is('u', "4")) t = {DType::I32, false, true, false, 4, t.swap};
  else if (is('u', "8")) t = {DType::I64, false, true, false, 8, t.swap};
  else if (is('V', "2")) t = {DType::I16, false, true, true, 2, t.swap};
  else
    throw FormatError(file, name, "npy dtype " + descr + " is not supported (float64/32/16, signed and unsigned "
                                  "integers, bool, 2-byte void for bfloat16 bits)");
  return t;
}

Shape npy_shape(const std::string& tuple, const std::string& file, const std::string& name) {
  if (tuple.size() < 2 || tuple.front() != '(' || tuple.back() != ')')
    throw FormatError(file, name, "npy shape " + tuple + " is not a tuple");
  Shape s;
  size_t p = 1;
  while (p < tuple.size() - 1) {
    while (p < tuple.size() - 1 && (tuple[p] == ' ' || tuple[p] == ',')) ++p;
    if (p >= tuple.size() - 1) break;
    size_t e = p;
    while (e < tuple.size() - 1 && std::isdigit(static_cast<unsigned char>(tuple[e]))) ++e;
    if (e == p || e - p > 15) throw FormatError(file, name, "npy shape " + tuple + " is malformed");
    s.push_back(std::stoll(tuple.substr(p, e - p)));
    p = e;
  }
  return s;
}

// Row-major copy of a Fortran-ordered array: element (i0..in) sits at
// i0 + n0 * (i1 + n1 * ...) in `src`.
template <typename T>
std::vector<T> from_fortran(const std::vector<T>& src, const Shape& shape) {
  std::vector<T> out(src.size());
  const size_t rank = shape.size();
  std::vector<int64_t> idx(rank, 0);
  for (size_t flat = 0; flat < out.size(); ++flat) {
    int64_t f = 0;
    for (size_t a = rank; a-- > 0;) f = f * shape[a] + idx[a];
    out[flat] = src[size_t(f)];
    for (size_t a = rank; a-- > 0;) {
      if (++idx[a] < shape[a]) break;
      idx[a] = 0;
    }
  }
  return out;
}

}  // namespace

namespace {

struct NpyHeader {
  NpyType type;
  bool fortran = false;
  Shape shape;
  size_t body = 0;
};

NpyHeader npy_header(const uint8_t* data, size_t size, const std::string& file, const std::string& name) {
  static const uint8_t magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  if (size < 10 || std::memcmp(data, magic, 6) != 0) throw FormatError(file, name, "not a .npy image (no magic)");
  const int major = data[6];
  size_t header_len = 0, start = 0;
  if (major == 1) {
    header_len = le16(data + 8);
    start = 10;
  } else if (major == 2 || major == 3) {
    if (size < 12) throw FormatError(file, name, "truncated .npy header");
    header_len = le32(data + 8);
    start = 12;
  } else {
    throw FormatError(file, name, ".npy format version " + std::to_string(major) + " is not supported (1-3)");
  }
  if (header_len > size - start) throw FormatError(file, name, "truncated .npy header");
  const std::string header(reinterpret_cast<const char*>(data + start), header_len);
  NpyHeader h;
  h.type = npy_type(header_value(header, "descr", file, name), file, name);
  const std::string fortran = header_value(header, "fortran_order", file, name);
  if (fortran != "True" && fortran != "False")
    throw FormatError(file, name, "npy fortran_order " + fortran + " is not True or False");
  h.fortran = fortran == "True";
  h.shape = npy_shape(header_value(header, "shape", file, name), file, name);
  h.body = start + header_len;
  return h;
}

}  // namespace

Shape npy_shape_of(const uint8_t* data, size_t size, const std::string& file, const std::string& name) {
  return npy_header(data, size, file, name).shape;
}

TensorData parse_npy(const uint8_t* data, size_t size, const std::string& file, const std::string& name) {
  const NpyHeader h = npy_header(data, size, file, name);
  const NpyType& t = h.type;
  const size_t body = h.body;
  TensorData td;
  td.name = name;
  td.shape = h.shape;
  td.stored = t.dtype;
  int64_t n = 1;
  for (int64_t d : td.shape) {
    if (d > 0 && n > std::numeric_limits<int64_t>::max() / d)
      throw FormatError(file, name, "npy shape " + shape_str(td.shape) + " overflows");
    n *= d;
  }
  if (uint64_t(n) > (size - body) / t.size)
    throw FormatError(file, name, "truncated: shape " + shape_str(td.shape) + " needs " +
                                      std::to_string(uint64_t(n) * t.size) + " bytes, the file has " +
                                      std::to_string(size - body));
  std::vector<uint8_t> bytes(data + body, data + body + size_t(n) * t.size);
  if (t.swap)
    for (size_t i = 0; i < bytes.size(); i += t.size) std::reverse(bytes.begin() + long(i), bytes.begin() + long(i + t.size));
  if (t.is_float) {
    td.f.resize(size_t(n));
    convert_to_f32(bytes.data(), t.dtype, size_t(n), td.f.data());
    if (h.fortran) td.f = from_fortran(td.f, td.shape);
  } else {
    td.is_int = true;
    td.i.resize(size_t(n));
    for (size_t k = 0; k < size_t(n); ++k) {
      const uint8_t* p = bytes.data() + k * t.size;
      int64_t v = 0;
      switch (t.size) {
        case 1: v = t.is_unsigned ? int64_t(p[0]) : int64_t(int8_t(p[0])); break;
        case 2: v = t.is_unsigned ? int64_t(le16(p)) : int64_t(int16_t(le16(p))); break;
        case 4: v = t.is_unsigned ? int64_t(le32(p)) : int64_t(int32_t(le32(p))); break;
        default: {
          const uint64_t u = le64(p);
          if (t.is_unsigned && u > uint64_t(std::numeric_limits<int64_t>::max()))
            throw FormatError(file, name, "uint64 value " + std::to_string(u) + " does not fit int64");
          v = int64_t(u);
        }
      }
      td.i[k] = v;
    }
    if (h.fortran) td.i = from_fortran(td.i, td.shape);
  }
  return td;
}

std::vector<ZipMember> zip_members(const uint8_t* data, size_t size, const std::string& file) {
  // End of central directory: the last "PK\5\6" within the final 64 KiB + 22.
  if (size < 22) throw FormatError(file, "", "not a zip archive (.npz): too short");
  size_t eocd = std::string::npos;
  const size_t lowest = size > 22 + 65535 ? size - 22 - 65535 : 0;
  for (size_t p = size - 22 + 1; p-- > lowest;)
    if (le32(data + p) == 0x06054b50) {
      eocd = p;
      break;
    }
  if (eocd == std::string::npos) throw FormatError(file, "", "not a zip archive (.npz): no end of central directory");
  uint64_t count = le16(data + eocd + 10), cd_size = le32(data + eocd + 12), cd_offset = le32(data + eocd + 16);
  if (count == 0xFFFF || cd_offset == 0xFFFFFFFFu || cd_size == 0xFFFFFFFFu) {
    // zip64: the locator just before the EOCD points at the zip64 EOCD record.
    if (eocd < 20 || le32(data + eocd - 20) != 0x07064b50)
      throw FormatError(file, "", "zip64 archive without its end-of-directory locator");
    const uint64_t rec = le64(data + eocd - 20 + 8);
    if (size < 56 || rec > size - 56 || le32(data + rec) != 0x06064b50) throw FormatError(file, "", "zip64 record malformed");
    count = le64(data + rec + 32);
    cd_size = le64(data + rec + 40);
    cd_offset = le64(data + rec + 48);
  }
  if (cd_offset > size || cd_size > size - cd_offset) throw FormatError(file, "", "zip central directory out of bounds");
  std::vector<ZipMember> out;
  size_t p = size_t(cd_offset);
  const size_t end = size_t(cd_offset + cd_size);
  for (uint64_t k = 0; k < count; ++k) {
    if (p + 46 > end || le32(data + p) != 0x02014b50) throw FormatError(file, "", "zip central directory malformed");
    ZipMember m;
    m.method = le16(data + p + 10);
    m.crc = le32(data + p + 16);
    m.compressed = le32(data + p + 20);
    m.size = le32(data + p + 24);
    const size_t name_len = le16(data + p + 28), extra_len = le16(data + p + 30), comment_len = le16(data + p + 32);
    m.local_offset = le32(data + p + 42);
    if (p + 46 + name_len + extra_len + comment_len > end) throw FormatError(file, "", "zip central directory malformed");
    m.name.assign(reinterpret_cast<const char*>(data + p + 46), name_len);
    // zip64 extra field: the 64-bit values of the fields saturated above, in order.
    const size_t extra_end = p + 46 + name_len + extra_len;
    for (size_t e = p + 46 + name_len; e + 4 <= extra_end;) {
      const uint16_t id = le16(data + e), len = le16(data + e + 2);
      size_t q = e + 4;
      const size_t field_end = std::min(e + 4 + len, extra_end);  // a field may not claim past the extra area
      if (id == 0x0001) {
        if (m.size == 0xFFFFFFFFu && q + 8 <= field_end) m.size = le64(data + q), q += 8;
        if (m.compressed == 0xFFFFFFFFu && q + 8 <= field_end) m.compressed = le64(data + q), q += 8;
        if (m.local_offset == 0xFFFFFFFFu && q + 8 <= field_end) m.local_offset = le64(data + q), q += 8;
      }
      e += 4 + len;
    }
    out.push_back(std::move(m));
    p += 46 + name_len + extra_len + comment_len;
  }
  return out;
}

std::vector<uint8_t> zip_extract(const uint8_t* data, size_t size, const ZipMember& m, const std::string& file) {
  const size_t lo = size_t(m.local_offset);
  if (m.local_offset > size || size - lo < 30 || le32(data + lo) != 0x04034b50)
    throw FormatError(file, m.name, "zip local header missing");
  const size_t start = lo + 30 + le16(data + lo + 26) + le16(data + lo + 28);
  if (start > size || m.compressed > size - start) throw FormatError(file, m.name, "truncated zip member");
  const uint8_t* src = data + start;
  if (m.size > 0xFFFFFFFFu || m.compressed > 0xFFFFFFFFu)
    throw FormatError(file, m.name, "zip member over 4 GiB: save the arrays as .npy files in a directory instead");
  std::vector<uint8_t> out;
  if (m.method == 0) {
    if (m.compressed != m.size) throw FormatError(file, m.name, "stored zip member with two sizes");
    out.assign(src, src + m.size);
  } else if (m.method == 8) {
    // Deflate expands at most 1032:1; a larger claimed size is a corrupt header, not a reason to allocate it.
    if (m.size > m.compressed * 1032 + 1024)
      throw FormatError(file, m.name, "zip member claims " + std::to_string(m.size) + " bytes from " +
                                          std::to_string(m.compressed) + " deflated: corrupt");
    out.resize(size_t(m.size));
    z_stream z{};
    if (inflateInit2(&z, -MAX_WBITS) != Z_OK) throw FormatError(file, m.name, "zlib could not start");
    z.next_in = const_cast<uint8_t*>(src);
    z.avail_in = uInt(m.compressed);
    z.next_out = out.data();
    z.avail_out = uInt(out.size());
    const int rc = inflate(&z, Z_FINISH);
    const uLong produced = z.total_out;
    inflateEnd(&z);
    if (rc != Z_STREAM_END || produced != m.size)
      throw FormatError(file, m.name, "deflated data is corrupt (zlib " + std::to_string(rc) + ")");
  } else {
    throw FormatError(file, m.name, "zip compression method " + std::to_string(m.method) +
                                        " is not supported (stored or deflated, as numpy writes)");
  }
  if (uint32_t(crc32(0L, out.data(), uInt(out.size()))) != m.crc)
    throw FormatError(file, m.name, "CRC-32 mismatch: the archive is corrupt");
  return out;
}

}  // namespace llmdiff
