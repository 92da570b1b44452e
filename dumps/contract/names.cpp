#include "dumps/contract/names.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <tuple>

#include "dumps/contract/sites.h"

namespace llmdiff {

namespace {

// The names of the table's sites of one scope, in table order.
std::vector<std::string> sites_of(SiteScope scope) {
  std::vector<std::string> v;
  for (const SiteInfo& i : site_table())
    if (i.scope == scope) v.push_back(i.name);
  return v;
}

}  // namespace

const std::vector<std::string>& step_sites_before_layers() {
  static const std::vector<std::string> v = sites_of(SiteScope::BeforeLayers);
  return v;
}

const std::vector<std::string>& layer_sites() {
  static const std::vector<std::string> v = sites_of(SiteScope::Layer);
  return v;
}

const std::vector<std::string>& step_sites_after_layers() {
  static const std::vector<std::string> v = sites_of(SiteScope::AfterLayers);
  return v;
}

namespace {

int index_of(const std::vector<std::string>& v, const std::string& s) {
  auto it = std::find(v.begin(), v.end(), s);
  return it == v.end() ? -1 : int(it - v.begin());
}

// Parses a non-negative decimal integer at s[pos..], advancing pos; -1 if none.
int parse_index(const std::string& s, size_t& pos) {
  size_t start = pos;
  long long v = 0;
  while (pos < s.size() && s[pos] >= '0' && s[pos] <= '9' && pos - start < 9) v = v * 10 + (s[pos++] - '0');
  if (pos == start || (pos - start > 1 && s[start] == '0')) return -1;
  return int(v);
}

// Order key: (group, step, section, layer, rank, name).
using Key = std::tuple<int, int, int, int, int, std::string>;

Key order_key(const std::string& name) {
  CanonName c = parse_name(name);
  switch (c.kind) {
    case CanonName::Kind::InvFreq: return {0, 0, 0, 0, 0, ""};
    case CanonName::Kind::Generated: return {2, 0, 0, 0, 0, ""};
    case CanonName::Kind::Unknown: return {3, 0, 0, 0, 0, name};
    case CanonName::Kind::Layer: {
      int r = index_of(layer_sites(), c.site);
      return {1, c.step, 1, c.layer, r < 0 ? 1000 : r, r < 0 ? c.site : ""};
    }
    case CanonName::Kind::Step: {
      int r = index_of(step_sites_before_layers(), c.site);
      if (r >= 0) return {1, c.step, 0, 0, r, ""};
      r = index_of(step_sites_after_layers(), c.site);
      if (r >= 0) return {1, c.step, 2, 0, r, ""};
      return {1, c.step, 3, 0, 0, c.site};  // a step name outside the spec
    }
  }
  return {3, 0, 0, 0, 0, name};
}

}  // namespace

CanonName parse_name(const std::string& name) {
  CanonName c;
  c.site = name;
  if (name == "rope.inv_freq") {
    c.kind = CanonName::Kind::InvFreq;
    return c;
  }
  if (name == "generated") {
    c.kind = CanonName::Kind::Generated;
    return c;
  }
  if (name.compare(0, 4, "step") != 0) return c;
  size_t pos = 4;
  int step = parse_index(name, pos);
  if (step < 0 || pos >= name.size() || name[pos] != '.' || pos + 1 >= name.size()) return c;
  std::string rest = name.substr(pos + 1);
  if (rest.compare(0, 7, "layers.") == 0) {
    size_t lp = 7;
    int layer = parse_index(rest, lp);
    if (layer < 0 || lp >= rest.size() || rest[lp] != '.' || lp + 1 >= rest.size()) return c;
    c.kind = CanonName::Kind::Layer;
    c.step = step;
    c.layer = layer;
    c.site = rest.substr(lp + 1);
    return c;
  }
  c.kind = CanonName::Kind::Step;
  c.step = step;
  c.site = rest;
  return c;
}

std::string CanonName::str() const {
  switch (kind) {
    case Kind::InvFreq: return "rope.inv_freq";
    case Kind::Generated: return "generated";
    case Kind::Step: return step_name(step, site);
    case Kind::Layer: return layer_name(step, layer, site);
    case Kind::Unknown: return site;
  }
  return site;
}

std::string step_name(int step, const std::string& site) { return "step" + std::to_string(step) + "." + site; }

std::string layer_name(int step, int layer, const std::string& site) {
  return "step" + std::to_string(step) + ".layers." + std::to_string(layer) + "." + site;
}

// "layers.2" before "layers.10": digit runs compare by value.
static bool natural_less(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (std::isdigit((unsigned char)a[i]) && std::isdigit((unsigned char)b[j])) {
      size_t i2 = i, j2 = j;
      while (i2 < a.size() && std::isdigit((unsigned char)a[i2])) ++i2;
      while (j2 < b.size() && std::isdigit((unsigned char)b[j2])) ++j2;
      std::string na = a.substr(i, i2 - i), nb = b.substr(j, j2 - j);
      na.erase(0, std::min(na.find_first_not_of('0'), na.size()));
      nb.erase(0, std::min(nb.find_first_not_of('0'), nb.size()));
      if (na.size() != nb.size()) return na.size() < nb.size();
      if (na != nb) return na < nb;
      i = i2, j = j2;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i, ++j;
    }
  }
  if ((a.size() - i) != (b.size() - j)) return a.size() - i < b.size() - j;
  return a < b;
}

// Canonical order of two names given their keys.
static bool key_less(const Key& ka, const std::string& a, const Key& kb, const std::string& b) {
  auto head = [](const Key& k) { return std::make_tuple(std::get<0>(k), std::get<1>(k), std::get<2>(k), std::get<3>(k), std::get<4>(k)); };
  if (head(ka) != head(kb)) return head(ka) < head(kb);
  if (std::get<5>(ka) != std::get<5>(kb)) return natural_less(std::get<5>(ka), std::get<5>(kb));
  return a < b;
}

bool NameOrder::operator()(const std::string& a, const std::string& b) const {
  return key_less(order_key(a), a, order_key(b), b);
}

// Each name parsed once (a comparison sort would parse it at every comparison).
void sort_canonical(std::vector<std::string>& names) {
  std::vector<std::pair<Key, size_t>> keyed;
  keyed.reserve(names.size());
  for (size_t i = 0; i < names.size(); ++i) keyed.emplace_back(order_key(names[i]), i);
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
    return key_less(x.first, names[x.second], y.first, names[y.second]);
  });
  std::vector<std::string> sorted;
  sorted.reserve(names.size());
  for (const auto& k : keyed) sorted.push_back(std::move(names[k.second]));
  names = std::move(sorted);
}

int site_rank(const std::string& site) {
  int r = index_of(step_sites_before_layers(), site);
  if (r >= 0) return r;
  const int nb = int(step_sites_before_layers().size());
  r = index_of(layer_sites(), site);
  if (r >= 0) return nb + r;
  r = index_of(step_sites_after_layers(), site);
  if (r >= 0) return nb + int(layer_sites().size()) + r;
  return -1;
}

}  // namespace llmdiff
