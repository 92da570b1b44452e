#include "compare/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "compare/parallel.h"
#include "dumps/base/dtype.h"

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

std::optional<ComputeDType> rounded_grid(const float* a, const float* b, int64_t n) {
  for (ComputeDType grid : {ComputeDType::Float16, ComputeDType::BFloat16}) {
    bool fits = true;
    for (int64_t i = 0; i < n && fits; ++i) {
      const float x = a[i];
      const float on = grid == ComputeDType::BFloat16 ? bf16_to_f32(f32_to_bf16(x)) : f16_to_f32(f32_to_f16(x));
      fits = std::isfinite(x) && on == x && ulp_distance(x, b[i], grid) <= 1;
    }
    if (fits) return grid;
  }
  return std::nullopt;
}

// The scalar definition rounds every product and sum on its own (the
// allclose bound atol + rtol*|b|, the atol that makes a pair pass); the
// vectorised loops below keep it so: no multiply-add contraction.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

namespace {
// pair_metrics cuts the data into chunks of kChunk elements; each chunk gives
// one Partial, and the partials are merged in chunk order. Within a chunk
// without NaN/Inf the sums run in kLanes interleaved lanes (element i feeds
// lane i % kLanes), merged lane 0 first, so the compiler can keep each lane
// in a vector register; a chunk holding a NaN or Inf runs the plain loop.
constexpr int64_t kChunk = 4096;
constexpr int64_t kChunksPerTask = 16;  // chunks one thread claims at a time
constexpr int kLanes = 8;
// Index of a maximum (or first failure) that lies in a finite chunk and is
// located only if it turns out to be the one reported.
constexpr int64_t kUnlocated = -2;

// A maximum and the first index holding it: at -1 = none yet; kUnlocated =
// somewhere in [from, to).
struct Max {
  double value = 0;
  int64_t at = -1, from = 0, to = 0;
  bool set() const { return at != -1; }
};
// The first index of something: at -1 = none; kUnlocated = in [from, to).
struct First {
  int64_t at = -1, from = 0, to = 0;
};

// Metrics and allclose state of a range of elements.
struct Partial {
  int64_t finite_pairs = 0;
  double sum_abs = 0, sum_sq = 0, sum_bb = 0, sum_aa = 0, sum_ab = 0;
  Max max_abs, max_rel, worst;
  double ref_max_abs = 0, cand_max_abs = 0;
  int64_t max_ulp = 0;
  NonFiniteCounts ref_nonfinite, cand_nonfinite;
  int64_t nonfinite_mismatch = 0, first_nonfinite_mismatch = -1;
  int64_t failing = 0;
  First first_fail;
  double min_atol = 0, min_rtol = 0;
};

// Keeps the earlier maximum on ties.
void take_max(Max& best, const Max& q) {
  if (q.set() && (!best.set() || q.value > best.value)) best = q;
}
void take_max(Max& best, double value, int64_t at) { take_max(best, Max{value, at, 0, 0}); }

void take_first(int64_t& first, int64_t at) {
  if (first < 0) first = at;
}

void add_counts(NonFiniteCounts& acc, const NonFiniteCounts& c) {
  acc.nan += c.nan;
  acc.pos_inf += c.pos_inf;
  acc.neg_inf += c.neg_inf;
  take_first(acc.first_nan, c.first_nan);
}

// Appends `q` (the range right after acc's) to `acc`.
void merge(Partial& acc, const Partial& q) {
  acc.finite_pairs += q.finite_pairs;
  acc.sum_abs += q.sum_abs;
  acc.sum_sq += q.sum_sq;
  acc.sum_bb += q.sum_bb;
  acc.sum_aa += q.sum_aa;
  acc.sum_ab += q.sum_ab;
  take_max(acc.max_abs, q.max_abs);
  take_max(acc.max_rel, q.max_rel);
  take_max(acc.worst, q.worst);
  acc.ref_max_abs = std::max(acc.ref_max_abs, q.ref_max_abs);
  acc.cand_max_abs = std::max(acc.cand_max_abs, q.cand_max_abs);
  acc.max_ulp = std::max(acc.max_ulp, q.max_ulp);
  add_counts(acc.ref_nonfinite, q.ref_nonfinite);
  add_counts(acc.cand_nonfinite, q.cand_nonfinite);
  acc.nonfinite_mismatch += q.nonfinite_mismatch;
  if (q.nonfinite_mismatch) take_first(acc.first_nonfinite_mismatch, q.first_nonfinite_mismatch);
  if (acc.failing == 0 && q.failing) acc.first_fail = q.first_fail;
  acc.failing += q.failing;
  acc.min_atol = std::max(acc.min_atol, q.min_atol);
  acc.min_rtol = std::max(acc.min_rtol, q.min_rtol);
}

// The allclose bound and worst-ratio term of a finite pair (ad = |a-b|,
// ab = |b|); one definition for every loop that evaluates them.
inline double allclose_bound(double ab, double atol, double rtol) { return atol + rtol * ab; }
inline double allclose_ratio(double ad, double bound) {
  const bool pos = bound > 0;
  const double q = ad / (pos ? bound : 1.0);  // the divisor is never 0, so the division can run unconditionally
  return pos ? q : (ad > 0 ? kInf : 0.0);
}

// The element-by-element definition of every metric, for ranges holding NaN
// or Inf (and tolerances outside [0, inf)).
void plain_range(const float* ref, const float* cand, int64_t begin, int64_t end, ComputeDType grid,
                 const Tolerance& tol, Partial& p) {
  for (int64_t i = begin; i < end; ++i) {
    const float fa = cand[i], fb = ref[i];
    const bool fin_a = std::isfinite(fa), fin_b = std::isfinite(fb);
    if (!fin_a || !fin_b) {
      if (!fin_a) count_nonfinite(fa, i, p.cand_nonfinite);
      if (!fin_b) count_nonfinite(fb, i, p.ref_nonfinite);
      const bool fail = !same_nonfinite(fa, fb);
      const double ratio = fail ? kInf : 0.0;
      if (fail) {
        if (p.nonfinite_mismatch++ == 0) p.first_nonfinite_mismatch = i;
        if (p.failing++ == 0) p.first_fail.at = i;
      }
      take_max(p.worst, ratio, i);
      p.min_atol = std::max(p.min_atol, ratio);
      p.min_rtol = std::max(p.min_rtol, ratio);
      continue;
    }
    ++p.finite_pairs;
    const double a = fa, b = fb, d = a - b, ad = std::fabs(d), ab = std::fabs(b);
    take_max(p.max_abs, ad, i);
    if (ab > 0) take_max(p.max_rel, ad / ab, i);
    p.ref_max_abs = std::max(p.ref_max_abs, ab);
    p.cand_max_abs = std::max(p.cand_max_abs, std::fabs(a));
    p.sum_abs += ad;
    p.sum_sq += d * d;
    p.sum_bb += b * b;
    p.sum_aa += a * a;
    p.sum_ab += a * b;
    p.max_ulp = std::max(p.max_ulp, ulp_distance(fa, fb, grid));

    const double bound = allclose_bound(ab, tol.atol, tol.rtol);
    if (!(ad <= bound) && p.failing++ == 0) p.first_fail.at = i;
    take_max(p.worst, allclose_ratio(ad, bound), i);
    p.min_atol = std::max(p.min_atol, std::max(0.0, ad - tol.rtol * ab));
    if (ad > tol.atol) p.min_rtol = std::max(p.min_rtol, ab > 0 ? (ad - tol.atol) / ab : kInf);
  }
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Branch-free `ordered` images of finite floats on each ULP grid (the same
// values as ulp_distance's, which rounds with f32_to_bf16 / f32_to_f16).
int32_t signed_magnitude(uint32_t mag, uint32_t negative) {  // negative: 0 or 1
  const int32_t s = -int32_t(negative);
  return (int32_t(mag) ^ s) - s;
}
struct GridF32 {
  static int32_t ordered(uint32_t u) { return signed_magnitude(u & 0x7fffffffu, u >> 31); }
};
struct GridBF16 {
  static int32_t ordered(uint32_t u) {
    const uint32_t h = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
    return signed_magnitude(h & 0x7fffu, (h >> 15) & 1u);
  }
};
struct GridF16 {
  static int32_t ordered(uint32_t u) {
    const uint32_t abs = u & 0x7fffffffu;
    const bool sub = abs < 0x38800000u;  // zero or subnormal in half: |value| * 2^24 rounded to an integer
    float small;
    const uint32_t small_bits = sub ? abs : 0u;
    std::memcpy(&small, &small_bits, 4);
    const uint32_t h_sub = uint32_t(std::nearbyint(small * 16777216.0f));
    uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
    r += 0xfffu + ((r >> 13) & 1u);
    const uint32_t h = abs >= 0x477ff000u ? 0x7c00u : (sub ? h_sub : (r >> 13));
    return signed_magnitude(h, u >> 31);
  }
};

// A chunk without NaN/Inf: every pair is finite, so the loop body has no
// branch. Maxima are taken without their index (located afterwards, for the
// one chunk that holds the reported maximum); sums run per lane. Returns
// false, leaving `p` untouched, when the chunk does hold a NaN or Inf.
template <class Grid>
bool finite_range(const float* ref, const float* cand, int64_t begin, int64_t end, const Tolerance& tol,
                  Partial& p) {
  const double atol = tol.atol, rtol = tol.rtol;
  double s_abs[kLanes], s_sq[kLanes], s_bb[kLanes], s_aa[kLanes], s_ab[kLanes];
  double mx_abs[kLanes], mx_rel[kLanes], mx_ratio[kLanes], need_atol[kLanes], need_rtol[kLanes];
  int64_t failing[kLanes];
  float ref_max[kLanes], cand_max[kLanes];
  uint32_t ulp[kLanes], nonfinite[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    nonfinite[l] = 0;
    s_abs[l] = s_sq[l] = s_bb[l] = s_aa[l] = s_ab[l] = 0;
    mx_abs[l] = mx_ratio[l] = 0;
    mx_rel[l] = -1;  // stays below 0 while the lane has no b != 0
    need_atol[l] = need_rtol[l] = 0;
    failing[l] = 0;
    ref_max[l] = cand_max[l] = 0;
    ulp[l] = 0;
  }
  // Groups of kLanes pairs; a last partial group is padded with 0 vs 0,
  // which leaves every sum and maximum as it is.
  float pad_ref[kLanes], pad_cand[kLanes];
  for (int64_t g = begin; g < end; g += kLanes) {
    const float* rg = ref + g;
    const float* cg = cand + g;
    if (end - g < kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        pad_ref[l] = g + l < end ? ref[g + l] : 0.0f;
        pad_cand[l] = g + l < end ? cand[g + l] : 0.0f;
      }
      rg = pad_ref;
      cg = pad_cand;
    }
    for (int l = 0; l < kLanes; ++l) {
      const float fa = cg[l], fb = rg[l];
      const double a = fa, b = fb, d = a - b, ad = std::fabs(d), ab = std::fabs(b);
      s_abs[l] += ad;
      s_sq[l] += d * d;
      s_bb[l] += b * b;
      s_aa[l] += a * a;
      s_ab[l] += a * b;
      mx_abs[l] = std::max(mx_abs[l], ad);
      // Divisors are replaced by 1 where the quotient is not used, so that
      // every division can run unconditionally.
      const bool pos = ab > 0;
      const double ab_div = pos ? ab : 1.0;
      mx_rel[l] = std::max(mx_rel[l], pos ? ad / ab_div : -1.0);  // b == 0: no relative error
      ref_max[l] = std::max(ref_max[l], std::fabs(fb));
      cand_max[l] = std::max(cand_max[l], std::fabs(fa));
      const uint32_t ua = bits_of(fa), ub = bits_of(fb);
      nonfinite[l] |= uint32_t((ua & 0x7f800000u) == 0x7f800000u) | uint32_t((ub & 0x7f800000u) == 0x7f800000u);
      const int32_t oa = Grid::ordered(ua), ob = Grid::ordered(ub);
      const uint32_t du = oa > ob ? uint32_t(oa) - uint32_t(ob) : uint32_t(ob) - uint32_t(oa);
      ulp[l] = std::max(ulp[l], du);

      const double bound = allclose_bound(ab, atol, rtol);
      failing[l] += ad <= bound ? 0 : 1;
      mx_ratio[l] = std::max(mx_ratio[l], allclose_ratio(ad, bound));
      need_atol[l] = std::max(need_atol[l], ad - rtol * ab);  // max(0, .) by the lane's start at 0
      const double rtol_q = (ad - atol) / ab_div;
      need_rtol[l] = std::max(need_rtol[l], ad <= atol ? 0.0 : (pos ? rtol_q : kInf));
    }
  }

  uint32_t any_nonfinite = 0;
  for (int l = 0; l < kLanes; ++l) any_nonfinite |= nonfinite[l];
  if (any_nonfinite) return false;
  p.finite_pairs = end - begin;
  double rel = -1;
  for (int l = 0; l < kLanes; ++l) {
    p.sum_abs += s_abs[l];
    p.sum_sq += s_sq[l];
    p.sum_bb += s_bb[l];
    p.sum_aa += s_aa[l];
    p.sum_ab += s_ab[l];
    p.max_abs.value = std::max(p.max_abs.value, mx_abs[l]);
    rel = std::max(rel, mx_rel[l]);
    p.worst.value = std::max(p.worst.value, mx_ratio[l]);
    p.ref_max_abs = std::max(p.ref_max_abs, double(ref_max[l]));
    p.cand_max_abs = std::max(p.cand_max_abs, double(cand_max[l]));
    p.max_ulp = std::max(p.max_ulp, int64_t(ulp[l]));
    p.failing += failing[l];
    p.min_atol = std::max(p.min_atol, need_atol[l]);
    p.min_rtol = std::max(p.min_rtol, need_rtol[l]);
  }
  if (end > begin) {
    p.max_abs.at = p.worst.at = kUnlocated;
    p.max_abs.from = p.worst.from = begin;
    p.max_abs.to = p.worst.to = end;
  }
  if (rel >= 0) p.max_rel = Max{rel, kUnlocated, begin, end};
  if (p.failing) p.first_fail = First{kUnlocated, begin, end};
  return true;
}

// Locating an index in a finite chunk, with the definitions finite_range uses.
int64_t locate_max_abs(const float* ref, const float* cand, const Max& m) {
  for (int64_t i = m.from; i < m.to; ++i)
    if (std::fabs(double(cand[i]) - double(ref[i])) == m.value) return i;
  return m.from;  // not reached: max_abs is one of the values
}
int64_t locate_max_rel(const float* ref, const float* cand, const Max& m) {
  for (int64_t i = m.from; i < m.to; ++i) {
    const double ab = std::fabs(double(ref[i]));
    if (ab > 0 && std::fabs(double(cand[i]) - double(ref[i])) / ab == m.value) return i;
  }
  return m.from;  // not reached: max_rel is one of the values
}
double ratio_at(const float* ref, const float* cand, int64_t i, const Tolerance& tol) {
  const double ab = std::fabs(double(ref[i]));
  return allclose_ratio(std::fabs(double(cand[i]) - double(ref[i])), allclose_bound(ab, tol.atol, tol.rtol));
}
// The first index of the worst ratio. Should a compiler contract the bound's
// multiply-add differently here than in the vector loop, the values could
// differ in the last bit; the first index of the largest recomputed ratio is
// then taken instead.
int64_t locate_worst(const float* ref, const float* cand, const Max& m, const Tolerance& tol) {
  int64_t best = m.from;
  double best_ratio = -1;
  for (int64_t i = m.from; i < m.to; ++i) {
    const double r = ratio_at(ref, cand, i, tol);
    if (r == m.value) return i;
    if (r > best_ratio) {
      best_ratio = r;
      best = i;
    }
  }
  return best;
}
int64_t locate_first_fail(const float* ref, const float* cand, const First& f, const Tolerance& tol) {
  for (int64_t i = f.from; i < f.to; ++i) {
    const double ab = std::fabs(double(ref[i]));
    if (!(std::fabs(double(cand[i]) - double(ref[i])) <= allclose_bound(ab, tol.atol, tol.rtol))) return i;
  }
  // As in locate_worst: a differently contracted bound; the worst element fails.
  return locate_worst(ref, cand, Max{-1, kUnlocated, f.from, f.to}, tol);
}

Partial chunk_partial(const float* ref, const float* cand, int64_t begin, int64_t end, ComputeDType grid,
                      const Tolerance& tol) {
  Partial p;
  const bool plain_tol = std::isfinite(tol.atol) && std::isfinite(tol.rtol) && tol.atol >= 0 && tol.rtol >= 0;
  bool done = false;
  if (plain_tol) {
    if (grid == ComputeDType::BFloat16)
      done = finite_range<GridBF16>(ref, cand, begin, end, tol, p);
    else if (grid == ComputeDType::Float16)
      done = finite_range<GridF16>(ref, cand, begin, end, tol, p);
    else
      done = finite_range<GridF32>(ref, cand, begin, end, tol, p);
  }
  if (!done) plain_range(ref, cand, begin, end, grid, tol, p);
  return p;
}
}  // namespace

PairMetrics pair_metrics(const float* ref, const float* cand, int64_t n, ComputeDType ulp_dtype, const Tolerance& tol,
                         ThreadPool* pool) {
  n = std::max<int64_t>(n, 0);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  auto chunk = [&](int64_t c) { return chunk_partial(ref, cand, c * kChunk, std::min(n, (c + 1) * kChunk), ulp_dtype, tol); };
  Partial p;
  const int64_t tasks = (chunks + kChunksPerTask - 1) / kChunksPerTask;
  if (pool && pool->size() > 1 && tasks > 1) {
    std::vector<Partial> parts(static_cast<size_t>(chunks));
    pool->parallel_for(tasks, [&](int64_t t) {
      for (int64_t c = t * kChunksPerTask; c < std::min(chunks, (t + 1) * kChunksPerTask); ++c) parts[size_t(c)] = chunk(c);
    });
    for (const Partial& q : parts) merge(p, q);
  } else {
    for (int64_t c = 0; c < chunks; ++c) merge(p, chunk(c));
  }

  if (p.max_abs.at == kUnlocated) p.max_abs.at = locate_max_abs(ref, cand, p.max_abs);
  if (p.max_rel.at == kUnlocated) p.max_rel.at = locate_max_rel(ref, cand, p.max_rel);
  if (p.worst.at == kUnlocated) p.worst.at = locate_worst(ref, cand, p.worst, tol);
  if (p.first_fail.at == kUnlocated) p.first_fail.at = locate_first_fail(ref, cand, p.first_fail, tol);

  PairMetrics out;
  FloatMetrics& m = out.metrics;
  m.count = n;
  m.ulp_dtype = ulp_dtype;
  m.finite_pairs = p.finite_pairs;
  if (p.max_abs.set()) {
    m.max_abs = p.max_abs.value;
    m.max_abs_at = p.max_abs.at;
    m.ref_at_max_abs = ref[m.max_abs_at];
    m.cand_at_max_abs = cand[m.max_abs_at];
  }
  if (p.max_rel.set()) {
    m.max_rel = p.max_rel.value;
    m.max_rel_at = p.max_rel.at;
  }
  m.ref_max_abs = p.ref_max_abs;
  m.cand_max_abs = p.cand_max_abs;
  m.max_ulp = p.max_ulp;
  m.ref_nonfinite = p.ref_nonfinite;
  m.cand_nonfinite = p.cand_nonfinite;
  m.nonfinite_mismatch = p.nonfinite_mismatch;
  m.first_nonfinite_mismatch = p.first_nonfinite_mismatch;
  const double sum_sq = p.sum_sq, sum_bb = p.sum_bb, sum_aa = p.sum_aa;
  if (m.finite_pairs > 0) {
    m.mean_abs = p.sum_abs / double(m.finite_pairs);
    m.rmse = std::sqrt(sum_sq / double(m.finite_pairs));
  }
  m.nmse = sum_bb > 0 ? sum_sq / sum_bb : (sum_sq > 0 ? kInf : 0.0);
  m.sqnr_db = sum_sq > 0 ? (sum_bb > 0 ? 10.0 * std::log10(sum_bb / sum_sq) : -kInf) : kInf;
  if (sum_aa == 0 && sum_bb == 0)
    m.cosine = 1;
  else if (sum_aa == 0 || sum_bb == 0)
    m.cosine = 0;
  else
    m.cosine = p.sum_ab / std::sqrt(sum_aa * sum_bb);

  AllcloseResult& r = out.allclose;
  r.tol = tol;
  r.count = n;
  r.failing = p.failing;
  r.first_fail = p.first_fail.at;
  r.fraction = n > 0 ? double(n - r.failing) / double(n) : 1.0;
  if (p.worst.set()) {
    r.worst_ratio = p.worst.value;
    r.worst_at = p.worst.at;
  }
  r.min_atol = p.min_atol;
  r.min_rtol = p.min_rtol;
  return out;
}

FloatMetrics float_metrics(const float* ref, const float* cand, int64_t n, ComputeDType ulp_dtype) {
  return pair_metrics(ref, cand, n, ulp_dtype, Tolerance{}).metrics;
}

AllcloseResult allclose(const float* ref, const float* cand, int64_t n, const Tolerance& tol) {
  return pair_metrics(ref, cand, n, ComputeDType::Float32, tol).allclose;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

int64_t argmax(const float* v, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(v[i])) continue;
    if (best < 0 || v[i] > v[best]) best = i;
  }
  return best;
}

