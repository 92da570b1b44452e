// ggml's block types: layouts, dequantisation and reference quantisation.
// Each routine names the ggml function (ggml/src/ggml-quants.c) it mirrors;
// the float32 arithmetic is the same, operation for operation, so results are
// bit-identical to ggml built without floating-point contraction.
#include "dumps/formats/ggml_types.h"

#include <cfloat>
#include <cstddef>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "dumps/base/dtype.h"
#include "dumps/base/errors.h"

// a*b + c must stay two roundings, as in ggml's C (contracting it into a fused
// multiply-add would change the quantisers' choices).
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the block structs below are read and written in the host's byte order: little-endian only"
#endif

namespace llmdiff {
namespace {

// ------------------------------------------------------------------ layouts

constexpr int kQK = 32;    // values per block of the 32-value types (QK4_0 ... QK8_0)
constexpr int kQK_K = 256; // values per super-block of the K-quants (QK_K)

using f16 = uint16_t;  // IEEE half, as stored (ggml_half)

// Every struct below has ggml's byte layout exactly: no padding (the sizes
// are asserted), fields in ggml's order, read and written with memcpy so the
// source may have any alignment.
struct BlockQ4_0 {  // x = d * (q - 8); q[j] low nibble of qs[j], q[j+16] high nibble
  f16 d;
  uint8_t qs[kQK / 2];
};
struct BlockQ4_1 {  // x = d * q + m
  f16 d, m;
  uint8_t qs[kQK / 2];
};
struct BlockQ5_0 {  // x = d * (q - 16); bit 4 of q[j] is bit j of qh (little-endian u32)
  f16 d;
  uint8_t qh[4];
  uint8_t qs[kQK / 2];
};
struct BlockQ5_1 {  // x = d * q + m
  f16 d, m;
  uint8_t qh[4];
  uint8_t qs[kQK / 2];
};
struct BlockQ8_0 {  // x = d * q
  f16 d;
  int8_t qs[kQK];
};
// 16 sub-blocks of 16: x = d * (scales[j] & 15) * q - dmin * (scales[j] >> 4), q 2 bits.
struct BlockQ2_K {
  uint8_t scales[kQK_K / 16];
  uint8_t qs[kQK_K / 4];
  f16 d, dmin;
};
// 16 sub-blocks of 16: x = d * (s[j] - 32) * (q - 4), s 6 bits packed in
// scales[12]; q: 2 low bits in qs, the high bit in hmask (set = no -4).
struct BlockQ3_K {
  uint8_t hmask[kQK_K / 8];
  uint8_t qs[kQK_K / 4];
  uint8_t scales[12];
  f16 d;
};
// 8 sub-blocks of 32: x = d * sc[j] * q - dmin * m[j], sc and m 6 bits packed in scales[12].
struct BlockQ4_K {
  f16 d, dmin;
  uint8_t scales[12];
  uint8_t qs[kQK_K / 2];
};
struct BlockQ5_K {  // as Q4_K with a fifth bit per value in qh
  f16 d, dmin;
  uint8_t scales[12];
  uint8_t qh[kQK_K / 8];
  uint8_t qs[kQK_K / 2];
};
// 16 sub-blocks of 16: x = d * scales[j] * (q - 32), q: 4 low bits in ql, 2 high bits in qh.
struct BlockQ6_K {
  uint8_t ql[kQK_K / 2];
  uint8_t qh[kQK_K / 4];
  int8_t scales[kQK_K / 16];
  f16 d;
};

static_assert(sizeof(BlockQ4_0) == 18, "block_q4_0 is 18 bytes");
static_assert(sizeof(BlockQ4_1) == 20, "block_q4_1 is 20 bytes");
static_assert(sizeof(BlockQ5_0) == 22, "block_q5_0 is 22 bytes");
static_assert(sizeof(BlockQ5_1) == 24, "block_q5_1 is 24 bytes");
static_assert(sizeof(BlockQ8_0) == 34, "block_q8_0 is 34 bytes");
static_assert(sizeof(BlockQ2_K) == 84, "block_q2_K is 84 bytes");
static_assert(sizeof(BlockQ3_K) == 110, "block_q3_K is 110 bytes");
static_assert(sizeof(BlockQ4_K) == 144, "block_q4_K is 144 bytes");
static_assert(sizeof(BlockQ5_K) == 176, "block_q5_K is 176 bytes");
static_assert(sizeof(BlockQ6_K) == 210, "block_q6_K is 210 bytes");

// ------------------------------------------------------------- type traits

struct Traits {
  uint32_t id;
  const char* name;
  int64_t block;  // values per block (0: no size known here)
  size_t size;    // bytes per block
  bool supported; // dequantize_row handles it
};

// Every type ggml defines (ggml.h, enum ggml_type); sizes for those of GgmlType.
constexpr Traits kTraits[] = {
    {0, "F32", 1, 4, true},       {1, "F16", 1, 2, true},
    {2, "Q4_0", 32, 18, true},    {3, "Q4_1", 32, 20, true},
    {6, "Q5_0", 32, 22, true},    {7, "Q5_1", 32, 24, true},
    {8, "Q8_0", 32, 34, true},    {9, "Q8_1", 32, 36, false},
    {10, "Q2_K", 256, 84, true},  {11, "Q3_K", 256, 110, true},
    {12, "Q4_K", 256, 144, true}, {13, "Q5_K", 256, 176, true},
    {14, "Q6_K", 256, 210, true}, {15, "Q8_K", 256, 292, false},
    {16, "IQ2_XXS", 0, 0, false}, {17, "IQ2_XS", 0, 0, false},
    {18, "IQ3_XXS", 0, 0, false}, {19, "IQ1_S", 0, 0, false},
    {20, "IQ4_NL", 0, 0, false},  {21, "IQ3_S", 0, 0, false},
    {22, "IQ2_S", 0, 0, false},   {23, "IQ4_XS", 0, 0, false},
    {24, "I8", 1, 1, false},      {25, "I16", 1, 2, false},
    {26, "I32", 1, 4, false},     {27, "I64", 1, 8, false},
    {28, "F64", 1, 8, false},     {29, "IQ1_M", 0, 0, false},
    {30, "BF16", 1, 2, true},     {34, "TQ1_0", 0, 0, false},
    {35, "TQ2_0", 0, 0, false},   {39, "MXFP4", 0, 0, false},
    {40, "NVFP4", 0, 0, false},   {41, "Q1_0", 0, 0, false},
    {42, "Q2_0", 0, 0, false},
};

const Traits* traits(uint32_t id) {
  for (const auto& t : kTraits)
    if (t.id == id) return &t;
  return nullptr;
}

// --------------------------------------------------------- scalar helpers

// GGML_FP32_TO_FP16 (ggml_compute_fp32_to_fp16): round to nearest even,
// overflow to infinity, NaN to 0x7e00 with the sign kept.
inline f16 fp32_to_fp16(float f) { return f32_to_f16(f); }

// ggml's MAX / MIN macros, which differ from std::max / std::min when the
// second argument is NaN.
template <class T>
inline T gmax(T a, T b) { return a > b ? a : b; }
template <class T>
inline T gmin(T a, T b) { return a < b ? a : b; }

// C's float -> integer cast as x86 performs it (cvttss2si): truncation
// toward zero, and INT32_MIN for NaN and values outside int32. ggml's
// narrower casts, (int8_t)(v) and (uint8_t)(v), keep the low bits of that.
// Unlike the cast itself this is defined for every input.
inline int32_t trunc_to_int(float v) {
  return (v > -2147483904.0f && v < 2147483648.0f) ? int32_t(v) : INT32_MIN;
}
inline int8_t trunc_to_i8(float v) { return int8_t(uint8_t(uint32_t(trunc_to_int(v)))); }
inline uint8_t trunc_to_u8(float v) { return uint8_t(uint32_t(trunc_to_int(v))); }

// nearest_int: round to nearest (ties to even) for |fval| <= 4194303 by
// adding 1.5 * 2^23 and reading the mantissa; well defined for any input.
inline int nearest_int(float fval) {
  const float val = fval + 12582912.f;
  int32_t i;
  std::memcpy(&i, &val, 4);
  return (i & 0x007fffff) - 0x00400000;
}

constexpr float kGroupMaxEps = 1e-15f;  // GROUP_MAX_EPS

// The quantisation weight of make_qx_quants for `rmse_type` 1..4.
inline float qx_weight(int rmse_type, float x) {
  return rmse_type == 1 ? x * x : rmse_type == 2 ? 1 : rmse_type == 3 ? std::fabs(x) : std::sqrt(std::fabs(x));
}

// The value of largest magnitude (signed; the first of equals), as ggml's
// reference quantisers look for it.
inline float signed_absmax(const float* x, int n) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < n; ++j) {
    const float v = x[j];
    if (amax < std::fabs(v)) {
      amax = std::fabs(v);
      max = v;
    }
  }
  return max;
}

