// The structural signature finders: length, permutation, partial dims, mask,
// elementwise and the changed projections (compare/signature_finders.h).
#include "compare/signature_finders.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "compare/layout.h"
#include "compare/metrics.h"
#include "compare/noise_floor.h"
#include "dumps/contract/sites.h"
#include "dumps/base/dtype.h"

namespace llmdiff::compare::sig {

namespace {

// Sites whose axis `axis` runs over keys (the cache length S) rather than
// over this call's positions.
bool key_axis(const std::string& site, size_t rank, int axis) {
  if (site == "mask" || site == "attn.scores" || site == "attn.probs") return axis == int(rank) - 1;
  if (site == "attn.k_cache" || site == "attn.v_cache" || site == "attn.k_rep" || site == "attn.v_rep")
    return axis == 1;
  if (site == "attn.latent_cache" || site == "attn.k_pe_cache") return axis == 0;
  return false;
}

// Whether `axis` runs over this call's positions (T): [T, X] tensors, the
// head-major [H, T, X] attention tensors, MoE's [T, K, D].
bool position_axis(const std::string& site, size_t rank, int axis) {
  if (key_axis(site, rank, axis)) return false;
  if (rank == 3 && site.rfind("attn.", 0) == 0) return axis == 1;
  return rank >= 2 && axis == 0;
}

// [start, start+len) along `axis`.
std::vector<float> slice_axis(const TensorData& t, int axis, int64_t start, int64_t len) {
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i) outer *= t.shape[size_t(i)];
  for (size_t i = size_t(axis) + 1; i < t.shape.size(); ++i) inner *= t.shape[i];
  const int64_t full = t.shape[size_t(axis)];
  std::vector<float> out;
  out.reserve(size_t(outer * len * inner));
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t k = start; k < start + len; ++k) {
      const float* row = t.f.data() + (o * full + k) * inner;
      out.insert(out.end(), row, row + inner);
    }
  return out;
}

// "0-3, 7, 9-12": sorted indices as ranges.
std::string ranges(const std::vector<int64_t>& idx, size_t max_items = 8) {
  std::string s;
  size_t items = 0;
  for (size_t i = 0; i < idx.size();) {
    size_t j = i;
    while (j + 1 < idx.size() && idx[j + 1] == idx[j] + 1) ++j;
    if (items++ == max_items) return s + ", ...";
    s += (s.empty() ? "" : ", ") + std::to_string(idx[i]) + (j > i ? "-" + std::to_string(idx[j]) : "");
    i = j + 1;
  }
  return s;
}

// A permutation's class in words: "reversed", "rotated by 1", "neighbours
// swapped", else the permutation itself.
std::string permutation_class(const std::vector<int64_t>& p) {
  const int64_t n = int64_t(p.size());
  bool reversed = true, swapped = n % 2 == 0;
  for (int64_t i = 0; i < n; ++i) {
    reversed = reversed && p[size_t(i)] == n - 1 - i;
    swapped = swapped && p[size_t(i)] == (i ^ 1);
  }
  if (reversed) return "reversed";
  if (swapped) return "neighbours swapped (0<->1, 2<->3, ...)";
  for (int64_t k = 1; k < n; ++k) {
    bool rot = true;
    for (int64_t i = 0; i < n && rot; ++i) rot = p[size_t(i)] == (i + k) % n;
    if (rot) return "rotated by " + std::to_string(k) + " (i holds the reference's (i+" + std::to_string(k) + ") mod " +
                    std::to_string(n) + ")";
  }
  std::string s = "[";
  for (int64_t i = 0; i < n && i < 16; ++i) s += (i ? ", " : "") + std::to_string(p[size_t(i)]);
  return s + (n > 16 ? ", ...]" : "]");
}

// Matches each of `n` candidate blocks to a reference block it equals (its
// own index first); empty when one has none or the mapping is the identity.
std::vector<int64_t> block_permutation(const Found& f, int64_t n,
                                       const std::function<std::vector<float>(const TensorData&, int64_t)>& block,
                                       const TensorData& c, const TensorData& r) {
  std::vector<std::vector<float>> cb, rb;
  for (int64_t i = 0; i < n; ++i) {
    cb.push_back(block(c, i));
    rb.push_back(block(r, i));
  }
  std::vector<int64_t> p(size_t(n), -1);
  bool identity = true;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t m = int64_t(cb[size_t(i)].size());
    if (f.close(cb[size_t(i)].data(), rb[size_t(i)].data(), m)) {
      p[size_t(i)] = i;
      continue;
    }
    identity = false;
    for (int64_t j = 0; j < n && p[size_t(i)] < 0; ++j)
      if (j != i && f.close(cb[size_t(i)].data(), rb[size_t(j)].data(), m)) p[size_t(i)] = j;
    if (p[size_t(i)] < 0) return {};
  }
  if (identity) return {};
  return p;
}

// Each block of `Dh` dims (a head, or k_pe's row) in another order: its
// RoPE pairs (in the last `Dr` dims, the rotated ones; 0: none) re-paired,
// its halves swapped, its dims reversed. Whether one was found (and added).
bool dims_permutation(Found& f, const TensorData& c, const TensorData& r, int64_t Dh, int64_t Dr,
                      const std::string& unit) {
  const int64_t n = int64_t(c.f.size());
  if (Dh < 2 || Dh % 2 != 0 || n % Dh != 0) return false;
  struct Way {
    std::string what;
    std::vector<float> v;
  };
  std::vector<Way> ways;
  if (Dr >= 2 && Dr % 2 == 0 && Dr <= Dh) {
    // The rotated dims of every block re-paired, the others as they are.
    auto repair = [&](bool half_to_interleaved) {
      std::vector<float> part;
      part.reserve(size_t(n / Dh * Dr));
      for (int64_t b = 0; b < n; b += Dh) part.insert(part.end(), c.f.begin() + b + Dh - Dr, c.f.begin() + b + Dh);
      part = rope_repair(part.data(), int64_t(part.size()), Dr, half_to_interleaved);
      std::vector<float> v(c.f);
      for (int64_t b = 0, k = 0; b < n; b += Dh, k += Dr)
        std::copy_n(part.begin() + k, Dr, v.begin() + b + Dh - Dr);
      return v;
    };
    const std::string D = Dr == Dh ? "Dh" : "Dr";
    const std::string where =
        Dr == Dh && unit == "each head" ? ""
        : Dr == Dh                      ? ", in the Dr = " + std::to_string(Dr) + " rope dims of " + unit
                                        : ", in the Dr = " + std::to_string(Dr) + " rope dims of " + unit + " (its last " +
                                              std::to_string(Dr) + " of " + std::to_string(Dh) + ")";
    ways.push_back({"RoPE pairs interleaved (2i, 2i+1) where the reference pairs (i, i+" + D + "/2)" + where +
                        ": re-paired interleaved->half it matches",
                    repair(false)});
    ways.push_back({"RoPE pairs as halves (i, i+" + D + "/2) where the reference interleaves (2i, 2i+1)" + where +
                        ": re-paired half->interleaved it matches",
                    repair(true)});
  }
  std::vector<float> swapped(c.f.size()), reversed(c.f.size());
  for (int64_t b = 0; b < n; b += Dh)
    for (int64_t d = 0; d < Dh; ++d) {
      swapped[size_t(b + d)] = c.f[size_t(b + (d + Dh / 2) % Dh)];
      reversed[size_t(b + d)] = c.f[size_t(b + Dh - 1 - d)];
    }
  ways.push_back({"the two halves of " + unit + " swapped (dims 0.." + std::to_string(Dh / 2 - 1) + " <-> " +
                      std::to_string(Dh / 2) + ".." + std::to_string(Dh - 1) + ")",
                  std::move(swapped)});
  ways.push_back({unit == "each head" ? "each head's dims reversed" : "the dims of " + unit + " reversed",
                  std::move(reversed)});
  for (const Way& w : ways)
    if (f.close(w.v.data(), r.f.data(), n)) {
      f.add_decisive("permutation", "dims inside " + unit + " (" + (Dr == Dh && unit != "each head" ? "Dr" : "Dh") +
                                        " = " + std::to_string(Dh) + ") in another order: " + w.what);
      return true;
    }
  return false;
}

}  // namespace

