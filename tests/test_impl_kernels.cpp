// The impl's kernels and RoPE on their own: matmul (and MLA's per-head
// absorption products) against a float64 reference for every weight dtype
// and awkward shape, bit-identical results for any thread count, the rope types without golden data (linear, dynamic,
// yarn) against the formulas of modeling_rope_utils.py evaluated in double.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>

#include "dumps/model/config.h"
#include "dumps/base/dtype.h"
#include "dumps/formats/ggml_types.h"
#include "impl/kernels.h"
#include "impl/rope.h"
#include "impl/thread_pool.h"

namespace llmdiff::impl {
namespace {

struct Weights {
  std::vector<uint16_t> half;  // BF16 or F16 storage
  std::vector<float> f32;      // F32 storage, or the exact widening of `half`
  WMat mat;
};

Weights random_weights(DType dt, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd;
  Weights w;
  w.f32.resize(size_t(rows * cols));
  for (float& v : w.f32) v = nd(gen);
  if (dt != DType::F32) {
    w.half.resize(w.f32.size());
    for (size_t i = 0; i < w.f32.size(); ++i) {
      w.half[i] = dt == DType::BF16 ? f32_to_bf16(w.f32[i]) : f32_to_f16(w.f32[i]);
      w.f32[i] = dt == DType::BF16 ? bf16_to_f32(w.half[i]) : f16_to_f32(w.half[i]);
    }
  }
  w.mat.data = dt == DType::F32 ? static_cast<const void*>(w.f32.data()) : w.half.data();
  w.mat.dtype = dt;
  w.mat.rows = rows;
  w.mat.cols = cols;
  return w;
}

// n values drawn from N(0, 1) with `seed`.
std::vector<float> random_vector(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = nd(gen);
  return v;
}

TEST(ImplKernels, MatmulMatchesFloat64ForEveryDtypeAndShape) {
  ThreadPool pool(2);
  MatmulScratch scratch;
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    for (int64_t T : {1, 2, 7, 16, 17, 33, 50}) {
      for (int64_t N : {1, 13, 30}) {
        for (int64_t K : {5, 16, 47, 100}) {
          SCOPED_TRACE(std::string(dtype_name(dt)) + " T=" + std::to_string(T) + " N=" + std::to_string(N) +
                       " K=" + std::to_string(K));
          const Weights w = random_weights(dt, N, K, uint32_t(T * 1000 + N * 10 + K));
          const std::vector<float> x = random_vector(T * K, 7);
          std::vector<float> y(size_t(T * N), -1.0f);
          matmul(pool, scratch, x.data(), T, w.mat, y.data());
          for (int64_t t = 0; t < T; ++t)
            for (int64_t o = 0; o < N; ++o) {
              double ref = 0, mag = 0;
              for (int64_t k = 0; k < K; ++k) {
                ref += double(x[size_t(t * K + k)]) * double(w.f32[size_t(o * K + k)]);
                mag += std::fabs(double(x[size_t(t * K + k)]) * double(w.f32[size_t(o * K + k)]));
              }
              ASSERT_NEAR(y[size_t(t * N + o)], ref, 4e-6 * mag + 1e-30) << "t=" << t << " o=" << o;
            }
        }
      }
    }
  }
}

TEST(ImplKernels, LoadRowWidensExactly) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    const Weights w = random_weights(dt, 3, 77, 17);
    std::vector<float> row(77);
    for (int64_t r = 0; r < 3; ++r) {
      load_row(w.mat, r, 0, 77, row.data());
      EXPECT_EQ(row, std::vector<float>(w.f32.begin() + r * 77, w.f32.begin() + (r + 1) * 77)) << dtype_name(dt);
      load_row(w.mat, r, 5, 40, row.data());
      EXPECT_EQ(std::vector<float>(row.begin(), row.begin() + 40),
                std::vector<float>(w.f32.begin() + r * 77 + 5, w.f32.begin() + r * 77 + 45))
          << dtype_name(dt);
    }
  }
  // float16 specials: subnormals, infinities, NaN, signed zero.
  const std::vector<uint16_t> specials = {0x0001, 0x03ff, 0x0400, 0x7bff, 0x7c00, 0xfc00, 0x8000, 0x7e00,
                                          0x3c00, 0xbc00, 0x0200, 0x8001, 0x7c01, 0x5555, 0x1234, 0xc000};
  WMat m{specials.data(), DType::F16, 1, int64_t(specials.size())};
  std::vector<float> got(specials.size());
  load_row(m, 0, 0, m.cols, got.data());
  for (size_t i = 0; i < specials.size(); ++i) {
    const float want = f16_to_f32(specials[i]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[i])) << i;
    } else {
      EXPECT_EQ(std::memcmp(&got[i], &want, 4), 0) << std::hex << specials[i] << ": " << got[i] << " vs " << want;
    }
  }
}