// make_qx_quants without importance weights: symmetric levels L in
// [0, 2*nmax) (value = scale * (L - nmax)); returns the scale.
float make_qx_quants(int n, int nmax, const float* x, int8_t* L, int rmse_type) {
  const float max = signed_absmax(x, n), amax = std::fabs(max);
  if (amax < kGroupMaxEps) {  // all zero
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  float iscale = -nmax / max;
  if (rmse_type == 0) {
    for (int i = 0; i < n; ++i) {
      const int l = nearest_int(iscale * x[i]);
      L[i] = int8_t(nmax + gmax(-nmax, gmin(nmax - 1, l)));
    }
    return 1 / iscale;
  }
  bool return_early = false;
  if (rmse_type < 0) {
    rmse_type = -rmse_type;
    return_early = true;
  }
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    int l = nearest_int(iscale * x[i]);
    l = gmax(-nmax, gmin(nmax - 1, l));
    L[i] = int8_t(l + nmax);
    const float w = qx_weight(rmse_type, x[i]);
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  float scale = suml2 ? sumlx / suml2 : 0.0f;
  if (return_early) return suml2 > 0 ? 0.5f * (scale + 1 / iscale) : 1 / iscale;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(nmax + 0.1f * is) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * x[i]);
      l = gmax(-nmax, gmin(nmax - 1, l));
      const float w = qx_weight(rmse_type, x[i]);
      sumlx += w * x[i] * l;
      suml2 += w * l * l;
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) {
        const int l = nearest_int(iscale * x[i]);
        L[i] = int8_t(nmax + gmax(-nmax, gmin(nmax - 1, l)));
      }
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// make_q3_quants: symmetric levels in [0, 2*nmax), refined by coordinate
// descent on the x^2-weighted error when do_rmse.
float make_q3_quants(int n, int nmax, const float* x, int8_t* L, bool do_rmse) {
  const float max = signed_absmax(x, n), amax = std::fabs(max);
  if (amax < kGroupMaxEps) {  // all zero
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  const float iscale = -nmax / max;
  if (do_rmse) {
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * x[i]);
      l = gmax(-nmax, gmin(nmax - 1, l));
      L[i] = int8_t(l);
      const float w = x[i] * x[i];
      sumlx += w * x[i] * l;
      suml2 += w * l * l;
    }
    for (int itry = 0; itry < 5; ++itry) {
      int n_changed = 0;
      for (int i = 0; i < n; ++i) {
        const float w = x[i] * x[i];
        float slx = sumlx - w * x[i] * L[i];
        if (slx > 0) {
          float sl2 = suml2 - w * L[i] * L[i];
          int new_l = nearest_int(x[i] * sl2 / slx);
          new_l = gmax(-nmax, gmin(nmax - 1, new_l));
          if (new_l != L[i]) {
            slx += w * x[i] * new_l;
            sl2 += w * new_l * new_l;
            if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
              L[i] = int8_t(new_l);
              sumlx = slx;
              suml2 = sl2;
              ++n_changed;
            }
          }
        }
      }
      if (!n_changed) break;
    }
    for (int i = 0; i < n; ++i) L[i] = int8_t(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
  }
  for (int i = 0; i < n; ++i) {
    int l = nearest_int(iscale * x[i]);
    l = gmax(-nmax, gmin(nmax - 1, l));
    L[i] = int8_t(l + nmax);
  }
  return 1 / iscale;
}

