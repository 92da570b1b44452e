#include "compare/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "dumps/dtype.h"

namespace llmdiff::compare {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

// Monotonic integer image of a float's bit pattern on a grid of `bits` bits
// (sign-magnitude to two's complement), so that neighbours differ by 1.
int64_t ordered(uint32_t pattern, int bits) {
  uint32_t sign = 1u << (bits - 1);
  uint32_t mag = pattern & (sign - 1);
  return (pattern & sign) ? -int64_t(mag) : int64_t(mag);
}

bool same_nonfinite(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b;  // both infinite here: equal only with the same sign
}
}  // namespace

std::vector<int64_t> unravel(int64_t flat, const Shape& shape) {
  std::vector<int64_t> idx(shape.size(), 0);
  for (size_t d = shape.size(); d-- > 0;) {
    int64_t n = shape[d] > 0 ? shape[d] : 1;
    idx[d] = flat % n;
    flat /= n;
  }
  return idx;
}

std::string index_str(const std::vector<int64_t>& idx) {
  std::string s = "[";
  for (size_t i = 0; i < idx.size(); ++i) s += (i ? ", " : "") + std::to_string(idx[i]);
  return s + "]";
}

int64_t ulp_distance(float a, float b, ComputeDType grid) {
  if (std::isnan(a) || std::isnan(b)) return -1;
  int64_t oa, ob;
  switch (grid) {
    case ComputeDType::BFloat16:
      oa = ordered(f32_to_bf16(a), 16);
      ob = ordered(f32_to_bf16(b), 16);
      break;
    case ComputeDType::Float16:
      oa = ordered(f32_to_f16(a), 16);
      ob = ordered(f32_to_f16(b), 16);
      break;
    default: {
      uint32_t ua, ub;
      std::memcpy(&ua, &a, 4);
      std::memcpy(&ub, &b, 4);
      oa = ordered(ua, 32);
      ob = ordered(ub, 32);
    }
  }
  return oa > ob ? oa - ob : ob - oa;
}

FloatMetrics float_metrics(const float* ref, const float* cand, int64_t n, ComputeDType ulp_dtype) {
  FloatMetrics m;
  m.count = n;
  m.ulp_dtype = ulp_dtype;
  double sum_abs = 0, sum_sq = 0, sum_bb = 0, sum_aa = 0, sum_ab = 0;
  auto count_nonfinite = [](float v, int64_t i, NonFiniteCounts& c) {
    if (std::isnan(v)) {
      if (c.first_nan < 0) c.first_nan = i;
      ++c.nan;
    } else if (v > 0) {
      ++c.pos_inf;
    } else {
      ++c.neg_inf;
    }
  };
  for (int64_t i = 0; i < n; ++i) {
    float fa = cand[i], fb = ref[i];
    bool fin_a = std::isfinite(fa), fin_b = std::isfinite(fb);
    if (!fin_a) count_nonfinite(fa, i, m.cand_nonfinite);
    if (!fin_b) count_nonfinite(fb, i, m.ref_nonfinite);
    if (!fin_a || !fin_b) {
      if (!same_nonfinite(fa, fb)) {
        if (m.first_nonfinite_mismatch < 0) m.first_nonfinite_mismatch = i;
        ++m.nonfinite_mismatch;
      }
      continue;
    }
    ++m.finite_pairs;
    double a = fa, b = fb, d = a - b, ad = std::fabs(d), ab = std::fabs(b);
    if (ad > m.max_abs || m.max_abs_at < 0) {
      m.max_abs = ad;
      m.max_abs_at = i;
      m.ref_at_max_abs = b;
      m.cand_at_max_abs = a;
    }
    if (ab > 0) {
      double rel = ad / ab;
      if (rel > m.max_rel || m.max_rel_at < 0) {
        m.max_rel = rel;
        m.max_rel_at = i;
      }
    }
    m.ref_max_abs = std::max(m.ref_max_abs, ab);
    m.cand_max_abs = std::max(m.cand_max_abs, std::fabs(a));
    sum_abs += ad;
    sum_sq += d * d;
    sum_bb += b * b;
    sum_aa += a * a;
    sum_ab += a * b;
    m.max_ulp = std::max(m.max_ulp, ulp_distance(fa, fb, ulp_dtype));
  }
  if (m.finite_pairs > 0) {
    m.mean_abs = sum_abs / double(m.finite_pairs);
    m.rmse = std::sqrt(sum_sq / double(m.finite_pairs));
  }
  m.nmse = sum_bb > 0 ? sum_sq / sum_bb : (sum_sq > 0 ? kInf : 0.0);
  m.sqnr_db = sum_sq > 0 ? (sum_bb > 0 ? 10.0 * std::log10(sum_bb / sum_sq) : -kInf) : kInf;
  if (sum_aa == 0 && sum_bb == 0)
    m.cosine = 1;
  else if (sum_aa == 0 || sum_bb == 0)
    m.cosine = 0;
  else
    m.cosine = sum_ab / std::sqrt(sum_aa * sum_bb);
  return m;
}

