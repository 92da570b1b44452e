// GGUF models end to end: HF goldens converted to GGUF compute the same
// function (config from the metadata, q/k row order undone), quantised
// models work in inspect, dump, bisect and run, precision profiles let a
// designed rounding pass while a bug is still found, and the quantisation
// error report separates the two.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <map>

#include "dumps/model/config.h"
#include "dumps/contract/dump.h"
#include "dumps/base/errors.h"
#include "dumps/formats/gguf.h"
#include "dumps/model/weights.h"
#include "tests/cli_runner.h"
#include "tests/support.h"
#include "tests/test_cli_diff_helpers.h"

namespace fs = std::filesystem;
using namespace llmdiff;
using llmdiff::testing::golden_dump;
using llmdiff::testing::golden_model;
using llmdiff::testing::run_cli;
using llmdiff::testing::temp_path;

namespace {

const char* kPrompt = "1,5,9,200,31,7,3000,12";

// `src` rewritten with its manifest changed by `edit`.
void copy_dump(const std::string& src, const std::string& dst, const std::function<void(Manifest&)>& edit) {
  DumpFile in(src);
  DumpWriter out(dst);
  out.mutable_manifest() = in.manifest();
  edit(out.mutable_manifest());
  for (const std::string& name : in.names()) {
    const TensorData t = in.get(name);
    if (t.is_int) out.on_i64(name, t.shape, t.i.data());
    else out.on_f32(name, t.shape, t.f.data());
  }
  out.finish();
}

// A quantised tiny Llama written by synth (GGUF, matrices `quant`), shared
// by the tests of one type.
const std::string& quantised_model(const std::string& quant) {
  static std::map<std::string, std::string> made;
  auto it = made.find(quant);
  if (it != made.end()) return it->second;
  const std::string path = temp_path("tiny-llama-" + quant) + ".gguf";
  const auto r = run_cli({"synth", "--preset", "tiny-llama", "--format", "gguf", "--quant", quant, "--out", path});
  EXPECT_EQ(r.code, 0) << r.error;
  return made[quant] = path;
}

std::string impl_dump(const std::string& model, const std::string& out, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {"dump", "--engine", "impl", "--model", model, "--tokens", kPrompt,
                                   "--decode", "3", "--out", out};
  args.insert(args.end(), extra.begin(), extra.end());
  const auto r = run_cli(args);
  EXPECT_EQ(r.code, 0) << r.error;
  return out;
}

}  // namespace

// Every dense golden, converted to GGUF, gives the ref's dump bit for bit:
// the metadata carries the config (rope scaling, eps, tie, biases, q/k
// norm), and llama's q/k rows come back in HF's order.
TEST(CliGguf, ConvertedGoldensComputeTheSameFunction) {
  const std::vector<std::pair<std::string, std::string>> models = {
      {"llama-gqa", "F32"}, {"llama-mha-bf16", "BF16"}, {"llama3-mqa-scaled", "F32"},
      {"qwen2-bias", "F32"}, {"qwen3-qknorm", "F32"}};
  for (const auto& [name, type] : models) {
    SCOPED_TRACE(name);
    const std::string gguf = temp_path(name) + ".gguf";
    const auto conv = run_cli({"convert", "--model", golden_model(name), "--out", gguf, "--type", type});
    ASSERT_EQ(conv.code, 0) << conv.error;
    const ModelConfig hf = load_config(golden_model(name)), gg = load_config(gguf);
    EXPECT_EQ(gg.model_type, hf.model_type);
    EXPECT_EQ(gg.num_hidden_layers, hf.num_hidden_layers);
    EXPECT_EQ(gg.num_attention_heads, hf.num_attention_heads);
    EXPECT_EQ(gg.num_key_value_heads, hf.num_key_value_heads);
    EXPECT_EQ(gg.head_dim, hf.head_dim);
    EXPECT_EQ(gg.vocab_size, hf.vocab_size);
    EXPECT_EQ(gg.rms_norm_eps, hf.rms_norm_eps);
    EXPECT_EQ(gg.rope_theta, hf.rope_theta);
    EXPECT_EQ(gg.tie_word_embeddings, hf.tie_word_embeddings);
    EXPECT_EQ(gg.qkv_bias, hf.qkv_bias);
    EXPECT_EQ(gg.qk_norm, hf.qk_norm);
    EXPECT_EQ(gg.default_dtype(), hf.default_dtype());

    const std::string from_hf = temp_path(name + "-hf") + ".st", from_gguf = temp_path(name + "-gguf") + ".st";
    llmdiff::testing::write_engine_dump("ref", golden_model(name), golden_dump(name, "decode"), from_hf);
    llmdiff::testing::write_engine_dump("ref", gguf, golden_dump(name, "decode"), from_gguf);
    EXPECT_EQ(llmdiff::testing::first_difference(DumpFile(from_hf), DumpFile(from_gguf)), "");
    // The impl reads the permuted rows in place: the same bits as well.
    const std::string impl_hf = temp_path(name + "-impl-hf") + ".st", impl_gguf = temp_path(name + "-impl-gguf") + ".st";
    llmdiff::testing::write_engine_dump("impl", golden_model(name), golden_dump(name, "prefill"), impl_hf);
    llmdiff::testing::write_engine_dump("impl", gguf, golden_dump(name, "prefill"), impl_gguf);
    EXPECT_EQ(llmdiff::testing::first_difference(DumpFile(impl_hf), DumpFile(impl_gguf)), "");
  }
}

