// The golden model: LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM
// of transformers 4.51.3 (eager attention, DynamicCache), one forward for all
// three families. The families differ only in config fields: q/k/v and o_proj
// biases (qkv_bias, o_bias), Qwen3's per-head q_norm/k_norm (qk_norm) and the
// mask construction (ops::causal_mask(cfg, ...)).
#include "ref/ref_engine.h"

#include <dlfcn.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "dumps/errors.h"
#include "dumps/names.h"
#include "ref/ops.h"
#include "ref/weights.h"

namespace llmdiff::ref {

namespace {

// Reports `t` (any float dtype, any layout) as contiguous float32.
void emit(Observer& obs, const std::string& name, const torch::Tensor& t) {
  if (!obs.wants(name)) return;
  torch::Tensor f = t.to(torch::kFloat).contiguous();
  obs.on_f32(name, Shape(f.sizes().begin(), f.sizes().end()), f.data_ptr<float>());
}

void emit_i64(Observer& obs, const std::string& name, const torch::Tensor& t) {
  if (!obs.wants(name)) return;
  torch::Tensor i = t.to(torch::kInt64).contiguous();
  obs.on_i64(name, Shape(i.sizes().begin(), i.sizes().end()), i.data_ptr<int64_t>());
}

void check_config(const ModelConfig& c) {
  auto fail = [&](const std::string& what) { throw ConfigError(c.source, what); };
  if (c.hidden_size <= 0 || c.intermediate_size <= 0 || c.num_hidden_layers <= 0 || c.vocab_size <= 0)
    fail("the ref needs positive hidden_size, intermediate_size, num_hidden_layers and vocab_size");
  if (c.num_attention_heads <= 0 || c.num_key_value_heads <= 0 ||
      c.num_attention_heads % c.num_key_value_heads != 0)
    fail("the ref needs num_attention_heads (" + std::to_string(c.num_attention_heads) +
         ") to be a positive multiple of num_key_value_heads (" + std::to_string(c.num_key_value_heads) + ")");
  if (c.head_dim < 2 || c.head_dim % 2 != 0)
    fail("the ref needs an even head_dim for RoPE, got " + std::to_string(c.head_dim));
  if (c.rope_theta <= 0) fail("the ref needs rope_theta > 0");
  if (c.max_position_embeddings <= 0) fail("the ref needs max_position_embeddings > 0");
  if (c.rope_scaling.type == RopeScaling::Type::Dynamic && c.head_dim <= 2)
    fail("dynamic RoPE needs head_dim > 2");
  if (c.rope_scaling.type == RopeScaling::Type::Llama3 && c.rope_scaling.original_max_position_embeddings <= 0)
    fail("llama3 RoPE needs rope_scaling.original_max_position_embeddings");
}

// The weights were checked against the config they were loaded with; the
// model's config must describe the same shapes.
void check_weights_match(const ModelConfig& c, const ModelConfig& loaded) {
  auto same = [&](const char* field, int64_t a, int64_t b) {
    if (a != b)
      throw ConfigError(c.source, std::string("config field ") + field + " is " + std::to_string(a) +
                                      " but the weights were loaded for " + std::to_string(b));
  };
  same("hidden_size", c.hidden_size, loaded.hidden_size);
  same("intermediate_size", c.intermediate_size, loaded.intermediate_size);
  same("num_hidden_layers", c.num_hidden_layers, loaded.num_hidden_layers);
  same("num_attention_heads * head_dim", c.q_dim(), loaded.q_dim());
  same("num_key_value_heads * head_dim", c.kv_dim(), loaded.kv_dim());
  same("head_dim", c.head_dim, loaded.head_dim);
  same("vocab_size", c.vocab_size, loaded.vocab_size);
}

class RefEngine : public Engine {
 public:
  RefEngine(const Model& model, ComputeDType dtype, std::shared_ptr<const RefWeights> shared)
      : model_(model), cfg_(model_.config), dtype_(dtype) {
    if (!model_.weights) throw UsageError("the ref needs a model with weights");
    check_config(cfg_);
    check_weights_match(cfg_, model_.weights->config());
    torch::NoGradGuard no_grad;
    st_ = ops::torch_dtype(dtype_);
    rope_dtype_ = st_ == torch::kDouble ? torch::kDouble : torch::kFloat;
    n_rep_ = cfg_.num_attention_heads / cfg_.num_key_value_heads;
    scaling_ = std::pow(double(cfg_.head_dim), -0.5);  // self.head_dim**-0.5

    if (shared && shared->st != st_)
      throw UsageError(std::string("ref: shared weights are ") + c10::toString(shared->st) + ", the engine computes in " +
                       compute_dtype_name(dtype_));
    w_ = shared ? shared : std::make_shared<const RefWeights>(*model_.weights, st_);
    for (const RefWeights::Layer& L : w_->layers) {
      if (cfg_.qkv_bias && !(L.q_bias.defined() && L.k_bias.defined() && L.v_bias.defined()))
        throw ConfigError(cfg_.source, "config asks for q/k/v biases but the checkpoint lacks them");
      if (cfg_.o_bias && !L.o_bias.defined())
        throw ConfigError(cfg_.source, "config asks for an o_proj bias but the checkpoint lacks it");
      if (cfg_.qk_norm && !(L.q_norm.defined() && L.k_norm.defined()))
        throw ConfigError(cfg_.source, "Qwen3 needs q_norm/k_norm weights, the checkpoint lacks them");
    }
    if (int64_t(w_->layers.size()) != cfg_.num_hidden_layers)
      throw ConfigError(cfg_.source, "the checkpoint holds " + std::to_string(w_->layers.size()) +
                                         " layers, the config " + std::to_string(cfg_.num_hidden_layers));

    // LlamaRotaryEmbedding.__init__: inv_freq from the config, seq_len unset.
    original_rope_ = ops::rope_init(cfg_, 0, rope_dtype_);
    rope_ = original_rope_;
    max_seq_len_cached_ = cfg_.max_position_embeddings;
    reset();
  }