// make_qkx2_quants: asymmetric levels L in [0, nmax] with
// value = scale * L - the_min; searches nstep+1 scales around nmax/(max-min)
// for the least weighted error (absolute when use_mad, else squared).
float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* the_min,
                       uint8_t* Laux, float rmin, float rdelta, int nstep, bool use_mad) {
  float min = x[0], max = x[0];
  float sum_w = weights[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    const float w = weights[i];
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -min;
    return 0.f;
  }
  float iscale = nmax / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    const int l = nearest_int(iscale * (x[i] - min));
    L[i] = uint8_t(gmax(0, gmin(nmax, l)));
    float diff = scale * L[i] + min - x[i];
    diff = use_mad ? std::fabs(diff) : diff * diff;
    best_error += weights[i] * diff;
  }
  if (nstep < 1) {
    *the_min = -min;
    return scale;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * (x[i] - min));
      l = gmax(0, gmin(nmax, l));
      Laux[i] = uint8_t(l);
      const float w = weights[i];
      sum_l += w * l;
      sum_l2 += w * l * l;
      sum_xl += w * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        float diff = this_scale * Laux[i] + this_min - x[i];
        diff = use_mad ? std::fabs(diff) : diff * diff;
        cur_error += weights[i] * diff;
      }
      if (cur_error < best_error) {
        for (int i = 0; i < n; ++i) L[i] = Laux[i];
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

// The 6-bit scale j (0..15) of a Q3_K block, biased by 32: low 4 bits in the
// nibbles of scales[0..7], top 2 bits in the bit pairs of scales[8..11].
inline int q3_k_scale(const uint8_t* scales, int j) {
  const int lo = j < 8 ? scales[j] & 0xF : scales[j - 8] >> 4;
  const int hi = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
  return lo | (hi << 4);
}

// Packs 2-bit levels of 256 values into 64 bytes (Q2_K, Q3_K): byte l of
// each 32-byte half holds values l, l+32, l+64, l+96 of that 128.
void pack_2bit(const uint8_t* L, uint8_t* qs) {
  for (int j = 0; j < kQK_K; j += 128)
    for (int l = 0; l < 32; ++l)
      qs[j / 4 + l] = uint8_t(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

// --------------------------------------------------------- dequantisation

void dequant(const BlockQ4_0& b, float* y) {  // dequantize_row_q4_0
  const float d = ggml_fp16_to_fp32(b.d);
  for (int j = 0; j < kQK / 2; ++j) {
    const int x0 = (b.qs[j] & 0x0F) - 8;
    const int x1 = (b.qs[j] >> 4) - 8;
    y[j] = x0 * d;
    y[j + kQK / 2] = x1 * d;
  }
}

void dequant(const BlockQ4_1& b, float* y) {  // dequantize_row_q4_1
  const float d = ggml_fp16_to_fp32(b.d);
  const float m = ggml_fp16_to_fp32(b.m);
  for (int j = 0; j < kQK / 2; ++j) {
    const int x0 = b.qs[j] & 0x0F;
    const int x1 = b.qs[j] >> 4;
    y[j] = x0 * d + m;
    y[j + kQK / 2] = x1 * d + m;
  }
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void dequant(const BlockQ5_0& b, float* y) {  // dequantize_row_q5_0
  const float d = ggml_fp16_to_fp32(b.d);
  const uint32_t qh = load_u32(b.qh);
  for (int j = 0; j < kQK / 2; ++j) {
    const int xh_0 = ((qh >> j) << 4) & 0x10;
    const int xh_1 = (qh >> (j + 12)) & 0x10;
    const int x0 = ((b.qs[j] & 0x0F) | xh_0) - 16;
    const int x1 = ((b.qs[j] >> 4) | xh_1) - 16;
    y[j] = x0 * d;
    y[j + kQK / 2] = x1 * d;
  }
}

void dequant(const BlockQ5_1& b, float* y) {  // dequantize_row_q5_1
  const float d = ggml_fp16_to_fp32(b.d);
  const float m = ggml_fp16_to_fp32(b.m);
  const uint32_t qh = load_u32(b.qh);
  for (int j = 0; j < kQK / 2; ++j) {
    const int xh_0 = ((qh >> j) << 4) & 0x10;
    const int xh_1 = (qh >> (j + 12)) & 0x10;
    const int x0 = (b.qs[j] & 0x0F) | xh_0;
    const int x1 = (b.qs[j] >> 4) | xh_1;
    y[j] = x0 * d + m;
    y[j + kQK / 2] = x1 * d + m;
  }
}

// dequantize_row_q8_0 of one block, read in place: a block copied out
// whole first (dequant_blocks) is read back across the pieces the copy
// wrote, a stall per 32 values.
void dequant_q8_0(const uint8_t* block, float* y) {
  f16 h;
  std::memcpy(&h, block + offsetof(BlockQ8_0, d), sizeof h);
  const float d = ggml_fp16_to_fp32(h);
  const auto* q = reinterpret_cast<const int8_t*>(block + offsetof(BlockQ8_0, qs));
  for (int j = 0; j < kQK; ++j) y[j] = q[j] * d;
}

void dequant(const BlockQ8_0& b, float* y) { dequant_q8_0(reinterpret_cast<const uint8_t*>(&b), y); }

void dequant(const BlockQ2_K& b, float* y) {  // dequantize_row_q2_K
  const float d = ggml_fp16_to_fp32(b.d);
  const float min = ggml_fp16_to_fp32(b.dmin);
  const uint8_t* q = b.qs;
  int is = 0;
  for (int n = 0; n < kQK_K; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half) {  // values l and l+16 of q
        const uint8_t sc = b.scales[is++];
        const float dl = d * (sc & 0xF), ml = min * (sc >> 4);
        for (int l = 0; l < 16; ++l) *y++ = dl * ((q[l + 16 * half] >> shift) & 3) - ml;
      }
    }
    q += 32;
  }
}

void dequant(const BlockQ3_K& b, float* y) {  // dequantize_row_q3_K
  const float d_all = ggml_fp16_to_fp32(b.d);
  const uint8_t* q = b.qs;
  uint8_t m = 1;  // the hmask bit of the current 32 values
  int is = 0;
  for (int n = 0; n < kQK_K; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half) {
        const float dl = d_all * (q3_k_scale(b.scales, is++) - 32);
        for (int l = 0; l < 16; ++l) {
          const int k = l + 16 * half;
          *y++ = dl * (((q[k] >> shift) & 3) - ((b.hmask[k] & m) ? 0 : 4));
        }
      }
      m = uint8_t(m << 1);
    }
    q += 32;
  }
}

