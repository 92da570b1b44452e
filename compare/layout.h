// Layout explanations of a mismatch: the candidate holds the reference's
// values in another layout (axis permutation, head-split vs flat, RoPE
// pairing), or a cache of another length. A finding explains a divergence; it
// never turns it into a pass.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "compare/metrics.h"
#include "compare/tolerance.h"
#include "dumps/contract/dump.h"

namespace llmdiff::compare {

// Model dimensions used to split flat tensors into heads (0 = unknown, then
// the other tensor's dims are tried instead).
struct LayoutContext {
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  // MLA: RoPE rotates only the last rope_dims (Dr) of each q/k head of
  // mla_head_dim (Dn + Dr) dims, and all of k_pe (0: not MLA, the whole
  // head rotates).
  int64_t mla_head_dim = 0, rope_dims = 0;
};
// Where RoPE pairs lie along a last axis of `last` values: in every block of
// `block`, the `len` from `start` (the whole head; MLA's last Dr of a q/k
// head, or all of a k_pe row). nullopt: no head dim fits.
struct RopeSpan {
  int64_t block = 0, start = 0, len = 0;
};
std::optional<RopeSpan> rope_span(int64_t last, const LayoutContext& ctx);
// From the `config` of the reference manifest, else the candidate's.
LayoutContext layout_context(const Manifest& ref, const Manifest& cand);

struct LayoutFinding {
  enum class Kind {
    Permute,      // same dims in another order: matches after permute [..]
    HeadSplit,    // reshaped (and possibly permuted): [Hq, T, Dh] vs [T, Hq*Dh]
    RopePairing,  // last dim's RoPE pairs laid out interleaved vs rotate-half
    CacheLength   // k/v cache (or scores/probs/mask) with another S
  };
  Kind kind = Kind::Permute;
  std::string summary;          // one line, numbers included
  Shape cand_view, ref_view;    // shapes each side was viewed as before the transform
  std::vector<int> perm;        // axes: transformed[i0, ..] = cand_view[.. index perm[k] = i_k ..]
  std::string rope;             // "" | "interleaved->half" | "half->interleaved" (applied to the candidate)
  int64_t ref_len = 0, cand_len = 0;  // CacheLength: S of each side
  int64_t extra_nonzero = 0;          // CacheLength: nonzero values beyond the shorter S
  FloatMetrics metrics;         // error after the transform (the overlap for CacheLength)
  AllcloseResult allclose;
  bool matches = false;         // within tolerance after the transform
};
const char* finding_kind_name(LayoutFinding::Kind k);  // "permute", "head-split", "rope-pairing", "cache-length"

// numpy-style transpose: out.shape[k] = shape[perm[k]].
std::vector<float> permute_axes(const float* x, const Shape& shape, const std::vector<int>& perm,
                                Shape* out_shape = nullptr);
// Re-pairs RoPE rotations in every block of `head_dim` along the flat data
// (in its `len` values from `start`; len 0: all of it): "half->interleaved"
// moves (i, i+len/2) to (2i, 2i+1); "interleaved->half" does the inverse.
std::vector<float> rope_repair(const float* x, int64_t n, int64_t head_dim, bool half_to_interleaved,
                               int64_t start = 0, int64_t len = 0);
// The first `len` entries along `axis`.
std::vector<float> slice_prefix(const float* x, const Shape& shape, int axis, int64_t len);

// Shapes differ: the best explanation(s) found (possibly none). Each kind is
// reported at most once, the closest match first.
std::vector<LayoutFinding> explain_shape_mismatch(const std::string& name, const TensorData& ref,
                                                  const TensorData& cand, const Tolerance& tol,
                                                  ComputeDType ulp_dtype, const LayoutContext& ctx);
// Same shape but out of tolerance: layouts under which the values do match
// (only matching explanations are reported).
std::vector<LayoutFinding> explain_value_mismatch(const std::string& name, const TensorData& ref,
                                                  const TensorData& cand, const Tolerance& tol,
                                                  ComputeDType ulp_dtype, const LayoutContext& ctx);
// The same on raw float values of one shape. Transforms are first checked on
// a sample of elements (a failing element rules a layout out) and only those
// passing it are evaluated in full; `pool` (optional) spreads that work.
std::vector<LayoutFinding> explain_value_mismatch(const std::string& name, const float* ref, const float* cand,
                                                  const Shape& shape, const Tolerance& tol, ComputeDType ulp_dtype,
                                                  const LayoutContext& ctx, ThreadPool* pool = nullptr);

}  // namespace llmdiff::compare
