// Every kind of Finding (compare/finding.h) in every format: a bisection of
// each kind, made from golden-model runs where the kind can be produced
// (HF's own dump, the impl with a zoo bug, HF's dump with its KV cache
// rounded to float16, HF's bfloat16 run declared float32, HF's dump in
// llama.cpp's q/k layout, in a ring cache that wrapped, with its scores
// rescaled or one op corrupted) and from a real result with the evidence
// added where it cannot on these models (a decisive fingerprint alone, a
// batch bug's replay, a quantised model's rounding profile), rendered as
// text, Markdown, HTML, JSON, JUnit, a batch of one sequence and `merge` of
// its JSON: each says the same headline.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <nlohmann/json.hpp>

#include "bisect/pipeline.h"
#include "compare/batch_report.h"
#include "compare/bisect_report.h"
#include "compare/explain.h"
#include "compare/html_page.h"
#include "compare/merge.h"
#include "compare/report.h"
#include "compare/report_html.h"
#include "dumps/base/dtype.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sites.h"
#include "dumps/zoo/bugs.h"
#include "tests/test_compare_helpers.h"

using namespace llmdiff;
using namespace llmdiff::compare;
using llmdiff::bisect::BisectOptions;
using llmdiff::testing::golden_dump;
using llmdiff::testing::golden_model;