void dequant(const BlockQ4_K& b, float* y) {  // dequantize_row_q4_K
  const float d = ggml_fp16_to_fp32(b.d);
  const float min = ggml_fp16_to_fp32(b.dmin);
  const uint8_t* q = b.qs;
  for (int is = 0; is < 8; is += 2) {  // 64 values: low nibbles, then high nibbles
    uint8_t sc, m;
    ggml_scale_min_k4(is + 0, b.scales, &sc, &m);
    const float d1 = d * sc, m1 = min * m;
    ggml_scale_min_k4(is + 1, b.scales, &sc, &m);
    const float d2 = d * sc, m2 = min * m;
    for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
    q += 32;
  }
}

void dequant(const BlockQ5_K& b, float* y) {  // dequantize_row_q5_K
  const float d = ggml_fp16_to_fp32(b.d);
  const float min = ggml_fp16_to_fp32(b.dmin);
  const uint8_t* ql = b.qs;
  uint8_t u1 = 1, u2 = 2;  // the qh bits of the two 32-value halves
  for (int is = 0; is < 8; is += 2) {
    uint8_t sc, m;
    ggml_scale_min_k4(is + 0, b.scales, &sc, &m);
    const float d1 = d * sc, m1 = min * m;
    ggml_scale_min_k4(is + 1, b.scales, &sc, &m);
    const float d2 = d * sc, m2 = min * m;
    for (int l = 0; l < 32; ++l) *y++ = d1 * ((ql[l] & 0xF) + (b.qh[l] & u1 ? 16 : 0)) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * ((ql[l] >> 4) + (b.qh[l] & u2 ? 16 : 0)) - m2;
    ql += 32;
    u1 = uint8_t(u1 << 2);
    u2 = uint8_t(u2 << 2);
  }
}

