// The bug zoo: each bug changes the impl's dump first at the name where the
// mistake is made, and leaves everything before it bit-identical; bugs that
// cannot apply to a model are refused.
#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/model/weights.h"
#include "dumps/zoo/bugs.h"
#include "impl/impl_engine.h"
#include "tests/support.h"

namespace llmdiff {
namespace {

using testing::golden_dump;
using testing::golden_model;

MemoryDump run(const Model& model, const Scenario& sc, const std::vector<zoo::BugSpec>& bugs) {
  impl::ImplOptions opt;
  opt.threads = 2;
  opt.bugs = bugs;
  auto engine = impl::make_impl_engine(model, opt);
  MemoryDump out;
  run_scenario(*engine, sc, out);
  return out;
}

bool same(const TensorData& a, const TensorData& b) {
  return a.shape == b.shape && a.is_int == b.is_int && a.i == b.i && a.f.size() == b.f.size() &&
         (a.f.empty() || std::memcmp(a.f.data(), b.f.data(), a.f.size() * sizeof(float)) == 0);
}

// The first name, in canonical order, that only one dump holds or whose
// tensors differ in any bit; "" when the dumps are identical.
std::string first_difference(const TensorSource& clean, const TensorSource& buggy) {
  std::set<std::string> all;
  for (const auto& n : clean.names()) all.insert(n);
  for (const auto& n : buggy.names()) all.insert(n);
  std::vector<std::string> names(all.begin(), all.end());
  sort_canonical(names);
  for (const std::string& n : names) {
    if (!clean.has(n) || !buggy.has(n)) return n;
    if (!same(clean.get(n), buggy.get(n))) return n;
  }
  return "";
}

struct ZooCase {
  const char* bug;       // as given to --inject
  const char* model;     // a golden model the bug applies to
  const char* scenario;  // golden scenario replayed
  const char* first;     // the first name that must change
};

const ZooCase kZoo[] = {
    {"rope-interleaved", "llama-gqa", "prefill", "step0.layers.0.attn.q_rope"},
    {"rope-theta", "llama-gqa", "prefill", "rope.inv_freq"},
    {"rope-theta=20000", "qwen2-bias", "prefill", "rope.inv_freq"},
    {"rope-scaling-ignored", "llama3-mqa-scaled", "prefill", "rope.inv_freq"},
    {"rope-position-reset", "llama-gqa", "decode", "step1.positions"},
    {"repeat-kv-tile", "llama-gqa", "prefill", "step0.layers.0.attn.k_rep"},
    {"mask-square", "llama-gqa", "chunked", "step1.mask"},
    {"mask-missing", "llama-gqa", "prefill", "step0.mask"},
    {"kv-overwrite", "llama-gqa", "chunked", "step1.mask"},  // S = T: the mask is [T, T]
    {"last-token-first", "llama-gqa", "prefill", "step0.last_hidden"},
    {"rmsnorm-eps", "qwen2-bias", "prefill", "step0.layers.0.attn_norm"},
    {"rmsnorm-eps=1e-2", "llama-gqa", "prefill", "step0.layers.0.attn_norm"},
    {"missing-bias", "qwen2-bias", "prefill", "step0.layers.0.attn.q"},
    {"qk-norm-after-rope", "qwen3-qknorm", "prefill", "step0.layers.0.attn.q_norm"},
    {"softmax-scale", "llama-gqa", "prefill", "step0.layers.0.attn.scores"},
    {"gate-up-swap", "llama-gqa", "prefill", "step0.layers.0.mlp.act"},
    {"lm-head", "llama-gqa", "prefill", "step0.logits"},
    // mixture of experts
    {"moe-softmax-routing", "deepseek-v3-mla", "prefill", "step0.layers.1.moe.router_probs"},
    {"moe-topk-norm", "qwen3-moe", "prefill", "step0.layers.0.moe.topk_weights"},
    {"moe-bias-in-weights", "deepseek-v3-mla", "prefill", "step0.layers.1.moe.topk_weights"},
    {"moe-no-correction-bias", "deepseek-v3-mla", "prefill", "step0.layers.1.moe.topk_ids"},
    {"moe-no-group-limit", "deepseek-v3-mla", "prefill", "step0.layers.1.moe.topk_ids"},
    {"moe-routed-scale", "deepseek-v3-mla", "prefill", "step0.layers.1.moe.topk_weights"},
    {"moe-shared-missing", "deepseek-v3-mla", "prefill", "step0.layers.1.moe.shared"},
    {"moe-expert-off-by-one", "mixtral-gqa", "prefill", "step0.layers.0.moe.expert_out"},
    // multi-head latent attention
    {"mla-rope-layout", "deepseek-v3-mla", "prefill", "step0.layers.0.attn.k_pe"},
    {"mla-rope-front", "deepseek-v3-mla", "prefill", "step0.layers.0.attn.q_rope"},
    {"mla-value-as-key", "deepseek-v3-mla", "prefill", "step0.layers.0.attn.k_rope"},
};
// Bugs no golden model can show, tested on a random checkpoint elsewhere:
// mla-mscale-missing needs yarn rope scaling with mscale_all_dim
// (tests/test_impl_moe.cpp, ImplMla.MscaleMissingChangesTheScoresFirst).
// pad-keys-unmasked acts on a row of a left-padded batch only
// (tests/test_cli_batch_engine.cpp, CliBatchEngine.PadKeysLeftOpen...).
const char* const kTestedElsewhere[] = {"mla-mscale-missing", "pad-keys-unmasked"};

TEST(ImplZoo, EachBugFirstChangesTheDumpWhereItIsMade) {
  std::set<zoo::Bug> covered;
  for (const ZooCase& z : kZoo) {
    SCOPED_TRACE(std::string(z.bug) + " on " + z.model + "/" + z.scenario);
    const Model model = Model::load(golden_model(z.model));
    const Scenario sc = replay_scenario(DumpFile(golden_dump(z.model, z.scenario)));
    const zoo::BugSpec spec = zoo::parse_bug(z.bug);
    covered.insert(spec.bug);
    const MemoryDump clean = run(model, sc, {});
    const MemoryDump buggy = run(model, sc, {spec});
    EXPECT_EQ(first_difference(clean, buggy), z.first);
  }
  for (const char* b : kTestedElsewhere) covered.insert(zoo::parse_bug(b).bug);
  // The sampler's bugs change no tensor of the forward pass
  // (tests/test_compare_sampling.cpp).
  for (const zoo::BugInfo* info : zoo::sampler_bugs()) covered.insert(info->bug);
  // The batch bugs act in the continuous-batching engine
  // (tests/test_cli_batch_engine.cpp, tests/test_impl_batch.cpp).
  for (const zoo::BugInfo* info : zoo::batch_bugs()) covered.insert(info->bug);
  // The tensor-parallel bugs act between ranks
  // (tests/test_impl_tensor_parallel.cpp, tests/test_cli_tensor_parallel.cpp).
  for (const zoo::BugInfo* info : zoo::tp_bugs()) covered.insert(info->bug);
  EXPECT_EQ(covered.size(), zoo::all_bugs().size()) << "a bug of the zoo has no case";
}

TEST(ImplZoo, DumpsShowWhatTheBuggyEngineComputes) {
  const Model model = Model::load(golden_model("llama-gqa"));
  const int64_t Hkv = model.config.num_key_value_heads, Dh = model.config.head_dim;
  {
    const Scenario sc = replay_scenario(DumpFile(golden_dump("llama-gqa", "chunked")));
    const MemoryDump d = run(model, sc, {zoo::parse_bug("kv-overwrite")});
    EXPECT_EQ(d.shape("step1.layers.0.attn.k_cache"), (Shape{Hkv, 3, Dh}));
    EXPECT_EQ(d.shape("step1.mask"), (Shape{3, 3}));
  }
  {
    // Positions follow the cache length, which is only the previous call's.
    const Scenario sc = replay_scenario(DumpFile(golden_dump("llama-gqa", "decode")));
    const MemoryDump d = run(model, sc, {zoo::parse_bug("kv-overwrite")});
    EXPECT_EQ(d.get("step1.positions").i, std::vector<int64_t>{5});
    EXPECT_EQ(d.get("step2.positions").i, std::vector<int64_t>{1});
    EXPECT_EQ(d.shape("step2.layers.1.attn.v_cache"), (Shape{Hkv, 1, Dh}));
  }
  {
    const Scenario sc = replay_scenario(DumpFile(golden_dump("llama-gqa", "chunked")));
    const MemoryDump d = run(model, sc, {zoo::parse_bug("mask-square")});
    const TensorData m = d.get("step1.mask");  // [3, 7]: key s allowed iff s <= t
    ASSERT_EQ(m.shape, (Shape{3, 7}));
    for (int64_t t = 0; t < 3; ++t)
      for (int64_t s = 0; s < 7; ++s) EXPECT_EQ(m.f[size_t(t * 7 + s)], s <= t ? 1.0f : 0.0f) << t << "," << s;
  }
  {
    const Scenario sc = replay_scenario(DumpFile(golden_dump("llama-gqa", "decode")));
    const MemoryDump d = run(model, sc, {zoo::parse_bug("rope-position-reset")});
    EXPECT_EQ(d.get("step2.positions").i, std::vector<int64_t>{0});
    EXPECT_EQ(d.shape("step2.layers.0.attn.k_cache"), (Shape{Hkv, 7, Dh}));  // the cache still grows
  }
  {
    const Scenario sc = replay_scenario(DumpFile(golden_dump("llama-gqa", "prefill")));
    const MemoryDump d = run(model, sc, {zoo::parse_bug("last-token-first")});
    const TensorData fn = d.get("step0.final_norm"), lh = d.get("step0.last_hidden");
    const TensorData lg = d.get("step0.logits"), nl = d.get("step0.next_logits");
    const int64_t D = model.config.hidden_size, V = model.config.vocab_size;
    EXPECT_EQ(std::vector<float>(fn.f.begin(), fn.f.begin() + D), lh.f);
    EXPECT_EQ(std::vector<float>(lg.f.begin(), lg.f.begin() + V), nl.f);
  }
  {
    const Scenario sc = replay_scenario(DumpFile(golden_dump("llama-gqa", "prefill")));
    const MemoryDump d = run(model, sc, {zoo::parse_bug("mask-missing")});
    for (float v : d.get("step0.mask").f) EXPECT_EQ(v, 1.0f);
  }
}

TEST(ImplZoo, SeveralBugsAtOnce) {
  const Model model = Model::load(golden_model("llama-gqa"));
  const Scenario sc = replay_scenario(DumpFile(golden_dump("llama-gqa", "prefill")));
  const MemoryDump clean = run(model, sc, {});
  const MemoryDump buggy = run(model, sc, {zoo::parse_bug("gate-up-swap"), zoo::parse_bug("softmax-scale")});
  EXPECT_EQ(first_difference(clean, buggy), "step0.layers.0.attn.scores");
  EXPECT_FALSE(same(clean.get("step0.layers.0.mlp.act"), buggy.get("step0.layers.0.mlp.act")));
}

TEST(ImplZoo, InapplicableBugsAreRefused) {
  struct Case {
    const char* bug;
    const char* model;
  };
  const Case cases[] = {
      {"missing-bias", "llama-gqa"},             // no q/k/v bias
      {"repeat-kv-tile", "llama-mha-bf16"},      // Hq = Hkv
      {"repeat-kv-tile", "llama3-mqa-scaled"},   // Hkv = 1
      {"qk-norm-after-rope", "llama-gqa"},       // no qk norm
      {"lm-head", "qwen2-bias"},                 // tied embeddings
      {"rope-scaling-ignored", "llama-gqa"},     // no rope_scaling
      {"rope-theta=10000", "llama-gqa"},         // the config's own theta
      {"rmsnorm-eps=1e-5", "llama-gqa"},         // the config's own eps
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.bug) + " on " + c.model);
    const Model model = Model::load(golden_model(c.model));
    const zoo::BugSpec spec = zoo::parse_bug(c.bug);
    if (!zoo::bug_takes_value(spec.bug)) {
      EXPECT_NE(zoo::bug_inapplicable_reason(spec.bug, model.config), "");
    }
    impl::ImplOptions opt;
    opt.bugs = {spec};
    EXPECT_THROW(impl::make_impl_engine(model, opt), UsageError);
  }
  // ... and the applicable ones are not.
  const Model qwen2 = Model::load(golden_model("qwen2-bias"));
  EXPECT_EQ(zoo::bug_inapplicable_reason(zoo::Bug::MissingBias, qwen2.config), "");
  EXPECT_EQ(zoo::bug_inapplicable_reason(zoo::Bug::RepeatKvTile, qwen2.config), "");
}

