// The rank checks of a tensor-parallel candidate (compare/tensor_parallel.h).
#include "compare/tensor_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "compare/noise_floor.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sites.h"

namespace llmdiff::compare {

namespace {

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2g", v);
  return buf;
}

// How far apart two float32 results may be and still be one computation in
// another order: the candidate's dtype's rounding, relative to the value.
double agreement_tolerance(ComputeDType dtype) {
  return dtype == ComputeDType::Float32 || dtype == ComputeDType::Float64 ? 1e-3 : 3e-2;
}

// The candidate's names of `sites` under `prefix`, without it, in step and
// layer order.
std::vector<std::string> names_of(const RankView& cand, const std::string& prefix, std::initializer_list<Site> sites) {
  std::vector<std::string> out;
  for (const std::string& n : cand.names()) {
    if (n.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string own = n.substr(prefix.size());
    const CanonName c = parse_name(own);
    if (c.kind != CanonName::Kind::Layer) continue;
    for (Site s : sites)
      if (c.site == site_name(s)) out.push_back(own);
  }
  sort_canonical(out);
  return out;
}

// rms(a - b) over the rms of b.
double relative(const std::vector<float>& a, const std::vector<float>& b) {
  const int64_t n = int64_t(a.size());
  return rmse(a.data(), b.data(), n) / std::max(rms(b.data(), n), 1e-30);
}

// What the block added to rank 0's residual stream, and the candidates for it.
struct Residual {
  std::vector<float> update;  // result - stream entering the block
  std::vector<float> sum;     // Σ_r partial_r in rank order
  std::vector<float> own;     // rank 0's partial sum
};

std::optional<Residual> residual_at(const RankView& cand, const std::string& prefix, const std::string& name,
                                    std::string* partial_site) {
  const CanonName c = parse_name(name);
  const bool attn = c.site == site_name(Site::AttnResidual);
  const std::string entering =
      attn ? layer_input_name(c.step, c.layer) : layer_name(c.step, c.layer, Site::AttnResidual);
  std::string partial = layer_name(c.step, c.layer, attn ? Site::AttnOut : Site::MlpDown);
  if (!attn && !cand.has(prefix + partial)) partial = layer_name(c.step, c.layer, Site::MoeOut);
  *partial_site = parse_name(partial).site;
  if (!cand.has(prefix + entering) || !cand.has(prefix + partial)) return std::nullopt;
  const TensorData result = cand.get(prefix + name), x = cand.get(prefix + entering);
  if (result.shape != x.shape || result.is_int) return std::nullopt;
  Residual r;
  for (int k = 0; k < cand.ranks(); ++k) {
    const TensorData p = cand.source().get(cand.rank_name(k, prefix + partial));
    if (p.shape != result.shape) return std::nullopt;
    if (k == 0) r.own = p.f, r.sum = p.f;
    else
      for (size_t i = 0; i < p.f.size(); ++i) r.sum[i] += p.f[i];
  }
  r.update.resize(result.f.size());
  for (size_t i = 0; i < result.f.size(); ++i) r.update[i] = result.f[i] - x.f[i];
  return r;
}

std::vector<float> times(const std::vector<float>& v, int k) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float(k) * v[i];
  return out;
}

}  // namespace

std::optional<RankFinding> check_all_reduce(const RankView& cand, const std::string& prefix, ComputeDType dtype) {
  const double tol = agreement_tolerance(dtype);
  const int R = cand.ranks();
  for (const std::string& name : names_of(cand, prefix, {Site::AttnResidual, Site::Out})) {
    std::string partial;
    const std::optional<Residual> res = residual_at(cand, prefix, name, &partial);
    if (!res) continue;
    const double to_sum = relative(res->update, res->sum);
    if (to_sum <= tol) continue;  // this all-reduce is right
    const bool attn = parse_name(name).site == site_name(Site::AttnResidual);
    const std::string where = attn ? "after o_proj" : partial == site_name(Site::MlpDown) ? "after the MLP"
                                                                                         : "after the MoE block";
    const std::string stream = attn ? "the residual stream" : "attn_residual";
    const std::string once = "not + the sum over the " + std::to_string(R) + " ranks (rmse " + num(to_sum) + ")";
    RankFinding f;
    f.at = name;
    const double to_own = relative(res->update, res->own);
    if (to_own <= tol && to_own * 10 < to_sum) {
      f.bug = "tp-allreduce-missing";
      f.rank = 0;
      f.text = name + " = " + stream + " + rank 0's partial sum of " + partial + " only (rmse " + num(to_own) +
               " of the update), " + once + ": the all-reduce " + where +
               " is missing, each rank goes on with its own partial sum";
      return f;
    }
    for (const int k : {R, 2}) {
      if (k < 2) continue;
      const double to_k = relative(res->update, times(res->sum, k));
      if (to_k > tol || to_k * 10 >= to_sum) continue;
      f.bug = "tp-allreduce-twice";
      f.text = name + " = " + stream + " + " + std::to_string(k) + " x the sum of the " + std::to_string(R) +
               " ranks' partial sums of " + partial + " (rmse " + num(to_k) + " of the update), " + once +
               ": the all-reduce " + where + " is applied twice (" +
               (k == R ? "the reduced sum reduced again over the " + std::to_string(R) + " ranks"
                       : std::string("the reduced sum added twice")) + ")";
      return f;
    }
    return std::nullopt;  // the first wrong all-reduce fits no bug of the zoo
  }
  return std::nullopt;
}

