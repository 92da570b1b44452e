#include "dumps/contract/ranks.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sequences.h"

namespace llmdiff {

namespace {

constexpr uint64_t kUnranked = uint64_t(1) << 63;  // held_ bit: the name outside every rank
constexpr int kMaxRanks = 62;

// The site of a canonical name (after any seq{b}.), and its layer.
struct NameSite {
  std::optional<Site> site;
  int layer = -1;
};
NameSite site_of(const std::string& name) {
  size_t rest = 0;
  const std::string canonical = sequence_of(name, &rest) >= 0 ? name.substr(rest) : name;
  const CanonName c = parse_name(canonical);
  NameSite n;
  if (c.kind == CanonName::Kind::Layer || c.kind == CanonName::Kind::Step) n.site = find_site(c.site);
  n.layer = c.layer;
  return n;
}

// Tensors of equal shapes but along `axis`, concatenated along it in order.
TensorData concatenated(std::vector<TensorData> parts, int axis) {
  TensorData out = parts.front();
  int64_t outer = 1, total = 0;
  for (int d = 0; d < axis; ++d) outer *= out.shape[size_t(d)];
  std::vector<int64_t> widths;  // each part's values per outer index
  for (const TensorData& p : parts) {
    int64_t inner = 1;
    for (size_t d = size_t(axis); d < p.shape.size(); ++d) inner *= p.shape[d];
    widths.push_back(inner);
    total += p.shape[size_t(axis)];
  }
  out.shape[size_t(axis)] = total;
  out.f.assign(size_t(numel(out.shape)), 0.0f);
  int64_t at = 0;
  for (int64_t o = 0; o < outer; ++o)
    for (size_t k = 0; k < parts.size(); ++k) {
      std::copy_n(parts[k].f.data() + o * widths[k], widths[k], out.f.data() + at);
      at += widths[k];
    }
  return out;
}

}  // namespace

const char* tensor_parallel_key() { return "tensor_parallel"; }

std::string tensor_parallel_json(int ranks) { return nlohmann::json{{"ranks", ranks}}.dump(); }

int manifest_ranks(const Manifest& m, const std::string& label) {
  auto it = m.extra.find(tensor_parallel_key());
  if (it == m.extra.end()) return 1;
  const nlohmann::json j = nlohmann::json::parse(it->second, nullptr, false);
  if (!j.is_object() || !j.contains("ranks") || !j["ranks"].is_number_integer() || j["ranks"].get<int64_t>() < 1 ||
      j["ranks"].get<int64_t>() > kMaxRanks)
    throw FormatError(label, "",
                      "manifest '" + std::string(tensor_parallel_key()) + "' is " + it->second +
                          ", expected {\"ranks\": R} with 1 <= R <= " + std::to_string(kMaxRanks));
  return int(j["ranks"].get<int64_t>());
}

std::string rank_prefix(int r) { return "rank" + std::to_string(r) + "."; }

int rank_of(const std::string& name, size_t* rest) {
  if (name.compare(0, 4, "rank") != 0) return -1;
  size_t i = 4;
  int r = 0;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9' && i < 10) r = r * 10 + (name[i++] - '0');
  if (i == 4 || i >= name.size() || name[i] != '.') return -1;
  if (rest) *rest = i + 1;
  return r;
}

const char* shard_rule_name(ShardRule r) {
  switch (r) {
    case ShardRule::Replicated: return "replicated";
    case ShardRule::QueryHeads: return "query heads";
    case ShardRule::KvHeads: return "kv heads";
    case ShardRule::Columns: return "columns";
    case ShardRule::PartialSum: return "partial sum";
  }
  return "?";
}

ShardSpec shard_spec(Site s, const ModelConfig& m) {
  using R = ShardRule;
  switch (s) {
    case Site::AttnQ: case Site::AttnQNorm: case Site::AttnCtx: case Site::AttnKv:
      return {R::QueryHeads, 1};  // [T, heads * width]
    case Site::AttnQRope: case Site::AttnScores: case Site::AttnProbs: case Site::AttnKRep: case Site::AttnVRep:
      return {R::QueryHeads, 0};  // [heads, ...]
    case Site::AttnK: case Site::AttnV: case Site::AttnKNorm:
      return {R::KvHeads, 1};
    case Site::AttnKRope: case Site::AttnKCache: case Site::AttnVCache:
      return {m.mla.enabled ? R::QueryHeads : R::KvHeads, 0};  // MLA: a key and value per query head
    case Site::MlpGate: case Site::MlpUp: case Site::MlpAct:
      return {R::Columns, 1};
    case Site::AttnOut: case Site::MlpDown: case Site::MoeExpertOut: case Site::MoeRouted: case Site::MoeShared:
    case Site::MoeOut:
      return {R::PartialSum, 0};
    default:
      return {};
  }
}

int64_t RankLayout::kv_head(int r, int64_t j) const {
  return kv_replicated() ? int64_t(r) * kv_total / ranks : int64_t(r) * kv_heads + j;
}

int RankLayout::holder(int64_t kv_head) const {
  return kv_replicated() ? int((kv_head * ranks + kv_total - 1) / kv_total) : int(kv_head / kv_heads);
}

std::string RankLayout::problem(const ModelConfig& m, int ranks) {
  const int64_t R = ranks, Hq = m.num_attention_heads, Hkv = m.mla.enabled ? Hq : m.num_key_value_heads;
  auto divides = [&](int64_t n, const std::string& what) -> std::string {
    return n % R == 0 ? "" : std::to_string(R) + " ranks do not divide the " + std::to_string(n) + " " + what;
  };
  if (R < 1) return "the rank count must be >= 1, got " + std::to_string(R);
  if (R > kMaxRanks) return "at most " + std::to_string(kMaxRanks) + " ranks, got " + std::to_string(R);
  std::string why = divides(Hq, "query heads");
  if (why.empty() && Hkv >= R) why = divides(Hkv, "kv heads");
  if (why.empty() && Hkv < R && R % Hkv != 0)
    why = "the " + std::to_string(Hkv) + " kv heads do not divide the " + std::to_string(R) +
          " ranks they are replicated over";
  bool dense = false;
  for (int64_t l = 0; l < m.num_hidden_layers; ++l) dense = dense || !m.moe.is_moe_layer(l);
  if (why.empty() && dense) why = divides(m.intermediate_size, "columns of the MLP (intermediate_size)");
  if (why.empty() && m.moe.enabled()) why = divides(m.moe.intermediate_size, "columns of each expert");
  if (why.empty() && m.moe.shared_intermediate_size > 0)
    why = divides(m.moe.shared_intermediate_size, "columns of the shared expert");
  return why;
}

RankLayout RankLayout::of(const ModelConfig& m, int ranks) {
  const std::string why = problem(m, ranks);
  if (!why.empty())
    throw UsageError("tensor parallel over " + std::to_string(ranks) + " ranks of " + m.source + ": " + why);
  RankLayout L;
  L.ranks = ranks;
  L.q_heads = m.num_attention_heads / ranks;
  L.kv_total = m.mla.enabled ? m.num_attention_heads : m.num_key_value_heads;
  L.kv_heads = L.kv_replicated() ? 1 : L.kv_total / ranks;
  return L;
}

std::optional<int64_t> RankLayout::shard_extent(Site s, const ModelConfig& m, int64_t layer) const {
  const bool mla = m.mla.enabled;
  const int64_t Dh = m.head_dim, Dn = m.mla.qk_nope_head_dim, Dr = m.mla.qk_rope_head_dim, Dv = m.mla.v_head_dim;
  switch (s) {
    case Site::AttnQ: return q_heads * (mla ? Dn + Dr : Dh);
    case Site::AttnQNorm: return q_heads * Dh;
    case Site::AttnCtx: return q_heads * (mla ? Dv : Dh);
    case Site::AttnKv: return q_heads * (Dn + Dv);
    case Site::AttnQRope: case Site::AttnScores: case Site::AttnProbs: case Site::AttnKRep: case Site::AttnVRep:
      return q_heads;
    case Site::AttnK: case Site::AttnV: case Site::AttnKNorm: return kv_heads * Dh;
    case Site::AttnKRope: case Site::AttnKCache: case Site::AttnVCache: return mla ? q_heads : kv_heads;
    case Site::MlpGate: case Site::MlpUp: case Site::MlpAct:
      if (layer >= 0 && m.moe.is_moe_layer(layer)) return std::nullopt;
      return m.intermediate_size / ranks;
    default: return std::nullopt;
  }
}

// ---------------------------------------------------------------------------
// RankView

RankView::RankView(const TensorSource& source, const ModelConfig& m) : src_(source), cfg_(m) {
  const int R = manifest_ranks(source.manifest(), source.label());
  const std::string why = RankLayout::problem(m, R);
  if (!why.empty())
    throw FormatError(source.label(), "", "manifest '" + std::string(tensor_parallel_key()) + "' says " +
                                              std::to_string(R) + " ranks: " + why);
  layout_ = RankLayout::of(m, R);
  manifest_ = source.manifest();
  manifest_.extra.erase(tensor_parallel_key());
  bool ranked = false;
  for (const std::string& n : source.names()) {
    size_t rest = 0;
    const int r = rank_of(n, &rest);
    if (r >= R)
      throw FormatError(source.label(), n, "rank " + std::to_string(r) + " of a dump the manifest gives " +
                                               std::to_string(R) + " ranks (" + tensor_parallel_json(R) + ")");
    ranked = ranked || r >= 0;
    held_[r < 0 ? n : n.substr(rest)] |= r < 0 ? kUnranked : uint64_t(1) << r;
  }
  if (!ranked)
    throw FormatError(source.label(), "", "the manifest says " + tensor_parallel_json(R) +
                                              " but no tensor is under a rank{r}. prefix");
  // Every sharded name on every rank, each shard of its rule's shape.
  for (const auto& [name, ranks] : held_) {
    names_.push_back(name);
    const NameSite at = site_of(name);
    const ShardSpec sp = at.site ? shard_spec(*at.site, m) : ShardSpec{};
    if (!sp.sharded()) continue;
    for (int r = 0; r < R; ++r)
      if (!(ranks & (uint64_t(1) << r))) throw MissingTensorError(source.label(), rank_prefix(r) + name);
    const std::string first = rank_prefix(0) + name;
    Shape want = source.shape(first);
    if (const std::optional<int64_t> extent = layout_.shard_extent(*at.site, m, at.layer)) {
      Shape expected = want;
      if (int(expected.size()) <= sp.axis) expected.resize(size_t(sp.axis) + 1, 1);
      expected[size_t(sp.axis)] = *extent;
      if (want != expected)
        throw ShapeError(source.label(), first,
                         shape_str(expected) + " (" + shard_rule_name(sp.rule) + " of rank 0 of " +
                             std::to_string(R) + ")",
                         shape_str(want));
    }
    for (int r = 1; r < R; ++r) {
      const Shape got = source.shape(rank_prefix(r) + name);
      if (got != want)
        throw ShapeError(source.label(), rank_prefix(r) + name,
                         shape_str(want) + " (the " + shard_rule_name(sp.rule) + " shard of every rank, as rank 0's)",
                         shape_str(got));
    }
  }
  sort_canonical(names_);
}

ShardSpec RankView::spec(const std::string& name) const {
  const NameSite at = site_of(name);
  return at.site ? shard_spec(*at.site, cfg_) : ShardSpec{};
}

std::string RankView::rank_name(int r, const std::string& name) const {
  auto it = held_.find(name);
  if (it == held_.end() || r < 0 || r >= layout_.ranks) return "";
  const uint64_t ranks = it->second;
  if (ranks & (uint64_t(1) << r)) return rank_prefix(r) + name;
  if (spec(name).sharded()) return "";
  for (int k = 0; k < layout_.ranks; ++k)  // replicated: the lowest rank's copy, or the one outside every rank
    if (ranks & (uint64_t(1) << k)) return rank_prefix(k) + name;
  return ranks & kUnranked ? name : "";
}

Shape RankView::shape(const std::string& name) const {
  if (!has(name)) throw MissingTensorError(label(), name);
  const ShardSpec sp = spec(name);
  Shape s = src_.shape(rank_name(0, name));
  if (sp.rule == ShardRule::QueryHeads || sp.rule == ShardRule::Columns ||
      (sp.rule == ShardRule::KvHeads && !layout_.kv_replicated()))
    s[size_t(sp.axis)] *= layout_.ranks;
  else if (sp.rule == ShardRule::KvHeads)
    s[size_t(sp.axis)] *= layout_.kv_total;
  return s;
}

TensorData RankView::get(const std::string& name) const {
  if (!has(name)) throw MissingTensorError(label(), name);
  const ShardSpec sp = spec(name);
  auto part = [&](int r) {
    TensorData t = src_.get(rank_name(r, name));
    if (t.is_int) throw FormatError(label(), rank_name(r, name), "a " + std::string(shard_rule_name(sp.rule)) +
                                                                   " shard holds integers");
    return t;
  };
  TensorData out;
  switch (sp.rule) {
    case ShardRule::Replicated:
      out = src_.get(rank_name(0, name));
      break;
    case ShardRule::PartialSum: {
      out = part(0);  // ((p0 + p1) + p2) + ...: the sum in rank order
      for (int r = 1; r < layout_.ranks; ++r) {
        const TensorData p = part(r);
        for (size_t i = 0; i < out.f.size(); ++i) out.f[i] += p.f[i];
      }
      break;
    }
    case ShardRule::KvHeads:
      if (layout_.kv_replicated()) {  // kv head j from the first rank holding it
        std::vector<TensorData> parts;
        for (int64_t j = 0; j < layout_.kv_total; ++j) parts.push_back(part(layout_.holder(j)));
        out = concatenated(std::move(parts), sp.axis);
        break;
      }
      [[fallthrough]];
    case ShardRule::QueryHeads:
    case ShardRule::Columns: {
      std::vector<TensorData> parts;
      for (int r = 0; r < layout_.ranks; ++r) parts.push_back(part(r));
      out = concatenated(std::move(parts), sp.axis);
      break;
    }
  }
  out.name = name;
  return out;
}

std::unique_ptr<RankView> unsharded(const TensorSource& d) {
  if (!d.manifest().extra.count(tensor_parallel_key())) return nullptr;
  return std::make_unique<RankView>(d, parse_config(d.manifest().config, d.label() + " manifest config"));
}

}  // namespace llmdiff
