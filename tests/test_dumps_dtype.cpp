// bfloat16 / float16 conversions against an independent reference: exact
// widening, round-to-nearest-even narrowing, NaN/Inf, subnormals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "dumps/base/dtype.h"

namespace llmdiff {
namespace {

float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A 16-bit float format described by its exponent and mantissa widths.
struct Format {
  int exp_bits, man_bits;
  int bias() const { return (1 << (exp_bits - 1)) - 1; }
  uint16_t exp_mask() const { return uint16_t(((1 << exp_bits) - 1) << man_bits); }
  uint16_t man_mask() const { return uint16_t((1 << man_bits) - 1); }
  bool is_nan(uint16_t h) const { return (h & exp_mask()) == exp_mask() && (h & man_mask()) != 0; }
  // Exact value of a bit pattern, from the IEEE definition.
  double value(uint16_t h) const {
    const int e = (h & exp_mask()) >> man_bits;
    const int m = h & man_mask();
    const double sign = (h >> 15) ? -1.0 : 1.0;
    if (e == (1 << exp_bits) - 1) return m ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
    if (e == 0) return sign * std::ldexp(double(m), 1 - bias() - man_bits);
    return sign * std::ldexp(double((1 << man_bits) + m), e - bias() - man_bits);
  }
  uint16_t inf() const { return exp_mask(); }
  uint16_t max_finite() const { return uint16_t(exp_mask() - 1); }
};
const Format kHalf{5, 10};
const Format kBF16{8, 7};
// How gtest names a format parameter.
void PrintTo(const Format* f, std::ostream* os) { *os << (f == &kHalf ? "f16" : "bf16"); }

// Reference narrowing of a finite or infinite float: the nearest value, ties to
// the even pattern; beyond the largest finite value by half an ulp or more: Inf.
uint16_t reference_narrow(const Format& fmt, float x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(double(x));
  const double max = fmt.value(fmt.max_finite());
  const double top_ulp = max - fmt.value(uint16_t(fmt.max_finite() - 1));
  if (a >= max + top_ulp / 2) return sign | fmt.inf();  // the tie goes to Inf: max's mantissa is odd
  // Non-negative finite patterns are ordered like their values: bisect.
  uint16_t lo = 0, hi = fmt.max_finite();
  while (hi - lo > 1) {
    uint16_t mid = uint16_t((lo + hi) / 2);
    (fmt.value(mid) <= a ? lo : hi) = mid;
  }
  if (fmt.value(hi) <= a) lo = hi;
  if (lo == fmt.max_finite() || fmt.value(lo) == a) return sign | lo;
  const uint16_t up = uint16_t(lo + 1);
  const double dl = a - fmt.value(lo), du = fmt.value(up) - a;
  if (dl < du) return sign | lo;
  if (du < dl) return sign | up;
  return sign | ((lo & 1) ? up : lo);
}

uint16_t narrow(const Format& fmt, float x) { return &fmt == &kHalf ? f32_to_f16(x) : f32_to_bf16(x); }
float widen(const Format& fmt, uint16_t h) { return &fmt == &kHalf ? f16_to_f32(h) : bf16_to_f32(h); }

class Half16 : public ::testing::TestWithParam<const Format*> {};

TEST_P(Half16, WideningIsExactForEveryPattern) {
  const Format& fmt = *GetParam();
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = widen(fmt, uint16_t(h));
    const double ref = fmt.value(uint16_t(h));
    if (fmt.is_nan(uint16_t(h))) {
      ASSERT_TRUE(std::isnan(f)) << h;
      ASSERT_EQ(std::signbit(f), bool(h >> 15)) << h;
    } else {
      ASSERT_EQ(double(f), ref) << h;
      ASSERT_EQ(std::signbit(f), bool(h >> 15)) << h;  // -0 stays -0
    }
  }
}

TEST_P(Half16, EveryPatternSurvivesARoundTrip) {
  const Format& fmt = *GetParam();
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t back = narrow(fmt, widen(fmt, uint16_t(h)));
    if (fmt.is_nan(uint16_t(h))) {
      ASSERT_TRUE(fmt.is_nan(back)) << h;
      ASSERT_EQ(back >> 15, h >> 15) << h;
    } else {
      ASSERT_EQ(back, h) << h;
    }
  }
}