std::optional<RankFinding> check_kv_heads(const RankView& cand, const RankView& clean, const std::string& prefix,
                                          ComputeDType dtype) {
  const RankLayout& L = cand.layout();
  if (cand.config().mla.enabled || !L.kv_replicated() || clean.ranks() != cand.ranks()) return std::nullopt;
  const double tol = agreement_tolerance(dtype);
  for (const std::string& name : names_of(cand, prefix, {Site::AttnK, Site::AttnV})) {
    if (!clean.has(prefix + name)) continue;
    // Every kv head as the clean run's ranks hold it.
    std::vector<TensorData> head;
    for (int64_t j = 0; j < L.kv_total; ++j)
      head.push_back(clean.source().get(clean.rank_name(clean.layout().holder(j), prefix + name)));
    for (int r = 0; r < cand.ranks(); ++r) {
      const TensorData mine = cand.source().get(cand.rank_name(r, prefix + name));
      const int64_t expected = L.kv_head(r);
      std::vector<double> to(size_t(L.kv_total), INFINITY);
      for (int64_t j = 0; j < L.kv_total; ++j)
        if (head[size_t(j)].shape == mine.shape) to[size_t(j)] = relative(mine.f, head[size_t(j)].f);
      if (to[size_t(expected)] <= tol) continue;  // its own kv head
      const int64_t held = std::min_element(to.begin(), to.end()) - to.begin();
      if (held == expected || to[size_t(held)] > tol || to[size_t(held)] * 10 >= to[size_t(expected)])
        return std::nullopt;  // a wrong shard, but not another kv head
      const CanonName c = parse_name(name);
      const int64_t q0 = int64_t(r) * L.q_heads, R = cand.ranks();
      RankFinding f;
      f.bug = "tp-kv-heads-split";
      f.at = name;
      f.rank = r;
      f.text = "rank " + std::to_string(r) + "'s " + c.site + " holds kv head " + std::to_string(held) +
               " where its query heads read kv head " + std::to_string(expected) + ": at " + name +
               " its shard is kv head " + std::to_string(held) + " as the clean run over " + std::to_string(R) +
               " ranks computes it (rmse " + num(to[size_t(held)]) + "), not kv head " + std::to_string(expected) +
               " (rmse " + num(to[size_t(expected)]) + ", the one of its query head" +
               (L.q_heads > 1 ? "s " + std::to_string(q0) + ".." + std::to_string(q0 + L.q_heads - 1)
                              : " " + std::to_string(q0)) +
               "); the " + std::to_string(L.kv_total) + " kv heads are split across the " + std::to_string(R) +
               " ranks (rank r takes kv head r mod " + std::to_string(L.kv_total) +
               ") where they should be replicated (rank r: kv head r*" + std::to_string(L.kv_total) + "/" +
               std::to_string(R) + ")";
      return f;
    }
  }
  return std::nullopt;
}

void judge_ranks(const RankView& cand, const RankView* clean, const std::string& prefix, ComputeDType dtype,
                 TensorParallelEvidence& e) {
  e.ranks = cand.ranks();
  std::optional<RankFinding> f = check_all_reduce(cand, prefix, dtype);
  if (!f && clean) f = check_kv_heads(cand, *clean, prefix, dtype);
  if (!f) return;
  e.bug = f->bug;
  e.at = f->at;
  e.rank = f->rank;
  e.text = f->text;
}

}  // namespace llmdiff::compare
