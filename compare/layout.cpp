#include "compare/layout.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "dumps/model/config.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"

namespace llmdiff::compare {

namespace {
// Layout searches copy the candidate once per tried transform; beyond this
// many elements they are skipped.
constexpr int64_t kMaxSearchNumel = int64_t(1) << 26;
constexpr size_t kMaxSearchRank = 4;

std::string fmt_g(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

std::string perm_str(const std::vector<int>& p) {
  std::string s = "[";
  for (size_t i = 0; i < p.size(); ++i) s += (i ? ", " : "") + std::to_string(p[i]);
  return s + "]";
}

bool is_identity(const std::vector<int>& p) {
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] != int(i)) return false;
  return true;
}

std::string error_words(const LayoutFinding& f) {
  std::string s = "max abs " + fmt_g(f.metrics.max_abs);
  if (f.metrics.nonfinite_mismatch) s += ", " + std::to_string(f.metrics.nonfinite_mismatch) + " non-finite mismatches";
  if (!f.matches) s += ", min atol " + fmt_g(f.allclose.min_atol);
  return s;
}

void evaluate(LayoutFinding& f, const float* ref, const float* cand, int64_t n, const Tolerance& tol,
              ComputeDType ulp_dtype, ThreadPool* pool = nullptr) {
  PairMetrics pm = pair_metrics(ref, cand, n, ulp_dtype, tol, pool);
  f.metrics = pm.metrics;
  f.allclose = pm.allclose;
  f.matches = f.allclose.pass();
}

// Better = matching first, then the smaller worst allclose ratio, then the smaller max abs.
bool better(const LayoutFinding& a, const LayoutFinding& b) {
  if (a.matches != b.matches) return a.matches;
  if (a.allclose.failing != b.allclose.failing) return a.allclose.failing < b.allclose.failing;
  return a.metrics.max_abs < b.metrics.max_abs;
}

// Head dims worth trying for RoPE re-pairing of a last axis of size `last`.
std::vector<int64_t> rope_head_dims(int64_t last, const LayoutContext& ctx) {
  std::vector<int64_t> dims;
  if (ctx.head_dim >= 4 && ctx.head_dim % 2 == 0 && last % ctx.head_dim == 0) dims.push_back(ctx.head_dim);
  if (dims.empty() && last >= 4 && last % 2 == 0) dims.push_back(last);
  return dims;
}

}  // namespace

std::optional<RopeSpan> rope_span(int64_t last, const LayoutContext& ctx) {
  if (ctx.rope_dims >= 2 && ctx.rope_dims % 2 == 0) {
    if (ctx.mla_head_dim > ctx.rope_dims && last % ctx.mla_head_dim == 0)
      return RopeSpan{ctx.mla_head_dim, ctx.mla_head_dim - ctx.rope_dims, ctx.rope_dims};
    if (last % ctx.rope_dims == 0) return RopeSpan{ctx.rope_dims, 0, ctx.rope_dims};
    return std::nullopt;
  }
  const std::vector<int64_t> dims = rope_head_dims(last, ctx);
  if (dims.empty()) return std::nullopt;
  return RopeSpan{dims.front(), 0, dims.front()};
}

