// The impl's forward pass of Llama / Mistral / Qwen2 / Qwen3, written from
// the math: one function, top to bottom, calling the kernels of kernels.h and
// the RoPE of rope.h, reporting every intermediate under its canonical name
// where it is computed. Weights stay in the checkpoint's mmap in their stored
// dtype; activations are float32.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dumps/errors.h"
#include "dumps/names.h"
#include "impl/impl_engine.h"
#include "impl/kernels.h"
#include "impl/rope.h"
#include "impl/thread_pool.h"

namespace llmdiff::impl {

namespace {

// Reports a step's intermediates through the observer under canonical names.
class Sites {
 public:
  Sites(Observer& obs, int step) : obs_(obs), step_(step) {}
  bool wants(const std::string& site) const { return obs_.wants(step_name(step_, site)); }
  bool wants(int layer, const std::string& site) const { return obs_.wants(layer_name(step_, layer, site)); }
  void f32(const std::string& site, const Shape& shape, const float* data) {
    emit(step_name(step_, site), shape, data);
  }
  void f32(int layer, const std::string& site, const Shape& shape, const float* data) {
    emit(layer_name(step_, layer, site), shape, data);
  }
  void i64(const std::string& site, const Shape& shape, const int64_t* data) {
    const std::string name = step_name(step_, site);
    if (obs_.wants(name)) obs_.on_i64(name, shape, data);
  }
  // x [T, H*Dh] reported head-major as [H, T, Dh] (transposed only when wanted).
  void head_major(int layer, const std::string& site, const float* x, int64_t T, int64_t H, int64_t Dh) {
    const std::string name = layer_name(step_, layer, site);
    if (!obs_.wants(name)) return;
    std::vector<float> out(size_t(H * T * Dh));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        std::memcpy(&out[size_t((h * T + t) * Dh)], x + (t * H + h) * Dh, size_t(Dh) * sizeof(float));
    obs_.on_f32(name, {H, T, Dh}, out.data());
  }

 private:
  void emit(const std::string& name, const Shape& shape, const float* data) {
    if (obs_.wants(name)) obs_.on_f32(name, shape, data);
  }
  Observer& obs_;
  int step_;
};

// mask [T, S]: 1 where query t (the (S-T+t)-th key position, `offset` = S-T)
// may attend key s: s <= offset + t, and closer than the sliding window.
std::vector<float> causal_mask(int64_t T, int64_t S, int64_t offset, int64_t window) {
  std::vector<float> mask(size_t(T * S), 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s <= std::min(offset + t, S - 1); ++s)
      if (window <= 0 || offset + t - s < window) mask[size_t(t * S + s)] = 1.0f;
  return mask;
}

// One layer's KV cache, token-major: row s = [Hkv*Dh] of key/value s.
struct LayerCache {
  std::vector<float> k, v;
};

// The whole KV cache [S, Hkv*Dh] of one layer as [Hkv, S, Dh].
std::vector<float> head_major_cache(const std::vector<float>& c, int64_t S, int64_t Hkv, int64_t Dh) {
  std::vector<float> out(size_t(Hkv * S * Dh));
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t s = 0; s < S; ++s)
      std::memcpy(&out[size_t((h * S + s) * Dh)], &c[size_t((s * Hkv + h) * Dh)], size_t(Dh) * sizeof(float));
  return out;
}

// K or V after repeat_kv: [Hq, S, Dh], query head h reading kv head kv_head[h].
std::vector<float> repeat_kv(const std::vector<float>& c, int64_t S, int64_t Hq, int64_t Hkv, int64_t Dh,
                             const std::vector<int>& kv_head) {
  std::vector<float> out(size_t(Hq * S * Dh));
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t s = 0; s < S; ++s)
      std::memcpy(&out[size_t((h * S + s) * Dh)], &c[size_t((s * Hkv + kv_head[size_t(h)]) * Dh)],
                  size_t(Dh) * sizeof(float));
  return out;
}

