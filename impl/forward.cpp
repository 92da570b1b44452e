// The impl's forward pass (forward.h), written from the math: each stage
// over the packed rows of a call, calling the kernels of kernels.h and the
// RoPE of rope.h, reporting every intermediate under its canonical name
// (dumps/contract/sites.h) where it is computed. Weights stay in the
// checkpoint's mmap in their stored dtype; activations are float32.
#include "impl/forward.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dumps/base/errors.h"
#include "dumps/contract/sequences.h"
#include "dumps/contract/sites.h"
#include "impl/cache_views.h"
#include "impl/rope.h"

namespace llmdiff::impl {

namespace {

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

// v as n zeros, reusing its storage.
template <class T>
std::vector<T>& zeroed(std::vector<T>& v, int64_t n) {
  v.assign(size_t(n), T{});
  return v;
}

// The type a matmul's weights are stored in, as ggml names it.
GgmlType weight_type(const WMat& w) {
  if (w.quantized()) return w.quant;
  return w.dtype == DType::F16 ? GgmlType::F16 : w.dtype == DType::BF16 ? GgmlType::BF16 : GgmlType::F32;
}

}  // namespace

const char* mla_form_name(MlaForm f) { return f == MlaForm::Absorbed ? "absorbed" : "naive"; }

MlaForm parse_mla_form(const std::string& text) {
  if (text == "naive") return MlaForm::Naive;
  if (text == "absorbed") return MlaForm::Absorbed;
  throw UsageError("unknown MLA form '" + text + "' (supported: naive, absorbed)");
}

// ---- reporting

// Reports a call's intermediates under each sequence's canonical names:
// a packed tensor [R, ...] as each sequence's rows [T, ...].
class Forward::Sites {
 public:
  Sites(Observer& obs, const ForwardCall& call) : obs_(obs), call_(call) {}
  Observer& observer() { return obs_; }
  std::string name(const SequenceRows& s, Site site) const { return prefix(s) + step_name(s.step, site); }
  std::string name(const SequenceRows& s, int l, Site site) const { return prefix(s) + layer_name(s.step, l, site); }
  bool wants(const SequenceRows& s, Site site) const { return s.reported() && obs_.wants(name(s, site)); }
  bool wants(const SequenceRows& s, int l, Site site) const { return s.reported() && obs_.wants(name(s, l, site)); }
  // packed [R, inner...]: each sequence's [T, inner...]
  void rows(Site site, const Shape& inner, const float* packed) {
    for (const SequenceRows& s : call_.seqs)
      if (s.reported()) emit(name(s, site), s, inner, packed);
  }
  void rows(int l, Site site, const Shape& inner, const float* packed) {
    for (const SequenceRows& s : call_.seqs)
      if (s.reported()) emit(name(s, l, site), s, inner, packed);
  }
  void rows(Site site, int64_t width, const float* packed) { rows(site, Shape{width}, packed); }
  void rows(int l, Site site, int64_t width, const float* packed) { rows(l, site, Shape{width}, packed); }
  void rows_i64(int l, Site site, int64_t width, const int64_t* packed) {
    for (const SequenceRows& s : call_.seqs)
      if (s.reported()) i64(s, l, site, {s.T, width}, packed + s.row0 * width);
  }
  // packed [R, H*Dh]: each sequence's [H, T, Dh] (transposed only when wanted)
  void head_major(int l, Site site, const float* packed, int64_t H, int64_t Dh) {
    for (const SequenceRows& s : call_.seqs) {
      if (!s.reported()) continue;
      const std::string n = name(s, l, site);
      if (!obs_.wants(n)) continue;
      std::vector<float> out(size_t(H * s.T * Dh));  // [H, T, Dh]
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < s.T; ++t)
          std::memcpy(&out[size_t((h * s.T + t) * Dh)], packed + ((s.row0 + t) * H + h) * Dh,
                      size_t(Dh) * sizeof(float));
      obs_.on_f32(n, {H, s.T, Dh}, out.data());
    }
  }
  void f32(const SequenceRows& s, Site site, const Shape& shape, const float* data) {
    if (wants(s, site)) obs_.on_f32(name(s, site), shape, data);
  }
  void f32(const SequenceRows& s, int l, Site site, const Shape& shape, const float* data) {
    if (wants(s, l, site)) obs_.on_f32(name(s, l, site), shape, data);
  }
  void i64(const SequenceRows& s, Site site, const Shape& shape, const int64_t* data) {
    if (wants(s, site)) obs_.on_i64(name(s, site), shape, data);
  }
  void i64(const SequenceRows& s, int l, Site site, const Shape& shape, const int64_t* data) {
    if (wants(s, l, site)) obs_.on_i64(name(s, l, site), shape, data);
  }

 private:
  std::string prefix(const SequenceRows& s) const { return call_.batched ? sequence_prefix(s.seq) : ""; }
  void emit(const std::string& n, const SequenceRows& s, const Shape& inner, const float* packed) {
    if (!obs_.wants(n)) return;
    Shape shape{s.T};
    int64_t width = 1;
    for (int64_t d : inner) shape.push_back(d), width *= d;
    obs_.on_f32(n, shape, packed + s.row0 * width);
  }
  Observer& obs_;
  const ForwardCall& call_;
};

// The buffers of one forward call over R rows, kept between calls so that a
// decode step allocates nothing: each is resized (within its capacity after
// the first call of that length) and zeroed.
struct Forward::Buffers {
  std::vector<float> cos, sin;          // [R, Dh]
  std::vector<float> x, xn;             // [R, D] residual stream, normed input
  std::vector<float> q, k, v, ctx;      // [R, Hq*Dk], [R, Hkv*Dk], [R, Hkv*Dvh], [R, Hq*Dvh]
  std::vector<float> proj;              // [R, D] attn.out / mlp.down / moe.out
  std::vector<float> gate, up, act;     // [R, F] of any MLP
  // MLA
  std::vector<float> q_a;               // [R, Rq]
  std::vector<float> kv_a;              // [R, Rkv+Dr]
  std::vector<float> latent;            // [R, Rkv] kv_a_norm
  std::vector<float> kv;                // [R, Hq*(Dn+Dv)]
  std::vector<float> q_pe, k_pe;        // [R, Hq*Dr], [R, Dr]
  std::vector<float> latent_rows;       // [R, Rkv+Dr]: the latent cache's new rows
  std::vector<float> q_lat, ctx_lat;    // [R, Hq*(Rkv+Dr)], [R, Hq*Rkv]
  // MoE
  std::vector<float> router_logits, router_probs;  // [R, E]
  std::vector<int64_t> topk_ids;                   // [R, K]
  std::vector<float> topk_weights;                 // [R, K]
  std::vector<float> expert_out;                   // [R, K, D]
  std::vector<float> expert_in, expert_y;          // [n, D] rows routed to one expert, and their output
  std::vector<float> routed, shared;               // [R, D]
  // attention with the rows of other sequences in front (packed-cross-attention)
  std::vector<float> keys, values, mask;

