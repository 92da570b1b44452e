// The impl on configurations the golden set lacks, checked for internal
// consistency in float64: a Mistral-style model with a sliding window,
// attention biases on q/k/v/o, yarn RoPE and float16 weights.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>
#include <sys/stat.h>

#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/formats/safetensors.h"
#include "dumps/model/weights.h"
#include "impl/impl_engine.h"
#include "tests/support.h"

namespace llmdiff {
namespace {

constexpr int64_t D = 32, F = 48, L = 2, Hq = 4, Hkv = 2, Dh = 8, V = 50, kWindow = 3;

// Writes config.json + float16 model.safetensors of a random model; returns the directory.
std::string write_model() {
  const std::string dir = testing::temp_path("impl-synthetic-mistral");
  ::mkdir(dir.c_str(), 0700);
  std::ofstream(dir + "/config.json")
      << R"({"model_type": "mistral", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 50,
             "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
             "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
             "sliding_window": 3, "attention_bias": true, "tie_word_embeddings": false,
             "torch_dtype": "float16"})";
  SafetensorsWriter w(dir + "/model.safetensors");
  std::mt19937 gen(123);
  std::normal_distribution<float> nd;
  auto add = [&](const std::string& name, Shape shape, float scale, float mean) {
    std::vector<uint16_t> h(size_t(numel(shape)));
    for (uint16_t& x : h) x = f32_to_f16(mean + scale * nd(gen));
    w.add(name, DType::F16, shape, h.data(), h.size() * 2);
  };
  add("model.embed_tokens.weight", {V, D}, 1.0f, 0.0f);
  for (int l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {D}, 0.2f, 1.0f);
    add(p + "self_attn.q_proj.weight", {Hq * Dh, D}, 0.3f, 0.0f);
    add(p + "self_attn.q_proj.bias", {Hq * Dh}, 0.5f, 0.0f);
    add(p + "self_attn.k_proj.weight", {Hkv * Dh, D}, 0.3f, 0.0f);
    add(p + "self_attn.k_proj.bias", {Hkv * Dh}, 0.5f, 0.0f);
    add(p + "self_attn.v_proj.weight", {Hkv * Dh, D}, 0.3f, 0.0f);
    add(p + "self_attn.v_proj.bias", {Hkv * Dh}, 0.5f, 0.0f);
    add(p + "self_attn.o_proj.weight", {D, Hq * Dh}, 0.3f, 0.0f);
    add(p + "self_attn.o_proj.bias", {D}, 0.5f, 0.0f);
    add(p + "post_attention_layernorm.weight", {D}, 0.2f, 1.0f);
    add(p + "mlp.gate_proj.weight", {F, D}, 0.3f, 0.0f);
    add(p + "mlp.up_proj.weight", {F, D}, 0.3f, 0.0f);
    add(p + "mlp.down_proj.weight", {D, F}, 0.2f, 0.0f);
  }
  add("model.norm.weight", {D}, 0.2f, 1.0f);
  add("lm_head.weight", {V, D}, 0.3f, 0.0f);
  w.finish();
  return dir;
}

// y[T, rows] = x[T, K] · Wᵀ + b in float64 from the checkpoint's values.
std::vector<double> linear64(const std::vector<float>& x, int64_t T, const WeightView& W, const WeightView& b) {
  const int64_t rows = W.shape[0], K = W.shape[1];
  std::vector<float> w(size_t(W.numel())), bias(size_t(rows), 0.0f);
  convert_to_f32(W.data, W.dtype, w.size(), w.data());
  if (b) convert_to_f32(b.data, b.dtype, bias.size(), bias.data());
  std::vector<double> y(size_t(T * rows));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < rows; ++o) {
      double s = bias[size_t(o)];
      for (int64_t k = 0; k < K; ++k) s += double(x[size_t(t * K + k)]) * w[size_t(o * K + k)];
      y[size_t(t * rows + o)] = s;
    }
  return y;
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], tol * (1 + std::fabs(want[i]))) << what << " [" << i << "]";
}

TEST(ImplSynthetic, SlidingWindowBiasesYarnAndFloat16Weights) {
  const Model model = Model::load(write_model());
  ASSERT_TRUE(model.config.o_bias);
  ASSERT_EQ(model.config.sliding_window, kWindow);
  ASSERT_EQ(model.weights->storage_dtype(), DType::F16);
  auto engine = impl::make_impl_engine(model, {});
  MemoryDump d;
  const Scenario sc = make_scenario({3, 14, 15, 9, 26, 5, 35}, {4, 3}, 2);
  const std::vector<int64_t> generated = run_scenario(*engine, sc, d);
  ASSERT_EQ(generated.size(), 3u);

  // Sliding window: query t (position P+t) sees keys s with 0 <= P+t-s < 3.
  const TensorData mask = d.get("step1.mask");  // [3, 7]
  ASSERT_EQ(mask.shape, (Shape{3, 7}));
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t s = 0; s < 7; ++s) {
      const int64_t dist = 4 + t - s;
      EXPECT_EQ(mask.f[size_t(t * 7 + s)], dist >= 0 && dist < kWindow ? 1.0f : 0.0f) << t << "," << s;
    }
  // Masked keys get probability 0, rows sum to 1.
  const TensorData probs = d.get("step1.layers.1.attn.probs");  // [Hq, 3, 7]
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t t = 0; t < 3; ++t) {
      double sum = 0;
      for (int64_t s = 0; s < 7; ++s) {
        const float p = probs.f[size_t((h * 3 + t) * 7 + s)];
        if (mask.f[size_t(t * 7 + s)] == 0.0f) {
          EXPECT_EQ(p, 0.0f);
        }
        sum += p;
      }
      EXPECT_NEAR(sum, 1.0, 1e-6);
    }

  // Biased projections, o_proj included, from the dumped inputs.
  const LayerWeights& L1 = model.weights->layers[1];
  const std::vector<float> xn = d.get("step1.layers.1.attn_norm").f, ctx = d.get("step1.layers.1.attn.ctx").f;
  expect_close(d.get("step1.layers.1.attn.q").f, linear64(xn, 3, L1.q, L1.q_bias), 1e-5, "attn.q");
  expect_close(d.get("step1.layers.1.attn.v").f, linear64(xn, 3, L1.v, L1.v_bias), 1e-5, "attn.v");
  expect_close(d.get("step1.layers.1.attn.out").f, linear64(ctx, 3, L1.o, L1.o_bias), 1e-5, "attn.out");

  // Yarn: cos/sin carry the attention factor 0.1 ln(64/16) + 1.
  const float factor = float(0.1 * std::log(4.0) + 1.0);
  const TensorData cos0 = d.get("step0.rope.cos");
  for (int64_t i = 0; i < Dh; ++i) EXPECT_FLOAT_EQ(cos0.f[size_t(i)], factor);
  const TensorData cos1 = d.get("step1.rope.cos"), sin1 = d.get("step1.rope.sin");
  for (int64_t i = 0; i < Dh; ++i) {
    const float c = cos1.f[size_t(i)], s = sin1.f[size_t(i)];
    EXPECT_NEAR(c * c + s * s, factor * factor, 1e-5);
  }
  // Decoding continues the positions after the cache.
  EXPECT_EQ(d.get("step2.positions").i, std::vector<int64_t>{7});
  EXPECT_EQ(d.get("step3.positions").i, std::vector<int64_t>{8});
  EXPECT_EQ(d.shape("step3.layers.0.attn.k_cache"), (Shape{Hkv, 9, Dh}));
}

}  // namespace
}  // namespace llmdiff
