// Dumps that parse but are inconsistent, given to `llmdiff bisect`: each
// gets a clear diagnosis (exit 1) or an error naming the tensor (exit 2),
// never a crash or a silent pass. HF's own decode dump of llama-gqa, changed
// at one place.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"
#include "dumps/contract/names.h"
#include "tests/cli_runner.h"
#include "tests/support.h"

using namespace llmdiff;
using namespace llmdiff::testing;

namespace {

// HF's decode dump of `model` with `change` applied, written to a file.
std::string changed_dump(const std::string& model, const std::string& stem,
                         const std::function<void(MemoryDump&)>& change) {
  return changed_golden(model, "decode", stem, change);
}

CliRun bisect_on(const std::string& model, const std::string& dump) {
  return run_cli({"bisect", "--model", golden_model(model), dump, "--threads", "1"});
}

void expect_error_naming(const CliRun& r, const std::vector<std::string>& words) {
  EXPECT_EQ(r.code, 2) << r.out << r.error;
  for (const auto& w : words) EXPECT_NE(r.error.find(w), std::string::npos) << "'" << w << "' not in: " << r.error;
}

}  // namespace

TEST(InconsistentDump, AMissingStepIsAnErrorNamingIt) {
  // Step 1 of 3 removed: step 2's tokens and cache follow a call the dump lacks.
  const std::string p = changed_dump("llama-gqa", "missing-step", [](MemoryDump& d) {
    for (const auto& n : d.names())
      if (parse_name(n).step == 1) d.erase(n);
  });
  expect_error_naming(bisect_on("llama-gqa", p), {p, "step1"});
}

TEST(InconsistentDump, StepsOutOfOrderAreTheFindingNotBadInput) {
  // Steps 1 and 2 exchanged (names renumbered): the cache of step 1 is longer
  // than step 2's. What an engine wrote that fits the model is a finding
  // (exit 1) at the first step it contradicts, never an input error.
  const std::string p = changed_dump("llama-gqa", "swapped-steps", [](MemoryDump& d) {
    std::vector<TensorData> moved;
    for (const auto& n : d.names()) {
      CanonName c = parse_name(n);
      if (c.step != 1 && c.step != 2) continue;
      TensorData t = d.get(n);
      d.erase(n);
      const std::string from = "step" + std::to_string(c.step) + ".", to = "step" + std::to_string(3 - c.step) + ".";
      t.name = to + t.name.substr(from.size());
      moved.push_back(std::move(t));
    }
    for (auto& t : moved) d.put(std::move(t));
  });
  const CliRun r = bisect_on("llama-gqa", p);
  EXPECT_EQ(r.code, 1) << r.error;
  EXPECT_NE(r.out.find("step1."), std::string::npos) << r.out;
}

TEST(InconsistentDump, TokensOutsideTheVocabularyAreAnErrorNamingTheTensor) {
  const std::string p = changed_dump("llama-gqa", "oov", [](MemoryDump& d) {
    TensorData t = d.get("step0.tokens");
    t.i[1] = 1000000;
    d.put(t);
  });
  expect_error_naming(bisect_on("llama-gqa", p), {p, "step0.tokens", "1000000", "vocab"});
}

TEST(InconsistentDump, PositionsThatContradictTheCacheAreTheFinding) {
  // Step 1's positions restart at 0 although the cache holds step 0's tokens.
  const std::string p = changed_dump("llama-gqa", "positions", [](MemoryDump& d) {
    TensorData t = d.get("step1.positions");
    for (auto& x : t.i) x -= 5;
    d.put(t);
  });
  const CliRun r = bisect_on("llama-gqa", p);
  EXPECT_EQ(r.code, 1) << r.error;
  EXPECT_NE(r.out.find("step1.positions"), std::string::npos) << r.out;
}

TEST(InconsistentDump, NanOrInfInTheCandidateIsAFindingAtItsFirstSite) {
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    const std::string p = changed_dump("llama-gqa", "nan", [bad](MemoryDump& d) {
      for (const std::string n : {"step0.layers.1.mlp.up", "step0.layers.1.out", "step0.logits"}) {
        TensorData t = d.get(n);
        t.f[3] = bad;
        d.put(t);
      }
    });
    const CliRun r = bisect_on("llama-gqa", p);
    SCOPED_TRACE(r.out + r.error);
    EXPECT_EQ(r.code, 1);
    const std::string what = std::isnan(bad) ? "NaN" : "Inf";
    EXPECT_NE(r.out.find(what), std::string::npos);
    EXPECT_NE(r.out.find("step0.layers.1.mlp.up is non-finite"), std::string::npos);
    EXPECT_NE(r.out.find("first non-finite values are at step0.layers.1.mlp.up"), std::string::npos);
  }
}

TEST(InconsistentDump, ShapesThatContradictTheConfigAreNamed) {
  // A k cache one slot longer than the tokens so far: a length signature (exit
  // 1); a hidden state of the wrong width: an error naming the tensor (exit 2).
  const std::string longer = changed_dump("llama-gqa", "long-cache", [](MemoryDump& d) {
    TensorData t = d.get("step1.layers.0.attn.k_cache");
    const int64_t H = t.shape[0], S = t.shape[1], X = t.shape[2];
    std::vector<float> f(size_t(H * (S + 1) * X), 0.25f);
    for (int64_t h = 0; h < H; ++h) std::copy_n(t.f.begin() + h * S * X, S * X, f.begin() + h * (S + 1) * X);
    t.f = f;
    t.shape[1] = S + 1;
    d.put(t);
  });
  const CliRun r1 = bisect_on("llama-gqa", longer);
  EXPECT_EQ(r1.code, 1) << r1.error;
  EXPECT_NE(r1.out.find("step1.layers.0.attn.k_cache"), std::string::npos) << r1.out;
  EXPECT_NE(r1.out.find("(+1 key)"), std::string::npos) << r1.out;

  const std::string wide = changed_dump("llama-gqa", "wide", [](MemoryDump& d) {
    TensorData t = d.get("step0.layers.0.out");
    t.shape[1] += 1;
    t.f.resize(size_t(t.shape[0] * t.shape[1]), 0.0f);
    d.put(t);
  });
  const CliRun r2 = bisect_on("llama-gqa", wide);
  EXPECT_EQ(r2.code, 1) << r2.error;
  EXPECT_NE(r2.out.find("step0.layers.0.out"), std::string::npos) << r2.out;
  EXPECT_NE(r2.out.find("shape [5, 65] vs reference [5, 64]"), std::string::npos) << r2.out;
  EXPECT_EQ(r2.out.find("length"), std::string::npos) << r2.out;  // a width is not a length
}

TEST(InconsistentDump, ALayerTheModelDoesNotHaveIsAnErrorNamingIt) {
  const std::string p = changed_dump("llama-gqa", "layer7", [](MemoryDump& d) {
    TensorData t = d.get("step0.layers.1.out");
    t.name = "step0.layers.7.out";
    d.put(t);
  });
  expect_error_naming(bisect_on("llama-gqa", p), {p, "step0.layers.7.out", "2 layers"});
}

TEST(InconsistentDump, ADumpOfAnotherModelIsAnErrorNamingBoth) {
  // qwen2-bias's dump given with llama-gqa's model: the manifest's config differs.
  const std::string p = changed_dump("qwen2-bias", "other-model", [](MemoryDump&) {});
  expect_error_naming(bisect_on("llama-gqa", p), {p, "config"});
}