void dequant(const BlockQ6_K& b, float* y) {  // dequantize_row_q6_K
  const float d = ggml_fp16_to_fp32(b.d);
  const uint8_t* ql = b.ql;
  const uint8_t* qh = b.qh;
  const int8_t* sc = b.scales;
  for (int n = 0; n < kQK_K; n += 128) {
    // ggml's loop over l = 0..31 with is = l / 16, as two loops of 16 over
    // which d * sc[is + k] is one value (the same products, each rounded
    // as there; a loop the compiler vectorises).
    for (int is = 0; is < 2; ++is) {
      const float s1 = d * sc[is + 0], s2 = d * sc[is + 2], s3 = d * sc[is + 4], s4 = d * sc[is + 6];
      for (int l = 16 * is; l < 16 * is + 16; ++l) {
        const int q1 = ((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l + 0] = s1 * float(q1);
        y[l + 32] = s2 * float(q2);
        y[l + 64] = s3 * float(q3);
        y[l + 96] = s4 * float(q4);
      }
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

template <class Block, int kValues>
void dequant_blocks(const void* src, float* dst, int64_t n) {
  static_assert(std::is_trivially_copyable<Block>::value, "blocks are copied bytewise");
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < n / kValues; ++i) {
    Block b;
    std::memcpy(&b, p + i * int64_t(sizeof(Block)), sizeof(Block));
    dequant(b, dst + i * kValues);
  }
}

// ----------------------------------------------------------- quantisation

void quant(const float* x, BlockQ4_0& y) {  // quantize_row_q4_0_ref
  const float max = signed_absmax(x, kQK);
  const float d = max / -8;
  const float id = d ? 1.0f / d : 0.0f;
  y.d = fp32_to_fp16(d);
  for (int j = 0; j < kQK / 2; ++j) {
    const float x0 = x[j] * id;
    const float x1 = x[kQK / 2 + j] * id;
    const uint8_t xi0 = uint8_t(gmin<int>(15, trunc_to_i8(x0 + 8.5f)));
    const uint8_t xi1 = uint8_t(gmin<int>(15, trunc_to_i8(x1 + 8.5f)));
    y.qs[j] = uint8_t(xi0 | (xi1 << 4));
  }
}

// The min and max of a 32-value block, as quantize_row_q4_1_ref / q5_1 find them.
inline void block_min_max(const float* x, float* min, float* max) {
  *min = FLT_MAX;
  *max = -FLT_MAX;
  for (int j = 0; j < kQK; ++j) {
    const float v = x[j];
    if (v < *min) *min = v;
    if (v > *max) *max = v;
  }
}

void quant(const float* x, BlockQ4_1& y) {  // quantize_row_q4_1_ref
  float min, max;
  block_min_max(x, &min, &max);
  const float d = (max - min) / ((1 << 4) - 1);
  const float id = d ? 1.0f / d : 0.0f;
  y.d = fp32_to_fp16(d);
  y.m = fp32_to_fp16(min);
  for (int j = 0; j < kQK / 2; ++j) {
    const float x0 = (x[j] - min) * id;
    const float x1 = (x[kQK / 2 + j] - min) * id;
    const uint8_t xi0 = uint8_t(gmin<int>(15, trunc_to_i8(x0 + 0.5f)));
    const uint8_t xi1 = uint8_t(gmin<int>(15, trunc_to_i8(x1 + 0.5f)));
    y.qs[j] = uint8_t(xi0 | (xi1 << 4));
  }
}

// The nibbles and fifth bits of 32 five-bit levels (Q5_0, Q5_1).
inline void pack_5bit(const uint8_t* xi, uint8_t* qs, uint8_t* qh_bytes) {
  uint32_t qh = 0;
  for (int j = 0; j < kQK / 2; ++j) {
    const uint8_t xi0 = xi[j], xi1 = xi[j + kQK / 2];
    qs[j] = uint8_t((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
    qh |= uint32_t((xi0 & 0x10u) >> 4) << (j + 0);
    qh |= uint32_t((xi1 & 0x10u) >> 4) << (j + kQK / 2);
  }
  std::memcpy(qh_bytes, &qh, 4);
}

void quant(const float* x, BlockQ5_0& y) {  // quantize_row_q5_0_ref
  const float max = signed_absmax(x, kQK);
  const float d = max / -16;
  const float id = d ? 1.0f / d : 0.0f;
  y.d = fp32_to_fp16(d);
  uint8_t xi[kQK];
  for (int j = 0; j < kQK; ++j) {
    const float x0 = x[j] * id;
    xi[j] = uint8_t(gmin<int>(31, trunc_to_i8(x0 + 16.5f)));
  }
  pack_5bit(xi, y.qs, y.qh);
}

void quant(const float* x, BlockQ5_1& y) {  // quantize_row_q5_1_ref
  float min, max;
  block_min_max(x, &min, &max);
  const float d = (max - min) / ((1 << 5) - 1);
  const float id = d ? 1.0f / d : 0.0f;
  y.d = fp32_to_fp16(d);
  y.m = fp32_to_fp16(min);
  uint8_t xi[kQK];
  for (int j = 0; j < kQK; ++j) {
    const float x0 = (x[j] - min) * id;
    xi[j] = trunc_to_u8(x0 + 0.5f);
  }
  pack_5bit(xi, y.qs, y.qh);
}

void quant(const float* x, BlockQ8_0& y) {  // quantize_row_q8_0_ref
  float amax = 0.0f;
  for (int j = 0; j < kQK; ++j) amax = gmax(amax, std::fabs(x[j]));
  const float d = amax / ((1 << 7) - 1);
  const float id = d ? 1.0f / d : 0.0f;
  y.d = fp32_to_fp16(d);
  for (int j = 0; j < kQK; ++j) {
    const float x0 = x[j] * id;
    y.qs[j] = trunc_to_i8(std::round(x0));
  }
}

void quant(const float* x, BlockQ2_K& y) {  // quantize_row_q2_K_ref
  uint8_t L[kQK_K], Laux[16];
  float weights[16], mins[kQK_K / 16], scales[kQK_K / 16];
  const float q4scale = 15.f;

  float max_scale = 0, max_min = 0;  // scales are positive: the min is subtracted
  for (int j = 0; j < kQK_K / 16; ++j) {
    for (int l = 0; l < 16; ++l) weights[l] = std::fabs(x[16 * j + l]);
    scales[j] = make_qkx2_quants(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux, -0.5f, 0.1f, 15, true);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  if (max_scale > 0) {
    const float iscale = q4scale / max_scale;
    for (int j = 0; j < kQK_K / 16; ++j) y.scales[j] = uint8_t(nearest_int(iscale * scales[j]));
    y.d = fp32_to_fp16(max_scale / q4scale);
  } else {
    for (int j = 0; j < kQK_K / 16; ++j) y.scales[j] = 0;
    y.d = fp32_to_fp16(0.f);
  }
  if (max_min > 0) {
    const float iscale = q4scale / max_min;
    for (int j = 0; j < kQK_K / 16; ++j)
      y.scales[j] = uint8_t(y.scales[j] | (uint32_t(nearest_int(iscale * mins[j])) << 4));
    y.dmin = fp32_to_fp16(max_min / q4scale);
  } else {
    y.dmin = fp32_to_fp16(0.f);
  }
  // Levels again, against the scales as stored.
  for (int j = 0; j < kQK_K / 16; ++j) {
    const float d = ggml_fp16_to_fp32(y.d) * (y.scales[j] & 0xF);
    if (!d) continue;
    const float dm = ggml_fp16_to_fp32(y.dmin) * (y.scales[j] >> 4);
    for (int ii = 0; ii < 16; ++ii) {
      const int l = nearest_int((x[16 * j + ii] + dm) / d);
      L[16 * j + ii] = uint8_t(gmax(0, gmin(3, l)));
    }
  }
  pack_2bit(L, y.qs);
}

void quant(const float* x, BlockQ3_K& y) {  // quantize_row_q3_K_ref
  int8_t L[kQK_K];
  float scales[kQK_K / 16];

  float max_scale = 0, amax = 0;
  for (int j = 0; j < kQK_K / 16; ++j) {
    scales[j] = make_q3_quants(16, 4, x + 16 * j, L + 16 * j, true);
    const float scale = std::fabs(scales[j]);
    if (scale > amax) {
      amax = scale;
      max_scale = scales[j];
    }
  }
  std::memset(y.scales, 0, sizeof y.scales);
  if (max_scale) {
    const float iscale = -32.f / max_scale;
    for (int j = 0; j < kQK_K / 16; ++j) {
      int l = int8_t(nearest_int(iscale * scales[j]));  // ggml stores it in an int8_t first
      l = gmax(-32, gmin(31, l)) + 32;
      if (j < 8)
        y.scales[j] = uint8_t(l & 0xF);
      else
        y.scales[j - 8] = uint8_t(y.scales[j - 8] | ((l & 0xF) << 4));
      l >>= 4;
      y.scales[j % 4 + 8] = uint8_t(y.scales[j % 4 + 8] | (l << (2 * (j / 4))));
    }
    y.d = fp32_to_fp16(1 / iscale);
  } else {
    y.d = fp32_to_fp16(0.f);
  }
  // Levels again, against the scales as stored.
  for (int j = 0; j < kQK_K / 16; ++j) {
    const int8_t sc = int8_t(q3_k_scale(y.scales, j) - 32);
    const float d = ggml_fp16_to_fp32(y.d) * sc;
    if (!d) continue;
    for (int ii = 0; ii < 16; ++ii) {
      const int l = nearest_int(x[16 * j + ii] / d);
      L[16 * j + ii] = int8_t(gmax(-4, gmin(3, l)) + 4);
    }
  }
  // The high bit of values 0-31 goes to bit 0 of hmask[0..31], of 32-63 to bit 1, ...
  std::memset(y.hmask, 0, sizeof y.hmask);
  uint8_t low[kQK_K];
  for (int j = 0; j < kQK_K; ++j) {
    int l = L[j];
    if (l > 3) {
      y.hmask[j % 32] = uint8_t(y.hmask[j % 32] | (1u << (j / 32)));
      l -= 4;
    }
    low[j] = uint8_t(l);
  }
  pack_2bit(low, y.qs);
}

// Scales and mins of the 8 sub-blocks of Q4_K / Q5_K quantised to 6 bits
// against their maxima, packed as get_scale_min_k4 reads them.
void pack_scales_k4(const float* scales, const float* mins, float max_scale, float max_min, uint8_t* packed) {
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  for (int j = 0; j < kQK_K / 32; ++j) {
    uint8_t ls = uint8_t(nearest_int(inv_scale * scales[j]));
    uint8_t lm = uint8_t(nearest_int(inv_min * mins[j]));
    ls = gmin<uint8_t>(63, ls);
    lm = gmin<uint8_t>(63, lm);
    if (j < 4) {
      packed[j] = ls;
      packed[j + 4] = lm;
    } else {
      packed[j + 4] = uint8_t((ls & 0xF) | ((lm & 0xF) << 4));
      packed[j - 4] = uint8_t(packed[j - 4] | ((ls >> 4) << 6));
      packed[j - 0] = uint8_t(packed[j - 0] | ((lm >> 4) << 6));
    }
  }
}

// The first half of quantize_row_q4_K_ref / q5_K_ref: per-sub-block scales
// and mins from make_qkx2_quants with weights av_x + |x|; packs them and
// sets d, dmin; then the levels L (0..nmax) against the stored scales.
void quant_k4_scales(const float* x, int nmax, float rmin, int nstep, uint8_t* packed, f16* d_out, f16* dmin_out,
                     uint8_t* L) {
  uint8_t Laux[32];
  float weights[32], mins[kQK_K / 32], scales[kQK_K / 32];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < kQK_K / 32; ++j) {
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(x[32 * j + l]);
    scales[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, rmin, 0.1f, nstep, false);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  pack_scales_k4(scales, mins, max_scale, max_min, packed);
  *d_out = fp32_to_fp16(max_scale / 63.f);
  *dmin_out = fp32_to_fp16(max_min / 63.f);
  for (int j = 0; j < kQK_K / 32; ++j) {
    uint8_t sc, m;
    ggml_scale_min_k4(j, packed, &sc, &m);
    const float d = ggml_fp16_to_fp32(*d_out) * sc;
    if (!d) continue;
    const float dm = ggml_fp16_to_fp32(*dmin_out) * m;
    for (int ii = 0; ii < 32; ++ii) {
      const int l = nearest_int((x[32 * j + ii] + dm) / d);
      L[32 * j + ii] = uint8_t(gmax(0, gmin(nmax, l)));
    }
  }
}

void quant(const float* x, BlockQ4_K& y) {  // quantize_row_q4_K_ref
  uint8_t L[kQK_K];
  quant_k4_scales(x, 15, -1.f, 20, y.scales, &y.d, &y.dmin, L);
  uint8_t* q = y.qs;
  for (int j = 0; j < kQK_K; j += 64) {
    for (int l = 0; l < 32; ++l) q[l] = uint8_t(L[j + l] | (L[j + l + 32] << 4));
    q += 32;
  }
}

void quant(const float* x, BlockQ5_K& y) {  // quantize_row_q5_K_ref
  uint8_t L[kQK_K];
  quant_k4_scales(x, 31, -0.5f, 15, y.scales, &y.d, &y.dmin, L);
  std::memset(y.qh, 0, sizeof y.qh);
  uint8_t* ql = y.qs;
  uint8_t m1 = 1, m2 = 2;
  for (int n = 0; n < kQK_K; n += 64) {
    for (int j = 0; j < 32; ++j) {
      int l1 = L[n + j];
      if (l1 > 15) {
        l1 -= 16;
        y.qh[j] |= m1;
      }
      int l2 = L[n + j + 32];
      if (l2 > 15) {
        l2 -= 16;
        y.qh[j] |= m2;
      }
      ql[j] = uint8_t(l1 | (l2 << 4));
    }
    m1 = uint8_t(m1 << 2);
    m2 = uint8_t(m2 << 2);
    ql += 32;
  }
}

void quant(const float* x, BlockQ6_K& y) {  // quantize_row_q6_K_ref
  int8_t L[kQK_K];
  float scales[kQK_K / 16];
  float max_scale = 0, max_abs_scale = 0;
  for (int ib = 0; ib < kQK_K / 16; ++ib) {
    const float scale = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib, 1);
    scales[ib] = scale;
    const float abs_scale = std::fabs(scale);
    if (abs_scale > max_abs_scale) {
      max_abs_scale = abs_scale;
      max_scale = scale;
    }
  }
  if (max_abs_scale < kGroupMaxEps) {
    std::memset(&y, 0, sizeof y);
    y.d = fp32_to_fp16(0.f);
    return;
  }
  const float iscale = -128.f / max_scale;
  y.d = fp32_to_fp16(1 / iscale);
  for (int ib = 0; ib < kQK_K / 16; ++ib) y.scales[ib] = int8_t(gmin(127, nearest_int(iscale * scales[ib])));
  // Levels again, against the scales as stored.
  for (int j = 0; j < kQK_K / 16; ++j) {
    const float d = ggml_fp16_to_fp32(y.d) * y.scales[j];
    if (!d) continue;
    for (int ii = 0; ii < 16; ++ii) {
      const int l = nearest_int(x[16 * j + ii] / d);
      L[16 * j + ii] = int8_t(gmax(-32, gmin(31, l)) + 32);
    }
  }
  // ql: byte l of each 64 holds the low nibbles of values l and l+64 (l < 32),
  // or l and l+64 shifted by 32; qh: byte l holds bits 4-5 of l, l+32, l+64, l+96.
  uint8_t* ql = y.ql;
  uint8_t* qh = y.qh;
  for (int j = 0; j < kQK_K; j += 128) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t q1 = L[j + l + 0] & 0xF, q2 = L[j + l + 32] & 0xF;
      const uint8_t q3 = L[j + l + 64] & 0xF, q4 = L[j + l + 96] & 0xF;
      ql[l + 0] = uint8_t(q1 | (q3 << 4));
      ql[l + 32] = uint8_t(q2 | (q4 << 4));
      qh[l] = uint8_t((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) |
                      ((L[j + l + 96] >> 4) << 6));
    }
    ql += 64;
    qh += 32;
  }
}

template <class Block, int kValues>
void quant_blocks(const float* src, void* dst, int64_t n) {
  auto* p = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n / kValues; ++i) {
    Block b;
    std::memset(&b, 0, sizeof b);
    quant(src + i * kValues, b);
    std::memcpy(p + i * int64_t(sizeof(Block)), &b, sizeof(Block));
  }
}

void check_count(GgmlType t, int64_t n, const char* what) {
  const int64_t block = ggml_block_size(t);
  if (block == 0) throw Error(std::string(what) + ": unknown ggml type " + std::to_string(uint32_t(t)));
  if (n < 0 || n % block != 0)
    throw Error(std::string(what) + ": " + std::to_string(n) + " values of " + ggml_type_name(uint32_t(t)) +
                " are not a whole number of blocks of " + std::to_string(block));
}

}  // namespace

// ------------------------------------------------------------------ public

std::string ggml_type_name(uint32_t type) {
  const Traits* t = traits(type);
  return t ? t->name : "type " + std::to_string(type);
}

bool ggml_type_supported(uint32_t type) {
  const Traits* t = traits(type);
  return t && t->supported;
}

std::string ggml_supported_types() {
  std::string out;
  for (const auto& t : kTraits)
    if (t.supported) out += (out.empty() ? "" : ", ") + std::string(t.name);
  return out;
}

int64_t ggml_block_size(GgmlType t) {
  const Traits* tr = traits(uint32_t(t));
  return tr ? tr->block : 0;
}

size_t ggml_type_size(GgmlType t) {
  const Traits* tr = traits(uint32_t(t));
  return tr && tr->block ? tr->size : 0;
}

size_t ggml_row_bytes(GgmlType t, int64_t n) {
  check_count(t, n, "ggml_row_bytes");
  size_t bytes;
  if (__builtin_mul_overflow(size_t(n / ggml_block_size(t)), ggml_type_size(t), &bytes))
    throw Error("ggml_row_bytes: a row of " + std::to_string(n) + " values overflows");
  return bytes;
}

bool ggml_is_quantized(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q5_0: case GgmlType::Q5_1:
    case GgmlType::Q8_0: case GgmlType::Q8_1: case GgmlType::Q2_K: case GgmlType::Q3_K:
    case GgmlType::Q4_K: case GgmlType::Q5_K: case GgmlType::Q6_K: case GgmlType::Q8_K:
      return true;
    default:
      return false;
  }
}

