// bisect/against.h's pieces on the golden models: the float64 logits that
// settle a greedy flip are HF's next_logits up to float32 rounding, and each
// view that replays a serving feature (prefix hit, verify calls, tensor
// parallel ranks) presents a plain run's calls as the reference makes them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "bisect/against.h"
#include "bisect/prefix_replay.h"
#include "bisect/spec_replay.h"
#include "bisect/tp_unshard.h"
#include "dumps/base/errors.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/names.h"
#include "dumps/model/config.h"
#include "tests/support.h"
#include "tests/test_compare_helpers.h"

using namespace llmdiff;
using namespace llmdiff::testing;

TEST(BisectAgainst, Float64LogitsAreHfsNextLogitsUpToFloat32Rounding) {
  for (const std::string model : {"llama-gqa", "qwen3-moe", "deepseek-v3-mla"}) {
    SCOPED_TRACE(model);
    DumpFile hf(golden_dump(model, "decode"));
    const bisect::ModelOracles m(golden_model(model), 1);
    // The prompt and the first decoded token, fed in one call: step 1's logits.
    std::vector<int64_t> tokens = hf.get("step0.tokens").i;
    tokens.push_back(hf.get("step1.tokens").i[0]);
    const std::vector<float> truth = bisect::float64_logits(m)(tokens);
    const std::vector<float> want = hf.get("step1.next_logits").f;
    ASSERT_EQ(truth.size(), want.size());
    double worst = 0, scale = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      worst = std::max(worst, std::fabs(double(truth[i]) - want[i]));
      scale = std::max(scale, std::fabs(double(want[i])));
    }
    EXPECT_LT(worst, 1e-5 * std::max(1.0, scale));
  }
}

// HF's chunked prefill seen through each view: a prefix hit's replay has
// the served chunk as a call of its own; a verify call's kept rows are the
// one-token calls; two ranks of a partial-sum site add up to the whole.
TEST(BisectAgainst, ViewsPresentServedCallsAsTheReferenceRunsThem) {
  DumpFile chunked(golden_dump("llama-gqa", "chunked"));
  const std::vector<std::vector<int64_t>> calls = chunked.step_tokens();
  ASSERT_GE(calls.size(), 2u);

  // Prefix hit: step 0 served, step 1 the hit's first call.
  MemoryDump warm("warm");
  for (const std::string& n : chunked.names()) {
    CanonName c = parse_name(n);
    TensorData t = chunked.get(n);
    if (c.step == 0) continue;
    if (c.step > 0) {
      c.step -= 1;
      t.name = c.str();
    }
    warm.put(std::move(t));
  }
  warm.put(int_tensor("step0.kv.cached_prefix", {int64_t(calls[0].size())}, calls[0]));
  ASSERT_TRUE(bisect::has_prefix_hit(warm));
  const bisect::PrefixReplayView hit(warm);
  EXPECT_EQ(hit.step_tokens(), calls);
  EXPECT_EQ(hit.get("step1.layers.0.attn.k_cache").f, chunked.get("step1.layers.0.attn.k_cache").f);
  EXPECT_FALSE(hit.has("step0.layers.0.attn.q"));

  // The last chunk as a verify call keeping all but its last row.
  MemoryDump spec("spec");
  copy_into(chunked, spec);
  const int last = int(calls.size()) - 1;
  const int64_t t = int64_t(calls.back().size());
  ASSERT_GE(t, 2);
  int64_t start = 0;  // the last chunk's P
  for (int s = 0; s < last; ++s) start += int64_t(calls[size_t(s)].size());
  spec.put(int_tensor("step" + std::to_string(last) + ".spec.accepted", {1}, {t - 2}));
  ASSERT_TRUE(bisect::has_verify_calls(spec));
  const bisect::SpecSplitView split(spec);
  ASSERT_EQ(split.num_steps(), last + int(t) - 1);
  const std::string last_q = "step" + std::to_string(last) + ".layers.1.attn.q";
  const TensorData whole = chunked.get(last_q);
  const int64_t width = whole.shape[1];
  for (int64_t j = 0; j < t - 1; ++j) {
    const TensorData row = split.get("step" + std::to_string(last + j) + ".layers.1.attn.q");
    ASSERT_EQ(row.shape, (Shape{1, width}));
    EXPECT_TRUE(std::equal(row.f.begin(), row.f.end(), whole.f.begin() + j * width));
    const Shape probs = split.shape("step" + std::to_string(last + j) + ".layers.1.attn.probs");
    EXPECT_EQ(probs.back(), start + j + 1);  // the positions row j sees
    EXPECT_EQ(split.get("step" + std::to_string(last + j) + ".next_logits").shape.size(), 1u);
  }
  EXPECT_FALSE(split.has("step" + std::to_string(last + t - 1) + ".tokens"));  // the rolled-back row

  // Two ranks: attn.out's partial sums (rank 0 the whole, rank 1 zeros),
  // attn.q split by query heads, the norms replicated under rank 0 only.
  MemoryDump tp("tp");
  const ModelConfig cfg = load_config(golden_model("llama-gqa"));
  const std::string out = "step0.layers.0.attn.out", qn = "step0.layers.0.attn.q", norm = "step0.layers.0.mlp_norm";
  TensorData a = chunked.get(out), b = chunked.get(out), q = chunked.get(qn);
  a.name = "rank0." + out;
  b.name = "rank1." + out;
  std::fill(b.f.begin(), b.f.end(), 0.0f);
  tp.put(a);
  tp.put(b);
  const int64_t rows = q.shape[0], cols = q.shape[1];
  for (int r = 0; r < 2; ++r) {
    TensorData h = q;
    h.name = "rank" + std::to_string(r) + "." + qn;
    h.shape = {rows, cols / 2};
    h.f.clear();
    for (int64_t i = 0; i < rows; ++i)
      h.f.insert(h.f.end(), q.f.begin() + i * cols + r * cols / 2, q.f.begin() + i * cols + (r + 1) * cols / 2);
    tp.put(std::move(h));
  }
  TensorData n = chunked.get(norm);
  n.name = "rank0." + norm;
  tp.put(n);
  ASSERT_TRUE(bisect::has_rank_names(tp));
  const bisect::UnshardView un(tp, cfg);
  EXPECT_EQ(un.ranks(), 2);
  EXPECT_EQ(un.get(out).f, chunked.get(out).f);
  EXPECT_EQ(un.get(qn).f, q.f);
  EXPECT_EQ(un.get(norm).f, chunked.get(norm).f);
  // A sharded name one rank lacks is malformed.
  tp.erase("rank1." + qn);
  try {
    bisect::UnshardView bad(tp, cfg);
    ADD_FAILURE() << "no error";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(qn), std::string::npos) << e.what();
  }
}
