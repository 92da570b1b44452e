// The decoder graph of ref/graph.h: LlamaForCausalLM.forward (LlamaModel +
// lm_head) of transformers 4.51.3, equally Qwen2ForCausalLM and
// Qwen3ForCausalLM (q/k/v and o_proj biases, Qwen3's per-head q_norm/k_norm
// and the family's mask construction are config fields), as one site table
// (Graph::compute_uncached) evaluated on demand.
#include "ref/graph.h"
#include "dumps/contract/rows.h"

#include <malloc.h>

#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "dumps/contract/engine.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"

namespace llmdiff::ref {

// ---------------------------------------------------------------------------
// Model checks

void check_model(const ModelConfig& c, const ModelWeights& weights) {
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
  if (c.rope_scaling.type == RopeScaling::Type::Dynamic && c.head_dim <= 2) fail("dynamic RoPE needs head_dim > 2");
  if (c.rope_scaling.type == RopeScaling::Type::Llama3 && c.rope_scaling.original_max_position_embeddings <= 0)
    fail("llama3 RoPE needs rope_scaling.original_max_position_embeddings");

  // The weights were checked against the config they were loaded with; the
  // model's config must describe the same shapes.
  const ModelConfig& loaded = weights.config();
  auto same = [&](const char* field, int64_t a, int64_t b) {
    if (a != b)
      fail(std::string("config field ") + field + " is " + std::to_string(a) + " but the weights were loaded for " +
           std::to_string(b));
  };
  same("hidden_size", c.hidden_size, loaded.hidden_size);
  same("intermediate_size", c.intermediate_size, loaded.intermediate_size);
  same("num_hidden_layers", c.num_hidden_layers, loaded.num_hidden_layers);
  same("num_attention_heads * head_dim", c.q_dim(), loaded.q_dim());
  same("num_key_value_heads * head_dim", c.kv_dim(), loaded.kv_dim());
  same("head_dim", c.head_dim, loaded.head_dim);
  same("vocab_size", c.vocab_size, loaded.vocab_size);
  same("the routed experts", c.moe.num_experts, loaded.moe.num_experts);
  same("moe_intermediate_size", c.moe.intermediate_size, loaded.moe.intermediate_size);
  same("the shared expert's intermediate size", c.moe.shared_intermediate_size, loaded.moe.shared_intermediate_size);
  same("multi-head latent attention", c.mla.enabled, loaded.mla.enabled);
  same("q_lora_rank", c.mla.q_lora_rank, loaded.mla.q_lora_rank);
  same("kv_lora_rank", c.mla.kv_lora_rank, loaded.mla.kv_lora_rank);
  same("qk_nope_head_dim", c.mla.qk_nope_head_dim, loaded.mla.qk_nope_head_dim);
  same("v_head_dim", c.mla.v_head_dim, loaded.mla.v_head_dim);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    if (c.moe.is_moe_layer(i) != loaded.moe.is_moe_layer(i))
      fail("layer " + std::to_string(i) + " is " + (c.moe.is_moe_layer(i) ? "MoE" : "dense") +
           " in the config but the weights were loaded for the other kind");
  if (c.moe.enabled() && (c.moe.top_k < 1 || c.moe.top_k > c.moe.num_experts))
    fail("the ref needs 1 <= num_experts_per_tok <= the experts");
  if (int64_t(weights.layers.size()) != c.num_hidden_layers)
    fail("the checkpoint holds " + std::to_string(weights.layers.size()) + " layers, the config " +
         std::to_string(c.num_hidden_layers));
  for (const LayerWeights& L : weights.layers) {
    if (c.qkv_bias && !(L.q_bias && L.k_bias && L.v_bias))
      fail("config asks for q/k/v biases but the checkpoint lacks them");
    if (c.o_bias && !L.o_bias) fail("config asks for an o_proj bias but the checkpoint lacks it");
    if (c.qk_norm && !(L.q_norm && L.k_norm)) fail("Qwen3 needs q_norm/k_norm weights, the checkpoint lacks them");
  }
}

std::string producer(ComputeDType dtype) {
  return std::string("llmdiff ref (libtorch ") + TORCH_VERSION + ", HF transformers 4.51.3 eager numerics) / " +
         compute_dtype_name(dtype);
}

// ---------------------------------------------------------------------------
// RopeState: LlamaRotaryEmbedding.__init__ and dynamic_rope_update

RopeState::RopeState(const ModelConfig& cfg, torch::ScalarType dtype)
    : cfg_(cfg), dtype_(dtype), original_(ops::rope_init(cfg, 0, dtype)), current_(original_),
      max_seq_len_cached_(cfg.max_position_embeddings) {}

const ops::RopeInit& RopeState::update(int64_t seq_len) {
  if (cfg_.rope_scaling.type != RopeScaling::Type::Dynamic) return current_;
  const int64_t original_max_seq_len = cfg_.max_position_embeddings;
  if (seq_len > max_seq_len_cached_) {  // growth
    current_ = ops::rope_init(cfg_, seq_len, dtype_);
    max_seq_len_cached_ = seq_len;
  }
  if (seq_len < original_max_seq_len && max_seq_len_cached_ > original_max_seq_len) {  // reset
    current_ = original_;
    max_seq_len_cached_ = original_max_seq_len;
  }
  return current_;
}

// ---------------------------------------------------------------------------
// Variant ops: how the bug zoo's op substitutions compute

namespace {

double finfo_min(torch::ScalarType st) {
  switch (st) {
    case torch::kDouble: return std::numeric_limits<double>::lowest();
    case torch::kBFloat16: return double(static_cast<float>(std::numeric_limits<c10::BFloat16>::lowest()));
    case torch::kHalf: return double(static_cast<float>(std::numeric_limits<c10::Half>::lowest()));
    default: return double(std::numeric_limits<float>::lowest());
  }
}

// rope-interleaved: adjacent pairs (2i, 2i+1) rotated at frequency i. x [H, T, Dh],
// cos/sin [T, Dh] in the rotate-half layout (their first half is used).
torch::Tensor apply_rope_interleaved(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  using torch::indexing::None;
  using torch::indexing::Slice;
  const int64_t half = x.size(-1) / 2;
  torch::Tensor c = cos.slice(-1, 0, half).unsqueeze(0);  // [1, T, Dh/2]
  torch::Tensor s = sin.slice(-1, 0, half).unsqueeze(0);  // [1, T, Dh/2]
  torch::Tensor x1 = x.index({"...", Slice(0, None, 2)});  // [H, T, Dh/2]
  torch::Tensor x2 = x.index({"...", Slice(1, None, 2)});  // [H, T, Dh/2]
  torch::Tensor even = x1 * c - x2 * s;                    // [H, T, Dh/2]
  torch::Tensor odd = x2 * c + x1 * s;                     // [H, T, Dh/2]
  return torch::stack({even, odd}, -1).reshape(x.sizes());  // [H, T, Dh]
}

// repeat-kv-tile: query head h reads kv head h mod Hkv. [Hkv, S, Dh] -> [Hkv*n_rep, S, Dh]
torch::Tensor repeat_kv_tile(const torch::Tensor& kv, int64_t n_rep) { return kv.repeat({n_rep, 1, 1}); }

int64_t argmax_row(const torch::Tensor& row) {
  torch::Tensor f = row.to(torch::kFloat).contiguous();
  return argmax_first(std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel()));
}

}  // namespace