class ImplEngine final : public Engine {
 public:
  ImplEngine(const Model& model, const ImplOptions& opt)
      : cfg_(model.config), weights_(model.weights), bugs_(opt.bugs), release_(opt.release_weights), pool_(opt.threads) {
    if (!weights_) throw UsageError("impl: model '" + model.config.source + "' has no weights loaded");
    zoo::check_bugs(bugs_, cfg_);
    faults_ = zoo::apply_bugs(bugs_, cfg_);
    if (opt.max_seq < 0) throw UsageError("impl: max_seq must be >= 0, got " + std::to_string(opt.max_seq));
    capacity_ = opt.max_seq > 0 ? opt.max_seq : cfg_.max_position_embeddings;
    const int64_t Hq = cfg_.num_attention_heads, Hkv = cfg_.num_key_value_heads;
    for (int64_t h = 0; h < Hq; ++h)
      kv_head_.push_back(int(faults_.repeat_kv_tile ? h % Hkv : h / (Hq / Hkv)));
    cache_.resize(size_t(cfg_.num_hidden_layers));
  }

  void reset() override {
    cached_ = 0;
    for (LayerCache& c : cache_) {
      c.k.clear();
      c.v.clear();
    }
  }

  std::string producer() const override {
    std::string p = "llmdiff impl (plain C++, float32 activations)";
    for (size_t i = 0; i < bugs_.size(); ++i) p += (i == 0 ? " with bugs: " : ", ") + bugs_[i].str();
    return p;
  }
  std::string dtype_name() const override { return "float32"; }

  std::vector<float> forward(const std::vector<int64_t>& tokens, int step, Observer& obs) override;

 private:
  ModelConfig cfg_;  // the model's config with the zoo's config-level bugs applied
  std::shared_ptr<ModelWeights> weights_;
  std::vector<zoo::BugSpec> bugs_;
  zoo::Faults faults_;
  bool release_ = false;
  int64_t capacity_ = 0;     // KV cache capacity in tokens
  std::vector<int> kv_head_; // [Hq]: kv head each query head reads
  ThreadPool pool_;
  MatmulScratch mm_;
  std::vector<std::vector<float>> attn_rows_;
  std::vector<LayerCache> cache_;
  int64_t cached_ = 0;  // keys in the cache (P)
};

