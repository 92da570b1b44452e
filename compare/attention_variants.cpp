// The attention variants at attn.ctx (compare/attention_variants.h).
#include "compare/attention_variants.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "compare/metrics.h"
#include "dumps/base/dtype.h"
#include "dumps/contract/sites.h"

namespace llmdiff::compare::sig {

namespace {

enum class Rope { Half, Interleaved, QOnly, KOnly, None, Partial };
enum class Mask { Causal, Later, Earlier, None };
enum class Kv { Normal, Swapped, KeysForBoth, ValuesForBoth };

struct Variant {
  Rope rope = Rope::Half;
  int64_t rotated = 0;      // Partial: R
  bool own_freqs = false;   // Partial: theta^(-2i/R) (else the model's first R/2)
  double scale = 0;         // 0: 1/sqrt(Dh)
  Mask mask = Mask::Causal;
  Kv kv = Kv::Normal;
  bool tiled = false;       // kv head h mod Hkv
  int softmax16 = 0;        // 1: scores rounded to bfloat16, 2: to float16
  std::string kind, words;  // the signature when it reproduces the candidate
  bool over_queries = false;  // the softmax over this call's queries (dim -2), not the keys
};

// One call's attention inputs, the sequence's keys and values up to it.
struct Inputs {
  int64_t T = 0, S = 0, Hq = 0, Hkv = 0, Dh = 0;
  std::vector<float> q;           // [T, Hq*Dh] this call's queries (before RoPE)
  std::vector<float> k, v;        // [S, Hkv*Dh] every call's keys (before RoPE) and values
  std::vector<float> qpos, kpos;  // [T], [S]
  std::vector<float> inv_freq;    // [Dh/2]
  double theta = 10000.0;
};

// HF's rotate-half RoPE of one head's x [Dh] at `pos` (angles pos x inv_freq
// in float32), or the variant's.
void rotate(const float* x, float* out, float pos, const Variant& v, const Inputs& in, bool is_query) {
  const int64_t Dh = in.Dh;
  std::copy(x, x + Dh, out);
  if (v.rope == Rope::None || (v.rope == Rope::QOnly && !is_query) || (v.rope == Rope::KOnly && is_query)) return;
  const int64_t R = v.rope == Rope::Partial ? v.rotated : Dh, half = R / 2;
  std::vector<double> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    const double freq = v.rope == Rope::Partial && v.own_freqs
                            ? double(float(1.0 / std::pow(in.theta, double(2 * i) / double(R))))
                            : double(in.inv_freq[size_t(i)]);
    const double a = double(pos * float(freq));
    c[size_t(i)] = std::cos(a);
    s[size_t(i)] = std::sin(a);
  }
  rotate_pairs(x, out, half, c.data(), s.data(), v.rope == Rope::Interleaved ? Pairing::Interleaved : Pairing::Halves);
}

// attn.ctx [T, Hq*Dh] under the variant, in double.
std::vector<float> attend(const Inputs& in, const Variant& v) {
  const int64_t T = in.T, S = in.S, Hq = in.Hq, Hkv = in.Hkv, Dh = in.Dh, group = Hq / Hkv;
  const std::vector<float>& keys = v.kv == Kv::Swapped || v.kv == Kv::ValuesForBoth ? in.v : in.k;
  const std::vector<float>& values = v.kv == Kv::Swapped || v.kv == Kv::KeysForBoth ? in.k : in.v;
  std::vector<float> kr(keys.size()), qr(static_cast<size_t>(Dh));
  for (int64_t s = 0; s < S; ++s)
    for (int64_t g = 0; g < Hkv; ++g)
      rotate(keys.data() + (s * Hkv + g) * Dh, kr.data() + (s * Hkv + g) * Dh, in.kpos[size_t(s)], v, in, false);
  const double scale = v.scale > 0 ? v.scale : 1.0 / std::sqrt(double(Dh));
  constexpr double kMasked = -std::numeric_limits<double>::infinity();
  std::vector<float> out(size_t(T * Hq * Dh), 0.f);
  std::vector<double> p(static_cast<size_t>(T * S));  // one head's scores, then probabilities [T, S]
  auto round_to = [&](double x) {
    if (v.softmax16 == 1) return double(bf16_to_f32(f32_to_bf16(float(x))));
    if (v.softmax16 == 2) return double(f16_to_f32(f32_to_f16(float(x))));
    return x;
  };
  // exp(x - max) / sum over the n entries at x[0], x[stride], ...; all
  // masked: zeros.
  auto softmax = [&](double* x, int64_t n, int64_t stride) {
    double top = kMasked, sum = 0;
    for (int64_t i = 0; i < n; ++i) top = std::max(top, x[i * stride]);
    for (int64_t i = 0; i < n; ++i) {
      double& e = x[i * stride];
      sum += e = std::isfinite(top) && std::isfinite(e) ? std::exp(e - top) : 0.0;
    }
    for (int64_t i = 0; i < n; ++i) x[i * stride] = sum > 0 ? round_to(x[i * stride] / sum) : 0.0;
  };
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t g = v.tiled ? h % Hkv : h / group;
    for (int64_t t = 0; t < T; ++t) {
      rotate(in.q.data() + (t * Hq + h) * Dh, qr.data(), in.qpos[size_t(t)], v, in, true);
      for (int64_t s = 0; s < S; ++s) {
        const float qp = in.qpos[size_t(t)], kp = in.kpos[size_t(s)];
        const bool allowed = v.mask == Mask::None || (v.mask == Mask::Causal && kp <= qp) ||
                             (v.mask == Mask::Later && kp <= qp + 1) || (v.mask == Mask::Earlier && kp < qp);
        double d = kMasked;
        if (allowed) {
          d = 0;
          const float* k = kr.data() + (s * Hkv + g) * Dh;
          for (int64_t i = 0; i < Dh; ++i) d += double(qr[size_t(i)]) * k[i];
          d = round_to(d * scale);
        }
        p[size_t(t * S + s)] = d;
      }
    }
    if (v.over_queries)
      for (int64_t s = 0; s < S; ++s) softmax(p.data() + s, T, S);
    else
      for (int64_t t = 0; t < T; ++t) softmax(p.data() + t * S, S, 1);
    for (int64_t t = 0; t < T; ++t) {
      float* o = out.data() + (t * Hq + h) * Dh;
      for (int64_t s = 0; s < S; ++s) {
        const double w = p[size_t(t * S + s)];
        if (w == 0) continue;
        const float* val = values.data() + (s * Hkv + g) * Dh;
        for (int64_t i = 0; i < Dh; ++i) o[i] = float(double(o[i]) + w * val[i]);
      }
    }
  }
  return out;
}

