#include "impl/kernels.h"

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>

#include "dumps/base/errors.h"
#include "dumps/model/gguf_model.h"

namespace llmdiff::impl {

namespace {

// ---------------------------------------------------------------- vectors
// GCC vector extensions: 16 float32 lanes (one AVX-512 register, two AVX2
// ones). Loads and stores go through memcpy, so any alignment is fine.
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));
typedef double v8d __attribute__((vector_size(64)));
constexpr int kLanes = 16;

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }

typedef float v4f __attribute__((vector_size(16)));
typedef float v2f __attribute__((vector_size(8)));

// Sum of the 16 lanes in a fixed tree order (i + 8, i + 4, i + 2, i + 1),
// made in registers, halving the vector at each step.
inline float hsum(v16f v) {
  const v8f h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4f h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  const v2f h2 = __builtin_shufflevector(h4, h4, 0, 1) + __builtin_shufflevector(h4, h4, 2, 3);
  return h2[0] + h2[1];
}

// ------------------------------------------------------- stored dtypes
// Each weight dtype knows how to widen one value and 16 values to float32.
struct F32W {
  using T = float;
  static float one(T x) { return x; }
  static v16f vec(const T* p) { return load16(p); }
};
struct BF16W {
  using T = uint16_t;
  static float one(T x) { return bf16_to_f32(x); }
  static v16f vec(const T* p) {
    v16h h;
    std::memcpy(&h, p, sizeof h);
    return (v16f)(__builtin_convertvector(h, v16u) << 16);
  }
};
struct F16W {
  using T = uint16_t;
  // Exact half -> float. With F16C (AVX-512F: 16 at once) one conversion
  // instruction; otherwise move exponent/mantissa into place and rescale by
  // 2^112 (covers normals and subnormals); Inf/NaN get the all-ones exponent.
  static v16f vec(const T* p) {
#if defined(__AVX512F__)
    __m256i h;
    std::memcpy(&h, p, sizeof h);
    const __m512 f = _mm512_maskz_cvtph_ps(__mmask16(0xffff), h);
    v16f v;
    std::memcpy(&v, &f, sizeof v);
    return v;
#elif defined(__F16C__)
    __m128i lo, hi;
    std::memcpy(&lo, p, sizeof lo);
    std::memcpy(&hi, p + 8, sizeof hi);
    const __m256 flo = _mm256_cvtph_ps(lo), fhi = _mm256_cvtph_ps(hi);
    v16f v;
    std::memcpy(&v, &flo, sizeof flo);
    std::memcpy(reinterpret_cast<char*>(&v) + sizeof flo, &fhi, sizeof fhi);
    return v;
#else
    v16h h16;
    std::memcpy(&h16, p, sizeof h16);
    const v16u h = __builtin_convertvector(h16, v16u);
    const v16u sign = (h & 0x8000u) << 16;
    const v16u em = (h & 0x7fffu) << 13;
    const v16u scaled = (v16u)((v16f)em * 0x1p112f);
    const v16u inf_nan = (v16u)((h & 0x7c00u) == 0x7c00u);  // all ones where true
    return (v16f)(((scaled & ~inf_nan) | ((em | 0x7f800000u) & inf_nan)) | sign);
#endif
  }
  static float one(T x) { return f16_to_f32(x); }
};

template <class W>
void convert_span(const typename W::T* src, int64_t n, float* dst) {
  int64_t i = 0;
  if constexpr (std::is_same<W, BF16W>::value) {
    // 32 values per step: widen the even and odd ones of 16 pairs, then interleave.
    for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
      v16u pairs;
      std::memcpy(&pairs, src + i, sizeof pairs);
      const v16f even = (v16f)(pairs << 16), odd = (v16f)(pairs & 0xffff0000u);
      store16(dst + i, __builtin_shufflevector(even, odd, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23));
      store16(dst + i + kLanes,
              __builtin_shufflevector(even, odd, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
    }
  }
  for (; i + kLanes <= n; i += kLanes) store16(dst + i, W::vec(src + i));
  for (; i < n; ++i) dst[i] = W::one(src[i]);
}

// ggml blocks (GGUF weights): a row at a time, dequantised by ggml's
// dequantize_row_* into float32, then read as F32W.
struct QuantW {
  using T = uint8_t;
};

const float* dequantized_row(const WMat& m, int64_t row, float* dst) {
  const int64_t n = m.row_len();
  const uint8_t* src = static_cast<const uint8_t*>(m.data) + size_t(m.src_row(row)) * ggml_row_bytes(m.quant, n);
  if (n == m.cols) {
    dequantize_row(m.quant, src, dst, n);
    return dst;
  }
  // A view of some columns: the blocks of the whole stored row, then those columns.
  thread_local std::vector<float> whole;
  whole.resize(size_t(n));
  dequantize_row(m.quant, src, whole.data(), n);
  std::copy_n(whole.data() + m.col0, m.cols, dst);
  return dst;
}

// Where row r of m starts among its stored values (stored type T).
template <class T>
const T* row_start(const WMat& m, int64_t r) {
  return static_cast<const T*>(m.data) + m.src_row(r) * m.row_len() + m.col0;
}

// Calls f(W{}) with the weight type W of dtype `t`.
template <class F>
void with_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F32: f(F32W{}); return;
    case DType::BF16: f(BF16W{}); return;
    case DType::F16: f(F16W{}); return;
    default: break;
  }
  throw UsageError(std::string("impl: unsupported weight dtype ") + dtype_name(t) + " (supported: F32, BF16, F16)");
}

// Calls f(W{}) with the weight type of m (QuantW for ggml blocks).
template <class F>
void with_weight(const WMat& m, F&& f) {
  if (m.quantized())
    f(QuantW{});
  else
    with_dtype(m.dtype, std::forward<F>(f));
}

// ------------------------------------------------------------- GEMV
// y[r] = W[r, :] · x. A worker reads NS rows at once, each a sequential
// stream of its own: one core keeps more reads in flight over a few streams
// than over one (the hardware prefetchers follow each), and each stream asks
// kPrefetchBytes ahead of its loads. Every row keeps its own accumulators, so
// its sum does not depend on NS: two 16-lane chains per row (float16: four,
// as each step waits on a conversion as well as on the multiply-add), summed
// pairwise, the fixed tree sum, then a scalar tail.
inline void prefetch_ahead(const void* p) {
  __builtin_prefetch(static_cast<const char*>(p) + kPrefetchBytes, 0, 0);
}

template <class W>
constexpr int kGemvChains = std::is_same<W, F16W>::value ? 4 : 2;

