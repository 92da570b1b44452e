// GGUF mixture-of-experts and multi-head-latent-attention models end to end:
// llama.cpp's merged expert tensors, routers, exp_probs_b and split or joint
// kv_b written and read back as the same function (bit for bit at f32),
// llama-quantize's type mixtures, quantised models bisected with their
// precision profile (routing flips at near-ties reported, not bugs) and every
// MoE/MLA zoo bug named on them, the quantisation error per layer and per
// expert against the source, and malformed expert tensors named.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dumps/base/errors.h"
#include "dumps/contract/dump.h"
#include "dumps/formats/gguf.h"
#include "dumps/model/config.h"
#include "dumps/model/weights.h"
#include "dumps/zoo/bugs.h"
#include "synth/synth.h"
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

const char* kPrompt = "1,5,9,200,31,7,30,12";
const char* kProfile = "kv_cache=f16,matmul_input=ggml";

// `model` converted to GGUF (`type`, `kv_b`), once per process.
const std::string& converted(const std::string& model, const std::string& type, const std::string& kv_b = "split") {
  static std::map<std::string, std::string> made;
  const std::string key = model + "|" + type + "|" + kv_b;
  auto it = made.find(key);
  if (it != made.end()) return it->second;
  const std::string out = temp_path(fs::path(model).filename().string() + "-" + type + "-" + kv_b) + ".gguf";
  const auto r = run_cli({"convert", "--model", model, "--out", out, "--type", type, "--kv-b", kv_b});
  EXPECT_EQ(r.code, 0) << r.error;
  return made[key] = out;
}

// A synthetic checkpoint of a preset (float32 HF directory), once per process.
const std::string& preset_model(const std::string& preset) {
  static std::map<std::string, std::string> made;
  auto it = made.find(preset);
  if (it != made.end()) return it->second;
  const std::string dir = temp_path(preset);
  const auto r = run_cli({"synth", "--preset", preset, "--dtype", "f32", "--out", dir});
  EXPECT_EQ(r.code, 0) << r.error;
  return made[preset] = dir;
}

std::string impl_dump(const std::string& model, const std::string& out, const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"dump", "--engine", "impl", "--model", model, "--tokens", kPrompt, "--decode", "3",
                                   "--out", out};
  args.insert(args.end(), extra.begin(), extra.end());
  const auto r = run_cli(args);
  EXPECT_EQ(r.code, 0) << r.error;
  return out;
}

// Every MoE / MLA bug of the zoo that applies to the model.
std::vector<std::string> moe_mla_bugs(const ModelConfig& c) {
  std::vector<std::string> out;
  for (const zoo::BugInfo& b : zoo::all_bugs()) {
    const std::string name = b.name;
    if (name.rfind("moe-", 0) != 0 && name.rfind("mla-", 0) != 0) continue;
    if (!zoo::bug_inapplicable_reason(b.bug, c).empty()) continue;
    out.push_back(name);
  }
  return out;
}

// The quantised model's profiled clean run passes; each bug, injected under
// the same profile, is localised and named.
void expect_profile_passes_and_bugs_named(const std::string& model, const std::string& stem) {
  const std::string clean = impl_dump(model, temp_path(stem + "-clean") + ".st", {"--precision", kProfile});
  const auto ok = run_cli({"bisect", "--model", model, clean});
  EXPECT_EQ(ok.code, 0) << ok.out << ok.error;
  const std::vector<std::string> bugs = moe_mla_bugs(load_config(model));
  EXPECT_FALSE(bugs.empty());
  for (const std::string& bug : bugs) {
    SCOPED_TRACE(bug);
    const std::string d = impl_dump(model, temp_path(stem + "-" + bug) + ".st", {"--precision", kProfile, "--inject", bug});
    const auto r = run_cli({"bisect", "--model", model, d});
    EXPECT_EQ(r.code, 1) << r.error;
    const size_t at = r.out.find("\nDiagnosis at ");
    ASSERT_NE(at, std::string::npos) << r.out;
    const std::string line = r.out.substr(at + 1, r.out.find('\n', at + 1) - at - 1);
    EXPECT_NE(line.find(": " + bug + " (evidence"), std::string::npos) << line;
  }
}

}  // namespace

