// The ref's ops. Each function names the HF 4.51.3 code it mirrors; Python
// operators are spelled out as the libtorch calls they dispatch to (e.g.
// `1.0 / t` is Tensor.__rdiv__, i.e. t.reciprocal() * 1.0, and `base ** t` is
// Tensor.__rpow__, i.e. torch.tensor(base, dtype=t.dtype) ** t), because the
// rounding of each step is part of HF's numerics.
#include "ref/ops.h"

#include <cmath>
#include <limits>

#include "dumps/base/errors.h"

namespace llmdiff::ref::ops {

namespace {


// torch 1.13 has no CPU float16 kernels for matmul, SiLU, cos/sin.
bool is_half(const torch::Tensor& t) { return t.scalar_type() == torch::kHalf; }

// Python `num / t` for a tensor t: Tensor.__rdiv__ = t.reciprocal() * num.
torch::Tensor rdiv(const c10::Scalar& num, const torch::Tensor& t) { return t.reciprocal() * num; }

// Python `base ** t` for a float base: Tensor.__rpow__ =
// torch.tensor(base, dtype=result_type(base, t)) ** t.
torch::Tensor rpow(double base, const torch::Tensor& t) {
  return torch::pow(torch::scalar_tensor(base, t.options()), t);
}

// torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  -> [dim/2]
torch::Tensor rope_exponents(int64_t dim, torch::ScalarType dt) {
  return torch::arange(0, dim, 2, torch::kInt64).to(dt) / dim;
}

// torch.finfo(dtype).min
double finfo_min(torch::ScalarType dt) {
  switch (dt) {
    case torch::kFloat: return double(std::numeric_limits<float>::lowest());
    case torch::kDouble: return std::numeric_limits<double>::lowest();
    case torch::kBFloat16: return double(static_cast<float>(std::numeric_limits<c10::BFloat16>::lowest()));
    case torch::kHalf: return double(static_cast<float>(std::numeric_limits<c10::Half>::lowest()));
    default: throw UsageError(std::string("causal mask: unsupported dtype ") + c10::toString(dt));
  }
}

// _compute_default_rope_parameters: 1.0 / (base ** (arange(0, dim, 2) / dim))
torch::Tensor default_inv_freq(double base, int64_t dim, torch::ScalarType dt) {
  return rdiv(1.0, rpow(base, rope_exponents(dim, dt)));  // [dim/2]
}

// _compute_dynamic_ntk_parameters
torch::Tensor dynamic_inv_freq(const ModelConfig& cfg, int64_t seq_len, torch::ScalarType dt) {
  const RopeScaling& rs = cfg.rope_scaling;
  const int64_t dim = cfg.head_dim;
  const int64_t max_pos = cfg.max_position_embeddings;
  const double exponent = double(dim) / double(dim - 2);
  if (seq_len > max_pos) {
    // dynamic_rope_update passes seq_len = torch.max(position_ids) + 1, an
    // int64 tensor, so the rescaled base is computed in tensor arithmetic
    // (float32; float64 in the truth mode):
    // base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    torch::Tensor s = torch::scalar_tensor(seq_len, torch::kInt64).to(dt);      // []
    torch::Tensor grown = ((s * rs.factor) / max_pos - (rs.factor - 1.0)).pow(exponent) * cfg.rope_theta;  // []
    return rdiv(1.0, torch::pow(grown, rope_exponents(dim, dt)));              // [dim/2]
  }
  // At init (and for seq_len <= max_pos) seq_len is the Python int max_pos:
  // the base is rescaled in double precision (by a factor of exactly 1 up to rounding).
  const double base = cfg.rope_theta *
                      std::pow((rs.factor * double(max_pos) / double(max_pos)) - (rs.factor - 1.0), exponent);
  return default_inv_freq(base, dim, dt);
}

// _compute_llama3_parameters
torch::Tensor llama3_inv_freq(const ModelConfig& cfg, torch::ScalarType dt) {
  const RopeScaling& rs = cfg.rope_scaling;
  torch::Tensor inv_freq = default_inv_freq(cfg.rope_theta, cfg.head_dim, dt);  // [Dh/2]
  const double factor = rs.factor;
  const double low_freq_factor = rs.low_freq_factor, high_freq_factor = rs.high_freq_factor;
  const int64_t old_context_len = rs.original_max_position_embeddings;
  const double low_freq_wavelen = double(old_context_len) / low_freq_factor;
  const double high_freq_wavelen = double(old_context_len) / high_freq_factor;

  torch::Tensor wavelen = rdiv(2 * M_PI, inv_freq);  // [Dh/2]
  // wavelen < high_freq_wavelen: kept; wavelen > low_freq_wavelen: divided by factor
  torch::Tensor inv_freq_llama = torch::where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq);
  // in between: interpolated with a smooth factor
  torch::Tensor smooth_factor =
      (rdiv(old_context_len, wavelen) - low_freq_factor) / (high_freq_factor - low_freq_factor);
  torch::Tensor smoothed_inv_freq =
      torch::rsub(smooth_factor, 1) * inv_freq_llama / factor + smooth_factor * inv_freq_llama;
  torch::Tensor is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen);
  return torch::where(is_medium_freq, smoothed_inv_freq, inv_freq_llama);  // [Dh/2]
}