namespace {
// Indices of the k largest values (NaN counting as -inf), ties to the lower
// index, best first; k <= kMaxTopk. One pass that keeps the k best so far: a
// later index enters only when strictly larger than the current k-th.
constexpr int kMaxTopk = 5;
int topk_indices(const float* v, int64_t n, int k, int64_t* out) {
  auto key = [v](int64_t i) { return std::isnan(v[i]) ? -std::numeric_limits<float>::infinity() : v[i]; };
  float best[kMaxTopk];
  int have = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = key(i);
    if (have == k && !(x > best[k - 1])) continue;
    int pos = have < k ? have++ : k - 1;
    while (pos > 0 && x > best[pos - 1]) {  // ties keep the earlier index in front
      best[pos] = best[pos - 1];
      out[pos] = out[pos - 1];
      --pos;
    }
    best[pos] = x;
    out[pos] = i;
  }
  return have;
}

// exp(x) for x <= 0 (larger x are taken as 0) without branches, so that
// loops over it vectorise: x = k ln2 + r with |r| <= ln2/2, exp(r) from its
// Taylor series to r^13 (truncation error below 1e-17), scaled by 2^k.
// Within about 1 ulp of std::exp; NaN gives NaN, -inf gives 0, and so does
// x < -708.39 (where std::exp gives subnormals).
inline double exp_nonpositive(double x) {
  x = std::min(std::max(x, -746.0), 0.0);  // keeps a NaN
  const double shift = 0x1.8p52;             // adding it rounds to an integer
  const double kd_shifted = x * 1.4426950408889634 + shift;
  const double kd = kd_shifted - shift;
  const double r = (x - kd * 0.693147180369123816490) - kd * 1.90821492927058770002e-10;
  double q = 1.0 / 6227020800.0;  // 1/13!
  q = q * r + 1.0 / 479001600.0;
  q = q * r + 1.0 / 39916800.0;
  q = q * r + 1.0 / 3628800.0;
  q = q * r + 1.0 / 362880.0;
  q = q * r + 1.0 / 40320.0;
  q = q * r + 1.0 / 5040.0;
  q = q * r + 1.0 / 720.0;
  q = q * r + 1.0 / 120.0;
  q = q * r + 1.0 / 24.0;
  q = q * r + 1.0 / 6.0;
  q = q * r + 0.5;
  const double e = 1.0 + (r + (r * r) * q);
  uint64_t kbits;
  std::memcpy(&kbits, &kd_shifted, 8);
  const int64_t k = int64_t(kbits - 0x4338000000000000ull);  // kd as an integer
  const uint64_t scale_bits = uint64_t(k + 1023) << 52;          // 2^k, for k >= -1022
  double scale;
  std::memcpy(&scale, &scale_bits, 8);
  return k < -1022 ? 0.0 : e * scale;
}