std::vector<Variant> variants(const Inputs& in) {
  const std::string dh = std::to_string(in.Dh);
  std::vector<Variant> out;
  auto add = [&](Variant v) { out.push_back(std::move(v)); };
  add({Rope::Interleaved, 0, false, 0, Mask::Causal, Kv::Normal, false, 0, "permutation",
       "RoPE on adjacent pairs (2i, 2i+1) where the model rotates halves (i, i+Dh/2)"});
  add({Rope::QOnly, 0, false, 0, Mask::Causal, Kv::Normal, false, 0, "rope",
       "RoPE applied to q only: the keys are not rotated"});
  add({Rope::KOnly, 0, false, 0, Mask::Causal, Kv::Normal, false, 0, "rope",
       "RoPE applied to k only: the queries are not rotated"});
  add({Rope::None, 0, false, 0, Mask::Causal, Kv::Normal, false, 0, "rope", "no RoPE at all: neither q nor k rotated"});
  for (int64_t R : {in.Dh / 2, in.Dh / 4})
    if (R >= 2 && R % 2 == 0)
      for (bool own : {true, false})
        add({Rope::Partial, R, own, 0, Mask::Causal, Kv::Normal, false, 0, "rotary-width",
             "RoPE on the first R = " + std::to_string(R) + " of " + dh + " dims of each head only (frequencies " +
                 (own ? "theta^(-2i/" + std::to_string(R) + ")" : std::string("the model's first ") +
                                                                       std::to_string(R / 2)) +
                 ", the other dims passed through): a partial rotary width where the model rotates all " + dh});
  add({Rope::Half, 0, false, 1.0, Mask::Causal, Kv::Normal, false, 0, "scale",
       "scores q.k not scaled (the model divides them by sqrt(Dh) = " + num(std::sqrt(double(in.Dh))) + ")"});
  add({Rope::Half, 0, false, 1.0 / double(in.Dh), Mask::Causal, Kv::Normal, false, 0, "scale",
       "scores scaled by 1/Dh = 1/" + dh + " where the model scales by 1/sqrt(Dh)"});
  add({Rope::Half, 0, false, std::sqrt(double(in.Dh)), Mask::Causal, Kv::Normal, false, 0, "scale",
       "scores multiplied by sqrt(Dh) where the model divides by it"});
  add({Rope::Half, 0, false, 0, Mask::Later, Kv::Normal, false, 0, "mask",
       "the causal mask one key late: each query also sees the next position"});
  add({Rope::Half, 0, false, 0, Mask::Earlier, Kv::Normal, false, 0, "mask",
       "the causal mask one key early: each query misses its own position"});
  add({Rope::Half, 0, false, 0, Mask::None, Kv::Normal, false, 0, "mask", "no causal mask: every query sees every key"});
  add({Rope::Half, 0, false, 0, Mask::Causal, Kv::Swapped, false, 0, "alias",
       "keys and values swapped: attention scores against v and sums k"});
  add({Rope::Half, 0, false, 0, Mask::Causal, Kv::KeysForBoth, false, 0, "alias",
       "the keys used as values too (v_proj's output unused)"});
  add({Rope::Half, 0, false, 0, Mask::Causal, Kv::ValuesForBoth, false, 0, "alias",
       "the values used as keys too (k_proj's output unused)"});
  if (in.Hkv > 1 && in.Hkv < in.Hq)
    add({Rope::Half, 0, false, 0, Mask::Causal, Kv::Normal, true, 0, "permutation",
         "query head h reads kv head h mod Hkv (tiled) where the model groups h / (Hq/Hkv)"});
  add({Rope::Half, 0, false, 0, Mask::Causal, Kv::Normal, false, 1, "precision",
       "the softmax of scores rounded to bfloat16 (scores and probabilities)"});
  add({Rope::Half, 0, false, 0, Mask::Causal, Kv::Normal, false, 2, "precision",
       "the softmax of scores rounded to float16 (scores and probabilities)"});
  if (in.T > 1)
    add({Rope::Half, 0, false, 0, Mask::Causal, Kv::Normal, false, 0, "softmax-axis",
         "the softmax taken over the queries of the call (dim -2) where the model normalises over the keys (dim -1); "
         "a key no query of the call sees weighs 0",
         true});
  return out;
}

