// Malformed .npy images: every one is an error naming the file and the array
// (FormatError), never a crash or a silently wrong tensor. The well-formed
// ones numpy writes are tested in tests/test_dumps_import.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "dumps/base/errors.h"
#include "dumps/formats/npy.h"

using namespace llmdiff;

namespace {

// A version-1 .npy image with `header` (padded to 64 bytes as numpy does) and `payload`.
std::vector<uint8_t> npy(const std::string& header, const std::vector<uint8_t>& payload, uint8_t major = 1) {
  std::string h = header;
  const size_t prefix = major == 1 ? 10 : 12;
  while ((prefix + h.size() + 1) % 64 != 0) h += ' ';
  h += '\n';
  std::vector<uint8_t> out = {0x93, 'N', 'U', 'M', 'P', 'Y', major, 0};
  if (major == 1) {
    out.push_back(uint8_t(h.size() & 0xff));
    out.push_back(uint8_t(h.size() >> 8));
  } else {
    for (int i = 0; i < 4; ++i) out.push_back(uint8_t((h.size() >> (8 * i)) & 0xff));
  }
  out.insert(out.end(), h.begin(), h.end());
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

std::vector<uint8_t> floats(std::initializer_list<float> v) {
  std::vector<uint8_t> out(v.size() * 4);
  std::memcpy(out.data(), v.begin(), out.size());
  return out;
}

void expect_error(const std::vector<uint8_t>& image, const std::string& what) {
  SCOPED_TRACE(what);
  try {
    parse_npy(image.data(), image.size(), "bad.npy", "arr");
    ADD_FAILURE() << "accepted";
  } catch (const FormatError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("bad.npy"), std::string::npos) << m;
  }
}

}  // namespace

TEST(DumpsNpy, AWellFormedImageParses) {
  const auto img = npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }", floats({1, 2, 3, 4}));
  const TensorData t = parse_npy(img.data(), img.size(), "ok.npy", "arr");
  EXPECT_EQ(t.shape, (Shape{2, 2}));
  EXPECT_EQ(t.f, (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(npy_shape_of(img.data(), img.size(), "ok.npy", "arr"), (Shape{2, 2}));
  const auto v2 = npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", floats({1, 2, 3, 4}), 2);
  EXPECT_EQ(parse_npy(v2.data(), v2.size(), "ok.npy", "arr").shape, (Shape{4}));
}

TEST(DumpsNpy, MalformedImagesAreErrorsNamingTheFile) {
  const std::string good = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }";
  const auto data = floats({1, 2, 3, 4});
  auto image = npy(good, data);
  // Not an .npy at all, or cut short anywhere in its header or data.
  expect_error({'n', 'o', 't'}, "no magic");
  for (size_t n : {size_t(0), size_t(5), size_t(9), size_t(20), image.size() - 1}) {
    std::vector<uint8_t> cut(image.begin(), image.begin() + long(n));
    expect_error(cut, "truncated at " + std::to_string(n));
  }
  // An unknown format version, a header length beyond the file.
  auto version = image;
  version[6] = 9;
  expect_error(version, "version 9");
  auto long_header = image;
  long_header[8] = 0xff, long_header[9] = 0xff;
  expect_error(long_header, "header length past the end");
  // Headers that are not numpy's dictionary, or miss or garble a key.
  expect_error(npy("[1, 2]", data), "not a dict");
  expect_error(npy("{'descr': '<f4', 'shape': (2, 2), }", data), "no fortran_order");
  expect_error(npy("{'fortran_order': False, 'shape': (2, 2), }", data), "no descr");
  expect_error(npy("{'descr': '<f4', 'fortran_order': False, }", data), "no shape");
  expect_error(npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -2), }", data), "negative dim");
  expect_error(npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, x), }", data), "garbled shape");
  expect_error(npy("{'descr': '|O', 'fortran_order': False, 'shape': (2, 2), }", data), "object arrays");
  expect_error(npy("{'descr': '<c8', 'fortran_order': False, 'shape': (2, 2), }", data), "complex");
  expect_error(npy("{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2, 2), }", data), "fortran_order not a bool");
  // A payload shorter than the shape says, a shape whose element count overflows.
  expect_error(npy(good, floats({1, 2, 3})), "short payload");
  expect_error(npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 4), }", data),
               "element count overflow");
}
