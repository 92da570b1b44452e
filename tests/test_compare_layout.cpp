// compare/layout on golden tensors: axis permutations, head-split vs flat,
// RoPE pairing, cache-length mismatches; each found and reported as a
// finding while the name still counts as divergent.
#include <gtest/gtest.h>

#include <algorithm>

#include "compare/compare.h"
#include "compare/layout.h"
#include "tests/test_compare_helpers.h"

using namespace llmdiff;
using namespace llmdiff::compare;
using namespace llmdiff::testing;

namespace {

// llama-gqa: Hq 4, Hkv 2, Dh 16; prefill T = S = 7.
struct Golden {
  DumpFile dump{golden_dump("llama-gqa", "prefill")};
  LayoutContext ctx = layout_context(dump.manifest(), dump.manifest());
  Tolerance tol = default_tolerance(ComputeDType::Float32);
};

const LayoutFinding* find_kind(const std::vector<LayoutFinding>& fs, LayoutFinding::Kind k) {
  for (const auto& f : fs)
    if (f.kind == k) return &f;
  return nullptr;
}

TensorData with_values(const TensorData& like, Shape shape, std::vector<float> v) {
  TensorData t = like;
  t.shape = std::move(shape);
  t.f = std::move(v);
  return t;
}

}  // namespace

