// A corpus of malformed safetensors inputs, generated from a valid golden file:
// each one must give a typed error (FormatError / IoError) naming the file and
// the tensor where there is one, never a crash (also under ASan + UBSan).
#include <gtest/gtest.h>

#include <cctype>
#include <random>
#include <set>

#include "dumps/model/config.h"
#include "dumps/contract/dump.h"
#include "dumps/base/errors.h"
#include "dumps/formats/safetensors.h"
#include "tests/support.h"
#include "tests/test_dumps_helpers.h"

namespace llmdiff {
namespace {

using namespace llmdiff::testing;
using ojson = nlohmann::ordered_json;

// The valid file every malformed variant is derived from.
const Bytes& base_bytes() {
  static const Bytes b = read_bytes(golden_dump("llama-gqa", "prefill"));
  return b;
}

// Serialises a (mutated) header, padded like a real file, in front of `data`.
Bytes with_header(const ojson& header, const Bytes& data) {
  std::string text = header.dump();
  while (text.size() % 8) text += ' ';
  return assemble(text, data);
}

struct Case {
  std::string name;
  Bytes bytes;
  std::set<std::string> tensors;  // the tensor the error must name ({""}: none)
  std::string phrase;             // a phrase the message must contain
};

std::vector<Case> corpus() {
  const Bytes& base = base_bytes();
  const RawFile raw = split_raw(base);
  const ojson H = ojson::parse(raw.header);
  const Bytes& D = raw.data;
  std::vector<Case> cs;
  auto mutated = [&](const std::function<void(ojson&)>& f) {
    ojson h = H;
    f(h);
    return with_header(h, D);
  };
  auto off = [&](const std::string& t, int i) { return H[t]["data_offsets"][i].get<uint64_t>(); };

  // --- the container
  cs.push_back({"empty-file", {}, {""}, "empty"});
  cs.push_back({"shorter-than-length-prefix", Bytes(base.begin(), base.begin() + 5), {""}, "truncated"});
  cs.push_back({"truncated-header", Bytes(base.begin(), base.begin() + 8 + long(raw.header.size() / 2)), {""},
                "past the end"});
  {
    Bytes b = base;
    put_header_length(b, b.size() - 8 + 1);
    cs.push_back({"header-length-past-eof", b, {""}, "past the end"});
  }
  {
    Bytes b = base;
    put_header_length(b, 100ull * 1000 * 1000 + 8);
    cs.push_back({"header-length-over-limit", b, {""}, "100 MB"});
  }
  {
    Bytes b = base;
    put_header_length(b, ~uint64_t(0));
    cs.push_back({"header-length-max-u64", b, {""}, "header length"});
  }
  {
    Bytes b = base;
    put_header_length(b, 0);
    cs.push_back({"header-length-zero", b, {""}, "JSON"});
  }
  // --- the JSON
  cs.push_back({"bad-json-unterminated", assemble("{\"step0.embed\": {\"dtype\": \"F32\",   ", D), {""}, "JSON"});
  cs.push_back({"bad-json-garbage", assemble("not json at all!", D), {""}, "JSON"});
  {
    std::string h = raw.header;
    h[h.find_last_of('}')] = ']';
    cs.push_back({"bad-json-mismatched-bracket", assemble(h, D), {""}, "JSON"});
  }
  {
    std::string h = raw.header;
    h[10] = '\0';
    cs.push_back({"bad-json-nul-byte", assemble(h, D), {""}, "JSON"});
  }
  {
    std::string h = raw.header;
    h.replace(h.find_last_of('}') + 1, 2, "{}");
    cs.push_back({"bad-json-trailing-value", assemble(h, D), {""}, "JSON"});
  }
  cs.push_back({"header-not-an-object", assemble("[1, 2, 3]       ", D), {""}, "not a JSON object"});
  // --- data_offsets
  {
    // The file ends 100 bytes early: the tensors whose data was cut are out of bounds.
    Bytes b(base.begin(), base.end() - 100);
    std::set<std::string> cut;
    for (auto it = H.begin(); it != H.end(); ++it)
      if (it.key() != "__metadata__" && it.value()["data_offsets"][1].get<uint64_t>() > D.size() - 100)
        cut.insert(it.key());
    cs.push_back({"data-truncated", b, cut, "out of bounds"});
  }
  cs.push_back({"offsets-out-of-bounds", mutated([&](ojson& h) {
                  const uint64_t len = off("step0.embed", 1) - off("step0.embed", 0);
                  h["step0.embed"]["data_offsets"] = {D.size() - len + 4, D.size() + 4};
                }),
                {"step0.embed"}, "out of bounds"});
  cs.push_back({"offsets-far-out-of-bounds", mutated([&](ojson& h) {
                  h["step0.mask"]["data_offsets"] = {~uint64_t(0) - 196, ~uint64_t(0)};
                }),
                {"step0.mask"}, "out of bounds"});
  cs.push_back({"offsets-reversed", mutated([&](ojson& h) {
                  h["step0.embed"]["data_offsets"] = {off("step0.embed", 1), off("step0.embed", 0)};
                }),
                {"step0.embed"}, "reversed"});
  cs.push_back({"offsets-negative", mutated([&](ojson& h) { h["step0.tokens"]["data_offsets"] = {-8, 48}; }),
                {"step0.tokens"}, "data_offsets"});
  cs.push_back({"offsets-one-number", mutated([&](ojson& h) { h["step0.tokens"]["data_offsets"] = {0}; }),
                {"step0.tokens"}, "data_offsets"});
  cs.push_back({"offsets-not-integers", mutated([&](ojson& h) { h["step0.tokens"]["data_offsets"] = {0.5, 56.5}; }),
                {"step0.tokens"}, "data_offsets"});
  cs.push_back({"offsets-a-string", mutated([&](ojson& h) { h["step0.tokens"]["data_offsets"] = "0,56"; }),
                {"step0.tokens"}, "data_offsets"});
  cs.push_back({"overlapping-tensors", mutated([&](ojson& h) {
                  const uint64_t b0 = off("step0.tokens", 0) + 8;
                  h["step0.positions"]["data_offsets"] = {b0, b0 + (off("step0.positions", 1) - off("step0.positions", 0))};
                }),
                {"step0.positions"}, "overlaps tensor 'step0.tokens'"});
  cs.push_back({"identical-ranges", mutated([&](ojson& h) {
                  h["step0.positions"]["data_offsets"] = H["step0.tokens"]["data_offsets"];
                }),
                {"step0.positions", "step0.tokens"}, "overlaps"});
  // --- byte length vs shape and dtype
  cs.push_back({"wrong-byte-length", mutated([&](ojson& h) { h["step0.embed"]["shape"] = {7, 63}; }),
                {"step0.embed"}, "byte length"});
  cs.push_back({"wrong-byte-length-dtype", mutated([&](ojson& h) { h["step0.embed"]["dtype"] = "F64"; }),
                {"step0.embed"}, "byte length"});
  cs.push_back({"scalar-shape-for-a-vector", mutated([&](ojson& h) { h["step0.tokens"]["shape"] = ojson::array(); }),
                {"step0.tokens"}, "byte length"});
  // --- names and dtypes
  {
    // JSON objects cannot hold a key twice: rename a key in the raw text.
    std::string h = raw.header;
    const size_t at = h.find("\"step0.positions\"");
    h.replace(at, std::string("\"step0.positions\"").size(), "\"step0.tokens\"   ");
    cs.push_back({"duplicate-names", assemble(h, D), {"step0.tokens"}, "duplicate"});
  }
  cs.push_back({"unknown-dtype", mutated([&](ojson& h) { h["step0.embed"]["dtype"] = "F8_E4M3"; }),
                {"step0.embed"}, "unknown dtype 'F8_E4M3'"});
  cs.push_back({"lowercase-dtype", mutated([&](ojson& h) { h["step0.embed"]["dtype"] = "f32"; }), {"step0.embed"},
                "unknown dtype"});
  cs.push_back({"dtype-not-a-string", mutated([&](ojson& h) { h["step0.embed"]["dtype"] = 4; }), {"step0.embed"},
                "dtype"});
  cs.push_back({"entry-not-an-object", mutated([&](ojson& h) { h["step0.embed"] = {1, 2}; }), {"step0.embed"},
                "not an object"});
  cs.push_back({"entry-lacks-offsets", mutated([&](ojson& h) { h["step0.embed"].erase("data_offsets"); }),
                {"step0.embed"}, "data_offsets"});
  cs.push_back({"entry-lacks-shape", mutated([&](ojson& h) { h["step0.embed"].erase("shape"); }), {"step0.embed"},
                "shape"});
  cs.push_back({"entry-lacks-dtype", mutated([&](ojson& h) { h["step0.embed"].erase("dtype"); }), {"step0.embed"},
                "dtype"});
  // --- metadata
  cs.push_back({"metadata-non-string-value", mutated([&](ojson& h) { h["__metadata__"]["steps"] = 1; }),
                {"__metadata__"}, "'steps'"});
  cs.push_back({"metadata-nested-object", mutated([&](ojson& h) { h["__metadata__"]["config"] = ojson::object(); }),
                {"__metadata__"}, "'config'"});
  cs.push_back({"metadata-null-value", mutated([&](ojson& h) { h["__metadata__"]["model"] = nullptr; }),
                {"__metadata__"}, "'model'"});
  cs.push_back({"metadata-not-a-map", mutated([&](ojson& h) { h["__metadata__"] = ojson::array({"format", "llm-dump/1"}); }),
                {"__metadata__"}, "not a map"});
  cs.push_back({"metadata-a-string", mutated([&](ojson& h) { h["__metadata__"] = "llm-dump/1"; }),
                {"__metadata__"}, "not a map"});
  // --- shapes
  cs.push_back({"shape-negative-dim", mutated([&](ojson& h) { h["step0.embed"]["shape"] = {-7, -64}; }),
                {"step0.embed"}, "negative"});
  cs.push_back({"shape-dim-over-int64", mutated([&](ojson& h) {
                  h["step0.embed"]["shape"] = {uint64_t(1) << 63, 1};
                }),
                {"step0.embed"}, "oversized"});
  cs.push_back({"shape-product-overflows-u64", mutated([&](ojson& h) {
                  h["step0.embed"]["shape"] = {int64_t(1) << 40, int64_t(1) << 40};
                }),
                {"step0.embed"}, "overflows"});
  cs.push_back({"shape-product-overflows-i64", mutated([&](ojson& h) {
                  h["step0.embed"]["shape"] = {int64_t(1) << 62, 2};  // 2^63 elements
                }),
                {"step0.embed"}, "overflows"});
  cs.push_back({"shape-bytes-overflow", mutated([&](ojson& h) {
                  h["step0.embed"]["shape"] = {int64_t(1) << 31, int64_t(1) << 31};  // x 4 bytes = 2^64
                }),
                {"step0.embed"}, "overflows"});
  cs.push_back({"shape-fractional-dim", mutated([&](ojson& h) { h["step0.embed"]["shape"] = {7.0, 64.5}; }),
                {"step0.embed"}, "non-integer"});
  cs.push_back({"shape-not-an-array", mutated([&](ojson& h) { h["step0.embed"]["shape"] = "[7, 64]"; }),
                {"step0.embed"}, "not an array"});
  return cs;
}

void check_error(const FormatError& e, const Case& c, const std::string& file) {
  EXPECT_EQ(e.file(), file);
  EXPECT_TRUE(c.tensors.count(e.tensor())) << "named tensor '" << e.tensor() << "'";
  const std::string msg = e.what();
  EXPECT_EQ(msg.rfind(file, 0), 0u) << msg;  // starts with the file
  if (!e.tensor().empty()) {
    EXPECT_NE(msg.find("'" + e.tensor() + "'"), std::string::npos) << msg;
  }
  EXPECT_NE(msg.find(c.phrase), std::string::npos) << "'" << c.phrase << "' not in: " << msg;
}

TEST(Malformed, EveryFileGivesATypedErrorNamingFileAndTensor) {
  const auto cases = corpus();
  EXPECT_GE(cases.size(), 40u);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = temp_path(c.name + ".safetensors");
    write_bytes(path, c.bytes);
    try {
      SafetensorsFile f(path);
      ADD_FAILURE() << "accepted";
    } catch (const FormatError& e) {
      check_error(e, c, path);
    }
    // DumpFile (what every command opens) reports the same.
    try {
      DumpFile d(path);
      ADD_FAILURE() << "accepted";
    } catch (const FormatError& e) {
      check_error(e, c, path);
    }
  }
}

TEST(Malformed, ExactSizeBuffersGiveTheSameErrors) {
  // An exactly sized heap copy lets ASan catch any read past the end.
  for (const Case& c : corpus()) {
    SCOPED_TRACE(c.name);
    std::unique_ptr<uint8_t[]> buf(new uint8_t[c.bytes.size() + (c.bytes.empty() ? 1 : 0)]);
    std::copy(c.bytes.begin(), c.bytes.end(), buf.get());
    try {
      parse_safetensors(buf.get(), c.bytes.size(), "<" + c.name + ">");
      ADD_FAILURE() << "accepted";
    } catch (const FormatError& e) {
      check_error(e, c, "<" + c.name + ">");
    }
  }
}

TEST(MalformedBase, TheBaseFileAndItsReserialisationAreValid) {
  // The corpus only means something if the unmutated source passes.
  const Bytes& base = base_bytes();
  const RawFile raw = split_raw(base);
  EXPECT_NO_THROW(parse_safetensors(base.data(), base.size(), "base"));
  const Bytes again = with_header(ojson::parse(raw.header), raw.data);
  ParsedHeader h = parse_safetensors(again.data(), again.size(), "again");
  EXPECT_EQ(h.tensors.size(), 53u);
  // A header with no tensors at all is valid too.
  const Bytes empty = assemble("{}      ", {});
  EXPECT_TRUE(parse_safetensors(empty.data(), empty.size(), "empty").tensors.empty());
  // Unreferenced bytes between tensors are tolerated (not overlapping).
  ojson hole = ojson::parse(raw.header);
  for (auto it = hole.begin(); it != hole.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    auto& o = it.value()["data_offsets"];
    o = {o[0].get<uint64_t>() + 4, o[1].get<uint64_t>() + 4};
  }
  Bytes shifted_data(4, 0);
  shifted_data.insert(shifted_data.end(), raw.data.begin(), raw.data.end());
  const Bytes shifted = with_header(hole, shifted_data);
  EXPECT_EQ(parse_safetensors(shifted.data(), shifted.size(), "shifted").tensors.size(), 53u);
}

// ------------------------------------------------------------ random mutations

// A small valid file with every dtype, a zero-sized tensor and metadata.
Bytes small_valid_file() {
  const std::string path = temp_path("fuzz-base.safetensors");
  SafetensorsWriter w(path);
  w.set_metadata("format", "llm-dump/1");
  w.set_metadata("steps", "1");
  const uint8_t bytes[64] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  w.add("step0.tokens", DType::I64, {2}, bytes, 16);
  w.add("a", DType::F16, {2, 3}, bytes, 12);
  w.add("b", DType::BF16, {4}, bytes, 8);
  w.add("c", DType::U8, {3}, bytes, 3);
  w.add("d", DType::F32, {0, 5}, bytes, 0);
  w.add("e", DType::F64, {1}, bytes, 8);
  w.add("f", DType::BOOL, {1}, bytes, 1);
  w.finish();
  return read_bytes(path);
}

// Parses `b` from an exactly sized buffer. Success must come with views that
// lie inside the buffer (touched byte by byte so ASan would see an overread);
// failure must be a FormatError naming the label.
void parse_or_typed_error(const Bytes& b, const std::string& what) {
  std::vector<uint8_t> buf(b);
  buf.shrink_to_fit();
  try {
    ParsedHeader h = parse_safetensors(buf.data(), buf.size(), "fuzz.safetensors");
    ASSERT_LE(h.data_start, buf.size()) << what;
    unsigned sum = 0;
    for (const auto& t : h.tensors) {
      ASSERT_LE(t.begin, t.end) << what;
      ASSERT_LE(t.end, buf.size() - h.data_start) << what;
      ASSERT_EQ(t.nbytes(), size_t(t.numel()) * dtype_size(t.dtype)) << what;
      for (uint64_t k = t.begin; k < t.end; ++k) sum += buf[h.data_start + k];
    }
    (void)sum;
  } catch (const FormatError& e) {
    EXPECT_EQ(e.file(), "fuzz.safetensors") << what;
    EXPECT_EQ(std::string(e.what()).rfind("fuzz.safetensors", 0), 0u) << what;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": untyped error " << e.what();
  }
}

TEST(MalformedFuzz, EveryTruncationIsRejectedWithATypedError) {
  const Bytes b = small_valid_file();
  for (size_t n = 0; n < b.size(); ++n) {
    // Any proper prefix lacks data the header promises (or the header itself).
    Bytes cut(b.begin(), b.begin() + long(n));
    std::vector<uint8_t> buf(cut);
    EXPECT_THROW(parse_safetensors(buf.data(), buf.size(), "fuzz.safetensors"), FormatError) << n;
    parse_or_typed_error(cut, "prefix " + std::to_string(n));
  }
}

TEST(MalformedFuzz, RandomMutationsNeverCrash) {
  const Bytes base = small_valid_file();
  const std::string header = split_raw(base).header;
  const Bytes data = split_raw(base).data;
  std::mt19937_64 rng(20240521);
  const std::vector<std::string> numbers = {"-1", "0", "1", "7", "4294967296", "9223372036854775807",
                                            "9223372036854775808", "18446744073709551615",
                                            "18446744073709551616", "1e400", "-0", "0.5", "1e3", "99999999999"};
  const std::vector<std::string> tokens = {"\"F32\"", "\"Q8\"", "null", "[]", "{}", "true", "\"\"", "[1,2,3]",
                                           "\"__metadata__\"", "\"dtype\"", "\"shape\"", "\"data_offsets\""};
  // Positions of number runs and of quoted strings/values in the header.
  std::vector<std::pair<size_t, size_t>> number_runs, value_runs;
  for (size_t i = 0; i < header.size();) {
    if (isdigit((unsigned char)header[i])) {
      size_t j = i;
      while (j < header.size() && isdigit((unsigned char)header[j])) ++j;
      number_runs.push_back({i, j - i});
      i = j;
    } else if (header[i] == '"') {
      size_t j = header.find('"', i + 1);
      value_runs.push_back({i, j + 1 - i});
      i = j + 1;
    } else {
      ++i;
    }
  }
  for (int iter = 0; iter < 3000; ++iter) {
    std::string h = header;
    Bytes d = data;
    Bytes file;
    const int kind = int(rng() % 5);
    if (kind == 0) {  // replace a number
      auto [at, len] = number_runs[rng() % number_runs.size()];
      h.replace(at, len, numbers[rng() % numbers.size()]);
      file = assemble(h, d);
    } else if (kind == 1) {  // replace a string by another JSON value
      auto [at, len] = value_runs[rng() % value_runs.size()];
      h.replace(at, len, tokens[rng() % tokens.size()]);
      file = assemble(h, d);
    } else if (kind == 2) {  // flip random bytes anywhere, length prefix included
      file = assemble(h, d);
      for (int k = 0, n = 1 + int(rng() % 3); k < n; ++k) file[rng() % file.size()] ^= uint8_t(1 + rng() % 255);
    } else if (kind == 3) {  // grow or shrink the data region
      if (rng() % 2) d.resize(d.size() + rng() % 16, 0);
      else d.resize(d.size() - std::min<size_t>(d.size(), 1 + rng() % 16));
      file = assemble(h, d);
    } else {  // a length prefix that disagrees with the header
      file = assemble(h, d);
      put_header_length(file, header_length(file) + (rng() % 2 ? 1 : -1) * int64_t(1 + rng() % 64));
    }
    parse_or_typed_error(file, "iteration " + std::to_string(iter));
    if (HasFailure()) break;
  }
}

}  // namespace
}  // namespace llmdiff

// Found by fuzz/fuzz_config: the JSON parser's message quotes the bytes it
// last read, raw. Every typed error's message is printable ASCII, the byte
// shown as \xNN.
TEST(MalformedMessages, RawBytesFromTheInputAreEscaped) {
  const std::string text = std::string("{\"model_type\": \"llama\"") + char(0x9c) + char(0x01) + "}";
  try {
    llmdiff::parse_config(text, "fuzz/config.json");
    FAIL() << "accepted";
  } catch (const llmdiff::ConfigError& e) {
    const std::string what = e.what();
    for (unsigned char c : what) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << what;
    EXPECT_NE(what.find("\\x9c"), std::string::npos) << what;
    EXPECT_NE(what.find("fuzz/config.json"), std::string::npos) << what;
  }
  // Any typed error, whatever its text.
  EXPECT_STREQ(llmdiff::FormatError("f", std::string("t\xff"), "bad\n").what(), "f: tensor 't\\xff': bad\\x0a");
}
