// Error metrics of one tensor pair. Throughout compare/, `ref` (b) is the
// reference and `cand` (a) the candidate; every sum is accumulated in double.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "compare/tolerance.h"
#include "dumps/model/config.h"
#include "dumps/formats/safetensors.h"

namespace llmdiff::compare {

class ThreadPool;

// Row-major multi-index of a flat offset ("unravel_index").
std::vector<int64_t> unravel(int64_t flat, const Shape& shape);
std::string index_str(const std::vector<int64_t>& idx);  // "[0, 2, 5]"

// Non-finite values of one side.
struct NonFiniteCounts {
  int64_t nan = 0, pos_inf = 0, neg_inf = 0;
  int64_t first_nan = -1;  // flat offset of the first NaN, -1 if none
  int64_t total() const { return nan + pos_inf + neg_inf; }
};
// Counts the non-finite value `v` found at flat offset `at`.
void count_nonfinite(float v, int64_t at, NonFiniteCounts& c);
// "2 NaN (first at [0, 3]), 1 +Inf" for a tensor of `shape`.
std::string nonfinite_words(const NonFiniteCounts& c, const Shape& shape);

// Elementwise metrics of a same-shape float pair (a = cand, b = ref).
// The sums run over the positions where both values are finite; positions
// where one side is non-finite and the other differs (NaN vs anything but
// NaN, Inf vs anything but the same Inf) are counted in nonfinite_mismatch.
struct FloatMetrics {
  int64_t count = 0;         // elements
  int64_t finite_pairs = 0;  // positions where both are finite
  double max_abs = 0;        // max |a-b|
  int64_t max_abs_at = -1;   // flat offset of max_abs
  double ref_at_max_abs = 0, cand_at_max_abs = 0;  // the values there
  double max_rel = 0;        // max |a-b|/|b| over b != 0 (b == 0 entries show in max_abs)
  int64_t max_rel_at = -1;
  double mean_abs = 0;       // mean |a-b|
  double rmse = 0;           // sqrt(mean (a-b)^2)
  double nmse = 0;           // sum (a-b)^2 / sum b^2 (0 if both sums are 0, inf if only b's is)
  double sqnr_db = 0;        // 10 log10(sum b^2 / sum (a-b)^2); +inf when identical
  double cosine = 1;         // sum ab / sqrt(sum a^2 sum b^2); 1 when both are all zero, 0 when one is
  double ref_max_abs = 0;    // max |b|
  double cand_max_abs = 0;   // max |a|
  int64_t max_ulp = 0;       // max distance in units in the last place of ulp_dtype's grid
  ComputeDType ulp_dtype = ComputeDType::Float32;
  NonFiniteCounts ref_nonfinite, cand_nonfinite;
  int64_t nonfinite_mismatch = 0;
  int64_t first_nonfinite_mismatch = -1;
};

// Distance between two floats in units in the last place of `grid`:
// float32 -> the float32 grid; bfloat16 / float16 -> both values rounded to
// that grid (nearest even) first, then the distance there; float64 -> the
// float32 grid (dumps store float32, so a float64 grid would only scale the
// float32 distance by 2^29). +0 and -0 are 0 apart. -1 when either is NaN.
int64_t ulp_distance(float a, float b, ComputeDType grid);
// The 16-bit grid (float16 tried first, then bfloat16) on which every value
// of `a` lies within one ulp of `b`'s: `a` is `b` rounded to that dtype.
// nullopt when neither fits (or a value is not finite).
std::optional<ComputeDType> rounded_grid(const float* a, const float* b, int64_t n);

// The x in [a, b] where f is least, by golden-section search (`iterations`
// steps; f unimodal there): the better of the last two points tried.
double golden_section_min(const std::function<double(double)>& f, double a, double b, int iterations);

FloatMetrics float_metrics(const float* ref, const float* cand, int64_t n, ComputeDType ulp_dtype);

// allclose at one tolerance: element i passes when |a-b| <= atol + rtol*|b|;
// a NaN or Inf passes only against the identical value (NaN vs NaN, +Inf vs
// +Inf), so NaN in the candidate where the reference is finite fails.
struct AllcloseResult {
  Tolerance tol;
  int64_t count = 0;
  int64_t failing = 0;       // elements outside tolerance (non-finite mismatches included)
  int64_t first_fail = -1;   // flat offset
  double fraction = 1;       // passing / count (1 for empty tensors)
  double worst_ratio = 0;    // max |a-b| / (atol + rtol*|b|); <= 1 means pass; inf on a non-finite mismatch
  int64_t worst_at = -1;
  double min_atol = 0;       // smallest atol that passes at tol.rtol (inf on a non-finite mismatch)
  double min_rtol = 0;       // smallest rtol that passes at tol.atol (inf if none does: b == 0 and |a-b| > atol)
  bool pass() const { return failing == 0; }
};
AllcloseResult allclose(const float* ref, const float* cand, int64_t n, const Tolerance& tol);

// float_metrics and allclose of one pair in a single pass over the data (what
// compare_tensors uses). The data is cut into fixed chunks whose partial
// results are combined in order, so the result does not depend on `pool`,
// which (when given) spreads the chunks of a large pair over its threads.
// Chunks without NaN/Inf take a vectorised path; sums may differ from a
// plain left-to-right loop by the rounding of their order only.
struct PairMetrics {
  FloatMetrics metrics;
  AllcloseResult allclose;
};
PairMetrics pair_metrics(const float* ref, const float* cand, int64_t n, ComputeDType ulp_dtype, const Tolerance& tol,
                         ThreadPool* pool = nullptr);

// Logits rows [rows, cols] (next_logits is one row).
struct LogitsMetrics {
  int64_t rows = 0, cols = 0;
  int64_t argmax_agree = 0;            // rows whose argmax (first index on ties) agrees
  int64_t first_argmax_mismatch = -1;  // row, -1 if none
  int64_t ref_argmax = -1, cand_argmax = -1;  // at that row (else at the last row)
  int topk = 5;                        // min(5, cols)
  double topk_overlap = 1;             // mean over rows of |topk(a) ∩ topk(b)| / topk
  double kl_mean = 0;                  // mean over rows of KL(softmax(b) || softmax(a)), in nats
  double kl_max = 0;
};
// `pool` (optional) spreads the rows over its threads; the result does not depend on it.
LogitsMetrics logits_metrics(const float* ref, const float* cand, int64_t rows, int64_t cols,
                             ThreadPool* pool = nullptr);

// Integer tensors are compared exactly.
struct IntMetrics {
  int64_t count = 0;
  int64_t mismatches = 0;
  int64_t first_mismatch = -1;  // flat offset
  int64_t ref_value = 0, cand_value = 0;  // at first_mismatch
};
IntMetrics int_metrics(const int64_t* ref, const int64_t* cand, int64_t n);

// Index of the largest value (first on ties, NaN ignored); -1 if none.
int64_t argmax(const float* v, int64_t n);

}  // namespace llmdiff::compare
