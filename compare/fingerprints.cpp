// The fingerprint finders (compare/fingerprints.h), one per test, and their table.
#include "compare/fingerprints.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "compare/batch_fingerprints.h"
#include "compare/local_error.h"
#include "compare/serving_fingerprints.h"
#include "compare/signatures.h"
#include "dumps/base/errors.h"
#include "dumps/contract/calls.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sites.h"
#include "dumps/zoo/bugs.h"

namespace llmdiff::compare {

namespace {

constexpr const char* kInvFreq = "rope.inv_freq";  // the model-level name (no step, no site of the table)

std::string num(double v) {
  char buf[32];
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (std::isnan(v)) return "nan";
  std::snprintf(buf, sizeof buf, "%.2g", v);
  return buf;
}

// The zoo's name of the bug a fingerprint points at (dumps/zoo/bugs.h).
std::string named(zoo::Signature s) { return zoo::bug_with_signature(s).name; }

// Row `row` of a [rows, cols] tensor.
std::vector<float> row_of(const TensorData& t, int64_t row) {
  const int64_t cols = t.shape.empty() ? 0 : t.shape.back();
  std::vector<float> f = t.floats();
  if (cols <= 0 || (row + 1) * cols > int64_t(f.size())) return {};
  return std::vector<float>(f.begin() + row * cols, f.begin() + (row + 1) * cols);
}

int64_t argmax_of(const std::vector<float>& v) { return v.empty() ? -1 : argmax(v.data(), int64_t(v.size())); }

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

// The first layer site of the candidate's names that fails, of `site` (in
// the candidate's name order); "" when none.
std::string first_failing(const FingerprintScene& s, Site site) {
  for (const auto& n : s.cand.names()) {
    const CanonName c = parse_name(n);
    if (c.kind == CanonName::Kind::Layer && c.site == site_name(site) && s.failing(n)) return n;
  }
  return "";
}

// ---------------------------------------------------------------------------
// The finders

// lm-head: the head's input matches, its output does not. Logits that are a
// multiple or an increasing function of the reference's are a scale or a
// pointwise change (a logit scale, soft-capping), not another head matrix.
void head_only(const FingerprintScene& s, std::vector<Fingerprint>& out) {
  for (int step = 0; step < int(s.scenario.steps.size()); ++step) {
    const std::string logits = step_name(step, Site::Logits);
    if (!s.failing(logits)) continue;
    const std::string fn = step_name(step, Site::FinalNorm);
    if (s.passing(fn)) {
      const TensorComparison* a = s.global.find(fn);
      const TensorComparison* b = s.global.find(logits);
      const std::string head = fn + " matches the reference (rmse " + num(a->metrics.rmse) + ") while " + logits +
                               " does not (rmse " + num(b->metrics.rmse) + ", max err " + num(b->metrics.max_abs) + ")";
      if (b->metrics.cand_nonfinite.total() > 0) return;  // NaN/Inf: the non-finite finding, not the head
      TensorData cl = s.cand.get(logits), rl = s.ref.get(logits);
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
    } else if (s.cfg && !s.cand.has(fn)) {
      const std::string last = layer_name(step, int(s.cfg->num_hidden_layers) - 1, Site::Out);
      if (s.passing(last))
        out.push_back({named(zoo::Signature::HeadOnly),
                       last + " matches the reference while " + logits +
                           " does not (no final_norm in the candidate: the final norm or the lm_head is wrong)",
                       false});
    }
    return;
  }
}

// The greedy token that follows step `step` in the candidate: its
// `generated` entry, or the next decode step's token; nullopt when neither.
std::optional<std::pair<int64_t, std::string>> picked_after(const FingerprintScene& s, int step) {
  const Scenario& sc = s.scenario;
  if (!sc.rollback.empty()) return std::nullopt;  // a speculative run: several tokens per call
  if (s.cand.has("generated") && step >= sc.first_generating_step) {
    TensorData g = s.cand.get("generated");
    const size_t k = size_t(step - sc.first_generating_step);
    if (g.is_int && k < g.i.size()) return std::make_pair(g.i[k], "generated[" + std::to_string(k) + "]");
    return std::nullopt;
  }
  if (step + 1 < int(sc.steps.size()) && sc.steps[size_t(step + 1)].size() == 1 &&
      s.cand.manifest().scenario == "decode")
    return std::make_pair(sc.steps[size_t(step + 1)][0], step_name(step + 1, Site::Tokens));
  return std::nullopt;
}

// last-token-first: next_logits (or the greedy token) read from row 0.
void last_row_first(const FingerprintScene& s, std::vector<Fingerprint>& out) {
  for (int step = 0; step < int(s.scenario.steps.size()); ++step) {
    const int64_t T = int64_t(s.scenario.steps[size_t(step)].size());
    if (T < 2 || !s.ref.has(step_name(step, Site::Logits))) continue;
    TensorData rl = s.ref.get(step_name(step, Site::Logits));
    std::vector<float> row0 = row_of(rl, 0), last = row_of(rl, T - 1);
    const std::string nl = step_name(step, Site::NextLogits);
    if (s.cand.has(nl) && s.failing(nl)) {
      TensorData c = s.cand.get(nl);
      if (c.numel() == int64_t(row0.size())) {
        const double e0 = rmse(c.f.data(), row0.data(), c.numel());
        const double el = rmse(c.f.data(), last.data(), c.numel());
        if (e0 * 100 < el) {
          out.push_back({named(zoo::Signature::LastRowFirst),
                         nl + " is the reference's logits row 0 (rmse " + num(e0) + ") instead of row " +
                             std::to_string(T - 1) + " (rmse " + num(el) + ")",
                         true});
          return;
        }
      }
    }
    const int64_t a0 = argmax_of(row0), al = argmax_of(last);
    if (a0 == al) continue;
    const auto picked = picked_after(s, step);
    if (picked && picked->first == a0) {
      out.push_back({named(zoo::Signature::LastRowFirst),
                     picked->second + " = " + std::to_string(picked->first) + " is the argmax of the reference's step" +
                         std::to_string(step) + " logits row 0, not of its last row " + std::to_string(T - 1) + " (" +
                         std::to_string(al) + ")",
                     true});
      return;
    }
  }
}

// rope-position-reset: positions restart at 0 after a cached prefix.
void positions_restart(const FingerprintScene& s, std::vector<Fingerprint>& out) {
  for (int step = 1; step < int(s.scenario.steps.size()); ++step) {
    const std::string name = step_name(step, Site::Positions);
    if (!s.cand.has(name) || s.past[size_t(step)] == 0) continue;
    TensorData p = s.cand.get(name);
    if (p.is_int && !p.i.empty() && p.i[0] == 0) {
      out.push_back({named(zoo::Signature::PositionsRestart),
                     name + " starts at 0 although " + std::to_string(s.past[size_t(step)]) +
                         " tokens are cached before this call",
                     true});
      return;
    }
  }
}

// Masks: every key allowed (no causal mask), this call's keys alone (the
// cache holds none of the past), or square as if nothing were cached.
void masks(const FingerprintScene& s, std::vector<Fingerprint>& out) {
  for (int step = 0; step < int(s.scenario.steps.size()); ++step) {
    const std::string name = step_name(step, Site::Mask);
    if (!s.cand.has(name)) continue;
    TensorData m = s.cand.get(name);
    const int64_t T = int64_t(s.scenario.steps[size_t(step)].size()), P = s.past[size_t(step)];
    if (m.shape.size() != 2 || m.shape[0] != T) continue;
    const int64_t S = m.shape[1];
    std::vector<float> f = m.floats();
    const bool all_ones = std::all_of(f.begin(), f.end(), [](float x) { return x == 1.0f; });
    if (T > 1 && all_ones && S >= T) {
      out.push_back({named(zoo::Signature::MaskAllowsAll),
                     name + " allows every key for every query (T = " + std::to_string(T) + "): no causal mask", true});
      return;
    }
    if (P > 0 && S == T) {
      out.push_back({named(zoo::Signature::CacheHoldsCallOnly),
                     name + " spans " + std::to_string(S) + " keys where " + std::to_string(P + T) +
                         " are cached (" + std::to_string(P) + " before this call): only this call's keys are attended",
                     true});
      return;
    }
    if (P > 0 && S == P + T) {
      bool square = true;  // key k allowed iff k <= t, whatever the past
      for (int64_t t = 0; t < T && square; ++t)
        for (int64_t k = 0; k < S; ++k)
          if ((f[size_t(t * S + k)] == 1.0f) != (k <= t)) {
            square = false;
            break;
          }
      if (square) {
        out.push_back({named(zoo::Signature::MaskIgnoresPast),
                       name + " allows key s iff s <= t as if nothing were cached (" + std::to_string(P) +
                           " cached tokens)",
                       true});
        return;
      }
    }
  }
}

// kv-overwrite: the cache holds only this call's keys (unless a mask said so already).
void cache_holds_call_only(const FingerprintScene& s, std::vector<Fingerprint>& out) {
  if (s.fired(named(zoo::Signature::CacheHoldsCallOnly))) return;
  for (int step = 1; step < int(s.scenario.steps.size()); ++step) {
    const int64_t T = int64_t(s.scenario.steps[size_t(step)].size()), P = s.past[size_t(step)];
    if (P == 0) continue;
    for (const auto& n : s.cand.names()) {
      const CanonName c = parse_name(n);
      if (c.kind != CanonName::Kind::Layer || c.step != step || c.site != site_name(Site::AttnKCache)) continue;
      const Shape sh = s.cand.shape(n);
      if (sh.size() == 3 && sh[1] == T) {
        out.push_back({named(zoo::Signature::CacheHoldsCallOnly),
                       n + " holds " + std::to_string(T) + " positions where " + std::to_string(P + T) +
                           " are expected: the cache was overwritten",
                       true});
        return;
      }
      break;  // the first layer's cache of this step speaks for the step
    }
  }
}

// repeat-kv-tile: k_rep[h] == k_cache[h mod Hkv] instead of k_cache[h / n_rep].
void kv_heads_tiled(const FingerprintScene& s, std::vector<Fingerprint>& out) {
  const std::optional<ModelConfig>& cfg = s.cfg;
  if (!cfg || cfg->num_key_value_heads <= 1 || cfg->num_attention_heads <= cfg->num_key_value_heads) return;
  const int64_t hq = cfg->num_attention_heads, hkv = cfg->num_key_value_heads, n_rep = hq / hkv;
  const std::string n = first_failing(s, Site::AttnKRep);
  if (n.empty()) return;
  const CanonName c = parse_name(n);
  const std::string cache = layer_name(c.step, c.layer, Site::AttnKCache);
  if (!s.cand.has(cache)) return;
  TensorData rep = s.cand.get(n), kc = s.cand.get(cache);
  if (rep.shape.size() != 3 || kc.shape.size() != 3 || rep.shape[0] != hq || kc.shape[0] != hkv ||
      rep.shape[1] != kc.shape[1])
    return;
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
    out.push_back({named(zoo::Signature::KvHeadsTiled),
                   n + ": query head h holds kv head h mod " + std::to_string(hkv) + " instead of h / " +
                       std::to_string(n_rep),
                   true});
}

// gate-up-swap: act == silu(up) * gate from the candidate's own values.
void gate_up_swapped(const FingerprintScene& s, std::vector<Fingerprint>& out) {
  const std::string n = first_failing(s, Site::MlpAct);
  if (n.empty()) return;
  const CanonName c = parse_name(n);
  const std::string g = layer_name(c.step, c.layer, Site::MlpGate), u = layer_name(c.step, c.layer, Site::MlpUp);
  if (!s.cand.has(g) || !s.cand.has(u)) return;
  TensorData act = s.cand.get(n), gate = s.cand.get(g), up = s.cand.get(u);
  if (act.shape != gate.shape || act.shape != up.shape) return;
  std::vector<float> right(act.f.size()), swapped(act.f.size());
  for (size_t i = 0; i < act.f.size(); ++i) {
    const double x = gate.f[i], y = up.f[i];
    right[i] = float(x / (1.0 + std::exp(-x)) * y);
    swapped[i] = float(y / (1.0 + std::exp(-y)) * x);
  }
  const double er = rmse(act.f.data(), right.data(), act.numel());
  const double es = rmse(act.f.data(), swapped.data(), act.numel());
  if (es * 100 < er)
    out.push_back({named(zoo::Signature::GateUpSwapped),
                   n + " equals silu(up) * gate of the candidate's own gate/up (rmse " + num(es) +
                       ") rather than silu(gate) * up (rmse " + num(er) + ")",
                   true});
}

// softmax-scale: scores a constant multiple of the reference's. The zoo's
// softmax-scale scales by 1/Dh instead of the model's own scaling (Dh^-0.5;
// MLA: (Dn+Dr)^-0.5 x mscale^2): named only for the factor that implies;
// any other is reported as the scale it is.
void scores_rescaled(const FingerprintScene& s, std::vector<Fingerprint>& out) {
  const std::string n = first_failing(s, Site::AttnScores);
  if (n.empty()) return;
  const CanonName c = parse_name(n);
  if (!s.passing(layer_name(c.step, c.layer, Site::AttnQRope))) return;
  TensorData a = s.cand.get(n), b = s.ref.get(n);
  if (a.shape != b.shape) return;
  const double k = fit_scale(a.f.data(), b.f.data(), a.numel());
  if (k == 0) return;
  const double e = scaled_rmse(a.f.data(), b.f.data(), a.numel(), k), e1 = rmse(a.f.data(), b.f.data(), a.numel());
  if (!(e * 100 < e1)) return;
  const std::string what = "the scores are the reference's times " + value_str(k);
  const std::string rest = " (rmse after rescaling " + num(e) + ")";
  const int64_t dh = s.cfg ? (s.cfg->mla.enabled ? s.cfg->mla.qk_head_dim() : s.cfg->head_dim) : 0;
  const double implied = dh > 0 ? (1.0 / double(dh)) / s.cfg->attn_scaling() : 0.0;
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

// RoPE frequencies of theta over `dim` (half = dim / 2 of them).
std::vector<float> default_inv_freq(double theta, int64_t half) {
  std::vector<float> v(static_cast<size_t>(half));
  for (int64_t j = 0; j < half; ++j) v[size_t(j)] = float(1.0 / std::pow(theta, double(2 * j) / double(2 * half)));
  return v;
}

double max_rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  double m = 0;
  for (size_t j = 0; j < want.size() && j < got.size(); ++j)
    m = std::max(m, std::fabs(double(got[j]) - want[j]) / std::max(1e-30, double(std::fabs(want[j]))));
  return m;
}

// The theta whose frequencies fit `inv` (least squares of log inv[j] =
// -(2j/dim) log theta over j >= 1), as round as reproduces them; nullopt
// when nothing fits to 1e-4.
std::optional<std::pair<double, double>> fitted_theta(const std::vector<float>& inv) {
  const int64_t half = int64_t(inv.size()), dim = 2 * half;
  double sxy = 0, sxx = 0;
  for (int64_t j = 1; j < half; ++j) {
    const float v = inv[size_t(j)];
    if (!(v > 0)) continue;
    const double x = double(2 * j) / double(dim);
    sxy += x * -std::log(double(v));
    sxx += x * x;
  }
  if (!(sxx > 0)) return std::nullopt;
  const double fit = std::exp(sxy / sxx);
  double theta = fit, e = max_rel_err(inv, default_inv_freq(fit, half));
  for (int digits = 2; digits <= 8; ++digits) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.*g", digits, fit);
    const double t = std::strtod(buf, nullptr), et = max_rel_err(inv, default_inv_freq(t, half));
    if (et < 2e-6) {
      theta = t, e = et;
      break;
    }
  }
  if (e >= 1e-4) return std::nullopt;
  return std::make_pair(theta, e);
}

// RoPE frequencies: the config's scaling ignored, or another theta.
void inv_freq(const FingerprintScene& s, std::vector<Fingerprint>& out) {
  const std::optional<ModelConfig>& cfg = s.cfg;
  if (!cfg || !s.cand.has(kInvFreq) || !s.failing(kInvFreq)) return;
  const TensorData inv = s.cand.get(kInvFreq);
  const int64_t half = inv.numel();
  if (cfg->rope_scaling.type != RopeScaling::Type::Default &&
      max_rel_err(inv.f, default_inv_freq(cfg->rope_theta, half)) < 1e-5) {
    out.push_back({named(zoo::Signature::InvFreqUnscaled),
                   std::string("rope.inv_freq equals the unscaled frequencies of theta ") + value_str(cfg->rope_theta) +
                       " (config rope_scaling " + rope_type_name(cfg->rope_scaling.type) + " ignored)",
                   true});
    return;
  }
  if (half < 2 || cfg->rope_scaling.type != RopeScaling::Type::Default) return;
  if (const auto fit = fitted_theta(inv.f))
    out.push_back({named(zoo::Signature::InvFreqTheta),
                   "rope.inv_freq fits theta = " + value_str(fit->first) + " (config says " +
                       value_str(cfg->rope_theta) + "; max rel err " + num(fit->second) + ")",
                   true, fit->first});
}

// missing-bias (or any wrong bias): q/k/v off by the same vector in every row.
void row_constant_offset(const FingerprintScene& s, std::vector<Fingerprint>& out) {
  for (const auto& n : s.cand.names()) {
    const CanonName c = parse_name(n);
    if (c.kind != CanonName::Kind::Layer ||
        (c.site != site_name(Site::AttnQ) && c.site != site_name(Site::AttnK) && c.site != site_name(Site::AttnV)) ||
        !s.failing(n))
      continue;
    if (!s.passing(layer_name(c.step, c.layer, Site::AttnNorm))) return;
    TensorData a = s.cand.get(n), b = s.ref.get(n);
    if (a.shape != b.shape || a.shape.size() != 2 || a.shape[0] < 2) return;
    const int64_t rows = a.shape[0], cols = a.shape[1];
    double spread = 0, total = 0;
    for (int64_t j = 0; j < cols; ++j) {
      const double d0 = double(a.f[size_t(j)]) - b.f[size_t(j)];
      total = std::max(total, std::fabs(d0));
      for (int64_t t = 1; t < rows; ++t)
        spread = std::max(spread, std::fabs(double(a.f[size_t(t * cols + j)]) - b.f[size_t(t * cols + j)] - d0));
    }
    if (total > 0 && spread * 100 < total)
      out.push_back({named(zoo::Signature::RowConstantOffset),
                     n + " differs from the reference by the same vector in every row (max " + num(total) +
                         ", row-to-row spread " + num(spread) + "): a bias is missing or wrong",
                     false});
    return;
  }
}

}  // namespace

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