// _compute_yarn_parameters
RopeInit yarn_rope(const ModelConfig& cfg, torch::ScalarType dt) {
  const RopeScaling& rs = cfg.rope_scaling;
  const double base = cfg.rope_theta;
  const int64_t dim = cfg.head_dim;
  double factor = rs.factor;
  // DeepSeek-V3 style configs: with original_max_position_embeddings the
  // factor becomes max_position_embeddings / original_max_position_embeddings.
  int64_t original_max_position_embeddings = cfg.max_position_embeddings;
  if (rs.original_max_position_embeddings > 0) {
    original_max_position_embeddings = rs.original_max_position_embeddings;
    factor = double(cfg.max_position_embeddings) / double(original_max_position_embeddings);
  }
  auto get_mscale = [](double scale, double mscale) {
    if (scale <= 1) return 1.0;
    return 0.1 * mscale * std::log(scale) + 1.0;
  };
  double attention_factor;
  if (rs.has_attention_factor) {
    attention_factor = rs.attention_factor;
  } else if (rs.mscale != 0 && rs.mscale_all_dim != 0) {
    attention_factor = get_mscale(factor, rs.mscale) / get_mscale(factor, rs.mscale_all_dim);
  } else {
    attention_factor = get_mscale(factor, 1);
  }
  // `config.rope_scaling.get("beta_fast") or 32`
  const double beta_fast = rs.beta_fast != 0 ? rs.beta_fast : 32;
  const double beta_slow = rs.beta_slow != 0 ? rs.beta_slow : 1;

  // find_correction_dim / find_correction_range
  auto find_correction_dim = [&](double num_rotations) {
    return (double(dim) * std::log(double(original_max_position_embeddings) / (num_rotations * 2 * M_PI))) /
           (2 * std::log(base));
  };
  const double low = std::max(std::floor(find_correction_dim(beta_fast)), 0.0);
  const double high = std::min(std::ceil(find_correction_dim(beta_slow)), double(dim - 1));

  // linear_ramp_factor(low, high, dim // 2)
  double ramp_max = high;
  if (low == ramp_max) ramp_max += 0.001;  // prevents a singularity
  torch::Tensor linear_func = (torch::arange(dim / 2, dt) - low) / (ramp_max - low);  // [Dh/2]
  torch::Tensor ramp = torch::clamp(linear_func, 0, 1);                                // [Dh/2]

  torch::Tensor pos_freqs = rpow(base, rope_exponents(dim, dt));  // [Dh/2]
  torch::Tensor inv_freq_extrapolation = rdiv(1.0, pos_freqs);
  torch::Tensor inv_freq_interpolation = rdiv(1.0, pos_freqs * factor);
  torch::Tensor extrapolation_factor = torch::rsub(ramp, 1);
  torch::Tensor inv_freq = inv_freq_interpolation * torch::rsub(extrapolation_factor, 1) +
                           inv_freq_extrapolation * extrapolation_factor;  // [Dh/2]
  return {inv_freq, attention_factor};
}

