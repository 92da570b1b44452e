#include "compare/quant_error.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "dumps/contract/names.h"
#include "dumps/contract/sites.h"

namespace llmdiff::compare {

namespace {

struct Sums {
  int names = 0;
  double n = 0, src_sq = 0, quant_sq = 0;
  double cand_n = 0, cand_sq = 0;
};

constexpr size_t kExpertsShown = 8;  // expert rows per layer in the text table

std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3e", v);
  return buf;
}

// A MoE site of one (step, layer) in a run, or empty when the run lacks it.
TensorData moe_site(const TensorSource& run, const CanonName& c, const std::string& site) {
  const std::string name = layer_name(c.step, c.layer, site);
  return run.has(name) ? run.get(name) : TensorData{};
}

// The routing and per-expert rows: every step's moe.topk_ids [T, K] of each
// layer, the rows of moe.expert_out [T, K, D] matched by expert id.
void add_moe_rows(QuantErrorReport& r, const TensorSource& src, const TensorSource& quant, const TensorSource& cand) {
  struct ExpertSums {
    int rows = 0;
    double src_sq = 0, quant_sq = 0, n = 0, cand_sq = 0, cand_n = 0;
  };
  std::map<int, QuantRoutingRow> routing;
  std::map<std::pair<int, int>, ExpertSums> experts;
  for (const std::string& name : src.names()) {
    const CanonName c = parse_name(name);
    if (c.kind != CanonName::Kind::Layer || c.site != "moe.topk_ids" || !quant.has(name)) continue;
    const TensorData si = src.get(name), qi = quant.get(name);
    if (!si.is_int || si.shape != qi.shape || si.shape.size() != 2) continue;
    const TensorData ci = cand.has(name) ? cand.get(name) : TensorData{};
    const bool cand_ids = ci.is_int && ci.shape == si.shape;
    const TensorData so = moe_site(src, c, "moe.expert_out"), qo = moe_site(quant, c, "moe.expert_out");
    const TensorData co = moe_site(cand, c, "moe.expert_out");
    const TensorData sp = moe_site(src, c, "moe.router_probs"), qp = moe_site(quant, c, "moe.router_probs");
    const int64_t T = si.shape[0], K = si.shape[1];
    const bool outs = so.shape.size() == 3 && so.shape == qo.shape && so.shape[0] == T && so.shape[1] == K;
    const bool cand_outs = outs && cand_ids && co.shape == so.shape;
    const bool probs = sp.shape.size() == 2 && sp.shape == qp.shape && sp.shape[0] == T;
    const int64_t D = outs ? so.shape[2] : 0;
    QuantRoutingRow& rr = routing[c.layer];
    rr.layer = c.layer;
    if (cand_ids && rr.cand_changed < 0) rr.cand_changed = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t* s_ids = &si.i[size_t(t * K)];
      const int64_t* q_ids = &qi.i[size_t(t * K)];
      const int64_t* c_ids = cand_ids ? &ci.i[size_t(t * K)] : nullptr;
      auto slot = [K](const int64_t* ids, int64_t e) { return int64_t(std::find(ids, ids + K, e) - ids); };
      ++rr.tokens;
      bool changed = false;
      for (int64_t k = 0; k < K; ++k) changed = changed || slot(q_ids, s_ids[k]) == K;
      if (changed) {
        ++rr.changed;
        if (probs)
          for (int64_t e = 0; e < sp.shape[1]; ++e)
            rr.score_shift = std::max(rr.score_shift, std::fabs(double(qp.f[size_t(t * sp.shape[1] + e)]) -
                                                                double(sp.f[size_t(t * sp.shape[1] + e)])));
      }
      if (c_ids) {
        bool cc = false;
        for (int64_t k = 0; k < K; ++k) cc = cc || slot(c_ids, s_ids[k]) == K;
        rr.cand_changed += cc ? 1 : 0;
      }
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = s_ids[k], kq = slot(q_ids, e);
        if (kq == K) continue;  // routed elsewhere on the quantised weights
        ExpertSums& g = experts[{c.layer, int(e)}];
        ++g.rows;
        if (!outs) continue;
        const float* a = &so.f[size_t((t * K + k) * D)];
        const float* b = &qo.f[size_t((t * K + kq) * D)];
        for (int64_t d = 0; d < D; ++d) {
          g.src_sq += double(a[d]) * double(a[d]);
          g.quant_sq += (double(b[d]) - double(a[d])) * (double(b[d]) - double(a[d]));
        }
        g.n += double(D);
        const int64_t kc = c_ids ? slot(c_ids, e) : K;
        if (!cand_outs || kc == K) continue;
        const float* x = &co.f[size_t((t * K + kc) * D)];
        for (int64_t d = 0; d < D; ++d) g.cand_sq += (double(x[d]) - double(a[d])) * (double(x[d]) - double(a[d]));
        g.cand_n += double(D);
      }
    }
  }
  for (const auto& [layer, rr] : routing) r.routing.push_back(rr);
  for (const auto& [key, g] : experts) {
    QuantExpertRow e;
    e.layer = key.first;
    e.expert = key.second;
    e.rows = g.rows;
    if (g.n > 0) {
      e.source_rms = std::sqrt(g.src_sq / g.n);
      e.quant_rmse = std::sqrt(g.quant_sq / g.n);
    }
    if (g.cand_n > 0) e.cand_rmse = std::sqrt(g.cand_sq / g.cand_n);
    r.experts.push_back(e);
  }
}

}  // namespace

