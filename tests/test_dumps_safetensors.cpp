// safetensors reader on the golden files, typed views of every dtype, and the
// streaming writer: round trip, deterministic bytes, padding, atomicity.
#include <ftw.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "dumps/base/dtype.h"
#include "dumps/base/errors.h"
#include "dumps/formats/safetensors.h"
#include "tests/support.h"
#include "tests/test_dumps_helpers.h"

namespace llmdiff {
namespace {

using namespace llmdiff::testing;

// Removes this process's temporary directory (written files include some
// tens of MB) once all tests have run.
class RemoveTempDir : public ::testing::Environment {
 public:
  void TearDown() override {
    std::string dir = temp_path("");
    dir.pop_back();  // the trailing '/'
    ::nftw(
        dir.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
        FTW_DEPTH | FTW_PHYS);
  }
};
[[maybe_unused]] ::testing::Environment* const kRemoveTempDir =
    ::testing::AddGlobalTestEnvironment(new RemoveTempDir);

std::vector<std::string> golden_safetensors_files() {
  std::vector<std::string> out;
  for (const auto& m : golden_models())
    for (const auto& f : list_dir(golden_model(m)))
      if (f.size() > 12 && f.compare(f.size() - 12, 12, ".safetensors") == 0) out.push_back(golden_model(m) + "/" + f);
  return out;
}

TEST(SafetensorsGolden, EveryGoldenFileReadsAndViewsItsOwnBytes) {
  const auto files = golden_safetensors_files();
  // Every model with model.safetensors and three dumps; two also with HF
  // generate's sample dump, two with its batched dump.
  ASSERT_EQ(files.size(), golden_models().size() * 4 + 2 + 2);
  for (const auto& path : files) {
    SCOPED_TRACE(path);
    SafetensorsFile f(path);
    const Bytes raw = read_bytes(path);
    const size_t data_start = 8 + header_length(raw);
    ASSERT_FALSE(f.tensors().empty());
    EXPECT_EQ(f.path(), path);

    // The tensors tile the data region exactly, and each view points at the
    // tensor's own bytes in the file.
    std::vector<const TensorInfo*> by_offset;
    for (const auto& t : f.tensors()) by_offset.push_back(&t);
    std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
    uint64_t expect_begin = 0;
    for (const TensorInfo* t : by_offset) {
      EXPECT_EQ(t->begin, expect_begin) << t->name;
      expect_begin = t->end;
      EXPECT_EQ(t->nbytes(), size_t(t->numel()) * dtype_size(t->dtype)) << t->name;
      EXPECT_EQ(std::memcmp(f.data(*t), raw.data() + data_start + t->begin, t->nbytes()), 0) << t->name;
      EXPECT_EQ(f.find(t->name), t);
      EXPECT_EQ(&f.at(t->name), t);
    }
    EXPECT_EQ(data_start + expect_begin, raw.size());

    // Float32 views are the stored values; BF16 widens exactly; I64 is verbatim.
    for (const auto& t : f.tensors()) {
      if (t.dtype == DType::F32) {
        std::vector<float> v = f.to_f32(t);
        EXPECT_EQ(std::memcmp(v.data(), f.data(t), t.nbytes()), 0) << t.name;
      } else if (t.dtype == DType::BF16) {
        std::vector<float> v = f.to_f32(t);
        const auto* h = static_cast<const uint8_t*>(f.data(t));
        for (size_t i = 0; i < v.size(); ++i) {
          uint16_t bits = uint16_t(h[2 * i] | (h[2 * i + 1] << 8));
          ASSERT_EQ(f32_to_bf16(v[i]), bits) << t.name << "[" << i << "]";
        }
      } else if (t.dtype == DType::I64) {
        std::vector<int64_t> v = f.to_i64(t);
        EXPECT_EQ(std::memcmp(v.data(), f.data(t), t.nbytes()), 0) << t.name;
      } else {
        ADD_FAILURE() << t.name << ": unexpected dtype " << dtype_name(t.dtype);
      }
    }
    const bool is_weights = path.size() >= 18 && path.compare(path.size() - 18, 18, "/model.safetensors") == 0;
    if (is_weights) {
      EXPECT_EQ(f.metadata().at("format"), "pt");
    } else {
      EXPECT_EQ(f.metadata().at("format"), "llm-dump/1");
    }
  }
}

TEST(SafetensorsGolden, MissingTensorIsATypedErrorNamingFileAndTensor) {
  const std::string path = golden_dump("llama-gqa", "prefill");
  SafetensorsFile f(path);
  EXPECT_EQ(f.find("step0.nope"), nullptr);
  expect_error<MissingTensorError>([&] { f.at("step0.nope"); }, {path, "step0.nope"});
}

TEST(SafetensorsGolden, NonexistentPathAndDirectoryAreIoErrors) {
  const std::string missing = temp_path("does-not-exist.safetensors");
  try {
    SafetensorsFile f(missing);
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.file(), missing);
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos);
  }
  expect_error<IoError>([&] { SafetensorsFile f(golden_dir()); }, {golden_dir()});
}

