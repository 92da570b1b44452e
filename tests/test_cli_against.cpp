// `llmdiff bisect A --against B` on the impl's own runs of the golden
// models (dense, MoE, MLA): the same requests under two configurations
// (chunk sizes, batch 1 vs N, ring vs paged cache, single vs batched, a
// prefix-cache hit made from a chunked run) are legitimate, their sequences
// paired by prompt whatever their order; a zoo bug injected in one side is
// a bug in that side, named; the reports say the same headline.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"
#include "dumps/contract/names.h"
#include "dumps/contract/rows.h"
#include "dumps/model/config.h"
#include "tests/cli_runner.h"
#include "tests/support.h"
#include "tests/test_compare_helpers.h"

using namespace llmdiff;
using namespace llmdiff::testing;

namespace {

// The requests: P is the one both sides serve, Q and R only the batch.
const std::string kP = "3,14,15,92,65", kQ = "2,7,18", kR = "9,9,8,1";

std::string impl_dump(const std::string& model, const std::string& tag, std::vector<std::string> args) {
  const std::string out = temp_path("against-" + model + "-" + tag + ".safetensors");
  std::vector<std::string> cmd = {"dump", "--engine", "impl", "--model", golden_model(model), "--threads", "1",
                                  "--out", out};
  cmd.insert(cmd.end(), args.begin(), args.end());
  const CliRun r = run_cli(cmd);
  EXPECT_EQ(r.code, 0) << r.error;
  return out;
}

// P alone, greedy, 3 decode calls.
std::string single(const std::string& model, std::vector<std::string> extra = {}, const std::string& tag = "single") {
  std::vector<std::string> args = {"--tokens", kP, "--decode", "3"};
  args.insert(args.end(), extra.begin(), extra.end());
  return impl_dump(model, tag, args);
}

// Q, P and R served together (P second), prompts in chunks of 2 beside the
// others' decodes, blocks of 4.
std::string batch_n(const std::string& model, std::vector<std::string> extra = {}, const std::string& tag = "batchN") {
  std::vector<std::string> args = {"--batch", kQ + ":2;" + kP + ":3;" + kR + ":1", "--chunk", "2", "--block-size", "4"};
  args.insert(args.end(), extra.begin(), extra.end());
  return impl_dump(model, tag, args);
}

nlohmann::json against(const std::string& model, const std::string& a, const std::string& b, int* code,
                       std::vector<std::string> extra = {}) {
  std::vector<std::string> cmd = {"bisect", "--model", golden_model(model), a, "--against", b, "--json",
                                  "--threads", "1"};
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  const CliRun r = run_cli(cmd);
  *code = r.code;
  EXPECT_TRUE(r.code == 0 || r.code == 1) << r.error;
  return nlohmann::json::parse(r.out);
}

void expect_all_legitimate(const nlohmann::json& j, int code, size_t pairs) {
  EXPECT_EQ(code, 0) << j["headline"];
  EXPECT_EQ(j["exit_code"], 0);
  ASSERT_EQ(j["pairs"].size(), pairs) << j["headline"];
  for (const auto& p : j["pairs"]) EXPECT_EQ(p["verdict"], "legitimate") << p["headline"];
  EXPECT_EQ(j["headline"].get<std::string>().rfind("legitimate: ", 0), 0u) << j["headline"];
}

// The warm side of a prefix-cache hit made from a cold run in chunks: its
// first call's tokens served from the cache (step0.kv.cached_prefix), its
// later calls as they were, numbered from 0.
std::string warm_from(const std::string& cold, const std::string& tag) {
  DumpFile c(cold);
  MemoryDump w("warm");
  w.mutable_manifest() = c.manifest();
  w.mutable_manifest().steps = c.manifest().steps - 1;
  for (const std::string& n : c.names()) {
    CanonName p = parse_name(n);
    TensorData t = c.get(n);
    if (p.kind == CanonName::Kind::Step || p.kind == CanonName::Kind::Layer) {
      if (p.step == 0) continue;
      p.step -= 1;
      t.name = p.str();
    }
    w.put(std::move(t));
  }
  TensorData prefix = c.get("step0.tokens");
  prefix.name = "step0.kv.cached_prefix";
  w.put(std::move(prefix));
  const std::string out = temp_path("against-warm-" + tag + ".safetensors");
  w.save(out);
  return out;
}

TEST(CliAgainst, LegitimateConfigurationsOfDenseMoeAndMlaModels) {
  for (const std::string model : {"llama-gqa", "qwen3-moe", "deepseek-v3-mla"}) {
    SCOPED_TRACE(model);
    const bool mla = model == "deepseek-v3-mla";
    const std::string one = single(model), chunked = single(model, {"--chunks", "2,3"}, "chunked");
    const std::string batch1 = impl_dump(model, "batch1", {"--batch", kP + ":3"}), many = batch_n(model);
    int code = -1;
    // Chunk sizes.
    nlohmann::json j = against(model, chunked, one, &code);
    expect_all_legitimate(j, code, 1);
    EXPECT_EQ(j["pairs"][0]["common_positions"], 8);  // 5 prompt + 3 fed back
    EXPECT_GT(j["pairs"][0]["compared"].get<int>(), 0);
    // Batch 1 vs N: P is seq0 of A, seq1 of B; Q and R only in B.
    j = against(model, batch1, many, &code);
    expect_all_legitimate(j, code, 1);
    EXPECT_EQ(j["pairs"][0]["a"], 0);
    EXPECT_EQ(j["pairs"][0]["b"], 1);
    EXPECT_EQ(j["only_in_b"], (std::vector<int>{0, 2}));
    EXPECT_EQ(j["b"]["sequences"][1]["prompt_length"], 5);
    // A ring cache (GQA only) that does not wrap vs the paged batch; single vs batched.
    const std::string ring = mla ? one : single(model, {"--kv-ring", "16"}, "ring");
    j = against(model, ring, many, &code);
    expect_all_legitimate(j, code, 1);
    EXPECT_EQ(j["pairs"][0]["b"], 1);
  }
}

// Two honest producers round differently (the ref's libtorch products, the
// impl's batched engine): the pair is legitimate, with the first op where
// they differ and the largest difference within the floor.
TEST(CliAgainst, ALegitimateDifferenceIsLocatedAndMeasuredAgainstTheFloor) {
  const std::string out = temp_path("against-ref-single.safetensors");
  const CliRun ref = run_cli({"dump", "--engine", "ref", "--model", golden_model("llama-gqa"), "--tokens", kP,
                              "--decode", "3", "--out", out});
  ASSERT_EQ(ref.code, 0) << ref.error;
  int code = -1;
  const nlohmann::json j = against("llama-gqa", out, batch_n("llama-gqa"), &code);
  expect_all_legitimate(j, code, 1);
  const auto& p = j["pairs"][0];
  ASSERT_TRUE(p["first_difference"].is_object()) << p.dump(1);
  EXPECT_GT(p["first_difference"]["differing"].get<int>(), 0);
  EXPECT_EQ(p["first_difference"]["name_a"].get<std::string>().rfind("step", 0), 0u);
  ASSERT_TRUE(p["largest"].is_object());
  const double ratio = p["largest"]["ratio"].get<double>();
  EXPECT_GT(ratio, 0);
  EXPECT_LT(ratio, 1) << p["headline"];
  EXPECT_GE(p["largest"]["threshold"].get<double>(), 0);
  EXPECT_NE(p["headline"].get<std::string>().find("x the noise-floor threshold at position"), std::string::npos);
}

TEST(CliAgainst, AZooBugInjectedInOneSideIsABugInThatSideAndNamed) {
  struct Case {
    const char* model;
    const char* bug;
    bool in_a;  // injected in A (the single run), else in B (the batch)
  };
  for (const Case& c : {Case{"llama-gqa", "rope-interleaved", false}, Case{"qwen3-moe", "moe-expert-off-by-one", true},
                        Case{"deepseek-v3-mla", "mla-rope-front", false}}) {
    SCOPED_TRACE(std::string(c.model) + " " + c.bug);
    const std::string a = c.in_a ? single(c.model, {"--inject", c.bug}, std::string("single-") + c.bug)
                                 : single(c.model);
    const std::string b = c.in_a ? batch_n(c.model) : batch_n(c.model, {"--inject", c.bug}, std::string("batch-") + c.bug);
    int code = -1;
    const nlohmann::json j = against(c.model, a, b, &code);
    EXPECT_EQ(code, 1);
    ASSERT_EQ(j["pairs"].size(), 1u);
    const auto& p = j["pairs"][0];
    EXPECT_EQ(p["verdict"], c.in_a ? "bug-in-a" : "bug-in-b");
    const auto& seq = c.in_a ? j["a"]["sequences"][0] : j["b"]["sequences"][1];
    EXPECT_FALSE(seq["ok"].get<bool>());
    EXPECT_EQ(seq["bisect"]["diagnosis"]["bug"], c.bug) << seq["bisect"]["diagnosis"].dump(1).substr(0, 2000);
    const std::string side = c.in_a ? "A" : "B";
    EXPECT_EQ(p["headline"], "a bug in " + side + ": " + seq["headline"].get<std::string>());
    EXPECT_NE(p["headline"].get<std::string>().find(std::string("Diagnosis: ") + c.bug), std::string::npos);
    EXPECT_EQ(j["headline"].get<std::string>().rfind("seq0 (A) / seq1 (B): a bug in " + side, 0), 0u) << j["headline"];
  }
}

// A chunked run is the cold side of a prefix hit: the warm side serves the
// first chunk from the cache. Its bisection replays the cached prefix first;
// the pair is legitimate. Served blocks holding other values are a bug of
// the warm side, first diverging at its cache.
TEST(CliAgainst, APrefixCacheHitIsLegitimateAndAWrongServedBlockIsABug) {
  const std::string cold = single("llama-gqa", {"--chunks", "3,2"}, "cold");
  const std::string warm = warm_from(cold, "llama-gqa");
  int code = -1;
  nlohmann::json j = against("llama-gqa", cold, warm, &code);
  expect_all_legitimate(j, code, 1);
  EXPECT_EQ(j["b"]["sequences"][0]["cached_prefix"], 3);
  EXPECT_EQ(j["b"]["sequences"][0]["calls"], 4);  // its own calls: the reference runs the hit in front of them
  EXPECT_FALSE(j["pairs"][0]["first_difference"].is_object()) << j["pairs"][0]["headline"];  // the same values

  // The served positions of layer 0's keys, off.
  DumpFile w(warm);
  MemoryDump bad("bad warm");
  copy_into(w, bad);
  TensorData k = bad.get("step0.layers.0.attn.k_cache");  // [Hkv, S, Dh], positions 0..2 served
  k.f[0] += 0.25f;
  bad.put(k);
  const std::string bad_path = temp_path("against-warm-bad.safetensors");
  bad.save(bad_path);
  j = against("llama-gqa", cold, bad_path, &code);
  EXPECT_EQ(code, 1);
  EXPECT_EQ(j["pairs"][0]["verdict"], "bug-in-b");
  EXPECT_EQ(j["b"]["sequences"][0]["bisect"]["first_divergence"], "step0.layers.0.attn.k_cache") << j["headline"];
}

// A speculative run made from the impl's own calls: the prompt, then one
// verify call feeding g0 with the drafts g1 (the greedy next token) and a
// wrong one, `accepted` of them kept; `generated` as the engine would say.
std::string speculative(const std::string& model, int accepted, const std::string& tag) {
  DumpFile plain(single(model));
  const std::vector<int64_t> g = plain.get("generated").i;  // g0 .. g3
  const int64_t wrong = (g[2] + 1) % 100;
  const std::string tokens = kP + "," + std::to_string(g[0]) + "," + std::to_string(g[1]) + "," + std::to_string(wrong);
  DumpFile run(impl_dump(model, tag + "-calls", {"--tokens", tokens, "--chunks", "5,3"}));
  MemoryDump spec("speculative");
  copy_into(run, spec);
  spec.put(int_tensor("step1.spec.draft", {2}, {g[1], wrong}));
  spec.put(int_tensor("step1.spec.accepted", {1}, {accepted}));
  // The prompt's pick, then the kept drafts and the pick after the last kept row.
  const std::vector<float> last = run.get("step1.logits").f;
  const int64_t v = int64_t(last.size()) / 3;
  const auto row_argmax = [&](int64_t r) {
    return int64_t(std::max_element(last.begin() + r * v, last.begin() + (r + 1) * v) - (last.begin() + r * v));
  };
  std::vector<int64_t> generated = {g[0], g[1]};
  if (accepted == 2) generated.push_back(wrong);
  generated.push_back(row_argmax(accepted));
  spec.put(int_tensor("generated", {int64_t(generated.size())}, generated));
  const std::string out = temp_path("against-spec-" + tag + ".safetensors");
  spec.save(out);
  return out;
}

// Speculative decoding on vs off: the verify call's kept rows are the
// one-token decodes' positions, the rejected draft rolled back; a verify
// call that keeps a draft its own logits reject is a bug of that side.
TEST(CliAgainst, SpeculativeDecodingOnVsOffIsLegitimateAndAWrongAcceptanceIsABug) {
  const std::string off = impl_dump("llama-gqa", "decode2", {"--tokens", kP, "--decode", "2"});
  int code = -1;
  nlohmann::json j = against("llama-gqa", speculative("llama-gqa", 1, "ok"), off, &code);
  expect_all_legitimate(j, code, 1);
  EXPECT_EQ(j["pairs"][0]["common_positions"], 7);
  EXPECT_GT(j["pairs"][0]["compared"].get<int>(), 0);
  EXPECT_EQ(j["a"]["sequences"][0]["calls"], 2);  // the prompt, then the verify call (its rejected draft rolled back)

  j = against("llama-gqa", speculative("llama-gqa", 2, "wrong"), off, &code);
  EXPECT_EQ(code, 1);
  EXPECT_EQ(j["pairs"][0]["verdict"], "bug-in-a") << j["headline"];
  EXPECT_EQ(j["a"]["sequences"][0]["bisect"]["first_divergence"], "step1.spec.accepted");
  EXPECT_EQ(j["a"]["sequences"][0]["bisect"]["finding"]["bug"], "spec-accept-off-by-one");
}

// A tensor-parallel run of R ranks made from a single run's tensors by the
// format's shard table: query heads, kv heads (one head on R / Hkv ranks
// when Hkv < R) and the MLP's columns split in rank order, the partial sums
// as rank 0 holding the whole and the others zeros, every other name under
// rank0 only. `twice`: rank 1's partial sum of this name is rank 0's (an
// all-reduce that adds one rank twice).
std::string tensor_parallel(const std::string& model, int ranks, const std::string& twice = "") {
  const ModelConfig cfg = load_config(golden_model(model));
  DumpFile one(single(model));
  MemoryDump tp("tensor parallel");
  tp.mutable_manifest() = one.manifest();
  tp.mutable_manifest().extra["tensor_parallel"] = "{\"ranks\": " + std::to_string(ranks) + "}";
  const std::set<std::string> q_cols = {"attn.q", "attn.q_norm", "attn.ctx"}, q_heads = {"attn.q_rope", "attn.scores",
      "attn.probs", "attn.k_rep", "attn.v_rep"}, kv_cols = {"attn.k", "attn.v", "attn.k_norm"},
      kv_heads = {"attn.k_rope", "attn.k_cache", "attn.v_cache"}, mlp = {"mlp.gate", "mlp.up", "mlp.act"},
      partial = {"attn.out", "mlp.down"};
  auto part = [](const TensorData& t, int axis, int64_t k, int64_t of) {
    const int64_t n = t.shape[size_t(axis)] / of;
    std::vector<int64_t> rows;
    for (int64_t i = k * n; i < (k + 1) * n; ++i) rows.push_back(i);
    TensorData o = select_rows(t, rows, axis);
    o.rows.clear();
    return o;
  };
  for (const std::string& n : one.names()) {
    const CanonName c = parse_name(n);
    const TensorData t = one.get(n);
    const bool q = q_cols.count(c.site) || q_heads.count(c.site), kv = kv_cols.count(c.site) || kv_heads.count(c.site);
    const int axis = q_cols.count(c.site) || kv_cols.count(c.site) || mlp.count(c.site) ? 1 : 0;
    for (int r = 0; r < ranks; ++r) {
      TensorData s;
      if (q || mlp.count(c.site)) {
        s = part(t, axis, r, ranks);
      } else if (kv) {
        const int64_t hkv = cfg.num_key_value_heads;
        s = hkv >= ranks ? part(t, axis, r, ranks) : part(t, axis, r * hkv / ranks, hkv);
      } else if (partial.count(c.site)) {
        s = t;
        if (r > 0 && n != twice) std::fill(s.f.begin(), s.f.end(), 0.0f);
      } else if (r == 0) {
        s = t;
      } else {
        continue;
      }
      s.name = "rank" + std::to_string(r) + "." + n;
      tp.put(std::move(s));
    }
  }
  const std::string out = temp_path("against-tp-" + model + "-" + std::to_string(ranks) + (twice.empty() ? "" : "-twice") + ".safetensors");
  tp.save(out);
  return out;
}

// TP 1 vs R: the ranks' shards unsharded are the single run's tensors; an
// all-reduce that adds one rank's partial sum twice is a bug of that side.
TEST(CliAgainst, TensorParallelRanksAreUnshardedAndADoubledPartialSumIsABug) {
  for (const std::string model : {"llama-gqa", "llama3-mqa-scaled"}) {  // Hkv = 2 and 1 over 2 ranks
    SCOPED_TRACE(model);
    int code = -1;
    nlohmann::json j = against(model, single(model), tensor_parallel(model, 2), &code);
    expect_all_legitimate(j, code, 1);
    EXPECT_FALSE(j["pairs"][0]["first_difference"].is_object()) << j["pairs"][0]["headline"];
    EXPECT_NE(j["b"]["sequences"][0]["bisect"]["notes"].dump().find("ranks: judged unsharded"), std::string::npos)
        << j["b"]["sequences"][0]["bisect"]["notes"];
  }
  int code = -1;
  const nlohmann::json j =
      against("llama-gqa", single("llama-gqa"), tensor_parallel("llama-gqa", 2, "step1.layers.0.attn.out"), &code);
  EXPECT_EQ(code, 1);
  EXPECT_EQ(j["pairs"][0]["verdict"], "bug-in-b");
  EXPECT_EQ(j["b"]["sequences"][0]["bisect"]["first_divergence"], "step1.layers.0.attn.out") << j["headline"];
}

TEST(CliAgainst, ReportsSayTheHeadlineAndBadInputIsExitTwo) {
  const std::string a = single("llama-gqa"), b = batch_n("llama-gqa", {"--inject", "rope-interleaved"}, "batch-bug");
  const std::string md = temp_path("against.md"), html = temp_path("against.html");
  const CliRun text = run_cli({"bisect", "--model", golden_model("llama-gqa"), a, "--against", b, "--threads", "1",
                               "--report", md, "--html", html});
  EXPECT_EQ(text.code, 1) << text.error;
  int code = -1;
  const nlohmann::json j = against("llama-gqa", a, b, &code);
  const std::string line = j["headline"];
  EXPECT_NE(text.out.find("RESULT: " + line), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("== the bug in B: seq1"), std::string::npos);
  EXPECT_NE(read_text(md).find("**" + line + "**"), std::string::npos);
  EXPECT_NE(read_text(md).find("## the bug in B: seq1"), std::string::npos);
  const std::string page = read_text(html);
  EXPECT_NE(page.find("id=\"pairs\""), std::string::npos);
  EXPECT_TRUE(embedded_json(page, "chart-data").is_object());
  // The page draws in a browser (scripts/setup.sh installs chromium): the
  // buggy side's chart and heatmap, no script error.
  std::string dom;
  run_command("timeout 90 chromium --headless --no-sandbox --disable-gpu --user-data-dir=" +
                  temp_path("chromium-profile-against") + " --dump-dom " + html + " 2>/dev/null",
              &dom);
  const size_t body = dom.find("<body");
  ASSERT_NE(body, std::string::npos) << dom.substr(0, 2000);
  const std::string tag = dom.substr(body, dom.find('>', body) - body);
  EXPECT_NE(tag.find("data-rendered=\"ok\""), std::string::npos) << tag;
  EXPECT_EQ(tag.find("data-error"), std::string::npos) << tag;

  const std::string model = golden_model("llama-gqa");
  EXPECT_EQ(run_cli({"bisect", "--model", model, a, "--against", b, "--no-noise-floor"}).code, 2);
  EXPECT_EQ(run_cli({"bisect", "--model", model, a, "--against", b, "--junit", temp_path("j.xml")}).code, 2);
  const std::string other = impl_dump("llama-gqa", "other", {"--tokens", kQ});
  const CliRun none = run_cli({"bisect", "--model", model, a, "--against", other, "--threads", "1"});
  EXPECT_EQ(none.code, 2);
  EXPECT_NE(none.error.find("share no request"), std::string::npos) << none.error;
}

}  // namespace
