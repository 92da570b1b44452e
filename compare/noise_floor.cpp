#include "compare/noise_floor.h"
#include "compare/pair_sums.h"
#include "dumps/contract/rows.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>

#include "dumps/contract/engine.h"
#include "dumps/contract/names.h"

namespace llmdiff::compare {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

bool same_nonfinite(float a, float b) {
  if (std::isnan(a) && std::isnan(b)) return true;
  return a == b;  // +Inf == +Inf, -Inf == -Inf
}
}  // namespace

double noise_multiplier(ComputeDType dtype) {
  switch (dtype) {
    case ComputeDType::BFloat16:
    case ComputeDType::Float16: return 3.0;
    case ComputeDType::Float32:
    case ComputeDType::Float64: return 2.0;
  }
  return 2.0;
}

double noise_floor_abs(double truth_rms) { return kNoiseFloorEps * kFloat32Eps * truth_rms; }

bool NoiseStats::pass() const { return finite && !(cand_rmse > threshold()) && !std::isnan(cand_rmse); }

double NoiseStats::ratio() const {
  if (!finite || std::isnan(cand_rmse)) return kInf;
  const double t = threshold();
  if (t > 0) return cand_rmse / t;
  return cand_rmse > 0 ? kInf : 0.0;
}

std::string NoiseStats::str() const {
  char buf[200];
  if (!finite) return "non-finite values where the float64 reference is finite";
  std::snprintf(buf, sizeof buf, "rmse %.3g %s %g x %.3g + %.2g", cand_rmse, pass() ? "<=" : ">", multiplier,
                noise(), floor);
  return buf;
}

double rmse(const float* a, const float* b, int64_t n, int64_t* mismatch) {
  namespace ps = pair_sums;
  ps::v8d acc[4] = {};
  double rest = 0;
  int64_t count = 0, bad = 0;
  ps::for_blocks(
      a, b, n,
      [&](const ps::v8f (&x)[4], const ps::v8f (&y)[4], int64_t) {
        for (int j = 0; j < 4; ++j) {
          const ps::v8d d = ps::wide(x[j]) - ps::wide(y[j]);
          acc[j] += d * d;
        }
        count += ps::kBlock;
      },
      [&](int64_t i) {
        const float x = a[i], y = b[i];
        if (std::isfinite(x) && std::isfinite(y)) {
          const double d = double(x) - double(y);
          rest += d * d;
          ++count;
        } else if (!same_nonfinite(x, y)) {
          ++bad;
        }
      });
  if (mismatch) *mismatch = bad;
  return count ? std::sqrt((ps::total(acc) + rest) / double(count)) : 0.0;
}

double rms(const float* a, int64_t n) {
  namespace ps = pair_sums;
  ps::v8d acc[4] = {};
  double rest = 0;
  int64_t count = 0;
  ps::for_blocks(
      a, nullptr, n,
      [&](const ps::v8f (&x)[4], const ps::v8f (&)[4], int64_t) {
        for (int j = 0; j < 4; ++j) {
          const ps::v8d v = ps::wide(x[j]);
          acc[j] += v * v;
        }
        count += ps::kBlock;
      },
      [&](int64_t i) {
        if (std::isfinite(a[i])) {
          rest += double(a[i]) * double(a[i]);
          ++count;
        }
      });
  return count ? std::sqrt((ps::total(acc) + rest) / double(count)) : 0.0;
}

void diff_stats(const float* a, const float* b, int64_t n, double* max_abs, int64_t* at, double* nmse) {
  namespace ps = pair_sums;
  ps::v8d num_l[4] = {}, den_l[4] = {}, max_l[4] = {};
  double m = 0, num = 0, den = 0;
  int64_t nonfinite_at = -1;
  ps::for_blocks(
      a, b, n,
      [&](const ps::v8f (&x)[4], const ps::v8f (&y)[4], int64_t) {
        for (int j = 0; j < 4; ++j) {
          const ps::v8d yb = ps::wide(y[j]), d = ps::wide(x[j]) - yb;
          num_l[j] += d * d;
          den_l[j] += yb * yb;
          const ps::v8d ad = d < 0 ? -d : d;
          max_l[j] = ad > max_l[j] ? ad : max_l[j];
        }
      },
      [&](int64_t i) {
        const double d = double(a[i]) - double(b[i]);
        if (!std::isfinite(d)) {
          if (!(std::isnan(a[i]) && std::isnan(b[i])) && a[i] != b[i]) nonfinite_at = i;
          return;
        }
        num += d * d;
        den += double(b[i]) * double(b[i]);
        m = std::max(m, std::fabs(d));
      });
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 8; ++l) m = std::max(m, max_l[j][l]);
  num += ps::total(num_l);
  den += ps::total(den_l);
  int64_t where = -1;
  if (nonfinite_at >= 0) {
    m = kInf;
    where = nonfinite_at;
  } else if (m > 0) {
    for (int64_t i = 0; i < n; ++i)
      if (std::fabs(double(a[i]) - double(b[i])) == m) {
        where = i;
        break;
      }
  }
  *max_abs = m;
  *at = where;
  *nmse = den > 0 ? num / den : (num > 0 ? kInf : 0.0);
}

