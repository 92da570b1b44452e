// One engine, two configurations (compare/against.h), on HF's golden dumps
// with bisections built as data: where each call's rows sit (prefix-cache
// hits, speculative rollback), sequences paired by prompt whatever their
// order, the first place where the two sides differ at all and the largest
// difference over the noise floor, a greedy flip settled by the float64
// margin, a side that fails its bisection named as the bug, and the
// renderers saying one headline.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "compare/against.h"
#include "compare/against_report.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sequences.h"
#include "tests/support.h"
#include "tests/test_compare_helpers.h"

using namespace llmdiff;
using namespace llmdiff::compare;
using namespace llmdiff::testing;

namespace {

constexpr double kThreshold = 1e-3;

// A bisection that passes (every name of `view` within a noise-floor
// threshold of kThreshold) or, with `failing`, diverges there.
BisectResult bisected(const TensorSource& view, const std::string& failing = "") {
  BisectResult r;
  r.model = "llama-gqa";
  r.noise_floor = true;
  for (const std::string& n : view.names()) {
    TensorComparison t;
    t.name = n;
    t.parsed = parse_name(n);
    t.pass = n != failing;
    t.judgement.metric = "rmse vs float64";
    t.judgement.threshold = kThreshold;
    t.judgement.pass = t.pass;
    if (!t.pass && !r.global.first_divergence) r.global.first_divergence = r.global.tensors.size();
    r.global.tensors.push_back(t);
  }
  r.finding.kind = failing.empty() ? FindingKind::Passes : FindingKind::NothingFits;
  r.finding.focus = failing;
  return r;
}

// Every sequence of a several-sequence dump, with its views and bisections.
struct Side {
  std::vector<std::unique_ptr<SequenceView>> views;
  AgainstSideInput input(const TensorSource& dump, const std::string& failing_seq_name = "", int failing_seq = -1) {
    AgainstSideInput in;
    in.label = dump.label();
    in.several = true;
    for (int b : dump_sequences(dump)) {
      views.push_back(std::make_unique<SequenceView>(dump, b));
      in.views.push_back(views.back().get());
      SequenceBisect s;
      s.seq = b;
      s.result = bisected(*views.back(), b == failing_seq ? failing_seq_name : "");
      in.sequences.push_back(std::move(s));
    }
    return in;
  }
};

// HF's batch of three sequences with the sequences renumbered by `order`
// (new seq b holds old seq order[b]).
std::unique_ptr<MemoryDump> reordered_batch(const std::vector<int>& order) {
  DumpFile src(golden_dump("llama-gqa", "batch"));
  auto out = std::make_unique<MemoryDump>("reordered batch");
  out->mutable_manifest() = src.manifest();
  for (const std::string& n : src.names()) {
    size_t rest = 0;
    const int b = sequence_of(n, &rest);
    if (b < 0) continue;  // iterations and model-wide names: not needed here
    for (size_t k = 0; k < order.size(); ++k)
      if (order[k] == b) {
        TensorData t = src.get(n);
        t.name = sequence_prefix(int(k)) + n.substr(rest);
        out->put(std::move(t));
      }
  }
  return out;
}

TEST(CompareAgainst, TimelinePlacesEachCallOnItsPositions) {
  DumpFile decode(golden_dump("llama-gqa", "decode"));
  const SequenceTimeline d = sequence_timeline(decode);
  ASSERT_EQ(d.calls.size(), 4u);
  EXPECT_EQ(d.calls[0].start, 0);
  EXPECT_EQ(d.calls[0].tokens, 5);
  EXPECT_EQ(d.calls[3].start, 7);
  EXPECT_EQ(d.prompt_length, 5);  // generated[0..2] fed back at positions 5, 6, 7
  EXPECT_EQ(d.prompt(), decode.get("step0.tokens").i);
  EXPECT_EQ(d.tokens[5], d.generated[0]);

  // A prefix-cache hit: step 0 starts at H; a verify call keeps 1 + accepted rows.
  MemoryDump m("serving");
  m.put(int_tensor("step0.kv.cached_prefix", {3}, {10, 11, 12}));
  m.put(int_tensor("step0.tokens", {2}, {13, 14}));
  m.put(int_tensor("step1.tokens", {3}, {20, 21, 99}));  // verify: last token 20, drafts 21 (kept) and 99 (rejected)
  m.put(int_tensor("step1.spec.draft", {2}, {21, 99}));
  m.put(int_tensor("step1.spec.accepted", {1}, {1}));
  m.put(int_tensor("step2.tokens", {1}, {22}));
  m.put(int_tensor("generated", {4}, {20, 21, 22, 23}));
  const SequenceTimeline t = sequence_timeline(m);
  EXPECT_EQ(t.cached_prefix, 3);
  ASSERT_EQ(t.calls.size(), 3u);
  EXPECT_EQ(t.calls[0].start, 3);
  EXPECT_EQ(t.calls[1].start, 5);
  EXPECT_EQ(t.calls[1].kept, 2);
  EXPECT_EQ(t.calls[2].start, 7);  // P + 1 + accepted, not P + T
  EXPECT_EQ(t.tokens, (std::vector<int64_t>{10, 11, 12, 13, 14, 20, 21, 22}));
  EXPECT_EQ(t.prompt(), (std::vector<int64_t>{10, 11, 12, 13, 14}));

  m.put(int_tensor("step1.spec.accepted", {1}, {3}));  // more than its 2 drafts allow
  try {
    sequence_timeline(m);
    ADD_FAILURE() << "no error";
  } catch (const FormatError& e) {
    EXPECT_EQ(e.tensor(), "step1.spec.accepted");
  }
}

TEST(CompareAgainst, SequencesPairByPromptAndTheFirstDifferenceIsNamed) {
  DumpFile a(golden_dump("llama-gqa", "batch"));
  auto b = reordered_batch({2, 0, 1});
  // One value of B's old seq1 (now seq2) moved at step 1 (position 3 + 0),
  // layer 1's mlp.down; and a larger one later, at layer 1's out of step 2.
  const std::string down = "seq2.step1.layers.1.mlp.down", out = "seq2.step2.layers.1.out";
  TensorData t = b->get(down);
  t.f[5] += 2e-4f;
  b->put(t);
  TensorData u = b->get(out);
  for (float& v : u.f) v += 5e-4f;
  b->put(u);

  Side sa, sb;
  const AgainstResult r = pair_against(sa.input(a), sb.input(*b));
  ASSERT_EQ(r.pairs.size(), 3u);
  EXPECT_TRUE(r.only_a.empty() && r.only_b.empty());
  for (const SequencePair& p : r.pairs) {
    const int sa_seq = r.a.sequences[p.a].bisect.seq, sb_seq = r.b.sequences[p.b].bisect.seq;
    EXPECT_EQ(sb_seq, (sa_seq + 1) % 3) << "aligned by prompt, not by index";
    EXPECT_EQ(p.verdict, PairVerdict::Legitimate);
    EXPECT_GT(p.compared, 0);
    if (sa_seq != 1) {
      EXPECT_FALSE(p.first_difference) << headline(r, p);
      EXPECT_NE(headline(r, p).find("identical bit for bit"), std::string::npos);
      continue;
    }
    const int64_t prompt = int64_t(r.a.sequences[p.a].prompt.size());
    ASSERT_TRUE(p.first_difference);
    EXPECT_EQ(p.first_difference->position, prompt);
    EXPECT_EQ(p.first_difference->layer, 1);
    EXPECT_EQ(p.first_difference->site, "mlp.down");
    EXPECT_EQ(p.first_difference->name_b, "step1.layers.1.mlp.down");
    EXPECT_EQ(p.first_difference->differing, 1);
    EXPECT_NEAR(p.first_difference->max_abs, 2e-4, 1e-6);
    ASSERT_TRUE(p.largest);
    EXPECT_EQ(p.largest->name_a, "step2.layers.1.out");
    EXPECT_NEAR(p.largest->rmse, 5e-4, 1e-6);
    EXPECT_NEAR(p.largest->ratio(), 5e-4 / kThreshold, 1e-3);
    EXPECT_EQ(p.differing, 2);
  }
  EXPECT_EQ(r.exit_code(), 0);
  EXPECT_EQ(headline(r).rfind("legitimate: 3 sequences aligned by prompt", 0), 0u) << headline(r);
}

TEST(CompareAgainst, ASideThatFailsItsBisectionIsTheBugOnlyUnpairedSequencesAreReported) {
  DumpFile a(golden_dump("llama-gqa", "batch"));
  auto b = reordered_batch({1, 0});  // B lacks old seq2
  Side sa, sb;
  const AgainstResult r = pair_against(sa.input(a), sb.input(*b, "step0.layers.0.attn.q", 0));
  ASSERT_EQ(r.pairs.size(), 2u);
  ASSERT_EQ(r.only_a.size(), 1u);
  EXPECT_EQ(r.a.sequences[r.only_a[0]].bisect.seq, 2);
  const SequencePair& p = r.pairs[1];  // A's seq1 with B's seq0, which fails
  EXPECT_EQ(p.verdict, PairVerdict::BugInB);
  EXPECT_EQ(headline(r, p), "a bug in B: " + headline(r.b.sequences[p.b].bisect.result));
  EXPECT_EQ(r.exit_code(), 1);
  EXPECT_EQ(headline(r).rfind("seq1 (A) / seq0 (B): a bug in B: Divergence, localised at step0.layers.0.attn.q", 0),
            0u)
      << headline(r);
  EXPECT_NE(headline(r).find("1 sequence(s) only in A"), std::string::npos) << headline(r);

  // No shared prompt at all: bad input.
  auto c = reordered_batch({2});
  Side s1, s2;
  EXPECT_THROW(pair_against(s1.input(*reordered_batch({0, 1})), s2.input(*c)), UsageError);
}

TEST(CompareAgainst, AGreedyFlipIsSettledByTheFloat64Margin) {
  DumpFile a(golden_dump("llama-gqa", "batch"));
  auto b = reordered_batch({0, 1, 2});
  // B's seq0 picks the runner-up as its last token.
  const std::vector<float> row = a.get("seq0.step3.next_logits").f;
  const int64_t best = std::max_element(row.begin(), row.end()) - row.begin();
  int64_t second = best == 0 ? 1 : 0;
  for (int64_t i = 0; i < int64_t(row.size()); ++i)
    if (i != best && row[size_t(i)] > row[size_t(second)]) second = i;
  const double gap = double(row[size_t(best)]) - double(row[size_t(second)]);
  TensorData g = b->get("seq0.generated");
  ASSERT_EQ(g.i.back(), best);
  g.i.back() = second;
  b->put(g);
  const std::vector<int64_t> prompt_and_fed = [&] {
    std::vector<int64_t> t = a.get("seq0.step0.tokens").i;
    for (int s = 1; s <= 3; ++s) t.push_back(a.get("seq0.step" + std::to_string(s) + ".tokens").i[0]);
    return t;
  }();
  // The float64 logits: each side's row moved by `err` everywhere.
  for (const double err : {gap, gap / 10}) {
    SCOPED_TRACE(err);
    std::vector<int64_t> asked;
    const TruthLogits truth = [&](const std::vector<int64_t>& tokens) {
      asked = tokens;
      std::vector<float> t = row;
      for (float& v : t) v = float(v + err);
      return t;
    };
    Side sa, sb;
    const AgainstResult r = pair_against(sa.input(a), sb.input(*b), truth);
    const SequencePair& p = r.pairs[0];
    EXPECT_EQ(asked, prompt_and_fed);
    ASSERT_TRUE(p.flip);
    EXPECT_EQ(p.flip->index, 3);
    EXPECT_EQ(p.flip->position, int64_t(prompt_and_fed.size()) - 1);
    EXPECT_EQ(p.flip->token_a, best);
    EXPECT_EQ(p.flip->token_b, second);
    ASSERT_TRUE(p.flip->noise);
    EXPECT_NEAR(*p.flip->noise, err, err * 1e-3 + 1e-6);
    EXPECT_NEAR(p.flip->margin, gap, 1e-5);
    if (err == gap) {
      EXPECT_TRUE(p.flip->near_tie);
      EXPECT_EQ(p.verdict, PairVerdict::Legitimate);
      EXPECT_NE(headline(r, p).find("a near-tie"), std::string::npos) << headline(r, p);
      EXPECT_EQ(r.exit_code(), 0);
    } else {
      EXPECT_FALSE(p.flip->near_tie);
      EXPECT_EQ(p.verdict, PairVerdict::BugInB);  // its token is the lower in float64
      EXPECT_EQ(headline(r, p).rfind("a bug in B: its greedy pick is the lower in float64", 0), 0u) << headline(r, p);
      EXPECT_EQ(r.exit_code(), 1);
    }
  }
}

TEST(CompareAgainst, EveryFormatSaysTheSameHeadline) {
  DumpFile a(golden_dump("llama-gqa", "batch"));
  auto b = reordered_batch({1, 0, 2});
  TensorData t = b->get("seq0.step0.layers.0.attn.q");
  t.f[0] += 1e-3f;
  b->put(t);
  Side sa, sb;
  const AgainstResult r = pair_against(sa.input(a), sb.input(*b, "step2.layers.1.out", 2));
  const std::string line = headline(r);
  EXPECT_NE(render_against_table(r).find("RESULT: " + line), std::string::npos);
  EXPECT_NE(render_against_markdown(r).find("**" + line + "**"), std::string::npos);
  const nlohmann::json j = against_to_json(r);
  EXPECT_EQ(j["schema"], "llmdiff.against/1");
  EXPECT_EQ(j["headline"], line);
  EXPECT_EQ(j["exit_code"], 1);
  ASSERT_EQ(j["pairs"].size(), 3u);
  EXPECT_EQ(j["pairs"][0]["a"], 0);
  EXPECT_EQ(j["pairs"][0]["b"], 1);
  EXPECT_EQ(j["pairs"][1]["verdict"], "legitimate");
  EXPECT_EQ(j["pairs"][1]["first_difference"]["name_b"], "step0.layers.0.attn.q");
  EXPECT_EQ(j["pairs"][1]["first_difference"]["position"], 0);
  EXPECT_EQ(j["pairs"][2]["verdict"], "bug-in-b");
  EXPECT_EQ(j["b"]["sequences"][2]["bisect"]["schema"], "llmdiff.bisect/1");
  EXPECT_EQ(j["a"]["sequences"][0]["prompt_length"], 7);
  const std::string page = render_against_html(r);
  EXPECT_NE(page.find("llmdiff: one engine, two configurations"), std::string::npos);
  EXPECT_NE(page.find("id=\"chart-data\""), std::string::npos);  // the buggy side's error growth
}

}  // namespace
