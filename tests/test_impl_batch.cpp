// The continuous-batching engine on its own: request parsing, one sequence
// served alone equals the single-sequence impl, a replay of its own
// schedule reproduces it bit for bit, the paged bookkeeping it reports
// (block tables, slots, context lengths, blocks of live sequences
// disjoint), and its errors.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sequences.h"
#include "impl/batch_engine.h"
#include "impl/impl_engine.h"
#include "tests/support.h"

using namespace llmdiff;
using namespace llmdiff::testing;

namespace {

const char* kRequests = "1,5,9,13,17,21,25@0:3;2,6,10@0:4;3,7,11,15,19,23,27,31,35@1:2;4,8@1:5;40,41,42,43,44@2:3";

MemoryDump serve(const Model& model, const std::vector<impl::BatchRequest>& req, impl::BatchEngineOptions o = {}) {
  o.threads = 1;
  impl::BatchEngine engine(model, o);
  MemoryDump d("batch");
  engine.run(req, d);
  return d;
}

double max_rel_diff(const TensorData& a, const TensorData& b) {
  double m = 0, scale = 0;
  for (size_t i = 0; i < a.f.size(); ++i) {
    m = std::max(m, std::fabs(double(a.f[i]) - b.f[i]));
    scale = std::max(scale, std::fabs(double(b.f[i])));
  }
  return m / std::max(scale, 1e-30);
}

}  // namespace

TEST(ImplBatch, ParsesRequests) {
  const auto r = impl::parse_batch_requests("1,2,3@2:4;5;6,7:0", 3);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].prompt, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(r[0].join, 2);
  EXPECT_EQ(r[0].decode, 4);
  EXPECT_EQ(r[1].prompt, (std::vector<int64_t>{5}));
  EXPECT_EQ(r[1].join, 0);
  EXPECT_EQ(r[1].decode, 3);
  EXPECT_EQ(r[2].decode, 0);
  for (const char* bad : {"", ";", "1,,2", "a", "1@x", "1:-2", "1@1@1", "1:2:3"})
    EXPECT_THROW(impl::parse_batch_requests(bad, 0), UsageError) << bad;
}

TEST(ImplBatch, OneSequenceAloneEqualsTheSingleSequenceImpl) {
  const Model model = Model::load(golden_model("qwen3-qknorm"));
  impl::BatchEngineOptions o;
  o.chunk = 3;
  o.block_size = 4;
  const MemoryDump batch = serve(model, impl::parse_batch_requests("3,1,4,1,5,9,2@0:3", 0), o);
  // The same forward calls: chunks of 3, 3, 1, then 3 decodes.
  impl::ImplOptions io;
  io.threads = 1;
  auto single = impl::make_impl_engine(model, io);
  MemoryDump alone("alone");
  Scenario sc = make_scenario({3, 1, 4, 1, 5, 9, 2}, {3, 3, 1}, 3);
  sc.emit_generated = true;
  run_scenario(*single, sc, alone);
  const SequenceView seq0(batch, 0);
  EXPECT_EQ(seq0.get("generated").i, alone.get("generated").i);
  int compared = 0;
  for (const std::string& n : alone.names()) {
    if (!seq0.has(n)) continue;
    const TensorData a = seq0.get(n), b = alone.get(n);
    ASSERT_EQ(a.shape, b.shape) << n;
    if (a.is_int) {
      EXPECT_EQ(a.i, b.i) << n;
    } else {
      EXPECT_LE(max_rel_diff(a, b), 1e-5) << n;  // the same ops; packed matmuls may sum in another order
    }
    ++compared;
  }
  EXPECT_GT(compared, 100);
  for (const std::string& n : seq0.names()) {
    const std::string site = parse_name(n).site;
    EXPECT_TRUE(alone.has(n) || site.rfind("kv.", 0) == 0) << n << " is not a single-sequence name";
  }
}

