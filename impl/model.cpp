// The impl's forward pass of Llama / Mistral / Qwen2 / Qwen3, their
// mixture-of-experts variants (Mixtral, Qwen2-MoE, Qwen3-MoE) and DeepSeek-V3
// (multi-head latent attention, group-limited sigmoid routing), written from
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

#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "impl/cache_views.h"
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
  void i64(int layer, const std::string& site, const Shape& shape, const int64_t* data) {
    const std::string name = layer_name(step_, layer, site);
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

// One layer's KV cache, token-major: row s = [Hkv*Dh] of key/value s
// (MLA's naive form: [Hq*(Dn+Dr)] and [Hq*Dv]). MLA also keeps row s =
// [Rkv+Dr]: the normalised latent then the rope key k_pe (all the absorbed
// form caches; the naive form keeps it for latent_cache / k_pe_cache).
struct LayerCache {
  std::vector<float> k, v;
  std::vector<float> latent;
  // Appends this call's T rows of K [T, k_dim] and V [T, v_dim]: the cache
  // then holds S rows, stored as `storage` rounds them (F32: exact).
  void append(const std::vector<float>& k_new, const std::vector<float>& v_new, int64_t S, int64_t T, int64_t k_dim,
              int64_t v_dim, GgmlType storage) {
    k.resize(size_t(S * k_dim));
    v.resize(size_t(S * v_dim));
    round_activations(storage, k_new.data(), k.data() + (S - T) * k_dim, T * k_dim);
    round_activations(storage, v_new.data(), v.data() + (S - T) * v_dim, T * v_dim);
  }
};

// q_a_layernorm / kv_a_layernorm: DeepseekV3RMSNorm(rank) built without eps,
// so 1e-6 whatever rms_norm_eps says.
constexpr float kMlaNormEps = 1e-6f;

// Columns [c0, c0+n) of rows [S, width] as [S, n] (latent_cache, k_pe_cache).
std::vector<float> columns(const std::vector<float>& rows, int64_t S, int64_t width, int64_t c0, int64_t n) {
  std::vector<float> out(size_t(S * n));
  for (int64_t s = 0; s < S; ++s)
    std::memcpy(&out[size_t(s * n)], &rows[size_t(s * width + c0)], size_t(n) * sizeof(float));
  return out;
}

// The buffers of one forward call, kept between calls so that a decode step
// allocates nothing: each is resized (within its capacity after the first
// call of that length) and zeroed where the forward takes it.
struct ForwardBuffers {
  std::vector<float> x;
  std::vector<float> xn;
  std::vector<float> q;
  std::vector<float> k;
  std::vector<float> v;
  std::vector<float> ctx;
  std::vector<float> proj;
  std::vector<float> gate;
  std::vector<float> up;
  std::vector<float> act;
  std::vector<float> q_a;
  std::vector<float> kv_a;
  std::vector<float> latent;
  std::vector<float> kv;
  std::vector<float> q_pe;
  std::vector<float> k_pe;
  std::vector<float> q_lat;
  std::vector<float> ctx_lat;
  std::vector<float> router_logits;
  std::vector<float> router_probs;
  std::vector<int64_t> topk_ids;
  std::vector<float> topk_weights;
  std::vector<float> expert_out;
  std::vector<float> expert_in;
  std::vector<float> expert_y;
  std::vector<float> routed;
  std::vector<float> shared;
};

// v as n zeros, reusing its storage.
template <class T>
std::vector<T>& zeroed(std::vector<T>& v, int64_t n) {
  v.assign(size_t(n), T{});
  return v;
}

class ImplEngine final : public Engine {
 public:
  ImplEngine(const Model& model, const ImplOptions& opt)
      : cfg_(model.config), weights_(model.weights), bugs_(opt.bugs), precision_(opt.precision),
        release_(opt.release_weights),
        absorbed_(model.config.mla.enabled && opt.mla == MlaForm::Absorbed), pool_(opt.threads) {
    if (!weights_) throw UsageError("impl: model '" + model.config.source + "' has no weights loaded");
    zoo::check_bugs(bugs_, cfg_);
    if (zoo::batch_faults(bugs_).any())
      throw UsageError("impl: the batch bugs act in the continuous-batching engine (dump --batch), not in a "
                       "single-sequence run");
    faults_ = zoo::apply_bugs(bugs_, cfg_);
    if (opt.max_seq < 0) throw UsageError("impl: max_seq must be >= 0, got " + std::to_string(opt.max_seq));
    capacity_ = opt.max_seq > 0 ? opt.max_seq : cfg_.max_position_embeddings;
    if (opt.kv_ring < 0) throw UsageError("impl: kv_ring must be >= 0, got " + std::to_string(opt.kv_ring));
    if (opt.kv_ring > 0 && cfg_.mla.enabled) throw UsageError("impl: a ring KV cache is for GQA attention, not MLA");
    ring_ = opt.kv_ring;
    const int64_t Hq = cfg_.num_attention_heads, Hkv = cfg_.num_key_value_heads;
    for (int64_t h = 0; h < Hq; ++h)
      kv_head_.push_back(int(faults_.repeat_kv_tile ? h % Hkv : h / (Hq / Hkv)));
    latent_head_.assign(size_t(Hq), 0);
    cache_.resize(size_t(cfg_.num_hidden_layers));
  }

  // A row of a left-padded batch (Engine::set_left_padding): the first
  // `pad` tokens of the first call are pads, at position 1 and masked as
  // keys (HF's generate), until reset().
  void set_left_padding(int64_t pad) override {
    if (pad < 0) throw UsageError("impl: left padding must be >= 0");
    if (cached_ != 0) throw UsageError("impl: left padding is set before a sequence's first call");
    pad_ = pad;
  }

  // A shard of the layers (Engine::set_layer_window), until reset().
  void set_layer_window(const LayerWindow& w) override {
    if (cached_ != 0) throw UsageError("impl: a layer window is set before a sequence's first call");
    if (!w.whole() && (w.num_layers != int(cfg_.num_hidden_layers) || w.first < 0 || w.end > w.num_layers ||
                       w.first >= w.end || (w.first > 0 && !w.boundary)))
      throw UsageError("impl: layer window " + w.str() + " does not fit the model's " +
                       std::to_string(cfg_.num_hidden_layers) + " layers (or lacks its boundary dump)");
    window_ = w;
  }

  void reset() override {
    cached_ = 0;
    pad_ = 0;
    window_ = {};
    for (LayerCache& c : cache_) {
      c.k.clear();
      c.v.clear();
      c.latent.clear();
    }
  }

  std::string producer() const override {
    std::string p = "llmdiff impl (plain C++, float32 activations";
    if (cfg_.mla.enabled) p += std::string(", ") + (absorbed_ ? "absorbed" : "naive") + " MLA";
    if (!precision_.empty()) p += ", precision " + precision_.str();
    p += ")";
    for (size_t i = 0; i < bugs_.size(); ++i) p += (i == 0 ? " with bugs: " : ", ") + bugs_[i].str();
    return p;
  }
  std::string dtype_name() const override { return "float32"; }
  PrecisionProfile precision() const override { return precision_; }
  std::string kv_cache_json() const override {
    return ring_ > 0 ? "{\"kind\": \"ring\", \"capacity\": " + std::to_string(ring_) + "}" : "";
  }

  std::vector<float> forward(const std::vector<int64_t>& tokens, int step, Observer& obs) override;

 private:
  // A SwiGLU MLP on n rows: out [n, D] = down(silu(gate(x)) * up(x)), with
  // gate, up, act [n, F] left in the scratch given (the dense MLP reports them).
  void swiglu(const MlpWeights& m, const float* x, int64_t n, float* gate, float* up, float* act, float* out);
  // matmul() of kernels.h with the inputs rounded as the precision profile
  // says for each weight's type (the jobs grouped by that rounding).
  void mm(const float* x, int64_t T, const std::vector<MatmulJob>& jobs);
  void mm(const float* x, int64_t T, const WMat& w, float* y) { mm(x, T, std::vector<MatmulJob>{{w, y}}); }

  ModelConfig cfg_;  // the model's config with the zoo's config-level bugs applied
  std::shared_ptr<ModelWeights> weights_;
  std::vector<zoo::BugSpec> bugs_;
  zoo::Faults faults_;
  PrecisionProfile precision_;  // the roundings the engine makes on purpose
  std::vector<float> rounded_;  // matmul inputs as the profile rounds them
  bool release_ = false;
  bool absorbed_ = false;    // MLA in the absorbed form
  int64_t capacity_ = 0;     // KV cache capacity in tokens
  int64_t ring_ = 0;  // ring KV cache capacity, 0: contiguous
  std::vector<int> kv_head_; // [Hq]: kv head each query head reads
  std::vector<int> latent_head_;  // [Hq]: all 0 (absorbed MLA: every head reads the one latent)
  ThreadPool pool_;
  MatmulScratch mm_;
  std::vector<std::vector<float>> attn_rows_;
  std::vector<LayerCache> cache_;
  ForwardBuffers buf_;
  int64_t cached_ = 0;  // keys in the cache (P)
  int64_t pad_ = 0;     // left padding of this sequence (set_left_padding)
  LayerWindow window_;  // the layers each call runs (set_layer_window): all by default
};

// The type a matmul's weights are stored in, as ggml names it.
GgmlType weight_type(const WMat& w) {
  if (w.quantized()) return w.quant;
  return w.dtype == DType::F16 ? GgmlType::F16 : w.dtype == DType::BF16 ? GgmlType::BF16 : GgmlType::F32;
}

void ImplEngine::mm(const float* x, int64_t T, const std::vector<MatmulJob>& jobs) {
  if (precision_.empty()) return matmul(pool_, mm_, x, T, jobs);
  std::vector<bool> done(jobs.size(), false);
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (done[i]) continue;
    const GgmlType r = precision_.input_rounding(weight_type(jobs[i].w));
    std::vector<MatmulJob> group;
    for (size_t j = i; j < jobs.size(); ++j)
      if (!done[j] && precision_.input_rounding(weight_type(jobs[j].w)) == r) {
        group.push_back(jobs[j]);
        done[j] = true;
      }
    if (r == GgmlType::F32) {
      matmul(pool_, mm_, x, T, group);
      continue;
    }
    const int64_t K = group[0].w.cols;
    rounded_.resize(size_t(T * K));
    for (int64_t t = 0; t < T; ++t) round_activations(r, x + t * K, rounded_.data() + t * K, K);  // [T, K]
    matmul(pool_, mm_, rounded_.data(), T, group);
  }
}

