// Element types of safetensors files and exact conversions to/from float32.
#pragma once
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

namespace llmdiff {

enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

size_t dtype_size(DType t);
const char* dtype_name(DType t);                         // "F32", "BF16", ...
std::optional<DType> parse_dtype(const std::string& s);  // safetensors spelling
bool dtype_is_float(DType t);

// bfloat16 <-> float32. Widening is exact; narrowing rounds to nearest even
// (NaN stays NaN), as torch does.
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
// IEEE half <-> float32 (exact widening, round-to-nearest-even narrowing).
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// Reads element i of a buffer of type t as double (integers exactly up to 2^53).
double load_as_double(const void* data, DType t, size_t i);
// Converts n elements of type t to float32 (integers converted by value).
void convert_to_f32(const void* src, DType t, size_t n, float* dst);

}  // namespace llmdiff
