// Error signatures: what a diverging tensor's error looks like when no bug of
// the zoo explains it, each with its numbers. Computed from the candidate's
// and the reference's values alone (compare/ sees no weights):
//
//  - precision: the reference's values rounded to float16 / bfloat16; or
//             RoPE's table (rope.cos, rope.sin) computed from the angles
//             position x inv_freq, or from inv_freq, rounded to one of them
//             (an error growing with position; the reference's inv_freq and
//             the step's positions read from the dumps); or an RMSNorm
//             (attn_norm, mlp_norm, final_norm) of its input rounded to one
//             of them (the weight read off the reference's input and output);
//             or attn.probs as the softmax of the candidate's own scores in
//             16 bits (its input, input and output, or every step rounded).
//             On 16-bit checkpoints and engines: the reference is at the
//             candidate's declared dtype (a float32 candidate on bfloat16
//             weights: float32 on those weights); a candidate declaring
//             bfloat16 / float16 has its recomputed ops' closeness judged
//             within that type's rounding (tol 1e-2 / 2e-3) and RoPE's table
//             tried both stored in that type and in float32. A rounding its
//             own type explains does not diverge, so gets no signature; nor
//             does an op the same recompute without the rounding reproduces
//             (right on inputs that diverge upstream);
//  - scale:   candidate ~ c x reference, globally, per head or per row;
//             c recognised against common factors (sqrt(D), sqrt(Dh),
//             1/sqrt(Dh), Dh, 1/Dh, their MLA forms);
//  - partial: only some heads, rows (positions) or head-dim halves are wrong;
//  - shift:   rows equal the reference's rows k positions away;
//  - alias:   the tensor equals another canonical tensor of the reference at
//             the same step (its input: the op was skipped; a sibling: k for
//             v; the residual alone); or mlp_norm is HF's norm of another of
//             the candidate's own tensors than the residual stream after
//             attention (attn.out alone: the residual connection missing;
//             attn_norm + attn.out; the layer's input alone; the input +
//             attn.ctx: o_proj skipped), the sum made from the layer's input
//             and attn.out when the candidate holds no attn_residual (an
//             engine recorded at module boundaries).
//  - permutation: heads, rows or the dims inside each head in another order
//             (the class named: reversed, rotated, RoPE pairs re-paired,
//             halves swapped, or the permutation itself; on MLA the pairs
//             re-paired in the Dr rope dims only: the last Dr of a q/k head,
//             all of k_pe);
//  - rotary-width: a RoPE output (attn.q_rope, attn.k_rope; MLA's
//             attn.q_rope, attn.k_pe) is the candidate's own pre-rope input
//             rotated over another width R than the model's (a partial
//             rotary width, or MLA's Dr mis-set), R named with its
//             frequencies (theta^(-2i/R) or the model's first R/2) and pairing;
//  - norm:    an RMSNorm site (attn_norm, mlp_norm, final_norm) is HF's
//             norm of the candidate's own input with another formula: the
//             weight as (1 + weight) (Gemma's), no weight, the weight before
//             the normalisation, the mean subtracted (a LayerNorm), eps
//             outside the square root (the weight read off the reference's
//             input and output; the three forms that move the weight only
//             when it differs between channels); or another eps, fitted
//             (the norm's eps, or its input scaled by c = sqrt(eps/eps'),
//             c named when within 10% of a known factor: Gemma's sqrt(D)
//             embedding normaliser at layer 0). Tried below the 1e-5 level
//             the other signatures skip: an eps moves a norm by its share;
//  - length:  the sequence or cache length differs by k (and which part of
//             the longer side matches the shorter);
//  - mask:    the pattern of allowed (query, key) cells differs: no mask, the
//             causal boundary offset by k, a window of another width;
//  - elementwise: candidate = f(reference) for another pointwise function
//             (tanh soft-capping, clamping, relu, |x|) with its fitted
//             parameter, or mlp.act = f(gate) * up for an activation f other
//             than SiLU, from the candidate's own gate and up;
//  - attention at attn.ctx (compare/attention_variants.h): the context
//             recomputed from the candidate's own q, k and v with one change
//             of HF's eager attention reproduces it, the change named in the
//             kind it belongs to: RoPE on adjacent pairs (permutation), on
//             the first R dims only (rotary-width), on q only, k only or
//             neither (rope); scores unscaled, by 1/Dh or times sqrt(Dh)
//             (scale); the causal boundary one key late or early, or none
//             (mask); keys and values swapped or one used for both (alias);
//             kv heads tiled (permutation); the softmax in 16 bits
//             (precision); the softmax over the call's queries instead of
//             the keys (softmax-axis). For engines recorded at module
//             boundaries, which hold nothing inside attention;
//  - non-finite: NaN/Inf where the reference is finite;
//  - transposed-weight: the projection recomputed from the candidate's own
//             input with its weight matrix transposed reproduces it (asked of
//             the LocalOracle, which holds the weights); with the RMSNorm
//             before it skipped (q/k/v, gate/up, logits of the norm's input):
//             alias.
//
// Across names (compare/cross_signatures.h, from a bisection's verdicts, not
// from this function):
//  - only-some: which of the localised op's sibling sites (q/k/v, gate/up,
//             MLA's q and kv paths), forward calls (decode steps, later
//             chunks, calls attending to more than N keys, verify calls) or
//             layers (MoE ones) fail and which pass; where the error is, not
//             what its values are (fit 1, never decisive).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "compare/local_error.h"
#include "dumps/model/config.h"
#include "dumps/contract/dump.h"

namespace llmdiff::compare {

struct ErrorSignature {
  std::string name;    // the tensor
  std::string kind;    // "precision", "scale", "partial", "shift", "alias", "permutation", "rotary-width",
                       // "rope", "norm", "softmax-axis", "length", "mask", "elementwise", "transposed-weight", "non-finite",
                       // "only-some"
  std::string detail;  // one line with the numbers
  // How well it explains the error: the RMSE left after the explanation
  // over the RMSE before it (0: exactly; the smaller, the better).
  double fit = 1.0;
  bool decisive = false;  // explains the error to float32 rounding
  // Reproduced by recomputing the op from the candidate's own inputs with
  // one change (another formula, input or precision), not by a relation to
  // the reference's values: a better account of the values than a
  // fingerprint that no run reproduces.
  bool recomputed = false;
};

// Least-squares c in a ~ c b (0 when b is all zero), and the RMSE of a - k b.
double fit_scale(const float* a, const float* b, int64_t n);
double scaled_rmse(const float* a, const float* b, int64_t n, double k);

// The signatures of `name` (a float tensor both dumps hold; of another shape
// only `length` applies), best first; empty when none fits. `cfg` (optional)
// lets scale factors be recognised and tensors split into heads; `oracle`
// (optional) recomputes projections with a transposed weight.
std::vector<ErrorSignature> error_signatures(const std::string& name, const TensorSource& cand,
                                             const TensorSource& ref, const std::optional<ModelConfig>& cfg,
                                             const LocalOracle* oracle = nullptr);

}  // namespace llmdiff::compare
