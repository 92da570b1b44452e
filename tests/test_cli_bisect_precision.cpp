// Precision signatures on a bfloat16 checkpoint (tests/golden/llama-mha-bf16):
// a float32 engine on its bfloat16 weights, and bfloat16 engines, each with
// one 16-bit rounding made on top of its own numerics at one op (recomputed
// from the engine's own dump), bisected whole: the op's precision signature
// is the finding, clean engines pass, and a rounding the engine's own dtype
// already explains is no finding. (The float32 goldens' precision cases:
// BisectSignatures in tests/test_cli_bisect.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>

#include "bisect/pipeline.h"
#include "cli/common.h"
#include "compare/bisect_report.h"
#include "dumps/base/dtype.h"
#include "tests/support.h"

using namespace llmdiff;
using namespace llmdiff::testing;
using bisect::BisectOptions;
using compare::BisectResult;

namespace {

const char* kModel = "llama-mha-bf16";  // bfloat16 weights

const bisect::ModelOracles& oracles() {
  static std::unique_ptr<bisect::ModelOracles> m;
  if (!m) m = std::make_unique<bisect::ModelOracles>(golden_model(kModel), 1);
  return *m;
}

float bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }
float f16(float x) { return f16_to_f32(f32_to_f16(x)); }
float to16(float x, bool to_bf16) { return to_bf16 ? bf16(x) : f16(x); }

// The golden decode scenario; and one prefill of `T` tokens (positions up to
// T - 1: a 16-bit angle's rounding grows with them).
Scenario decode_scenario() { return replay_scenario(DumpFile(golden_dump(kModel, "decode"))); }
Scenario long_prefill(int64_t T) {
  Scenario sc;
  sc.name = "prefill";
  std::vector<int64_t> tokens;
  for (int64_t t = 0; t < T; ++t) tokens.push_back((t * 37 + 11) % 256);
  sc.steps.push_back(tokens);
  return sc;
}

// `engine` ("impl" with a precision profile, or "ref" at a dtype) over `sc`,
// every site recorded.
std::unique_ptr<MemoryDump> engine_dump(const std::string& engine, const Scenario& sc, const std::string& precision,
                                        const std::string& dtype = "") {
  const bisect::ModelOracles& m = oracles();
  cli::EngineOptions eo;
  eo.threads = 1;
  eo.precision = precision;
  eo.dtype = dtype;
  auto e = cli::make_engine(engine, m.model, eo);
  auto d = std::make_unique<MemoryDump>(engine + (precision.empty() ? "" : " --precision " + precision) +
                                        (dtype.empty() ? "" : " --dtype " + dtype));
  d->mutable_manifest() = cli::make_manifest(*e, m.model, m.dir, sc);
  run_scenario(*e, sc, *d);
  return d;
}

// A change of one tensor, recomputed from the base dump's own inputs; `out`
// rounds what the op stores (the engine's own dtype: identity for float32).
using Out = std::function<float(float)>;
using Change = std::function<void(TensorData&, const TensorSource&, const Out&)>;

Change rounded_to_bf16() {
  return [](TensorData& t, const TensorSource&, const Out&) {
    for (float& x : t.f) x = bf16(x);
  };
}

// HF's table cat(freqs, freqs) from the angles position x inv_freq (or
// inv_freq itself) rounded to a 16-bit type, the attention scaling fitted
// from the dump's own table.
Change rope16(bool is_cos, bool angles, bool to_bf16) {
  return [=](TensorData& t, const TensorSource& g, const Out& out) {
    const std::vector<float> inv = g.get("rope.inv_freq").f, pos = g.get("step0.positions").floats();
    const int64_t T = t.shape[0], D = t.shape[1], half = int64_t(inv.size());
    auto fn = [is_cos](float a) { return is_cos ? std::cos(a) : std::sin(a); };
    double num = 0, den = 0;
    for (int64_t k = 0; k < T * D; ++k) {
      const double e = fn(pos[size_t(k / D)] * inv[size_t(k % D % half)]);
      num += e * t.f[size_t(k)], den += e * e;
    }
    const double scaling = std::round(num / den * 1e3) / 1e3;
    for (int64_t k = 0; k < T * D; ++k) {
      const float f = inv[size_t(k % D % half)], p = pos[size_t(k / D)];
      const float a = angles ? to16(p * f, to_bf16) : p * to16(f, to_bf16);
      t.f[size_t(k)] = out(float(scaling * fn(a)));
    }
  };
}

