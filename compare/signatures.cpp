#include "compare/signatures.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "compare/metrics.h"
#include "compare/attention_variants.h"
#include "compare/signature_finders.h"
#include "compare/noise_floor.h"
#include "dumps/base/dtype.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sites.h"

namespace llmdiff::compare {

namespace sig {

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

std::optional<Heads> heads_of(const std::string& site, const Shape& shape, const std::optional<ModelConfig>& cfg) {
  if (shape.size() == 3 && site.rfind("attn.", 0) == 0) return Heads{shape[0], shape[1] * shape[2], 1, shape[2]};
  if (shape.size() == 2 && cfg && (site == "attn.q" || site == "attn.k" || site == "attn.v" || site == "attn.ctx" ||
                                   site == "attn.q_norm" || site == "attn.k_norm")) {
    const int64_t H = site == "attn.q" || site == "attn.ctx" || site == "attn.q_norm" ? cfg->num_attention_heads
                                                                                     : cfg->num_key_value_heads;
    if (H > 0 && shape[1] % H == 0) return Heads{H, shape[1] / H, shape[0], shape[1] / H};
  }
  return std::nullopt;
}

void Found::add(const std::string& kind, const std::string& detail, double left) {
  ErrorSignature s;
  s.name = name;
  s.kind = kind;
  s.detail = detail;
  s.fit = err > 0 ? left / err : 0.0;
  s.decisive = left <= tol * scale;
  out.push_back(s);
}

void Found::add_decisive(const std::string& kind, const std::string& detail) {
  ErrorSignature s;
  s.name = name;
  s.kind = kind;
  s.detail = detail;
  s.fit = 0;
  s.decisive = true;
  out.push_back(s);
}

void Found::add_recomputed(const std::string& kind, const std::string& detail) {
  add_decisive(kind, detail);
  out.back().recomputed = true;
}

bool Found::close(const float* a, const float* b, int64_t n) const {
  return rmse(a, b, n) <= tol * std::max(rms(b, n), 1e-30);
}

bool Found::has_decisive() const {
  return std::any_of(out.begin(), out.end(), [](const ErrorSignature& s) { return s.decisive; });
}

// Named forms of a factor: "sqrt(Dh)", ...
std::string recognise_factor(double c, const std::optional<ModelConfig>& cfg, double rel) {
  if (!cfg) return "";
  const double D = double(cfg->hidden_size);
  const double dh = double(cfg->mla.enabled ? cfg->mla.qk_head_dim() : cfg->head_dim);
  const std::vector<std::pair<std::string, double>> forms = {
      {"sqrt(Dh)", std::sqrt(dh)}, {"1/sqrt(Dh)", 1.0 / std::sqrt(dh)}, {"Dh", dh}, {"1/Dh", 1.0 / dh},
      {"sqrt(D)", std::sqrt(D)},   {"1/sqrt(D)", 1.0 / std::sqrt(D)},   {"-1", -1.0}, {"2", 2.0}, {"1/2", 0.5}};
  for (const auto& [label, v] : forms)
    if (std::fabs(c / v - 1.0) < rel) return label;
  return "";
}

}  // namespace sig

namespace {

using namespace sig;

std::string recognise(double c, const std::optional<ModelConfig>& cfg) { return recognise_factor(c, cfg, 1e-3); }

}  // namespace

double fit_scale(const float* a, const float* b, int64_t n) {
  double num_ = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num_ += double(a[i]) * b[i];
    den += double(b[i]) * b[i];
  }
  return den > 0 ? num_ / den : 0.0;
}

double scaled_rmse(const float* a, const float* b, int64_t n, double k) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = double(a[i]) - k * double(b[i]);
    s += d * d;
  }
  return n > 0 ? std::sqrt(s / double(n)) : 0.0;
}

namespace {

// Positions (an integer site) all off by the same k: what an engine that
// counts them from another start computes (the batch's packed start, a
// prefix it does not hold, a rollback it forgot); a shift, named with k.
std::vector<ErrorSignature> integer_signatures(const std::string& name, const TensorData& c, const TensorData& r) {
  if (parse_name(name).site != site_name(Site::Positions) || c.i.empty() || c.i.size() != r.i.size()) return {};
  const int64_t k = c.i[0] - r.i[0];
  for (size_t t = 0; t < c.i.size(); ++t)
    if (c.i[t] - r.i[t] != k) return {};
  if (k == 0) return {};
  ErrorSignature s;
  s.name = name;
  s.kind = "shift";
  s.detail = "positions start at " + std::to_string(c.i[0]) + " where the sequence's start at " +
             std::to_string(r.i[0]) + ": every position " + (k > 0 ? "+" : "") + std::to_string(k) +
             " (counted from another start than the sequence's own first token)";
  s.fit = 0;
  s.decisive = true;
  return {s};
}

}  // namespace