TEST_P(Half16, MidpointsRoundToEvenAndNeighboursToNearest) {
  // Every midpoint between consecutive finite values (subnormals included) is
  // exactly representable in float32: it must round to the even pattern, and
  // the floats just below/above it to the lower/upper value.
  const Format& fmt = *GetParam();
  for (uint16_t lo = 0; lo < fmt.max_finite(); ++lo) {
    const uint16_t up = uint16_t(lo + 1);
    const float mid = float((fmt.value(lo) + fmt.value(up)) / 2);
    ASSERT_EQ(double(mid), (fmt.value(lo) + fmt.value(up)) / 2);
    const uint16_t even = (lo & 1) ? up : lo;
    ASSERT_EQ(narrow(fmt, mid), even) << lo;
    ASSERT_EQ(narrow(fmt, -mid), even | 0x8000) << lo;
    ASSERT_EQ(narrow(fmt, std::nextafter(mid, 0.0f)), lo) << lo;
    ASSERT_EQ(narrow(fmt, std::nextafter(mid, INFINITY)), up) << lo;
  }
}

TEST_P(Half16, SampledFloatsMatchTheReference) {
  const Format& fmt = *GetParam();
  std::mt19937 rng(7);
  for (int i = 0; i < 400000; ++i) {
    const uint32_t u = rng();
    const float x = float_of(u);
    if (std::isnan(x)) continue;
    ASSERT_EQ(narrow(fmt, x), reference_narrow(fmt, x)) << std::hex << u;
  }
}

TEST_P(Half16, OverflowInfinityAndNaN) {
  const Format& fmt = *GetParam();
  const double max = fmt.value(fmt.max_finite());
  const double half_ulp = (max - fmt.value(uint16_t(fmt.max_finite() - 1))) / 2;
  EXPECT_EQ(narrow(fmt, float(max)), fmt.max_finite());
  EXPECT_EQ(narrow(fmt, std::nextafter(float(max + half_ulp), 0.0f)), fmt.max_finite());
  EXPECT_EQ(narrow(fmt, float(max + half_ulp)), fmt.inf());
  EXPECT_EQ(narrow(fmt, -float(max + half_ulp)), fmt.inf() | 0x8000);
  EXPECT_EQ(narrow(fmt, INFINITY), fmt.inf());
  EXPECT_EQ(narrow(fmt, -INFINITY), fmt.inf() | 0x8000);
  EXPECT_EQ(narrow(fmt, std::numeric_limits<float>::max()), fmt.inf());
  EXPECT_TRUE(std::isinf(widen(fmt, fmt.inf())));
  // NaNs stay NaN, whatever their payload: one that lives only in the low
  // mantissa bits must not collapse to Inf, nor a negative one lose its sign.
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0x7f801000u, 0xff800001u, 0x7fffffffu}) {
    const uint16_t h = narrow(fmt, float_of(nan));
    EXPECT_TRUE(fmt.is_nan(h)) << std::hex << nan << " -> " << h;
    EXPECT_EQ(h >> 15, nan >> 31) << std::hex << nan;
    EXPECT_TRUE(std::isnan(widen(fmt, h)));
  }
}