TEST(ImplKernels, MatmulIsBitIdenticalForAnyThreadCount) {
  ThreadPool p1(1), p2(2), p3(3);
  MatmulScratch s1, s2, s3;
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    for (int64_t T : {1, 5, 40}) {
      const int64_t N = 301, K = 200;
      const Weights w = random_weights(dt, N, K, 99);
      const std::vector<float> x = random_vector(T * K, 3);
      std::vector<float> y1(size_t(T * N)), y2(y1.size()), y3(y1.size());
      matmul(p1, s1, x.data(), T, w.mat, y1.data());
      matmul(p2, s2, x.data(), T, w.mat, y2.data());
      matmul(p3, s3, x.data(), T, w.mat, y3.data());
      EXPECT_EQ(0, std::memcmp(y1.data(), y2.data(), y1.size() * 4)) << dtype_name(dt) << " T=" << T;
      EXPECT_EQ(0, std::memcmp(y1.data(), y3.data(), y1.size() * 4)) << dtype_name(dt) << " T=" << T;
    }
  }
}

TEST(ImplKernels, AFewTokensTogetherEqualEachTokenAloneBitForBit) {
  // A batch of decodes (T <= 8) gives each token exactly its T = 1 result.
  ThreadPool pool(2);
  MatmulScratch scratch;
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    for (int64_t K : {64, 75, 200}) {
      const int64_t N = 37;
      const Weights w = random_weights(dt, N, K, uint32_t(K));
      for (int64_t T = 2; T <= 8; ++T) {
        const std::vector<float> x = random_vector(T * K, uint32_t(T));
        std::vector<float> y(size_t(T * N)), one(static_cast<size_t>(N));
        matmul(pool, scratch, x.data(), T, w.mat, y.data());
        for (int64_t t = 0; t < T; ++t) {
          matmul(pool, scratch, x.data() + t * K, 1, w.mat, one.data());
          EXPECT_EQ(0, std::memcmp(one.data(), y.data() + t * N, size_t(N) * 4))
              << dtype_name(dt) << " K=" << K << " T=" << T << " t=" << t;
        }
      }
    }
  }
}

TEST(ImplKernels, AGemvRowIsSummedAloneWhicheverRowsAreReadBesideIt) {
  // A worker reads several rows at once (impl/kernels.cpp, kGemvStreams):
  // each row's y is the same bit for bit as when the row is read alone, or
  // in a view that groups the rows differently.
  ThreadPool pool(2);
  MatmulScratch scratch;
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    for (int64_t K : {64, 75, 200}) {
      const int64_t N = 301;
      const Weights w = random_weights(dt, N, K, uint32_t(K + 7));
      const std::vector<float> x = random_vector(K, 9);
      std::vector<float> y(static_cast<size_t>(N));
      matmul(pool, scratch, x.data(), 1, w.mat, y.data());
      for (int64_t r = 0; r < N; ++r) {
        float alone = 0;
        matmul(pool, scratch, x.data(), 1, row_view(w.mat, r, 1), &alone);
        ASSERT_EQ(0, std::memcmp(&alone, &y[size_t(r)], 4)) << dtype_name(dt) << " K=" << K << " row " << r;
      }
      for (int64_t r0 : {1, 3, 66}) {
        const int64_t n = N - r0 - 5;
        std::vector<float> part(static_cast<size_t>(n));
        matmul(pool, scratch, x.data(), 1, row_view(w.mat, r0, n), part.data());
        EXPECT_EQ(0, std::memcmp(part.data(), y.data() + r0, size_t(n) * 4))
            << dtype_name(dt) << " K=" << K << " rows from " << r0;
      }
    }
  }
}

