// Canonical names of llm-dump/1: parse/format round trip on every golden name,
// names outside the spec, and the canonical order.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "dumps/model/config.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/names.h"
#include "tests/support.h"
#include "tests/test_dumps_helpers.h"

namespace llmdiff {
namespace {

using namespace llmdiff::testing;

const std::vector<std::string> kScenarios = {"prefill", "decode", "chunked"};

bool in(const std::vector<std::string>& v, const std::string& s) { return std::find(v.begin(), v.end(), s) != v.end(); }

// Names in the order the file's header lists them.
std::vector<std::string> file_order(const DumpFile& d) {
  std::vector<std::string> v;
  for (const auto& t : d.file().tensors()) v.push_back(t.name);
  return v;
}

TEST(Names, EveryGoldenNameParsesAndFormatsBack) {
  size_t checked = 0;
  for (const auto& model : golden_models()) {
    const ModelConfig cfg = load_config(golden_model(model));
    for (const auto& sc : kScenarios) {
      DumpFile d(golden_dump(model, sc));
      for (const auto& n : file_order(d)) {
        SCOPED_TRACE(model + "/" + sc + ": " + n);
        const CanonName c = parse_name(n);
        EXPECT_EQ(c.str(), n);
        ++checked;
        switch (c.kind) {
          case CanonName::Kind::InvFreq: EXPECT_EQ(n, "rope.inv_freq"); break;
          case CanonName::Kind::Generated: EXPECT_EQ(n, "generated"); break;
          case CanonName::Kind::Step:
            EXPECT_TRUE(in(step_sites_before_layers(), c.site) || in(step_sites_after_layers(), c.site));
            EXPECT_LT(c.step, d.manifest().steps);
            EXPECT_EQ(c.layer, -1);
            EXPECT_EQ(step_name(c.step, c.site), n);
            break;
          case CanonName::Kind::Layer:
            EXPECT_TRUE(in(layer_sites(), c.site));
            EXPECT_LT(c.step, d.manifest().steps);
            EXPECT_GE(c.layer, 0);
            EXPECT_LT(c.layer, cfg.num_hidden_layers);
            EXPECT_EQ(layer_name(c.step, c.layer, c.site), n);
            break;
          case CanonName::Kind::Unknown: ADD_FAILURE() << "a golden name outside the spec"; break;
        }
      }
    }
  }
  EXPECT_GT(checked, 1500u);  // 1868 names in the golden dumps
}

TEST(Names, ParseSplitsStepLayerAndSite) {
  CanonName c = parse_name("step12.layers.30.attn.k_cache");
  EXPECT_EQ(c.kind, CanonName::Kind::Layer);
  EXPECT_EQ(c.step, 12);
  EXPECT_EQ(c.layer, 30);
  EXPECT_EQ(c.site, "attn.k_cache");
  c = parse_name("step3.rope.cos");
  EXPECT_EQ(c.kind, CanonName::Kind::Step);
  EXPECT_EQ(c.step, 3);
  EXPECT_EQ(c.site, "rope.cos");
  EXPECT_EQ(step_name(0, "mask"), "step0.mask");
  EXPECT_EQ(layer_name(0, 1, "attn.q"), "step0.layers.1.attn.q");
  EXPECT_EQ(layer_name(10, 2, "out"), "step10.layers.2.out");
}

TEST(Names, NamesOutsideTheSpecAreKeptVerbatim) {
  for (const std::string n : {"foo", "step", "step.embed", "stepA.embed", "step0", "step0.", "step-1.embed",
                              "step01.embed", "step0.layers.", "step0.layers.x.attn_norm", "step0.layers.1",
                              "step0.layers.1.", "step0.layers.01.out", "step99999999999.embed", "Step0.embed",
                              "rope.inv_freq.x", "generated2", "model.layers.0.mlp.up_proj.weight", ""}) {
    const CanonName c = parse_name(n);
    EXPECT_EQ(c.kind, CanonName::Kind::Unknown) << n;
    EXPECT_EQ(c.site, n);
    EXPECT_EQ(c.str(), n);
  }
  // A well-formed step/layer prefix with a site the spec does not list keeps
  // its step and layer.
  CanonName c = parse_name("step2.my_probe");
  EXPECT_EQ(c.kind, CanonName::Kind::Step);
  EXPECT_EQ(c.step, 2);
  EXPECT_EQ(c.site, "my_probe");
  EXPECT_EQ(c.str(), "step2.my_probe");
  c = parse_name("step0.layers.3.attn.extra");
  EXPECT_EQ(c.kind, CanonName::Kind::Layer);
  EXPECT_EQ(c.layer, 3);
  EXPECT_EQ(c.str(), "step0.layers.3.attn.extra");
}

bool before(const std::string& a, const std::string& b) {
  NameOrder lt;
  return lt(a, b) && !lt(b, a);
}

TEST(Names, StepsAndLayersOrderNumerically) {
  EXPECT_TRUE(before("step2.tokens", "step10.tokens"));
  EXPECT_TRUE(before("step9.next_logits", "step10.tokens"));
  EXPECT_TRUE(before("step0.layers.2.out", "step0.layers.10.attn_norm"));
  EXPECT_TRUE(before("step0.layers.9.mlp.down", "step0.layers.10.attn_norm"));
  EXPECT_TRUE(before("step1.layers.2.attn.q", "step1.layers.10.attn.q"));
  EXPECT_TRUE(before("step2.layers.10.out", "step10.layers.2.attn_norm"));
  EXPECT_TRUE(before("step0.layers.31.out", "step0.final_norm"));
}

TEST(Names, OrderFollowsTheSpecTables) {
  EXPECT_TRUE(before("rope.inv_freq", "step0.tokens"));
  EXPECT_TRUE(before("step0.tokens", "step0.positions"));
  EXPECT_TRUE(before("step0.mask", "step0.embed"));
  EXPECT_TRUE(before("step0.embed", "step0.layers.0.attn_norm"));
  EXPECT_TRUE(before("step0.layers.0.attn.v", "step0.layers.0.attn.q_norm"));
  EXPECT_TRUE(before("step0.layers.0.attn.k_norm", "step0.layers.0.attn.q_rope"));
  EXPECT_TRUE(before("step0.layers.0.attn.probs", "step0.layers.0.attn.ctx"));
  EXPECT_TRUE(before("step0.layers.0.out", "step0.layers.1.attn_norm"));
  EXPECT_TRUE(before("step0.final_norm", "step0.last_hidden"));
  EXPECT_TRUE(before("step0.logits", "step0.next_logits"));
  EXPECT_TRUE(before("step0.next_logits", "step1.tokens"));
  EXPECT_TRUE(before("step5.next_logits", "generated"));
  // Names outside the spec: after the known ones, among themselves with
  // numbers compared by value.
  EXPECT_TRUE(before("generated", "aaa"));
  EXPECT_TRUE(before("generated", "step0"));
  EXPECT_TRUE(before("probe.2", "probe.10"));
  EXPECT_TRUE(before("model.layers.2.mlp.up_proj.weight", "model.layers.10.mlp.up_proj.weight"));
  // Unlisted sites under a valid prefix: after that step's / layer's known sites.
  EXPECT_TRUE(before("step0.next_logits", "step0.my_probe"));
  EXPECT_TRUE(before("step0.my_probe", "step1.tokens"));
  EXPECT_TRUE(before("step0.layers.0.out", "step0.layers.0.zz_extra"));
  EXPECT_TRUE(before("step0.layers.0.zz_extra", "step0.layers.1.attn_norm"));
}

TEST(Names, SiteRankFollowsTheTables) {
  int expect = 0;
  for (const auto* table : {&step_sites_before_layers(), &layer_sites(), &step_sites_after_layers()})
    for (const auto& s : *table) EXPECT_EQ(site_rank(s), expect++) << s;
  EXPECT_EQ(site_rank("tokens"), 0);
  EXPECT_EQ(site_rank("next_logits"), expect - 1);
  EXPECT_EQ(site_rank("bogus"), -1);
  EXPECT_EQ(site_rank("layers.0.out"), -1);
  // Tables hold the spec's names.
  EXPECT_EQ(step_sites_before_layers().front(), "tokens");
  EXPECT_EQ(step_sites_before_layers().back(), "embed");
  EXPECT_EQ(layer_sites().front(), "attn_norm");
  EXPECT_EQ(layer_sites().back(), "out");
  EXPECT_EQ(layer_sites().size(), 39u);
  EXPECT_EQ(step_sites_after_layers(),
            (std::vector<std::string>{"final_norm", "last_hidden", "logits", "next_logits"}));
}

TEST(Names, GoldenFileOrderIsTheCanonicalOrder) {
  for (const auto& model : golden_models()) {
    for (const auto& sc : kScenarios) {
      SCOPED_TRACE(model + "/" + sc);
      DumpFile d(golden_dump(model, sc));
      std::vector<std::string> file = file_order(d);
      std::vector<std::string> canon = d.names();
      ASSERT_EQ(canon.size(), file.size());
      // The spec puts `generated` last; the golden writer stored it right
      // after rope.inv_freq. Every other name is in canonical order in the file.
      if (sc == "decode") {
        EXPECT_EQ(canon.back(), "generated");
        ASSERT_EQ(file[1], "generated");
        file.erase(file.begin() + 1);
        canon.pop_back();
      }
      EXPECT_EQ(file, canon);
      EXPECT_EQ(canon.front(), "rope.inv_freq");
    }
  }
}

TEST(Names, SortingIsDeterministicAndAStrictWeakOrder) {
  DumpFile d(golden_dump("qwen3-qknorm", "decode"));
  std::vector<std::string> names = d.names();
  for (const std::string extra : {"zeta", "alpha.10", "alpha.9", "step1.custom", "step0.layers.1.custom",
                                  "step10.tokens", "step2.layers.10.out"})
    names.push_back(extra);
  std::vector<std::string> expected = names;
  sort_canonical(expected);
  std::mt19937 rng(11);
  for (int k = 0; k < 5; ++k) {
    std::vector<std::string> shuffled = names;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    sort_canonical(shuffled);
    EXPECT_EQ(shuffled, expected);
  }
  NameOrder lt;
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_FALSE(lt(expected[i], expected[i]));
    if (i + 1 < expected.size()) {
      EXPECT_TRUE(lt(expected[i], expected[i + 1])) << expected[i] << " / " << expected[i + 1];
      EXPECT_FALSE(lt(expected[i + 1], expected[i]));
    }
  }
  // Unknown names come after `generated`, numerically ordered.
  auto pos = [&](const std::string& n) { return std::find(expected.begin(), expected.end(), n) - expected.begin(); };
  EXPECT_LT(pos("generated"), pos("alpha.9"));
  EXPECT_LT(pos("alpha.9"), pos("alpha.10"));
  EXPECT_LT(pos("alpha.10"), pos("zeta"));
  EXPECT_LT(pos("step3.next_logits"), pos("step10.tokens"));
  EXPECT_LT(pos("step1.next_logits"), pos("step1.custom"));
  EXPECT_LT(pos("step1.custom"), pos("step2.tokens"));
}

}  // namespace
}  // namespace llmdiff