TEST(ImplZoo, ParsesBugSpecs) {
  EXPECT_EQ(zoo::parse_bug("mask-missing").bug, zoo::Bug::MaskMissing);
  EXPECT_FALSE(zoo::parse_bug("mask-missing").value.has_value());
  const zoo::BugSpec theta = zoo::parse_bug("rope-theta=5e4");
  EXPECT_EQ(theta.bug, zoo::Bug::RopeTheta);
  EXPECT_EQ(*theta.value, 50000.0);
  EXPECT_EQ(theta.str(), "rope-theta=50000");
  EXPECT_EQ(zoo::parse_bug("rmsnorm-eps=1e-5").str(), "rmsnorm-eps=1e-05");
  EXPECT_EQ(zoo::parse_bug(zoo::parse_bug("rmsnorm-eps=3.3e-7").str()).value, 3.3e-7);
  for (const zoo::BugInfo& info : zoo::all_bugs()) {
    EXPECT_EQ(zoo::parse_bug(info.name).bug, info.bug);
    EXPECT_STREQ(zoo::bug_name(info.bug), info.name);
  }
  EXPECT_THROW(zoo::parse_bug("no-such-bug"), UsageError);
  EXPECT_THROW(zoo::parse_bug("mask-missing=1"), UsageError);
  EXPECT_THROW(zoo::parse_bug("rope-theta=abc"), UsageError);
  EXPECT_THROW(zoo::parse_bug("rope-theta=0"), UsageError);
  EXPECT_THROW(zoo::parse_bug("rope-theta="), UsageError);
  try {
    zoo::parse_bug("rope-thta");
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("rope-theta"), std::string::npos) << "lists the known bugs: " << e.what();
  }
  // Documented defaults.
  const Model gqa = Model::load(golden_model("llama-gqa"));  // theta 10000, eps 1e-5
  EXPECT_EQ(zoo::bug_value(zoo::parse_bug("rope-theta"), gqa.config), 1000.0);
  EXPECT_EQ(zoo::bug_value(zoo::parse_bug("rmsnorm-eps"), gqa.config), 1e-6);
  const Model qwen2 = Model::load(golden_model("qwen2-bias"));  // eps 1e-6
  EXPECT_EQ(zoo::bug_value(zoo::parse_bug("rmsnorm-eps"), qwen2.config), 1e-5);
}

}  // namespace
}  // namespace llmdiff
