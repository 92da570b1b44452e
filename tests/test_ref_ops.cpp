// The ref's ops one at a time: RoPE initialisation of every rope type against
// hand-computed formulas (modeling_rope_utils.py v4.51.3), the cos/sin
// tables, the causal mask, RMSNorm's rounding points, rotate-half RoPE,
// repeat_kv, attention pieces, and the typed errors of the engine.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "dumps/model/config.h"
#include "dumps/base/dtype.h"
#include "dumps/contract/engine.h"
#include "dumps/base/errors.h"
#include "dumps/model/weights.h"
#include "ref/ops.h"
#include "ref/ref_engine.h"
#include "tests/support.h"

namespace llmdiff {
namespace {

namespace ops = ref::ops;

std::vector<double> values(const torch::Tensor& t) {
  torch::Tensor d = t.to(torch::kDouble).contiguous();
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

ModelConfig rope_config(int64_t head_dim, double theta, int64_t max_pos) {
  ModelConfig c;
  c.source = "test-config.json";
  c.model_type = "llama";
  c.family = Family::Llama;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.head_dim = head_dim;
  c.hidden_size = 4 * head_dim;
  c.intermediate_size = 8 * head_dim;
  c.num_hidden_layers = 1;
  c.vocab_size = 16;
  c.rope_theta = theta;
  c.max_position_embeddings = max_pos;
  return c;
}

// 1 / theta^(2i/dim), i < dim/2: the unscaled RoPE frequencies.
std::vector<double> plain_freqs(double theta, int64_t dim) {
  std::vector<double> f;
  for (int64_t i = 0; i < dim / 2; ++i) f.push_back(1.0 / std::pow(theta, double(2 * i) / double(dim)));
  return f;
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double rel, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(got[i], want[i], rel * std::fabs(want[i])) << what << " [" << i << "]";
}

TEST(RefRopeInit, DefaultMatchesPowersOfTheta) {
  ModelConfig c = rope_config(16, 10000.0, 128);
  ops::RopeInit r = ops::rope_init(c, 0);
  EXPECT_EQ(r.inv_freq.scalar_type(), torch::kFloat);
  EXPECT_EQ(r.attention_scaling, 1.0);
  // theta = 10^4, dim 16: theta^(-2i/16) = 10^(-i/2)
  const std::vector<double> hand = {1.0, 0.31622776601683794, 0.1, 0.031622776601683794,
                                    0.01, 0.0031622776601683794, 0.001, 0.00031622776601683794};
  expect_close(values(r.inv_freq), hand, 2e-7, "default f32");
  expect_close(values(ops::rope_init(c, 0, torch::kDouble).inv_freq), hand, 1e-14, "default f64");
}

TEST(RefRopeInit, LinearDividesByFactor) {
  ModelConfig c = rope_config(16, 10000.0, 128);
  torch::Tensor plain = ops::rope_init(c, 0).inv_freq;
  c.rope_scaling.type = RopeScaling::Type::Linear;
  c.rope_scaling.factor = 4.0;
  ops::RopeInit r = ops::rope_init(c, 0);
  EXPECT_TRUE(torch::equal(r.inv_freq, plain / 4)) << "division by a power of two is exact";
  std::vector<double> hand = plain_freqs(10000.0, 16);
  for (double& f : hand) f /= 4.0;
  expect_close(values(r.inv_freq), hand, 2e-7, "linear");
  EXPECT_EQ(r.attention_scaling, 1.0);
}

TEST(RefRopeInit, DynamicRescalesTheBasePastMaxPositions) {
  ModelConfig c = rope_config(16, 10000.0, 32);
  torch::Tensor plain = ops::rope_init(c, 0).inv_freq;
  c.rope_scaling.type = RopeScaling::Type::Dynamic;
  c.rope_scaling.factor = 2.0;
  // Up to max_position_embeddings the base is theta * 1^(dim/(dim-2)).
  EXPECT_TRUE(torch::equal(ops::rope_init(c, 0).inv_freq, plain));
  EXPECT_TRUE(torch::equal(ops::rope_init(c, 32).inv_freq, plain));
  // seq_len 64 > 32: base = theta * ((2 * 64 / 32) - (2 - 1))^(16/14) = theta * 3^(8/7)
  const double base = 10000.0 * std::pow(3.0, 16.0 / 14.0);
  expect_close(values(ops::rope_init(c, 64).inv_freq), plain_freqs(base, 16), 1e-6, "dynamic 64");
  expect_close(values(ops::rope_init(c, 64, torch::kDouble).inv_freq), plain_freqs(base, 16), 1e-13, "dynamic f64");
  // seq_len 40: base = theta * ((2 * 40 / 32) - 1)^(8/7) = theta * 1.5^(8/7)
  expect_close(values(ops::rope_init(c, 40).inv_freq), plain_freqs(10000.0 * std::pow(1.5, 8.0 / 7.0), 16), 1e-6,
               "dynamic 40");
  EXPECT_EQ(ops::rope_init(c, 64).attention_scaling, 1.0);
}

TEST(RefRopeInit, Llama3KeepsHighDividesLowFrequencies) {
  // The llama3-mqa-scaled golden's parameters: no frequency in the smoothed band.
  ModelConfig c = rope_config(16, 500000.0, 256);
  torch::Tensor plain = ops::rope_init(c, 0).inv_freq;
  c.rope_scaling.type = RopeScaling::Type::Llama3;
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 32;
  torch::Tensor inv = ops::rope_init(c, 0).inv_freq;
  EXPECT_EQ(inv[0].item<float>(), plain[0].item<float>());
  for (int i = 1; i < 8; ++i) EXPECT_EQ(inv[i].item<float>(), plain[i].item<float>() / 8) << i;
}

TEST(RefRopeInit, Llama3SmoothsTheMediumBand) {
  // theta 1e4, dim 16: wavelengths 2*pi*10^(i/2) = 6.3, 19.9, 62.8, 199, ...
  // original context 64, low/high freq factors 1/4: wavelen < 16 kept,
  // wavelen > 64 divided by 4, in between smoothed with
  // s = (64 / wavelen - 1) / (4 - 1): (1 - s) * f / 4 + s * f.
  ModelConfig c = rope_config(16, 10000.0, 256);
  c.rope_scaling.type = RopeScaling::Type::Llama3;
  c.rope_scaling.factor = 4.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 64;
  std::vector<double> hand = plain_freqs(10000.0, 16);
  int kept = 0, divided = 0, smoothed = 0;
  for (double& f : hand) {
    const double wavelen = 2 * M_PI / f;
    if (wavelen < 16) {
      ++kept;
    } else if (wavelen > 64) {
      f /= 4;
      ++divided;
    } else {
      const double s = (64 / wavelen - 1) / 3;
      f = (1 - s) * f / 4 + s * f;
      ++smoothed;
    }
  }
  EXPECT_EQ(kept, 1);
  EXPECT_EQ(smoothed, 2);
  EXPECT_EQ(divided, 5);
  expect_close(values(ops::rope_init(c, 0).inv_freq), hand, 1e-6, "llama3 f32");
  expect_close(values(ops::rope_init(c, 0, torch::kDouble).inv_freq), hand, 1e-13, "llama3 f64");
}

// YaRN with a ramp: inv = interp * ramp + extrap * (1 - ramp), where
// extrap = f, interp = f / factor and ramp_i = clamp((i - low) / (high - low), 0, 1).
std::vector<double> yarn_hand(double theta, int64_t dim, double factor, double low, double high) {
  std::vector<double> f = plain_freqs(theta, dim);
  if (low == high) high += 0.001;
  for (size_t i = 0; i < f.size(); ++i) {
    const double ramp = std::min(1.0, std::max(0.0, (double(i) - low) / (high - low)));
    f[i] = (f[i] / factor) * ramp + f[i] * (1 - ramp);
  }
  return f;
}

TEST(RefRopeInit, YarnRampAndAttentionFactor) {
  // dim 16, theta 1e4, 128 positions, factor 4, beta 32/1:
  // find_correction_dim(r) = 16 ln(128 / (2 pi r)) / (2 ln 1e4)
  //   r = 32: -0.392 -> floor -1 -> low 0;  r = 1: 2.618 -> ceil 3 -> high 3.
  ModelConfig c = rope_config(16, 10000.0, 128);
  c.rope_scaling.type = RopeScaling::Type::Yarn;
  c.rope_scaling.factor = 4.0;
  ops::RopeInit r = ops::rope_init(c, 0);
  expect_close(values(r.inv_freq), yarn_hand(10000.0, 16, 4.0, 0, 3), 1e-6, "yarn");
  expect_close(values(ops::rope_init(c, 0, torch::kDouble).inv_freq), yarn_hand(10000.0, 16, 4.0, 0, 3), 1e-13,
               "yarn f64");
  EXPECT_DOUBLE_EQ(r.attention_scaling, 0.1 * std::log(4.0) + 1.0);  // get_mscale(4)

  // mscale and mscale_all_dim: get_mscale(4, 1) / get_mscale(4, 0.5)
  c.rope_scaling.mscale = 1.0;
  c.rope_scaling.mscale_all_dim = 0.5;
  EXPECT_DOUBLE_EQ(ops::rope_init(c, 0).attention_scaling,
                   (0.1 * std::log(4.0) + 1.0) / (0.05 * std::log(4.0) + 1.0));
  // An explicit attention_factor wins.
  c.rope_scaling.has_attention_factor = true;
  c.rope_scaling.attention_factor = 0.7;
  EXPECT_DOUBLE_EQ(ops::rope_init(c, 0).attention_scaling, 0.7);
}

TEST(RefRopeInit, YarnOriginalMaxPositionsSetTheFactor) {
  // original_max_position_embeddings 32 with 128 positions: factor becomes
  // 128 / 32 = 4 whatever rope_scaling.factor says; the correction range uses 32:
  //   r = 32: -1.596 -> low 0;  r = 1: 1.414 -> high 2.
  ModelConfig c = rope_config(16, 10000.0, 128);
  c.rope_scaling.type = RopeScaling::Type::Yarn;
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.original_max_position_embeddings = 32;
  ops::RopeInit r = ops::rope_init(c, 0);
  expect_close(values(r.inv_freq), yarn_hand(10000.0, 16, 4.0, 0, 2), 1e-6, "yarn original");
  EXPECT_DOUBLE_EQ(r.attention_scaling, 0.1 * std::log(4.0) + 1.0);
}

TEST(RefRopeInit, YarnEqualBoundsUseTheSingularityGuard) {
  // beta_fast 1.2, beta_slow 3.5 (dim 16, theta 1e4, 128 positions):
  // find_correction_dim = 2.46 and 1.53 -> low = floor(2.46) = 2 = ceil(1.53) = high,
  // so high becomes 2.001 and the ramp is a step between i = 2 and i = 3.
  ModelConfig c = rope_config(16, 10000.0, 128);
  c.rope_scaling.type = RopeScaling::Type::Yarn;
  c.rope_scaling.factor = 2.0;
  c.rope_scaling.beta_fast = 1.2;
  c.rope_scaling.beta_slow = 3.5;
  expect_close(values(ops::rope_init(c, 0).inv_freq), yarn_hand(10000.0, 16, 2.0, 2, 2), 1e-6, "yarn step");
  std::vector<double> f = values(ops::rope_init(c, 0, torch::kDouble).inv_freq);
  std::vector<double> plain = plain_freqs(10000.0, 16);
  EXPECT_NEAR(f[2], plain[2], 1e-15);
  EXPECT_NEAR(f[3], plain[3] / 2, 1e-15);
}

TEST(RefRope, CosSinTablesFoldTheAttentionScaling) {
  ModelConfig c = rope_config(16, 10000.0, 128);
  c.rope_scaling.type = RopeScaling::Type::Yarn;
  c.rope_scaling.factor = 4.0;
  ops::RopeInit r = ops::rope_init(c, 0);
  torch::Tensor pos = torch::arange(3, 8, torch::kInt64);
  auto [cos, sin] = ops::rope_cos_sin(r, pos, torch::kFloat);
  ASSERT_EQ(cos.sizes(), (std::vector<int64_t>{5, 16}));
  std::vector<double> inv = values(r.inv_freq), cv = values(cos), sv = values(sin);
  for (int t = 0; t < 5; ++t)
    for (int j = 0; j < 16; ++j) {
      const double angle = double(3 + t) * inv[size_t(j % 8)];
      EXPECT_NEAR(cv[size_t(t * 16 + j)], std::cos(angle) * r.attention_scaling, 1e-6);
      EXPECT_NEAR(sv[size_t(t * 16 + j)], std::sin(angle) * r.attention_scaling, 1e-6);
    }
  auto [cos_bf, sin_bf] = ops::rope_cos_sin(r, pos, torch::kBFloat16);
  EXPECT_EQ(cos_bf.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(cos_bf, cos.to(torch::kBFloat16)));
}

TEST(RefMask, LlamaConstruction) {
  const int64_t T = 3, P = 2, S = 5;
  torch::Tensor m = ops::causal_mask(T, P, 0, torch::kFloat);
  ASSERT_EQ(m.sizes(), (std::vector<int64_t>{T, S}));
  std::vector<double> v = values(m);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < S; ++s) {
      const double x = v[size_t(t * S + s)];
      if (s <= P + t) {
        // triu(diagonal=1) zeroes s <= t (+0); the cached keys t < s <= P+t
        // become finfo.min * False = -0.
        EXPECT_EQ(x, 0.0);
        EXPECT_EQ(std::signbit(x), s > t) << t << "," << s;
      } else {
        EXPECT_EQ(x, double(std::numeric_limits<float>::lowest()));
      }
    }
  EXPECT_TRUE(torch::equal(ops::mask_allowed(m), torch::ones({T, S}).tril(P)));
  // A single new token (no triu): allowed entries are min * 0 = -0.
  std::vector<double> d = values(ops::causal_mask(1, 4, 0, torch::kBFloat16));
  ASSERT_EQ(d.size(), 5u);
  for (double x : d) EXPECT_TRUE(x == 0.0 && std::signbit(x));
}

TEST(RefMask, SlidingWindowConstruction) {
  // window 2: key s is masked once pos - s >= 2.
  const int64_t T = 4, P = 1, S = 5;
  torch::Tensor m = ops::causal_mask(T, P, 2, torch::kBFloat16);
  std::vector<double> v = values(m);
  const double bf16_min = -3.3895313892515355e38;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t pos = P + t;
      const bool allowed = s <= pos && pos - s < 2;
      EXPECT_EQ(v[size_t(t * S + s)], allowed ? 0.0 : bf16_min) << t << "," << s;
    }
  // Families pick their construction: llama has no window; mistral and qwen
  // apply theirs.
  ModelConfig c = rope_config(8, 10000.0, 64);
  c.sliding_window = 2;
  EXPECT_TRUE(torch::equal(ops::mask_allowed(ops::causal_mask(c, T, P, torch::kFloat)),
                           torch::ones({T, S}).tril(P)));
  c.model_type = "mistral";
  EXPECT_TRUE(torch::equal(ops::mask_allowed(ops::causal_mask(c, T, P, torch::kFloat)), ops::mask_allowed(m)));
  c.model_type = "qwen2";
  c.family = Family::Qwen2;
  EXPECT_TRUE(torch::equal(ops::mask_allowed(ops::causal_mask(c, T, P, torch::kFloat)), ops::mask_allowed(m)));
  c.sliding_window = 0;
  EXPECT_TRUE(torch::equal(ops::mask_allowed(ops::causal_mask(c, T, P, torch::kFloat)),
                           torch::ones({T, S}).tril(P)));
}

TEST(RefOps, RmsNormRoundsBeforeAndAfterTheWeight) {
  torch::manual_seed(7);
  torch::Tensor x = (torch::randn({3, 64}) * 3).to(torch::kBFloat16);
  torch::Tensor w = (1 + 0.2 * torch::randn({64})).to(torch::kBFloat16);
  std::vector<double> y = values(ops::rms_norm(x, w, 1e-6));
  std::vector<double> xv = values(x), wv = values(w);
  for (int r = 0; r < 3; ++r) {
    double ss = 0;
    for (int j = 0; j < 64; ++j) ss += xv[size_t(r * 64 + j)] * xv[size_t(r * 64 + j)];
    const double inv_rms = 1.0 / std::sqrt(ss / 64 + 1e-6);
    for (int j = 0; j < 64; ++j) {
      // h = round(x * rsqrt(var + eps)) in bf16, y = round(w * h)
      const float h = bf16_to_f32(f32_to_bf16(float(xv[size_t(r * 64 + j)] * inv_rms)));
      const float want = bf16_to_f32(f32_to_bf16(float(wv[size_t(j)]) * h));
      EXPECT_EQ(float(y[size_t(r * 64 + j)]), want) << r << "," << j;
    }
  }
  // float32: within float32 rounding of the exact value
  torch::Tensor xf = torch::randn({2, 32});
  torch::Tensor wf = torch::randn({32});
  torch::Tensor exact = wf.to(torch::kDouble) * xf.to(torch::kDouble) *
                        torch::rsqrt(xf.to(torch::kDouble).pow(2).mean(-1, true) + 1e-5);
  EXPECT_TRUE(torch::allclose(ops::rms_norm(xf, wf, 1e-5).to(torch::kDouble), exact, 1e-6, 1e-6));
}

TEST(RefOps, RotateHalfRope) {
  torch::manual_seed(3);
  const int64_t H = 2, T = 3, Dh = 8;
  torch::Tensor x = torch::randn({H, T, Dh}, torch::kDouble);
  torch::Tensor angle = torch::rand({T, Dh / 2}, torch::kDouble) * 6;
  torch::Tensor cos = torch::cat({angle.cos(), angle.cos()}, -1), sin = torch::cat({angle.sin(), angle.sin()}, -1);
  torch::Tensor y = ops::apply_rope(x, cos, sin);
  auto X = x.accessor<double, 3>();
  auto Y = y.accessor<double, 3>();
  auto A = angle.accessor<double, 2>();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < Dh / 2; ++i) {
        const double c = std::cos(A[t][i]), s = std::sin(A[t][i]);
        EXPECT_NEAR(Y[h][t][i], X[h][t][i] * c - X[h][t][i + Dh / 2] * s, 1e-12);
        EXPECT_NEAR(Y[h][t][i + Dh / 2], X[h][t][i + Dh / 2] * c + X[h][t][i] * s, 1e-12);
      }
  EXPECT_TRUE(torch::equal(ops::rotate_half(torch::arange(4)), torch::tensor({-2, -3, 0, 1}).to(torch::kLong)));
}