namespace {

// Sites whose last axis carries RoPE pairs (unknown names too: an adapter's
// own names may be anything).
bool rope_site(const std::string& name) {
  CanonName c = parse_name(name);
  if (c.kind == CanonName::Kind::Unknown) return true;
  static const std::vector<std::string> sites{"attn.q",      "attn.k",      "attn.q_norm", "attn.k_norm",
                                              "attn.q_rope", "attn.k_rope", "attn.k_cache", "attn.k_rep",
                                              "rope.cos",    "rope.sin",    "attn.k_pe",   "attn.k_pe_cache"};
  return std::find(sites.begin(), sites.end(), c.site) != sites.end();
}

// Shapes a tensor may be viewed as without moving data: itself, size-1 axes
// dropped, a rank-3 tensor with two neighbouring axes merged, and a rank-2
// tensor with one axis split by a head count / head dim (from the config or
// from the other tensor's dims).
std::vector<Shape> views(const Shape& s, const Shape& other, const LayoutContext& ctx) {
  std::vector<Shape> out{s};
  auto add = [&out](Shape v) {
    if (v.size() <= kMaxSearchRank && std::find(out.begin(), out.end(), v) == out.end()) out.push_back(std::move(v));
  };
  Shape squeezed;
  for (int64_t d : s)
    if (d != 1) squeezed.push_back(d);
  if (!squeezed.empty()) add(squeezed);
  if (s.size() == 3) {
    add({s[0] * s[1], s[2]});
    add({s[0], s[1] * s[2]});
  }
  if (s.size() == 2) {
    std::vector<int64_t> split{ctx.head_dim, ctx.num_heads, ctx.num_kv_heads, ctx.mla_head_dim};
    split.insert(split.end(), other.begin(), other.end());
    for (int64_t d : split) {
      if (d <= 1) continue;
      if (d < s[1] && s[1] % d == 0) {
        add({s[0], s[1] / d, d});
        add({s[0], d, s[1] / d});
      }
      if (d < s[0] && s[0] % d == 0) {
        add({d, s[0] / d, s[1]});
        add({s[0] / d, d, s[1]});
      }
    }
  }
  return out;
}

Shape permuted(const Shape& s, const std::vector<int>& p) {
  Shape out(p.size());
  for (size_t k = 0; k < p.size(); ++k) out[k] = s[size_t(p[k])];
  return out;
}

std::string describe_layout(const LayoutFinding& f, const Shape& ref_shape, const Shape& cand_shape) {
  std::string s = "candidate " + shape_str(cand_shape);
  if (f.cand_view != cand_shape) s += " viewed as " + shape_str(f.cand_view);
  s += f.matches ? " matches reference " : " comes closest to reference ";
  s += shape_str(ref_shape);
  if (f.ref_view != ref_shape) s += " viewed as " + shape_str(f.ref_view);
  std::vector<std::string> steps;
  if (!is_identity(f.perm)) steps.push_back("permute " + perm_str(f.perm));
  if (!f.rope.empty()) steps.push_back("RoPE re-pairing " + f.rope);
  if (steps.empty()) steps.push_back("reshape");
  s += " after " + steps[0];
  for (size_t i = 1; i < steps.size(); ++i) s += " and " + steps[i];
  if (f.kind == LayoutFinding::Kind::HeadSplit) s += " (head-split vs flat layout)";
  if (!f.matches) s += " but is still outside tolerance";
  return s + " (" + error_words(f) + ")";
}

// Where element o of the transformed candidate comes from: the candidate
// viewed as `cv`, permuted by `perm` (giving shape `rv`), then re-paired in
// blocks of `head_dim` ("" = no re-pairing), as permute_axes and rope_repair
// would move it.
class TransformIndex {
 public:
  TransformIndex(const Shape& cv, const Shape& rv, const std::vector<int>& perm, const std::string& rope,
                 RopeSpan span)
      : out_shape_(rv), rope_(rope), span_(span), n_(numel(rv)) {
    std::vector<int64_t> in_stride(cv.size(), 1);
    for (size_t d = cv.size(); d-- > 1;) in_stride[d - 1] = in_stride[d] * cv[d];
    for (size_t k = 0; k < perm.size(); ++k) step_.push_back(in_stride[size_t(perm[k])]);
  }
  int64_t source(int64_t o) const {
    int64_t k = o;  // index into the permuted candidate
    const int64_t dh = span_.block;
    if (!rope_.empty() && dh >= 2 && span_.len >= 2 && span_.len % 2 == 0 && o < n_ / dh * dh) {
      const int64_t b = o - o % dh, j = o % dh - span_.start, half = span_.len / 2;
      if (j >= 0 && j < span_.len) {
        if (rope_ == "half->interleaved")
          k = b + span_.start + (j % 2 == 0 ? j / 2 : j / 2 + half);
        else
          k = b + span_.start + (j < half ? 2 * j : 2 * (j - half) + 1);
      }
    }
    int64_t src = 0;
    for (size_t d = out_shape_.size(); d-- > 0;) {
      src += (k % out_shape_[d]) * step_[d];
      k /= out_shape_[d];
    }
    return src;
  }