namespace {

// Calls f(BlockTag<B, N>{}) with the block struct of a block type; false for
// a type without blocks.
template <class B, int N>
struct BlockTag {
  using Block = B;
  static constexpr int kValues = N;
};
template <class F>
bool with_block(GgmlType t, F&& f) {
  switch (t) {
    case GgmlType::Q4_0: f(BlockTag<BlockQ4_0, kQK>{}); return true;
    case GgmlType::Q4_1: f(BlockTag<BlockQ4_1, kQK>{}); return true;
    case GgmlType::Q5_0: f(BlockTag<BlockQ5_0, kQK>{}); return true;
    case GgmlType::Q5_1: f(BlockTag<BlockQ5_1, kQK>{}); return true;
    case GgmlType::Q8_0: f(BlockTag<BlockQ8_0, kQK>{}); return true;
    case GgmlType::Q2_K: f(BlockTag<BlockQ2_K, kQK_K>{}); return true;
    case GgmlType::Q3_K: f(BlockTag<BlockQ3_K, kQK_K>{}); return true;
    case GgmlType::Q4_K: f(BlockTag<BlockQ4_K, kQK_K>{}); return true;
    case GgmlType::Q5_K: f(BlockTag<BlockQ5_K, kQK_K>{}); return true;
    case GgmlType::Q6_K: f(BlockTag<BlockQ6_K, kQK_K>{}); return true;
    default: return false;
  }
}

}  // namespace

