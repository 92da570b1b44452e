// The scenario driver of engine.h: make_scenario, replay_scenario on the
// golden dumps, and run_scenario's call sequence and `generated` semantics,
// checked with a fake engine that answers with the golden logits.
#include <gtest/gtest.h>

#include <cmath>

#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/base/errors.h"
#include "tests/support.h"
#include "tests/test_dumps_helpers.h"

namespace llmdiff {
namespace {

using namespace llmdiff::testing;
using Tokens = std::vector<int64_t>;

// An engine that replays a golden dump: it checks that each forward call gets
// the tokens HF got at that step, reports tokens/positions/next_logits like a
// real engine, and returns HF's next_logits. Every call is logged.
class GoldenReplayEngine : public Engine {
 public:
  explicit GoldenReplayEngine(const TensorSource& golden) : golden_(golden) {}

  struct Call {
    std::string what;  // "reset" or "forward"
    Tokens tokens;
    int step = -1;
  };
  std::vector<Call> calls;

  void reset() override {
    calls.push_back({"reset", {}, -1});
    cached_ = 0;
  }
  std::vector<float> forward(const Tokens& tokens, int step, Observer& obs) override {
    calls.push_back({"forward", tokens, step});
    const std::string tok = step_name(step, "tokens");
    EXPECT_TRUE(golden_.has(tok)) << "no golden step " << step;
    if (!golden_.has(tok)) return std::vector<float>(8, 0.0f);
    EXPECT_EQ(tokens, golden_.get(tok).i) << "step " << step;
    const int64_t T = int64_t(tokens.size());
    Tokens positions(tokens.size());
    for (size_t i = 0; i < positions.size(); ++i) positions[i] = cached_ + int64_t(i);
    cached_ += T;
    if (step == 0 && obs.wants("rope.inv_freq")) {
      const TensorData f = golden_.get("rope.inv_freq");
      obs.on_f32("rope.inv_freq", f.shape, f.f.data());
    }
    if (obs.wants(tok)) obs.on_i64(tok, {T}, tokens.data());
    if (obs.wants(step_name(step, "positions"))) obs.on_i64(step_name(step, "positions"), {T}, positions.data());
    const TensorData logits = golden_.get(step_name(step, "next_logits"));
    if (obs.wants(step_name(step, "next_logits")))
      obs.on_f32(step_name(step, "next_logits"), logits.shape, logits.f.data());
    return logits.f;
  }
  std::string producer() const override { return "golden replay"; }
  std::string dtype_name() const override { return "float32"; }

  std::vector<int> forward_steps() const {
    std::vector<int> out;
    for (const auto& c : calls)
      if (c.what == "forward") out.push_back(c.step);
    return out;
  }