// The positions of step `s`: the dumps' step{s}.positions, else `next`, ...
std::optional<std::vector<float>> positions(const TensorSource& cand, const TensorSource& ref, int s, int64_t T,
                                            int64_t next) {
  const std::string name = step_name(s, "positions");
  const TensorSource* src = cand.has(name) ? &cand : ref.has(name) ? &ref : nullptr;
  std::vector<float> p;
  if (src) {
    const TensorData d = src->get(name);
    if (d.numel() != T) return std::nullopt;
    p = d.floats();
  } else {
    for (int64_t t = 0; t < T; ++t) p.push_back(float(next + t));
  }
  return p;
}

std::optional<Inputs> gather(const Found& f, const TensorData& c, const TensorSource& cand, const TensorSource& ref,
                             const ModelConfig& cfg) {
  const int step = f.cn.step, layer = f.cn.layer;
  Inputs in;
  in.Hq = cfg.num_attention_heads;
  in.Hkv = cfg.num_key_value_heads;
  in.Dh = cfg.head_dim;
  in.theta = cfg.rope_theta;
  if (in.Hq <= 0 || in.Hkv <= 0 || in.Dh < 2 || in.Dh % 2 || in.Hq % in.Hkv || c.shape.size() != 2 ||
      c.shape[1] != in.Hq * in.Dh)
    return std::nullopt;
  in.T = c.shape[0];
  // HF's inv_freq: the dumps', else theta's (a rope_scaling changes it and
  // may scale cos/sin: only from the dumps then).
  const TensorSource* inv = ref.has("rope.inv_freq") ? &ref : cand.has("rope.inv_freq") ? &cand : nullptr;
  if (inv) {
    in.inv_freq = inv->get("rope.inv_freq").floats();
  } else if (cfg.rope_scaling.type == RopeScaling::Type::Default) {
    for (int64_t i = 0; i < in.Dh / 2; ++i)
      in.inv_freq.push_back(float(1.0 / std::pow(cfg.rope_theta, double(float(2 * i) / float(in.Dh)))));
  }
  if (int64_t(in.inv_freq.size()) != in.Dh / 2 || cfg.rope_scaling.type == RopeScaling::Type::Yarn) return std::nullopt;
  const bool qk_norm = model_has_site(cfg, layer, Site::AttnQNorm);
  const std::string q_site = qk_norm ? "attn.q_norm" : "attn.q", k_site = qk_norm ? "attn.k_norm" : "attn.k";
  const int64_t kv_width = in.Hkv * in.Dh;
  int64_t next = 0;
  for (int s = 0; s <= step; ++s) {
    const std::string kn = layer_name(s, layer, k_site), vn = layer_name(s, layer, "attn.v");
    if (!cand.has(kn) || !cand.has(vn)) return std::nullopt;
    const TensorData k = cand.get(kn), v = cand.get(vn);
    if (k.is_int || v.is_int || k.shape.size() != 2 || k.shape != v.shape || k.shape[1] != kv_width || !k.rows.empty())
      return std::nullopt;
    const int64_t T = k.shape[0];
    const std::optional<std::vector<float>> p = positions(cand, ref, s, T, next);
    // A contiguous sequence: each call continues after the last (no
    // padding, rollback or ring to model).
    if (!p || (*p)[0] != float(next)) return std::nullopt;
    for (int64_t t = 0; t < T; ++t)
      if ((*p)[size_t(t)] != float(next + t)) return std::nullopt;
    in.k.insert(in.k.end(), k.f.begin(), k.f.end());
    in.v.insert(in.v.end(), v.f.begin(), v.f.end());
    in.kpos.insert(in.kpos.end(), p->begin(), p->end());
    if (s == step) {
      const std::string qn = layer_name(s, layer, q_site);
      if (!cand.has(qn) || T != in.T) return std::nullopt;
      const TensorData q = cand.get(qn);
      if (q.is_int || q.shape != Shape{in.T, in.Hq * in.Dh}) return std::nullopt;
      in.q = q.f;
      in.qpos = *p;
    }
    next += T;
  }
  in.S = next;
  return in;
}

}  // namespace

void find_attention_variant(Found& f, const TensorData& c, const TensorSource& cand, const TensorSource& ref,
                            const std::optional<ModelConfig>& cfg) {
  if (f.cn.kind != CanonName::Kind::Layer || f.cn.site != "attn.ctx" || !cfg || cfg->mla.enabled) return;
  const std::optional<Inputs> in = gather(f, c, cand, ref, *cfg);
  if (!in) return;
  const int64_t n = int64_t(c.f.size());
  // HF's attention on the candidate's own q, k, v: when it gives the
  // candidate's context, what is wrong is not inside attention.
  if (f.close(c.f.data(), attend(*in, Variant{}).data(), n)) return;
  for (const Variant& v : variants(*in)) {
    const std::vector<float> y = attend(*in, v);
    if (!f.close(c.f.data(), y.data(), n)) continue;
    f.add_recomputed(v.kind, "attn.ctx recomputed from the candidate's own q, k and v reproduces it (rmse " +
                               num(rmse(c.f.data(), y.data(), n)) + "; " + num(f.err) + " against the reference) with " +
                               v.words);
    return;
  }
}

}  // namespace llmdiff::compare::sig