  // Every buffer sized for a call of R rows and zeroed.
  void prepare(const ModelConfig& c, bool absorbed, int64_t R);
};

void Forward::Buffers::prepare(const ModelConfig& c, bool absorbed, int64_t R) {
  const int64_t D = c.hidden_size, Dh = c.head_dim, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const bool mla = c.mla.enabled;
  const int64_t Rq = c.mla.q_lora_rank, Rkv = c.mla.kv_lora_rank;
  const int64_t Dn = c.mla.qk_nope_head_dim, Dr = c.mla.qk_rope_head_dim, Dv = c.mla.v_head_dim;
  const int64_t Lw = Rkv + Dr;
  // Attention widths: a query/key head of Dk, a value head of Dvh.
  const int64_t Dk = mla ? Dn + Dr : Dh, Dvh = mla ? Dv : Dh;
  const int64_t Fmax = std::max({c.intermediate_size, c.moe.intermediate_size, c.moe.shared_intermediate_size});
  const int64_t E = c.moe.num_experts, K = c.moe.top_k;
  const bool moe = c.moe.enabled();
  zeroed(cos, R * Dh), zeroed(sin, R * Dh);
  zeroed(x, R * D), zeroed(xn, R * D);
  zeroed(q, R * Hq * Dk);
  zeroed(k, absorbed ? 0 : R * Hkv * Dk), zeroed(v, absorbed ? 0 : R * Hkv * Dvh);
  zeroed(ctx, R * Hq * Dvh);
  zeroed(proj, R * D);
  zeroed(gate, R * Fmax), zeroed(up, R * Fmax), zeroed(act, R * Fmax);
  zeroed(q_a, mla ? R * Rq : 0), zeroed(kv_a, mla ? R * Lw : 0), zeroed(latent, mla ? R * Rkv : 0);
  zeroed(kv, mla && !absorbed ? R * Hq * (Dn + Dv) : 0);
  zeroed(q_pe, mla ? R * Hq * Dr : 0), zeroed(k_pe, mla ? R * Dr : 0), zeroed(latent_rows, mla ? R * Lw : 0);
  zeroed(q_lat, absorbed ? R * Hq * Lw : 0), zeroed(ctx_lat, absorbed ? R * Hq * Rkv : 0);
  zeroed(router_logits, R * E), zeroed(router_probs, R * E);
  zeroed(topk_ids, R * K), zeroed(topk_weights, R * K);
  zeroed(expert_out, moe ? R * K * D : 0);
  zeroed(expert_in, moe ? R * D : 0), zeroed(expert_y, moe ? R * D : 0), zeroed(routed, moe ? R * D : 0);
  zeroed(shared, c.moe.shared_intermediate_size > 0 ? R * D : 0);
}

// ---- construction

Forward::Forward(const Model& model, const ForwardOptions& opt)
    : cfg_(model.config), weights_(model.weights), opt_(opt),
      absorbed_(model.config.mla.enabled && opt.mla == MlaForm::Absorbed), pool_(opt.threads),
      buf_(std::make_unique<Buffers>()) {
  if (!weights_) throw UsageError("impl: model '" + model.config.source + "' has no weights loaded");
  std::vector<zoo::BugSpec> forward_bugs;  // the sampler's bugs act outside the forward pass
  for (const zoo::BugSpec& b : opt.bugs)
    if (!zoo::bug_info(b.bug).is_sampler()) forward_bugs.push_back(b);
  zoo::check_bugs(forward_bugs, cfg_);
  faults_ = zoo::apply_bugs(forward_bugs, cfg_);
  batch_faults_ = zoo::batch_faults(forward_bugs);
  const int64_t Hq = cfg_.num_attention_heads, Hkv = cfg_.num_key_value_heads;
  for (int64_t h = 0; h < Hq; ++h) kv_head_.push_back(int(faults_.repeat_kv_tile ? h % Hkv : h / (Hq / Hkv)));
  latent_head_.assign(size_t(Hq), 0);
}

Forward::~Forward() = default;

KvWidths Forward::kv_widths() const {
  const ModelConfig& c = cfg_;
  KvWidths w;
  if (!c.mla.enabled) {
    w.of[size_t(KvStream::Key)] = c.num_key_value_heads * c.head_dim;
    w.of[size_t(KvStream::Value)] = c.num_key_value_heads * c.head_dim;
    return w;
  }
  const MlaConfig& a = c.mla;
  w.of[size_t(KvStream::Latent)] = a.kv_lora_rank + a.qk_rope_head_dim;
  if (!absorbed_) {
    w.of[size_t(KvStream::Key)] = c.num_key_value_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim);
    w.of[size_t(KvStream::Value)] = c.num_key_value_heads * a.v_head_dim;
  }
  return w;
}

std::string Forward::describe() const {
  std::string p = "plain C++, float32 activations";
  if (cfg_.mla.enabled) p += std::string(", ") + mla_form_name(absorbed_ ? MlaForm::Absorbed : MlaForm::Naive) + " MLA";
  if (!opt_.precision.empty()) p += ", precision " + opt_.precision.str();
  return p;
}