void ImplEngine::swiglu(const MlpWeights& m, const float* x, int64_t n, float* gate, float* up, float* act,
                        float* out) {
  const int64_t F = m.gate.shape[0];
  mm(x, n, {{wmat(m.gate), gate}, {wmat(m.up), up}});  // [n, F] each
  if (faults_.gate_up_swap)
    silu_mul(pool_, up, gate, n * F, act);  // [n, F]
  else
    silu_mul(pool_, gate, up, n * F, act);  // [n, F]
  mm(act, n, wmat(m.down), out);  // [n, D]
}

std::vector<float> ImplEngine::forward(const std::vector<int64_t>& tokens, int step, Observer& obs) {
  const ModelConfig& c = cfg_;
  const ModelWeights& w = *weights_;
  const zoo::Faults& bug = faults_;
  const int64_t T = int64_t(tokens.size()), P = cached_;
  const int64_t D = c.hidden_size, F = c.intermediate_size, V = c.vocab_size;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, Dh = c.head_dim;
  const float eps = float(c.rms_norm_eps);
  // Multi-head latent attention (DeepSeek-V3): q through the rank-Rq
  // bottleneck, keys and values of every head from one rank-Rkv latent, a
  // Dr-wide rope key shared by all heads (Dh = Dr: the RoPE tables' width).
  const bool mla = c.mla.enabled;
  const int64_t Rq = c.mla.q_lora_rank, Rkv = c.mla.kv_lora_rank;
  const int64_t Dn = c.mla.qk_nope_head_dim, Dr = c.mla.qk_rope_head_dim, Dv = c.mla.v_head_dim;
  const int64_t Lw = Rkv + Dr;  // MLA latent cache row: [latent | k_pe]
  // Attention widths: a query/key head of Dk, a value head of Dvh.
  const int64_t Dk = mla ? Dn + Dr : Dh, Dvh = mla ? Dv : Dh;
  const int64_t q_dim = Hq * Dk, k_dim = Hkv * Dk, v_dim = Hkv * Dvh, ctx_dim = Hq * Dvh;
  // Feed-forward widths: dense MLP, routed expert, shared expert.
  const int64_t Fe = c.moe.intermediate_size, Fs = c.moe.shared_intermediate_size;
  const int64_t Fmax = std::max({F, Fe, Fs});

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
  // A left-padded row (generate): attention_mask.cumsum(-1) - 1, pads at 1.
  if (pad_ > 0)
    for (int64_t& p : positions) p = p < pad_ ? 1 : p - pad_;
  // RoPE frequencies for this call (dynamic NTK: its largest position).
  const RopeFrequencies freqs = rope_frequencies(c, *std::max_element(positions.begin(), positions.end()) + 1);
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
  // A ring of ring_ slots holds the last ring_ positions: the older keys were overwritten.
  const int64_t ring_lost = ring_ > 0 && S > ring_ ? S - ring_ : 0;
  for (int64_t t = 0; t < T; ++t) std::fill_n(&mask[size_t(t * S)], ring_lost, 0.0f);
  // The attention_mask's pads, closed for every query (pad-keys-unmasked: open).
  if (pad_ > 0 && !bug.pad_keys_unmasked)
    for (int64_t t = 0; t < T; ++t) std::fill_n(&mask[size_t(t * S)], std::min(pad_, S), 0.0f);
  site.f32("mask", {T, S}, mask.data());  // [T, S]

  // The layers this call runs: all, or a shard's (set_layer_window).
  const int first_layer = window_.whole() ? 0 : window_.first;
  const int end_layer = window_.whole() ? int(c.num_hidden_layers) : window_.end;
  std::vector<float>& x = zeroed(buf_.x, T * D);                                    // [T, D] residual stream
  if (first_layer == 0) {
    for (int64_t t = 0; t < T; ++t) load_row(wmat(w.embed), tokens[size_t(t)], 0, D, &x[size_t(t * D)]);
    site.f32("embed", {T, D}, x.data());
  } else {  // a shard: the residual stream entering its first layer, as the boundary dump holds it
    const std::string name = window_.boundary_name(step);
    const TensorData b = window_.boundary->get(name);
    if (b.is_int || b.shape != Shape{T, D})
      throw ShapeError(window_.boundary->label(), name, shape_str({T, D}), shape_str(b.shape));
    std::copy(b.f.begin(), b.f.end(), x.begin());
  }

  std::vector<float>& xn = zeroed(buf_.xn, T * D);                                  // [T, D] normed input
  std::vector<float>& q = zeroed(buf_.q, T * q_dim);                                // [T, Hq*Dk]
  std::vector<float>& k = zeroed(buf_.k, absorbed_ ? 0 : T * k_dim);                // [T, Hkv*Dk]
  std::vector<float>& v = zeroed(buf_.v, absorbed_ ? 0 : T * v_dim);                // [T, Hkv*Dvh]
  std::vector<float>& ctx = zeroed(buf_.ctx, T * ctx_dim);                          // [T, Hq*Dvh]
  std::vector<float>& proj = zeroed(buf_.proj, T * D);  // [T, D] attn.out / mlp.down / moe.out
  std::vector<float>& gate = zeroed(buf_.gate, T * Fmax);                           // [T, F] (F of any MLP)
  std::vector<float>& up = zeroed(buf_.up, T * Fmax);                               // [T, F]
  std::vector<float>& act = zeroed(buf_.act, T * Fmax);                             // [T, F]
  // MLA
  std::vector<float>& q_a = zeroed(buf_.q_a, T * Rq);                               // [T, Rq]
  std::vector<float>& kv_a = zeroed(buf_.kv_a, T * Lw);                             // [T, Rkv+Dr]
  std::vector<float>& latent = zeroed(buf_.latent, T * Rkv);                        // [T, Rkv] kv_a_norm
  std::vector<float>& kv = zeroed(buf_.kv, mla && !absorbed_ ? T * Hq * (Dn + Dv) : 0);  // [T, Hq*(Dn+Dv)]
  std::vector<float>& q_pe = zeroed(buf_.q_pe, mla ? T * Hq * Dr : 0);              // [T, Hq*Dr]
  std::vector<float>& k_pe = zeroed(buf_.k_pe, mla ? T * Dr : 0);                   // [T, Dr]
  std::vector<float>& q_lat = zeroed(buf_.q_lat, absorbed_ ? T * Hq * Lw : 0);      // [T, Hq*(Rkv+Dr)]
  std::vector<float>& ctx_lat = zeroed(buf_.ctx_lat, absorbed_ ? T * Hq * Rkv : 0);  // [T, Hq*Rkv]
  // MoE
  const int64_t E = c.moe.num_experts, K = c.moe.top_k;
  std::vector<float>& router_logits = zeroed(buf_.router_logits, T * E);            // [T, E]
  std::vector<float>& router_probs = zeroed(buf_.router_probs, T * E);              // [T, E]
  std::vector<int64_t>& topk_ids = zeroed(buf_.topk_ids, T * K);                    // [T, K]
  std::vector<float>& topk_weights = zeroed(buf_.topk_weights, T * K);              // [T, K]
  std::vector<float>& expert_out = zeroed(buf_.expert_out, c.moe.enabled() ? T * K * D : 0);  // [T, K, D]
  // [n, D] rows routed to one expert, and their output
  std::vector<float>& expert_in = zeroed(buf_.expert_in, c.moe.enabled() ? T * D : 0);
  std::vector<float>& expert_y = zeroed(buf_.expert_y, c.moe.enabled() ? T * D : 0);
  std::vector<float>& routed = zeroed(buf_.routed, c.moe.enabled() ? T * D : 0);    // [T, D]
  std::vector<float>& shared = zeroed(buf_.shared, Fs > 0 ? T * D : 0);             // [T, D]

  const float scale = float(bug.softmax_scale_dh ? 1.0 / double(Dk)
                            : bug.mla_no_mscale  ? std::pow(double(Dk), -0.5)
                                                 : c.attn_scaling());
  auto rope = bug.rope_interleaved ? apply_rope_interleaved : apply_rope;

  for (int l = first_layer; l < end_layer; ++l) {
    const LayerWeights& L = w.layers[size_t(l)];
    LayerCache& cache = cache_[size_t(l)];

    // ---- attention block
    rms_norm(pool_, x.data(), T, D, wmat(L.input_norm), eps, xn.data());  // [T, D]
    site.f32(l, "attn_norm", {T, D}, xn.data());
    std::vector<float> scores, probs;  // [Hq, T, S], only when dumped
    if (site.wants(l, "attn.scores")) scores.resize(size_t(Hq * T * S));
    if (site.wants(l, "attn.probs")) probs.resize(size_t(Hq * T * S));
    AttentionArgs att;
    att.T = T, att.S = S, att.mask = mask.data(), att.scale = scale;
    att.scores = scores.empty() ? nullptr : scores.data();
    att.probs = probs.empty() ? nullptr : probs.data();

    if (!mla) {
      // q [T, Hq*Dh], k [T, Hkv*Dh], v [T, Hkv*Dh]
      mm(xn.data(), T, {{wmat(L.q), q.data()}, {wmat(L.k), k.data()}, {wmat(L.v), v.data()}});
      if (c.qkv_bias) {
        add_bias(wmat(L.q_bias), T, q.data());
        add_bias(wmat(L.k_bias), T, k.data());
        add_bias(wmat(L.v_bias), T, v.data());
      }
      site.f32(l, "attn.q", {T, q_dim}, q.data());
      site.f32(l, "attn.k", {T, k_dim}, k.data());
      site.f32(l, "attn.v", {T, v_dim}, v.data());

      // Qwen3: per-head RMSNorm of q and k (over Dh), before RoPE.
      auto qk_norm = [&] {
        rms_norm(pool_, q.data(), T * Hq, Dh, wmat(L.q_norm), eps, q.data());   // [T, Hq*Dh]
        rms_norm(pool_, k.data(), T * Hkv, Dh, wmat(L.k_norm), eps, k.data());  // [T, Hkv*Dh]
        site.f32(l, "attn.q_norm", {T, q_dim}, q.data());
        site.f32(l, "attn.k_norm", {T, k_dim}, k.data());
      };
      if (c.qk_norm && !bug.qk_norm_after_rope) qk_norm();

      rope(q.data(), T, Hq, Dh, cos.data(), sin.data());   // [T, Hq*Dh]
      rope(k.data(), T, Hkv, Dh, cos.data(), sin.data());  // [T, Hkv*Dh]
      site.head_major(l, "attn.q_rope", q.data(), T, Hq, Dh);   // [Hq, T, Dh]
      site.head_major(l, "attn.k_rope", k.data(), T, Hkv, Dh);  // [Hkv, T, Dh]
      if (c.qk_norm && bug.qk_norm_after_rope) qk_norm();

      // Append this call's K (after RoPE) and V to the cache: [S, Hkv*Dh].
      cache.append(k, v, S, T, k_dim, v_dim, precision_.kv_cache);
      // What the cache holds: every position, or a ring's slots.
      const int64_t held = ring_ > 0 ? std::min(S, ring_) : S;
      auto stored = [&](const std::vector<float>& c) { return ring_ > 0 ? ring_slots(c, S, ring_, k_dim) : c; };
      if (site.wants(l, "attn.k_cache"))
        site.f32(l, "attn.k_cache", {Hkv, held, Dh}, head_major_cache(stored(cache.k), held, Hkv, Dh).data());
      if (site.wants(l, "attn.v_cache"))
        site.f32(l, "attn.v_cache", {Hkv, held, Dh}, head_major_cache(stored(cache.v), held, Hkv, Dh).data());
      if (site.wants(l, "attn.k_rep"))
        site.f32(l, "attn.k_rep", {Hq, held, Dh}, repeat_kv(stored(cache.k), held, Hq, Hkv, Dh, kv_head_).data());
      if (site.wants(l, "attn.v_rep"))
        site.f32(l, "attn.v_rep", {Hq, held, Dh}, repeat_kv(stored(cache.v), held, Hq, Hkv, Dh, kv_head_).data());

      // softmax(q·kᵀ * scale + mask) · v, per (head, query) in parallel.
      att.Hq = Hq, att.Hkv = Hkv, att.Dh = Dh;
      att.q = q.data(), att.k = cache.k.data(), att.v = cache.v.data(), att.kv_head = kv_head_.data();
      if (precision_.weights || precision_.flash_attention)
        att.product_rounding = precision_.kv_cache;  // ggml multiplies in the cache's type
      att.flash = precision_.flash_attention;
      att.ctx = ctx.data();
      attention(pool_, attn_rows_, att);
    } else {
      // ---- multi-head latent attention
      // q_a [T, Rq] (without q_lora_rank: q straight from xn) and kv_a [T, Rkv+Dr].
      if (Rq > 0) {
        mm(xn.data(), T, {{wmat(L.q_a), q_a.data()}, {wmat(L.kv_a), kv_a.data()}});
        site.f32(l, "attn.q_a", {T, Rq}, q_a.data());
        rms_norm(pool_, q_a.data(), T, Rq, wmat(L.q_a_norm), kMlaNormEps, q_a.data());  // [T, Rq]
        site.f32(l, "attn.q_a_norm", {T, Rq}, q_a.data());
        mm(q_a.data(), T, wmat(L.q), q.data());  // [T, Hq*(Dn+Dr)]
      } else {
        mm(xn.data(), T, {{wmat(L.q), q.data()}, {wmat(L.kv_a), kv_a.data()}});
      }
      site.f32(l, "attn.q", {T, q_dim}, q.data());  // per head: Dn nope, then Dr rope
      site.f32(l, "attn.kv_a", {T, Lw}, kv_a.data());

      // kv_a = [latent | k_pe]: the latent normalised (the vector every
      // head's keys and values come from), the rope key left for RoPE.
      for (int64_t t = 0; t < T; ++t) {
        std::copy_n(&kv_a[size_t(t * Lw)], Rkv, &latent[size_t(t * Rkv)]);
        std::copy_n(&kv_a[size_t(t * Lw + Rkv)], Dr, &k_pe[size_t(t * Dr)]);
      }
      rms_norm(pool_, latent.data(), T, Rkv, wmat(L.kv_a_norm), kMlaNormEps, latent.data());  // [T, Rkv]
      site.f32(l, "attn.kv_a_norm", {T, Rkv}, latent.data());
      if (!absorbed_) {
        mm(latent.data(), T, wmat(L.kv_b), kv.data());  // [T, Hq*(Dn+Dv)]
        site.f32(l, "attn.kv", {T, Hq * (Dn + Dv)}, kv.data());          // per head: Dn key, then Dv value
      }

      // RoPE on q's rope part of every head and on the one shared k_pe, in
      // halves order after rope_interleave's reorder (mla-rope-front: the
      // first Dr dims rotated, the last Dn taken as q_nope).
      const int64_t rot_at = bug.mla_rope_front ? 0 : Dn;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < Hq; ++h) {
          float* qh = &q[size_t(t * q_dim + h * Dk)];
          std::copy_n(qh + rot_at, Dr, &q_pe[size_t((t * Hq + h) * Dr)]);
          if (bug.mla_rope_front) std::memmove(qh, qh + Dr, size_t(Dn) * sizeof(float));
        }
      if (c.mla.rope_interleave) {
        pairs_to_halves(q_pe.data(), T * Hq, Dr);  // [T, Hq*Dr]
        pairs_to_halves(k_pe.data(), T, Dr);       // [T, Dr]
      }
      rope(q_pe.data(), T, Hq, Dr, cos.data(), sin.data());  // [T, Hq*Dr]
      rope(k_pe.data(), T, 1, Dr, cos.data(), sin.data());   // [T, Dr]
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < Hq; ++h)
          std::copy_n(&q_pe[size_t((t * Hq + h) * Dr)], Dr, &q[size_t(t * q_dim + h * Dk + Dn)]);
      site.f32(l, "attn.k_pe", {T, Dr}, k_pe.data());
      site.head_major(l, "attn.q_rope", q.data(), T, Hq, Dk);  // [Hq, T, Dn+Dr]: q_nope, rope(q_pe)

      // Naive form: every head's key [k_nope | k_pe] and value out of kv
      // (mla-value-as-key: k_nope read from the value rows).
      const int64_t key_at = bug.mla_value_as_key ? Dn : 0;
      if (!absorbed_) {
        for (int64_t t = 0; t < T; ++t)
          for (int64_t h = 0; h < Hq; ++h) {
            const float* kvh = &kv[size_t((t * Hq + h) * (Dn + Dv))];
            std::copy_n(kvh + key_at, Dn, &k[size_t(t * k_dim + h * Dk)]);
            std::copy_n(&k_pe[size_t(t * Dr)], Dr, &k[size_t(t * k_dim + h * Dk + Dn)]);
            std::copy_n(kvh + Dn, Dv, &v[size_t(t * v_dim + h * Dv)]);
          }
        site.head_major(l, "attn.k_rope", k.data(), T, Hq, Dk);  // [Hq, T, Dn+Dr]
      }

      // Append the latent and k_pe rows to the latent cache [S, Rkv+Dr].
      cache.latent.resize(size_t(S * Lw));
      for (int64_t t = 0; t < T; ++t) {
        float* row = &cache.latent[size_t((S - T + t) * Lw)];
        std::copy_n(&latent[size_t(t * Rkv)], Rkv, row);
        std::copy_n(&k_pe[size_t(t * Dr)], Dr, row + Rkv);
      }
      if (site.wants(l, "attn.latent_cache"))
        site.f32(l, "attn.latent_cache", {S, Rkv}, columns(cache.latent, S, Lw, 0, Rkv).data());
      if (site.wants(l, "attn.k_pe_cache"))
        site.f32(l, "attn.k_pe_cache", {S, Dr}, columns(cache.latent, S, Lw, Rkv, Dr).data());

      if (!absorbed_) {
        // Naive: the full keys [S, Hq*(Dn+Dr)] and values [S, Hq*Dv] cached,
        // plain attention with a head of Dn+Dr for q·k and Dv for v.
        cache.append(k, v, S, T, k_dim, v_dim, precision_.kv_cache);
        if (site.wants(l, "attn.k_cache"))
          site.f32(l, "attn.k_cache", {Hq, S, Dk}, head_major_cache(cache.k, S, Hq, Dk).data());
        if (site.wants(l, "attn.v_cache"))
          site.f32(l, "attn.v_cache", {Hq, S, Dv}, head_major_cache(cache.v, S, Hq, Dv).data());
        att.Hq = Hq, att.Hkv = Hkv, att.Dh = Dk, att.Dv = Dv;
        att.q = q.data(), att.k = cache.k.data(), att.v = cache.v.data(), att.kv_head = kv_head_.data();
      if (precision_.weights) att.product_rounding = precision_.kv_cache;  // ggml multiplies in the cache's type
        att.ctx = ctx.data();
        attention(pool_, attn_rows_, att);
      } else {
        // Absorbed: q_nope·k_nope = q_nope·(W_uk_h·latent) = (W_uk_hᵀ·q_nope)·latent,
        // so each head's query becomes [W_uk_hᵀ·q_nope | rope(q_pe)] in
        // latent space [T, Hq*(Rkv+Dr)] and attends the latent cache rows
        // [latent | k_pe] like one shared kv head; probs·latent [T, Hq*Rkv]
        // then goes through the head's value rows W_uv_h of kv_b.
        HeadMatmul uk;  // W_uk_h = kv_b rows [h*(Dn+Dv), +Dn): [Dn, Rkv]
        uk.T = T, uk.H = Hq;
        uk.x = q.data(), uk.x_row = q_dim, uk.x_head = Dk;
        uk.w = wmat(L.kv_b), uk.w_head = Dn + Dv, uk.w_row0 = key_at, uk.w_rows = Dn;
        uk.y = q_lat.data(), uk.y_row = Hq * Lw, uk.y_head = Lw;
        head_matmul_t(pool_, uk);  // [T, Hq*(Rkv+Dr)]: latent part
        for (int64_t t = 0; t < T; ++t)
          for (int64_t h = 0; h < Hq; ++h)
            std::copy_n(&q_pe[size_t((t * Hq + h) * Dr)], Dr, &q_lat[size_t((t * Hq + h) * Lw + Rkv)]);
        att.Hq = Hq, att.Hkv = 1, att.Dh = Lw, att.Dv = Rkv, att.k_stride = Lw, att.v_stride = Lw;
        att.q = q_lat.data(), att.k = cache.latent.data(), att.v = cache.latent.data();
        att.kv_head = latent_head_.data();
        att.ctx = ctx_lat.data();
        attention(pool_, attn_rows_, att);  // ctx_lat [T, Hq*Rkv]
        HeadMatmul uv;  // W_uv_h = kv_b rows [h*(Dn+Dv) + Dn, +Dv): [Dv, Rkv]
        uv.T = T, uv.H = Hq;
        uv.x = ctx_lat.data(), uv.x_row = Hq * Rkv, uv.x_head = Rkv;
        uv.w = wmat(L.kv_b), uv.w_head = Dn + Dv, uv.w_row0 = Dn, uv.w_rows = Dv;
        uv.y = ctx.data(), uv.y_row = ctx_dim, uv.y_head = Dv;
        head_matmul(pool_, uv);  // [T, Hq*Dv]
      }
    }
    if (!scores.empty()) site.f32(l, "attn.scores", {Hq, T, S}, scores.data());
    if (!probs.empty()) site.f32(l, "attn.probs", {Hq, T, S}, probs.data());
    site.f32(l, "attn.ctx", {T, ctx_dim}, ctx.data());

    mm(ctx.data(), T, wmat(L.o), proj.data());  // [T, D]
    if (c.o_bias) add_bias(wmat(L.o_bias), T, proj.data());
    site.f32(l, "attn.out", {T, D}, proj.data());
    add(x.data(), proj.data(), T * D, x.data());  // [T, D]
    site.f32(l, "attn_residual", {T, D}, x.data());

    // ---- feed-forward block
    rms_norm(pool_, x.data(), T, D, wmat(L.post_attn_norm), eps, xn.data());  // [T, D]
    site.f32(l, "mlp_norm", {T, D}, xn.data());
    if (!c.moe.is_moe_layer(l)) {
      // Dense MLP: down(silu(gate(x)) * up(x))
      swiglu(L.mlp, xn.data(), T, gate.data(), up.data(), act.data(), proj.data());
      site.f32(l, "mlp.gate", {T, F}, gate.data());
      site.f32(l, "mlp.up", {T, F}, up.data());
      site.f32(l, "mlp.act", {T, F}, act.data());
      site.f32(l, "mlp.down", {T, D}, proj.data());  // [T, D]
    } else {
      // ---- mixture of experts: the router picks K of E experts per token
      const MoeConfig& moe = c.moe;
      mm(xn.data(), T, wmat(L.router), router_logits.data());  // [T, E]
      site.f32(l, "moe.router_logits", {T, E}, router_logits.data());
      // (moe-softmax-routing: softmax whatever the model's scoring.)
      const bool sigmoid = moe.scoring == MoeConfig::Scoring::Sigmoid && !bug.moe_softmax_scoring;
      for (int64_t t = 0; t < T; ++t) {
        const float* lg = &router_logits[size_t(t * E)];
        float* p = &router_probs[size_t(t * E)];
        if (sigmoid) {
          for (int64_t e = 0; e < E; ++e) p[e] = 1.0f / (1.0f + std::exp(-lg[e]));
        } else {  // softmax over the experts
          const float mx = *std::max_element(lg, lg + E);
          float sum = 0.0f;
          for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(lg[e] - mx));
          for (int64_t e = 0; e < E; ++e) p[e] /= sum;
        }
      }
      site.f32(l, "moe.router_probs", {T, E}, router_probs.data());  // [T, E]
      std::vector<float> bias(size_t(moe.correction_bias ? E : 0));  // [E] e_score_correction_bias
      if (moe.correction_bias) load_row(wmat(L.router_bias), 0, 0, E, bias.data());
      for (int64_t t = 0; t < T; ++t) {
        const float* p = &router_probs[size_t(t * E)];
        if (bug.moe_bias_in_weights) {
          // The same choice, weighted by score + bias instead of the score.
          std::vector<float> biased(static_cast<size_t>(E));  // [E]
          for (int64_t e = 0; e < E; ++e) biased[size_t(e)] = p[e] + bias[size_t(e)];
          moe_route(moe, biased.data(), nullptr, &topk_ids[size_t(t * K)], &topk_weights[size_t(t * K)]);
        } else {
          moe_route(moe, p, bias.empty() ? nullptr : bias.data(), &topk_ids[size_t(t * K)],
                    &topk_weights[size_t(t * K)]);
        }
      }
      site.i64(l, "moe.topk_ids", {T, K}, topk_ids.data());          // [T, K], ascending expert id
      site.f32(l, "moe.topk_weights", {T, K}, topk_weights.data());  // [T, K]

      // Each expert runs once on the rows routed to it (a decode step reads
      // the weights of K experts, not E); its output rows land in their
      // token's slot of expert_out.
      for (int64_t e = 0; e < E; ++e) {
        std::vector<int64_t> slots;  // t*K + k of each row routed to expert e
        for (int64_t i = 0; i < T * K; ++i)
          if (topk_ids[size_t(i)] == e) slots.push_back(i);
        const int64_t n = int64_t(slots.size());
        if (n == 0) continue;
        for (int64_t r = 0; r < n; ++r)
          std::copy_n(&xn[size_t(slots[size_t(r)] / K * D)], D, &expert_in[size_t(r * D)]);  // [n, D]
        const int64_t runs = bug.moe_expert_shift ? (e + 1) % E : e;  // moe-expert-off-by-one
        swiglu(L.experts[size_t(runs)], expert_in.data(), n, gate.data(), up.data(), act.data(), expert_y.data());
        for (int64_t r = 0; r < n; ++r)
          std::copy_n(&expert_y[size_t(r * D)], D, &expert_out[size_t(slots[size_t(r)] * D)]);  // [T, K, D]
      }
      site.f32(l, "moe.expert_out", {T, K, D}, expert_out.data());
      // routed = Σ_k w_k · expert_out_k, in ascending expert id (HF's index_add_ order).
      for (int64_t t = 0; t < T; ++t) {
        float* r = &routed[size_t(t * D)];
        std::fill_n(r, D, 0.0f);
        for (int64_t kk = 0; kk < K; ++kk) {
          const float wk = topk_weights[size_t(t * K + kk)];
          const float* eo = &expert_out[size_t((t * K + kk) * D)];
          for (int64_t d = 0; d < D; ++d) r[d] += wk * eo[d];
        }
      }
      site.f32(l, "moe.routed", {T, D}, routed.data());  // [T, D]

      if (L.shared.gate && !bug.moe_shared_missing) {
        // Shared expert on every token (Qwen2-MoE: scaled by sigmoid(shared_expert_gate(x))).
        swiglu(L.shared, xn.data(), T, gate.data(), up.data(), act.data(), shared.data());  // [T, D]
        if (L.shared_gate) {
          std::vector<float> g(static_cast<size_t>(T));  // [T, 1]
          mm(xn.data(), T, wmat(L.shared_gate), g.data());
          for (int64_t t = 0; t < T; ++t) {
            const float sg = 1.0f / (1.0f + std::exp(-g[size_t(t)]));
            for (int64_t d = 0; d < D; ++d) shared[size_t(t * D + d)] *= sg;
          }
        }
        site.f32(l, "moe.shared", {T, D}, shared.data());
        add(routed.data(), shared.data(), T * D, proj.data());  // [T, D]
      } else {
        std::copy(routed.begin(), routed.end(), proj.begin());  // [T, D]
      }
      site.f32(l, "moe.out", {T, D}, proj.data());
    }
    add(x.data(), proj.data(), T * D, x.data());  // [T, D]
    site.f32(l, "out", {T, D}, x.data());
    if (release_) w.release_layer(l);
  }
  if (end_layer < int(c.num_hidden_layers)) {  // a shard ending before the last layer: no head
    if (release_) w.release_head();              // the embedding's pages
    cached_ = S;
    return {};
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
  mm(last_hidden, 1, head, next.data());  // [V]
  if (site.wants("logits")) {
    std::vector<float> logits(size_t(T * V));  // [T, V]
    mm(xn.data(), T, head, logits.data());
    std::copy(next.begin(), next.end(), logits.begin() + last * V);
    site.f32("logits", {T, V}, logits.data());
  }
  site.f32("next_logits", {V}, next.data());
  if (release_) w.release_head();

  cached_ = S;
  return next;
}

}  // namespace

const char* mla_form_name(MlaForm f) { return f == MlaForm::Absorbed ? "absorbed" : "naive"; }

MlaForm parse_mla_form(const std::string& text) {
  if (text == "naive") return MlaForm::Naive;
  if (text == "absorbed") return MlaForm::Absorbed;
  throw UsageError("unknown MLA form '" + text + "' (supported: naive, absorbed)");
}

std::unique_ptr<Engine> make_impl_engine(const Model& model, const ImplOptions& opt) {
  return std::make_unique<ImplEngine>(model, opt);
}

}  // namespace llmdiff::impl