// Softmax statistics of one row in double: the largest value (NaN skipped),
// sum exp(v - max) and lse = max + log(sum); `e`, when given, receives
// exp(v - max). A NaN or +Inf in the row makes sum and lse NaN.
struct SoftmaxRow {
  double max = -kInf, sum = 0, lse = 0;
};
SoftmaxRow softmax_row(const float* v, int64_t n, double* e) {
  SoftmaxRow s;
  const int64_t full = n / kLanes * kLanes;
  double mx[kLanes], sum[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    mx[l] = -kInf;
    sum[l] = 0;
  }
  for (int64_t i = 0; i < full; i += kLanes)
    for (int l = 0; l < kLanes; ++l) mx[l] = std::max(mx[l], double(v[i + l]));
  for (int l = 0; l < kLanes; ++l) s.max = std::max(s.max, mx[l]);
  for (int64_t i = full; i < n; ++i) s.max = std::max(s.max, double(v[i]));
  for (int64_t i = 0; i < full; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const double x = exp_nonpositive(double(v[i + l]) - s.max);
      if (e) e[i + l] = x;
      sum[l] += x;
    }
  for (int l = 0; l < kLanes; ++l) s.sum += sum[l];
  for (int64_t i = full; i < n; ++i) {
    const double x = exp_nonpositive(double(v[i]) - s.max);
    if (e) e[i] = x;
    s.sum += x;
  }
  s.lse = s.max + std::log(s.sum);
  return s;
}