// RMSNorm of `input` rounded to a 16-bit type, with the checkpoint's weight
// (HF's order: the normalised input stored in the engine's dtype, then the
// weight's product).
Change norm_input16(const std::string& input, int layer, bool to_bf16) {
  return [=](TensorData& t, const TensorSource& g, const Out& out) {
    const bisect::ModelOracles& m = oracles();
    const WeightView& wv = m.model.weights->layers[size_t(layer)].post_attn_norm;
    const int64_t T = t.shape[0], D = t.shape[1];
    std::vector<float> w(static_cast<size_t>(D));
    wv.rows_f32(0, 1, w.data());
    std::vector<float> x = g.get(input).f;
    for (float& v : x) v = to16(v, to_bf16);
    for (int64_t r = 0; r < T; ++r) {
      float ss = 0;
      for (int64_t j = 0; j < D; ++j) ss += x[size_t(r * D + j)] * x[size_t(r * D + j)];
      const float k = 1.0f / std::sqrt(ss / float(D) + float(m.model.config.rms_norm_eps));
      for (int64_t j = 0; j < D; ++j) t.f[size_t(r * D + j)] = out(w[size_t(j)] * out(x[size_t(r * D + j)] * k));
    }
  };
}

// The softmax of the dump's own scores in float16 throughout (exp, the
// running sum, the division), stored in the engine's dtype.
Change softmax16(bool to_bf16) {
  return [=](TensorData& t, const TensorSource& g, const Out& out) {
    const std::string site = "step0.layers.0.attn.scores";
    const TensorData sc = g.get(site), mk = g.get("step0.mask");
    const int64_t H = t.shape[0], T = t.shape[1], S = t.shape[2];
    auto h = [to_bf16](float x) { return to16(x, to_bf16); };
    for (int64_t hd = 0; hd < H; ++hd)
      for (int64_t r = 0; r < T; ++r) {
        const float* x = sc.f.data() + (hd * T + r) * S;
        float* y = t.f.data() + (hd * T + r) * S;
        float mx = -std::numeric_limits<float>::infinity(), sum = 0;
        for (int64_t k = 0; k < S; ++k)
          if (mk.f[size_t(r * S + k)] != 0) mx = std::max(mx, h(x[k]));
        for (int64_t k = 0; k < S; ++k) {
          y[k] = 0;
          if (mk.f[size_t(r * S + k)] == 0) continue;
          y[k] = h(std::exp(h(x[k]) - mx));
          sum = h(sum + y[k]);
        }
        for (int64_t k = 0; k < S; ++k) y[k] = out(h(y[k] / sum));
      }
  };
}

// The transformed dump: `base` with `change` made at `name`.
std::unique_ptr<MemoryDump> changed(const TensorSource& base, const std::string& name, const Change& change,
                                    const Out& out) {
  auto cand = std::make_unique<MemoryDump>(base.label() + " changed at " + name);
  cand->mutable_manifest() = base.manifest();
  for (const auto& n : base.names()) {
    TensorData t = base.get(n);
    if (n == name) change(t, base, out);
    cand->put(t);
  }
  return cand;
}

const Out kFloat32 = [](float x) { return x; };

struct Case {
  std::string name, detail;  // where the rounding is made; the precision signature's words
  Change change;
};

const std::string kSoftmaxWhole = "every step of it (the scores, exp, the running sum, the division) in ";