void find_length(Found& f, const TensorData& c, const TensorData& r) {
  if (c.shape.size() != r.shape.size()) return;
  int axis = -1;
  for (size_t i = 0; i < c.shape.size(); ++i)
    if (c.shape[i] != r.shape[i]) {
      if (axis >= 0) return;  // more than one axis: a layout, not a length
      axis = int(i);
    }
  if (axis < 0) return;
  const int64_t lc = c.shape[size_t(axis)], lr = r.shape[size_t(axis)], k = lc - lr, m = std::min(lc, lr);
  const bool keys = key_axis(f.cn.site, c.shape.size(), axis);
  if (!keys && !position_axis(f.cn.site, c.shape.size(), axis)) return;  // a width: another model or layout
  const std::string len = keys ? "S" : "T", unit = keys ? "key" : "position";
  const TensorData& shorter = k > 0 ? r : c;
  const TensorData& longer = k > 0 ? c : r;
  const std::vector<float> s = slice_axis(shorter, axis, 0, m);
  const bool head = m > 0 && f.close(slice_axis(longer, axis, 0, m).data(), s.data(), int64_t(s.size()));
  const bool tail = m > 0 && !head && f.close(slice_axis(longer, axis, std::abs(k), m).data(), s.data(), int64_t(s.size()));
  std::string d = len + " = " + std::to_string(lc) + " where the reference has " + std::to_string(lr) + " (" +
                  (k > 0 ? "+" : "") + std::to_string(k) + " " + unit + (std::abs(k) == 1 ? "" : "s") + ")";
  if (k > 0 && head)
    d += ": the first " + std::to_string(m) + " match the reference, the extra " + (k == 1 ? "one is" : "ones are") +
         " at the end" + (keys ? " (a stale or unwritten cache slot read: a context one too long)" : "");
  else if (k > 0 && tail)
    d += ": the last " + std::to_string(m) + " match the reference, the extra " + (k == 1 ? "one is" : "ones are") +
         " at the start";
  else if (k < 0 && head)
    d += ": they match the reference's first " + std::to_string(m) + ", its last " + std::to_string(-k) +
         " are missing" + (keys ? " (this call's keys were not appended)" : "");
  else if (k < 0 && tail)
    d += ": they match the reference's last " + std::to_string(m) + ", its first " + std::to_string(-k) +
         " are missing" + (keys ? " (only the newest kept: the cache was overwritten or wrapped)" : "");
  else
    d += "; no contiguous part matches the reference";
  if (head || tail) {
    f.add_decisive("length", d);
  } else {
    ErrorSignature g;
    g.name = f.name;
    g.kind = "length";
    g.detail = d;
    f.out.push_back(g);
  }
}

void find_axis_scale(Found& f, const TensorData& c, const TensorData& r) {
  if (c.shape.size() != 2) return;
  const int64_t T = c.shape[0], X = c.shape[1];
  // by channel: k_x over the rows; by row: k_t over the channels (a few
  // values per fit at least, or any error would fit).
  for (const bool channel : {true, false}) {
    if ((channel ? T : X) < 4) continue;
    const int64_t groups = channel ? X : T, len = channel ? T : X;
    std::vector<double> ks(static_cast<size_t>(groups), 0.0);
    std::vector<float> a(static_cast<size_t>(len)), b(static_cast<size_t>(len));
    double left = 0;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t i = 0; i < len; ++i) {
        const size_t at = size_t(channel ? i * X + g : g * X + i);
        a[size_t(i)] = c.f[at];
        b[size_t(i)] = r.f[at];
      }
      ks[size_t(g)] = fit_scale(a.data(), b.data(), len);
      const double l = scaled_rmse(a.data(), b.data(), len, ks[size_t(g)]);
      left += l * l * double(len);
    }
    left = std::sqrt(left / double(T * X));
    if (left >= kFits * f.err) continue;
    double lo = INFINITY, hi = -INFINITY;
    for (double k : ks) {
      lo = std::min(lo, k);
      hi = std::max(hi, k);
    }
    std::string list;
    for (size_t i = 0; i < ks.size() && i < 6; ++i) list += (i ? ", " : "") + num(ks[i]);
    f.add("scale", std::string(channel ? "per channel" : "per row") + ": candidate = reference x k with k = [" + list +
                       (ks.size() > 6 ? ", ..." : "") + "] (from " + num(lo) + " to " + num(hi) + "; rmse after " +
                       num(left) + ", before " + num(f.err) + ")" +
                       (channel ? ": a per-channel weight applied wrongly or not at all (a norm's weight?)" : ""),
          left);
    return;
  }
}

void find_permutation(Found& f, const TensorData& c, const TensorData& r, const std::optional<ModelConfig>& cfg) {
  if (std::any_of(f.out.begin(), f.out.end(), [](const ErrorSignature& g) { return g.kind == "shift"; })) return;
  // Heads in another order.
  if (std::optional<Heads> h = heads_of(f.cn.site, c.shape, cfg); h && h->H > 1) {
    auto block = [&](const TensorData& t, int64_t head) {
      std::vector<float> b;
      b.reserve(size_t(h->outer * h->inner));
      for (int64_t o = 0; o < h->outer; ++o) {
        const float* p = t.f.data() + h->at(o, head, 0);
        b.insert(b.end(), p, p + h->inner);
      }
      return b;
    };
    std::vector<int64_t> p = block_permutation(f, h->H, block, c, r);
    if (!p.empty()) {
      f.add_decisive("permutation", "heads in another order: head h holds the reference's head p[h], " +
                                        permutation_class(p));
      return;
    }
    // Each head's dims in another order.
    const int64_t Dh = h->dims;
    const bool mla = cfg && cfg->mla.enabled;
    // MLA rotates the last Dr dims of a q/k head only (its RoPE outputs in
    // halves order); its other heads (values, context) have no RoPE pairs.
    const bool mla_rope = mla && Dh == cfg->mla.qk_head_dim() &&
                          (f.cn.site == "attn.q_rope" || f.cn.site == "attn.k_rope" || f.cn.site == "attn.k_cache");
    if (dims_permutation(f, c, r, Dh, mla ? (mla_rope ? cfg->mla.qk_rope_head_dim : 0) : Dh, "each head")) return;
  } else if (cfg && cfg->mla.enabled && (f.cn.site == "attn.k_pe" || f.cn.site == "attn.k_pe_cache") &&
             c.shape.size() == 2 && c.shape[1] == cfg->mla.qk_rope_head_dim) {
    // MLA's shared rope part [T, Dr]: all of it rotated.
    if (dims_permutation(f, c, r, c.shape[1], c.shape[1], f.cn.site.substr(5))) return;
  }
  // Rows (positions) in another order.
  const bool rows3 = c.shape.size() == 3;
  if (c.shape.size() == 2 || rows3) {
    const int64_t H = rows3 ? c.shape[0] : 1, T = rows3 ? c.shape[1] : c.shape[0], X = c.shape.back();
    if (T < 2) return;
    auto row = [&](const TensorData& t, int64_t at) {
      std::vector<float> b;
      b.reserve(size_t(H * X));
      for (int64_t h = 0; h < H; ++h) {
        const float* p = t.f.data() + (h * T + at) * X;
        b.insert(b.end(), p, p + X);
      }
      return b;
    };
    std::vector<int64_t> p = block_permutation(f, T, row, c, r);
    if (!p.empty())
      f.add_decisive("permutation", "rows (positions) in another order: row t holds the reference's row p[t], " +
                                        permutation_class(p));
  }
}

