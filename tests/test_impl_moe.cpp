// The impl's mixture-of-experts block and multi-head latent attention:
// against HuggingFace on the MoE/MLA goldens (qwen3-moe, mixtral-gqa,
// deepseek-v3-mla), MLA's naive and absorbed forms against each other (on
// the golden and on a larger random DeepSeek-V3 checkpoint), the router's
// choice rules, and a random Qwen2-MoE (shared expert behind its sigmoid
// gate, a dense layer among MoE ones) recomputed in float64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <numeric>
#include <random>
#include <set>
#include <sys/stat.h>

#include "dumps/zoo/bugs.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/formats/safetensors.h"
#include "dumps/model/weights.h"
#include "impl/impl_engine.h"
#include "impl/kernels.h"
#include "tests/support.h"

namespace llmdiff {
namespace {

using impl::MlaForm;
using testing::golden_dump;
using testing::golden_model;

const char* const kScenarios[] = {"prefill", "decode", "chunked"};
const char* const kMoeGoldens[] = {"qwen3-moe", "mixtral-gqa", "deepseek-v3-mla"};

MemoryDump run_impl(const Model& model, const Scenario& sc, MlaForm form, int threads = 2,
                    std::vector<std::string> filter = {}, std::vector<zoo::BugSpec> bugs = {}) {
  impl::ImplOptions opt;
  opt.threads = threads;
  opt.mla = form;
  opt.bugs = std::move(bugs);
  auto engine = impl::make_impl_engine(model, opt);
  MemoryDump out(impl::mla_form_name(form));
  if (!filter.empty()) out.set_filter(std::move(filter));
  run_scenario(*engine, sc, out);
  return out;
}

// The names only MLA's naive form can observe (the absorbed form never
// expands the latent into per-head keys and values).
bool naive_only(const std::string& name) {
  const CanonName cn = parse_name(name);
  return cn.kind == CanonName::Kind::Layer &&
         (cn.site == "attn.kv" || cn.site == "attn.k_rope" || cn.site == "attn.k_cache" || cn.site == "attn.v_cache");
}

// ------------------------------------------------------------ vs HF goldens

TEST(ImplMoe, GoldenModelsMatchHuggingFace) {
  for (const char* name : kMoeGoldens) {
    const Model model = Model::load(golden_model(name));
    ASSERT_TRUE(model.config.moe.enabled()) << name;
    const bool mla = model.config.mla.enabled;
    for (MlaForm form : {MlaForm::Naive, MlaForm::Absorbed}) {
      if (form == MlaForm::Absorbed && !mla) continue;
      double worst_nmse = 0, worst_rel = 0;
      std::string worst_at;
      for (const char* scenario : kScenarios) {
        SCOPED_TRACE(std::string(name) + "/" + scenario + "/" + impl::mla_form_name(form));
        DumpFile hf(golden_dump(name, scenario));
        const MemoryDump ours = run_impl(model, replay_scenario(hf), form);
        int ints = 0;
        for (const std::string& n : hf.names()) {
          if (form == MlaForm::Absorbed && naive_only(n)) {
            EXPECT_FALSE(ours.has(n)) << "the absorbed form cannot observe " << n;
            continue;
          }
          ASSERT_TRUE(ours.has(n)) << "impl does not produce " << n;
          const TensorData a = ours.get(n), b = hf.get(n);
          ASSERT_EQ(a.shape, b.shape) << n;
          if (b.is_int) {  // tokens, positions, topk_ids, generated: exactly
            ASSERT_TRUE(a.is_int) << n;
            EXPECT_EQ(a.i, b.i) << n;
            ++ints;
            continue;
          }
          const double nmse = testing::nmse(a, b);
          const double rel = testing::max_abs_diff(a, b) / std::max(1.0, testing::max_abs(b));
          EXPECT_LE(nmse, 1e-10) << n;
          EXPECT_LE(rel, 1e-5) << n;
          worst_nmse = std::max(worst_nmse, nmse);
          if (rel > worst_rel) worst_rel = rel, worst_at = std::string(scenario) + ":" + n;
        }
        EXPECT_GT(ints, 0);
        for (const std::string& n : ours.names()) EXPECT_TRUE(hf.has(n)) << "extra name " << n;
        if (std::string(scenario) == "decode") {
          ASSERT_TRUE(ours.has("generated"));
          EXPECT_EQ(ours.get("generated").i, hf.get("generated").i);
        }
      }
      std::cout << "[impl vs HF] " << name << " (" << impl::mla_form_name(form) << "): worst NMSE " << worst_nmse
                << ", worst max|diff|/max(1,max|HF|) " << worst_rel << " (" << worst_at << ")\n";
    }
  }
}

TEST(ImplMoe, DenseAndMoeLayersReportTheirOwnNames) {
  // deepseek-v3-mla: layer 0 dense (mlp.*), layers 1, 2 MoE (moe.*, shared expert).
  const Model model = Model::load(golden_model("deepseek-v3-mla"));
  const MemoryDump d = run_impl(model, make_scenario({1, 2, 3}, {}, 0), MlaForm::Naive);
  EXPECT_TRUE(d.has("step0.layers.0.mlp.down"));
  EXPECT_FALSE(d.has("step0.layers.0.moe.out"));
  EXPECT_TRUE(d.has("step0.layers.1.moe.shared"));
  EXPECT_FALSE(d.has("step0.layers.1.mlp.down"));
  EXPECT_EQ(d.shape("step0.layers.2.moe.expert_out"), (Shape{3, 2, 64}));
  const std::vector<int64_t> ids = d.get("step0.layers.2.moe.topk_ids").i;
  for (size_t t = 0; t < 3; ++t) EXPECT_LT(ids[2 * t], ids[2 * t + 1]) << "topk_ids ascending";
  // qwen3-moe: no shared expert, so no moe.shared.
  const Model q = Model::load(golden_model("qwen3-moe"));
  const MemoryDump dq = run_impl(q, make_scenario({1, 2, 3}, {}, 0), MlaForm::Naive);
  EXPECT_TRUE(dq.has("step0.layers.0.moe.routed"));
  EXPECT_FALSE(dq.has("step0.layers.0.moe.shared"));
}


TEST(ImplMoe, ResultsDoNotDependOnThreadCount) {
  for (const char* name : {"mixtral-gqa", "deepseek-v3-mla"}) {
    const Model model = Model::load(golden_model(name));
    for (MlaForm form : {MlaForm::Naive, MlaForm::Absorbed}) {
      SCOPED_TRACE(std::string(name) + "/" + impl::mla_form_name(form));
      const Scenario sc = replay_scenario(DumpFile(golden_dump(name, "chunked")));
      const MemoryDump one = run_impl(model, sc, form, 1);
      EXPECT_EQ(testing::first_difference(one, run_impl(model, sc, form, 2)), "");
      EXPECT_EQ(testing::first_difference(one, run_impl(model, sc, form, 3)), "");
    }
  }
}

TEST(ImplMoe, ObservingFewerSitesChangesNothing) {
  const Model model = Model::load(golden_model("deepseek-v3-mla"));
  const Scenario sc = replay_scenario(DumpFile(golden_dump("deepseek-v3-mla", "decode")));
  for (MlaForm form : {MlaForm::Naive, MlaForm::Absorbed}) {
    const MemoryDump all = run_impl(model, sc, form);
    const MemoryDump few = run_impl(model, sc, form, 2, {"*next_logits", "*attn.ctx", "*moe.routed", "generated"});
    ASSERT_FALSE(few.names().empty());
    for (const std::string& n : few.names()) {
      const TensorData x = all.get(n), y = few.get(n);
      EXPECT_EQ(x.i, y.i) << n;
      EXPECT_EQ(x.f, y.f) << n;
    }
  }
}

// ------------------------------------------------------ naive vs absorbed

// Every name both forms report agrees within float32 noise: max |a - b| <=
// rel * max |naive| (integers exactly); the absorbed form lacks exactly the
// naive-only names. Returns the worst relative difference.
double expect_forms_agree(const MemoryDump& naive, const MemoryDump& absorbed, double rel) {
  double worst = 0;
  std::string worst_at;
  for (const std::string& n : naive.names()) {
    if (naive_only(n)) {
      EXPECT_FALSE(absorbed.has(n)) << n;
      continue;
    }
    EXPECT_TRUE(absorbed.has(n)) << "the absorbed form does not report " << n;
    if (!absorbed.has(n)) continue;
    const TensorData a = naive.get(n), b = absorbed.get(n);
    EXPECT_EQ(a.shape, b.shape) << n;
    if (a.is_int) {
      EXPECT_EQ(a.i, b.i) << n;
      continue;
    }
    const double scale = std::max(testing::max_abs(a), 1e-30);
    const double r = testing::max_abs_diff(a, b) / scale;
    EXPECT_LE(r, rel) << n;
    if (r > worst) worst = r, worst_at = n;
  }
  for (const std::string& n : absorbed.names()) EXPECT_TRUE(naive.has(n)) << "extra name " << n;
  std::cout << "[naive vs absorbed] worst max|diff|/max|naive| " << worst << " (" << worst_at << ")\n";
  return worst;
}

TEST(ImplMla, AbsorbedFormAgreesWithNaiveOnGolden) {
  const Model model = Model::load(golden_model("deepseek-v3-mla"));
  for (const char* scenario : kScenarios) {
    SCOPED_TRACE(scenario);
    const Scenario sc = replay_scenario(DumpFile(golden_dump("deepseek-v3-mla", scenario)));
    const MemoryDump naive = run_impl(model, sc, MlaForm::Naive), absorbed = run_impl(model, sc, MlaForm::Absorbed);
    expect_forms_agree(naive, absorbed, 1e-5);
  }
}

// ------------------------------------------- random DeepSeek-V3 checkpoints

// Random weights in HF's layout, Linear weights N(0,1) * 1.5/sqrt(in) and
// norms 1 + 0.2 N(0,1) as in the goldens.
class Checkpoint {
 public:
  Checkpoint(const std::string& dir, DType dtype, uint32_t seed)
      : w_(dir + "/model.safetensors"), dtype_(dtype), gen_(seed) {}
  void add(const std::string& name, const Shape& shape, float scale, float mean) {
    std::vector<float> v(size_t(numel(shape)));
    for (float& x : v) x = mean + scale * nd_(gen_);
    if (dtype_ == DType::F32) {
      w_.add_f32(name, shape, v.data());
      return;
    }
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = dtype_ == DType::BF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
    w_.add(name, dtype_, shape, h.data(), h.size() * 2);
  }
  void linear(const std::string& name, int64_t out, int64_t in) {
    add(name, {out, in}, float(1.5 / std::sqrt(double(in))), 0.0f);
  }
  void norm(const std::string& name, int64_t n) { add(name, {n}, 0.2f, 1.0f); }
  void mlp(const std::string& p, int64_t F, int64_t D) {
    linear(p + "gate_proj.weight", F, D);
    linear(p + "up_proj.weight", F, D);
    linear(p + "down_proj.weight", D, F);
  }
  void finish() { w_.finish(); }