TEST_P(Half16, SignedZeroAndSubnormals) {
  const Format& fmt = *GetParam();
  EXPECT_EQ(narrow(fmt, 0.0f), 0u);
  EXPECT_EQ(narrow(fmt, -0.0f), 0x8000u);
  const double tiny = fmt.value(1);  // smallest subnormal
  EXPECT_EQ(narrow(fmt, float(tiny)), 1u);
  EXPECT_EQ(narrow(fmt, float(tiny / 2)), 0u);                                // tie to even: 0
  EXPECT_EQ(narrow(fmt, std::nextafter(float(tiny / 2), 1.0f)), 1u);          // just above the tie
  EXPECT_EQ(narrow(fmt, float(tiny * 1.5)), 2u);                              // tie 1|2 -> 2
  EXPECT_EQ(narrow(fmt, -float(tiny * 2.5)), 0x8002u);                        // tie 2|3 -> 2
  EXPECT_EQ(narrow(fmt, float_of(1)), 0u);                                    // float32 subnormal
  const uint16_t largest_sub = fmt.man_mask();
  const uint16_t smallest_normal = uint16_t(largest_sub + 1);
  EXPECT_EQ(double(widen(fmt, largest_sub)), fmt.value(largest_sub));
  EXPECT_EQ(double(widen(fmt, smallest_normal)), std::ldexp(1.0, 1 - fmt.bias()));
  EXPECT_EQ(narrow(fmt, float(fmt.value(largest_sub))), largest_sub);
}

INSTANTIATE_TEST_SUITE_P(Formats, Half16, ::testing::Values(&kHalf, &kBF16),
                         [](const ::testing::TestParamInfo<const Format*>& i) {
                           return std::string(i.param == &kHalf ? "f16" : "bf16");
                         });

TEST(DtypeConvert, KnownValues) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65519.99f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(bf16_to_f32(0x0001), std::ldexp(1.0f, -133));
  // 1 + 2^-8 is the bf16 tie between 1 and 1 + 2^-7: to even (1).
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
}

TEST(DtypeConvert, ConvertToF32HandlesEveryDtype) {
  const uint16_t halves[3] = {0x3c00, 0xc000, 0x7c00};
  float out[3];
  convert_to_f32(halves, DType::F16, 3, out);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
  EXPECT_TRUE(std::isinf(out[2]));
  const uint16_t bf[3] = {0x3f80, 0xc040, 0xff80};
  convert_to_f32(bf, DType::BF16, 3, out);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -3.0f);
  EXPECT_EQ(out[2], -INFINITY);
  const double d[3] = {0.1, -1e40, 1e-50};
  convert_to_f32(d, DType::F64, 3, out);
  EXPECT_EQ(out[0], 0.1f);
  EXPECT_EQ(out[1], -INFINITY);
  EXPECT_EQ(out[2], 0.0f);
  const int64_t big[2] = {-(int64_t(1) << 40), 16777217};
  convert_to_f32(big, DType::I64, 2, out);
  EXPECT_EQ(out[0], -std::ldexp(1.0f, 40));
  EXPECT_EQ(out[1], 16777216.0f);  // nearest float
  const int8_t i8[3] = {-128, 0, 127};
  convert_to_f32(i8, DType::I8, 3, out);
  EXPECT_EQ(out[0], -128.0f);
  EXPECT_EQ(out[2], 127.0f);
  const uint8_t b[3] = {0, 2, 1};
  convert_to_f32(b, DType::BOOL, 3, out);
  EXPECT_EQ(out[1], 1.0f);  // any non-zero byte is true
  // Unaligned sources are fine.
  alignas(8) uint8_t raw[12] = {};
  const float v = 3.25f;
  std::memcpy(raw + 1, &v, 4);
  convert_to_f32(raw + 1, DType::F32, 1, out);
  EXPECT_EQ(out[0], 3.25f);
  EXPECT_EQ(load_as_double(raw + 1, DType::F32, 0), 3.25);
  const int16_t s16[2] = {-32768, 32767};
  EXPECT_EQ(load_as_double(s16, DType::I16, 0), -32768.0);
  const int32_t s32[2] = {INT32_MIN, 5};
  EXPECT_EQ(load_as_double(s32, DType::I32, 0), double(INT32_MIN));
}

}  // namespace
}  // namespace llmdiff