// ------------------------------------------------------------- typed views

TEST(SafetensorsViews, EveryDtypeRoundTripsThroughWriterAndReader) {
  const std::string path = temp_path("all-dtypes.safetensors");
  const std::vector<double> f64 = {1.0 / 3.0, -1e300, 0.0, 5e-324};
  const std::vector<float> f32 = {1.5f, -0.0f, std::numeric_limits<float>::infinity(), 1e-45f};
  const std::vector<uint16_t> f16 = {0x3c00 /*1*/, 0xc000 /*-2*/, 0x0001 /*2^-24*/, 0x7bff /*65504*/};
  const std::vector<uint16_t> bf16 = {0x3f80 /*1*/, 0xc040 /*-3*/, 0x0001, 0x7f7f};
  const std::vector<int64_t> i64 = {INT64_MIN, -1, (int64_t(1) << 53) + 1, INT64_MAX};
  const std::vector<int32_t> i32 = {INT32_MIN, -7, 0, INT32_MAX};
  const std::vector<int16_t> i16 = {INT16_MIN, -1, 300, INT16_MAX};
  const std::vector<int8_t> i8 = {-128, -1, 0, 127};
  const std::vector<uint8_t> u8 = {0, 1, 200, 255};
  const std::vector<uint8_t> boolean = {0, 1, 1, 0};
  {
    SafetensorsWriter w(path);
    w.add("f64", DType::F64, {2, 2}, f64.data(), 32);
    w.add("f32", DType::F32, {4}, f32.data(), 16);
    w.add("f16", DType::F16, {4, 1}, f16.data(), 8);
    w.add("bf16", DType::BF16, {1, 4}, bf16.data(), 8);
    w.add("i64", DType::I64, {4}, i64.data(), 32);
    w.add("i32", DType::I32, {4}, i32.data(), 16);
    w.add("i16", DType::I16, {4}, i16.data(), 8);
    w.add("i8", DType::I8, {4}, i8.data(), 4);
    w.add("u8", DType::U8, {2, 2}, u8.data(), 4);
    w.add("bool", DType::BOOL, {4}, boolean.data(), 4);
    const float scalar = 42.0f;
    w.add_f32("scalar", {}, &scalar);
    w.add_f32("empty", {0, 3}, nullptr);
    w.finish();
  }
  SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), 12u);
  // File order is the order of add().
  EXPECT_EQ(f.tensors()[0].name, "f64");
  EXPECT_EQ(f.tensors()[9].name, "bool");
  EXPECT_EQ(f.at("f64").shape, (Shape{2, 2}));
  EXPECT_EQ(f.at("u8").dtype, DType::U8);

  auto f64v = f.to_f32(f.at("f64"));
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(f64v[i], float(f64[i]));
  EXPECT_EQ(load_as_double(f.data(f.at("f64")), DType::F64, 0), 1.0 / 3.0);
  auto f32v = f.to_f32(f.at("f32"));
  EXPECT_EQ(std::memcmp(f32v.data(), f32.data(), 16), 0);
  EXPECT_EQ(f.to_f32(f.at("f16")), (std::vector<float>{1.0f, -2.0f, std::ldexp(1.0f, -24), 65504.0f}));
  auto bfv = f.to_f32(f.at("bf16"));
  EXPECT_EQ(bfv[0], 1.0f);
  EXPECT_EQ(bfv[1], -3.0f);
  EXPECT_EQ(bfv[2], std::ldexp(1.0f, -133));  // smallest bf16 subnormal
  EXPECT_EQ(bfv[3], std::ldexp(255.0f, 120));  // largest finite bf16
  EXPECT_EQ(f.to_i64(f.at("i64")), i64);  // exact beyond 2^53
  EXPECT_EQ(f.to_i64(f.at("i32")), (std::vector<int64_t>{INT32_MIN, -7, 0, INT32_MAX}));
  EXPECT_EQ(f.to_i64(f.at("i16")), (std::vector<int64_t>{INT16_MIN, -1, 300, INT16_MAX}));
  EXPECT_EQ(f.to_i64(f.at("i8")), (std::vector<int64_t>{-128, -1, 0, 127}));
  EXPECT_EQ(f.to_i64(f.at("u8")), (std::vector<int64_t>{0, 1, 200, 255}));
  EXPECT_EQ(f.to_i64(f.at("bool")), (std::vector<int64_t>{0, 1, 1, 0}));
  EXPECT_EQ(f.to_f32(f.at("i8")), (std::vector<float>{-128, -1, 0, 127}));
  EXPECT_EQ(f.to_f32(f.at("bool")), (std::vector<float>{0, 1, 1, 0}));
  EXPECT_EQ(f.to_f32(f.at("scalar")), std::vector<float>{42.0f});
  EXPECT_EQ(f.at("scalar").numel(), 1);
  EXPECT_EQ(f.at("empty").numel(), 0);
  EXPECT_TRUE(f.to_f32(f.at("empty")).empty());
  EXPECT_EQ(f.at("empty").nbytes(), 0u);
}