void find_partial_dims(Found& f, const TensorData& c, const TensorData& r, const std::optional<ModelConfig>& cfg) {
  const std::optional<Heads> h = heads_of(f.cn.site, c.shape, cfg);
  if (!h || h->dims < 2) return;
  const int64_t Dh = h->dims, n = int64_t(c.f.size());
  std::vector<double> e(static_cast<size_t>(Dh), 0.0), s(static_cast<size_t>(Dh), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const double d = double(c.f[size_t(i)]) - r.f[size_t(i)];
    e[size_t(i % Dh)] += d * d;
    s[size_t(i % Dh)] += double(r.f[size_t(i)]) * r.f[size_t(i)];
  }
  std::vector<int64_t> wrong;
  for (int64_t d = 0; d < Dh; ++d)
    if (std::sqrt(e[size_t(d)]) > f.tol * std::max(std::sqrt(s[size_t(d)]), 1e-30)) wrong.push_back(d);
  if (wrong.empty() || int64_t(wrong.size()) == Dh) return;
  std::string which;
  if (int64_t(wrong.size()) == Dh / 2 && wrong.front() == Dh / 2 && wrong.back() == Dh - 1) which = " (the second half)";
  if (int64_t(wrong.size()) == Dh / 2 && wrong.front() == 0 && wrong.back() == Dh / 2 - 1) which = " (the first half)";
  f.add("partial", std::to_string(wrong.size()) + " of " + std::to_string(Dh) + " dims of every head wrong: " +
                       ranges(wrong) + which + "; the others match the reference",
        f.err);
}

void find_mask(Found& f, const TensorData& c, const TensorData& r) {
  const size_t rank = c.shape.size();
  if (rank != 2 && rank != 3) return;
  const int64_t H = rank == 3 ? c.shape[0] : 1, T = c.shape[rank - 2], S = c.shape[rank - 1];
  // allowed[t*S+s]: some head has a nonzero value there.
  auto allowed = [&](const TensorData& t) {
    std::vector<char> a(size_t(T * S), 0);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T * S; ++i)
        if (t.f[size_t(h * T * S + i)] != 0.0f) a[size_t(i)] = 1;
    return a;
  };
  const std::vector<char> ac = allowed(c), ar = allowed(r);
  if (ac == ar) return;  // the same cells: the values differ, not the mask
  struct Band {
    int64_t lo = 0, hi = -1;  // allowed keys [lo, hi]
    bool interval = true;
  };
  auto bands = [&](const std::vector<char>& a) {
    std::vector<Band> out(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      Band& b = out[size_t(t)];
      int64_t count = 0;
      b.lo = S;
      for (int64_t s = 0; s < S; ++s)
        if (a[size_t(t * S + s)]) {
          b.lo = std::min(b.lo, s);
          b.hi = s;
          ++count;
        }
      b.interval = count == 0 || count == b.hi - b.lo + 1;
    }
    return out;
  };
  const std::vector<Band> bc = bands(ac), br = bands(ar);
  int64_t differ = 0, first = -1;
  for (int64_t i = 0; i < T * S; ++i)
    if (ac[size_t(i)] != ar[size_t(i)]) {
      ++differ;
      if (first < 0) first = i / S;
    }
  const std::string cells = std::to_string(differ) + " of " + std::to_string(T * S) + " (query, key) cells differ";
  if (std::all_of(ac.begin(), ac.end(), [](char x) { return x != 0; })) {
    f.add_decisive("mask", "every key allowed for every query (no mask), where the reference masks " +
                               std::to_string(differ) + " cells");
    return;
  }
  bool clean = true, dlo_const = true, dhi_const = true;
  int64_t dlo = 0, dhi = 0, rows = 0;
  for (int64_t t = 0; t < T && clean; ++t) {
    const Band &x = bc[size_t(t)], &y = br[size_t(t)];
    clean = x.interval && y.interval && x.hi >= x.lo && y.hi >= y.lo;
    if (!clean) break;
    if (rows++ == 0) {
      dlo = x.lo - y.lo;
      dhi = x.hi - y.hi;
    }
    dlo_const = dlo_const && x.lo - y.lo == dlo;
    dhi_const = dhi_const && x.hi - y.hi == dhi;
  }
  auto width = [&](const std::vector<Band>& b, bool* limited) {  // widest band; limited: some row starts after key 0
    int64_t w = 0;
    *limited = false;
    for (const Band& x : b) {
      w = std::max(w, x.hi - x.lo + 1);
      *limited = *limited || x.lo > 0;
    }
    return w;
  };
  if (clean && dhi_const && dhi != 0 && dlo_const && dlo == 0) {
    std::string what = dhi == -1  ? ": the diagonal is masked (a query does not see its own key)"
                       : dhi > 0 ? ": " + std::to_string(dhi) + " future key" + (dhi == 1 ? "" : "s") + " visible"
                                 : ": the newest " + std::to_string(-dhi) + " keys hidden";
    f.add_decisive("mask", "the causal boundary is offset by " + std::string(dhi > 0 ? "+" : "") +
                               std::to_string(dhi) + " (query t sees keys up to " +
                               (dhi > 0 ? "its position + " + std::to_string(dhi) : "its position - " + std::to_string(-dhi)) +
                               ")" + what + "; " + cells);
    return;
  }
  if (clean && dhi_const && dhi == 0) {
    bool lc = false, lr = false;
    const int64_t wc = width(bc, &lc), wr = width(br, &lr);
    std::string d = "the window differs: the candidate attends to " +
                    (lc ? "the last " + std::to_string(wc) + " keys (a sliding window of " + std::to_string(wc) + ")"
                        : std::string("every earlier key")) +
                    ", the reference to " +
                    (lr ? "the last " + std::to_string(wr) + " keys (a window of " + std::to_string(wr) + ")"
                        : std::string("every earlier key"));
    if (lc && lr) d += ", off by " + std::string(wc > wr ? "+" : "") + std::to_string(wc - wr);
    f.add_decisive("mask", d + "; " + cells);
    return;
  }
  if (clean && dhi_const && dlo_const) {
    f.add_decisive("mask", "the allowed band is shifted by " + std::to_string(dhi) + " keys; " + cells);
    return;
  }
  std::string d = cells + ", first at query " + std::to_string(first);
  if (S <= 64) {
    std::string rc, rr;
    for (int64_t s = 0; s < S; ++s) {
      rc += ac[size_t(first * S + s)] ? '1' : '0';
      rr += ar[size_t(first * S + s)] ? '1' : '0';
    }
    d += " (allowed keys: candidate " + rc + ", reference " + rr + ")";
  }
  ErrorSignature g;
  g.name = f.name;
  g.kind = "mask";
  g.detail = d;
  f.out.push_back(g);
}