 private:
  SafetensorsWriter w_;
  DType dtype_;
  std::mt19937 gen_;
  std::normal_distribution<float> nd_;
};

struct MlaShape {
  int64_t D = 128, F = 192, layers = 3, first_dense = 1, Hq = 8, V = 256;
  int64_t Rq = 48, Rkv = 64, Dn = 32, Dr = 16, Dv = 24;
  int64_t E = 16, K = 4, Fe = 32, n_group = 4, topk_group = 2, n_shared = 2;
  bool interleave = true, yarn = true;
  DType dtype = DType::BF16;
};

// A DeepSeek-V3 checkpoint of MlaShape's sizes (Rq = 0: q_proj straight from
// the hidden state; yarn: rope_scaling with mscale_all_dim, so the softmax
// scaling carries mscale²).
std::string write_deepseek(const std::string& stem, const MlaShape& s) {
  const std::string dir = testing::temp_path(stem);
  ::mkdir(dir.c_str(), 0700);
  const std::string dt = s.dtype == DType::BF16 ? "bfloat16" : s.dtype == DType::F16 ? "float16" : "float32";
  std::ofstream(dir + "/config.json")
      << "{\"model_type\": \"deepseek_v3\", \"hidden_size\": " << s.D << ", \"intermediate_size\": " << s.F
      << ", \"num_hidden_layers\": " << s.layers << ", \"first_k_dense_replace\": " << s.first_dense
      << ", \"num_attention_heads\": " << s.Hq << ", \"num_key_value_heads\": " << s.Hq
      << ", \"q_lora_rank\": " << (s.Rq > 0 ? std::to_string(s.Rq) : "null") << ", \"kv_lora_rank\": " << s.Rkv
      << ", \"qk_nope_head_dim\": " << s.Dn << ", \"qk_rope_head_dim\": " << s.Dr << ", \"v_head_dim\": " << s.Dv
      << ", \"head_dim\": " << s.Dr << ", \"rope_interleave\": " << (s.interleave ? "true" : "false")
      << ", \"n_routed_experts\": " << s.E << ", \"num_experts_per_tok\": " << s.K
      << ", \"moe_intermediate_size\": " << s.Fe << ", \"n_group\": " << s.n_group
      << ", \"topk_group\": " << s.topk_group << ", \"n_shared_experts\": " << s.n_shared
      << ", \"norm_topk_prob\": true, \"routed_scaling_factor\": 2.5, \"vocab_size\": " << s.V
      << ", \"max_position_embeddings\": 256, \"rms_norm_eps\": 1e-5, \"rope_theta\": 10000.0, "
      << (s.yarn ? "\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 64, "
                   "\"beta_fast\": 32, \"beta_slow\": 1, \"mscale\": 1.0, \"mscale_all_dim\": 1.0}, "
                 : "\"rope_scaling\": null, ")
      << "\"tie_word_embeddings\": false, \"torch_dtype\": \"" << dt << "\"}";
  Checkpoint c(dir, s.dtype, 7);
  c.add("model.embed_tokens.weight", {s.V, s.D}, 1.0f, 0.0f);
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    c.norm(p + "input_layernorm.weight", s.D);
    if (s.Rq > 0) {
      c.linear(p + "self_attn.q_a_proj.weight", s.Rq, s.D);
      c.norm(p + "self_attn.q_a_layernorm.weight", s.Rq);
      c.linear(p + "self_attn.q_b_proj.weight", s.Hq * (s.Dn + s.Dr), s.Rq);
    } else {
      c.linear(p + "self_attn.q_proj.weight", s.Hq * (s.Dn + s.Dr), s.D);
    }
    c.linear(p + "self_attn.kv_a_proj_with_mqa.weight", s.Rkv + s.Dr, s.D);
    c.norm(p + "self_attn.kv_a_layernorm.weight", s.Rkv);
    c.linear(p + "self_attn.kv_b_proj.weight", s.Hq * (s.Dn + s.Dv), s.Rkv);
    c.linear(p + "self_attn.o_proj.weight", s.D, s.Hq * s.Dv);
    c.norm(p + "post_attention_layernorm.weight", s.D);
    if (l < s.first_dense) {
      c.mlp(p + "mlp.", s.F, s.D);
    } else {
      c.linear(p + "mlp.gate.weight", s.E, s.D);
      c.add(p + "mlp.gate.e_score_correction_bias", {s.E}, 0.1f, 0.0f);
      for (int64_t e = 0; e < s.E; ++e) c.mlp(p + "mlp.experts." + std::to_string(e) + ".", s.Fe, s.D);
      c.mlp(p + "mlp.shared_experts.", s.Fe * s.n_shared, s.D);
    }
  }
  c.norm("model.norm.weight", s.D);
  c.linear("lm_head.weight", s.V, s.D);
  c.finish();
  return dir;
}

std::vector<int64_t> random_tokens(int64_t n, int64_t V, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int64_t> t(static_cast<size_t>(n));
  for (int64_t& x : t) x = int64_t(gen() % uint32_t(V));
  return t;
}

void check_forms_on(const std::string& dir, double rel) {
  const Model model = Model::load(dir);
  const ModelConfig& c = model.config;
  ASSERT_TRUE(c.mla.enabled);
  const std::vector<int64_t> prompt = random_tokens(24, c.vocab_size, 5);
  const std::vector<int64_t> first(prompt.begin(), prompt.begin() + 10);
  const std::pair<const char*, Scenario> scenarios[] = {
      {"prefill", make_scenario(prompt, {}, 0)},
      {"decode", make_scenario(first, {}, 6)},
      {"chunked", make_scenario(prompt, {9, 8, 7}, 0)},
  };
  for (const auto& [what, sc] : scenarios) {
    SCOPED_TRACE(what);
    const MemoryDump naive = run_impl(model, sc, MlaForm::Naive);
    const MemoryDump absorbed = run_impl(model, sc, MlaForm::Absorbed);
    expect_forms_agree(naive, absorbed, rel);
    if (naive.has("generated")) {
      ASSERT_EQ(naive.get("generated").i.size(), 7u);
      EXPECT_EQ(naive.get("generated").i, absorbed.get("generated").i) << "the forms generate other tokens";
    }
    // The absorbed cache: one latent row and one k_pe row per token.
    const int last = int(sc.steps.size()) + sc.decode - 1;
    const int64_t S = what == std::string("decode") ? 10 + 6 : 24;
    EXPECT_EQ(absorbed.shape(layer_name(last, 1, "attn.latent_cache")), (Shape{S, c.mla.kv_lora_rank}));
    EXPECT_EQ(absorbed.shape(layer_name(last, 1, "attn.k_pe_cache")), (Shape{S, c.mla.qk_rope_head_dim}));
    EXPECT_EQ(naive.shape(layer_name(last, 1, "attn.k_cache")),
              (Shape{c.num_attention_heads, S, c.mla.qk_head_dim()}));
  }
}

TEST(ImplMla, AbsorbedFormAgreesWithNaiveOnALargerRandomModel) {
  // bfloat16 weights, q_lora_rank, rope_interleave, yarn with mscale_all_dim,
  // 16 experts in 4 groups (2 kept), 4 per token, 2 shared; T up to 24.
  MlaShape s;
  const std::string dir = write_deepseek("impl-mla-random", s);
  const ModelConfig cfg = load_config(dir);
  EXPECT_NE(cfg.attn_scaling(), std::pow(double(s.Dn + s.Dr), -0.5)) << "yarn mscale in the softmax scaling";
  check_forms_on(dir, 1e-5);
}

TEST(ImplMla, AbsorbedFormAgreesWithNaiveWithoutQLoraOrInterleave) {
  // q_proj straight from the hidden state, rope dims rotated as they are,
  // float32 weights, no rope scaling, Dv != Dn.
  MlaShape s;
  s.Rq = 0, s.interleave = false, s.yarn = false, s.dtype = DType::F32, s.Dv = 40;
  check_forms_on(write_deepseek("impl-mla-random-noq", s), 1e-5);
}

TEST(ImplMla, MscaleMissingChangesTheScoresFirst) {
  // No golden has yarn's mscale_all_dim: the random checkpoint has. The bug
  // leaves out mscale² from the softmax scaling, so the scores are the
  // clean ones divided by it; every name before them is bit-identical.
  MlaShape s;
  s.layers = 2;
  const Model model = Model::load(write_deepseek("impl-mla-mscale", s));
  const double mscale2 = model.config.attn_scaling() / std::pow(double(s.Dn + s.Dr), -0.5);
  ASSERT_GT(mscale2, 1.01);
  const Scenario sc = make_scenario(random_tokens(6, s.V, 9), {}, 0);
  for (MlaForm form : {MlaForm::Naive, MlaForm::Absorbed}) {
    const MemoryDump clean = run_impl(model, sc, form);
    const MemoryDump buggy = run_impl(model, sc, form, 2, {}, {zoo::parse_bug("mla-mscale-missing")});
    for (const char* n : {"step0.layers.0.attn.q_rope", "step0.layers.0.attn.latent_cache"})
      EXPECT_EQ(clean.get(n).f, buggy.get(n).f) << n;
    const TensorData a = clean.get("step0.layers.0.attn.scores"), b = buggy.get("step0.layers.0.attn.scores");
    for (size_t i = 0; i < a.f.size(); ++i) {
      if (std::isinf(a.f[i])) continue;
      EXPECT_NEAR(b.f[i] * mscale2, a.f[i], 1e-5 * (1 + std::fabs(a.f[i]))) << i;
    }
  }
}

TEST(ImplMla, AbsorbedFormHonoursTheZoo) {
  // Every bug that applies to the golden DeepSeek-V3 gives the same numbers
  // in both forms.
  const Model model = Model::load(golden_model("deepseek-v3-mla"));
  const Scenario sc = replay_scenario(DumpFile(golden_dump("deepseek-v3-mla", "decode")));
  int tried = 0;
  for (const zoo::BugInfo& info : zoo::all_bugs()) {
    if (!info.acts_on_model() || !zoo::bug_inapplicable_reason(info.bug, model.config).empty()) continue;
    SCOPED_TRACE(info.name);
    const std::vector<zoo::BugSpec> bugs = {zoo::parse_bug(info.name)};
    const MemoryDump naive = run_impl(model, sc, MlaForm::Naive, 2, {}, bugs);
    const MemoryDump absorbed = run_impl(model, sc, MlaForm::Absorbed, 2, {}, bugs);
    expect_forms_agree(naive, absorbed, 1e-5);
    ++tried;
  }
  EXPECT_GE(tried, 10);
}

TEST(ImplMla, RopeInterleaveRotatesPairsIntoHalves) {
  // With rope_interleave, k_pe = rotate-half RoPE of kv_a's rope part
  // reordered from pairs (2i, 2i+1) to halves (i, i + Dr/2).
  const Model model = Model::load(golden_model("deepseek-v3-mla"));
  const int64_t Rkv = model.config.mla.kv_lora_rank, Dr = model.config.mla.qk_rope_head_dim;
  const MemoryDump d = run_impl(model, make_scenario({5, 6, 7, 8}, {}, 0), MlaForm::Naive);
  const TensorData kv_a = d.get("step0.layers.0.attn.kv_a"), k_pe = d.get("step0.layers.0.attn.k_pe");
  const TensorData cos = d.get("step0.rope.cos"), sin = d.get("step0.rope.sin");
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t i = 0; i < Dr / 2; ++i) {
      const double x1 = kv_a.f[size_t(t * (Rkv + Dr) + Rkv + 2 * i)], x2 = kv_a.f[size_t(t * (Rkv + Dr) + Rkv + 2 * i + 1)];
      const double c = cos.f[size_t(t * Dr + i)], s = sin.f[size_t(t * Dr + i)];
      EXPECT_NEAR(k_pe.f[size_t(t * Dr + i)], x1 * c - x2 * s, 1e-5);
      EXPECT_NEAR(k_pe.f[size_t(t * Dr + Dr / 2 + i)], x2 * c + x1 * s, 1e-5);
    }
}

