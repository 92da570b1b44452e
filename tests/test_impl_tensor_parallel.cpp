// Tensor parallelism in the impl (impl/tensor_parallel.h): R ranks in one
// process on dense GQA (MQA included), MoE and MLA models, in both engines.
// Unsharded (dumps/contract/ranks.h), a run over R ranks is the single-rank
// run: the row-parallel products (q, k, v, gate, up, every head's
// attention) bit for bit until the first all-reduce, the rest within
// float32 rounding of the partial sums' order. Each rank's tensors are the
// slices of the unsharded ones (the round trip), and each tensor-parallel
// bug of the zoo first changes the dump where it is made.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "dumps/base/errors.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/contract/names.h"
#include "dumps/contract/ranks.h"
#include "dumps/contract/sequences.h"
#include "dumps/zoo/bugs.h"
#include "impl/batch_engine.h"
#include "impl/impl_engine.h"
#include "tests/support.h"

using namespace llmdiff;
using namespace llmdiff::testing;

namespace {

MemoryDump run_tp(const Model& model, const Scenario& sc, int ranks, const std::vector<std::string>& bugs = {},
                  impl::MlaForm mla = impl::MlaForm::Naive) {
  impl::ImplOptions o;
  o.threads = 2;
  o.tensor_parallel = ranks;
  o.mla = mla;
  for (const std::string& b : bugs) o.bugs.push_back(zoo::parse_bug(b));
  auto engine = impl::make_impl_engine(model, o);
  MemoryDump d("impl --tp " + std::to_string(ranks));
  RankZeroNames named(d);
  run_scenario(*engine, sc, ranks > 1 ? static_cast<Observer&>(named) : d);
  if (ranks > 1) d.mutable_manifest().extra[tensor_parallel_key()] = tensor_parallel_json(ranks);
  return d;
}

bool bit_identical(const TensorData& a, const TensorData& b) {
  return a.shape == b.shape && a.i == b.i && a.f.size() == b.f.size() &&
         (a.f.empty() || std::memcmp(a.f.data(), b.f.data(), a.f.size() * sizeof(float)) == 0);
}

// max |a-b| / max(1, max |b|)
double scaled_diff(const TensorData& a, const TensorData& b) {
  return max_abs_diff(a, b) / std::max(1.0, max_abs(b));
}

struct TpRun {
  const char* model;
  impl::MlaForm mla;
};
const TpRun kRuns[] = {{"llama-gqa", impl::MlaForm::Naive},     {"llama3-mqa-scaled", impl::MlaForm::Naive},
                     {"qwen3-moe", impl::MlaForm::Naive},     {"qwen2-bias", impl::MlaForm::Naive},
                     {"deepseek-v3-mla", impl::MlaForm::Naive}, {"deepseek-v3-mla", impl::MlaForm::Absorbed}};

}  // namespace

TEST(ImplTensorParallel, UnshardedRanksAreTheSingleRankRun) {
  for (const TpRun& run : kRuns) {
    const Model model = Model::load(golden_model(run.model));
    const Scenario sc = replay_scenario(DumpFile(golden_dump(run.model, "chunked")));
    const MemoryDump one = run_tp(model, sc, 1, {}, run.mla);
    for (const int R : {2, 4}) {
      SCOPED_TRACE(std::string(run.model) + (run.mla == impl::MlaForm::Absorbed ? " absorbed" : "") + " over " +
                   std::to_string(R) + " ranks");
      const MemoryDump tp = run_tp(model, sc, R, {}, run.mla);
      const RankView view(tp, model.config);
      EXPECT_EQ(view.names(), one.names());
      bool reduced = false;  // past the first all-reduce of step 0
      for (const std::string& n : one.names()) {
        ASSERT_TRUE(view.has(n)) << n;
        const TensorData a = view.get(n), b = one.get(n);
        ASSERT_EQ(a.shape, b.shape) << n;
        const CanonName c = parse_name(n);
        if (c.step == 0 && c.site == site_name(Site::AttnOut)) reduced = true;
        if (!reduced)
          EXPECT_TRUE(bit_identical(a, b)) << n << " differs by " << max_abs_diff(a, b) << " before any all-reduce";
        else
          EXPECT_LE(scaled_diff(a, b), 2e-5) << n;
      }
    }
  }
}