// The MoE and MLA goldens too: experts merged into llama.cpp's [E, rows,
// cols] tensors and read back in place, the routers F32, DeepSeek's
// correction bias as exp_probs_b, MLA's kv_b split for the absorbed form
// (attn_k_b transposed, attn_v_b) or joint, and the metadata (experts, top-k,
// gating, renormalisation, routed scaling, groups, shared experts, leading
// dense layers, q/kv lora ranks) read back as the same config: the ref's and
// the impl's dumps equal the HF checkpoint's bit for bit.
TEST(CliGgufMoe, ConvertedGoldensComputeTheSameFunction) {
  const std::vector<std::pair<std::string, std::string>> models = {
      {"qwen3-moe", "split"}, {"mixtral-gqa", "split"}, {"deepseek-v3-mla", "split"}, {"deepseek-v3-mla", "joint"}};
  for (const auto& [name, kv_b] : models) {
    SCOPED_TRACE(name + " " + kv_b);
    const std::string gguf = temp_path(name + "-" + kv_b) + ".gguf";
    const auto conv = run_cli({"convert", "--model", golden_model(name), "--out", gguf, "--type", "F32", "--kv-b", kv_b});
    ASSERT_EQ(conv.code, 0) << conv.error;
    const ModelConfig hf = load_config(golden_model(name)), gg = load_config(gguf);
    EXPECT_EQ(gg.model_type, hf.model_type);
    EXPECT_EQ(gg.moe.num_experts, hf.moe.num_experts);
    EXPECT_EQ(gg.moe.top_k, hf.moe.top_k);
    EXPECT_EQ(gg.moe.intermediate_size, hf.moe.intermediate_size);
    EXPECT_EQ(gg.moe.scoring, hf.moe.scoring);
    EXPECT_EQ(gg.moe.norm_topk_prob, hf.moe.norm_topk_prob);
    EXPECT_EQ(gg.moe.routed_scaling_factor, hf.moe.routed_scaling_factor);
    EXPECT_EQ(gg.moe.n_group, hf.moe.n_group);
    EXPECT_EQ(gg.moe.topk_group, hf.moe.topk_group);
    EXPECT_EQ(gg.moe.correction_bias, hf.moe.correction_bias);
    EXPECT_EQ(gg.moe.shared_intermediate_size, hf.moe.shared_intermediate_size);
    EXPECT_EQ(gg.moe.first_k_dense, hf.moe.first_k_dense);
    EXPECT_EQ(gg.mla.enabled, hf.mla.enabled);
    EXPECT_EQ(gg.mla.q_lora_rank, hf.mla.q_lora_rank);
    EXPECT_EQ(gg.mla.kv_lora_rank, hf.mla.kv_lora_rank);
    EXPECT_EQ(gg.mla.qk_nope_head_dim, hf.mla.qk_nope_head_dim);
    EXPECT_EQ(gg.mla.v_head_dim, hf.mla.v_head_dim);
    EXPECT_EQ(gg.attn_scaling(), hf.attn_scaling());
    const GgufFile file(gguf);
    if (hf.moe.enabled()) {
      const int first = int(hf.moe.first_k_dense);
      const GgufTensorInfo* up = file.find("blk." + std::to_string(first) + ".ffn_up_exps.weight");
      ASSERT_NE(up, nullptr);
      EXPECT_EQ(up->ne, (std::vector<int64_t>{hf.hidden_size, hf.moe.intermediate_size, hf.moe.num_experts}));
      EXPECT_EQ(file.find("blk." + std::to_string(first) + ".ffn_gate_inp.weight")->type, GgmlType::F32);
    }
    if (hf.mla.enabled) {
      EXPECT_EQ(file.find("blk.0.attn_kv_b.weight") != nullptr, kv_b == "joint");
      EXPECT_EQ(file.find("blk.0.attn_k_b.weight") != nullptr, kv_b == "split");
      EXPECT_NE(file.find("blk.1.exp_probs_b.bias"), nullptr);
    }

    const std::string from_hf = temp_path(name + "-hf") + ".st", from_gguf = temp_path(name + "-gguf-" + kv_b) + ".st";
    llmdiff::testing::write_engine_dump("ref", golden_model(name), golden_dump(name, "decode"), from_hf);
    llmdiff::testing::write_engine_dump("ref", gguf, golden_dump(name, "decode"), from_gguf);
    EXPECT_EQ(llmdiff::testing::first_difference(DumpFile(from_hf), DumpFile(from_gguf)), "");
    const std::string impl_hf = temp_path(name + "-impl-hf") + ".st",
                      impl_gguf = temp_path(name + "-impl-gguf-" + kv_b) + ".st";
    llmdiff::testing::write_engine_dump("impl", golden_model(name), golden_dump(name, "decode"), impl_hf);
    llmdiff::testing::write_engine_dump("impl", gguf, golden_dump(name, "decode"), impl_gguf);
    EXPECT_EQ(llmdiff::testing::first_difference(DumpFile(impl_hf), DumpFile(impl_gguf)), "");
  }
}


