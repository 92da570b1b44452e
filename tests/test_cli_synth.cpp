// llmdiff synth: presets carry the published configs, checkpoints load with
// the right shapes, the generator is deterministic and realistic, sharding
// round-trips, and a synthetic model gives peaked attention and spread logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "synth/synth.h"
#include "dumps/contract/dump.h"
#include "dumps/base/errors.h"
#include "dumps/model/weights.h"
#include "impl/impl_engine.h"
#include "tests/cli_runner.h"
#include "tests/support.h"

namespace fs = std::filesystem;
using namespace llmdiff;
using namespace llmdiff::cli;
using namespace llmdiff::synth;
using llmdiff::testing::read_text;

namespace {

// A checkpoint directory of one test, removed when the test ends.
struct ScratchDir {
  explicit ScratchDir(const std::string& stem) : path(llmdiff::testing::temp_path(stem)) {}
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  operator const std::string&() const { return path; }
  std::string operator+(const char* tail) const { return path + tail; }
  std::string path;
};

SynthResult write_model(const std::string& dir, const std::string& preset, DType dtype, uint64_t seed,
                  uint64_t shard_size = 2000000000ULL, int threads = 0) {
  SynthOptions o;
  o.config_json = synth_preset_config(preset);
  o.config_source = preset;
  o.dtype = dtype;
  o.seed = seed;
  o.shard_size = shard_size;
  o.threads = threads;
  return write_synth_checkpoint(dir, o);
}

uint64_t plan_params(const ModelConfig& c) {
  uint64_t n = 0;
  for (const auto& t : synth_tensor_plan(c)) n += uint64_t(numel(t.shape));
  return n;
}

std::vector<float> weight_f32(const WeightView& w) {
  std::vector<float> out(size_t(w.numel()));
  convert_to_f32(w.data, w.dtype, out.size(), out.data());
  return out;
}

void mean_std(const std::vector<float>& v, double& mean, double& std) {
  double s = 0, s2 = 0;
  for (float x : v) {
    s += x;
    s2 += double(x) * x;
  }
  mean = s / double(v.size());
  std = std::sqrt(std::max(0.0, s2 / double(v.size()) - mean * mean));
}

// Runs `llmdiff synth ARGS` through the command line's own option parsing;
// the command's exceptions propagate.
int run_synth_command(std::vector<std::string> args) {
  args.insert(args.begin(), "synth");
  return llmdiff::testing::CliCommand(args).run();
}

}  // namespace