bool is_cache_site(const std::string& site) {
  return site == "attn.k_cache" || site == "attn.v_cache" || site == "attn.latent_cache" || site == "attn.k_pe_cache";
}

// ---------------------------------------------------------------------------
// Graph: the executor

Graph::Graph(ModelConfig cfg, LayerByLayerWeights& w, const GraphOptions& opt, const TensorSource* dump,
             RopeState* rope)
    : cfg_(std::move(cfg)), w_(w), opt_(opt), dump_(dump), st_(w.st()),
      rope_dtype_(w.st() == torch::kDouble ? torch::kDouble : torch::kFloat) {
  if (opt_.inputs == Inputs::Dump && !dump_) throw UsageError("graph: teacher forcing needs a dump");
  if (!rope) own_rope_ = std::make_unique<RopeState>(cfg_, rope_dtype_);
  rope_ = rope ? rope : own_rope_.get();
  if (opt_.inputs == Inputs::Dump) {
    for (const auto& tokens : dump_->step_tokens()) add_step(tokens);
    // Sampled tokens are no argmax to recompute (the sampler's own check
    // judges them).
    const std::optional<SamplingParams> sampling = manifest_sampling(dump_->manifest(), dump_->label());
    sampled_ = sampling && sampling->do_sample;
    if (dump_->has("generated") && !sampled_) {
      const int64_t m = numel(dump_->shape("generated"));
      first_generating_ = int(std::max<int64_t>(0, int64_t(tokens_.size()) - m));
    }
  }
}

void Graph::add_step(const std::vector<int64_t>& tokens) {
  if (tokens.empty()) throw UsageError("forward: no tokens");
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= cfg_.vocab_size)
      throw UsageError("forward: token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                       " is outside the vocabulary [0, " + std::to_string(cfg_.vocab_size) + ")");
  const size_t s = tokens_.size();
  int64_t at = 0;
  for (const auto& t : tokens_) at += int64_t(t.size());
  // kv-overwrite keeps only the previous call's keys.
  past_.push_back(opt_.faults.kv_overwrite ? (s == 0 ? 0 : int64_t(tokens_[s - 1].size())) : at);
  tokens_.push_back(tokens);
  // rotary_emb(hidden_states, position_ids) with dynamic_rope_update:
  // seq_len = max(position_ids) + 1.
  const int64_t start = opt_.faults.position_reset ? 0 : past_.back();
  int64_t seq_len = start + int64_t(tokens.size());
  if (opt_.left_pad > 0) seq_len = std::max<int64_t>(seq_len - opt_.left_pad, start < opt_.left_pad ? 2 : 1);
  step_rope_.push_back(rope_->update(seq_len));
}

void Graph::set_generated(int first_step) { first_generating_ = first_step; }

std::vector<std::string> Graph::names(int first, int last) const {
  std::vector<std::string> out;
  if (first == 0 && last > 0) out.push_back("rope.inv_freq");
  for (int s = first; s < last; ++s) {
    for (const auto& site : step_sites_before_layers()) out.push_back(step_name(s, site));
    for (int l = 0; l < int(cfg_.num_hidden_layers); ++l)
      for (const auto& site : layer_sites()) out.push_back(layer_name(s, l, site));
    for (const auto& site : step_sites_after_layers()) out.push_back(step_name(s, site));
  }
  if (first_generating_ >= 0 && last == steps()) out.push_back("generated");
  return out;
}

