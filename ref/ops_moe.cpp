// The ref's mixture-of-experts and MLA ops (ref/ops.h), mirroring
// MixtralSparseMoeBlock (modeling_mixtral.py), Qwen2MoeSparseMoeBlock,
// Qwen3MoeSparseMoeBlock and DeepseekV3TopkRouter / DeepseekV3MoE /
// apply_rotary_pos_emb_interleave (modeling_deepseek_v3.py) of transformers
// 4.51.3, the same libtorch calls on the same layouts.
#include <algorithm>
#include <numeric>

#include "dumps/base/errors.h"
#include "ref/ops.h"

namespace llmdiff::ref::ops {

// apply_rotary_pos_emb_interleave: q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
torch::Tensor apply_rope_mla(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                             bool interleave) {
  if (!interleave) return apply_rope(x, cos, sin);
  const int64_t H = x.size(0), T = x.size(1), Dr = x.size(2);
  torch::Tensor halves = x.reshape({H, T, Dr / 2, 2}).transpose(3, 2).reshape({H, T, Dr});  // [H, T, Dr]
  return apply_rope(halves, cos, sin);                                                        // [H, T, Dr]
}

// self.gate(hidden_states), or DeepseekV3TopkRouter's
// F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
torch::Tensor router_logits(const torch::Tensor& x, const torch::Tensor& w, const MoeConfig& moe) {
  if (moe.scoring == MoeConfig::Scoring::Sigmoid) {
    const torch::ScalarType up = upcast(x.scalar_type());
    return at::linear(x.to(up), w.to(up));  // [T, E]
  }
  return at::linear(x, w);  // [T, E]
}

// F.softmax(router_logits, dim=1, dtype=torch.float) / router_logits.sigmoid()
torch::Tensor router_probs(const torch::Tensor& logits, const MoeConfig& moe) {
  if (moe.scoring == MoeConfig::Scoring::Sigmoid) return logits.sigmoid();  // [T, E]
  return torch::softmax(logits, 1, upcast(logits.scalar_type()));          // [T, E]
}

namespace {

// DeepseekV3TopkRouter.get_topk_indices
torch::Tensor deepseek_choice(const torch::Tensor& scores, const torch::Tensor& bias, const MoeConfig& m) {
  const int64_t E = m.num_experts, G = m.n_group;
  torch::Tensor choice = scores.view({-1, E});                                   // [T, E]
  if (bias.defined()) choice = choice + bias.to(scores.scalar_type()).unsqueeze(0);
  torch::Tensor group_scores =
      std::get<0>(choice.view({-1, G, E / G}).topk(2, -1)).sum(-1);                // [T, G]
  torch::Tensor group_idx = std::get<1>(torch::topk(group_scores, m.topk_group, -1, true, /*sorted=*/false));
  torch::Tensor group_mask = torch::zeros_like(group_scores);
  group_mask.scatter_(1, group_idx, 1);                                           // [T, G]
  torch::Tensor score_mask = group_mask.unsqueeze(-1).expand({-1, G, E / G}).reshape({-1, E});  // [T, E]
  choice = choice.masked_fill(score_mask.to(torch::kBool).logical_not(), 0.0);
  return std::get<1>(torch::topk(choice, m.top_k, -1, true, /*sorted=*/false));  // [T, K]
}

// topk_weights /= topk_weights.sum(dim=-1, keepdim=True) (+ 1e-20 for DeepSeek-V3)
torch::Tensor renormalise(const torch::Tensor& w, const MoeConfig& m) {
  if (!m.norm_topk_prob) return w;
  if (m.scoring == MoeConfig::Scoring::Sigmoid) return w / (w.sum(-1, true) + 1e-20);
  return w / w.sum(-1, true);
}

torch::Tensor finish_weights(const torch::Tensor& w, const MoeConfig& m, torch::ScalarType dtype) {
  if (m.scoring == MoeConfig::Scoring::Sigmoid) return renormalise(w, m) * m.routed_scaling_factor;  // float32
  // A softmax router with a routed_scaling_factor (DeepSeek-V2's greedy
  // choice, a deepseek2 GGUF's expert_weights_scale): scaled in float32.
  if (m.routed_scaling_factor != 1.0) return (renormalise(w, m) * m.routed_scaling_factor).to(dtype);
  return renormalise(w, m).to(dtype);  // routing_weights.to(hidden_states.dtype)
}

}  // namespace

Route route(const torch::Tensor& probs, const torch::Tensor& bias, const MoeConfig& m, torch::ScalarType dtype) {
  if (m.scoring == MoeConfig::Scoring::Sigmoid) {
    torch::Tensor ids = deepseek_choice(probs, bias, m);  // [T, K]
    return {ids, finish_weights(probs.gather(1, ids), m, dtype)};
  }
  auto [w, ids] = torch::topk(probs, m.top_k, -1);  // [T, K] each, descending
  return {ids, finish_weights(w, m, dtype)};
}

torch::Tensor route_weights(const torch::Tensor& probs, const torch::Tensor& ids, const MoeConfig& m,
                            torch::ScalarType dtype) {
  // HF sums the chosen in topk's order: by descending probability (softmax
  // routers; DeepSeek-V3's unsorted topk order is unknown here, taken by
  // descending choice score too).
  torch::Tensor chosen = probs.gather(1, ids);                                  // [T, K]
  torch::Tensor order = std::get<1>(chosen.sort(-1, /*descending=*/true));      // [T, K]
  torch::Tensor w = finish_weights(chosen.gather(1, order), m, dtype);          // [T, K], slot order
  return torch::empty_like(w).scatter_(1, order, w);                            // [T, K], ids' order
}

torch::Tensor route_slots(const torch::Tensor& probs, const torch::Tensor& ids, const MoeConfig& m) {
  if (m.scoring == MoeConfig::Scoring::Sigmoid) return torch::zeros_like(ids);  // token-major
  torch::Tensor chosen = probs.gather(1, ids);                                    // [T, K]
  torch::Tensor order = std::get<1>(chosen.sort(-1, /*descending=*/true));        // slot -> k
  torch::Tensor slot = torch::arange(ids.size(1), torch::kLong).expand_as(ids).contiguous();
  return torch::empty_like(ids).scatter_(1, order, slot);                         // k -> slot
}

// Qwen3MoeMLP / MixtralBlockSparseTop2MLP / DeepseekV3MLP.forward
torch::Tensor mlp(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& up,
                  const torch::Tensor& down) {
  const torch::Tensor none;
  return ops::linear(swiglu(ops::linear(x, gate, none), ops::linear(x, up, none)), down, none);  // [N, D]
}

torch::Tensor experts_out(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& slots,
                          const std::function<torch::Tensor(int64_t, const torch::Tensor&)>& expert) {
  const int64_t T = ids.size(0), K = ids.size(1), D = x.size(-1);
  torch::Tensor id = ids.to(torch::kLong).contiguous(), sl = slots.to(torch::kLong).contiguous();
  const int64_t* pid = id.data_ptr<int64_t>();
  const int64_t* psl = sl.data_ptr<int64_t>();
  // (slot, token, k) of every choice, in the order torch.where visits
  // expert_mask[e]: slot-major (Mixtral, Qwen) or token-major (slots all 0).
  std::vector<std::array<int64_t, 3>> picks;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) picks.push_back({psl[t * K + k], t, k});
  std::sort(picks.begin(), picks.end());
  std::vector<int64_t> experts(size_t(T * K));
  for (size_t i = 0; i < experts.size(); ++i) experts[i] = pid[i];
  std::sort(experts.begin(), experts.end());
  experts.erase(std::unique(experts.begin(), experts.end()), experts.end());
  torch::Tensor out = torch::zeros({T, K, D}, x.options());  // [T, K, D]
  for (int64_t e : experts) {
    std::vector<int64_t> tokens, flat;
    for (const auto& p : picks)
      if (pid[p[1] * K + p[2]] == e) {
        tokens.push_back(p[1]);
        flat.push_back(p[1] * K + p[2]);
      }
    torch::Tensor rows = x.index_select(0, torch::tensor(tokens, torch::kLong));  // [N, D]
    torch::Tensor y = expert(e, rows);                                              // [N, D]
    out.view({T * K, D}).index_copy_(0, torch::tensor(flat, torch::kLong), y);
  }
  return out;
}

// final_hidden_states.index_add_(0, top_x, expert_out * weight) for experts
// in ascending id, from zeros of the weights' dtype.
torch::Tensor moe_combine(const torch::Tensor& expert_out, const torch::Tensor& weights, torch::ScalarType dtype) {
  const int64_t T = expert_out.size(0), K = expert_out.size(1), D = expert_out.size(2);
  torch::Tensor acc = torch::zeros({T, D}, expert_out.options().dtype(weights.scalar_type()));  // [T, D]
  for (int64_t k = 0; k < K; ++k) acc = acc + expert_out.select(1, k) * weights.select(1, k).unsqueeze(-1);
  return acc.to(dtype);  // [T, D]
}

}  // namespace llmdiff::ref::ops