// _prepare_4d_causal_attention_mask_with_cache_position of LlamaModel
// (sliding_style false) or of MistralModel / Qwen2Model / Qwen3Model
// (sliding_style true), called by _update_causal_mask without an
// attention_mask: P+T+1 key columns; eager_attention_forward slices them to S.
torch::Tensor build_causal_mask(int64_t T, int64_t P, bool sliding_style, int64_t sliding_window,
                                torch::ScalarType dtype) {
  if (T <= 0 || P < 0) throw UsageError("causal mask: need T > 0 and P >= 0");
  const int64_t target_length = P + T + 1;
  const double min_dtype = finfo_min(dtype);
  torch::Tensor cache_position = torch::arange(P, P + T, torch::kInt64).reshape({-1, 1});  // [T, 1]
  torch::Tensor key_index = torch::arange(target_length, torch::kInt64);                    // [P+T+1]
  torch::Tensor causal_mask = torch::full({T, target_length}, min_dtype, torch::dtype(dtype));  // [T, P+T+1]
  if (!sliding_style) {
    if (T != 1) causal_mask = torch::triu(causal_mask, 1);
    causal_mask *= key_index > cache_position;
  } else {
    torch::Tensor diagonal_attend_mask = key_index > cache_position;  // [T, P+T+1] bool
    if (sliding_window > 0) {
      torch::Tensor sliding_attend_mask = key_index <= (cache_position - sliding_window);
      diagonal_attend_mask.bitwise_or_(sliding_attend_mask);
    }
    causal_mask *= diagonal_attend_mask;
  }
  return causal_mask.slice(1, 0, P + T);  // [T, S]
}

}  // namespace

torch::ScalarType upcast(torch::ScalarType t) { return t == torch::kDouble ? torch::kDouble : torch::kFloat; }

torch::ScalarType torch_dtype(ComputeDType d) {
  switch (d) {
    case ComputeDType::Float32: return torch::kFloat;
    case ComputeDType::BFloat16: return torch::kBFloat16;
    case ComputeDType::Float16: return torch::kHalf;
    case ComputeDType::Float64: return torch::kDouble;
  }
  throw UsageError("unknown compute dtype");
}

// LlamaRMSNorm.forward (= Qwen2RMSNorm, Qwen3RMSNorm)
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  const torch::ScalarType input_dtype = x.scalar_type();
  torch::Tensor h = x.to(upcast(input_dtype));                // [..., N]
  torch::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);  // [..., 1]
  h = h * torch::rsqrt(variance + eps);                       // [..., N]
  return w * h.to(input_dtype);                               // [..., N]
}

// nn.Embedding.forward (F.embedding)
torch::Tensor embed(const torch::Tensor& table, const torch::Tensor& ids) {
  return at::embedding(table, ids);  // [T, D]
}

// nn.Linear.forward (F.linear) on HF's [1, T, in] activations: the batch
// dimension picks the same at::linear path (mm, or addmm with a bias).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  const bool add_batch = x.dim() == 2;
  torch::Tensor x3 = add_batch ? x.unsqueeze(0) : x;  // [1, T, in]
  torch::Tensor y;
  if (is_half(x3)) {
    // float32 accumulation, one rounding (no CPU float16 gemm in torch 1.13)
    c10::optional<torch::Tensor> b32;
    if (b.defined()) b32 = b.to(torch::kFloat);
    y = at::linear(x3.to(torch::kFloat), w.to(torch::kFloat), b32).to(torch::kHalf);
  } else if (x3.scalar_type() == torch::kDouble && x3.numel() == x3.size(-1)) {
    // float64 is the truth, mirroring no HF kernel: a single row is a
    // matrix-vector product, which streams the weight once instead of
    // packing it for a gemm on every decode step.
    torch::Tensor v = at::mv(w, x3.reshape({-1}));  // [out]
    if (b.defined()) v = v + b;
    y = v.reshape({1, 1, -1});  // [1, 1, out]
  } else {
    c10::optional<torch::Tensor> bias;
    if (b.defined()) bias = b;
    y = at::linear(x3, w, bias);  // [1, T, out]
  }
  return add_batch ? y.squeeze(0) : y;  // [T, out]
}

