// End to end: every bug of the zoo, injected into the impl on every golden
// model it applies to, replayed over the golden decode scenario (a prefill of
// 5 tokens then 3 decode steps: cache, mask and position bugs show), is
// localised at the op that causes it and diagnosed by bisect, from a full
// dump and from one cut down to tokens / positions / layers.*.out / logits /
// generated. Clean impl dumps and HF's own golden dumps (float32 and
// bfloat16) pass the noise floor. The `bisect` and `run` commands: exit
// codes, JSON, Markdown reports, usage errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/common.h"
#include "bisect/pipeline.h"
#include "synth/synth.h"
#include "compare/bisect_report.h"
#include "compare/signatures.h"
#include "compare/cross_signatures.h"
#include "compare/report.h"
#include "compare/html_page.h"
#include "compare/report_html.h"
#include "dumps/model/config.h"
#include "dumps/base/dtype.h"
#include "dumps/base/errors.h"
#include "dumps/zoo/bugs.h"
#include "ref/ref_engine.h"
#include "tests/cli_runner.h"
#include "tests/support.h"

namespace fs = std::filesystem;
using namespace llmdiff;
using namespace llmdiff::testing;
using bisect::BisectOptions;
using compare::BisectResult;

namespace {

// One ModelOracles per golden model for the whole test binary.
const bisect::ModelOracles& oracles(const std::string& model) {
  static std::map<std::string, std::unique_ptr<bisect::ModelOracles>> cache;
  auto& m = cache[model];
  if (!m) m = std::make_unique<bisect::ModelOracles>(golden_model(model), 1);
  return *m;
}

Scenario golden_scenario(const std::string& model, const std::string& scenario = "decode") {
  return replay_scenario(DumpFile(golden_dump(model, scenario)));
}

// The impl (with the given zoo bugs) over `sc`, every site recorded.
std::unique_ptr<MemoryDump> impl_candidate(const bisect::ModelOracles& m, const Scenario& sc,
                                           const std::vector<std::string>& inject, const std::string& mla = "naive") {
  cli::EngineOptions eo;
  eo.threads = 1;
  eo.inject = inject;
  eo.mla = mla;
  auto engine = cli::make_engine("impl", m.model, eo);
  auto d = std::make_unique<MemoryDump>(inject.empty() ? "impl" : "impl --inject " + inject.front());
  d->mutable_manifest() = cli::make_manifest(*engine, m.model, m.dir, sc);
  run_scenario(*engine, sc, *d);
  return d;
}

// The same dump holding only what a minimal producer reports: tokens,
// positions, each layer's output, logits and the greedy tokens.
std::unique_ptr<MemoryDump> cut_down(const TensorSource& full) {
  auto d = std::make_unique<MemoryDump>(full.label() + " (cut down)");
  d->mutable_manifest() = full.manifest();
  for (const auto& n : full.names()) {
    CanonName c = parse_name(n);
    const bool keep = (c.kind == CanonName::Kind::Step && (c.site == "tokens" || c.site == "positions" || c.site == "logits")) ||
                      (c.kind == CanonName::Kind::Layer && c.site == "out") || c.kind == CanonName::Kind::Generated;
    if (keep) d->put(full.get(n));
  }
  return d;
}

// Where each bug first shows: in a full dump, and in a cut-down one. `{moe}`
// stands for the first MoE layer, `{ffn}` for the first layer's feed-forward
// site where silu(gate) * up first shows (mlp.act, or a MoE layer's
// moe.expert_out).
struct Expected {
  std::string full, cut;
};
const std::map<std::string, Expected>& expected_patterns() {
  static const std::map<std::string, Expected> m = {
      {"rope-interleaved", {"step0.layers.0.attn.q_rope", "step0.layers.0.out"}},
      {"rope-theta", {"rope.inv_freq", "step0.layers.0.out"}},
      {"rope-scaling-ignored", {"rope.inv_freq", "step0.layers.0.out"}},
      {"rope-position-reset", {"step1.positions", "step1.positions"}},
      {"repeat-kv-tile", {"step0.layers.0.attn.k_rep", "step0.layers.0.out"}},
      {"mask-square", {"step1.mask", "step1.layers.0.out"}},
      {"mask-missing", {"step0.mask", "step0.layers.0.out"}},
      {"kv-overwrite", {"step1.mask", "step1.layers.0.out"}},
      {"last-token-first", {"step0.last_hidden", "generated"}},
      {"rmsnorm-eps", {"step0.layers.0.attn_norm", "step0.layers.0.out"}},
      {"missing-bias", {"step0.layers.0.attn.q", "step0.layers.0.out"}},
      {"qk-norm-after-rope", {"step0.layers.0.attn.q_norm", "step0.layers.0.out"}},
      {"softmax-scale", {"step0.layers.0.attn.scores", "step0.layers.0.out"}},
      {"gate-up-swap", {"step0.layers.0.{ffn}", "step0.layers.0.out"}},
      {"lm-head", {"step0.logits", "step0.logits"}},
      {"moe-softmax-routing", {"step0.layers.{moe}.moe.router_probs", "step0.layers.{moe}.out"}},
      {"moe-topk-norm", {"step0.layers.{moe}.moe.topk_weights", "step0.layers.{moe}.out"}},
      {"moe-bias-in-weights", {"step0.layers.{moe}.moe.topk_weights", "step0.layers.{moe}.out"}},
      {"moe-no-correction-bias", {"step0.layers.{moe}.moe.topk_ids", "step0.layers.{moe}.out"}},
      {"moe-no-group-limit", {"step0.layers.{moe}.moe.topk_ids", "step0.layers.{moe}.out"}},
      {"moe-routed-scale", {"step0.layers.{moe}.moe.topk_weights", "step0.layers.{moe}.out"}},
      {"moe-shared-missing", {"step0.layers.{moe}.moe.out", "step0.layers.{moe}.out"}},
      {"moe-expert-off-by-one", {"step0.layers.{moe}.moe.expert_out", "step0.layers.{moe}.out"}},
      {"mla-rope-layout", {"step0.layers.0.attn.k_pe", "step0.layers.0.out"}},
      {"mla-rope-front", {"step0.layers.0.attn.q_rope", "step0.layers.0.out"}},
      {"mla-value-as-key", {"step0.layers.0.attn.k_rope", "step0.layers.0.out"}},
  };
  return m;
}

Expected expected_divergence(const std::string& bug, const ModelConfig& cfg) {
  Expected e = expected_patterns().at(bug);
  int64_t first_moe = 0;
  while (first_moe < cfg.num_hidden_layers && !cfg.moe.is_moe_layer(first_moe)) ++first_moe;
  for (std::string* s : {&e.full, &e.cut}) {
    for (size_t at; (at = s->find("{moe}")) != std::string::npos;) s->replace(at, 5, std::to_string(first_moe));
    for (size_t at; (at = s->find("{ffn}")) != std::string::npos;)
      s->replace(at, 5, cfg.moe.is_moe_layer(0) ? "moe.expert_out" : "mlp.act");
  }
  return e;
}

std::string describe(const BisectResult& r) {
  return "first divergence " + r.first_divergence().value_or("none") + ", first local failure " +
         r.first_local_failure().value_or("none") + ", diagnosis " +
         (compare::named_bug(r.finding) ? compare::named_bug(r.finding)->str() : std::string("none")) + ": " +
         r.finding.evidence;
}

// ---------------------------------------------------------------------------
// Every zoo bug on every golden model it applies to.

struct ZooCase {
  std::string model, bug;
};

std::vector<ZooCase> zoo_cases() {
  std::vector<ZooCase> out;
  for (const auto& model : golden_models()) {
    ModelConfig cfg = load_config(golden_model(model));
    // (A bug that acts on left-padded rows only: tests/test_cli_batch_engine.cpp.)
    for (const auto& info : zoo::all_bugs())
      if (info.acts_on_model() && !info.needs_padding && zoo::bug_inapplicable_reason(info.bug, cfg).empty())
        out.push_back({model, info.name});
  }
  return out;
}

class BisectZoo : public ::testing::TestWithParam<ZooCase> {};

void check_diagnosis(const BisectResult& r, const bisect::ModelOracles& m, const std::string& bug,
                     const std::string& expected_first, const std::string& what) {
  SCOPED_TRACE(what + ": " + describe(r));
  EXPECT_EQ(r.exit_code(), 1);
  EXPECT_EQ(r.first_divergence().value_or("none"), expected_first);
  // Localised at the op that causes it: its local error fails first.
  EXPECT_EQ(r.first_local_failure().value_or("none"), expected_first);
  ASSERT_TRUE(compare::named_bug(r.finding).has_value());
  EXPECT_EQ(compare::named_bug(r.finding)->bug, bug);
  EXPECT_TRUE(r.finding.ambiguous.empty());
  EXPECT_FALSE(r.finding.evidence.empty());
  zoo::BugSpec spec = zoo::parse_bug(bug);
  if (zoo::bug_takes_value(spec.bug)) {
    ASSERT_TRUE(compare::named_bug(r.finding)->value.has_value());
    EXPECT_DOUBLE_EQ(*compare::named_bug(r.finding)->value, zoo::bug_value(spec, m.model.config));
    EXPECT_NE(r.finding.evidence.find("config says"), std::string::npos);
  }
}

TEST_P(BisectZoo, LocalisesAndNamesTheBugInFullAndCutDownDumps) {
  const ZooCase& c = GetParam();
  const bisect::ModelOracles& m = oracles(c.model);
  const Expected want = expected_divergence(c.bug, m.model.config);
  std::unique_ptr<MemoryDump> full = impl_candidate(m, golden_scenario(c.model), {c.bug});
  check_diagnosis(bisect::bisect_candidate(m, *full, BisectOptions{}), m, c.bug, want.full, "full dump");
  std::unique_ptr<MemoryDump> cut = cut_down(*full);
  check_diagnosis(bisect::bisect_candidate(m, *cut, BisectOptions{}), m, c.bug, want.cut, "cut-down dump");
}

INSTANTIATE_TEST_SUITE_P(AllGolden, BisectZoo, ::testing::ValuesIn(zoo_cases()),
                         [](const ::testing::TestParamInfo<ZooCase>& info) {
                           std::string s = info.param.model + "_" + info.param.bug;
                           for (char& ch : s)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return s;
                         });

// An absorbed-MLA engine reports neither kv nor the full keys and values:
// clean, it passes from the names it has (scores and ctx recomputed through
// kv_b from its own latent and k_pe); with a bug, the bug is still localised
// and named.
TEST(BisectAbsorbedMla, AnAbsorbedCandidateIsJudgedFromTheNamesItHas) {
  const bisect::ModelOracles& m = oracles("deepseek-v3-mla");
  for (const std::string scenario : {"decode", "chunked"}) {
    std::unique_ptr<MemoryDump> clean = impl_candidate(m, golden_scenario("deepseek-v3-mla", scenario), {}, "absorbed");
    EXPECT_FALSE(clean->has("step0.layers.0.attn.kv"));
    EXPECT_FALSE(clean->has("step0.layers.0.attn.k_cache"));
    EXPECT_TRUE(clean->has("step0.layers.0.attn.latent_cache"));
    BisectResult r = bisect::bisect_candidate(m, *clean, BisectOptions{});
    SCOPED_TRACE(scenario + ": " + describe(r));
    EXPECT_EQ(r.exit_code(), 0);
    EXPECT_EQ(r.local.failing(), 0u);
    EXPECT_FALSE(compare::named_bug(r.finding));
    // scores and ctx were recomputed, not skipped.
    int recomputed = 0;
    for (const auto& site : r.local.sites)
      if (parse_name(site.name).site == "attn.scores" || parse_name(site.name).site == "attn.ctx") ++recomputed;
    EXPECT_GE(recomputed, 2 * 3);
  }
  for (const std::string bug : {"mla-rope-front", "mla-value-as-key", "mla-rope-layout", "moe-bias-in-weights"}) {
    std::unique_ptr<MemoryDump> cand = impl_candidate(m, golden_scenario("deepseek-v3-mla"), {bug}, "absorbed");
    BisectResult r = bisect::bisect_candidate(m, *cand, BisectOptions{});
    SCOPED_TRACE(bug + ": " + describe(r));
    EXPECT_EQ(r.exit_code(), 1);
    std::string want = expected_divergence(bug, m.model.config).full;
    if (!cand->has(want)) want = "step0.layers.0.attn.scores";  // k_rope: not observable in the absorbed form
    EXPECT_EQ(r.first_local_failure().value_or("none"), want);
    ASSERT_TRUE(compare::named_bug(r.finding));
    EXPECT_EQ(compare::named_bug(r.finding)->bug, bug);
  }
}

// A KV cache stored at a lower precision (llama.cpp's default F16 cache):
// the cache writes are the recompute rounded to float16, which the local
// check says instead of calling the copy wrong; a cache that is wrong
// (kv-overwrite) still fails it.
TEST(BisectStorage, ACacheStoredAsFloat16IsNotAWrongCopy) {
  const bisect::ModelOracles& m = oracles("llama-gqa");
  std::unique_ptr<MemoryDump> cand = impl_candidate(m, golden_scenario("llama-gqa"), {});
  auto rounded = std::make_unique<MemoryDump>("impl, f16 cache");
  rounded->mutable_manifest() = cand->manifest();
  for (const auto& n : cand->names()) {
    TensorData t = cand->get(n);
    const std::string site = parse_name(n).site;
    if (site == "attn.k_cache" || site == "attn.v_cache")
      for (float& x : t.f) x = f16_to_f32(f32_to_f16(x));
    rounded->put(t);
  }
  BisectResult r = bisect::bisect_candidate(m, *rounded, BisectOptions{});
  SCOPED_TRACE(describe(r));
  int caches = 0;
  for (const auto& site : r.local.sites) {
    if (site.parsed.site != "attn.k_cache" && site.parsed.site != "attn.v_cache") continue;
    ++caches;
    EXPECT_TRUE(site.pass) << site.name << ": " << site.note;
    if (site.parsed.step > 0) {
      EXPECT_NE(site.note.find("stored as float16"), std::string::npos) << site.note;
    }
  }
  EXPECT_EQ(caches, 2 * 2 * 4);
  std::unique_ptr<MemoryDump> wrong = impl_candidate(m, golden_scenario("llama-gqa"), {"kv-overwrite"});
  BisectResult w = bisect::bisect_candidate(m, *wrong, BisectOptions{});
  const compare::LocalSite* cache = w.local.find("step1.layers.0.attn.k_cache");
  ASSERT_NE(cache, nullptr);
  EXPECT_FALSE(cache->pass);
}

// llama.cpp's layout: q/k rows permuted so that RoPE rotates adjacent pairs.
// Every q/k-side name holds each head's dims interleaved (2i <- i,
// 2i+1 <- i + Dh/2); scores and everything after are HF's. Not a bug: the
// headline is the layout, with the transform to apply.
TEST(BisectLayout, AnEnginesOwnRopeLayoutIsTheFindingNotABug) {
  const bisect::ModelOracles& m = oracles("llama-gqa");
  DumpFile golden(golden_dump("llama-gqa", "decode"));
  const int64_t Dh = m.model.config.head_dim;
  MemoryDump permuted("llama.cpp-style q/k layout");
  permuted.mutable_manifest() = golden.manifest();
  for (const auto& n : golden.names()) {
    TensorData t = golden.get(n);
    const std::string site = parse_name(n).site;
    if (site == "attn.q" || site == "attn.k" || site == "attn.q_rope" || site == "attn.k_rope" ||
        site == "attn.k_cache" || site == "attn.k_rep") {
      std::vector<float> out(t.f.size());
      for (size_t base = 0; base < t.f.size(); base += size_t(Dh))
        for (int64_t i = 0; i < Dh / 2; ++i) {
          out[base + size_t(2 * i)] = t.f[base + size_t(i)];
          out[base + size_t(2 * i + 1)] = t.f[base + size_t(i + Dh / 2)];
        }
      t.f = out;
    }
    permuted.put(t);
  }
  BisectResult r = bisect::bisect_candidate(m, permuted, BisectOptions{});
  SCOPED_TRACE(describe(r));
  EXPECT_EQ(r.exit_code(), 1);
  EXPECT_FALSE(compare::named_bug(r.finding));
  ASSERT_EQ(r.finding.kind, compare::FindingKind::Layout);
  EXPECT_EQ(r.finding.layout.rope, "interleaved->half");
  EXPECT_EQ(compare::basis_label(r.finding).value_or(""), "layout");
  EXPECT_NE(r.finding.evidence.find("engine's own layout"), std::string::npos);
  // A real bug is not explained away: rope-interleaved changes the scores too.
  BisectResult bug = bisect::bisect_candidate(m, *impl_candidate(m, golden_scenario("llama-gqa"), {"rope-interleaved"}),
                                              BisectOptions{});
  EXPECT_NE(bug.finding.kind, compare::FindingKind::Layout);
}

// llama.cpp's DeepSeek layout: RoPE on adjacent pairs of the raw weights'
// order, where HF reorders them to halves first (rope_interleave): after
// the rotation the Dr rope dims of each head (the last Dr of a q/k head, all
// of a k_pe row) are laid out interleaved, the nope dims as HF's. The
// engine's own layout, not a bug, found in the rope dims only.
TEST(BisectLayout, AnMlaEnginesOwnRopeLayoutIsFoundInTheRopeDims) {
  const bisect::ModelOracles& m = oracles("deepseek-v3-mla");
  DumpFile golden(golden_dump("deepseek-v3-mla", "decode"));
  const int64_t Dr = m.model.config.mla.qk_rope_head_dim, Dk = m.model.config.mla.qk_head_dim();
  MemoryDump permuted("llama.cpp-style MLA rope layout");
  permuted.mutable_manifest() = golden.manifest();
  int changed = 0;
  for (const auto& n : golden.names()) {
    TensorData t = golden.get(n);
    const std::string site = parse_name(n).site;
    const bool head = site == "attn.q_rope" || site == "attn.k_rope" || site == "attn.k_cache" || site == "attn.k_rep";
    if (head || site == "attn.k_pe_cache") {
      const int64_t block = head ? Dk : Dr, start = block - Dr;
      std::vector<float> out = t.f;
      for (size_t base = 0; base < t.f.size(); base += size_t(block))
        for (int64_t i = 0; i < Dr / 2; ++i) {
          out[base + size_t(start + 2 * i)] = t.f[base + size_t(start + i)];
          out[base + size_t(start + 2 * i + 1)] = t.f[base + size_t(start + i + Dr / 2)];
        }
      t.f = out;
      ++changed;
    }
    permuted.put(t);
  }
  ASSERT_GT(changed, 0);
  BisectResult r = bisect::bisect_candidate(m, permuted, BisectOptions{});
  SCOPED_TRACE(describe(r));
  EXPECT_FALSE(compare::named_bug(r.finding));
  ASSERT_EQ(r.finding.kind, compare::FindingKind::Layout);
  EXPECT_EQ(r.finding.layout.rope, "interleaved->half");
  EXPECT_NE(r.finding.evidence.find("engine's own layout"), std::string::npos);
  EXPECT_NE(r.finding.layout.summary.find("rope dims of each head"), std::string::npos) << r.finding.layout.summary;
}

// Bugs outside the zoo, made by transforming HF's own dump at one name, on
// every golden model: the error's signature (kind and parameter) is reported
// in text, Markdown and JSON, and no zoo bug is claimed.
struct SignatureCase {
  std::string name, kind, detail;
  std::function<void(TensorData&, const TensorSource&)> change;
  bool headline = true;  // the signature is the diagnosis' finding (basis "signature")
};

std::vector<SignatureCase> signature_cases(const bisect::ModelOracles& m, const TensorSource& g) {
  const ModelConfig& cfg = m.model.config;
  const int64_t Dh = cfg.mla.enabled ? cfg.mla.qk_head_dim() : cfg.head_dim;
  const bool bf16 = cfg.default_dtype() == ComputeDType::BFloat16;
  std::vector<SignatureCase> cases;
  auto garbage = [](float& x, size_t i) { x = std::sin(float(i) * 0.7f) * 3.0f; };
  cases.push_back({"step0.layers.0.attn.scores", "scale", "= sqrt(Dh)", [Dh](TensorData& t, const TensorSource&) {
                     for (float& x : t.f) x *= float(std::sqrt(double(Dh)));
                   }});
  cases.push_back({"step0.layers.0.attn_norm", "scale", "per channel", [](TensorData& t, const TensorSource&) {
                     const int64_t X = t.shape[1];
                     for (size_t i = 0; i < t.f.size(); ++i) t.f[i] *= 1.0f + 0.5f * std::sin(float(int64_t(i) % X));
                   }});
  cases.push_back({"step0.layers.0.attn_norm", "shift", "row t holds the reference's row t+1",
                   [](TensorData& t, const TensorSource&) {
                     const int64_t T = t.shape[0], X = t.shape[1];
                     for (int64_t r = 0; r + 1 < T; ++r)
                       for (int64_t x = 0; x < X; ++x) t.f[size_t(r * X + x)] = t.f[size_t((r + 1) * X + x)];
                   }});
  cases.push_back({"step0.layers.1.attn_norm", "alias", "step0.layers.0.out",  // the norm skipped
                   [](TensorData& t, const TensorSource& g) { t.f = g.get("step0.layers.0.out").f; }});
  if (g.has("step0.layers.0.attn.v") && g.shape("step0.layers.0.attn.v") == g.shape("step0.layers.0.attn.k"))
    cases.push_back({"step0.layers.0.attn.v", "alias", "step0.layers.0.attn.k",
                     [](TensorData& t, const TensorSource& g) { t.f = g.get("step0.layers.0.attn.k").f; }});
  // A bfloat16 model's values already lie on the bfloat16 grid (and mostly on float16's).
  if (!bf16)
    cases.push_back({"step0.layers.0.attn_norm", "precision", "rounded to bfloat16", [](TensorData& t, const TensorSource&) {
                       for (float& x : t.f) x = bf16_to_f32(f32_to_bf16(x));
                     }});
  cases.push_back({"step0.layers.0.attn.q_rope", "partial", "1 of 4 heads wrong (1)", [garbage](TensorData& t, const TensorSource&) {
                     const size_t per = size_t(t.shape[1] * t.shape[2]);
                     for (size_t i = per; i < 2 * per; ++i) garbage(t.f[i], i);
                   }, false});
  cases.push_back({"step0.layers.0.attn.q_rope", "partial", "(the second half)", [garbage](TensorData& t, const TensorSource&) {
                     const int64_t X = t.shape[2];
                     for (size_t i = 0; i < t.f.size(); ++i)
                       if (int64_t(i) % X >= X / 2) garbage(t.f[i], i);
                   }, false});
  cases.push_back({"step0.layers.0.attn.q_rope", "permutation", "heads in another order: head h holds the reference's "
                   "head p[h], reversed", [](TensorData& t, const TensorSource& g) {
                     const TensorData r = g.get("step0.layers.0.attn.q_rope");
                     const int64_t H = t.shape[0], per = t.shape[1] * t.shape[2];
                     for (int64_t h = 0; h < H; ++h)
                       std::copy_n(r.f.begin() + (H - 1 - h) * per, per, t.f.begin() + h * per);
                   }});
  cases.push_back({"step0.layers.0.attn.q_rope", "permutation", "the two halves of each head swapped",
                   [](TensorData& t, const TensorSource& g) {
                     const TensorData r = g.get("step0.layers.0.attn.q_rope");
                     const int64_t X = t.shape[2];
                     for (size_t i = 0; i < t.f.size(); ++i) {
                       const int64_t d = int64_t(i) % X, base = int64_t(i) - d;
                       t.f[i] = r.f[size_t(base + (d + X / 2) % X)];
                     }
                   }});
  cases.push_back({"step0.layers.0.attn_norm", "permutation", "rows (positions) in another order: row t holds the "
                   "reference's row p[t], reversed", [](TensorData& t, const TensorSource& g) {
                     const TensorData r = g.get("step0.layers.0.attn_norm");
                     const int64_t T = t.shape[0], X = t.shape[1];
                     for (int64_t row = 0; row < T; ++row)
                       std::copy_n(r.f.begin() + (T - 1 - row) * X, X, t.f.begin() + row * X);
                   }});
  cases.push_back({"step1.layers.0.attn.k_cache", "length", "(+1 key): the first", [](TensorData& t, const TensorSource&) {
                     // One stale slot read after the cache: S + 1 keys.
                     const int64_t H = t.shape[0], S = t.shape[1], X = t.shape[2];
                     std::vector<float> longer(size_t(H * (S + 1) * X), 0.5f);
                     for (int64_t h = 0; h < H; ++h)
                       std::copy_n(t.f.begin() + h * S * X, S * X, longer.begin() + h * (S + 1) * X);
                     t.f = longer;
                     t.shape[1] = S + 1;
                   }});
  cases.push_back({"step1.mask", "mask", "offset by -1 (query t sees keys up to its position - 1): the diagonal is masked",
                   [](TensorData& t, const TensorSource&) {
                     const int64_t T = t.shape[0], S = t.shape[1];
                     for (int64_t r = 0; r < T; ++r) t.f[size_t(r * S + (S - T + r))] = 0.0f;
                   }});
  cases.push_back({"step0.mask", "mask", "the last 2 keys (a sliding window of 2)", [](TensorData& t, const TensorSource&) {
                     const int64_t T = t.shape[0], S = t.shape[1];
                     for (int64_t r = 0; r < T; ++r)
                       for (int64_t k = 0; k < S; ++k) t.f[size_t(r * S + k)] = k <= r && k > r - 2 ? 1.0f : 0.0f;
                   }});
  if (g.has("step0.layers.0.mlp.act"))
    cases.push_back({"step0.layers.0.mlp.act", "elementwise", "mlp.act = gelu_tanh(gate) * up",
                     [bf16](TensorData& t, const TensorSource& g) {
                       const TensorData gate = g.get("step0.layers.0.mlp.gate"), up = g.get("step0.layers.0.mlp.up");
                       for (size_t i = 0; i < t.f.size(); ++i) {
                         const double x = gate.f[i];
                         const double y = 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))) * up.f[i];
                         t.f[i] = bf16 ? bf16_to_f32(f32_to_bf16(float(y))) : float(y);
                       }
                     }});
  if (!bf16)
    cases.push_back({"step0.logits", "elementwise", "soft-capped at", [](TensorData& t, const TensorSource&) {
                       float cap = 0;
                       for (float x : t.f) cap = std::max(cap, std::fabs(x));
                       cap *= 0.5f;
                       for (float& x : t.f) x = cap * std::tanh(x / cap);
                     }});
  // RoPE's table computed in 16 bits: the angles position x inv_freq, or
  // inv_freq itself, rounded (HF's layout cat(freqs, freqs), its attention
  // scaling fitted from its own table; a bfloat16 model's table rounded too).
  auto rope16 = [bf16](bool is_cos, bool angles, bool to_bf16) {
    return [=](TensorData& t, const TensorSource& g) {
      const std::vector<float> inv = g.get("rope.inv_freq").f, pos = g.get("step0.positions").floats();
      const int64_t T = t.shape[0], D = t.shape[1], half = int64_t(inv.size());
      auto g16 = [to_bf16](float x) { return to_bf16 ? bf16_to_f32(f32_to_bf16(x)) : f16_to_f32(f32_to_f16(x)); };
      auto fn = [is_cos](float a) { return is_cos ? std::cos(a) : std::sin(a); };
      double num = 0, den = 0;
      for (int64_t k = 0; k < T * D; ++k) {
        const double e = fn(pos[size_t(k / D)] * inv[size_t(k % D % half)]);
        num += e * t.f[size_t(k)], den += e * e;
      }
      const double scaling = num / den;
      for (int64_t k = 0; k < T * D; ++k) {
        const float f = inv[size_t(k % D % half)], p = pos[size_t(k / D)];
        const float a = angles ? g16(p * f) : p * g16(f);
        const float v = float(scaling * fn(a));
        t.f[size_t(k)] = bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
      }
    };
  };
  // (A bfloat16 model's table rounds most of the difference away.)
  if (!bf16) {
    cases.push_back({"step0.rope.cos", "precision", "cos of the angles position x inv_freq rounded to bfloat16",
                     rope16(true, true, true)});
    cases.push_back({"step0.rope.sin", "precision", "sin of inv_freq rounded to float16", rope16(false, false, false)});
  }
  // The residual stream cast to bfloat16 before the norm: HF's RMSNorm of
  // the rounded input with the model's own weight, in float32.
  if (!bf16)
    cases.push_back({"step0.layers.1.mlp_norm", "precision",
                     "the norm's input step0.layers.1.attn_residual rounded to bfloat16",
                     [&m](TensorData& t, const TensorSource& g) {
                       const WeightView& wv = m.model.weights->layers[1].post_attn_norm;
                       const int64_t D = t.shape[1], T = t.shape[0];
                       std::vector<float> w(static_cast<size_t>(D));
                       wv.rows_f32(0, 1, w.data());
                       std::vector<float> x = g.get("step0.layers.1.attn_residual").f;
                       for (float& v : x) v = bf16_to_f32(f32_to_bf16(v));
                       for (int64_t r = 0; r < T; ++r) {
                         float ss = 0;
                         for (int64_t j = 0; j < D; ++j) ss += x[size_t(r * D + j)] * x[size_t(r * D + j)];
                         const float k = 1.0f / std::sqrt(ss / float(D) + float(m.model.config.rms_norm_eps));
                         for (int64_t j = 0; j < D; ++j) t.f[size_t(r * D + j)] = w[size_t(j)] * (x[size_t(r * D + j)] * k);
                       }
                     }});
  // RMSNorms of another formula on HF's own input, with the model's weight:
  // Gemma's (1 + weight) and a LayerNorm's mean subtraction.
  auto norm = [&m](const char* weight_of, const char* input, bool one_plus, bool mean, double in_scale) {
    return [&m, weight_of, input, one_plus, mean, in_scale](TensorData& t, const TensorSource& g) {
      const LayerWeights& L = m.model.weights->layers[std::string(weight_of) == "mlp" ? 1 : 0];
      const WeightView& wv = std::string(weight_of) == "mlp" ? L.post_attn_norm : L.input_norm;
      const int64_t D = t.shape[1], T = t.shape[0];
      std::vector<float> w(static_cast<size_t>(D));
      wv.rows_f32(0, 1, w.data());
      // "a+b": the sum of two of HF's tensors, as the residual adds them.
      const std::string in(input);
      const size_t plus = in.find('+');
      std::vector<float> x = g.get(in.substr(0, plus)).f;
      if (plus != std::string::npos) {
        const std::vector<float> y = g.get(in.substr(plus + 1)).f;
        for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
      }
      for (float& e : x) e = float(e * in_scale);
      for (int64_t r = 0; r < T; ++r) {
        double mu = 0, ss = 0;
        if (mean)
          for (int64_t j = 0; j < D; ++j) mu += x[size_t(r * D + j)] / double(D);
        for (int64_t j = 0; j < D; ++j) ss += (x[size_t(r * D + j)] - mu) * (x[size_t(r * D + j)] - mu);
        const double k = 1.0 / std::sqrt(ss / double(D) + m.model.config.rms_norm_eps);
        for (int64_t j = 0; j < D; ++j)
          t.f[size_t(r * D + j)] = float((one_plus ? 1.0 + w[size_t(j)] : w[size_t(j)]) * ((x[size_t(r * D + j)] - mu) * k));
      }
    };
  };
  cases.push_back({"step0.layers.1.mlp_norm", "norm", "applied as (1 + weight) (Gemma's RMSNorm)",
                   norm("mlp", "step0.layers.1.attn_residual", true, false, 1.0)});
  cases.push_back({"step0.layers.0.attn_norm", "norm", "the mean is subtracted first (a LayerNorm",
                   norm("attn", "step0.embed", false, true, 1.0)});
  // The embeddings scaled by 1/sqrt(D) before layer 0: its attn_norm is the
  // norm of HF's embeddings with eps x D (within a bfloat16 model's noise).
  if (!bf16)
    cases.push_back({"step0.layers.0.attn_norm", "norm", "or its input scaled by",
                     norm("attn", "step0.embed", false, false, 1.0 / std::sqrt(double(cfg.hidden_size)))});
  // The attention block's residual connection missing: mlp_norm of attn.out alone.
  cases.push_back({"step0.layers.1.mlp_norm", "alias", "step0.layers.1.attn.out alone reproduces the candidate",
                   norm("mlp", "step0.layers.1.attn.out", false, false, 1.0)});
  // o_proj skipped: mlp_norm of the layer's input plus the attention's context.
  if (g.shape("step0.layers.1.attn.ctx") == g.shape("step0.layers.1.attn.out"))
    cases.push_back({"step0.layers.1.mlp_norm", "alias", "o_proj skipped",
                     norm("mlp", "step0.layers.0.out+step0.layers.1.attn.ctx", false, false, 1.0)});
  // A softmax in float16 throughout (exp, the running sum, the division),
  // from HF's own scores and mask.
  if (!bf16)
    cases.push_back({"step0.layers.0.attn.probs", "precision", "every step of it (the scores, exp, the running sum, "
                     "the division) in float16", [](TensorData& t, const TensorSource& g) {
                       const TensorData sc = g.get("step0.layers.0.attn.scores"), mk = g.get("step0.mask");
                       const int64_t H = t.shape[0], T = t.shape[1], S = t.shape[2];
                       auto h16 = [](float x) { return f16_to_f32(f32_to_f16(x)); };
                       for (int64_t h = 0; h < H; ++h)
                         for (int64_t r = 0; r < T; ++r) {
                           const float* x = sc.f.data() + (h * T + r) * S;
                           float* y = t.f.data() + (h * T + r) * S;
                           float m = -1e30f, sum = 0;
                           for (int64_t k = 0; k < S; ++k)
                             if (mk.f[size_t(r * S + k)] != 0) m = std::max(m, h16(x[k]));
                           for (int64_t k = 0; k < S; ++k) {
                             y[k] = 0;
                             if (mk.f[size_t(r * S + k)] == 0) continue;
                             y[k] = h16(std::exp(h16(x[k]) - m));
                             sum = h16(sum + y[k]);
                           }
                           for (int64_t k = 0; k < S; ++k) y[k] = h16(y[k] / sum);
                         }
                     }});
  // Attention done differently, seen at attn.ctx alone (an engine recorded
  // by module hooks records nothing inside attention): HF's eager attention
  // from its own rotated q (attn.q_rope) and grouped keys and values
  // (attn.k_rep, attn.v_rep) with one change; GQA models.
  if (!cfg.mla.enabled) {
    // keys: 'k' HF's; 'v' keys and values swapped (the values rotated as
    // keys, the keys' projection summed); 'p' q and k rotated on their first
    // Dh/2 dims only (frequencies theta^(-2i/(Dh/2))).
    auto attention = [bf16, &cfg](char keys, double scale, int64_t late) {
      return [=, &cfg](TensorData& t, const TensorSource& g) {
        const TensorData cos = g.get("step0.rope.cos"), sin = g.get("step0.rope.sin");
        std::vector<float> q = g.get("step0.layers.0.attn.q_rope").f;    // [H, T, D]
        std::vector<float> k = g.get("step0.layers.0.attn.k_rep").f;     // [H, S, D]
        std::vector<float> val = g.get("step0.layers.0.attn.v_rep").f;   // [H, S, D]
        const Shape vs = g.shape("step0.layers.0.attn.v_rep");
        const int64_t H = vs[0], S = vs[1], D = vs[2], T = t.shape[0];
        auto rotate = [&](float* x, int64_t pos, int64_t R, bool own) {  // rotate-half on the first R dims
          std::vector<double> y(x, x + D);
          for (int64_t i = 0; i < R / 2; ++i) {
            const double a = double(pos) / std::pow(cfg.rope_theta, double(2 * i) / double(R));
            const double c = own ? std::cos(a) : cos.f[size_t(pos * D + i)];
            const double s = own ? std::sin(a) : sin.f[size_t(pos * D + i)];
            y[size_t(i)] = x[i] * c - x[i + R / 2] * s;
            y[size_t(i + R / 2)] = x[i + R / 2] * c + x[i] * s;
          }
          for (int64_t i = 0; i < D; ++i) x[i] = float(y[size_t(i)]);
        };
        // The projections (after Qwen3's q/k norms), head-major and grouped.
        const bool normed = g.has("step0.layers.0.attn.q_norm");
        const TensorData qp = g.get(normed ? "step0.layers.0.attn.q_norm" : "step0.layers.0.attn.q"),
                         kp = g.get(normed ? "step0.layers.0.attn.k_norm" : "step0.layers.0.attn.k");
        const int64_t Hkv = kp.shape[1] / D;
        auto k_proj = [&](int64_t h, int64_t p) { return kp.f.data() + (p * Hkv + h / (H / Hkv)) * D; };
        if (keys == 'v') {
          std::swap(k, val);
          for (int64_t h = 0; h < H; ++h)
            for (int64_t p = 0; p < S; ++p) {
              rotate(k.data() + (h * S + p) * D, p, D, false);
              std::copy_n(k_proj(h, p), D, val.data() + (h * S + p) * D);
            }
        }
        if (keys == 'p')
          for (int64_t h = 0; h < H; ++h) {
            for (int64_t p = 0; p < T; ++p) {
              std::copy_n(qp.f.data() + (p * H + h) * D, D, q.data() + (h * T + p) * D);
              rotate(q.data() + (h * T + p) * D, p, D / 2, true);
            }
            for (int64_t p = 0; p < S; ++p) {
              std::copy_n(k_proj(h, p), D, k.data() + (h * S + p) * D);
              rotate(k.data() + (h * S + p) * D, p, D / 2, true);
            }
          }
        if (keys == 'q') {  // the softmax over the queries: per key p, over the rows that see it
          for (int64_t h = 0; h < H; ++h) {
            std::vector<double> w(static_cast<size_t>(T * S), 0.0);
            for (int64_t p = 0; p < S; ++p) {
              double top = -1e300, sum = 0;
              for (int64_t r = std::max<int64_t>(0, p - (S - T)); r < T; ++r) {
                double d = 0;
                for (int64_t i = 0; i < D; ++i) d += double(q[size_t((h * T + r) * D + i)]) * k[size_t((h * S + p) * D + i)];
                top = std::max(top, w[size_t(r * S + p)] = d * scale);
              }
              for (int64_t r = std::max<int64_t>(0, p - (S - T)); r < T; ++r)
                sum += w[size_t(r * S + p)] = std::exp(w[size_t(r * S + p)] - top);
              for (int64_t r = std::max<int64_t>(0, p - (S - T)); r < T; ++r) w[size_t(r * S + p)] /= sum;
            }
            for (int64_t r = 0; r < T; ++r)
              for (int64_t i = 0; i < D; ++i) {
                double acc = 0;
                for (int64_t p = 0; p < S; ++p) acc += w[size_t(r * S + p)] * val[size_t((h * S + p) * D + i)];
                t.f[size_t(r * H * D + h * D + i)] = bf16 ? bf16_to_f32(f32_to_bf16(float(acc))) : float(acc);
              }
          }
          return;
        }
        for (int64_t h = 0; h < H; ++h)
          for (int64_t r = 0; r < T; ++r) {
            const int64_t last = std::min(S - 1, S - T + r + late);  // the last key row r sees
            std::vector<double> w(static_cast<size_t>(last + 1));
            double top = -1e300, sum = 0;
            for (int64_t p = 0; p <= last; ++p) {
              double d = 0;
              for (int64_t i = 0; i < D; ++i) d += double(q[size_t((h * T + r) * D + i)]) * k[size_t((h * S + p) * D + i)];
              top = std::max(top, w[size_t(p)] = d * scale);
            }
            for (double& x : w) sum += x = std::exp(x - top);
            for (int64_t i = 0; i < D; ++i) {
              double acc = 0;
              for (int64_t p = 0; p <= last; ++p) acc += w[size_t(p)] / sum * val[size_t((h * S + p) * D + i)];
              t.f[size_t(r * H * D + h * D + i)] = bf16 ? bf16_to_f32(f32_to_bf16(float(acc))) : float(acc);
            }
          }
      };
    };
    const double inv_sqrt = 1.0 / std::sqrt(double(Dh));
    cases.push_back({"step0.layers.0.attn.ctx", "mask", "the causal mask one key late", attention('k', inv_sqrt, 1)});
    cases.push_back({"step0.layers.0.attn.ctx", "scale", "scores q.k not scaled", attention('k', 1.0, 0)});
    cases.push_back({"step0.layers.0.attn.ctx", "alias", "keys and values swapped", attention('v', inv_sqrt, 0)});
    cases.push_back({"step0.layers.0.attn.ctx", "softmax-axis", "the softmax taken over the queries of the call",
                     attention('q', inv_sqrt, 0)});
    cases.push_back({"step0.layers.0.attn.ctx", "rotary-width",
                     "RoPE on the first R = " + std::to_string(Dh / 2) + " of " + std::to_string(Dh) + " dims",
                     attention('p', inv_sqrt, 0)});
  }
  // RoPE over another width than the model's, from HF's own pre-rope values
  // (apply_rotary_pos_emb on x[..., start:start+R], the rest passed through;
  // rotate_half pairs, GPT-J's adjacent pairs, or DeepSeek's pairs reordered
  // to halves first), the angles position x inv_freq in float32.
  enum class Pairs { Halves, Adjacent, ReorderedToHalves };
  // x: rows of Dw values, row r at position pos[r % T].
  auto rope_part = [bf16](std::vector<float> x, int64_t Dw, const std::vector<float>& pos, const std::vector<float>& inv,
                          int64_t start, Pairs pairs) {
    const int64_t T = int64_t(pos.size()), R = 2 * int64_t(inv.size());
    for (size_t row = 0; row * size_t(Dw) < x.size(); ++row) {
      float* v = x.data() + row * size_t(Dw) + start;
      std::vector<float> in(v, v + R);
      if (pairs == Pairs::ReorderedToHalves)  // cat(x[0::2], x[1::2])
        for (int64_t i = 0; i < R / 2; ++i) in[size_t(i)] = v[2 * i], in[size_t(i + R / 2)] = v[2 * i + 1];
      const float p = pos[row % size_t(T)];
      for (int64_t i = 0; i < R; ++i) {
        const int64_t fi = pairs == Pairs::Adjacent ? i / 2 : i % (R / 2);
        const float cs = std::cos(p * inv[size_t(fi)]), sn = std::sin(p * inv[size_t(fi)]);
        // rotate_half: (-x2, x1); adjacent: (-x[2i+1], x[2i])
        const float rot = pairs == Pairs::Adjacent ? (i % 2 == 0 ? -in[size_t(i + 1)] : in[size_t(i - 1)])
                                                   : (i < R / 2 ? -in[size_t(i + R / 2)] : in[size_t(i - R / 2)]);
        const float y = in[size_t(i)] * cs + rot * sn;
        v[i] = bf16 ? bf16_to_f32(f32_to_bf16(y)) : y;
      }
    }
    return x;
  };
  auto theta_freqs = [&cfg](int64_t R) {  // HF's default inv_freq over R dims
    std::vector<float> inv(size_t(R / 2));
    for (int64_t i = 0; i < R / 2; ++i) inv[size_t(i)] = float(1.0 / std::pow(cfg.rope_theta, double(2 * i) / double(R)));
    return inv;
  };
  // [T, H*Dw] -> [H, T, Dw]
  auto heads_first = [](const TensorData& x, int64_t H) {
    const int64_t T = x.shape[0], Dw = x.shape[1] / H;
    std::vector<float> out(x.f.size());
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) std::copy_n(x.f.begin() + (t * H + h) * Dw, Dw, out.begin() + (h * T + t) * Dw);
    return out;
  };
  if (!cfg.mla.enabled) {
    // GPT-NeoX's partial rotary (partial_rotary_factor 0.5) on q; k rotated
    // over its first Dh/4 dims in adjacent pairs at the model's own first
    // Dh/8 frequencies (its rope.inv_freq, rope scaling included).
    const std::string q_in = cfg.qk_norm ? "step0.layers.0.attn.q_norm" : "step0.layers.0.attn.q";
    const std::string k_in = cfg.qk_norm ? "step0.layers.0.attn.k_norm" : "step0.layers.0.attn.k";
    cases.push_back({"step0.layers.0.attn.q_rope", "rotary-width",
                     "RoPE applied to the first R = " + std::to_string(Dh / 2) + " of " + std::to_string(Dh) +
                         " dims of each head (frequencies theta^(-2i/" + std::to_string(Dh / 2) + "), pairs (i, i+R/2))"
                         "; the reference rotates all " + std::to_string(Dh) + ": a partial rotary width "
                         "(partial_rotary_factor 0.5)",
                     [=](TensorData& t, const TensorSource& g) {
                       const std::vector<float> pos = g.get("step0.positions").floats();
                       t.f = rope_part(heads_first(g.get(q_in), cfg.num_attention_heads), Dh, pos, theta_freqs(Dh / 2),
                                       0, Pairs::Halves);
                     }});
    cases.push_back({"step0.layers.0.attn.k_rope", "rotary-width",
                     "RoPE applied to the first R = " + std::to_string(Dh / 4) + " of " + std::to_string(Dh) +
                         " dims of each head (frequencies the model's first " + std::to_string(Dh / 8) + " of " +
                         std::to_string(Dh / 2) + ", theta^(-2i/" + std::to_string(Dh) + "), pairs (2i, 2i+1) in place)",
                     [=](TensorData& t, const TensorSource& g) {
                       const std::vector<float> pos = g.get("step0.positions").floats(), inv = g.get("rope.inv_freq").f;
                       t.f = rope_part(heads_first(g.get(k_in), cfg.num_key_value_heads), Dh, pos,
                                       std::vector<float>(inv.begin(), inv.begin() + Dh / 8), 0, Pairs::Adjacent);
                     }});
  } else {
    // MLA: qk_rope_head_dim taken as 2 Dr for q (its last 2 Dr dims rotated
    // at theta^(-2i/2Dr)); k_pe rotated over its first Dr/2 dims only; q's
    // rope dims left in adjacent pairs where HF's are in halves order.
    const int64_t Dr = cfg.mla.qk_rope_head_dim, Hq = cfg.num_attention_heads;
    const Pairs model = cfg.mla.rope_interleave ? Pairs::ReorderedToHalves : Pairs::Halves;
    cases.push_back({"step0.layers.0.attn.q_rope", "rotary-width",
                     "RoPE applied to the last R = " + std::to_string(2 * Dr) + " dims of each head (frequencies "
                     "theta^(-2i/" + std::to_string(2 * Dr) + ")",
                     [=](TensorData& t, const TensorSource& g) {
                       const std::vector<float> pos = g.get("step0.positions").floats();
                       t.f = rope_part(heads_first(g.get("step0.layers.0.attn.q"), Hq), Dh, pos, theta_freqs(2 * Dr),
                                       Dh - 2 * Dr, model);
                     }});
    cases.push_back({"step0.layers.0.attn.k_pe", "rotary-width",
                     "RoPE applied to the first R = " + std::to_string(Dr / 2) + " of the Dr = " + std::to_string(Dr) +
                         " rope dims of k_pe (frequencies theta^(-2i/" + std::to_string(Dr / 2) + ")",
                     [=](TensorData& t, const TensorSource& g) {
                       const TensorData kv_a = g.get("step0.layers.0.attn.kv_a");  // [T, Rkv+Dr]
                       const int64_t T = kv_a.shape[0], W = kv_a.shape[1];
                       std::vector<float> x(size_t(T * Dr));
                       for (int64_t r = 0; r < T; ++r) std::copy_n(kv_a.f.begin() + r * W + W - Dr, Dr, x.begin() + r * Dr);
                       t.f = rope_part(x, Dr, g.get("step0.positions").floats(), theta_freqs(Dr / 2), 0, model);
                     }});
    cases.push_back({"step0.layers.0.attn.q_rope", "permutation",
                     "RoPE pairs interleaved (2i, 2i+1) where the reference pairs (i, i+Dr/2), in the Dr = " +
                         std::to_string(Dr) + " rope dims of each head",
                     [=](TensorData& t, const TensorSource& g) {
                       const TensorData r = g.get("step0.layers.0.attn.q_rope");  // [Hq, T, Dn+Dr], rope dims last
                       for (size_t b = 0; b < t.f.size(); b += size_t(Dh))
                         for (int64_t i = 0; i < Dr / 2; ++i) {
                           const size_t at = b + size_t(Dh - Dr);
                           t.f[at + size_t(2 * i)] = r.f[at + size_t(i)];
                           t.f[at + size_t(2 * i + 1)] = r.f[at + size_t(i + Dr / 2)];
                         }
                     }});
  }
  // x [T, in] times the [out, in] weight W: x W^T as HF, or with the memory
  // read as [in, out] (x W), in double, stored at the model's precision.
  auto project = [bf16](const std::vector<float>& x, const WeightView& W, bool transposed, TensorData& t) {
    const int64_t out = W.shape[0], in = W.shape[1], T = int64_t(x.size()) / in;
    std::vector<float> w(size_t(out * in));
    W.rows_f32(0, out, w.data());
    for (int64_t r = 0; r < T; ++r)
      for (int64_t c = 0; c < out; ++c) {
        double acc = 0;
        for (int64_t i = 0; i < in; ++i)
          acc += double(x[size_t(r * in + i)]) * w[size_t(transposed ? i * out + c : c * in + i)];
        t.f[size_t(r * out + c)] = bf16 ? bf16_to_f32(f32_to_bf16(float(acc))) : float(acc);
      }
  };
  // o_proj's [out, in] data read as [in, out] (x W instead of x W^T), from HF's own attn.ctx.
  cases.push_back({"step0.layers.0.attn.out", "transposed-weight", "weight matrix transposed",
                   [&m, project](TensorData& t, const TensorSource& g) {
                     project(g.get("step0.layers.0.attn.ctx").f, m.model.weights->layers[0].o, true, t);
                   }});
  // The final norm skipped: lm_head (or the tied embedding) on HF's own last
  // layer output.
  cases.push_back({"step0.logits", "alias", "the RMSNorm before it skipped",
                   [&m, project](TensorData& t, const TensorSource& g) {
                     const ModelWeights& mw = *m.model.weights;
                     const WeightView& W = mw.lm_head_tied || !mw.lm_head ? mw.embed : mw.lm_head;
                     project(g.get(layer_name(0, int(mw.layers.size()) - 1, "out")).f, W, false, t);
                   }});
  return cases;
}