void Graph::run(const std::vector<std::string>& names, Observer& out, std::map<std::string, std::string>* source,
                bool keep_caches) {
  torch::NoGradGuard no_grad;
  // Layer-major: the step sites before the layers, then layer by layer
  // (each for every step), then the sites after the layers. Once layer l is
  // reached, the values of layer l-2 and earlier are dropped: the memo holds
  // about two layers instead of the whole model's activations.
  auto phase = [](const CanonName& c) {
    if (c.kind == CanonName::Kind::Layer) return 1;
    if (c.kind == CanonName::Kind::Generated) return 2;
    if (c.kind == CanonName::Kind::Step &&
        (c.site == "final_norm" || c.site == "last_hidden" || c.site == "logits" || c.site == "next_logits"))
      return 2;
    return 0;
  };
  // Inside a layer, site by site over the steps (each step's q, then each
  // step's k, ...): each weight matrix is then used for every call before the
  // next one is converted.
  auto layer_rank = [](const CanonName& c) {
    if (c.kind != CanonName::Kind::Layer) return 0;
    const auto& sites = layer_sites();
    return int(std::find(sites.begin(), sites.end(), c.site) - sites.begin());
  };
  std::vector<std::pair<std::tuple<int, int, int>, std::string>> order;
  std::set<int> steps_used;
  int carry_to = -1;  // layers.l.out for l < carry_to is read by what is asked
  for (const auto& n : names) {
    CanonName c = parse_name(n);
    order.push_back({{phase(c), c.kind == CanonName::Kind::Layer ? c.layer : 0, layer_rank(c)}, n});
    if (c.kind == CanonName::Kind::Layer) {
      steps_used.insert(c.step);
      carry_to = std::max(carry_to, c.layer);
    } else if (phase(c) == 2) {
      if (c.kind == CanonName::Kind::Generated)
        for (int k = std::max(0, first_generating_); k < steps(); ++k) steps_used.insert(k);
      else
        steps_used.insert(c.step);
      carry_to = int(cfg_.num_hidden_layers);
    }
  }
  // The residual stream each layer hands to the next is computed while its
  // layer is at hand: asked for or not, it must not be dropped with its layer
  // and then rebuilt from the layers below (for every layer: quadratic).
  const std::set<std::string> asked(names.begin(), names.end());
  int lowest = carry_to;  // the lowest layer asked for
  for (const auto& n : names) {
    const CanonName c = parse_name(n);
    if (c.kind == CanonName::Kind::Layer) lowest = std::min(lowest, c.layer);
  }
  for (int st : steps_used) {
    if (st < 0 || st >= steps()) continue;
    int first = opt_.window.whole() ? 0 : opt_.window.first;  // a shard computes none below its window
    // Teacher-forced from a dump holding the residual stream below the
    // lowest layer asked for (a shard's view): the layers under it are not
    // needed.
    if (opt_.inputs == Inputs::Dump)
      for (int l = lowest - 1; l >= first; --l)
        if (dump_->has(layer_name(st, l, "out"))) {
          first = l + 1;
          break;
        }
    for (int l = first; l < carry_to && l < int(cfg_.num_hidden_layers); ++l) {
      const std::string n = layer_name(st, l, "out");
      if (asked.count(n) || (opt_.inputs == Inputs::Dump && dump_->has(n))) continue;
      order.push_back({{1, l, int(layer_sites().size())}, n});
    }
  }
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  int reached = -1;
  for (const auto& [key, name] : order) {
    if (std::get<0>(key) == 1 && std::get<1>(key) > reached) {
      reached = std::get<1>(key);
      forget_layers_before(reached - 1, keep_caches);
      // What the dropped layers freed goes back to the system once it adds
      // up: the heap would otherwise keep the pieces (under the mmap
      // threshold) of every layer passed, and a deeper model would peak
      // higher. Not every layer: trimming returns pages the next layer would
      // fault in (and the kernel zero) again.
      if (!keep_caches && mallinfo2().fordblks > (size_t(512) << 20)) malloc_trim(0);
    }
    const Value* v = compute(name);
    if (!v || !v->t.defined() || !asked.count(name) || !out.wants(name)) continue;
    torch::Tensor t = v->t.contiguous();
    Shape shape(t.sizes().begin(), t.sizes().end());
    if (t.scalar_type() == torch::kLong) {
      out.on_i64(name, shape, t.data_ptr<int64_t>());
    } else {
      torch::Tensor f = t.to(torch::kFloat).contiguous();
      out.on_f32(name, shape, f.data_ptr<float>());
    }
    if (source) (*source)[name] = describe(*v);
  }
}

torch::Tensor Graph::value(const std::string& name) const {
  auto it = memo_.find(name);
  return it == memo_.end() ? torch::Tensor() : it->second.t;
}

void Graph::keep_only_caches() {
  const int last = steps() - 1;
  for (auto it = memo_.begin(); it != memo_.end();) {
    CanonName c = parse_name(it->first);
    const bool keep = c.kind == CanonName::Kind::Layer && c.step == last && is_cache_site(c.site);
    it = keep ? std::next(it) : memo_.erase(it);
  }
  dump_cache_.clear();
  tables_.clear();
}

void Graph::forget_layers_before(int layer, bool keep_caches) {
  const int last = steps() - 1;
  auto old = [&](const std::string& name, bool is_memo) {
    CanonName c = parse_name(name);
    if (c.kind != CanonName::Kind::Layer || c.layer >= layer) return false;
    return !(is_memo && keep_caches && c.step == last && is_cache_site(c.site));
  };
  for (auto it = memo_.begin(); it != memo_.end();) it = old(it->first, true) ? memo_.erase(it) : std::next(it);
  for (auto it = dump_cache_.begin(); it != dump_cache_.end();)
    it = old(it->first, false) ? dump_cache_.erase(it) : std::next(it);
}

std::string Graph::describe(const Value& v) {
  std::string s;
  bool chained = false;
  for (const auto& d : v.direct) {
    if (!d.empty() && d.back() == '*') chained = true;
    s += (s.empty() ? "" : ", ") + d;
  }
  if (s.empty()) return "reference structure";
  if (!chained) return s;
  std::string f;
  size_t k = 0;
  for (const auto& n : v.frontier) {
    if (k++ == 3) {
      f += ", +" + std::to_string(v.frontier.size() - 3) + " more";
      break;
    }
    f += (f.empty() ? "" : ", ") + n;
  }
  return s + " (* recomputed; reads the dump's " + (f.empty() ? std::string("tokens only") : f) + ")";
}

