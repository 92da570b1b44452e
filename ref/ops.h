// The ref's ops as small pure functions on libtorch tensors, each mirroring
// one piece of HuggingFace transformers 4.51.3 (modeling_llama.py,
// modeling_qwen2.py, modeling_qwen3.py, modeling_rope_utils.py). The ref's
// forward calls them top to bottom; llmdiff's local-error analysis calls them
// one at a time on a candidate's own inputs (teacher forcing).
// Tensors carry the compute dtype unless a comment says float32.
//
// Every op is the same libtorch call sequence, on the same tensor layouts, as
// the Python it mirrors, so libtorch 1.13 (the build HF's goldens come from)
// reproduces HF's roundings, including bfloat16 matmul accumulation. Two
// departures: float16 matmuls and SiLU, which torch 1.13 lacks on CPU, are
// computed in float32 and rounded once (as GPU kernels do); and in float64
// (the truth mode) the float32 up-casts of RMSNorm, softmax and RoPE become
// float64, so that every op is evaluated in double precision.
#pragma once
#include <torch/torch.h>

#include <functional>

#include "dumps/model/config.h"

namespace llmdiff::ref::ops {

torch::ScalarType torch_dtype(ComputeDType d);

// The dtype HF up-casts to for RMSNorm variance, softmax, RoPE tables and
// DeepSeek-V3's router: float32, or float64 in the truth mode.
torch::ScalarType upcast(torch::ScalarType t);

// LlamaRMSNorm.forward: variance in float32, normalised value cast back to the
// input dtype before the weight multiply. x [..., N], w [N].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);

// nn.Embedding: rows of table [V, D] for ids [T] (int64) -> [T, D].
torch::Tensor embed(const torch::Tensor& table, const torch::Tensor& ids);

// nn.Linear: x [T, in] @ w[out, in]^T (+ b [out]); b may be undefined.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b);

// ROPE_INIT_FUNCTIONS of modeling_rope_utils.py (+ dynamic_rope_update for
// "dynamic"): inverse frequencies [Dh/2] float32 after scaling, for a forward
// whose largest position is seq_len-1, and the attention scaling (1 except yarn).
struct RopeInit {
  torch::Tensor inv_freq;  // [Dh/2] float32 (float64 from the dtype overload)
  double attention_scaling = 1.0;
};
// "dynamic" depends on seq_len only past max_position_embeddings (base grown by
// NTK); below it every type returns the frequencies of the config. A call at
// positions P..P+T-1 of a fresh cache uses rope_init(cfg, P+T); the engine also
// keeps dynamic_rope_update's state across calls (see ref_engine.cpp).
RopeInit rope_init(const ModelConfig& cfg, int64_t seq_len);
// The same in `dtype`: float32 is HF's; float64 evaluates the same formulas in
// double precision (the truth mode).
RopeInit rope_init(const ModelConfig& cfg, int64_t seq_len, torch::ScalarType dtype);

// LlamaRotaryEmbedding.forward: cos/sin [T, Dh] (rotate-half layout, attention
// scaling folded in) computed in inv_freq's dtype (float32), then cast to
// `dtype`. positions: [T] int64.
std::pair<torch::Tensor, torch::Tensor> rope_cos_sin(const RopeInit& r, const torch::Tensor& positions,
                                                     torch::ScalarType dtype);

// rotate_half and apply_rotary_pos_emb for one tensor: x [H, T, Dh], cos/sin [T, Dh].
torch::Tensor rotate_half(const torch::Tensor& x);
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// repeat_kv: [Hkv, S, Dh] -> [Hkv*n_rep, S, Dh], query head h reads kv head h / n_rep.
torch::Tensor repeat_kv(const torch::Tensor& kv, int64_t n_rep);

// eager_attention_forward, piece by piece:
// scores = (q @ k_rep^T) * scaling, q [Hq, T, Dh], k_rep [Hq, S, Dh] -> [Hq, T, S]
torch::Tensor attn_scores(const torch::Tensor& q, const torch::Tensor& k_rep, double scaling);
// The additive causal mask HF builds for a call with P cached tokens and T new
// ones: [T, S] of 0 (allowed) and finfo(dtype).min (masked); sliding_window > 0
// also masks keys at distance >= window (Qwen2/Qwen3 mask construction).
torch::Tensor causal_mask(int64_t T, int64_t P, int64_t sliding_window, torch::ScalarType dtype);
// The mask the model's family builds: LlamaModel's construction (triu, no
// window) for llama, the sliding-window construction of MistralModel /
// Qwen2Model / Qwen3Model otherwise (cfg.sliding_window, 0 = none). Without a
// window both give the same 0 / finfo.min pattern and differ only in the sign
// of some zeros (numerically irrelevant after the add).
torch::Tensor causal_mask(const ModelConfig& cfg, int64_t T, int64_t P, torch::ScalarType dtype);
// 1.0 where the additive mask allows attention (entry == 0), else 0.0: the
// dump's `mask` site. float32 [T, S].
torch::Tensor mask_allowed(const torch::Tensor& additive_mask);
// softmax(scores + mask, dim=-1, dtype=float32) cast back to scores' dtype;
// mask [T, S] broadcasts over heads.
torch::Tensor attn_probs(const torch::Tensor& scores, const torch::Tensor& additive_mask);
// probs [Hq, T, S] @ v_rep [Hq, S, Dh], heads merged -> [T, Hq*Dh]
torch::Tensor attn_ctx(const torch::Tensor& probs, const torch::Tensor& v_rep);

// LlamaMLP's act_fn(gate) * up with act_fn = silu.
torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up);