std::vector<int64_t> past_lengths(const Scenario& sc) {
  std::vector<int64_t> p;
  for (const CallSpan& c : call_spans(sc.steps, int64_t(sc.cached_prefix.size()), sc.rollback)) p.push_back(c.P);
  return p;
}

bool FingerprintScene::failing(const std::string& name) const {
  const TensorComparison* t = global.find(name);
  return t && !t->pass;
}

bool FingerprintScene::passing(const std::string& name) const {
  const TensorComparison* t = global.find(name);
  return t && t->pass;
}

bool FingerprintScene::fired(const std::string& bug) const {
  return found && std::any_of(found->begin(), found->end(), [&](const Fingerprint& f) { return f.bug == bug; });
}

const std::vector<FingerprintFinderEntry>& fingerprint_finders() {
  static const std::vector<FingerprintFinderEntry> table = {
      {"speculative: accepted drafts miscounted", spec_accepted_miscounted},
      {"speculative: rejected drafts not rolled back", spec_rollback_missing},
      {"speculative: rejected drafts still read", spec_context_rejected},
      {"the head alone wrong", head_only},
      {"next_logits from the prompt's first row", last_row_first},
      {"positions restarting at 0", positions_restart},
      {"masks without the causal or the past keys", masks},
      {"a cache of this call's length", cache_holds_call_only},
      {"kv heads tiled", kv_heads_tiled},
      {"gate and up swapped", gate_up_swapped},
      {"scores rescaled", scores_rescaled},
      {"RoPE frequencies of another theta or unscaled", inv_freq},
      {"q/k/v off by one row vector", row_constant_offset},
      {"batch: positions shifted", batch_positions_shifted},
      {"batch: attention beyond the sequence's keys", batch_attention_leak},
      {"batch: paged bookkeeping", batch_paged_bookkeeping},
      {"batch: cache blocks out of order", batch_blocks_out_of_order},
  };
  return table;
}

std::vector<Fingerprint> fingerprints(const TensorSource& cand, const TensorSource& ref, const DiffResult& global,
                                      const Scenario& sc) {
  std::vector<Fingerprint> out;
  const FingerprintScene scene{cand, ref, global, sc, past_lengths(sc), manifest_config(ref, cand), &out};
  for (const FingerprintFinderEntry& f : fingerprint_finders()) f.find(scene, out);
  return out;
}

}  // namespace llmdiff::compare