// The bisection of `base` changed by `c` names it by its precision signature
// at `c.name` (no zoo bug, no dtype to declare).
void expect_signature(const TensorSource& base, const Out& out, const Case& c) {
  SCOPED_TRACE(base.label() + ": " + c.name + " (" + c.detail + ")");
  std::unique_ptr<MemoryDump> cand = changed(base, c.name, c.change, out);
  const BisectResult r = bisect::bisect_candidate(oracles(), *cand, BisectOptions{});
  SCOPED_TRACE(r.finding.evidence);
  EXPECT_EQ(r.exit_code(), 1);
  EXPECT_EQ(r.localised_at().value_or(""), c.name);
  EXPECT_FALSE(compare::named_bug(r.finding));
  ASSERT_EQ(r.finding.kind, compare::FindingKind::Signature) << compare::kind_name(r.finding.kind);
  EXPECT_EQ(r.finding.signature.name, c.name);
  EXPECT_EQ(r.finding.signature.kind, "precision");
  EXPECT_TRUE(r.finding.signature.decisive);
  EXPECT_NE(r.finding.signature.detail.find(c.detail), std::string::npos) << r.finding.signature.detail;
}

// The bisection of `base` (unchanged, or changed by `c` within its own
// rounding) passes: no finding at all.
void expect_pass(const TensorSource& base, const Out& out, const Case* c = nullptr) {
  std::unique_ptr<MemoryDump> cand = c ? changed(base, c->name, c->change, out) : nullptr;
  const TensorSource& judged = cand ? *cand : base;
  SCOPED_TRACE(judged.label());
  const BisectResult r = bisect::bisect_candidate(oracles(), judged, BisectOptions{});
  EXPECT_EQ(r.exit_code(), 0) << r.finding.evidence;
  EXPECT_EQ(r.finding.kind, compare::FindingKind::Passes) << compare::kind_name(r.finding.kind);
}

}  // namespace

// A float32 engine on the bfloat16 checkpoint (the reference: float32 on
// the same bfloat16 weights) rounding one op to 16 bits: each finder names
// it; neither a zoo bug nor "declare bfloat16" (the rest is float32).
TEST(BisectPrecisionBf16Weights, AFloat32EngineRoundingOneOpGetsThatOpsPrecisionSignature) {
  const std::unique_ptr<MemoryDump> base = engine_dump("impl", decode_scenario(), "");
  expect_pass(*base, kFloat32);
  const std::vector<Case> cases = {
      {"step0.layers.0.attn_norm", "every value is the reference's rounded to bfloat16", rounded_to_bf16()},
      {"step0.rope.cos", "cos of the angles position x inv_freq rounded to bfloat16", rope16(true, true, true)},
      {"step0.rope.sin", "sin of the angles position x inv_freq rounded to float16", rope16(false, true, false)},
      {"step0.rope.sin", "sin of inv_freq rounded to bfloat16", rope16(false, false, true)},
      {"step0.layers.1.mlp_norm", "the norm's input step0.layers.1.attn_residual rounded to bfloat16",
       norm_input16("step0.layers.1.attn_residual", 1, true)},
      {"step0.layers.1.mlp_norm", "the norm's input step0.layers.1.attn_residual rounded to float16",
       norm_input16("step0.layers.1.attn_residual", 1, false)},
      {"step0.layers.0.attn.probs", kSoftmaxWhole + "float16", softmax16(false)},
      {"step0.layers.0.attn.probs", kSoftmaxWhole + "bfloat16", softmax16(true)},
  };
  for (const Case& c : cases) expect_signature(*base, kFloat32, c);
}

