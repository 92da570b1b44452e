// The ref on configurations outside tests/golden: other head counts and
// head_dims, deeper models, every rope type, biases, qk-norm, sliding windows,
// bf16/f16 checkpoints. Each synthetic checkpoint is written to a temporary
// directory and run through the ref (float64 and float32) and through a
// plain double-precision re-statement of the decoder written here from the
// model definition (loops, no libtorch), so both must agree.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "dumps/base/dtype.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/formats/safetensors.h"
#include "dumps/model/weights.h"
#include "ref/ref_engine.h"
#include "tests/support.h"

namespace llmdiff {
namespace {

using Vec = std::vector<double>;
using Weights = std::map<std::string, Vec>;

struct Spec {
  std::string name, model_type;
  int64_t D = 32, F = 64, L = 2, Hq = 4, Hkv = 2, Dh = 0 /* 0: no head_dim key */, V = 64, max_pos = 64;
  double theta = 10000.0, eps = 1e-6;
  std::string rope_scaling = "null";  // JSON
  bool attention_bias = false, tie = false;
  int64_t sliding_window = 0;  // 0: null
  DType wdtype = DType::F32;
  std::vector<std::vector<int64_t>> steps;  // forward calls
  int64_t head_dim() const { return Dh > 0 ? Dh : D / Hq; }
};
void PrintTo(const Spec& s, std::ostream* os) { *os << s.name; }

// Rounds to the checkpoint dtype (what the model computes with).
double stored(double x, DType t) {
  if (t == DType::BF16) return bf16_to_f32(f32_to_bf16(float(x)));
  if (t == DType::F16) return f16_to_f32(f32_to_f16(float(x)));
  return float(x);
}

// A model directory under the test's temporary directory, removed at the end.
struct ModelDir {
  std::string path;
  explicit ModelDir(const std::string& name) : path(testing::temp_path(name)) { ::mkdir(path.c_str(), 0700); }
  ~ModelDir() {
    std::remove((path + "/config.json").c_str());
    std::remove((path + "/model.safetensors").c_str());
    ::rmdir(path.c_str());
  }
};

// Writes config.json and model.safetensors into dir; returns the weights as stored.
Weights write_model(const Spec& sp, const std::string& dir) {
  const bool qwen2 = sp.model_type == "qwen2", qwen3 = sp.model_type == "qwen3";
  const char* dt = sp.wdtype == DType::BF16 ? "bfloat16" : sp.wdtype == DType::F16 ? "float16" : "float32";
  {
    std::ofstream c(dir + "/config.json");
    c << "{\n  \"model_type\": \"" << sp.model_type << "\",\n"
      << "  \"hidden_size\": " << sp.D << ",\n  \"intermediate_size\": " << sp.F << ",\n"
      << "  \"num_hidden_layers\": " << sp.L << ",\n  \"num_attention_heads\": " << sp.Hq << ",\n"
      << "  \"num_key_value_heads\": " << sp.Hkv << ",\n";
    if (sp.Dh > 0) c << "  \"head_dim\": " << sp.Dh << ",\n";
    c << "  \"vocab_size\": " << sp.V << ",\n  \"max_position_embeddings\": " << sp.max_pos << ",\n"
      << "  \"rms_norm_eps\": " << sp.eps << ",\n  \"rope_theta\": " << sp.theta << ",\n"
      << "  \"rope_scaling\": " << sp.rope_scaling << ",\n"
      << "  \"attention_bias\": " << (sp.attention_bias ? "true" : "false") << ",\n"
      << "  \"tie_word_embeddings\": " << (sp.tie ? "true" : "false") << ",\n"
      << "  \"sliding_window\": " << (sp.sliding_window > 0 ? std::to_string(sp.sliding_window) : "null") << ",\n"
      << "  \"hidden_act\": \"silu\",\n  \"torch_dtype\": \"" << dt << "\"\n}\n";
  }
  std::mt19937_64 rng(std::hash<std::string>{}(sp.name));
  std::normal_distribution<double> normal(0.0, 1.0);
  Weights W;
  SafetensorsWriter out(dir + "/model.safetensors");
  auto add = [&](const std::string& name, Shape shape, double scale, double offset) {
    const int64_t n = numel(shape);
    Vec v(static_cast<size_t>(n));
    std::vector<uint16_t> half(static_cast<size_t>(n));
    std::vector<float> f32(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      v[size_t(i)] = stored(offset + scale * normal(rng), sp.wdtype);
      f32[size_t(i)] = float(v[size_t(i)]);
      half[size_t(i)] = sp.wdtype == DType::BF16 ? f32_to_bf16(f32[size_t(i)]) : f32_to_f16(f32[size_t(i)]);
    }
    if (sp.wdtype == DType::F32) out.add(name, DType::F32, shape, f32.data(), f32.size() * 4);
    else out.add(name, sp.wdtype, shape, half.data(), half.size() * 2);
    W[name] = v;
  };
  const int64_t Dh = sp.head_dim(), QD = sp.Hq * Dh, KD = sp.Hkv * Dh;
  add("model.embed_tokens.weight", {sp.V, sp.D}, 1.0, 0.0);
  for (int64_t l = 0; l < sp.L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {sp.D}, 0.2, 1.0);
    add(p + "self_attn.q_proj.weight", {QD, sp.D}, 1.5 / std::sqrt(double(sp.D)), 0.0);
    add(p + "self_attn.k_proj.weight", {KD, sp.D}, 1.5 / std::sqrt(double(sp.D)), 0.0);
    add(p + "self_attn.v_proj.weight", {KD, sp.D}, 1.5 / std::sqrt(double(sp.D)), 0.0);
    add(p + "self_attn.o_proj.weight", {sp.D, QD}, 1.5 / std::sqrt(double(QD)), 0.0);
    if (qwen2 || sp.attention_bias) {
      add(p + "self_attn.q_proj.bias", {QD}, 0.5, 0.0);
      add(p + "self_attn.k_proj.bias", {KD}, 0.5, 0.0);
      add(p + "self_attn.v_proj.bias", {KD}, 0.5, 0.0);
    }
    if (!qwen2 && sp.attention_bias) add(p + "self_attn.o_proj.bias", {sp.D}, 0.5, 0.0);
    if (qwen3) {
      add(p + "self_attn.q_norm.weight", {Dh}, 0.2, 1.0);
      add(p + "self_attn.k_norm.weight", {Dh}, 0.2, 1.0);
    }
    add(p + "post_attention_layernorm.weight", {sp.D}, 0.2, 1.0);
    add(p + "mlp.gate_proj.weight", {sp.F, sp.D}, 1.5 / std::sqrt(double(sp.D)), 0.0);
    add(p + "mlp.up_proj.weight", {sp.F, sp.D}, 1.5 / std::sqrt(double(sp.D)), 0.0);
    add(p + "mlp.down_proj.weight", {sp.D, sp.F}, 1.5 / std::sqrt(double(sp.F)), 0.0);
  }
  add("model.norm.weight", {sp.D}, 0.2, 1.0);
  if (!sp.tie) add("lm_head.weight", {sp.V, sp.D}, 1.0 / std::sqrt(double(sp.D)), 0.0);
  out.finish();
  return W;
}

// ---- the double-precision re-statement ------------------------------------

struct RopeTable {
  Vec inv_freq;
  double scale = 1.0;
};

// Inverse frequencies for a call whose sequence (cache + new tokens) is
// seq_len long, from the formulas of each rope type.
RopeTable rope_table(const ModelConfig& c, int64_t seq_len) {
  const int64_t dim = c.head_dim;
  const RopeScaling& rs = c.rope_scaling;
  auto freqs = [&](double base) {
    Vec f;
    for (int64_t i = 0; i < dim / 2; ++i) f.push_back(std::pow(base, -double(2 * i) / double(dim)));
    return f;
  };
  RopeTable r;
  switch (rs.type) {
    case RopeScaling::Type::Default: r.inv_freq = freqs(c.rope_theta); break;
    case RopeScaling::Type::Linear:
      r.inv_freq = freqs(c.rope_theta);
      for (double& f : r.inv_freq) f /= rs.factor;
      break;
    case RopeScaling::Type::Dynamic: {
      // NTK: past the trained length the base grows with the sequence
      const double L = double(c.max_position_embeddings), s = double(std::max(seq_len, c.max_position_embeddings));
      r.inv_freq = freqs(c.rope_theta * std::pow(rs.factor * s / L - (rs.factor - 1), double(dim) / double(dim - 2)));
      break;
    }
    case RopeScaling::Type::Llama3: {
      r.inv_freq = freqs(c.rope_theta);
      const double old = double(rs.original_max_position_embeddings);
      for (double& f : r.inv_freq) {
        const double wl = 2 * M_PI / f;
        if (wl > old / rs.low_freq_factor) {
          f = f / rs.factor;
        } else if (wl >= old / rs.high_freq_factor) {
          const double s = (old / wl - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
          f = (1 - s) * f / rs.factor + s * f;
        }
      }
      break;
    }
    case RopeScaling::Type::Yarn: {
      double factor = rs.factor, orig = double(c.max_position_embeddings);
      if (rs.original_max_position_embeddings > 0) {
        orig = double(rs.original_max_position_embeddings);
        factor = double(c.max_position_embeddings) / orig;
      }
      auto mscale = [&](double m) { return factor <= 1 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; };
      r.scale = rs.has_attention_factor ? rs.attention_factor
                : (rs.mscale != 0 && rs.mscale_all_dim != 0) ? mscale(rs.mscale) / mscale(rs.mscale_all_dim)
                                                              : mscale(1.0);
      // dimension index at which a frequency completes `rot` rotations over orig positions
      auto dim_of = [&](double rot) { return dim * std::log(orig / (rot * 2 * M_PI)) / (2 * std::log(c.rope_theta)); };
      const double lo = std::max(0.0, std::floor(dim_of(rs.beta_fast)));
      double hi = std::min(double(dim - 1), std::ceil(dim_of(rs.beta_slow)));
      if (hi == lo) hi += 0.001;
      r.inv_freq = freqs(c.rope_theta);
      for (size_t i = 0; i < r.inv_freq.size(); ++i) {
        const double ramp = std::clamp((double(i) - lo) / (hi - lo), 0.0, 1.0);
        r.inv_freq[i] = r.inv_freq[i] / factor * ramp + r.inv_freq[i] * (1 - ramp);
      }
      break;
    }
  }
  return r;
}

class Reference {
 public:
  Reference(const ModelConfig& c, const Weights& w) : c_(c), w_(w) {}

  // One forward call; returns the sites it checks, in the dump's layouts.
  std::map<std::string, Vec> forward(const std::vector<int64_t>& tok, int step) {
    const int64_t T = int64_t(tok.size()), P = int64_t(k_.size() ? k_[0].size() : 0), S = P + T;
    const int64_t D = c_.hidden_size, Dh = c_.head_dim, Hq = c_.num_attention_heads, Hkv = c_.num_key_value_heads;
    const int64_t half = Dh / 2, nrep = Hq / Hkv, V = c_.vocab_size;
    if (k_.empty()) k_.assign(size_t(c_.num_hidden_layers), {}), v_.assign(size_t(c_.num_hidden_layers), {});
    std::map<std::string, Vec> out;
    auto site = [&](const std::string& s) { return step_name(step, s); };
    const RopeTable rope = rope_table(c_, S);
    if (step == 0) out["rope.inv_freq"] = rope.inv_freq;
    Vec cosv(static_cast<size_t>(T * Dh)), sinv(static_cast<size_t>(T * Dh));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < Dh; ++j) {
        const double a = double(P + t) * rope.inv_freq[size_t(j % half)];
        cosv[size_t(t * Dh + j)] = std::cos(a) * rope.scale;
        sinv[size_t(t * Dh + j)] = std::sin(a) * rope.scale;
      }
    out[site("rope.cos")] = cosv;
    const int64_t window = (c_.family != Family::Llama || c_.model_type == "mistral") ? c_.sliding_window : 0;
    auto allowed = [&](int64_t pos, int64_t s) { return s <= pos && (window <= 0 || pos - s < window); };
    Vec mask(static_cast<size_t>(T * S));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t s = 0; s < S; ++s) mask[size_t(t * S + s)] = allowed(P + t, s) ? 1 : 0;
    out[site("mask")] = mask;

    std::vector<Vec> h(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      const Vec& e = w_.at("model.embed_tokens.weight");
      h[size_t(t)] = Vec(e.begin() + tok[size_t(t)] * D, e.begin() + (tok[size_t(t)] + 1) * D);
    }
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      auto lsite = [&](const std::string& s) { return layer_name(step, int(l), s); };
      Vec q_rope(size_t(Hq * T * Dh)), probs(size_t(Hq * T * S)), ctx(size_t(T * Hq * Dh)), layer_out;
      std::vector<Vec> qs(static_cast<size_t>(T));
      for (int64_t t = 0; t < T; ++t) {
        const Vec x = rms(h[size_t(t)], w_.at(p + "input_layernorm.weight"));
        Vec q = lin(x, p + "self_attn.q_proj"), k = lin(x, p + "self_attn.k_proj"), v = lin(x, p + "self_attn.v_proj");
        if (c_.qk_norm) {
          head_rms(q, w_.at(p + "self_attn.q_norm.weight"));
          head_rms(k, w_.at(p + "self_attn.k_norm.weight"));
        }
        rotate(q, cosv, sinv, t);
        rotate(k, cosv, sinv, t);
        for (int64_t hh = 0; hh < Hq; ++hh)
          for (int64_t d = 0; d < Dh; ++d) q_rope[size_t((hh * T + t) * Dh + d)] = q[size_t(hh * Dh + d)];
        qs[size_t(t)] = q;
        k_[size_t(l)].push_back(k);
        v_[size_t(l)].push_back(v);
      }
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t hh = 0; hh < Hq; ++hh) {
          const int64_t kvh = hh / nrep;
          Vec sc(static_cast<size_t>(S));
          double mx = -INFINITY;
          for (int64_t s = 0; s < S; ++s) {
            if (!allowed(P + t, s)) continue;
            double dot = 0;
            for (int64_t d = 0; d < Dh; ++d)
              dot += qs[size_t(t)][size_t(hh * Dh + d)] * k_[size_t(l)][size_t(s)][size_t(kvh * Dh + d)];
            sc[size_t(s)] = dot / std::sqrt(double(Dh));
            mx = std::max(mx, sc[size_t(s)]);
          }
          double sum = 0;
          for (int64_t s = 0; s < S; ++s)
            if (allowed(P + t, s)) sum += std::exp(sc[size_t(s)] - mx);
          for (int64_t s = 0; s < S; ++s) {
            const double pr = allowed(P + t, s) ? std::exp(sc[size_t(s)] - mx) / sum : 0.0;
            probs[size_t((hh * T + t) * S + s)] = pr;
            for (int64_t d = 0; d < Dh; ++d)
              ctx[size_t(t * Hq * Dh + hh * Dh + d)] += pr * v_[size_t(l)][size_t(s)][size_t(kvh * Dh + d)];
          }
        }
        const Vec c(ctx.begin() + t * Hq * Dh, ctx.begin() + (t + 1) * Hq * Dh);
        const Vec o = lin(c, p + "self_attn.o_proj");
        for (int64_t i = 0; i < D; ++i) h[size_t(t)][size_t(i)] += o[size_t(i)];
        const Vec x = rms(h[size_t(t)], w_.at(p + "post_attention_layernorm.weight"));
        const Vec g = lin(x, p + "mlp.gate_proj"), u = lin(x, p + "mlp.up_proj");
        Vec a(g.size());
        for (size_t i = 0; i < g.size(); ++i) a[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
        const Vec dn = lin(a, p + "mlp.down_proj");
        for (int64_t i = 0; i < D; ++i) h[size_t(t)][size_t(i)] += dn[size_t(i)];
        layer_out.insert(layer_out.end(), h[size_t(t)].begin(), h[size_t(t)].end());
      }
      out[lsite("attn.q_rope")] = q_rope;
      out[lsite("attn.probs")] = probs;
      out[lsite("attn.ctx")] = ctx;
      out[lsite("out")] = layer_out;
    }
    Vec logits;
    const std::string head = c_.tie_word_embeddings ? "model.embed_tokens" : "lm_head";
    for (int64_t t = 0; t < T; ++t) {
      const Vec y = lin(rms(h[size_t(t)], w_.at("model.norm.weight")), head);
      logits.insert(logits.end(), y.begin(), y.end());
    }
    (void)V;
    out[site("logits")] = logits;
    return out;
  }

 private:
  Vec rms(const Vec& x, const Vec& w) const {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double r = 1.0 / std::sqrt(ss / double(x.size()) + c_.rms_norm_eps);
    Vec y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * r * w[i];
    return y;
  }
  void head_rms(Vec& x, const Vec& w) const {
    const size_t dh = w.size();
    for (size_t h0 = 0; h0 < x.size(); h0 += dh) {
      const Vec y = rms(Vec(x.begin() + long(h0), x.begin() + long(h0 + dh)), w);
      std::copy(y.begin(), y.end(), x.begin() + long(h0));
    }
  }
  // y = W x (+ b) for the Linear `name` ("...q_proj"; "model.embed_tokens" for a tied head)
  Vec lin(const Vec& x, const std::string& name) const {
    const Vec& W = w_.at(name + ".weight");
    const size_t in = x.size(), outn = W.size() / in;
    Vec y(outn, 0.0);
    auto b = w_.find(name + ".bias");
    for (size_t o = 0; o < outn; ++o) {
      double acc = b != w_.end() ? b->second[o] : 0.0;
      for (size_t i = 0; i < in; ++i) acc += W[o * in + i] * x[i];
      y[o] = acc;
    }
    return y;
  }
  // rotate-half RoPE of every head of x at row t of the tables
  void rotate(Vec& x, const Vec& cosv, const Vec& sinv, int64_t t) const {
    const int64_t Dh = c_.head_dim, half = Dh / 2;
    for (size_t h0 = 0; h0 < x.size(); h0 += size_t(Dh)) {
      Vec y(static_cast<size_t>(Dh));
      for (int64_t i = 0; i < Dh; ++i) {
        const double rot = i < half ? -x[h0 + size_t(i + half)] : x[h0 + size_t(i - half)];
        y[size_t(i)] = x[h0 + size_t(i)] * cosv[size_t(t * Dh + i)] + rot * sinv[size_t(t * Dh + i)];
      }
      std::copy(y.begin(), y.end(), x.begin() + long(h0));
    }
  }

  const ModelConfig& c_;
  const Weights& w_;
  std::vector<std::vector<Vec>> k_, v_;  // [layer][position][Hkv*Dh]
};

