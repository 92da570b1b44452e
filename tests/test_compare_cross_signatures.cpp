// Error signatures across names (compare/cross_signatures.h): from local
// and global verdicts built by hand, which siblings, forward calls and
// layers of the localised op fail; what the failing calls share (decode
// steps, later prefill chunks, more keys, verify calls) or the failing
// layers (MoE); nothing when every part fails or every part passes; how
// the renderers say them.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "compare/bisect_report.h"
#include "compare/cross_signatures.h"
#include "dumps/contract/names.h"

using namespace llmdiff;
using namespace llmdiff::compare;

namespace {

// Local verdicts: every (step, layer, site) in `sites` over `steps` steps
// and `layers` layers; `fails(step, layer, site)` says which fail.
template <typename Fails>
LocalReport local_report(int steps, int layers, const std::vector<std::string>& sites, Fails fails) {
  LocalReport r;
  r.ran = true;
  for (int s = 0; s < steps; ++s) {
    for (int l = 0; l < layers; ++l)
      for (const std::string& site : sites) {
        LocalSite x;
        x.name = layer_name(s, l, site);
        x.parsed = parse_name(x.name);
        x.pass = !fails(s, l, site);
        if (!x.pass && !r.first_failure) r.first_failure = r.sites.size();
        r.sites.push_back(x);
      }
  }
  return r;
}

LocalReport step_site_report(const std::string& site, const std::set<int>& failing, int steps) {
  LocalReport r;
  r.ran = true;
  for (int s = 0; s < steps; ++s) {
    LocalSite x;
    x.name = step_name(s, site);
    x.parsed = parse_name(x.name);
    x.pass = failing.count(s) == 0;
    r.sites.push_back(x);
  }
  return r;
}

// Forward calls of these token counts.
Scenario calls(const std::vector<int>& t) {
  Scenario sc;
  for (int n : t) sc.steps.push_back(std::vector<int64_t>(size_t(n), 1));
  return sc;
}

std::vector<std::string> details(const std::vector<ErrorSignature>& s) {
  std::vector<std::string> out;
  for (const ErrorSignature& g : s) {
    EXPECT_EQ(g.kind, kOnlySomeKind);
    EXPECT_FALSE(g.decisive);
    EXPECT_EQ(g.fit, 1.0);
    out.push_back(g.detail);
  }
  return out;
}

bool has(const std::vector<std::string>& ds, const std::string& words) {
  for (const std::string& d : ds)
    if (d.find(words) != std::string::npos) return true;
  return false;
}

const std::vector<std::string> kAttn = {"attn.q", "attn.k", "attn.v", "attn.q_rope", "attn.k_rope", "attn.k_cache",
                                        "attn.v_cache"};

}  // namespace

TEST(CrossSignatures, OnlyKsRotationFailsWhileQsPasses) {
  const LocalReport local =
      local_report(4, 2, kAttn, [](int, int l, const std::string& site) { return l == 0 && site == "attn.k_rope"; });
  const auto s = cross_name_signatures("step0.layers.0.attn.k_rope", local, DiffResult{}, calls({5, 1, 1, 1}));
  const auto ds = details(s);
  EXPECT_TRUE(has(ds, "attn.k_rope fails locally at layer 0 (every step) while attn.q_rope passes there: only k is "
                      "wrong, q is right"))
      << ::testing::PrintToString(ds);
  // Every step fails at layer 0: no step signature; layer 1 passes.
  EXPECT_FALSE(has(ds, "forward calls"));
  EXPECT_TRUE(has(ds, "attn.k_rope fails locally at layer 0 of the 2 layers holding it and passes at every step of "
                      "layer 1"));
  for (const ErrorSignature& g : s) EXPECT_EQ(g.name, "step0.layers.0.attn.k_rope");
}