TEST(CliSynth, PresetsCarryThePublishedConfigs) {
  // Parameter counts published for these checkpoints pin every dimension.
  const ModelConfig tl = parse_config(synth_preset_config("tinyllama-1.1b"), "tinyllama");
  EXPECT_EQ(plan_params(tl), 1100048384u);
  EXPECT_FALSE(tl.tie_word_embeddings);
  EXPECT_EQ(tl.num_key_value_heads, 4);
  EXPECT_EQ(tl.vocab_size, 32000);
  EXPECT_DOUBLE_EQ(tl.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(tl.rms_norm_eps, 1e-5);
  EXPECT_EQ(tl.max_position_embeddings, 2048);
  EXPECT_EQ(tl.torch_dtype, "bfloat16");

  const ModelConfig l3 = parse_config(synth_preset_config("llama-3.2-1b"), "llama-3.2-1b");
  EXPECT_EQ(plan_params(l3), 1235814400u);
  EXPECT_TRUE(l3.tie_word_embeddings);
  EXPECT_EQ(l3.rope_scaling.type, RopeScaling::Type::Llama3);
  EXPECT_DOUBLE_EQ(l3.rope_scaling.factor, 32.0);
  EXPECT_DOUBLE_EQ(l3.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(l3.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(l3.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(l3.rope_theta, 500000.0);
  EXPECT_EQ(l3.max_position_embeddings, 131072);

  const ModelConfig q3 = parse_config(synth_preset_config("qwen3-0.6b"), "qwen3-0.6b");
  EXPECT_EQ(plan_params(q3), 596049920u);
  EXPECT_EQ(q3.family, Family::Qwen3);
  EXPECT_TRUE(q3.qk_norm);
  EXPECT_EQ(q3.head_dim, 128);
  EXPECT_TRUE(q3.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(q3.rms_norm_eps, 1e-6);

  const ModelConfig q2 = parse_config(synth_preset_config("qwen2.5-1.5b"), "qwen2.5-1.5b");
  EXPECT_EQ(plan_params(q2), 1543714304u);
  EXPECT_EQ(q2.family, Family::Qwen2);
  EXPECT_TRUE(q2.qkv_bias);
  EXPECT_TRUE(q2.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(q2.rope_theta, 1000000.0);

  for (const auto& p : synth_presets()) EXPECT_NO_THROW(parse_config(synth_preset_config(p.name), p.name)) << p.name;
  EXPECT_THROW(synth_preset_config("gpt-2"), UsageError);
}

TEST(CliSynth, GeneratorIsStandardNormalAndThreadIndependent) {
  SynthTensor t{"x", {1 << 20}, 0.0, 1.0};
  std::vector<float> a(size_t(1) << 20), b(a.size());
  synth_fill(42, t, DType::F32, a.data(), 1);
  synth_fill(42, t, DType::F32, b.data(), 3);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
  double mean, std;
  mean_std(a, mean, std);
  EXPECT_NEAR(mean, 0.0, 0.005);
  EXPECT_NEAR(std, 1.0, 0.005);
  size_t beyond3 = 0;
  for (float x : a) beyond3 += std::fabs(x) > 3.0f;
  EXPECT_NEAR(double(beyond3) / double(a.size()), 0.0027, 0.0005);  // Gaussian tails, not uniform noise

  // BF16 output is the F32 output rounded; another name is another stream.
  std::vector<uint16_t> h(a.size());
  synth_fill(42, t, DType::BF16, h.data(), 2);
  for (size_t i = 0; i < a.size(); i += 4099) EXPECT_EQ(h[i], f32_to_bf16(a[i]));
  SynthTensor u{"y", {1 << 20}, 0.0, 1.0};
  synth_fill(42, u, DType::F32, b.data(), 2);
  EXPECT_NE(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
}

TEST(CliSynth, CheckpointLoadsWithTheConfigShapes) {
  const ScratchDir dir("synth_tiny_llama");
  const SynthResult r = write_model(dir, "tiny-llama", DType::BF16, 3);
  EXPECT_EQ(r.files, std::vector<std::string>{"model.safetensors"});
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors.index.json"));
  const Model m = Model::load(dir);
  const ModelConfig& c = m.config;
  EXPECT_EQ(c.hidden_size, 512);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  const ModelWeights& w = *m.weights;
  EXPECT_EQ(w.storage_dtype(), DType::BF16);
  EXPECT_EQ(w.embed.shape, (Shape{4096, 512}));
  EXPECT_FALSE(w.lm_head_tied);
  EXPECT_EQ(w.lm_head.shape, (Shape{4096, 512}));
  ASSERT_EQ(w.layers.size(), 4u);
  EXPECT_EQ(w.layers[2].q.shape, (Shape{512, 512}));
  EXPECT_EQ(w.layers[2].k.shape, (Shape{128, 512}));
  EXPECT_EQ(w.layers[2].mlp.down.shape, (Shape{512, 1536}));
  EXPECT_EQ(w.total_bytes(), r.data_bytes);

  // The documented scales.
  double mean, std;
  mean_std(weight_f32(w.layers[1].q), mean, std);
  EXPECT_NEAR(std, 1.5 / std::sqrt(512.0), 0.002);
  mean_std(weight_f32(w.layers[1].mlp.down), mean, std);
  EXPECT_NEAR(std, 1.5 / std::sqrt(1536.0), 0.002);
  mean_std(weight_f32(w.layers[0].input_norm), mean, std);
  EXPECT_NEAR(mean, 1.0, 0.02);
  EXPECT_NEAR(std, 0.1, 0.02);
  mean_std(weight_f32(w.embed), mean, std);
  EXPECT_NEAR(std, 3.0 / std::sqrt(512.0), 0.002);
}

TEST(CliSynth, SameSeedSameBytesOtherSeedOtherWeights) {
  const ScratchDir a("synth_seed_a"), b("synth_seed_b"), c("synth_seed_c");
  write_model(a, "tiny-qwen3", DType::BF16, 7, 2000000000ULL, 1);
  write_model(b, "tiny-qwen3", DType::BF16, 7, 2000000000ULL, 2);
  write_model(c, "tiny-qwen3", DType::BF16, 8);
  EXPECT_EQ(read_text(a + "/model.safetensors"), read_text(b + "/model.safetensors"));
  EXPECT_EQ(read_text(a + "/config.json"), read_text(b + "/config.json"));
  EXPECT_EQ(read_text(a + "/config.json"), read_text(c + "/config.json"));
  const Model ma = Model::load(a), mc = Model::load(c);
  for (const std::string name : {"model.embed_tokens.weight", "model.layers.3.self_attn.k_norm.weight",
                                 "model.layers.0.mlp.up_proj.weight", "model.norm.weight"}) {
    const WeightView x = ma.weights->find(name), y = mc.weights->find(name);
    ASSERT_TRUE(x && y) << name;
    EXPECT_NE(std::memcmp(x.data, y.data, size_t(x.numel()) * 2), 0) << name;
  }
}

TEST(CliSynth, ShardedCheckpointLoadsThroughTheIndex) {
  const ScratchDir one("synth_one"), many("synth_many");
  write_model(one, "tiny-qwen2", DType::F32, 5);
  const SynthResult r = write_model(many, "tiny-qwen2", DType::F32, 5, 7000000);
  ASSERT_GT(r.files.size(), 2u);
  EXPECT_FALSE(fs::exists(many + "/model.safetensors"));
  const auto index = nlohmann::json::parse(read_text(many + "/model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), r.data_bytes);
  EXPECT_EQ(index["weight_map"].size(), r.tensors);
  for (const auto& f : r.files) {
    EXPECT_LE(fs::file_size(many + "/" + f), 7000000u + 65536u) << f;  // data within the limit + header
  }

  const Model a = Model::load(one), b = Model::load(many);
  EXPECT_TRUE(b.config.qkv_bias);
  ASSERT_TRUE(b.weights->layers[1].k_bias);
  for (const auto& t : synth_tensor_plan(a.config)) {
    const WeightView x = a.weights->find(t.name), y = b.weights->find(t.name);
    ASSERT_TRUE(x && y) << t.name;
    EXPECT_NE(x.file, y.file);
    EXPECT_EQ(std::memcmp(x.data, y.data, size_t(x.numel()) * 4), 0) << t.name;
  }

  // Writing a single-file checkpoint over the sharded one removes the shards.
  write_model(many, "tiny-qwen2", DType::F32, 5);
  for (const auto& f : r.files) EXPECT_FALSE(fs::exists(many + "/" + f)) << f;
  EXPECT_FALSE(fs::exists(many + "/model.safetensors.index.json"));
  EXPECT_EQ(read_text(many + "/model.safetensors"), read_text(one + "/model.safetensors"));
  for (const auto& e : fs::directory_iterator(many.path))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
}

TEST(CliSynth, LayersOptionKeepsTheShapesWithFewerLayers) {
  // Llama-3.1-70B as published: 70,553,706,496 parameters.
  const ModelConfig l70 = parse_config(synth_preset_config("llama-3.1-70b"), "llama-3.1-70b");
  EXPECT_EQ(plan_params(l70), 70553706496u);
  const ScratchDir dir("synth_layers");
  EXPECT_EQ(run_synth_command({"--preset", "tiny-llama", "--layers", "1", "--out", dir}), 0);
  const Model m = Model::load(dir);
  const ModelConfig full = parse_config(synth_preset_config("tiny-llama"), "tiny-llama");
  EXPECT_EQ(m.config.num_hidden_layers, 1);
  EXPECT_EQ(m.weights->layers.size(), 1u);
  EXPECT_EQ(m.config.hidden_size, full.hidden_size);
  EXPECT_EQ(m.config.intermediate_size, full.intermediate_size);
  EXPECT_EQ(m.config.vocab_size, full.vocab_size);
  EXPECT_ANY_THROW(run_synth_command({"--preset", "tiny-llama", "--layers", "0", "--out", dir}));
}

TEST(CliSynth, CommandTakesAUserConfig) {
  // The golden llama3 config (rope scaling, tied, MQA) as --config, stored as f16.
  const ScratchDir dir("synth_cmd");
  const std::string cfg = llmdiff::testing::golden_model("llama3-mqa-scaled") + "/config.json";
  EXPECT_EQ(run_synth_command({"--config", cfg, "--dtype", "f16", "--seed", "11", "--out", dir,
                               "--shard-size", "64KiB"}),
            0);
  const Model m = Model::load(dir);
  const ModelConfig golden = load_config(cfg);
  EXPECT_EQ(m.config.torch_dtype, "float16");
  EXPECT_EQ(m.config.rope_scaling.type, RopeScaling::Type::Llama3);
  EXPECT_EQ(m.config.vocab_size, golden.vocab_size);
  EXPECT_EQ(m.config.num_key_value_heads, 1);
  EXPECT_TRUE(m.weights->lm_head_tied);
  EXPECT_EQ(m.weights->storage_dtype(), DType::F16);
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors.index.json"));

  EXPECT_THROW(run_synth_command({"--preset", "tiny-llama", "--config", cfg, "--out", dir}), UsageError);
  EXPECT_THROW(run_synth_command({"--preset", "tiny-llama", "--dtype", "int8", "--out", dir}), UsageError);
  EXPECT_THROW(run_synth_command({"--preset", "tiny-llama", "--shard-size", "lots", "--out", dir}), UsageError);
}

TEST(CliSynth, LeavesARealCheckpointAloneUnlessForced) {
  const ScratchDir dir("synth_over_real");
  fs::create_directories(dir.path);
  const std::string golden = llmdiff::testing::golden_model("llama-gqa");
  for (const char* f : {"/config.json", "/model.safetensors"}) fs::copy_file(golden + f, dir + f);
  const std::string before = read_text(dir + "/model.safetensors");
  EXPECT_THROW(write_model(dir, "tiny-llama3", DType::F32, 1), UsageError);
  EXPECT_EQ(read_text(dir + "/model.safetensors"), before);
  EXPECT_EQ(read_text(dir + "/config.json"), read_text(golden + "/config.json"));

  SynthOptions o;
  o.config_json = synth_preset_config("tiny-llama3");
  o.dtype = DType::F32;
  o.force = true;
  write_synth_checkpoint(dir, o);
  EXPECT_EQ(Model::load(dir).config.hidden_size, 256);
  // A synthetic checkpoint is replaced without --force.
  EXPECT_NO_THROW(write_model(dir, "tiny-llama3", DType::BF16, 2));
  EXPECT_EQ(Model::load(dir).weights->storage_dtype(), DType::BF16);
}

TEST(CliSynth, ByteSizes) {
  EXPECT_EQ(parse_byte_size("2GB"), 2000000000u);
  EXPECT_EQ(parse_byte_size("500MB"), 500000000u);
  EXPECT_EQ(parse_byte_size("64KiB"), 65536u);
  EXPECT_EQ(parse_byte_size("1.5GiB"), 1610612736u);
  EXPECT_EQ(parse_byte_size("123"), 123u);
  EXPECT_THROW(parse_byte_size("12XB"), UsageError);
  EXPECT_THROW(parse_byte_size("-1"), UsageError);
  EXPECT_THROW(parse_byte_size("0"), UsageError);
}

// A synthetic model behaves like a trained one where llmdiff looks: attention
// concentrates (far from uniform) and logits are spread (std >= 1).
class CliSynthActivations : public ::testing::TestWithParam<const char*> {};

TEST_P(CliSynthActivations, AttentionPeakedLogitsSpread) {
  const ScratchDir dir(std::string("synth_act_") + GetParam());
  write_model(dir, GetParam(), DType::F32, 1);
  const Model m = Model::load(dir);
  impl::ImplOptions io;
  io.max_seq = 64;
  auto engine = impl::make_impl_engine(m, io);
  MemoryDump dump;
  dump.set_filter({"*attn.probs", "*next_logits"});
  std::vector<int64_t> tokens;
  for (int i = 0; i < 48; ++i) tokens.push_back((i * 733 + 17) % m.config.vocab_size);
  engine->forward(tokens, 0, dump);

  for (int64_t l = 0; l < m.config.num_hidden_layers; ++l) {
    const TensorData p = dump.get(layer_name(0, int(l), "attn.probs"));  // [Hq, T, S]
    const int64_t H = p.shape[0], T = p.shape[1], S = p.shape[2];
    // Mean over heads and the later rows of (max prob) / (uniform prob).
    double ratio = 0;
    int64_t rows = 0;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 16; t < T; ++t) {
        const float* row = p.f.data() + (h * T + t) * S;
        ratio += double(*std::max_element(row, row + S)) * double(t + 1);
        ++rows;
      }
    ratio /= double(rows);
    EXPECT_GT(ratio, 4.0) << GetParam() << " layer " << l;
  }
  const TensorData logits = dump.get(step_name(0, "next_logits"));
  double mean, std;
  mean_std(logits.f, mean, std);
  EXPECT_GE(std, 1.0) << GetParam();
  EXPECT_LE(std, 30.0) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(Presets, CliSynthActivations,
                         ::testing::Values("tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3"));