class BisectSignatures : public ::testing::TestWithParam<std::string> {};

TEST_P(BisectSignatures, ErrorsOutsideTheZooGetTheirSignature) {
  const std::string model = GetParam();
  const bisect::ModelOracles& m = oracles(model);
  DumpFile golden(golden_dump(model, "decode"));
  for (const SignatureCase& c : signature_cases(m, golden)) {
    SCOPED_TRACE(model + " " + c.name + " " + c.kind + " (" + c.detail + ")");
    ASSERT_TRUE(golden.has(c.name));
    MemoryDump cand("transformed");
    cand.mutable_manifest() = golden.manifest();
    for (const auto& n : golden.names()) {
      TensorData t = golden.get(n);
      if (n == c.name) c.change(t, golden);
      cand.put(t);
    }
    BisectResult r = bisect::bisect_candidate(m, cand, BisectOptions{});
    SCOPED_TRACE(describe(r));
    EXPECT_EQ(r.exit_code(), 1);
    EXPECT_EQ(r.localised_at().value_or(""), c.name);
    EXPECT_FALSE(compare::named_bug(r.finding));
    const compare::ErrorSignature* hit = nullptr;
    for (const auto& g : r.diagnosis.signatures)
      if (g.name == c.name && g.kind == c.kind && g.detail.find(c.detail) != std::string::npos) hit = &g;
    ASSERT_TRUE(hit != nullptr);
    if (c.headline) {
      EXPECT_TRUE(hit->decisive);
      EXPECT_TRUE(r.finding.kind == compare::FindingKind::Signature || r.finding.kind == compare::FindingKind::Layout)
          << compare::kind_name(r.finding.kind);
    }
    // Reported in every format.
    const nlohmann::json j = nlohmann::json::parse(compare::render_bisect_json(r));
    bool in_json = false;
    for (const auto& s : j["diagnosis"]["signatures"])
      in_json = in_json || (s["kind"] == c.kind && s["name"] == c.name &&
                            s["detail"].get<std::string>().find(c.detail) != std::string::npos);
    EXPECT_TRUE(in_json);
    EXPECT_NE(compare::render_bisect_markdown(r).find(hit->detail), std::string::npos);
    EXPECT_NE(compare::render_bisect_table(r).find(hit->detail), std::string::npos);
  }
}

