// RefLocalOracle::transposed_weight: a projection recomputed from a dump's
// own input with its weight's memory read as [in, out] instead of HF's
// [out, in] (for a square matrix: x W instead of x W^T). Plain float64
// loops over the mapped weight: one matrix, no libtorch.
#include <cstring>

#include "bisect/pipeline.h"
#include "dumps/contract/names.h"

namespace llmdiff::bisect {

namespace {

struct Projection {
  std::string input;  // the site it reads
  const WeightView* weight = nullptr;
  const WeightView* bias = nullptr;  // may be absent
};

// The projection computing `site` of layer `L` (nullopt: not a plain projection).
std::optional<Projection> projection(const ModelConfig& cfg, const LayerWeights& L, const std::string& site) {
  const WeightView* none = nullptr;
  auto with = [&](const WeightView& b) { return b ? &b : none; };
  if (cfg.mla.enabled) {
    if (site == "attn.q_a") return Projection{"attn_norm", &L.q_a, none};
    if (site == "attn.q") return Projection{cfg.mla.q_lora_rank > 0 ? "attn.q_a_norm" : "attn_norm", &L.q, none};
    if (site == "attn.kv_a") return Projection{"attn_norm", &L.kv_a, none};
    if (site == "attn.kv") return Projection{"attn.kv_a_norm", &L.kv_b, none};
  } else {
    if (site == "attn.q") return Projection{"attn_norm", &L.q, with(L.q_bias)};
    if (site == "attn.k") return Projection{"attn_norm", &L.k, with(L.k_bias)};
    if (site == "attn.v") return Projection{"attn_norm", &L.v, with(L.v_bias)};
  }
  if (site == "attn.out") return Projection{"attn.ctx", &L.o, with(L.o_bias)};
  if (L.mlp.gate) {
    if (site == "mlp.gate") return Projection{"mlp_norm", &L.mlp.gate, none};
    if (site == "mlp.up") return Projection{"mlp_norm", &L.mlp.up, none};
    if (site == "mlp.down") return Projection{"mlp.act", &L.mlp.down, none};
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::vector<float>> RefLocalOracle::transposed_weight(const TensorSource& dump,
                                                                    const std::string& name) const {
  const CanonName cn = parse_name(name);
  const ModelWeights& mw = *model_.weights;
  if (cn.kind != CanonName::Kind::Layer || cn.layer < 0 || cn.layer >= int(mw.layers.size())) return std::nullopt;
  const std::optional<Projection> p = projection(model_.config, mw.layers[size_t(cn.layer)], cn.site);
  if (!p || !*p->weight || p->weight->shape.size() != 2) return std::nullopt;
  const std::string in_name = layer_name(cn.step, cn.layer, p->input);
  if (!dump.has(in_name) || !dump.has(name)) return std::nullopt;
  const TensorData x = dump.get(in_name);
  const int64_t out = p->weight->shape[0], in = p->weight->shape[1];
  if (x.is_int || x.shape.size() != 2 || x.shape[1] != in || dump.shape(name) != Shape{x.shape[0], out})
    return std::nullopt;
  std::vector<float> w(size_t(out * in));  // HF's [out, in] data, read below as M[in][out]
  p->weight->rows_f32(0, out, w.data());
  std::vector<float> b;
  if (p->bias && *p->bias) {
    b.resize(size_t(out));
    p->bias->rows_f32(0, 1, b.data());
  }
  const int64_t T = x.shape[0];
  std::vector<float> y(size_t(T * out));
  std::vector<double> acc(static_cast<size_t>(out), 0.0);
  for (int64_t t = 0; t < T; ++t) {  // y[t] = x[t] M (+ b)
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t i = 0; i < in; ++i) {
      const double xi = x.f[size_t(t * in + i)];
      const float* m = w.data() + i * out;
      for (int64_t o = 0; o < out; ++o) acc[size_t(o)] += xi * m[o];
    }
    for (int64_t o = 0; o < out; ++o) y[size_t(t * out + o)] = float(acc[size_t(o)] + (b.empty() ? 0.0 : b[size_t(o)]));
  }
  return y;
}

}  // namespace llmdiff::bisect
