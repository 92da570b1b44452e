// The shards of tensor parallelism (tensor_parallel.h): views of rows and
// columns of the checkpoint's matrices, by the split of dumps/contract/ranks.h.
#include "impl/tensor_parallel.h"

#include <algorithm>

#include "dumps/base/errors.h"

namespace llmdiff::impl {

namespace {

// Rank r's part of an MLP of F columns: gate/up rows, down columns.
MlpShard mlp_shard(const MlpWeights& m, int r, int R) {
  MlpShard s;
  if (!m.gate) return s;
  const int64_t F = m.gate.shape[0] / R;
  s.F = F;
  s.gate = row_view(wmat(m.gate), r * F, F);
  s.up = row_view(wmat(m.up), r * F, F);
  s.down = col_view(wmat(m.down), r * F, F);
  return s;
}

// Elements [c0, c0 + n) of a bias, or an absent one.
WMat bias_part(const WeightView& b, int64_t c0, int64_t n) { return b ? col_view(wmat(b), c0, n) : WMat{}; }

LayerShard layer_shard(const ModelConfig& c, const LayerWeights& L, const RankShard& k, int R) {
  LayerShard s;
  const int64_t h0 = int64_t(k.rank) * k.q_heads, Hq = k.q_heads;
  if (c.mla.enabled) {
    const int64_t Dk = c.mla.qk_head_dim(), Dn = c.mla.qk_nope_head_dim, Dv = c.mla.v_head_dim;
    s.q = row_view(wmat(L.q), h0 * Dk, Hq * Dk);
    s.kv_b = row_view(wmat(L.kv_b), h0 * (Dn + Dv), Hq * (Dn + Dv));
    s.o = col_view(wmat(L.o), h0 * Dv, Hq * Dv);
  } else {
    const int64_t Dh = c.head_dim, kv0 = k.kv_head0 * Dh, kvn = k.kv_heads * Dh;
    s.q = row_view(wmat(L.q), h0 * Dh, Hq * Dh);
    s.k = row_view(wmat(L.k), kv0, kvn);
    s.v = row_view(wmat(L.v), kv0, kvn);
    s.o = col_view(wmat(L.o), h0 * Dh, Hq * Dh);
    s.q_bias = bias_part(L.q_bias, h0 * Dh, Hq * Dh);
    s.k_bias = bias_part(L.k_bias, kv0, kvn);
    s.v_bias = bias_part(L.v_bias, kv0, kvn);
  }
  s.mlp = mlp_shard(L.mlp, k.rank, R);
  for (const MlpWeights& e : L.experts) s.experts.push_back(mlp_shard(e, k.rank, R));
  s.shared = mlp_shard(L.shared, k.rank, R);
  return s;
}

}  // namespace

TensorParallel::TensorParallel(const ModelConfig& c, const ModelWeights& w, int ranks, const zoo::TpFaults& faults)
    : layout_(RankLayout::of(c, ranks)) {
  if (faults.any() && ranks == 1)
    throw UsageError("impl: the tensor-parallel bugs act between ranks: run with R > 1 ranks (--tp)");
  if (faults.kv_heads_split && !layout_.kv_replicated())
    throw UsageError("impl: tp-kv-heads-split acts when the ranks outnumber the kv heads (" + std::to_string(ranks) +
                     " ranks, " + std::to_string(layout_.kv_total) + " kv heads): every rank then has kv heads of "
                     "its own");
  for (int r = 0; r < ranks; ++r) {
    RankShard k;
    k.rank = r;
    k.q_heads = layout_.q_heads;
    k.kv_heads = layout_.kv_heads;
    k.kv_head0 = faults.kv_heads_split ? r % layout_.kv_total : layout_.kv_head(r);
    k.kv_slot0 = int64_t(r) * layout_.kv_heads;
    for (const LayerWeights& L : w.layers) k.layers.push_back(layer_shard(c, L, k, ranks));
    ranks_.push_back(std::move(k));
  }
}

void all_reduce(const std::vector<const float*>& parts, int64_t n, float* out) {
  if (parts.empty()) return;
  if (parts[0] != out) std::copy_n(parts[0], n, out);
  for (size_t r = 1; r < parts.size(); ++r)
    for (int64_t i = 0; i < n; ++i) out[i] += parts[r][i];
}

}  // namespace llmdiff::impl