TEST(SafetensorsViews, DtypeTables) {
  for (DType t : {DType::F64, DType::F32, DType::F16, DType::BF16, DType::I64, DType::I32, DType::I16, DType::I8,
                  DType::U8, DType::BOOL}) {
    auto back = parse_dtype(dtype_name(t));
    ASSERT_TRUE(back.has_value()) << dtype_name(t);
    EXPECT_EQ(*back, t);
  }
  EXPECT_EQ(dtype_size(DType::F64), 8u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::BOOL), 1u);
  EXPECT_TRUE(dtype_is_float(DType::F16));
  EXPECT_FALSE(dtype_is_float(DType::U8));
  for (const char* bad : {"", "f32", "F8_E4M3", "Q4_0", "int64", "F32 "}) EXPECT_FALSE(parse_dtype(bad).has_value()) << bad;
  EXPECT_EQ(shape_str({4, 7, 16}), "[4, 7, 16]");
  EXPECT_EQ(shape_str({}), "[]");
  EXPECT_EQ(numel({}), 1);
  EXPECT_EQ(numel({3, 0, 5}), 0);
}

// ------------------------------------------------------------------ writer

// Copies every tensor and the metadata of `src` into a new file at `dst`, in
// file order.
void rewrite(const SafetensorsFile& src, const std::string& dst) {
  SafetensorsWriter w(dst);
  for (const auto& [k, v] : src.metadata()) w.set_metadata(k, v);
  for (const auto& t : src.tensors()) w.add(t.name, t.dtype, t.shape, src.data(t), t.nbytes());
  w.finish();
}

TEST(SafetensorsWriter, GoldenRewriteKeepsTensorsAndIsByteIdenticalWhenRepeated) {
  for (const auto& model : golden_models()) {
    for (const std::string what : {"model", "decode"}) {
      SCOPED_TRACE(model + "/" + what);
      const std::string src_path = golden_model(model) + "/" + what + ".safetensors";
      SafetensorsFile src(src_path);
      const std::string a = temp_path("rewrite-a.safetensors"), b = temp_path("rewrite-b.safetensors");
      rewrite(src, a);
      SafetensorsFile fa(a);
      rewrite(fa, b);
      EXPECT_EQ(read_bytes(a), read_bytes(b));

      // Same tensors, same offsets, same metadata; the data region is the golden one.
      ASSERT_EQ(fa.tensors().size(), src.tensors().size());
      for (size_t i = 0; i < src.tensors().size(); ++i) {
        const TensorInfo &x = src.tensors()[i], &y = fa.tensors()[i];
        EXPECT_EQ(x.name, y.name);
        EXPECT_EQ(x.dtype, y.dtype);
        EXPECT_EQ(x.shape, y.shape);
        EXPECT_EQ(x.begin, y.begin);
        EXPECT_EQ(x.end, y.end);
      }
      EXPECT_EQ(fa.metadata(), src.metadata());
      EXPECT_EQ(split_raw(read_bytes(a)).data, split_raw(read_bytes(src_path)).data);
    }
  }
}

