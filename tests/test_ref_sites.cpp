// The ref's graph and the site table (dumps/contract/sites.h): the graph
// computes, for every golden model, exactly the sites the table gives that
// model, each of the spec's shape; names parse to their Site once.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/contract/sites.h"
#include "dumps/model/weights.h"
#include "ref/graph.h"
#include "ref/ref_engine.h"
#include "tests/support.h"

namespace llmdiff {
namespace {

using testing::golden_dump;
using testing::golden_model;
using testing::golden_models;

// The names of the forward's sites the table gives the model at each call
// of `steps`, with rope.inv_freq (and `generated` when asked).
std::set<std::string> table_names(const ModelConfig& m, int steps, bool generated) {
  std::set<std::string> out = {"rope.inv_freq"};
  if (generated) out.insert("generated");
  for (int s = 0; s < steps; ++s)
    for (const SiteInfo& i : site_table()) {
      if (i.scope == SiteScope::Record) continue;
      if (i.scope != SiteScope::Layer) {
        out.insert(step_name(s, i.id));
        continue;
      }
      for (int l = 0; l < int(m.num_hidden_layers); ++l)
        if (model_has_site(m, l, i.id)) out.insert(layer_name(s, l, i.id));
    }
  return out;
}

// Each golden model's decode calls (a prefill, then one token a call)
// through the ref: every name it emits is one the table gives the model,
// and every such name is emitted, of the spec's shape.
TEST(RefSites, ComputesExactlyTheTablesSitesOfEachModel) {
  for (const std::string& name : golden_models()) {
    Model model = Model::load(golden_model(name));
    const ModelConfig& cfg = model.config;
    DumpFile golden(golden_dump(name, "decode"));
    ref::RefOptions opt;
    opt.threads = 1;
    opt.dtype = ComputeDType::Float32;
    auto engine = ref::make_ref_engine(model, opt);
    MemoryDump mem("ref");
    const Scenario sc = replay_scenario(golden);
    run_scenario(*engine, sc, mem);
    ASSERT_GE(sc.steps.size(), 2u) << name;

    const std::vector<std::string> emitted = mem.names();
    EXPECT_EQ(std::set<std::string>(emitted.begin(), emitted.end()),
              table_names(cfg, int(sc.steps.size()), mem.has("generated")))
        << name;

    const int64_t generated = mem.has("generated") ? numel(mem.shape("generated")) : 0;
    for (const std::string& n : emitted) {
      const CanonName c = parse_name(n);
      int64_t T = 0, S = 0;
      for (int s = 0; s <= c.step && c.step >= 0; ++s) {
        T = int64_t(sc.steps[size_t(s)].size());
        S += T;
      }
      const std::optional<Shape> want = spec_shape(c, cfg, T, S, generated);
      ASSERT_TRUE(want) << name << ": " << n;
      EXPECT_EQ(mem.shape(n), *want) << name << ": " << n;
    }
  }
}

TEST(RefSites, NamesParseToTheirSiteOfTheRightScope) {
  const ref::SiteName k = ref::parse_site_name("step1.layers.2.attn.k_cache");
  EXPECT_EQ(k.kind, CanonName::Kind::Layer);
  EXPECT_EQ(k.step, 1);
  EXPECT_EQ(k.layer, 2);
  EXPECT_EQ(k.id, Site::AttnKCache);
  EXPECT_EQ(ref::parse_site_name("step3.next_logits").id, Site::NextLogits);
  EXPECT_EQ(ref::parse_site_name("step0.rows").id, Site::Rows);
  // A site named in the other scope, a site outside the table, and the names
  // that are no step's site.
  EXPECT_FALSE(ref::parse_site_name("step0.attn.q").id);
  EXPECT_FALSE(ref::parse_site_name("step0.layers.0.embed").id);
  EXPECT_FALSE(ref::parse_site_name("step0.layers.0.attn.qkv").id);
  EXPECT_FALSE(ref::parse_site_name("rope.inv_freq").id);
  EXPECT_FALSE(ref::parse_site_name("generated").id);
  EXPECT_FALSE(ref::parse_site_name("attn.q").id);
}

// What a forward call carries to the next: the four KV caches of the table.
TEST(RefSites, CacheSitesAreTheKvCaches) {
  std::set<std::string> caches;
  for (const SiteInfo& i : site_table())
    if (is_kv_cache(i.id)) caches.insert(i.name);
  EXPECT_EQ(caches, (std::set<std::string>{"attn.k_cache", "attn.v_cache", "attn.latent_cache", "attn.k_pe_cache"}));
}

}  // namespace
}  // namespace llmdiff