// The weights themselves: each HF tensor read back from the GGUF file
// (dequantised rows, q/k rows unpermuted) equals the checkpoint's.
TEST(CliGguf, WeightsReadBackInHfLayout) {
  const std::string gguf = temp_path("llama-gqa-weights") + ".gguf";
  ASSERT_EQ(run_cli({"convert", "--model", golden_model("llama-gqa"), "--out", gguf, "--type", "F32"}).code, 0);
  const ModelWeights hf(golden_model("llama-gqa"), load_config(golden_model("llama-gqa")));
  const ModelWeights gg(gguf, load_config(gguf));
  ASSERT_TRUE(gg.is_gguf());
  for (const char* name : {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                           "model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.down_proj.weight",
                           "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}) {
    SCOPED_TRACE(name);
    const WeightView a = hf.find(name), b = gg.find(name);
    ASSERT_NE(a.data, nullptr);
    ASSERT_NE(b.data, nullptr);
    ASSERT_EQ(a.shape, b.shape);
    std::vector<float> ra(size_t(a.rows() * a.cols())), rb(ra.size());
    a.rows_f32(0, a.rows(), ra.data());
    b.rows_f32(0, b.rows(), rb.data());
    EXPECT_EQ(ra, rb);
  }
  // q_proj is stored permuted: the GGUF's own bytes differ from HF's order.
  const GgufFile file(gguf);
  const GgufTensorInfo* q = file.find("blk.0.attn_q.weight");
  ASSERT_NE(q, nullptr);
  std::vector<float> stored(size_t(q->numel()));
  std::memcpy(stored.data(), file.data(*q), stored.size() * 4);
  std::vector<float> hf_rows(stored.size());
  hf.find("model.layers.0.self_attn.q_proj.weight").rows_f32(0, q->shape()[0], hf_rows.data());
  EXPECT_NE(stored, hf_rows);
}

// A Q4_K model: inspect names the types, ref and impl agree, a clean impl
// dump bisects clean, and an injected bug is localised and named.
TEST(CliGguf, QuantisedModelBisectsAndNamesABug) {
  const std::string& model = quantised_model("Q4_K");
  const auto ins = run_cli({"inspect", model});
  ASSERT_EQ(ins.code, 0) << ins.error;
  EXPECT_NE(ins.out.find("gguf-model"), std::string::npos);
  EXPECT_NE(ins.out.find("blk.0.attn_q.weight"), std::string::npos);
  EXPECT_NE(ins.out.find("Q4_K"), std::string::npos);

  const std::string clean = impl_dump(model, temp_path("q4k-clean") + ".st");
  const auto ok = run_cli({"bisect", "--model", model, clean});
  EXPECT_EQ(ok.code, 0) << ok.out << ok.error;
  EXPECT_NE(ok.out.find("no divergence"), std::string::npos) << ok.out;

  const std::string bug = impl_dump(model, temp_path("q4k-bug") + ".st", {"--inject", "repeat-kv-tile"});
  const auto found = run_cli({"bisect", "--model", model, bug});
  EXPECT_EQ(found.code, 1) << found.error;
  EXPECT_NE(found.out.find("Diagnosis at step0.layers.0.attn.k_rep: repeat-kv-tile"), std::string::npos)
      << found.out;
}

// Other block types through the same path: the ref and the impl agree on
// the dequantised weights, and run (impl vs ref in one process) is clean.
TEST(CliGguf, EveryQuantTypeRunsClean) {
  for (const char* quant : {"Q8_0", "Q4_0", "Q5_1", "Q6_K", "Q3_K"}) {
    SCOPED_TRACE(quant);
    const std::string& model = quantised_model(quant);
    const auto r = run_cli({"run", "--model", model, "--tokens", kPrompt, "--decode", "2"});
    EXPECT_EQ(r.code, 0) << r.out << r.error;
  }
}

// llama.cpp's designed rounding (F16 KV cache, 8-bit activations against
// K-quant weights): declared in the manifest it passes; the same dump
// without the declaration fails at the first matmul; a bug under the
// profile is still named.
TEST(CliGguf, PrecisionProfileModelsDesignedRounding) {
  const std::string& model = quantised_model("Q4_K");
  const std::string profiled =
      impl_dump(model, temp_path("q4k-profile") + ".st", {"--precision", "kv_cache=f16,matmul_input=ggml"});
  EXPECT_EQ(DumpFile(profiled).manifest().extra.at("precision"), R"({"kv_cache":"f16","matmul_input":"ggml"})");
  const auto pass = run_cli({"bisect", "--model", model, profiled});
  EXPECT_EQ(pass.code, 0) << pass.out << pass.error;
  EXPECT_NE(pass.out.find("precision profile declared by the candidate: kv_cache=f16,matmul_input=ggml"),
            std::string::npos);

  const std::string undeclared = temp_path("q4k-undeclared") + ".st";
  copy_dump(profiled, undeclared, [](Manifest& m) { m.extra.erase("precision"); });
  const auto fail = run_cli({"bisect", "--model", model, undeclared});
  EXPECT_EQ(fail.code, 1) << fail.error;
  EXPECT_NE(fail.out.find("first local failure   step0.layers.0.attn.q "), std::string::npos) << fail.out;
  // The clean impl making ggml's roundings reproduces that site: precision, with the profile to declare.
  const std::string declare = R"(precision, not a bug: declare "precision": {"kv_cache":"f16","matmul_input":"ggml"})";
  EXPECT_NE(fail.out.find(declare), std::string::npos) << fail.out;

  const std::string bug = impl_dump(model, temp_path("q4k-profile-bug") + ".st",
                                    {"--precision", "kv_cache=f16,matmul_input=ggml", "--inject", "rope-interleaved"});
  const auto named = run_cli({"bisect", "--model", model, bug});
  EXPECT_EQ(named.code, 1) << named.error;
  EXPECT_NE(named.out.find("Diagnosis at step0.layers.0.attn.q_rope: rope-interleaved"), std::string::npos)
      << named.out;

  // The F16 cache alone, undeclared: no op fails on its own inputs, the
  // cache holds float16 values, and bisect says what to declare rather
  // than calling it a bug.
  const std::string kv16 = impl_dump(model, temp_path("q4k-kv16") + ".st", {"--precision", "kv_cache=f16"});
  const std::string kv16_undeclared = temp_path("q4k-kv16-undeclared") + ".st";
  copy_dump(kv16, kv16_undeclared, [](Manifest& m) { m.extra.erase("precision"); });
  const auto kv = run_cli({"bisect", "--model", model, kv16_undeclared});
  EXPECT_EQ(kv.code, 1) << kv.error;
  EXPECT_NE(kv.out.find("precision, not a bug: declare the KV cache as float16"), std::string::npos) << kv.out;
  EXPECT_EQ(run_cli({"bisect", "--model", model, kv16}).code, 0);

  // Declared, the run passes in one process too.
  const auto run = run_cli({"run", "--model", model, "--tokens", kPrompt, "--decode", "2", "--precision",
                            "kv_cache=f16,matmul_input=q8_k"});
  EXPECT_EQ(run.code, 0) << run.out << run.error;

  const auto bad = run_cli({"dump", "--engine", "impl", "--model", model, "--tokens", kPrompt, "--precision",
                            "kv_cache=f8", "--out", temp_path("never") + ".st"});
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.error.find("kv_cache: f32, f16, bf16"), std::string::npos) << bad.error;
  EXPECT_FALSE(fs::exists(temp_path("never") + ".st"));
  const auto on_ref = run_cli({"dump", "--engine", "ref", "--model", model, "--tokens", kPrompt, "--precision",
                               "kv_cache=f16", "--out", temp_path("never2") + ".st"});
  EXPECT_EQ(on_ref.code, 2);

  const std::string malformed = temp_path("q4k-malformed-profile") + ".st";
  copy_dump(profiled, malformed, [](Manifest& m) { m.extra["precision"] = R"({"kv_cache":"f8"})"; });
  const auto mal = run_cli({"bisect", "--model", model, malformed});
  EXPECT_EQ(mal.code, 2);
  EXPECT_NE(mal.error.find(malformed), std::string::npos) << mal.error;
}