TEST(SafetensorsWriter, SameContentGivesSameBytesWhateverThePath) {
  auto write = [](const std::string& path) {
    SafetensorsWriter w(path);
    w.set_metadata("zeta", "last");
    w.set_metadata("alpha", "first");
    const std::vector<float> x = {1, 2, 3, 4, 5, 6};
    const std::vector<int64_t> ids = {7, 8};
    w.add_f32("x", {2, 3}, x.data());
    w.add_i64("ids", {2}, ids.data());
    w.finish();
  };
  const std::string d1 = fresh_dir("same-a"), d2 = fresh_dir("same-b");
  write(d1 + "/one.safetensors");
  write(d2 + "/a-much-longer-file-name.safetensors");
  EXPECT_EQ(read_bytes(d1 + "/one.safetensors"), read_bytes(d2 + "/a-much-longer-file-name.safetensors"));
  SafetensorsFile f(d1 + "/one.safetensors");
  EXPECT_EQ(f.metadata().at("alpha"), "first");
  EXPECT_EQ(f.metadata().at("zeta"), "last");
  EXPECT_EQ(f.to_i64(f.at("ids")), (std::vector<int64_t>{7, 8}));
}

TEST(SafetensorsWriter, HeaderIsPaddedToEightBytesWithSpaces) {
  // Names of every length 1..16 shift the raw JSON length through all residues mod 8.
  for (int len = 1; len <= 16; ++len) {
    const std::string path = temp_path("pad.safetensors");
    const double v = 2.5;
    {
      SafetensorsWriter w(path);
      w.add(std::string(size_t(len), 'n'), DType::F64, {1}, &v, 8);
      w.finish();
    }
    const Bytes b = read_bytes(path);
    const uint64_t n = header_length(b);
    EXPECT_EQ(n % 8, 0u) << len;
    const std::string header = split_raw(b).header;
    const size_t close = header.find_last_of('}');
    ASSERT_NE(close, std::string::npos);
    EXPECT_LT(header.size() - close - 1, 8u);
    for (size_t i = close + 1; i < header.size(); ++i) EXPECT_EQ(header[i], ' ') << len;
    SafetensorsFile f(path);
    EXPECT_EQ(load_as_double(f.data(f.tensors()[0]), DType::F64, 0), 2.5);
    // The data region starts 8-aligned in the file, so F64/I64 data is aligned in the map.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(f.data(f.tensors()[0])) % 8, 0u);
  }
}

TEST(SafetensorsWriter, RejectsInvalidTensorsWithTypedErrors) {
  const std::string dir = fresh_dir("writer-errors");
  const std::string path = dir + "/out.safetensors";
  SafetensorsWriter w(path);
  const std::vector<float> x(6, 1.0f);
  w.add_f32("x", {2, 3}, x.data());
  EXPECT_TRUE(w.has("x"));
  EXPECT_FALSE(w.has("y"));
  expect_error<FormatError>([&] { w.add_f32("x", {2, 3}, x.data()); }, {path, "'x'", "duplicate"});
  expect_error<FormatError>([&] { w.add("y", DType::F32, {2, 3}, x.data(), 20); }, {path, "'y'", "[2, 3]"});
  expect_error<FormatError>([&] { w.add("z", DType::F32, {-2, -3}, x.data(), 24); }, {path, "'z'", "negative"});
  expect_error<FormatError>([&] { w.add("", DType::F32, {1}, x.data(), 4); }, {path});
  expect_error<FormatError>([&] { w.add("__metadata__", DType::F32, {1}, x.data(), 4); }, {path, "__metadata__"});
  w.finish();
  w.finish();  // a second finish() is a no-op
  expect_error<IoError>([&] { w.add_f32("late", {1}, x.data()); }, {path, "late"});
  SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), 1u);  // rejected tensors left no trace
  EXPECT_EQ(f.tensors()[0].end, 24u);
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"out.safetensors"});
}

