// The ref's ops as small pure functions on libtorch tensors, each mirroring
// one piece of HuggingFace transformers 4.51.3 (modeling_llama.py,
// modeling_qwen2.py, modeling_qwen3.py, modeling_rope_utils.py). The ref's
// forward calls them top to bottom; llmdiff's local-error analysis calls them
// one at a time on a candidate's own inputs (teacher forcing).
// Tensors carry the compute dtype unless a comment says float32.
#pragma once
#include <torch/torch.h>

#include "dumps/config.h"

namespace llmdiff::ref::ops {

torch::ScalarType torch_dtype(ComputeDType d);

// LlamaRMSNorm.forward: variance in float32, normalised value cast back to the
// input dtype before the weight multiply. x [..., N], w [N].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);

// nn.Linear: x [T, in] @ w[out, in]^T (+ b [out]); b may be undefined.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b);

// ROPE_INIT_FUNCTIONS of modeling_rope_utils.py (+ dynamic_rope_update for
// "dynamic"): inverse frequencies [Dh/2] float32 after scaling, for a forward
// whose largest position is seq_len-1, and the attention scaling (1 except yarn).
struct RopeInit {
  torch::Tensor inv_freq;  // [Dh/2] float32
  double attention_scaling = 1.0;
};
RopeInit rope_init(const ModelConfig& cfg, int64_t seq_len);

// LlamaRotaryEmbedding.forward: cos/sin [T, Dh] (rotate-half layout, attention
// scaling folded in) computed in float32, then cast to `dtype`.
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
// softmax(scores + mask, dim=-1, dtype=float32) cast back to scores' dtype.
torch::Tensor attn_probs(const torch::Tensor& scores, const torch::Tensor& additive_mask);
// probs [Hq, T, S] @ v_rep [Hq, S, Dh], heads merged -> [T, Hq*Dh]
torch::Tensor attn_ctx(const torch::Tensor& probs, const torch::Tensor& v_rep);

// LlamaMLP's act_fn(gate) * up with act_fn = silu.
torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up);

}  // namespace llmdiff::ref::ops