// Whether every format says the "only-some" signature whose detail holds
// `words`: JSON (diagnosis.signatures), Markdown, the text table, HTML and
// JUnit's failure.
// "steps 1, 2 and 3", "step 1": the steps from 1 to n - 1.
std::string later_steps(size_t n) {
  std::string o = n > 2 ? "steps " : "step ";
  for (size_t s = 1; s < n; ++s) o += (s == 1 ? "" : s + 1 == n ? " and " : ", ") + std::to_string(s);
  return o;
}

void says_only_some(const BisectResult& r, const std::string& words) {
  SCOPED_TRACE("only-some: " + words);
  const compare::ErrorSignature* hit = nullptr;
  for (const auto& g : r.diagnosis.signatures)
    if (g.kind == compare::kOnlySomeKind && g.detail.find(words) != std::string::npos) hit = &g;
  ASSERT_TRUE(hit != nullptr);
  EXPECT_FALSE(hit->decisive);
  EXPECT_EQ(hit->name, r.localised_at().value_or(""));
  const nlohmann::json j = nlohmann::json::parse(compare::render_bisect_json(r));
  bool in_json = false;
  for (const auto& s : j["diagnosis"]["signatures"])
    in_json = in_json || (s["kind"] == compare::kOnlySomeKind && s["name"] == hit->name &&
                          s["detail"].get<std::string>().find(words) != std::string::npos);
  EXPECT_TRUE(in_json);
  EXPECT_NE(compare::render_bisect_markdown(r).find("**only-some**: " + hit->detail), std::string::npos);
  EXPECT_NE(compare::render_bisect_table(r).find(hit->name + ": only-some: " + hit->detail), std::string::npos);
  EXPECT_NE(compare::render_bisect_html(r).find(compare::html::esc(hit->detail)), std::string::npos);
  EXPECT_NE(compare::render_bisect_junit(r).find(compare::xml_escape(hit->detail)), std::string::npos);
}