TEST(ImplKernels, GgmlRowsReadInPlaceEqualTheRowsDequantisedFirst) {
  // GGUF Q8_0, Q4_0, Q4_K, Q5_K and Q6_K weights are read block by block in
  // place for a few tokens (all but Q8_0 with AVX-512), the other types
  // dequantised a row at a time; each y is bit for bit the product with the
  // rows dequantised first (as a GEMM's panel and a view of some columns
  // read them), in any row grouping, interleaved heads included.
  ThreadPool pool(2);
  MatmulScratch scratch;
  for (GgmlType type : {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q5_0})
  for (int64_t K : {256, 768, 2048}) {
    SCOPED_TRACE(ggml_type_name(uint32_t(type)));
    const int64_t N = 308;  // 7 heads of 44 rows
    const std::vector<float> values = random_vector(N * K, uint32_t(K));
    const size_t row_bytes = ggml_row_bytes(type, K);
    std::vector<uint8_t> blocks(row_bytes * size_t(N));
    std::vector<float> dequantised(values.size());
    for (int64_t r = 0; r < N; ++r) {
      quantize_row(type, values.data() + r * K, blocks.data() + size_t(r) * row_bytes, K);
      dequantize_row(type, blocks.data() + size_t(r) * row_bytes, dequantised.data() + r * K, K);
    }
    for (int64_t heads : {0, 7}) {
      WMat q;
      q.data = blocks.data();
      q.quant = type;
      q.rows = N;
      q.cols = K;
      q.interleaved_heads = heads;
      // The same rows as float32, in the order q reads them.
      std::vector<float> f32(values.size());
      for (int64_t r = 0; r < N; ++r)
        std::copy_n(dequantised.data() + q.src_row(r) * K, K, f32.data() + r * K);
      WMat f;
      f.data = f32.data();
      f.rows = N;
      f.cols = K;
      for (int64_t T : {1, 3}) {
        const std::vector<float> x = random_vector(T * K, uint32_t(T + 11));
        std::vector<float> yq(size_t(T * N)), yf(yq.size());
        matmul(pool, scratch, x.data(), T, q, yq.data());
        matmul(pool, scratch, x.data(), T, f, yf.data());
        EXPECT_EQ(0, std::memcmp(yq.data(), yf.data(), yq.size() * 4)) << "K=" << K << " heads=" << heads << " T=" << T;
      }
      const std::vector<float> x = random_vector(K, 5);
      const int64_t r0 = heads ? 2 * (N / heads) : 3, n = heads ? 3 * (N / heads) : N - 8;
      std::vector<float> part(static_cast<size_t>(n)), whole(static_cast<size_t>(N));
      matmul(pool, scratch, x.data(), 1, row_view(q, r0, n), part.data());
      matmul(pool, scratch, x.data(), 1, q, whole.data());
      EXPECT_EQ(0, std::memcmp(part.data(), whole.data() + r0, size_t(n) * 4)) << "K=" << K << " heads=" << heads;
    }
  }
}

TEST(ImplKernels, SeveralWeightsOnOneInputEqualSeparateMatmuls) {
  ThreadPool pool(2);
  MatmulScratch scratch;
  const int64_t K = 70;
  const Weights a = random_weights(DType::BF16, 25, K, 1), b = random_weights(DType::F32, 7, K, 2),
                c = random_weights(DType::F16, 40, K, 3);
  for (int64_t T : {1, 9, 33}) {
    const std::vector<float> x = random_vector(T * K, 5);
    std::vector<float> ya(size_t(T * 25)), yb(size_t(T * 7)), yc(size_t(T * 40));
    matmul(pool, scratch, x.data(), T, {{a.mat, ya.data()}, {b.mat, yb.data()}, {c.mat, yc.data()}});
    std::vector<float> ra(ya.size()), rb(yb.size()), rc(yc.size());
    matmul(pool, scratch, x.data(), T, a.mat, ra.data());
    matmul(pool, scratch, x.data(), T, b.mat, rb.data());
    matmul(pool, scratch, x.data(), T, c.mat, rc.data());
    EXPECT_EQ(ya, ra) << "T=" << T;
    EXPECT_EQ(yb, rb) << "T=" << T;
    EXPECT_EQ(yc, rc) << "T=" << T;
  }
}

