// GGUF reader and writer: a writer round trip (metadata, tensors of several
// types, custom alignment) read back by GgufFile; files written byte by byte
// here (v2 and v3, every value type); malformed files, each a typed error
// naming the file and the tensor, with non-printable bytes escaped; every
// truncation of valid files rejected without a crash.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "dumps/base/errors.h"
#include "dumps/formats/ggml_types.h"
#include "dumps/formats/gguf.h"
#include "tests/support.h"
#include "tests/test_dumps_helpers.h"

namespace llmdiff {
namespace {

using namespace llmdiff::testing;
using VT = GgufValue::Type;

// ------------------------------------------------------ byte-level builder

// Little-endian writer of GGUF pieces.
struct Buf {
  Bytes b;
  Buf& u8(uint8_t v) {
    b.push_back(v);
    return *this;
  }
  Buf& uint(uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) b.push_back(uint8_t(v >> (8 * i)));
    return *this;
  }
  Buf& u16(uint16_t v) { return uint(v, 2); }
  Buf& u32(uint32_t v) { return uint(v, 4); }
  Buf& u64(uint64_t v) { return uint(v, 8); }
  Buf& f32(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u32(u);
  }
  Buf& f64(double f) {
    uint64_t u;
    std::memcpy(&u, &f, 8);
    return u64(u);
  }
  Buf& raw(const std::string& s) {
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  Buf& raw(const Bytes& s) {
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  Buf& str(const std::string& s) { return u64(s.size()).raw(s); }
};

// A metadata value as stored: u32 type, then the payload.
Bytes value(VT t, const Bytes& payload) { return Buf().u32(uint32_t(t)).raw(payload).b; }
Bytes v_u32(uint32_t v) { return value(VT::U32, Buf().u32(v).b); }
Bytes v_i32(int32_t v) { return value(VT::I32, Buf().u32(uint32_t(v)).b); }
Bytes v_str(const std::string& s) { return value(VT::String, Buf().str(s).b); }
// An array: element type, count, then the elements' payloads.
Bytes v_array(VT elem, uint64_t count, const Bytes& elems) {
  return value(VT::Array, Buf().u32(uint32_t(elem)).u64(count).raw(elems).b);
}

struct RawTensor {
  std::string name;
  std::vector<uint64_t> ne;  // n_dims is its size
  uint32_t type;
  uint64_t offset;
};

// A whole file; the counts default to the lists' sizes.
struct RawGguf {
  std::string magic = "GGUF";
  uint32_t version = 3;
  std::optional<uint64_t> n_tensors, n_kv;
  std::vector<std::pair<std::string, Bytes>> kv;  // key, encoded value
  std::vector<RawTensor> tensors;
  size_t align = 32;  // padding after the tensor infos
  Bytes data;

  Bytes bytes() const {
    Buf w;
    w.raw(magic).u32(version).u64(n_tensors.value_or(tensors.size())).u64(n_kv.value_or(kv.size()));
    for (const auto& [k, v] : kv) w.str(k).raw(v);
    for (const auto& t : tensors) {
      w.str(t.name).u32(uint32_t(t.ne.size()));
      for (uint64_t d : t.ne) w.u64(d);
      w.u32(t.type).u64(t.offset);
    }
    while (w.b.size() % align) w.u8(0);
    return w.raw(data).b;
  }
};

// A small valid v3 file: two metadata entries, an F32 tensor "a" of 8 values
// and a Q8_0 tensor "b" of 32 that ends exactly at the end of the file.
RawGguf small_file() {
  RawGguf g;
  g.kv.push_back({"general.architecture", v_str("llama")});
  g.kv.push_back({"tokenizer.ggml.tokens", v_array(VT::String, 2, Buf().str("a").str("bc").b)});
  g.tensors.push_back({"a", {8}, 0, 0});
  g.tensors.push_back({"b", {32}, 8, 32});
  Buf d;
  for (int i = 0; i < 8; ++i) d.f32(float(i) - 3.5f);
  d.u16(0x3800);  // Q8_0: d = 0.5, then 32 int8 levels
  for (int i = 0; i < 32; ++i) d.u8(uint8_t(i * 9 - 128));
  g.data = d.b;
  return g;
}

// parse_gguf on an exactly sized heap copy, so ASan sees any overread.
ParsedGguf parse(const Bytes& b, const std::string& label) {
  std::unique_ptr<uint8_t[]> buf(new uint8_t[b.size() + (b.empty() ? 1 : 0)]);
  std::copy(b.begin(), b.end(), buf.get());
  return parse_gguf(buf.get(), b.size(), label);
}

bool printable(const std::string& s) {
  for (unsigned char c : s)
    if (c < 0x20 || c >= 0x7f) return false;
  return true;
}

uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
uint64_t dbits(double f) {
  uint64_t u;
  std::memcpy(&u, &f, 8);
  return u;
}

// ------------------------------------------------------------ round trip

struct WrittenTensor {
  std::string name;
  GgmlType type;
  std::vector<int64_t> ne;
  Bytes bytes;
};

// Random bytes for a tensor of `type` and `ne`: F32 / F16 / BF16 from random
// floats, block types from quantize_row of random floats.
WrittenTensor make_tensor(const std::string& name, GgmlType type, std::vector<int64_t> ne, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g;
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = g(rng);
  WrittenTensor t{name, type, ne, Bytes(ggml_row_bytes(type, ne[0]) * size_t(n / ne[0]))};
  if (ggml_type_supported(uint32_t(type))) {
    quantize_row(type, x.data(), t.bytes.data(), n);
  } else {
    for (auto& c : t.bytes) c = uint8_t(rng());
  }
  return t;
}

TEST(GgufRoundTrip, WriterOutputReadsBackIdentically) {
  const std::string path = temp_path("roundtrip.gguf");
  const size_t align = 64;
  const char odd[] = "nul\0inside \x01\xff utf8 \xc3\xa9";
  const std::string odd_string(odd, sizeof odd - 1);
  const std::vector<WrittenTensor> tensors = {
      make_tensor("token_embd.weight", GgmlType::Q4_K, {256, 3}, 1),
      make_tensor("norm", GgmlType::F32, {5}, 2),  // 20 bytes: padding follows
      make_tensor("f16.4d", GgmlType::F16, {7, 1, 3, 2}, 3),
      make_tensor("bf16", GgmlType::BF16, {9, 2}, 4),
      make_tensor("q8", GgmlType::Q8_0, {64, 2}, 5),
      make_tensor("q4_0", GgmlType::Q4_0, {32}, 6),
      make_tensor("q5_1", GgmlType::Q5_1, {32, 3}, 7),
      make_tensor("q6k", GgmlType::Q6_K, {256}, 8),
      make_tensor("q2k", GgmlType::Q2_K, {512}, 9),
      make_tensor("q8_1.stored", GgmlType::Q8_1, {32, 2}, 10),  // stored, not readable as f32
  };
  std::vector<float> f32s = {0.0f, -0.0f, 1.5f, std::numeric_limits<float>::denorm_min(),
                             std::numeric_limits<float>::max(), -INFINITY};
  {
    GgufWriter w(path, align);
    w.set_string("general.architecture", "llama");
    w.set_u32("u32.max", 0xffffffffu);
    w.set_i32("i32.min", std::numeric_limits<int32_t>::min());
    w.set_u64("u64.max", uint64_t(std::numeric_limits<int64_t>::max()));
    w.set_f32("f32.tiny", std::numeric_limits<float>::denorm_min());
    w.set_f32("f32.negzero", -0.0f);
    w.set_bool("bool.true", true);
    w.set_bool("bool.false", false);
    w.set_string("string.empty", "");
    w.set_string("string.odd", odd_string);
    w.set_array_i32("array.i32", {1, -2, std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()});
    w.set_array_f32("array.f32", f32s);
    w.set_array_string("array.string", {"", "x", odd_string, std::string(1000, 'z')});
    w.set_array_i32("array.empty", {});
    w.set_u32("overwritten", 1);
    w.set_u32("overwritten", 2);  // the last value wins
    w.set_u32("general.alignment", uint32_t(align));  // the writer's own value is accepted
    for (const auto& t : tensors) w.add_tensor(t.name, t.type, t.ne, t.bytes.data(), t.bytes.size());
    w.finish();
  }
  GgufFile f(path);
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), align);