void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n) {
  if (!ggml_type_supported(uint32_t(t)))
    throw Error("dequantize_row: ggml type " + ggml_type_name(uint32_t(t)) + " is not supported (supported: " +
                ggml_supported_types() + ")");
  check_count(t, n, "dequantize_row");
  if (n == 0) return;
  const auto* p = static_cast<const uint8_t*>(src);
  switch (t) {
    case GgmlType::F32:
      std::memcpy(dst, src, size_t(n) * 4);
      return;
    case GgmlType::F16:  // ggml_fp16_to_fp32_row
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = ggml_fp16_to_fp32(h);
      }
      return;
    case GgmlType::BF16:  // ggml_bf16_to_fp32_row
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = bf16_to_f32(h);
      }
      return;
    case GgmlType::Q8_0:  // each block read in place (dequant_q8_0)
      for (int64_t i = 0; i < n / kQK; ++i) dequant_q8_0(p + i * int64_t(sizeof(BlockQ8_0)), dst + i * kQK);
      return;
    default:
      if (with_block(t, [&](auto tag) {
            using Tag = decltype(tag);
            dequant_blocks<typename Tag::Block, Tag::kValues>(src, dst, n);
          }))
        return;
      break;
  }
  throw Error("dequantize_row: ggml type " + ggml_type_name(uint32_t(t)) + " is not supported");
}