AllcloseResult allclose(const float* ref, const float* cand, int64_t n, const Tolerance& tol) {
  AllcloseResult r;
  r.tol = tol;
  r.count = n;
  for (int64_t i = 0; i < n; ++i) {
    float fa = cand[i], fb = ref[i];
    bool fail;
    double ratio, need_atol, need_rtol;
    if (!std::isfinite(fa) || !std::isfinite(fb)) {
      fail = !same_nonfinite(fa, fb);
      ratio = need_atol = need_rtol = fail ? kInf : 0.0;
    } else {
      double ad = std::fabs(double(fa) - double(fb)), ab = std::fabs(double(fb));
      double bound = tol.atol + tol.rtol * ab;
      fail = !(ad <= bound);
      ratio = bound > 0 ? ad / bound : (ad > 0 ? kInf : 0.0);
      need_atol = std::max(0.0, ad - tol.rtol * ab);
      if (ad <= tol.atol)
        need_rtol = 0;
      else
        need_rtol = ab > 0 ? (ad - tol.atol) / ab : kInf;
    }
    if (fail) {
      if (r.first_fail < 0) r.first_fail = i;
      ++r.failing;
    }
    if (ratio > r.worst_ratio || r.worst_at < 0) {
      r.worst_ratio = ratio;
      r.worst_at = i;
    }
    r.min_atol = std::max(r.min_atol, need_atol);
    r.min_rtol = std::max(r.min_rtol, need_rtol);
  }
  r.fraction = n > 0 ? double(n - r.failing) / double(n) : 1.0;
  return r;
}

int64_t argmax(const float* v, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(v[i])) continue;
    if (best < 0 || v[i] > v[best]) best = i;
  }
  return best;
}

namespace {
// Indices of the k largest values, ties to the lower index.
std::vector<int64_t> topk_indices(const float* v, int64_t n, int k) {
  std::vector<int64_t> idx(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) idx[size_t(i)] = i;
  auto better = [v](int64_t x, int64_t y) {
    float a = std::isnan(v[x]) ? -std::numeric_limits<float>::infinity() : v[x];
    float b = std::isnan(v[y]) ? -std::numeric_limits<float>::infinity() : v[y];
    return a > b || (a == b && x < y);
  };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), better);
  idx.resize(size_t(k));
  return idx;
}

// log-softmax of one row in double.
std::vector<double> log_softmax(const float* v, int64_t n) {
  double mx = -kInf;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, double(v[i]));
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(double(v[i]) - mx);
  double lse = mx + std::log(s);
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = double(v[i]) - lse;
  return out;
}
}  // namespace

LogitsMetrics logits_metrics(const float* ref, const float* cand, int64_t rows, int64_t cols) {
  LogitsMetrics m;
  m.rows = rows;
  m.cols = cols;
  m.topk = int(std::min<int64_t>(5, cols));
  if (rows <= 0 || cols <= 0) return m;
  double overlap_sum = 0, kl_sum = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* b = ref + r * cols;
    const float* a = cand + r * cols;
    int64_t ia = argmax(a, cols), ib = argmax(b, cols);
    if (ia == ib) {
      ++m.argmax_agree;
    } else if (m.first_argmax_mismatch < 0) {
      m.first_argmax_mismatch = r;
      m.ref_argmax = ib;
      m.cand_argmax = ia;
    }
    if (m.first_argmax_mismatch < 0) {
      m.ref_argmax = ib;
      m.cand_argmax = ia;
    }
    auto ta = topk_indices(a, cols, m.topk), tb = topk_indices(b, cols, m.topk);
    int common = 0;
    for (int64_t x : ta)
      if (std::find(tb.begin(), tb.end(), x) != tb.end()) ++common;
    overlap_sum += double(common) / double(m.topk);
    auto lp = log_softmax(b, cols), lq = log_softmax(a, cols);
    double kl = 0;
    for (int64_t i = 0; i < cols; ++i) {
      double p = std::exp(lp[size_t(i)]);
      if (p > 0) kl += p * (lp[size_t(i)] - lq[size_t(i)]);
    }
    if (kl < 0) kl = 0;  // rounding can leave a tiny negative for equal rows
    kl_sum += kl;
    if (!(kl <= m.kl_max)) m.kl_max = kl;  // keeps a NaN visible
  }
  m.topk_overlap = overlap_sum / double(rows);
  m.kl_mean = kl_sum / double(rows);
  return m;
}

IntMetrics int_metrics(const int64_t* ref, const int64_t* cand, int64_t n) {
  IntMetrics m;
  m.count = n;
  for (int64_t i = 0; i < n; ++i) {
    if (ref[i] == cand[i]) continue;
    if (m.first_mismatch < 0) {
      m.first_mismatch = i;
      m.ref_value = ref[i];
      m.cand_value = cand[i];
    }
    ++m.mismatches;
  }
  return m;
}

}  // namespace llmdiff::compare