void plan_rows(const Forward& f, SequenceRows& s, int64_t P, int64_t pad, int64_t ring, int64_t stale) {
  const ModelConfig& c = f.config();
  const zoo::Faults& bug = f.faults();
  const zoo::BatchFaults& batch_bug = f.batch_faults();
  const int64_t T = int64_t(s.tokens.size());
  s.T = T;
  // Keys held after this call: the cache plus this call's (kv-overwrite:
  // this call's only); attention reads them (context-len-plus-one: one more).
  s.kv.T = T;
  s.kv.write_at = bug.kv_overwrite ? 0 : P;
  s.kv.context = s.kv.write_at + T + (batch_bug.context_one_long ? 1 : 0) + stale;
  const int64_t S = s.kv.context;
  // Positions continue after the cached keys (P .. P+T-1).
  s.positions.resize(size_t(T));  // [T]
  for (int64_t t = 0; t < T; ++t)
    s.positions[size_t(t)] = (bug.position_reset ? 0 : P) + t + (batch_bug.positions_from_batch_start ? s.row0 : 0);
  // A left-padded row (generate): attention_mask.cumsum(-1) - 1, pads at 1.
  if (pad > 0)
    for (int64_t& p : s.positions) p = p < pad ? 1 : p - pad;
  // Causal over the S keys read: query t sits at key position S-T+t.
  s.mask = bug.mask_missing ? std::vector<float>(size_t(T * S), 1.0f)
                            : causal_mask(T, S, bug.mask_square ? 0 : S - T, c.sliding_window);  // [T, S]
  // A ring of `ring` slots holds the last `ring` positions: the older keys were overwritten.
  const int64_t ring_lost = ring > 0 && S > ring ? S - ring : 0;
  for (int64_t t = 0; t < T; ++t) std::fill_n(&s.mask[size_t(t * S)], ring_lost, 0.0f);
  // The attention_mask's pads, closed for every query (pad-keys-unmasked: open).
  if (pad > 0 && !bug.pad_keys_unmasked)
    for (int64_t t = 0; t < T; ++t) std::fill_n(&s.mask[size_t(t * S)], std::min(pad, S), 0.0f);
}

// ---- matrix products