  // Metadata: 16 keys set above, general.alignment included once.
  EXPECT_EQ(f.metadata().size(), 16u);
  EXPECT_EQ(f.get_string("general.architecture", ""), "llama");
  ASSERT_TRUE(f.get("general.alignment"));
  EXPECT_EQ(f.get("general.alignment")->type, VT::U32);
  EXPECT_EQ(f.get_int("general.alignment", 0), int64_t(align));
  EXPECT_EQ(f.get("u32.max")->type, VT::U32);
  EXPECT_EQ(f.get_int("u32.max", 0), 0xffffffffll);
  EXPECT_EQ(f.get("i32.min")->type, VT::I32);
  EXPECT_EQ(f.get_int("i32.min", 0), std::numeric_limits<int32_t>::min());
  EXPECT_EQ(f.get("u64.max")->type, VT::U64);
  EXPECT_EQ(f.get_int("u64.max", 0), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(f.get("f32.tiny")->type, VT::F32);
  EXPECT_EQ(dbits(f.get_float("f32.tiny", 0)), dbits(double(std::numeric_limits<float>::denorm_min())));
  EXPECT_EQ(dbits(f.get_float("f32.negzero", 0)), dbits(-0.0));
  EXPECT_EQ(f.get("bool.true")->type, VT::Bool);
  EXPECT_EQ(f.get_int("bool.true", 7), 1);
  EXPECT_EQ(f.get_int("bool.false", 7), 0);
  EXPECT_EQ(f.get_string("string.empty", "absent"), "");
  EXPECT_EQ(f.get_string("string.odd", ""), odd_string);
  const GgufValue* ai = f.get("array.i32");
  ASSERT_TRUE(ai && ai->is_array());
  EXPECT_EQ(ai->elem_type, VT::I32);
  EXPECT_EQ(ai->ints, (std::vector<int64_t>{1, -2, std::numeric_limits<int32_t>::max(),
                                            std::numeric_limits<int32_t>::min()}));
  const GgufValue* af = f.get("array.f32");
  ASSERT_TRUE(af && af->is_array());
  EXPECT_EQ(af->elem_type, VT::F32);
  ASSERT_EQ(af->floats.size(), f32s.size());
  for (size_t i = 0; i < f32s.size(); ++i) EXPECT_EQ(fbits(float(af->floats[i])), fbits(f32s[i])) << i;
  const GgufValue* as = f.get("array.string");
  ASSERT_TRUE(as && as->is_array());
  EXPECT_EQ(as->elem_type, VT::String);
  EXPECT_EQ(as->strings, (std::vector<std::string>{"", "x", odd_string, std::string(1000, 'z')}));
  EXPECT_EQ(f.get("array.empty")->array_size(), 0u);
  EXPECT_EQ(f.get("array.empty")->elem_type, VT::I32);
  EXPECT_EQ(f.get_int("overwritten", 0), 2);

  // Tensors: file order, ne as given, shape reversed, offsets aligned and
  // contiguous (each tensor padded to the alignment, as ggml requires).
  const Bytes raw = read_bytes(path);
  const ParsedGguf p = parse(raw, path);
  EXPECT_EQ(p.data_start % align, 0u);
  ASSERT_EQ(f.tensors().size(), tensors.size());
  uint64_t expect_offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const WrittenTensor& w = tensors[i];
    const GgufTensorInfo& t = f.tensors()[i];
    SCOPED_TRACE(w.name);
    EXPECT_EQ(t.name, w.name);
    EXPECT_EQ(f.find(w.name), &t);
    EXPECT_EQ(t.type, w.type);
    EXPECT_EQ(t.ne, w.ne);
    EXPECT_EQ(t.shape(), Shape(w.ne.rbegin(), w.ne.rend()));
    EXPECT_EQ(t.nbytes, w.bytes.size());
    EXPECT_EQ(t.offset, expect_offset);
    EXPECT_EQ(t.offset % align, 0u);
    expect_offset += (w.bytes.size() + align - 1) / align * align;
    // The bytes, through the mapping and at their place in the file.
    ASSERT_EQ(std::memcmp(f.data(t), w.bytes.data(), w.bytes.size()), 0);
    ASSERT_EQ(std::memcmp(raw.data() + p.data_start + t.offset, w.bytes.data(), w.bytes.size()), 0);
    if (ggml_type_supported(uint32_t(w.type))) {
      std::vector<float> want(size_t(t.numel()));
      dequantize_row(w.type, w.bytes.data(), want.data(), t.numel());
      const std::vector<float> got = f.to_f32(t);
      ASSERT_EQ(got.size(), want.size());
      EXPECT_EQ(std::memcmp(got.data(), want.data(), 4 * want.size()), 0);
    }
  }
  EXPECT_EQ(raw.size(), p.data_start + expect_offset);
  EXPECT_EQ(f.find("missing"), nullptr);