// llama-quantize's Q4_K_M on the MoE/MLA goldens (widths of 64: its K-quants
// fall back to Q5_0 / Q5_1 / Q8_0 per tensor, attn_k_b to F16): the profiled
// clean run passes, every MoE / MLA bug of the zoo that applies is named.
TEST(CliGgufMoe, QuantisedGoldensPassWithTheProfileAndEveryBugIsNamed) {
  for (const char* name : {"qwen3-moe", "mixtral-gqa", "deepseek-v3-mla"}) {
    SCOPED_TRACE(name);
    const std::string& model = converted(golden_model(name), "Q4_K_M");
    const GgufFile f(model);
    std::map<std::string, int> types;
    for (const GgufTensorInfo& t : f.tensors()) ++types[ggml_type_name(uint32_t(t.type))];
    EXPECT_GT(types["Q5_0"], 0);
    EXPECT_GT(types["Q8_0"], 0);  // the output and use_more_bits' ffn_down: Q6_K, falling back
    EXPECT_GT(types["F32"], 0);   // norms and routers
    expect_profile_passes_and_bugs_named(model, std::string(name) + "-q4km");
  }
}

// The two MoE checkpoints' counts and routing at narrow widths: DeepSeek-V2-Lite
// (MLA without q_lora, softmax greedy routing over 64 experts, 2 shared, yarn
// x40 with mscale 0.707) and Qwen3-30B-A3B (128 experts, top 8). Written by
// the converter they compute the HF checkpoint's function bit for bit at f32;
// as Q4_K_M (real K-quants: the experts' gate/up Q4_K, Q6_K where llama-quantize
// bumps) the profiled clean run passes with its routing flips at near-ties
// reported, and every applicable bug is named.
TEST(CliGgufMoe, NarrowDeepseekV2LiteAndQwen3MoeRoundTripAndQuantise) {
  for (const char* preset : {"tiny-deepseek-v2-lite", "tiny-qwen3-30b-a3b"}) {
    SCOPED_TRACE(preset);
    const std::string& hf = preset_model(preset);
    const std::string& f32 = converted(hf, "F32");
    const ModelConfig hc = load_config(hf), gc = load_config(f32);
    EXPECT_EQ(gc.moe.scoring, hc.moe.scoring);
    EXPECT_EQ(gc.moe.num_experts, hc.moe.num_experts);
    EXPECT_EQ(gc.moe.top_k, hc.moe.top_k);
    EXPECT_EQ(gc.mla.q_lora_rank, hc.mla.q_lora_rank);
    EXPECT_EQ(gc.attn_scaling(), hc.attn_scaling());  // yarn's mscale back from yarn_log_multiplier
    EXPECT_EQ(gc.rope_scaling.mscale_all_dim, hc.rope_scaling.mscale_all_dim);
    const std::string a = temp_path(std::string(preset) + "-hf") + ".st", b = temp_path(std::string(preset) + "-gg") + ".st";
    const std::vector<std::string> args = {"--tokens", kPrompt, "--decode", "2"};
    for (const char* engine : {"ref", "impl"}) {
      SCOPED_TRACE(engine);
      for (const auto& [model, out] : {std::pair<std::string, std::string>{hf, a}, {f32, b}}) {
        std::vector<std::string> cmd = {"dump", "--engine", engine, "--model", model, "--out", out};
        cmd.insert(cmd.end(), args.begin(), args.end());
        ASSERT_EQ(run_cli(cmd).code, 0);
      }
      EXPECT_EQ(llmdiff::testing::first_difference(DumpFile(a), DumpFile(b)), "");
    }

    const std::string& q = converted(hf, "Q4_K_M");
    const GgufFile f(q);
    EXPECT_EQ(f.get_int("general.file_type", 0), 15);  // LLAMA_FTYPE_MOSTLY_Q4_K_M
    const int moe = int(hc.moe.first_k_dense);
    const std::string blk = "blk." + std::to_string(moe) + ".";
    EXPECT_EQ(f.find(blk + "ffn_gate_exps.weight")->type, GgmlType::Q4_K);
    EXPECT_EQ(f.find(blk + "ffn_up_exps.weight")->type, GgmlType::Q4_K);
    EXPECT_EQ(f.find(blk + "ffn_gate_inp.weight")->type, GgmlType::F32);
    EXPECT_EQ(f.find("output.weight")->type, GgmlType::Q6_K);
    // A longer prompt: the 8-bit activations of the profile tip near-ties.
    std::string tokens;
    for (int i = 0; i < 40; ++i) tokens += (i ? "," : "") + std::to_string((i * 7919) % 4000 + 3);
    const std::string clean = temp_path(std::string(preset) + "-q4km-long") + ".st";
    ASSERT_EQ(run_cli({"dump", "--engine", "impl", "--model", q, "--tokens", tokens, "--decode", "3", "--precision",
                       kProfile, "--out", clean})
                  .code,
              0);
    const auto r = run_cli({"bisect", "--model", q, clean});
    EXPECT_EQ(r.code, 0) << r.out << r.error;
    EXPECT_NE(r.out.find("moe.topk_ids: routing flip at a near-tie, undecidable"), std::string::npos) << r.out;
    expect_profile_passes_and_bugs_named(q, std::string(preset) + "-q4km");

    // Pure Q6_K (llama-quantize --pure): the experts' gate and up in Q6_K,
    // the 64-wide down falling back to Q8_0; the impl and the ref agree.
    const std::string& q6 = converted(hf, "Q6_K");
    const GgufFile f6(q6);
    EXPECT_EQ(f6.find(blk + "ffn_up_exps.weight")->type, GgmlType::Q6_K);
    EXPECT_EQ(f6.find(blk + "ffn_down_exps.weight")->type, GgmlType::Q8_0);
    const auto run = run_cli({"run", "--model", q6, "--tokens", kPrompt, "--decode", "2"});
    EXPECT_EQ(run.code, 0) << run.out << run.error;
  }
}

