// RefLocalOracle::changed_projection: a projection recomputed from a dump's
// own values with one change an engine makes by mistake (compare/local_error.h
// ProjectionChange): its weight's memory read as [in, out] instead of HF's
// [out, in], or the RMSNorm before it skipped. Plain float64 loops over the
// mapped weight, a block of its rows at a time; no libtorch.
#include <algorithm>
#include <cstring>

#include "bisect/pipeline.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sites.h"

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

// The dump's own [T, in] values at `name`; for attn_residual, which an
// engine recorded at module boundaries does not hold, the layer's input plus
// attn.out. Empty when it has neither.
std::vector<float> own_input(const TensorSource& dump, const CanonName& cn, const std::string& name, int64_t in,
                             int64_t& T) {
  auto rows = [&](const std::string& n) {
    if (!dump.has(n)) return std::vector<float>{};
    const TensorData x = dump.get(n);
    if (x.is_int || x.shape.size() != 2 || x.shape[1] != in) return std::vector<float>{};
    T = x.shape[0];
    return x.f;
  };
  std::vector<float> x = rows(name);
  if (!x.empty() || parse_name(name).site != "attn_residual") return x;
  std::vector<float> a = rows(layer_input_name(cn.step, cn.layer)), b = rows(layer_name(cn.step, cn.layer, "attn.out"));
  if (a.empty() || a.size() != b.size()) return {};
  for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  return a;
}

// x . w over n in float64, in four partial sums (vectorised; the order moves
// a float64 sum by ~1e-16 of its terms, far below what a signature judges).
double dot_f64(const float* x, const float* w, int64_t n) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) s[k] += double(x[i + k]) * double(w[i + k]);
  for (; i < n; ++i) s[0] += double(x[i]) * double(w[i]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

}  // namespace

std::optional<std::vector<float>> RefLocalOracle::changed_projection(const TensorSource& dump, const std::string& name,
                                                                     compare::ProjectionChange change,
                                                                     int64_t max_rows) const {
  const CanonName cn = parse_name(name);
  const ModelWeights& mw = *model_.weights;
  const int L = int(mw.layers.size());
  // The projection and the name of its input.
  std::optional<Projection> p;
  std::string in_name;
  if (cn.kind == CanonName::Kind::Step && cn.site == "logits") {
    p = Projection{"final_norm", mw.lm_head_tied || !mw.lm_head ? &mw.embed : &mw.lm_head, nullptr};
    in_name = step_name(cn.step, "final_norm");
  } else if (cn.kind == CanonName::Kind::Layer && cn.layer >= 0 && cn.layer < L) {
    p = projection(model_.config, mw.layers[size_t(cn.layer)], cn.site);
    if (p) in_name = layer_name(cn.step, cn.layer, p->input);
  }
  if (!p || !*p->weight || p->weight->shape.size() != 2 || !dump.has(name)) return std::nullopt;
  const int64_t out = p->weight->shape[0], in = p->weight->shape[1];
  bool transposed = false;
  switch (change) {
    case compare::ProjectionChange::TransposedWeight: transposed = true; break;
    case compare::ProjectionChange::NormSkipped:
      // The norm's own input in place of its output.
      if (p->input == "attn_norm")
        in_name = layer_input_name(cn.step, cn.layer);
      else if (p->input == "mlp_norm")
        in_name = layer_name(cn.step, cn.layer, "attn_residual");
      else if (p->input == "final_norm" && L > 0)
        in_name = layer_name(cn.step, L - 1, "out");
      else if (p->input == "attn.q_a_norm")
        in_name = layer_name(cn.step, cn.layer, "attn.q_a");
      else
        return std::nullopt;
      break;
  }
  int64_t T = 0;
  const std::vector<float> x = own_input(dump, cn, in_name, in, T);
  if (x.empty() || dump.shape(name) != Shape{T, out}) return std::nullopt;
  const int64_t R = std::min(T, std::max<int64_t>(1, max_rows));
  std::vector<float> b;
  if (p->bias && *p->bias) {
    b.resize(size_t(out));
    p->bias->rows_f32(0, 1, b.data());
  }
  std::vector<double> acc(static_cast<size_t>(R * out), 0.0);  // [R, out]
  if (transposed) {  // y[t] = x[t] M, HF's [out, in] data read as M[in][out]
    std::vector<float> w(size_t(out * in));
    p->weight->rows_f32(0, out, w.data());
    for (int64_t i = 0; i < in; ++i) {  // M read once, each of its rows for every row of x
      const float* m = w.data() + i * out;
      for (int64_t t = 0; t < R; ++t) {
        const double xi = x[size_t(t * in + i)];
        double* a = acc.data() + t * out;
        for (int64_t o = 0; o < out; ++o) a[o] += xi * m[o];
      }
    }
  } else {  // y[t][o] = x[t] . W[o], 16 MiB of W's rows at a time
    const int64_t block = std::max<int64_t>(1, (int64_t(16) << 20) / (in * int64_t(sizeof(float))));
    std::vector<float> w(size_t(std::min(block, out) * in));
    for (int64_t o0 = 0; o0 < out; o0 += block) {
      const int64_t n = std::min(block, out - o0);
      p->weight->rows_f32(o0, n, w.data());
      for (int64_t o = 0; o < n; ++o) {  // a row of W from cache for every row of x
        const float* row = w.data() + o * in;
        for (int64_t t = 0; t < R; ++t) acc[size_t(t * out + o0 + o)] = dot_f64(x.data() + t * in, row, in);
      }
    }
  }
  std::vector<float> y(size_t(R * out));
  for (int64_t t = 0; t < R; ++t)
    for (int64_t o = 0; o < out; ++o)
      y[size_t(t * out + o)] = float(acc[size_t(t * out + o)] + (b.empty() ? 0.0 : b[size_t(o)]));
  return y;
}

}  // namespace llmdiff::bisect