TEST(ImplKernels, AttentionIsBitIdenticalForAnyThreadCountAndMatchesFloat64) {
  const int64_t T = 5, S = 9, Hq = 6, Hkv = 2, Dh = 24;
  std::mt19937 gen(11);
  std::normal_distribution<float> nd;
  std::vector<float> q(size_t(T * Hq * Dh)), k(size_t(S * Hkv * Dh)), v(k.size()), mask(size_t(T * S));
  for (float& x : q) x = nd(gen);
  for (float& x : k) x = nd(gen);
  for (float& x : v) x = nd(gen);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < S; ++s) mask[size_t(t * S + s)] = s <= S - T + t ? 1.0f : 0.0f;
  const std::vector<int> kv_head = {0, 0, 0, 1, 1, 1};
  auto run = [&](int threads, std::vector<float>& ctx, std::vector<float>& probs) {
    ThreadPool pool(threads);
    std::vector<std::vector<float>> rows;
    ctx.assign(size_t(T * Hq * Dh), 0.0f);
    probs.assign(size_t(Hq * T * S), 0.0f);
    AttentionArgs a;
    a.T = T, a.S = S, a.Hq = Hq, a.Hkv = Hkv, a.Dh = Dh;
    a.q = q.data(), a.k = k.data(), a.v = v.data(), a.mask = mask.data(), a.kv_head = kv_head.data();
    a.scale = 0.2f, a.probs = probs.data(), a.ctx = ctx.data();
    attention(pool, rows, a);
  };
  std::vector<float> c1, p1, c2, p2;
  run(1, c1, p1);
  run(2, c2, p2);
  EXPECT_EQ(c1, c2);
  EXPECT_EQ(p1, p2);
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> p(size_t(S), 0.0);
      double mx = -1e300, sum = 0;
      for (int64_t s = 0; s <= S - T + t; ++s) {
        double d = 0;
        for (int64_t i = 0; i < Dh; ++i)
          d += double(q[size_t((t * Hq + h) * Dh + i)]) * k[size_t((s * Hkv + kv_head[size_t(h)]) * Dh + i)];
        p[size_t(s)] = d * 0.2f;
        mx = std::max(mx, p[size_t(s)]);
      }
      for (int64_t s = 0; s <= S - T + t; ++s) sum += (p[size_t(s)] = std::exp(p[size_t(s)] - mx));
      for (int64_t s = 0; s < S; ++s) {
        p[size_t(s)] /= sum;
        EXPECT_NEAR(p1[size_t((h * T + t) * S + s)], p[size_t(s)], 1e-6);
      }
      for (int64_t i = 0; i < Dh; ++i) {
        double c = 0;
        for (int64_t s = 0; s < S; ++s) c += p[size_t(s)] * v[size_t((s * Hkv + kv_head[size_t(h)]) * Dh + i)];
        EXPECT_NEAR(c1[size_t((t * Hq + h) * Dh + i)], c, 1e-5);
      }
    }
}

ModelConfig rope_config(double theta, int64_t head_dim, int64_t max_pos) {
  ModelConfig c;
  c.source = "test config";
  c.rope_theta = theta;
  c.head_dim = head_dim;
  c.hidden_size = head_dim * 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.max_position_embeddings = max_pos;
  return c;
}

void expect_rel_near(const std::vector<float>& got, const std::vector<double>& want, double rel) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], rel * std::fabs(want[i])) << "i=" << i;
}

std::vector<double> default_freqs(double base, int64_t dim) {
  std::vector<double> out;
  for (int64_t i = 0; i < dim; i += 2) out.push_back(1.0 / std::pow(base, double(i) / double(dim)));
  return out;
}

TEST(ImplRope, DefaultAndLinear) {
  ModelConfig c = rope_config(10000.0, 64, 2048);
  const RopeFrequencies def = rope_frequencies(c, 10);
  expect_rel_near(def.inv_freq, default_freqs(10000.0, 64), 1e-6);
  EXPECT_EQ(def.attention_scaling, 1.0);
  c.rope_scaling.type = RopeScaling::Type::Linear;
  c.rope_scaling.factor = 4.0;
  const RopeFrequencies lin = rope_frequencies(c, 10);
  for (size_t i = 0; i < lin.inv_freq.size(); ++i) EXPECT_EQ(lin.inv_freq[i], def.inv_freq[i] / 4.0f);
}

