#include "dumps/contract/padding.h"

#include <cstring>
#include <vector>

#include <nlohmann/json.hpp>

#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/rows.h"
#include "dumps/contract/sites.h"

namespace llmdiff {

namespace {
std::string padding_key(int seq) { return seq < 0 ? "padding" : "padding.seq" + std::to_string(seq); }
}  // namespace

std::optional<LeftPadding> manifest_padding(const Manifest& m, const std::string& where, int seq) {
  auto it = m.extra.find(padding_key(seq));
  if (it == m.extra.end() && seq >= 0) it = m.extra.find(padding_key(-1));
  if (it == m.extra.end()) return std::nullopt;
  const nlohmann::json j = nlohmann::json::parse(it->second, nullptr, false);
  auto bad = [&](const std::string& why) {
    return FormatError(where, "",
                       "manifest '" + it->first + "': " + why + " (expected {\"left\": N, \"pad_token\": ID})");
  };
  if (!j.is_object()) throw bad("not a JSON object");
  LeftPadding p;
  for (const auto& [k, v] : j.items()) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0) throw bad("'" + k + "' must be a non-negative integer");
    if (k == "left")
      p.left = v.get<int64_t>();
    else if (k == "pad_token")
      p.pad_token = v.get<int64_t>();
    else
      throw bad("unknown key '" + k + "'");
  }
  return p;
}

void set_manifest_padding(Manifest& m, const LeftPadding& p, int seq) {
  m.extra[padding_key(seq)] = nlohmann::json{{"left", p.left}, {"pad_token", p.pad_token}}.dump();
}

std::optional<int> key_axis(const std::string& site) {
  const std::optional<Site> s = find_site(site);
  if (!s || site_info(*s).key_axis < 0) return std::nullopt;
  return site_info(*s).key_axis;
}

namespace {

// `in` [shape] without the first drop[a] entries of each axis a.
template <class T>
std::vector<T> strip(const T* in, const Shape& shape, const std::vector<int64_t>& drop, Shape& out_shape) {
  const size_t n = shape.size();
  out_shape = shape;
  for (size_t a = 0; a < n; ++a) out_shape[a] -= drop[a];
  int64_t total = 1;
  for (int64_t d : out_shape) total *= d;
  std::vector<T> out(size_t(std::max<int64_t>(total, 0)));
  if (total <= 0) return out;
  std::vector<int64_t> idx(n, 0);  // index into out_shape
  std::vector<int64_t> stride(n, 1);
  for (size_t a = n; a-- > 1;) stride[a - 1] = stride[a] * shape[a];
  const int64_t inner = out_shape[n - 1];
  for (int64_t o = 0; o < total; o += inner) {
    int64_t src = 0;
    for (size_t a = 0; a < n; ++a) src += (idx[a] + drop[a]) * stride[a];
    std::memcpy(&out[size_t(o)], in + src, size_t(inner) * sizeof(T));
    for (size_t a = n - 1; a-- > 0;) {  // next row: carry over the outer axes
      if (++idx[a] < out_shape[a]) break;
      idx[a] = 0;
    }
  }
  return out;
}

}  // namespace

std::vector<int64_t> LeftPadStripper::drops(const std::string& name, const Shape& shape) const {
  std::vector<int64_t> drop(shape.size(), 0);
  const CanonName c = parse_name(name);
  if (c.step < 0 || shape.empty()) return drop;
  if (c.step == 0)
    if (const std::optional<int> a = token_axis(c.site); a && size_t(*a) < shape.size()) drop[size_t(*a)] = pad_;
  if (const std::optional<int> a = key_axis(c.site); a && size_t(*a) < shape.size()) drop[size_t(*a)] = pad_;
  for (size_t a = 0; a < shape.size(); ++a)
    if (drop[a] > shape[a]) throw Error("left padding: " + name + " has " + std::to_string(shape[a]) +
                                        " entries along axis " + std::to_string(a) + ", fewer than the " +
                                        std::to_string(pad_) + " pads");
  return drop;
}

void LeftPadStripper::on_f32(const std::string& name, const Shape& shape, const float* data) {
  if (pad_ == 0) return inner_.on_f32(name, shape, data);
  Shape out;
  const std::vector<float> v = strip(data, shape, drops(name, shape), out);
  inner_.on_f32(name, out, v.data());
}

void LeftPadStripper::on_i64(const std::string& name, const Shape& shape, const int64_t* data) {
  if (pad_ == 0) return inner_.on_i64(name, shape, data);
  Shape out;
  const std::vector<int64_t> v = strip(data, shape, drops(name, shape), out);
  inner_.on_i64(name, out, v.data());
}

}  // namespace llmdiff