NoiseStats noise_stats(double cand_rmse, double ref_rmse, double truth_rms, ComputeDType dtype) {
  NoiseStats s;
  s.cand_rmse = cand_rmse;
  s.ref_rmse = ref_rmse;
  s.truth_rms = truth_rms;
  s.multiplier = noise_multiplier(dtype);
  s.floor = noise_floor_abs(truth_rms);
  s.finite = std::isfinite(cand_rmse);
  return s;
}

NoiseStats noise_stats(const float* truth, const float* ref, const float* cand, int64_t n, ComputeDType dtype,
                       const float* second) {
  int64_t cand_bad = 0, ref_bad = 0;
  const double c = rmse(cand, truth, n, &cand_bad);
  const double r = rmse(ref, truth, n, &ref_bad);
  NoiseStats s = noise_stats(c, r, rms(truth, n), dtype);
  if (second) {
    int64_t second_bad = 0;
    const double e = rmse(second, truth, n, &second_bad);
    if (second_bad == 0) s.second_rmse = e;  // a non-finite honest run says nothing of the noise
  }
  // A non-finite candidate value is an error unless the reference at dtype
  // shows the same (e.g. both overflow where float64 does not).
  if (cand_bad > ref_bad) s.finite = false;
  return s;
}

NoiseFloorCriterion::NoiseFloorCriterion(std::shared_ptr<const TensorSource> truth, ComputeDType dtype,
                                         std::shared_ptr<const TensorSource> second)
    : truth_(std::move(truth)), second_(std::move(second)), dtype_(dtype) {}

Judgement NoiseFloorCriterion::judge(const TensorData& ref, const TensorData& cand, const TensorComparison& cmp) const {
  const std::string& name = cmp.name;
  auto fallback = [&](const std::string& why) {
    Judgement j = AllcloseCriterion().judge(ref, cand, cmp);
    j.note = "noise floor unavailable (" + why + "); judged by allclose at " + cmp.tolerance.str();
    return j;
  };
  if (!truth_ || !truth_->has(name)) return fallback("the float64 run lacks this name");
  TensorData truth = rows_like(truth_->get(name), cand);  // the candidate's rows when it holds some
  if (truth.shape != ref.shape) return fallback("the float64 run has shape " + shape_str(truth.shape));
  if (truth.is_int) truth.f = truth.floats();  // float values without a copy of a float tensor
  TensorData sd;
  if (second_ && second_->has(name)) sd = rows_like(second_->get(name), cand);
  const bool has_second = sd.shape == ref.shape && !sd.is_int && !sd.f.empty();
  NoiseStats s = noise_stats(truth.f.data(), ref.f.data(), cand.f.data(), ref.numel(), dtype_,
                             has_second ? sd.f.data() : nullptr);
  Judgement j;
  j.pass = s.pass();
  j.metric = "rmse vs float64";
  j.value = s.finite ? s.cand_rmse : kInf;
  j.threshold = s.threshold();
  if (!j.pass) {
    char buf[240];
    std::snprintf(buf, sizeof buf,
                  "noise floor: RMSE against float64 %.3g exceeds %g x %.3g (%s %s rounding) + floor %.2g",
                  s.cand_rmse, s.multiplier, s.noise(),
                  s.second_rmse > s.ref_rmse ? "the second honest run's" : "the reference's own",
                  compute_dtype_name(dtype_), s.floor);
    j.note = s.finite ? buf : "noise floor: " + s.str();
  }
  return j;
}