std::string Graph::short_name(const std::string& name) {
  CanonName c = parse_name(name);
  if (c.kind == CanonName::Kind::Layer) return "layers." + std::to_string(c.layer) + "." + c.site;
  if (c.kind == CanonName::Kind::Step) return c.site;
  return name;
}

// The value an op reads for `name`, recording it in `reads`: the step's
// tokens, a teacher-forced input from the dump, or a computed site.
torch::Tensor Graph::input(const std::string& name, Value& reads) {
  CanonName c = parse_name(name);
  if (c.kind == CanonName::Kind::Step && c.site == "tokens" && c.step >= 0 && c.step < steps()) {
    reads.direct.push_back(short_name(name));
    reads.frontier.insert(name);
    return torch::tensor(tokens_[size_t(c.step)], torch::kLong);  // [T]
  }
  if (opt_.inputs == Inputs::Dump && dump_->has(name)) return read(*dump_, c, name, reads);
  // A shard: the residual stream entering its first layer is the boundary dump's.
  const LayerWindow& win = opt_.window;
  if (!win.whole() && win.first > 0 && c.kind == CanonName::Kind::Layer && c.layer == win.first - 1 &&
      c.site == "out") {
    if (!win.boundary || !win.boundary->has(name))
      throw MissingTensorError(win.boundary ? win.boundary->label() : std::string("shard ") + win.str(), name);
    return read(*win.boundary, c, name, reads);
  }
  const Value* v = compute(name);
  if (!v || !v->t.defined()) throw UsageError("cannot recompute " + name);
  reads.direct.push_back(short_name(name) + "*");
  reads.frontier.insert(v->frontier.begin(), v->frontier.end());
  return v->t;
}

// `name` read from a dump (the teacher-forced inputs, a shard's boundary),
// recorded in `reads`.
torch::Tensor Graph::read(const TensorSource& from, const CanonName& c, const std::string& name, Value& reads) {
  auto it = dump_cache_.find(name);
  if (it == dump_cache_.end()) {
    TensorData d = from.get(name);
    torch::Tensor t;
    if (d.is_int)
      t = torch::tensor(d.i, torch::kLong).reshape(d.shape);
    else  // one conversion straight from the dump's values (a copy when st_ is float32)
      t = torch::from_blob(d.f.data(), d.shape, torch::kFloat).to(st_, false, /*copy=*/true);
    const std::optional<int> axis = token_axis(c.site);
    if (!d.rows.empty() && axis && c.step >= 0 && c.step < steps() &&
        d.rows.size() < tokens_[size_t(c.step)].size()) {
      if (&from != dump_)
        throw UsageError(from.label() + ": " + name + " holds some of its rows only; a shard of the layers starts "
                         "from every row of the residual stream");
      // Some of the step's token rows only (dumps/contract/rows.h): teacher-forced
      // on those rows, the others the reference's own values, so that every
      // op reads whole tensors.
      const Value* v = compute(name);
      if (!v || !v->t.defined()) throw UsageError("cannot recompute " + name + " around its dumped rows");
      reads.frontier.insert(v->frontier.begin(), v->frontier.end());
      t = v->t.clone().index_copy_(*axis, torch::tensor(d.rows, torch::kLong), t.to(v->t.dtype()));
    }
    it = dump_cache_.emplace(name, t).first;
  }
  reads.direct.push_back(short_name(name));
  reads.frontier.insert(name);
  return it->second;
}

const Graph::Value* Graph::compute(const std::string& name) {
  auto it = memo_.find(name);
  if (it != memo_.end()) return &it->second;
  if (in_progress_.count(name)) return nullptr;
  in_progress_.insert(name);
  Value v;
  try {
    v = compute_uncached(parse_name(name));
  } catch (const std::exception&) {
    // Free-running, every input exists: an error is the model's, reported.
    // Teacher-forced, an input may be missing or of a shape the op cannot
    // take: the site cannot be recomputed (v stays undefined).
    if (opt_.inputs == Inputs::Tokens) {
      in_progress_.erase(name);
      throw;
    }
  }
  in_progress_.erase(name);
  return &memo_.emplace(name, std::move(v)).first->second;
}

// --- the structure of each forward call --------------------------------------

// cache_position (= position_ids[0]): the positions after what the cache holds.
torch::Tensor Graph::positions(int s) const {
  const int64_t start = opt_.faults.position_reset ? 0 : P(s);
  torch::Tensor p = torch::arange(start, start + T(s), torch::kLong);  // [T]
  if (opt_.left_pad == 0) return p;
  // generate: attention_mask.cumsum(-1) - 1, the pads' positions set to 1.
  return torch::where(p < opt_.left_pad, torch::ones_like(p), p - opt_.left_pad);
}

// LlamaRotaryEmbedding.forward: cos/sin [T, Dh] of the call's positions.
std::pair<torch::Tensor, torch::Tensor> Graph::rope_table(int s) {
  auto it = tables_.find(s);
  if (it != tables_.end()) return it->second;
  auto cs = ops::rope_cos_sin(step_rope_[size_t(s)], positions(s), st_);  // [T, Dh] each
  tables_[s] = cs;
  return cs;
}

// _update_causal_mask without an attention_mask: the additive mask [T, S].
torch::Tensor Graph::additive_mask(int s) const {
  const zoo::Faults& f = opt_.faults;
  const int64_t t = T(s), S = f.kv_overwrite ? t : P(s) + t;
  if (f.mask_missing) return torch::zeros({t, S}, torch::dtype(st_));
  if (f.mask_square) {
    torch::Tensor allowed = torch::arange(S, torch::kLong).unsqueeze(0) <= torch::arange(t, torch::kLong).unsqueeze(1);
    return torch::where(allowed, torch::zeros({t, S}, torch::dtype(st_)),
                        torch::full({t, S}, finfo_min(st_), torch::dtype(st_)));
  }
  torch::Tensor mask = ops::causal_mask(cfg_, t, f.kv_overwrite ? 0 : P(s), st_);
  // The attention_mask's pads: every pad key masked for every query.
  // (pad-keys-unmasked: only the causal part.)
  if (opt_.left_pad > 0 && !f.pad_keys_unmasked) mask.narrow(1, 0, std::min(opt_.left_pad, S)).fill_(finfo_min(st_));
  return mask;
}