// Evidence across names, on HF's own dump changed at one op's k side from
// the first decode step on: layer 0's attn.k_rope (q, v, the other layers
// and the prefill as HF computed them). The signatures say that only k
// fails there (q_rope passes), only at the decode steps and only at layer
// 0; no zoo bug is claimed.
TEST_P(BisectSignatures, OnlyKAtTheDecodeStepsOfOneLayerIsSaidAcrossNames) {
  const std::string model = GetParam();
  const bisect::ModelOracles& m = oracles(model);
  DumpFile golden(golden_dump(model, "decode"));
  const std::vector<std::vector<int64_t>> steps = golden.step_tokens();
  ASSERT_GE(steps.size(), 3u);
  for (size_t s = 1; s < steps.size(); ++s) ASSERT_EQ(steps[s].size(), 1u);
  MemoryDump cand("k_rope changed at decode steps");
  cand.mutable_manifest() = golden.manifest();
  for (const auto& n : golden.names()) {
    TensorData t = golden.get(n);
    const CanonName c = parse_name(n);
    if (c.kind == CanonName::Kind::Layer && c.layer == 0 && c.step >= 1 && c.site == "attn.k_rope")
      for (size_t i = 0; i < t.f.size(); ++i) t.f[i] = t.f[i] * 1.5f + 0.25f * std::sin(float(i));
    cand.put(t);
  }
  BisectResult r = bisect::bisect_candidate(m, cand, BisectOptions{});
  SCOPED_TRACE(describe(r));
  EXPECT_EQ(r.exit_code(), 1);
  ASSERT_EQ(r.localised_at().value_or(""), "step1.layers.0.attn.k_rope");
  EXPECT_FALSE(compare::named_bug(r.finding));
  const size_t n = steps.size();
  says_only_some(r, "attn.k_rope fails locally at layer 0 (" + later_steps(n) + " of " + std::to_string(n) +
                        ") while attn.q_rope passes there: only k is wrong, q is right");
  says_only_some(r, "attn.k_rope at layer 0 fails locally at " + std::to_string(n - 1) + " of " + std::to_string(n) +
                        " forward calls (" + later_steps(n) + ") and passes at step 0: every decode step (T = 1), "
                        "never the prefill (T = " + std::to_string(steps[0].size()) + ")");
  says_only_some(r, "attn.k_rope fails locally at layer 0 of the " + std::to_string(m.model.config.num_hidden_layers) +
                        " layers holding it");
}