// ----------------------------------------------------------- routing rules

MoeConfig deepseek_router(int64_t E, int64_t K, int64_t groups, int64_t keep) {
  MoeConfig m;
  m.num_experts = E, m.top_k = K, m.scoring = MoeConfig::Scoring::Sigmoid;
  m.norm_topk_prob = true, m.routed_scaling_factor = 2.5;
  m.n_group = groups, m.topk_group = keep, m.correction_bias = true;
  return m;
}

TEST(ImplMoeRoute, SoftmaxTopKRenormalisedAndAscending) {
  MoeConfig m;
  m.num_experts = 6, m.top_k = 3, m.norm_topk_prob = true;
  const float probs[6] = {0.05f, 0.30f, 0.10f, 0.25f, 0.02f, 0.28f};
  int64_t ids[3];
  float w[3];
  impl::moe_route(m, probs, nullptr, ids, w);
  EXPECT_EQ(std::vector<int64_t>(ids, ids + 3), (std::vector<int64_t>{1, 3, 5}));
  const float sum = (0.30f + 0.28f) + 0.25f;  // best first
  EXPECT_EQ(w[0], 0.30f / sum);
  EXPECT_EQ(w[1], 0.25f / sum);
  EXPECT_EQ(w[2], 0.28f / sum);
  m.norm_topk_prob = false;  // Qwen-MoE default: the probabilities as they are
  impl::moe_route(m, probs, nullptr, ids, w);
  EXPECT_EQ(std::vector<float>(w, w + 3), (std::vector<float>{0.30f, 0.25f, 0.28f}));
}