TEST(SafetensorsWriter, RejectsOverflowingShapesAndNamesThatAreNotUtf8) {
  const std::string dir = fresh_dir("writer-limits");
  const std::string path = dir + "/out.safetensors";
  SafetensorsWriter w(path);
  const float v = 1;
  expect_error<FormatError>([&] { w.add("huge", DType::F32, {int64_t(1) << 40, int64_t(1) << 40}, &v, 4); },
                            {path, "'huge'", "overflows"});
  expect_error<FormatError>([&] { w.add("bytes", DType::F64, {int64_t(1) << 61}, &v, 4); }, {path, "'bytes'"});
  expect_error<FormatError>([&] { w.add_f32("bad\xff\xfename", {1}, &v); }, {path, "invalid tensor name"});
  expect_error<FormatError>([&] { w.set_metadata("k", "\xc3"); }, {path, "__metadata__", "UTF-8"});
  w.set_metadata("k", "caf\xc3\xa9");  // valid UTF-8 is kept verbatim
  w.add_f32("ok", {1}, &v);
  w.finish();
  SafetensorsFile f(path);
  EXPECT_EQ(f.tensors().size(), 1u);
  EXPECT_EQ(f.metadata().at("k"), "caf\xc3\xa9");
}

TEST(SafetensorsViews, IntegerViewOfFloatsTruncatesAndSaturates) {
  const std::string path = temp_path("float-as-int.safetensors");
  const std::vector<float> x = {2.9f, -2.9f, NAN, 1e30f, -INFINITY, 0.0f};
  {
    SafetensorsWriter w(path);
    w.add_f32("x", {6}, x.data());
    w.finish();
  }
  SafetensorsFile f(path);
  EXPECT_EQ(f.to_i64(f.at("x")), (std::vector<int64_t>{2, -2, 0, INT64_MAX, INT64_MIN, 0}));
}

TEST(SafetensorsWriter, UnwritableDestinationIsAnIoError) {
  const std::string path = temp_path("no-such-dir") + "/x.safetensors";
  expect_error<IoError>([&] { SafetensorsWriter w(path); }, {path});
}

TEST(SafetensorsWriter, DestinationDirectoryRemovedBeforeFinishIsAnIoError) {
  const std::string dir = fresh_dir("vanishing");
  const std::string path = dir + "/x.safetensors";
  SafetensorsWriter w(path);
  const float v = 1;
  w.add_f32("v", {1}, &v);
  // Remove the directory under the writer (its data temp is unlinked first).
  for (const auto& e : list_dir(dir)) ::unlink((dir + "/" + e).c_str());
  ASSERT_EQ(::rmdir(dir.c_str()), 0);
  expect_error<IoError>([&] { w.finish(); }, {path});
  EXPECT_FALSE(path_exists(path));
}

// ---------------------------------------------------------------- atomicity

std::vector<std::string> temporaries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : list_dir(dir))
    if (e.find(".tmp.") != std::string::npos) out.push_back(e);
  return out;
}

TEST(SafetensorsWriterAtomic, NormalFinishLeavesOnlyTheFinalFile) {
  const std::string dir = fresh_dir("atomic-ok");
  const std::string path = dir + "/dump.safetensors";
  SafetensorsWriter w(path);
  const std::vector<float> x(100, 0.5f);
  w.add_f32("x", {10, 10}, x.data());
  EXPECT_FALSE(path_exists(path));  // nothing under the final name before finish()
  EXPECT_FALSE(temporaries(dir).empty());
  w.finish();
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"dump.safetensors"});
}

TEST(SafetensorsWriterAtomic, TensorBytesAreStreamedToDiskAsTheyAreAdded) {
  const std::string dir = fresh_dir("atomic-stream");
  SafetensorsWriter w(dir + "/big.safetensors");
  const std::vector<float> chunk(1 << 20, 1.0f);  // 4 MiB per tensor
  for (int i = 0; i < 3; ++i) {
    w.add_f32("t" + std::to_string(i), {1 << 20}, chunk.data());
    auto tmps = temporaries(dir);
    ASSERT_EQ(tmps.size(), 1u);
    struct stat st {};
    ASSERT_EQ(::stat((dir + "/" + tmps[0]).c_str(), &st), 0);
    // All but what stdio still buffers is already in the temporary file.
    EXPECT_GE(uint64_t(st.st_size), uint64_t(i + 1) * (4u << 20) - (1u << 16)) << i;
  }
  w.finish();
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"big.safetensors"});
  EXPECT_EQ(SafetensorsFile(dir + "/big.safetensors").tensors().size(), 3u);
}

TEST(SafetensorsWriterAtomic, WriterDestroyedBeforeFinishLeavesNothing) {
  const std::string dir = fresh_dir("atomic-abandon");
  const std::string path = dir + "/dump.safetensors";
  {
    SafetensorsWriter w(path);
    const std::vector<float> x(1000, 2.0f);
    w.add_f32("x", {1000}, x.data());
  }
  EXPECT_FALSE(path_exists(path));
  EXPECT_TRUE(list_dir(dir).empty());
}