  // A fresh DynamicCache on the same model. The dynamic-NTK state of the
  // rotary module (dynamic_rope_update) belongs to the model, not to the
  // cache, so it persists, as in HF; a new engine is a freshly loaded model.
  void reset() override {
    k_cache_.assign(w_->layers.size(), torch::Tensor());
    v_cache_.assign(w_->layers.size(), torch::Tensor());
    cached_ = 0;
  }

  std::string producer() const override {
    return std::string("llmdiff ref (libtorch ") + TORCH_VERSION + ", HF transformers 4.51.3 eager numerics) / " +
           compute_dtype_name(dtype_);
  }
  std::string dtype_name() const override { return compute_dtype_name(dtype_); }

  std::vector<float> forward(const std::vector<int64_t>& tokens, int step, Observer& obs) override {
    try {
      return forward_impl(tokens, step, obs);
    } catch (const c10::Error& e) {
      throw Error(cfg_.source + ": step " + std::to_string(step) + ": libtorch: " + e.what_without_backtrace());
    }
  }

 private:
  std::vector<float> forward_impl(const std::vector<int64_t>& tokens, int step, Observer& obs);

  // dynamic_rope_update (rope_type "dynamic" only): the rotary module grows
  // its inverse frequencies to a call's sequence length when it exceeds the
  // longest so far (initially max_position_embeddings), keeps them for
  // shorter calls, and returns to the original ones for a call shorter than
  // max_position_embeddings. Within one cache sequence lengths only grow, so
  // each call past max_position_embeddings uses its own length.
  void update_dynamic_rope(int64_t seq_len) {
    if (cfg_.rope_scaling.type != RopeScaling::Type::Dynamic) return;
    const int64_t original_max_seq_len = cfg_.max_position_embeddings;
    if (seq_len > max_seq_len_cached_) {
      rope_ = ops::rope_init(cfg_, seq_len, rope_dtype_);
      max_seq_len_cached_ = seq_len;
    }
    if (seq_len < original_max_seq_len && max_seq_len_cached_ > original_max_seq_len) {
      rope_ = original_rope_;
      max_seq_len_cached_ = original_max_seq_len;
    }
  }