// bfloat16 engines over a prefill of 120 tokens (a 16-bit angle's rounding
// grows with the position): HF's numerics (the ref in bfloat16), and the
// impl rounding its matmul inputs to bfloat16 declared bfloat16 (its other
// values, RoPE's table too, in float32). A rounding beyond the engine's own
// is named at its op; the clean engines pass.
TEST(BisectPrecisionBf16Weights, ABfloat16EngineRoundingBeyondItsOwnGetsThePrecisionSignature) {
  const Scenario sc = long_prefill(120);
  const std::unique_ptr<MemoryDump> hf = engine_dump("ref", sc, "", "bfloat16");
  std::unique_ptr<MemoryDump> impl = engine_dump("impl", sc, "matmul_input=bf16");
  impl->mutable_manifest().dtype = "bfloat16";
  const Out stored_bf16 = bf16;
  expect_pass(*hf, stored_bf16);
  expect_pass(*impl, kFloat32);
  const Case cos_angles{"step0.rope.cos", "cos of the angles position x inv_freq rounded to bfloat16",
                        rope16(true, true, true)};
  const Case sin_inv_freq{"step0.rope.sin", "sin of inv_freq rounded to bfloat16", rope16(false, false, true)};
  for (const Case& c : {cos_angles, sin_inv_freq}) {
    expect_signature(*hf, stored_bf16, c);
    expect_signature(*impl, kFloat32, c);
  }
  expect_signature(*hf, stored_bf16, {"step0.layers.0.attn.probs", kSoftmaxWhole + "bfloat16", softmax16(true)});
}

// Roundings a bfloat16 engine's own explains: its residual stream is already
// bfloat16 (the norm's input rounded again changes nothing), a softmax in
// float16 or angles in float16 stay within its rounding of what it stores.
// No divergence, so no precision claim.
TEST(BisectPrecisionBf16Weights, ARoundingWithinABfloat16EnginesOwnIsNoFinding) {
  const std::unique_ptr<MemoryDump> hf = engine_dump("ref", long_prefill(120), "", "bfloat16");
  const Out stored_bf16 = bf16;
  const std::vector<Case> cases = {
      {"step0.layers.1.mlp_norm", "", norm_input16("step0.layers.1.attn_residual", 1, true)},
      {"step0.layers.1.mlp_norm", "", norm_input16("step0.layers.1.attn_residual", 1, false)},
      {"step0.layers.0.attn.probs", "", softmax16(false)},
      {"step0.rope.sin", "", rope16(false, true, false)},
  };
  for (const Case& c : cases) expect_pass(*hf, stored_bf16, &c);
}

// A bug of the zoo upstream leaves the softmax, the norm and RoPE's table
// right on what the candidate fed them (its own scores, input, positions):
// no precision signature there, whether the engine computes in float32 or
// declares bfloat16; the bug is named.
TEST(BisectPrecisionBf16Weights, AZooBugIsNoPrecisionSignatureDownstream) {
  const bisect::ModelOracles& m = oracles();
  for (const std::string precision : {"", "matmul_input=bf16"})
    for (const std::string bug : {"softmax-scale", "mask-square", "rope-position-reset", "rope-theta"}) {
      cli::EngineOptions eo;
      eo.threads = 1;
      eo.precision = precision;
      eo.inject = {bug};
      const Scenario sc = decode_scenario();
      auto engine = cli::make_engine("impl", m.model, eo);
      MemoryDump cand("impl --precision '" + precision + "' --inject " + bug);
      cand.mutable_manifest() = cli::make_manifest(*engine, m.model, m.dir, sc);
      if (!precision.empty()) cand.mutable_manifest().dtype = "bfloat16";
      run_scenario(*engine, sc, cand);
      const BisectResult r = bisect::bisect_candidate(m, cand, BisectOptions{});
      SCOPED_TRACE(cand.label() + ": " + r.finding.evidence);
      EXPECT_EQ(r.exit_code(), 1);
      ASSERT_TRUE(compare::named_bug(r.finding).has_value());
      EXPECT_EQ(compare::named_bug(r.finding)->bug, bug);
      for (const compare::ErrorSignature& g : r.diagnosis.signatures)
        EXPECT_NE(g.kind, "precision") << g.name << ": " << g.detail;
    }
}
