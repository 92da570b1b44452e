#include "compare/diagnose.h"
#include "compare/batch_fingerprints.h"
#include "compare/paged_kv.h"
#include "compare/parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>

#include "compare/tolerance.h"
#include "dumps/zoo/bugs.h"
#include "dumps/base/errors.h"

namespace llmdiff::compare {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

// Share of the diverging names a hypothesis run must reproduce (and of all
// names it must agree on) to count as supported.
constexpr double kReplaySupport = 0.9;
// A hypothesis run agrees with the candidate at a name when their RMSE is
// within this many noise-floor thresholds: two honest implementations differ
// by about sqrt(2) times one's rounding noise.
constexpr double kReplayAgreeFactor = 2.0;
// ... and, at a diverging name, within this fraction of the clean model's
// RMSE against the candidate (the hypothesis must explain the divergence,
// not merely sit within the noise of a small one).
constexpr double kBeatClean = 0.5;

std::string num(double v) {
  char buf[32];
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (std::isnan(v)) return "nan";
  std::snprintf(buf, sizeof buf, "%.2g", v);
  return buf;
}

// Row `row` of a [rows, cols] tensor.
std::vector<float> row_of(const TensorData& t, int64_t row) {
  const int64_t cols = t.shape.empty() ? 0 : t.shape.back();
  std::vector<float> f = t.floats();
  if (cols <= 0 || (row + 1) * cols > int64_t(f.size())) return {};
  return std::vector<float>(f.begin() + row * cols, f.begin() + (row + 1) * cols);
}

int64_t argmax_of(const std::vector<float>& v) { return v.empty() ? -1 : argmax(v.data(), int64_t(v.size())); }

std::optional<ModelConfig> manifest_config(const TensorSource& a, const TensorSource& b) {
  for (const TensorSource* s : {&a, &b}) {
    if (s->manifest().config.empty()) continue;
    try {
      return parse_config(s->manifest().config, s->label() + " manifest config");
    } catch (const Error&) {
    }
  }
  return std::nullopt;
}

// Tokens per step (from `sc`) and the cache length before each step.
std::vector<int64_t> past_lengths(const Scenario& sc) {
  std::vector<int64_t> p;
  int64_t at = 0;
  for (const auto& s : sc.steps) {
    p.push_back(at);
    at += int64_t(s.size());
  }
  return p;
}

// The threshold at which a hypothesis run agrees with the candidate at
// `name`: kReplayAgreeFactor x the global noise-floor threshold when the
// diff was judged by the noise floor, else nullopt (then allclose decides).
std::optional<double> agree_threshold(const TensorComparison* cmp) {
  if (!cmp || cmp->judgement.metric != "rmse vs float64" || !std::isfinite(cmp->judgement.threshold)) return std::nullopt;
  return kReplayAgreeFactor * cmp->judgement.threshold;
}

}  // namespace

Agreement agreement(const TensorData& hyp, const TensorData& cand, const TensorComparison* cmp, ComputeDType dtype) {
  Agreement a;
  if (hyp.shape != cand.shape) return a;
  if (hyp.is_int && cand.is_int) {
    a.agree = hyp.i == cand.i;
    a.rmse = a.agree ? 0.0 : kInf;
    return a;
  }
  std::vector<float> h = hyp.floats(), c = cand.floats();
  int64_t bad = 0;
  a.rmse = rmse(h.data(), c.data(), int64_t(h.size()), &bad);
  if (bad) {
    a.rmse = kInf;
    return a;
  }
  if (auto t = agree_threshold(cmp)) {
    // A shape mismatch against the reference leaves no noise level there:
    // borrow the floor of the candidate's own scale.
    a.threshold = cmp->shape_match ? *t : kReplayAgreeFactor * noise_floor_abs(rms(c.data(), int64_t(c.size())));
    a.agree = a.rmse <= a.threshold;
    return a;
  }
  Tolerance tol = cmp ? cmp->tolerance : default_tolerance(dtype);
  AllcloseResult r = allclose(c.data(), h.data(), int64_t(h.size()), tol);
  a.threshold = tol.atol;
  a.agree = r.pass();
  return a;
}