// y[s] = w[s] · x for NS rows w[s] of K stored values.
template <class W, int NS>
inline void gemv_streams(const typename W::T* const* w, int64_t K, const float* x, float* const* y) {
  constexpr int NA = kGemvChains<W>;
  v16f a[NS][NA];
  for (int s = 0; s < NS; ++s)
    for (int i = 0; i < NA; ++i) a[s][i] = v16f{};
  int64_t k = 0;
  for (; k + NA * kLanes <= K; k += NA * kLanes)
    for (int s = 0; s < NS; ++s)
      for (int i = 0; i < NA; ++i) {
        prefetch_ahead(w[s] + k + i * kLanes);
        a[s][i] += W::vec(w[s] + k + i * kLanes) * load16(x + k + i * kLanes);
      }
  const int64_t k_vec = k;
  for (int s = 0; s < NS; ++s) {
    k = k_vec;
    for (; k + kLanes <= K; k += kLanes) a[s][0] += W::vec(w[s] + k) * load16(x + k);
    for (int n = NA / 2; n >= 1; n /= 2)  // pairwise: (a0 + a1) + (a2 + a3)
      for (int i = 0; i < n; ++i) a[s][i] = a[s][2 * i] + a[s][2 * i + 1];
    float sum = hsum(a[s][0]);
    for (; k < K; ++k) sum += W::one(w[s][k]) * x[k];
    *y[s] = sum;
  }
}

// bfloat16 rows, 32 values per step: one 64-byte load holds 16 (even, odd)
// pairs; `<< 16` widens the even values, masking the low half the odd ones,
// which meet x split the same way (xe = x[0::2], xo = x[1::2]).
template <int NS>
inline void gemv_streams_bf16(const uint16_t* const* w, int64_t K, const float* x, const float* xe, const float* xo,
                              float* const* y) {
  v16f ae[NS], ao[NS];
  for (int s = 0; s < NS; ++s) ae[s] = ao[s] = v16f{};
  int64_t k = 0;
  for (; k + 2 * kLanes <= K; k += 2 * kLanes) {
    const v16f e = load16(xe + k / 2), o = load16(xo + k / 2);
    for (int s = 0; s < NS; ++s) {
      v16u pairs;
      prefetch_ahead(w[s] + k);
      std::memcpy(&pairs, w[s] + k, sizeof pairs);
      ae[s] += (v16f)(pairs << 16) * e;
      ao[s] += (v16f)(pairs & 0xffff0000u) * o;
    }
  }
  for (int s = 0; s < NS; ++s) {
    float sum = hsum(ae[s] + ao[s]);
    for (int64_t j = k; j < K; ++j) sum += bf16_to_f32(w[s][j]) * x[j];
    *y[s] = sum;
  }
}

// ggml rows read in place (Q8_0; with AVX-512 Q4_0, Q4_K, Q5_K, Q6_K): each
// value is made as ggml's dequantize_row_* makes it and meets x as
// gemv_streams<F32W> meets the dequantised row, 32 values per step (one
// 16-lane chain for the first 16, one for the rest), so y is bit for bit
// that of the row dequantised first.

// A block's f16 scale at p, as ggml reads it.
inline float block_scale(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return ggml_fp16_to_fp32(h);
}

#if defined(__AVX512F__)
// 16 bytes as float32, unsigned (4- and 5-bit values) or signed (the maskz
// forms: no undefined operand).
inline v16f unsigned_bytes_to_float(__m128i b) {
  const __m512i i = _mm512_maskz_cvtepu8_epi32(__mmask16(0xffff), b);
  v16i w;
  std::memcpy(&w, &i, sizeof w);
  return __builtin_convertvector(w, v16f);
}
inline v16f signed_bytes_to_float(__m128i b) {
  const __m512i i = _mm512_maskz_cvtepi8_epi32(__mmask16(0xffff), b);
  v16i w;
  std::memcpy(&w, &i, sizeof w);
  return __builtin_convertvector(w, v16f);
}
#endif

// 16 int8 values as float32 (exact). The compiler's generic conversion
// makes it a lane at a time.
inline v16f int8_to_float(const uint8_t* p) {
  v16f v;
#if defined(__AVX512F__)
  __m128i q;
  std::memcpy(&q, p, sizeof q);
  v = signed_bytes_to_float(q);
#elif defined(__AVX2__)
  __m128i lo = _mm_setzero_si128(), hi = _mm_setzero_si128();
  std::memcpy(&lo, p, 8);
  std::memcpy(&hi, p + 8, 8);
  const __m256i ilo = _mm256_cvtepi8_epi32(lo), ihi = _mm256_cvtepi8_epi32(hi);
  v16i w;
  std::memcpy(&w, &ilo, sizeof ilo);
  std::memcpy(reinterpret_cast<char*>(&w) + sizeof ilo, &ihi, sizeof ihi);
  v = __builtin_convertvector(w, v16f);
#else
  for (int i = 0; i < kLanes; ++i) v[i] = float(int8_t(p[i]));
#endif
  return v;
}

// Blocks of 32 values q * d (Q8_0, and Q4_0 below): B::kBytes a block, an
// f16 d first, B::values(block, first, second) its 32 q as float32, 16 and
// 16; each value the float32 product q * d, a block per step.
template <class B, int NS>
inline void gemv_streams_32(const uint8_t* const* w, int64_t K, const float* x, float* const* y) {
  v16f a0[NS], a1[NS];
  for (int s = 0; s < NS; ++s) a0[s] = a1[s] = v16f{};
  for (int64_t b = 0; b < K / 32; ++b) {
    const v16f x0 = load16(x + b * 32), x1 = load16(x + b * 32 + kLanes);
    for (int s = 0; s < NS; ++s) {
      const uint8_t* block = w[s] + b * B::kBytes;
      prefetch_ahead(block);
      const v16f d = v16f{} + block_scale(block);
      v16f q0, q1;
      B::values(block, q0, q1);
      a0[s] += (q0 * d) * x0;
      a1[s] += (q1 * d) * x1;
    }
  }
  for (int s = 0; s < NS; ++s) *y[s] = hsum(a0[s] + a1[s]);
}

// Q8_0: d, then 32 int8 q.
struct Q8_0Blocks {
  static constexpr int64_t kBytes = 34;
  static void values(const uint8_t* block, v16f& first, v16f& second) {
    first = int8_to_float(block + 2);
    second = int8_to_float(block + 2 + kLanes);
  }
};

#if defined(__AVX512F__)
// Q4_K and Q5_K rows (ggml's super-blocks of 256 values: f16 d and dmin,
// 12 bytes of packed 6-bit scales and mins, Q5_K's 32 bytes of fifth bits,
// 128 bytes of 4-bit q, each 32 bytes holding two sub-blocks of 32 values
// in their low and high nibbles; value d * scale * q - dmin * min), read in
// place as Q8_0's: each value made as dequantize_row_q4_K / q5_K makes it,
// and met with x as the dequantised row's values are, 32 per step.
template <bool kFifthBit>
struct KQuant45 {
  static constexpr int64_t kValues = 256, kBytes = kFifthBit ? 176 : 144, kQs = kFifthBit ? 48 : 16;
};

// scale * q - min. The product is exact (scale = d * sc has at most 17
// significant bits, q 5), so it is the same fused into the subtraction or
// not.
inline v16f scaled_minus_min(v16f q, v16f scale, v16f min) { return scale * q - min; }