INSTANTIATE_TEST_SUITE_P(AllGolden, BisectSignatures, ::testing::ValuesIn(golden_models()),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& ch : s)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return s;
                         });

// The rotary width is named from a dump holding little more than the RoPE
// output and its pre-rope input (tokens, positions, those two, each layer's
// output, logits), and never when the RoPE is right on a wrong input (q and
// q_rope, or MLA's kv_a and k_pe, both twice HF's: a scale, not a width).
TEST(BisectSignatures, RotaryWidthFromACutDownDumpAndNotOnAWrongInput) {
  for (const std::string model : {"llama-gqa", "deepseek-v3-mla"}) {
    const bisect::ModelOracles& m = oracles(model);
    DumpFile golden(golden_dump(model, "decode"));
    int cases = 0;
    for (const SignatureCase& c : signature_cases(m, golden)) {
      if (c.kind != "rotary-width" || c.name.find("attn.ctx") != std::string::npos) continue;  // the RoPE outputs
      ++cases;
      SCOPED_TRACE(model + " " + c.name + " (" + c.detail + ")");
      const bool mla = m.model.config.mla.enabled, is_q = c.name.find("attn.q_rope") != std::string::npos;
      const std::string input = layer_name(0, 0, mla ? (is_q ? "attn.q" : "attn.kv_a") : is_q ? "attn.q" : "attn.k");
      MemoryDump cand("transformed, cut down");
      cand.mutable_manifest() = golden.manifest();
      for (const auto& n : golden.names()) {
        const CanonName cn = parse_name(n);
        const bool keep = n == c.name || n == input || cn.kind == CanonName::Kind::Generated ||
                          (cn.kind == CanonName::Kind::Step && (cn.site == "tokens" || cn.site == "positions" ||
                                                                cn.site == "logits")) ||
                          (cn.kind == CanonName::Kind::Layer && cn.site == "out");
        if (!keep) continue;
        TensorData t = golden.get(n);
        if (n == c.name) c.change(t, golden);
        cand.put(t);
      }
      ASSERT_TRUE(cand.has(input));
      ASSERT_FALSE(cand.has(layer_name(0, 0, "attn_norm")));
      BisectResult r = bisect::bisect_candidate(m, cand, BisectOptions{});
      SCOPED_TRACE(describe(r));
      EXPECT_EQ(r.exit_code(), 1);
      EXPECT_EQ(r.localised_at().value_or(""), c.name);
      EXPECT_EQ(r.finding.kind, compare::FindingKind::Signature) << compare::kind_name(r.finding.kind);
      EXPECT_EQ(r.finding.signature.kind, "rotary-width");
      EXPECT_NE(r.finding.signature.detail.find(c.detail), std::string::npos) << r.finding.signature.detail;
    }
    EXPECT_GE(cases, 2);
    // The RoPE right, its input wrong: both sides twice HF's.
    const bool mla = m.model.config.mla.enabled;
    const std::string input = mla ? "step0.layers.0.attn.kv_a" : "step0.layers.0.attn.q",
                      output = mla ? "step0.layers.0.attn.k_pe" : "step0.layers.0.attn.q_rope";
    MemoryDump doubled("input and RoPE output doubled");
    doubled.mutable_manifest() = golden.manifest();
    for (const auto& n : golden.names()) {
      TensorData t = golden.get(n);
      if (n == input || n == output)
        for (float& x : t.f) x *= 2.0f;
      doubled.put(t);
    }
    const std::vector<compare::ErrorSignature> sigs =
        compare::error_signatures(output, doubled, golden, m.model.config);
    ASSERT_FALSE(sigs.empty());
    EXPECT_EQ(sigs.front().kind, "scale") << sigs.front().detail;
    for (const auto& g : sigs) EXPECT_NE(g.kind, "rotary-width") << g.detail;
  }
}

// Zoo bugs that act only once something is cached, on a dense and an MLA
// model: beside the bug named, the signature across names says at which
// forward calls the mask fails (every decode step; the later chunk of a
// chunked prefill) and that it passes at the first call.
TEST(BisectCrossSignatures, BugsOfTheCachedCallsAreSaidByTheCallsTheyFailAt) {
  for (const std::string model : {"llama-gqa", "deepseek-v3-mla"}) {
    const bisect::ModelOracles& m = oracles(model);
    for (const std::string scenario : {"decode", "chunked"})
      for (const std::string bug : {"mask-square", "kv-overwrite"}) {
        SCOPED_TRACE(model + " " + scenario + " " + bug);
        const Scenario sc = golden_scenario(model, scenario);
        BisectResult r = bisect::bisect_candidate(m, *impl_candidate(m, sc, {bug}), BisectOptions{});
        SCOPED_TRACE(describe(r));
        ASSERT_TRUE(compare::named_bug(r.finding).has_value());
        EXPECT_EQ(compare::named_bug(r.finding)->bug, bug);
        ASSERT_EQ(r.localised_at().value_or(""), "step1.mask");
        const size_t n = sc.steps.size();
        const std::string calls = "mask fails locally at " + std::to_string(n - 1) + " of " + std::to_string(n) +
                                  " forward calls";
        const std::string at = calls + " (" + later_steps(n) + ") and passes at step 0: ";
        if (scenario == "decode")
          says_only_some(r, at + "every decode step (T = 1), never the prefill (T = " +
                                std::to_string(sc.steps[0].size()) + ")");
        else
          says_only_some(r, at + "every chunk of the prompt after the first");
      }
  }
}

// kv-overwrite and mask-square both change the decode mask; the cache length
// tells them apart: each fingerprint fires on its own bug only, in full and
// cut-down dumps, and the bisection names the right one.
TEST(BisectFingerprints, KvOverwriteAndMaskSquareAreToldApart) {
  const bisect::ModelOracles& m = oracles("llama-gqa");
  for (const std::string scenario : {"decode", "chunked"}) {
    for (const std::string bug : {"kv-overwrite", "mask-square"}) {
      const std::string other = bug == "kv-overwrite" ? "mask-square" : "kv-overwrite";
      std::unique_ptr<MemoryDump> full = impl_candidate(m, golden_scenario("llama-gqa", scenario), {bug});
      std::unique_ptr<MemoryDump> cut = cut_down(*full);
      for (const MemoryDump* cand : {full.get(), cut.get()}) {
        BisectResult r = bisect::bisect_candidate(m, *cand, BisectOptions{});
        SCOPED_TRACE(scenario + " " + cand->label() + ": " + describe(r));
        ASSERT_TRUE(compare::named_bug(r.finding).has_value());
        EXPECT_EQ(compare::named_bug(r.finding)->bug, bug);
        for (const compare::Fingerprint& f : r.diagnosis.fingerprints)
          EXPECT_FALSE(f.bug == other && f.decisive) << f.evidence;
        if (cand == full.get()) {
          bool own = false;
          for (const compare::Fingerprint& f : r.diagnosis.fingerprints) own = own || (f.bug == bug && f.decisive);
          EXPECT_TRUE(own);
        }
        // Both bugs change no call before the first decode step or later
        // chunk: replayed from call 1 on the candidate's caches of call 0
        // when it recorded them, from call 0 when it did not.
        for (const compare::HypothesisEvidence& e : r.diagnosis.ranked)
          if (e.hypothesis.bug == bug) {
            EXPECT_TRUE(e.replayed);
            EXPECT_TRUE(e.supported_by_replay) << e.summary;
            EXPECT_EQ(e.replay_from_step, cand == full.get() ? 1 : 0) << e.summary;
          }
      }
    }
  }
}

// HF's own bfloat16 run declared float32 (an engine that rounds its matmul
// inputs to the weights' dtype but says float32): not a bug; the report says
// which dtype to declare. Declared bfloat16 it passes.
TEST(BisectPrecision, ABfloat16RunDeclaredFloat32IsToldWhichDtypeToDeclare) {
  const bisect::ModelOracles& m = oracles("llama-mha-bf16");
  DumpFile golden(golden_dump("llama-mha-bf16", "decode"));
  MemoryDump declared("hf bf16 declared float32");
  declared.mutable_manifest() = golden.manifest();
  declared.mutable_manifest().dtype = "float32";
  for (const auto& n : golden.names()) declared.put(golden.get(n));
  BisectResult r = bisect::bisect_candidate(m, declared, BisectOptions{});
  SCOPED_TRACE(describe(r));
  EXPECT_EQ(r.exit_code(), 1);
  ASSERT_EQ(r.finding.kind, compare::FindingKind::Precision);
  ASSERT_EQ(r.finding.declare, compare::Declaration::ComputeDtype);
  EXPECT_EQ(r.finding.dtype, ComputeDType::BFloat16);
  EXPECT_FALSE(compare::named_bug(r.finding));
  EXPECT_EQ(compare::basis_label(r.finding).value_or(""), "precision");
  EXPECT_NE(r.finding.evidence.find("\"dtype\": \"bfloat16\""), std::string::npos);
  EXPECT_EQ(bisect::bisect_candidate(m, golden, BisectOptions{}).exit_code(), 0);
}

// ---------------------------------------------------------------------------
// Honest implementations pass.

class BisectClean : public ::testing::TestWithParam<std::string> {};

TEST_P(BisectClean, CleanImplDumpsPassTheNoiseFloor) {
  const std::string model = GetParam();
  const bisect::ModelOracles& m = oracles(model);
  for (const std::string scenario : {"decode", "chunked", "prefill"}) {
    std::unique_ptr<MemoryDump> full = impl_candidate(m, golden_scenario(model, scenario), {});
    std::unique_ptr<MemoryDump> cut = cut_down(*full);
    for (const MemoryDump* cand : {full.get(), cut.get()}) {
      BisectResult r = bisect::bisect_candidate(m, *cand, BisectOptions{});
      SCOPED_TRACE(scenario + " " + cand->label() + ": " + describe(r));
      EXPECT_TRUE(r.ok());
      EXPECT_EQ(r.exit_code(), 0);
      EXPECT_TRUE(r.noise_floor);
      EXPECT_EQ(r.dtype, ComputeDType::Float32);  // the impl computes in float32, also from bf16 weights
      EXPECT_GE(r.global.tensors.size(), 5u);
      EXPECT_TRUE(r.local.ran);
      EXPECT_GE(r.local.sites.size(), 4u);
      for (const auto& n : r.local.not_recomputed) EXPECT_EQ(parse_name(n).site, "tokens") << n;
      EXPECT_EQ(r.finding.kind, compare::FindingKind::Passes);
      EXPECT_FALSE(compare::named_bug(r.finding));
      EXPECT_TRUE(r.diagnosis.signatures.empty());
    }
  }
}

TEST_P(BisectClean, HuggingFaceGoldenDumpsPassAsExternalCandidates) {
  const std::string model = GetParam();
  const bisect::ModelOracles& m = oracles(model);
  for (const std::string scenario : {"decode", "chunked", "prefill"}) {
    DumpFile golden(golden_dump(model, scenario));
    BisectResult r = bisect::bisect_candidate(m, golden, BisectOptions{});
    SCOPED_TRACE(scenario + ": " + describe(r));
    EXPECT_TRUE(r.ok());
    EXPECT_EQ(r.dtype, m.model.config.default_dtype());  // bfloat16 for llama-mha-bf16: judged with m = 3
    EXPECT_TRUE(r.local.ran);
    EXPECT_EQ(r.local.failing(), 0u);
    EXPECT_TRUE(r.diagnosis.signatures.empty());  // nothing, across names either, on a correct engine
  }
}

// The model's RoPE bug of the zoo: MLA's rope layout, else the pairing.
std::string rope_bug(const ModelConfig& cfg) { return cfg.mla.enabled ? "mla-rope-layout" : "rope-interleaved"; }