void find_elementwise(Found& f, const TensorData& c, const TensorData& r, const TensorSource& cand) {
  const int64_t n = int64_t(c.f.size());
  std::vector<float> y(c.f.size());
  auto fits = [&](const std::function<double(double)>& fn, const TensorData& x) {
    for (int64_t i = 0; i < n; ++i) y[size_t(i)] = float(fn(double(x.f[size_t(i)])));
    return f.close(c.f.data(), y.data(), n);
  };
  // mlp.act from the candidate's own gate and up.
  if (f.cn.site == "mlp.act" && f.cn.kind == CanonName::Kind::Layer) {
    const std::string prefix = f.name.substr(0, f.name.size() - std::string("act").size());
    if (cand.has(prefix + "gate") && cand.has(prefix + "up")) {
      const TensorData g = cand.get(prefix + "gate"), u = cand.get(prefix + "up");
      if (!g.is_int && !u.is_int && g.shape == c.shape && u.shape == c.shape) {
        const double kPi = 3.14159265358979323846;
        const std::vector<std::pair<std::string, std::function<double(double)>>> acts = {
            {"silu", [](double x) { return x / (1 + std::exp(-x)); }},
            {"gelu", [](double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }},
            {"gelu_tanh",
             [&](double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / kPi) * (x + 0.044715 * x * x * x))); }},
            {"relu", [](double x) { return x > 0 ? x : 0; }},
            {"sigmoid", [](double x) { return 1 / (1 + std::exp(-x)); }},
            {"tanh", [](double x) { return std::tanh(x); }},
            {"identity", [](double x) { return x; }}};
        auto left = [&](const std::function<double(double)>& fn, bool times_up) {
          for (int64_t i = 0; i < n; ++i)
            y[size_t(i)] = float(fn(double(g.f[size_t(i)])) * (times_up ? double(u.f[size_t(i)]) : 1.0));
          return f.close(c.f.data(), y.data(), n) ? rmse(c.f.data(), y.data(), n) : INFINITY;
        };
        // The closest function within the candidate's rounding (gelu and
        // its tanh form differ by less than bfloat16's).
        size_t best = 0;
        double best_left = INFINITY;
        for (size_t a = 0; a < acts.size(); ++a)
          if (const double l = left(acts[a].second, true); l < best_left) {
            best = a;
            best_left = l;
          }
        if (best == 0 && std::isfinite(best_left)) return;  // silu(gate) * up: the op is right
        if (std::isfinite(best_left)) {
          f.add_recomputed("elementwise", "mlp.act = " + acts[best].first + "(gate) * up from the candidate's own gate "
                                        "and up, where the model's activation is silu: another activation function");
          return;
        }
        if (std::isfinite(left(acts[0].second, false))) {
          f.add_recomputed("elementwise", "mlp.act = silu(gate) from the candidate's own gate: the product with up is "
                                        "missing");
          return;
        }
      }
    }
  }
  // candidate = f(reference).
  double mc = 0, mr = 0;
  for (int64_t i = 0; i < n; ++i) {
    mc = std::max(mc, double(std::fabs(c.f[size_t(i)])));
    mr = std::max(mr, double(std::fabs(r.f[size_t(i)])));
  }
  if (fits([](double x) { return x > 0 ? x : 0; }, r)) {
    f.add_decisive("elementwise", "candidate = relu(reference): the negative values are zeroed");
    return;
  }
  if (fits([](double x) { return std::fabs(x); }, r)) {
    f.add_decisive("elementwise", "candidate = |reference|: the signs are lost");
    return;
  }
  if (mc <= 0 || mc >= mr) return;
  if (fits([&](double x) { return std::clamp(x, -mc, mc); }, r)) {
    f.add_decisive("elementwise", "candidate = clamp(reference, -" + num(mc) + ", " + num(mc) + "): values beyond " +
                                      num(mc) + " are clipped");
    return;
  }
  // tanh soft-capping c * tanh(x / c): the cap fitted on a log scale, on at
  // most 65536 evenly spread values (a real vocabulary's logits are
  // millions), then judged on all of them.
  auto left = [&](double cap, int64_t stride) {
    double s = 0;
    int64_t m = 0;
    for (int64_t i = 0; i < n; i += stride, ++m) {
      const double d = double(c.f[size_t(i)]) - cap * std::tanh(double(r.f[size_t(i)]) / cap);
      s += d * d;
    }
    return std::sqrt(s / double(std::max<int64_t>(m, 1)));
  };
  const int64_t stride = std::max<int64_t>(1, n / 65536);
  double lo = std::log(mc), hi = std::log(std::max(mc, mr) * 1e3);
  const double phi = (std::sqrt(5.0) - 1) / 2;
  for (int it = 0; it < 64; ++it) {
    const double a = hi - phi * (hi - lo), b = lo + phi * (hi - lo);
    if (left(std::exp(a), stride) < left(std::exp(b), stride))
      hi = b;
    else
      lo = a;
  }
  const double cap = std::exp((lo + hi) / 2), l = left(cap, 1);
  if (l < kFits * f.err)
    f.add("elementwise", "candidate = " + num(cap) + " * tanh(reference / " + num(cap) + "): soft-capped at " +
                             num(cap) + " (rmse after " + num(l) + ", before " + num(f.err) + ")",
          l);
}

void find_changed_projection(Found& f, const TensorData& c, const TensorSource& cand, const LocalOracle& oracle) {
  if (c.shape.size() != 2 || c.is_int) return;
  // The first rows suffice to tell: a logits product is V x D per row.
  constexpr int64_t kRows = 16;
  struct Change {
    ProjectionChange change;
    const char* kind;
    std::string words;
  };
  const Change changes[] = {
      {ProjectionChange::TransposedWeight, "transposed-weight",
       "the weight matrix transposed (its [out, in] data read as [in, out]: x W where HF computes x W^T"},
      {ProjectionChange::NormSkipped, "alias",
       "the RMSNorm before it skipped (the projection applied to the norm's input instead of its output"},
  };
  for (const Change& ch : changes) {
    const std::optional<std::vector<float>> p = oracle.changed_projection(cand, f.name, ch.change, kRows);
    if (!p || p->empty() || p->size() > c.f.size()) continue;
    const int64_t n = int64_t(p->size());
    const double e = rmse(c.f.data(), p->data(), n), s = rms(p->data(), n);
    // Within 16-bit rounding of the product, and far closer than the reference.
    if (e > 2e-2 * std::max(s, 1e-30) || e > kFits * f.err) continue;
    ErrorSignature g;
    g.name = f.name;
    g.kind = ch.kind;
    g.detail = "equals the projection recomputed from the candidate's own values with " + ch.words + "; rmse " +
               num(e) + " over its first " + std::to_string(n / c.shape[1]) + " rows, error before " + num(f.err) + ")";
    g.fit = e / f.err;
    g.decisive = true;
    g.recomputed = true;
    f.out.push_back(g);
    return;
  }
}