template <int NS, bool kFifthBit>
inline void gemv_streams_k45(const uint8_t* const* w, int64_t K, const float* x, float* const* y) {
  using Q = KQuant45<kFifthBit>;
  const __m128i low = _mm_set1_epi8(0x0F), one = _mm_set1_epi8(1);
  // Bit `bit` of each byte of h, as 16 or 0 (Q5_K's fifth bit of a value).
  auto fifth = [&](__m128i h, int bit) {
    return _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(h, _mm_cvtsi32_si128(bit)), one), 4);
  };
  v16f a0[NS], a1[NS];
  for (int s = 0; s < NS; ++s) a0[s] = a1[s] = v16f{};
  for (int64_t b = 0; b < K / Q::kValues; ++b) {
    // Each stream's eight sub-block scales and mins (d * scale, dmin * min).
    float scale[NS][8], min[NS][8];
    for (int s = 0; s < NS; ++s) {
      const uint8_t* block = w[s] + b * Q::kBytes;
      for (int64_t at = 0; at < Q::kBytes; at += 64) prefetch_ahead(block + at);
      const float d = block_scale(block), dmin = block_scale(block + 2);
      for (int j = 0; j < 8; ++j) {
        uint8_t sc, m;
        ggml_scale_min_k4(j, block + 4, &sc, &m);
        scale[s][j] = d * sc;
        min[s][j] = dmin * m;
      }
    }
    for (int g = 0; g < 4; ++g) {  // 64 values: 32 low nibbles, then 32 high ones
      const float* xg = x + b * Q::kValues + 64 * g;
      const v16f x0 = load16(xg), x1 = load16(xg + 16), x2 = load16(xg + 32), x3 = load16(xg + 48);
      for (int s = 0; s < NS; ++s) {
        const uint8_t* block = w[s] + b * Q::kBytes;
        __m128i q0, q1;
        std::memcpy(&q0, block + Q::kQs + 32 * g, sizeof q0);
        std::memcpy(&q1, block + Q::kQs + 32 * g + 16, sizeof q1);
        __m128i lo0 = _mm_and_si128(q0, low), lo1 = _mm_and_si128(q1, low);
        __m128i hi0 = _mm_and_si128(_mm_srli_epi16(q0, 4), low), hi1 = _mm_and_si128(_mm_srli_epi16(q1, 4), low);
        if constexpr (kFifthBit) {
          __m128i h0, h1;  // qh[0..16), qh[16..32): bits 2g and 2g + 1
          std::memcpy(&h0, block + 16, sizeof h0);
          std::memcpy(&h1, block + 32, sizeof h1);
          lo0 = _mm_or_si128(lo0, fifth(h0, 2 * g));
          lo1 = _mm_or_si128(lo1, fifth(h1, 2 * g));
          hi0 = _mm_or_si128(hi0, fifth(h0, 2 * g + 1));
          hi1 = _mm_or_si128(hi1, fifth(h1, 2 * g + 1));
        }
        const v16f s1 = v16f{} + scale[s][2 * g], m1 = v16f{} + min[s][2 * g];
        const v16f s2 = v16f{} + scale[s][2 * g + 1], m2 = v16f{} + min[s][2 * g + 1];
        a0[s] += scaled_minus_min(unsigned_bytes_to_float(lo0), s1, m1) * x0;
        a1[s] += scaled_minus_min(unsigned_bytes_to_float(lo1), s1, m1) * x1;
        a0[s] += scaled_minus_min(unsigned_bytes_to_float(hi0), s2, m2) * x2;
        a1[s] += scaled_minus_min(unsigned_bytes_to_float(hi1), s2, m2) * x3;
      }
    }
  }
  for (int s = 0; s < NS; ++s) *y[s] = hsum(a0[s] + a1[s]);
}

// Q4_0: d, then 16 bytes whose low nibbles are values 0-15 and high
// nibbles values 16-31, each q - 8.
struct Q4_0Blocks {
  static constexpr int64_t kBytes = 18;
  static void values(const uint8_t* block, v16f& first, v16f& second) {
    const __m128i low = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    __m128i q;
    std::memcpy(&q, block + 2, sizeof q);
    first = signed_bytes_to_float(_mm_sub_epi8(_mm_and_si128(q, low), eight));
    second = signed_bytes_to_float(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low), eight));
  }
};

// Q6_K rows (ggml's super-blocks of 256 values: 128 bytes of low 4 bits,
// 64 of high 2 bits, 16 int8 scales of 16 values each, an f16 d; value
// d * scale * (q - 32)), read in place the same way: each value made as
// dequantize_row_q6_K makes it ((d * scale) * q, one product after the
// other), 32 per step in the row's order.
constexpr int64_t kQ6_KValues = 256, kQ6_KBytes = 210;

template <int NS>
inline void gemv_streams_q6_k(const uint8_t* const* w, int64_t K, const float* x, float* const* y) {
  const __m128i low4 = _mm_set1_epi8(0x0F), bits45 = _mm_set1_epi8(0x30), bias = _mm_set1_epi8(32);
  v16f a0[NS], a1[NS];
  for (int s = 0; s < NS; ++s) a0[s] = a1[s] = v16f{};
  for (int64_t b = 0; b < K / kQ6_KValues; ++b) {
    float scale[NS][16];  // d * scales[j]
    for (int s = 0; s < NS; ++s) {
      const uint8_t* block = w[s] + b * kQ6_KBytes;
      for (int64_t at = 0; at < kQ6_KBytes; at += 64) prefetch_ahead(block + at);
      const float d = block_scale(block + 208);
      for (int j = 0; j < 16; ++j) scale[s][j] = d * int8_t(block[192 + j]);
    }
    for (int n = 0; n < 2; ++n) {  // 128 values: 32 from each of four bit fields
      const float* xn = x + b * kQ6_KValues + 128 * n;
      for (int s = 0; s < NS; ++s) {
        const uint8_t* ql = w[s] + b * kQ6_KBytes + 64 * n;
        const uint8_t* qh = w[s] + b * kQ6_KBytes + 128 + 32 * n;
        __m128i l0, l1, l2, l3, h0, h1;  // ql[0..16), [16..32), [32..48), [48..64); qh[0..16), [16..32)
        std::memcpy(&l0, ql, 16);
        std::memcpy(&l1, ql + 16, 16);
        std::memcpy(&l2, ql + 32, 16);
        std::memcpy(&l3, ql + 48, 16);
        std::memcpy(&h0, qh, 16);
        std::memcpy(&h1, qh + 16, 16);
        // q - 32 of the values l (ql[l] low nibble, qh bits 0-1), l + 32
        // (ql[l + 32] low, bits 2-3), l + 64 (ql[l] high, bits 4-5), l + 96
        // (ql[l + 32] high, bits 6-7), the two high bits moved to bits 4-5.
        auto q = [&](__m128i nibbles, __m128i high) {
          return signed_bytes_to_float(_mm_sub_epi8(_mm_or_si128(nibbles, _mm_and_si128(high, bits45)), bias));
        };
        auto lo = [&](__m128i v) { return _mm_and_si128(v, low4); };
        auto hi = [&](__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 4), low4); };
        const float* sc = scale[s] + 8 * n;
        const v16f v[8] = {q(lo(l0), _mm_slli_epi16(h0, 4)), q(lo(l1), _mm_slli_epi16(h1, 4)),
                           q(lo(l2), _mm_slli_epi16(h0, 2)), q(lo(l3), _mm_slli_epi16(h1, 2)),
                           q(hi(l0), h0),                    q(hi(l1), h1),
                           q(hi(l2), _mm_srli_epi16(h0, 2)), q(hi(l3), _mm_srli_epi16(h1, 2))};
        for (int k = 0; k < 4; ++k) {  // values 32k .. 32k + 31 of the 128
          a0[s] += ((v16f{} + sc[2 * k]) * v[2 * k]) * load16(xn + 32 * k);
          a1[s] += ((v16f{} + sc[2 * k + 1]) * v[2 * k + 1]) * load16(xn + 32 * k + 16);
        }
      }
    }
  }
  for (int s = 0; s < NS; ++s) *y[s] = hsum(a0[s] + a1[s]);
}
#endif