std::vector<float> ImplEngine::forward(const std::vector<int64_t>& tokens, int step, Observer& obs) {
  const ModelConfig& c = cfg_;
  const ModelWeights& w = *weights_;
  const zoo::Faults& bug = faults_;
  const int64_t T = int64_t(tokens.size()), P = cached_;
  const int64_t D = c.hidden_size, F = c.intermediate_size, V = c.vocab_size;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, Dh = c.head_dim;
  const int64_t q_dim = Hq * Dh, kv_dim = Hkv * Dh;
  const float eps = float(c.rms_norm_eps);

  if (T == 0) throw UsageError("impl: a forward call needs at least one token");
  for (int64_t t = 0; t < T; ++t)
    if (tokens[size_t(t)] < 0 || tokens[size_t(t)] >= V)
      throw UsageError("impl: token id " + std::to_string(tokens[size_t(t)]) + " at index " + std::to_string(t) +
                       " of step " + std::to_string(step) + " is outside the vocabulary [0, " +
                       std::to_string(V) + ")");
  // Keys held after this call: the cache plus this call's (kv-overwrite: this call's only).
  const int64_t S = bug.kv_overwrite ? T : P + T;
  if (S > capacity_)
    throw UsageError("impl: KV cache capacity exceeded at step " + std::to_string(step) + ": " + std::to_string(P) +
                     " cached + " + std::to_string(T) + " new tokens > capacity " + std::to_string(capacity_) +
                     " (max_position_embeddings of " + c.source + " unless the engine's max_seq overrides it)");
  Sites site(obs, step);

  // Positions continue after the cached keys (P .. P+T-1).
  std::vector<int64_t> positions(static_cast<size_t>(T));  // [T]
  for (int64_t t = 0; t < T; ++t) positions[size_t(t)] = (bug.position_reset ? 0 : P) + t;
  // RoPE frequencies for this call (dynamic NTK: its largest position).
  const RopeFrequencies freqs = rope_frequencies(c, positions.back() + 1);
  if (step == 0 && obs.wants("rope.inv_freq")) obs.on_f32("rope.inv_freq", {Dh / 2}, freqs.inv_freq.data());
  site.i64("tokens", {T}, tokens.data());
  site.i64("positions", {T}, positions.data());

  std::vector<float> cos(size_t(T * Dh)), sin(size_t(T * Dh));  // [T, Dh]
  rope_tables(freqs, positions, Dh, cos.data(), sin.data());
  site.f32("rope.cos", {T, Dh}, cos.data());
  site.f32("rope.sin", {T, Dh}, sin.data());

  // Causal mask over the S keys: query t sits at key position S-T+t.
  std::vector<float> mask = bug.mask_missing ? std::vector<float>(size_t(T * S), 1.0f)
                                             : causal_mask(T, S, bug.mask_square ? 0 : S - T, c.sliding_window);
  site.f32("mask", {T, S}, mask.data());  // [T, S]

  std::vector<float> x(size_t(T * D));  // [T, D] residual stream
  for (int64_t t = 0; t < T; ++t) load_row(wmat(w.embed), tokens[size_t(t)], 0, D, &x[size_t(t * D)]);
  site.f32("embed", {T, D}, x.data());

  std::vector<float> xn(size_t(T * D));                                    // [T, D] normed input
  std::vector<float> q(size_t(T * q_dim)), k(size_t(T * kv_dim)), v(size_t(T * kv_dim));
  std::vector<float> ctx(size_t(T * q_dim));                               // [T, Hq*Dh]
  std::vector<float> proj(size_t(T * D));                                  // [T, D] attn.out / mlp.down
  std::vector<float> gate(size_t(T * F)), up(size_t(T * F)), act(size_t(T * F));  // [T, F]
  const float scale = bug.softmax_scale_dh ? float(1.0 / double(Dh)) : float(std::pow(double(Dh), -0.5));
  auto rope = bug.rope_interleaved ? apply_rope_interleaved : apply_rope;

  for (int l = 0; l < int(c.num_hidden_layers); ++l) {
    const LayerWeights& L = w.layers[size_t(l)];
    LayerCache& kv = cache_[size_t(l)];

    // ---- attention block
    rms_norm(pool_, x.data(), T, D, wmat(L.input_norm), eps, xn.data());  // [T, D]
    site.f32(l, "attn_norm", {T, D}, xn.data());

    // q [T, Hq*Dh], k [T, Hkv*Dh], v [T, Hkv*Dh]
    matmul(pool_, mm_, xn.data(), T, {{wmat(L.q), q.data()}, {wmat(L.k), k.data()}, {wmat(L.v), v.data()}});
    if (c.qkv_bias) {
      add_bias(wmat(L.q_bias), T, q.data());
      add_bias(wmat(L.k_bias), T, k.data());
      add_bias(wmat(L.v_bias), T, v.data());
    }
    site.f32(l, "attn.q", {T, q_dim}, q.data());
    site.f32(l, "attn.k", {T, kv_dim}, k.data());
    site.f32(l, "attn.v", {T, kv_dim}, v.data());

    // Qwen3: per-head RMSNorm of q and k (over Dh), before RoPE.
    auto qk_norm = [&] {
      rms_norm(pool_, q.data(), T * Hq, Dh, wmat(L.q_norm), eps, q.data());   // [T, Hq*Dh]
      rms_norm(pool_, k.data(), T * Hkv, Dh, wmat(L.k_norm), eps, k.data());  // [T, Hkv*Dh]
      site.f32(l, "attn.q_norm", {T, q_dim}, q.data());
      site.f32(l, "attn.k_norm", {T, kv_dim}, k.data());
    };
    if (c.qk_norm && !bug.qk_norm_after_rope) qk_norm();

    rope(q.data(), T, Hq, Dh, cos.data(), sin.data());   // [T, Hq*Dh]
    rope(k.data(), T, Hkv, Dh, cos.data(), sin.data());  // [T, Hkv*Dh]
    site.head_major(l, "attn.q_rope", q.data(), T, Hq, Dh);   // [Hq, T, Dh]
    site.head_major(l, "attn.k_rope", k.data(), T, Hkv, Dh);  // [Hkv, T, Dh]
    if (c.qk_norm && bug.qk_norm_after_rope) qk_norm();

    // Append this call's K (after RoPE) and V to the cache: [S, Hkv*Dh].
    kv.k.resize(size_t(S * kv_dim));
    kv.v.resize(size_t(S * kv_dim));
    std::copy(k.begin(), k.end(), kv.k.begin() + (S - T) * kv_dim);
    std::copy(v.begin(), v.end(), kv.v.begin() + (S - T) * kv_dim);
    if (site.wants(l, "attn.k_cache"))
      site.f32(l, "attn.k_cache", {Hkv, S, Dh}, head_major_cache(kv.k, S, Hkv, Dh).data());
    if (site.wants(l, "attn.v_cache"))
      site.f32(l, "attn.v_cache", {Hkv, S, Dh}, head_major_cache(kv.v, S, Hkv, Dh).data());
    if (site.wants(l, "attn.k_rep"))
      site.f32(l, "attn.k_rep", {Hq, S, Dh}, repeat_kv(kv.k, S, Hq, Hkv, Dh, kv_head_).data());
    if (site.wants(l, "attn.v_rep"))
      site.f32(l, "attn.v_rep", {Hq, S, Dh}, repeat_kv(kv.v, S, Hq, Hkv, Dh, kv_head_).data());

    // softmax(q·kᵀ * scale + mask) · v, per (head, query) in parallel.
    std::vector<float> scores, probs;  // [Hq, T, S], only when dumped
    if (site.wants(l, "attn.scores")) scores.resize(size_t(Hq * T * S));
    if (site.wants(l, "attn.probs")) probs.resize(size_t(Hq * T * S));
    AttentionArgs att;
    att.T = T, att.S = S, att.Hq = Hq, att.Hkv = Hkv, att.Dh = Dh;
    att.q = q.data(), att.k = kv.k.data(), att.v = kv.v.data(), att.mask = mask.data();
    att.kv_head = kv_head_.data(), att.scale = scale;
    att.scores = scores.empty() ? nullptr : scores.data();
    att.probs = probs.empty() ? nullptr : probs.data();
    att.ctx = ctx.data();
    attention(pool_, attn_rows_, att);
    if (!scores.empty()) site.f32(l, "attn.scores", {Hq, T, S}, scores.data());
    if (!probs.empty()) site.f32(l, "attn.probs", {Hq, T, S}, probs.data());
    site.f32(l, "attn.ctx", {T, q_dim}, ctx.data());

    matmul(pool_, mm_, ctx.data(), T, wmat(L.o), proj.data());  // [T, D]
    if (c.o_bias) add_bias(wmat(L.o_bias), T, proj.data());
    site.f32(l, "attn.out", {T, D}, proj.data());
    add(x.data(), proj.data(), T * D, x.data());  // [T, D]
    site.f32(l, "attn_residual", {T, D}, x.data());

    // ---- MLP block: down(silu(gate(x)) * up(x))
    rms_norm(pool_, x.data(), T, D, wmat(L.post_attn_norm), eps, xn.data());  // [T, D]
    site.f32(l, "mlp_norm", {T, D}, xn.data());
    matmul(pool_, mm_, xn.data(), T, {{wmat(L.gate), gate.data()}, {wmat(L.up), up.data()}});  // [T, F] each
    site.f32(l, "mlp.gate", {T, F}, gate.data());
    site.f32(l, "mlp.up", {T, F}, up.data());
    if (bug.gate_up_swap)
      silu_mul(pool_, up.data(), gate.data(), T * F, act.data());  // [T, F]
    else
      silu_mul(pool_, gate.data(), up.data(), T * F, act.data());  // [T, F]
    site.f32(l, "mlp.act", {T, F}, act.data());
    matmul(pool_, mm_, act.data(), T, wmat(L.down), proj.data());  // [T, D]
    site.f32(l, "mlp.down", {T, D}, proj.data());
    add(x.data(), proj.data(), T * D, x.data());  // [T, D]
    site.f32(l, "out", {T, D}, x.data());
    if (release_) w.release_layer(l);
  }

  rms_norm(pool_, x.data(), T, D, wmat(w.final_norm), eps, xn.data());  // [T, D]
  site.f32("final_norm", {T, D}, xn.data());
  const int64_t last = bug.last_token_first ? 0 : T - 1;
  const float* last_hidden = &xn[size_t(last * D)];  // [D]
  site.f32("last_hidden", {D}, last_hidden);

  // next_logits [V] always through the same single-row kernel, whether or not
  // the full logits [T, V] are dumped, so observing never changes results.
  const WMat head = wmat(bug.lm_head_embed ? w.embed : w.lm_head);
  std::vector<float> next(static_cast<size_t>(V));
  matmul(pool_, mm_, last_hidden, 1, head, next.data());  // [V]
  if (site.wants("logits")) {
    std::vector<float> logits(size_t(T * V));  // [T, V]
    matmul(pool_, mm_, xn.data(), T, head, logits.data());
    std::copy(next.begin(), next.end(), logits.begin() + last * V);
    site.f32("logits", {T, V}, logits.data());
  }
  site.f32("next_logits", {V}, next.data());
  if (release_) w.release_head();

  cached_ = S;
  return next;
}

}  // namespace

std::unique_ptr<Engine> make_impl_engine(const Model& model, const ImplOptions& opt) {
  return std::make_unique<ImplEngine>(model, opt);
}

}  // namespace llmdiff::impl