namespace {

// The 16-bit types of the precision finders below (None: no rounding).
enum class Type16 { None, BFloat16, Float16 };

float round16(float x, Type16 t) {
  return t == Type16::BFloat16 ? bf16_to_f32(f32_to_bf16(x)) : t == Type16::Float16 ? f16_to_f32(f32_to_f16(x)) : x;
}

const char* type16_name(Type16 t) { return t == Type16::BFloat16 ? "bfloat16" : "float16"; }

// The 16-bit dtype the candidate declares (None: float32 or float64).
Type16 declared16(const TensorSource& cand) {
  const std::string& d = cand.manifest().dtype;
  return d == "bfloat16" ? Type16::BFloat16 : d == "float16" ? Type16::Float16 : Type16::None;
}

// The rmse left by an op's recomputed values `h` against the candidate,
// stored in float32 or in the candidate's declared 16-bit type `stored`,
// whichever is closer (an engine declaring bfloat16 for its matmuls may keep
// other values, RoPE's table, a softmax, in float32).
double stored_rmse(const TensorData& c, std::vector<float> h, Type16 stored) {
  const int64_t n = int64_t(c.f.size());
  double e = rmse(c.f.data(), h.data(), n);
  if (stored != Type16::None) {
    for (float& x : h) x = round16(x, stored);
    e = std::min(e, rmse(c.f.data(), h.data(), n));
  }
  return e;
}

}  // namespace

void find_rope_angle_precision(Found& f, const TensorData& c, const TensorData& r, const TensorSource& cand,
                               const TensorSource& ref) {
  const bool is_cos = f.cn.site == "rope.cos";
  if (!is_cos && f.cn.site != "rope.sin") return;
  const std::string inv_name = "rope.inv_freq", pos_name = step_name(f.cn.step, "positions");
  const TensorSource* pos_src = cand.has(pos_name) ? &cand : ref.has(pos_name) ? &ref : nullptr;
  if (!ref.has(inv_name) || !pos_src || c.shape.size() != 2) return;
  const TensorData inv = ref.get(inv_name), pos = pos_src->get(pos_name);
  const int64_t T = c.shape[0], D = c.shape[1], half = int64_t(inv.f.size());
  if (inv.is_int || half == 0 || D != 2 * half || int64_t(pos.numel()) != T) return;
  const std::vector<float> p = pos.floats();
  // HF's table: emb = cat(freqs, freqs), freqs[t, i] = positions[t] x inv_freq[i]
  // in float32, cos/sin times the rope's attention scaling (fitted below);
  // variant 1: the angles rounded to `t16`, 2: inv_freq rounded to `t16`.
  auto table = [&](int variant, Type16 t16) {
    std::vector<float> v(size_t(T * D));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < D; ++i) {
        const float fr = inv.f[size_t(i % half)];
        float a = p[size_t(t)] * (variant == 2 ? round16(fr, t16) : fr);
        if (variant == 1) a = round16(a, t16);
        v[size_t(t * D + i)] = is_cos ? std::cos(a) : std::sin(a);
      }
    return v;
  };
  const Type16 stored = declared16(cand);
  const std::vector<float> exact = table(0, Type16::None);
  const int64_t n = T * D;
  double num_s = 0, den_s = 0;
  for (int64_t k = 0; k < n; ++k) num_s += double(r.f[size_t(k)]) * exact[size_t(k)], den_s += double(exact[size_t(k)]) * exact[size_t(k)];
  const double scaling = den_s > 0 ? num_s / den_s : 1.0;
  auto left = [&](int variant, Type16 t16) {
    std::vector<float> h = table(variant, t16);
    for (float& x : h) x = float(double(x) * scaling);
    return stored_rmse(c, std::move(h), stored);
  };
  struct Try {
    int variant;
    Type16 type;
    double rmse = 0;
  };
  std::optional<Try> best;
  for (int variant : {1, 2})
    for (Type16 t16 : {Type16::BFloat16, Type16::Float16})
      if (const double e = left(variant, t16); !best || e < best->rmse) best = Try{variant, t16, e};
  // The 16-bit table must also fit far better than the exact one at the
  // candidate's own positions (a table exact for positions that differ from
  // the reference's is no rounding).
  if (!best || !(best->rmse <= 0.1 * f.err) || !(best->rmse < 0.1 * left(0, Type16::None))) return;
  // How the error grows with position: the row rmse at the first and the last row.
  auto row_err = [&](int64_t t) { return rmse(c.f.data() + t * D, r.f.data() + t * D, D); };
  const char* type = type16_name(best->type);
  const std::string what = best->variant == 1 ? std::string("the angles position x inv_freq rounded to ") + type
                                              : std::string("inv_freq rounded to ") + type;
  f.add_recomputed("precision", std::string(is_cos ? "cos" : "sin") + " of " + what + " reproduces the candidate (rmse " +
                                  num(best->rmse) + " against that, " + num(f.err) +
                                  " against the reference): RoPE computed in 16 bits, an error growing with position "
                                  "(row rmse " + num(row_err(0)) + " at position " + num(p[0]) + ", " +
                                  num(row_err(T - 1)) + " at position " + num(p[size_t(T - 1)]) + ")");
}

namespace {

// The candidate's own tensor `name` as [T, D] floats (empty when it lacks it
// or its shape is another).
std::vector<float> own_rows(const TensorSource& cand, const std::string& name, const Shape& shape) {
  if (!cand.has(name)) return {};
  const TensorData t = cand.get(name);
  if (t.is_int || t.shape != shape) return {};
  return t.f;
}

// a + b elementwise in float32, as the residual adds (empty when either is).
std::vector<float> summed(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.empty() || b.empty() || a.size() != b.size()) return {};
  std::vector<float> out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = a[i] + b[i];
  return out;
}

}  // namespace