namespace {

// The zoo's name of the bug a fingerprint points at (dumps/zoo/bugs.h).
std::string named(zoo::Signature s) { return zoo::bug_with_signature(s).name; }

std::string describe_hypothesis(const Hypothesis& h, const HypothesisRunner* runner) {
  if (!h.value) return h.bug;
  std::string what = runner ? runner->parameter(h.bug) : "";
  if (what.empty()) what = h.bug;
  std::string s = what + " = " + value_str(*h.value);
  if (runner)
    if (auto c = runner->configured(h.bug)) s += ", config says " + value_str(*c);
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------
// BisectResult

std::optional<std::string> BisectResult::first_divergence() const {
  if (const TensorComparison* t = global.first()) return t->name;
  return std::nullopt;
}

std::optional<std::string> BisectResult::first_local_failure() const {
  if (const LocalSite* s = local.first()) return s->name;
  return std::nullopt;
}

std::optional<std::string> BisectResult::localised_at() const {
  if (auto l = first_local_failure()) return l;
  return first_divergence();
}

bool BisectResult::ok() const {
  return (global.failing() == 0 || flips_explain) && local.failing() == 0 && !global.tensors.empty();
}

ComputeDType candidate_dtype(const TensorSource& cand, std::string* source) {
  if (auto d = manifest_dtype(cand.manifest())) {
    if (source) *source = "manifest";
    return *d;
  }
  if (source) *source = "default (no manifest dtype)";
  return ComputeDType::Float32;
}

// ---------------------------------------------------------------------------
// Fingerprints

namespace {

// Whether b is a non-decreasing function of a (values of a in order give
// values of b in order, up to float32 rounding of b's scale).
bool monotone_in(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<size_t> order(a.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return a[x] < a[y]; });
  double scale = 0;
  for (float v : b) scale = std::max(scale, double(std::fabs(v)));
  const double slack = 1e-6 * scale;
  for (size_t i = 1; i < order.size(); ++i)
    if (double(b[order[i]]) < double(b[order[i - 1]]) - slack) return false;
  return !a.empty();
}

}  // namespace

std::vector<Fingerprint> fingerprints(const TensorSource& cand, const TensorSource& ref, const DiffResult& global,
                                      const Scenario& sc) {
  std::vector<Fingerprint> out;
  const std::vector<int64_t> past = past_lengths(sc);
  const int steps = int(sc.steps.size());
  std::optional<ModelConfig> cfg = manifest_config(ref, cand);
  auto failing = [&](const std::string& name) {
    const TensorComparison* t = global.find(name);
    return t && !t->pass;
  };
  auto passing = [&](const std::string& name) {
    const TensorComparison* t = global.find(name);
    return t && t->pass;
  };

  // lm-head: the head's input matches, its output does not.
  for (int s = 0; s < steps; ++s) {
    const std::string logits = step_name(s, "logits");
    if (!failing(logits)) continue;
    const std::string fn = step_name(s, "final_norm");
    if (passing(fn)) {
      const TensorComparison* a = global.find(fn);
      const TensorComparison* b = global.find(logits);
      const std::string head = fn + " matches the reference (rmse " + num(a->metrics.rmse) + ") while " + logits +
                               " does not (rmse " + num(b->metrics.rmse) + ", max err " + num(b->metrics.max_abs) + ")";
      // Another head matrix gives logits of no simple relation to the
      // reference's; logits that are a multiple of them are a scale (a
      // logit scale, a soft-cap's linear range), not the lm-head bug.
      TensorData cl = cand.get(logits), rl = ref.get(logits);
      if (b->metrics.cand_nonfinite.total() > 0) break;  // NaN/Inf: the non-finite finding, not the head
      double k = 0, rel = INFINITY;
      if (cl.shape == rl.shape && !cl.is_int && !rl.is_int) {
        k = fit_scale(cl.f.data(), rl.f.data(), cl.numel());
        if (k != 0) rel = scaled_rmse(cl.f.data(), rl.f.data(), cl.numel(), k) / std::max(1e-30, b->metrics.rmse);
      }
      if (rel * 100 < 1)
        out.push_back({named(zoo::Signature::HeadOnly),
                       head + ", and " + logits + " is the reference's times " + value_str(k) +
                           ": a scale of the logits, not another head matrix",
                       false});
      else if (cl.shape == rl.shape && !cl.is_int && monotone_in(rl.f, cl.f))
        out.push_back({named(zoo::Signature::HeadOnly),
                       head + ", and " + logits + " is an increasing function of the reference's (the same order "
                              "everywhere): a pointwise change of the logits (soft-capping, clamping), not another "
                              "head matrix",
                       false});
      else
        out.push_back({named(zoo::Signature::HeadOnly), head + ": the lm_head projection itself is wrong", true});
    } else if (cfg && !cand.has(fn)) {
      const std::string last = layer_name(s, int(cfg->num_hidden_layers) - 1, "out");
      if (passing(last))
        out.push_back({named(zoo::Signature::HeadOnly),
                       last + " matches the reference while " + logits +
                           " does not (no final_norm in the candidate: the final norm or the lm_head is wrong)",
                       false});
    }
    break;
  }

  // last-token-first: next_logits (or the greedy token) read from row 0.
  for (int s = 0; s < steps; ++s) {
    const int64_t T = int64_t(sc.steps[size_t(s)].size());
    if (T < 2 || !ref.has(step_name(s, "logits"))) continue;
    TensorData rl = ref.get(step_name(s, "logits"));
    std::vector<float> row0 = row_of(rl, 0), last = row_of(rl, T - 1);
    const std::string nl = step_name(s, "next_logits");
    if (cand.has(nl) && failing(nl)) {
      TensorData c = cand.get(nl);
      if (c.numel() == int64_t(row0.size())) {
        const double e0 = rmse(c.f.data(), row0.data(), c.numel());
        const double el = rmse(c.f.data(), last.data(), c.numel());
        if (e0 * 100 < el) {
          out.push_back({named(zoo::Signature::LastRowFirst),
                         nl + " is the reference's logits row 0 (rmse " + num(e0) + ") instead of row " +
                             std::to_string(T - 1) + " (rmse " + num(el) + ")",
                         true});
          break;
        }
      }
    }
    // The greedy token that follows this step (generated or the next step's token).
    const int64_t a0 = argmax_of(row0), al = argmax_of(last);
    if (a0 == al) continue;
    std::optional<int64_t> picked;
    std::string where;
    if (cand.has("generated") && s >= sc.first_generating_step) {
      TensorData g = cand.get("generated");
      const size_t k = size_t(s - sc.first_generating_step);
      if (g.is_int && k < g.i.size()) {
        picked = g.i[k];
        where = "generated[" + std::to_string(k) + "]";
      }
    } else if (s + 1 < steps && sc.steps[size_t(s + 1)].size() == 1 && cand.manifest().scenario == "decode") {
      picked = sc.steps[size_t(s + 1)][0];
      where = step_name(s + 1, "tokens");
    }
    if (picked && *picked == a0) {
      out.push_back({named(zoo::Signature::LastRowFirst),
                     where + " = " + std::to_string(*picked) + " is the argmax of the reference's step" +
                         std::to_string(s) + " logits row 0, not of its last row " + std::to_string(T - 1) + " (" +
                         std::to_string(al) + ")",
                     true});
      break;
    }
  }

  // rope-position-reset: positions restart at 0 after a cached prefix.
  for (int s = 1; s < steps; ++s) {
    const std::string name = step_name(s, "positions");
    if (!cand.has(name) || past[size_t(s)] == 0) continue;
    TensorData p = cand.get(name);
    if (p.is_int && !p.i.empty() && p.i[0] == 0) {
      out.push_back({named(zoo::Signature::PositionsRestart),
                     name + " starts at 0 although " + std::to_string(past[size_t(s)]) +
                         " tokens are cached before this call",
                     true});
      break;
    }
  }

  // Masks: square (no past) or none at all.
  for (int s = 0; s < steps; ++s) {
    const std::string name = step_name(s, "mask");
    if (!cand.has(name)) continue;
    TensorData m = cand.get(name);
    const int64_t T = int64_t(sc.steps[size_t(s)].size()), P = past[size_t(s)];
    if (m.shape.size() != 2 || m.shape[0] != T) continue;
    const int64_t S = m.shape[1];
    std::vector<float> f = m.floats();
    bool all_ones = std::all_of(f.begin(), f.end(), [](float x) { return x == 1.0f; });
    if (T > 1 && all_ones && S >= T) {
      out.push_back({named(zoo::Signature::MaskAllowsAll), name + " allows every key for every query (T = " + std::to_string(T) +
                                         "): no causal mask", true});
      break;
    }
    if (P > 0 && S == T) {
      // A mask over this call's keys alone: the cache holds none of the
      // past (kv-overwrite), which a mask of the full length would not say.
      out.push_back({named(zoo::Signature::CacheHoldsCallOnly),
                     name + " spans " + std::to_string(S) + " keys where " + std::to_string(P + T) +
                         " are cached (" + std::to_string(P) + " before this call): only this call's keys are attended",
                     true});
      break;
    }
    if (P > 0 && S == P + T) {
      bool square = true;  // key s allowed iff s <= t, whatever the past
      for (int64_t t = 0; t < T && square; ++t)
        for (int64_t k = 0; k < S; ++k)
          if ((f[size_t(t * S + k)] == 1.0f) != (k <= t)) {
            square = false;
            break;
          }
      if (square) {
        out.push_back({named(zoo::Signature::MaskIgnoresPast), name + " allows key s iff s <= t as if nothing were cached (" +
                                          std::to_string(P) + " cached tokens)", true});
        break;
      }
    }
  }

  // kv-overwrite: the cache holds only this call's keys.
  const bool mask_said = std::any_of(out.begin(), out.end(), [&](const Fingerprint& f) {
    return f.bug == named(zoo::Signature::CacheHoldsCallOnly);
  });
  for (int s = 1; s < steps && !mask_said; ++s) {
    const int64_t T = int64_t(sc.steps[size_t(s)].size()), P = past[size_t(s)];
    if (P == 0) continue;
    bool found = false;
    for (const auto& n : cand.names()) {
      CanonName c = parse_name(n);
      if (c.kind != CanonName::Kind::Layer || c.step != s || c.site != "attn.k_cache") continue;
      Shape sh = cand.shape(n);
      if (sh.size() == 3 && sh[1] == T) {
        out.push_back({named(zoo::Signature::CacheHoldsCallOnly), n + " holds " + std::to_string(T) + " positions where " +
                                           std::to_string(P + T) + " are expected: the cache was overwritten",
                       true});
        found = true;
      }
      break;
    }
    if (found) break;
  }

  // repeat-kv-tile: k_rep[h] == k_cache[h mod Hkv].
  if (cfg && cfg->num_key_value_heads > 1 && cfg->num_attention_heads > cfg->num_key_value_heads) {
    const int64_t hq = cfg->num_attention_heads, hkv = cfg->num_key_value_heads, n_rep = hq / hkv;
    for (const auto& n : cand.names()) {
      CanonName c = parse_name(n);
      if (c.kind != CanonName::Kind::Layer || c.site != "attn.k_rep" || !failing(n)) continue;
      const std::string cache = layer_name(c.step, c.layer, "attn.k_cache");
      if (!cand.has(cache)) break;
      TensorData rep = cand.get(n), kc = cand.get(cache);
      if (rep.shape.size() != 3 || kc.shape.size() != 3 || rep.shape[0] != hq || kc.shape[0] != hkv ||
          rep.shape[1] != kc.shape[1])
        break;
      const int64_t block = rep.shape[1] * rep.shape[2];
      auto head_eq = [&](int64_t h, int64_t g) {
        return std::equal(rep.f.begin() + h * block, rep.f.begin() + (h + 1) * block, kc.f.begin() + g * block);
      };
      bool tile = true, grouped = true;
      for (int64_t h = 0; h < hq; ++h) {
        tile = tile && head_eq(h, h % hkv);
        grouped = grouped && head_eq(h, h / n_rep);
      }
      if (tile && !grouped)
        out.push_back({named(zoo::Signature::KvHeadsTiled), n + ": query head h holds kv head h mod " + std::to_string(hkv) +
                                             " instead of h / " + std::to_string(n_rep), true});
      break;
    }
  }

  // gate-up-swap: act == silu(up) * gate from the candidate's own values.
  for (const auto& n : cand.names()) {
    CanonName c = parse_name(n);
    if (c.kind != CanonName::Kind::Layer || c.site != "mlp.act" || !failing(n)) continue;
    const std::string g = layer_name(c.step, c.layer, "mlp.gate"), u = layer_name(c.step, c.layer, "mlp.up");
    if (!cand.has(g) || !cand.has(u)) break;
    TensorData act = cand.get(n), gate = cand.get(g), up = cand.get(u);
    if (act.shape != gate.shape || act.shape != up.shape) break;
    std::vector<float> right(act.f.size()), swapped(act.f.size());
    for (size_t i = 0; i < act.f.size(); ++i) {
      const double x = gate.f[i], y = up.f[i];
      right[i] = float(x / (1.0 + std::exp(-x)) * y);
      swapped[i] = float(y / (1.0 + std::exp(-y)) * x);
    }
    const double er = rmse(act.f.data(), right.data(), act.numel());
    const double es = rmse(act.f.data(), swapped.data(), act.numel());
    if (es * 100 < er)
      out.push_back({named(zoo::Signature::GateUpSwapped), n + " equals silu(up) * gate of the candidate's own gate/up (rmse " + num(es) +
                                         ") rather than silu(gate) * up (rmse " + num(er) + ")", true});
    break;
  }

  // softmax-scale: scores a constant multiple of the reference's.
  for (const auto& n : cand.names()) {
    CanonName c = parse_name(n);
    if (c.kind != CanonName::Kind::Layer || c.site != "attn.scores" || !failing(n)) continue;
    if (!passing(layer_name(c.step, c.layer, "attn.q_rope"))) break;
    TensorData a = cand.get(n), b = ref.get(n);
    if (a.shape != b.shape) break;
    const double k = fit_scale(a.f.data(), b.f.data(), a.numel());
    if (k == 0) break;
    const double e = scaled_rmse(a.f.data(), b.f.data(), a.numel(), k), e1 = rmse(a.f.data(), b.f.data(), a.numel());
    if (e * 100 < e1) {
      // The zoo's softmax-scale scales by 1/Dh instead of the model's own
      // scaling (Dh^-0.5; MLA: (Dn+Dr)^-0.5 x mscale^2): the factor it
      // implies is (1/Dh) / scaling. Named only for that factor; any other
      // is reported as the scale it is.
      const std::string what = "the scores are the reference's times " + value_str(k);
      const std::string rest = " (rmse after rescaling " + num(e) + ")";
      const int64_t dh = cfg ? (cfg->mla.enabled ? cfg->mla.qk_head_dim() : cfg->head_dim) : 0;
      const double implied = dh > 0 ? (1.0 / double(dh)) / cfg->attn_scaling() : 0.0;
      if (implied > 0 && std::fabs(k / implied - 1.0) < 1e-3)
        out.push_back({named(zoo::Signature::ScoresRescaled),
                       n + ": " + what + " = (1/" + std::to_string(dh) + ") / the model's scaling: scaled by 1/" +
                           std::to_string(dh) + " instead" + rest,
                       true});
      else
        out.push_back({named(zoo::Signature::ScoresRescaled),
                       n + ": " + what + rest + ", not the factor softmax-scale implies (" + value_str(implied) +
                           "): a scaling error of another kind",
                       false});
    }
    break;
  }

  // RoPE frequencies: another theta, or the scaling ignored.
  if (cfg && cand.has("rope.inv_freq") && failing("rope.inv_freq")) {
    TensorData inv = cand.get("rope.inv_freq");
    const int64_t half = inv.numel(), dim = 2 * half;
    auto default_inv = [&](double theta) {
      std::vector<float> v(static_cast<size_t>(half));
      for (int64_t j = 0; j < half; ++j) v[static_cast<size_t>(j)] = float(1.0 / std::pow(theta, double(2 * j) / double(dim)));
      return v;
    };
    auto rel_err = [&](const std::vector<float>& v) {
      double m = 0;
      for (int64_t j = 0; j < half; ++j)
        m = std::max(m, std::fabs(double(inv.f[size_t(j)]) - v[size_t(j)]) / std::max(1e-30, double(std::fabs(v[size_t(j)]))));
      return m;
    };
    if (cfg->rope_scaling.type != RopeScaling::Type::Default && rel_err(default_inv(cfg->rope_theta)) < 1e-5) {
      out.push_back({named(zoo::Signature::InvFreqUnscaled), std::string("rope.inv_freq equals the unscaled frequencies of theta ") +
                                                 value_str(cfg->rope_theta) + " (config rope_scaling " +
                                                 rope_type_name(cfg->rope_scaling.type) + " ignored)", true});
    } else if (half >= 2) {
      // log inv[j] = -(2j/dim) log theta: least squares over j >= 1.
      double sxy = 0, sxx = 0;
      for (int64_t j = 1; j < half; ++j) {
        const float v = inv.f[size_t(j)];
        if (!(v > 0)) continue;
        const double x = double(2 * j) / double(dim);
        sxy += x * -std::log(double(v));
        sxx += x * x;
      }
      if (sxx > 0) {
        // The fitted theta, as round as reproduces the frequencies.
        const double fit = std::exp(sxy / sxx);
        double theta = fit, e = rel_err(default_inv(fit));
        for (int digits = 2; digits <= 8; ++digits) {
          char buf[32];
          std::snprintf(buf, sizeof buf, "%.*g", digits, fit);
          const double t = std::strtod(buf, nullptr), et = rel_err(default_inv(t));
          if (et < 2e-6) {
            theta = t, e = et;
            break;
          }
        }
        if (e < 1e-4 && cfg->rope_scaling.type == RopeScaling::Type::Default)
          out.push_back({named(zoo::Signature::InvFreqTheta), "rope.inv_freq fits theta = " + value_str(theta) + " (config says " +
                                           value_str(cfg->rope_theta) + "; max rel err " + num(e) + ")", true, theta});
      }
    }
  }

  // missing-bias (or any wrong bias): q/k/v off by the same vector in every row.
  for (const auto& n : cand.names()) {
    CanonName c = parse_name(n);
    if (c.kind != CanonName::Kind::Layer || (c.site != "attn.q" && c.site != "attn.k" && c.site != "attn.v") ||
        !failing(n))
      continue;
    if (!passing(layer_name(c.step, c.layer, "attn_norm"))) break;
    TensorData a = cand.get(n), b = ref.get(n);
    if (a.shape != b.shape || a.shape.size() != 2 || a.shape[0] < 2) break;
    const int64_t rows = a.shape[0], cols = a.shape[1];
    double spread = 0, total = 0;
    for (int64_t j = 0; j < cols; ++j) {
      const double d0 = double(a.f[size_t(j)]) - b.f[size_t(j)];
      total = std::max(total, std::fabs(d0));
      for (int64_t t = 1; t < rows; ++t)
        spread = std::max(spread, std::fabs(double(a.f[size_t(t * cols + j)]) - b.f[size_t(t * cols + j)] - d0));
    }
    if (total > 0 && spread * 100 < total)
      out.push_back({named(zoo::Signature::RowConstantOffset), n + " differs from the reference by the same vector in every row (max " +
                                         num(total) + ", row-to-row spread " + num(spread) + "): a bias is missing or wrong",
                     false});
    break;
  }
  // Several sequences served together: how the batch was shared.
  batch_fingerprints(cand, ref, global, past, out);
  return out;
}

// ---------------------------------------------------------------------------
// Diagnosis

namespace {

// Ranking: supported by both kinds of evidence, then by one; then the share
// of diverging names reproduced; then the smaller error.
double score_of(const HypothesisEvidence& e) {
  double s = 0;
  if (e.supported_by_replay) s += 4;
  if (e.supported_by_local) s += 4;
  if (e.failing_compared > 0) s += 2.0 * double(e.failing_agree) / double(e.failing_compared);
  if (e.replay_focus_agree) s += 1;
  if (e.local_tested && e.local_focus_pass) s += 1;
  if (e.local_tested) s -= 0.5 * double(e.local_new);
  if (e.replayed && std::isfinite(e.replay_log_error)) s -= 0.01 * std::clamp(e.replay_log_error, -10.0, 10.0);
  return s;
}

std::string replay_summary(const HypothesisEvidence& e, const std::string& focus) {
  std::string s = "replay with " + e.hypothesis.str() + " reproduces the candidate at " +
                  std::to_string(e.replay_agree) + "/" + std::to_string(e.replay_compared) + " names (" +
                  std::to_string(e.failing_agree) + "/" + std::to_string(e.failing_compared) + " of the diverging ones)";
  if (!focus.empty())
    s += "; " + focus + ": rmse " + num(e.replay_focus_rmse) + (e.replay_focus_agree ? " <= " : " > ") +
         num(e.replay_focus_threshold);
  if (!e.replay_first_disagreement.empty()) s += "; first disagreement " + e.replay_first_disagreement;
  return s;
}

std::string local_summary(const HypothesisEvidence& e, const std::string& focus, const LocalSite* clean) {
  std::string s = focus + " recomputed from the candidate's own inputs with " + e.hypothesis.str() + ": max err " +
                  num(e.local_focus_max_abs);
  if (clean) s += " (reference op: max err " + num(clean->max_abs) + ")";
  s += "; local failures " + std::to_string(e.local_failures) + " (fixed " + std::to_string(e.local_fixed) +
       ", new " + std::to_string(e.local_new) + ")";
  return s;
}

// What the evidence gathering shares.
struct Context {
  explicit Context(const DiagnoseInputs& i) : in(i) {}
  const DiagnoseInputs& in;
  const LocalReport* local = nullptr;  // the clean local report (null when not computed)
  std::string global_focus, local_focus;
  std::vector<std::string> cand_names;
  std::vector<const TensorComparison*> cand_cmp;  // the global comparison of each of cand_names (or null)
  std::map<std::string, double> clean_rmse;  // the clean model's run vs the candidate, per name
};

// Replays the scenario with `e.hypothesis` and compares every name. A
// hypothesis is first screened at the first divergent name alone (a run that
// stops there, a fraction of the scenario): one that does not reproduce the
// candidate there is judged on that name, without the full replay.
void replay_evidence(const Context& cx, HypothesisEvidence& e) {
  const DiagnoseInputs& in = cx.in;
  const TensorComparison* focus = in.global->find(cx.global_focus);
  if (focus && in.cand->has(cx.global_focus)) {
    std::unique_ptr<MemoryDump> probe;
    try {
      probe = in.runner->run(e.hypothesis, in.scenario, {cx.global_focus});
    } catch (const Error& err) {
      e.summary = "replay with " + e.hypothesis.str() + " failed: " + err.what();
      return;
    }
    if (probe->has(cx.global_focus)) {
      Agreement ag = agreement(probe->get(cx.global_focus), in.cand->get(cx.global_focus), focus, in.dtype);
      if (!ag.agree) {
        e.replayed = true;
        e.replay_compared = e.failing_compared = 1;
        e.replay_first_disagreement = cx.global_focus;
        e.replay_focus_rmse = ag.rmse;
        e.replay_focus_threshold = ag.threshold;
        e.replay_log_error =
            ag.threshold > 0 ? std::log10(std::max(ag.rmse, 1e-30) / ag.threshold) : 10.0;
        return;
      }
    }
  }
  std::unique_ptr<MemoryDump> run;
  try {
    run = in.runner->run(e.hypothesis, in.scenario, cx.cand_names);
  } catch (const Error& err) {
    e.summary = "replay with " + e.hypothesis.str() + " failed: " + err.what();
    return;
  }
  e.replayed = true;
  // Every name's agreement, several names at a time (each reads its own
  // tensors through const get()); tallied below in canonical order.
  std::vector<std::optional<Agreement>> agreed(cx.cand_names.size());
  ThreadPool pool;
  pool.parallel_for(int64_t(cx.cand_names.size()), [&](int64_t k) {
    const std::string& name = cx.cand_names[size_t(k)];
    if (!in.sites.empty() && !any_site_glob_match(in.sites, name)) return;
    const TensorComparison* cmp = cx.cand_cmp[size_t(k)];
    if (!cmp || !run->has(name)) return;
    agreed[size_t(k)] = agreement(run->get(name), in.cand->get(name), cmp, in.dtype);
  });
  double log_sum = 0;
  int log_n = 0;
  for (size_t k = 0; k < cx.cand_names.size(); ++k) {
    if (!agreed[k]) continue;
    const std::string& name = cx.cand_names[k];
    const TensorComparison* cmp = cx.cand_cmp[k];
    Agreement ag = *agreed[k];
    if (!cmp->pass) {
      auto c = cx.clean_rmse.find(name);
      if (c != cx.clean_rmse.end()) {
        // Where the clean run already reproduces the candidate, its divergence
        // from the reference is no bug's doing (e.g. the candidate rounds like
        // the hypothesis engine): such a name is evidence for no hypothesis.
        if (c->second <= ag.threshold) continue;
        // Elsewhere the hypothesis must reproduce the divergence clearly
        // better than the clean run does.
        if (ag.agree && std::isfinite(c->second) && !(ag.rmse <= kBeatClean * c->second)) ag.agree = false;
      }
    }
    ++e.replay_compared;
    if (ag.agree)
      ++e.replay_agree;
    else if (e.replay_first_disagreement.empty())
      e.replay_first_disagreement = name;
    if (!cmp->pass) {
      ++e.failing_compared;
      if (ag.agree) ++e.failing_agree;
      log_sum += ag.threshold > 0 ? std::log10(std::max(ag.rmse, 1e-30) / ag.threshold) : (ag.agree ? -10.0 : 10.0);
      ++log_n;
    }
    if (name == cx.global_focus) {
      e.replay_focus_agree = ag.agree;
      e.replay_focus_rmse = ag.rmse;
      e.replay_focus_threshold = ag.threshold;
    }
  }
  e.replay_log_error = log_n ? log_sum / log_n : 0.0;
  e.supported_by_replay = e.failing_compared > 0 && e.replay_focus_agree &&
                          e.failing_agree >= kReplaySupport * e.failing_compared &&
                          e.replay_agree >= kReplaySupport * e.replay_compared;
}

// Recomputes the candidate's sites with the hypothesis' ops.
void local_evidence(const Context& cx, HypothesisEvidence& e) {
  const DiagnoseInputs& in = cx.in;
  if (!cx.local || !in.oracle || !in.cand_local || !in.local_ref || cx.local->failing() == 0 ||
      !in.oracle->supports(e.hypothesis))
    return;
  LocalReport lh = analyse_local_variant(*in.oracle, *in.cand, *in.cand_local, *cx.local, nullptr, in.dtype,
                                         in.sites, e.hypothesis, in.cand_local, in.second_local, in.local_ref);
  e.local_tested = true;
  e.local_failures = lh.failing();
  e.local_fixed = e.local_new = 0;
  for (const auto& s : cx.local->sites) {
    const LocalSite* t = lh.find(s.name);
    const bool now = t ? t->pass : s.pass;
    if (!s.pass && now) ++e.local_fixed;
    if (s.pass && !now) ++e.local_new;
  }
  if (const LocalSite* t = lh.find(cx.local_focus)) {
    e.local_focus_pass = t->pass;
    e.local_focus_max_abs = t->max_abs;
    e.local_focus_rmse = t->noise.cand_rmse;
  }
  e.supported_by_local = e.local_focus_pass && e.local_new == 0 && e.local_failures == 0;
}

// The hypothesis run's RMSE against the candidate at the first divergent
// name (inf when it cannot run or the shapes differ): the objective of the
// parameter search.
double focus_error(const Context& cx, const Hypothesis& h) {
  std::unique_ptr<MemoryDump> run;
  try {
    run = cx.in.runner->run(h, cx.in.scenario, {cx.global_focus});
  } catch (const Error&) {
    return kInf;
  }
  if (!run->has(cx.global_focus)) return kInf;
  TensorData a = run->get(cx.global_focus), b = cx.in.cand->get(cx.global_focus);
  if (a.shape != b.shape) return kInf;
  std::vector<float> x = a.floats(), y = b.floats();
  int64_t bad = 0;
  const double e = rmse(x.data(), y.data(), int64_t(x.size()), &bad);
  return bad ? kInf : e;
}

double round_sig(double v, int digits) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.*g", digits, v);
  return std::strtod(buf, nullptr);
}

// A parameterised bug whose grid holds no exact value: the value between
// the best grid point's neighbours (log scale) that best reproduces the
// first divergent name, by a scan and a golden-section search.
std::optional<Hypothesis> refine_parameter(const Context& cx, const std::string& bug,
                                           const std::vector<HypothesisEvidence>& tested) {
  std::vector<std::pair<double, double>> grid;  // value, focus rmse
  for (const auto& e : tested)
    if (e.hypothesis.bug == bug && e.hypothesis.value && *e.hypothesis.value > 0 && e.replayed)
      grid.emplace_back(*e.hypothesis.value, e.replay_focus_rmse);
  if (grid.empty()) return std::nullopt;
  std::sort(grid.begin(), grid.end());
  size_t best = 0;
  for (size_t k = 1; k < grid.size(); ++k)
    if (grid[k].second < grid[best].second) best = k;
  if (!std::isfinite(grid[best].second)) return std::nullopt;
  // The grid's whole range, on a log scale: the error is not unimodal over
  // it (the config's own value, left out of the grid, sits in between).
  const double lo = std::log(grid.front().first), hi = std::log(grid.back().first);
  auto f = [&](double x) { return focus_error(cx, Hypothesis{bug, std::exp(x)}); };
  // Coarse scan (~6 points per decade), then golden-section search around the best point.
  const int kScan = std::clamp(int((hi - lo) / std::log(10.0) * 6), 8, 72);
  double best_x = std::log(grid[best].first), best_f = grid[best].second;
  for (int k = 0; k <= kScan; ++k) {
    const double x = lo + (hi - lo) * k / kScan, fx = f(x);
    if (fx < best_f) best_f = fx, best_x = x;
  }
  const double step = (hi - lo) / kScan;
  double a = best_x - step, b = best_x + step;
  const double g = (std::sqrt(5.0) - 1) / 2;
  double c = b - g * (b - a), d = a + g * (b - a), fc = f(c), fd = f(d);
  for (int it = 0; it < 30; ++it) {
    if (fc < fd) {
      b = d, d = c, fd = fc, c = b - g * (b - a), fc = f(c);
    } else {
      a = c, c = d, fc = fd, d = a + g * (b - a), fd = f(d);
    }
  }
  double v = std::exp(fc < fd ? c : d);
  // Prefer a round value when it fits as well.
  double chosen = v, chosen_f = kInf;
  for (int digits : {2, 3, 4, 6}) {
    const double r = round_sig(v, digits), fr = focus_error(cx, Hypothesis{bug, r});
    if (fr < chosen_f * 0.999) chosen = r, chosen_f = fr;
  }
  for (const auto& gp : grid)
    if (gp.first == chosen) return std::nullopt;  // nothing new
  return Hypothesis{bug, chosen};
}

}  // namespace

