// compare_dumps on golden HF dumps: identical dumps agree, a perturbation is
// localised at its first name, names only one side holds are listed, the
// per-layer trace and greedy-token agreement follow the error.
#include <gtest/gtest.h>

#include <filesystem>

#include <cmath>

#include "compare/compare.h"
#include "compare/regress.h"
#include "dumps/base/errors.h"
#include "tests/test_compare_helpers.h"

using namespace llmdiff;
using namespace llmdiff::compare;
using namespace llmdiff::testing;

namespace {

// Perturbs `first` (one element by `delta`) and scales every later float
// tensor of the same dump by (1 + 1e-3), as an error propagating downstream.
void perturb_from(MemoryDump& d, const std::string& first, float delta) {
  NameOrder before;
  for (const auto& n : d.names()) {
    TensorData t = d.get(n);
    if (t.is_int || before(n, first)) continue;
    if (n == first)
      t.f[t.f.size() / 2] += delta;
    else
      for (auto& v : t.f) v *= 1.001f;
    d.put(t);
  }
}

}  // namespace

TEST(CompareDiff, IdenticalDumpsAgreeEverywhere) {
  for (const std::string& model : golden_models()) {
    for (const char* scenario : {"prefill", "decode", "chunked"}) {
      DumpFile a(golden_dump(model, scenario)), b(golden_dump(model, scenario));
      DiffResult r = compare_dumps(a, b);
      EXPECT_TRUE(r.ok()) << model << "/" << scenario;
      EXPECT_FALSE(r.first_divergence.has_value());
      EXPECT_EQ(r.tensors.size(), a.names().size());
      EXPECT_TRUE(r.only_in_ref.empty());
      EXPECT_TRUE(r.only_in_cand.empty());
      EXPECT_EQ(r.greedy.first_divergent_step, -1);
      for (const auto& t : r.tensors) {
        EXPECT_TRUE(t.pass) << t.name;
        EXPECT_EQ(t.max_abs(), 0) << t.name;
      }
      if (std::string(scenario) == "decode") {
        EXPECT_EQ(r.greedy.steps.size(), 4u);
        EXPECT_TRUE(r.greedy.has_generated);
        EXPECT_EQ(r.greedy.first_generated_mismatch, -1);
      }
    }
  }
}

TEST(CompareDiff, DtypeFromManifestsIsTheCoarser) {
  DumpFile bf16(golden_dump("llama-mha-bf16", "prefill"));
  MemoryDump cand("f32 candidate");
  copy_into(bf16, cand);
  cand.mutable_manifest().dtype = "float32";
  DiffResult r = compare_dumps(bf16, cand);
  EXPECT_EQ(r.dtype, ComputeDType::BFloat16);
  EXPECT_DOUBLE_EQ(r.base_tolerance.rtol, 1.6e-2);
  EXPECT_EQ(r.tensors.front().metrics.ulp_dtype, ComputeDType::BFloat16);
  bool noted = false;
  for (const auto& n : r.notes) noted |= n.find("compute dtypes differ") != std::string::npos;
  EXPECT_TRUE(noted);
  CompareOptions o;
  o.dtype = ComputeDType::Float32;
  EXPECT_DOUBLE_EQ(compare_dumps(bf16, cand, o).base_tolerance.rtol, 1.3e-6);
}

TEST(CompareDiff, FirstDivergenceIsThePerturbedName) {
  for (const char* first : {"step0.layers.1.attn.q", "step0.layers.0.mlp.act", "step0.final_norm"}) {
    DumpFile ref(golden_dump("llama-gqa", "prefill"));
    MemoryDump cand("perturbed");
    copy_into(ref, cand);
    perturb_from(cand, first, 0.05f);
    DiffResult r = compare_dumps(ref, cand);
    EXPECT_FALSE(r.ok());
    ASSERT_TRUE(r.first_divergence.has_value());
    EXPECT_EQ(r.first()->name, first);
    // Everything before it passes.
    for (size_t k = 0; k < *r.first_divergence; ++k) EXPECT_TRUE(r.tensors[k].pass) << r.tensors[k].name;
    const TensorComparison* f = r.first();
    EXPECT_NEAR(f->metrics.max_abs, 0.05, 1e-6);
    EXPECT_EQ(f->allclose.failing, 1);
    EXPECT_GT(f->allclose.min_atol, 0.04);
  }
}