std::optional<Judgement> NoiseFloorCriterion::judge_ints(const TensorData& ref, const TensorData& cand,
                                                         const TensorComparison& cmp) const {
  const std::string tail = "moe.topk_ids";
  if (cmp.name.size() > tail.size() && cmp.name.compare(cmp.name.size() - tail.size(), tail.size(), tail) == 0)
    return judge_routing(ref, cand, cmp);
  if (cmp.name != "generated" || !truth_ || !reference_ || ref.i.size() != cand.i.size()) return std::nullopt;
  // generated[k] is the pick of step first + k, the last M steps.
  int steps = 0;
  while (truth_->has(step_name(steps, "next_logits"))) ++steps;
  const int first = steps - int(cand.i.size());
  if (first < 0) return std::nullopt;
  Judgement j;
  j.metric = "greedy picks wrong against float64";
  std::string ties, flips;
  int wrong = 0;
  for (size_t k = 0; k < cand.i.size(); ++k) {
    if (cand.i[k] == ref.i[k]) continue;
    const std::string logits = step_name(first + int(k), "next_logits");
    if (!reference_->has(logits)) return std::nullopt;
    const std::vector<float> t = truth_->get(logits).floats(), r = reference_->get(logits).floats();
    const int64_t pick = cand.i[k];
    if (t.size() != r.size() || pick < 0 || pick >= int64_t(t.size())) return std::nullopt;
    const int64_t best = argmax_first(t);
    if (pick == best) {
      flips += (flips.empty() ? "" : ", ") + std::to_string(k);
      continue;
    }
    double noise = 0;
    for (size_t i = 0; i < t.size(); ++i) noise = std::max(noise, double(std::fabs(r[i] - t[i])));
    if (second_ && second_->has(logits)) {
      const std::vector<float> sv = second_->get(logits).floats();
      if (sv.size() == t.size())
        for (size_t i = 0; i < t.size(); ++i) noise = std::max(noise, double(std::fabs(sv[i] - t[i])));
    }
    const double gap = double(t[size_t(best)]) - double(t[size_t(pick)]);
    if (gap <= 2.0 * noise + noise_floor_abs(std::fabs(double(t[size_t(best)])))) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "%zu (float64 gap %.3g to the argmax %lld, noise %.3g)", k, gap, (long long)best,
                    noise);
      ties += (ties.empty() ? "" : ", ") + std::string(buf);
    } else {
      ++wrong;
    }
  }
  j.value = wrong;
  j.threshold = 0;
  j.pass = wrong == 0;
  if (!flips.empty()) j.note += "the float64 argmax at index " + flips + " (the reference at dtype flips it)";
  if (!ties.empty())
    j.note += std::string(j.note.empty() ? "" : "; ") + "near-tie, undecidable at index " + ties;
  return j;
}

