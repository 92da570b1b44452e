#include "bisect/ggml_rounding.h"

#include <cmath>

#include "dumps/base/errors.h"
#include "dumps/contract/precision.h"
#include "dumps/contract/sites.h"

namespace llmdiff::bisect {

namespace {

// An op ggml computes in the cache's type: the scores (q times the cache),
// the probabilities and the context (the probabilities times V), and
// attn.out when its recompute ran attention itself (an engine that never
// materialises ctx, e.g. ggml's flash attention).
bool attention_product(const compare::LocalSite& s) {
  const std::string& site = s.parsed.site;
  return site == site_name(Site::AttnScores) || site == site_name(Site::AttnProbs) ||
         site == site_name(Site::AttnCtx) ||
         (site == site_name(Site::AttnOut) &&
          s.source.find(std::string(site_name(Site::AttnCtx)) + "*") != std::string::npos);
}

}  // namespace

std::optional<compare::KvCacheRounding> kv_cache_rounding(const compare::LocalReport& local) {
  compare::KvCacheRounding k;
  bool found = false;
  for (const compare::LocalSite& s : local.sites)
    if (s.stored_as) {
      k.stored_as = *s.stored_as;
      found = true;
      break;
    }
  if (!found) return std::nullopt;
  k.failing = local.failing();
  k.fused = true;  // no attention probabilities in the dump: a fused (flash) attention
  for (const compare::LocalSite& s : local.sites)
    if (s.parsed.site == site_name(Site::AttnProbs) || s.parsed.site == site_name(Site::AttnScores)) k.fused = false;
  const compare::LocalSite* first = local.first();
  if (!first) return k;
  const double u = std::ldexp(1.0, k.stored_as == ComputeDType::BFloat16 ? -8 : -11);  // unit roundoff
  for (const compare::LocalSite& s : local.sites) {
    if (s.pass) continue;
    if (!attention_product(s) || !s.shape_match || !s.noise.finite || s.noise.cand_rmse > 8 * u * s.noise.truth_rms)
      return k;
  }
  k.products_only = true;
  k.first_product = first->name;
  k.product_rmse = first->noise.cand_rmse;
  k.product_relative = first->noise.cand_rmse / std::max(first->noise.truth_rms, 1e-300);
  return k;
}

std::optional<compare::RoundingProbe> probe_ggml_rounding(const ModelOracles& m, const TensorSource& cand,
                                                          const compare::BisectResult& r) {
  const std::optional<std::string> focus = r.first_local_failure();
  if (!focus) return std::nullopt;
  bool quantised = false;
  for (const LayerWeights& L : m.model.weights->layers)
    for (const WeightView* v : L.views()) quantised = quantised || v->quant != GgmlType::F32;
  if (!quantised) return std::nullopt;
  PrecisionProfile p = PrecisionProfile::parse("matmul_input=ggml");
  if (r.local.ran)
    for (const compare::LocalSite& s : r.local.sites)
      if (s.stored_as) p.kv_cache = *s.stored_as == ComputeDType::BFloat16 ? GgmlType::BF16 : GgmlType::F16;
  try {
    const ImplHypothesisRunner ggml(m.model, m.threads, p);
    const std::unique_ptr<MemoryDump> rounded = ggml.run(compare::Hypothesis{}, r.scenario, {*focus});
    const std::unique_ptr<MemoryDump> plain = m.reference.run(r.scenario, ComputeDType::Float32, {*focus});
    if (!rounded->has(*focus) || !plain->has(*focus)) return std::nullopt;
    const TensorData c = cand.get(*focus), g = rounded->get(*focus), f = plain->get(*focus);
    if (c.is_int || c.shape != g.shape || c.shape != f.shape) return std::nullopt;
    const std::vector<float> cv = c.floats(), gv = g.floats(), fv = f.floats();
    compare::RoundingProbe probe;
    probe.profile = p.json();
    probe.flags = p.str();
    probe.at = *focus;
    probe.to_profile = compare::rmse(cv.data(), gv.data(), c.numel());
    probe.to_plain = compare::rmse(cv.data(), fv.data(), c.numel());
    return probe;
  } catch (const Error&) {
    return std::nullopt;
  }
}

}  // namespace llmdiff::bisect
