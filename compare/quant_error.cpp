#include "compare/quant_error.h"

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

std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3e", v);
  return buf;
}

}  // namespace

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