// The same for NT tokens and NR rows at once: each 64-byte load of W is
// widened once and meets every token's x, and each load of a token's x
// meets every row; token t of row s keeps its own two accumulators, so its
// sum is made exactly as gemv_streams_bf16 makes it. xi: the tokens' x
// interleaved per 32 values (interleave_tokens), so that every load is at a
// fixed offset.
template <int NT, int NR>
void gemv_rows_bf16_tokens(const uint16_t* const* w, const int64_t* r, int64_t K, const float* x, const float* xi,
                           float* y, int64_t ldy) {
  v16f ae[NR][NT], ao[NR][NT];
  for (int s = 0; s < NR; ++s)
    for (int t = 0; t < NT; ++t) ae[s][t] = ao[s][t] = v16f{};
  int64_t k = 0;
  for (; k + 2 * kLanes <= K; k += 2 * kLanes, xi += NT * 2 * kLanes) {
    v16f even[NR], odd[NR];
    for (int s = 0; s < NR; ++s) {
      v16u pairs;
      std::memcpy(&pairs, w[s] + k, sizeof pairs);
      even[s] = (v16f)(pairs << 16), odd[s] = (v16f)(pairs & 0xffff0000u);
    }
    for (int t = 0; t < NT; ++t) {
      const v16f xe = load16(xi + t * 2 * kLanes), xo = load16(xi + t * 2 * kLanes + kLanes);
      for (int s = 0; s < NR; ++s) {
        ae[s][t] += even[s] * xe;
        ao[s][t] += odd[s] * xo;
      }
    }
  }
  for (int s = 0; s < NR; ++s)
    for (int t = 0; t < NT; ++t) {
      float sum = hsum(ae[s][t] + ao[s][t]);
      for (int64_t j = k; j < K; ++j) sum += bf16_to_f32(w[s][j]) * x[t * K + j];
      y[t * ldy + r[s]] = sum;
    }
}

// x [T, K] as gemv_rows_bf16_tokens reads it: for each 32 values of K, token
// after token, its 16 even then its 16 odd values.
void interleave_tokens(const float* x, int64_t T, int64_t K, std::vector<float>& xi) {
  const int64_t chunks = K / (2 * kLanes);
  xi.resize(size_t(std::max<int64_t>(chunks, 1) * T * 2 * kLanes));
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t t = 0; t < T; ++t) {
      float* dst = xi.data() + (c * T + t) * 2 * kLanes;
      const float* src = x + t * K + c * 2 * kLanes;
      for (int64_t i = 0; i < kLanes; ++i) dst[i] = src[2 * i], dst[kLanes + i] = src[2 * i + 1];
    }
}

// Calls read(n, first, stride) over rows [r0, r1) in groups of N rows read
// at once: rows r, r + q, ..., r + (N - 1) q for r in [r0, r0 + q), q being
// an N-th of the range, then the rows left over one by one (n: the group's
// size as a std::integral_constant).
template <int N, class Read>
void in_row_groups(int64_t r0, int64_t r1, Read&& read) {
  const int64_t q = (r1 - r0) / N;
  for (int64_t r = r0; r < r0 + q; ++r) read(std::integral_constant<int, N>{}, r, q);
  for (int64_t r = r0 + N * q; r < r1; ++r) read(std::integral_constant<int, 1>{}, r, int64_t(0));
}

// Rows [r0, r1) of y[t] = W · x[t] for NT bfloat16 tokens, kBatchRows<NT>
// rows at once (in_row_groups, as gemv_rows reads them), as many as keep
// the 2 x NT x rows accumulators in the 32 vector registers: each load of a
// token's x then meets several rows, where one row at a time read all of x
// (tens of KiB) for every 4 KiB row of W.
template <int NT>
constexpr int kBatchRows = NT <= 2 ? 4 : NT <= 4 ? 2 : 1;

template <int NT>
void gemv_rows_bf16_batch(const WMat& m, const float* x, const float* xi, int64_t r0, int64_t r1, float* y) {
  auto rows = [&](auto nr, int64_t first, int64_t stride) {
    constexpr int NR = decltype(nr)::value;
    const uint16_t* w[NR];
    int64_t r[NR];
    for (int s = 0; s < NR; ++s) r[s] = first + s * stride, w[s] = row_start<uint16_t>(m, r[s]);
    gemv_rows_bf16_tokens<NT, NR>(w, r, m.cols, x, xi, y, m.rows);
  };
  in_row_groups<kBatchRows<NT>>(r0, r1, rows);
}