void find_norm_variant(Found& f, const TensorData& c, const TensorData& r, const TensorSource& cand,
                       const TensorSource& ref, const std::optional<ModelConfig>& cfg) {
  const CanonName& cn = f.cn;
  std::string input;  // the norm's input (HF's residual stream at that point)
  if (cn.site == "attn_norm" && cn.kind == CanonName::Kind::Layer)
    input = layer_input_name(cn.step, cn.layer);
  else if (cn.site == "mlp_norm" && cn.kind == CanonName::Kind::Layer)
    input = layer_name(cn.step, cn.layer, "attn_residual");
  else if (cn.site == "final_norm" && cfg && cfg->num_hidden_layers > 0)
    input = layer_name(cn.step, int(cfg->num_hidden_layers) - 1, "out");
  if (input.empty() || c.shape.size() != 2 || c.is_int || r.shape != c.shape) return;
  const int64_t T = c.shape[0], D = c.shape[1];
  // mlp_norm's input is the layer's input plus the attention's output: an
  // engine recorded at module boundaries holds those two, not their sum (and
  // the reference records what the candidate holds).
  const bool mlp = cn.site == "mlp_norm";
  const std::string layer_in = mlp ? layer_input_name(cn.step, cn.layer) : "";
  const std::string attn_out = mlp ? layer_name(cn.step, cn.layer, "attn.out") : "";
  std::vector<float> xr = own_rows(ref, input, c.shape);  // the reference's, for its weight
  if (xr.empty() && mlp) xr = summed(own_rows(ref, layer_in, c.shape), own_rows(ref, attn_out, c.shape));
  if (xr.empty()) return;
  // The candidate's own layer input and attention output (mlp_norm), read
  // once: HF's input of the norm when it holds no attn_residual, and the
  // wirings tried below.
  const std::vector<float> x_in = mlp ? own_rows(cand, layer_in, c.shape) : std::vector<float>{},
                           a = mlp ? own_rows(cand, attn_out, c.shape) : std::vector<float>{};
  std::vector<float> xc = own_rows(cand, input, c.shape);  // HF's input, the candidate's values
  if (xc.empty() && mlp) xc = summed(x_in, a);
  const double eps = cfg ? cfg->rms_norm_eps : 1e-6;
  auto inv_rms = [&](const float* x) {
    double ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += double(x[j]) * x[j];
    return 1.0 / std::sqrt(ss / double(D) + eps);
  };
  // The weight, per channel, from the reference's own input and output (the
  // row where the normalised input is largest).
  std::vector<double> w(size_t(D), 0.0), best(size_t(D), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const double k = inv_rms(xr.data() + t * D);
    for (int64_t j = 0; j < D; ++j) {
      const double xn = double(xr[size_t(t * D + j)]) * k;
      if (std::fabs(xn) > best[size_t(j)]) best[size_t(j)] = std::fabs(xn), w[size_t(j)] = r.f[size_t(t * D + j)] / xn;
    }
  }
  // One change of HF's LlamaRMSNorm (weight * x * rsqrt(mean(x^2) + eps)).
  enum class Norm { Hf, OnePlusWeight, NoWeight, MeanSubtracted, EpsOutsideSqrt, WeightFirst };
  // The rmse left by the norm of `in`, rounded to `t16`, with the change.
  auto left = [&](const std::vector<float>& in, Type16 t16, Norm v, double norm_eps) {
    std::vector<float> x(in), h(size_t(T * D));
    for (float& e : x) e = round16(e, t16);
    for (int64_t t = 0; t < T; ++t) {
      const float* row = x.data() + t * D;
      std::vector<double> y(row, row + D);
      if (v == Norm::WeightFirst)
        for (int64_t j = 0; j < D; ++j) y[size_t(j)] *= w[size_t(j)];
      if (v == Norm::MeanSubtracted) {
        double mean = 0;
        for (double e : y) mean += e;
        mean /= double(D);
        for (double& e : y) e -= mean;
      }
      double ss = 0;
      for (double e : y) ss += e * e;
      const double k = v == Norm::EpsOutsideSqrt ? 1.0 / (std::sqrt(ss / double(D)) + norm_eps)
                                                 : 1.0 / std::sqrt(ss / double(D) + norm_eps);
      for (int64_t j = 0; j < D; ++j) {
        const double g = v == Norm::OnePlusWeight ? 1.0 + w[size_t(j)]
                         : v == Norm::NoWeight || v == Norm::WeightFirst ? 1.0
                                                                          : w[size_t(j)];
        h[size_t(t * D + j)] = float(g * (y[size_t(j)] * k));
      }
    }
    return stored_rmse(c, std::move(h), declared16(cand));
  };
  // Each claim must fit far better than HF's norm of the candidate's own
  // input (a norm right on an input that diverges upstream is no change of
  // the norm).
  const double exact = xc.empty() ? std::numeric_limits<double>::infinity() : left(xc, Type16::None, Norm::Hf, eps);
  auto fits = [&](double e) { return e <= 0.1 * f.err && e < 0.1 * exact; };
  auto numbers = [&](double e) {
    return "(rmse " + num(e) + " against that, " + num(f.err) + " against the reference" +
           (xc.empty() ? std::string() : "; HF's norm of the candidate's own input: " + num(exact)) + ")";
  };
  // The input rounded to 16 bits before the norm.
  if (!xc.empty()) {
    struct Try {
      Type16 type;
      double rmse;
    };
    std::optional<Try> found;
    for (Type16 t16 : {Type16::BFloat16, Type16::Float16})
      if (const double e = left(xc, t16, Norm::Hf, eps); !found || e < found->rmse) found = Try{t16, e};
    if (found && fits(found->rmse)) {
      f.add_recomputed("precision", std::string("the norm's input ") + input + " rounded to " +
                                      type16_name(found->type) + " before the norm reproduces the candidate "
                                      "(rmse " + num(found->rmse) + " against that, " + num(f.err) +
                                      " against the reference): the residual stream cast to 16 bits for the norm");
      return;
    }
  }
  // mlp_norm of another input than the residual stream after attention: the
  // residual connection wired wrong.
  if (mlp) {
    const std::string attn_norm = layer_name(cn.step, cn.layer, "attn_norm"),
                      ctx = layer_name(cn.step, cn.layer, "attn.ctx");
    struct Wiring {
      std::vector<float> in;
      std::string what, why;
    };
    const Wiring wirings[] = {
        {a, attn_out + " alone", "the attention block's residual connection is missing"},
        {summed(own_rows(cand, attn_norm, c.shape), a), attn_norm + " + " + attn_out,
         "the residual added to the normed input instead of the layer's input " + layer_in},
        {x_in, layer_in + " alone", "the attention block's output is not added"},
        {summed(x_in, own_rows(cand, ctx, c.shape)), layer_in + " + " + ctx,
         "o_proj skipped, the attention's context added as it is"},
    };
    const Wiring* hit = nullptr;
    double hit_rmse = 0;
    for (const Wiring& v : wirings) {
      if (v.in.empty()) continue;
      if (const double e = left(v.in, Type16::None, Norm::Hf, eps); fits(e) && (!hit || e < hit_rmse)) hit = &v, hit_rmse = e;
    }
    if (hit) {
      f.add_recomputed("alias", "HF's RMSNorm of the candidate's own " + hit->what + " reproduces the candidate " +
                                  numbers(hit_rmse) + ": " + hit->why);
      return;
    }
  }
  if (xc.empty()) return;
  // Another norm formula on the candidate's own input.
  struct Variant {
    Norm v;
    const char* words;
  };
  const Variant variants[] = {
      {Norm::OnePlusWeight, "the weight is applied as (1 + weight) (Gemma's RMSNorm)"},
      {Norm::NoWeight, "the weight is not applied"},
      {Norm::MeanSubtracted, "the mean is subtracted first (a LayerNorm, not an RMSNorm)"},
      {Norm::EpsOutsideSqrt, "eps is added after the square root: x / (sqrt(mean(x^2)) + eps)"},
      {Norm::WeightFirst, "the weight is applied before the normalisation, not after"},
  };
  // A weight the same in every channel (a checkpoint's initial ones) makes
  // the three forms that move it a global scale: those are the scale
  // finder's, not told apart here.
  const auto [w_lo, w_hi] = std::minmax_element(w.begin(), w.end());
  const bool weight_varies = *w_hi - *w_lo > 1e-3 * std::max(std::fabs(*w_lo), std::fabs(*w_hi));
  const Variant* hit = nullptr;
  double hit_rmse = 0;
  for (const Variant& v : variants) {
    if (!weight_varies && v.v != Norm::MeanSubtracted && v.v != Norm::EpsOutsideSqrt) continue;
    if (const double e = left(xc, Type16::None, v.v, eps); fits(e) && (!hit || e < hit_rmse)) hit = &v, hit_rmse = e;
  }
  if (hit) {
    f.add_recomputed("norm", std::string("HF's RMSNorm of the candidate's own input ") + input + ", changed so that " +
                                 hit->words + ", reproduces the candidate " + numbers(hit_rmse));
    return;
  }
  // Another eps, fitted: the eps whose norm of the candidate's own input
  // leaves the least rmse (golden-section search on log eps over twelve
  // decades around the config's). The norm of the input scaled by c is the
  // norm with eps / c^2: an engine that scales its embeddings (Gemma's
  // sqrt(D)) shows it at layer 0's attn_norm.
  const double eps2 = std::exp(golden_section_min(
      [&](double log_eps) { return left(xc, Type16::None, Norm::Hf, std::exp(log_eps)); },
      std::log(eps) - 6 * std::log(10.0), std::log(eps) + 6 * std::log(10.0), 60));
  if (std::fabs(eps2 / eps - 1.0) < 0.1) return;
  const double e = left(xc, Type16::None, Norm::Hf, eps2);
  if (!fits(e)) return;
  const double c_in = std::sqrt(eps / eps2);
  // The fitted eps is as precise as eps's share of the norm allows: the
  // factor is named when it is within 10% of a known form.
  const std::string form = recognise_factor(c_in, cfg, 0.1);
  std::string factor = num(c_in);
  if (!form.empty()) {
    factor += " (close to " + form + (form == "sqrt(D)" ? ", Gemma's embedding normaliser" : "") + ")";
  }
  f.add_recomputed("norm", "HF's RMSNorm of the candidate's own input " + input + " with eps = " + num(eps2) +
                               " where the config says " + num(eps) + " reproduces the candidate " + numbers(e) +
                               ": the norm's eps, or its input scaled by " + factor + " before the norm (eps / c^2)");
}