TEST(CrossSignatures, TwoOfThreeProjectionsFail) {
  const LocalReport local = local_report(2, 1, kAttn, [](int s, int, const std::string& site) {
    return site == "attn.k" || (site == "attn.v" && s == 1);
  });
  const auto ds = details(cross_name_signatures("step0.layers.0.attn.k", local, DiffResult{}, calls({3, 1})));
  EXPECT_TRUE(has(ds, "attn.k and attn.v fail locally at layer 0 (every step) while attn.q passes there: only k and "
                      "v are wrong, q is right"))
      << ::testing::PrintToString(ds);
}

TEST(CrossSignatures, EverySiblingFailingOrPassingSaysNothing) {
  const LocalReport all = local_report(2, 1, kAttn, [](int, int, const std::string& site) {
    return site == "attn.q_rope" || site == "attn.k_rope";
  });
  EXPECT_TRUE(cross_name_signatures("step0.layers.0.attn.k_rope", all, DiffResult{}, calls({3, 1})).empty());
  const LocalReport none = local_report(2, 1, kAttn, [](int, int, const std::string&) { return false; });
  EXPECT_TRUE(cross_name_signatures("step0.layers.0.attn.k_rope", none, DiffResult{}, calls({3, 1})).empty());
}

TEST(CrossSignatures, MlasQAndKvPathsAndTheMlpsGateAndUp) {
  const std::vector<std::string> mla = {"attn.q_a", "attn.kv_a", "attn.q", "attn.kv", "attn.k_pe"};
  const LocalReport local =
      local_report(1, 1, mla, [](int, int, const std::string& site) { return site == "attn.kv"; });
  const auto ds = details(cross_name_signatures("step0.layers.0.attn.kv", local, DiffResult{}, calls({4})));
  EXPECT_TRUE(has(ds, "attn.kv fails locally at layer 0 (its one step) while attn.q and attn.k_pe pass there: only "
                      "kv is wrong, q and k_pe are right"))
      << ::testing::PrintToString(ds);
  const LocalReport mlp = local_report(1, 1, {"mlp.gate", "mlp.up"},
                                       [](int, int, const std::string& site) { return site == "mlp.up"; });
  EXPECT_TRUE(has(details(cross_name_signatures("step0.layers.0.mlp.up", mlp, DiffResult{}, calls({4}))),
                  "only up is wrong, gate is right"));
}

TEST(CrossSignatures, DecodeStepsOnly) {
  const LocalReport local = step_site_report("mask", {1, 2, 3}, 4);
  const auto ds = details(cross_name_signatures("step1.mask", local, DiffResult{}, calls({5, 1, 1, 1})));
  ASSERT_EQ(ds.size(), 1u);
  EXPECT_EQ(ds[0], "mask fails locally at 3 of 4 forward calls (steps 1, 2 and 3) and passes at step 0: every "
                   "decode step (T = 1), never the prefill (T = 5)");
}

TEST(CrossSignatures, PrefillOnlyLaterChunksMoreKeysVerifyCallsAndNoPattern) {
  EXPECT_TRUE(has(details(cross_name_signatures("step0.mask", step_site_report("mask", {0}, 3), DiffResult{},
                                                calls({5, 1, 1}))),
                  "every call of several tokens (T = 5), never a decode step (T = 1)"));
  // Chunks 3, 2, 2 then a decode step: the later chunks fail.
  EXPECT_TRUE(has(details(cross_name_signatures("step1.mask", step_site_report("mask", {1, 2}, 4), DiffResult{},
                                                calls({3, 2, 2, 1}))),
                  "every chunk of the prompt after the first"));
  // Decode steps from the third on: more than 7 keys.
  EXPECT_TRUE(has(details(cross_name_signatures("step3.mask", step_site_report("mask", {3, 4}, 5), DiffResult{},
                                                calls({5, 1, 1, 1, 1}))),
                  "every call attending to more than 7 keys (S = P + T > 7), never one attending to fewer"));
  // Verify calls (drafts accepted reported at steps 1 and 3).
  Scenario spec = calls({4, 3, 1, 3});
  spec.rollback = {{1, 1}, {3, 0}};
  EXPECT_TRUE(has(details(cross_name_signatures("step1.mask", step_site_report("mask", {1, 3}, 4), DiffResult{}, spec)),
                  "steps 1 and 3) and passes at steps 0 and 2: every speculative verify call, never another call"));
  // Steps 1 and 3 of decode steps 1..3: nothing the calls share.
  const auto odd = details(cross_name_signatures("step1.mask", step_site_report("mask", {1, 3}, 4), DiffResult{},
                                                 calls({5, 1, 1, 1})));
  ASSERT_EQ(odd.size(), 1u);
  EXPECT_EQ(odd[0], "mask fails locally at 2 of 4 forward calls (steps 1 and 3) and passes at steps 0 and 2");
}