// ---------------------------------------------------------------------------
// Multi-head latent attention (modeling_deepseek_v3.py)

// apply_rotary_pos_emb_interleave for one tensor (the adjacent pairs of the
// rope dims reordered to halves, then rotate-half RoPE), or apply_rope when
// `interleave` is false. x [H, T, Dr], cos/sin [T, Dr].
torch::Tensor apply_rope_mla(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                             bool interleave);

// ---------------------------------------------------------------------------
// Mixture of experts (modeling_mixtral.py, modeling_qwen2_moe.py,
// modeling_qwen3_moe.py, modeling_deepseek_v3.py)

// The router's linear: gate(x) in the model dtype, or (DeepseekV3TopkRouter)
// F.linear(x.float32, W.float32). x [T, D], W [E, D] -> [T, E].
torch::Tensor router_logits(const torch::Tensor& x, const torch::Tensor& w, const MoeConfig& moe);
// softmax(logits, dtype=float32) or sigmoid(logits): [T, E] float32.
torch::Tensor router_probs(const torch::Tensor& logits, const MoeConfig& moe);

// The routing decision in HF's slot order (torch.topk's): ids [T, K] int64,
// weights [T, K] (model dtype for softmax routers, float32 for DeepSeek-V3).
struct Route {
  torch::Tensor ids, weights;
};
// Softmax routers: top-K of probs, renormalised (norm_topk_prob), cast to
// `dtype`. DeepSeek-V3: choice on probs + bias among the topk_group best
// groups (0.0 fill), weights the unbiased probs of the chosen,
// / (sum + 1e-20), * routed_scaling_factor. `bias` [E] (undefined: none).
Route route(const torch::Tensor& probs, const torch::Tensor& bias, const MoeConfig& moe, torch::ScalarType dtype);
// The weights HF gives experts `ids` [T, K] of a token (any order):
// route()'s formula on those experts, the renormalising sum taken in HF's
// slot order (descending probability for softmax routers).
torch::Tensor route_weights(const torch::Tensor& probs, const torch::Tensor& ids, const MoeConfig& moe,
                            torch::ScalarType dtype);
// The slot-major row order Mixtral / Qwen*-MoE gather each expert's tokens
// in (torch.where over expert_mask[e] = [K, T]): for each (token, k) of ids
// [T, K] sorted ascending, its slot in HF's topk order (descending
// probability). DeepSeek-V3 gathers token-major: slot 0 for all.
torch::Tensor route_slots(const torch::Tensor& probs, const torch::Tensor& ids, const MoeConfig& moe);

// One expert (a SwiGLU MLP): down(silu(gate(x)) * up(x)).
torch::Tensor mlp(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& up,
                  const torch::Tensor& down);
// Every chosen expert's output for its token, [T, K, D] in the order of ids
// [T, K]: expert e (ascending) runs once on its tokens, gathered in the order
// HF gathers them (by `slots`, then token). `expert(e, rows)` runs expert e.
torch::Tensor experts_out(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& slots,
                          const std::function<torch::Tensor(int64_t, const torch::Tensor&)>& expert);
// The routed sum, HF's index_add_ loop: per token, over its experts in
// ascending id (ids sorted ascending), acc = acc + expert_out * weight from
// zero; the accumulator has weights' dtype (float32 for DeepSeek-V3: cast to
// `dtype` at the end). expert_out [T, K, D], weights [T, K] -> [T, D].
torch::Tensor moe_combine(const torch::Tensor& expert_out, const torch::Tensor& weights, torch::ScalarType dtype);

}  // namespace llmdiff::ref::ops