// ---- the checks ----------------------------------------------------------------

std::vector<int64_t> tokens(int64_t n, int64_t V, int seed) {
  std::vector<int64_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back((i * 37 + seed * 11 + 5) % V);
  return t;
}

std::vector<Spec> specs() {
  std::vector<Spec> v;
  Spec s;
  // deeper, 6 heads over 2 kv heads, head_dim 12 != D/H, all four attention biases, linear rope
  s = Spec{};
  s.name = "llama-deep-bias-linear";
  s.model_type = "llama";
  s.D = 48, s.F = 96, s.L = 4, s.Hq = 6, s.Hkv = 2, s.Dh = 12, s.V = 97;
  s.attention_bias = true;
  s.rope_scaling = R"({"rope_type": "linear", "factor": 2.5})";
  s.steps = {tokens(6, s.V, 1), tokens(3, s.V, 2), {7}, {8}};
  v.push_back(s);
  // MHA qwen2 with dynamic NTK growing past max_position_embeddings = 8, a
  // sliding window of 3, tied head, bfloat16 checkpoint
  s = Spec{};
  s.name = "qwen2-dynamic-window-bf16";
  s.model_type = "qwen2";
  s.D = 32, s.F = 64, s.L = 3, s.Hq = 4, s.Hkv = 4, s.V = 64, s.max_pos = 8;
  s.rope_scaling = R"({"type": "dynamic", "factor": 2.0})";
  s.sliding_window = 3;
  s.tie = true;
  s.wdtype = DType::BF16;
  s.steps = {tokens(5, s.V, 3), tokens(4, s.V, 4), {9}, {10}};
  v.push_back(s);
  // qwen3 MQA (8 query heads, 1 kv head), head_dim 16 with D 32, yarn with
  // original_max_position_embeddings and mscale, sliding window 5
  s = Spec{};
  s.name = "qwen3-mqa-yarn";
  s.model_type = "qwen3";
  s.D = 32, s.F = 80, s.L = 2, s.Hq = 8, s.Hkv = 1, s.Dh = 16, s.V = 50, s.max_pos = 64;
  s.rope_scaling =
      R"({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5})";
  s.sliding_window = 5;
  s.tie = true;
  s.steps = {tokens(7, s.V, 5), tokens(2, s.V, 6), {11}};
  v.push_back(s);
  // llama3 rope with frequencies in the smoothed band, float16 checkpoint
  s = Spec{};
  s.name = "llama3-band-f16";
  s.model_type = "llama";
  s.D = 32, s.F = 64, s.L = 2, s.Hq = 4, s.Hkv = 2, s.Dh = 16, s.V = 40, s.max_pos = 256;
  s.rope_scaling =
      R"({"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64})";
  s.wdtype = DType::F16;
  s.steps = {tokens(6, s.V, 7), {3}, {4}};
  v.push_back(s);
  // mistral: sliding window 4, yarn with an explicit attention_factor
  s = Spec{};
  s.name = "mistral-window-yarn";
  s.model_type = "mistral";
  s.D = 32, s.F = 48, s.L = 3, s.Hq = 4, s.Hkv = 2, s.Dh = 8, s.V = 30, s.max_pos = 32;
  s.rope_scaling = R"({"rope_type": "yarn", "factor": 3.0, "attention_factor": 0.9})";
  s.sliding_window = 4;
  s.steps = {tokens(9, s.V, 8), tokens(3, s.V, 9), {2}};
  v.push_back(s);
  // dynamic rope that grows already in the first call
  s = Spec{};
  s.name = "llama-dynamic-prefill";
  s.model_type = "llama";
  s.D = 32, s.F = 64, s.L = 2, s.Hq = 2, s.Hkv = 1, s.V = 32, s.max_pos = 6;
  s.rope_scaling = R"({"rope_type": "dynamic", "factor": 3.0})";
  s.steps = {tokens(10, s.V, 10), {5}};
  v.push_back(s);
  return v;
}

