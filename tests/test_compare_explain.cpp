// The verdict of a bisection (compare/explain.h, compare/finding.h): each
// explainer on its own, on results built from their evidence; the order of
// the list (which evidence wins, and what is gathered only when reached);
// a Finding read back from its JSON says the same headline.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "compare/explain.h"
#include "compare/finding.h"
#include "compare/fingerprints.h"
#include "dumps/contract/names.h"
#include "dumps/zoo/bugs.h"
#include "tests/test_diag_toys.h"

using namespace llmdiff;
using namespace llmdiff::compare;

namespace {

TensorComparison compared(const std::string& name, bool pass) {
  TensorComparison t;
  t.name = name;
  t.parsed = parse_name(name);
  t.pass = pass;
  return t;
}

// A result whose global comparison holds `names` in order; those in
// `failing` diverge.
BisectResult result_with(const std::vector<std::string>& names, const std::vector<std::string>& failing) {
  BisectResult r;
  for (const auto& n : names) {
    const bool fails = std::find(failing.begin(), failing.end(), n) != failing.end();
    if (fails && !r.global.first_divergence) r.global.first_divergence = r.global.tensors.size();
    r.global.tensors.push_back(compared(n, !fails));
  }
  return r;
}

// A decode of three steps that diverges from step 2 on.
BisectResult diverging_at_step2() {
  return result_with({"step0.layers.0.attn.ctx", "step1.layers.0.attn.ctx", "step2.layers.0.attn.ctx",
                      "step2.layers.0.out"},
                     {"step2.layers.0.attn.ctx", "step2.layers.0.out"});
}

LocalSite local_site(const std::string& name, bool pass) {
  LocalSite s;
  s.name = name;
  s.parsed = parse_name(name);
  s.pass = pass;
  return s;
}

void add_local(BisectResult& r, LocalSite s) {
  r.local.ran = true;
  if (!s.pass && !r.local.first_failure) r.local.first_failure = r.local.sites.size();
  r.local.sites.push_back(std::move(s));
}

HypothesisEvidence supported(const std::string& bug, bool replay, bool local, double score) {
  HypothesisEvidence e;
  e.hypothesis = Hypothesis{bug, std::nullopt};
  e.supported_by_replay = replay;
  e.supported_by_local = local;
  e.replay_text = "replay with " + bug + " reproduces the candidate at 4/4 names";
  e.local_text = "recomputed with " + bug + ": max err 0";
  e.summary = e.replay_text;
  e.description = "what " + bug + " does";
  e.score = score;
  return e;
}

BisectResult diagnosed(BisectResult r) {
  r.evidence.diagnosed = true;
  return r;
}

}  // namespace

// ---------------------------------------------------------------------------
// Each explainer

TEST(Explainers, PassesWhenNothingDiverges) {
  BisectResult same = result_with({"step0.embed", "step0.logits"}, {});
  ASSERT_TRUE(explain_passes(same));
  EXPECT_EQ(explain_passes(same)->kind, FindingKind::Passes);
  EXPECT_FALSE(explain_passes(diverging_at_step2()));
}

TEST(Explainers, ARingWrapExplainsAnErrorStartingWhereTheRingWrapped) {
  BisectResult r = diverging_at_step2();
  EXPECT_FALSE(explain_ring_wrap(r));  // no ring
  r.evidence.ring = RingWrap{6, 2, 7, "the ring wraps"};
  const std::optional<Finding> f = explain_ring_wrap(r);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->kind, FindingKind::RingWrap);
  EXPECT_EQ(f->wrap_step, 2);
  EXPECT_EQ(f->capacity, 6);
  EXPECT_NE(f->evidence.find("positions < 1 overwritten"), std::string::npos) << f->evidence;
  // An error before the wrap is not the wrap's doing.
  r.evidence.ring = RingWrap{6, 3, 8, "the ring wraps"};
  EXPECT_FALSE(explain_ring_wrap(r));
}