std::optional<Judgement> NoiseFloorCriterion::judge_routing(const TensorData& ref, const TensorData& cand,
                                                            const TensorComparison& cmp) const {
  // The scores the experts were chosen by, in each run: the candidate's, the
  // reference's at dtype, the float64 truth's and the second honest run's;
  // and the honest runs' own choices.
  const std::string probs = cmp.name.substr(0, cmp.name.size() - std::string("moe.topk_ids").size()) + "moe.router_probs";
  if (!candidate_ || !reference_ || !truth_ || !candidate_->has(probs) || !reference_->has(probs) || !truth_->has(probs))
    return std::nullopt;
  if (ref.shape.size() != 2 || ref.shape != cand.shape) return std::nullopt;
  const TensorData c = candidate_->get(probs);
  const TensorData r = rows_like(reference_->get(probs), c), t = rows_like(truth_->get(probs), c);
  TensorData sd, s_ids, t_ids;
  if (second_ && second_->has(probs)) sd = rows_like(second_->get(probs), c);
  if (second_ && second_->has(cmp.name)) s_ids = rows_like(second_->get(cmp.name), cand);
  if (truth_->has(cmp.name)) t_ids = rows_like(truth_->get(cmp.name), cand);
  const int64_t T = ref.shape[0], K = ref.shape[1];
  if (c.is_int || c.shape.size() != 2 || c.shape[0] != T || r.shape != c.shape || t.shape != c.shape) return std::nullopt;
  const bool has_second = sd.shape == c.shape && !sd.is_int;
  const int64_t E = c.shape[1];
  auto same_set = [K](const int64_t* x, const int64_t* y) {
    for (int64_t k = 0; k < K; ++k)
      if (std::find(y, y + K, x[k]) == y + K) return false;
    return true;
  };
  // Whether `ids` are K experts of the largest scores in `v` (ties either way).
  auto top_k = [K, E](const int64_t* ids, const float* v) {
    float low = std::numeric_limits<float>::infinity(), high = -low;
    for (int64_t e = 0; e < E; ++e) {
      const bool in = std::find(ids, ids + K, e) != ids + K;
      if (in) low = std::min(low, v[e]);
      else high = std::max(high, v[e]);
    }
    return low >= high;
  };
  Judgement j;
  j.metric = "expert choices differing beyond rounding";
  std::string ties;
  int wrong = 0, flips = 0, listed = 0;
  for (int64_t row = 0; row < T; ++row) {
    const int64_t* a = &cand.i[size_t(row * K)];
    const int64_t* b = &ref.i[size_t(row * K)];
    if (same_set(a, b)) continue;
    ++flips;
    const float *cr = &c.f[size_t(row * E)], *rr = &r.f[size_t(row * E)], *tr = &t.f[size_t(row * E)];
    // Rounding noise of the scores on this row: the honest runs' largest
    // deviation from float64; the candidate's deviation from the reference.
    double noise = 0, dev = 0, top = 0;
    for (int64_t e = 0; e < E; ++e) {
      noise = std::max(noise, double(std::fabs(rr[e] - tr[e])));
      if (has_second) noise = std::max(noise, double(std::fabs(sd.f[size_t(row * E + e)] - tr[e])));
      dev = std::max(dev, double(std::fabs(cr[e] - rr[e])));
      top = std::max(top, double(std::fabs(tr[e])));
    }
    const double floor = noise_floor_abs(top);
    // An honest run chose as the candidate did: the choice is undecidable.
    const bool honest = (s_ids.is_int && s_ids.shape == cand.shape && same_set(a, &s_ids.i[size_t(row * K)])) ||
                        (t_ids.is_int && t_ids.shape == cand.shape && same_set(a, &t_ids.i[size_t(row * K)]));
    // Or a router choosing by these scores (both choices their top K): the
    // reference's margin between the swapped experts is within what the
    // candidate's rounding moved them, itself within the honest noise.
    double margin = std::numeric_limits<double>::infinity();
    if (top_k(a, cr) && top_k(b, rr)) {
      double best_out = -margin, worst_in = margin;
      for (int64_t k = 0; k < K; ++k) {
        if (std::find(b, b + K, a[k]) == b + K) best_out = std::max(best_out, double(rr[a[k]]));
        if (std::find(a, a + K, b[k]) == a + K) worst_in = std::min(worst_in, double(rr[b[k]]));
      }
      margin = worst_in - best_out;
    }
    const bool near = margin <= 2.0 * dev + floor && dev <= 2.0 * noise + floor;
    if (!honest && !near) {
      ++wrong;
      continue;
    }
    if (listed++ < 3) {
      std::string only_c, only_r;
      for (int64_t k = 0; k < K; ++k) {
        if (std::find(b, b + K, a[k]) == b + K) only_c += (only_c.empty() ? "" : ",") + std::to_string(a[k]);
        if (std::find(a, a + K, b[k]) == a + K) only_r += (only_r.empty() ? "" : ",") + std::to_string(b[k]);
      }
      char buf[240];
      if (near)
        std::snprintf(buf, sizeof buf, "token %lld: expert %s for %s (the reference's margin %.3g, its scores moved by %.3g, noise %.3g)",
                      (long long)row, only_c.c_str(), only_r.c_str(), margin, dev, noise);
      else
        std::snprintf(buf, sizeof buf, "token %lld: expert %s for %s (as an honest run chose)", (long long)row,
                      only_c.c_str(), only_r.c_str());
      ties += (ties.empty() ? "" : "; ") + std::string(buf);
    }
  }
  j.value = wrong;
  j.threshold = 0;
  j.pass = wrong == 0;
  if (flips > wrong)
    j.note = "routing flip at a near-tie, undecidable (" + std::to_string(flips - wrong) + " of " + std::to_string(T) +
             " tokens): " + ties + (listed > 3 ? "; ..." : "");
  return j;
}

}  // namespace llmdiff::compare