// --source: the reference on the full-precision checkpoint says how much of
// the candidate's error the quantisation explains, layer by layer.
TEST(CliGguf, QuantisationErrorAgainstTheSource) {
  const std::string source = temp_path("tiny-llama-source");
  ASSERT_EQ(run_cli({"synth", "--preset", "tiny-llama", "--dtype", "f32", "--out", source}).code, 0);
  const std::string model = temp_path("tiny-llama-source-q4k") + ".gguf";
  ASSERT_EQ(run_cli({"convert", "--model", source, "--out", model, "--type", "Q4_K"}).code, 0);

  const std::string clean = impl_dump(model, temp_path("q4k-src-clean") + ".st");
  const auto r = run_cli({"bisect", "--model", model, "--source", source, clean});
  EXPECT_EQ(r.code, 0) << r.error;
  const size_t at = r.out.find("Quantisation error");
  ASSERT_NE(at, std::string::npos) << r.out;
  // The clean candidate's error is the quantisation's: every row explained
  // at about 100%.
  for (const char* row : {"layer 0", "layer 3", "next_logits"}) {
    const size_t p = r.out.find(std::string("  ") + row, at);
    ASSERT_NE(p, std::string::npos) << row;
    const std::string line = r.out.substr(p, r.out.find('\n', p) - p);
    const size_t pct = line.rfind(' ');
    const int explained = std::stoi(line.substr(pct + 1));
    EXPECT_GE(explained, 95) << line;
    EXPECT_LE(explained, 105) << line;
  }
  // The table is part of the result: in the JSON too, nothing on stderr.
  const auto j = run_cli({"bisect", "--model", model, "--source", source, clean, "--json"});
  EXPECT_EQ(j.code, 0) << j.error;
  const nlohmann::json doc = nlohmann::json::parse(j.out);
  ASSERT_TRUE(doc.contains("quantisation")) << j.out.substr(0, 2000);
  const nlohmann::json& rows = doc["quantisation"]["rows"];
  ASSERT_FALSE(rows.empty());
  EXPECT_EQ(rows.back()["group"], "next_logits");
  for (const auto& row : rows) EXPECT_NEAR(row["explained"].get<double>(), 1.0, 0.05) << row.dump();
  EXPECT_EQ(j.error.find("Quantisation error"), std::string::npos) << j.error;
  // A bug adds error the quantisation does not explain.
  const std::string bug = impl_dump(model, temp_path("q4k-src-bug") + ".st", {"--inject", "rope-interleaved"});
  const auto b = run_cli({"bisect", "--model", model, "--source", source, "--no-diagnose", bug});
  EXPECT_EQ(b.code, 1);
  const size_t p = b.out.find("  layer 0", b.out.find("Quantisation error"));
  ASSERT_NE(p, std::string::npos) << b.out;
  const std::string line = b.out.substr(p, b.out.find('\n', p) - p);
  EXPECT_LT(std::stoi(line.substr(line.rfind(' ') + 1)), 50) << line;

  // A source of other shapes is refused.
  const auto other = run_cli({"bisect", "--model", model, "--source", golden_model("llama-gqa"), clean});
  EXPECT_EQ(other.code, 2);
  EXPECT_NE(other.error.find("is not the same model"), std::string::npos) << other.error;
}