TEST(ImplRope, DynamicNtkRescalesOnlyBeyondTheTrainedContext) {
  ModelConfig c = rope_config(10000.0, 64, 128);
  c.rope_scaling.type = RopeScaling::Type::Dynamic;
  c.rope_scaling.factor = 2.0;
  const std::vector<float> plain = rope_frequencies(rope_config(10000.0, 64, 128), 1).inv_freq;
  EXPECT_EQ(rope_frequencies(c, 100).inv_freq, plain);
  EXPECT_EQ(rope_frequencies(c, 128).inv_freq, plain);
  const int64_t seq = 300;
  const double base = 10000.0 * std::pow(2.0 * seq / 128.0 - 1.0, 64.0 / 62.0);
  expect_rel_near(rope_frequencies(c, seq).inv_freq, default_freqs(base, 64), 2e-6);
}

TEST(ImplRope, YarnBlendsFrequenciesAndScalesAttention) {
  ModelConfig c = rope_config(10000.0, 64, 4096);
  c.rope_scaling.type = RopeScaling::Type::Yarn;
  c.rope_scaling.factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 1024;
  const RopeFrequencies y = rope_frequencies(c, 10);
  // Formulas of _compute_yarn_parameters in double.
  const double factor = 4096.0 / 1024.0, pi = std::acos(-1.0);
  auto corr = [&](double rot) { return 64.0 * std::log(1024.0 / (rot * 2 * pi)) / (2 * std::log(10000.0)); };
  const double low = std::max(std::floor(corr(32.0)), 0.0), high = std::min(std::ceil(corr(1.0)), 63.0);
  std::vector<double> want;
  const std::vector<double> base = default_freqs(10000.0, 64);
  for (size_t i = 0; i < base.size(); ++i) {
    const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation = 1.0 - ramp;
    want.push_back(base[i] / factor * (1 - extrapolation) + base[i] * extrapolation);
  }
  expect_rel_near(y.inv_freq, want, 2e-6);
  EXPECT_DOUBLE_EQ(y.attention_scaling, 0.1 * std::log(factor) + 1.0);
  EXPECT_GT(y.inv_freq[0], y.inv_freq.back() * 100);  // high frequencies kept, low ones interpolated
  EXPECT_NEAR(y.inv_freq.back(), base.back() / factor, 1e-6 * base.back());

  // cos/sin carry the attention factor: at position 0, cos = factor, sin = 0.
  std::vector<float> cs(64 * 2), sn(64 * 2);
  rope_tables(y, {0, 5}, 64, cs.data(), sn.data());
  EXPECT_FLOAT_EQ(cs[0], float(y.attention_scaling));
  EXPECT_EQ(sn[0], 0.0f);
  EXPECT_EQ(cs[64 + 3], cs[64 + 32 + 3]);  // rotate-half layout: halves equal
}

TEST(ImplRope, RotateHalfAndInterleavedPairings) {
  const int64_t Dh = 8;
  ModelConfig c = rope_config(10000.0, Dh, 64);
  const RopeFrequencies f = rope_frequencies(c, 4);
  std::vector<float> cs(static_cast<size_t>(Dh)), sn(static_cast<size_t>(Dh));
  rope_tables(f, {3}, Dh, cs.data(), sn.data());
  const std::vector<float> x0 = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<float> a = x0, b = x0;
  apply_rope(a.data(), 1, 1, Dh, cs.data(), sn.data());
  apply_rope_interleaved(b.data(), 1, 1, Dh, cs.data(), sn.data());
  for (int64_t i = 0; i < Dh / 2; ++i) {
    const double th = 3.0 * f.inv_freq[size_t(i)];
    EXPECT_NEAR(a[size_t(i)], x0[size_t(i)] * std::cos(th) - x0[size_t(i + Dh / 2)] * std::sin(th), 1e-5);
    EXPECT_NEAR(a[size_t(i + Dh / 2)], x0[size_t(i + Dh / 2)] * std::cos(th) + x0[size_t(i)] * std::sin(th), 1e-5);
    EXPECT_NEAR(b[size_t(2 * i)], x0[size_t(2 * i)] * std::cos(th) - x0[size_t(2 * i + 1)] * std::sin(th), 1e-5);
    EXPECT_NEAR(b[size_t(2 * i + 1)], x0[size_t(2 * i + 1)] * std::cos(th) + x0[size_t(2 * i)] * std::sin(th), 1e-5);
  }
}