TEST(ImplMoeRoute, DeepseekGroupLimitBiasAndZeroFill) {
  // 8 experts in 2 groups of 4, one group kept, 2 chosen.
  const MoeConfig m = deepseek_router(8, 2, 2, 1);
  int64_t ids[2];
  float w[2];
  {
    // The bias steers the choice: expert 6 wins on score + bias, weights use the scores.
    const float s[8] = {0.9f, 0.8f, 0.1f, 0.1f, 0.7f, 0.6f, 0.5f, 0.1f};
    const float b[8] = {0, 0, 0, 0, 0.5f, 0, 0.5f, 0};
    // group scores (two best of s + b): {1.7, 2.2}: group 1 kept -> choice among 4..7: 1.2, 0.6, 1.0, 0.1
    impl::moe_route(m, s, b, ids, w);
    EXPECT_EQ(std::vector<int64_t>(ids, ids + 2), (std::vector<int64_t>{4, 6}));
    const float denom = (0.7f + 0.5f) + 1e-20f;
    EXPECT_EQ(w[0], 0.7f / denom * 2.5f);
    EXPECT_EQ(w[1], 0.5f / denom * 2.5f);
  }
  {
    // Negative choice scores in the kept group: the dropped group's 0.0
    // (HF's masked_fill) beats them, lower id first among the zeros.
    const float s[8] = {0.5f, 0.5f, 0.5f, 0.5f, 0.4f, 0.3f, 0.2f, 0.1f};
    const float b[8] = {0.1f, 0.1f, -0.2f, -0.2f, -1.0f, -1.0f, -1.0f, -1.0f};
    // (with b: choice {0.6, 0.6, 0.3, 0.3 | -0.6, -0.7, -0.8, -0.9}, group 0 kept, no zero chosen)
    const float b2[8] = {-0.9f, -0.9f, -0.9f, -0.9f, 0.5f, -0.4f, -0.4f, -0.4f};
    // choice: {-0.4 x4 | 0.9, -0.1, -0.2, -0.3}: group scores {-0.8, 0.8}: group 1 kept;
    // masked: {0, 0, 0, 0 | 0.9, -0.1, -0.2, -0.3}: experts 4 and 0 (a dropped one, at 0.0).
    impl::moe_route(m, s, b2, ids, w);
    EXPECT_EQ(std::vector<int64_t>(ids, ids + 2), (std::vector<int64_t>{0, 4}));
    const float denom = (0.4f + 0.5f) + 1e-20f;  // best first: expert 4 (0.4), then expert 0 (0.5)
    EXPECT_EQ(w[0], 0.5f / denom * 2.5f);
    EXPECT_EQ(w[1], 0.4f / denom * 2.5f);
    impl::moe_route(m, s, b, ids, w);  // group 0 kept, its best two
    EXPECT_EQ(std::vector<int64_t>(ids, ids + 2), (std::vector<int64_t>{0, 1}));
  }
  {
    // topk_group = n_group: no limit, plain top-K on score + bias.
    const MoeConfig all = deepseek_router(8, 2, 2, 2);
    const float s[8] = {0.9f, 0.8f, 0.1f, 0.1f, 0.7f, 0.6f, 0.5f, 0.1f};
    const float b[8] = {0, 0, 0, 0, 0.5f, 0, 0.5f, 0};
    impl::moe_route(all, s, b, ids, w);
    EXPECT_EQ(std::vector<int64_t>(ids, ids + 2), (std::vector<int64_t>{4, 6}));
    impl::moe_route(all, s, nullptr, ids, w);
    EXPECT_EQ(std::vector<int64_t>(ids, ids + 2), (std::vector<int64_t>{0, 1}));
  }
}