// One term p (log p - log q) of KL(softmax(b) || softmax(a)) from e =
// exp(b - max b); 0 where p is 0 or NaN.
inline double kl_term(double e, const SoftmaxRow& sb, float b, const SoftmaxRow& sa, float a) {
  const double p = e / sb.sum;
  const double t = p * ((double(b) - sb.lse) - (double(a) - sa.lse));
  return p > 0 ? t : 0.0;
}

struct LogitsRow {
  int64_t ref_argmax = -1, cand_argmax = -1;
  int common = 0;  // |topk(a) ∩ topk(b)|
  double kl = 0;
};

// argmax of a row whose top-k is known: the first top index unless the
// largest value is -inf or NaN (then argmax's own rule decides).
int64_t row_argmax(const float* v, int64_t n, const int64_t* top, int have) {
  if (have > 0 && v[top[0]] > -std::numeric_limits<float>::infinity()) return top[0];
  return argmax(v, n);
}

LogitsRow logits_row(const float* b, const float* a, int64_t cols, int topk, std::vector<double>& e) {
  LogitsRow row;
  int64_t ta[kMaxTopk], tb[kMaxTopk];
  const int na = topk_indices(a, cols, topk, ta), nb = topk_indices(b, cols, topk, tb);
  row.cand_argmax = row_argmax(a, cols, ta, na);
  row.ref_argmax = row_argmax(b, cols, tb, nb);
  for (int x = 0; x < na; ++x)
    if (std::find(tb, tb + nb, ta[x]) != tb + nb) ++row.common;
  // KL(softmax(b) || softmax(a)) = sum p (log p - log q), p = exp(b - max b) / sum.
  e.resize(size_t(cols));
  const SoftmaxRow sb = softmax_row(b, cols, e.data()), sa = softmax_row(a, cols, nullptr);
  double kl[kLanes];
  for (int l = 0; l < kLanes; ++l) kl[l] = 0;
  const int64_t full = cols / kLanes * kLanes;
  for (int64_t i = 0; i < full; i += kLanes)
    for (int l = 0; l < kLanes; ++l) kl[l] += kl_term(e[size_t(i + l)], sb, b[i + l], sa, a[i + l]);
  double total = 0;
  for (int l = 0; l < kLanes; ++l) total += kl[l];
  for (int64_t i = full; i < cols; ++i) total += kl_term(e[size_t(i)], sb, b[i], sa, a[i]);
  row.kl = total < 0 ? 0 : total;  // rounding can leave a tiny negative for equal rows
  return row;
}
}  // namespace