// Whether step s's token is the greedy pick of step s-1, to be checked
// against it: only in a decode dump without `generated` (which, when
// present, is where the greedy picks are checked; the step tokens may then
// be another run's, replayed).
bool Graph::greedy_step(int s) const {
  if (opt_.inputs != Inputs::Dump) return false;
  if (s < 1 || T(s) != 1 || first_generating_ >= 0) return false;
  if (dump_->manifest().scenario != "decode") return false;
  if (sampled_) return false;  // drawn, not the argmax
  for (int r = s; r < steps(); ++r)
    if (T(r) != 1) return false;
  return true;
}

// A projection `out` = linear(`in`, W, b) at step s. With batch_steps it is
// computed for every step at once (rows stacked: one matrix product instead
// of one per decode step, each of which would stream the whole weight); the
// other steps' results go to the memo, and a step whose input cannot be had
// is left to be computed alone. `name_at(t, site)` names a site at step t;
// `project(x)` is the op.
template <class NameAt, class Project>
Graph::Value Graph::batched_linear(int s, NameAt name_at, const std::string& in, const std::string& out,
                                   Project project) {
  std::vector<int> steps;
  std::vector<Value> values;
  std::vector<torch::Tensor> xs;
  for (int t = 0; t < this->steps(); ++t) {
    if (t != s && !opt_.batch_steps) continue;
    const std::string name = name_at(t, out);
    if (t != s && (memo_.count(name) || in_progress_.count(name))) continue;
    Value v;
    torch::Tensor x;
    if (t == s) {
      x = input(name_at(t, in), v);  // throws: this step cannot be computed
    } else {
      try {
        x = input(name_at(t, in), v);
      } catch (const std::exception&) {
        continue;
      }
    }
    steps.push_back(t);
    values.push_back(std::move(v));
    xs.push_back(x);
  }
  torch::Tensor y = project(xs.size() == 1 ? xs[0] : torch::cat(xs, 0));  // [sum T, out]
  Value mine;
  int64_t row = 0;
  for (size_t k = 0; k < steps.size(); ++k) {
    const int64_t rows = xs[k].size(0);
    values[k].t = xs.size() == 1 ? y : y.narrow(0, row, rows);  // [T, out]
    row += rows;
    if (steps[k] == s)
      mine = std::move(values[k]);
    else
      memo_.emplace(name_at(steps[k], out), std::move(values[k]));
  }
  return mine;
}

// --- the site table --------------------------------------------------------------