 private:
  Shape out_shape_;
  std::string rope_;
  RopeSpan span_;
  int64_t n_;
  std::vector<int64_t> step_;
};

// False when some sampled element of the transformed candidate is clearly
// outside tolerance (then allclose of the whole transform fails too); true
// otherwise. The margin keeps elements within rounding of the bound in, so
// the full evaluation alone decides those.
bool sample_may_match(const float* ref, const float* cand, int64_t n, const TransformIndex& at, const Tolerance& tol) {
  auto fails = [&](int64_t o) {
    const float b = ref[o], a = cand[at.source(o)];
    if (!std::isfinite(a) || !std::isfinite(b)) return !(std::isnan(a) ? std::isnan(b) : a == b);
    const double ad = std::fabs(double(a) - double(b));
    return ad > (tol.atol + tol.rtol * std::fabs(double(b))) * (1 + 1e-9);
  };
  constexpr int64_t kHead = 64, kSpread = 1024;
  for (int64_t o = 0; o < std::min(n, kHead); ++o)
    if (fails(o)) return false;
  if (n > kHead)
    for (int64_t s = 0; s < kSpread; ++s)
      if (fails(kHead + (n - kHead) * s / kSpread)) return false;
  return true;
}

// Searches views x permutations (x RoPE re-pairings) of the candidate for the
// layout closest to the reference; `with_views` also tries reshapes. The
// plain comparison (no transform) is never a finding. `matching_only` skips
// (without evaluating them in full) transforms that a sample shows cannot
// match: for callers that report matching layouts only.
std::optional<LayoutFinding> search_layouts(const std::string& name, const float* ref_f, const Shape& ref_shape,
                                            const float* cand_f, const Shape& cand_shape, const Tolerance& tol,
                                            ComputeDType ulp_dtype, const LayoutContext& ctx, bool with_views,
                                            bool matching_only, ThreadPool* pool) {
  const int64_t n = numel(ref_shape);
  if (n != numel(cand_shape) || n == 0 || n > kMaxSearchNumel) return std::nullopt;
  if (ref_shape.size() > kMaxSearchRank || cand_shape.size() > kMaxSearchRank) return std::nullopt;
  std::vector<Shape> ref_views = with_views ? views(ref_shape, cand_shape, ctx) : std::vector<Shape>{ref_shape};
  std::vector<Shape> cand_views = with_views ? views(cand_shape, ref_shape, ctx) : std::vector<Shape>{cand_shape};
  std::optional<LayoutFinding> best;
  for (const Shape& rv : ref_views) {
    for (const Shape& cv : cand_views) {
      if (rv.size() != cv.size()) continue;
      Shape a = rv, b = cv;
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      if (a != b) continue;
      std::vector<int> p(cv.size());
      std::iota(p.begin(), p.end(), 0);
      do {
        if (permuted(cv, p) != rv) continue;
        bool plain = rv == ref_shape && cv == cand_shape && is_identity(p);
        std::vector<float> moved;  // the permuted candidate, made on first use
        std::vector<std::string> ropes{""};
        const std::optional<RopeSpan> pairs = rv.empty() ? std::nullopt : rope_span(rv.back(), ctx);
        const RopeSpan span = pairs.value_or(RopeSpan{});
        if (rope_site(name) && pairs) {
          ropes.push_back("interleaved->half");
          ropes.push_back("half->interleaved");
        }
        for (const std::string& rope : ropes) {
          if (plain && rope.empty()) continue;
          const RopeSpan sp = rope.empty() ? RopeSpan{} : span;
          if (matching_only && !sample_may_match(ref_f, cand_f, n, TransformIndex(cv, rv, p, rope, sp), tol)) continue;
          if (moved.empty()) moved = permute_axes(cand_f, cv, p);
          LayoutFinding f;
          f.cand_view = cv;
          f.ref_view = rv;
          f.perm = p;
          f.rope = rope;
          bool reshaped = rv != ref_shape || cv != cand_shape;
          f.kind = reshaped ? LayoutFinding::Kind::HeadSplit
                            : (is_identity(p) ? LayoutFinding::Kind::RopePairing : LayoutFinding::Kind::Permute);
          if (rope.empty()) {
            evaluate(f, ref_f, moved.data(), n, tol, ulp_dtype, pool);
          } else {
            auto repaired = rope_repair(moved.data(), n, sp.block, rope == "half->interleaved", sp.start, sp.len);
            evaluate(f, ref_f, repaired.data(), n, tol, ulp_dtype, pool);
          }
          if (!best || better(f, *best)) best = std::move(f);
        }
      } while (std::next_permutation(p.begin(), p.end()));
    }
  }
  return best;
}

// k/v cache, repeated k/v: [H, S, Dh] (axis 1); scores/probs: [Hq, T, S]
// (axis 2); mask: [T, S] (axis 1). -1 for other sites.
int cache_axis(const std::string& site, size_t rank) {
  if ((site == "attn.k_cache" || site == "attn.v_cache" || site == "attn.k_rep" || site == "attn.v_rep") && rank == 3)
    return 1;
  if ((site == "attn.scores" || site == "attn.probs") && rank == 3) return 2;
  if (site == "mask" && rank == 2) return 1;
  return -1;
}

std::optional<LayoutFinding> cache_length(const std::string& name, const TensorData& ref, const TensorData& cand,
                                          const Tolerance& tol, ComputeDType ulp_dtype) {
  std::string site = parse_name(name).site;
  if (ref.shape.size() != cand.shape.size()) return std::nullopt;
  int axis = cache_axis(site, ref.shape.size());
  if (axis < 0) return std::nullopt;
  for (size_t d = 0; d < ref.shape.size(); ++d)
    if (int(d) != axis && ref.shape[d] != cand.shape[d]) return std::nullopt;
  int64_t s_ref = ref.shape[size_t(axis)], s_cand = cand.shape[size_t(axis)];
  if (s_ref == s_cand) return std::nullopt;
  int64_t len = std::min(s_ref, s_cand);
  LayoutFinding f;
  f.kind = LayoutFinding::Kind::CacheLength;
  f.ref_len = s_ref;
  f.cand_len = s_cand;
  f.ref_view = ref.shape;
  f.cand_view = cand.shape;
  auto r = slice_prefix(ref.f.data(), ref.shape, axis, len);
  auto c = slice_prefix(cand.f.data(), cand.shape, axis, len);
  evaluate(f, r.data(), c.data(), int64_t(r.size()), tol, ulp_dtype);
  // Values beyond the overlap, on the longer side.
  const TensorData& longer = s_ref > s_cand ? ref : cand;
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < axis; ++d) outer *= longer.shape[size_t(d)];
  for (size_t d = size_t(axis) + 1; d < longer.shape.size(); ++d) inner *= longer.shape[d];
  int64_t s_long = std::max(s_ref, s_cand);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t s = len; s < s_long; ++s)
      for (int64_t i = 0; i < inner; ++i)
        if (longer.f[size_t((o * s_long + s) * inner + i)] != 0.0f) ++f.extra_nonzero;
  std::string what = site == "mask" || site == "attn.scores" || site == "attn.probs" ? "key length" : "cache";
  f.summary = (what == "cache" ? "cache holds S'=" : "key length S'=") + std::to_string(s_cand) +
              " where reference has S=" + std::to_string(s_ref) + "; the overlapping " + std::to_string(len) +
              " positions " + (f.matches ? "match" : "differ") + " (" + error_words(f) + "); the " +
              std::to_string(s_long - len) + " extra positions of the " + (s_ref > s_cand ? "reference" : "candidate") +
              " hold " + std::to_string(f.extra_nonzero) + " nonzero values";
  return f;
}