TEST(Explainers, AFloat32RunAtItsWeightsDtypeDeclaresIt) {
  BisectResult r = diverging_at_step2();
  r.evidence.weights_dtype = WeightsDtypeCheck{ComputeDType::BFloat16, true, 0.9};
  ASSERT_TRUE(explain_weights_dtype(r));
  EXPECT_EQ(explain_weights_dtype(r)->declare, Declaration::ComputeDtype);
  EXPECT_EQ(explain_weights_dtype(r)->dtype, ComputeDType::BFloat16);
  // Within the 16-bit noise but far below a 16-bit run's error: a small bug hides there.
  r.evidence.weights_dtype->median_ratio = 0.1;
  EXPECT_FALSE(explain_weights_dtype(r));
  r.evidence.weights_dtype = WeightsDtypeCheck{ComputeDType::BFloat16, false, 0.9};
  EXPECT_FALSE(explain_weights_dtype(r));
}

// One op rounded to 16 bits (it and its consumers fail on their own inputs,
// in one layer of one step) is that op's signature, not a dtype to declare;
// a 16-bit engine's local failures are in every layer.
TEST(Explainers, OneOpRoundedIsNoDtypeToDeclare) {
  BisectResult r = diverging_at_step2();
  r.evidence.weights_dtype = WeightsDtypeCheck{ComputeDType::BFloat16, true, 0.9};
  add_local(r, local_site("step2.layers.0.attn_norm", false));
  add_local(r, local_site("step2.layers.0.attn.q", false));
  add_local(r, local_site("step2.layers.1.attn_norm", true));
  EXPECT_FALSE(explain_weights_dtype(r));
  add_local(r, local_site("step2.layers.1.attn.q", false));
  ASSERT_TRUE(explain_weights_dtype(r));
  EXPECT_EQ(explain_weights_dtype(r)->dtype, ComputeDType::BFloat16);
}

TEST(Explainers, ASixteenBitCacheByDesignDeclaresTheCacheType) {
  BisectResult r = diverging_at_step2();
  add_local(r, local_site("step2.layers.0.attn.k_cache", true));
  EXPECT_FALSE(explain_kv_cache(r));  // the cache is not 16-bit
  KvCacheRounding k;
  k.stored_as = ComputeDType::Float16;
  r.evidence.kv_cache = k;
  std::optional<Finding> f = explain_kv_cache(r);  // no op fails locally
  ASSERT_TRUE(f);
  EXPECT_EQ(f->declare, Declaration::KvCache);
  EXPECT_EQ(f->dtype, ComputeDType::Float16);
  EXPECT_NE(f->evidence.find("\"precision\": {\"kv_cache\": \"f16\"}"), std::string::npos) << f->evidence;
  // Failures other than the attention products reading the cache: not the cache's doing.
  add_local(r, local_site("step2.layers.0.attn.scores", false));
  EXPECT_FALSE(explain_kv_cache(r));
  r.evidence.kv_cache->products_only = true;
  r.evidence.kv_cache->first_product = "step2.layers.0.attn.scores";
  r.evidence.kv_cache->failing = 1;
  f = explain_kv_cache(r);
  ASSERT_TRUE(f);
  EXPECT_NE(f->evidence.find("\"matmul_input\": \"ggml\""), std::string::npos) << f->evidence;
}