// --source on a quantised MoE model: per layer, the routing the quantisation
// changed (near-ties it tipped) and a row per routed expert with its types
// and its weights' and outputs' error; the clean candidate explained at 100%.
TEST(CliGgufMoe, QuantisationErrorPerLayerAndPerExpert) {
  const std::string& hf = preset_model("tiny-deepseek-v2-lite");
  const std::string& q = converted(hf, "Q4_K_M");
  const std::string clean = impl_dump(q, temp_path("dsv2l-src-clean") + ".st", {});
  const auto r = run_cli({"bisect", "--model", q, "--source", hf, clean});
  EXPECT_EQ(r.code, 0) << r.error;
  const size_t at = r.out.find("Quantisation error");
  ASSERT_NE(at, std::string::npos) << r.out;
  for (const char* layer : {"  layer 1 ", "  layer 2 "}) {
    const size_t p = r.out.find(layer, at);
    ASSERT_NE(p, std::string::npos) << layer;
    const std::string line = r.out.substr(p, r.out.find('\n', p) - p);
    EXPECT_NE(line.find(" 100%"), std::string::npos) << line;
  }
  const size_t routing = r.out.find("Routing: tokens sent to other experts", at);
  ASSERT_NE(routing, std::string::npos) << r.out;
  const size_t experts = r.out.find("Per expert", routing);
  ASSERT_NE(experts, std::string::npos) << r.out;
  // An expert row: layer, expert, tokens, its three types, the weights' relative error.
  const std::string rows = r.out.substr(experts);
  EXPECT_NE(rows.find(" Q4_K Q4_K "), std::string::npos) << rows;
  const size_t first = rows.find("\n  1 ");
  ASSERT_NE(first, std::string::npos) << rows;
  std::istringstream row(rows.substr(first + 1));
  int layer = -1, expert = -1, tokens = 0;
  std::string tg, tu, td;
  double weights = -1, src_rms = 0, quant = 0;
  row >> layer >> expert >> tokens >> tg >> tu >> td >> weights >> src_rms >> quant;
  EXPECT_EQ(layer, 1);
  EXPECT_GE(expert, 0);
  EXPECT_LT(expert, 64);
  EXPECT_GT(tokens, 0);
  EXPECT_GT(weights, 0.005);  // Q4_K rounds a normal weight by a few percent
  EXPECT_LT(weights, 0.2);
  EXPECT_GT(quant, 0);
}