void Forward::mm(const float* x, int64_t T, const std::vector<MatmulJob>& jobs) {
  const PrecisionProfile& p = opt_.precision;
  if (p.empty()) return matmul(pool_, mm_, x, T, jobs);
  std::vector<bool> done(jobs.size(), false);
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (done[i]) continue;
    const GgmlType r = p.input_rounding(weight_type(jobs[i].w));
    std::vector<MatmulJob> group;
    for (size_t j = i; j < jobs.size(); ++j)
      if (!done[j] && p.input_rounding(weight_type(jobs[j].w)) == r) {
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

void Forward::swiglu(const MlpWeights& m, const float* x, int64_t n, float* gate, float* up, float* act, float* out) {
  const int64_t F = m.gate.shape[0];
  mm(x, n, {{wmat(m.gate), gate}, {wmat(m.up), up}});  // [n, F] each
  if (faults_.gate_up_swap)
    silu_mul(pool_, up, gate, n * F, act);  // [n, F]
  else
    silu_mul(pool_, gate, up, n * F, act);  // [n, F]
  mm(act, n, wmat(m.down), out);  // [n, D]
}

// ---- the forward call

std::vector<float> Forward::run(const ForwardCall& call, KvStore& kv, Observer& obs) {
  const ModelConfig& c = cfg_;
  const ModelWeights& w = *weights_;
  Buffers& b = *buf_;
  const int64_t R = call.rows(), D = c.hidden_size, Dh = c.head_dim;
  if (call.seqs.empty() || R == 0) throw UsageError("impl: a forward call needs at least one token");
  Sites site(obs, call);

  b.prepare(c, absorbed_, R);

  // Per sequence: its RoPE tables (dynamic NTK follows each sequence's
  // largest position) into the packed cos/sin [R, Dh].
  bool inv_freq = call.iteration == 0;  // reported once, with the first reported sequence's frequencies
  for (const SequenceRows& s : call.seqs) {
    const RopeFrequencies freqs = rope_frequencies(c, *std::max_element(s.positions.begin(), s.positions.end()) + 1);
    if (inv_freq && s.reported()) {
      inv_freq = false;
      if (obs.wants("rope.inv_freq")) obs.on_f32("rope.inv_freq", {Dh / 2}, freqs.inv_freq.data());
    }
    rope_tables(freqs, s.positions, Dh, &b.cos[size_t(s.row0 * Dh)], &b.sin[size_t(s.row0 * Dh)]);
    site.i64(s, Site::Tokens, {s.T}, s.tokens.data());
    site.i64(s, Site::Positions, {s.T}, s.positions.data());
  }
  site.rows(Site::RopeCos, Dh, b.cos.data());
  site.rows(Site::RopeSin, Dh, b.sin.data());
  for (const SequenceRows& s : call.seqs) {
    site.f32(s, Site::Mask, {s.T, s.kv.context}, s.mask.data());  // [T, S]
    if (!kv.paged() || !s.reported()) continue;
    const std::vector<int64_t>& table = kv.table(s.seq);
    site.i64(s, Site::KvBlockTable, {int64_t(table.size())}, table.data());
    const std::vector<int64_t> sources = kv.block_sources(s.seq);  // a prefix cache: who wrote each block
    if (!sources.empty()) site.i64(s, Site::KvBlockSource, {int64_t(sources.size())}, sources.data());
    site.i64(s, Site::KvSlotMapping, {s.T}, s.kv.slots.data());
    site.i64(s, Site::KvContextLen, {1}, &s.kv.context);
  }

  // The layers this call runs: all, or a shard's.
  const int first = call.first_layer, end = call.end_layer < 0 ? int(c.num_hidden_layers) : call.end_layer;
  std::vector<float>& x = b.x;  // [R, D] residual stream
  if (first == 0) {
    for (const SequenceRows& s : call.seqs)
      for (int64_t t = 0; t < s.T; ++t) load_row(wmat(w.embed), s.tokens[size_t(t)], 0, D, &x[size_t((s.row0 + t) * D)]);
    site.rows(Site::Embed, D, x.data());
  } else {  // a shard: the residual stream entering its first layer
    std::copy(call.entering->begin(), call.entering->end(), x.begin());
  }

  for (int l = first; l < end; ++l) {
    attention_block(l, call, kv, site);
    ffn_block(l, R, site);
    if (opt_.release_weights) w.release_layer(l);
  }
  if (end < int(c.num_hidden_layers)) {  // a shard ending before the last layer: no head
    if (opt_.release_weights) w.release_head();  // the embedding's pages
    return {};
  }
  return head(call, site);
}

// ---- attention block: norm, attention (GQA or MLA), output projection, residual

void Forward::attention_block(int l, const ForwardCall& call, KvStore& kv, Sites& site) {
  const ModelConfig& c = cfg_;
  const LayerWeights& L = weights_->layers[size_t(l)];
  Buffers& b = *buf_;
  const int64_t R = call.rows(), D = c.hidden_size;
  rms_norm(pool_, b.x.data(), R, D, wmat(L.input_norm), float(c.rms_norm_eps), b.xn.data());  // [R, D]
  site.rows(l, Site::AttnNorm, D, b.xn.data());
  if (c.mla.enabled)
    mla_attention(l, call, kv, site);
  else
    gqa_attention(l, call, kv, site);
  const int64_t ctx_dim = int64_t(b.ctx.size()) / R;  // Hq*Dh, MLA: Hq*Dv
  site.rows(l, Site::AttnCtx, ctx_dim, b.ctx.data());

  std::vector<float>& proj = b.proj;
  mm(b.ctx.data(), R, wmat(L.o), proj.data());  // [R, D]
  if (c.o_bias) add_bias(wmat(L.o_bias), R, proj.data());
  site.rows(l, Site::AttnOut, D, proj.data());
  add(b.x.data(), proj.data(), R * D, b.x.data());  // [R, D]
  site.rows(l, Site::AttnResidual, D, b.x.data());
}

void Forward::attend(int l, const ForwardCall& call, const SequenceRows& s, AttentionArgs att, const float* new_k,
                     const float* new_v, Sites& site) {
  Buffers& b = *buf_;
  const int64_t T = s.T, S = s.kv.context, Hq = att.Hq;
  // Rows of this call that are not the sequence's own, attended in front of
  // its keys: the sequences before it (packed-cross-attention), the padding
  // rows (bucket-pad-leak).
  int64_t from = 0, extra = 0;
  if (batch_faults_.cross_attention) extra = s.row0;
  if (batch_faults_.bucket_pad_leak && !s.padding)
    for (const SequenceRows& p : call.seqs)
      if (p.padding) from = p.row0, extra = p.T;
  const int64_t Sx = extra + S;
  const float* mask = s.mask.data();  // [T, Sx]
  if (extra > 0) {
    const int64_t ks = att.k_stride > 0 ? att.k_stride : att.Hkv * att.Dh;
    const int64_t vs = att.v_stride > 0 ? att.v_stride : att.Hkv * (att.Dv > 0 ? att.Dv : att.Dh);
    auto in_front = [&](std::vector<float>& out, const float* packed, const float* own, int64_t width) {
      out.resize(size_t(Sx * width));  // [Sx, width]
      std::copy_n(packed + from * width, extra * width, out.data());
      std::copy_n(own, S * width, out.data() + extra * width);
      return out.data();
    };
    att.k = in_front(b.keys, new_k, att.k, ks);
    att.v = att.v == att.k ? att.k : in_front(b.values, new_v, att.v, vs);
    b.mask.assign(size_t(T * Sx), 1.0f);  // every extra key allowed
    for (int64_t t = 0; t < T; ++t) std::copy_n(&s.mask[size_t(t * S)], S, &b.mask[size_t(t * Sx + extra)]);
    mask = b.mask.data();
  }
  const bool want_scores = site.wants(s, l, Site::AttnScores), want_probs = site.wants(s, l, Site::AttnProbs);
  std::vector<float> scores(want_scores ? size_t(Hq * T * Sx) : 0), probs(want_probs ? size_t(Hq * T * Sx) : 0);
  att.T = T, att.S = Sx, att.mask = mask;
  att.scores = want_scores ? scores.data() : nullptr;
  att.probs = want_probs ? probs.data() : nullptr;
  attention(pool_, attn_rows_, att);
  // What this sequence's attention read over its own S positions: [Hq, T, Sx] -> [Hq, T, S].
  auto own_columns = [&](std::vector<float>& a) {
    if (extra == 0) return a.data();
    for (int64_t r = 0; r < Hq * T; ++r) std::copy_n(&a[size_t(r * Sx + extra)], S, &a[size_t(r * S)]);
    return a.data();
  };
  if (want_scores) site.f32(s, l, Site::AttnScores, {Hq, T, S}, own_columns(scores));
  if (want_probs) site.f32(s, l, Site::AttnProbs, {Hq, T, S}, own_columns(probs));
}

void Forward::gqa_attention(int l, const ForwardCall& call, KvStore& kv, Sites& site) {
  const ModelConfig& c = cfg_;
  const LayerWeights& L = weights_->layers[size_t(l)];
  const zoo::Faults& bug = faults_;
  Buffers& b = *buf_;
  const int64_t R = call.rows(), Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, Dh = c.head_dim;
  const int64_t q_dim = Hq * Dh, k_dim = Hkv * Dh;
  const float eps = float(c.rms_norm_eps);
  std::vector<float>& q = b.q;      // [R, Hq*Dh]
  std::vector<float>& k = b.k;      // [R, Hkv*Dh]
  std::vector<float>& v = b.v;      // [R, Hkv*Dh]
  std::vector<float>& ctx = b.ctx;  // [R, Hq*Dh]

  mm(b.xn.data(), R, {{wmat(L.q), q.data()}, {wmat(L.k), k.data()}, {wmat(L.v), v.data()}});
  if (c.qkv_bias) {
    add_bias(wmat(L.q_bias), R, q.data());
    add_bias(wmat(L.k_bias), R, k.data());
    add_bias(wmat(L.v_bias), R, v.data());
  }
  site.rows(l, Site::AttnQ, q_dim, q.data());
  site.rows(l, Site::AttnK, k_dim, k.data());
  site.rows(l, Site::AttnV, k_dim, v.data());

  // Qwen3: per-head RMSNorm of q and k (over Dh), before RoPE.
  auto qk_norm = [&] {
    rms_norm(pool_, q.data(), R * Hq, Dh, wmat(L.q_norm), eps, q.data());   // [R, Hq*Dh]
    rms_norm(pool_, k.data(), R * Hkv, Dh, wmat(L.k_norm), eps, k.data());  // [R, Hkv*Dh]
    site.rows(l, Site::AttnQNorm, q_dim, q.data());
    site.rows(l, Site::AttnKNorm, k_dim, k.data());
  };
  if (c.qk_norm && !bug.qk_norm_after_rope) qk_norm();
  auto rope = bug.rope_interleaved ? apply_rope_interleaved : apply_rope;
  rope(q.data(), R, Hq, Dh, b.cos.data(), b.sin.data());   // [R, Hq*Dh]
  rope(k.data(), R, Hkv, Dh, b.cos.data(), b.sin.data());  // [R, Hkv*Dh]
  site.head_major(l, Site::AttnQRope, q.data(), Hq, Dh);   // [Hq, T, Dh]
  site.head_major(l, Site::AttnKRope, k.data(), Hkv, Dh);  // [Hkv, T, Dh]
  if (c.qk_norm && bug.qk_norm_after_rope) qk_norm();

  // Every sequence's new keys (after RoPE) and values into the cache.
  for (const SequenceRows& s : call.seqs) {
    kv.write(l, KvStream::Key, s.kv, &k[size_t(s.row0 * k_dim)]);
    kv.write(l, KvStream::Value, s.kv, &v[size_t(s.row0 * k_dim)]);
  }
  // Attention per sequence over the keys it reads.
  const PrecisionProfile& prec = opt_.precision;
  for (const SequenceRows& s : call.seqs) {
    // What the cache holds: k_cache, v_cache [Hkv, n, Dh], then both after repeat_kv [Hq, n, Dh].
    std::vector<float> held[2];
    int64_t n = 0;
    const Site cache_site[2] = {Site::AttnKCache, Site::AttnVCache}, rep_site[2] = {Site::AttnKRep, Site::AttnVRep};
    const KvStream stream[2] = {KvStream::Key, KvStream::Value};
    for (int i = 0; i < 2; ++i)
      if (site.wants(s, l, cache_site[i]) || site.wants(s, l, rep_site[i])) held[i] = kv.held(l, stream[i], s.kv, &n);
    for (int i = 0; i < 2; ++i)
      if (site.wants(s, l, cache_site[i]))
        site.f32(s, l, cache_site[i], {Hkv, n, Dh}, head_major_cache(held[i], n, Hkv, Dh).data());
    for (int i = 0; i < 2; ++i)
      if (site.wants(s, l, rep_site[i]))
        site.f32(s, l, rep_site[i], {Hq, n, Dh}, repeat_kv(held[i], n, Hq, Hkv, Dh, kv_head_).data());
    AttentionArgs att;
    att.Hq = Hq, att.Hkv = Hkv, att.Dh = Dh, att.scale = float(c.attn_scaling());
    if (bug.softmax_scale_dh) att.scale = float(1.0 / double(Dh));
    att.q = &q[size_t(s.row0 * q_dim)];
    att.k = kv.read(l, KvStream::Key, s.kv);
    att.v = kv.read(l, KvStream::Value, s.kv);
    att.kv_head = kv_head_.data();
    if (prec.weights || prec.flash_attention) att.product_rounding = prec.kv_cache;  // ggml multiplies in the cache's type
    att.flash = prec.flash_attention;
    att.ctx = &ctx[size_t(s.row0 * q_dim)];
    attend(l, call, s, att, k.data(), v.data(), site);
  }
}

void Forward::mla_attention(int l, const ForwardCall& call, KvStore& kv, Sites& site) {
  const ModelConfig& c = cfg_;
  const LayerWeights& L = weights_->layers[size_t(l)];
  const zoo::Faults& bug = faults_;
  Buffers& b = *buf_;
  // q through the rank-Rq bottleneck, keys and values of every head from one
  // rank-Rkv latent, a Dr-wide rope key shared by all heads (Dh = Dr: the
  // RoPE tables' width).
  const int64_t R = call.rows(), Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const int64_t Rq = c.mla.q_lora_rank, Rkv = c.mla.kv_lora_rank;
  const int64_t Dn = c.mla.qk_nope_head_dim, Dr = c.mla.qk_rope_head_dim, Dv = c.mla.v_head_dim;
  const int64_t Lw = Rkv + Dr, Dk = Dn + Dr;  // latent cache row [latent | k_pe]; a query/key head
  const int64_t q_dim = Hq * Dk, k_dim = Hkv * Dk, v_dim = Hkv * Dv, ctx_dim = Hq * Dv;
  std::vector<float>& q = b.q;              // [R, Hq*(Dn+Dr)]
  std::vector<float>& k = b.k;              // [R, Hkv*(Dn+Dr)] (naive form)
  std::vector<float>& v = b.v;              // [R, Hkv*Dv] (naive form)
  std::vector<float>& ctx = b.ctx;          // [R, Hq*Dv]
  std::vector<float>& q_a = b.q_a;          // [R, Rq]
  std::vector<float>& kv_a = b.kv_a;        // [R, Rkv+Dr]
  std::vector<float>& latent = b.latent;    // [R, Rkv]
  std::vector<float>& kvb = b.kv;           // [R, Hq*(Dn+Dv)] (naive form)
  std::vector<float>& q_pe = b.q_pe;        // [R, Hq*Dr]
  std::vector<float>& k_pe = b.k_pe;        // [R, Dr]
  std::vector<float>& rows = b.latent_rows; // [R, Rkv+Dr]

  // q_a [R, Rq] (without q_lora_rank: q straight from xn) and kv_a [R, Rkv+Dr].
  if (Rq > 0) {
    mm(b.xn.data(), R, {{wmat(L.q_a), q_a.data()}, {wmat(L.kv_a), kv_a.data()}});
    site.rows(l, Site::AttnQA, Rq, q_a.data());
    rms_norm(pool_, q_a.data(), R, Rq, wmat(L.q_a_norm), kMlaNormEps, q_a.data());  // [R, Rq]
    site.rows(l, Site::AttnQANorm, Rq, q_a.data());
    mm(q_a.data(), R, wmat(L.q), q.data());  // [R, Hq*(Dn+Dr)]
  } else {
    mm(b.xn.data(), R, {{wmat(L.q), q.data()}, {wmat(L.kv_a), kv_a.data()}});
  }
  site.rows(l, Site::AttnQ, q_dim, q.data());  // per head: Dn nope, then Dr rope
  site.rows(l, Site::AttnKvA, Lw, kv_a.data());

  // kv_a = [latent | k_pe]: the latent normalised (the vector every head's
  // keys and values come from), the rope key left for RoPE.
  for (int64_t t = 0; t < R; ++t) {
    std::copy_n(&kv_a[size_t(t * Lw)], Rkv, &latent[size_t(t * Rkv)]);
    std::copy_n(&kv_a[size_t(t * Lw + Rkv)], Dr, &k_pe[size_t(t * Dr)]);
  }
  rms_norm(pool_, latent.data(), R, Rkv, wmat(L.kv_a_norm), kMlaNormEps, latent.data());  // [R, Rkv]
  site.rows(l, Site::AttnKvANorm, Rkv, latent.data());
  if (!absorbed_) {
    mm(latent.data(), R, wmat(L.kv_b), kvb.data());         // [R, Hq*(Dn+Dv)]
    site.rows(l, Site::AttnKv, Hq * (Dn + Dv), kvb.data());  // per head: Dn key, then Dv value
  }

  // RoPE on q's rope part of every head and on the one shared k_pe, in
  // halves order after rope_interleave's reorder (mla-rope-front: the first
  // Dr dims rotated, the last Dn taken as q_nope).
  const int64_t rot_at = bug.mla_rope_front ? 0 : Dn;
  for (int64_t t = 0; t < R; ++t)
    for (int64_t h = 0; h < Hq; ++h) {
      float* qh = &q[size_t(t * q_dim + h * Dk)];
      std::copy_n(qh + rot_at, Dr, &q_pe[size_t((t * Hq + h) * Dr)]);
      if (bug.mla_rope_front) std::memmove(qh, qh + Dr, size_t(Dn) * sizeof(float));
    }
  if (c.mla.rope_interleave) {
    pairs_to_halves(q_pe.data(), R * Hq, Dr);  // [R, Hq*Dr]
    pairs_to_halves(k_pe.data(), R, Dr);       // [R, Dr]
  }
  auto rope = bug.rope_interleaved ? apply_rope_interleaved : apply_rope;
  rope(q_pe.data(), R, Hq, Dr, b.cos.data(), b.sin.data());  // [R, Hq*Dr]
  rope(k_pe.data(), R, 1, Dr, b.cos.data(), b.sin.data());   // [R, Dr]
  for (int64_t t = 0; t < R; ++t)
    for (int64_t h = 0; h < Hq; ++h)
      std::copy_n(&q_pe[size_t((t * Hq + h) * Dr)], Dr, &q[size_t(t * q_dim + h * Dk + Dn)]);
  site.rows(l, Site::AttnKPe, Dr, k_pe.data());
  site.head_major(l, Site::AttnQRope, q.data(), Hq, Dk);  // [Hq, T, Dn+Dr]: q_nope, rope(q_pe)

  // Naive form: every head's key [k_nope | k_pe] and value out of kv
  // (mla-value-as-key: k_nope read from the value rows).
  const int64_t key_at = bug.mla_value_as_key ? Dn : 0;
  if (!absorbed_) {
    for (int64_t t = 0; t < R; ++t)
      for (int64_t h = 0; h < Hq; ++h) {
        const float* kvh = &kvb[size_t((t * Hq + h) * (Dn + Dv))];
        std::copy_n(kvh + key_at, Dn, &k[size_t(t * k_dim + h * Dk)]);
        std::copy_n(&k_pe[size_t(t * Dr)], Dr, &k[size_t(t * k_dim + h * Dk + Dn)]);
        std::copy_n(kvh + Dn, Dv, &v[size_t(t * v_dim + h * Dv)]);
      }
    site.head_major(l, Site::AttnKRope, k.data(), Hq, Dk);  // [Hq, T, Dn+Dr]
  }

  // The latent cache's new rows [latent | k_pe], and (naive) the full keys
  // and values, into the cache.
  for (int64_t t = 0; t < R; ++t) {
    std::copy_n(&latent[size_t(t * Rkv)], Rkv, &rows[size_t(t * Lw)]);
    std::copy_n(&k_pe[size_t(t * Dr)], Dr, &rows[size_t(t * Lw + Rkv)]);
  }
  for (const SequenceRows& s : call.seqs) {
    kv.write(l, KvStream::Latent, s.kv, &rows[size_t(s.row0 * Lw)]);
    if (absorbed_) continue;
    kv.write(l, KvStream::Key, s.kv, &k[size_t(s.row0 * k_dim)]);
    kv.write(l, KvStream::Value, s.kv, &v[size_t(s.row0 * v_dim)]);
  }

  // Absorbed: q_nope·k_nope = q_nope·(W_uk_h·latent) = (W_uk_hᵀ·q_nope)·latent,
  // so each head's query becomes [W_uk_hᵀ·q_nope | rope(q_pe)] in latent
  // space [R, Hq*(Rkv+Dr)] and attends the latent cache rows [latent | k_pe]
  // like one shared kv head; probs·latent [R, Hq*Rkv] then goes through the
  // head's value rows W_uv_h of kv_b.
  std::vector<float>& q_lat = b.q_lat;      // [R, Hq*(Rkv+Dr)] (absorbed form)
  std::vector<float>& ctx_lat = b.ctx_lat;  // [R, Hq*Rkv] (absorbed form)
  if (absorbed_) {
    HeadMatmul uk;  // W_uk_h = kv_b rows [h*(Dn+Dv), +Dn): [Dn, Rkv]
    uk.T = R, uk.H = Hq;
    uk.x = q.data(), uk.x_row = q_dim, uk.x_head = Dk;
    uk.w = wmat(L.kv_b), uk.w_head = Dn + Dv, uk.w_row0 = key_at, uk.w_rows = Dn;
    uk.y = q_lat.data(), uk.y_row = Hq * Lw, uk.y_head = Lw;
    head_matmul_t(pool_, uk);  // [R, Hq*(Rkv+Dr)]: latent part
    for (int64_t t = 0; t < R; ++t)
      for (int64_t h = 0; h < Hq; ++h)
        std::copy_n(&q_pe[size_t((t * Hq + h) * Dr)], Dr, &q_lat[size_t((t * Hq + h) * Lw + Rkv)]);
  }

  const float scale = float(bug.softmax_scale_dh ? 1.0 / double(Dk)
                            : bug.mla_no_mscale  ? std::pow(double(Dk), -0.5)
                                                 : c.attn_scaling());
  for (const SequenceRows& s : call.seqs) {
    if (site.wants(s, l, Site::AttnLatentCache) || site.wants(s, l, Site::AttnKPeCache)) {
      int64_t n = 0;
      const std::vector<float> held = kv.held(l, KvStream::Latent, s.kv, &n);  // [n, Rkv+Dr]
      if (site.wants(s, l, Site::AttnLatentCache))
        site.f32(s, l, Site::AttnLatentCache, {n, Rkv}, columns(held, n, Lw, 0, Rkv).data());
      if (site.wants(s, l, Site::AttnKPeCache))
        site.f32(s, l, Site::AttnKPeCache, {n, Dr}, columns(held, n, Lw, Rkv, Dr).data());
    }
    AttentionArgs att;
    att.scale = scale;
    if (!absorbed_) {
      // Naive: the full keys [S, Hq*(Dn+Dr)] and values [S, Hq*Dv] cached,
      // plain attention with a head of Dn+Dr for q·k and Dv for v.
      auto report = [&](KvStream stream, Site cache, int64_t width) {
        if (!site.wants(s, l, cache)) return;
        int64_t n = 0;
        const std::vector<float> held = kv.held(l, stream, s.kv, &n);
        site.f32(s, l, cache, {Hq, n, width}, head_major_cache(held, n, Hq, width).data());
      };
      report(KvStream::Key, Site::AttnKCache, Dk);
      report(KvStream::Value, Site::AttnVCache, Dv);
      att.Hq = Hq, att.Hkv = Hkv, att.Dh = Dk, att.Dv = Dv;
      att.q = &q[size_t(s.row0 * q_dim)];
      att.k = kv.read(l, KvStream::Key, s.kv);
      att.v = kv.read(l, KvStream::Value, s.kv);
      att.kv_head = kv_head_.data();
      if (opt_.precision.weights) att.product_rounding = opt_.precision.kv_cache;  // ggml multiplies in the cache's type
      att.ctx = &ctx[size_t(s.row0 * ctx_dim)];
      attend(l, call, s, att, k.data(), v.data(), site);
    } else {
      att.Hq = Hq, att.Hkv = 1, att.Dh = Lw, att.Dv = Rkv, att.k_stride = Lw, att.v_stride = Lw;
      att.q = &q_lat[size_t(s.row0 * Hq * Lw)];
      att.k = att.v = kv.read(l, KvStream::Latent, s.kv);
      att.kv_head = latent_head_.data();
      att.ctx = &ctx_lat[size_t(s.row0 * Hq * Rkv)];
      attend(l, call, s, att, rows.data(), rows.data(), site);  // ctx_lat [T, Hq*Rkv]
    }
  }
  if (absorbed_) {
    HeadMatmul uv;  // W_uv_h = kv_b rows [h*(Dn+Dv) + Dn, +Dv): [Dv, Rkv]
    uv.T = R, uv.H = Hq;
    uv.x = ctx_lat.data(), uv.x_row = Hq * Rkv, uv.x_head = Rkv;
    uv.w = wmat(L.kv_b), uv.w_head = Dn + Dv, uv.w_row0 = Dn, uv.w_rows = Dv;
    uv.y = ctx.data(), uv.y_row = ctx_dim, uv.y_head = Dv;
    head_matmul(pool_, uv);  // [R, Hq*Dv]
  }
}

// ---- feed-forward block: norm, dense MLP or mixture of experts, residual

void Forward::ffn_block(int l, int64_t R, Sites& site) {
  const ModelConfig& c = cfg_;
  const LayerWeights& L = weights_->layers[size_t(l)];
  Buffers& b = *buf_;
  const int64_t D = c.hidden_size, F = c.intermediate_size;
  rms_norm(pool_, b.x.data(), R, D, wmat(L.post_attn_norm), float(c.rms_norm_eps), b.xn.data());  // [R, D]
  site.rows(l, Site::MlpNorm, D, b.xn.data());
  if (c.moe.is_moe_layer(l)) {
    moe_block(l, R, site);
  } else {
    // Dense MLP: down(silu(gate(x)) * up(x))
    swiglu(L.mlp, b.xn.data(), R, b.gate.data(), b.up.data(), b.act.data(), b.proj.data());
    site.rows(l, Site::MlpGate, F, b.gate.data());
    site.rows(l, Site::MlpUp, F, b.up.data());
    site.rows(l, Site::MlpAct, F, b.act.data());
    site.rows(l, Site::MlpDown, D, b.proj.data());  // [R, D]
  }
  add(b.x.data(), b.proj.data(), R * D, b.x.data());  // [R, D]
  site.rows(l, Site::Out, D, b.x.data());
}

void Forward::moe_block(int l, int64_t R, Sites& site) {
  const ModelConfig& c = cfg_;
  const LayerWeights& L = weights_->layers[size_t(l)];
  const zoo::Faults& bug = faults_;
  const MoeConfig& moe = c.moe;
  Buffers& b = *buf_;
  const int64_t D = c.hidden_size, E = moe.num_experts, K = moe.top_k;
  std::vector<float>& router_logits = b.router_logits;  // [R, E]
  std::vector<float>& router_probs = b.router_probs;    // [R, E]
  std::vector<int64_t>& topk_ids = b.topk_ids;          // [R, K]
  std::vector<float>& topk_weights = b.topk_weights;    // [R, K]
  std::vector<float>& expert_out = b.expert_out;        // [R, K, D]
  std::vector<float>& expert_in = b.expert_in;          // [n, D]
  std::vector<float>& expert_y = b.expert_y;            // [n, D]
  std::vector<float>& routed = b.routed;                // [R, D]
  std::vector<float>& shared = b.shared;                // [R, D]
  const std::vector<float>& xn = b.xn;

  // ---- the router picks K of E experts per token
  mm(xn.data(), R, wmat(L.router), router_logits.data());  // [R, E]
  site.rows(l, Site::MoeRouterLogits, E, router_logits.data());
  // (moe-softmax-routing: softmax whatever the model's scoring.)
  const bool sigmoid = moe.scoring == MoeConfig::Scoring::Sigmoid && !bug.moe_softmax_scoring;
  for (int64_t t = 0; t < R; ++t) {
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
  site.rows(l, Site::MoeRouterProbs, E, router_probs.data());  // [R, E]
  std::vector<float> bias(size_t(moe.correction_bias ? E : 0));  // [E] e_score_correction_bias
  if (moe.correction_bias) load_row(wmat(L.router_bias), 0, 0, E, bias.data());
  for (int64_t t = 0; t < R; ++t) {
    const float* p = &router_probs[size_t(t * E)];
    if (bug.moe_bias_in_weights) {
      // The same choice, weighted by score + bias instead of the score.
      std::vector<float> biased(static_cast<size_t>(E));  // [E]
      for (int64_t e = 0; e < E; ++e) biased[size_t(e)] = p[e] + bias[size_t(e)];
      moe_route(moe, biased.data(), nullptr, &topk_ids[size_t(t * K)], &topk_weights[size_t(t * K)]);
    } else {
      moe_route(moe, p, bias.empty() ? nullptr : bias.data(), &topk_ids[size_t(t * K)], &topk_weights[size_t(t * K)]);
    }
  }
  site.rows_i64(l, Site::MoeTopkIds, K, topk_ids.data());           // [T, K], ascending expert id
  site.rows(l, Site::MoeTopkWeights, K, topk_weights.data());       // [T, K]

  // Each expert runs once on the rows routed to it (a decode step reads the
  // weights of K experts, not E); its output rows land in their token's
  // slot of expert_out.
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> slots;  // t*K + k of each row routed to expert e
    for (int64_t i = 0; i < R * K; ++i)
      if (topk_ids[size_t(i)] == e) slots.push_back(i);
    const int64_t n = int64_t(slots.size());
    if (n == 0) continue;
    for (int64_t r = 0; r < n; ++r)
      std::copy_n(&xn[size_t(slots[size_t(r)] / K * D)], D, &expert_in[size_t(r * D)]);  // [n, D]
    const int64_t runs = bug.moe_expert_shift ? (e + 1) % E : e;  // moe-expert-off-by-one
    swiglu(L.experts[size_t(runs)], expert_in.data(), n, b.gate.data(), b.up.data(), b.act.data(), expert_y.data());
    for (int64_t r = 0; r < n; ++r)
      std::copy_n(&expert_y[size_t(r * D)], D, &expert_out[size_t(slots[size_t(r)] * D)]);  // [R, K, D]
  }
  site.rows(l, Site::MoeExpertOut, Shape{K, D}, expert_out.data());
  // routed = Σ_k w_k · expert_out_k, in ascending expert id (HF's index_add_ order).
  for (int64_t t = 0; t < R; ++t) {
    float* r = &routed[size_t(t * D)];
    std::fill_n(r, D, 0.0f);
    for (int64_t kk = 0; kk < K; ++kk) {
      const float wk = topk_weights[size_t(t * K + kk)];
      const float* eo = &expert_out[size_t((t * K + kk) * D)];
      for (int64_t d = 0; d < D; ++d) r[d] += wk * eo[d];
    }
  }
  site.rows(l, Site::MoeRouted, D, routed.data());  // [R, D]

  if (L.shared.gate && !bug.moe_shared_missing) {
    // Shared expert on every token (Qwen2-MoE: scaled by sigmoid(shared_expert_gate(x))).
    swiglu(L.shared, xn.data(), R, b.gate.data(), b.up.data(), b.act.data(), shared.data());  // [R, D]
    if (L.shared_gate) {
      std::vector<float> g(static_cast<size_t>(R));  // [R, 1]
      mm(xn.data(), R, wmat(L.shared_gate), g.data());
      for (int64_t t = 0; t < R; ++t) {
        const float sg = 1.0f / (1.0f + std::exp(-g[size_t(t)]));
        for (int64_t d = 0; d < D; ++d) shared[size_t(t * D + d)] *= sg;
      }
    }
    site.rows(l, Site::MoeShared, D, shared.data());
    add(routed.data(), shared.data(), R * D, b.proj.data());  // [R, D]
  } else {
    std::copy(routed.begin(), routed.end(), b.proj.begin());  // [R, D]
  }
  site.rows(l, Site::MoeOut, D, b.proj.data());
}

// ---- the head: final norm, each sequence's last row through lm_head

std::vector<float> Forward::head(const ForwardCall& call, Sites& site) {
  const ModelConfig& c = cfg_;
  const ModelWeights& w = *weights_;
  Buffers& b = *buf_;
  const int64_t R = call.rows(), D = c.hidden_size, V = c.vocab_size, M = int64_t(call.seqs.size());
  rms_norm(pool_, b.x.data(), R, D, wmat(w.final_norm), float(c.rms_norm_eps), b.xn.data());  // [R, D]
  site.rows(Site::FinalNorm, D, b.xn.data());
  // Each sequence's last row (last-token-first: its first), all together: [M, D].
  std::vector<float> last(size_t(M * D));
  for (int64_t j = 0; j < M; ++j) {
    const SequenceRows& s = call.seqs[size_t(j)];
    const int64_t row = s.row0 + (faults_.last_token_first ? 0 : s.T - 1);
    std::copy_n(&b.xn[size_t(row * D)], D, &last[size_t(j * D)]);
    site.f32(s, Site::LastHidden, {D}, &last[size_t(j * D)]);
  }
  // next_logits [M, V] always through the same product, whether or not the
  // full logits [T, V] are dumped, so observing never changes results.
  const WMat head = wmat(faults_.lm_head_embed ? w.embed : w.lm_head);
  std::vector<float> next(size_t(M * V));
  mm(last.data(), M, head, next.data());  // [M, V]
  std::vector<float> out;  // each sequence's last row, or all its rows (all_logits), in row order
  out.reserve(size_t(M * V));
  for (int64_t j = 0; j < M; ++j) {
    const SequenceRows& s = call.seqs[size_t(j)];
    const float* row = &next[size_t(j * V)];
    if (site.wants(s, Site::Logits) || s.all_logits) {
      std::vector<float> logits(size_t(s.T * V));  // [T, V]
      mm(&b.xn[size_t(s.row0 * D)], s.T, head, logits.data());
      const int64_t last_row = faults_.last_token_first ? 0 : s.T - 1;
      std::copy_n(row, V, &logits[size_t(last_row * V)]);
      site.f32(s, Site::Logits, {s.T, V}, logits.data());
      if (s.all_logits) out.insert(out.end(), logits.begin(), logits.end());
    }
    if (!s.all_logits) out.insert(out.end(), row, row + V);
    site.f32(s, Site::NextLogits, {V}, row);
  }
  if (opt_.release_weights) w.release_head();
  return out;
}

}  // namespace llmdiff::impl