  // The header as ggml lays it out: magic, version, counts.
  ASSERT_GE(raw.size(), 24u);
  EXPECT_EQ(std::string(raw.begin(), raw.begin() + 4), "GGUF");
  EXPECT_EQ(raw[4], 3);
  EXPECT_EQ(raw[5] | raw[6] | raw[7], 0);
  EXPECT_EQ(raw[8], tensors.size());
  EXPECT_EQ(raw[16], 16);

  // A tensor ggml can store but llmdiff cannot dequantise: named with the
  // supported types.
  const std::string msg = expect_error<FormatError>([&] { f.to_f32(*f.find("q8_1.stored")); },
                                                    {path, "'q8_1.stored'", "Q8_1", "supported", "Q6_K"});
  EXPECT_TRUE(printable(msg));
}

TEST(GgufRoundTrip, SameContentGivesTheSameBytes) {
  auto write = [](const std::string& path) {
    GgufWriter w(path);
    w.set_string("general.name", "same");
    w.set_array_f32("v", {1, 2, 3});
    const std::vector<float> x(64, 127.0f / 512);  // exact in Q8_0 (d = 2^-9) and F16
    w.add_tensor_f32("w", GgmlType::Q8_0, {2, 32}, x.data());
    w.add_tensor_f32("v", GgmlType::F16, {3}, x.data());
    w.finish();
    return read_bytes(path);
  };
  const Bytes a = write(temp_path("same-a.gguf")), b = write(temp_path("same-b.gguf"));
  EXPECT_EQ(a, b);
  // Default alignment: 32, and no general.alignment key written.
  GgufFile f(temp_path("same-a.gguf"));
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_FALSE(f.has("general.alignment"));
  ASSERT_EQ(f.tensors().size(), 2u);
  // add_tensor_f32 takes a row-major shape: ne is reversed.
  EXPECT_EQ(f.tensors()[0].ne, (std::vector<int64_t>{32, 2}));
  EXPECT_EQ(f.tensors()[0].shape(), (Shape{2, 32}));
  EXPECT_EQ(f.tensors()[1].offset, 96u);  // 68 bytes of Q8_0 padded to 32
  for (float v : f.to_f32(f.tensors()[0])) EXPECT_EQ(v, 127.0f / 512);
  for (float v : f.to_f32(f.tensors()[1])) EXPECT_EQ(v, 127.0f / 512);
}

TEST(GgufRoundTrip, EveryTruncationOfAWrittenFileIsRejectedUntilTheLastTensorIsWhole) {
  const std::string path = temp_path("prefix.gguf");
  {
    GgufWriter w(path, 16);
    w.set_string("general.architecture", "llama");
    w.set_array_string("tokens", {"<s>", "</s>", "hello"});
    w.set_array_i32("ids", {1, 2, 3});
    const WrittenTensor a = make_tensor("a", GgmlType::Q8_0, {32}, 1);
    const WrittenTensor b = make_tensor("b", GgmlType::F16, {3}, 2);  // 6 bytes, then 10 of padding
    w.add_tensor(a.name, a.type, a.ne, a.bytes.data(), a.bytes.size());
    w.add_tensor(b.name, b.type, b.ne, b.bytes.data(), b.bytes.size());
    w.finish();
  }
  const Bytes full = read_bytes(path);
  const ParsedGguf p = parse(full, "full");
  ASSERT_EQ(p.tensors.size(), 2u);
  const size_t end = p.data_start + p.tensors[1].offset + p.tensors[1].nbytes;
  ASSERT_LT(end, full.size());  // the padding after the last tensor
  for (size_t n = 0; n <= full.size(); ++n) {
    const Bytes cut(full.begin(), full.begin() + long(n));
    if (n < end) {
      try {
        parse(cut, "cut.gguf");
        ADD_FAILURE() << "prefix of " << n << " bytes accepted";
      } catch (const FormatError& e) {
        EXPECT_EQ(e.file(), "cut.gguf");
        EXPECT_EQ(std::string(e.what()).rfind("cut.gguf: ", 0), 0u) << e.what();
      }
    } else {
      // Only padding is missing: the file is complete.
      EXPECT_EQ(parse(cut, "cut.gguf").tensors.size(), 2u) << n;
    }
  }
}

// ------------------------------------------------------ hand-built files

TEST(GgufReader, HandBuiltV2FileWithEveryValueType) {
  RawGguf g;
  g.version = 2;
  auto kv = [&](const std::string& k, const Bytes& v) { g.kv.push_back({k, v}); };
  kv("u8", value(VT::U8, {0xff}));
  kv("i8", value(VT::I8, {0x80}));
  kv("u16", value(VT::U16, Buf().u16(0xffff).b));
  kv("i16", value(VT::I16, Buf().u16(0x8000).b));
  kv("u32", v_u32(0xffffffffu));
  kv("i32", v_i32(-7));
  kv("f32", value(VT::F32, Buf().f32(-2.5f).b));
  kv("bool", value(VT::Bool, {1}));
  kv("string", v_str("héllo"));
  kv("u64", value(VT::U64, Buf().u64(uint64_t(1) << 62).b));
  kv("i64", value(VT::I64, Buf().u64(uint64_t(std::numeric_limits<int64_t>::min())).b));
  kv("f64", value(VT::F64, Buf().f64(1e-300).b));
  kv("a.u8", v_array(VT::U8, 3, {0, 1, 255}));
  kv("a.i8", v_array(VT::I8, 2, {0x7f, 0x80}));
  kv("a.u16", v_array(VT::U16, 1, Buf().u16(65535).b));
  kv("a.i16", v_array(VT::I16, 2, Buf().u16(0xffff).u16(0x7fff).b));
  kv("a.u32", v_array(VT::U32, 1, Buf().u32(4000000000u).b));
  kv("a.i32", v_array(VT::I32, 1, Buf().u32(0x80000000u).b));
  kv("a.f32", v_array(VT::F32, 2, Buf().f32(0.5f).f32(-0.0f).b));
  kv("a.bool", v_array(VT::Bool, 2, {0, 1}));
  kv("a.string", v_array(VT::String, 2, Buf().str("").str("tok").b));
  kv("a.u64", v_array(VT::U64, 1, Buf().u64(123456789012345ull).b));
  kv("a.i64", v_array(VT::I64, 1, Buf().u64(uint64_t(-5)).b));
  kv("a.f64", v_array(VT::F64, 1, Buf().f64(-0.125).b));
  kv("a.empty", v_array(VT::F64, 0, {}));
  // An F16 [2, 4] matrix, then a Q4_0 row at the next multiple of 32.
  g.tensors.push_back({"m", {4, 2}, 1, 0});
  g.tensors.push_back({"q", {32}, 2, 32});
  Buf d;
  for (uint16_t h : {0x3c00, 0xc000, 0x3800, 0x0001, 0x7bff, 0x8000, 0x7c00, 0x3555}) d.u16(h);
  d.raw(Bytes(16, 0));
  d.u16(0x4000);  // Q4_0: d = 2; qs[j] = j | (15 - j) << 4
  for (int j = 0; j < 16; ++j) d.u8(uint8_t(j | ((15 - j) << 4)));
  g.data = d.b;
  const std::string path = temp_path("v2.gguf");
  write_bytes(path, g.bytes());

  GgufFile f(path);
  EXPECT_EQ(f.version(), 2u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.metadata().size(), g.kv.size());
  struct IntCase {
    const char* key;
    VT type;
    int64_t v;
  };
  for (const IntCase& c : {IntCase{"u8", VT::U8, 255}, IntCase{"i8", VT::I8, -128}, IntCase{"u16", VT::U16, 65535},
                           IntCase{"i16", VT::I16, -32768}, IntCase{"u32", VT::U32, 4294967295ll},
                           IntCase{"i32", VT::I32, -7}, IntCase{"bool", VT::Bool, 1},
                           IntCase{"u64", VT::U64, int64_t(1) << 62},
                           IntCase{"i64", VT::I64, std::numeric_limits<int64_t>::min()}}) {
    const GgufValue* v = f.get(c.key);
    ASSERT_TRUE(v) << c.key;
    EXPECT_EQ(v->type, c.type) << c.key;
    EXPECT_TRUE(v->is_integer()) << c.key;
    EXPECT_EQ(v->i, c.v) << c.key;
  }
  EXPECT_EQ(f.get("f32")->type, VT::F32);
  EXPECT_EQ(f.get("f32")->f, -2.5);
  EXPECT_EQ(f.get("f64")->type, VT::F64);
  EXPECT_EQ(dbits(f.get("f64")->f), dbits(1e-300));
  EXPECT_EQ(f.get_string("string", ""), "héllo");
  auto ints = [&](const char* k) { return f.get(k)->ints; };
  EXPECT_EQ(ints("a.u8"), (std::vector<int64_t>{0, 1, 255}));
  EXPECT_EQ(ints("a.i8"), (std::vector<int64_t>{127, -128}));
  EXPECT_EQ(ints("a.u16"), (std::vector<int64_t>{65535}));
  EXPECT_EQ(ints("a.i16"), (std::vector<int64_t>{-1, 32767}));
  EXPECT_EQ(ints("a.u32"), (std::vector<int64_t>{4000000000ll}));
  EXPECT_EQ(ints("a.i32"), (std::vector<int64_t>{std::numeric_limits<int32_t>::min()}));
  EXPECT_EQ(ints("a.bool"), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(ints("a.u64"), (std::vector<int64_t>{123456789012345ll}));
  EXPECT_EQ(ints("a.i64"), (std::vector<int64_t>{-5}));
  EXPECT_EQ(f.get("a.f32")->floats.size(), 2u);
  EXPECT_EQ(f.get("a.f32")->floats[0], 0.5);
  EXPECT_EQ(dbits(f.get("a.f32")->floats[1]), dbits(-0.0));
  EXPECT_EQ(f.get("a.f64")->floats, (std::vector<double>{-0.125}));
  EXPECT_EQ(f.get("a.string")->strings, (std::vector<std::string>{"", "tok"}));
  EXPECT_EQ(f.get("a.empty")->elem_type, VT::F64);
  EXPECT_EQ(f.get("a.empty")->array_size(), 0u);
  const std::vector<std::pair<const char*, size_t>> sizes = {
      {"a.u8", 3},  {"a.i8", 2},  {"a.u16", 1},    {"a.i16", 2}, {"a.u32", 1}, {"a.i32", 1},
      {"a.f32", 2}, {"a.bool", 2}, {"a.string", 2}, {"a.u64", 1}, {"a.i64", 1}, {"a.f64", 1}};
  for (const auto& [k, n] : sizes) {
    EXPECT_TRUE(f.get(k)->is_array()) << k;
    EXPECT_EQ(f.get(k)->array_size(), n) << k;
  }

  // Typed accessors: integers read as floats; wrong types name the key.
  EXPECT_EQ(f.get_float("i32", 0), -7.0);
  EXPECT_EQ(f.get_int("absent", 42), 42);
  EXPECT_EQ(f.get_string("absent", "fb"), "fb");
  expect_error<FormatError>([&] { f.get_int("string", 0); }, {path, "'string'", "integer"});
  expect_error<FormatError>([&] { f.get_string("u8", ""); }, {path, "'u8'", "string"});
  expect_error<FormatError>([&] { f.get_float("a.f32", 0); }, {path, "'a.f32'", "array"});

  ASSERT_EQ(f.tensors().size(), 2u);
  const GgufTensorInfo& m = f.tensors()[0];
  EXPECT_EQ(m.name, "m");
  EXPECT_EQ(m.type, GgmlType::F16);
  EXPECT_EQ(m.ne, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(m.shape(), (Shape{2, 4}));
  EXPECT_EQ(m.numel(), 8);
  EXPECT_EQ(m.nbytes, 16u);
  const std::vector<float> mv = f.to_f32(m);
  // 0x3555: exponent 13, mantissa 0x155: (1024 + 341) / 1024 * 2^-2.
  const std::vector<float> want = {1, -2, 0.5f, std::ldexp(1.0f, -24), 65504, -0.0f, INFINITY, 1365.0f / 4096};
  ASSERT_EQ(mv.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(fbits(mv[i]), fbits(want[i])) << i;
  const GgufTensorInfo& q = f.tensors()[1];
  EXPECT_EQ(q.type, GgmlType::Q4_0);
  EXPECT_EQ(q.offset, 32u);
  EXPECT_EQ(q.nbytes, 18u);
  const std::vector<float> qv = f.to_f32(q);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(qv[size_t(j)], 2.0f * float(j - 8)) << j;
    EXPECT_EQ(qv[size_t(j + 16)], 2.0f * float(15 - j - 8)) << j;
  }
  const Bytes raw = read_bytes(path);
  EXPECT_EQ(std::memcmp(f.data(q), raw.data() + raw.size() - 18, 18), 0);
}

TEST(GgufReader, CustomAlignmentAndNoTensors) {
  {  // general.alignment 64: the data region and offsets follow it.
    RawGguf g;
    g.kv.push_back({"general.alignment", v_u32(64)});
    g.tensors.push_back({"x", {4}, 0, 0});
    g.tensors.push_back({"y", {4}, 0, 64});
    g.align = 64;
    g.data = Bytes(64 + 16, 0x3f);
    const Bytes b = g.bytes();
    const ParsedGguf p = parse(b, "aligned");
    EXPECT_EQ(p.alignment, 64u);
    EXPECT_EQ(p.data_start % 64, 0u);
    EXPECT_EQ(p.data_start + 80, b.size());
    // The same file with offset 32 for y: aligned to 32, not to 64.
    g.tensors[1].offset = 32;
    expect_error<FormatError>([&] { parse(g.bytes(), "aligned"); }, {"'y'", "offset 32", "alignment 64"});
  }
  {  // No tensors and no metadata: a 24-byte file is valid.
    RawGguf g;
    g.align = 1;
    const ParsedGguf p = parse(g.bytes(), "empty");
    EXPECT_TRUE(p.tensors.empty());
    EXPECT_TRUE(p.kv.empty());
    EXPECT_LE(p.data_start, 24u);
  }
}

TEST(GgufReader, OverlappingTensorsAreRejected) {
  // ggml lays tensors out back to back: two tensors sharing bytes is a
  // corrupt table, named by the later tensor and the one it overlaps.
  RawGguf g = small_file();
  g.tensors[1] = {"b", {8}, 0, 0};  // the same 32 bytes as "a"
  expect_error<FormatError>([&] { parse(g.bytes(), "overlap.gguf"); }, {"overlap.gguf", "overlaps tensor"});
  try {
    parse(g.bytes(), "overlap.gguf");
  } catch (const FormatError& e) {
    EXPECT_FALSE(e.tensor().empty()) << e.what();
  }
}

// ------------------------------------------------------------- malformed

struct Case {
  std::string name;
  Bytes bytes;
  std::string tensor;  // the (escaped) tensor the error names, "" for none
  std::vector<std::string> phrases;
};

std::vector<Case> corpus() {
  std::vector<Case> cs;
  const RawGguf base = small_file();
  const Bytes valid = base.bytes();
  auto with = [&](const std::function<void(RawGguf&)>& f) {
    RawGguf g = base;
    f(g);
    return g.bytes();
  };

  // --- header
  cs.push_back({"empty", {}, "", {"empty file"}});
  cs.push_back({"bad-magic", with([](RawGguf& g) { g.magic = "GGML"; }), "", {"bad magic 'GGML'", "'GGUF'"}});
  cs.push_back({"bad-magic-binary", with([](RawGguf& g) { g.magic = std::string("\x01\xff\0G", 4); }), "",
                {"bad magic '\\x01\\xff\\x00G'"}});
  cs.push_back({"magic-only", Bytes(valid.begin(), valid.begin() + 4), "", {"truncated", "version"}});
  cs.push_back({"short-magic", Bytes(valid.begin(), valid.begin() + 3), "", {"truncated", "magic"}});
  cs.push_back({"version-1", with([](RawGguf& g) { g.version = 1; }), "", {"version 1 is not supported"}});
  cs.push_back({"version-0", with([](RawGguf& g) { g.version = 0; }), "", {"unsupported GGUF version 0"}});
  cs.push_back({"version-4", with([](RawGguf& g) { g.version = 4; }), "", {"unsupported GGUF version 4"}});
  cs.push_back({"version-big-endian", with([](RawGguf& g) { g.version = 0x03000000; }), "",
                {"unsupported GGUF version 50331648", "big-endian"}});
  cs.push_back({"truncated-counts", Bytes(valid.begin(), valid.begin() + 12), "", {"truncated", "tensor count"}});
  cs.push_back({"truncated-kv-count", Bytes(valid.begin(), valid.begin() + 20), "", {"truncated", "metadata count"}});
  cs.push_back({"tensor-count-huge", with([](RawGguf& g) { g.n_tensors = uint64_t(1) << 40; }), "",
                {"tensor count 1099511627776"}});
  cs.push_back({"tensor-count-max", with([](RawGguf& g) { g.n_tensors = ~uint64_t(0); }), "",
                {"tensor count 18446744073709551615"}});
  cs.push_back({"kv-count-huge", with([](RawGguf& g) { g.n_kv = uint64_t(1) << 40; }), "",
                {"metadata count 1099511627776"}});
  cs.push_back({"kv-count-max", with([](RawGguf& g) { g.n_kv = ~uint64_t(0); }), "", {"metadata count"}});

  // --- metadata
  {
    // The first key's length runs past the end of the file.
    Bytes b = valid;
    for (int i = 0; i < 8; ++i) b[24 + size_t(i)] = uint8_t((uint64_t(1) << 62) >> (8 * i));
    cs.push_back({"key-length-past-eof", b, "", {"metadata entry 0", "the key", "runs past the end"}});
  }
  cs.push_back({"string-value-past-eof",
                with([](RawGguf& g) { g.kv[0].second = value(VT::String, Buf().u64(100000).raw("llama").b); }), "",
                {"metadata key 'general.architecture'", "a string value of 100000 bytes", "runs past the end"}});
  cs.push_back({"array-count-past-eof",
                with([](RawGguf& g) { g.kv[1].second = v_array(VT::U32, uint64_t(1) << 40, Buf().u32(1).b); }), "",
                {"'tokenizer.ggml.tokens'", "array of 1099511627776 u32 elements runs past the end"}});
  cs.push_back({"array-string-past-eof",
                with([](RawGguf& g) { g.kv[1].second = v_array(VT::String, 2, Buf().str("a").u64(1u << 30).b); }), "",
                {"'tokenizer.ggml.tokens'", "an array string", "runs past the end"}});
  cs.push_back({"array-of-arrays",
                with([](RawGguf& g) { g.kv[1].second = v_array(VT::Array, 1, v_array(VT::U8, 1, {1})); }), "",
                {"'tokenizer.ggml.tokens'", "arrays of arrays"}});
  cs.push_back({"unknown-value-type", with([](RawGguf& g) { g.kv[0].second = Buf().u32(13).u32(0).b; }), "",
                {"'general.architecture'", "unknown value type 13"}});
  cs.push_back({"unknown-value-type-max", with([](RawGguf& g) { g.kv[0].second = Buf().u32(0xffffffffu).b; }), "",
                {"unknown value type 4294967295"}});
  cs.push_back({"unknown-array-element-type", with([](RawGguf& g) { g.kv[1].second = v_array(VT(99), 0, {}); }), "",
                {"'tokenizer.ggml.tokens'", "unknown value type 99"}});
  cs.push_back({"bool-not-0-or-1", with([](RawGguf& g) { g.kv[0].second = value(VT::Bool, {2}); }), "",
                {"'general.architecture'", "bool value 2"}});
  cs.push_back({"u64-over-int64",
                with([](RawGguf& g) { g.kv[0].second = value(VT::U64, Buf().u64(uint64_t(1) << 63).b); }), "",
                {"u64 value 9223372036854775808 exceeds INT64_MAX"}});
  cs.push_back({"empty-key", with([](RawGguf& g) { g.kv[0].first = ""; }), "", {"metadata entry 0", "empty key"}});
  cs.push_back({"duplicate-key", with([](RawGguf& g) {
                  g.kv[0].first = std::string("k\x01\xff", 3);
                  g.kv[1].first = g.kv[0].first;
                }),
                "", {"metadata key 'k\\x01\\xff'", "duplicate key"}});
  cs.push_back({"alignment-not-power-of-two",
                with([](RawGguf& g) { g.kv.push_back({"general.alignment", v_u32(48)}); }), "",
                {"'general.alignment'", "alignment 48 is not a power of two"}});
  cs.push_back({"alignment-zero", with([](RawGguf& g) { g.kv.push_back({"general.alignment", v_u32(0)}); }), "",
                {"'general.alignment'", "alignment 0 is not a power of two"}});
  cs.push_back({"alignment-not-u32", with([](RawGguf& g) { g.kv.push_back({"general.alignment", v_i32(32)}); }),
                "", {"'general.alignment'", "must be a u32, not i32"}});

  // --- tensor infos
  {
    // The first tensor's name length runs past the end of the file.
    RawGguf g = base;
    g.tensors[0].name = "A";
    Bytes b = g.bytes();
    const Bytes header_end = Buf().str("A").b;
    const auto at = std::search(b.begin(), b.end(), header_end.begin(), header_end.end()) - b.begin();
    for (int i = 0; i < 8; ++i) b[size_t(at + i)] = 0xee;
    cs.push_back({"tensor-name-past-eof", b, "", {"tensor entry 0", "the tensor name", "runs past the end"}});
  }
  cs.push_back({"unknown-ggml-type", with([](RawGguf& g) { g.tensors[1].type = 99; }), "b",
                {"unknown ggml type 99", "supported", "Q8_0", "Q4_K", "BF16"}});
  cs.push_back({"unsupported-ggml-type", with([](RawGguf& g) { g.tensors[1].type = 16; }), "b",
                {"ggml type 16 (IQ2_XXS) is not supported", "supported: ", "Q6_K"}});
  cs.push_back({"removed-ggml-type", with([](RawGguf& g) { g.tensors[0].type = 4; }), "a",
                {"unknown ggml type 4", "supported"}});
  cs.push_back({"offset-unaligned", with([](RawGguf& g) { g.tensors[1].offset = 36; }), "b",
                {"data offset 36 is not a multiple of the alignment 32"}});
  cs.push_back({"data-out-of-bounds", with([](RawGguf& g) { g.tensors[1].offset = 64; }), "b",
                {"data at offset 64 (34 bytes) runs past the end of the file"}});
  cs.push_back({"data-offset-huge", with([](RawGguf& g) { g.tensors[0].offset = uint64_t(1) << 63; }), "a",
                {"runs past the end of the file"}});
  cs.push_back({"data-one-byte-short", Bytes(valid.begin(), valid.end() - 1), "b", {"runs past the end of the file"}});
  cs.push_back({"data-size-past-eof", with([](RawGguf& g) { g.tensors[1].ne = {32, 1000}; }), "b",
                {"(34000 bytes) runs past the end"}});
  cs.push_back({"data-region-past-eof", Bytes(valid.begin(), valid.end() - long(base.data.size()) - 1), "",
                {"data region starts at byte"}});
  cs.push_back({"duplicate-tensor-name", with([](RawGguf& g) {
                  g.tensors[0].name = std::string("x\x01\xff", 3);
                  g.tensors[1].name = g.tensors[0].name;
                }),
                "x\\x01\\xff", {"duplicate tensor name"}});
  {
    // A 93-byte name: 80 bytes of it shown, escaped, then its length.
    std::string shown;
    for (int i = 0; i < 80; ++i) shown += "\\xff";
    cs.push_back({"long-escaped-name", with([](RawGguf& g) {
                    g.tensors[0].name = std::string(90, '\xff') + "end";
                    g.tensors[0].type = 99;
                  }),
                  shown + "... (93 bytes)", {"unknown ggml type 99"}});
  }
  cs.push_back({"n-dims-5", with([](RawGguf& g) { g.tensors[0].ne = {8, 1, 1, 1, 1}; }), "a",
                {"n_dims 5 is outside 1..4"}});
  cs.push_back({"n-dims-0", with([](RawGguf& g) { g.tensors[0].ne = {}; }), "a", {"n_dims 0 is outside 1..4"}});
  cs.push_back({"dim-zero", with([](RawGguf& g) { g.tensors[0].ne = {0}; }), "a",
                {"dimension 0 has 0 elements"}});
  cs.push_back({"dim-zero-later", with([](RawGguf& g) { g.tensors[1].ne = {32, 1, 0}; }), "b",
                {"dimension 2 has 0 elements"}});
  cs.push_back({"dim-negative", with([](RawGguf& g) { g.tensors[0].ne = {8, ~uint64_t(0)}; }), "a",
                {"dimension 1 has 18446744073709551615 elements"}});
  cs.push_back({"dim-over-int64", with([](RawGguf& g) { g.tensors[0].ne = {uint64_t(1) << 63}; }), "a",
                {"dimension 0 has 9223372036854775808 elements"}});
  cs.push_back({"element-count-overflow",
                with([](RawGguf& g) { g.tensors[0].ne = {uint64_t(1) << 32, uint64_t(1) << 32}; }), "a",
                {"element count overflows"}});
  cs.push_back({"byte-size-overflow", with([](RawGguf& g) { g.tensors[0].ne = {uint64_t(1) << 62}; }), "a",
                {"byte size", "overflows"}});
  cs.push_back({"ne0-not-whole-blocks", with([](RawGguf& g) { g.tensors[1].ne = {48}; }), "b",
                {"ne[0] = 48 is not a multiple of the block size 32 of Q8_0"}});
  cs.push_back({"ne0-not-whole-k-blocks", with([](RawGguf& g) {
                  g.tensors[1].type = uint32_t(GgmlType::Q4_K);
                  g.tensors[1].ne = {128, 2};  // 256 values, but rows of 128
                }),
                "b", {"ne[0] = 128 is not a multiple of the block size 256 of Q4_K"}});
  return cs;
}

void check_error(const FormatError& e, const Case& c, const std::string& file) {
  const std::string msg = e.what();
  EXPECT_EQ(e.file(), file);
  EXPECT_EQ(msg.rfind(file + ": ", 0), 0u) << msg;
  EXPECT_EQ(e.tensor(), c.tensor) << msg;
  if (!c.tensor.empty()) {
    EXPECT_NE(msg.find("tensor '" + c.tensor + "'"), std::string::npos) << msg;
  }
  for (const auto& p : c.phrases) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  EXPECT_TRUE(printable(msg)) << msg;
}

TEST(GgufMalformed, EveryFileGivesATypedErrorNamingFileAndTensor) {
  const auto cases = corpus();
  EXPECT_GE(cases.size(), 50u);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    try {
      parse(c.bytes, "<" + c.name + ">");
      ADD_FAILURE() << "accepted";
    } catch (const FormatError& e) {
      check_error(e, c, "<" + c.name + ">");
    }
    const std::string path = temp_path(c.name + ".gguf");
    write_bytes(path, c.bytes);
    try {
      GgufFile f(path);
      ADD_FAILURE() << "accepted";
    } catch (const FormatError& e) {
      check_error(e, c, path);
    }
  }
}

TEST(GgufMalformed, TheBaseFileIsValid) {
  // The corpus only means something if the unmutated file passes.
  const RawGguf g = small_file();
  const ParsedGguf p = parse(g.bytes(), "base");
  EXPECT_EQ(p.version, 3u);
  ASSERT_EQ(p.tensors.size(), 2u);
  EXPECT_EQ(p.tensors[1].nbytes, 34u);
  EXPECT_EQ(p.data_start + 66, g.bytes().size());
  const std::string path = temp_path("base.gguf");
  write_bytes(path, g.bytes());
  GgufFile f(path);
  const std::vector<float> b = f.to_f32(f.tensors()[1]);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(b[size_t(i)], 0.5f * float(int8_t(uint8_t(i * 9 - 128)))) << i;
  const std::vector<float> a = f.to_f32(f.tensors()[0]);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(a[size_t(i)], float(i) - 3.5f);
}

TEST(GgufMalformed, EveryTruncationOfASmallFileThrows) {
  // The last tensor ends at the end of the file: every proper prefix lacks
  // something, and must be a FormatError, never a crash or an overread.
  const Bytes full = small_file().bytes();
  for (size_t n = 0; n < full.size(); ++n) {
    try {
      parse(Bytes(full.begin(), full.begin() + long(n)), "cut.gguf");
      ADD_FAILURE() << "prefix of " << n << " bytes accepted";
    } catch (const FormatError& e) {
      EXPECT_EQ(e.file(), "cut.gguf") << n;
      EXPECT_TRUE(printable(e.what())) << n;
    }
  }
  EXPECT_NO_THROW(parse(full, "full.gguf"));
}

TEST(GgufMalformed, RandomByteFlipsNeverCrash) {
  // Accepted files must keep every tensor inside the buffer.
  const Bytes base = small_file().bytes();
  std::mt19937_64 rng(20250101);
  for (int iter = 0; iter < 4000; ++iter) {
    Bytes b = base;
    for (int k = 0, n = 1 + int(rng() % 4); k < n; ++k) {
      const size_t at = rng() % std::min<size_t>(b.size(), 200);  // the header mostly
      b[at] = rng() % 3 ? uint8_t(b[at] ^ (1u << (rng() % 8))) : uint8_t(rng());
    }
    try {
      const ParsedGguf p = parse(b, "fuzz.gguf");
      for (const auto& t : p.tensors) {
        ASSERT_LE(p.data_start, b.size());
        ASSERT_LE(t.offset + t.nbytes, b.size() - p.data_start) << "iteration " << iter;
        ASSERT_EQ(t.offset % p.alignment, 0u);
      }
    } catch (const FormatError& e) {
      ASSERT_EQ(e.file(), "fuzz.gguf");
      ASSERT_TRUE(printable(e.what())) << e.what();
    }
  }
}

TEST(GgufMalformed, MissingFileIsAnIoError) {
  const std::string path = temp_path("does-not-exist.gguf");
  expect_error<IoError>([&] { GgufFile f(path); }, {path});
}

// ------------------------------------------------------------------ writer

TEST(GgufWriterErrors, InvalidTensorsAndKeysAreRejected) {
  const std::string path = temp_path("writer-errors.gguf");
  const Bytes buf(4096, 0);
  for (size_t bad : {size_t(0), size_t(48), size_t(3), size_t(1) << 33})
    expect_error<FormatError>([&] { GgufWriter w(path, bad); }, {path, "alignment " + std::to_string(bad)});

  GgufWriter w(path);
  const std::string odd("n\x01\xff", 3);
  w.add_tensor(odd, GgmlType::F32, {4}, buf.data(), 16);
  std::string msg =
      expect_error<FormatError>([&] { w.add_tensor(odd, GgmlType::F32, {4}, buf.data(), 16); },
                                {path, "tensor 'n\\x01\\xff'", "duplicate tensor name"});
  EXPECT_TRUE(printable(msg)) << msg;
  expect_error<FormatError>([&] { w.add_tensor("t", GgmlType::F32, {4}, buf.data(), 15); },
                            {"'t'", "byte count 15", "16 bytes"});
  expect_error<FormatError>([&] { w.add_tensor("t", GgmlType::Q8_0, {48}, buf.data(), 51); },
                            {"'t'", "ne[0] = 48", "block size 32 of Q8_0"});
  expect_error<FormatError>([&] { w.add_tensor("t", GgmlType::F32, {}, buf.data(), 0); }, {"'t'", "n_dims 0"});
  expect_error<FormatError>([&] { w.add_tensor("t", GgmlType::F32, {1, 1, 1, 1, 1}, buf.data(), 4); },
                            {"'t'", "n_dims 5"});
  expect_error<FormatError>([&] { w.add_tensor("t", GgmlType::F32, {4, 0}, buf.data(), 0); }, {"'t'", "dimension 0"});
  expect_error<FormatError>([&] { w.add_tensor("t", GgmlType::F32, {4, -2}, buf.data(), 0); },
                            {"'t'", "dimension -2"});
  expect_error<FormatError>([&] { w.add_tensor("t", GgmlType(99), {4}, buf.data(), 4); }, {"'t'", "ggml type 99"});
  expect_error<FormatError>([&] { w.add_tensor("", GgmlType::F32, {1}, buf.data(), 4); }, {"empty tensor name"});
  expect_error<FormatError>([&] { w.add_tensor(std::string(64, 'n'), GgmlType::F32, {1}, buf.data(), 4); },
                            {"name of 64 bytes"});
  expect_error<FormatError>([&] { w.add_tensor_f32("t", GgmlType::Q8_1, {32}, nullptr); },
                            {"'t'", "Q8_1", "supported", "Q4_K"});
  expect_error<FormatError>([&] { w.add_tensor_f32("t", GgmlType::Q4_K, {2, 128}, nullptr); },
                            {"'t'", "128", "block size 256"});
  expect_error<FormatError>([&] { w.set_i32("general.alignment", 32); }, {"general.alignment"});
  expect_error<FormatError>([&] { w.set_string("general.alignment", "32"); }, {"general.alignment"});
  expect_error<FormatError>([&] { w.set_u32("general.alignment", 64); }, {"general.alignment"});
  expect_error<FormatError>([&] { w.set_u64("big", uint64_t(1) << 63); }, {"'big'", "INT64_MAX"});
  expect_error<FormatError>([&] { w.set_u32("", 1); }, {"empty metadata key"});
  // The failed calls left nothing behind: the file holds the one tensor.
  w.finish();
  w.finish();  // a second finish does nothing
  expect_error<IoError>([&] { w.set_u32("late", 1); }, {path, "after finish"});
  expect_error<IoError>([&] { w.add_tensor("late", GgmlType::F32, {1}, buf.data(), 4); }, {path, "after finish"});
  GgufFile f(path);
  ASSERT_EQ(f.tensors().size(), 1u);
  EXPECT_EQ(f.tensors()[0].name, odd);
  EXPECT_EQ(f.tensors()[0].nbytes, 16u);
  EXPECT_TRUE(f.metadata().empty());
}

}  // namespace
}  // namespace llmdiff