void quantize_row(GgmlType t, const float* src, void* dst, int64_t n) {
  if (!ggml_type_supported(uint32_t(t)))
    throw Error("quantize_row: ggml type " + ggml_type_name(uint32_t(t)) + " is not supported (supported: " +
                ggml_supported_types() + ")");
  check_count(t, n, "quantize_row");
  if (n == 0) return;
  auto* p = static_cast<uint8_t*>(dst);
  switch (t) {
    case GgmlType::F32:
      std::memcpy(dst, src, size_t(n) * 4);
      return;
    case GgmlType::F16:  // ggml_fp32_to_fp16_row
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = fp32_to_fp16(src[i]);
        std::memcpy(p + 2 * i, &h, 2);
      }
      return;
    case GgmlType::BF16:  // ggml_fp32_to_bf16_row_ref
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_bf16(src[i]);
        std::memcpy(p + 2 * i, &h, 2);
      }
      return;
    default:
      if (with_block(t, [&](auto tag) {
            using Tag = decltype(tag);
            quant_blocks<typename Tag::Block, Tag::kValues>(src, dst, n);
          }))
        return;
      break;
  }
  throw Error("quantize_row: ggml type " + ggml_type_name(uint32_t(t)) + " is not supported");
}

GgmlType ggml_vec_dot_type(GgmlType weight) {
  switch (weight) {
    case GgmlType::F16: return GgmlType::F16;
    case GgmlType::BF16: return GgmlType::BF16;
    case GgmlType::Q4_0: case GgmlType::Q5_0: case GgmlType::Q8_0: return GgmlType::Q8_0;
    case GgmlType::Q4_1: case GgmlType::Q5_1: return GgmlType::Q8_1;
    case GgmlType::Q2_K: case GgmlType::Q3_K: case GgmlType::Q4_K: case GgmlType::Q5_K: case GgmlType::Q6_K:
      return GgmlType::Q8_K;
    default: return GgmlType::F32;
  }
}

void round_activations(GgmlType act, const float* x, float* y, int64_t n) {
  switch (act) {
    case GgmlType::F32:
      if (y != x) std::memcpy(y, x, size_t(n) * 4);
      return;
    case GgmlType::F16:
      for (int64_t i = 0; i < n; ++i) y[i] = ggml_fp16_to_fp32(fp32_to_fp16(x[i]));
      return;
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_f32(f32_to_bf16(x[i]));
      return;
    case GgmlType::Q8_0: case GgmlType::Q8_1: {  // quantize_row_q8_0_ref / q8_1_ref
      if (n % kQK != 0) throw Error("round_activations: " + std::to_string(n) + " values are not whole Q8_0 blocks");
      // Q8_1's values are Q8_0's (its extra sum only serves the dot product).
      for (int64_t b = 0; b < n; b += kQK) {
        BlockQ8_0 block;
        quant(x + b, block);
        dequant(block, y + b);
      }
      return;
    }
    case GgmlType::Q8_K: {  // quantize_row_q8_K_ref
      if (n % kQK_K != 0) throw Error("round_activations: " + std::to_string(n) + " values are not whole Q8_K blocks");
      for (int64_t b = 0; b < n; b += kQK_K) {
        const float max = signed_absmax(x + b, kQK_K);
        if (!max) {
          for (int j = 0; j < kQK_K; ++j) y[b + j] = 0.0f;
          continue;
        }
        const float iscale = -127.f / max;
        const float d = 1 / iscale;
        for (int j = 0; j < kQK_K; ++j) y[b + j] = d * float(gmin(127, nearest_int(iscale * x[b + j])));
      }
      return;
    }
    default:
      throw Error("round_activations: ggml type " + ggml_type_name(uint32_t(act)) +
                  " is not an activation type (F32, F16, BF16, Q8_0, Q8_1, Q8_K)");
  }
}

}  // namespace llmdiff