// Rows [r0, r1) of y = W · x, kGemvStreams rows at once (in_row_groups).
// xe/xo: x split into even and odd elements (used by bfloat16 weights).
template <class W>
void gemv_rows(const WMat& m, const float* x, const float* xe, const float* xo, int64_t r0, int64_t r1, float* y) {
  const int64_t K = m.cols;
  if constexpr (std::is_same<W, QuantW>::value) {
    // Whole rows of Q8_0 (and, with AVX-512, Q4_0, Q4_K, Q5_K and Q6_K) blocks:
    // read in place.
    const size_t row_bytes = ggml_row_bytes(m.quant, m.row_len());
    auto in_place = [&](auto kernel) {
      in_row_groups<kGemvStreams>(r0, r1, [&](auto ns, int64_t first, int64_t stride) {
        constexpr int NS = decltype(ns)::value;
        const uint8_t* w[NS];
        float* yr[NS];
        for (int s = 0; s < NS; ++s) {
          const int64_t r = first + s * stride;
          w[s] = static_cast<const uint8_t*>(m.data) + size_t(m.src_row(r)) * row_bytes;
          yr[s] = y + r;
        }
        kernel(ns, w, yr);
      });
    };
    if (m.quant == GgmlType::Q8_0 && m.row_len() == K)
      return in_place([&](auto ns, const uint8_t* const* w, float* const* yr) {
        gemv_streams_32<Q8_0Blocks, decltype(ns)::value>(w, K, x, yr);
      });
#if defined(__AVX512F__)
    if (m.quant == GgmlType::Q4_K && m.row_len() == K)
      return in_place([&](auto ns, const uint8_t* const* w, float* const* yr) {
        gemv_streams_k45<decltype(ns)::value, false>(w, K, x, yr);
      });
    if (m.quant == GgmlType::Q5_K && m.row_len() == K)
      return in_place([&](auto ns, const uint8_t* const* w, float* const* yr) {
        gemv_streams_k45<decltype(ns)::value, true>(w, K, x, yr);
      });
    if (m.quant == GgmlType::Q4_0 && m.row_len() == K)
      return in_place([&](auto ns, const uint8_t* const* w, float* const* yr) {
        gemv_streams_32<Q4_0Blocks, decltype(ns)::value>(w, K, x, yr);
      });
    if (m.quant == GgmlType::Q6_K && m.row_len() == K)
      return in_place([&](auto ns, const uint8_t* const* w, float* const* yr) {
        gemv_streams_q6_k<decltype(ns)::value>(w, K, x, yr);
      });
#endif
    thread_local std::vector<float> row;
    row.resize(size_t(K));
    for (int64_t r = r0; r < r1; ++r) {
      const float* w = dequantized_row(m, r, row.data());
      float* yr = y + r;
      gemv_streams<F32W, 1>(&w, K, x, &yr);
    }
  } else {
    using T = typename W::T;
    auto rows = [&](auto ns, int64_t first, int64_t stride) {
      constexpr int NS = decltype(ns)::value;
      const T* w[NS];
      float* yr[NS];
      for (int s = 0; s < NS; ++s) w[s] = row_start<T>(m, first + s * stride), yr[s] = y + first + s * stride;
      if constexpr (std::is_same<W, BF16W>::value)
        gemv_streams_bf16<NS>(w, K, x, xe, xo, yr);
      else
        gemv_streams<W, NS>(w, K, x, yr);
    };
    in_row_groups<kGemvStreams>(r0, r1, rows);
  }
}

// Rows per chunk of work in a GEMV (64 rows of 2048 bfloat16 weights: 256 KiB).
constexpr int64_t kGemvChunk = 64;
// Up to this many tokens a matmul runs as GEMVs (see matmul()).
constexpr int64_t kGemvTokens = 8;

// ------------------------------------------------------------- GEMM
// y[T, N] = x[T, K] · W[N, K]ᵀ for T > 1. x is transposed once into xt
// [K, ldt] (ldt = T rounded up to 16, zero padded). Workers take tiles of
// kPanelRows rows of W, convert each tile once to a float32 panel, and sweep
// it over x in blocks of 16 or 32 tokens: acc[r][j] (16 tokens each) +=
// panel[r][k] · xt[k][t..t+16) for k = 0 .. K-1. Every y element is a single
// sequential fused multiply-add chain over k, identical for any tiling.
constexpr int kPanelRows = 12;

template <int NV>
inline void gemm_micro(const float* panel, int64_t K, const float* xt, int64_t ldt, v16f (&acc)[kPanelRows][NV]) {
  for (int r = 0; r < kPanelRows; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = v16f{};
  for (int64_t k = 0; k < K; ++k) {
    v16f xv[NV];
    for (int j = 0; j < NV; ++j) xv[j] = load16(xt + k * ldt + j * kLanes);
    for (int r = 0; r < kPanelRows; ++r) {
      const float wv = panel[r * K + k];
      for (int j = 0; j < NV; ++j) acc[r][j] += wv * xv[j];
    }
  }
}

template <int NV>
inline void gemm_tokens(const float* panel, int64_t K, const float* xt, int64_t ldt, int64_t t0, int64_t T,
                        int64_t o0, int64_t rows, int64_t N, float* y) {
  v16f acc[kPanelRows][NV];
  gemm_micro<NV>(panel, K, xt + t0, ldt, acc);
  for (int j = 0; j < NV; ++j) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const int64_t t = t0 + j * kLanes + l;
      if (t >= T) break;
      float* yrow = y + t * N + o0;
      for (int64_t r = 0; r < rows; ++r) yrow[r] = acc[r][j][l];
    }
  }
}

// Tokens swept per pass over a worker's tiles: a block of xt (K x 64
// floats) stays in cache while every tile of the worker reads it, instead of
// each tile streaming all of xt (a long prompt's xt is megabytes); a tile is
// converted again for each block, 1/64 of the multiply-adds.
constexpr int64_t kTokenBlock = 64;

// Tiles [tile0, tile1) of kPanelRows rows of y[T, N] = x · Wᵀ, x given as xt.
template <class W>
void gemm_tiles(const WMat& m, const float* xt, int64_t ldt, int64_t T, int64_t tile0, int64_t tile1,
                std::vector<float>& buf, float* y) {
  const int64_t K = m.cols, N = m.rows;
  buf.resize(size_t(kPanelRows * K));
  for (int64_t tb = 0; tb < ldt; tb += kTokenBlock)
  for (int64_t tile = tile0; tile < tile1; ++tile) {
    const int64_t o0 = tile * kPanelRows;
    const int64_t rows = std::min<int64_t>(kPanelRows, N - o0);
    const float* panel;
    if (std::is_same<W, F32W>::value && rows == kPanelRows && m.interleaved_heads == 0 && m.row_len() == K) {
      panel = static_cast<const float*>(m.data) + o0 * K;  // already float32: read in place
    } else if constexpr (std::is_same<W, QuantW>::value) {
      for (int64_t r = 0; r < rows; ++r) dequantized_row(m, o0 + r, buf.data() + r * K);
      std::fill(buf.begin() + rows * K, buf.end(), 0.0f);
      panel = buf.data();
    } else {
      for (int64_t r = 0; r < rows; ++r) convert_span<W>(row_start<typename W::T>(m, o0 + r), K, buf.data() + r * K);
      std::fill(buf.begin() + rows * K, buf.end(), 0.0f);
      panel = buf.data();
    }
    const int64_t te = std::min(ldt, tb + kTokenBlock);
    int64_t t0 = tb;
    for (; t0 + 2 * kLanes <= te; t0 += 2 * kLanes) gemm_tokens<2>(panel, K, xt, ldt, t0, T, o0, rows, N, y);
    if (t0 < te) gemm_tokens<1>(panel, K, xt, ldt, t0, T, o0, rows, N, y);
  }
}

// Runs fn(job, begin, end, worker) over a range of work items [0, Σ counts)
// split over the workers, each worker's range cut at the job boundaries.
template <class F>
void for_each_job_range(ThreadPool& pool, const std::vector<int64_t>& counts, F&& fn) {
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  pool.parallel_for(total, [&](int64_t b, int64_t e, int worker) {
    int64_t first = 0;
    for (size_t j = 0; j < counts.size(); ++j) {
      const int64_t lo = std::max(b, first), hi = std::min(e, first + counts[j]);
      if (lo < hi) fn(j, lo - first, hi - first, worker);
      first += counts[j];
    }
  });
}

}  // namespace