namespace {

// One tensor of a GGUF being rewritten: its stored form.
struct StoredTensor {
  std::string name;
  GgmlType type;
  std::vector<int64_t> ne;
  std::vector<uint8_t> bytes;
};

// `src` written again to `dst` with each tensor passed through `edit` (false:
// dropped) and the metadata through `meta`.
void rewrite_gguf(const std::string& src, const std::string& dst, const std::function<bool(StoredTensor&)>& edit,
                  const std::function<void(std::map<std::string, GgufValue>&)>& meta = nullptr) {
  const GgufFile in(src);
  std::map<std::string, GgufValue> kv = in.metadata();
  if (meta) meta(kv);
  GgufWriter out(dst);
  for (const auto& [key, value] : kv)
    if (key != "general.alignment") out.set_value(key, value);
  for (const GgufTensorInfo& t : in.tensors()) {
    StoredTensor s{t.name, t.type, t.ne, {}};
    const auto* p = static_cast<const uint8_t*>(in.data(t));
    s.bytes.assign(p, p + t.nbytes);
    if (edit(s)) out.add_tensor(s.name, s.type, s.ne, s.bytes.data(), s.bytes.size());
  }
  out.finish();
}

GgufValue u32(int64_t v) {
  GgufValue x;
  x.type = GgufValue::Type::U32;
  x.i = v;
  return x;
}

}  // namespace

// Expert tensors (and MLA's split kv_b) that do not fit the metadata: one
// line naming the file and the tensor (or key), exit 2, never a crash.
TEST(CliGgufMoe, MalformedExpertTensorsAreNamed) {
  const std::string& good = converted(golden_model("deepseek-v3-mla"), "F32");
  struct Case {
    std::string what, names;
    std::function<bool(StoredTensor&)> edit;
    std::function<void(std::map<std::string, GgufValue>&)> meta = nullptr;
  };
  auto keep = [](StoredTensor&) { return true; };
  const std::vector<Case> cases = {
      {"an expert fewer than expert_count", "blk.1.ffn_up_exps.weight",
       [](StoredTensor& t) {
         if (t.name == "blk.1.ffn_up_exps.weight") {
           t.ne[2] -= 1;
           t.bytes.resize(t.bytes.size() / 8 * 7);
         }
         return true;
       }},
      {"a 2-D expert tensor", "blk.1.ffn_down_exps.weight",
       [](StoredTensor& t) {
         if (t.name == "blk.1.ffn_down_exps.weight") t.ne = {t.ne[0], t.ne[1] * t.ne[2]};
         return true;
       }},
      {"expert rows other than expert_feed_forward_length", "blk.1.ffn_gate_exps.weight",
       [](StoredTensor& t) {
         if (t.name == "blk.1.ffn_gate_exps.weight") {
           t.ne[1] /= 2;
           t.bytes.resize(t.bytes.size() / 2);
         }
         return true;
       }},
      {"an expert tensor of a type llmdiff does not read", "blk.2.ffn_up_exps.weight",
       [](StoredTensor& t) {
         if (t.name == "blk.2.ffn_up_exps.weight") {
           t.type = GgmlType::I8;
           t.bytes.resize(t.bytes.size() / 4);
         }
         return true;
       }},
      {"expert_count above the tensors' experts", "blk.1.ffn_gate_inp.weight", keep,
       [](std::map<std::string, GgufValue>& kv) { kv["deepseek2.expert_count"] = u32(16); }},
      {"expert_used_count above expert_count", "num_experts_per_tok", keep,
       [](std::map<std::string, GgufValue>& kv) { kv["deepseek2.expert_used_count"] = u32(9); }},
      {"attn_v_b missing beside attn_k_b", "blk.0.attn_v_b.weight",
       [](StoredTensor& t) { return t.name != "blk.0.attn_v_b.weight"; }},
      {"attn_k_b of the wrong heads", "blk.2.attn_k_b.weight",
       [](StoredTensor& t) {
         if (t.name == "blk.2.attn_k_b.weight") {
           t.ne[2] /= 2;
           t.bytes.resize(t.bytes.size() / 2);
         }
         return true;
       }},
      {"group-limited sigmoid routing without exp_probs_b", "blk.1.exp_probs_b.bias",
       [](StoredTensor& t) { return t.name.find("exp_probs_b") == std::string::npos; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string bad = temp_path("malformed-moe") + ".gguf";
    rewrite_gguf(good, bad, c.edit, c.meta);
    const auto r = run_cli({"dump", "--engine", "ref", "--model", bad, "--tokens", "1,2,3", "--out",
                            temp_path("never") + ".st"});
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.error.find(bad), std::string::npos) << r.error;
    EXPECT_NE(r.error.find(c.names), std::string::npos) << r.error;
    EXPECT_LE(std::count(r.error.begin(), r.error.end(), '\n'), 1) << r.error;
  }
  // The unedited rewrite loads: the cases fail for their edit alone.
  const std::string same = temp_path("rewritten-moe") + ".gguf";
  rewrite_gguf(good, same, keep);
  EXPECT_EQ(run_cli({"run", "--model", same, "--tokens", "1,2,3"}).code, 0);
}

// The seeds of the model fuzz target (fuzz/corpus/gguf_model: one small file
// per MoE / MLA architecture and layout) are models: each loads, its experts
// or latent attention as the file says, and runs clean.
TEST(CliGgufMoe, FuzzSeedsAreModels) {
  const std::string dir = llmdiff::testing::source_dir() + "/fuzz/corpus/gguf_model";
  std::map<std::string, int> archs;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string path = entry.path().string();
    SCOPED_TRACE(path);
    const GgufFile f(path);
    ++archs[f.get_string("general.architecture", "")];
    const ModelConfig c = load_config(path);
    EXPECT_TRUE(c.moe.enabled());
    const ModelWeights w(path, c);
    size_t experts = 0;
    for (const LayerWeights& L : w.layers) experts += L.experts.size();
    EXPECT_GT(experts, 0u);
    EXPECT_EQ(run_cli({"run", "--model", path, "--tokens", "1,2,3"}).code, 0);
  }
  EXPECT_EQ(archs.size(), 4u);  // llama (Mixtral), qwen2moe, qwen3moe, deepseek2
  EXPECT_GE(archs["deepseek2"], 3);
}

