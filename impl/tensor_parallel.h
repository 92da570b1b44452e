// Tensor parallelism over R ranks in one process (docs/DUMP_FORMAT.md,
// "Tensor parallelism"; the layout of dumps/contract/ranks.h). Each rank
// holds a shard of every layer's weights as views into the checkpoint's
// matrices (no copies): the q/k/v rows of its heads and the o_proj columns
// they feed; MLA's q_b and kv_b rows of its heads (the latent path
// replicated); the gate/up rows and down columns of its part of every MLP
// (the dense one, each expert, the shared expert; the router replicated).
// The forward (impl/forward.h) runs each rank on its shard with its own
// residual stream; the ranks meet only in the all-reduce after o_proj and
// after the MLP/MoE block, a sum of their partial sums in rank order.
//
// The KV store's rows hold every rank's kv heads side by side in rank order
// (R * kv heads per rank slots; GQA with Hkv < R: each rank's replica), MLA's
// latent rows one copy per rank. With R = 1 the one shard is the whole
// model, and everything is as without tensor parallelism.
//
// The zoo's tensor-parallel bugs (zoo::TpFaults) change the shard a rank
// takes (tp-kv-heads-split) or the all-reduce (tp-allreduce-*).
#pragma once
#include <cstdint>
#include <vector>

#include "dumps/contract/ranks.h"
#include "dumps/model/weights.h"
#include "dumps/zoo/bugs.h"
#include "impl/kernels.h"

namespace llmdiff::impl {

// A rank's part of a SwiGLU MLP: its F columns of the intermediate.
struct MlpShard {
  WMat gate, up, down;  // [F, D], [F, D], [D, F]: rows of gate/up, columns of down
  int64_t F = 0;
  explicit operator bool() const { return gate.data != nullptr; }
};

// A rank's views of one layer's weights.
struct LayerShard {
  // GQA: q [Hq_r*Dh, D], k and v [Hkv_r*Dh, D], their biases; MLA: q is
  // q_b_proj's rows of the rank's heads [Hq_r*(Dn+Dr), Rq] (q_proj's without
  // q_lora_rank), kv_b [Hq_r*(Dn+Dv), Rkv]. o: o_proj's columns of those
  // heads [D, Hq_r*Dh] (MLA [D, Hq_r*Dv]).
  WMat q, k, v, o, kv_b;
  WMat q_bias, k_bias, v_bias;  // absent: data null
  MlpShard mlp;                 // a dense layer's MLP
  std::vector<MlpShard> experts;
  MlpShard shared;              // absent: none
};

struct RankShard {
  int rank = 0;
  int64_t q_heads = 0;   // query heads [rank*q_heads, (rank+1)*q_heads)
  int64_t kv_heads = 0;  // kv heads it holds (its own, or one replicated)
  int64_t kv_head0 = 0;  // the model's kv head of its first (tp-kv-heads-split: r mod Hkv)
  int64_t kv_slot0 = 0;  // where its kv heads start in the KV store's rows (in kv heads)
  std::vector<LayerShard> layers;
};

class TensorParallel {
 public:
  // Throws UsageError when `ranks` does not divide the model's heads or
  // intermediate sizes, or a tensor-parallel bug cannot act (R = 1;
  // tp-kv-heads-split with Hkv >= R).
  TensorParallel(const ModelConfig& c, const ModelWeights& w, int ranks, const zoo::TpFaults& faults);
  int ranks() const { return layout_.ranks; }
  const RankLayout& layout() const { return layout_; }
  const RankShard& rank(int r) const { return ranks_[size_t(r)]; }
  // kv heads in a KV store row: every rank's side by side.
  int64_t kv_slots() const { return int64_t(layout_.ranks) * layout_.kv_heads; }

 private:
  RankLayout layout_;
  std::vector<RankShard> ranks_;
};

// The all-reduce of R partial sums of n floats: out = ((p0 + p1) + p2) + ...,
// in rank order (R = 1: p0 as it is). `out` may be parts[0].
void all_reduce(const std::vector<const float*>& parts, int64_t n, float* out);

}  // namespace llmdiff::impl