TEST(RefOps, RepeatKvMapsQueryHeadsToKvHeads) {
  torch::Tensor kv = torch::arange(2 * 3 * 4).reshape({2, 3, 4}).to(torch::kFloat);
  torch::Tensor rep = ops::repeat_kv(kv, 3);
  ASSERT_EQ(rep.sizes(), (std::vector<int64_t>{6, 3, 4}));
  for (int64_t h = 0; h < 6; ++h) EXPECT_TRUE(torch::equal(rep[h], kv[h / 3])) << h;
  EXPECT_TRUE(ops::repeat_kv(kv, 1).is_same(kv));
}

TEST(RefOps, AttentionPieces) {
  torch::manual_seed(5);
  const int64_t Hq = 2, T = 3, P = 2, S = 5, Dh = 4;
  torch::Tensor q = torch::randn({Hq, T, Dh}, torch::kDouble);
  torch::Tensor k = torch::randn({Hq, S, Dh}, torch::kDouble);
  torch::Tensor v = torch::randn({Hq, S, Dh}, torch::kDouble);
  torch::Tensor scores = ops::attn_scores(q, k, 0.5);
  auto Q = q.accessor<double, 3>();
  auto K = k.accessor<double, 3>();
  auto Sc = scores.accessor<double, 3>();
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t s = 0; s < S; ++s) {
        double dot = 0;
        for (int64_t d = 0; d < Dh; ++d) dot += Q[h][t][d] * K[h][s][d];
        EXPECT_NEAR(Sc[h][t][s], dot * 0.5, 1e-12);
      }
  torch::Tensor probs = ops::attn_probs(scores, ops::causal_mask(T, P, 0, torch::kDouble));
  EXPECT_EQ(probs.scalar_type(), torch::kDouble);
  auto Pr = probs.accessor<double, 3>();
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t t = 0; t < T; ++t) {
      double sum = 0, denom = 0;
      for (int64_t s = 0; s <= P + t; ++s) denom += std::exp(Sc[h][t][s]);
      for (int64_t s = 0; s < S; ++s) {
        sum += Pr[h][t][s];
        if (s > P + t) {
          EXPECT_EQ(Pr[h][t][s], 0.0);
        } else {
          EXPECT_NEAR(Pr[h][t][s], std::exp(Sc[h][t][s]) / denom, 1e-12);
        }
      }
      EXPECT_NEAR(sum, 1.0, 1e-12);
    }
  torch::Tensor ctx = ops::attn_ctx(probs, v);  // [T, Hq*Dh]
  ASSERT_EQ(ctx.sizes(), (std::vector<int64_t>{T, Hq * Dh}));
  auto V = v.accessor<double, 3>();
  auto C = ctx.accessor<double, 2>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t d = 0; d < Dh; ++d) {
        double acc = 0;
        for (int64_t s = 0; s < S; ++s) acc += Pr[h][t][s] * V[h][s][d];
        EXPECT_NEAR(C[t][h * Dh + d], acc, 1e-12);
      }
  // bfloat16 scores give bfloat16 probabilities (softmax computed in float32)
  torch::Tensor pb = ops::attn_probs(scores.to(torch::kBFloat16), ops::causal_mask(T, P, 0, torch::kBFloat16));
  EXPECT_EQ(pb.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::allclose(pb.to(torch::kDouble), probs, 0, 1e-2));
}