TEST(CrossSignatures, StepsAtTheLocalisedLayer) {
  const LocalReport local = local_report(3, 2, {"attn.k_cache", "attn.v_cache"}, [](int s, int, const std::string& site) {
    return site == "attn.k_cache" && s > 0;
  });
  const auto ds = details(cross_name_signatures("step1.layers.0.attn.k_cache", local, DiffResult{}, calls({5, 1, 1})));
  EXPECT_TRUE(has(ds, "attn.k_cache at layer 0 fails locally at 2 of 3 forward calls (steps 1 and 2) and passes at "
                      "step 0: every decode step (T = 1), never the prefill (T = 5)"))
      << ::testing::PrintToString(ds);
  EXPECT_TRUE(has(ds, "attn.k_cache fails locally at layer 0 (steps 1 and 2 of 3) while attn.v_cache passes there"));
}

TEST(CrossSignatures, OnlySomeLayersAndTheMoeOnes) {
  LocalReport local = local_report(2, 4, {"attn.q_rope", "attn.k_rope"}, [](int, int l, const std::string&) {
    return l == 1 || l == 3;
  });
  auto ds = details(cross_name_signatures("step0.layers.1.attn.q_rope", local, DiffResult{}, calls({5, 1})));
  EXPECT_TRUE(has(ds, "attn.q_rope fails locally at layers 1 and 3 of the 4 layers holding it and passes at every "
                      "step of layers 0 and 2"))
      << ::testing::PrintToString(ds);
  EXPECT_FALSE(has(ds, "MoE"));
  for (int l : {1, 3}) {
    LocalSite m;
    m.name = layer_name(0, l, "moe.out");
    m.parsed = parse_name(m.name);
    local.sites.push_back(m);
  }
  ds = details(cross_name_signatures("step0.layers.1.attn.q_rope", local, DiffResult{}, calls({5, 1})));
  EXPECT_TRUE(has(ds, "layers 0 and 2: every MoE layer, never a dense one")) << ::testing::PrintToString(ds);
}

TEST(CrossSignatures, WithoutLocalVerdictsOnlyTheSiblingsAtTheLocalisedStep) {
  DiffResult global;
  for (int s = 0; s < 2; ++s)
    for (const std::string site : {"attn.q_rope", "attn.k_rope"}) {
      TensorComparison t;
      t.name = layer_name(s, 0, site);
      t.parsed = parse_name(t.name);
      t.pass = s == 0 && site == "attn.q_rope";  // step 1 diverges everywhere (the cache carries the error)
      global.tensors.push_back(t);
    }
  LocalReport none;
  const auto ds = details(cross_name_signatures("step0.layers.0.attn.k_rope", none, global, calls({5, 1})));
  ASSERT_EQ(ds.size(), 1u);
  EXPECT_EQ(ds[0], "attn.k_rope diverges at layer 0, step 0 while attn.q_rope matches the reference there: only k is "
                   "wrong up to here, q is right");
}

TEST(CrossSignatures, RenderedWithoutAFitTheyDoNotHave) {
  ErrorSignature g;
  g.name = "step1.mask";
  g.kind = kOnlySomeKind;
  g.detail = "mask fails locally at 3 of 4 forward calls";
  EXPECT_EQ(signature_line(g), "step1.mask: only-some: mask fails locally at 3 of 4 forward calls");
  g.kind = "scale";
  g.fit = 0.25;
  EXPECT_EQ(signature_line(g), "step1.mask: scale (partial fit 0.25): mask fails locally at 3 of 4 forward calls");
}
