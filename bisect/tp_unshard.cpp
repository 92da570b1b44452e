#include "bisect/tp_unshard.h"

#include <nlohmann/json.hpp>

#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sequences.h"
#include "dumps/contract/sites.h"

namespace llmdiff::bisect {

namespace {

// r when `name` starts with "rank{r}." (at most 9 digits), else -1; `rest`
// is set to where the name after it starts.
int rank_of(const std::string& name, size_t* rest) {
  if (name.compare(0, 4, "rank") != 0) return -1;
  size_t i = 4;
  int r = 0;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9' && i < 13) r = r * 10 + (name[i++] - '0');
  if (i == 4 || i >= name.size() || name[i] != '.') return -1;
  *rest = i + 1;
  return r;
}

// How a site's tensor is split over the ranks (the format's table).
enum class Shard { Replicated, Concat, KvHeads, PartialSum };
struct Rule {
  Shard shard = Shard::Replicated;
  int axis = 0;
};

Rule rule_of(Site s, bool mla) {
  switch (s) {
    case Site::AttnQ: case Site::AttnQNorm: case Site::AttnCtx: case Site::AttnKv: return {Shard::Concat, 1};
    case Site::AttnQRope: case Site::AttnScores: case Site::AttnProbs: case Site::AttnKRep: case Site::AttnVRep:
      return {Shard::Concat, 0};
    case Site::AttnK: case Site::AttnV: case Site::AttnKNorm: return {Shard::KvHeads, 1};
    case Site::AttnKRope: case Site::AttnKCache: case Site::AttnVCache:
      return mla ? Rule{Shard::Concat, 0} : Rule{Shard::KvHeads, 0};  // MLA's: per query head
    case Site::MlpGate: case Site::MlpUp: case Site::MlpAct: return {Shard::Concat, 1};
    case Site::AttnOut: case Site::MlpDown: case Site::MoeExpertOut: case Site::MoeRouted: case Site::MoeShared:
    case Site::MoeOut:
      return {Shard::PartialSum, 0};
    default: return {};
  }
}

// The site of a rank-less name (after any seq{b}. prefix).
std::optional<Site> site_of(const std::string& name) {
  size_t rest = 0;
  const std::string own = sequence_of(name, &rest) >= 0 ? name.substr(rest) : name;
  const CanonName c = parse_name(own);
  if (c.kind != CanonName::Kind::Step && c.kind != CanonName::Kind::Layer) return std::nullopt;
  return find_site(c.site);
}

TensorData concat(const std::vector<TensorData>& parts, int axis, const std::string& label, const std::string& name) {
  TensorData o = parts.front();
  if (axis >= int(o.shape.size())) throw FormatError(label, name, "a shard of rank " + shape_str(o.shape) + " has no axis " + std::to_string(axis));
  int64_t outer = 1, inner = 1, total = 0;
  for (int k = 0; k < axis; ++k) outer *= o.shape[size_t(k)];
  for (size_t k = size_t(axis) + 1; k < o.shape.size(); ++k) inner *= o.shape[k];
  for (const TensorData& p : parts) {
    Shape a = p.shape, b = o.shape;
    if (a.size() != b.size() || p.is_int != o.is_int)
      throw FormatError(label, name, "the ranks' shards differ in rank or type: " + shape_str(a) + " vs " + shape_str(b));
    a[size_t(axis)] = b[size_t(axis)] = 0;
    if (a != b) throw FormatError(label, name, "the ranks' shards differ off the split axis: " + shape_str(p.shape) + " vs " + shape_str(o.shape));
    total += p.shape[size_t(axis)];
  }
  o.shape[size_t(axis)] = total;
  o.f.clear();
  o.i.clear();
  for (int64_t a = 0; a < outer; ++a)
    for (const TensorData& p : parts) {
      const int64_t block = p.shape[size_t(axis)] * inner;
      if (o.is_int)
        o.i.insert(o.i.end(), p.i.begin() + a * block, p.i.begin() + (a + 1) * block);
      else
        o.f.insert(o.f.end(), p.f.begin() + a * block, p.f.begin() + (a + 1) * block);
    }
  return o;
}

}  // namespace

bool has_rank_names(const TensorSource& dump) {
  size_t rest = 0;
  for (const std::string& n : dump.names())
    if (rank_of(n, &rest) >= 0) return true;
  return false;
}

UnshardView::UnshardView(const TensorSource& dump, const ModelConfig& cfg) : dump_(dump), cfg_(cfg) {
  int highest = -1;
  for (const std::string& n : dump.names()) {
    size_t rest = 0;
    const int r = rank_of(n, &rest);
    if (r < 0) {
      holders_[n];  // a rank-less name (a producer's own bookkeeping): as it is
      continue;
    }
    holders_[n.substr(rest)].push_back(r);
    highest = std::max(highest, r);
  }
  ranks_ = highest + 1;
  const auto tp = dump.manifest().extra.find("tensor_parallel");
  if (tp != dump.manifest().extra.end()) {
    const nlohmann::json j = nlohmann::json::parse(tp->second, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("ranks") || !j["ranks"].is_number_integer() ||
        j["ranks"].get<int>() < 1)
      throw FormatError(dump.label(), "", "manifest tensor_parallel: expected {\"ranks\": R}, got " + tp->second);
    if (j["ranks"].get<int>() != ranks_)
      throw FormatError(dump.label(), "", "manifest tensor_parallel says " + std::to_string(j["ranks"].get<int>()) +
                                              " ranks, the names " + std::to_string(ranks_));
  }
  for (auto& [name, ranks] : holders_) {
    names_.push_back(name);
    const std::optional<Site> s = site_of(name);
    if (!s || rule_of(*s, cfg_.mla.enabled).shard == Shard::Replicated) continue;
    if (int(ranks.size()) != ranks_)
      throw FormatError(dump.label(), "rank" + std::to_string(ranks_ - 1) + "." + name,
                        "a sharded name every one of the " + std::to_string(ranks_) + " ranks must write; " +
                            std::to_string(ranks.size()) + " do");
  }
  sort_canonical(names_);
  manifest_ = dump.manifest();
}

TensorData UnshardView::get(const std::string& name) const {
  const auto it = holders_.find(name);
  if (it == holders_.end()) throw MissingTensorError(label(), name);
  const std::vector<int>& ranks = it->second;
  if (ranks.empty()) return dump_.get(name);
  auto of_rank = [&](int r) {
    TensorData t = dump_.get("rank" + std::to_string(r) + "." + name);
    t.name = name;
    return t;
  };
  const std::optional<Site> s = site_of(name);
  const Rule rule = s ? rule_of(*s, cfg_.mla.enabled) : Rule{};
  std::vector<TensorData> parts;
  switch (rule.shard) {
    case Shard::Replicated: return of_rank(ranks.front());
    case Shard::Concat:
      for (int r = 0; r < ranks_; ++r) parts.push_back(of_rank(r));
      return concat(parts, rule.axis, label(), name);
    case Shard::KvHeads: {
      // Hkv >= R: each rank its heads; Hkv < R: one head on R / Hkv ranks.
      const int64_t hkv = cfg_.num_key_value_heads;
      const int step = hkv >= ranks_ || hkv <= 0 ? 1 : int(ranks_ / hkv);
      for (int r = 0; r < ranks_; r += step) parts.push_back(of_rank(r));
      return concat(parts, rule.axis, label(), name);
    }
    case Shard::PartialSum: {
      TensorData sum = of_rank(0);
      for (int r = 1; r < ranks_; ++r) {
        const TensorData p = of_rank(r);
        if (p.shape != sum.shape || p.is_int || sum.is_int)
          throw FormatError(label(), "rank" + std::to_string(r) + "." + name,
                            "a partial sum of shape " + shape_str(p.shape) + ", rank 0's " + shape_str(sum.shape));
        for (size_t k = 0; k < sum.f.size(); ++k) sum.f[k] += p.f[k];
      }
      return sum;
    }
  }
  return of_rank(ranks.front());
}

std::string UnshardView::note() const {
  return std::to_string(ranks_) +
         " tensor-parallel ranks unsharded: heads and columns concatenated, partial sums added in rank order "
         "(each rank's shard judged within the whole tensor, not on its own)";
}

}  // namespace llmdiff::bisect