// max |ref - reference| / max(1, max |reference|) over every checked site.
double worst_relative(const MemoryDump& ref, const std::vector<std::map<std::string, Vec>>& want, std::string& where) {
  double worst = 0;
  for (const auto& step : want)
    for (const auto& [name, v] : step) {
      EXPECT_TRUE(ref.has(name)) << name;
      if (!ref.has(name)) continue;
      TensorData t = ref.get(name);
      EXPECT_EQ(size_t(t.numel()), v.size()) << name;
      if (size_t(t.numel()) != v.size()) continue;
      double scale = 1, err = 0;
      for (size_t i = 0; i < v.size(); ++i) {
        scale = std::max(scale, std::fabs(v[i]));
        err = std::max(err, std::fabs(double(t.f[i]) - v[i]));
      }
      if (std::isnan(err) || err / scale > worst) {
        worst = std::isnan(err) ? INFINITY : err / scale;
        where = name;
      }
    }
  return worst;
}

class RefSynthetic : public ::testing::TestWithParam<Spec> {};

TEST_P(RefSynthetic, AgreesWithADoublePrecisionReStatement) {
  const Spec& sp = GetParam();
  ModelDir dir(sp.name);
  const Weights W = write_model(sp, dir.path);
  Model model = Model::load(dir.path);
  ASSERT_EQ(model.config.head_dim, sp.head_dim());

  Reference reference(model.config, W);
  std::vector<std::map<std::string, Vec>> want;
  for (size_t s = 0; s < sp.steps.size(); ++s) want.push_back(reference.forward(sp.steps[s], int(s)));

  Scenario sc;
  sc.steps = sp.steps;
  // float64 truth mode: only the float32 rounding of the reported values
  // (2^-24 relative); float32: float32 arithmetic through a few layers;
  // float16 / bfloat16: their own precision.
  const std::vector<std::pair<ComputeDType, double>> modes = {
      {ComputeDType::Float64, 2e-7}, {ComputeDType::Float32, 1e-5}, {ComputeDType::Float16, 2e-2},
      {ComputeDType::BFloat16, 1.5e-1}};
  for (const auto& [dtype, tol] : modes) {
    ref::RefOptions opt;
    opt.threads = 1;  // as HF produced the goldens
    opt.dtype = dtype;
    auto engine = ref::make_ref_engine(model, opt);
    MemoryDump mem;
    run_scenario(*engine, sc, mem);
    std::string where;
    const double worst = worst_relative(mem, want, where);
    EXPECT_LE(worst, tol) << sp.name << " " << compute_dtype_name(dtype) << " at " << where;
    std::printf("[ref vs double re-statement] %-26s %-8s worst %-30s %.3g (tolerance %.3g)\n", sp.name.c_str(),
                compute_dtype_name(dtype), where.c_str(), worst, tol);
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, RefSynthetic, ::testing::ValuesIn(specs()),
                         [](const ::testing::TestParamInfo<Spec>& info) {
                           std::string n = info.param.name;
                           for (char& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// Dynamic NTK is stateful in HF (dynamic_rope_update): the rotary module of
// the model grows its frequencies to the longest call past
// max_position_embeddings, keeps them for shorter calls, and returns to the
// original ones for a call shorter than max_position_embeddings. reset() is a
// fresh DynamicCache on the same model, so that state persists across it.
TEST(RefDynamicRope, GrowsAndReturnsLikeTheRotaryModule) {
  Spec sp = specs()[1];  // qwen2, dynamic factor 2, max_position_embeddings 8, head_dim 8
  ModelDir dir(sp.name + "-state");
  write_model(sp, dir.path);
  Model model = Model::load(dir.path);
  ref::RefOptions opt;
  opt.threads = 1;  // as HF produced the goldens
  auto engine = ref::make_ref_engine(model, opt);
  auto inv_freq_of_call = [&](int64_t n) {
    engine->reset();
    MemoryDump mem;
    engine->forward(tokens(n, sp.V, 1), 0, mem);
    return mem.get("rope.inv_freq").f;
  };
  // base * ((factor * seq_len / max_pos) - (factor - 1))^(dim / (dim - 2))
  auto expected = [&](double seq_len) {
    std::vector<float> f;
    const double base = model.config.rope_theta * std::pow(2.0 * seq_len / 8 - 1, 8.0 / 6.0);
    for (int i = 0; i < 4; ++i) f.push_back(float(std::pow(base, -double(2 * i) / 8)));
    return f;
  };
  auto near = [](const std::vector<float>& a, const std::vector<float>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (std::fabs(a[i] - b[i]) > 2e-6 * std::fabs(b[i])) return false;
    return true;
  };
  const std::vector<float> original = inv_freq_of_call(3);
  EXPECT_TRUE(near(original, expected(8)));   // seq_len <= 8: the plain frequencies
  EXPECT_TRUE(near(inv_freq_of_call(12), expected(12)));  // grown to 12
  EXPECT_TRUE(near(inv_freq_of_call(10), expected(12)));  // 8 < 10 <= 12: kept
  EXPECT_FALSE(near(inv_freq_of_call(10), expected(10)));
  EXPECT_EQ(inv_freq_of_call(5), original);                // 5 < 8: back to the original
  EXPECT_TRUE(near(inv_freq_of_call(10), expected(10)));  // grows again from 8
  // A new engine is a freshly loaded model.
  engine = ref::make_ref_engine(model, opt);
  EXPECT_TRUE(near(inv_freq_of_call(9), expected(9)));
}

// Weights are used in place from the mmap when their dtype is the compute
// dtype; a conversion makes one copy.
long rss_anon_kb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("RssAnon:", 0) == 0) return std::stol(line.substr(8));
  return -1;
}

TEST(RefEngineWeights, UsedInPlaceWithoutACopy) {
  if (rss_anon_kb() < 0) GTEST_SKIP() << "no RssAnon in /proc/self/status";
  Spec sp;
  sp.name = "llama-big-vocab";
  sp.model_type = "llama";
  sp.D = 256, sp.F = 64, sp.L = 1, sp.Hq = 4, sp.Hkv = 4, sp.V = 32768;  // 32 MiB embedding + 32 MiB head
  ModelDir dir(sp.name);
  write_model(sp, dir.path);
  Model model = Model::load(dir.path);
  const long weight_kb = long(model.weights->total_bytes() / 1024);
  ref::RefOptions opt;
  opt.threads = 1;  // as HF produced the goldens
  opt.dtype = ComputeDType::Float32;
  // Weights are converted as the forward calls reach them.
  NullObserver none;
  { ref::make_ref_engine(model, opt)->forward({1, 2}, 0, none); }
  const long before = rss_anon_kb();
  auto in_place = ref::make_ref_engine(model, opt);
  in_place->forward({1, 2}, 0, none);
  const long in_place_kb = rss_anon_kb() - before;
  opt.dtype = ComputeDType::Float64;
  auto converted = ref::make_ref_engine(model, opt);
  converted->forward({1, 2}, 0, none);
  const long converted_kb = rss_anon_kb() - before - in_place_kb;
  std::printf("[weights] %ld KiB of weights: +%ld KiB anonymous memory in place (float32), +%ld KiB converted (float64)\n",
              weight_kb, in_place_kb, converted_kb);
  EXPECT_LT(in_place_kb, weight_kb / 10);
  // float64: the lm_head (half the weights) converted once at twice its bytes;
  // the embedding is read a row at a time.
  EXPECT_GT(converted_kb, weight_kb * 9 / 10);
}

}  // namespace
}  // namespace llmdiff