TensorData float_copy(const TensorData& t) {
  if (!t.is_int) return t;
  TensorData c = t;
  c.f = t.floats();
  c.i.clear();
  c.is_int = false;
  return c;
}
}  // namespace

const char* finding_kind_name(LayoutFinding::Kind k) {
  switch (k) {
    case LayoutFinding::Kind::Permute: return "permute";
    case LayoutFinding::Kind::HeadSplit: return "head-split";
    case LayoutFinding::Kind::RopePairing: return "rope-pairing";
    case LayoutFinding::Kind::CacheLength: return "cache-length";
  }
  return "?";
}

LayoutContext layout_context(const Manifest& ref, const Manifest& cand) {
  LayoutContext ctx;
  for (const Manifest* m : {&ref, &cand}) {
    if (m->config.empty()) continue;
    try {
      ModelConfig c = parse_config(m->config, "manifest config");
      ctx.num_heads = c.num_attention_heads;
      ctx.num_kv_heads = c.num_key_value_heads;
      ctx.head_dim = c.head_dim;
      if (c.mla.enabled) {
        ctx.mla_head_dim = c.mla.qk_head_dim();
        ctx.rope_dims = c.mla.qk_rope_head_dim;
      }
      return ctx;
    } catch (const Error&) {
      // An unparsable config leaves the dims to be guessed from the shapes.
    }
  }
  return ctx;
}

std::vector<float> permute_axes(const float* x, const Shape& shape, const std::vector<int>& perm, Shape* out_shape) {
  const size_t r = shape.size();
  if (perm.size() != r) throw UsageError("permute_axes: permutation " + perm_str(perm) + " does not fit shape " + shape_str(shape));
  std::vector<int64_t> in_stride(r, 1);
  for (size_t d = r; d-- > 1;) in_stride[d - 1] = in_stride[d] * shape[d];
  Shape os = permuted(shape, perm);
  if (out_shape) *out_shape = os;
  const int64_t n = numel(shape);
  std::vector<float> out(size_t(std::max<int64_t>(n, 0)));
  if (n <= 0) return out;
  std::vector<int64_t> idx(r, 0);
  std::vector<int64_t> step(r);
  for (size_t k = 0; k < r; ++k) step[k] = in_stride[size_t(perm[k])];
  int64_t src = 0;
  for (int64_t o = 0; o < n; ++o) {
    out[size_t(o)] = x[src];
    for (size_t k = r; k-- > 0;) {
      if (++idx[k] < os[k]) {
        src += step[k];
        break;
      }
      src -= step[k] * (os[k] - 1);
      idx[k] = 0;
    }
  }
  return out;
}

