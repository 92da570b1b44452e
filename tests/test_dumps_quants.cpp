// ggml tensor types: dequantisation of every supported type checked bit for
// bit on blocks built byte by byte from ggml's block layouts (ggml-common.h),
// with the expected floats computed here element by element from the
// format's definition; the reference quantisers' round-trip error and exact
// cases; block sizes and errors for unsupported types.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "dumps/base/errors.h"
#include "dumps/formats/ggml_types.h"

namespace llmdiff {
namespace {

using Bytes = std::vector<uint8_t>;

// ------------------------------------------------------------------ scalars

// One float32 rounding per operation, in ggml's order of operations; the
// volatile store keeps the compiler from fusing a multiply and an add.
float mul(float a, float b) {
  volatile float r = a * b;
  return r;
}
float add(float a, float b) {
  volatile float r = a + b;
  return r;
}
float sub(float a, float b) {
  volatile float r = a - b;
  return r;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary16 from its definition: sign, 5 exponent bits (bias 15), 10
// mantissa bits, exponent 0 subnormal. A NaN comes out quiet with its
// payload in the top mantissa bits (as ggml's conversion leaves it).
float half(uint16_t h) {
  const bool neg = (h & 0x8000) != 0;
  const int e = (h >> 10) & 31, m = h & 1023;
  if (e == 31) {
    if (m == 0) return neg ? -INFINITY : INFINITY;
    return from_bits((neg ? 0x80000000u : 0u) | 0x7fc00000u | (uint32_t(m) << 13));
  }
  const double v = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(double(1024 + m), e - 25);
  return float(neg ? -v : v);
}

// The f16 bits of a value that binary16 represents exactly (searched).
uint16_t half_bits(float v) {
  for (uint32_t h = 0; h < 0x10000; ++h)
    if (bits(half(uint16_t(h))) == bits(v)) return uint16_t(h);
  ADD_FAILURE() << v << " is not a binary16 value";
  return 0;
}

void put16(Bytes& b, size_t at, uint16_t v) {
  b.at(at) = uint8_t(v);
  b.at(at + 1) = uint8_t(v >> 8);
}
uint16_t get16(const Bytes& b, size_t at) { return uint16_t(b.at(at) | (b.at(at + 1) << 8)); }

// dequantize_row from an exactly sized, deliberately misaligned heap copy
// (so ASan sees any overread and UBSan any misaligned load).
std::vector<float> dequant(GgmlType t, const Bytes& src, int64_t n) {
  std::unique_ptr<uint8_t[]> buf(new uint8_t[src.size() + 1]);
  std::copy(src.begin(), src.end(), buf.get() + 1);
  std::vector<float> out(static_cast<size_t>(n));
  dequantize_row(t, buf.get() + 1, out.data(), n);
  return out;
}

Bytes quant(GgmlType t, const std::vector<float>& x) {
  Bytes out(ggml_row_bytes(t, int64_t(x.size())), 0xA5);
  quantize_row(t, x.data(), out.data(), int64_t(x.size()));
  return out;
}

// Compares float bit patterns; reports the first few differences.
void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int shown = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (bits(got[i]) != bits(want[i])) {
      ADD_FAILURE() << what << ": value " << i << " is " << got[i] << " (0x" << std::hex << bits(got[i])
                    << "), expected " << std::dec << want[i] << " (0x" << std::hex << bits(want[i]) << ")";
      if (++shown == 8) return;
    }
  }
}

// ------------------------------------------------------------ block layouts

// A block as numbers: the f16 scale `d` and min / dmin `m` (as bits), the
// sub-block scales and mins of the K-quants, and one level per value as
// stored (before any offset is taken off; signed for Q8_0).
struct Levels {
  uint16_t d = 0, m = 0;
  std::vector<int> sc, mn, q;
  bool operator==(const Levels& o) const { return d == o.d && m == o.m && sc == o.sc && mn == o.mn && q == o.q; }
};

// One ggml block type: its shape and, written from ggml's layout, how
// levels are packed into bytes, read back, and what value each one means.
struct Format {
  GgmlType type;
  const char* name;
  int n;           // values per block
  size_t bytes;    // bytes per block
  int qmin, qmax;  // range of the stored levels
  int subs;        // sub-blocks with their own scale (0: none)
  int scmin, scmax;
  int mnmax;       // sub-block mins 0..mnmax (0: no mins)
  bool has_m;      // a second f16 (min of Q4_1/Q5_1, dmin of Q2_K/Q4_K/Q5_K)
  Bytes (*pack)(const Levels&);
  Levels (*unpack)(const Bytes&);
  float (*value)(const Levels&, int);  // value i of the block
};

// Q4_0: {f16 d; u8 qs[16]}. Value j < 16 is the low nibble of qs[j], value
// j + 16 the high nibble; x = (q - 8) * d.
Bytes pack_q4_0(const Levels& L) {
  Bytes b(18, 0);
  put16(b, 0, L.d);
  for (int j = 0; j < 32; ++j) b[2 + j % 16] |= uint8_t(L.q[j] << (j < 16 ? 0 : 4));
  return b;
}
Levels unpack_q4_0(const Bytes& b) {
  Levels L;
  L.d = get16(b, 0);
  for (int j = 0; j < 32; ++j) L.q.push_back((b[2 + j % 16] >> (j < 16 ? 0 : 4)) & 15);
  return L;
}
float value_q4_0(const Levels& L, int j) { return mul(float(L.q[j] - 8), half(L.d)); }

// Q4_1: {f16 d, m; u8 qs[16]}, nibbles as Q4_0; x = q * d + m.
Bytes pack_q4_1(const Levels& L) {
  Bytes b(20, 0);
  put16(b, 0, L.d);
  put16(b, 2, L.m);
  for (int j = 0; j < 32; ++j) b[4 + j % 16] |= uint8_t(L.q[j] << (j < 16 ? 0 : 4));
  return b;
}
Levels unpack_q4_1(const Bytes& b) {
  Levels L;
  L.d = get16(b, 0);
  L.m = get16(b, 2);
  for (int j = 0; j < 32; ++j) L.q.push_back((b[4 + j % 16] >> (j < 16 ? 0 : 4)) & 15);
  return L;
}
float value_q4_1(const Levels& L, int j) { return add(mul(float(L.q[j]), half(L.d)), half(L.m)); }

// Q5_0: {f16 d; u8 qh[4]; u8 qs[16]}: the low 4 bits as Q4_0, bit 4 of value
// j is bit j of qh read as a little-endian u32; x = (q - 16) * d.
Bytes pack_q5(const Levels& L, size_t qh_at) {
  Bytes b(qh_at + 4 + 16, 0);
  put16(b, 0, L.d);
  if (qh_at == 4) put16(b, 2, L.m);
  for (int j = 0; j < 32; ++j) {
    b[qh_at + j / 8] |= uint8_t(((L.q[j] >> 4) & 1) << (j % 8));
    b[qh_at + 4 + j % 16] |= uint8_t((L.q[j] & 15) << (j < 16 ? 0 : 4));
  }
  return b;
}
Levels unpack_q5(const Bytes& b, size_t qh_at) {
  Levels L;
  L.d = get16(b, 0);
  if (qh_at == 4) L.m = get16(b, 2);
  for (int j = 0; j < 32; ++j) {
    const int lo = (b[qh_at + 4 + j % 16] >> (j < 16 ? 0 : 4)) & 15;
    const int hi = (b[qh_at + j / 8] >> (j % 8)) & 1;
    L.q.push_back(lo | (hi << 4));
  }
  return L;
}
Bytes pack_q5_0(const Levels& L) { return pack_q5(L, 2); }
Levels unpack_q5_0(const Bytes& b) { return unpack_q5(b, 2); }
float value_q5_0(const Levels& L, int j) { return mul(float(L.q[j] - 16), half(L.d)); }

// Q5_1: {f16 d, m; u8 qh[4]; u8 qs[16]}; x = q * d + m.
Bytes pack_q5_1(const Levels& L) { return pack_q5(L, 4); }
Levels unpack_q5_1(const Bytes& b) { return unpack_q5(b, 4); }
float value_q5_1(const Levels& L, int j) { return add(mul(float(L.q[j]), half(L.d)), half(L.m)); }

// Q8_0: {f16 d; i8 qs[32]}; x = q * d.
Bytes pack_q8_0(const Levels& L) {
  Bytes b(34, 0);
  put16(b, 0, L.d);
  for (int j = 0; j < 32; ++j) b[2 + j] = uint8_t(int8_t(L.q[j]));
  return b;
}
Levels unpack_q8_0(const Bytes& b) {
  Levels L;
  L.d = get16(b, 0);
  for (int j = 0; j < 32; ++j) L.q.push_back(int8_t(b[2 + j]));
  return L;
}
float value_q8_0(const Levels& L, int j) { return mul(float(L.q[j]), half(L.d)); }

// The 2-bit planes of Q2_K and Q3_K (64 bytes at `at`): value i lives in
// byte 32 * (i / 128) + i % 32, at bit 2 * ((i % 128) / 32).
size_t plane_byte(int i) { return size_t(32 * (i / 128) + i % 32); }
int plane_shift(int i) { return 2 * ((i % 128) / 32); }

// Q2_K: {u8 scales[16]; u8 qs[64]; f16 d, dmin}. Sub-block i / 16 has scale
// scales[.] & 15 and min scales[.] >> 4; x = d * sc * q - dmin * mn.
Bytes pack_q2_k(const Levels& L) {
  Bytes b(84, 0);
  for (int s = 0; s < 16; ++s) b[s] = uint8_t(L.sc[s] | (L.mn[s] << 4));
  for (int i = 0; i < 256; ++i) b[16 + plane_byte(i)] |= uint8_t(L.q[i] << plane_shift(i));
  put16(b, 80, L.d);
  put16(b, 82, L.m);
  return b;
}
Levels unpack_q2_k(const Bytes& b) {
  Levels L;
  for (int s = 0; s < 16; ++s) {
    L.sc.push_back(b[s] & 15);
    L.mn.push_back(b[s] >> 4);
  }
  for (int i = 0; i < 256; ++i) L.q.push_back((b[16 + plane_byte(i)] >> plane_shift(i)) & 3);
  L.d = get16(b, 80);
  L.m = get16(b, 82);
  return L;
}
float value_q2_k(const Levels& L, int i) {
  const int s = i / 16;
  return sub(mul(mul(half(L.d), float(L.sc[s])), float(L.q[i])), mul(half(L.m), float(L.mn[s])));
}

// Q3_K: {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}. Level q (0..7):
// low 2 bits in the qs plane, bit 2 in bit i / 32 of hmask[i % 32]. The 16
// 6-bit scales: low 4 bits in the low nibbles of scales[0..7] (sub-blocks
// 0-7) and the high nibbles (8-15); the top 2 bits of sub-block s at bits
// 2 * (s / 4) of scales[8 + s % 4]. x = d * (sc - 32) * (q - 4).
Bytes pack_q3_k(const Levels& L) {
  Bytes b(110, 0);
  for (int i = 0; i < 256; ++i) {
    b[i % 32] |= uint8_t(((L.q[i] >> 2) & 1) << (i / 32));
    b[32 + plane_byte(i)] |= uint8_t((L.q[i] & 3) << plane_shift(i));
  }
  for (int s = 0; s < 16; ++s) {
    b[96 + s % 8] |= uint8_t((L.sc[s] & 15) << (s < 8 ? 0 : 4));
    b[96 + 8 + s % 4] |= uint8_t((L.sc[s] >> 4) << (2 * (s / 4)));
  }
  put16(b, 108, L.d);
  return b;
}
Levels unpack_q3_k(const Bytes& b) {
  Levels L;
  for (int i = 0; i < 256; ++i) {
    const int lo = (b[32 + plane_byte(i)] >> plane_shift(i)) & 3;
    const int hi = (b[i % 32] >> (i / 32)) & 1;
    L.q.push_back(lo | (hi << 2));
  }
  for (int s = 0; s < 16; ++s) {
    const int lo = (b[96 + s % 8] >> (s < 8 ? 0 : 4)) & 15;
    const int hi = (b[96 + 8 + s % 4] >> (2 * (s / 4))) & 3;
    L.sc.push_back(lo | (hi << 4));
  }
  L.d = get16(b, 108);
  return L;
}
float value_q3_k(const Levels& L, int i) {
  return mul(mul(half(L.d), float(L.sc[i / 16] - 32)), float(L.q[i] - 4));
}

// The 12 packed scale bytes of Q4_K / Q5_K (at `at`), 8 sub-blocks of 32 with
// a 6-bit scale and min each: for s < 4, scale in the low 6 bits of byte s
// and min in those of byte s + 4; for s >= 4, the low 4 bits of scale and min
// in the low and high nibble of byte s + 4, their top 2 bits in bits 6-7 of
// bytes s - 4 (scale) and s (min).
void pack_k4_scales(const Levels& L, Bytes& b, size_t at) {
  for (int s = 0; s < 8; ++s) {
    if (s < 4) {
      b[at + s] |= uint8_t(L.sc[s]);
      b[at + s + 4] |= uint8_t(L.mn[s]);
    } else {
      b[at + s + 4] |= uint8_t((L.sc[s] & 15) | ((L.mn[s] & 15) << 4));
      b[at + s - 4] |= uint8_t((L.sc[s] >> 4) << 6);
      b[at + s] |= uint8_t((L.mn[s] >> 4) << 6);
    }
  }
}
void unpack_k4_scales(const Bytes& b, size_t at, Levels& L) {
  for (int s = 0; s < 8; ++s) {
    if (s < 4) {
      L.sc.push_back(b[at + s] & 63);
      L.mn.push_back(b[at + s + 4] & 63);
    } else {
      L.sc.push_back((b[at + s + 4] & 15) | ((b[at + s - 4] >> 6) << 4));
      L.mn.push_back((b[at + s + 4] >> 4) | ((b[at + s] >> 6) << 4));
    }
  }
}
// The nibble plane of Q4_K / Q5_K (128 bytes at `at`): value i lives in byte
// 32 * (i / 64) + i % 32, in the low nibble when i % 64 < 32, else the high.
size_t nib_byte(int i) { return size_t(32 * (i / 64) + i % 32); }
int nib_shift(int i) { return i % 64 < 32 ? 0 : 4; }

// Q4_K: {f16 d, dmin; u8 scales[12]; u8 qs[128]}; x = d * sc * q - dmin * mn
// with the scale and min of sub-block i / 32.
Bytes pack_q4_k(const Levels& L) {
  Bytes b(144, 0);
  put16(b, 0, L.d);
  put16(b, 2, L.m);
  pack_k4_scales(L, b, 4);
  for (int i = 0; i < 256; ++i) b[16 + nib_byte(i)] |= uint8_t(L.q[i] << nib_shift(i));
  return b;
}
Levels unpack_q4_k(const Bytes& b) {
  Levels L;
  L.d = get16(b, 0);
  L.m = get16(b, 2);
  unpack_k4_scales(b, 4, L);
  for (int i = 0; i < 256; ++i) L.q.push_back((b[16 + nib_byte(i)] >> nib_shift(i)) & 15);
  return L;
}
float value_q4_k(const Levels& L, int i) {
  const int s = i / 32;
  return sub(mul(mul(half(L.d), float(L.sc[s])), float(L.q[i])), mul(half(L.m), float(L.mn[s])));
}

// Q5_K: {f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}: as Q4_K with
// bit 4 of value i in bit i / 32 of qh[i % 32].
Bytes pack_q5_k(const Levels& L) {
  Bytes b(176, 0);
  put16(b, 0, L.d);
  put16(b, 2, L.m);
  pack_k4_scales(L, b, 4);
  for (int i = 0; i < 256; ++i) {
    b[16 + i % 32] |= uint8_t(((L.q[i] >> 4) & 1) << (i / 32));
    b[48 + nib_byte(i)] |= uint8_t((L.q[i] & 15) << nib_shift(i));
  }
  return b;
}
Levels unpack_q5_k(const Bytes& b) {
  Levels L;
  L.d = get16(b, 0);
  L.m = get16(b, 2);
  unpack_k4_scales(b, 4, L);
  for (int i = 0; i < 256; ++i) {
    const int lo = (b[48 + nib_byte(i)] >> nib_shift(i)) & 15;
    const int hi = (b[16 + i % 32] >> (i / 32)) & 1;
    L.q.push_back(lo | (hi << 4));
  }
  return L;
}
float value_q5_k(const Levels& L, int i) { return value_q4_k(L, i); }

// Q6_K: {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}. With h = i / 128,
// g = (i % 128) / 32, l = i % 32: the low 4 bits of value i in
// ql[64h + 32 * (g % 2) + l] (low nibble for g < 2, high for g >= 2), the top
// 2 bits at bit 2g of qh[32h + l]; x = d * scales[i / 16] * (q - 32).
Bytes pack_q6_k(const Levels& L) {
  Bytes b(210, 0);
  for (int i = 0; i < 256; ++i) {
    const int h = i / 128, g = (i % 128) / 32, l = i % 32;
    b[size_t(64 * h + 32 * (g % 2) + l)] |= uint8_t((L.q[i] & 15) << (g < 2 ? 0 : 4));
    b[size_t(128 + 32 * h + l)] |= uint8_t((L.q[i] >> 4) << (2 * g));
  }
  for (int s = 0; s < 16; ++s) b[192 + s] = uint8_t(int8_t(L.sc[s]));
  put16(b, 208, L.d);
  return b;
}
Levels unpack_q6_k(const Bytes& b) {
  Levels L;
  for (int i = 0; i < 256; ++i) {
    const int h = i / 128, g = (i % 128) / 32, l = i % 32;
    const int lo = (b[size_t(64 * h + 32 * (g % 2) + l)] >> (g < 2 ? 0 : 4)) & 15;
    const int hi = (b[size_t(128 + 32 * h + l)] >> (2 * g)) & 3;
    L.q.push_back(lo | (hi << 4));
  }
  for (int s = 0; s < 16; ++s) L.sc.push_back(int8_t(b[192 + s]));
  L.d = get16(b, 208);
  return L;
}
float value_q6_k(const Levels& L, int i) {
  return mul(mul(half(L.d), float(L.sc[i / 16])), float(L.q[i] - 32));
}

const std::vector<Format>& formats() {
  static const std::vector<Format> f = {
      {GgmlType::Q4_0, "Q4_0", 32, 18, 0, 15, 0, 0, 0, 0, false, pack_q4_0, unpack_q4_0, value_q4_0},
      {GgmlType::Q4_1, "Q4_1", 32, 20, 0, 15, 0, 0, 0, 0, true, pack_q4_1, unpack_q4_1, value_q4_1},
      {GgmlType::Q5_0, "Q5_0", 32, 22, 0, 31, 0, 0, 0, 0, false, pack_q5_0, unpack_q5_0, value_q5_0},
      {GgmlType::Q5_1, "Q5_1", 32, 24, 0, 31, 0, 0, 0, 0, true, pack_q5_1, unpack_q5_1, value_q5_1},
      {GgmlType::Q8_0, "Q8_0", 32, 34, -128, 127, 0, 0, 0, 0, false, pack_q8_0, unpack_q8_0, value_q8_0},
      {GgmlType::Q2_K, "Q2_K", 256, 84, 0, 3, 16, 0, 15, 15, true, pack_q2_k, unpack_q2_k, value_q2_k},
      {GgmlType::Q3_K, "Q3_K", 256, 110, 0, 7, 16, 0, 63, 0, false, pack_q3_k, unpack_q3_k, value_q3_k},
      {GgmlType::Q4_K, "Q4_K", 256, 144, 0, 15, 8, 0, 63, 63, true, pack_q4_k, unpack_q4_k, value_q4_k},
      {GgmlType::Q5_K, "Q5_K", 256, 176, 0, 31, 8, 0, 63, 63, true, pack_q5_k, unpack_q5_k, value_q5_k},
      {GgmlType::Q6_K, "Q6_K", 256, 210, 0, 63, 16, -128, 127, 0, false, pack_q6_k, unpack_q6_k, value_q6_k},
  };
  return f;
}

const Format& format(GgmlType t) {
  for (const auto& f : formats())
    if (f.type == t) return f;
  throw std::logic_error("no format");
}

// Block `blk` of a deterministic sequence that walks every level, scale and
// min value, with f16 scales from `ds` / `ms`.
Levels pattern(const Format& f, int blk, const std::vector<uint16_t>& ds, const std::vector<uint16_t>& ms) {
  Levels L;
  L.d = ds[size_t(blk) % ds.size()];
  if (f.has_m) L.m = ms[size_t(blk) % ms.size()];
  const int range = f.qmax - f.qmin + 1;
  // Stride 7 walks every level; the t / 16 term keeps values 16, 32, 64 and
  // 128 apart (which share bytes or bits in the layouts) on different levels.
  for (int i = 0; i < f.n; ++i) {
    const int64_t t = int64_t(blk) * f.n + i;
    L.q.push_back(f.qmin + int((t * 7 + t / 16 * 3) % range));
  }
  for (int s = 0; s < f.subs; ++s) {
    const int t = blk * f.subs + s;
    L.sc.push_back(f.scmin + t * 13 % (f.scmax - f.scmin + 1));
    if (f.mnmax) L.mn.push_back((t * 5 + 3) % (f.mnmax + 1));
  }
  if (f.subs) {  // the extremes, in every block
    L.sc[0] = f.scmax;
    L.sc[1] = f.scmin;
    if (f.mnmax) {
      L.mn[0] = f.mnmax;
      L.mn[2] = 0;
    }
  }
  return L;
}

std::vector<float> expected(const Format& f, const std::vector<Levels>& blocks) {
  std::vector<float> out;
  for (const auto& L : blocks)
    for (int i = 0; i < f.n; ++i) out.push_back(f.value(L, i));
  return out;
}

Bytes concat(const Format& f, const std::vector<Levels>& blocks) {
  Bytes out;
  for (const auto& L : blocks) {
    const Bytes b = f.pack(L);
    EXPECT_EQ(b.size(), f.bytes);
    out.insert(out.end(), b.begin(), b.end());
  }
  return out;
}

// f16 scales worth covering: smallest and largest subnormal (both signs),
// smallest normal, the largest finite value (both signs), both zeros, 1, a
// value with a full mantissa.
const std::vector<uint16_t> kScales = {0x0001, 0x03ff, 0x8001, 0x0400, 0x7bff, 0xfbff,
                                       0x0000, 0x8000, 0x3c00, 0xb555, 0x2e66, 0x83ff};
const std::vector<uint16_t> kMins = {0x7bff, 0x0001, 0xfbff, 0x8000, 0x3555, 0x0000,
                                     0xc500, 0x03ff, 0x1234, 0xbc00, 0x8001, 0x5a5a};

// ------------------------------------------------------------- dequantise

TEST(QuantDequant, EveryBlockTypeMatchesItsDefinitionBitForBit) {
  for (const Format& f : formats()) {
    SCOPED_TRACE(f.name);
    // Sixteen blocks in one row: every scale of kScales, every level value in
    // every position class, every sub-block scale and min.
    std::vector<Levels> blocks;
    for (int blk = 0; blk < 16; ++blk) blocks.push_back(pattern(f, blk, kScales, kMins));
    const Bytes row = concat(f, blocks);
    const int64_t n = int64_t(blocks.size()) * f.n;
    ASSERT_EQ(row.size(), ggml_row_bytes(f.type, n));
    expect_same_bits(dequant(f.type, row, n), expected(f, blocks), f.name);
    // Every level value occurs.
    std::set<int> seen;
    for (const auto& L : blocks) seen.insert(L.q.begin(), L.q.end());
    EXPECT_EQ(int(seen.size()), f.qmax - f.qmin + 1);
    // One block alone (the first of the row) decodes the same.
    const Bytes one(row.begin(), row.begin() + long(f.bytes));
    expect_same_bits(dequant(f.type, one, f.n), expected(f, {blocks[0]}), std::string(f.name) + " alone");
  }
}

TEST(QuantDequant, RandomBlocksMatchTheirDefinitionBitForBit) {
  std::mt19937 rng(7);
  auto finite_half = [&] {
    uint16_t h = uint16_t(rng());
    if ((h & 0x7c00) == 0x7c00) h = uint16_t(h & ~0x4000);  // no Inf / NaN
    return h;
  };
  for (const Format& f : formats()) {
    SCOPED_TRACE(f.name);
    std::vector<Levels> blocks;
    for (int blk = 0; blk < 200; ++blk) {
      Levels L;
      L.d = finite_half();
      if (f.has_m) L.m = finite_half();
      for (int i = 0; i < f.n; ++i) L.q.push_back(f.qmin + int(rng() % unsigned(f.qmax - f.qmin + 1)));
      for (int s = 0; s < f.subs; ++s) {
        L.sc.push_back(f.scmin + int(rng() % unsigned(f.scmax - f.scmin + 1)));
        if (f.mnmax) L.mn.push_back(int(rng() % unsigned(f.mnmax + 1)));
      }
      blocks.push_back(L);
    }
    const int64_t n = int64_t(blocks.size()) * f.n;
    expect_same_bits(dequant(f.type, concat(f, blocks), n), expected(f, blocks), f.name);
  }
}

TEST(QuantDequant, TheTestsPackingIsLossless) {
  // The property tests below read quantiser output with these unpackers.
  for (const Format& f : formats()) {
    SCOPED_TRACE(f.name);
    for (int blk = 0; blk < 12; ++blk) {
      const Levels L = pattern(f, blk, kScales, kMins);
      EXPECT_TRUE(f.unpack(f.pack(L)) == L) << "block " << blk;
    }
  }
}

// Blocks written out literally, with values worked out by hand.
TEST(QuantDequant, LiteralBlocks) {
  {  // Q4_0, d = 1: qs[0] = 0x1F holds value 0 (15) and value 16 (1).
    Bytes b(18, 0x88);
    put16(b, 0, 0x3c00);
    b[2] = 0x1F;
    std::vector<float> want(32, 0.0f);
    want[0] = 7;
    want[16] = -7;
    expect_same_bits(dequant(GgmlType::Q4_0, b, 32), want, "Q4_0");
  }
  {  // Q4_1, d = 2, m = -1: qs[3] = 0xF0 holds value 3 (0) and value 19 (15).
    Bytes b(20, 0);
    put16(b, 0, 0x4000);
    put16(b, 2, 0xbc00);
    b[4 + 3] = 0xF0;
    std::vector<float> want(32, -1.0f);
    want[19] = 29;
    expect_same_bits(dequant(GgmlType::Q4_1, b, 32), want, "Q4_1");
  }
  {  // Q5_0, d = 1: qh = 0x80010001 sets bit 4 of values 0, 16 and 31.
    Bytes b(22, 0);
    put16(b, 0, 0x3c00);
    b[2] = 0x01;
    b[4] = 0x01;
    b[5] = 0x80;
    std::vector<float> want(32, -16.0f);
    want[0] = want[16] = want[31] = 0;
    expect_same_bits(dequant(GgmlType::Q5_0, b, 32), want, "Q5_0");
  }
  {  // Q5_1, d = 0.5, m = 1: bit 31 of qh and the high nibble of qs[15] make value 31 = 31.
    Bytes b(24, 0);
    put16(b, 0, 0x3800);
    put16(b, 2, 0x3c00);
    b[7] = 0x80;
    b[8 + 15] = 0xF0;
    std::vector<float> want(32, 1.0f);
    want[31] = 16.5f;
    expect_same_bits(dequant(GgmlType::Q5_1, b, 32), want, "Q5_1");
  }
  {  // Q8_0, d = 0.5: -128 and 127.
    Bytes b(34, 0);
    put16(b, 0, 0x3800);
    b[2] = 0x80;
    b[33] = 0x7f;
    std::vector<float> want(32, 0.0f);
    want[0] = -64;
    want[31] = 63.5f;
    expect_same_bits(dequant(GgmlType::Q8_0, b, 32), want, "Q8_0");
  }
  {  // Q2_K, d = 1, dmin = 0.5; every sub-block scale 1 and min 2 but the
     // last (scale 3, min 15); qs[0] = 0xE4 holds levels 0,1,2,3 of values
     // 0, 32, 64, 96; qs[63] = 0xFF level 3 of values 159, 191, 223, 255.
    Bytes b(84, 0);
    for (int s = 0; s < 16; ++s) b[s] = 0x21;
    b[15] = 0xF3;
    b[16] = 0xE4;
    b[16 + 63] = 0xFF;
    put16(b, 80, 0x3c00);
    put16(b, 82, 0x3800);
    std::vector<float> want(256, -1.0f);
    for (int i = 240; i < 256; ++i) want[i] = -7.5f;
    want[32] = 0;
    want[64] = 1;
    want[96] = 2;
    want[159] = want[191] = want[223] = 2;
    want[255] = 1.5f;
    expect_same_bits(dequant(GgmlType::Q2_K, b, 256), want, "Q2_K");
  }
  {  // Q3_K, d = 1/32. scales[0] = 0x1F, scales[8] = 0x03: sub-block 0 has
     // 6-bit scale 0xF | 3 << 4 = 63 (x 31/32), sub-block 8 has 1 (x -31/32),
     // all others 0 (x -1). hmask[0] bit 0 and qs[0] = 3 make value 0 level 7.
    Bytes b(110, 0);
    b[0] = 0x01;
    b[32] = 0x03;
    b[96] = 0x1F;
    b[96 + 8] = 0x03;
    put16(b, 108, 0x2800);
    std::vector<float> want(256, 4.0f);  // -1 * (0 - 4)
    for (int i = 0; i < 16; ++i) want[i] = -3.875f;  // 31/32 * -4
    for (int i = 128; i < 144; ++i) want[i] = 3.875f;  // -31/32 * -4
    want[0] = 2.90625f;  // 31/32 * 3
    expect_same_bits(dequant(GgmlType::Q3_K, b, 256), want, "Q3_K");
    // Level 4 (q - 4 = 0) under a negative scale decodes to -0: bit 2 of
    // hmask[0] is the high bit of value 64 (sub-block 4, scale 0 - 32).
    Bytes z(110, 0);
    z[0] = 0x04;
    put16(z, 108, 0x2800);
    const std::vector<float> got = dequant(GgmlType::Q3_K, z, 256);
    EXPECT_EQ(bits(got[64]), 0x80000000u) << got[64];  // -1 * 0 is -0
  }
  {  // Q4_K, d = dmin = 1; qs all 0x21: level 1 in even sub-blocks (low
     // nibbles), 2 in odd ones. Scale / min per sub-block: 1/5, 2/6, 3/7, 4/8,
     // then 0x9 | 2 << 4 = 41 / 0x1 | 1 << 4 = 17, 10/2, 11/3, 12/4.
    const uint8_t sc[12] = {0x81, 0x02, 0x03, 0x04, 0x45, 0x06, 0x07, 0x08, 0x19, 0x2A, 0x3B, 0x4C};
    const float per_sub[8] = {1 - 5, 4 - 6, 3 - 7, 8 - 8, 41 - 17, 20 - 2, 11 - 3, 24 - 4};
    Bytes b(144, 0x21);
    put16(b, 0, 0x3c00);
    put16(b, 2, 0x3c00);
    std::copy(sc, sc + 12, b.begin() + 4);
    std::vector<float> want(256);
    for (int i = 0; i < 256; ++i) want[size_t(i)] = per_sub[i / 32];
    expect_same_bits(dequant(GgmlType::Q4_K, b, 256), want, "Q4_K");
    // Q5_K with the same scales and nibbles; qh[0] = 0xFF adds 16 to value
    // 32 * s of every sub-block s.
    Bytes c(176, 0x21);
    put16(c, 0, 0x3c00);
    put16(c, 2, 0x3c00);
    std::copy(sc, sc + 12, c.begin() + 4);
    std::fill(c.begin() + 16, c.begin() + 48, 0);
    c[16] = 0xFF;
    const int scale[8] = {1, 2, 3, 4, 41, 10, 11, 12};
    for (int s = 0; s < 8; ++s) want[size_t(32 * s)] = per_sub[s] + 16.0f * float(scale[s]);
    expect_same_bits(dequant(GgmlType::Q5_K, c, 256), want, "Q5_K");
  }
  {  // Q6_K, d = 1; scales -128 (sub-block 0), 127 (15), 1 elsewhere. qh[0] =
     // 3 gives value 0 level 48; ql[0] = 0xF0 gives value 64 level 15; ql[127]
     // = 0x50 and qh[63] = 0x80 give value 255 level 5 | 2 << 4 = 37.
    Bytes b(210, 0);
    for (int s = 0; s < 16; ++s) b[192 + s] = 1;
    b[192] = 0x80;
    b[192 + 15] = 0x7f;
    b[128] = 0x03;
    b[0] = 0xF0;
    b[127] = 0x50;
    b[128 + 63] = 0x80;
    put16(b, 208, 0x3c00);
    std::vector<float> want(256, -32.0f);
    for (int i = 0; i < 16; ++i) want[size_t(i)] = 4096;
    for (int i = 240; i < 256; ++i) want[size_t(i)] = -4064;
    want[0] = -2048;
    want[64] = -17;
    want[255] = 635;
    expect_same_bits(dequant(GgmlType::Q6_K, b, 256), want, "Q6_K");
  }
}

TEST(QuantDequant, F16EveryBitPattern) {
  Bytes b(2 * 65536);
  std::vector<float> want;
  for (uint32_t h = 0; h < 65536; ++h) {
    put16(b, 2 * h, uint16_t(h));
    want.push_back(half(uint16_t(h)));
  }
  expect_same_bits(dequant(GgmlType::F16, b, 65536), want, "F16");
  // Spot values of the definition itself.
  EXPECT_EQ(half(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(half(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(half(0x7bff), 65504.0f);
  EXPECT_EQ(half(0xc000), -2.0f);
  EXPECT_EQ(bits(half(0x8000)), 0x80000000u);
  EXPECT_EQ(bits(half(0x7c01)), 0x7fc02000u);
}

TEST(QuantDequant, Q8_0ScaleEveryBitPattern) {
  // Every block's scale is an f16: one block per bit pattern, its first
  // value d * 1 and its second d * -1 (a NaN's sign after a product is
  // IEEE's to leave open: checked for the numbers only).
  const size_t bytes = ggml_type_size(GgmlType::Q8_0);
  Bytes b(bytes * 65536);
  for (uint32_t h = 0; h < 65536; ++h) {
    put16(b, bytes * h, uint16_t(h));
    b[bytes * h + 2] = 1;
    b[bytes * h + 3] = uint8_t(int8_t(-1));
  }
  const std::vector<float> got = dequant(GgmlType::Q8_0, b, 32 * 65536);
  std::vector<float> first, second, want, want_neg;
  for (uint32_t h = 0; h < 65536; ++h) {
    first.push_back(got[32 * h]);
    want.push_back(half(uint16_t(h)));
    if (std::isnan(want.back())) continue;
    second.push_back(got[32 * h + 1]);
    want_neg.push_back(-want.back());
  }
  expect_same_bits(first, want, "Q8_0 scale");
  expect_same_bits(second, want_neg, "Q8_0 scale x -1");
}

TEST(QuantDequant, Bf16EveryBitPattern) {
  Bytes b(2 * 65536);
  std::vector<float> want;
  for (uint32_t h = 0; h < 65536; ++h) {
    put16(b, 2 * h, uint16_t(h));
    want.push_back(from_bits(h << 16));  // bf16 is the top half of a float32
  }
  expect_same_bits(dequant(GgmlType::BF16, b, 65536), want, "BF16");
}

TEST(QuantDequant, F32IsCopiedBitForBit) {
  const std::vector<uint32_t> patterns = {0x00000000, 0x80000000, 0x00000001, 0x807fffff, 0x7f7fffff, 0x7f800000,
                                          0xff800000, 0x7fc00001, 0x7f800001, 0xffbfffff, 0x3f800000, 0xc2f6e979};
  Bytes b;
  std::vector<float> want;
  for (uint32_t u : patterns) {
    for (int k = 0; k < 4; ++k) b.push_back(uint8_t(u >> (8 * k)));
    want.push_back(from_bits(u));
  }
  expect_same_bits(dequant(GgmlType::F32, b, int64_t(patterns.size())), want, "F32");
}

TEST(QuantDequant, CountsThatAreNotWholeBlocksAreRejected) {
  const Bytes b(1024, 0);
  std::vector<float> out(512);
  for (const Format& f : formats()) {
    SCOPED_TRACE(f.name);
    EXPECT_THROW(dequantize_row(f.type, b.data(), out.data(), f.n + 1), Error);
    EXPECT_THROW(dequantize_row(f.type, b.data(), out.data(), -f.n), Error);
    EXPECT_THROW(quantize_row(f.type, std::vector<float>(512).data(), std::vector<uint8_t>(1024).data(), f.n - 1),
                 Error);
    // Zero values is an empty row: nothing written.
    out.assign(512, 42.0f);
    dequantize_row(f.type, b.data(), out.data(), 0);
    EXPECT_EQ(out[0], 42.0f);
  }
}

// ---------------------------------------------------------- quantisation

// Gaussian values in blocks of 256 at different magnitudes, with a few
// blocks of one sign and one with an outlier.
std::vector<float> test_data(unsigned seed, int blocks) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x;
  for (int b = 0; b < blocks; ++b) {
    const float scale = std::ldexp(1.0f, b % 9 - 4);
    for (int i = 0; i < 256; ++i) {
      float v = g(rng) * scale;
      if (b % 5 == 3) v = std::fabs(v);
      if (b % 5 == 4) v = -std::fabs(v) - scale;
      x.push_back(v);
    }
    if (b % 7 == 6) x[size_t(b) * 256 + 17] = 40 * scale;
  }
  return x;
}

float block_amax(const float* x, int n) {
  float a = 0;
  for (int j = 0; j < n; ++j) a = std::max(a, std::fabs(x[j]));
  return a;
}

// The value with the largest magnitude, the first one on ties (as ggml picks it).
float block_signed_max(const float* x, int n) {
  float amax = 0, max = 0;
  for (int j = 0; j < n; ++j)
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  return max;
}

TEST(QuantRoundTrip, Q8_0ErrorIsHalfAStepPlusTheScaleRounding) {
  const std::vector<float> x = test_data(1, 16);
  const Bytes q = quant(GgmlType::Q8_0, x);
  const std::vector<float> y = dequant(GgmlType::Q8_0, q, int64_t(x.size()));
  for (size_t b = 0; b < x.size() / 32; ++b) {
    const float* xb = &x[32 * b];
    const float d = block_amax(xb, 32) / 127;  // the scale before rounding to f16
    const float d16 = half(get16(q, 34 * b));
    EXPECT_LE(std::fabs(d16 - d), d * 0x1p-11f) << "block " << b;  // nearest f16
    const float bound = 0.5f * d * 1.0001f + 127 * std::fabs(d16 - d);
    for (int j = 0; j < 32; ++j) {
      EXPECT_LE(std::fabs(xb[j] - y[32 * b + size_t(j)]), bound) << "block " << b << " value " << j;
      // The level is round(x / d), so the decoded value has x's sign or is zero.
      EXPECT_GE(xb[j] * y[32 * b + size_t(j)], 0.0f);
    }
  }
}

// Q4_0 / Q5_0: d = max / -levels with max the value of largest magnitude;
// levels -L..L-1, so the value -max (if present) is clamped one step short.
void check_symmetric(GgmlType t, int L, size_t block_bytes) {
  const std::vector<float> x = test_data(2, 16);
  const Bytes q = quant(t, x);
  const std::vector<float> y = dequant(t, q, int64_t(x.size()));
  for (size_t b = 0; b < x.size() / 32; ++b) {
    const float* xb = &x[32 * b];
    const float d = block_signed_max(xb, 32) / float(-L);
    const float d16 = half(get16(q, block_bytes * b));
    const float ad = std::fabs(d), dd = std::fabs(d16 - d);
    EXPECT_LE(dd, ad * 0x1p-11f) << "block " << b;
    for (int j = 0; j < 32; ++j) {
      const float t_level = xb[j] / d;  // in [-L, L]
      const float bound = (t_level < L - 0.5f - 1e-3f ? 0.5f * ad : ad) * 1.0001f + float(L) * dd;
      EXPECT_LE(std::fabs(xb[j] - y[32 * b + size_t(j)]), bound) << "block " << b << " value " << j;
    }
  }
}

// Q4_1 / Q5_1: d = (max - min) / levels, x = q * d + min.
void check_asymmetric(GgmlType t, int levels, size_t block_bytes) {
  const std::vector<float> x = test_data(3, 16);
  const Bytes q = quant(t, x);
  const std::vector<float> y = dequant(t, q, int64_t(x.size()));
  for (size_t b = 0; b < x.size() / 32; ++b) {
    const float* xb = &x[32 * b];
    const float mn = *std::min_element(xb, xb + 32), mx = *std::max_element(xb, xb + 32);
    const float d = (mx - mn) / float(levels);
    const float d16 = half(get16(q, block_bytes * b)), m16 = half(get16(q, block_bytes * b + 2));
    EXPECT_LE(std::fabs(d16 - d), d * 0x1p-11f) << "block " << b;
    EXPECT_LE(std::fabs(m16 - mn), std::max(std::fabs(mn) * 0x1p-11f, 0x1p-25f)) << "block " << b;
    const float bound = 0.5f * d * 1.0001f + float(levels) * std::fabs(d16 - d) + std::fabs(m16 - mn) +
                        1e-6f * std::max(std::fabs(mn), std::fabs(mx));
    for (int j = 0; j < 32; ++j)
      EXPECT_LE(std::fabs(xb[j] - y[32 * b + size_t(j)]), bound) << "block " << b << " value " << j;
  }
}

TEST(QuantRoundTrip, Q4_0AndQ5_0ErrorBounds) {
  check_symmetric(GgmlType::Q4_0, 8, 18);
  check_symmetric(GgmlType::Q5_0, 16, 22);
}

TEST(QuantRoundTrip, Q4_1AndQ5_1ErrorBounds) {
  check_asymmetric(GgmlType::Q4_1, 15, 20);
  check_asymmetric(GgmlType::Q5_1, 31, 24);
}

// The K-quant reference quantisers pick each level last, against the scales
// as stored: every value decodes to the level of its sub-block nearest to it.
TEST(QuantRoundTrip, KQuantsPickTheNearestLevelOfTheStoredScales) {
  for (GgmlType t : {GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K}) {
    const Format& f = format(t);
    SCOPED_TRACE(f.name);
    const std::vector<float> x = test_data(4, 18);
    const Bytes q = quant(t, x);
    const std::vector<float> y = dequant(t, q, int64_t(x.size()));
    int failures = 0;
    for (size_t b = 0; b < x.size() / 256 && failures < 5; ++b) {
      const Levels L = f.unpack(Bytes(q.begin() + long(b * f.bytes), q.begin() + long((b + 1) * f.bytes)));
      for (int i = 0; i < 256; ++i) {
        const float xi = x[b * 256 + size_t(i)], yi = y[b * 256 + size_t(i)];
        // The decoded value is the block's own level (decoder and unpacker agree).
        ASSERT_EQ(bits(yi), bits(f.value(L, i))) << "block " << b << " value " << i;
        Levels alt = L;
        float best = INFINITY, span = 0;
        for (int k = f.qmin; k <= f.qmax; ++k) {
          alt.q[size_t(i)] = k;
          const float c = f.value(alt, i);
          best = std::min(best, std::fabs(xi - c));
          span = std::max(span, std::fabs(c));
        }
        if (std::fabs(xi - yi) > best + 1e-5f * (span + std::fabs(xi))) {
          ADD_FAILURE() << "block " << b << " value " << i << ": x = " << xi << " decodes to " << yi
                        << ", a level at distance " << best << " exists";
          ++failures;
        }
      }
    }
  }
}

// Relative RMS error per block of 256 Gaussian values: a check on how well
// the scales are chosen. Each bound is about 1.25x the worst block seen with
// ggml's reference quantisers, which sits near step / sqrt(12) for the
// type's step (e.g. Q4_K: 16 levels over a 32-value range of ~4 sigma).
TEST(QuantRoundTrip, RelativeRmsErrorPerType) {
  const struct {
    GgmlType t;
    double bound;
  } cases[] = {{GgmlType::F16, 3e-4},  {GgmlType::BF16, 2.5e-3}, {GgmlType::Q8_0, 0.0075}, {GgmlType::Q5_0, 0.058},
               {GgmlType::Q5_1, 0.05}, {GgmlType::Q4_0, 0.115},  {GgmlType::Q4_1, 0.105},  {GgmlType::Q6_K, 0.024},
               {GgmlType::Q5_K, 0.048}, {GgmlType::Q4_K, 0.092}, {GgmlType::Q3_K, 0.2},    {GgmlType::Q2_K, 0.39}};
  const std::vector<float> x = test_data(5, 36);
  for (const auto& c : cases) {
    SCOPED_TRACE(ggml_type_name(uint32_t(c.t)));
    const std::vector<float> y = dequant(c.t, quant(c.t, x), int64_t(x.size()));
    double worst = 0;
    for (size_t b = 0; b < x.size() / 256; ++b) {
      if (b % 5 >= 3 || b % 7 == 6) continue;  // only the plain Gaussian blocks of test_data
      double e2 = 0, x2 = 0;
      for (size_t i = 256 * b; i < 256 * (b + 1); ++i) {
        e2 += double(x[i] - y[i]) * double(x[i] - y[i]);
        x2 += double(x[i]) * double(x[i]);
      }
      worst = std::max(worst, std::sqrt(e2 / x2));
    }
    EXPECT_LE(worst, c.bound);
    EXPECT_GT(worst, c.bound / 4);  // lossy as the type must be: not a copy of the input
  }
}

TEST(QuantRoundTrip, ZerosStayZeros) {
  const std::vector<float> x(512, 0.0f);
  for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0,
                     GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K,
                     GgmlType::Q6_K}) {
    const std::vector<float> y = dequant(t, quant(t, x), 512);
    for (float v : y) EXPECT_EQ(v, 0.0f) << ggml_type_name(uint32_t(t));
  }
}

// Blocks whose values are exactly levels of one scale come back exactly, in
// the bytes ggml's reference quantiser writes for them.
TEST(QuantRoundTrip, ExactlyRepresentableBlocksAreExact) {
  // Q8_0: x = k * d with |k| <= 127 and some |k| = 127; d = amax / 127 is d
  // itself and round(x / d) is k.
  for (float d : {0.125f, 3 * 0x1p-7f, 1.0f, 0x1p-14f, 5 * 0x1p-24f, 0.375f}) {
    SCOPED_TRACE(d);
    const Format& f = format(GgmlType::Q8_0);
    std::vector<float> x;
    std::vector<Levels> blocks;
    for (int b = 0; b < 3; ++b) {
      Levels L;
      L.d = half_bits(d);
      for (int j = 0; j < 32; ++j) L.q.push_back(int((j * 37 + 11 * b) % 255) - 127);
      L.q[size_t(b)] = b == 1 ? -127 : 127;
      for (int j = 0; j < 32; ++j) x.push_back(float(L.q[size_t(j)]) * d);
      blocks.push_back(L);
    }
    const Bytes q = quant(GgmlType::Q8_0, x);
    EXPECT_EQ(q, concat(f, blocks));
    expect_same_bits(dequant(GgmlType::Q8_0, q, int64_t(x.size())), x, "Q8_0");
  }
  // Q4_0 / Q5_0: x = (q - L) * d with one value at -L * d, the largest
  // magnitude (so ggml's d = max / -L is d); d may be negative.
  // Q4_1 / Q5_1: x = q * d + m with levels 0 and the top one present.
  struct Sym {
    GgmlType t;
    int offset;  // L for the symmetric types, -1 for the asymmetric ones
  };
  for (Sym s : {Sym{GgmlType::Q4_0, 8}, Sym{GgmlType::Q5_0, 16}, Sym{GgmlType::Q4_1, -1}, Sym{GgmlType::Q5_1, -1}}) {
    const Format& f = format(s.t);
    for (float d : {0.25f, -0.75f, 0x1p-10f, 1.5f}) {
      for (float m : {-1.0f, 0.5f, 0.0f, -0x1p-9f}) {
        if (s.offset > 0 && m != 0.0f) continue;
        if (s.offset < 0 && d < 0) continue;
        SCOPED_TRACE(std::string(f.name) + " d=" + std::to_string(d) + " m=" + std::to_string(m));
        std::vector<float> x;
        std::vector<Levels> blocks;
        for (int b = 0; b < 2; ++b) {
          Levels L;
          L.d = half_bits(d);
          if (f.has_m) L.m = half_bits(m);
          for (int j = 0; j < 32; ++j) L.q.push_back((j * 7 + 5 * b) % (f.qmax + 1));
          L.q[size_t(3 + b)] = 0;  // -L * d, or the min
          if (s.offset < 0) L.q[size_t(20 + b)] = f.qmax;
          for (int j = 0; j < 32; ++j) {
            const int k = L.q[size_t(j)];
            x.push_back(s.offset > 0 ? float(k - s.offset) * d : float(k) * d + m);
          }
          blocks.push_back(L);
        }
        const Bytes q = quant(s.t, x);
        EXPECT_EQ(q, concat(f, blocks));
        expect_same_bits(dequant(s.t, q, int64_t(x.size())), x, f.name);
      }
    }
  }
}

TEST(QuantRoundTrip, F16AndBf16ConversionRoundsToNearestEven) {
  // Every finite f16 value (and the infinities) converts back to its own bits.
  std::vector<float> x;
  std::vector<uint16_t> want;
  for (uint32_t h = 0; h < 65536; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;  // NaN
    x.push_back(half(uint16_t(h)));
    want.push_back(uint16_t(h));
  }
  Bytes q = quant(GgmlType::F16, x);
  for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(get16(q, 2 * i), want[i]) << x[i];
  // Ties and edges: 1 + 2^-11 ties to 1; 1 + 3 * 2^-11 to 1 + 2^-9; 65520 is
  // past the largest value and overflows; half the smallest subnormal ties to
  // 0, one and a half of it to 2 * 2^-24.
  const std::vector<std::pair<float, uint16_t>> ties = {
      {1 + 0x1p-11f, 0x3c00},        {1 + 3 * 0x1p-11f, 0x3c02}, {65519.0f, 0x7bff},  {65520.0f, 0x7c00},
      {-65520.0f, 0xfc00},           {0x1p-25f, 0x0000},         {-0x1p-25f, 0x8000}, {3 * 0x1p-25f, 0x0002},
      {0x1p-25f * 1.0001f, 0x0001},  {1e10f, 0x7c00}};
  for (const auto& [v, h] : ties) EXPECT_EQ(get16(quant(GgmlType::F16, {v}), 0), h) << v;
  EXPECT_TRUE(std::isnan(dequant(GgmlType::F16, quant(GgmlType::F16, {NAN}), 1)[0]));

  // BF16: every non-NaN pattern round-trips; ties go to even; NaN stays NaN.
  x.clear();
  want.clear();
  for (uint32_t h = 0; h < 65536; ++h) {
    if ((h & 0x7f80) == 0x7f80 && (h & 0x7f)) continue;
    x.push_back(from_bits(h << 16));
    want.push_back(uint16_t(h));
  }
  q = quant(GgmlType::BF16, x);
  for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(get16(q, 2 * i), want[i]) << x[i];
  const std::vector<std::pair<uint32_t, uint16_t>> bties = {
      {0x3f808000, 0x3f80}, {0x3f818000, 0x3f82}, {0x3f808001, 0x3f81}, {0x7f7fffff, 0x7f80}, {0x80008000, 0x8000}};
  for (const auto& [u, h] : bties) EXPECT_EQ(get16(quant(GgmlType::BF16, {from_bits(u)}), 0), h) << std::hex << u;
  EXPECT_TRUE(std::isnan(dequant(GgmlType::BF16, quant(GgmlType::BF16, {from_bits(0x7f800001)}), 1)[0]));
}

// ------------------------------------------------------------ type table

TEST(GgmlTypes, SizesAreGgmlsConstants) {
  const struct {
    GgmlType t;
    uint32_t id;
    const char* name;
    int64_t block;
    size_t bytes;
  } known[] = {
      {GgmlType::F32, 0, "F32", 1, 4},         {GgmlType::F16, 1, "F16", 1, 2},
      {GgmlType::Q4_0, 2, "Q4_0", 32, 18},     {GgmlType::Q4_1, 3, "Q4_1", 32, 20},
      {GgmlType::Q5_0, 6, "Q5_0", 32, 22},     {GgmlType::Q5_1, 7, "Q5_1", 32, 24},
      {GgmlType::Q8_0, 8, "Q8_0", 32, 34},     {GgmlType::Q8_1, 9, "Q8_1", 32, 36},
      {GgmlType::Q2_K, 10, "Q2_K", 256, 84},   {GgmlType::Q3_K, 11, "Q3_K", 256, 110},
      {GgmlType::Q4_K, 12, "Q4_K", 256, 144},  {GgmlType::Q5_K, 13, "Q5_K", 256, 176},
      {GgmlType::Q6_K, 14, "Q6_K", 256, 210},  {GgmlType::Q8_K, 15, "Q8_K", 256, 292},
      {GgmlType::I8, 24, "I8", 1, 1},          {GgmlType::I16, 25, "I16", 1, 2},
      {GgmlType::I32, 26, "I32", 1, 4},        {GgmlType::I64, 27, "I64", 1, 8},
      {GgmlType::F64, 28, "F64", 1, 8},        {GgmlType::BF16, 30, "BF16", 1, 2},
  };
  for (const auto& k : known) {
    SCOPED_TRACE(k.name);
    EXPECT_EQ(uint32_t(k.t), k.id);
    EXPECT_EQ(ggml_type_name(k.id), k.name);
    EXPECT_EQ(ggml_block_size(k.t), k.block);
    EXPECT_EQ(ggml_type_size(k.t), k.bytes);
    EXPECT_EQ(ggml_row_bytes(k.t, 4 * k.block), 4 * k.bytes);
    EXPECT_EQ(ggml_row_bytes(k.t, 0), 0u);
    EXPECT_EQ(ggml_is_quantized(k.t), k.block > 1);
  }
  // The block sizes agree with the layouts written out above.
  for (const Format& f : formats()) {
    EXPECT_EQ(ggml_block_size(f.type), f.n) << f.name;
    EXPECT_EQ(ggml_type_size(f.type), f.bytes) << f.name;
  }
  EXPECT_EQ(ggml_row_bytes(GgmlType::Q4_K, 4096), 16u * 144);
  EXPECT_EQ(ggml_row_bytes(GgmlType::F16, 3), 6u);
  // Types without a block layout here: named, no size.
  for (uint32_t id : {16u, 17u, 18u, 19u, 20u, 21u, 22u, 23u, 29u, 34u, 35u, 39u}) {
    EXPECT_EQ(ggml_block_size(GgmlType(id)), 0) << id;
    EXPECT_EQ(ggml_type_size(GgmlType(id)), 0u) << id;
    EXPECT_NE(ggml_type_name(id).rfind("type ", 0), 0u) << id;
  }
  EXPECT_EQ(ggml_type_name(16), "IQ2_XXS");
  EXPECT_EQ(ggml_type_name(99), "type 99");
  EXPECT_EQ(ggml_type_name(4), "type 4");  // removed from ggml (Q4_2)
  EXPECT_EQ(ggml_block_size(GgmlType(99)), 0);
}

TEST(GgmlTypes, RowBytesRejectsPartialBlocksAndUnknownTypes) {
  try {
    ggml_row_bytes(GgmlType::Q8_0, 48);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("48"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Q8_0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("32"), std::string::npos) << msg;
  }
  EXPECT_THROW(ggml_row_bytes(GgmlType::Q4_K, 128), Error);
  EXPECT_THROW(ggml_row_bytes(GgmlType::F32, -1), Error);
  EXPECT_THROW(ggml_row_bytes(GgmlType(99), 32), Error);
  EXPECT_THROW(ggml_row_bytes(GgmlType::F32, int64_t(1) << 62), Error);  // 2^64 bytes overflow size_t
}

TEST(GgmlTypes, SupportedSetIsExactlyTheThirteen) {
  const std::set<uint32_t> supported = {0, 1, 30, 8, 2, 3, 6, 7, 10, 11, 12, 13, 14};
  for (uint32_t id = 0; id < 64; ++id) EXPECT_EQ(ggml_type_supported(id), supported.count(id) == 1) << id;
  EXPECT_FALSE(ggml_type_supported(0xffffffffu));
  const std::string list = ggml_supported_types();
  for (uint32_t id : supported) EXPECT_NE(list.find(ggml_type_name(id)), std::string::npos) << list;
  EXPECT_EQ(std::count(list.begin(), list.end(), ','), 12) << list;
  EXPECT_EQ(list.find("Q8_1"), std::string::npos) << list;
}

TEST(GgmlTypes, UnsupportedTypesAreNamedInErrors) {
  std::vector<float> f(256);
  Bytes b(2048);
  const struct {
    GgmlType t;
    const char* shown;
  } cases[] = {{GgmlType::Q8_1, "Q8_1"}, {GgmlType::Q8_K, "Q8_K"}, {GgmlType::I32, "I32"},
               {GgmlType::F64, "F64"},   {GgmlType(16), "IQ2_XXS"}, {GgmlType(99), "type 99"}};
  for (const auto& c : cases) {
    for (bool deq : {true, false}) {
      try {
        if (deq) dequantize_row(c.t, b.data(), f.data(), 256);
        else quantize_row(c.t, f.data(), b.data(), 256);
        ADD_FAILURE() << c.shown << " accepted";
      } catch (const Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(c.shown), std::string::npos) << msg;
        EXPECT_NE(msg.find("not supported"), std::string::npos) << msg;
        EXPECT_NE(msg.find("Q4_K"), std::string::npos) << msg;  // the supported list
      }
    }
  }
}

}  // namespace
}  // namespace llmdiff