TEST(Explainers, TheBestSupportedHypothesisIsTheZoosBug) {
  BisectResult r = diverging_at_step2();
  r.diagnosis.ranked = {supported("rope-interleaved", true, false, 7), supported("mask-square", false, false, 1)};
  r.diagnosis.ranked[1].supported_by_replay = false;
  EXPECT_FALSE(explain_zoo_by_runs(r));  // not diagnosed
  r = diagnosed(r);
  std::optional<Finding> f = explain_zoo_by_runs(r);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->bug.bug, "rope-interleaved");
  EXPECT_EQ(f->basis, BugBasis::Replay);
  EXPECT_EQ(f->description, "what rope-interleaved does");
  EXPECT_NE(f->evidence.find("reproduces the candidate"), std::string::npos);
  // Both kinds of evidence; another bug supported as well is ambiguous.
  r.diagnosis.ranked = {supported("rope-interleaved", true, true, 9), supported("rope-theta", true, true, 9)};
  f = explain_zoo_by_runs(r);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->basis, BugBasis::Both);
  EXPECT_EQ(f->ambiguous, std::vector<std::string>{"rope-theta"});
  EXPECT_NE(f->evidence.find("equally well"), std::string::npos);
  r.diagnosis.ranked = {supported("rope-interleaved", false, false, 1)};
  EXPECT_FALSE(explain_zoo_by_runs(r));
}

TEST(Explainers, ADecisiveFingerprintNamesTheBugAlone) {
  BisectResult r = diagnosed(diverging_at_step2());
  const std::string bug = zoo::bug_with_signature(zoo::Signature::PositionsRestart).name;
  r.diagnosis.fingerprints.push_back({bug, "positions start at 0", false});
  EXPECT_FALSE(explain_zoo_by_fingerprint(r));  // a hint only
  r.diagnosis.fingerprints.push_back({bug, "positions start at 0", true});
  const std::optional<Finding> f = explain_zoo_by_fingerprint(r);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->bug.bug, bug);
  EXPECT_EQ(f->basis, BugBasis::Fingerprint);
  EXPECT_EQ(f->description, zoo::find_bug(bug)->description);
  // Where the clean run reproduces the candidate, the divergence is rounding.
  r.diagnosis.clean_reproduces = "the clean implementation reproduces the candidate";
  EXPECT_FALSE(explain_zoo_by_fingerprint(r));
}

TEST(Explainers, ABlockReusedWhileReadNamesTheBatchBug) {
  BisectResult r = diverging_at_step2();
  EXPECT_FALSE(explain_block_reuse(r));
  const std::string bug = zoo::bug_with_signature(zoo::Signature::BlockShared).name;
  r.evidence.block_reuse = BlockReuse{bug, "block 0 is in the tables of seq0 and seq2", 0, 2, 3};
  const std::optional<Finding> f = explain_block_reuse(r);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->bug.bug, bug);
  EXPECT_EQ(f->basis, BugBasis::Fingerprint);
  EXPECT_NE(f->evidence.find("(engine iteration 3)"), std::string::npos) << f->evidence;
}

TEST(Explainers, ABatchBugWhoseReplayReproducesTheSequenceIsNamed) {
  BisectResult r = diverging_at_step2();
  BatchReplayEvidence b;
  b.seq = 1;
  b.iterations = 5;
  b.tried = "batch-positions 0/2; packed-cross-attention 2/2";
  r.evidence.batch_replay = b;
  EXPECT_FALSE(explain_batch_replay(r));
  // Nothing reproduced: said with the closest numbers when nothing else fits.
  EXPECT_NE(explain_nothing_fits(diagnosed(r))->evidence.find("reproduces none of them"), std::string::npos);
  r.evidence.batch_replay->fits = {"packed-cross-attention", "batch-positions"};
  r.evidence.batch_replay->descriptions = {"attention over the whole batch", "positions from the batch's start"};
  r.evidence.batch_replay->compared = 2;
  const std::optional<Finding> f = explain_batch_replay(r);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->bug.bug, "packed-cross-attention");
  EXPECT_EQ(f->basis, BugBasis::BatchReplay);
  EXPECT_EQ(f->ambiguous, std::vector<std::string>{"batch-positions"});
  EXPECT_NE(f->evidence.find("reproduces seq1's 2 diverging names"), std::string::npos) << f->evidence;
}