// ------------------------------------------------------------- public

int64_t WMat::src_row(int64_t r) const {
  return interleaved_heads > 0 ? gguf_permuted_row(r, rows, interleaved_heads) : r;
}

WMat wmat(const WeightView& w) {
  WMat m;
  m.data = w.data;
  m.dtype = w.dtype;
  m.quant = w.quant;
  m.interleaved_heads = w.interleaved_heads;
  if (w.shape.size() == 2) {
    m.rows = w.shape[0];
    m.cols = w.shape[1];
  } else {
    m.rows = 1;
    m.cols = w.numel();
  }
  return m;
}

void load_row(const WMat& m, int64_t row, int64_t c0, int64_t n, float* dst) {
  if (m.quantized()) {
    thread_local std::vector<float> whole;
    whole.resize(size_t(m.cols));
    std::copy_n(dequantized_row(m, row, whole.data()) + c0, n, dst);
    return;
  }
  with_dtype(m.dtype, [&](auto tag) {
    using W = decltype(tag);
    convert_span<W>(row_start<typename W::T>(m, row) + c0, n, dst);
  });
}

WMat row_view(const WMat& m, int64_t r0, int64_t n) {
  if (r0 < 0 || n < 0 || r0 + n > m.rows)
    throw UsageError("impl: rows [" + std::to_string(r0) + ", " + std::to_string(r0 + n) + ") of a matrix of " +
                     std::to_string(m.rows) + " rows");
  WMat v = m;
  v.rows = n;
  if (m.interleaved_heads > 0) {  // rows permuted within each head: the view keeps whole heads
    const int64_t per_head = m.rows / m.interleaved_heads;
    if (r0 % per_head != 0 || n % per_head != 0)
      throw UsageError("impl: a view of rows [" + std::to_string(r0) + ", " + std::to_string(r0 + n) +
                       ") cuts a head of " + std::to_string(per_head) + " interleaved rows");
    v.interleaved_heads = n / per_head;
  }
  const size_t row_bytes =
      m.quantized() ? ggml_row_bytes(m.quant, m.row_len()) : size_t(m.row_len()) * dtype_size(m.dtype);
  v.data = static_cast<const uint8_t*>(m.data) + size_t(r0) * row_bytes;
  return v;
}

WMat col_view(const WMat& m, int64_t c0, int64_t n) {
  if (c0 < 0 || n < 0 || c0 + n > m.cols)
    throw UsageError("impl: columns [" + std::to_string(c0) + ", " + std::to_string(c0 + n) + ") of a matrix of " +
                     std::to_string(m.cols) + " columns");
  WMat v = m;
  v.stride = m.row_len();
  v.col0 = m.col0 + c0;
  v.cols = n;
  return v;
}

void matmul(ThreadPool& pool, MatmulScratch& scratch, const float* x, int64_t T, const std::vector<MatmulJob>& jobs) {
  if (T <= 0 || jobs.empty()) return;
  const int64_t K = jobs[0].w.cols;
  for (const MatmulJob& j : jobs)
    if (j.w.cols != K) throw UsageError("impl matmul: weights of one input must share its width");
  std::vector<int64_t> counts;
  if (T <= kGemvTokens) {
    // GEMV: rows of all jobs shared out together; each token's x split into
    // even/odd elements once for bfloat16 weights. A few tokens (a batch of
    // decodes) read each chunk of rows once from memory and then from cache,
    // token after token: each token's y is bit for bit its T = 1 result.
    const int64_t xw = K + 2;  // one token's xe | xo
    scratch.xt.resize(size_t(T * xw));
    for (int64_t t = 0; t < T; ++t) {
      float* xe = scratch.xt.data() + t * xw;
      float* xo = xe + K / 2;
      for (int64_t i = 0; i < K / 2; ++i) {
        xe[i] = x[t * K + 2 * i];
        xo[i] = x[t * K + 2 * i + 1];
      }
    }
    if (T > 1) interleave_tokens(x, T, K, scratch.xi);
    // The rows go out in chunks that the workers claim in turn: decode is
    // bound by memory bandwidth, and a worker slowed down by whatever else
    // runs on its core takes fewer chunks instead of holding the others up.
    std::vector<int64_t> first_chunk{0};  // [jobs + 1]
    for (const MatmulJob& j : jobs)
      first_chunk.push_back(first_chunk.back() + (j.w.rows + kGemvChunk - 1) / kGemvChunk);
    std::atomic<int64_t> next{0};
    pool.run([&](int) {
      size_t j = 0;
      for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < first_chunk.back();
           c = next.fetch_add(1, std::memory_order_relaxed)) {
        while (c >= first_chunk[j + 1]) ++j;
        const WMat& w = jobs[j].w;
        const int64_t r0 = (c - first_chunk[j]) * kGemvChunk, r1 = std::min(w.rows, r0 + kGemvChunk);
        with_weight(w, [&](auto tag) {
          using W = decltype(tag);
          if constexpr (std::is_same<W, BF16W>::value) {
            if (T > 1) {
              const float* xi = scratch.xi.data();
              float* y = jobs[j].y;
              switch (T) {
                case 2: return gemv_rows_bf16_batch<2>(w, x, xi, r0, r1, y);
                case 3: return gemv_rows_bf16_batch<3>(w, x, xi, r0, r1, y);
                case 4: return gemv_rows_bf16_batch<4>(w, x, xi, r0, r1, y);
                case 5: return gemv_rows_bf16_batch<5>(w, x, xi, r0, r1, y);
                case 6: return gemv_rows_bf16_batch<6>(w, x, xi, r0, r1, y);
                case 7: return gemv_rows_bf16_batch<7>(w, x, xi, r0, r1, y);
                default: return gemv_rows_bf16_batch<8>(w, x, xi, r0, r1, y);
              }
            }
          }
          for (int64_t t = 0; t < T; ++t) {
            const float* xe = scratch.xt.data() + t * xw;
            gemv_rows<W>(w, x + t * K, xe, xe + K / 2, r0, r1, jobs[j].y + t * w.rows);
          }
        });
      }
    });
    return;
  }
  // GEMM: x transposed once into xt [K, ldt] (zero padded to 16 tokens), then
  // the row tiles of all jobs shared out together.
  const int64_t ldt = (T + kLanes - 1) / kLanes * kLanes;
  scratch.xt.resize(size_t(K * ldt));
  float* xt = scratch.xt.data();
  pool.parallel_for(K, [&](int64_t b, int64_t e, int) {
    for (int64_t k = b; k < e; ++k) {
      float* col = xt + k * ldt;
      for (int64_t t = 0; t < T; ++t) col[t] = x[t * K + k];
      for (int64_t t = T; t < ldt; ++t) col[t] = 0.0f;
    }
  });
  if (int(scratch.panels.size()) < pool.size()) scratch.panels.resize(size_t(pool.size()));
  for (const MatmulJob& j : jobs) counts.push_back((j.w.rows + kPanelRows - 1) / kPanelRows);
  for_each_job_range(pool, counts, [&](size_t j, int64_t t0, int64_t t1, int worker) {
    with_weight(jobs[j].w, [&](auto tag) {
      gemm_tiles<decltype(tag)>(jobs[j].w, xt, ldt, T, t0, t1, scratch.panels[size_t(worker)], jobs[j].y);
    });
  });
}

