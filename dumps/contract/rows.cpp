#include "dumps/contract/rows.h"

#include <set>

#include <cctype>

#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sequences.h"
#include "dumps/contract/sites.h"

namespace llmdiff {

namespace {

// Length of a "seq{b}." prefix of `name`, 0 when it has none.
size_t sequence_prefix_length(const std::string& name) {
  size_t rest = 0;
  return sequence_of(name, &rest) >= 0 ? rest : 0;
}

}  // namespace

std::optional<int> token_axis(const std::string& site) {
  const std::optional<Site> s = find_site(site);
  if (!s || site_info(*s).token_axis < 0) return std::nullopt;
  return site_info(*s).token_axis;
}

std::string rows_name_for(const std::string& name) {
  const size_t pre = sequence_prefix_length(name);
  const CanonName c = parse_name(name.substr(pre));
  if (c.kind != CanonName::Kind::Step && c.kind != CanonName::Kind::Layer) return "";
  return name.substr(0, pre) + step_name(c.step, Site::Rows);
}

void attach_rows(const TensorSource& src, TensorData& t) {
  const size_t pre = sequence_prefix_length(t.name);
  const CanonName c = parse_name(t.name.substr(pre));
  if (c.kind != CanonName::Kind::Step && c.kind != CanonName::Kind::Layer) return;
  const std::optional<int> axis = token_axis(c.site);
  if (!axis || int(t.shape.size()) <= *axis) return;
  const std::string rn = t.name.substr(0, pre) + step_name(c.step, Site::Rows);
  if (!src.has(rn)) return;
  const TensorData r = src.get(rn);
  if (!r.is_int || r.shape.size() != 1) throw FormatError(src.label(), rn, "row list must be I64 [R]");
  for (size_t k = 0; k < r.i.size(); ++k)
    if (r.i[k] < 0 || (k > 0 && r.i[k] <= r.i[k - 1]))
      throw FormatError(src.label(), rn, "row list must be ascending token indices >= 0, entry " + std::to_string(k) +
                                             " is " + std::to_string(r.i[k]));
  if (t.shape[size_t(*axis)] == int64_t(r.i.size())) t.rows = r.i;
}

TensorData select_rows(const TensorData& full, const std::vector<int64_t>& rows, int axis) {
  int64_t outer = 1, inner = 1;
  for (int k = 0; k < axis; ++k) outer *= full.shape[size_t(k)];
  for (size_t k = size_t(axis) + 1; k < full.shape.size(); ++k) inner *= full.shape[k];
  const int64_t n = full.shape[size_t(axis)];
  TensorData o;
  o.name = full.name;
  o.is_int = full.is_int;
  o.stored = full.stored;
  o.shape = full.shape;
  o.shape[size_t(axis)] = int64_t(rows.size());
  o.rows = rows;
  auto copy = [&](const auto& src, auto& dst) {
    dst.reserve(size_t(numel(o.shape)));
    for (int64_t a = 0; a < outer; ++a)
      for (int64_t r : rows) {
        if (r >= n) throw ShapeError(full.name, full.name, "a row below " + std::to_string(n), "row " + std::to_string(r));
        dst.insert(dst.end(), src.begin() + (a * n + r) * inner, src.begin() + (a * n + r + 1) * inner);
      }
  };
  if (full.is_int)
    copy(full.i, o.i);
  else
    copy(full.f, o.f);
  return o;
}

TensorData rows_like(TensorData full, const TensorData& part) {
  if (part.rows.empty() || !full.rows.empty() || full.shape.size() != part.shape.size()) return full;
  const size_t pre = sequence_prefix_length(part.name);
  const std::optional<int> axis = token_axis(parse_name(part.name.substr(pre)).site);
  if (!axis || int(full.shape.size()) <= *axis) return full;
  for (size_t k = 0; k < full.shape.size(); ++k)
    if (int(k) != *axis && full.shape[k] != part.shape[k]) return full;
  if (full.shape[size_t(*axis)] <= part.rows.back()) return full;  // not the whole axis: left to the comparison
  return select_rows(full, part.rows, *axis);
}

InferredRowsView::InferredRowsView(const TensorSource& src) : src_(src), names_(src.names()) {
  // Per step: the step's token count, and the lengths its shorter per-token tensors have.
  struct Step {
    int64_t tokens = -1;  // T (step{N}.tokens [T])
    std::set<int64_t> lengths;
    int shorter = 0;
    int last_layer = -1;       // the step's last layer
    bool pruned_shape = true;  // every shorter tensor is where output pruning cuts
  };
  // Each name parsed once, with the rows name of its step ("" outside the steps).
  struct Parsed {
    const std::string* name;
    CanonName c;
    std::string rows;
  };
  std::vector<Parsed> parsed;
  for (const std::string& n : names_) {
    const size_t pre = sequence_prefix_length(n);
    Parsed p{&n, parse_name(n.substr(pre)), ""};
    if (p.c.kind == CanonName::Kind::Step || p.c.kind == CanonName::Kind::Layer)
      p.rows = n.substr(0, pre) + step_name(p.c.step, Site::Rows);
    parsed.push_back(std::move(p));
  }
  std::map<std::string, Step> steps;  // by the step's rows name
  for (const Parsed& p : parsed) {
    if (p.rows.empty() || p.c.kind != CanonName::Kind::Step || p.c.site != site_name(Site::Tokens)) continue;
    const Shape sh = src.shape(*p.name);
    if (sh.size() == 1) steps[p.rows].tokens = sh[0];
  }
  auto step_of = [&](const Parsed& p) -> Step* {
    auto st = p.rows.empty() ? steps.end() : steps.find(p.rows);
    return st == steps.end() || st->second.tokens < 2 ? nullptr : &st->second;
  };
  for (const Parsed& p : parsed)
    if (Step* st = step_of(p); st && p.c.kind == CanonName::Kind::Layer) st->last_layer = std::max(st->last_layer, p.c.layer);
  // Output pruning cuts after the last layer's attention: its feed-forward
  // (and the norm before it), its output, and what follows the layers. A
  // shorter tensor anywhere else (an attention, an earlier layer) is read as
  // it is: a length finding, not a subset.
  for (const Parsed& p : parsed) {
    Step* st = step_of(p);
    const std::optional<int> axis = st ? token_axis(p.c.site) : std::nullopt;
    if (!axis) continue;
    const Shape sh = src.shape(*p.name);
    if (int(sh.size()) <= *axis || sh[size_t(*axis)] >= st->tokens) continue;
    st->lengths.insert(sh[size_t(*axis)]);
    ++st->shorter;
    const CanonName& c = p.c;
    const std::optional<Site> site = find_site(c.site);
    // (llama.cpp selects the output rows after o_proj, before the residual add.)
    const bool after_attention = c.kind == CanonName::Kind::Layer && c.layer == st->last_layer &&
                                 (c.site.rfind("attn", 0) != 0 || c.site == "attn.out" || c.site == "attn_residual");
    const bool after_layers = c.kind == CanonName::Kind::Step && site && site_info(*site).scope == SiteScope::AfterLayers;
    if (!after_attention && !after_layers) st->pruned_shape = false;
  }
  for (const auto& [rn, st] : steps) {
    if (st.lengths.size() != 1 || !st.pruned_shape || src.has(rn)) continue;
    const int64_t R = *st.lengths.begin(), T = st.tokens;
    if (R < 1) continue;
    std::vector<int64_t> rows(static_cast<size_t>(R));
    for (int64_t k = 0; k < R; ++k) rows[size_t(k)] = T - R + k;
    rows_[rn] = rows;
    names_.push_back(rn);
    notes_.push_back(rn.substr(0, rn.size() - 5) + ": " + std::to_string(st.shorter) + " tensor" +
                     (st.shorter == 1 ? " holds" : "s hold") + " the last " + std::to_string(R) + " of the step's " +
                     std::to_string(T) + " rows, without " + rn + ": compared as that row subset");
  }
  if (!rows_.empty()) sort_canonical(names_);
}

bool InferredRowsView::has(const std::string& name) const { return rows_.count(name) > 0 || src_.has(name); }

Shape InferredRowsView::shape(const std::string& name) const {
  auto it = rows_.find(name);
  return it != rows_.end() ? Shape{int64_t(it->second.size())} : src_.shape(name);
}

TensorData InferredRowsView::get(const std::string& name) const {
  auto it = rows_.find(name);
  if (it != rows_.end()) {
    TensorData t;
    t.name = name;
    t.is_int = true;
    t.stored = DType::I64;
    t.shape = {int64_t(it->second.size())};
    t.i = it->second;
    return t;
  }
  TensorData t = src_.get(name);
  if (t.rows.empty()) attach_rows(*this, t);
  return t;
}

}  // namespace llmdiff