// The reference's local noise at a site is its own op at the candidate's
// dtype on the candidate's inputs against their float64 recompute, made
// only where the local error exceeds the floor alone (RefOnDemand): every
// verdict, note and first failure is the one the reference's ops at every
// site give, for a candidate with a bug and for HF's own dump, and the
// noise judged is that op's. On HF's own prefill of a dense golden (which
// the ref reproduces bit for bit here) the noise is the candidate's local
// error itself.
TEST_P(BisectClean, TheReferencesLocalNoiseIsItsOpOnTheCandidatesInputsWhereNeeded) {
  const std::string model = GetParam();
  const bisect::ModelOracles& m = oracles(model);
  const Scenario sc = golden_scenario(model);
  const std::string bug = rope_bug(m.model.config);
  std::unique_ptr<MemoryDump> bugged = impl_candidate(m, sc, {bug});
  DumpFile golden(golden_dump(model, "decode")), prefill(golden_dump(model, "prefill"));
  const ComputeDType own = m.model.config.default_dtype();
  const std::vector<std::pair<const TensorSource*, ComputeDType>> cases = {
      {bugged.get(), ComputeDType::Float32}, {&golden, own}, {&prefill, own}};
  const bool bit_exact = !m.model.config.moe.enabled() && !m.model.config.mla.enabled;
  for (const auto& [cand, dtype] : cases) {
    SCOPED_TRACE(cand->label());
    auto cand_local = m.oracle.recompute(*cand, ComputeDType::Float64);
    auto every = m.oracle.recompute(*cand, dtype);
    size_t made = 0;
    compare::RefOnDemand lazy([&](const std::vector<std::string>& sites) {
      made += sites.size();
      return m.oracle.recompute(*cand, dtype, nullptr, &sites);
    });
    const compare::LocalReport a = compare::judge_local(*cand, *cand_local, &every->values, cand_local.get(), dtype);
    const compare::LocalReport b =
        compare::judge_local(*cand, *cand_local, nullptr, cand_local.get(), dtype, {}, nullptr, &lazy);
    ASSERT_EQ(a.sites.size(), b.sites.size());
    EXPECT_EQ(a.first_failure, b.first_failure);
    EXPECT_EQ(a.failing(), b.failing());
    size_t within = 0;
    for (size_t k = 0; k < a.sites.size(); ++k) {
      const compare::LocalSite &x = a.sites[k], &y = b.sites[k];
      EXPECT_EQ(x.name, y.name);
      EXPECT_EQ(x.pass, y.pass) << x.name << ": " << x.note;
      EXPECT_EQ(x.note, y.note) << x.name;
      if (y.within_floor) {
        ++within;
        EXPECT_TRUE(y.pass && !y.has_ref_noise) << y.name;
        EXPECT_LE(x.noise.cand_rmse, x.noise.floor) << x.name;
      } else if (y.has_ref_noise) {
        EXPECT_EQ(x.noise.ref_rmse, y.noise.ref_rmse) << x.name;
        const TensorData r = every->values.get(x.name), l = cand_local->values.get(x.name);
        EXPECT_EQ(y.noise.ref_rmse, compare::rmse(r.f.data(), l.f.data(), r.numel())) << x.name;
        if (cand == &prefill && bit_exact) {
          EXPECT_EQ(y.noise.ref_rmse, y.noise.cand_rmse) << y.name;
        }
      }
    }
    EXPECT_EQ(made, lazy.asked());
    EXPECT_EQ(made + within, b.sites.size() - std::count_if(b.sites.begin(), b.sites.end(), [](const auto& s) {
                                return s.is_int || !s.shape_match;
                              }));
    if (cand == bugged.get()) {
      EXPECT_GT(a.failing(), 0u);
      EXPECT_LT(made, a.sites.size());  // not every site
    }
  }
}

// The global comparison and the local verdicts judge several names at a
// time: for a candidate with a bug (thousands of diverging names, layout
// explanations, lazily made reference noise) every result is the one a
// single thread gives, field by field, in canonical order.
TEST_P(BisectClean, ComparisonAndLocalVerdictsDoNotDependOnTheThreadCount) {
  const std::string model = GetParam();
  const bisect::ModelOracles& m = oracles(model);
  const Scenario sc = golden_scenario(model);
  std::unique_ptr<MemoryDump> bugged = impl_candidate(m, sc, {rope_bug(m.model.config)});
  std::vector<std::string> wanted = bugged->names();
  const std::shared_ptr<MemoryDump> ref = m.reference.run(sc, ComputeDType::Float32, wanted);
  const std::shared_ptr<MemoryDump> truth = m.reference.run(sc, ComputeDType::Float64, wanted);
  std::unique_ptr<MemoryDump> clean = impl_candidate(m, sc, {});
  const std::shared_ptr<const TensorSource> second(clean.get(), [](const TensorSource*) {});
  auto criterion = std::make_shared<compare::NoiseFloorCriterion>(truth, ComputeDType::Float32, second);
  criterion->set_reference(ref);
  auto cand_local = m.oracle.recompute(*bugged, ComputeDType::Float64);
  std::vector<compare::DiffResult> global;
  std::vector<compare::LocalReport> local;
  for (int threads : {1, 3}) {
    compare::CompareOptions co;
    co.dtype = ComputeDType::Float32;
    co.criterion = criterion;
    co.threads = threads;
    global.push_back(compare::compare_dumps(*ref, *bugged, co));
    compare::RefOnDemand lazy([&](const std::vector<std::string>& sites) {
      return m.oracle.recompute(*bugged, ComputeDType::Float32, nullptr, &sites);
    });
    local.push_back(compare::judge_local(*bugged, *cand_local, nullptr, cand_local.get(), ComputeDType::Float32, {},
                                         nullptr, &lazy, threads));
  }
  const compare::DiffResult &g1 = global[0], &g3 = global[1];
  ASSERT_EQ(g1.tensors.size(), g3.tensors.size());
  EXPECT_GT(g1.failing(), 0u);
  EXPECT_EQ(g1.first_divergence, g3.first_divergence);
  for (size_t k = 0; k < g1.tensors.size(); ++k) {
    const compare::TensorComparison &a = g1.tensors[k], &b = g3.tensors[k];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.pass, b.pass) << a.name;
    EXPECT_EQ(a.judgement.value, b.judgement.value) << a.name;
    EXPECT_EQ(a.judgement.threshold, b.judgement.threshold) << a.name;
    EXPECT_EQ(a.metrics.rmse, b.metrics.rmse) << a.name;
    EXPECT_EQ(a.notes, b.notes) << a.name;
    EXPECT_EQ(a.findings.size(), b.findings.size()) << a.name;
  }
  const compare::LocalReport &l1 = local[0], &l3 = local[1];
  ASSERT_EQ(l1.sites.size(), l3.sites.size());
  EXPECT_GT(l1.failing(), 0u);
  EXPECT_EQ(l1.first_failure, l3.first_failure);
  EXPECT_EQ(l1.not_recomputed, l3.not_recomputed);
  for (size_t k = 0; k < l1.sites.size(); ++k) {
    const compare::LocalSite &a = l1.sites[k], &b = l3.sites[k];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.pass, b.pass) << a.name;
    EXPECT_EQ(a.within_floor, b.within_floor) << a.name;
    EXPECT_EQ(a.note, b.note) << a.name;
    EXPECT_EQ(a.noise.cand_rmse, b.noise.cand_rmse) << a.name;
    EXPECT_EQ(a.noise.ref_rmse, b.noise.ref_rmse) << a.name;
    EXPECT_EQ(a.max_abs, b.max_abs) << a.name;
  }
}

// On two threads the bisect runs its independent passes in pairs, one thread
// each (the clean run beside the reference, the float64 truth beside the
// candidate's local recompute): the findings are those of the passes one
// after the other on one thread.
TEST_P(BisectClean, PassesRunBesideEachOtherFindWhatTheyFindOneAfterTheOther) {
  const std::string model = GetParam();
  const bisect::ModelOracles& one = oracles(model);
  const bisect::ModelOracles two(golden_model(model), 2);
  const Scenario sc = golden_scenario(model);
  std::unique_ptr<MemoryDump> bugged = impl_candidate(one, sc, {rope_bug(one.model.config)});
  std::vector<std::string> phases;
  bisect::BisectOptions o;
  const BisectResult a = bisect::bisect_candidate(one, *bugged, o);
  o.progress = [&](const std::string& p) { phases.push_back(p); };
  const BisectResult b = bisect::bisect_candidate(two, *bugged, o);
  auto beside = [&](const std::string& what) {
    return std::count_if(phases.begin(), phases.end(), [&](const std::string& p) {
      return p.find(" beside the ") != std::string::npos && p.find(what) != std::string::npos;
    });
  };
  EXPECT_EQ(beside("clean run of the hypothesis engine"), 1) << describe(b);
  EXPECT_EQ(beside("local recompute of the candidate"), 1) << describe(b);
  EXPECT_EQ(a.exit_code(), b.exit_code());
  EXPECT_EQ(a.first_divergence(), b.first_divergence());
  EXPECT_EQ(a.first_local_failure(), b.first_local_failure());
  EXPECT_EQ(a.localised_at(), b.localised_at());
  ASSERT_TRUE(compare::named_bug(a.finding) && compare::named_bug(b.finding)) << describe(a) << "\n" << describe(b);
  EXPECT_EQ(compare::named_bug(a.finding)->str(), compare::named_bug(b.finding)->str());
  EXPECT_EQ(a.global.failing(), b.global.failing());
  EXPECT_EQ(a.local.failing(), b.local.failing());
  EXPECT_EQ(a.second_noise, b.second_noise);
  ASSERT_EQ(a.local.sites.size(), b.local.sites.size());
  for (size_t k = 0; k < a.local.sites.size(); ++k) {
    EXPECT_EQ(a.local.sites[k].name, b.local.sites[k].name);
    EXPECT_EQ(a.local.sites[k].pass, b.local.sites[k].pass) << a.local.sites[k].name;
  }
}

// The clean run's local noise is recomputed only at the sites that fail on
// the reference's noise alone: every verdict, note and first failure is the
// one the whole clean run's recompute gives, for a candidate with a bug and
// for HF's own dump.
TEST_P(BisectClean, TheCleanRunsLocalNoiseIsMadeOnlyWhereAVerdictNeedsIt) {
  const std::string model = GetParam();
  const bisect::ModelOracles& m = oracles(model);
  const Scenario sc = golden_scenario(model);
  const std::string bug = rope_bug(m.model.config);
  std::unique_ptr<MemoryDump> bugged = impl_candidate(m, sc, {bug});
  DumpFile golden(golden_dump(model, "decode"));
  const std::vector<std::pair<const TensorSource*, ComputeDType>> cases = {
      {bugged.get(), ComputeDType::Float32}, {&golden, m.model.config.default_dtype()}};
  for (const auto& [cand, dtype] : cases) {
    SCOPED_TRACE(cand->label());
    const std::vector<std::string> names = cand->names();
    std::unique_ptr<MemoryDump> ref = m.reference.run(sc, dtype, names);
    std::unique_ptr<MemoryDump> clean = m.hypotheses.run(compare::Hypothesis{}, sc, names);
    const compare::SubsetSource ref_run(*ref, names), clean_run(*clean, names);
    auto ref_local = m.oracle.recompute(ref_run, ComputeDType::Float64);
    auto cand_local = m.oracle.recompute(*cand, ComputeDType::Float64);
    compare::SecondNoise whole(compare::local_noise(clean_run, *m.oracle.recompute(clean_run, ComputeDType::Float64)));
    size_t recomputed = 0;
    compare::SecondNoise lazy([&](const std::vector<std::string>& sites) {
      recomputed += sites.size();
      return compare::local_noise(clean_run, *m.oracle.recompute(clean_run, ComputeDType::Float64, nullptr, &sites));
    });
    const compare::LocalReport a =
        compare::judge_local(*cand, *cand_local, ref.get(), ref_local.get(), dtype, {}, &whole);
    const compare::LocalReport b =
        compare::judge_local(*cand, *cand_local, ref.get(), ref_local.get(), dtype, {}, &lazy);
    ASSERT_EQ(a.sites.size(), b.sites.size());
    EXPECT_EQ(a.first_failure, b.first_failure);
    EXPECT_EQ(a.failing(), b.failing());
    size_t failing_alone = 0;
    for (size_t k = 0; k < a.sites.size(); ++k) {
      EXPECT_EQ(a.sites[k].name, b.sites[k].name);
      EXPECT_EQ(a.sites[k].pass, b.sites[k].pass) << a.sites[k].name << ": " << a.sites[k].note;
      if (!a.sites[k].pass) {
        EXPECT_EQ(a.sites[k].note, b.sites[k].note) << a.sites[k].name;
      }
      if (b.sites[k].noise.second_rmse >= 0) ++failing_alone;
    }
    EXPECT_EQ(recomputed, lazy.filled());
    EXPECT_LE(failing_alone, recomputed);
    EXPECT_LT(recomputed, a.sites.size());  // the whole run is not recomputed
    if (cand == bugged.get()) {
      EXPECT_GT(a.failing(), 0u);
    }
  }
}

// An impl candidate with `bug`, the reference at float32, both recomputed in
// float64 from their own inputs, and the candidate's local verdicts.
struct JudgedCandidate {
  std::unique_ptr<MemoryDump> cand, ref;
  std::unique_ptr<compare::Recomputed> ref_local, cand_local;
  compare::LocalReport clean;
};

JudgedCandidate judged_candidate(const bisect::ModelOracles& m, const Scenario& sc, const std::string& bug) {
  JudgedCandidate j;
  j.cand = impl_candidate(m, sc, {bug});
  const std::vector<std::string> names = j.cand->names();
  j.ref = m.reference.run(sc, ComputeDType::Float32, names);
  j.ref_local = m.oracle.recompute(compare::SubsetSource(*j.ref, names), ComputeDType::Float64);
  j.cand_local = m.oracle.recompute(*j.cand, ComputeDType::Float64);
  j.clean = compare::judge_local(*j.cand, *j.cand_local, j.ref.get(), j.ref_local.get(), ComputeDType::Float32);
  return j;
}