LogitsMetrics logits_metrics(const float* ref, const float* cand, int64_t rows, int64_t cols, ThreadPool* pool) {
  LogitsMetrics m;
  m.rows = rows;
  m.cols = cols;
  m.topk = int(std::min<int64_t>(kMaxTopk, cols));
  if (rows <= 0 || cols <= 0) return m;
  std::vector<LogitsRow> per_row(static_cast<size_t>(rows));
  constexpr int64_t kRowsPerTask = 8;
  const int64_t tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  auto task = [&](int64_t t) {
    std::vector<double> e;
    for (int64_t r = t * kRowsPerTask; r < std::min(rows, (t + 1) * kRowsPerTask); ++r)
      per_row[size_t(r)] = logits_row(ref + r * cols, cand + r * cols, cols, m.topk, e);
  };
  if (pool && tasks > 1)
    pool->parallel_for(tasks, task);
  else
    for (int64_t t = 0; t < tasks; ++t) task(t);

  double overlap_sum = 0, kl_sum = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const LogitsRow& row = per_row[size_t(r)];
    if (row.cand_argmax == row.ref_argmax) {
      ++m.argmax_agree;
    } else if (m.first_argmax_mismatch < 0) {
      m.first_argmax_mismatch = r;
      m.ref_argmax = row.ref_argmax;
      m.cand_argmax = row.cand_argmax;
    }
    if (m.first_argmax_mismatch < 0) {
      m.ref_argmax = row.ref_argmax;
      m.cand_argmax = row.cand_argmax;
    }
    overlap_sum += double(row.common) / double(m.topk);
    kl_sum += row.kl;
    if (!(row.kl <= m.kl_max)) m.kl_max = row.kl;  // keeps a NaN visible
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

void count_nonfinite(float v, int64_t at, NonFiniteCounts& c) {
  if (std::isnan(v)) {
    if (c.first_nan < 0) c.first_nan = at;
    ++c.nan;
  } else if (v > 0) {
    ++c.pos_inf;
  } else {
    ++c.neg_inf;
  }
}

double golden_section_min(const std::function<double(double)>& f, double a, double b, int iterations) {
  const double g = (std::sqrt(5.0) - 1) / 2;
  double c = b - g * (b - a), d = a + g * (b - a), fc = f(c), fd = f(d);
  for (int it = 0; it < iterations; ++it) {
    if (fc < fd) {
      b = d, d = c, fd = fc, c = b - g * (b - a), fc = f(c);
    } else {
      a = c, c = d, fc = fd, d = a + g * (b - a), fd = f(d);
    }
  }
  return fc < fd ? c : d;
}

}  // namespace llmdiff::compare