TEST(RefOps, LinearSwigluAndFloat16) {
  torch::manual_seed(9);
  torch::Tensor x = torch::randn({3, 8}, torch::kDouble);
  torch::Tensor w = torch::randn({5, 8}, torch::kDouble);
  torch::Tensor b = torch::randn({5}, torch::kDouble);
  torch::Tensor y = ops::linear(x, w, b);
  EXPECT_TRUE(torch::allclose(y, torch::matmul(x, w.t()) + b, 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(ops::linear(x, w, {}), torch::matmul(x, w.t()), 1e-12, 1e-12));
  // float16 (no CPU kernels in torch 1.13): float32 accumulation, one rounding
  torch::Tensor yh = ops::linear(x.to(torch::kHalf), w.to(torch::kHalf), b.to(torch::kHalf));
  EXPECT_EQ(yh.scalar_type(), torch::kHalf);
  EXPECT_TRUE(torch::allclose(yh.to(torch::kDouble), y, 1e-2, 1e-2));
  torch::Tensor g = torch::randn({4, 6}, torch::kDouble), u = torch::randn({4, 6}, torch::kDouble);
  EXPECT_TRUE(torch::allclose(ops::swiglu(g, u), g / (1 + torch::exp(-g)) * u, 1e-12, 1e-12));
  torch::Tensor ah = ops::swiglu(g.to(torch::kHalf), u.to(torch::kHalf));
  EXPECT_EQ(ah.scalar_type(), torch::kHalf);
  EXPECT_TRUE(torch::allclose(ah.to(torch::kDouble), g / (1 + torch::exp(-g)) * u, 1e-2, 1e-2));
  torch::Tensor sh = ops::attn_scores(g.to(torch::kHalf).reshape({2, 2, 6}), u.to(torch::kHalf).reshape({2, 2, 6}), 0.5);
  EXPECT_EQ(sh.scalar_type(), torch::kHalf);
}

TEST(RefErrors, UnsupportedConfigsAndInputsAreTypedErrors) {
  Model model = Model::load(testing::golden_model("llama-gqa"));
  ref::RefOptions opt;
  {
    Model bad = model;
    bad.config.num_key_value_heads = 3;  // 4 query heads
    EXPECT_THROW(ref::make_ref_engine(bad, opt), ConfigError);
  }
  {
    Model bad = model;
    bad.config.rope_scaling.type = RopeScaling::Type::Llama3;  // lacks original_max_position_embeddings
    EXPECT_THROW(ref::make_ref_engine(bad, opt), ConfigError);
  }
  {
    Model bad = model;
    bad.config.qkv_bias = true;  // the checkpoint has no biases
    EXPECT_THROW(ref::make_ref_engine(bad, opt), ConfigError);
  }
  {
    Model bad = model;
    bad.config.intermediate_size += 1;  // not the shapes the weights were checked against
    EXPECT_THROW(ref::make_ref_engine(bad, opt), ConfigError);
  }
  opt.threads = -1;
  EXPECT_THROW(ref::make_ref_engine(model, opt), UsageError);
  opt.threads = 1;
  auto engine = ref::make_ref_engine(model, opt);
  NullObserver none;
  EXPECT_THROW(engine->forward({}, 0, none), UsageError);
  EXPECT_THROW(engine->forward({1, model.config.vocab_size}, 0, none), UsageError);
  EXPECT_THROW(engine->forward({-1}, 0, none), UsageError);
  EXPECT_EQ(engine->forward({1, 2, 3}, 0, none).size(), size_t(model.config.vocab_size));
  ModelConfig odd = rope_config(6, 10000.0, 64);
  odd.head_dim = 7;
  EXPECT_THROW(ops::rope_init(odd, 0), ConfigError);
  EXPECT_THROW(ops::rope_init(rope_config(8, 1e4, 8), 0, torch::kBFloat16), UsageError);
}

}  // namespace
}  // namespace llmdiff