// Each rank's tensor is its slice of the unsharded one (heads and columns),
// or its partial sum; the unsharded partial sums are their sum in rank order.
TEST(ImplTensorParallel, RankShardsRoundTripThroughTheUnshardedView) {
  for (const char* model_name : {"llama3-mqa-scaled", "qwen3-moe", "deepseek-v3-mla"}) {
    const Model model = Model::load(golden_model(model_name));
    const Scenario sc = replay_scenario(DumpFile(golden_dump(model_name, "decode")));
    const int R = 4;
    const MemoryDump tp = run_tp(model, sc, R);
    const RankView view(tp, model.config);
    const RankLayout& L = view.layout();
    int sharded = 0, partial = 0;
    for (const std::string& n : view.names()) {
      SCOPED_TRACE(std::string(model_name) + " " + n);
      const ShardSpec sp = view.spec(n);
      if (!sp.sharded()) {
        EXPECT_TRUE(bit_identical(view.get(n), tp.get(rank_prefix(0) + n)));
        EXPECT_FALSE(tp.has(rank_prefix(1) + n));  // replicated: written once
        continue;
      }
      const TensorData whole = view.get(n);
      if (sp.rule == ShardRule::PartialSum) {
        TensorData sum = tp.get(rank_prefix(0) + n);
        for (int r = 1; r < R; ++r) {
          const TensorData p = tp.get(rank_prefix(r) + n);
          for (size_t i = 0; i < sum.f.size(); ++i) sum.f[i] += p.f[i];
        }
        EXPECT_TRUE(bit_identical(sum, whole));
        ++partial;
        continue;
      }
      // Heads or columns: rank r's slice along the axis is its tensor (kv
      // heads replicated when Hkv < R: the head r*Hkv/R).
      const int64_t outer = [&] {
        int64_t o = 1;
        for (int d = 0; d < sp.axis; ++d) o *= whole.shape[size_t(d)];
        return o;
      }();
      const int64_t total = int64_t(whole.f.size()) / outer;  // values per outer index, all ranks
      for (int r = 0; r < R; ++r) {
        const TensorData mine = tp.get(rank_prefix(r) + n);
        const int64_t width = int64_t(mine.f.size()) / outer;  // the rank's
        const bool replicated_kv = sp.rule == ShardRule::KvHeads && L.kv_replicated();
        const int64_t slot = replicated_kv ? L.kv_head(r) : r;
        for (int64_t o = 0; o < outer; ++o)
          ASSERT_EQ(std::memcmp(&mine.f[size_t(o * width)], &whole.f[size_t(o * total + slot * width)],
                                size_t(width) * sizeof(float)),
                    0)
              << "rank " << r;
      }
      ++sharded;
    }
    EXPECT_GT(sharded, 10);
    EXPECT_GT(partial, 4);
  }
}

// The continuous-batching engine runs every rank through the same forward:
// each sequence unsharded is its single-rank run.
TEST(ImplTensorParallel, TheBatchEngineRunsRanksToo) {
  for (const TpRun& run : {kRuns[1], kRuns[2], kRuns[5]}) {
    SCOPED_TRACE(run.model);
    const Model model = Model::load(golden_model(run.model));
    const auto requests = impl::parse_batch_requests("1,5,9,13,17,21,25@0:2;2,6,10@0:3;3,7,11,15,19@1:2", 0);
    impl::BatchEngineOptions o;
    o.threads = 1;
    o.chunk = 3;
    o.block_size = 4;
    o.mla = run.mla;
    MemoryDump one("batch");
    impl::BatchEngine(model, o).run(requests, one);
    o.tensor_parallel = 4;
    MemoryDump tp("batch --tp 4");
    RankZeroNames named(tp);
    impl::BatchEngine(model, o).run(requests, named);
    tp.mutable_manifest().extra[tensor_parallel_key()] = tensor_parallel_json(4);
    const RankView view(tp, model.config);
    EXPECT_EQ(view.names(), one.names());
    EXPECT_EQ(dump_sequences(view), (std::vector<int>{0, 1, 2}));
    for (const std::string& n : one.names()) {
      const TensorData a = view.get(n), b = one.get(n);
      ASSERT_EQ(a.shape, b.shape) << n;
      if (a.is_int)
        EXPECT_EQ(a.i, b.i) << n;
      else
        EXPECT_LE(scaled_diff(a, b), 2e-5) << n;
    }
  }
}

