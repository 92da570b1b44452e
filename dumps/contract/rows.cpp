#include "dumps/contract/rows.h"

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

}  // namespace llmdiff