std::vector<ErrorSignature> error_signatures(const std::string& name, const TensorSource& cand,
                                             const TensorSource& ref, const std::optional<ModelConfig>& cfg,
                                             const LocalOracle* oracle) {
  if (!cand.has(name) || !ref.has(name)) return {};
  const TensorData c = cand.get(name), r = ref.get(name);
  if (c.is_int && r.is_int) return integer_signatures(name, c, r);
  if (c.is_int || r.is_int || c.f.empty() || r.f.empty()) return {};
  Found found;
  found.name = name;
  found.cn = parse_name(name);
  {
    const std::string& d = cand.manifest().dtype;  // a 16-bit engine's recomputed ops carry its rounding
    found.tol = d == "bfloat16" ? 1e-2 : d == "float16" ? 2e-3 : kExact;
  }
  std::vector<ErrorSignature>& out = found.out;
  if (c.shape != r.shape) {
    find_length(found, c, r);
    return out;
  }
  const int64_t n = int64_t(c.f.size());
  // non-finite: NaN/Inf where the reference is finite (no metric applies).
  {
    NonFiniteCounts nc;
    int64_t ref_bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float x = c.f[size_t(i)];
      if (!std::isfinite(r.f[size_t(i)])) ++ref_bad;
      if (!std::isfinite(x)) count_nonfinite(x, i, nc);
    }
    if (nc.total() > ref_bad) {
      found.add_decisive("non-finite", nonfinite_words(nc, c.shape) + " where the reference has " +
                                           std::to_string(ref_bad) + " non-finite values: an overflow, a division by "
                                           "zero or an uninitialised read");
      return out;
    }
  }
  const double err = rmse(c.f.data(), r.f.data(), n);
  const double scale = std::max(rms(r.f.data(), n), 1e-30);
  found.err = err;
  found.scale = scale;
  // RoPE's table in 16 bits: small errors (small angles round little), below
  // the exact-match level the other signatures skip.
  if (err > 0) sig::find_rope_angle_precision(found, c, r, cand, ref);
  if (found.has_decisive()) return out;
  // An RMSNorm of its input rounded to 16 bits or of another formula; its
  // eps (or its input scaled): errors as small as eps's share of the norm.
  if (err > 0) sig::find_norm_variant(found, c, r, cand, ref, cfg);
  if (found.has_decisive()) return out;
  if (err <= kExact * scale) return out;  // nothing to explain
  const CanonName& cn = found.cn;
  auto add = [&](const std::string& kind, const std::string& detail, double left) { found.add(kind, detail, left); };

  // precision: the reference's values rounded to a 16-bit grid (an output
  // stored or computed at lower precision, not a formula error).
  if (const std::optional<ComputeDType> grid = rounded_grid(c.f.data(), r.f.data(), n)) {
    found.add_decisive("precision", std::string("every value is the reference's rounded to ") +
                                        compute_dtype_name(*grid) +
                                        " (within one of its ulps): stored or computed at lower precision, not a "
                                        "formula error");
    return out;
  }
  // ... or an op computed in 16 bits throughout.
  sig::find_softmax_precision(found, c, cand, ref);
  if (found.has_decisive()) return out;
  // attn.ctx: the attention recomputed from the candidate's own q, k, v.
  sig::find_attention_variant(found, c, cand, ref, cfg);
  // RoPE over another width than the model's, from the candidate's own input.
  sig::find_rotary_width(found, c, cand, ref, cfg);
  if (found.has_decisive()) return out;

  // scale: global, then per head, then per channel or row.
  const double k = fit_scale(c.f.data(), r.f.data(), n);
  const double left = scaled_rmse(c.f.data(), r.f.data(), n, k);
  if (left < kFits * err) {
    const std::string form = recognise(k, cfg);
    add("scale", "candidate = reference x " + num(k) + (form.empty() ? "" : " = " + form) + " (rmse after " +
                     num(left) + ", before " + num(err) + ")",
        left);
  } else if (std::optional<Heads> h = heads_of(cn.site, c.shape, cfg)) {
    std::vector<double> ks(size_t(h->H));
    std::vector<float> pc, pr;
    double left2 = 0;
    std::vector<int64_t> wrong_heads;
    for (int64_t head = 0; head < h->H; ++head) {
      pc.clear();
      pr.clear();
      for (int64_t o = 0; o < h->outer; ++o)
        for (int64_t i = 0; i < h->inner; ++i) {
          const int64_t at = (o * h->H + head) * h->inner + i;
          pc.push_back(c.f[size_t(at)]);
          pr.push_back(r.f[size_t(at)]);
        }
      const int64_t m = int64_t(pc.size());
      ks[size_t(head)] = fit_scale(pc.data(), pr.data(), m);
      const double l = scaled_rmse(pc.data(), pr.data(), m, ks[size_t(head)]);
      left2 += l * l * double(m);
      if (rmse(pc.data(), pr.data(), m) > found.tol * std::max(rms(pr.data(), m), 1e-30)) wrong_heads.push_back(head);
    }
    left2 = std::sqrt(left2 / double(n));
    if (!wrong_heads.empty() && int64_t(wrong_heads.size()) < h->H) {
      std::string list;
      for (int64_t w : wrong_heads) list += (list.empty() ? "" : ", ") + std::to_string(w);
      add("partial", std::to_string(wrong_heads.size()) + " of " + std::to_string(h->H) + " heads wrong (" + list +
                         "), the others match the reference",
          err);
    } else if (left2 < kFits * err) {
      std::string list;
      for (size_t i = 0; i < ks.size() && i < 8; ++i) list += (i ? ", " : "") + num(ks[i]);
      add("scale", "per head: candidate = reference x [" + list + (ks.size() > 8 ? ", ..." : "") + "] (rmse after " +
                       num(left2) + ")",
          left2);
    }
  }
  if (!found.has_decisive() && std::none_of(out.begin(), out.end(), [](const ErrorSignature& g) {
        return g.kind == "scale" || g.kind == "partial";
      }))
    find_axis_scale(found, c, r);
  // Every head wrong: maybe only some of each head's dims.
  if (!found.has_decisive() && std::none_of(out.begin(), out.end(), [](const ErrorSignature& g) {
        return g.kind == "partial";
      }))
    find_partial_dims(found, c, r, cfg);

  // Rows: [T, X] tensors (and [H, T, X] per head) by the position axis.
  const bool rows2 = c.shape.size() == 2, rows3 = c.shape.size() == 3;
  if (rows2 || rows3) {
    const int64_t H = rows3 ? c.shape[0] : 1, T = rows3 ? c.shape[1] : c.shape[0], X = c.shape.back();
    auto at = [&](int64_t h, int64_t t, int64_t x) { return size_t((h * T + t) * X + x); };
    // partial by rows
    std::vector<int64_t> wrong_rows;
    for (int64_t t = 0; t < T; ++t) {
      double e = 0, s = 0;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t x = 0; x < X; ++x) {
          const double d = double(c.f[at(h, t, x)]) - r.f[at(h, t, x)];
          e += d * d;
          s += double(r.f[at(h, t, x)]) * r.f[at(h, t, x)];
        }
      if (std::sqrt(e) > found.tol * std::max(std::sqrt(s), 1e-30)) wrong_rows.push_back(t);
    }
    if (!wrong_rows.empty() && int64_t(wrong_rows.size()) < T && out.empty()) {
      std::string list;
      for (size_t i = 0; i < wrong_rows.size() && i < 8; ++i) list += (i ? ", " : "") + std::to_string(wrong_rows[i]);
      add("partial", std::to_string(wrong_rows.size()) + " of " + std::to_string(T) + " rows (positions) wrong (" +
                         list + (wrong_rows.size() > 8 ? ", ..." : "") + "), the others match",
          err);
    }
    // shift: candidate row t = reference row t + k
    for (int64_t shift : {1, -1, 2, -2}) {
      if (T <= std::abs(shift)) continue;
      double e = 0, s = 0;
      int64_t m = 0;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t src = t + shift;
          if (src < 0 || src >= T) continue;
          for (int64_t x = 0; x < X; ++x) {
            const double d = double(c.f[at(h, t, x)]) - r.f[at(h, src, x)];
            e += d * d;
            s += double(r.f[at(h, src, x)]) * r.f[at(h, src, x)];
            ++m;
          }
        }
      if (m > 0 && std::sqrt(e) <= found.tol * std::max(std::sqrt(s), 1e-30)) {
        add("shift", "row t holds the reference's row t" + std::string(shift > 0 ? "+" : "") + std::to_string(shift) +
                         " (positions offset by " + std::to_string(shift) + ")",
            0.0);
        break;
      }
    }
  }

  find_permutation(found, c, r, cfg);
  if (cn.site == "mask" || cn.site == "attn.probs") find_mask(found, c, r);

  // alias: equal to another tensor of the reference at this step (and the
  // layer before, for a layer's input).
  if (cn.kind == CanonName::Kind::Layer || cn.kind == CanonName::Kind::Step) {
    for (const std::string& other : ref.names()) {
      if (other == name) continue;
      const CanonName o = parse_name(other);
      if (o.step != cn.step) continue;
      if (cn.kind == CanonName::Kind::Layer && o.kind == CanonName::Kind::Layer && o.layer != cn.layer &&
          !(o.layer == cn.layer - 1 && o.site == "out"))
        continue;
      if (ref.shape(other) != c.shape) continue;
      const TensorData t = ref.get(other);
      if (t.is_int) continue;
      const double e = rmse(c.f.data(), t.f.data(), n);
      if (e <= found.tol * std::max(rms(t.f.data(), n), 1e-30)) {
        add("alias", "equals the reference's " + other + " (rmse " + num(e) + "): the op was skipped or its input "
                     "or a sibling taken instead",
            0.0);
        break;
      }
    }
  }
  if (!found.has_decisive()) find_elementwise(found, c, r, cand);
  if (!found.has_decisive() && oracle) find_changed_projection(found, c, cand, *oracle);
  std::stable_sort(out.begin(), out.end(), [](const ErrorSignature& a, const ErrorSignature& b) {
    return a.decisive != b.decisive ? a.decisive : a.fit < b.fit;
  });
  return out;
}

}  // namespace llmdiff::compare