RopeInit rope_init(const ModelConfig& cfg, int64_t seq_len) { return rope_init(cfg, seq_len, torch::kFloat); }

// ROPE_INIT_FUNCTIONS[rope_type](config, device, seq_len)
RopeInit rope_init(const ModelConfig& cfg, int64_t seq_len, torch::ScalarType dtype) {
  if (dtype != torch::kFloat && dtype != torch::kDouble)
    throw UsageError(std::string("rope_init: inverse frequencies are float32 or float64, not ") + c10::toString(dtype));
  if (cfg.head_dim < 2 || cfg.head_dim % 2 != 0)
    throw ConfigError(cfg.source, "RoPE needs an even head_dim, got " + std::to_string(cfg.head_dim));
  const RopeScaling& rs = cfg.rope_scaling;
  switch (rs.type) {
    case RopeScaling::Type::Default:
      return {default_inv_freq(cfg.rope_theta, cfg.head_dim, dtype), 1.0};
    case RopeScaling::Type::Linear: {
      // _compute_linear_scaling_rope_parameters: inv_freq /= factor
      torch::Tensor inv_freq = default_inv_freq(cfg.rope_theta, cfg.head_dim, dtype);
      inv_freq.div_(rs.factor);
      return {inv_freq, 1.0};
    }
    case RopeScaling::Type::Dynamic:
      if (cfg.head_dim <= 2) throw ConfigError(cfg.source, "dynamic RoPE needs head_dim > 2");
      return {dynamic_inv_freq(cfg, seq_len, dtype), 1.0};
    case RopeScaling::Type::Llama3:
      if (rs.original_max_position_embeddings <= 0)
        throw ConfigError(cfg.source, "llama3 RoPE needs rope_scaling.original_max_position_embeddings");
      return {llama3_inv_freq(cfg, dtype), 1.0};
    case RopeScaling::Type::Yarn:
      return yarn_rope(cfg, dtype);
  }
  throw ConfigError(cfg.source, "unsupported rope type");
}

// LlamaRotaryEmbedding.forward
std::pair<torch::Tensor, torch::Tensor> rope_cos_sin(const RopeInit& r, const torch::Tensor& positions,
                                                     torch::ScalarType dtype) {
  using torch::indexing::None;
  using torch::indexing::Slice;
  const torch::ScalarType f = r.inv_freq.scalar_type();  // float32 (float64 in the truth mode)
  torch::Tensor inv_freq_expanded = r.inv_freq.index({None, Slice(), None}).to(f).expand({1, -1, 1});  // [1, Dh/2, 1]
  torch::Tensor position_ids_expanded = positions.reshape({1, 1, -1}).to(f);                           // [1, 1, T]
  torch::Tensor freqs = torch::matmul(inv_freq_expanded, position_ids_expanded).transpose(1, 2);     // [1, T, Dh/2]
  torch::Tensor emb = torch::cat({freqs, freqs}, -1);                                                // [1, T, Dh]
  torch::Tensor cos = emb.cos() * r.attention_scaling;
  torch::Tensor sin = emb.sin() * r.attention_scaling;
  return {cos.to(dtype).squeeze(0), sin.to(dtype).squeeze(0)};  // [T, Dh] each
}

// rotate_half
torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  torch::Tensor x1 = x.slice(-1, 0, half);  // [..., Dh/2]
  torch::Tensor x2 = x.slice(-1, half);     // [..., Dh/2]
  return torch::cat({-x2, x1}, -1);         // [..., Dh]
}

// apply_rotary_pos_emb for one of q / k, with HF's batch dim and
// cos.unsqueeze(1): q_embed = (q * cos) + (rotate_half(q) * sin)
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  torch::Tensor x4 = x.unsqueeze(0);                   // [1, H, T, Dh]
  torch::Tensor c = cos.unsqueeze(0).unsqueeze(1);     // [1, 1, T, Dh]
  torch::Tensor s = sin.unsqueeze(0).unsqueeze(1);     // [1, 1, T, Dh]
  return ((x4 * c) + (rotate_half(x4) * s)).squeeze(0);  // [H, T, Dh]
}