TEST(Explainers, ATensorParallelRankCheckOrReplayNamesTheBug) {
  BisectResult r = diverging_at_step2();
  TensorParallelEvidence t;
  t.ranks = 4;
  t.replayed = true;
  t.tried = "tp-allreduce-missing 0/3; tp-allreduce-twice 0/3";
  r.evidence.tensor_parallel = t;
  EXPECT_FALSE(explain_tensor_parallel(r));
  EXPECT_NE(explain_nothing_fits(diagnosed(r))->evidence.find("over its 4 ranks with each tensor-parallel bug "
                                                              "reproduces none of them"),
            std::string::npos);
  // A rank check's exact finding: the bug with the rank, as a fingerprint.
  r.evidence.tensor_parallel->bug = "tp-kv-heads-split";
  r.evidence.tensor_parallel->rank = 1;
  r.evidence.tensor_parallel->text = "rank 1's attn.k holds kv head 1 where its query heads read kv head 0";
  std::optional<Finding> f = explain_tensor_parallel(r);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->bug.bug, "tp-kv-heads-split");
  EXPECT_EQ(f->basis, BugBasis::Fingerprint);
  EXPECT_EQ(f->evidence, "rank 1's attn.k holds kv head 1 where its query heads read kv head 0");
  // Else the replay over the ranks that reproduces every diverging name.
  r.evidence.tensor_parallel->bug.clear();
  r.evidence.tensor_parallel->fits = {"tp-allreduce-twice"};
  r.evidence.tensor_parallel->descriptions = {"all-reduced twice"};
  r.evidence.tensor_parallel->compared = 3;
  f = explain_tensor_parallel(r);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->bug.bug, "tp-allreduce-twice");
  EXPECT_EQ(f->basis, BugBasis::Replay);
  EXPECT_NE(f->evidence.find("over its 4 ranks with tp-allreduce-twice reproduces its 3 diverging names"),
            std::string::npos)
      << f->evidence;
}

TEST(Explainers, AProfilesRoundingsThatReproduceTheCandidateAreDeclared) {
  BisectResult r = diverging_at_step2();
  r.evidence.rounding = RoundingProbe{R"({"kv_cache":"f16","matmul_input":"ggml"})", "kv_cache=f16,matmul_input=ggml",
                                      "step2.layers.0.attn.ctx", 0.1, 1.0};
  const std::optional<Finding> f = explain_rounding_profile(r);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->declare, Declaration::Profile);
  EXPECT_EQ(headline(*f), R"(precision, not a bug: declare "precision": {"kv_cache":"f16","matmul_input":"ggml"})");
  r.evidence.rounding->to_profile = 0.5;  // closer, but not 5x
  EXPECT_FALSE(explain_rounding_profile(r));
}

TEST(Explainers, OneLayoutTransformForEveryDivergingNameIsTheEnginesLayout) {
  BisectResult r = diagnosed(result_with({"step0.layers.0.attn.q", "step0.layers.0.attn.k"},
                                         {"step0.layers.0.attn.q", "step0.layers.0.attn.k"}));
  EXPECT_FALSE(explain_layout(r));  // no layout explains them
  LayoutFinding lf;
  lf.kind = LayoutFinding::Kind::RopePairing;
  lf.rope = "interleaved->half";
  lf.matches = true;
  lf.summary = "matches after re-pairing";
  r.global.tensors[0].findings.push_back(lf);
  EXPECT_FALSE(explain_layout(r));  // one name left unexplained
  r.global.tensors[1].findings.push_back(lf);
  const std::optional<Finding> f = explain_layout(r);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->layout.rope, "interleaved->half");
  EXPECT_NE(headline(*f).find("the engine's own layout, not a bug (rope-pairing"), std::string::npos);
}

