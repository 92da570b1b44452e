// The impl against HuggingFace: every golden model and scenario replayed
// through the impl, every tensor compared with HF's; results independent of
// the thread count; KV capacity errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <map>

#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sites.h"
#include "dumps/model/weights.h"
#include "impl/impl_engine.h"
#include "tests/support.h"

namespace llmdiff {
namespace {

using testing::golden_dump;
using testing::golden_model;

const char* const kScenarios[] = {"prefill", "decode", "chunked"};

// Replays a golden dump through the impl into memory.
MemoryDump run_impl(const Model& model, const TensorSource& golden, int threads) {
  impl::ImplOptions opt;
  opt.threads = threads;
  auto engine = impl::make_impl_engine(model, opt);
  MemoryDump out("impl");
  run_scenario(*engine, replay_scenario(golden), out);
  return out;
}

struct Worst {
  double nmse = 0, rel_abs = 0, logits_nmse = 0;
  std::string nmse_at, abs_at;
};

TEST(ImplGolden, MatchesHuggingFaceOnEveryModelAndScenario) {
  const auto models = testing::golden_models();
  ASSERT_GE(models.size(), 5u);
  for (const std::string& name : models) {
    const Model model = Model::load(golden_model(name));
    const bool bf16 = model.config.torch_dtype == "bfloat16";
    Worst worst;
    for (const char* scenario : kScenarios) {
      SCOPED_TRACE(name + "/" + scenario);
      DumpFile hf(golden_dump(name, scenario));
      MemoryDump ours = run_impl(model, hf, 2);
      for (const std::string& n : hf.names()) {
        ASSERT_TRUE(ours.has(n)) << "impl does not produce " << n;
        const TensorData a = ours.get(n), b = hf.get(n);
        ASSERT_EQ(a.shape, b.shape) << n;
        if (b.is_int) {
          ASSERT_TRUE(a.is_int) << n;
          EXPECT_EQ(a.i, b.i) << n;
          continue;
        }
        const double nmse = testing::nmse(a, b);
        const double rel_abs = testing::max_abs_diff(a, b) / std::max(1.0, testing::max_abs(b));
        if (nmse > worst.nmse) worst.nmse = nmse, worst.nmse_at = std::string(scenario) + ":" + n;
        if (rel_abs > worst.rel_abs) worst.rel_abs = rel_abs, worst.abs_at = std::string(scenario) + ":" + n;
        const CanonName cn = parse_name(n);
        const bool is_logits = cn.site == "logits" || cn.site == "next_logits";
        if (is_logits) worst.logits_nmse = std::max(worst.logits_nmse, nmse);
        if (!bf16) {
          EXPECT_LE(nmse, 1e-10) << n;
          EXPECT_LE(rel_abs, 1e-5) << n;
        } else if (is_logits) {
          EXPECT_LE(nmse, 1e-3) << n;
        }
      }
      // The impl reports nothing outside the spec and nothing HF lacks.
      for (const std::string& n : ours.names()) EXPECT_TRUE(hf.has(n)) << "extra name " << n;
    }
    std::cout << "[impl vs HF] " << name << ": worst NMSE " << worst.nmse << " (" << worst.nmse_at
              << "), worst max|diff|/max(1,max|HF|) " << worst.rel_abs << " (" << worst.abs_at
              << "), worst logits NMSE " << worst.logits_nmse << "\n";
  }
}

TEST(ImplGolden, Bf16ModelGeneratesHfTokens) {
  const Model model = Model::load(golden_model("llama-mha-bf16"));
  ASSERT_EQ(model.weights->storage_dtype(), DType::BF16);
  DumpFile hf(golden_dump("llama-mha-bf16", "decode"));
  MemoryDump ours = run_impl(model, hf, 2);
  EXPECT_EQ(ours.get("generated").i, hf.get("generated").i);
}

// Float values compared bit for bit (NaN payloads and signed zeros included).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}


TEST(ImplGolden, ResultsDoNotDependOnThreadCount) {
  for (const char* name : {"llama-gqa", "qwen3-qknorm", "llama-mha-bf16"}) {
    SCOPED_TRACE(name);
    const Model model = Model::load(golden_model(name));
    for (const char* scenario : {"decode", "chunked"}) {
      DumpFile hf(golden_dump(name, scenario));
      MemoryDump one = run_impl(model, hf, 1), two = run_impl(model, hf, 2), three = run_impl(model, hf, 3);
      EXPECT_EQ(testing::first_difference(one, two), "");
      EXPECT_EQ(testing::first_difference(one, three), "");
    }
  }
}

TEST(ImplGolden, ObservingFewerSitesChangesNothing) {
  // Sites that cost memory (scores, probs, k_rep, logits) are only built when
  // wanted; what is computed must not depend on it.
  const Model model = Model::load(golden_model("qwen2-bias"));
  DumpFile hf(golden_dump("qwen2-bias", "decode"));
  const Scenario sc = replay_scenario(hf);
  auto engine = impl::make_impl_engine(model, {});
  MemoryDump all("all"), few("few");
  few.set_filter({"*next_logits", "*attn.ctx", "generated"});
  run_scenario(*engine, sc, all);
  run_scenario(*engine, sc, few);
  ASSERT_FALSE(few.names().empty());
  for (const std::string& n : few.names()) {
    const TensorData x = all.get(n), y = few.get(n);
    EXPECT_EQ(x.i, y.i) << n;
    EXPECT_TRUE(same_bits(x.f, y.f)) << n;
  }
}

TEST(ImplGolden, KvCapacityOverflowIsAUsageError) {
  const Model model = Model::load(golden_model("llama-gqa"));
  impl::ImplOptions opt;
  opt.max_seq = 5;
  auto engine = impl::make_impl_engine(model, opt);
  NullObserver none;
  engine->forward({1, 2, 3, 4}, 0, none);
  try {
    engine->forward({5, 6}, 1, none);
    FAIL() << "expected a UsageError for 4 + 2 tokens in a cache of 5";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("capacity"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("5"), std::string::npos) << e.what();
  }
  // The failed call left the cache as it was: one more token still fits.
  EXPECT_NO_THROW(engine->forward({5}, 1, none));
  EXPECT_THROW(engine->forward({6}, 2, none), UsageError);
  // reset() empties the cache.
  engine->reset();
  EXPECT_NO_THROW(engine->forward({1, 2, 3, 4, 5}, 0, none));

  // Default capacity: max_position_embeddings (128 for this model).
  auto dflt = impl::make_impl_engine(model, {});
  EXPECT_THROW(dflt->forward(std::vector<int64_t>(129, 1), 0, none), UsageError);
  EXPECT_NO_THROW(dflt->forward(std::vector<int64_t>(128, 1), 0, none));
}

// A scenario resumed at call 1 from a dump's caches of call 0
// (Scenario::resume) computes every later call exactly as the whole run
// that recorded them, on dense, MoE and MLA models; on HF's caches, as HF.
TEST(ImplGolden, ResumedFromADumpsCachesContinuesAsTheWholeRun) {
  for (const std::string& name : testing::golden_models()) {
    SCOPED_TRACE(name);
    const Model model = Model::load(golden_model(name));
    DumpFile hf(golden_dump(name, "decode"));
    const Scenario whole_sc = replay_scenario(hf);
    ASSERT_GE(whole_sc.steps.size(), 2u);
    MemoryDump whole = run_impl(model, hf, 2);
    Scenario sc = whole_sc;
    sc.resume = {1, &whole};
    auto engine = impl::make_impl_engine(model, {});
    MemoryDump resumed("resumed");
    run_scenario(*engine, sc, resumed);
    size_t later = 0;
    for (const std::string& n : whole.names()) {
      const CanonName c = parse_name(n);
      if (c.kind != CanonName::Kind::Step && c.kind != CanonName::Kind::Layer) continue;
      if (c.step < 1) {
        EXPECT_FALSE(resumed.has(n)) << n << " is a call the resumed run does not make";
        continue;
      }
      ASSERT_TRUE(resumed.has(n)) << n;
      const TensorData a = resumed.get(n), b = whole.get(n);
      ASSERT_EQ(a.shape, b.shape) << n;
      if (b.is_int)
        EXPECT_EQ(a.i, b.i) << n;
      else
        EXPECT_EQ(0, std::memcmp(a.f.data(), b.f.data(), a.f.size() * sizeof(float))) << n;
      ++later;
    }
    EXPECT_GT(later, 0u);
    // Caches longer than the engine's capacity: a UsageError naming both,
    // and the engine starts again from nothing.
    impl::ImplOptions small;
    small.max_seq = int64_t(whole_sc.steps[0].size()) - 1;  // call 0 cached its prompt
    auto short_engine = impl::make_impl_engine(model, small);
    try {
      short_engine->resume(whole, 1);
      ADD_FAILURE() << "resumed caches longer than the capacity " << small.max_seq;
    } catch (const UsageError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(std::to_string(small.max_seq + 1) + " cached positions"), std::string::npos) << what;
      EXPECT_NE(what.find("capacity " + std::to_string(small.max_seq)), std::string::npos) << what;
    }
    MemoryDump again("again");
    Scenario first = whole_sc;
    first.steps.resize(1);
    first.steps[0].resize(size_t(small.max_seq));
    EXPECT_NO_THROW(run_scenario(*short_engine, first, again));
    // On HF's own caches: the later calls as HF computed them.
    Scenario on_hf = whole_sc;
    on_hf.resume = {1, &hf};
    MemoryDump from_hf("from hf");
    run_scenario(*impl::make_impl_engine(model, {}), on_hf, from_hf);
    const std::string logits = step_name(int(whole_sc.steps.size()) - 1, Site::NextLogits);
    ASSERT_TRUE(from_hf.has(logits));
    EXPECT_LE(testing::nmse(from_hf.get(logits), hf.get(logits)), model.config.torch_dtype == "bfloat16" ? 1e-3 : 1e-10);
  }
  // A dump without a layer's cache cannot be resumed: the missing tensor named.
  const Model model = Model::load(golden_model("llama-gqa"));
  DumpFile hf(golden_dump("llama-gqa", "decode"));
  MemoryDump cut("cut");
  for (const std::string& n : hf.names())
    if (n != layer_name(0, 1, Site::AttnVCache)) cut.put(hf.get(n));
  Scenario sc = replay_scenario(hf);
  sc.resume = {1, &cut};
  MemoryDump out("out");
  try {
    run_scenario(*impl::make_impl_engine(model, {}), sc, out);
    ADD_FAILURE() << "resumed without step0.layers.1.attn.v_cache";
  } catch (const MissingTensorError& e) {
    EXPECT_NE(std::string(e.what()).find("step0.layers.1.attn.v_cache"), std::string::npos) << e.what();
  }
  sc.left_pad = 2;
  EXPECT_THROW(run_scenario(*impl::make_impl_engine(model, {}), sc, out), UsageError);
}

TEST(ImplGolden, RejectsBadTokens) {
  const Model model = Model::load(golden_model("llama-gqa"));
  auto engine = impl::make_impl_engine(model, {});
  NullObserver none;
  EXPECT_THROW(engine->forward({}, 0, none), UsageError);
  EXPECT_THROW(engine->forward({1, model.config.vocab_size}, 0, none), UsageError);
  EXPECT_THROW(engine->forward({-1}, 0, none), UsageError);
}

TEST(ImplGolden, ManifestFields) {
  const Model model = Model::load(golden_model("llama-gqa"));
  auto engine = impl::make_impl_engine(model, {});
  EXPECT_EQ(engine->dtype_name(), "float32");
  EXPECT_NE(engine->producer().find("impl"), std::string::npos);
  impl::ImplOptions opt;
  opt.bugs = {zoo::parse_bug("rope-theta=5000")};
  auto buggy = impl::make_impl_engine(model, opt);
  EXPECT_NE(buggy->producer().find("rope-theta=5000"), std::string::npos) << buggy->producer();
}

}  // namespace
}  // namespace llmdiff