// Bad GGUF models get errors that name the file and what is wrong.
TEST(CliGguf, BadModelsAreNamed) {
  const std::string gguf = temp_path("llama-gqa-bad") + ".gguf";
  ASSERT_EQ(run_cli({"convert", "--model", golden_model("llama-gqa"), "--out", gguf, "--type", "F32"}).code, 0);
  std::string bytes = llmdiff::testing::read_text(gguf);
  auto write = [](const std::string& path, const std::string& data) {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fwrite(data.data(), 1, data.size(), f);
    std::fclose(f);
  };
  // One block more than the file holds: the missing tensor is named.
  {
    const std::string key = "llama.block_count";
    const size_t at = bytes.find(key);
    ASSERT_NE(at, std::string::npos);
    std::string patched = bytes;
    uint32_t type = 0, value = 0;
    std::memcpy(&type, &patched[at + key.size()], 4);
    std::memcpy(&value, &patched[at + key.size() + 4], 4);
    ASSERT_EQ(type, 4u);  // GGUF_TYPE_UINT32
    ASSERT_EQ(value, 2u);
    value = 3;
    std::memcpy(&patched[at + key.size() + 4], &value, 4);
    const std::string path = temp_path("three-blocks") + ".gguf";
    write(path, patched);
    const auto r = run_cli({"dump", "--engine", "ref", "--model", path, "--tokens", "1,2,3", "--out",
                            temp_path("x") + ".st"});
    EXPECT_EQ(r.code, 2);
    EXPECT_NE(r.error.find("blk.2."), std::string::npos) << r.error;
    EXPECT_NE(r.error.find(path), std::string::npos) << r.error;
  }
  // An architecture llmdiff does not model: the supported ones are listed.
  {
    const std::string key = "general.architecture";
    const size_t at = bytes.find(key);
    ASSERT_NE(at, std::string::npos);
    std::string patched = bytes;
    // value: u32 type 8 (string), u64 length 5, "llama" -> "gemma"
    const size_t text = at + key.size() + 4 + 8;
    ASSERT_EQ(patched.substr(text, 5), "llama");
    patched.replace(text, 5, "gemma");
    const std::string path = temp_path("gemma") + ".gguf";
    write(path, patched);
    const auto r = run_cli({"inspect", path});
    EXPECT_EQ(r.code, 2);
    EXPECT_NE(r.error.find("gemma"), std::string::npos) << r.error;
    EXPECT_NE(r.error.find("qwen2, qwen3, qwen2moe, qwen3moe, deepseek2"), std::string::npos) << r.error;
  }
  // Truncated: the file is named, never a crash.
  {
    const std::string path = temp_path("truncated") + ".gguf";
    write(path, bytes.substr(0, bytes.size() / 2));
    const auto r = run_cli({"inspect", path});
    EXPECT_EQ(r.code, 2);
    EXPECT_NE(r.error.find(path), std::string::npos) << r.error;
  }
}