void find_softmax_precision(Found& f, const TensorData& c, const TensorSource& cand, const TensorSource& ref) {
  const CanonName& cn = f.cn;
  if (cn.site != "attn.probs" || cn.kind != CanonName::Kind::Layer || c.shape.size() != 3) return;
  const std::string scores_name = layer_name(cn.step, cn.layer, "attn.scores"), mask_name = step_name(cn.step, "mask");
  const TensorSource* mask_src = cand.has(mask_name) ? &cand : ref.has(mask_name) ? &ref : nullptr;
  if (!cand.has(scores_name) || !mask_src) return;
  const TensorData sc = cand.get(scores_name), mk = mask_src->get(mask_name);
  const int64_t H = c.shape[0], T = c.shape[1], S = c.shape[2];
  if (sc.shape != c.shape || mk.shape != Shape{T, S} || sc.is_int) return;
  const std::vector<float> mask = mk.floats();
  enum Variant { Input, InputOutput, Whole };
  // In `type` (None: the softmax itself, in float32).
  auto softmax = [&](Variant v, Type16 type) {
    std::vector<float> out(size_t(H * T * S), 0.0f);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const float* x = sc.f.data() + (h * T + t) * S;
        float* y = out.data() + (h * T + t) * S;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < S; ++s)
          if (mask[size_t(t * S + s)] != 0.0f) m = std::max(m, round16(x[s], type));
        float sum = 0;
        for (int64_t s = 0; s < S; ++s) {
          if (mask[size_t(t * S + s)] == 0.0f) continue;
          float e = std::exp(round16(x[s], type) - m);
          if (v == Whole) e = round16(e, type);
          y[s] = e;
          sum = v == Whole ? round16(sum + e, type) : sum + e;
        }
        for (int64_t s = 0; s < S; ++s) {
          const float p = y[s] / sum;
          y[s] = v == Input ? p : round16(p, type);
        }
      }
    return out;
  };
  const Type16 stored = declared16(cand);
  auto left = [&](Variant v, Type16 type) { return stored_rmse(c, softmax(v, type), stored); };
  struct Try {
    Variant v;
    Type16 type;
    double rmse;
  };
  std::optional<Try> best;
  for (Variant v : {Input, InputOutput, Whole})
    for (Type16 t16 : {Type16::Float16, Type16::BFloat16})
      if (const double e = left(v, t16); !best || e < best->rmse - 1e-12) best = Try{v, t16, e};
  // ... and far better than the softmax itself (a softmax right on scores
  // that diverge upstream, or rows of one allowed key, is no rounding).
  if (!best || !(best->rmse <= 0.1 * f.err) || !(best->rmse < 0.1 * left(Input, Type16::None))) return;
  const std::string type = type16_name(best->type);
  const std::string what = best->v == Input         ? "its scores rounded to " + type + " before it"
                           : best->v == InputOutput ? "its scores and its output rounded to " + type
                                                    : "every step of it (the scores, exp, the running sum, the "
                                                      "division) in " + type;
  f.add_recomputed("precision", "the softmax of the candidate's own scores with " + what +
                                  " reproduces the candidate (rmse " + num(best->rmse) + " against that, " +
                                  num(f.err) + " against the reference): a softmax computed in 16 bits");
}

namespace {

const char* pairing_words(Pairing p) {
  switch (p) {
    case Pairing::Halves: return "pairs (i, i+R/2)";
    case Pairing::Interleaved: return "pairs (2i, 2i+1) in place";
    case Pairing::PairsToHalves: return "pairs (2i, 2i+1) rotated into halves order";
  }
  return "";
}

// One RoPE output site and what it is computed from, in the output's layout:
// rows of `width` values (a head's [T] rows for [H, T, Dw], a [T, Dr] k_pe),
// row r at position index r % T; the RoPE of the reference rotates
// [start, start + rotated) of each row.
struct RopeSite {
  std::vector<float> input;  // the pre-rope values, laid out as the output
  int64_t width = 0, T = 0;
  int64_t start = 0, rotated = 0;  // the reference's rotated part
  Pairing pairing = Pairing::Halves;
  bool mla = false, shared = false;  // MLA's rope dims; k_pe (one rope part for every head)
};

// The pre-rope values of a RoPE output site (the candidate's own, else the
// reference's): attn.q / attn.k (Qwen3: attn.q_norm / attn.k_norm) for
// attn.q_rope / attn.k_rope; on MLA the last Dr dims of attn.q's heads for
// attn.q_rope and attn.kv_a's last Dr for attn.k_pe.
std::optional<RopeSite> rope_site(const Found& f, const TensorData& c, const TensorSource& cand, const TensorSource& ref,
                                  const ModelConfig& cfg) {
  const CanonName& cn = f.cn;
  if (cn.kind != CanonName::Kind::Layer || !c.rows.empty()) return std::nullopt;
  const bool mla = cfg.mla.enabled;
  const bool q = cn.site == "attn.q_rope", k = cn.site == (mla ? "attn.k_pe" : "attn.k_rope");
  if (!q && !k) return std::nullopt;
  std::string src = q ? "attn.q" : mla ? "attn.kv_a" : "attn.k";
  if (!mla && cfg.qk_norm) src = q ? "attn.q_norm" : "attn.k_norm";
  const std::string in_name = layer_name(cn.step, cn.layer, src);
  const TensorSource* from = cand.has(in_name) ? &cand : ref.has(in_name) ? &ref : nullptr;
  if (!from) return std::nullopt;
  const TensorData x = from->get(in_name);
  if (x.is_int || !x.rows.empty() || x.shape.size() != 2) return std::nullopt;
  RopeSite s;
  s.mla = mla;
  s.pairing = mla && cfg.mla.rope_interleave ? Pairing::PairsToHalves : Pairing::Halves;
  const int64_t Dr = cfg.mla.qk_rope_head_dim;
  if (mla && k) {  // x [T, Rkv+Dr] -> [T, Dr]
    const int64_t T = x.shape[0], Rkv = x.shape[1] - Dr;
    if (c.shape != Shape{T, Dr} || Rkv < 0) return std::nullopt;
    s.width = s.rotated = Dr;
    s.T = T;
    s.shared = true;
    s.input.resize(size_t(T * Dr));
    for (int64_t t = 0; t < T; ++t)
      std::copy_n(x.f.begin() + t * (Rkv + Dr) + Rkv, Dr, s.input.begin() + t * Dr);
    return s;
  }
  // x [T, H*Dw] -> [H, T, Dw]
  if (c.shape.size() != 3) return std::nullopt;
  const int64_t H = c.shape[0], T = c.shape[1], Dw = c.shape[2];
  if (x.shape != Shape{T, H * Dw}) return std::nullopt;
  s.width = Dw;
  s.T = T;
  s.rotated = mla ? Dr : Dw;
  s.start = Dw - s.rotated;
  if (s.rotated <= 0 || s.start < 0) return std::nullopt;
  s.input.resize(size_t(H * T * Dw));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t)
      std::copy_n(x.f.begin() + (t * H + h) * Dw, Dw, s.input.begin() + (h * T + t) * Dw);
  return s;
}