TEST(Explainers, ADecisiveSignatureAtTheLocalisedSiteCharacterisesTheDivergence) {
  BisectResult r = diagnosed(diverging_at_step2());
  ErrorSignature s;
  s.name = "step2.layers.0.out";  // not the localised site
  s.kind = "scale";
  s.detail = "candidate = reference x 2";
  s.decisive = true;
  r.diagnosis.signatures = {s};
  EXPECT_FALSE(explain_signature(r));
  s.name = "step2.layers.0.attn.ctx";
  r.diagnosis.signatures = {s};
  const std::optional<Finding> f = explain_signature(r);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->signature.kind, "scale");
  EXPECT_NE(f->evidence.find("no hypothesis of the bug zoo fits"), std::string::npos);
}

TEST(Explainers, NothingFitsIsTheLastWord) {
  BisectResult r = diverging_at_step2();
  EXPECT_EQ(explain_nothing_fits(r)->kind, FindingKind::NotDiagnosed);
  r = diagnosed(r);
  r.diagnosis.ranked = {supported("rope-interleaved", false, false, 0.5)};
  const std::optional<Finding> f = explain_nothing_fits(r);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->kind, FindingKind::NothingFits);
  EXPECT_NE(f->evidence.find("no hypothesis of the bug zoo fits the evidence at step2.layers.0.attn.ctx"),
            std::string::npos);
  EXPECT_NE(f->evidence.find("closest: replay with rope-interleaved"), std::string::npos) << f->evidence;
}

// ---------------------------------------------------------------------------
// The list

TEST(Explain, TheListRunsInOrderAndGathersOnlyWhatItReaches) {
  const std::vector<Explainer>& list = explainers();
  ASSERT_FALSE(list.empty());
  EXPECT_EQ(list.front().explain, &explain_passes);
  EXPECT_EQ(list.back().explain, &explain_nothing_fits);
  // A ring that wrapped comes before the hypotheses: they are not replayed.
  BisectResult r = diverging_at_step2();
  r.evidence.ring = RingWrap{6, 2, 7, "wraps"};
  std::vector<Need> asked;
  auto gather = [&](Need n, BisectResult& res) {
    asked.push_back(n);
    if (n != Need::Diagnosis) return false;
    res.diagnosis.ranked = {supported("rope-interleaved", true, false, 7)};
    res.evidence.diagnosed = true;
    return true;
  };
  explain(r, gather);
  EXPECT_EQ(r.finding.kind, FindingKind::RingWrap);
  EXPECT_EQ(r.finding.focus, "step2.layers.0.attn.ctx");
  EXPECT_TRUE(asked.empty());
  // Without the ring, the diagnosis is gathered once and names the bug (a
  // tensor-parallel candidate's rank checks are asked for first, refused).
  r.evidence.ring.reset();
  explain(r, gather);
  EXPECT_EQ(r.finding.kind, FindingKind::ZooBug);
  EXPECT_EQ(asked, (std::vector<Need>{Need::TensorParallel, Need::Diagnosis}));
  // A need refused is asked again later (a batch's replay, after the sequences).
  BisectResult s = diverging_at_step2();
  asked.clear();
  explain(s, [&](Need n, BisectResult&) {
    asked.push_back(n);
    return false;
  });
  EXPECT_EQ(s.finding.kind, FindingKind::NotDiagnosed);
  EXPECT_EQ(std::count(asked.begin(), asked.end(), Need::Diagnosis), 4);  // each explainer that reads it asks
  EXPECT_EQ(std::count(asked.begin(), asked.end(), Need::BatchReplay), 1);
  EXPECT_EQ(std::count(asked.begin(), asked.end(), Need::Rounding), 1);
  EXPECT_EQ(std::count(asked.begin(), asked.end(), Need::TensorParallel), 1);
}

TEST(Explain, ADeclaredPrecisionComesBeforeTheHypotheses) {
  BisectResult r = diverging_at_step2();
  r.evidence.weights_dtype = WeightsDtypeCheck{ComputeDType::BFloat16, true, 1.0};
  bool diagnosis_asked = false;
  explain(r, [&](Need n, BisectResult&) { return diagnosis_asked = diagnosis_asked || n == Need::Diagnosis; });
  EXPECT_EQ(r.finding.kind, FindingKind::Precision);
  EXPECT_FALSE(diagnosis_asked);
  EXPECT_EQ(headline(r), "Divergence, localised at step2.layers.0.attn.ctx. Diagnosis: precision, not a bug: "
                         "declare bfloat16");
}

