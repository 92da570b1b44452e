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
#include "dumps/contract/ranks.h"
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
// a packed tensor [R, ...] as each sequence's rows [T, ...]. With tensor
// parallelism, the tensors of the rank set by at_rank(): its shards under
// rank{r}. (dumps/contract/ranks.h), the replicated names from rank 0 only.
class Forward::Sites {
 public:
  Sites(Observer& obs, const ForwardCall& call, const ModelConfig& c, int ranks)
      : obs_(obs), call_(call), sharded_(site_table().size(), false) {
    if (ranks > 1)
      for (const SiteInfo& i : site_table()) sharded_[size_t(i.id)] = shard_spec(i.id, c).sharded();
  }
  Observer& observer() { return obs_; }
  void at_rank(int r) { rank_ = r; }
  // The full name; "" for a name this rank does not report.
  std::string name(const SequenceRows& s, Site site) const {
    return skipped(site) ? "" : prefix(s, site) + step_name(s.step, site);
  }
  std::string name(const SequenceRows& s, int l, Site site) const {
    return skipped(site) ? "" : prefix(s, site) + layer_name(s.step, l, site);
  }
  bool wants(const SequenceRows& s, Site site) const { return s.reported() && on(name(s, site)); }
  bool wants(const SequenceRows& s, int l, Site site) const { return s.reported() && on(name(s, l, site)); }
  // packed [R, inner...]: each reported sequence's [T, inner...]
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
    for (const SequenceRows& s : call_.seqs) i64(s, l, site, {s.T, width}, packed + s.row0 * width);  // reported ones
  }
  // packed [R, H*Dh]: each sequence's [H, T, Dh] (transposed only when wanted)
  void head_major(int l, Site site, const float* packed, int64_t H, int64_t Dh) {
    for (const SequenceRows& s : call_.seqs) {
      if (!s.reported()) continue;
      const std::string n = name(s, l, site);
      if (!on(n)) continue;
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
  bool on(const std::string& n) const { return !n.empty() && obs_.wants(n); }
  bool skipped(Site site) const { return rank_ > 0 && !sharded_[size_t(site)]; }
  std::string prefix(const SequenceRows& s, Site site) const {
    return (sharded_[size_t(site)] ? rank_prefix(rank_) : "") + (call_.batched ? sequence_prefix(s.seq) : "");
  }
  void emit(const std::string& n, const SequenceRows& s, const Shape& inner, const float* packed) {
    if (!on(n)) return;
    Shape shape{s.T};
    int64_t width = 1;
    for (int64_t d : inner) shape.push_back(d), width *= d;
    obs_.on_f32(n, shape, packed + s.row0 * width);
  }
  Observer& obs_;
  const ForwardCall& call_;
  std::vector<bool> sharded_;  // by Site: a rank's shard (tensor parallel only)
  int rank_ = 0;
};

// A rank's buffers of one forward call over R rows (its heads Hq, Hkv and
// columns F: the whole model's without tensor parallelism), kept between
// calls so that a decode step allocates nothing: each is resized (within
// its capacity after the first call of that length) and zeroed.
struct Forward::Buffers {
  std::vector<float> x, xn;             // [R, D] residual stream, normed input
  std::vector<float> q, k, v, ctx;      // [R, Hq*Dk], [R, Hkv*Dk], [R, Hkv*Dvh], [R, Hq*Dvh]
  std::vector<float> proj;              // [R, D] attn.out / mlp.down / moe.out (a rank's partial sum)
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

  // Every buffer sized for rank `k`'s part of a call of R rows, and zeroed.
  void prepare(const ModelConfig& c, const RankShard& k, int ranks, bool absorbed, int64_t R);
};

// One rank (the only one without tensor parallelism): its shard of the
// weights, the kv head each of its query heads reads, its buffers.
struct Forward::Rank {
  int rank = 0;
  const RankShard* shard = nullptr;
  std::vector<int> kv_read;      // [Hq_r]: the KV store slot (kv head) each query head reads
  std::vector<int> latent_read;  // [Hq_r]: absorbed MLA: the rank's own copy of the latent
  Buffers b;
};

void Forward::Buffers::prepare(const ModelConfig& c, const RankShard& rank, int ranks, bool absorbed, int64_t R) {
  const int64_t D = c.hidden_size, Dh = c.head_dim, Hq = rank.q_heads, Hkv = rank.kv_heads;
  const bool mla = c.mla.enabled;
  const int64_t Rq = c.mla.q_lora_rank, Rkv = c.mla.kv_lora_rank;
  const int64_t Dn = c.mla.qk_nope_head_dim, Dr = c.mla.qk_rope_head_dim, Dv = c.mla.v_head_dim;
  const int64_t Lw = Rkv + Dr;
  // Attention widths: a query/key head of Dk, a value head of Dvh.
  const int64_t Dk = mla ? Dn + Dr : Dh, Dvh = mla ? Dv : Dh;
  const int64_t Fmax =
      (std::max({c.intermediate_size, c.moe.intermediate_size, c.moe.shared_intermediate_size}) + ranks - 1) / ranks;
  const int64_t E = c.moe.num_experts, K = c.moe.top_k;
  const bool moe = c.moe.enabled();
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

namespace {

const ModelWeights& loaded(const Model& model) {
  if (!model.weights) throw UsageError("impl: model '" + model.config.source + "' has no weights loaded");
  return *model.weights;
}

// The bugs that change the forward pass (the sampler's act outside it),
// checked against the model.
std::vector<zoo::BugSpec> forward_bugs(const std::vector<zoo::BugSpec>& bugs, const ModelConfig& c) {
  std::vector<zoo::BugSpec> out;
  for (const zoo::BugSpec& b : bugs)
    if (!zoo::bug_info(b.bug).is_sampler()) out.push_back(b);
  zoo::check_bugs(out, c);
  return out;
}

}  // namespace

Forward::Forward(const Model& model, const ForwardOptions& opt)
    : cfg_(model.config), weights_(model.weights), opt_(opt),
      absorbed_(model.config.mla.enabled && opt.mla == MlaForm::Absorbed),
      tp_(model.config, loaded(model), opt.tensor_parallel, zoo::tp_faults(forward_bugs(opt.bugs, model.config))),
      pool_(opt.threads) {
  const std::vector<zoo::BugSpec> bugs = forward_bugs(opt.bugs, cfg_);
  faults_ = zoo::apply_bugs(bugs, cfg_);
  batch_faults_ = zoo::batch_faults(bugs);
  tp_faults_ = zoo::tp_faults(bugs);
  // Each rank's query head h reads kv head h / (Hq/Hkv) of the rank's own
  // (repeat-kv-tile: h mod Hkv), at its slot in the KV store's rows.
  ranks_.resize(size_t(tp_.ranks()));
  for (int r = 0; r < tp_.ranks(); ++r) {
    Rank& rk = ranks_[size_t(r)];
    rk.rank = r;
    rk.shard = &tp_.rank(r);
    const int64_t Hq = rk.shard->q_heads, Hkv = rk.shard->kv_heads;
    for (int64_t h = 0; h < Hq; ++h)
      rk.kv_read.push_back(int(rk.shard->kv_slot0 + (faults_.repeat_kv_tile ? h % Hkv : h / (Hq / Hkv))));
    rk.latent_read.assign(size_t(Hq), r);
  }
}

Forward::~Forward() = default;

KvWidths Forward::kv_widths() const {
  const ModelConfig& c = cfg_;
  KvWidths w;
  const int64_t slots = tp_.kv_slots();  // every rank's kv heads side by side
  if (!c.mla.enabled) {
    w.of[size_t(KvStream::Key)] = slots * c.head_dim;
    w.of[size_t(KvStream::Value)] = slots * c.head_dim;
    return w;
  }
  const MlaConfig& a = c.mla;
  w.of[size_t(KvStream::Latent)] = tp_.ranks() * (a.kv_lora_rank + a.qk_rope_head_dim);  // a copy per rank
  if (!absorbed_) {
    w.of[size_t(KvStream::Key)] = slots * (a.qk_nope_head_dim + a.qk_rope_head_dim);
    w.of[size_t(KvStream::Value)] = slots * a.v_head_dim;
  }
  return w;
}

std::string Forward::describe() const {
  std::string p = "plain C++, float32 activations";
  if (cfg_.mla.enabled) p += std::string(", ") + mla_form_name(absorbed_ ? MlaForm::Absorbed : MlaForm::Naive) + " MLA";
  if (!opt_.precision.empty()) p += ", precision " + opt_.precision.str();
  if (tp_.ranks() > 1) p += ", tensor parallel over " + std::to_string(tp_.ranks()) + " ranks";
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

void Forward::swiglu(const MlpShard& m, const float* x, int64_t n, float* gate, float* up, float* act, float* out) {
  const int64_t F = m.F;
  mm(x, n, {{m.gate, gate}, {m.up, up}});  // [n, F] each
  if (faults_.gate_up_swap)
    silu_mul(pool_, up, gate, n * F, act);  // [n, F]
  else
    silu_mul(pool_, gate, up, n * F, act);  // [n, F]
  mm(act, n, m.down, out);  // [n, D]
}

// ---- tensor parallelism: the ranks side by side, the all-reduce

const float* Forward::side_by_side(std::vector<float> Buffers::*part, int64_t R, int64_t per_rank,
                                   std::vector<float>& out) {
  if (ranks_.size() == 1) return (ranks_[0].b.*part).data();
  const int64_t n = int64_t(ranks_.size());
  out.resize(size_t(R * n * per_rank));  // [R, ranks * per_rank]
  for (int64_t t = 0; t < R; ++t)
    for (int64_t r = 0; r < n; ++r)
      std::copy_n(&(ranks_[size_t(r)].b.*part)[size_t(t * per_rank)], per_rank, &out[size_t((t * n + r) * per_rank)]);
  return out.data();
}

void Forward::add_all_reduced(int64_t n, bool ffn) {
  if (ranks_.size() == 1) {  // one rank: its output is the whole sum
    Buffers& b = ranks_[0].b;
    add(b.x.data(), b.proj.data(), n, b.x.data());  // [R, D]
    return;
  }
  if (tp_faults_.allreduce_missing) {  // tp-allreduce-missing: each rank goes on with its own partial sum
    for (Rank& rk : ranks_) add(rk.b.x.data(), rk.b.proj.data(), n, rk.b.x.data());
    return;
  }
  std::vector<const float*> parts;
  for (const Rank& rk : ranks_) parts.push_back(rk.b.proj.data());
  reduced_.resize(size_t(n));
  all_reduce(parts, n, reduced_.data());  // [R, D]: Σ_r proj_r in rank order
  if (ffn && tp_faults_.allreduce_twice) {  // tp-allreduce-twice: the reduced sum reduced again
    parts.assign(ranks_.size(), reduced_.data());
    reduced_again_.resize(size_t(n));
    all_reduce(parts, n, reduced_again_.data());
    reduced_.swap(reduced_again_);
  }
  for (Rank& rk : ranks_) add(rk.b.x.data(), reduced_.data(), n, rk.b.x.data());  // [R, D]
}

// ---- the forward call

std::vector<float> Forward::run(const ForwardCall& call, KvStore& kv, Observer& obs) {
  const ModelConfig& c = cfg_;
  const ModelWeights& w = *weights_;
  const int64_t R = call.rows(), D = c.hidden_size, Dh = c.head_dim;
  if (call.seqs.empty() || R == 0) throw UsageError("impl: a forward call needs at least one token");
  Sites site(obs, call, c, tp_.ranks());

  for (Rank& rk : ranks_) rk.b.prepare(c, *rk.shard, tp_.ranks(), absorbed_, R);
  zeroed(cos_, R * Dh), zeroed(sin_, R * Dh);

  // Per sequence: its RoPE tables (dynamic NTK follows each sequence's
  // largest position) into the packed cos/sin [R, Dh].
  bool inv_freq = call.iteration == 0;  // reported once, with the first reported sequence's frequencies
  for (const SequenceRows& s : call.seqs) {
    const RopeFrequencies freqs = rope_frequencies(c, *std::max_element(s.positions.begin(), s.positions.end()) + 1);
    if (inv_freq && s.reported()) {
      inv_freq = false;
      if (obs.wants("rope.inv_freq")) obs.on_f32("rope.inv_freq", {Dh / 2}, freqs.inv_freq.data());
    }
    rope_tables(freqs, s.positions, Dh, &cos_[size_t(s.row0 * Dh)], &sin_[size_t(s.row0 * Dh)]);
    site.i64(s, Site::Tokens, {s.T}, s.tokens.data());
    site.i64(s, Site::Positions, {s.T}, s.positions.data());
  }
  site.rows(Site::RopeCos, Dh, cos_.data());
  site.rows(Site::RopeSin, Dh, sin_.data());
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
  std::vector<float>& x = ranks_[0].b.x;  // [R, D] residual stream
  if (first == 0) {
    for (const SequenceRows& s : call.seqs)
      for (int64_t t = 0; t < s.T; ++t) load_row(wmat(w.embed), s.tokens[size_t(t)], 0, D, &x[size_t((s.row0 + t) * D)]);
    site.rows(Site::Embed, D, x.data());
  } else {  // a shard: the residual stream entering its first layer
    std::copy(call.entering->begin(), call.entering->end(), x.begin());
  }
  for (size_t r = 1; r < ranks_.size(); ++r) ranks_[r].b.x = x;  // every rank's stream starts the same

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
  const int64_t R = call.rows(), D = c.hidden_size;
  for (Rank& rk : ranks_) {  // each rank normalises its own residual stream
    site.at_rank(rk.rank);
    rms_norm(pool_, rk.b.x.data(), R, D, wmat(L.input_norm), float(c.rms_norm_eps), rk.b.xn.data());  // [R, D]
    site.rows(l, Site::AttnNorm, D, rk.b.xn.data());
  }
  if (c.mla.enabled)
    mla_attention(l, call, kv, site);
  else
    gqa_attention(l, call, kv, site);

  // o_proj: each rank's columns on its heads' context, its partial sum (the
  // bias once, on rank 0), then the all-reduce into every residual stream.
  for (Rank& rk : ranks_) {
    site.at_rank(rk.rank);
    Buffers& b = rk.b;
    const int64_t ctx_dim = int64_t(b.ctx.size()) / R;  // Hq*Dh, MLA: Hq*Dv (the rank's heads)
    site.rows(l, Site::AttnCtx, ctx_dim, b.ctx.data());
    mm(b.ctx.data(), R, rk.shard->layers[size_t(l)].o, b.proj.data());  // [R, D]
    if (c.o_bias && rk.rank == 0) add_bias(wmat(L.o_bias), R, b.proj.data());
    site.rows(l, Site::AttnOut, D, b.proj.data());
  }
  add_all_reduced(R * D, false);
  site.at_rank(0);
  site.rows(l, Site::AttnResidual, D, ranks_[0].b.x.data());
}

void Forward::attend(int l, const ForwardCall& call, const SequenceRows& s, AttentionArgs att, const float* new_k,
                     const float* new_v, Sites& site) {
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
    const bool shared = att.v == att.k;  // keys and values in the same rows (absorbed MLA)
    att.k = in_front(keys_, new_k, att.k, ks);
    att.v = shared ? att.k : in_front(values_, new_v, att.v, vs);
    mask_.assign(size_t(T * Sx), 1.0f);  // every extra key allowed
    for (int64_t t = 0; t < T; ++t) std::copy_n(&s.mask[size_t(t * S)], S, &mask_[size_t(t * Sx + extra)]);
    mask = mask_.data();
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
  const int64_t R = call.rows(), Dh = c.head_dim;
  const int64_t slots = tp_.kv_slots(), width = slots * Dh;  // a KV store row: every rank's kv heads
  const float eps = float(c.rms_norm_eps);
  auto rope = bug.rope_interleaved ? apply_rope_interleaved : apply_rope;

  // Each rank: q, k, v of its heads (its rows of q_proj, k_proj, v_proj),
  // Qwen3's per-head norms, RoPE.
  for (Rank& rk : ranks_) {
    site.at_rank(rk.rank);
    const LayerShard& W = rk.shard->layers[size_t(l)];
    Buffers& b = rk.b;
    const int64_t Hq = rk.shard->q_heads, Hkv = rk.shard->kv_heads, q_dim = Hq * Dh, k_dim = Hkv * Dh;
    std::vector<float>& q = b.q;  // [R, Hq*Dh]
    std::vector<float>& k = b.k;  // [R, Hkv*Dh]
    std::vector<float>& v = b.v;  // [R, Hkv*Dh]
    mm(b.xn.data(), R, {{W.q, q.data()}, {W.k, k.data()}, {W.v, v.data()}});
    if (c.qkv_bias) {
      add_bias(W.q_bias, R, q.data());
      add_bias(W.k_bias, R, k.data());
      add_bias(W.v_bias, R, v.data());
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
    rope(q.data(), R, Hq, Dh, cos_.data(), sin_.data());   // [R, Hq*Dh]
    rope(k.data(), R, Hkv, Dh, cos_.data(), sin_.data());  // [R, Hkv*Dh]
    site.head_major(l, Site::AttnQRope, q.data(), Hq, Dh);   // [Hq, T, Dh]
    site.head_major(l, Site::AttnKRope, k.data(), Hkv, Dh);  // [Hkv, T, Dh]
    if (c.qk_norm && bug.qk_norm_after_rope) qk_norm();
  }

  // Every sequence's new keys (after RoPE) and values, every rank's side by
  // side, into the cache.
  const int64_t rank_width = ranks_[0].shard->kv_heads * Dh;
  const float* new_k = side_by_side(&Buffers::k, R, rank_width, new_k_);  // [R, slots*Dh]
  const float* new_v = side_by_side(&Buffers::v, R, rank_width, new_v_);  // [R, slots*Dh]
  for (const SequenceRows& s : call.seqs) {
    kv.write(l, KvStream::Key, s.kv, new_k + s.row0 * width);
    kv.write(l, KvStream::Value, s.kv, new_v + s.row0 * width);
  }
  // Each rank's attention per sequence over the keys it reads.
  const PrecisionProfile& prec = opt_.precision;
  for (Rank& rk : ranks_) {
    site.at_rank(rk.rank);
    Buffers& b = rk.b;
    const int64_t Hq = rk.shard->q_heads, Hkv = rk.shard->kv_heads, q_dim = Hq * Dh;
    for (const SequenceRows& s : call.seqs) {
      // What the cache holds: k_cache, v_cache [Hkv, n, Dh] (the rank's kv
      // heads), then both after repeat_kv [Hq, n, Dh].
      std::vector<float> held[2];
      int64_t n = 0;
      const Site cache_site[2] = {Site::AttnKCache, Site::AttnVCache}, rep_site[2] = {Site::AttnKRep, Site::AttnVRep};
      const KvStream stream[2] = {KvStream::Key, KvStream::Value};
      for (int i = 0; i < 2; ++i)
        if (site.wants(s, l, cache_site[i]) || site.wants(s, l, rep_site[i])) held[i] = kv.held(l, stream[i], s.kv, &n);
      for (int i = 0; i < 2; ++i)
        if (site.wants(s, l, cache_site[i]))
          site.f32(s, l, cache_site[i], {Hkv, n, Dh},
                   head_major_cache(columns(held[i], n, width, rk.shard->kv_slot0 * Dh, Hkv * Dh), n, Hkv, Dh).data());
      for (int i = 0; i < 2; ++i)
        if (site.wants(s, l, rep_site[i]))
          site.f32(s, l, rep_site[i], {Hq, n, Dh}, repeat_kv(held[i], n, Hq, slots, Dh, rk.kv_read).data());
      AttentionArgs att;
      att.Hq = Hq, att.Hkv = slots, att.Dh = Dh, att.scale = float(c.attn_scaling());
      if (bug.softmax_scale_dh) att.scale = float(1.0 / double(Dh));
      att.q = &b.q[size_t(s.row0 * q_dim)];
      att.k = kv.read(l, KvStream::Key, s.kv);
      att.v = kv.read(l, KvStream::Value, s.kv);
      att.kv_head = rk.kv_read.data();
      if (prec.weights || prec.flash_attention) att.product_rounding = prec.kv_cache;  // ggml: in the cache's type
      att.flash = prec.flash_attention;
      att.ctx = &b.ctx[size_t(s.row0 * q_dim)];
      attend(l, call, s, att, new_k, new_v, site);
    }
  }
}

void Forward::mla_attention(int l, const ForwardCall& call, KvStore& kv, Sites& site) {
  const ModelConfig& c = cfg_;
  const LayerWeights& L = weights_->layers[size_t(l)];
  const zoo::Faults& bug = faults_;
  // q through the rank-Rq bottleneck, keys and values of every head from one
  // rank-Rkv latent, a Dr-wide rope key shared by all heads (Dh = Dr: the
  // RoPE tables' width). With tensor parallelism the latent path is
  // replicated (each rank on its own stream, its own copy of the latent
  // cache) and each rank expands only its own heads.
  const int64_t R = call.rows(), ranks = tp_.ranks(), slots = tp_.kv_slots();
  const int64_t Rq = c.mla.q_lora_rank, Rkv = c.mla.kv_lora_rank;
  const int64_t Dn = c.mla.qk_nope_head_dim, Dr = c.mla.qk_rope_head_dim, Dv = c.mla.v_head_dim;
  const int64_t Lw = Rkv + Dr, Dk = Dn + Dr;  // latent cache row [latent | k_pe]; a query/key head
  // RoPE on q's rope part (mla-rope-front: the first Dr dims rotated, the
  // last Dn taken as q_nope); keys' nope part from kv_b's key rows
  // (mla-value-as-key: from the value rows).
  const int64_t rot_at = bug.mla_rope_front ? 0 : Dn;
  const int64_t key_at = bug.mla_value_as_key ? Dn : 0;
  auto rope = bug.rope_interleaved ? apply_rope_interleaved : apply_rope;

  for (Rank& rk : ranks_) {
    site.at_rank(rk.rank);
    const LayerShard& W = rk.shard->layers[size_t(l)];
    Buffers& b = rk.b;
    const int64_t Hq = rk.shard->q_heads, Hkv = rk.shard->kv_heads;
    const int64_t q_dim = Hq * Dk, k_dim = Hkv * Dk, v_dim = Hkv * Dv;
    std::vector<float>& q = b.q;              // [R, Hq*(Dn+Dr)]
    std::vector<float>& k = b.k;              // [R, Hkv*(Dn+Dr)] (naive form)
    std::vector<float>& v = b.v;              // [R, Hkv*Dv] (naive form)
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
      mm(q_a.data(), R, W.q, q.data());  // [R, Hq*(Dn+Dr)]
    } else {
      mm(b.xn.data(), R, {{W.q, q.data()}, {wmat(L.kv_a), kv_a.data()}});
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
      mm(latent.data(), R, W.kv_b, kvb.data());               // [R, Hq*(Dn+Dv)]
      site.rows(l, Site::AttnKv, Hq * (Dn + Dv), kvb.data());  // per head: Dn key, then Dv value
    }

    // RoPE on q's rope part of every head and on the one shared k_pe, in
    // halves order after rope_interleave's reorder.
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
    rope(q_pe.data(), R, Hq, Dr, cos_.data(), sin_.data());  // [R, Hq*Dr]
    rope(k_pe.data(), R, 1, Dr, cos_.data(), sin_.data());   // [R, Dr]
    for (int64_t t = 0; t < R; ++t)
      for (int64_t h = 0; h < Hq; ++h)
        std::copy_n(&q_pe[size_t((t * Hq + h) * Dr)], Dr, &q[size_t(t * q_dim + h * Dk + Dn)]);
    site.rows(l, Site::AttnKPe, Dr, k_pe.data());
    site.head_major(l, Site::AttnQRope, q.data(), Hq, Dk);  // [Hq, T, Dn+Dr]: q_nope, rope(q_pe)

    // Naive form: every head's key [k_nope | k_pe] and value out of kv.
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
    // The latent cache's new rows [latent | k_pe].
    for (int64_t t = 0; t < R; ++t) {
      std::copy_n(&latent[size_t(t * Rkv)], Rkv, &rows[size_t(t * Lw)]);
      std::copy_n(&k_pe[size_t(t * Dr)], Dr, &rows[size_t(t * Lw + Rkv)]);
    }
  }

  // Every rank's new latent rows (its copy) and, naive, its heads' keys and
  // values, side by side, into the cache.
  const int64_t rank_heads = ranks_[0].shard->kv_heads;
  const int64_t latent_width = ranks * Lw, k_width = slots * Dk, v_width = slots * Dv;
  const float* new_latent = side_by_side(&Buffers::latent_rows, R, Lw, new_latent_);  // [R, ranks*(Rkv+Dr)]
  const float* new_k = absorbed_ ? nullptr : side_by_side(&Buffers::k, R, rank_heads * Dk, new_k_);
  const float* new_v = absorbed_ ? nullptr : side_by_side(&Buffers::v, R, rank_heads * Dv, new_v_);
  for (const SequenceRows& s : call.seqs) {
    kv.write(l, KvStream::Latent, s.kv, new_latent + s.row0 * latent_width);
    if (absorbed_) continue;
    kv.write(l, KvStream::Key, s.kv, new_k + s.row0 * k_width);
    kv.write(l, KvStream::Value, s.kv, new_v + s.row0 * v_width);
  }

  const float scale = float(bug.softmax_scale_dh ? 1.0 / double(Dk)
                            : bug.mla_no_mscale  ? std::pow(double(Dk), -0.5)
                                                 : c.attn_scaling());
  for (Rank& rk : ranks_) {
    site.at_rank(rk.rank);
    const LayerShard& W = rk.shard->layers[size_t(l)];
    Buffers& b = rk.b;
    const int64_t Hq = rk.shard->q_heads, q_dim = Hq * Dk, ctx_dim = Hq * Dv;
    std::vector<float>& q_lat = b.q_lat;      // [R, Hq*(Rkv+Dr)] (absorbed form)
    std::vector<float>& ctx_lat = b.ctx_lat;  // [R, Hq*Rkv] (absorbed form)
    // Absorbed: q_nope·k_nope = q_nope·(W_uk_h·latent) = (W_uk_hᵀ·q_nope)·latent,
    // so each head's query becomes [W_uk_hᵀ·q_nope | rope(q_pe)] in latent
    // space [R, Hq*(Rkv+Dr)] and attends the latent cache rows [latent | k_pe]
    // like one shared kv head; probs·latent [R, Hq*Rkv] then goes through the
    // head's value rows W_uv_h of kv_b.
    if (absorbed_) {
      HeadMatmul uk;  // W_uk_h = kv_b rows [h*(Dn+Dv), +Dn): [Dn, Rkv]
      uk.T = R, uk.H = Hq;
      uk.x = b.q.data(), uk.x_row = q_dim, uk.x_head = Dk;
      uk.w = W.kv_b, uk.w_head = Dn + Dv, uk.w_row0 = key_at, uk.w_rows = Dn;
      uk.y = q_lat.data(), uk.y_row = Hq * Lw, uk.y_head = Lw;
      head_matmul_t(pool_, uk);  // [R, Hq*(Rkv+Dr)]: latent part
      for (int64_t t = 0; t < R; ++t)
        for (int64_t h = 0; h < Hq; ++h)
          std::copy_n(&b.q_pe[size_t((t * Hq + h) * Dr)], Dr, &q_lat[size_t((t * Hq + h) * Lw + Rkv)]);
    }
    for (const SequenceRows& s : call.seqs) {
      if (site.wants(s, l, Site::AttnLatentCache) || site.wants(s, l, Site::AttnKPeCache)) {
        int64_t n = 0;
        const std::vector<float> held = kv.held(l, KvStream::Latent, s.kv, &n);  // [n, ranks*(Rkv+Dr)]
        const int64_t own = rk.rank * Lw;  // the rank's copy
        if (site.wants(s, l, Site::AttnLatentCache))
          site.f32(s, l, Site::AttnLatentCache, {n, Rkv}, columns(held, n, latent_width, own, Rkv).data());
        if (site.wants(s, l, Site::AttnKPeCache))
          site.f32(s, l, Site::AttnKPeCache, {n, Dr}, columns(held, n, latent_width, own + Rkv, Dr).data());
      }
      AttentionArgs att;
      att.scale = scale;
      if (!absorbed_) {
        // Naive: the full keys [S, Hq*(Dn+Dr)] and values [S, Hq*Dv] cached
        // (every rank's heads), plain attention with a head of Dn+Dr for
        // q·k and Dv for v.
        auto report = [&](KvStream stream, Site cache, int64_t head_width) {
          if (!site.wants(s, l, cache)) return;
          int64_t n = 0;
          const std::vector<float> held = kv.held(l, stream, s.kv, &n);  // [n, slots*head_width]
          const std::vector<float> mine =
              columns(held, n, slots * head_width, rk.shard->kv_slot0 * head_width, Hq * head_width);
          site.f32(s, l, cache, {Hq, n, head_width}, head_major_cache(mine, n, Hq, head_width).data());
        };
        report(KvStream::Key, Site::AttnKCache, Dk);
        report(KvStream::Value, Site::AttnVCache, Dv);
        att.Hq = Hq, att.Hkv = slots, att.Dh = Dk, att.Dv = Dv;
        att.q = &b.q[size_t(s.row0 * q_dim)];
        att.k = kv.read(l, KvStream::Key, s.kv);
        att.v = kv.read(l, KvStream::Value, s.kv);
        att.kv_head = rk.kv_read.data();
        if (opt_.precision.weights) att.product_rounding = opt_.precision.kv_cache;  // ggml multiplies in the cache's type
        att.ctx = &b.ctx[size_t(s.row0 * ctx_dim)];
        attend(l, call, s, att, new_k, new_v, site);
      } else {
        // Absorbed: every head reads the rank's own copy of the latent rows.
        att.Hq = Hq, att.Hkv = ranks, att.Dh = Lw, att.Dv = Rkv;
        att.k_stride = att.v_stride = latent_width, att.kv_head_step = Lw;
        att.q = &q_lat[size_t(s.row0 * Hq * Lw)];
        att.k = att.v = kv.read(l, KvStream::Latent, s.kv);
        att.kv_head = rk.latent_read.data();
        att.ctx = &ctx_lat[size_t(s.row0 * Hq * Rkv)];
        attend(l, call, s, att, new_latent, new_latent, site);  // ctx_lat [T, Hq*Rkv]
      }
    }
    if (absorbed_) {
      HeadMatmul uv;  // W_uv_h = kv_b rows [h*(Dn+Dv) + Dn, +Dv): [Dv, Rkv]
      uv.T = R, uv.H = Hq;
      uv.x = ctx_lat.data(), uv.x_row = Hq * Rkv, uv.x_head = Rkv;
      uv.w = W.kv_b, uv.w_head = Dn + Dv, uv.w_row0 = Dn, uv.w_rows = Dv;
      uv.y = b.ctx.data(), uv.y_row = ctx_dim, uv.y_head = Dv;
      head_matmul(pool_, uv);  // [R, Hq*Dv]
    }
  }
}

// ---- feed-forward block: norm, dense MLP or mixture of experts, residual

void Forward::ffn_block(int l, int64_t R, Sites& site) {
  const ModelConfig& c = cfg_;
  const LayerWeights& L = weights_->layers[size_t(l)];
  const int64_t D = c.hidden_size;
  // Each rank on its own stream: its columns of the MLP (of every expert),
  // its partial sum; then the all-reduce into every residual stream.
  for (Rank& rk : ranks_) {
    site.at_rank(rk.rank);
    Buffers& b = rk.b;
    rms_norm(pool_, b.x.data(), R, D, wmat(L.post_attn_norm), float(c.rms_norm_eps), b.xn.data());  // [R, D]
    site.rows(l, Site::MlpNorm, D, b.xn.data());
    if (c.moe.is_moe_layer(l)) {
      moe_block(l, R, rk, site);
    } else {
      // Dense MLP: down(silu(gate(x)) * up(x))
      const MlpShard& m = rk.shard->layers[size_t(l)].mlp;
      swiglu(m, b.xn.data(), R, b.gate.data(), b.up.data(), b.act.data(), b.proj.data());
      site.rows(l, Site::MlpGate, m.F, b.gate.data());
      site.rows(l, Site::MlpUp, m.F, b.up.data());
      site.rows(l, Site::MlpAct, m.F, b.act.data());
      site.rows(l, Site::MlpDown, D, b.proj.data());  // [R, D]
    }
  }
  add_all_reduced(R * D, true);
  site.at_rank(0);
  site.rows(l, Site::Out, D, ranks_[0].b.x.data());
}

void Forward::moe_block(int l, int64_t R, Rank& rk, Sites& site) {
  const ModelConfig& c = cfg_;
  const LayerWeights& L = weights_->layers[size_t(l)];
  const LayerShard& W = rk.shard->layers[size_t(l)];  // the rank's columns of each expert
  const zoo::Faults& bug = faults_;
  const MoeConfig& moe = c.moe;
  Buffers& b = rk.b;
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
    swiglu(W.experts[size_t(runs)], expert_in.data(), n, b.gate.data(), b.up.data(), b.act.data(), expert_y.data());
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

  if (W.shared && !bug.moe_shared_missing) {
    // Shared expert on every token (Qwen2-MoE: scaled by sigmoid(shared_expert_gate(x))).
    swiglu(W.shared, xn.data(), R, b.gate.data(), b.up.data(), b.act.data(), shared.data());  // [R, D]
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
  Buffers& b = ranks_[0].b;  // rank 0's stream (every rank's, after a correct all-reduce)
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