std::vector<float> rope_repair(const float* x, int64_t n, int64_t head_dim, bool half_to_interleaved,
                               int64_t start, int64_t len) {
  std::vector<float> out(x, x + n);
  if (len == 0) len = head_dim - start;
  if (head_dim < 2 || len < 2 || len % 2 != 0 || start < 0 || start + len > head_dim) return out;
  const int64_t half = len / 2;
  for (int64_t b = start; b - start + head_dim <= n; b += head_dim) {
    for (int64_t i = 0; i < half; ++i) {
      if (half_to_interleaved) {
        out[size_t(b + 2 * i)] = x[b + i];
        out[size_t(b + 2 * i + 1)] = x[b + i + half];
      } else {
        out[size_t(b + i)] = x[b + 2 * i];
        out[size_t(b + i + half)] = x[b + 2 * i + 1];
      }
    }
  }
  return out;
}

std::vector<float> slice_prefix(const float* x, const Shape& shape, int axis, int64_t len) {
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < axis; ++d) outer *= shape[size_t(d)];
  for (size_t d = size_t(axis) + 1; d < shape.size(); ++d) inner *= shape[d];
  const int64_t s = shape[size_t(axis)];
  len = std::min(len, s);
  std::vector<float> out;
  out.reserve(size_t(outer * len * inner));
  for (int64_t o = 0; o < outer; ++o) {
    const float* row = x + o * s * inner;
    out.insert(out.end(), row, row + len * inner);
  }
  return out;
}

std::vector<LayoutFinding> explain_shape_mismatch(const std::string& name, const TensorData& ref_in,
                                                  const TensorData& cand_in, const Tolerance& tol,
                                                  ComputeDType ulp_dtype, const LayoutContext& ctx) {
  std::vector<LayoutFinding> out;
  TensorData ref = float_copy(ref_in), cand = float_copy(cand_in);
  if (auto f = cache_length(name, ref, cand, tol, ulp_dtype)) out.push_back(std::move(*f));
  if (auto f = search_layouts(name, ref.f.data(), ref.shape, cand.f.data(), cand.shape, tol, ulp_dtype, ctx, true,
                              false, nullptr)) {
    f->summary = describe_layout(*f, ref.shape, cand.shape);
    out.push_back(std::move(*f));
  }
  std::stable_sort(out.begin(), out.end(), [](const LayoutFinding& a, const LayoutFinding& b) {
    return a.matches && !b.matches;
  });
  return out;
}

std::vector<LayoutFinding> explain_value_mismatch(const std::string& name, const TensorData& ref_in,
                                                  const TensorData& cand_in, const Tolerance& tol,
                                                  ComputeDType ulp_dtype, const LayoutContext& ctx) {
  if (ref_in.is_int || cand_in.is_int || ref_in.shape != cand_in.shape) return {};
  return explain_value_mismatch(name, ref_in.f.data(), cand_in.f.data(), ref_in.shape, tol, ulp_dtype, ctx);
}

std::vector<LayoutFinding> explain_value_mismatch(const std::string& name, const float* ref, const float* cand,
                                                  const Shape& shape, const Tolerance& tol, ComputeDType ulp_dtype,
                                                  const LayoutContext& ctx, ThreadPool* pool) {
  std::vector<LayoutFinding> out;
  if (auto f = search_layouts(name, ref, shape, cand, shape, tol, ulp_dtype, ctx, false, true, pool); f && f->matches) {
    if (f->kind == LayoutFinding::Kind::RopePairing) {
      const RopeSpan sp = *rope_span(shape.back(), ctx);
      bool cand_interleaved = f->rope == "interleaved->half";
      const std::string where = sp.len == sp.block ? "Dh=" + std::to_string(sp.block)
                                                   : "in the Dr = " + std::to_string(sp.len) +
                                                         " rope dims of each head of " + std::to_string(sp.block);
      f->summary = std::string("candidate pairs RoPE dims as ") + (cand_interleaved ? "(2i, 2i+1)" : "(i, i+Dh/2)") +
                   " where the reference pairs " + (cand_interleaved ? "(i, i+Dh/2)" : "(2i, 2i+1)") + " (" + where +
                   "): matches after re-pairing " + f->rope + " (" + error_words(*f) + ")";
    } else {
      f->summary = describe_layout(*f, shape, shape);
    }
    out.push_back(std::move(*f));
  }
  return out;
}

}  // namespace llmdiff::compare