// Under a hypothesis, the candidate's sites are recomputed only where the
// hypothesis changes them (found on the first layer of each kind): for every
// bug of the zoo that acts on the model, the report is the one a recompute
// of every site gives, verdict, note (its numbers) and order.
TEST_P(BisectClean, AHypothesisIsRecomputedOnlyWhereItCanChangeASite) {
  const std::string model = GetParam();
  const bisect::ModelOracles& m = oracles(model);
  const Scenario sc = golden_scenario(model);
  const JudgedCandidate j = judged_candidate(m, sc, rope_bug(m.model.config));
  ASSERT_GT(j.clean.failing(), 0u);
  std::set<std::string> tried;
  for (const compare::Hypothesis& h : m.hypotheses.hypotheses()) {
    if (!m.hypotheses.acts_in(h.bug, sc) || !m.oracle.supports(h) || !tried.insert(h.bug).second) continue;
    SCOPED_TRACE(h.str());
    const compare::LocalReport full =
        compare::analyse_local(m.oracle, *j.cand, j.ref.get(), ComputeDType::Float32, {}, &h, j.ref_local.get());
    const compare::LocalReport part = compare::analyse_local_variant(
        m.oracle, *j.cand, *j.cand_local, j.clean, j.ref.get(), ComputeDType::Float32, {}, h, j.ref_local.get());
    ASSERT_EQ(full.sites.size(), part.sites.size());
    EXPECT_EQ(full.first_failure, part.first_failure);
    EXPECT_EQ(full.hypothesis, part.hypothesis);
    for (size_t k = 0; k < full.sites.size(); ++k) {
      EXPECT_EQ(full.sites[k].name, part.sites[k].name);
      EXPECT_EQ(full.sites[k].pass, part.sites[k].pass) << full.sites[k].name;
      EXPECT_EQ(full.sites[k].note, part.sites[k].note) << full.sites[k].name;
      EXPECT_EQ(full.sites[k].max_abs, part.sites[k].max_abs) << full.sites[k].name;
    }
  }
  EXPECT_GE(tried.size(), 8u);
}

// The diagnosis' screen recomputes the first local failure with each
// hypothesis' ops at float32 against the reference's ops at float32: it
// screens out exactly the hypotheses a float64 screen (against the
// candidate's float64 recompute) screens out, and keeps the bug.
TEST_P(BisectClean, TheScreenAtFloat32KeepsWhatTheFloat64ScreenKeeps) {
  const std::string model = GetParam();
  const bisect::ModelOracles& m = oracles(model);
  const Scenario sc = golden_scenario(model);
  size_t screened = 0, kept = 0;
  for (const std::string bug : {"mask-square", "kv-overwrite", "last-token-first", "lm-head"}) {
    const bool applies = zoo::bug_inapplicable_reason(zoo::parse_bug(bug).bug, m.model.config).empty();
    if (!applies || !m.hypotheses.acts_in(bug, sc)) continue;
    SCOPED_TRACE(bug);
    const JudgedCandidate j = judged_candidate(m, sc, bug);
    ASSERT_TRUE(j.clean.first_failure.has_value());
    const std::string first = j.clean.sites[*j.clean.first_failure].name;
    const std::vector<std::string> focus = {first};
    auto clean32 = m.oracle.recompute(*j.cand, ComputeDType::Float32, nullptr, &focus);
    for (const compare::Hypothesis& h : m.hypotheses.hypotheses()) {
      if (!m.oracle.supports(h)) continue;
      SCOPED_TRACE(h.str() + " at " + first);
      const bool at64 = compare::op_unchanged_under(m.oracle, *j.cand, *j.cand_local, first, h);
      const bool at32 = compare::op_unchanged_under(m.oracle, *j.cand, *clean32, first, h, ComputeDType::Float32);
      EXPECT_EQ(at64, at32);
      if (h.bug == bug) {
        EXPECT_FALSE(at32);
      }
      (at32 ? screened : kept) += 1;
    }
  }
  EXPECT_GT(screened, 0u);
  EXPECT_GT(kept, 0u);
}

// Every value name of `want` (not the tokens fed or the greedy picks) is in
// `truth` with the same shape, integers equal and floats within 2 float32
// ulps (both are float64 results stored as float32). Returns the float names
// compared.
size_t expect_same_values(const TensorSource& truth, const TensorSource& want) {
  size_t compared = 0;
  for (const auto& name : want.names()) {
    if (name == "generated" || parse_name(name).site == "tokens") continue;  // inputs and picks, not values
    EXPECT_TRUE(truth.has(name)) << name;
    if (!truth.has(name)) return compared;
    TensorData a = truth.get(name), b = want.get(name);
    EXPECT_EQ(a.shape, b.shape) << name;
    if (a.shape != b.shape) return compared;
    if (b.is_int) {
      EXPECT_EQ(a.i, b.i) << name;
      continue;
    }
    for (size_t k = 0; k < b.f.size(); ++k)
      if (std::fabs(double(a.f[k]) - b.f[k]) > 2.5e-7 * std::fabs(double(b.f[k])) + 1e-30) {
        ADD_FAILURE() << name << "[" << k << "]: " << a.f[k] << " vs " << b.f[k];
        return compared;
      }
    ++compared;
  }
  return compared;
}

// The noise floor's truth is recomputed layer by layer (all forward calls'
// projections in one product); it must be the ref engine in float64, name
// for name, up to the float32 rounding both are stored with.
TEST_P(BisectClean, TheFloat64TruthIsTheRefEngineInFloat64) {
  const std::string model = GetParam();
  const bisect::ModelOracles& m = oracles(model);
  for (const std::string scenario : {"decode", "chunked", "prefill"}) {
    SCOPED_TRACE(model + " " + scenario);
    const Scenario sc = golden_scenario(model, scenario);
    std::unique_ptr<MemoryDump> truth = m.reference.run(sc, ComputeDType::Float64);
    ref::RefOptions o;
    o.dtype = ComputeDType::Float64;
    o.threads = 1;
    std::unique_ptr<Engine> engine = ref::make_ref_engine(m.model, o);
    MemoryDump want("ref engine float64");
    run_scenario(*engine, sc, want);
    EXPECT_GE(expect_same_values(*truth, want), 10u);
  }
}

// A replay (every call's tokens known) runs layer-major through the graph,
// the projections of all its calls one product: at the candidate's dtype it
// must be the ref engine's forward (HF's numbers, each call its own
// products) up to that dtype's rounding, every integer (tokens, greedy
// picks) equal.
TEST_P(BisectClean, TheLayerMajorReplayIsTheRefEngineUpToRounding) {
  const std::string model = GetParam();
  const bisect::ModelOracles& m = oracles(model);
  for (const ComputeDType dtype : {ComputeDType::Float32, ComputeDType::BFloat16}) {
    for (const std::string scenario : {"decode", "chunked"}) {
      SCOPED_TRACE(model + " " + scenario + " " + compute_dtype_name(dtype));
      const Scenario sc = golden_scenario(model, scenario);
      std::unique_ptr<MemoryDump> replay = m.reference.run(sc, dtype);
      ref::RefOptions o;
      o.dtype = dtype;
      o.threads = 1;
      std::unique_ptr<Engine> engine = ref::make_ref_engine(m.model, o);
      MemoryDump want("ref engine");
      run_scenario(*engine, sc, want);
      EXPECT_EQ(replay->names(), want.names());
      // Relative RMSE within `allowed` unit roundoffs of the dtype: measured
      // at most 22 (float32, the stacked rows change OpenBLAS's blocking) and
      // 0 (bfloat16, libtorch's own per-row loops) on the golden models; a
      // row of another call would be off by O(1).
      const bool f32 = dtype == ComputeDType::Float32;
      const double unit = std::ldexp(1.0, f32 ? -24 : -8), allowed = f32 ? 256 : 16;
      size_t compared = 0;
      for (const auto& name : want.names()) {
        const TensorData a = replay->get(name), b = want.get(name);
        ASSERT_EQ(a.shape, b.shape) << name;
        if (b.is_int) {
          EXPECT_EQ(a.i, b.i) << name;
          continue;
        }
        double d2 = 0, r2 = 0;
        for (size_t k = 0; k < b.f.size(); ++k) {
          d2 += (double(a.f[k]) - b.f[k]) * (double(a.f[k]) - b.f[k]);
          r2 += double(b.f[k]) * b.f[k];
        }
        const double rel = r2 > 0 ? std::sqrt(d2 / r2) : std::sqrt(d2);
        EXPECT_LE(rel, allowed * unit) << name;
        ++compared;
      }
      EXPECT_GT(compared, 50u);
    }
  }
}

// tiny-qwen3-moe turned into a Qwen2-MoE: q/k/v biases, a shared expert
// behind its sigmoid gate, layer 1 dense (mlp_only_layers).
nlohmann::json qwen2_moe_changes() {
  return {{"model_type", "qwen2_moe"},
          {"architectures", {"Qwen2MoeForCausalLM"}},
          {"shared_expert_intermediate_size", 192},
          {"mlp_only_layers", {1}},
          {"norm_topk_prob", false}};
}

// A synthetic checkpoint of `preset` (2 layers) with `changes`, float32.
std::string synth_model(const std::string& stem, const std::string& preset, const nlohmann::json& changes) {
  nlohmann::json cfg = nlohmann::json::parse(synth::synth_preset_config(preset));
  cfg["num_hidden_layers"] = 2;
  for (const auto& [k, val] : changes.items()) cfg[k] = val;
  const std::string dir = temp_path(stem);
  synth::SynthOptions so;
  so.config_json = cfg.dump();
  so.dtype = DType::F32;
  so.seed = 5;
  synth::write_synth_checkpoint(dir, so);
  return dir;
}

// What no golden model has: yarn's mscale in MLA's softmax scaling, and
// Qwen2-MoE's gated shared expert. Clean impl candidates pass; their bugs
// are localised and named.
TEST(BisectSyntheticMoe, MscaleAndGatedSharedExpertBugsAreNamed) {
  struct Case {
    std::string preset;
    nlohmann::json changes;
    std::string bug, first;
  };
  const std::vector<Case> cases = {
      {"tiny-deepseek", {}, "mla-mscale-missing", "step0.layers.0.attn.scores"},
      {"tiny-qwen3-moe", qwen2_moe_changes(), "moe-shared-missing", "step0.layers.0.moe.out"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.preset + " " + c.bug);
    bisect::ModelOracles m(synth_model("synth-moe", c.preset, c.changes), 1);
    const Scenario sc = make_scenario({3, 1, 4, 1, 5, 9, 2, 6, 5}, {5, 4}, 3);
    BisectResult clean = bisect::bisect_candidate(m, *impl_candidate(m, sc, {}), BisectOptions{});
    EXPECT_EQ(clean.exit_code(), 0) << describe(clean);
    std::unique_ptr<MemoryDump> full = impl_candidate(m, sc, {c.bug});
    BisectResult r = bisect::bisect_candidate(m, *full, BisectOptions{});
    SCOPED_TRACE(describe(r));
    EXPECT_EQ(r.first_local_failure().value_or("none"), c.first);
    ASSERT_TRUE(compare::named_bug(r.finding));
    EXPECT_EQ(compare::named_bug(r.finding)->bug, c.bug);
  }
}

// The same on synthetic configurations the golden models lack: a sliding
// window shorter than the sequence, dynamic-NTK RoPE that grows during the
// scenario, yarn and linear scaling.
TEST(BisectTruth, TheFloat64TruthIsTheRefEngineOnSyntheticConfigs) {
  struct Variant {
    std::string name, preset;
    nlohmann::json changes;
  };
  const std::vector<Variant> variants = {
      {"sliding window 6", "tiny-qwen2", {{"sliding_window", 6}, {"use_sliding_window", true}}},
      {"dynamic ntk", "tiny-llama", {{"max_position_embeddings", 10}, {"rope_scaling", {{"rope_type", "dynamic"}, {"factor", 2.0}}}}},
      {"yarn", "tiny-llama",
       {{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 8}}}}},
      {"linear", "tiny-llama", {{"rope_scaling", {{"rope_type", "linear"}, {"factor", 2.0}}}}},
      {"deepseek yarn mscale", "tiny-deepseek", {}},
      {"qwen2-moe", "tiny-qwen3-moe", qwen2_moe_changes()},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    bisect::ModelOracles m(synth_model("truth-synth", v.preset, v.changes), 1);
    // The forward calls: a 9-token prompt in chunks of 5 and 4, then 3 greedy steps.
    ref::RefOptions o;
    o.dtype = ComputeDType::Float64;
    o.threads = 1;
    std::unique_ptr<Engine> engine = ref::make_ref_engine(m.model, o);
    MemoryDump want("ref engine float64");
    want.mutable_manifest().scenario = "chunked";
    run_scenario(*engine, make_scenario({3, 1, 4, 1, 5, 9, 2, 6, 5}, {5, 4}, 3), want);
    const Scenario sc = replay_scenario(want);
    std::unique_ptr<MemoryDump> truth = m.reference.run(sc, ComputeDType::Float64);
    EXPECT_GE(expect_same_values(*truth, want), 50u);
  }
}

INSTANTIATE_TEST_SUITE_P(AllGolden, BisectClean, ::testing::ValuesIn(golden_models()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string s = info.param;
                           for (char& ch : s)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return s;
                         });

// ---------------------------------------------------------------------------
// Values off the grids, bugs outside the zoo.

TEST(BisectParameters, ThetaIsFittedFromInvFreqAndEpsSearchedInCutDownDumps) {
  {
    const bisect::ModelOracles& m = oracles("llama-gqa");
    std::unique_ptr<MemoryDump> full = impl_candidate(m, golden_scenario("llama-gqa"), {"rope-theta=12345"});
    BisectResult r = bisect::bisect_candidate(m, *full, BisectOptions{});
    SCOPED_TRACE(describe(r));
    ASSERT_TRUE(compare::named_bug(r.finding));
    EXPECT_EQ(compare::named_bug(r.finding)->str(), "rope-theta=12345");
    EXPECT_NE(r.finding.evidence.find("rope.inv_freq fits theta = 12345"), std::string::npos);
  }
  {
    const bisect::ModelOracles& m = oracles("qwen3-qknorm");
    std::unique_ptr<MemoryDump> full = impl_candidate(m, golden_scenario("qwen3-qknorm"), {"rmsnorm-eps=2.5e-5"});
    BisectResult r = bisect::bisect_candidate(m, *cut_down(*full), BisectOptions{});
    SCOPED_TRACE(describe(r));
    ASSERT_TRUE(compare::named_bug(r.finding));
    EXPECT_EQ(compare::named_bug(r.finding)->bug, "rmsnorm-eps");
    ASSERT_TRUE(compare::named_bug(r.finding)->value);
    EXPECT_NEAR(*compare::named_bug(r.finding)->value, 2.5e-5, 1e-7);
  }
}