 private:
  const TensorSource& golden_;
  int64_t cached_ = 0;
};

// ------------------------------------------------------------- make_scenario

TEST(MakeScenario, PrefillChunkedAndDecode) {
  const Tokens t = {11, 12, 13, 14, 15, 16, 17};
  Scenario s = make_scenario(t, {}, 0);
  EXPECT_EQ(s.name, "prefill");
  EXPECT_EQ(s.steps, std::vector<Tokens>{t});
  EXPECT_EQ(s.decode, 0);
  EXPECT_FALSE(s.emit_generated);
  EXPECT_EQ(s.first_generating_step, 0);

  s = make_scenario(t, {4, 3}, 0);
  EXPECT_EQ(s.name, "chunked");
  EXPECT_EQ(s.steps, (std::vector<Tokens>{{11, 12, 13, 14}, {15, 16, 17}}));
  EXPECT_FALSE(s.emit_generated);
  EXPECT_EQ(s.first_generating_step, 1);

  s = make_scenario(t, {7}, 0);
  EXPECT_EQ(s.name, "prefill");
  EXPECT_EQ(s.steps.size(), 1u);

  s = make_scenario(Tokens(t.begin(), t.begin() + 5), {}, 3);
  EXPECT_EQ(s.name, "decode");
  EXPECT_EQ(s.steps.size(), 1u);
  EXPECT_EQ(s.decode, 3);
  EXPECT_TRUE(s.emit_generated);
  EXPECT_EQ(s.first_generating_step, 0);

  s = make_scenario(t, {1, 1, 5}, 2);
  EXPECT_EQ(s.name, "decode");
  EXPECT_EQ(s.steps, (std::vector<Tokens>{{11}, {12}, {13, 14, 15, 16, 17}}));
  EXPECT_EQ(s.first_generating_step, 2);
  EXPECT_TRUE(s.emit_generated);
}

TEST(MakeScenario, InvalidRequestsAreUsageErrors) {
  const Tokens t = {1, 2, 3, 4, 5, 6, 7};
  expect_error<UsageError>([&] { make_scenario({}, {}, 0); }, {"token"});
  expect_error<UsageError>([&] { make_scenario(t, {4, 4}, 0); }, {"8", "7"});
  expect_error<UsageError>([&] { make_scenario(t, {4, 2}, 0); }, {"6", "7"});
  expect_error<UsageError>([&] { make_scenario(t, {0, 7}, 0); }, {"positive"});
  expect_error<UsageError>([&] { make_scenario(t, {-1, 8}, 0); }, {"positive"});
  expect_error<UsageError>([&] { make_scenario(t, {}, -1); }, {"decode"});
}

// ----------------------------------------------------------- replay_scenario

TEST(ReplayScenario, GoldenDumpsGiveTheirOwnForwardCalls) {
  for (const auto& model : golden_models()) {
    SCOPED_TRACE(model);
    DumpFile decode(golden_dump(model, "decode")), chunked(golden_dump(model, "chunked")),
        prefill(golden_dump(model, "prefill"));
    Scenario d = replay_scenario(decode);
    EXPECT_EQ(d.name, "decode");
    EXPECT_EQ(d.steps, decode.step_tokens());
    EXPECT_EQ(d.steps.size(), 4u);
    EXPECT_EQ(d.decode, 0);  // the generated tokens are replayed as given steps
    EXPECT_TRUE(d.emit_generated);
    EXPECT_EQ(d.first_generating_step, 0);  // generated[k] = argmax of step k, k = 0..3

    Scenario c = replay_scenario(chunked);
    EXPECT_EQ(c.name, "chunked");
    EXPECT_EQ(c.steps, chunked.step_tokens());
    EXPECT_EQ(c.steps.size(), 2u);
    EXPECT_FALSE(c.emit_generated);
    EXPECT_EQ(c.first_generating_step, 1);

    Scenario p = replay_scenario(prefill);
    EXPECT_EQ(p.name, "prefill");
    EXPECT_EQ(p.steps.size(), 1u);
    EXPECT_FALSE(p.emit_generated);
    EXPECT_EQ(p.first_generating_step, 0);
  }
}

TEST(ReplayScenario, DumpsWithoutForwardCallsAreFormatErrors) {
  MemoryDump empty("empty-dump");
  expect_error<FormatError>([&] { replay_scenario(empty); }, {"empty-dump"});
  MemoryDump no_tokens("no-tokens");
  const Tokens none;
  no_tokens.on_i64("step0.tokens", {0}, none.data());
  expect_error<FormatError>([&] { replay_scenario(no_tokens); }, {"no-tokens", "step0.tokens"});
  MemoryDump gap("gap");
  const Tokens one = {4};
  gap.on_i64("step0.tokens", {1}, one.data());
  gap.on_i64("step2.tokens", {1}, one.data());
  expect_error<MissingTensorError>([&] { replay_scenario(gap); }, {"gap", "step1.tokens"});
  // Without a manifest scenario the replay is named as such.
  MemoryDump plain("plain");
  plain.on_i64("step0.tokens", {1}, one.data());
  EXPECT_EQ(replay_scenario(plain).name, "replay");
}

// -------------------------------------------------------------- run_scenario

TEST(RunScenario, GreedyDecodeFeedsTheLastGeneratedToken) {
  for (const auto& model : golden_models()) {
    SCOPED_TRACE(model);
    DumpFile golden(golden_dump(model, "decode"));
    const Tokens want = golden.get("generated").i;
    ASSERT_EQ(want.size(), 4u);
    const Tokens prompt = golden.step_tokens()[0];

    // --tokens <5 ids> --decode 3: one prefill call, then each call feeds
    // generated.back(); generated = argmax of next_logits of steps 0..3.
    GoldenReplayEngine engine(golden);
    MemoryDump obs;
    const Tokens got = run_scenario(engine, make_scenario(prompt, {}, 3), obs);
    EXPECT_EQ(got, want);
    ASSERT_EQ(engine.calls.size(), 5u);
    EXPECT_EQ(engine.calls[0].what, "reset");
    EXPECT_EQ(engine.forward_steps(), (std::vector<int>{0, 1, 2, 3}));
    EXPECT_EQ(engine.calls[1].tokens, prompt);
    for (int k = 1; k <= 3; ++k) EXPECT_EQ(engine.calls[size_t(k + 1)].tokens, Tokens{want[size_t(k - 1)]});
    ASSERT_TRUE(obs.has("generated"));
    EXPECT_EQ(obs.get("generated").i, want);
    EXPECT_EQ(obs.shape("generated"), Shape{4});
    EXPECT_EQ(obs.get("step3.positions").i, Tokens{7});
    EXPECT_EQ(obs.names().back(), "generated");
  }
}

TEST(RunScenario, ReplayOfTheGoldenDecodeGivesTheSameCallsAndGenerated) {
  DumpFile golden(golden_dump("llama-gqa", "decode"));
  GoldenReplayEngine engine(golden);
  MemoryDump obs;
  const Tokens got = run_scenario(engine, replay_scenario(golden), obs);
  EXPECT_EQ(got, golden.get("generated").i);
  EXPECT_EQ(engine.forward_steps(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(obs.get("generated").i, golden.get("generated").i);
  EXPECT_EQ(obs.step_tokens(), golden.step_tokens());
  EXPECT_TRUE(obs.has("rope.inv_freq"));
  // A second run starts again from an empty cache.
  MemoryDump again;
  EXPECT_EQ(run_scenario(engine, replay_scenario(golden), again), got);
  EXPECT_EQ(engine.calls[5].what, "reset");
  EXPECT_EQ(again.get("step0.positions").i, (Tokens{0, 1, 2, 3, 4}));
}

TEST(RunScenario, ChunkedAndPrefillGenerateFromTheLastPromptCallOnly) {
  DumpFile chunked(golden_dump("qwen3-qknorm", "chunked")), prefill(golden_dump("qwen3-qknorm", "prefill"));
  {
    GoldenReplayEngine engine(chunked);
    MemoryDump obs;
    const Tokens got = run_scenario(engine, replay_scenario(chunked), obs);
    EXPECT_EQ(got, Tokens{argmax_first(chunked.get("step1.next_logits").f)});
    EXPECT_FALSE(obs.has("generated"));  // not emitted outside decode scenarios
    EXPECT_EQ(engine.forward_steps(), (std::vector<int>{0, 1}));
    EXPECT_EQ(obs.get("step1.positions").i, (Tokens{4, 5, 6}));
  }
  {
    // --tokens <7 ids> --chunks 4,3 is the same run.
    GoldenReplayEngine engine(chunked);
    MemoryDump obs;
    run_scenario(engine, make_scenario(prefill.step_tokens()[0], {4, 3}, 0), obs);
    EXPECT_EQ(engine.forward_steps(), (std::vector<int>{0, 1}));
    EXPECT_EQ(obs.step_tokens(), chunked.step_tokens());
  }
  {
    GoldenReplayEngine engine(prefill);
    NullObserver null;
    const Tokens got = run_scenario(engine, replay_scenario(prefill), null);
    EXPECT_EQ(got, Tokens{argmax_first(prefill.get("step0.next_logits").f)});
  }
}

TEST(RunScenario, GeneratedIsOnlyReportedToObserversThatWantIt) {
  DumpFile golden(golden_dump("llama3-mqa-scaled", "decode"));
  GoldenReplayEngine engine(golden);
  MemoryDump obs;
  obs.set_filter({"step*.tokens"});
  const Tokens got = run_scenario(engine, replay_scenario(golden), obs);
  EXPECT_EQ(got, golden.get("generated").i);
  EXPECT_FALSE(obs.has("generated"));
  EXPECT_EQ(obs.names().size(), 4u);
}

TEST(RunScenario, ScenariosThatCannotRunAreUsageErrorsBeforeAnyCall) {
  DumpFile golden(golden_dump("llama-gqa", "decode"));
  GoldenReplayEngine engine(golden);
  NullObserver null;
  Scenario none;
  none.decode = 2;
  expect_error<UsageError>([&] { run_scenario(engine, none, null); }, {"no forward calls"});
  Scenario late = replay_scenario(golden);
  late.decode = 1;
  late.first_generating_step = 4;  // no prompt call produces the token to feed
  expect_error<UsageError>([&] { run_scenario(engine, late, null); }, {"first generating step 4"});
  EXPECT_TRUE(engine.calls.empty());
}

TEST(ArgmaxFirst, FirstIndexWinsTies) {
  EXPECT_EQ(argmax_first({1.0f}), 0);
  EXPECT_EQ(argmax_first({-3.0f, -1.0f, -2.0f}), 1);
  EXPECT_EQ(argmax_first({0.5f, 2.0f, 2.0f, 1.0f}), 1);
  EXPECT_EQ(argmax_first({2.0f, 2.0f}), 0);
  EXPECT_EQ(argmax_first({-INFINITY, 0.0f, INFINITY, INFINITY}), 2);
}

}  // namespace
}  // namespace llmdiff