// repeat_kv
torch::Tensor repeat_kv(const torch::Tensor& kv, int64_t n_rep) {
  if (n_rep == 1) return kv;
  const int64_t h_kv = kv.size(0), s = kv.size(1), dh = kv.size(2);
  return kv.unsqueeze(1).expand({h_kv, n_rep, s, dh}).reshape({h_kv * n_rep, s, dh});  // [Hq, S, Dh]
}

// eager_attention_forward: torch.matmul(query, key_states.transpose(2, 3)) * scaling
torch::Tensor attn_scores(const torch::Tensor& q, const torch::Tensor& k_rep, double scaling) {
  torch::Tensor q4 = q.unsqueeze(0);      // [1, Hq, T, Dh]
  torch::Tensor k4 = k_rep.unsqueeze(0);  // [1, Hq, S, Dh]
  torch::Tensor scores;
  if (is_half(q4)) {
    scores = torch::matmul(q4.to(torch::kFloat), k4.to(torch::kFloat).transpose(2, 3)).to(torch::kHalf);
  } else {
    scores = torch::matmul(q4, k4.transpose(2, 3));  // [1, Hq, T, S]
  }
  return (scores * scaling).squeeze(0);  // [Hq, T, S]
}

torch::Tensor causal_mask(int64_t T, int64_t P, int64_t sliding_window, torch::ScalarType dtype) {
  return build_causal_mask(T, P, sliding_window > 0, sliding_window, dtype);
}

torch::Tensor causal_mask(const ModelConfig& cfg, int64_t T, int64_t P, torch::ScalarType dtype) {
  const bool sliding_style = cfg.family == Family::Qwen2 || cfg.family == Family::Qwen3 || cfg.family == Family::Mixtral ||
                             cfg.model_type == "mistral";  // DeepseekV3Model builds the Llama mask
  return build_causal_mask(T, P, sliding_style, cfg.sliding_window, dtype);
}

torch::Tensor mask_allowed(const torch::Tensor& additive_mask) {
  return (additive_mask == 0).to(torch::kFloat);  // [T, S]
}

// eager_attention_forward: attn_weights + causal_mask, then
// softmax(dim=-1, dtype=torch.float32).to(query.dtype)
torch::Tensor attn_probs(const torch::Tensor& scores, const torch::Tensor& additive_mask) {
  torch::Tensor masked = scores + additive_mask;  // [Hq, T, S]
  return torch::softmax(masked, -1, upcast(scores.scalar_type())).to(scores.scalar_type());
}

// eager_attention_forward: torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous(),
// then LlamaAttention's reshape(*input_shape, -1)
torch::Tensor attn_ctx(const torch::Tensor& probs, const torch::Tensor& v_rep) {
  const int64_t T = probs.size(1), Hq = v_rep.size(0), Dh = v_rep.size(2);
  torch::Tensor p4 = probs.unsqueeze(0);  // [1, Hq, T, S]
  torch::Tensor v4 = v_rep.unsqueeze(0);  // [1, Hq, S, Dh]
  torch::Tensor out;
  if (is_half(p4)) {
    out = torch::matmul(p4.to(torch::kFloat), v4.to(torch::kFloat)).to(torch::kHalf);
  } else {
    out = torch::matmul(p4, v4);  // [1, Hq, T, Dh]
  }
  out = out.transpose(1, 2).contiguous();  // [1, T, Hq, Dh]
  return out.reshape({T, Hq * Dh});        // [T, Hq*Dh]
}

// LlamaMLP.forward's act_fn(gate_proj(x)) * up_proj(x), act_fn = SiLU
torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  if (is_half(gate)) return torch::silu(gate.to(torch::kFloat)).to(torch::kHalf) * up;
  return torch::silu(gate) * up;  // [T, F]
}

}  // namespace llmdiff::ref::ops