// --------------------------------------- random Qwen2-MoE, float64 recompute

constexpr int64_t kQD = 64, kQF = 96, kQE = 6, kQK = 2, kQFe = 24, kQFs = 40, kQHq = 4, kQHkv = 2, kQV = 100;

std::string write_qwen2_moe() {
  const std::string dir = testing::temp_path("impl-qwen2-moe");
  ::mkdir(dir.c_str(), 0700);
  std::ofstream(dir + "/config.json")
      << R"({"model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
             "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
             "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
             "shared_expert_intermediate_size": 40, "decoder_sparse_step": 1, "mlp_only_layers": [1],
             "norm_topk_prob": false, "tie_word_embeddings": false, "torch_dtype": "float32"})";
  Checkpoint c(dir, DType::F32, 11);
  const int64_t Dh = kQD / kQHq;
  c.add("model.embed_tokens.weight", {kQV, kQD}, 1.0f, 0.0f);
  for (int l = 0; l < 3; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    c.norm(p + "input_layernorm.weight", kQD);
    c.linear(p + "self_attn.q_proj.weight", kQHq * Dh, kQD);
    c.add(p + "self_attn.q_proj.bias", {kQHq * Dh}, 0.5f, 0.0f);
    c.linear(p + "self_attn.k_proj.weight", kQHkv * Dh, kQD);
    c.add(p + "self_attn.k_proj.bias", {kQHkv * Dh}, 0.5f, 0.0f);
    c.linear(p + "self_attn.v_proj.weight", kQHkv * Dh, kQD);
    c.add(p + "self_attn.v_proj.bias", {kQHkv * Dh}, 0.5f, 0.0f);
    c.linear(p + "self_attn.o_proj.weight", kQD, kQHq * Dh);
    c.norm(p + "post_attention_layernorm.weight", kQD);
    if (l == 1) {
      c.mlp(p + "mlp.", kQF, kQD);
    } else {
      c.linear(p + "mlp.gate.weight", kQE, kQD);
      for (int64_t e = 0; e < kQE; ++e) c.mlp(p + "mlp.experts." + std::to_string(e) + ".", kQFe, kQD);
      c.mlp(p + "mlp.shared_expert.", kQFs, kQD);
      c.linear(p + "mlp.shared_expert_gate.weight", 1, kQD);
    }
  }
  c.norm("model.norm.weight", kQD);
  c.linear("lm_head.weight", kQV, kQD);
  c.finish();
  return dir;
}