// Qwen2-MoE (no golden of its own): tiny-qwen3-moe's shapes as qwen2_moe,
// q/k/v biases and a shared expert behind its sigmoid gate (llama.cpp's
// ffn_*_shexp and ffn_gate_inp_shexp). Round trip bit for bit at f32; as
// Q4_K_M the profiled clean run passes and the missing shared expert is named.
TEST(CliGgufMoe, Qwen2MoeWithItsGatedSharedExpert) {
  nlohmann::json cfg = nlohmann::json::parse(synth::synth_preset_config("tiny-qwen3-moe"));
  cfg["model_type"] = "qwen2_moe";
  cfg["architectures"] = {"Qwen2MoeForCausalLM"};
  cfg["shared_expert_intermediate_size"] = 256;
  cfg["norm_topk_prob"] = false;
  cfg.erase("head_dim");
  const std::string config = temp_path("qwen2moe-config") + ".json";
  std::ofstream(config) << cfg.dump();
  const std::string hf = temp_path("qwen2moe");
  ASSERT_EQ(run_cli({"synth", "--config", config, "--dtype", "f32", "--out", hf}).code, 0);
  const std::string& f32 = converted(hf, "F32");
  const GgufFile f(f32);
  EXPECT_EQ(f.get_string("general.architecture", ""), "qwen2moe");
  EXPECT_EQ(f.find("blk.0.ffn_gate_inp_shexp.weight")->ne, (std::vector<int64_t>{256, 1}));
  EXPECT_NE(f.find("blk.0.attn_q.bias"), nullptr);
  for (const char* engine : {"ref", "impl"}) {
    SCOPED_TRACE(engine);
    const std::string a = temp_path("q2m-hf") + ".st", b = temp_path("q2m-gg") + ".st";
    ASSERT_EQ(run_cli({"dump", "--engine", engine, "--model", hf, "--tokens", kPrompt, "--decode", "2", "--out", a}).code, 0);
    ASSERT_EQ(run_cli({"dump", "--engine", engine, "--model", f32, "--tokens", kPrompt, "--decode", "2", "--out", b}).code, 0);
    EXPECT_EQ(llmdiff::testing::first_difference(DumpFile(a), DumpFile(b)), "");
  }
  expect_profile_passes_and_bugs_named(converted(hf, "Q4_K_M"), "qwen2moe-q4km");
}