Graph::Value Graph::compute_uncached(const CanonName& c) {
  Value v;
  const zoo::Faults& f = opt_.faults;
  const int64_t Hq = cfg_.num_attention_heads, Hkv = cfg_.num_key_value_heads, Dh = cfg_.head_dim;
  const int64_t n_rep = Hq / Hkv;  // num_key_value_groups
  const double eps = cfg_.rms_norm_eps;
  auto step_in = [&](int s, const std::string& site) { return input(step_name(s, site), v); };
  if (c.kind == CanonName::Kind::InvFreq) {
    if (steps() == 0) return v;
    v.t = step_rope_[0].inv_freq;  // [Dh/2]
    return v;
  }
  if (c.kind == CanonName::Kind::Generated) {
    if (first_generating_ < 0) return v;
    std::vector<int64_t> g;
    for (int s = first_generating_; s < steps(); ++s) g.push_back(argmax_row(step_in(s, "next_logits")));
    v.t = torch::tensor(g, torch::kLong);  // [steps - first]
    return v;
  }
  if (c.step < 0 || c.step >= steps()) return v;
  const int s = c.step;
  const int64_t t = T(s);

  // LlamaModel.forward around the layers, and LlamaForCausalLM's head.
  if (c.kind == CanonName::Kind::Step) {
    const std::string& site = c.site;
    if (site == "tokens") {
      if (opt_.inputs == Inputs::Tokens) {
        v.t = torch::tensor(tokens_[size_t(s)], torch::kLong);  // [T]
      } else if (greedy_step(s)) {  // a dump's tokens are its input, checked only where greedy
        v.t = torch::tensor(std::vector<int64_t>{argmax_row(step_in(s - 1, "next_logits"))}, torch::kLong);
      }
    } else if (site == "positions") {
      v.t = positions(s);  // [T]
    } else if (site == "rope.cos") {
      v.t = rope_table(s).first;  // [T, Dh]
    } else if (site == "rope.sin") {
      v.t = rope_table(s).second;  // [T, Dh]
    } else if (site == "mask") {
      v.t = ops::mask_allowed(additive_mask(s));  // [T, S]
    } else if (site == "embed") {
      v.t = w_.embed_rows(step_in(s, "tokens"));  // [T, D]
    } else if (site == "final_norm") {
      torch::Tensor h = input(layer_name(s, int(cfg_.num_hidden_layers) - 1, "out"), v);  // [T, D]
      v.t = ops::rms_norm(h, w_.final_norm, eps);                                         // [T, D]
    } else if (site == "last_hidden") {
      v.t = step_in(s, "final_norm")[f.last_token_first ? 0 : t - 1];  // [D]
    } else if (site == "logits") {
      auto head = [&](const torch::Tensor& x) { return w_.head(x, f.lm_head_embed); };
      return batched_linear(s, [](int k, const std::string& x) { return step_name(k, x); }, "final_norm", "logits",
                            head);  // [T, V]
    } else if (site == "next_logits") {
      v.t = step_in(s, "logits")[f.last_token_first ? 0 : t - 1];  // [V]
    }
    return v;
  }

  // LlamaDecoderLayer.forward
  if (c.kind != CanonName::Kind::Layer || c.layer < 0 || c.layer >= int64_t(w_.num_layers())) return v;
  const int l = c.layer;
  const LayerWeights& L = w_.layer(l);
  auto W = [&](const WeightView& which) { return w_.weight(which); };  // converted as needed
  const std::string& site = c.site;
  auto here = [&](const std::string& x) { return input(layer_name(s, l, x), v); };
  auto at_layer = [l](int k, const std::string& x) { return layer_name(k, l, x); };
  auto project = [&](const std::string& in, const torch::Tensor& w, const torch::Tensor& b) {
    return batched_linear(s, at_layer, in, site, [&](const torch::Tensor& x) { return ops::linear(x, w, b); });
  };
  auto layer_input = [&]() {
    return l == 0 ? input(step_name(s, "embed"), v) : input(layer_name(s, l - 1, "out"), v);  // [T, D]
  };
  auto rope = [&](const torch::Tensor& x) {  // x [H, T, Dh]
    auto [cos, sin] = rope_table(s);
    return f.rope_interleaved ? apply_rope_interleaved(x, cos, sin) : ops::apply_rope(x, cos, sin);
  };
  auto repeat = [&](const torch::Tensor& kv) {  // [Hkv, S, Dh] -> [Hq, S, Dh]
    return f.repeat_kv_tile ? repeat_kv_tile(kv, n_rep) : ops::repeat_kv(kv, n_rep);
  };
  // DynamicCache.update: the first call stores the tensors, later ones
  // concatenate along the sequence axis (`dim`: 1 for [H, S, *] caches, 0
  // for MLA's [S, *] latent and k_pe caches).
  auto cache = [&](const std::string& which, const torch::Tensor& fresh, int64_t dim = 1) {
    if (s == 0 || f.kv_overwrite) return fresh;
    return torch::cat({input(layer_name(s - 1, l, which), v), fresh}, dim);
  };
  const bool qk = cfg_.qk_norm;
  const bool qk_late = qk && f.qk_norm_after_rope;
  const bool mla = cfg_.mla.enabled;
  const bool moe = cfg_.moe.is_moe_layer(l);
  const bool gqa_site = site == "attn.k" || site == "attn.v" || site == "attn.q_norm" || site == "attn.k_norm" ||
                        site == "attn.k_rep" || site == "attn.v_rep";
  const bool mla_site = site == "attn.q_a" || site == "attn.q_a_norm" || site == "attn.kv_a" ||
                        site == "attn.kv_a_norm" || site == "attn.kv" || site == "attn.k_pe" ||
                        site == "attn.latent_cache" || site == "attn.k_pe_cache";
  if ((mla && gqa_site) || (!mla && mla_site)) return v;  // not a site of this attention
  if (moe ? site.compare(0, 4, "mlp.") == 0 : site.compare(0, 4, "moe.") == 0) return v;

  // DeepseekV3Attention: low-rank q and kv, one rope part shared by the heads.
  if (mla) {
    const MlaConfig& m = cfg_.mla;
    const int64_t Dn = m.qk_nope_head_dim, Dr = m.qk_rope_head_dim, Dv = m.v_head_dim, Rkv = m.kv_lora_rank;
    const double lora_eps = 1e-6;  // DeepseekV3RMSNorm(rank) built without eps
    auto rope_mla = [&](const torch::Tensor& x) {  // x [H, T, Dr]
      auto [cos, sin] = rope_table(s);
      return ops::apply_rope_mla(x, cos, sin, m.rope_interleave);
    };
    if (site == "attn.q_a") {  // q_a_proj
      if (m.q_lora_rank == 0) return v;
      return project("attn_norm", W(L.q_a), {});  // [T, Rq]
    } else if (site == "attn.q_a_norm") {  // q_a_layernorm
      if (m.q_lora_rank == 0) return v;
      v.t = ops::rms_norm(here("attn.q_a"), W(L.q_a_norm), lora_eps);  // [T, Rq]
      return v;
    } else if (site == "attn.q") {  // q_b_proj (q_proj without q_lora_rank)
      return project(m.q_lora_rank > 0 ? "attn.q_a_norm" : "attn_norm", W(L.q), {});  // [T, Hq*(Dn+Dr)]
    } else if (site == "attn.kv_a") {  // kv_a_proj_with_mqa
      return project("attn_norm", W(L.kv_a), {});  // [T, Rkv+Dr]
    } else if (site == "attn.kv_a_norm") {  // kv_a_layernorm of the latent part
      v.t = ops::rms_norm(here("attn.kv_a").narrow(-1, 0, Rkv), W(L.kv_a_norm), lora_eps);  // [T, Rkv]
      return v;
    } else if (site == "attn.kv") {  // kv_b_proj
      return project("attn.kv_a_norm", W(L.kv_b), {});  // [T, Hq*(Dn+Dv)]
    } else if (site == "attn.k_pe") {  // k_rot.view(b, 1, s, Dr), rotated
      v.t = rope_mla(here("attn.kv_a").narrow(-1, Rkv, Dr).unsqueeze(0)).squeeze(0);  // [T, Dr]
      return v;
    } else if (site == "attn.q_rope") {  // cat(q_pass, rope(q_rot))
      torch::Tensor q = here("attn.q").view({t, Hq, Dn + Dr}).transpose(0, 1);  // [Hq, T, Dn+Dr]
      const int64_t rot = f.mla_rope_front ? 0 : Dn, pass = f.mla_rope_front ? Dr : 0;
      v.t = torch::cat({q.narrow(-1, pass, Dn), rope_mla(q.narrow(-1, rot, Dr))}, -1);  // [Hq, T, Dn+Dr]
      return v;
    } else if (site == "attn.k_rope") {  // cat(k_pass, k_rot.expand(...))
      torch::Tensor kv = here("attn.kv").view({t, Hq, Dn + Dv}).transpose(0, 1);  // [Hq, T, Dn+Dv]
      torch::Tensor k_pe = here("attn.k_pe").unsqueeze(0).expand({Hq, t, Dr});    // [Hq, T, Dr]
      const int64_t key_at = f.mla_value_as_key ? Dn : 0;                         // the value rows (Dv == Dn)
      v.t = torch::cat({kv.narrow(-1, key_at, Dn), k_pe}, -1);                    // [Hq, T, Dn+Dr]
      return v;
    } else if (site == "attn.latent_cache") {  // what an absorbed engine caches
      v.t = cache("attn.latent_cache", here("attn.kv_a_norm"), 0);  // [S, Rkv]
      return v;
    } else if (site == "attn.k_pe_cache") {
      v.t = cache("attn.k_pe_cache", here("attn.k_pe"), 0);  // [S, Dr]
      return v;
    } else if (site == "attn.k_cache") {  // HF's DynamicCache: full keys
      v.t = cache("attn.k_cache", here("attn.k_rope"));  // [Hq, S, Dn+Dr]
      return v;
    } else if (site == "attn.v_cache") {
      torch::Tensor kv = here("attn.kv").view({t, Hq, Dn + Dv}).transpose(0, 1);  // [Hq, T, Dn+Dv]
      v.t = cache("attn.v_cache", kv.narrow(-1, Dn, Dv));                        // [Hq, S, Dv]
      return v;
    } else if (site == "attn.scores") {  // repeat_kv is the identity (Hkv == Hq)
      const double scaling = f.softmax_scale_dh ? 1.0 / double(m.qk_head_dim())
                             : f.mla_no_mscale  ? std::pow(double(m.qk_head_dim()), -0.5)
                                                : cfg_.attn_scaling();
      v.t = ops::attn_scores(here("attn.q_rope"), here("attn.k_cache"), scaling);  // [Hq, T, S]
      return v;
    } else if (site == "attn.ctx") {
      v.t = ops::attn_ctx(here("attn.probs"), here("attn.v_cache"));  // [T, Hq*Dv]
      return v;
    }
  }

  // The MoE block on MoE layers (MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock,
  // Qwen3MoeSparseMoeBlock, DeepseekV3MoE).
  if (moe) {
    const MoeConfig& m = cfg_.moe;
    const torch::Tensor bias = m.correction_bias ? W(L.router_bias) : torch::Tensor();  // [E]
    const bool shared = L.shared.gate && !f.moe_shared_missing;
    auto mlp = [&](const MlpWeights& w, const torch::Tensor& x) {  // an expert, with gate-up-swap's swap
      return f.gate_up_swap ? ops::mlp(x, W(w.up), W(w.gate), W(w.down)) : ops::mlp(x, W(w.gate), W(w.up), W(w.down));
    };
    if (site == "moe.router_logits") {  // gate
      v.t = ops::router_logits(here("mlp_norm"), W(L.router), m);  // [T, E]
    } else if (site == "moe.router_probs") {  // softmax / sigmoid, float32
      MoeConfig scoring = m;
      if (f.moe_softmax_scoring) scoring.scoring = MoeConfig::Scoring::Softmax;
      v.t = ops::router_probs(here("moe.router_logits"), scoring);  // [T, E]
    } else if (site == "moe.topk_ids") {  // the choice, sorted ascending
      const ops::Route r = ops::route(here("moe.router_probs"), bias, m, st_);
      v.t = std::get<0>(r.ids.sort(-1));  // [T, K]
    } else if (site == "moe.topk_weights") {
      // HF's weights for the experts chosen: the route's own (its slot order,
      // bit for bit) where the choice is the route's, else the same formula
      // on the experts given.
      torch::Tensor probs = here("moe.router_probs"), ids = here("moe.topk_ids");   // [T, E], [T, K]
      if (f.moe_bias_in_weights) {  // the biased choice scores weighted instead
        v.t = ops::route_weights(probs + bias.to(probs.scalar_type()).unsqueeze(0), ids, m, st_);  // [T, K]
        return v;
      }
      const ops::Route r = ops::route(probs, bias, m, st_);
      auto [route_ids, order] = r.ids.sort(-1);                                     // [T, K] each
      torch::Tensor same = (route_ids == ids).all(-1, /*keepdim=*/true);            // [T, 1]
      v.t = torch::where(same, r.weights.gather(1, order), ops::route_weights(probs, ids, m, st_));  // [T, K]
    } else if (site == "moe.expert_out") {  // each chosen expert on its token, before weighting
      torch::Tensor ids = here("moe.topk_ids");  // [T, K]
      torch::Tensor slots = ops::route_slots(here("moe.router_probs"), ids, m);  // [T, K]
      auto expert = [&](int64_t e, const torch::Tensor& rows) {
        if (f.moe_expert_shift) e = (e + 1) % m.num_experts;
        return mlp(L.experts.at(size_t(e)), rows);  // [N, D]
      };
      v.t = ops::experts_out(here("mlp_norm"), ids, slots, expert);  // [T, K, D]
    } else if (site == "moe.routed") {  // sum_k weight * expert_out
      v.t = ops::moe_combine(here("moe.expert_out"), here("moe.topk_weights"), st_);  // [T, D]
    } else if (site == "moe.shared") {  // shared expert(s), Qwen2-MoE's behind a sigmoid gate
      if (!shared) return v;
      torch::Tensor x = here("mlp_norm");  // [T, D]
      torch::Tensor y = mlp(L.shared, x);  // [T, D]
      v.t = m.shared_gate ? torch::sigmoid(ops::linear(x, W(L.shared_gate), {})) * y : y;  // [T, D]
    } else if (site == "moe.out") {  // routed + shared
      v.t = shared ? here("moe.routed") + here("moe.shared") : here("moe.routed");  // [T, D]
    } else if (site == "out") {  // residual + hidden_states
      v.t = here("attn_residual") + here("moe.out");  // [T, D]
    }
    if (site.compare(0, 4, "moe.") == 0 || site == "out") return v;
  }

  if (site == "attn_norm") {  // input_layernorm
    v.t = ops::rms_norm(layer_input(), W(L.input_norm), eps);  // [T, D]
  } else if (site == "attn.q" || site == "attn.k" || site == "attn.v") {  // q_proj / k_proj / v_proj
    const char p = site.back();
    const torch::Tensor w = W(p == 'q' ? L.q : p == 'k' ? L.k : L.v);
    const torch::Tensor b = !cfg_.qkv_bias ? torch::Tensor()
                                           : W(p == 'q'   ? L.q_bias
                                               : p == 'k' ? L.k_bias
                                                          : L.v_bias);
    return project("attn_norm", w, b);  // [T, H*Dh]
  } else if (site == "attn.q_norm" || site == "attn.k_norm") {  // Qwen3Attention: per head, before the transpose
    if (!qk) return v;
    const bool is_q = site == "attn.q_norm";
    const int64_t H = is_q ? Hq : Hkv;
    torch::Tensor x = here(is_q ? "attn.q" : "attn.k").view({t, H, Dh});             // [T, H, Dh]
    if (qk_late) x = rope(x.transpose(0, 1)).transpose(0, 1);                       // [T, H, Dh]
    v.t = ops::rms_norm(x, W(is_q ? L.q_norm : L.k_norm), eps).reshape({t, H * Dh});   // [T, H*Dh]
  } else if (site == "attn.q_rope" || site == "attn.k_rope") {  // apply_rotary_pos_emb
    const bool is_q = site == "attn.q_rope";
    const int64_t H = is_q ? Hq : Hkv;
    const std::string src = qk && !qk_late ? (is_q ? "attn.q_norm" : "attn.k_norm") : (is_q ? "attn.q" : "attn.k");
    v.t = rope(here(src).view({t, H, Dh}).transpose(0, 1));  // [H, T, Dh]
  } else if (site == "attn.k_cache") {
    // The cache holds the keys attention reads: after RoPE (and, with
    // qk-norm-after-rope, after the norm that follows it).
    torch::Tensor fresh = qk_late ? here("attn.k_norm").view({t, Hkv, Dh}).transpose(0, 1)
                                  : here("attn.k_rope");  // [Hkv, T, Dh]
    v.t = cache("attn.k_cache", fresh);                   // [Hkv, S, Dh]
  } else if (site == "attn.v_cache") {
    v.t = cache("attn.v_cache", here("attn.v").view({t, Hkv, Dh}).transpose(0, 1));  // [Hkv, S, Dh]
  } else if (site == "attn.k_rep") {  // eager_attention_forward: repeat_kv
    v.t = repeat(here("attn.k_cache"));  // [Hq, S, Dh]
  } else if (site == "attn.v_rep") {
    v.t = repeat(here("attn.v_cache"));  // [Hq, S, Dh]
  } else if (site == "attn.scores") {  // q @ k^T * scaling (self.head_dim**-0.5)
    torch::Tensor q = qk_late ? here("attn.q_norm").view({t, Hq, Dh}).transpose(0, 1)
                              : here("attn.q_rope");  // [Hq, T, Dh]
    const double scaling = f.softmax_scale_dh ? 1.0 / double(Dh) : std::pow(double(Dh), -0.5);
    v.t = ops::attn_scores(q, here("attn.k_rep"), scaling);  // [Hq, T, S]
  } else if (site == "attn.probs") {  // softmax(scores + mask) in float32
    v.t = ops::attn_probs(here("attn.scores"), additive_mask(s));  // [Hq, T, S]
  } else if (site == "attn.ctx") {  // probs @ v, heads merged
    v.t = ops::attn_ctx(here("attn.probs"), here("attn.v_rep"));  // [T, Hq*Dh]
  } else if (site == "attn.out") {  // o_proj
    return project("attn.ctx", W(L.o), cfg_.o_bias ? W(L.o_bias) : torch::Tensor());  // [T, D] (ctx [T, Hq*Dv] for MLA)
  } else if (site == "attn_residual") {  // residual + hidden_states
    v.t = layer_input() + here("attn.out");  // [T, D]
  } else if (site == "mlp_norm") {  // post_attention_layernorm
    v.t = ops::rms_norm(here("attn_residual"), W(L.post_attn_norm), eps);  // [T, D]
  } else if (site == "mlp.gate") {  // LlamaMLP.gate_proj
    return project("mlp_norm", W(L.mlp.gate), {});  // [T, F]
  } else if (site == "mlp.up") {  // up_proj
    return project("mlp_norm", W(L.mlp.up), {});  // [T, F]
  } else if (site == "mlp.act") {  // act_fn(gate) * up
    torch::Tensor g = here("mlp.gate"), u = here("mlp.up");
    v.t = f.gate_up_swap ? ops::swiglu(u, g) : ops::swiglu(g, u);  // [T, F]
  } else if (site == "mlp.down") {  // down_proj
    return project("mlp.act", W(L.mlp.down), {});  // [T, D]
  } else if (site == "out") {  // residual + hidden_states
    v.t = here("attn_residual") + here("mlp.down");  // [T, D]
  }
  return v;
}

}  // namespace llmdiff::ref