// Where each tensor-parallel bug first changes a run over 4 ranks.
TEST(ImplTensorParallel, EachBugFirstChangesTheDumpWhereItIsMade) {
  struct Case {
    const char* bug;
    const char* model;
    const char* first;  // the first name (canonical order, rank prefix included) that changes
  };
  const Case cases[] = {
      // rank 1's query heads read kv head 0; it takes kv head 1 mod 2 = 1
      {"tp-kv-heads-split", "llama-gqa", "rank1.step0.layers.0.attn.k"},
      {"tp-kv-heads-split", "qwen3-moe", "rank1.step0.layers.0.attn.k"},
      {"tp-allreduce-missing", "llama3-mqa-scaled", "rank0.step0.layers.0.attn_residual"},
      {"tp-allreduce-missing", "deepseek-v3-mla", "rank0.step0.layers.0.attn_residual"},
      {"tp-allreduce-twice", "qwen3-moe", "rank0.step0.layers.0.out"},
      {"tp-allreduce-twice", "deepseek-v3-mla", "rank0.step0.layers.0.out"},
  };
  std::set<std::string> covered;
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.bug) + " on " + c.model);
    covered.insert(c.bug);
    const Model model = Model::load(golden_model(c.model));
    const Scenario sc = replay_scenario(DumpFile(golden_dump(c.model, "prefill")));
    const MemoryDump clean = run_tp(model, sc, 4), buggy = run_tp(model, sc, 4, {c.bug});
    // The first name by step, layer and site; within one site, by rank.
    std::vector<std::string> names = clean.names();
    std::stable_sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) {
      size_t ra = 0, rb = 0;
      rank_of(a, &ra), rank_of(b, &rb);
      return NameOrder{}(a.substr(ra), b.substr(rb));
    });
    std::string first;
    for (const std::string& n : names)
      if (!buggy.has(n) || !bit_identical(clean.get(n), buggy.get(n))) {
        first = n;
        break;
      }
    EXPECT_EQ(first, c.first);
  }
  for (const zoo::BugInfo* info : zoo::tp_bugs()) EXPECT_TRUE(covered.count(info->name)) << info->name;
}

TEST(ImplTensorParallel, RanksThatDoNotFitTheModelAndBugsThatCannotActAreRefused) {
  const Model gqa = Model::load(golden_model("llama-gqa"));  // Hq 4, Hkv 2, F 160
  const Scenario sc = make_scenario({1, 2, 3}, {}, 0);
  auto refused = [&](const Model& m, int ranks, const std::vector<std::string>& bugs, const std::string& words) {
    try {
      run_tp(m, sc, ranks, bugs);
      ADD_FAILURE() << "not refused: " << ranks << " ranks";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  refused(gqa, 3, {}, "3 ranks do not divide the 4 query heads");
  refused(gqa, 8, {}, "8 ranks do not divide the 4 query heads");
  refused(gqa, 1, {"tp-allreduce-missing"}, "act between ranks");
  refused(gqa, 2, {"tp-kv-heads-split"}, "ranks outnumber the kv heads");
  refused(Model::load(golden_model("llama3-mqa-scaled")), 4, {"tp-kv-heads-split"}, "one kv head (MQA)");
  refused(Model::load(golden_model("deepseek-v3-mla")), 2, {"tp-kv-heads-split"}, "latent");
}