TEST(ImplRope, PairsToHalvesThenRotateHalfRotatesAdjacentPairs) {
  // DeepSeek's rope_interleave: reorder, rotate-half = the interleaved
  // rotation, read in halves order.
  const int64_t Dh = 8;
  ModelConfig c = rope_config(10000.0, Dh, 64);
  const RopeFrequencies f = rope_frequencies(c, 4);
  std::vector<float> cs(static_cast<size_t>(Dh)), sn(static_cast<size_t>(Dh));
  rope_tables(f, {3}, Dh, cs.data(), sn.data());
  const std::vector<float> x0 = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<float> a = x0, b = x0;
  pairs_to_halves(a.data(), 1, Dh);
  EXPECT_EQ(a, (std::vector<float>{1, 3, 5, 7, 2, 4, 6, 8}));
  apply_rope(a.data(), 1, 1, Dh, cs.data(), sn.data());
  apply_rope_interleaved(b.data(), 1, 1, Dh, cs.data(), sn.data());
  pairs_to_halves(b.data(), 1, Dh);
  EXPECT_EQ(a, b);
}

// MLA's absorption products: y_h[t] = W_h · x_h[t] and W_hᵀ · x_h[t] over
// blocks of a weight's rows, strided inputs and outputs, against float64, the
// same for any thread count.
TEST(ImplKernels, HeadMatmulsMatchFloat64ForAnyThreadCount) {
  const int64_t T = 5, H = 3, block = 7, off = 2, n = 4, K = 70;  // W_h = rows [h*7 + 2, +4) of [21, 70]
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Weights w = random_weights(dt, H * block, K, 5);
    std::mt19937 gen(6);
    std::normal_distribution<float> nd;
    // head_matmul: x_h[t] [K] at x + t*(H*K+3) + h*K, y_h[t] [n] at y + t*(H*n) + h*n
    std::vector<float> x(size_t(T * (H * K + 3)));
    for (float& v : x) v = nd(gen);
    auto run = [&](int threads, bool transposed, const std::vector<float>& in, int64_t x_row, int64_t x_head,
                   int64_t y_row, int64_t y_head, int64_t y_size) {
      ThreadPool pool(threads);
      std::vector<float> y(static_cast<size_t>(y_size), -1.0f);
      HeadMatmul m;
      m.T = T, m.H = H, m.x = in.data(), m.x_row = x_row, m.x_head = x_head;
      m.w = w.mat, m.w_head = block, m.w_row0 = off, m.w_rows = n;
      m.y = y.data(), m.y_row = y_row, m.y_head = y_head;
      if (transposed)
        head_matmul_t(pool, m);
      else
        head_matmul(pool, m);
      return y;
    };
    const std::vector<float> y1 = run(1, false, x, H * K + 3, K, H * n, n, T * H * n);
    EXPECT_EQ(y1, run(2, false, x, H * K + 3, K, H * n, n, T * H * n));
    EXPECT_EQ(y1, run(3, false, x, H * K + 3, K, H * n, n, T * H * n));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < n; ++r) {
          double ref = 0;
          for (int64_t k = 0; k < K; ++k)
            ref += double(w.f32[size_t((h * block + off + r) * K + k)]) * x[size_t(t * (H * K + 3) + h * K + k)];
          EXPECT_NEAR(y1[size_t(t * H * n + h * n + r)], ref, 1e-4 * (1 + std::fabs(ref)));
        }
    // head_matmul_t: x_h[t] [n] at xt + t*(H*n) + h*n, y_h[t] [K] at y + t*(H*K+1) + h*K
    std::vector<float> xt(size_t(T * H * n));
    for (float& v : xt) v = nd(gen);
    const std::vector<float> z1 = run(1, true, xt, H * n, n, H * K + 1, K, T * (H * K + 1));
    EXPECT_EQ(z1, run(2, true, xt, H * n, n, H * K + 1, K, T * (H * K + 1)));
    EXPECT_EQ(z1, run(3, true, xt, H * n, n, H * K + 1, K, T * (H * K + 1)));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t c = 0; c < K; ++c) {
          double ref = 0;
          for (int64_t r = 0; r < n; ++r)
            ref += double(w.f32[size_t((h * block + off + r) * K + c)]) * xt[size_t(t * H * n + h * n + r)];
          EXPECT_NEAR(z1[size_t(t * (H * K + 1) + h * K + c)], ref, 1e-5 * (1 + std::fabs(ref)));
        }
        EXPECT_EQ(z1[size_t(t * (H * K + 1) + H * K)], -1.0f) << "the gap after the heads is not written";
      }
  }
}