TEST(CompareDiff, FirstDivergenceInALaterDecodeStep) {
  DumpFile ref(golden_dump("qwen3-qknorm", "decode"));
  MemoryDump cand("perturbed decode");
  copy_into(ref, cand);
  perturb_from(cand, "step2.layers.0.attn.k_norm", 0.25f);
  DiffResult r = compare_dumps(ref, cand);
  ASSERT_TRUE(r.first());
  EXPECT_EQ(r.first()->name, "step2.layers.0.attn.k_norm");
  // The trace: step 0/1 clean, step 2 layer 0 carries the error into its output.
  bool saw_layer0 = false;
  for (const auto& g : r.layer_trace) {
    if (g.step < 2) {
      EXPECT_EQ(g.failing, 0) << g.step << " " << g.label();
      EXPECT_EQ(g.worst_nmse, 0);
    }
    if (g.step == 2 && g.part == LayerTrace::Part::Layer && g.layer == 0) {
      saw_layer0 = true;
      EXPECT_GT(g.failing, 0);
      EXPECT_TRUE(g.has_key);
      EXPECT_GT(g.key_nmse, 0);
      EXPECT_EQ(g.key_site, "out");
    }
  }
  EXPECT_TRUE(saw_layer0);
}

TEST(CompareDiff, MissingAndExtraNamesAreListedNotDivergences) {
  DumpFile ref(golden_dump("qwen2-bias", "prefill"));
  MemoryDump cand("partial");
  copy_into(ref, cand);
  cand.erase("step0.layers.0.attn.k_rep");
  cand.erase("step0.layers.1.attn.scores");
  TensorData extra = cand.get("step0.embed");
  extra.name = "step0.adapter.extra";
  cand.put(extra);
  DiffResult r = compare_dumps(ref, cand);
  EXPECT_EQ(r.only_in_ref, (std::vector<std::string>{"step0.layers.0.attn.k_rep", "step0.layers.1.attn.scores"}));
  EXPECT_EQ(r.only_in_cand, (std::vector<std::string>{"step0.adapter.extra"}));
  EXPECT_FALSE(r.first_divergence.has_value());
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.find("step0.layers.0.attn.k_rep"), nullptr);
  EXPECT_EQ(r.tensors.size(), ref.names().size() - 2);

  // Nothing in common: not ok.
  MemoryDump empty("empty");
  EXPECT_FALSE(compare_dumps(ref, empty).ok());
}

TEST(CompareDiff, ShapeMismatchCountsAsDivergenceWithFinding) {
  DumpFile ref(golden_dump("llama-gqa", "chunked"));
  MemoryDump cand("permuted");
  copy_into(ref, cand);
  TensorData q = cand.get("step1.layers.0.attn.q_rope");  // [4, 3, 16]
  Shape s;
  q.f = permute_axes(q.f.data(), q.shape, {1, 0, 2}, &s);
  q.shape = s;
  cand.put(q);
  DiffResult r = compare_dumps(ref, cand);
  ASSERT_TRUE(r.first());
  EXPECT_EQ(r.first()->name, "step1.layers.0.attn.q_rope");
  EXPECT_FALSE(r.first()->shape_match);
  ASSERT_FALSE(r.first()->findings.empty());
  EXPECT_EQ(r.first()->findings[0].perm, (std::vector<int>{1, 0, 2}));
  EXPECT_EQ(r.failing(), 1u);
}

TEST(CompareDiff, NaNInTheCandidateFailsWithItsPosition) {
  DumpFile ref(golden_dump("llama-gqa", "prefill"));
  MemoryDump cand("nan");
  copy_into(ref, cand);
  TensorData p = cand.get("step0.layers.1.attn.probs");  // [4, 7, 7]
  p.f[size_t(2 * 49 + 3 * 7 + 1)] = std::nanf("");
  cand.put(p);
  DiffResult r = compare_dumps(ref, cand);
  ASSERT_TRUE(r.first());
  const TensorComparison& c = *r.first();
  EXPECT_EQ(c.name, "step0.layers.1.attn.probs");
  EXPECT_EQ(c.metrics.cand_nonfinite.nan, 1);
  EXPECT_EQ(c.metrics.nonfinite_mismatch, 1);
  EXPECT_TRUE(std::isinf(c.max_abs()));
  bool where = false;
  for (const auto& n : c.notes) where |= n.find("1 NaN (first at [2, 3, 1])") != std::string::npos;
  EXPECT_TRUE(where);
}

