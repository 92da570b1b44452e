// ggml's tensor types and their block layouts (the data of GGUF files), with
// dequantisation to float32 and reference quantisation. Plain C++, no
// dependencies; the layouts follow ggml's definition (ggml-common.h):
//   Q4_0  {f16 d; u8 qs[16]}                       32 values, x = d*(q-8)
//   Q4_1  {f16 d, m; u8 qs[16]}                    32 values, x = d*q + m
//   Q5_0  {f16 d; u8 qh[4]; u8 qs[16]}             32 values, x = d*(q-16)
//   Q5_1  {f16 d, m; u8 qh[4]; u8 qs[16]}          32 values, x = d*q + m
//   Q8_0  {f16 d; i8 qs[32]}                       32 values, x = d*q
//   Q2_K  {u8 scales[16]; u8 qs[64]; f16 d, dmin}  256 values
//   Q3_K  {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}
//   Q4_K  {f16 d, dmin; u8 scales[12]; u8 qs[128]}
//   Q5_K  {f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}
//   Q6_K  {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "dumps/base/dtype.h"

namespace llmdiff {

// The numeric values are ggml's (enum ggml_type) as stored in GGUF files.
enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, BF16 = 30,
};

// "Q4_K", "F16", ...; for a value ggml does not define: "type 99".
std::string ggml_type_name(uint32_t type);
// Whether llmdiff can read tensors of this type (dequantize_row works): F32,
// F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
bool ggml_type_supported(uint32_t type);
// The supported types, comma separated, for error messages.
std::string ggml_supported_types();
// Values per block and bytes per block (1 and the element size for F32, F16,
// BF16, I8..F64). 0, 0 for an unknown type.
int64_t ggml_block_size(GgmlType t);
size_t ggml_type_size(GgmlType t);
// Bytes of a row of `n` values; throws llmdiff::Error when n is not a multiple
// of the block size.
size_t ggml_row_bytes(GgmlType t, int64_t n);
bool ggml_is_quantized(GgmlType t);  // a block type (not F32/F16/BF16/I*/F64)

// GGML_FP16_TO_FP32 (ggml_compute_fp16_to_fp32), how ggml reads every
// block's f16 scale: exact, subnormals included; a NaN comes out quiet, as
// ggml's float arithmetic leaves it. With F16C one instruction does exactly
// that (ggml's x86 build uses it too); a call per block held the
// dequantisation up.
inline float ggml_fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  float f = f16_to_f32(h);
  if ((h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u |= 0x00400000u;
    std::memcpy(&f, &u, 4);
  }
  return f;
#endif
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) of a
// super-block from its 12 packed bytes (ggml's get_scale_min_k4). Bytes
// 0-3: scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes
// 4-7: mins 0-3 and the top 2 bits of mins 4-7; bytes 8-11: low nibble the
// low 4 bits of scale j, high nibble of min j.
inline void ggml_scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = uint8_t((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = uint8_t((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
  }
}

// Dequantises `n` values (a multiple of the block size) from `src` into
// `dst`, exactly as ggml's dequantize_row_* (float32 arithmetic in the same
// order, so results are bit-identical). Throws llmdiff::Error for an
// unsupported type.
void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n);

// Quantises `n` float32 values into blocks of type `t` (the supported block
// types and F32/F16/BF16), following ggml's reference quantisers
// (quantize_row_*_ref): scales chosen the same way, so a model quantised here
// looks like one from llama.cpp's quantize tool without an importance matrix.
// `dst` holds ggml_row_bytes(t, n) bytes.
void quantize_row(GgmlType t, const float* src, void* dst, int64_t n);

// The type ggml's CPU backend converts a matmul's activations to before the
// dot products with weights of type `weight` (type_traits_cpu's
// vec_dot_type): F16 for F16, BF16 for BF16, Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1
// for Q4_1/Q5_1, Q8_K for the K-quants, F32 for F32.
GgmlType ggml_vec_dot_type(GgmlType weight);

// `n` activations as the dot product with such weights sees them: rounded to
// F16/BF16, or quantised to 8 bits in blocks as quantize_row_q8_0_ref /
// q8_1_ref (32 values, scale amax/127 stored as f16, round half away from
// zero) and quantize_row_q8_K_ref (256 values, float scale max/-127 of the
// largest-magnitude value, nearest_int) do, then multiplied back by the
// scale. F32: copied. n must be a multiple of the block size. y may alias x.
void round_activations(GgmlType act, const float* x, float* y, int64_t n);

}  // namespace llmdiff
