// The noise-floor criterion (PyTorch dynamo's accuracy check with a float64
// reference): the reference is run twice over the candidate's own forward
// calls, at the candidate's compute dtype and in float64 ("truth"). A
// candidate tensor passes iff
//
//     RMSE(candidate, truth) <= m * noise + floor
//
// with m = 2 (float32) or 3 (16-bit) and noise the larger rounding error of
// two honest implementations of the same forward calls: RMSE(reference at
// dtype, truth) and, when given, RMSE(second, truth) of another honest run
// (`llmdiff bisect`/`run` use the clean impl). The candidate may be as
// inaccurate as honest rounding allows, a little more, but not more: this
// catches systematic errors orders of magnitude below any allclose atol (an
// RMSNorm eps of 1e-5 instead of 1e-6 moves unit-scale float32 activations by
// ~4.5e-6 relative, ~40 float32 epsilons) without flagging honest rounding.
//
// Why two: the order of accumulation alone sets a float32 dot product's
// error. libtorch's OpenBLAS sums in blocks; one sequential fused
// multiply-add chain per output (llama2.c's matmul, the impl's prefill
// kernel) is ~2.5x less accurate at K = 2048, growing as sqrt(K). Judged
// against the reference alone, a clean sequential-sum engine exceeded m = 2
// on 900 of 4250 names of a 1.1B model (at 1.06-1.44x the threshold).
//
// The floor, kNoiseFloorEps float32 machine epsilons of the truth's RMS
// (about 1e-6 relative, an NMSE of ~1e-12), covers what a single reference
// run cannot measure: ops it evaluates exactly (copies, cache appends,
// last-row extraction: reference error 0) and the scatter of its RMSE on
// small tensors, whose error accumulated over many ops lies in a few
// directions (a 28-element attention row, a 64-element last_hidden), where
// an honest float32 implementation was measured at up to 2.6x the
// reference's RMSE. With the floor, every clean impl dump of the golden
// models stays below 0.56 of the threshold, while the RMSNorm-eps error
// above still exceeds it ~4x at the first norm (NMSE 2e-11, ~20x the floor's).
#pragma once
#include <memory>
#include <string>

#include "compare/compare.h"
#include "dumps/model/config.h"
#include "dumps/contract/dump.h"

namespace llmdiff::compare {

// float32 machine epsilon (2^-23).
inline constexpr double kFloat32Eps = 1.1920928955078125e-07;
// The floor, in float32 machine epsilons of the truth's RMS.
inline constexpr double kNoiseFloorEps = 8.0;

// m: 2 for float32 and float64, 3 for bfloat16 and float16.
double noise_multiplier(ComputeDType dtype);
// The absolute floor for a tensor whose truth has RMS `truth_rms`.
double noise_floor_abs(double truth_rms);

// The numbers behind one noise-floor verdict.
struct NoiseStats {
  double cand_rmse = 0;   // RMSE(candidate, truth)
  double ref_rmse = 0;    // RMSE(reference at dtype, truth): the reference's own rounding noise
  double second_rmse = -1;  // RMSE(second honest run, truth); < 0: none
  double truth_rms = 0;   // sqrt(mean truth^2)
  double multiplier = 2;  // m
  double floor = 0;       // absolute
  bool finite = true;     // false: a non-finite value where the truth is finite (always fails)
  // The honest rounding noise: the larger of ref_rmse and second_rmse.
  double noise() const { return second_rmse > ref_rmse ? second_rmse : ref_rmse; }
  double threshold() const { return multiplier * noise() + floor; }
  bool pass() const;
  // cand_rmse / threshold (inf when not finite): <= 1 passes.
  double ratio() const;
  // "rmse 3.1e-06 > 2 x 1.2e-07 + 2.4e-07" (the relation the verdict rests on).
  std::string str() const;
};

// From raw values (n elements each; a non-finite candidate value where the
// truth is finite makes `finite` false, NaN/Inf pairs that agree are skipped).
// `second` (may be null): a second honest run's values.
NoiseStats noise_stats(const float* truth, const float* ref, const float* cand, int64_t n, ComputeDType dtype,
                       const float* second = nullptr);
// From already measured RMSEs.
NoiseStats noise_stats(double cand_rmse, double ref_rmse, double truth_rms, ComputeDType dtype);

// RMSE over the positions where both values are finite; `mismatch` (when
// given) counts positions where exactly one side is non-finite or both are
// but differ.
double rmse(const float* a, const float* b, int64_t n, int64_t* mismatch = nullptr);
double rms(const float* a, int64_t n);
// max |a-b| (Inf when a pair holds a NaN/Inf of its own that the other
// lacks) and its offset: the first where the maximum is reached, or the last
// such non-finite pair; -1 when every pair agrees. NMSE against b over the
// finite pairs.
void diff_stats(const float* a, const float* b, int64_t n, double* max_abs, int64_t* at, double* nmse);

// compare_dumps' Criterion form: compare_dumps(ref at dtype, candidate) with
// this criterion judges every float name by the noise floor against `truth`
// (the float64 run of the same forward calls), with `second` (may be null)
// the second honest run. Names the truth lacks, or holds with another shape,
// fall back to allclose with a note.
class NoiseFloorCriterion : public Criterion {
 public:
  NoiseFloorCriterion(std::shared_ptr<const TensorSource> truth, ComputeDType dtype,
                      std::shared_ptr<const TensorSource> second = nullptr);
  std::string name() const override { return "noise-floor"; }
  Judgement judge(const TensorData& ref, const TensorData& cand, const TensorComparison& cmp) const override;
  // `generated`: a greedy pick that differs from the reference's at the
  // candidate's dtype is judged against the float64 run instead. It is
  // right when it is the float64 argmax, and undecidable (reported, not a
  // divergence) when its float64 logit is within rounding noise of the
  // argmax's: twice the largest deviation of the reference at dtype (and of
  // the second honest run) from float64 on that step's next_logits. Needs
  // `reference` (the run at dtype, with next_logits) set.
  std::optional<Judgement> judge_ints(const TensorData& ref, const TensorData& cand,
                                      const TensorComparison& cmp) const override;
  // `moe.topk_ids`: experts chosen other than the reference's are a routing
  // flip at a near-tie (reported, not a divergence) on a token where an
  // honest run (the float64 truth, the second run) chose as the candidate
  // did, or where both choices are the top K of their own router scores
  // (`moe.router_probs`: a router without correction bias or groups), the
  // candidate's scores are within twice the honest runs' rounding noise of
  // the reference's, and the reference's margin between the swapped experts
  // is within twice that deviation. Needs `reference` and `candidate` set,
  // and router_probs in every run.
  void set_reference(std::shared_ptr<const TensorSource> reference) { reference_ = std::move(reference); }
  void set_candidate(const TensorSource* candidate) { candidate_ = candidate; }
  ComputeDType dtype() const { return dtype_; }
  const TensorSource& truth() const { return *truth_; }

 private:
  std::optional<Judgement> judge_routing(const TensorData& ref, const TensorData& cand, const TensorComparison& cmp) const;
  std::shared_ptr<const TensorSource> truth_, second_, reference_;
  const TensorSource* candidate_ = nullptr;
  ComputeDType dtype_;
};

}  // namespace llmdiff::compare