TEST(CompareDiff, IntegerAndGreedyDivergence) {
  DumpFile ref(golden_dump("llama-gqa", "decode"));
  MemoryDump cand("other tokens");
  copy_into(ref, cand);
  // Step 1 prefers another token: raise a different logit above the argmax.
  TensorData nl = cand.get("step1.next_logits");
  int64_t best = argmax(nl.f.data(), nl.numel());
  int64_t other = best == 0 ? 1 : 0;
  nl.f[size_t(other)] = nl.f[size_t(best)] + 1.0f;
  cand.put(nl);
  TensorData gen = cand.get("generated");
  gen.i[1] = other;
  cand.put(gen);
  DiffResult r = compare_dumps(ref, cand);
  EXPECT_EQ(r.greedy.first_divergent_step, 1);
  EXPECT_EQ(r.greedy.first_generated_mismatch, 1);
  const TensorComparison* g = r.find("generated");
  ASSERT_NE(g, nullptr);
  EXPECT_TRUE(g->is_int);
  EXPECT_FALSE(g->pass);
  EXPECT_EQ(g->ints.mismatches, 1);
  EXPECT_EQ(g->ints.first_mismatch, 1);
  const TensorComparison* l = r.find("step1.next_logits");
  ASSERT_TRUE(l && l->logits);
  EXPECT_EQ(l->logits->argmax_agree, 0);
  EXPECT_EQ(r.first()->name, "step1.next_logits");
}

TEST(CompareDiff, ToleranceOverridesAndSiteFilter) {
  DumpFile ref(golden_dump("llama3-mqa-scaled", "prefill"));
  MemoryDump cand("perturbed");
  copy_into(ref, cand);
  perturb_from(cand, "step0.layers.1.attn.probs", 1e-3f);
  CompareOptions o;
  o.sites = {"layers.*.attn.probs"};
  DiffResult r = compare_dumps(ref, cand, o);
  ASSERT_EQ(r.tensors.size(), 2u);
  EXPECT_EQ(r.first()->name, "step0.layers.1.attn.probs");
  // Loosening probs lets them pass; the source of the tolerance is reported.
  o.overrides = {parse_tolerance_override("layers.*.attn.probs=atol:2e-3,rtol:2e-3")};
  r = compare_dumps(ref, cand, o);
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.tensors[1].tolerance_source, "--tol layers.*.attn.probs=atol:2e-3,rtol:2e-3");
  // A global atol: min atol needed is what was reported.
  CompareOptions g;
  g.sites = {"step0.layers.1.attn.probs"};
  double need = compare_dumps(ref, cand, g).tensors[0].allclose.min_atol;
  g.atol = need * 1.0001;
  EXPECT_TRUE(compare_dumps(ref, cand, g).ok());
}

TEST(CompareDiff, PluggableCriterion) {
  // A criterion that judges only mlp.up, with a bound on NMSE.
  struct UpOnly : Criterion {
    std::string name() const override { return "mlp.up nmse"; }
    Judgement judge(const TensorData&, const TensorData&, const TensorComparison& c) const override {
      Judgement j;
      j.judged = c.parsed.site == "mlp.up";
      j.metric = "nmse";
      j.value = c.metrics.nmse;
      j.threshold = 1e-8;
      j.pass = j.value <= j.threshold;
      return j;
    }
  };
  DumpFile ref(golden_dump("llama-gqa", "prefill"));
  MemoryDump cand("perturbed");
  copy_into(ref, cand);
  perturb_from(cand, "step0.layers.0.attn.v", 0.1f);
  CompareOptions o;
  o.criterion = std::make_shared<UpOnly>();
  DiffResult r = compare_dumps(ref, cand, o);
  EXPECT_EQ(r.criterion, "mlp.up nmse");
  ASSERT_TRUE(r.first());
  EXPECT_EQ(r.first()->name, "step0.layers.0.mlp.up");
  EXPECT_FALSE(r.find("step0.layers.0.attn.v")->judgement.judged);
  EXPECT_TRUE(r.find("step0.layers.0.attn.v")->pass);
}

