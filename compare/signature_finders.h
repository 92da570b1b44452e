// The finders behind error_signatures (compare/signatures.h), one per kind
// or family of kinds, and what they share. Internal to compare/.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "compare/local_error.h"
#include "compare/signatures.h"
#include "dumps/model/config.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/names.h"

namespace llmdiff::compare::sig {

// "Explained": what is left is float32 rounding of the tensor's scale.
constexpr double kExact = 1e-5;  // residual RMS / RMS of the reference
constexpr double kFits = 1e-2;   // residual / error before: a partial explanation

std::string num(double v);  // "%.4g"
// A factor's named form ("sqrt(Dh)", "1/sqrt(D)", "2", ...) within relative
// `rel`, or "" (compare/signatures.cpp).
std::string recognise_factor(double c, const std::optional<ModelConfig>& cfg, double rel);

// The "head" view of a tensor: [H, rest] for [H, T, X] tensors, [T, H, X]
// for [T, H*Dh] projections (H from the config), else none.
struct Heads {
  int64_t H = 0, inner = 0;  // heads, contiguous elements per head block
  int64_t outer = 1;         // blocks before the head axis (T for [T, H*Dh])
  int64_t dims = 0;          // the head dim (X of [H, T, X], Dh of [T, H*Dh])
  int64_t at(int64_t o, int64_t h, int64_t i) const { return (o * H + h) * inner + i; }
};
std::optional<Heads> heads_of(const std::string& site, const Shape& shape, const std::optional<ModelConfig>& cfg);

// How a RoPE rotates the dims it covers: rotate-half pairs (i, i+R/2),
// adjacent pairs (2i, 2i+1) in place, or DeepSeek's rope_interleave (pairs
// (2i, 2i+1) rotated and left in halves order).
enum class Pairing { Halves, Interleaved, PairsToHalves };

// RoPE's rotation of the R = 2*half dims at x into out: pair i's inputs
// (a, b) by `pairing` rotated by (c[i], s[i]), a*c - b*s and b*c + a*s,
// in T's arithmetic (float: HF's float32 op; double: a recompute's).
template <typename T>
void rotate_pairs(const float* x, float* out, int64_t half, const T* c, const T* s, Pairing pairing) {
  for (int64_t i = 0; i < half; ++i) {
    int64_t ia = i, ib = i + half;  // where (a, b) are written
    T a = x[i], b = x[i + half];
    if (pairing != Pairing::Halves) a = x[2 * i], b = x[2 * i + 1];
    if (pairing == Pairing::Interleaved) ia = 2 * i, ib = 2 * i + 1;
    out[ia] = float(a * c[i] - b * s[i]);
    out[ib] = float(b * c[i] + a * s[i]);
  }
}

// The signatures found for one name, with the error they are judged against.
struct Found {
  std::string name;
  CanonName cn;
  double err = 0;    // rmse candidate vs reference
  double scale = 0;  // rms of the reference
  // Relative RMSE within which a recomputed value counts as the candidate's
  // (its own rounding: kExact for float32, the 16-bit types' epsilon).
  double tol = kExact;
  bool close(const float* a, const float* b, int64_t n) const;
  std::vector<ErrorSignature> out;
  // `left`: the rmse that remains after the explanation.
  void add(const std::string& kind, const std::string& detail, double left);
  // A finding that describes the error rather than fitting its values.
  void add_decisive(const std::string& kind, const std::string& detail);
  // add_decisive of an op recomputed from the candidate's own inputs with a
  // change (ErrorSignature::recomputed).
  void add_recomputed(const std::string& kind, const std::string& detail);
  bool has_decisive() const;
};

// Shapes differ: the length along one axis (tensors of one rank).
void find_length(Found& f, const TensorData& c, const TensorData& r);
// [T, X] tensors: candidate = reference x k per channel (column) or per row.
void find_axis_scale(Found& f, const TensorData& c, const TensorData& r);
// Heads, rows, or each head's dims reordered.
void find_permutation(Found& f, const TensorData& c, const TensorData& r, const std::optional<ModelConfig>& cfg);
// Which dims of each head are wrong (all heads wrong, some dims right).
void find_partial_dims(Found& f, const TensorData& c, const TensorData& r, const std::optional<ModelConfig>& cfg);
// `mask` and `attn.probs`: the allowed (query, key) cells.
void find_mask(Found& f, const TensorData& c, const TensorData& r);
// candidate = f(reference), or mlp.act from the candidate's own gate and up.
void find_elementwise(Found& f, const TensorData& c, const TensorData& r, const TensorSource& cand);
// Each 16-bit finder below claims a rounding only where the op recomputed
// with it fits the candidate within a tenth of its error, and within a tenth
// of what the op recomputed without it leaves (an op right on inputs that
// diverge upstream is no rounding); the recomputed values are tried stored
// in float32 and, for an engine declaring a 16-bit dtype, in that type.
//
// `rope.cos` / `rope.sin`: the angles position x inv_freq (or inv_freq
// itself) rounded to bfloat16 or float16 reproduce the candidate (the
// reference's inv_freq and the step's positions read from the dumps).
void find_rope_angle_precision(Found& f, const TensorData& c, const TensorData& r, const TensorSource& cand,
                               const TensorSource& ref);
// RMSNorm sites (attn_norm, mlp_norm, final_norm): HF's norm of the
// candidate's own input with one change reproduces the candidate, the norm's
// weight read off the reference's own input and output: the input rounded
// to bfloat16 or float16 first (precision), or another formula (norm: the
// weight as 1 + w, no weight, the mean subtracted, eps outside the square
// root, the weight before the normalisation), or another eps (its input
// scaled).
void find_norm_variant(Found& f, const TensorData& c, const TensorData& r, const TensorSource& cand,
                       const TensorSource& ref, const std::optional<ModelConfig>& cfg);
// `attn.probs`: the softmax of the candidate's own scores (and the step's
// mask) computed in float16 or bfloat16 — the scores rounded before it, its
// output rounded too, or every step of it (exp, sum, division) in that type —
// reproduces the candidate.
void find_softmax_precision(Found& f, const TensorData& c, const TensorSource& cand, const TensorSource& ref);
// RoPE output sites (attn.q_rope, attn.k_rope; MLA: attn.q_rope, attn.k_pe):
// the candidate's own pre-rope input (attn.q / attn.k, Qwen3's q_norm /
// k_norm, MLA's q heads and kv_a) rotated over another width R than the
// model's (the first Dh/4, Dh/2 or 3Dh/4 of a head's dims, or of MLA's Dr
// rope dims; on MLA also the last Dr/2 or 2 Dr dims of each head: Dr mis-set),
// at frequencies theta^(-2i/R) or the model's first R/2, pairs as halves,
// adjacent or DeepSeek's interleave, reproduces the candidate (the step's
// positions; the reference's rope.inv_freq and its rope.cos's attention
// scaling). Only when the model's own RoPE of that input does not.
void find_rotary_width(Found& f, const TensorData& c, const TensorSource& cand, const TensorSource& ref,
                       const std::optional<ModelConfig>& cfg);
// The projection recomputed from the candidate's own values with one change
// (compare/local_error.h ProjectionChange: its weight transposed, the norm
// before it skipped) reproduces the candidate's first rows.
void find_changed_projection(Found& f, const TensorData& c, const TensorSource& cand, const LocalOracle& oracle);

}  // namespace llmdiff::compare::sig