namespace {

const bisect::ModelOracles& oracles(const std::string& model) {
  static std::map<std::string, std::unique_ptr<bisect::ModelOracles>> cache;
  auto& m = cache[model];
  if (!m) m = std::make_unique<bisect::ModelOracles>(golden_model(model), 1);
  return *m;
}

// HF's decode dump of `model`, each tensor through `change`.
std::unique_ptr<MemoryDump> golden_with(const std::string& model,
                                        const std::function<void(TensorData&)>& change = {}) {
  DumpFile golden(golden_dump(model, "decode"));
  auto d = std::make_unique<MemoryDump>("hf " + model + " decode, changed");
  d->mutable_manifest() = golden.manifest();
  for (const auto& n : golden.names()) {
    TensorData t = golden.get(n);
    if (change) change(t);
    d->put(t);
  }
  return d;
}

BisectResult bisect_of(const std::string& model, const TensorSource& cand, BisectOptions opt = {}) {
  return bisect::bisect_candidate(oracles(model), cand, opt);
}

// The impl with `bug` over HF's decode calls.
std::unique_ptr<MemoryDump> impl_with(const std::string& model, const std::string& bug) {
  bisect::EngineOptions eo;
  eo.threads = 1;
  eo.inject = {bug};
  const Scenario sc = replay_scenario(DumpFile(golden_dump(model, "decode")));
  return bisect::run_impl_candidate(oracles(model), sc, eo);
}

bool site_is(const TensorData& t, Site s) { return parse_name(t.name).site == site_name(s); }

struct KindCase {
  std::string what;
  FindingKind kind;
  BisectResult result;
  std::string model = "llama-gqa";
};

// A real result with evidence added, explained again.
BisectResult with_evidence(BisectResult r, const std::function<void(BisectResult&)>& add) {
  add(r);
  explain(r);
  return r;
}

std::vector<KindCase> every_kind() {
  std::vector<KindCase> cases;
  const std::string gqa = "llama-gqa";
  const int64_t Dh = oracles(gqa).model.config.head_dim;
  cases.push_back({"HF's own dump", FindingKind::Passes, bisect_of(gqa, *golden_with(gqa))});
  const std::unique_ptr<MemoryDump> buggy = impl_with(gqa, "rope-interleaved");
  cases.push_back({"the impl with rope-interleaved", FindingKind::ZooBug, bisect_of(gqa, *buggy)});
  BisectOptions no_diagnosis;
  no_diagnosis.diagnose = false;
  cases.push_back({"the same, --no-diagnose", FindingKind::NotDiagnosed, bisect_of(gqa, *buggy, no_diagnosis)});
  cases.push_back({"HF's KV cache rounded to float16", FindingKind::Precision,
                   bisect_of(gqa, *golden_with(gqa, [](TensorData& t) {
                               if (site_is(t, Site::AttnKCache) || site_is(t, Site::AttnVCache) ||
                                   site_is(t, Site::AttnKRep) || site_is(t, Site::AttnVRep))
                                 for (float& x : t.f) x = f16_to_f32(f32_to_f16(x));
                             }))});
  std::unique_ptr<MemoryDump> bf16 = golden_with("llama-mha-bf16");
  bf16->mutable_manifest().dtype = "float32";
  cases.push_back(
      {"HF's bfloat16 run declared float32", FindingKind::Precision, bisect_of("llama-mha-bf16", *bf16),
       "llama-mha-bf16"});
  cases.push_back({"HF's q/k rows in llama.cpp's RoPE layout", FindingKind::Layout,
                   bisect_of(gqa, *golden_with(gqa, [Dh](TensorData& t) {
                               for (Site s : {Site::AttnQ, Site::AttnK, Site::AttnQRope, Site::AttnKRope,
                                              Site::AttnKCache, Site::AttnKRep}) {
                                 if (!site_is(t, s)) continue;
                                 std::vector<float> out(t.f.size());
                                 for (size_t base = 0; base < t.f.size(); base += size_t(Dh))
                                   for (int64_t i = 0; i < Dh / 2; ++i) {
                                     out[base + size_t(2 * i)] = t.f[base + size_t(i)];
                                     out[base + size_t(2 * i + 1)] = t.f[base + size_t(i + Dh / 2)];
                                   }
                                 t.f = out;
                               }
                             }))});
  std::unique_ptr<MemoryDump> ring = golden_with(gqa, [](TensorData& t) {
    if (t.name == layer_name(2, 0, Site::AttnCtx))
      for (float& x : t.f) x *= 1.3f;
  });
  ring->mutable_manifest().extra["kv_cache"] = R"({"kind": "ring", "capacity": 6})";
  cases.push_back({"HF's decode in a ring cache of 6 that wrapped", FindingKind::RingWrap, bisect_of(gqa, *ring)});
  cases.push_back({"HF's scores rescaled by sqrt(Dh)", FindingKind::Signature,
                   bisect_of(gqa, *golden_with(gqa, [Dh](TensorData& t) {
                               if (t.name == layer_name(0, 0, Site::AttnScores))
                                 for (float& x : t.f) x *= float(std::sqrt(double(Dh)));
                             }))});
  const BisectResult nothing = bisect_of(gqa, *golden_with(gqa, [](TensorData& t) {
    if (t.name == layer_name(0, 1, Site::MlpDown))
      for (size_t i = 0; i < t.f.size(); ++i) t.f[i] += 0.05f * std::sin(float(i) * 0.7f) * std::fabs(t.f[i]);
  }));
  cases.push_back({"HF's mlp.down of layer 1 corrupted", FindingKind::NothingFits, nothing});
  // Kinds these models cannot produce, on that real result.
  const std::string head = zoo::bug_with_signature(zoo::Signature::HeadOnly).name;
  cases.push_back({"a decisive fingerprint alone", FindingKind::ZooBug, with_evidence(nothing, [&](BisectResult& r) {
                     r.diagnosis.fingerprints.push_back({head, "final_norm matches while logits do not", true});
                   })});
  cases.push_back({"a batch bug's schedule replay", FindingKind::ZooBug, with_evidence(nothing, [](BisectResult& r) {
                     BatchReplayEvidence b;
                     b.iterations = 4;
                     b.fits = {"packed-cross-attention"};
                     b.descriptions = {zoo::find_bug("packed-cross-attention")->description};
                     b.compared = 3;
                     b.tried = "packed-cross-attention 3/3";
                     r.evidence.batch_replay = b;
                   })});
  cases.push_back({"a quantised model's rounding profile", FindingKind::Precision,
                   with_evidence(nothing, [](BisectResult& r) {
                     r.evidence.rounding = RoundingProbe{R"({"kv_cache":"f16","matmul_input":"ggml"})",
                                                        "kv_cache=f16,matmul_input=ggml",
                                                        r.localised_at().value_or(""), 1e-4, 1e-2};
                   })});
  return cases;
}

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// `text` holds `words` (a headline opens a sentence in some formats: any
// case), with a readable failure.
void says(const std::string& format, const std::string& text, const std::string& words) {
  EXPECT_NE(lower(text).find(lower(words)), std::string::npos)
      << format << " lacks \"" << words << "\":\n" << text.substr(0, 4000);
}

}  // namespace