TEST(ImplKernels, AttentionWithOwnValueWidthAndCacheRowStrides) {
  // MLA's absorbed form: every head reads keys [latent | k_pe] (Dh = 12) and
  // values [latent] (Dv = 8) from the same cache rows of 12 floats.
  const int64_t T = 3, S = 6, Hq = 4, Dh = 12, Dv = 8;
  std::mt19937 gen(21);
  std::normal_distribution<float> nd;
  std::vector<float> q(size_t(T * Hq * Dh)), cache(size_t(S * Dh)), mask(size_t(T * S));
  for (float& x : q) x = nd(gen);
  for (float& x : cache) x = nd(gen);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < S; ++s) mask[size_t(t * S + s)] = s <= S - T + t ? 1.0f : 0.0f;
  const std::vector<int> heads(size_t(Hq), 0);
  ThreadPool pool(2);
  std::vector<std::vector<float>> rows;
  std::vector<float> ctx(size_t(T * Hq * Dv));
  AttentionArgs a;
  a.T = T, a.S = S, a.Hq = Hq, a.Hkv = 1, a.Dh = Dh, a.Dv = Dv, a.k_stride = Dh, a.v_stride = Dh;
  a.q = q.data(), a.k = cache.data(), a.v = cache.data(), a.mask = mask.data(), a.kv_head = heads.data();
  a.scale = 0.3f, a.ctx = ctx.data();
  attention(pool, rows, a);
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> p(size_t(S), 0.0);
      double mx = -1e300, sum = 0;
      for (int64_t s = 0; s <= S - T + t; ++s) {
        double d = 0;
        for (int64_t i = 0; i < Dh; ++i) d += double(q[size_t((t * Hq + h) * Dh + i)]) * cache[size_t(s * Dh + i)];
        mx = std::max(mx, p[size_t(s)] = d * 0.3f);
      }
      for (int64_t s = 0; s <= S - T + t; ++s) sum += (p[size_t(s)] = std::exp(p[size_t(s)] - mx));
      for (int64_t i = 0; i < Dv; ++i) {
        double c = 0;
        for (int64_t s = 0; s <= S - T + t; ++s) c += p[size_t(s)] / sum * cache[size_t(s * Dh + i)];
        EXPECT_NEAR(ctx[size_t((t * Hq + h) * Dv + i)], c, 1e-5);
      }
    }
}

TEST(ImplKernels, ThreadPoolCoversEveryIndexOnce) {
  for (int threads : {1, 2, 5}) {
    ThreadPool pool(threads);
    for (int64_t n : {0, 1, 3, 100}) {
      std::vector<int> hits(size_t(n), 0);
      for (int rep = 0; rep < 50; ++rep)
        pool.parallel_for(n, [&](int64_t b, int64_t e, int) {
          for (int64_t i = b; i < e; ++i) ++hits[size_t(i)];
        });
      for (int h : hits) EXPECT_EQ(h, 50);
    }
  }
}

TEST(ImplKernels, ThreadPoolRethrowsAWorkersException) {
  ThreadPool pool(2);
  EXPECT_THROW(pool.run([](int w) {
    if (w == 1) throw std::runtime_error("worker failed");
  }),
               std::runtime_error);
  EXPECT_THROW(pool.run([](int w) {
    if (w == 0) throw std::runtime_error("caller failed");
  }),
               std::runtime_error);
  int calls = 0;  // still usable afterwards
  pool.parallel_for(2, [&](int64_t, int64_t, int) { __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED); });
  EXPECT_EQ(calls, 2);
}

}  // namespace
}  // namespace llmdiff::impl