void add_expert_weight_errors(QuantErrorReport& r, const ModelWeights& source, const ModelWeights& quantised) {
  std::vector<float> a, b;
  for (QuantExpertRow& e : r.experts) {
    if (size_t(e.layer) >= source.layers.size() || size_t(e.layer) >= quantised.layers.size()) continue;
    const LayerWeights &ls = source.layers[size_t(e.layer)], &lq = quantised.layers[size_t(e.layer)];
    if (size_t(e.expert) >= ls.experts.size() || size_t(e.expert) >= lq.experts.size()) continue;
    const MlpWeights &ms = ls.experts[size_t(e.expert)], &mq = lq.experts[size_t(e.expert)];
    double sq = 0, diff = 0;
    e.types.clear();
    for (auto part : {&MlpWeights::gate, &MlpWeights::up, &MlpWeights::down}) {
      const WeightView &vs = ms.*part, &vq = mq.*part;
      if (vs.shape != vq.shape) return;
      a.resize(size_t(vs.numel()));
      b.resize(a.size());
      vs.rows_f32(0, vs.rows(), a.data());
      vq.rows_f32(0, vq.rows(), b.data());
      for (size_t i = 0; i < a.size(); ++i) {
        sq += double(a[i]) * double(a[i]);
        diff += (double(b[i]) - double(a[i])) * (double(b[i]) - double(a[i]));
      }
      const std::string type = vq.quantized() ? ggml_type_name(uint32_t(vq.quant)) : dtype_name(vq.dtype);
      e.types += (e.types.empty() ? "" : " ") + type;
    }
    e.weight_rel = sq > 0 ? std::sqrt(diff / sq) : 0;
  }
}

QuantErrorReport quantisation_error(const TensorSource& source_truth, const TensorSource& quantised_truth,
                                    const TensorSource& cand) {
  QuantErrorReport r;
  r.source = source_truth.label();
  r.quantised = quantised_truth.label();
  std::map<int, Sums> groups;  // layer -> sums; -1: next_logits
  for (const std::string& name : source_truth.names()) {
    const CanonName c = parse_name(name);
    int group;
    if (c.kind == CanonName::Kind::Layer && c.site == site_name(Site::Out)) group = c.layer;
    else if (c.kind == CanonName::Kind::Step && c.site == site_name(Site::NextLogits)) group = -1;
    else continue;
    if (!quantised_truth.has(name)) continue;
    const TensorData s = source_truth.get(name), q = quantised_truth.get(name);
    if (s.shape != q.shape || s.is_int) continue;
    Sums& g = groups[group];
    ++g.names;
    for (size_t i = 0; i < s.f.size(); ++i) {
      const double d = double(q.f[i]) - double(s.f[i]);
      g.src_sq += double(s.f[i]) * double(s.f[i]);
      g.quant_sq += d * d;
    }
    g.n += double(s.f.size());
    if (cand.has(name) && cand.shape(name) == s.shape) {
      const TensorData x = cand.get(name);
      for (size_t i = 0; i < s.f.size(); ++i) {
        const double d = double(x.f[i]) - double(s.f[i]);
        g.cand_sq += d * d;
      }
      g.cand_n += double(s.f.size());
    }
  }
  add_moe_rows(r, source_truth, quantised_truth, cand);
  auto row = [](const std::string& label, int layer, const Sums& g) {
    QuantErrorRow q;
    q.group = label;
    q.layer = layer;
    q.names = g.names;
    q.source_rms = std::sqrt(g.src_sq / g.n);
    q.quant_rmse = std::sqrt(g.quant_sq / g.n);
    q.cand_rmse = g.cand_n > 0 ? std::sqrt(g.cand_sq / g.cand_n) : -1;
    return q;
  };
  for (const auto& [layer, g] : groups)
    if (layer >= 0) r.rows.push_back(row("layer " + std::to_string(layer), layer, g));
  if (groups.count(-1)) r.rows.push_back(row(site_name(Site::NextLogits), -1, groups.at(-1)));
  return r;
}

