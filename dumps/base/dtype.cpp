#include "dumps/base/dtype.h"

#include <cmath>

namespace llmdiff {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    case DType::I8: case DType::U8: case DType::BOOL: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F64: return "F64";
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::I16: return "I16";
    case DType::I8: return "I8";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
  }
  return "?";
}

std::optional<DType> parse_dtype(const std::string& s) {
  static const std::pair<const char*, DType> table[] = {
      {"F64", DType::F64}, {"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16},
      {"I64", DType::I64}, {"I32", DType::I32}, {"I16", DType::I16}, {"I8", DType::I8},
      {"U8", DType::U8},   {"BOOL", DType::BOOL}};
  for (const auto& [name, t] : table)
    if (s == name) return t;
  return std::nullopt;
}

bool dtype_is_float(DType t) {
  return t == DType::F64 || t == DType::F32 || t == DType::F16 || t == DType::BF16;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; mant <<= 1; } while ((mant & 0x400) == 0);
      u = sign | uint32_t(127 - 15 - e) << 23 | (mant & 0x3ff) << 13;
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | mant << 13;
  } else {
    u = sign | (exp + 112) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00;  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65520: Inf
  if (abs < 0x38800000u) {  // subnormal or zero in half: value * 2^24 rounded to integer
    float a;
    std::memcpy(&a, &abs, 4);
    return sign | uint16_t(std::nearbyint(a * 16777216.0f));
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | uint16_t(r >> 13);
}

double load_as_double(const void* data, DType t, size_t i) {
  const auto* p = static_cast<const uint8_t*>(data);
  switch (t) {
    case DType::F64: { double v; std::memcpy(&v, p + 8 * i, 8); return v; }
    case DType::F32: { float v; std::memcpy(&v, p + 4 * i, 4); return v; }
    case DType::F16: { uint16_t v; std::memcpy(&v, p + 2 * i, 2); return f16_to_f32(v); }
    case DType::BF16: { uint16_t v; std::memcpy(&v, p + 2 * i, 2); return bf16_to_f32(v); }
    case DType::I64: { int64_t v; std::memcpy(&v, p + 8 * i, 8); return double(v); }
    case DType::I32: { int32_t v; std::memcpy(&v, p + 4 * i, 4); return v; }
    case DType::I16: { int16_t v; std::memcpy(&v, p + 2 * i, 2); return v; }
    case DType::I8: return double(int8_t(p[i]));
    case DType::U8: return p[i];
    case DType::BOOL: return p[i] ? 1.0 : 0.0;
  }
  return 0.0;
}

void convert_to_f32(const void* src, DType t, size_t n, float* dst) {
  if (n == 0) return;  // an empty tensor may come with null pointers
  if (t == DType::F32) {
    std::memcpy(dst, src, n * 4);
    return;
  }
  const auto* p = static_cast<const uint8_t*>(src);
  if (t == DType::BF16) {
    for (size_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      dst[i] = bf16_to_f32(v);
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) dst[i] = float(load_as_double(src, t, i));
}

}  // namespace llmdiff