// The input with [start, start + R) of every row rotated at the angles
// position x inv[i] (i < R/2), cos and sin times `scaling`, in float32 as HF.
std::vector<float> rotate_part(const RopeSite& s, const std::vector<float>& pos, const std::vector<float>& inv,
                               double scaling, int64_t start, int64_t R, Pairing pairing) {
  const int64_t half = R / 2;
  std::vector<float> cs(size_t(s.T * half)), sn(size_t(s.T * half));  // [T, R/2]
  for (int64_t t = 0; t < s.T; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const float a = pos[size_t(t)] * inv[size_t(i)];
      cs[size_t(t * half + i)] = float(double(std::cos(a)) * scaling);
      sn[size_t(t * half + i)] = float(double(std::sin(a)) * scaling);
    }
  std::vector<float> y(s.input);
  const int64_t rows = int64_t(y.size()) / s.width;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = s.input.data() + r * s.width + start;
    float* o = y.data() + r * s.width + start;
    rotate_pairs(x, o, half, cs.data() + (r % s.T) * half, sn.data() + (r % s.T) * half, pairing);
  }
  return y;
}

}  // namespace

void find_rotary_width(Found& f, const TensorData& c, const TensorSource& cand, const TensorSource& ref,
                       const std::optional<ModelConfig>& cfg) {
  if (!cfg || cfg->rope_theta <= 0) return;
  const std::optional<RopeSite> s = rope_site(f, c, cand, ref, *cfg);
  if (!s || s->rotated < 4) return;
  const std::string pos_name = step_name(f.cn.step, "positions");
  const TensorSource* pos_src = cand.has(pos_name) ? &cand : ref.has(pos_name) ? &ref : nullptr;
  if (!pos_src) return;
  const std::vector<float> pos = pos_src->get(pos_name).floats();
  if (int64_t(pos.size()) != s->T) return;
  const int64_t W = s->rotated;
  // The model's own frequencies [W/2] (scaled as the reference's table) and
  // the attention scaling folded into its cos (the reference's rope.cos).
  auto theta_freqs = [&](int64_t R) {
    std::vector<float> v(size_t(R / 2));
    for (int64_t i = 0; i < R / 2; ++i) v[size_t(i)] = float(1.0 / std::pow(cfg->rope_theta, double(2 * i) / double(R)));
    return v;
  };
  std::vector<float> full = theta_freqs(W);
  if (ref.has("rope.inv_freq")) {
    const TensorData inv = ref.get("rope.inv_freq");
    if (!inv.is_int && int64_t(inv.f.size()) == W / 2) full = inv.f;
  }
  double scaling = 1.0;
  if (const std::string cos_name = step_name(f.cn.step, "rope.cos"); ref.has(cos_name)) {
    const TensorData table = ref.get(cos_name);  // [T, W]
    if (!table.is_int && table.shape == Shape{s->T, W}) {
      std::vector<float> exact(size_t(s->T * W));
      for (int64_t t = 0; t < s->T; ++t)
        for (int64_t i = 0; i < W; ++i) exact[size_t(t * W + i)] = std::cos(pos[size_t(t)] * full[size_t(i % (W / 2))]);
      if (const double k = fit_scale(table.f.data(), exact.data(), s->T * W); k > 0) scaling = k;
    }
  }
  const int64_t n = int64_t(c.f.size());
  if (int64_t(s->input.size()) != n) return;
  // The model's own RoPE from the candidate's own input: when it reproduces
  // the candidate, the op is right and the error came in with its input.
  const std::vector<float> right = rotate_part(*s, pos, full, scaling, s->start, W, s->pairing);
  const double right_err = rmse(c.f.data(), right.data(), n);
  if (f.close(c.f.data(), right.data(), n)) return;
  // Widths: a quarter, a half, three quarters of the rotated dims, from
  // their start; on MLA also Dr mis-set by a factor of 2, rotating the last
  // Dr/2 or 2 Dr dims of each head (the split of q into nope and rope parts).
  struct Try {
    int64_t start, R;
    bool theta;  // frequencies theta^(-2i/R), else the model's first R/2
    Pairing pairing;
    double rmse;
  };
  std::vector<std::pair<int64_t, int64_t>> spans;  // (start, R)
  for (int64_t R : {W / 4, W / 2, 3 * W / 4})
    if (R >= 2 && R % 2 == 0) spans.emplace_back(s->start, R);
  if (s->mla && !s->shared) {
    if (W / 2 >= 2 && W % 4 == 0) spans.emplace_back(s->width - W / 2, W / 2);
    if (2 * W <= s->width) spans.emplace_back(s->width - 2 * W, 2 * W);
  }
  std::vector<Pairing> pairings = {Pairing::Halves, Pairing::Interleaved};
  if (s->mla) pairings.push_back(Pairing::PairsToHalves);
  std::optional<Try> best;
  for (const auto& [start, R] : spans)
    for (const bool theta : {true, false}) {
      if (!theta && R > W) continue;
      std::vector<float> inv = theta ? theta_freqs(R) : std::vector<float>(full.begin(), full.begin() + R / 2);
      for (Pairing p : pairings) {
        const std::vector<float> y = rotate_part(*s, pos, inv, scaling, start, R, p);
        const double e = rmse(c.f.data(), y.data(), n);
        if (f.close(c.f.data(), y.data(), n) && (!best || e < best->rmse)) best = Try{start, R, theta, p, e};
      }
    }
  if (!best || !(best->rmse <= 0.1 * right_err)) return;
  const Try& b = *best;
  const std::string R = std::to_string(b.R), Ws = std::to_string(W), half = std::to_string(b.R / 2);
  const std::string freqs = b.theta ? "frequencies theta^(-2i/" + R + ")"
                                    : "frequencies the model's first " + half + " of " + std::to_string(W / 2) +
                                          ", theta^(-2i/" + Ws + ")";
  const std::string how = " (" + freqs + ", " + pairing_words(b.pairing) + ")";
  const std::string unit = s->shared ? " of k_pe" : " of each head";
  std::string d;
  if (!s->mla) {
    d = "RoPE applied to the first R = " + R + " of " + Ws + " dims" + unit + how + "; the reference rotates all " + Ws +
        ": a partial rotary width" + (b.theta ? " (partial_rotary_factor " + num(double(b.R) / double(W)) + ")" : "") +
        " where the model has none";
  } else if (b.start == s->start) {
    d = "RoPE applied to the first R = " + R + " of the Dr = " + Ws + " rope dims" + unit + how +
        "; the reference rotates all " + Ws + ": a rotary width other than qk_rope_head_dim";
  } else {
    d = "RoPE applied to the last R = " + R + " dims" + unit + how + " where the reference rotates the Dr = " + Ws +
        " rope dims (the last " + Ws + " of " + std::to_string(s->width) + "): qk_rope_head_dim taken as " + R;
  }
  f.add_recomputed("rotary-width", d + " (rmse " + num(b.rmse) + " against that, " + num(f.err) +
                                     " against the reference)");
}


}  // namespace llmdiff::compare::sig