std::vector<float> f32_of(const WeightView& w) {
  std::vector<float> out(size_t(w.numel()));
  convert_to_f32(w.data, w.dtype, out.size(), out.data());
  return out;
}

// y [rows] = W [rows, K] · x [K] in float64.
std::vector<double> matvec(const WeightView& W, const double* x) {
  const std::vector<float> w = f32_of(W);
  const int64_t rows = W.shape[0], K = W.shape[1];
  std::vector<double> y(size_t(rows), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) y[size_t(r)] += double(w[size_t(r * K + k)]) * x[k];
  return y;
}

std::vector<double> swiglu64(const MlpWeights& m, const double* x) {
  std::vector<double> g = matvec(m.gate, x), u = matvec(m.up, x);
  for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
  return matvec(m.down, g.data());
}

void expect_near_rel(const std::vector<float>& got, const std::vector<double>& want, double rel, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double mx = 0;
  for (double x : want) mx = std::max(mx, std::fabs(x));
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], rel * std::max(mx, 1.0)) << what << " [" << i << "]";
}

TEST(ImplMoe, Qwen2MoeSharedExpertGateRecomputedInFloat64) {
  const Model model = Model::load(write_qwen2_moe());
  const ModelConfig& cfg = model.config;
  ASSERT_TRUE(cfg.moe.shared_gate);
  ASSERT_FALSE(cfg.moe.is_moe_layer(1));
  const MemoryDump d = run_impl(model, make_scenario(random_tokens(9, kQV, 3), {5, 4}, 2), MlaForm::Naive);
  EXPECT_TRUE(d.has("step0.layers.1.mlp.act"));
  EXPECT_FALSE(d.has("step0.layers.1.moe.out"));
  for (int step = 0; step < 4; ++step)
    for (int l : {0, 2}) {
      SCOPED_TRACE("step " + std::to_string(step) + " layer " + std::to_string(l));
      const LayerWeights& L = model.weights->layers[size_t(l)];
      const TensorData xn = d.get(layer_name(step, l, "mlp_norm"));
      const int64_t T = xn.shape[0];
      std::vector<double> logits, probs, routed, shared, out, eo, tw;
      std::vector<int64_t> ids;
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> x(xn.f.begin() + t * kQD, xn.f.begin() + (t + 1) * kQD);
        const std::vector<double> lg = matvec(L.router, x.data());
        logits.insert(logits.end(), lg.begin(), lg.end());
        const double mx = *std::max_element(lg.begin(), lg.end());
        std::vector<double> p(lg.size());
        double sum = 0;
        for (size_t e = 0; e < p.size(); ++e) sum += (p[e] = std::exp(lg[e] - mx));
        for (double& v : p) v /= sum;
        probs.insert(probs.end(), p.begin(), p.end());
        std::vector<int64_t> order(static_cast<size_t>(kQE));
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[size_t(a)] > p[size_t(b)]; });
        std::vector<int64_t> chosen(order.begin(), order.begin() + kQK);
        std::sort(chosen.begin(), chosen.end());
        std::vector<double> r(size_t(kQD), 0.0);
        for (int64_t e : chosen) {
          ids.push_back(e);
          tw.push_back(p[size_t(e)]);  // norm_topk_prob false: the probability itself
          const std::vector<double> y = swiglu64(L.experts[size_t(e)], x.data());
          eo.insert(eo.end(), y.begin(), y.end());
          for (int64_t i = 0; i < kQD; ++i) r[size_t(i)] += p[size_t(e)] * y[size_t(i)];
        }
        routed.insert(routed.end(), r.begin(), r.end());
        std::vector<double> sh = swiglu64(L.shared, x.data());
        const double gate = 1.0 / (1.0 + std::exp(-matvec(L.shared_gate, x.data())[0]));
        for (double& v : sh) v *= gate;
        shared.insert(shared.end(), sh.begin(), sh.end());
        for (int64_t i = 0; i < kQD; ++i) out.push_back(r[size_t(i)] + sh[size_t(i)]);
      }
      EXPECT_EQ(d.get(layer_name(step, l, "moe.topk_ids")).i, ids);
      expect_near_rel(d.get(layer_name(step, l, "moe.router_logits")).f, logits, 1e-5, "router_logits");
      expect_near_rel(d.get(layer_name(step, l, "moe.router_probs")).f, probs, 1e-5, "router_probs");
      expect_near_rel(d.get(layer_name(step, l, "moe.topk_weights")).f, tw, 1e-5, "topk_weights");
      expect_near_rel(d.get(layer_name(step, l, "moe.expert_out")).f, eo, 1e-5, "expert_out");
      expect_near_rel(d.get(layer_name(step, l, "moe.routed")).f, routed, 1e-5, "routed");
      expect_near_rel(d.get(layer_name(step, l, "moe.shared")).f, shared, 1e-5, "shared");
      expect_near_rel(d.get(layer_name(step, l, "moe.out")).f, out, 1e-5, "moe.out");
      // out = attn_residual + moe.out
      const TensorData res = d.get(layer_name(step, l, "attn_residual")), mo = d.get(layer_name(step, l, "moe.out"));
      const TensorData lo = d.get(layer_name(step, l, "out"));
      for (size_t i = 0; i < lo.f.size(); ++i) EXPECT_EQ(lo.f[i], res.f[i] + mo.f[i]);
    }
}

TEST(ImplMla, ParsesTheForm) {
  EXPECT_EQ(impl::parse_mla_form("naive"), MlaForm::Naive);
  EXPECT_EQ(impl::parse_mla_form("absorbed"), MlaForm::Absorbed);
  EXPECT_THROW(impl::parse_mla_form("latent"), UsageError);
  const Model model = Model::load(golden_model("deepseek-v3-mla"));
  impl::ImplOptions opt;
  opt.mla = MlaForm::Absorbed;
  EXPECT_NE(impl::make_impl_engine(model, opt)->producer().find("absorbed"), std::string::npos);
  // A model without MLA ignores the form.
  const Model llama = Model::load(golden_model("llama-gqa"));
  EXPECT_EQ(impl::make_impl_engine(llama, opt)->producer(), impl::make_impl_engine(llama, {})->producer());
}

}  // namespace
}  // namespace llmdiff