TEST(ImplBatch, ReplayingItsOwnScheduleReproducesTheRunBitForBit) {
  const Model model = Model::load(golden_model("llama-gqa"));
  impl::BatchEngineOptions o;
  o.chunk = 3;
  o.block_size = 4;
  const MemoryDump run = serve(model, impl::parse_batch_requests(kRequests, 0), o);
  // The schedule as the dump records it: the iterations' calls, each prompt's length.
  const impl::BatchSchedule schedule = impl::schedule_of(run);
  EXPECT_EQ(schedule.prompt_len, (std::vector<int64_t>{7, 3, 9, 2, 5}));
  ASSERT_TRUE(run.has("iter" + std::to_string(schedule.iterations.size() - 1) + ".seqs"));
  EXPECT_FALSE(run.has("iter" + std::to_string(schedule.iterations.size()) + ".seqs"));
  impl::BatchEngine engine(model, [&] {
    impl::BatchEngineOptions r = o;
    r.threads = 1;
    return r;
  }());
  MemoryDump again("replay");
  engine.replay(schedule, again);
  EXPECT_EQ(again.names(), run.names());
  for (const std::string& n : run.names()) {
    const TensorData a = run.get(n), b = again.get(n);
    EXPECT_EQ(a.shape, b.shape) << n;
    EXPECT_TRUE(a.is_int ? a.i == b.i : a.f == b.f) << n;
  }
}

TEST(ImplBatch, PagedBookkeepingIsConsistent) {
  const Model model = Model::load(golden_model("llama-gqa"));
  impl::BatchEngineOptions o;
  o.chunk = 3;
  o.block_size = 4;
  const MemoryDump d = serve(model, impl::parse_batch_requests(kRequests, 0), o);
  for (int n = 0; d.has("iter" + std::to_string(n) + ".seqs"); ++n) {
    std::set<int64_t> used;  // blocks of the live sequences of this iteration
    for (const auto& [seq, step] : iteration_members(d, n)) {
      const SequenceView v(d, seq);
      int64_t P = 0;
      for (int s = 0; s < step; ++s) P += int64_t(v.get(step_name(s, "tokens")).i.size());
      const int64_t T = int64_t(v.get(step_name(step, "tokens")).i.size()), S = P + T;
      const std::vector<int64_t> table = v.get(step_name(step, "kv.block_table")).i;
      const std::vector<int64_t> slots = v.get(step_name(step, "kv.slot_mapping")).i;
      EXPECT_EQ(v.get(step_name(step, "kv.context_len")).i, (std::vector<int64_t>{S}));
      EXPECT_EQ(int64_t(table.size()), (S + 3) / 4);
      for (int64_t t = 0; t < T; ++t) EXPECT_EQ(slots[size_t(t)], table[size_t((P + t) / 4)] * 4 + (P + t) % 4);
      for (int64_t b : table) EXPECT_TRUE(used.insert(b).second) << "block " << b << " shared in iteration " << n;
    }
  }
}

TEST(ImplBatch, Errors) {
  const Model model = Model::load(golden_model("llama-gqa"));
  impl::BatchEngineOptions o;
  o.block_size = 2;
  o.num_blocks = 3;
  EXPECT_THROW(serve(model, impl::parse_batch_requests("1,2,3,4,5,6,7", 0), o), UsageError);
  EXPECT_THROW(serve(model, impl::parse_batch_requests("1,400", 0)), UsageError);  // vocabulary 384
  EXPECT_THROW(serve(model, impl::parse_batch_requests("1,2:200", 0)), UsageError);  // beyond 128 positions
  impl::BatchEngineOptions inapplicable;  // a MoE bug on a dense model
  inapplicable.bugs = {zoo::parse_bug("moe-expert-off-by-one")};
  EXPECT_THROW(impl::BatchEngine(model, inapplicable), UsageError);
  // A replayed iteration that calls one sequence twice.
  impl::BatchSchedule twice;
  impl::BatchCall first, again;
  first.tokens = {1, 2};
  again.tokens = {3};
  twice.iterations = {{first, again}};
  EXPECT_THROW(impl::BatchEngine(model, impl::BatchEngineOptions{}).replay(twice, *std::make_unique<MemoryDump>()),
               UsageError);
  impl::ImplOptions single;
  single.bugs = {zoo::parse_bug("packed-cross-attention")};
  EXPECT_THROW(impl::make_impl_engine(model, single), UsageError);
}