Diagnosis diagnose(const DiagnoseInputs& in) {
  auto done = [&](const std::string& what) {
    if (in.progress) in.progress("diagnosis: " + what);
  };
  Diagnosis d;
  const TensorSource& cand = *in.cand;
  Context cx(in);
  cx.local = in.local && in.local->ran ? in.local : nullptr;
  cx.global_focus = in.global->first() ? in.global->first()->name : "";
  cx.local_focus = cx.local && cx.local->first() ? cx.local->first()->name : "";
  d.focus = !cx.local_focus.empty() ? cx.local_focus : cx.global_focus;
  d.needed = !d.focus.empty();
  if (!d.needed) {
    d.evidence = "no divergence: nothing to diagnose";
    return d;
  }
  if (in.ref) d.fingerprints = fingerprints(cand, *in.ref, *in.global, in.scenario);
  if (in.runner) d.inapplicable = in.runner->inapplicable();
  cx.cand_names = cand.names();
  {
    std::unordered_map<std::string, const TensorComparison*> by_name;
    for (const TensorComparison& t : in.global->tensors) by_name.emplace(t.name, &t);
    for (const auto& n : cx.cand_names) {
      auto it = by_name.find(n);
      cx.cand_cmp.push_back(it == by_name.end() ? nullptr : it->second);
    }
  }

  // The hypotheses: the runner's (grids included) and values fitted by fingerprints.
  std::vector<Hypothesis> hyps = in.runner ? in.runner->hypotheses() : std::vector<Hypothesis>{};
  hyps.erase(std::remove_if(hyps.begin(), hyps.end(),
                            [&](const Hypothesis& h) { return !in.runner->acts_in(h.bug, in.scenario); }),
             hyps.end());
  std::set<std::string> known_bugs;
  for (const auto& h : hyps) known_bugs.insert(h.bug);
  for (const auto& f : d.fingerprints)
    if (f.value && known_bugs.count(f.bug)) {
      Hypothesis h{f.bug, f.value};
      if (std::find(hyps.begin(), hyps.end(), h) == hyps.end()) hyps.push_back(h);
    }

  // The clean model's run: the baseline every hypothesis must beat.
  if (in.runner) {
    try {
      std::unique_ptr<MemoryDump> own;
      if (!in.clean) own = in.runner->run(Hypothesis{}, in.scenario, cx.cand_names);
      const TensorSource* clean = in.clean ? in.clean : own.get();
      // Several names at a time (each reads its own tensors through const get()).
      std::vector<std::optional<double>> errors(cx.cand_names.size());
      ThreadPool pool;
      pool.parallel_for(int64_t(cx.cand_names.size()), [&](int64_t k) {
        const std::string& name = cx.cand_names[size_t(k)];
        if (!clean->has(name)) return;
        TensorData a = clean->get(name), b = cand.get(name);
        double e = kInf;
        if (a.shape == b.shape) {
          if (a.is_int) a.f = a.floats();  // float tensors as they are, without a copy
          if (b.is_int) b.f = b.floats();
          int64_t bad = 0;
          e = rmse(a.f.data(), b.f.data(), int64_t(a.f.size()), &bad);
          if (bad) e = kInf;
        }
        errors[size_t(k)] = e;
      });
      for (size_t k = 0; k < errors.size(); ++k)
        if (errors[k]) cx.clean_rmse[cx.cand_names[k]] = *errors[k];
      // The clean run already reproduces the candidate where it diverges and
      // no op is wrong by itself: the divergence is rounding that no zoo bug
      // explains, and no hypothesis could get credit there (replay_evidence).
      const TensorComparison* focus = in.global->find(cx.global_focus);
      if (cx.local_focus.empty() && focus && clean->has(cx.global_focus)) {
        Agreement ag = agreement(clean->get(cx.global_focus), cand.get(cx.global_focus), focus, in.dtype);
        if (ag.agree) {
          d.evidence = "the clean implementation reproduces the candidate at " + cx.global_focus + " (rmse " +
                       num(ag.rmse) + " <= " + num(ag.threshold) + ") and no op fails locally: the divergence " +
                       "from the reference is rounding, not a bug of the zoo; no hypothesis was replayed";
          return d;
        }
      }
    } catch (const Error&) {
    }
    done("the clean run against the candidate");
  }
  // Replay evidence for every hypothesis.
  for (const Hypothesis& h : hyps) {
    HypothesisEvidence e;
    e.hypothesis = h;
    replay_evidence(cx, e);
    d.ranked.push_back(std::move(e));
  }
  if (!hyps.empty()) {
    size_t full = 0;
    for (const auto& e : d.ranked)
      if (e.replay_compared > 1) ++full;
    done("replays of " + std::to_string(hyps.size()) + " hypotheses (" + std::to_string(full) + " in full)");
  }
  auto any_replay_support = [&] {
    return std::any_of(d.ranked.begin(), d.ranked.end(), [](const HypothesisEvidence& e) { return e.supported_by_replay; });
  };
  // Parameterised bugs off the grid: search the value.
  if (in.runner && !any_replay_support() && !cx.global_focus.empty()) {
    std::set<std::string> param_bugs;
    for (const auto& h : hyps)
      if (h.value) param_bugs.insert(h.bug);
    for (const auto& bug : param_bugs)
      if (auto h = refine_parameter(cx, bug, d.ranked)) {
        HypothesisEvidence e;
        e.hypothesis = *h;
        replay_evidence(cx, e);
        d.ranked.push_back(std::move(e));
      }
    done("parameter search");
  }
  // Local evidence: for the hypotheses the replay points at, or for all of
  // them when no replay reproduces the candidate (another implementation's
  // numerics, a dump without the diverging names).
  const bool all_local = !any_replay_support();
  for (auto& e : d.ranked)
    if (all_local || e.replay_focus_agree || e.supported_by_replay) {
      local_evidence(cx, e);
      if (e.local_tested) done("local recompute with " + e.hypothesis.str());
    }

  for (auto& e : d.ranked) {
    e.score = score_of(e);
    std::string s;
    if (e.replayed) s = replay_summary(e, cx.global_focus);
    if (e.local_tested)
      s += (s.empty() ? "" : "; ") + local_summary(e, cx.local_focus, cx.local ? cx.local->find(cx.local_focus) : nullptr);
    if (!s.empty()) e.summary = s;
  }
  std::stable_sort(d.ranked.begin(), d.ranked.end(),
                   [](const HypothesisEvidence& a, const HypothesisEvidence& b) { return a.score > b.score; });

  auto fingerprint_text = [&](const std::string& bug) {
    std::string s;
    for (const auto& f : d.fingerprints)
      if (f.bug == bug) s += (s.empty() ? "" : "; ") + f.evidence;
    return s;
  };

  if (!d.ranked.empty() && d.ranked.front().supported()) {
    const HypothesisEvidence& best = d.ranked.front();
    d.bug = best.hypothesis;
    if (in.runner) d.description = in.runner->description(best.hypothesis.bug);
    d.basis = best.supported_by_replay && best.supported_by_local ? "replay + local recompute"
              : best.supported_by_replay                            ? "replay"
                                                                    : "local recompute";
    std::string ev;
    if (best.hypothesis.value) ev = describe_hypothesis(best.hypothesis, in.runner) + ": ";
    if (best.supported_by_local)
      ev += local_summary(best, cx.local_focus, cx.local ? cx.local->find(cx.local_focus) : nullptr);
    if (best.supported_by_replay) ev += (best.supported_by_local ? "; " : "") + replay_summary(best, cx.global_focus);
    const std::string fp = fingerprint_text(best.hypothesis.bug);
    if (!fp.empty()) ev += "; fingerprint: " + fp;
    d.evidence = ev;
    for (size_t k = 1; k < d.ranked.size(); ++k) {
      const HypothesisEvidence& o = d.ranked[k];
      if (o.supported() && o.hypothesis.bug != best.hypothesis.bug && o.score >= best.score - 1e-9)
        d.ambiguous.push_back(o.hypothesis.str());
    }
    if (!d.ambiguous.empty()) {
      std::string list;
      for (const auto& a : d.ambiguous) list += (list.empty() ? "" : ", ") + a;
      d.evidence += "; the evidence fits " + list + " equally well";
    }
    return d;
  }

  // Nothing reproduces the candidate: a decisive fingerprint may still name the bug.
  std::string numbers;
  for (size_t k = 0; k < d.ranked.size() && k < 3; ++k)
    numbers += (numbers.empty() ? "" : " | ") + d.ranked[k].summary;
  for (const auto& f : d.fingerprints) {
    if (!f.decisive) continue;
    d.bug = Hypothesis{f.bug, f.value};
    if (in.runner) d.description = in.runner->description(f.bug);
    d.basis = "fingerprint";
    d.evidence = f.evidence;
    if (!numbers.empty()) d.evidence += "; no replay or recompute reproduces the candidate (closest: " + numbers + ")";
    return d;
  }
  d.evidence = "no hypothesis of the bug zoo fits the evidence at " + d.focus;
  if (!numbers.empty()) d.evidence += "; closest: " + numbers;
  std::string weak;
  for (const auto& f : d.fingerprints) weak += (weak.empty() ? "" : "; ") + f.evidence;
  if (!weak.empty()) d.evidence += "; hints: " + weak;
  if (hyps.empty()) d.evidence += " (no hypotheses were tested: no model to replay)";
  return d;
}