  Model model_;  // keeps the weight maps alive
  const ModelConfig& cfg_;
  ComputeDType dtype_;
  torch::ScalarType st_ = torch::kFloat, rope_dtype_ = torch::kFloat;
  int64_t n_rep_ = 1;
  double scaling_ = 1.0;
  // In place from the mmap where the stored dtype is the compute dtype; may be
  // shared with other users of the same model at the same dtype.
  std::shared_ptr<const RefWeights> w_;
  // DynamicCache: per layer [Hkv, P, Dh], undefined before the first call
  std::vector<torch::Tensor> k_cache_, v_cache_;
  int64_t cached_ = 0;
  ops::RopeInit original_rope_, rope_;
  int64_t max_seq_len_cached_ = 0;
};

// LlamaForCausalLM.forward (LlamaModel.forward + lm_head), equally
// Qwen2ForCausalLM / Qwen3ForCausalLM, for one call with a DynamicCache.
std::vector<float> RefEngine::forward_impl(const std::vector<int64_t>& tokens, int step, Observer& obs) {
  torch::NoGradGuard no_grad;
  const int64_t T = int64_t(tokens.size());
  if (T == 0) throw UsageError("forward: no tokens");
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= cfg_.vocab_size)
      throw UsageError("forward: token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                       " is outside the vocabulary [0, " + std::to_string(cfg_.vocab_size) + ")");
  const int64_t P = cached_, S = P + T;
  const int64_t Hq = cfg_.num_attention_heads, Hkv = cfg_.num_key_value_heads, Dh = cfg_.head_dim;
  const double eps = cfg_.rms_norm_eps;
  auto site = [&](const std::string& s) { return step_name(step, s); };

  torch::Tensor ids = torch::tensor(tokens, torch::kInt64);            // [T]
  torch::Tensor positions = torch::arange(P, S, torch::kInt64);        // [T]  cache_position = position_ids[0]

  // rotary_emb(hidden_states, position_ids), with dynamic_rope_update
  update_dynamic_rope(S);  // seq_len = max(position_ids) + 1
  if (step == 0) emit(obs, "rope.inv_freq", rope_.inv_freq);
  emit_i64(obs, site("tokens"), ids);
  emit_i64(obs, site("positions"), positions);
  auto [cos, sin] = ops::rope_cos_sin(rope_, positions, st_);  // [T, Dh] each
  emit(obs, site("rope.cos"), cos);
  emit(obs, site("rope.sin"), sin);

  // _update_causal_mask (no attention_mask given)
  torch::Tensor mask = ops::causal_mask(cfg_, T, P, st_);  // [T, S] additive
  emit(obs, site("mask"), ops::mask_allowed(mask));

  torch::Tensor h = ops::embed(w_->embed, ids);  // [T, D]
  emit(obs, site("embed"), h);

  for (size_t li = 0; li < w_->layers.size(); ++li) {
    const RefWeights::Layer& L = w_->layers[li];
    auto lsite = [&](const std::string& s) { return layer_name(step, int(li), s); };

    // LlamaDecoderLayer: input_layernorm -> self_attn
    torch::Tensor x = ops::rms_norm(h, L.input_norm, eps);  // [T, D]
    emit(obs, lsite("attn_norm"), x);

    // LlamaAttention.forward (Qwen2Attention, Qwen3Attention)
    torch::Tensor q = ops::linear(x, L.q, L.q_bias);  // [T, Hq*Dh]
    torch::Tensor k = ops::linear(x, L.k, L.k_bias);  // [T, Hkv*Dh]
    torch::Tensor v = ops::linear(x, L.v, L.v_bias);  // [T, Hkv*Dh]
    emit(obs, lsite("attn.q"), q);
    emit(obs, lsite("attn.k"), k);
    emit(obs, lsite("attn.v"), v);
    torch::Tensor qh = q.view({T, Hq, Dh});   // [T, Hq, Dh]
    torch::Tensor kh = k.view({T, Hkv, Dh});  // [T, Hkv, Dh]
    if (cfg_.qk_norm) {
      // Qwen3Attention: q_norm / k_norm over head_dim, before the transpose
      qh = ops::rms_norm(qh, L.q_norm, eps);  // [T, Hq, Dh]
      kh = ops::rms_norm(kh, L.k_norm, eps);  // [T, Hkv, Dh]
      emit(obs, lsite("attn.q_norm"), qh.reshape({T, Hq * Dh}));
      emit(obs, lsite("attn.k_norm"), kh.reshape({T, Hkv * Dh}));
    }
    torch::Tensor q_rope = ops::apply_rope(qh.transpose(0, 1), cos, sin);  // [Hq, T, Dh]
    torch::Tensor k_rope = ops::apply_rope(kh.transpose(0, 1), cos, sin);  // [Hkv, T, Dh]
    torch::Tensor v_new = v.view({T, Hkv, Dh}).transpose(0, 1);            // [Hkv, T, Dh]
    emit(obs, lsite("attn.q_rope"), q_rope);
    emit(obs, lsite("attn.k_rope"), k_rope);

    // DynamicCache.update: the first call stores the tensors, later ones concatenate
    torch::Tensor& kc = k_cache_[li];
    torch::Tensor& vc = v_cache_[li];
    kc = kc.defined() ? torch::cat({kc, k_rope}, 1) : k_rope;  // [Hkv, S, Dh]
    vc = vc.defined() ? torch::cat({vc, v_new}, 1) : v_new;    // [Hkv, S, Dh]
    emit(obs, lsite("attn.k_cache"), kc);
    emit(obs, lsite("attn.v_cache"), vc);

    // eager_attention_forward
    torch::Tensor k_rep = ops::repeat_kv(kc, n_rep_);  // [Hq, S, Dh]
    torch::Tensor v_rep = ops::repeat_kv(vc, n_rep_);  // [Hq, S, Dh]
    emit(obs, lsite("attn.k_rep"), k_rep);
    emit(obs, lsite("attn.v_rep"), v_rep);
    torch::Tensor scores = ops::attn_scores(q_rope, k_rep, scaling_);  // [Hq, T, S]
    emit(obs, lsite("attn.scores"), scores);
    torch::Tensor probs = ops::attn_probs(scores, mask);  // [Hq, T, S]
    emit(obs, lsite("attn.probs"), probs);
    torch::Tensor ctx = ops::attn_ctx(probs, v_rep);  // [T, Hq*Dh]
    emit(obs, lsite("attn.ctx"), ctx);
    torch::Tensor attn_out = ops::linear(ctx, L.o, L.o_bias);  // [T, D]
    emit(obs, lsite("attn.out"), attn_out);

    // residual + hidden_states
    h = h + attn_out;  // [T, D]
    emit(obs, lsite("attn_residual"), h);

    // post_attention_layernorm -> LlamaMLP
    x = ops::rms_norm(h, L.post_attn_norm, eps);  // [T, D]
    emit(obs, lsite("mlp_norm"), x);
    torch::Tensor gate = ops::linear(x, L.gate, {});  // [T, F]
    torch::Tensor up = ops::linear(x, L.up, {});      // [T, F]
    emit(obs, lsite("mlp.gate"), gate);
    emit(obs, lsite("mlp.up"), up);
    torch::Tensor act = ops::swiglu(gate, up);  // [T, F]
    emit(obs, lsite("mlp.act"), act);
    torch::Tensor down = ops::linear(act, L.down, {});  // [T, D]
    emit(obs, lsite("mlp.down"), down);
    h = h + down;  // [T, D]
    emit(obs, lsite("out"), h);
  }
  cached_ = S;

  // LlamaModel.norm, then LlamaForCausalLM.lm_head over every position
  torch::Tensor final_norm = ops::rms_norm(h, w_->final_norm, eps);  // [T, D]
  emit(obs, site("final_norm"), final_norm);
  emit(obs, site("last_hidden"), final_norm[T - 1]);  // [D]
  torch::Tensor logits = ops::linear(final_norm, w_->lm_head, {});  // [T, V]
  emit(obs, site("logits"), logits);
  torch::Tensor next = logits[T - 1].to(torch::kFloat).contiguous();  // [V]
  emit(obs, site("next_logits"), next);
  return std::vector<float>(next.data_ptr<float>(), next.data_ptr<float>() + next.numel());
}

}  // namespace

// libtorch's own parallel loops run on an OpenMP team whose idle workers spin,
// which on a few cores starves OpenBLAS's threads (sgemm/dgemm have their own
// pool): measured 12.4 s against 8.5 s for a 1.1B float32 dump on 2 cores.
// float32/float64 work is nearly all BLAS calls: they get every thread and
// the elementwise ops one. bfloat16/float16 matmuls are libtorch's own
// loops: those keep libtorch's threads (and OpenBLAS sits idle).
void use_threads(int threads, ComputeDType dtype) {
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  using SetThreads = void (*)(int);
  static const auto openblas = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  const bool blas_bound = dtype == ComputeDType::Float32 || dtype == ComputeDType::Float64;
  if (openblas && threads > 1 && blas_bound) {
    at::set_num_threads(1);
    openblas(threads);
  } else {
    at::set_num_threads(threads);
  }
}

std::unique_ptr<Engine> make_ref_engine(const Model& model, const RefOptions& opt,
                                        std::shared_ptr<const RefWeights> weights) {
  if (opt.threads < 0) throw UsageError("--threads must be >= 0, got " + std::to_string(opt.threads));
  use_threads(opt.threads, opt.dtype);
  try {
    return std::make_unique<RefEngine>(model, opt.dtype, std::move(weights));
  } catch (const c10::Error& e) {
    throw Error(model.config.source + ": libtorch: " + e.what_without_backtrace());
  }
}

}  // namespace llmdiff::ref