// ---------------------------------------------------------------------------
// Finding as JSON

TEST(Finding, ItsJsonReadsBackToTheSameHeadline) {
  std::vector<Finding> all;
  Finding f;
  f.kind = FindingKind::Passes;
  all.push_back(f);
  f.kind = FindingKind::ZooBug;
  f.bug = Hypothesis{"rmsnorm-eps", 1e-5};
  f.basis = BugBasis::LocalRecompute;
  f.ambiguous = {"rope-theta=10000"};
  all.push_back(f);
  f = Finding{};
  f.kind = FindingKind::Precision;
  f.declare = Declaration::KvCache;
  f.dtype = ComputeDType::BFloat16;
  all.push_back(f);
  f.declare = Declaration::Profile;
  f.profile = R"({"kv_cache":"f16","matmul_input":"ggml"})";
  all.push_back(f);
  f = Finding{};
  f.kind = FindingKind::Layout;
  f.layout.kind = LayoutFinding::Kind::HeadSplit;
  all.push_back(f);
  f = Finding{};
  f.kind = FindingKind::RingWrap;
  f.wrap_step = 2;
  f.capacity = 6;
  all.push_back(f);
  f = Finding{};
  f.kind = FindingKind::Signature;
  f.signature.name = "step0.layers.0.attn.scores";
  f.signature.kind = "scale";
  all.push_back(f);
  for (FindingKind k : {FindingKind::NothingFits, FindingKind::NotDiagnosed}) {
    f = Finding{};
    f.kind = k;
    all.push_back(f);
  }
  for (Finding& g : all) {
    g.focus = "step0.layers.0.attn.scores";
    g.evidence = "the numbers";
    const nlohmann::json j = nlohmann::json::parse(finding_to_json(g).dump());
    const Finding back = finding_from_json(j);
    EXPECT_EQ(j["kind"], kind_name(g.kind));
    EXPECT_EQ(headline(back), headline(g)) << j.dump();
    EXPECT_EQ(j["headline"], headline(g));
    EXPECT_EQ(explanation(back), "the numbers");
    EXPECT_EQ(back.focus, g.focus);
    EXPECT_EQ(basis_label(back), basis_label(g));
  }
  EXPECT_THROW(finding_from_json(nlohmann::json{{"kind", "no such kind"}}), std::exception);
}

// ---------------------------------------------------------------------------
// Fingerprint finders

TEST(FingerprintFinders, EachCheckIsAFinderOfTheTable) {
  std::set<std::string> names;
  for (const FingerprintFinderEntry& e : fingerprint_finders()) {
    EXPECT_TRUE(names.insert(e.name).second) << e.name;
    EXPECT_NE(e.find, nullptr);
  }
  EXPECT_EQ(names.size(), 17u);
  // One finder alone: positions restarting at 0, on a toy decode whose step 1 restarts.
  auto ref = llmdiff::testing::toy_dump(false, false, false, 1.0f);
  auto cand = llmdiff::testing::toy_dump(true, false, false, 1.0f);
  const DiffResult g = compare_dumps(*ref, *cand);
  const Scenario sc = llmdiff::testing::toy_scenario();
  std::vector<Fingerprint> out;
  const FingerprintScene scene{*cand, *ref, g, sc, past_lengths(sc), std::nullopt, &out};
  for (const FingerprintFinderEntry& e : fingerprint_finders())
    if (std::string(e.name) == "positions restarting at 0") e.find(scene, out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].bug, zoo::bug_with_signature(zoo::Signature::PositionsRestart).name);
  EXPECT_TRUE(out[0].decisive);
}