// ---------------------------------------------------------------------------
// The pipeline

namespace {

// The error signatures at the focus and the first failing names; a decisive
// one at the focus is the finding when no bug fits.
void add_signatures(BisectResult& r, const TensorSource& cand, const TensorSource& ref, const LocalOracle* oracle) {
  std::vector<std::string> names;
  if (auto at = r.localised_at()) names.push_back(*at);
  for (const TensorComparison& t : r.global.tensors) {
    if (names.size() >= 4) break;
    if (!t.pass && !t.is_int && std::find(names.begin(), names.end(), t.name) == names.end())
      names.push_back(t.name);
  }
  const std::optional<ModelConfig> cfg = manifest_config(ref, cand);
  for (const std::string& n : names)
    for (ErrorSignature& s : error_signatures(n, cand, ref, cfg, oracle)) r.diagnosis.signatures.push_back(std::move(s));
  if (r.diagnosis.bug || r.diagnosis.signatures.empty()) return;
  const ErrorSignature& best = r.diagnosis.signatures.front();
  if (best.decisive && !names.empty() && best.name == names.front()) {
    r.diagnosis.basis = "signature";
    r.diagnosis.evidence = "no bug of the zoo; the error's signature at " + best.name + " is " + best.kind + ": " + best.detail +
                           ". " + r.diagnosis.evidence;
  }
}

// An engine's own layout instead of a bug: every diverging name matches the
// reference after the same transform (the same kind, RoPE re-pairing and
// axis order), and nothing else diverges. The finding becomes the headline.
void explain_by_layout(BisectResult& r) {
  std::optional<LayoutFinding> common;
  size_t explained = 0;
  for (const TensorComparison& t : r.global.tensors) {
    if (t.pass) continue;
    const LayoutFinding* match = nullptr;
    for (const LayoutFinding& f : t.findings)
      if (f.matches && f.kind != LayoutFinding::Kind::CacheLength) {
        match = &f;
        break;
      }
    if (!match) return;  // a divergence the layout does not explain
    if (!common) common = *match;
    if (match->kind != common->kind || match->rope != common->rope) return;
    ++explained;
  }
  if (!common || explained == 0) return;
  r.layout = common;
  double worst = 0;
  for (const TensorComparison& t : r.global.tensors)
    for (const LayoutFinding& f : t.findings)
      if (f.matches) worst = std::max(worst, f.metrics.max_abs);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3g", worst);
  Diagnosis& d = r.diagnosis;
  d.basis = "layout";
  d.evidence = "no bug: every one of the " + std::to_string(explained) +
               " diverging names matches the reference after the same layout transform (" +
               finding_kind_name(common->kind) + (common->rope.empty() ? "" : ", RoPE pairs " + common->rope) +
               "; max error after it " + buf + "), e.g. " + common->summary +
               ". The dump holds the engine's own layout: apply that transform when exporting to llm-dump/1";
}

}  // namespace