TEST(CompareLayout, PermuteAxesMatchesNumpyTranspose) {
  std::vector<float> x{0, 1, 2, 3, 4, 5};  // [2, 3]
  Shape out;
  EXPECT_EQ(permute_axes(x.data(), {2, 3}, {1, 0}, &out), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(out, (Shape{3, 2}));
  std::vector<float> y(24);
  for (int i = 0; i < 24; ++i) y[size_t(i)] = float(i);  // [2, 3, 4]
  auto p = permute_axes(y.data(), {2, 3, 4}, {2, 0, 1}, &out);
  EXPECT_EQ(out, (Shape{4, 2, 3}));
  // out[k][i][j] = y[i][j][k]
  EXPECT_EQ(p[size_t(3 * 6 + 1 * 3 + 2)], y[size_t(1 * 12 + 2 * 4 + 3)]);
  EXPECT_EQ(permute_axes(y.data(), {2, 3, 4}, {0, 1, 2}), y);
}

TEST(CompareLayout, RopeRepairRoundTrips) {
  std::vector<float> x{0, 1, 2, 3, 10, 11, 12, 13};  // two blocks of Dh = 4
  auto inter = rope_repair(x.data(), 8, 4, true);   // (i, i+2) -> (2i, 2i+1)
  EXPECT_EQ(inter, (std::vector<float>{0, 2, 1, 3, 10, 12, 11, 13}));
  EXPECT_EQ(rope_repair(inter.data(), 8, 4, false), x);
}

TEST(CompareLayout, LayoutContextFromManifestConfig) {
  Golden g;
  EXPECT_EQ(g.ctx.num_heads, 4);
  EXPECT_EQ(g.ctx.num_kv_heads, 2);
  EXPECT_EQ(g.ctx.head_dim, 16);
}

TEST(CompareLayout, DetectsAxisPermutationOfQRope) {
  Golden g;
  TensorData ref = g.dump.get("step0.layers.0.attn.q_rope");  // [Hq, T, Dh] = [4, 7, 16]
  ASSERT_EQ(ref.shape, (Shape{4, 7, 16}));
  Shape s;
  auto moved = permute_axes(ref.f.data(), ref.shape, {1, 0, 2}, &s);  // [T, Hq, Dh]
  TensorData cand = with_values(ref, s, moved);
  auto fs = explain_shape_mismatch(ref.name, ref, cand, g.tol, ComputeDType::Float32, g.ctx);
  ASSERT_FALSE(fs.empty());
  const LayoutFinding& f = fs.front();
  EXPECT_EQ(f.kind, LayoutFinding::Kind::Permute);
  EXPECT_TRUE(f.matches);
  EXPECT_EQ(f.perm, (std::vector<int>{1, 0, 2}));
  EXPECT_EQ(f.metrics.max_abs, 0);
  EXPECT_NE(f.summary.find("permute [1, 0, 2]"), std::string::npos) << f.summary;

  // A permuted and perturbed candidate is still explained, as "closest" and not matching.
  for (auto& v : moved) v += 0.5f;
  auto fs2 = explain_shape_mismatch(ref.name, ref, with_values(ref, s, moved), g.tol, ComputeDType::Float32, g.ctx);
  ASSERT_FALSE(fs2.empty());
  EXPECT_FALSE(fs2.front().matches);
  EXPECT_EQ(fs2.front().perm, (std::vector<int>{1, 0, 2}));
  EXPECT_NEAR(fs2.front().metrics.max_abs, 0.5, 1e-6);
}

TEST(CompareLayout, DetectsHeadSplitVsFlat) {
  Golden g;
  TensorData ref = g.dump.get("step0.layers.1.attn.q_rope");  // [4, 7, 16]
  Shape s;
  auto moved = permute_axes(ref.f.data(), ref.shape, {1, 0, 2}, &s);  // [7, 4, 16] == [T, Hq*Dh] flat
  TensorData cand = with_values(ref, {7, 64}, moved);
  auto fs = explain_shape_mismatch(ref.name, ref, cand, g.tol, ComputeDType::Float32, g.ctx);
  const LayoutFinding* f = find_kind(fs, LayoutFinding::Kind::HeadSplit);
  ASSERT_NE(f, nullptr);
  EXPECT_TRUE(f->matches) << f->summary;
  EXPECT_EQ(f->metrics.max_abs, 0);
  EXPECT_NE(f->summary.find("head-split"), std::string::npos) << f->summary;

  // The reverse: the reference flat [T, Hq*Dh] (attn.q), the candidate head-major.
  TensorData q = g.dump.get("step0.layers.0.attn.q");  // [7, 64]
  auto head_major = permute_axes(q.f.data(), {7, 4, 16}, {1, 0, 2}, &s);  // [4, 7, 16]
  auto fs2 = explain_shape_mismatch(q.name, q, with_values(q, s, head_major), g.tol, ComputeDType::Float32, g.ctx);
  const LayoutFinding* f2 = find_kind(fs2, LayoutFinding::Kind::HeadSplit);
  ASSERT_NE(f2, nullptr);
  EXPECT_TRUE(f2->matches) << f2->summary;
}

TEST(CompareLayout, DetectsRopePairingPermutation) {
  Golden g;
  TensorData ref = g.dump.get("step0.layers.0.attn.q_rope");
  // The candidate keeps each head's RoPE pairs interleaved: (2i, 2i+1) holds (i, i+Dh/2).
  TensorData cand = with_values(ref, ref.shape, rope_repair(ref.f.data(), ref.numel(), 16, true));
  auto fs = explain_value_mismatch(ref.name, ref, cand, g.tol, ComputeDType::Float32, g.ctx);
  ASSERT_EQ(fs.size(), 1u);
  EXPECT_EQ(fs[0].kind, LayoutFinding::Kind::RopePairing);
  EXPECT_EQ(fs[0].rope, "interleaved->half");
  EXPECT_TRUE(fs[0].matches);
  EXPECT_NE(fs[0].summary.find("(2i, 2i+1)"), std::string::npos) << fs[0].summary;

  // Flat attn.k [T, Hkv*Dh]: the pairing repeats in every head block of Dh = 16 (from the config).
  TensorData k = g.dump.get("step0.layers.1.attn.k");
  TensorData kc = with_values(k, k.shape, rope_repair(k.f.data(), k.numel(), 16, true));
  auto fk = explain_value_mismatch(k.name, k, kc, g.tol, ComputeDType::Float32, g.ctx);
  ASSERT_EQ(fk.size(), 1u);
  EXPECT_TRUE(fk[0].matches);

  // Values that are merely wrong produce no finding.
  TensorData wrong = ref;
  for (auto& v : wrong.f) v *= 1.1f;
  EXPECT_TRUE(explain_value_mismatch(ref.name, ref, wrong, g.tol, ComputeDType::Float32, g.ctx).empty());
}

TEST(CompareLayout, ExplainsCacheLength) {
  Golden g;
  TensorData ref = g.dump.get("step0.layers.0.attn.k_cache");  // [Hkv, S, Dh] = [2, 7, 16]
  ASSERT_EQ(ref.shape, (Shape{2, 7, 16}));
  // A preallocated cache of 12 positions, the tail zero.
  std::vector<float> padded(2 * 12 * 16, 0.0f);
  for (int h = 0; h < 2; ++h)
    std::copy_n(ref.f.begin() + h * 7 * 16, 7 * 16, padded.begin() + h * 12 * 16);
  auto fs = explain_shape_mismatch(ref.name, ref, with_values(ref, {2, 12, 16}, padded), g.tol,
                                   ComputeDType::Float32, g.ctx);
  const LayoutFinding* f = find_kind(fs, LayoutFinding::Kind::CacheLength);
  ASSERT_NE(f, nullptr);
  EXPECT_TRUE(f->matches);
  EXPECT_EQ(f->ref_len, 7);
  EXPECT_EQ(f->cand_len, 12);
  EXPECT_EQ(f->extra_nonzero, 0);
  EXPECT_NE(f->summary.find("cache holds S'=12 where reference has S=7"), std::string::npos) << f->summary;

  // A shorter probs row set [Hq, T, S'] with S' = 5 < S = 7: the overlapping prefix differs
  // (the softmax was taken over fewer keys).
  TensorData probs = g.dump.get("step0.layers.0.attn.probs");  // [4, 7, 7]
  auto prefix = slice_prefix(probs.f.data(), probs.shape, 2, 5);
  auto fp = explain_shape_mismatch(probs.name, probs, with_values(probs, {4, 7, 5}, prefix), g.tol,
                                   ComputeDType::Float32, g.ctx);
  const LayoutFinding* f2 = find_kind(fp, LayoutFinding::Kind::CacheLength);
  ASSERT_NE(f2, nullptr);
  EXPECT_EQ(f2->cand_len, 5);
  EXPECT_TRUE(f2->matches);     // the prefix copies the reference exactly
  EXPECT_GT(f2->extra_nonzero, 0);  // the reference's last two keys carry probability
}

TEST(CompareLayout, FindingNeverMakesANamePass) {
  Golden g;
  TensorData ref = g.dump.get("step0.layers.0.attn.q_rope");
  Shape s;
  auto moved = permute_axes(ref.f.data(), ref.shape, {1, 0, 2}, &s);
  PairContext pc;
  pc.tolerance = g.tol;
  pc.layout = g.ctx;
  TensorComparison c = compare_tensors(ref, with_values(ref, s, moved), pc);
  EXPECT_FALSE(c.pass);
  EXPECT_FALSE(c.shape_match);
  ASSERT_FALSE(c.findings.empty());
  EXPECT_TRUE(c.findings.front().matches);

  TensorComparison r = compare_tensors(ref, with_values(ref, ref.shape, rope_repair(ref.f.data(), ref.numel(), 16, true)), pc);
  EXPECT_FALSE(r.pass);
  ASSERT_EQ(r.findings.size(), 1u);
  EXPECT_EQ(r.findings[0].kind, LayoutFinding::Kind::RopePairing);
}