void matmul(ThreadPool& pool, MatmulScratch& scratch, const float* x, int64_t T, const WMat& W, float* y) {
  matmul(pool, scratch, x, T, std::vector<MatmulJob>{{W, y}});
}

void add_bias(const WMat& b, int64_t T, float* y) {
  const int64_t n = b.cols;
  thread_local std::vector<float> bias;  // [n], kept between calls
  bias.resize(size_t(n));
  load_row(b, 0, 0, n, bias.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < n; ++i) y[t * n + i] += bias[size_t(i)];
}

void rms_norm(ThreadPool& pool, const float* x, int64_t rows, int64_t n, const WMat& w, float eps, float* y) {
  thread_local std::vector<float> weight_row;  // [n] the calling thread's, kept between calls
  weight_row.resize(size_t(n));
  load_row(w, 0, 0, n, weight_row.data());
  const float* weight = weight_row.data();  // what the workers read (a thread_local is each thread's own)
  pool.parallel_for(rows, [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * n;
      float* yr = y + r * n;
      // mean(x²) accumulated in double (16 lanes, fixed order), then float32.
      v8d a0 = v8d{}, a1 = v8d{};
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        v8f lo, hi;
        std::memcpy(&lo, xr + i, sizeof lo);
        std::memcpy(&hi, xr + i + 8, sizeof hi);
        const v8d dlo = __builtin_convertvector(lo, v8d), dhi = __builtin_convertvector(hi, v8d);
        a0 += dlo * dlo;
        a1 += dhi * dhi;
      }
      const v8d a = a0 + a1;
      double ss = 0;
      for (int l = 0; l < 8; ++l) ss += a[l];
      for (; i < n; ++i) ss += double(xr[i]) * double(xr[i]);
      const float var = float(ss / double(n));
      const float inv_rms = float(1.0 / std::sqrt(double(var + eps)));
      for (int64_t j = 0; j < n; ++j) {
        const float h = xr[j] * inv_rms;
        yr[j] = weight[j] * h;
      }
    }
  });
}

void add(const float* a, const float* b, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = a[i] + b[i];
}

void silu_mul(ThreadPool& pool, const float* g, const float* u, int64_t n, float* act) {
  pool.parallel_for(n, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) {
      const float silu = g[i] / (1.0f + std::exp(-g[i]));
      act[i] = silu * u[i];
    }
  });
}