namespace {

// A ring-buffer cache that wrapped: said at the step it wraps, and when the
// error starts there (nothing wrong before it), it is the finding instead of
// a bug of the model's ops.
void explain_by_ring_wrap(BisectResult& r, const TensorSource& cand) {
  const std::optional<RingWrap> w = ring_wrap(cand);
  if (!w) return;
  r.notes.push_back(w->text);
  const std::optional<std::string> at = r.localised_at();
  if (r.ok() || !at) return;
  const int step = parse_name(*at).step;
  const std::optional<std::string> first = r.first_divergence();
  if (step < w->step || (first && parse_name(*first).step < w->step)) return;
  r.diagnosis.needed = true;
  r.diagnosis.bug.reset();
  r.layout.reset();
  r.diagnosis.description.clear();
  r.diagnosis.ambiguous.clear();
  r.diagnosis.focus = *at;
  r.diagnosis.basis = "kv-ring";
  r.diagnosis.evidence = "no bug of the model's ops: the error starts at step " + std::to_string(step) + " (" + *at +
                         "), where the ring KV cache of capacity " + std::to_string(w->capacity) +
                         " has wrapped (S = " + std::to_string(w->S) + " at step " + std::to_string(w->step) +
                         ": positions < " + std::to_string(w->S - w->capacity) +
                         " overwritten) and nothing diverges before it. HF attends to every position: compare "
                         "the steps before the wrap, or give the cache at least the sequence's length";
}

}  // namespace