// ggml's attention with a float16 cache: q and the probabilities multiplied
// by the cache in its type, and with flash attention the value sum kept in
// float16 too. Declared (kv_cache=f16, matmul_input=ggml, attention=flash),
// the impl's run of it passes; undeclared, bisect says it is precision and
// which keys to declare (attention=flash when the dump has no attention
// probabilities, as a fused attention never materialises them).
TEST(CliGguf, FlashAttentionWithAFloat16CacheIsPrecisionNotABug) {
  const std::string model = golden_model("llama-gqa");
  const std::string flash = temp_path("flash16") + ".st";
  ASSERT_EQ(run_cli({"dump", "--engine", "impl", "--model", model, "--tokens", "1,5,9,200,31,7,300,12", "--decode",
                     "3", "--precision", "kv_cache=f16,matmul_input=ggml,attention=flash", "--out", flash})
                .code,
            0);
  EXPECT_EQ(DumpFile(flash).manifest().extra.at("precision"),
            R"({"attention":"flash","kv_cache":"f16","matmul_input":"ggml"})");
  const auto pass = run_cli({"bisect", "--model", model, flash});
  EXPECT_EQ(pass.code, 0) << pass.out << pass.error;
  // Undeclared, without the probabilities and scores a fused attention lacks.
  const DumpFile d(flash);
  MemoryDump fused("fused");
  fused.mutable_manifest() = d.manifest();
  fused.mutable_manifest().extra.erase("precision");
  for (const std::string& n : d.names())
    if (n.find("attn.probs") == std::string::npos && n.find("attn.scores") == std::string::npos &&
        n.find("attn.ctx") == std::string::npos)
      fused.put(d.get(n));
  const std::string undeclared = temp_path("flash16-undeclared") + ".st";
  fused.save(undeclared);
  const auto r = run_cli({"bisect", "--model", model, undeclared, "--json"});
  ASSERT_EQ(r.code, 1) << r.error;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["diagnosis"]["basis"], "precision") << j["diagnosis"].dump(1);
  const std::string ev = j["diagnosis"]["evidence"];
  EXPECT_NE(ev.find("\"attention\": \"flash\""), std::string::npos) << ev;
  EXPECT_NE(ev.find("\"kv_cache\": \"f16\""), std::string::npos) << ev;
}