TEST(FindingFormats, EveryKindSaysTheSameHeadlineInEveryFormat) {
  const std::vector<KindCase> cases = every_kind();
  std::set<FindingKind> kinds;
  for (const KindCase& c : cases) {
    SCOPED_TRACE(c.what + ": " + headline(c.result) + "; " + explanation(c.result.finding).substr(0, 600));
    const BisectResult& r = c.result;
    ASSERT_EQ(r.finding.kind, c.kind) << kind_name(r.finding.kind);
    kinds.insert(r.finding.kind);
    const std::string h = headline(r.finding), whole = headline(r);
    EXPECT_EQ(r.exit_code(), c.kind == FindingKind::Passes ? 0 : 1);
    says("the whole result's headline", whole, h);

    const std::string table = render_bisect_table(r);
    if (c.kind == FindingKind::Passes)
      says("text", table, "RESULT: no divergence");
    else
      says("text", table, "Diagnosis at " + r.finding.focus + ": " + h + "\n");
    says("Markdown", render_bisect_markdown(r), h);
    says("HTML", render_bisect_html(r), html::esc(whole));
    const std::string junit = render_bisect_junit(r);
    says("JUnit", junit, "<property name=\"finding\" value=\"" + xml_escape(h) + "\"/>");
    if (c.kind != FindingKind::Passes) says("JUnit", junit, "<failure message=\"" + xml_escape(whole) + "\"");

    const nlohmann::json j = nlohmann::json::parse(render_bisect_json(r));
    EXPECT_EQ(j["finding"]["kind"], kind_name(c.kind));
    EXPECT_EQ(j["finding"]["headline"], h);
    EXPECT_EQ(j["finding"]["explanation"], explanation(r.finding));
    EXPECT_EQ(j["headline"], whole);
    EXPECT_EQ(headline(finding_from_json(j["finding"])), h);
    EXPECT_EQ(j["diagnosis"]["basis"].is_null(), !basis_label(r.finding).has_value());
    EXPECT_EQ(j["diagnosis"]["bug"].is_null(), c.kind != FindingKind::ZooBug);

    // A batch of this one sequence.
    BatchBisect b;
    b.candidate_label = r.candidate_label;
    b.sequences.push_back({0, r, std::nullopt, std::nullopt});
    if (!r.ok()) b.first = 0;
    const nlohmann::json bj = batch_to_json(b);
    EXPECT_EQ(bj["sequences"][0]["bisect"]["finding"]["headline"], h);
    says("batch JUnit", render_batch_junit(b), xml_escape(h));
    if (c.kind != FindingKind::Passes) says("batch text", render_batch_table(b), h);

    // `merge` of its JSON as a shard holding every layer.
    BisectResult shard = r;
    const int L = int(oracles(c.model).model.config.num_hidden_layers);
    shard.layers = LayerWindow{0, L, L};
    const nlohmann::json merged = merge_bisect_shards({ShardResult{"shard.json", bisect_to_json(shard)}});
    EXPECT_EQ(merged["headline"], whole);
    EXPECT_EQ(merged["finding"]["headline"], h);
    const std::string summary = render_merged_summary(merged);
    if (c.kind == FindingKind::Passes)
      says("merge", summary, "RESULT: no divergence");
    else
      says("merge", summary, "diagnosis             " + h + ", from shard.json");
  }
  // Every kind, and every basis of a zoo bug but the local recompute alone
  // and the block reuse (tests/test_compare_explain.cpp).
  EXPECT_EQ(kinds.size(), 8u);
}