namespace {

// `mine` on this thread while `other` runs on a thread of its own; returns
// other's result. An exception of either is thrown once both are done.
template <class Mine, class Other>
auto beside(Mine&& mine, Other&& other) {
  auto theirs = std::async(std::launch::async, std::forward<Other>(other));
  try {
    mine();
  } catch (...) {
    theirs.wait();
    throw;
  }
  return theirs.get();
}

// bisect() of `cand` (a shard's view of the candidate when `window` is not
// the whole model).
// Expert choices that differ from the reference's only at near-ties: one
// note per routing site; with every op right on its own inputs, names that
// diverge only after the first such flip (canonical order) follow from it.
void explain_by_routing_flips(BisectResult& r) {
  std::optional<size_t> first;
  for (size_t i = 0; i < r.global.tensors.size(); ++i) {
    const TensorComparison& t = r.global.tensors[i];
    if (!t.is_int || !t.pass || t.ints.mismatches == 0) continue;
    if (t.judgement.note.rfind("routing flip at a near-tie", 0) != 0) continue;
    if (!first) first = i;
    r.routing_flips.push_back(t.name);
    if (r.routing_flips.size() <= 8) r.notes.push_back(t.name + ": " + t.judgement.note + " (not a routing bug)");
  }
  if (r.routing_flips.size() > 8)
    r.notes.push_back(std::to_string(r.routing_flips.size() - 8) + " more routing sites flip at near-ties");
  if (!first || r.global.ok() || !r.local.ran || r.local.first_failure) return;
  for (size_t i = 0; i <= *first; ++i)
    if (!r.global.tensors[i].pass) return;
  r.flips_explain = true;
  r.notes.push_back(std::to_string(r.global.failing()) + " names diverge after " + r.global.tensors[*first].name +
                    ", whose expert choices differ from the reference's at near-ties: the tokens ran other experts "
                    "from there on, and every op is right on its own inputs");
}

BisectResult bisect_source(const TensorSource& cand, const WindowSource* view, const LayerWindow& window,
                           const ReferenceRunner& reference, const LocalOracle* oracle,
                           const HypothesisRunner* hypotheses, const BisectOptions& opt) {
  auto done = [&](const std::string& what) {
    if (opt.progress) opt.progress(what);
  };
  BisectResult r;
  r.candidate_label = cand.label();
  r.model = cand.manifest().model;
  r.scenario = replay_scenario(cand);
  r.scenario.layers = window;
  r.scenario.emit_generated = r.scenario.emit_generated && window.finishes();  // the greedy picks need the head
  r.layers = window;
  r.dtype = candidate_dtype(cand, &r.dtype_source);
  r.reference = reference.describe();
  // The reference records what the candidate holds, plus the logits the
  // fingerprints read.
  std::vector<std::string> wanted = cand.names();
  if (window.finishes()) {
    wanted.push_back("step*.logits");
    wanted.push_back("step*.next_logits");
  }
  // The clean hypothesis run: a second honest implementation for the noise
  // floor, and the baseline of the diagnosis. Alone, it runs first (the BLAS
  // threads of the reference runs would compete with its own).
  //
  // Independent passes run side by side, each on part of the cores, when
  // the runners can be split (on 2 cores a pass alone leaves one idle
  // through its serial work): in two lanes of two passes when all four are
  // made, else in pairs (the clean run beside the reference at the
  // candidate's dtype, the float64 truth beside the candidate's local
  // recompute).
  const int threads = reference.threads();
  const int half = threads / 2, rest = threads - threads / 2;
  std::shared_ptr<const TensorSource> clean = opt.clean;
  std::string clean_failed;
  auto run_clean = [&](const HypothesisRunner& h) {
    try {
      clean = h.run(Hypothesis{}, r.scenario, cand.names());
    } catch (const Error& e) {
      clean_failed = std::string("the clean hypothesis engine could not replay the candidate: ") + e.what();
    }
  };
  const bool make_clean = !clean && hypotheses && (opt.noise_floor || opt.diagnose);
  const bool local = opt.local && oracle;
  std::unique_ptr<ReferenceRunner> ref_part = half > 0 ? reference.with_threads(half) : nullptr;
  std::unique_ptr<HypothesisRunner> clean_part = make_clean && ref_part ? hypotheses->with_threads(rest) : nullptr;
  std::unique_ptr<LocalOracle> oracle_part =
      opt.noise_floor && local && ref_part ? oracle->with_threads(half) : nullptr;
  std::unique_ptr<ReferenceRunner> truth_part = oracle_part ? reference.with_threads(rest) : nullptr;
  std::shared_ptr<MemoryDump> ref, truth;
  std::unique_ptr<Recomputed> cand_local;
  const std::string ref_phase = std::string("reference run in ") + compute_dtype_name(r.dtype);
  auto run_truth = [&](const ReferenceRunner& runner) {
    truth = runner.run(r.scenario, ComputeDType::Float64, wanted);
  };
  if (clean_part && truth_part) {
    // Four passes in two lanes: the clean run then the truth, beside the
    // reference at the candidate's dtype then the local recompute (alone on
    // one thread, TinyLlama: 8.0 + 8.1 s beside 4.5 + 8.9 s). In pairs, the
    // reference's thread waited for the clean run: 18.1 s -> 17.1 s.
    beside(
        [&] {
          ref = ref_part->run(r.scenario, r.dtype, wanted);
          cand_local = oracle_part->recompute(cand, ComputeDType::Float64);
        },
        [&] {
          run_clean(*clean_part);
          run_truth(*truth_part);
        });
    done("clean run of the hypothesis engine, then the reference run in float64, beside the " + ref_phase +
         ", then the local recompute of the candidate");
  } else {
    if (clean_part) {
      beside([&] { ref = ref_part->run(r.scenario, r.dtype, wanted); }, [&] { run_clean(*clean_part); });
      done("clean run of the hypothesis engine beside the " + ref_phase);
    } else {
      if (make_clean) {
        run_clean(*hypotheses);
        if (clean_failed.empty()) done("clean run of the hypothesis engine");
      }
      ref = reference.run(r.scenario, r.dtype, wanted);
      done(ref_phase);
    }
    if (truth_part) {
      cand_local = beside([&] { run_truth(*truth_part); },
                          [&] { return oracle_part->recompute(cand, ComputeDType::Float64); });
      done("reference run in float64 beside the local recompute of the candidate");
    } else if (opt.noise_floor) {
      run_truth(reference);
      done("reference run in float64");
    }
  }
  if (!clean_failed.empty()) r.notes.push_back(clean_failed);
  CompareOptions co = opt.compare;
  co.dtype = r.dtype;
  if (opt.noise_floor) {
    auto criterion = std::make_shared<NoiseFloorCriterion>(truth, r.dtype, clean);
    criterion->set_reference(ref);
    criterion->set_candidate(&cand);
    co.criterion = criterion;
    r.noise_floor = true;
    if (clean) r.second_noise = clean->label();
  }
  r.global = compare_dumps(*ref, cand, co);
  done("comparison");
  // A float32 candidate that diverges but is a 16-bit computation (an engine
  // rounding its matmul inputs to the weights' dtype) is told which dtype to
  // declare, instead of being diagnosed with a bug.
  if (opt.noise_floor && !r.global.ok() && r.dtype == ComputeDType::Float32) {
    if (const std::optional<ComputeDType> low = reference.weights_dtype()) {
      CompareOptions lo = co;
      lo.explain_layouts = false;
      // First the first divergent name alone (the reference computes only
      // what it needs): when it fails as 16-bit too, the whole comparison
      // would, and the 16-bit run of every name is not made.
      bool first_fails_too = false;
      if (const TensorComparison* first = r.global.first()) {
        std::shared_ptr<MemoryDump> one = reference.run(r.scenario, *low, {first->name});
        auto criterion = std::make_shared<NoiseFloorCriterion>(truth, *low);
        criterion->set_reference(one);
        lo.criterion = criterion;
        const DiffResult as_low_first = compare_dumps(*one, cand, lo);
        first_fails_too = !as_low_first.tensors.empty() && as_low_first.failing() > 0;
      }
      std::shared_ptr<MemoryDump> at_low =
          first_fails_too ? std::make_shared<MemoryDump>("unused") : reference.run(r.scenario, *low, wanted);
      auto criterion = std::make_shared<NoiseFloorCriterion>(truth, *low);
      criterion->set_reference(at_low);
      lo.criterion = criterion;
      const DiffResult as_low = first_fails_too ? DiffResult{} : compare_dumps(*at_low, cand, lo);
      // Within the 16-bit noise is not enough (a float32 engine's small bug
      // hides in it too): where it diverges as float32, the candidate's
      // error must be of the 16-bit run's size, not far below it.
      std::vector<double> ratios;
      for (const TensorComparison& t : r.global.tensors) {
        if (t.pass || t.is_int || !t.shape_match || ratios.size() >= 64) continue;
        if (!truth->has(t.name) || !at_low->has(t.name)) continue;
        const TensorData tr = truth->get(t.name), lw = at_low->get(t.name), cd = cand.get(t.name);
        if (tr.shape != cd.shape || lw.shape != cd.shape) continue;
        const double low_err = rmse(lw.f.data(), tr.f.data(), tr.numel());
        if (low_err > 0) ratios.push_back(rmse(cd.f.data(), tr.f.data(), tr.numel()) / low_err);
      }
      std::sort(ratios.begin(), ratios.end());
      const bool sixteen_bit_sized = !ratios.empty() && ratios[ratios.size() / 2] >= 0.25;
      if (as_low.ok() && sixteen_bit_sized) r.declare_dtype = *low;
      done(std::string("comparison at the weights' dtype (") + compute_dtype_name(*low) + ")");
    }
  }
  co.criterion.reset();  // the float64 truth (a dump's worth of memory) is not needed any more
  truth.reset();

  // cand_local: the candidate's sites recomputed in float64 from its own
  // inputs; ref_ops: the same sites by the reference's ops at the
  // candidate's dtype, from the same inputs, made where a verdict needs them.
  // The reference's local noise at a site is ref_ops against cand_local: the
  // rounding the reference makes on the very inputs judged.
  std::optional<RefOnDemand> ref_ops;
  SecondNoise second_local;
  if (local) {
    // A run's own values (those of the candidate's names, or only `names`)
    // recomputed from themselves; a shard's run also read the candidate's
    // inputs (tokens, the boundary).
    auto recompute_own = [&](const SubsetSource& run, const std::vector<std::string>* names = nullptr) {
      return view ? oracle->recompute(WithShardInputs(run, *view), ComputeDType::Float64, nullptr, names)
                  : oracle->recompute(run, ComputeDType::Float64, nullptr, names);
    };
    if (!cand_local) {
      cand_local = oracle->recompute(cand, ComputeDType::Float64);
      done("local recompute of the candidate");
    }
    const ComputeDType dtype = r.dtype;
    ref_ops.emplace([&cand, &done, oracle, dtype](const std::vector<std::string>& names) {
      std::unique_ptr<Recomputed> made = oracle->recompute(cand, dtype, nullptr, &names);
      done(std::string("the reference's ops in ") + compute_dtype_name(dtype) + " on the candidate's inputs at " +
           std::to_string(names.size()) + " sites");
      return made;
    });
    // The clean run's own local noise: the candidate's recompute when the
    // candidate is that run, else the clean run recomputed at the sites
    // whose verdict needs it (those failing on the reference's noise).
    if (clean.get() == &cand) {
      second_local = SecondNoise(local_noise(cand, *cand_local));
    } else if (clean) {
      // (Called by the diagnosis too, after this block: `recompute_own` is copied.)
      second_local = SecondNoise([&cand, &done, clean, recompute_own](const std::vector<std::string>& names) {
        const SubsetSource subset(*clean, cand.names());
        LocalNoise n = local_noise(subset, *recompute_own(subset, &names));
        done("local recompute of the clean run at " + std::to_string(names.size()) + " sites");
        return n;
      });
    }
    r.local = judge_local(cand, *cand_local, nullptr, cand_local.get(), r.dtype, co.sites,
                          clean ? &second_local : nullptr, &*ref_ops);
    done("local verdicts at " + std::to_string(r.local.sites.size()) + " sites");
    std::vector<std::string> missing;
    // Step tokens are the run's inputs; sample.* the sampler's (judged by
    // compare/sampling_check.h); kv.* a paged cache's bookkeeping (checked
    // by compare/paged_kv.h); rows the list of a row subset (dumps/contract/rows.h).
    for (const auto& n : r.local.not_recomputed)
      if (parse_name(n).site != "tokens" && parse_name(n).site != "rows" && n.find("sample.") == std::string::npos &&
          n.find(".kv.") == std::string::npos)
        missing.push_back(n);
    if (!missing.empty())
      r.notes.push_back(std::to_string(missing.size()) +
                        " candidate names have no local recompute (their inputs are not in the dump and cannot be "
                        "derived), e.g. " + missing.front());
  }
  explain_by_routing_flips(r);
  // NaN/Inf the reference does not have: a finding of its own, at the first
  // name (canonical order) that holds them.
  for (const TensorComparison& t : r.global.tensors)
    if (t.metrics.cand_nonfinite.total() > t.metrics.ref_nonfinite.total()) {
      r.notes.push_back("the candidate's first non-finite values are at " + t.name + ": " +
                        nonfinite_words(t.metrics.cand_nonfinite, t.cand_shape) + " (the reference has " +
                        std::to_string(t.metrics.ref_nonfinite.total()) + ")");
      break;
    }
  // A paged KV cache's own bookkeeping (kv.* names), whatever the values say.
  for (const PagedKvFinding& f : check_paged_sequence(cand))
    r.notes.push_back("paged KV cache (" + f.kind + "), " + f.text);
  // A 16-bit cache by design: no op fails on its own inputs, or the only
  // ones that do are attention products reading the cache, each within that
  // type's rounding (ggml multiplies q by a 16-bit cache, and the
  // probabilities by V, in the cache's type).
  std::optional<ComputeDType> cache16;
  for (const LocalSite& s : r.local.sites)
    if (s.stored_as) {
      cache16 = s.stored_as;
      break;
    }
  const LocalSite* product_failure = nullptr;
  if (!r.global.ok() && !r.flips_explain && !r.declare_dtype && r.local.ran && cache16) {
    if (!r.local.first_failure) {
      r.declare_kv_cache = cache16;
    } else {
      const double u = std::ldexp(1.0, *cache16 == ComputeDType::BFloat16 ? -8 : -11);  // unit roundoff
      bool only_products = true;
      for (const LocalSite& s : r.local.sites) {
        if (s.pass) continue;
        const std::string& site = s.parsed.site;
        // attn.out too when its recompute ran attention itself (an engine
        // that never materialises ctx, e.g. ggml's flash attention).
        const bool product = site == "attn.scores" || site == "attn.probs" || site == "attn.ctx" ||
                             (site == "attn.out" && s.source.find("attn.ctx*") != std::string::npos);
        if (!product || !s.shape_match || !s.noise.finite || s.noise.cand_rmse > 8 * u * s.noise.truth_rms) {
          only_products = false;
          break;
        }
      }
      if (only_products) {
        r.declare_kv_cache = cache16;
        product_failure = r.local.first();
      }
    }
  }
  if (r.declare_kv_cache && product_failure) {
    const std::string d = compute_dtype_name(*r.declare_kv_cache);
    const std::string key = *r.declare_kv_cache == ComputeDType::BFloat16 ? "bf16" : "f16";
    // No attention probabilities in the dump: a fused (flash) attention.
    bool fused = true;
    for (const LocalSite& s : r.local.sites)
      if (s.parsed.site == "attn.probs" || s.parsed.site == "attn.scores") fused = false;
    r.diagnosis.needed = true;
    r.diagnosis.focus = r.localised_at().value_or("");
    r.diagnosis.basis = "precision";
    r.diagnosis.evidence = "no bug: the candidate's KV cache holds every value rounded to " + d +
                           ", and the only ops that fail on their own inputs are attention products reading it (" +
                           std::to_string(r.local.failing()) + " sites, first " + product_failure->name +
                           ": local rmse " + num(product_failure->noise.cand_rmse) + ", " +
                           num(product_failure->noise.cand_rmse / std::max(product_failure->noise.truth_rms, 1e-300)) +
                           " of its rms, the size of " + d + " rounding): q and the probabilities multiplied by the "
                           "cache in its own type, as ggml does" +
                           (fused ? std::string(" (the dump has no attention probabilities: a fused flash attention, "
                                                "which also sums the values in that type)")
                                  : std::string("")) +
                           ". Declare it in the dump's manifest, \"precision\": {\"kv_cache\": \"" + key +
                           "\", \"matmul_input\": \"ggml\"" + (fused ? ", \"attention\": \"flash\"" : "") +
                           "} (llama.cpp), so that the noise floor's second run computes the same way";
  } else if (r.declare_kv_cache) {
    const std::string d = compute_dtype_name(*r.declare_kv_cache);
    const std::string key = *r.declare_kv_cache == ComputeDType::BFloat16 ? "bf16" : "f16";
    r.diagnosis.needed = true;
    r.diagnosis.focus = r.localised_at().value_or("");
    r.diagnosis.basis = "precision";
    r.diagnosis.evidence = "no bug: no op fails on its own inputs, and the candidate's KV cache holds every value "
                           "rounded to " + d + " (a " + d + " cache by design, as llama.cpp's default). Declare it "
                           "in the dump's manifest, \"precision\": {\"kv_cache\": \"" + key + "\"}, so that "
                           "the noise floor's second run stores its cache the same way";
  } else if (r.declare_dtype) {
    const std::string d = compute_dtype_name(*r.declare_dtype);
    r.diagnosis.needed = true;
    r.diagnosis.focus = r.localised_at().value_or("");
    r.diagnosis.basis = "precision";
    r.diagnosis.evidence = "no bug: judged as " + d + " (the dtype the weights are stored in) every name of the " +
                           "candidate is within the noise floor. It computes in " + d +
                           " (its matmul inputs rounded to the weights' dtype) while its manifest says float32; "
                           "declare \"dtype\": \"" + d + "\" in the dump's manifest";
  } else if (r.flips_explain) {
    r.diagnosis.needed = false;
    r.diagnosis.evidence = "routing flips at near-ties explain every divergence";
  } else if (opt.diagnose) {
    DiagnoseInputs in;
    in.cand = &cand;
    in.ref = ref.get();
    in.global = &r.global;
    in.local = &r.local;
    in.oracle = opt.local ? oracle : nullptr;
    in.local_ref = ref_ops ? &*ref_ops : nullptr;
    in.cand_local = cand_local.get();
    in.second_local = clean && ref_ops ? &second_local : nullptr;
    in.runner = hypotheses;
    in.clean = clean.get();
    in.scenario = r.scenario;
    in.dtype = r.dtype;
    in.sites = co.sites;
    in.progress = opt.progress;
    r.diagnosis = diagnose(in);
    add_signatures(r, cand, *ref, in.oracle);
    if (!r.diagnosis.bug) explain_by_layout(r);
    done("diagnosis: error signatures");
  } else {
    r.diagnosis.needed = !r.ok();
    r.diagnosis.focus = r.localised_at().value_or("");
    r.diagnosis.evidence = "diagnosis not requested";
  }
  explain_by_ring_wrap(r, cand);
  if (const std::optional<std::string> at = r.localised_at()) r.heatmap = error_heatmap(*at, *ref, cand);
  if (!r.heatmap) r.heatmap = r.global.heatmap;
  return r;
}

}  // namespace

BisectResult bisect(const TensorSource& cand, const ReferenceRunner& reference, const LocalOracle* oracle,
                    const HypothesisRunner* hypotheses, const BisectOptions& opt) {
  if (opt.layers.whole()) return bisect_source(cand, nullptr, opt.layers, reference, oracle, hypotheses, opt);
  if (opt.clean) throw UsageError("bisect: a shard of the layers makes its own clean run");
  LayerWindow window = opt.layers;
  window.boundary = &cand;  // the residual stream entering the shard: the candidate's
  check_boundary(window, cand);
  const WindowSource view(cand, window);
  if (view.names().empty())
    throw UsageError(cand.label() + ": no name of the candidate belongs to layers " + window.str() +
                     " (a shard analyses the names of its layers)");
  return bisect_source(view, &view, window, reference, oracle, hypotheses, opt);
}

}  // namespace llmdiff::compare