// Another implementation's rounding: every float of the dump moved by a
// relative N(0, 1) * 2e-7 (about 2 float32 ulps), reproducibly.
void perturb(MemoryDump& d, uint64_t seed) {
  for (const auto& n : d.names()) {
    TensorData t = d.get(n);
    if (t.is_int) continue;
    for (float& v : t.f) {
      seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
      const double u1 = (double(seed >> 11) + 0.5) / 9007199254740992.0;
      seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
      const double u2 = (double(seed >> 11) + 0.5) / 9007199254740992.0;
      const double g = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
      v = float(double(v) * (1.0 + 2e-7 * g));
    }
    d.put(t);
  }
}

TEST(BisectExternalNumerics, BugsAreDiagnosedInDumpsThatAreNotBitExactWithTheImpl) {
  const bisect::ModelOracles& m = oracles("qwen2-bias");
  {
    std::unique_ptr<MemoryDump> clean = impl_candidate(m, golden_scenario("qwen2-bias"), {});
    perturb(*clean, 1);
    BisectResult r = bisect::bisect_candidate(m, *clean, BisectOptions{});
    SCOPED_TRACE(describe(r));
    EXPECT_TRUE(r.ok());
  }
  for (const std::string bug : {"rmsnorm-eps", "rope-interleaved", "kv-overwrite", "gate-up-swap"}) {
    std::unique_ptr<MemoryDump> full = impl_candidate(m, golden_scenario("qwen2-bias"), {bug});
    perturb(*full, 2);
    std::unique_ptr<MemoryDump> cut = cut_down(*full);
    for (const MemoryDump* cand : {full.get(), cut.get()}) {
      BisectResult r = bisect::bisect_candidate(m, *cand, BisectOptions{});
      SCOPED_TRACE(bug + " " + cand->label() + ": " + describe(r));
      const Expected want = expected_divergence(bug, m.model.config);
      EXPECT_EQ(r.localised_at().value_or(""), cand == full.get() ? want.full : want.cut);
      ASSERT_TRUE(compare::named_bug(r.finding));
      EXPECT_EQ(compare::named_bug(r.finding)->bug, bug);
    }
  }
}

TEST(BisectUnknownBug, ACorruptionOutsideTheZooIsLocalisedButNotNamed) {
  const bisect::ModelOracles& m = oracles("qwen2-bias");
  std::unique_ptr<MemoryDump> cand = impl_candidate(m, golden_scenario("qwen2-bias"), {});
  // One op of layer 1 off by 0.1% (and only that op: later sites untouched).
  TensorData down = cand->get("step0.layers.1.mlp.down");
  for (float& v : down.f) v *= 1.001f;
  cand->put(down);
  BisectResult r = bisect::bisect_candidate(m, *cand, BisectOptions{});
  SCOPED_TRACE(describe(r));
  EXPECT_EQ(r.exit_code(), 1);
  EXPECT_EQ(r.first_divergence().value_or(""), "step0.layers.1.mlp.down");
  EXPECT_EQ(r.first_local_failure().value_or(""), "step0.layers.1.mlp.down");
  // out = attn_residual + down is locally wrong too (it no longer adds up).
  ASSERT_NE(r.local.find("step0.layers.1.out"), nullptr);
  EXPECT_FALSE(r.local.find("step0.layers.1.out")->pass);
  EXPECT_FALSE(compare::named_bug(r.finding).has_value());
  EXPECT_NE(r.finding.evidence.find("no hypothesis of the bug zoo fits"), std::string::npos);
  EXPECT_NE(r.finding.evidence.find("rmse"), std::string::npos);  // the numbers are shown
}

// ---------------------------------------------------------------------------
// The commands.

TEST(BisectCommands, RunWithAnInjectedBugPrintsTheDiagnosis) {
  const std::string model = golden_model("llama-gqa"), replay = golden_dump("llama-gqa", "decode");
  ::testing::internal::CaptureStderr();
  CliRun t = run_cli(
      {"run", "--model", model, "--replay", replay, "--inject", "rope-interleaved", "--threads", "1", "--verbose"});
  const std::string phases = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(t.code, 1) << t.error;
  EXPECT_NE(t.out.find("RESULT: divergence, localised at step0.layers.0.attn.q_rope"), std::string::npos) << t.out;
  // --verbose: each phase on stderr, in order, with time, peak memory and disk traffic.
  size_t at = 0;
  for (const char* phase : {"candidate run (impl)", "clean run of the hypothesis engine", "reference run in float32",
                            "reference run in float64", "comparison", "local recompute of the candidate", "diagnosis"}) {
    const size_t k = phases.find(phase, at);
    EXPECT_NE(k, std::string::npos) << phase << " missing or out of order in:\n" << phases;
    if (k != std::string::npos) at = k;
  }
  EXPECT_NE(phases.find(" s, peak "), std::string::npos) << phases;
  EXPECT_NE(phases.find(" mapped files; disk read "), std::string::npos) << phases;  // what each phase read
  EXPECT_EQ(t.out.find("peak"), std::string::npos) << "phase lines belong on stderr";
  EXPECT_NE(t.out.find("Diagnosis at step0.layers.0.attn.q_rope: rope-interleaved"), std::string::npos) << t.out;

  const std::string report = temp_path("bisect-report.md"), junit = temp_path("bisect-report.xml");
  CliRun j = run_cli({"run", "--model", model, "--replay", replay, "--inject", "rope-interleaved", "--threads", "1",
                      "--json", "--report", report, "--junit", junit});
  ASSERT_EQ(j.code, 1) << j.error;
  nlohmann::json doc = nlohmann::json::parse(j.out);
  EXPECT_EQ(doc["schema"], "llmdiff.bisect/1");
  EXPECT_EQ(doc["first_divergence"], "step0.layers.0.attn.q_rope");
  EXPECT_EQ(doc["first_local_failure"], "step0.layers.0.attn.q_rope");
  EXPECT_EQ(doc["diagnosis"]["bug"], "rope-interleaved");
  EXPECT_TRUE(doc["diagnosis"]["value"].is_null());
  EXPECT_FALSE(doc["diagnosis"]["evidence"].get<std::string>().empty());
  EXPECT_EQ(doc["criterion"], "noise-floor");
  EXPECT_EQ(doc["noise_second_run"], "impl");
  EXPECT_EQ(doc["exit_code"], 1);
  EXPECT_EQ(doc["finding"]["kind"], "zoo-bug");
  EXPECT_EQ(doc["finding"]["headline"],
            "rope-interleaved (evidence: " + doc["diagnosis"]["basis"].get<std::string>() + ")");
  EXPECT_EQ(doc["headline"], "Divergence, localised at step0.layers.0.attn.q_rope. Diagnosis: " +
                                 doc["finding"]["headline"].get<std::string>());
  std::string md = read_text(report);
  EXPECT_NE(md.find("# llmdiff bisection report"), std::string::npos);
  EXPECT_NE(md.find("`rope-interleaved`"), std::string::npos);
  const std::string xml = read_text(junit);
  EXPECT_NE(xml.find("<failure message=\"" + doc["headline"].get<std::string>() + "\""), std::string::npos) << xml;
  for (const auto& e : fs::directory_iterator(fs::path(report).parent_path()))
    EXPECT_EQ(e.path().filename().string().find("bisect-report.md.tmp"), std::string::npos) << "temporary left behind";
}

// A clean impl judged by a zero tolerance diverges everywhere (honest
// rounding against the ref), yet no zoo bug may be named: the clean impl run
// reproduces the candidate as well as any hypothesis does.
TEST(BisectCommands, RoundingDivergenceOfACleanRunNamesNoBug) {
  const std::string model = golden_model("llama-gqa"), replay = golden_dump("llama-gqa", "decode");
  CliRun t = run_cli({"run", "--model", model, "--replay", replay, "--threads", "1", "--no-noise-floor", "--atol",
                      "0", "--rtol", "0", "--json"});
  ASSERT_EQ(t.code, 1) << t.error;
  nlohmann::json doc = nlohmann::json::parse(t.out);
  EXPECT_FALSE(doc["first_divergence"].is_null());
  EXPECT_TRUE(doc["diagnosis"]["bug"].is_null()) << doc["diagnosis"].dump(2);

  // Without local errors the clean run's agreement at the divergence settles
  // it before any hypothesis is replayed.
  CliRun n = run_cli({"run", "--model", model, "--replay", replay, "--threads", "1", "--no-noise-floor", "--atol",
                      "0", "--rtol", "0", "--no-local", "--json"});
  ASSERT_EQ(n.code, 1) << n.error;
  nlohmann::json nd = nlohmann::json::parse(n.out);
  EXPECT_TRUE(nd["diagnosis"]["bug"].is_null()) << nd["diagnosis"].dump(2);
  EXPECT_NE(nd["diagnosis"]["evidence"].get<std::string>().find("the clean implementation reproduces the candidate"),
            std::string::npos)
      << nd["diagnosis"].dump(2);
}

TEST(BisectCommands, RunRecordsOnlyTheRequestedSites) {
  const std::string model = golden_model("qwen3-qknorm"), replay = golden_dump("qwen3-qknorm", "decode");
  const std::string out = temp_path("run-sites.safetensors");
  CliRun t = run_cli({"run", "--model", model, "--replay", replay, "--inject", "gate-up-swap", "--threads", "1",
                      "--sites", "layers.?.out,logits", "--out", out, "--json"});
  ASSERT_EQ(t.code, 1) << t.error;
  nlohmann::json doc = nlohmann::json::parse(t.out);
  EXPECT_EQ(doc["first_divergence"], "step0.layers.0.out");
  EXPECT_EQ(doc["diagnosis"]["bug"], "gate-up-swap");
  // The candidate held only the requested sites and the forward calls' inputs.
  DumpFile d(out);
  for (const auto& name : d.names()) {
    const CanonName c = parse_name(name);
    const bool kept = name == "generated" || c.site == "tokens" || c.site == "positions" || c.site == "out" ||
                      c.site == "logits";
    EXPECT_TRUE(kept) << name;
  }
  EXPECT_TRUE(d.has("step3.layers.1.out"));
  EXPECT_TRUE(d.has("step0.logits"));
  EXPECT_FALSE(d.has("step0.layers.0.attn.q"));
}

TEST(BisectCommands, BisectOfAnExternalDump) {
  const std::string model = golden_model("qwen2-bias");
  CliRun ok = run_cli({"bisect", "--model", model, golden_dump("qwen2-bias", "chunked"), "--threads", "1"});
  ASSERT_EQ(ok.code, 0) << ok.error;
  EXPECT_NE(ok.out.find("RESULT: no divergence"), std::string::npos) << ok.out;

  // A buggy dump written to disk by the impl, as another program would.
  const std::string cand = temp_path("qwen2-missing-bias.safetensors");
  CliRun w = run_cli({"run", "--model", model, "--replay", golden_dump("qwen2-bias", "decode"), "--inject",
                      "missing-bias", "--threads", "1", "--out", cand, "--no-diagnose"});
  ASSERT_EQ(w.code, 1) << w.error;
  CliRun b = run_cli({"bisect", "--model", model, cand, "--threads", "1", "--json"});
  ASSERT_EQ(b.code, 1) << b.error;
  nlohmann::json doc = nlohmann::json::parse(b.out);
  EXPECT_EQ(doc["first_divergence"], "step0.layers.0.attn.q");
  EXPECT_EQ(doc["diagnosis"]["bug"], "missing-bias");

  // Without the noise floor the diff is judged by allclose.
  CliRun a = run_cli({"bisect", "--model", model, cand, "--threads", "1", "--json", "--no-noise-floor", "--no-local",
                      "--no-diagnose"});
  ASSERT_EQ(a.code, 1) << a.error;
  nlohmann::json adoc = nlohmann::json::parse(a.out);
  EXPECT_EQ(adoc["criterion"], "allclose");
  EXPECT_TRUE(adoc["local"].is_null());
  EXPECT_EQ(adoc["first_divergence"], "step0.layers.0.attn.q");
}

TEST(BisectCommands, UsageAndInputErrorsExitWith2) {
  const std::string model = golden_model("llama-gqa"), g = golden_dump("llama-gqa", "prefill");
  EXPECT_EQ(run_cli({"bisect", g}).code, 2);                                                   // no --model
  EXPECT_EQ(run_cli({"bisect", "--model", model}).code, 2);                                    // no candidate
  EXPECT_EQ(run_cli({"bisect", "--model", model, temp_path("missing.safetensors")}).code, 2);  // no such file
  EXPECT_EQ(run_cli({"bisect", "--model", temp_path("no-model"), g}).code, 2);                 // no such model
  EXPECT_EQ(run_cli({"bisect", "--model", model, g, "--tol", "layers.*=atol"}).code, 2);       // bad --tol
  EXPECT_EQ(run_cli({"run", "--model", model}).code, 2);                                       // no tokens
  EXPECT_EQ(run_cli({"run", "--model", model, "--tokens", "1,2", "--replay", g}).code, 2);
  EXPECT_EQ(run_cli({"run", "--model", model, "--tokens", "1,2", "--inject", "no-such-bug"}).code, 2);
  EXPECT_EQ(run_cli({"run", "--model", model, "--tokens", "1,2", "--inject", "missing-bias"}).code, 2);  // inapplicable
  // A dump without step tokens cannot be replayed.
  const std::string no_tokens = temp_path("no-tokens.safetensors");
  {
    DumpFile src(g);
    MemoryDump d;
    d.mutable_manifest() = src.manifest();
    d.put(src.get("step0.logits"));
    d.save(no_tokens);
  }
  CliRun r = run_cli({"bisect", "--model", model, no_tokens});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.error.find("tokens"), std::string::npos) << r.error;
}

}  // namespace