std::string render_quant_error(const QuantErrorReport& r) {
  std::string s = "Quantisation error, per layer over all steps (RMSE vs the reference on the source weights, "
                  "float64):\n";
  s += "  source     " + r.source + "\n  quantised  " + r.quantised + "\n";
  char line[256];
  std::snprintf(line, sizeof line, "  %-12s %6s %12s %14s %14s %10s\n", "output of", "names", "source rms",
                "quantisation", "candidate", "explained");
  s += line;
  for (const QuantErrorRow& q : r.rows) {
    const std::string cand = q.cand_rmse < 0 ? "-" : fmt(q.cand_rmse);
    const std::string expl = q.cand_rmse <= 0 ? "-" : std::to_string(int(std::lround(100 * q.explained()))) + "%";
    std::snprintf(line, sizeof line, "  %-12s %6d %12s %14s %14s %10s\n", q.group.c_str(), q.names,
                  fmt(q.source_rms).c_str(), fmt(q.quant_rmse).c_str(), cand.c_str(), expl.c_str());
    s += line;
  }
  s += "  (explained = quantisation / candidate: about 100% when the weights' rounding alone accounts for the "
       "candidate's error)\n";
  if (!r.routing.empty()) {
    s += "Routing: tokens sent to other experts than on the source weights (each a near-tie the quantisation "
         "tipped: the source scores closer than the largest score change):\n";
    std::snprintf(line, sizeof line, "  %-12s %8s %14s %14s %14s\n", "layer", "tokens", "quantisation", "candidate",
                  "score change");
    s += line;
    for (const QuantRoutingRow& q : r.routing) {
      const std::string cand = q.cand_changed < 0 ? "-" : std::to_string(q.cand_changed);
      std::snprintf(line, sizeof line, "  %-12s %8d %14d %14s %14s\n", ("layer " + std::to_string(q.layer)).c_str(),
                    q.tokens, q.changed, cand.c_str(), q.changed > 0 ? fmt(q.score_shift).c_str() : "-");
      s += line;
    }
  }
  if (!r.experts.empty()) {
    s += "Per expert, the " + std::to_string(kExpertsShown) +
         " of each layer with the largest relative error (moe.expert_out of the tokens both runs routed to it, "
         "each on its own run's input, so with the error entering the layer; weights: rms of the rounding of gate, "
         "up, down over their rms):\n";
    std::snprintf(line, sizeof line, "  %-8s %6s %6s %-18s %10s %12s %14s %14s\n", "layer", "expert", "tokens",
                  "types", "weights", "source rms", "quantisation", "candidate");
    s += line;
    std::map<int, std::vector<const QuantExpertRow*>> by_layer;
    for (const QuantExpertRow& e : r.experts) by_layer[e.layer].push_back(&e);
    for (auto& [layer, rows] : by_layer) {
      auto rel = [](const QuantExpertRow* e) { return e->source_rms > 0 ? e->quant_rmse / e->source_rms : 0.0; };
      std::stable_sort(rows.begin(), rows.end(), [&](const auto* a, const auto* b) { return rel(a) > rel(b); });
      for (size_t i = 0; i < rows.size() && i < kExpertsShown; ++i) {
        const QuantExpertRow& e = *rows[i];
        const std::string cand = e.cand_rmse < 0 ? "-" : fmt(e.cand_rmse);
        const std::string w = e.weight_rel < 0 ? "-" : fmt(e.weight_rel);
        std::snprintf(line, sizeof line, "  %-8d %6d %6d %-18s %10s %12s %14s %14s\n", e.layer, e.expert, e.rows,
                      e.types.empty() ? "-" : e.types.c_str(), w.c_str(), fmt(e.source_rms).c_str(),
                      fmt(e.quant_rmse).c_str(), cand.c_str());
        s += line;
      }
      if (rows.size() > kExpertsShown)
        s += "  (layer " + std::to_string(layer) + ": " + std::to_string(rows.size() - kExpertsShown) +
             " more experts routed, each with a smaller relative error)\n";
    }
  }
  return s;
}

nlohmann::json quant_error_to_json(const QuantErrorReport& r) {
  nlohmann::json rows = nlohmann::json::array();
  for (const QuantErrorRow& q : r.rows)
    rows.push_back({{"group", q.group},
                    {"layer", q.layer},
                    {"names", q.names},
                    {"source_rms", q.source_rms},
                    {"quant_rmse", q.quant_rmse},
                    {"cand_rmse", q.cand_rmse < 0 ? nlohmann::json(nullptr) : nlohmann::json(q.cand_rmse)},
                    {"explained", q.cand_rmse <= 0 ? nlohmann::json(nullptr) : nlohmann::json(q.explained())}});
  return {{"source", r.source}, {"quantised", r.quantised}, {"rows", rows}};
}

}  // namespace llmdiff::compare