TEST(CompareDiff, RegressionPolicyOnGoldenData) {
  auto models = discover_golden(golden_dir());
  ASSERT_EQ(models.size(), golden_models().size());
  for (const auto& m : models) {
    // prefill, decode, chunked, and for two models each HF generate's
    // sample and batch (model.safetensors is not a dump)
    const bool sample = std::filesystem::exists(m.dir + "/sample.safetensors");
    const bool batch = std::filesystem::exists(m.dir + "/batch.safetensors");
    EXPECT_EQ(m.dumps.size(), 3u + (sample ? 1u : 0u) + (batch ? 1u : 0u)) << m.dir;
    for (const auto& d : m.dumps) EXPECT_EQ(d.find("model.safetensors"), std::string::npos);
  }
  RegressionPolicy p;
  // float32: scaled max-abs bound, max|a-b| <= 1e-5 * max(1, max|HF|) per tensor.
  DumpFile ref(golden_dump("qwen2-bias", "prefill"));
  MemoryDump cand("perturbed");
  copy_into(ref, cand);
  TensorData logits = cand.get("step0.logits");
  double bound = p.f32_abs * std::max(1.0, max_abs(logits));
  ASSERT_GT(bound, 2e-5);
  logits.f[3] += float(bound * 0.5);
  cand.put(logits);
  RegressionCase c;
  c.engine = EngineKind::Impl;
  c.diff = compare_dumps(ref, cand, regression_options(p, EngineKind::Impl, ComputeDType::Float32));
  evaluate_case(c, p);
  EXPECT_TRUE(c.pass) << (c.failures.empty() ? "" : c.failures[0]);
  EXPECT_EQ(c.worst_name, "step0.logits");
  EXPECT_NEAR(c.worst_threshold, bound, 1e-12);

  TensorData embed = cand.get("step0.embed");
  embed.f[0] += float(2 * p.f32_abs * std::max(1.0, max_abs(embed)));
  cand.put(embed);
  c.diff = compare_dumps(ref, cand, regression_options(p, EngineKind::Impl, ComputeDType::Float32));
  evaluate_case(c, p);
  EXPECT_FALSE(c.pass);
  ASSERT_FALSE(c.failures.empty());
  EXPECT_NE(c.failures[0].find("step0.embed"), std::string::npos);

  // Missing names fail a regression (they are only listed by a diff).
  cand.erase("step0.layers.0.attn.k_rep");
  c.diff = compare_dumps(ref, cand, regression_options(p, EngineKind::Ref, ComputeDType::Float32));
  evaluate_case(c, p);
  bool missing = false;
  for (const auto& f : c.failures) missing |= f.find("attn.k_rep: missing") != std::string::npos;
  EXPECT_TRUE(missing);

  // bf16 impl: only logits NMSE and integer tensors are judged.
  DumpFile bref(golden_dump("llama-mha-bf16", "decode"));
  MemoryDump bcand("f32 compute");
  copy_into(bref, bcand);
  perturb_from(bcand, "step0.layers.0.attn.q", 1.0f);  // later tensors scaled by 1.001: logits NMSE ~1e-6
  c = RegressionCase{};
  c.engine = EngineKind::Impl;
  c.diff = compare_dumps(bref, bcand, regression_options(p, EngineKind::Impl, ComputeDType::BFloat16));
  evaluate_case(c, p);
  EXPECT_TRUE(c.pass) << (c.failures.empty() ? "" : c.failures[0]);
  EXPECT_EQ(c.worst_metric, "nmse");
  EXPECT_FALSE(c.diff->find("step0.layers.0.attn.q")->judgement.judged);
  // ... whereas the bf16 ref rule (allclose at 1.6e-2/1e-5 everywhere) fails at the bumped q.
  c.engine = EngineKind::Ref;
  c.diff = compare_dumps(bref, bcand, regression_options(p, EngineKind::Ref, ComputeDType::BFloat16));
  evaluate_case(c, p);
  EXPECT_FALSE(c.pass);
  ASSERT_TRUE(c.diff->first());
  EXPECT_EQ(c.diff->first()->name, "step0.layers.0.attn.q");
  // A changed generated token fails the impl rule.
  TensorData gen = bcand.get("generated");
  gen.i.back() += 1;
  bcand.put(gen);
  c.engine = EngineKind::Impl;
  c.diff = compare_dumps(bref, bcand, regression_options(p, EngineKind::Impl, ComputeDType::BFloat16));
  evaluate_case(c, p);
  EXPECT_FALSE(c.pass);
  EXPECT_EQ(c.worst_name, "generated");
}

TEST(CompareDiff, RegressionPolicyKeys) {
  RegressionPolicy p;
  p.set("f32_abs=2e-5");
  p.set("bf16_ref_rtol=0.02");
  p.set("lowp_impl_nmse=1e-4");
  p.set("require_all_names=0");
  EXPECT_DOUBLE_EQ(p.f32_abs, 2e-5);
  EXPECT_DOUBLE_EQ(p.bf16_ref.rtol, 0.02);
  EXPECT_DOUBLE_EQ(p.lowp_impl_nmse, 1e-4);
  EXPECT_FALSE(p.require_all_names);
  for (const char* bad : {"f32_abs", "f32_abs=", "f32_abs=-1", "nope=1", "require_all_names=yes"})
    EXPECT_THROW(p.set(bad), UsageError) << bad;
  EXPECT_THROW(discover_golden(golden_dir() + "/does-not-exist"), UsageError);
}