float dot(const float* a, const float* b, int64_t n) {
  v16f acc = v16f{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load16(a + i) * load16(b + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void attention(ThreadPool& pool, std::vector<std::vector<float>>& row_scratch, const AttentionArgs& a) {
  const int64_t T = a.T, S = a.S, Dh = a.Dh, Dv = a.Dv > 0 ? a.Dv : a.Dh;
  constexpr int64_t kMaxRoundedHead = 1024;  // head widths a rounded q fits in
  if (a.product_rounding != GgmlType::F32 && Dh > kMaxRoundedHead)
    throw UsageError("impl attention: rounding q of head width " + std::to_string(Dh) + " (at most " +
                     std::to_string(kMaxRoundedHead) + ")");
  const int64_t q_stride = a.Hq * Dh, ctx_stride = a.Hq * Dv;
  const int64_t k_stride = a.k_stride > 0 ? a.k_stride : a.Hkv * Dh;
  const int64_t v_stride = a.v_stride > 0 ? a.v_stride : a.Hkv * Dv;
  if (int(row_scratch.size()) < pool.size()) row_scratch.resize(size_t(pool.size()));
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  pool.parallel_for(a.Hq * T, [&](int64_t b, int64_t e, int worker) {
    std::vector<float>& row = row_scratch[size_t(worker)];
    row.resize(size_t(S));
    for (int64_t unit = b; unit < e; ++unit) {
      const int64_t h = unit / T, t = unit % T;
      const float* q = a.q + t * q_stride + h * Dh;
      float q_rounded[kMaxRoundedHead];
      if (a.product_rounding != GgmlType::F32) {
        round_activations(a.product_rounding, q, q_rounded, Dh);
        q = q_rounded;
      }
      const float* k = a.k + int64_t(a.kv_head[h]) * (a.kv_head_step > 0 ? a.kv_head_step : Dh);
      const float* v = a.v + int64_t(a.kv_head[h]) * (a.kv_head_step > 0 ? a.kv_head_step : Dv);
      const float* mask = a.mask + t * S;
      float* scores = a.scores ? a.scores + (h * T + t) * S : nullptr;
      float* probs = a.probs ? a.probs + (h * T + t) * S : nullptr;

      // scores = q·k * scale (every key when they are dumped, else only the
      // allowed ones), masked entries -inf.
      float max = kNegInf;
      for (int64_t s = 0; s < S; ++s) {
        const bool allowed = mask[s] != 0.0f;
        float sc = kNegInf;
        if (allowed || scores) sc = dot(q, k + s * k_stride, Dh) * a.scale;
        if (scores) scores[s] = sc;
        row[size_t(s)] = allowed ? sc : kNegInf;
        if (allowed) max = std::max(max, sc);
      }
      // softmax over the allowed keys; a fully masked row is uniform, as
      // HF's finfo.min-filled rows are.
      float sum = 0.0f;
      if (max == kNegInf) {
        for (int64_t s = 0; s < S; ++s) row[size_t(s)] = 1.0f;
        sum = float(S);
      } else {
        for (int64_t s = 0; s < S; ++s) {
          const float ex = row[size_t(s)] == kNegInf ? 0.0f : std::exp(row[size_t(s)] - max);
          row[size_t(s)] = ex;
          sum += ex;
        }
      }
      for (int64_t s = 0; s < S; ++s) row[size_t(s)] /= sum;
      if (probs) std::memcpy(probs, row.data(), size_t(S) * sizeof(float));
      if (a.product_rounding != GgmlType::F32) round_activations(a.product_rounding, row.data(), row.data(), S);

      float* ctx = a.ctx + t * ctx_stride + h * Dv;
      if (a.flash && a.product_rounding != GgmlType::F32) {
        // ggml's flash attention (ggml_compute_forward_flash_attn_ext_f16):
        // keys in order, running max M and sum S in float32, the value sum
        // in the cache type, rounded after each key and rescaled by
        // exp(M_old - M) when M grows.
        float M = kNegInf, sum_w = 0.0f;
        std::fill(ctx, ctx + Dv, 0.0f);
        for (int64_t s = 0; s < S; ++s) {
          if (mask[s] == 0.0f) continue;
          const float sc = dot(q, k + s * k_stride, Dh) * a.scale;
          float ms = 1.0f, vs = 1.0f;
          if (sc > M) {
            const float m_old = M;
            M = sc;
            ms = m_old == kNegInf ? 0.0f : std::exp(m_old - M);
            for (int64_t d = 0; d < Dv; ++d) ctx[d] *= ms;
            round_activations(a.product_rounding, ctx, ctx, Dv);
          } else {
            vs = std::exp(sc - M);
          }
          const float* vv = v + s * v_stride;
          for (int64_t d = 0; d < Dv; ++d) ctx[d] += vv[d] * vs;
          round_activations(a.product_rounding, ctx, ctx, Dv);
          sum_w = sum_w * ms + vs;
        }
        if (sum_w > 0.0f)
          for (int64_t d = 0; d < Dv; ++d) ctx[d] /= sum_w;
        continue;
      }
      // ctx = Σ_s p_s · v_s
      std::fill(ctx, ctx + Dv, 0.0f);
      for (int64_t s = 0; s < S; ++s) {
        const float p = row[size_t(s)];
        if (p == 0.0f) continue;
        const float* vs = v + s * v_stride;
        for (int64_t d = 0; d < Dv; ++d) ctx[d] += p * vs[d];
      }
    }
  });
}

void moe_route(const MoeConfig& m, const float* probs, const float* bias, int64_t* ids, float* weights) {
  const int64_t E = m.num_experts, K = m.top_k;
  // The score experts are chosen by (DeepSeek-V3: score + bias, float32).
  std::vector<float> choice(probs, probs + E);  // [E]
  if (bias)
    for (int64_t e = 0; e < E; ++e) choice[size_t(e)] = probs[e] + bias[e];
  // Largest first, the lower id first on ties.
  auto better = [](const std::vector<float>& v) {
    return [&v](int64_t a, int64_t b) { return v[size_t(a)] > v[size_t(b)] || (v[size_t(a)] == v[size_t(b)] && a < b); };
  };
  // Group-limited choice: each group of E/n_group experts scores the sum of
  // its two best; outside the topk_group best groups the choice score is set
  // to 0.0 (HF's masked_fill: 0, not -inf, so those experts may still win
  // over negative scores).
  if (m.topk_group < m.n_group) {
    const int64_t G = m.n_group, per = E / G;
    std::vector<float> group_score(static_cast<size_t>(G));  // [G]
    for (int64_t g = 0; g < G; ++g) {
      std::vector<float> in(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::partial_sort(in.begin(), in.begin() + 2, in.end(), std::greater<float>());
      group_score[size_t(g)] = in[0] + in[1];
    }
    std::vector<int64_t> groups(static_cast<size_t>(G));
    for (int64_t g = 0; g < G; ++g) groups[size_t(g)] = g;
    std::partial_sort(groups.begin(), groups.begin() + m.topk_group, groups.end(), better(group_score));
    std::vector<bool> kept(static_cast<size_t>(G), false);
    for (int64_t i = 0; i < m.topk_group; ++i) kept[size_t(groups[size_t(i)])] = true;
    for (int64_t e = 0; e < E; ++e)
      if (!kept[size_t(e / per)]) choice[size_t(e)] = 0.0f;
  }
  std::vector<int64_t> order(static_cast<size_t>(E));  // experts, best first
  for (int64_t e = 0; e < E; ++e) order[size_t(e)] = e;
  std::partial_sort(order.begin(), order.begin() + K, order.end(), better(choice));
  // Weights from the unbiased probabilities, renormalised over the chosen
  // (summed best first; DeepSeek-V3 adds 1e-20), then scaled.
  std::vector<float> w(static_cast<size_t>(K));  // [K], best first
  for (int64_t k = 0; k < K; ++k) w[size_t(k)] = probs[order[size_t(k)]];
  if (m.norm_topk_prob) {
    float sum = 0.0f;
    for (float x : w) sum += x;
    if (m.scoring == MoeConfig::Scoring::Sigmoid) sum += 1e-20f;
    for (float& x : w) x /= sum;
  }
  if (m.routed_scaling_factor != 1.0)
    for (float& x : w) x *= float(m.routed_scaling_factor);
  // Reported in ascending expert id.
  std::vector<int64_t> slot(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k) slot[size_t(k)] = k;
  std::sort(slot.begin(), slot.end(), [&](int64_t a, int64_t b) { return order[size_t(a)] < order[size_t(b)]; });
  for (int64_t k = 0; k < K; ++k) {
    ids[k] = order[size_t(slot[size_t(k)])];
    weights[k] = w[size_t(slot[size_t(k)])];
  }
}

void head_matmul(ThreadPool& pool, const HeadMatmul& m) {
  const int64_t K = m.w.cols;
  // One unit per (head, output row): W's row converted once, dotted with
  // every token's input.
  pool.parallel_for(m.H * m.w_rows, [&](int64_t b, int64_t e, int) {
    std::vector<float> wrow(static_cast<size_t>(K));
    for (int64_t unit = b; unit < e; ++unit) {
      const int64_t h = unit / m.w_rows, n = unit % m.w_rows;
      load_row(m.w, h * m.w_head + m.w_row0 + n, 0, K, wrow.data());
      for (int64_t t = 0; t < m.T; ++t)
        m.y[t * m.y_row + h * m.y_head + n] = dot(wrow.data(), m.x + t * m.x_row + h * m.x_head, K);
    }
  });
}

void head_matmul_t(ThreadPool& pool, const HeadMatmul& m) {
  // One unit per (head, block of kCols output columns): y[t, cols] =
  // Σ_k x[t, k] · W_h[k, cols], k in order, W_h's row segment converted once
  // per k for all tokens.
  constexpr int64_t kCols = 64;
  const int64_t N = m.w.cols, blocks = (N + kCols - 1) / kCols;
  pool.parallel_for(m.H * blocks, [&](int64_t b, int64_t e, int) {
    float seg[kCols];
    for (int64_t unit = b; unit < e; ++unit) {
      const int64_t h = unit / blocks, c0 = unit % blocks * kCols, n = std::min(kCols, N - c0);
      for (int64_t t = 0; t < m.T; ++t) std::fill_n(m.y + t * m.y_row + h * m.y_head + c0, n, 0.0f);
      for (int64_t k = 0; k < m.w_rows; ++k) {
        load_row(m.w, h * m.w_head + m.w_row0 + k, c0, n, seg);
        for (int64_t t = 0; t < m.T; ++t) {
          const float xk = m.x[t * m.x_row + h * m.x_head + k];
          float* y = m.y + t * m.y_row + h * m.y_head + c0;
          for (int64_t i = 0; i < n; ++i) y[i] += xk * seg[i];
        }
      }
    }
  });
}

}  // namespace llmdiff::impl
