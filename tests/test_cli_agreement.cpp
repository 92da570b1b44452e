// The two engines of llmdiff agree with each other beyond the tiny golden
// models: a synthesised Llama (hidden 512, 4 layers, GQA 8/2, bf16 weights),
// every tensor of a greedy decode and of a chunked prefill.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "cli/common.h"
#include "synth/synth.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "tests/support.h"

using namespace llmdiff;
using namespace llmdiff::testing;

namespace {

struct Runs {
  MemoryDump ref{"ref"}, impl{"impl"};
};

void run_both(const Model& model, const Scenario& sc, Runs& out) {
  cli::EngineOptions ro;
  ro.dtype = "float32";  // the impl's compute dtype: weights widened from bf16 in both
  ro.threads = 1;
  auto ref = cli::make_engine("ref", model, ro);
  cli::EngineOptions io;
  io.threads = 2;
  auto impl = cli::make_engine("impl", model, io);
  run_scenario(*ref, sc, out.ref);
  run_scenario(*impl, sc, out.impl);
}

void expect_every_tensor_agrees(const Runs& r, const std::string& what) {
  const auto names = r.ref.names();
  ASSERT_EQ(names, r.impl.names()) << what;
  double worst = 0;
  std::string worst_name;
  for (const auto& name : names) {
    const TensorData a = r.impl.get(name), b = r.ref.get(name);
    ASSERT_EQ(a.shape, b.shape) << what << " " << name;
    if (a.is_int) {
      EXPECT_EQ(a.i, b.i) << what << " " << name;
      continue;
    }
    // Twice the golden models' bound: sums here run over 512..1408 terms
    // (the goldens' over 64..192), in a different order in each engine.
    const double bound = 2e-5 * std::max(1.0, max_abs(b));
    const double err = max_abs_diff(a, b);
    EXPECT_LE(err, bound) << what << " " << name;
    EXPECT_LE(nmse(a, b), 1e-10) << what << " " << name;
    if (err / bound > worst) worst = err / bound, worst_name = name;
  }
  std::printf("%s: worst tensor %s at %.2f of its bound\n", what.c_str(), worst_name.c_str(), worst);
}

}  // namespace

TEST(EngineAgreement, RefAndImplAgreeOnASynthesisedBf16Llama) {
  synth::SynthOptions so;
  so.config_json = synth::synth_preset_config("tiny-llama");
  so.dtype = DType::BF16;
  so.seed = 7;
  const std::string dir = temp_path("agreement-tiny-llama");
  synth::write_synth_checkpoint(dir, so);
  const Model model = Model::load(dir);
  ASSERT_EQ(model.config.hidden_size, 512);
  ASSERT_EQ(model.config.num_hidden_layers, 4);
  ASSERT_LT(model.config.num_key_value_heads, model.config.num_attention_heads);

  std::vector<int64_t> prompt;
  for (int i = 0; i < 16; ++i) prompt.push_back((i * 389 + 11) % model.config.vocab_size);

  Runs decode;
  run_both(model, make_scenario(prompt, {}, 4), decode);
  expect_every_tensor_agrees(decode, "decode");
  EXPECT_EQ(decode.ref.get("generated").i, decode.impl.get("generated").i);

  Runs chunked;
  run_both(model, make_scenario(prompt, {9, 7}, 0), chunked);
  expect_every_tensor_agrees(chunked, "chunked");
}