TEST(SafetensorsWriterAtomic, ExistingFileSurvivesAnAbandonedRewriteAndIsReplacedByAFinishedOne) {
  const std::string dir = fresh_dir("atomic-replace");
  const std::string path = dir + "/dump.safetensors";
  const float one = 1.0f, two = 2.0f;
  {
    SafetensorsWriter w(path);
    w.add_f32("v", {1}, &one);
    w.finish();
  }
  const Bytes before = read_bytes(path);
  {
    SafetensorsWriter w(path);
    w.add_f32("v", {1}, &two);
    w.add_f32("w", {1}, &two);
  }
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"dump.safetensors"});
  {
    SafetensorsWriter w(path);
    w.add_f32("v", {1}, &two);
    w.finish();
  }
  SafetensorsFile f(path);
  EXPECT_EQ(f.to_f32(f.at("v")), std::vector<float>{2.0f});
}

TEST(SafetensorsWriterAtomic, KilledWriterProcessLeavesNoFileUnderTheFinalName) {
  const std::string dir = fresh_dir("atomic-kill");
  const std::string path = dir + "/dump.safetensors";
  const std::string old_path = dir + "/old.safetensors";
  const float keep = 7.0f;
  {
    SafetensorsWriter w(old_path);
    w.add_f32("keep", {1}, &keep);
    w.finish();
  }
  const Bytes old_bytes = read_bytes(old_path);

  for (const std::string& target : {path, old_path}) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      // Child: stream a few tensors, report progress, then wait to be killed
      // before finish() is reached.
      ::close(fds[0]);
      SafetensorsWriter w(target);
      std::vector<float> x(1 << 16, 3.0f);
      for (int i = 0; i < 4; ++i) w.add_f32("x" + std::to_string(i), {1 << 16}, x.data());
      char c = 'x';
      if (::write(fds[1], &c, 1) != 1) ::_exit(3);
      for (;;) ::pause();
    }
    ::close(fds[1]);
    char c = 0;
    ASSERT_EQ(::read(fds[0], &c, 1), 1);
    ::close(fds[0]);
    EXPECT_FALSE(temporaries(dir).empty());  // the child was mid-write
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFSIGNALED(status));
    // Only temporaries remain (a killed process cannot clean up); the final
    // name is absent or holds its previous complete content.
    for (const auto& t : temporaries(dir)) ::unlink((dir + "/" + t).c_str());
    EXPECT_FALSE(path_exists(path));
    EXPECT_EQ(read_bytes(old_path), old_bytes);
  }
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"old.safetensors"});
}

TEST(SafetensorsWriterAtomic, ProcessKilledDuringFinishNeverLeavesAPartialFile) {
  // finish() copies the data into a temporary and renames it: whenever the
  // writer dies, the final name is absent or holds the complete file.
  const std::string dir = fresh_dir("atomic-kill-finish");
  const std::string path = dir + "/dump.safetensors";
  constexpr int kTensors = 8, kFloats = 1 << 20;  // 32 MiB of data
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(fds[0]);
    SafetensorsWriter w(path);
    std::vector<float> x(kFloats, 1.0f);
    for (int i = 0; i < kTensors; ++i) w.add_f32("x" + std::to_string(i), {kFloats}, x.data());
    char c = 'f';
    if (::write(fds[1], &c, 1) != 1) ::_exit(3);
    w.finish();
    ::_exit(0);
  }
  ::close(fds[1]);
  char c = 0;
  ASSERT_EQ(::read(fds[0], &c, 1), 1);
  ::close(fds[0]);
  // Kill the child as soon as the temporary of finish() (no ".data" suffix) shows up.
  for (int spin = 0; spin < 200000; ++spin) {
    bool in_finish = false;
    for (const auto& t : temporaries(dir))
      if (t.size() < 5 || t.compare(t.size() - 5, 5, ".data") != 0) in_finish = true;
    if (in_finish || path_exists(path)) break;
  }
  ::kill(pid, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  if (path_exists(path)) {
    SafetensorsFile f(path);  // complete and valid
    EXPECT_EQ(f.tensors().size(), size_t(kTensors));
  }
  for (const auto& t : temporaries(dir)) ::unlink((dir + "/" + t).c_str());
  for (const auto& e : list_dir(dir)) EXPECT_EQ(e, "dump.safetensors");
}

}  // namespace
}  // namespace llmdiff
