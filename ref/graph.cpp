// The decoder graph of ref/graph.h: LlamaForCausalLM.forward (LlamaModel +
// lm_head) of transformers 4.51.3, equally Qwen2ForCausalLM and
// Qwen3ForCausalLM (q/k/v and o_proj biases, Qwen3's per-head q_norm/k_norm
// and the family's mask construction are config fields), as the ops of the
// site table (dumps/contract/sites.h) evaluated on demand: Graph::compute_uncached
// hands each site to its stage (the step's sites, MLA attention, the MoE
// block, the decoder layer).
#include "ref/graph.h"

#include "dumps/base/memory.h"
#include "dumps/contract/rows.h"

#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "dumps/base/errors.h"
#include "dumps/contract/calls.h"
#include "dumps/contract/engine.h"
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

SiteName parse_site_name(const std::string& name) {
  SiteName n;
  static_cast<CanonName&>(n) = parse_name(name);
  if (n.kind != CanonName::Kind::Step && n.kind != CanonName::Kind::Layer) return n;
  const std::optional<Site> id = find_site(n.site);
  if (id && (n.kind == CanonName::Kind::Layer) == (site_info(*id).scope == SiteScope::Layer)) n.id = id;
  return n;
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
    // The calls as the dump places them: after a prefix-cache hit, with the
    // rejected drafts of verify calls rolled back.
    prefix_ = int64_t(cached_prefix(*dump_).size());
    const std::map<int, int64_t> rollbacks = spec_rollbacks(*dump_);
    for (const auto& tokens : dump_->step_tokens()) {
      add_step(tokens);
      const auto r = rollbacks.find(steps() - 1);
      if (r == rollbacks.end()) continue;
      mark_verify(steps() - 1);
      if (r->second > 0) rollback(r->second);
    }
    // Sampled tokens are no argmax to recompute (the sampler's own check
    // judges them).
    const std::optional<SamplingParams> sampling = manifest_sampling(dump_->manifest(), dump_->label());
    sampled_ = sampling && sampling->do_sample;
    // Nor are a speculative run's: a verify call generates several (the
    // speculative check judges them).
    if (dump_->has("generated") && !sampled_ && !speculative(*dump_)) {
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
  // Positions held: the call before's and its own, less what it rolled back.
  const int64_t at = s == 0 ? prefix_ : past_[s - 1] + int64_t(tokens_[s - 1].size()) - rollback_[s - 1];
  // kv-overwrite keeps only the previous call's keys.
  past_.push_back(opt_.faults.kv_overwrite ? (s == 0 ? 0 : int64_t(tokens_[s - 1].size())) : at);
  rollback_.push_back(0);
  tokens_.push_back(tokens);
  // rotary_emb(hidden_states, position_ids) with dynamic_rope_update:
  // seq_len = max(position_ids) + 1.
  const int64_t start = opt_.faults.position_reset ? 0 : past_.back();
  int64_t seq_len = start + int64_t(tokens.size());
  if (opt_.left_pad > 0) seq_len = std::max<int64_t>(seq_len - opt_.left_pad, start < opt_.left_pad ? 2 : 1);
  step_rope_.push_back(rope_->update(seq_len));
}

void Graph::rollback(int64_t positions) {
  if (steps() == 0) throw UsageError("rollback: no forward call yet");
  const int s = steps() - 1;
  if (positions < 0 || positions > P(s) + T(s))
    throw UsageError("rollback: " + std::to_string(positions) + " positions of the " + std::to_string(P(s) + T(s)) +
                     " cached");
  rollback_[size_t(s)] = positions;
}

void Graph::set_generated(int first_step) { first_generating_ = first_step; }

void Graph::mark_verify(int step) { verify_.insert(step); }

std::vector<std::string> Graph::names(int first, int last) const {
  std::vector<std::string> out;
  if (first == 0 && last > 0) out.push_back("rope.inv_freq");
  auto step_sites = [&](int s, SiteScope scope) {
    for (const SiteInfo& i : site_table())
      if (i.scope == scope) out.push_back(step_name(s, i.id));
  };
  for (int s = first; s < last; ++s) {
    step_sites(s, SiteScope::BeforeLayers);
    for (int l = 0; l < int(cfg_.num_hidden_layers); ++l)
      for (const SiteInfo& i : site_table())
        if (i.scope == SiteScope::Layer) out.push_back(layer_name(s, l, i.id));
    step_sites(s, SiteScope::AfterLayers);
    if (verify_.count(s)) out.push_back(step_name(s, Site::SpecAccepted));
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
  auto phase = [](const SiteName& c) {
    if (c.kind == CanonName::Kind::Layer) return 1;
    if (c.kind == CanonName::Kind::Generated) return 2;
    if (c.id && site_info(*c.id).scope == SiteScope::AfterLayers) return 2;
    if (c.id == Site::SpecAccepted) return 2;  // from the step's logits
    return 0;
  };
  // Inside a layer, site by site over the steps (each step's q, then each
  // step's k, ...): each weight matrix is then used for every call before the
  // next one is converted. Site values follow the table's order; a name
  // outside the table, and the residual stream carried to the next layer,
  // come after every site.
  const int after_sites = int(site_table().size());
  auto layer_rank = [after_sites](const SiteName& c) {
    if (c.kind != CanonName::Kind::Layer) return 0;
    return c.id ? int(*c.id) : after_sites;
  };
  std::vector<std::pair<std::tuple<int, int, int>, std::string>> order;
  std::set<int> steps_used;
  int carry_to = -1;                             // layers.l.out for l < carry_to is read by what is asked
  int lowest = std::numeric_limits<int>::max();  // the lowest layer asked for
  for (const auto& n : names) {
    const SiteName c = parse_site_name(n);
    order.push_back({{phase(c), c.kind == CanonName::Kind::Layer ? c.layer : 0, layer_rank(c)}, n});
    if (c.kind == CanonName::Kind::Layer) {
      steps_used.insert(c.step);
      carry_to = std::max(carry_to, c.layer);
      lowest = std::min(lowest, c.layer);
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
  lowest = std::min(lowest, carry_to);  // no layer asked for: the top of the layers carried
  for (int st : steps_used) {
    if (st < 0 || st >= steps()) continue;
    int first = opt_.window.whole() ? 0 : opt_.window.first;  // a shard computes none below its window
    // Teacher-forced from a dump holding the residual stream below the
    // lowest layer asked for (a shard's view): the layers under it are not
    // needed.
    if (opt_.inputs == Inputs::Dump)
      for (int l = lowest - 1; l >= first; --l)
        if (dump_->has(layer_name(st, l, Site::Out))) {
          first = l + 1;
          break;
        }
    for (int l = first; l < carry_to && l < int(cfg_.num_hidden_layers); ++l) {
      const std::string n = layer_name(st, l, Site::Out);
      if (asked.count(n) || (opt_.inputs == Inputs::Dump && dump_->has(n))) continue;
      order.push_back({{1, l, after_sites}, n});
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
      if (!keep_caches) release_free_heap(int64_t(512) << 20);
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
    const SiteName c = parse_site_name(it->first);
    const bool keep = c.step == last && c.id && is_kv_cache(*c.id);
    it = keep ? std::next(it) : memo_.erase(it);
  }
  dump_cache_.clear();
  tables_.clear();
}

void Graph::forget_layers_before(int layer, bool keep_caches) {
  const int last = steps() - 1;
  auto old = [&](const std::string& name, bool is_memo) {
    const SiteName c = parse_site_name(name);
    if (c.kind != CanonName::Kind::Layer || c.layer >= layer) return false;
    return !(is_memo && keep_caches && c.step == last && c.id && is_kv_cache(*c.id));
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
  const SiteName c = parse_site_name(name);
  if (c.id == Site::Tokens && c.step >= 0 && c.step < steps()) {
    reads.direct.push_back(short_name(name));
    reads.frontier.insert(name);
    return torch::tensor(tokens_[size_t(c.step)], torch::kLong);  // [T]
  }
  if (opt_.inputs == Inputs::Dump && dump_->has(name)) return read(*dump_, c, name, reads);
  // A shard: the residual stream entering its first layer is the boundary dump's.
  const LayerWindow& win = opt_.window;
  if (!win.whole() && win.first > 0 && c.id == Site::Out && c.layer == win.first - 1) {
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
    v = compute_uncached(parse_site_name(name));
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
Graph::Value Graph::batched_linear(int s, NameAt name_at, Site in, Site out, Project project) {
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

// --- the site table ------------------------------------------------------------

// A layer site being computed: where it is, what its op has read so far
// (v), and the inputs the layer's ops take.
struct Graph::LayerOp {
  Graph& g;
  const int s, l;  // step, layer
  const Site site;
  const LayerWeights& L;
  const int64_t t;  // the step's tokens
  Value v;          // the reads, then the value

  torch::Tensor W(const WeightView& which) { return g.w_.weight(which); }  // converted as needed
  torch::Tensor here(Site x) { return g.input(layer_name(s, l, x), v); }  // a site of this layer and step
  torch::Tensor layer_input() {  // the residual stream entering the layer
    return l == 0 ? g.input(step_name(s, Site::Embed), v) : g.input(layer_name(s, l - 1, Site::Out), v);  // [T, D]
  }
  // This site as linear(`in`, w, b), over every step at once with batch_steps.
  Value project(Site in, const torch::Tensor& w, const torch::Tensor& b) {
    const int layer = l;
    return g.batched_linear(s, [layer](int k, Site x) { return layer_name(k, layer, x); }, in, site,
                            [&](const torch::Tensor& x) { return ops::linear(x, w, b); });
  }
  // DynamicCache.update: the first call stores the tensors, later ones
  // concatenate this site of the call before along the sequence axis (`dim`:
  // 1 for [H, S, *] caches, 0 for MLA's [S, *] latent and k_pe caches).
  // After a speculative verify call's rollback only the first P positions
  // of the call before are kept (DynamicCache.crop); after a prefix-cache
  // hit, step 0 continues the hit's positions as the dump's own cache holds
  // them (teacher forcing; undefined without them).
  torch::Tensor cache(const torch::Tensor& fresh, int64_t dim = 1) {
    if (g.opt_.faults.kv_overwrite) return fresh;
    if (s == 0) {
      if (g.P(0) == 0) return fresh;
      const std::string own = layer_name(0, l, site);
      if (g.opt_.inputs != Inputs::Dump || !g.dump_->has(own)) return torch::Tensor();
      return torch::cat({g.input(own, v).narrow(dim, 0, g.P(0)), fresh}, dim);
    }
    torch::Tensor before = g.input(layer_name(s - 1, l, site), v);
    if (before.size(dim) > g.P(s)) before = before.narrow(dim, 0, g.P(s));
    return torch::cat({before, fresh}, dim);
  }
  Value result(torch::Tensor value) {
    v.t = std::move(value);
    return std::move(v);
  }
};

// Hands a name to the stage that computes its site; what the model does not
// have (model_has_site: attn.k on MLA, mlp.gate on a MoE layer, ...), or
// what is not a site of the table, stays undefined.
Graph::Value Graph::compute_uncached(const SiteName& c) {
  Value v;
  if (c.kind == CanonName::Kind::InvFreq) {
    if (steps() == 0) return v;
    v.t = step_rope_[0].inv_freq;  // [Dh/2]
    return v;
  }
  if (c.kind == CanonName::Kind::Generated) {  // GenerationMixin._sample's greedy picks
    if (first_generating_ < 0) return v;
    std::vector<int64_t> g;
    for (int s = first_generating_; s < steps(); ++s)
      g.push_back(argmax_row(input(step_name(s, Site::NextLogits), v)));
    v.t = torch::tensor(g, torch::kLong);  // [steps - first]
    return v;
  }
  if (!c.id || c.step < 0 || c.step >= steps()) return v;
  if (c.kind == CanonName::Kind::Step) return step_site(c.step, *c.id);

  // LlamaDecoderLayer.forward (DeepseekV3DecoderLayer with MLA attention, a
  // MoE block in place of the MLP on MoE layers).
  if (c.layer < 0 || c.layer >= int64_t(w_.num_layers())) return v;
  if (!model_has_site(cfg_, c.layer, *c.id)) return v;
  LayerOp op{*this, c.step, c.layer, *c.id, w_.layer(c.layer), T(c.step), {}};
  if (cfg_.mla.enabled)
    if (std::optional<Value> r = mla_attention(op)) return std::move(*r);
  if (cfg_.moe.is_moe_layer(c.layer))
    if (std::optional<Value> r = moe_block(op)) return std::move(*r);
  return decoder_layer(op);
}

// LlamaModel.forward around the layers, and LlamaForCausalLM's head.
Graph::Value Graph::step_site(int s, Site site) {
  Value v;
  const zoo::Faults& f = opt_.faults;
  const int64_t t = T(s);
  auto step_in = [&](int k, Site x) { return input(step_name(k, x), v); };
  switch (site) {
    case Site::Tokens:
      if (opt_.inputs == Inputs::Tokens) {
        v.t = torch::tensor(tokens_[size_t(s)], torch::kLong);  // [T]
      } else if (greedy_step(s)) {  // a dump's tokens are its input, checked only where greedy
        v.t = torch::tensor(std::vector<int64_t>{argmax_row(step_in(s - 1, Site::NextLogits))}, torch::kLong);
      }
      return v;
    case Site::Positions: v.t = positions(s); return v;                         // [T]
    case Site::RopeCos: v.t = rope_table(s).first; return v;                    // [T, Dh]
    case Site::RopeSin: v.t = rope_table(s).second; return v;                   // [T, Dh]
    case Site::Mask: v.t = ops::mask_allowed(additive_mask(s)); return v;       // [T, S]
    case Site::Embed: v.t = w_.embed_rows(step_in(s, Site::Tokens)); return v;  // embed_tokens: [T, D]
    case Site::FinalNorm: {  // norm
      torch::Tensor h = input(layer_name(s, int(cfg_.num_hidden_layers) - 1, Site::Out), v);  // [T, D]
      v.t = ops::rms_norm(h, w_.final_norm, cfg_.rms_norm_eps);                              // [T, D]
      return v;
    }
    case Site::LastHidden: v.t = step_in(s, Site::FinalNorm)[f.last_token_first ? 0 : t - 1]; return v;  // [D]
    case Site::Logits: {  // lm_head
      auto head = [&](const torch::Tensor& x) { return w_.head(x, f.lm_head_embed); };
      return batched_linear(s, [](int k, Site x) { return step_name(k, x); }, Site::FinalNorm, Site::Logits,
                            head);  // [T, V]
    }
    case Site::NextLogits: v.t = step_in(s, Site::Logits)[f.last_token_first ? 0 : t - 1]; return v;  // [V]
    case Site::SpecAccepted: {  // a verify call's drafts kept: while the argmax of the row before agrees
      if (!verify_.count(s)) return v;
      const torch::Tensor next = step_in(s, Site::Logits).argmax(-1);  // [T]
      int64_t accepted = 0;
      while (accepted + 1 < t && next[accepted].item<int64_t>() == tokens_[size_t(s)][size_t(accepted + 1)]) ++accepted;
      v.t = torch::tensor(std::vector<int64_t>{accepted}, torch::kLong);  // [1]
      return v;
    }
    default: return v;  // the record's sites (rows, kv.*, sample.*) are no op of the graph
  }
}

// DeepseekV3Attention: low-rank q and kv, one rope part shared by the heads.
// attn_norm, attn.probs, attn.out and the rest of the layer are Llama's.
std::optional<Graph::Value> Graph::mla_attention(LayerOp& op) {
  const zoo::Faults& f = opt_.faults;
  const MlaConfig& m = cfg_.mla;
  const LayerWeights& L = op.L;
  const int64_t t = op.t, Hq = cfg_.num_attention_heads;
  const int64_t Dn = m.qk_nope_head_dim, Dr = m.qk_rope_head_dim, Dv = m.v_head_dim, Rkv = m.kv_lora_rank;
  const double lora_eps = 1e-6;  // DeepseekV3RMSNorm(rank) built without eps
  auto rope_mla = [&](const torch::Tensor& x) {  // x [H, T, Dr]
    auto [cos, sin] = rope_table(op.s);
    return ops::apply_rope_mla(x, cos, sin, m.rope_interleave);
  };
  switch (op.site) {
    case Site::AttnQA:  // q_a_proj
      return op.project(Site::AttnNorm, op.W(L.q_a), {});  // [T, Rq]
    case Site::AttnQANorm:  // q_a_layernorm
      return op.result(ops::rms_norm(op.here(Site::AttnQA), op.W(L.q_a_norm), lora_eps));  // [T, Rq]
    case Site::AttnQ:  // q_b_proj (q_proj without q_lora_rank)
      return op.project(m.q_lora_rank > 0 ? Site::AttnQANorm : Site::AttnNorm, op.W(L.q), {});  // [T, Hq*(Dn+Dr)]
    case Site::AttnKvA:  // kv_a_proj_with_mqa
      return op.project(Site::AttnNorm, op.W(L.kv_a), {});  // [T, Rkv+Dr]
    case Site::AttnKvANorm: {  // kv_a_layernorm of the latent part
      torch::Tensor latent = op.here(Site::AttnKvA).narrow(-1, 0, Rkv);       // [T, Rkv]
      return op.result(ops::rms_norm(latent, op.W(L.kv_a_norm), lora_eps));  // [T, Rkv]
    }
    case Site::AttnKv:  // kv_b_proj
      return op.project(Site::AttnKvANorm, op.W(L.kv_b), {});  // [T, Hq*(Dn+Dv)]
    case Site::AttnKPe:  // k_rot.view(b, 1, s, Dr), rotated
      return op.result(rope_mla(op.here(Site::AttnKvA).narrow(-1, Rkv, Dr).unsqueeze(0)).squeeze(0));  // [T, Dr]
    case Site::AttnQRope: {  // cat(q_pass, rope(q_rot))
      torch::Tensor q = op.here(Site::AttnQ).view({t, Hq, Dn + Dr}).transpose(0, 1);  // [Hq, T, Dn+Dr]
      const int64_t rot = f.mla_rope_front ? 0 : Dn, pass = f.mla_rope_front ? Dr : 0;
      return op.result(torch::cat({q.narrow(-1, pass, Dn), rope_mla(q.narrow(-1, rot, Dr))}, -1));  // [Hq, T, Dn+Dr]
    }
    case Site::AttnKRope: {  // cat(k_pass, k_rot.expand(...))
      torch::Tensor kv = op.here(Site::AttnKv).view({t, Hq, Dn + Dv}).transpose(0, 1);  // [Hq, T, Dn+Dv]
      torch::Tensor k_pe = op.here(Site::AttnKPe).unsqueeze(0).expand({Hq, t, Dr});    // [Hq, T, Dr]
      const int64_t key_at = f.mla_value_as_key ? Dn : 0;                              // the value rows (Dv == Dn)
      return op.result(torch::cat({kv.narrow(-1, key_at, Dn), k_pe}, -1));             // [Hq, T, Dn+Dr]
    }
    case Site::AttnLatentCache:  // what an absorbed engine caches
      return op.result(op.cache(op.here(Site::AttnKvANorm), 0));  // [S, Rkv]
    case Site::AttnKPeCache:
      return op.result(op.cache(op.here(Site::AttnKPe), 0));  // [S, Dr]
    case Site::AttnKCache:  // HF's DynamicCache: full keys
      return op.result(op.cache(op.here(Site::AttnKRope)));  // [Hq, S, Dn+Dr]
    case Site::AttnVCache: {
      torch::Tensor kv = op.here(Site::AttnKv).view({t, Hq, Dn + Dv}).transpose(0, 1);  // [Hq, T, Dn+Dv]
      return op.result(op.cache(kv.narrow(-1, Dn, Dv)));                                // [Hq, S, Dv]
    }
    case Site::AttnScores: {  // repeat_kv is the identity (Hkv == Hq)
      const double scaling = f.softmax_scale_dh ? 1.0 / double(m.qk_head_dim())
                             : f.mla_no_mscale  ? std::pow(double(m.qk_head_dim()), -0.5)
                                                : cfg_.attn_scaling();
      return op.result(ops::attn_scores(op.here(Site::AttnQRope), op.here(Site::AttnKCache), scaling));  // [Hq, T, S]
    }
    case Site::AttnCtx:
      return op.result(ops::attn_ctx(op.here(Site::AttnProbs), op.here(Site::AttnVCache)));  // [T, Hq*Dv]
    default: return std::nullopt;
  }
}

// The MoE block on MoE layers (MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock,
// Qwen3MoeSparseMoeBlock, DeepseekV3MoE), and the residual around it.
std::optional<Graph::Value> Graph::moe_block(LayerOp& op) {
  const zoo::Faults& f = opt_.faults;
  const MoeConfig& m = cfg_.moe;
  const LayerWeights& L = op.L;
  const torch::Tensor bias = m.correction_bias ? op.W(L.router_bias) : torch::Tensor();  // [E]
  const bool shared = L.shared.gate && !f.moe_shared_missing;
  auto mlp = [&](const MlpWeights& w, const torch::Tensor& x) {  // an expert, with gate-up-swap's swap
    return f.gate_up_swap ? ops::mlp(x, op.W(w.up), op.W(w.gate), op.W(w.down))
                          : ops::mlp(x, op.W(w.gate), op.W(w.up), op.W(w.down));
  };
  switch (op.site) {
    case Site::MoeRouterLogits:  // gate
      return op.result(ops::router_logits(op.here(Site::MlpNorm), op.W(L.router), m));  // [T, E]
    case Site::MoeRouterProbs: {  // softmax / sigmoid, float32
      MoeConfig scoring = m;
      if (f.moe_softmax_scoring) scoring.scoring = MoeConfig::Scoring::Softmax;
      return op.result(ops::router_probs(op.here(Site::MoeRouterLogits), scoring));  // [T, E]
    }
    case Site::MoeTopkIds: {  // the choice, sorted ascending
      const ops::Route r = ops::route(op.here(Site::MoeRouterProbs), bias, m, st_);
      return op.result(std::get<0>(r.ids.sort(-1)));  // [T, K]
    }
    case Site::MoeTopkWeights: {
      // HF's weights for the experts chosen: the route's own (its slot order,
      // bit for bit) where the choice is the route's, else the same formula
      // on the experts given.
      torch::Tensor probs = op.here(Site::MoeRouterProbs), ids = op.here(Site::MoeTopkIds);  // [T, E], [T, K]
      if (f.moe_bias_in_weights)  // the biased choice scores weighted instead
        return op.result(ops::route_weights(probs + bias.to(probs.scalar_type()).unsqueeze(0), ids, m, st_));  // [T, K]
      const ops::Route r = ops::route(probs, bias, m, st_);
      auto [route_ids, order] = r.ids.sort(-1);                                 // [T, K] each
      torch::Tensor same = (route_ids == ids).all(-1, /*keepdim=*/true);        // [T, 1]
      torch::Tensor given = ops::route_weights(probs, ids, m, st_);             // [T, K]
      return op.result(torch::where(same, r.weights.gather(1, order), given));  // [T, K]
    }
    case Site::MoeExpertOut: {  // each chosen expert on its token, before weighting
      torch::Tensor ids = op.here(Site::MoeTopkIds);                                // [T, K]
      torch::Tensor slots = ops::route_slots(op.here(Site::MoeRouterProbs), ids, m);  // [T, K]
      auto expert = [&](int64_t e, const torch::Tensor& rows) {
        if (f.moe_expert_shift) e = (e + 1) % m.num_experts;
        return mlp(L.experts.at(size_t(e)), rows);  // [N, D]
      };
      return op.result(ops::experts_out(op.here(Site::MlpNorm), ids, slots, expert));  // [T, K, D]
    }
    case Site::MoeRouted:  // sum_k weight * expert_out
      return op.result(ops::moe_combine(op.here(Site::MoeExpertOut), op.here(Site::MoeTopkWeights), st_));  // [T, D]
    case Site::MoeShared: {  // shared expert(s), Qwen2-MoE's behind a sigmoid gate
      if (!shared) return std::move(op.v);
      torch::Tensor x = op.here(Site::MlpNorm);  // [T, D]
      torch::Tensor y = mlp(L.shared, x);        // [T, D]
      return op.result(m.shared_gate ? torch::sigmoid(ops::linear(x, op.W(L.shared_gate), {})) * y : y);  // [T, D]
    }
    case Site::MoeOut:  // routed + shared: [T, D]
      return op.result(shared ? op.here(Site::MoeRouted) + op.here(Site::MoeShared) : op.here(Site::MoeRouted));
    case Site::Out:  // residual + hidden_states
      return op.result(op.here(Site::AttnResidual) + op.here(Site::MoeOut));  // [T, D]
    default: return std::nullopt;
  }
}

// LlamaDecoderLayer.forward: LlamaAttention (eager_attention_forward; Qwen2's
// biases, Qwen3's q/k norms) and LlamaMLP, each behind its RMSNorm and
// inside a residual.
Graph::Value Graph::decoder_layer(LayerOp& op) {
  const zoo::Faults& f = opt_.faults;
  const LayerWeights& L = op.L;
  const int64_t t = op.t, Hq = cfg_.num_attention_heads, Hkv = cfg_.num_key_value_heads, Dh = cfg_.head_dim;
  const int64_t n_rep = Hq / Hkv;  // num_key_value_groups
  const double eps = cfg_.rms_norm_eps;
  const bool qk = cfg_.qk_norm;
  const bool qk_late = qk && f.qk_norm_after_rope;
  auto rope = [&](const torch::Tensor& x) {  // x [H, T, Dh]
    auto [cos, sin] = rope_table(op.s);
    return f.rope_interleaved ? apply_rope_interleaved(x, cos, sin) : ops::apply_rope(x, cos, sin);
  };
  auto repeat = [&](const torch::Tensor& kv) {  // [Hkv, S, Dh] -> [Hq, S, Dh]
    return f.repeat_kv_tile ? repeat_kv_tile(kv, n_rep) : ops::repeat_kv(kv, n_rep);
  };
  switch (op.site) {
    case Site::AttnNorm:  // input_layernorm
      return op.result(ops::rms_norm(op.layer_input(), op.W(L.input_norm), eps));  // [T, D]
    case Site::AttnQ:
    case Site::AttnK:
    case Site::AttnV: {  // q_proj / k_proj / v_proj
      const bool q = op.site == Site::AttnQ, k = op.site == Site::AttnK;
      const torch::Tensor w = op.W(q ? L.q : k ? L.k : L.v);
      const torch::Tensor b = !cfg_.qkv_bias ? torch::Tensor() : op.W(q ? L.q_bias : k ? L.k_bias : L.v_bias);
      return op.project(Site::AttnNorm, w, b);  // [T, H*Dh]
    }
    case Site::AttnQNorm:
    case Site::AttnKNorm: {  // Qwen3Attention: per head, before the transpose
      const bool is_q = op.site == Site::AttnQNorm;
      const int64_t H = is_q ? Hq : Hkv;
      torch::Tensor x = op.here(is_q ? Site::AttnQ : Site::AttnK).view({t, H, Dh});  // [T, H, Dh]
      if (qk_late) x = rope(x.transpose(0, 1)).transpose(0, 1);                    // [T, H, Dh]
      return op.result(ops::rms_norm(x, op.W(is_q ? L.q_norm : L.k_norm), eps).reshape({t, H * Dh}));  // [T, H*Dh]
    }
    case Site::AttnQRope:
    case Site::AttnKRope: {  // apply_rotary_pos_emb
      const bool is_q = op.site == Site::AttnQRope;
      const int64_t H = is_q ? Hq : Hkv;
      const Site src = qk && !qk_late ? (is_q ? Site::AttnQNorm : Site::AttnKNorm) : (is_q ? Site::AttnQ : Site::AttnK);
      return op.result(rope(op.here(src).view({t, H, Dh}).transpose(0, 1)));  // [H, T, Dh]
    }
    case Site::AttnKCache: {
      // The cache holds the keys attention reads: after RoPE (and, with
      // qk-norm-after-rope, after the norm that follows it).
      torch::Tensor fresh = qk_late ? op.here(Site::AttnKNorm).view({t, Hkv, Dh}).transpose(0, 1)
                                    : op.here(Site::AttnKRope);  // [Hkv, T, Dh]
      return op.result(op.cache(fresh));                         // [Hkv, S, Dh]
    }
    case Site::AttnVCache:
      return op.result(op.cache(op.here(Site::AttnV).view({t, Hkv, Dh}).transpose(0, 1)));  // [Hkv, S, Dh]
    case Site::AttnKRep:  // eager_attention_forward: repeat_kv
      return op.result(repeat(op.here(Site::AttnKCache)));  // [Hq, S, Dh]
    case Site::AttnVRep:
      return op.result(repeat(op.here(Site::AttnVCache)));  // [Hq, S, Dh]
    case Site::AttnScores: {  // q @ k^T * scaling (self.head_dim**-0.5)
      torch::Tensor q = qk_late ? op.here(Site::AttnQNorm).view({t, Hq, Dh}).transpose(0, 1)
                                : op.here(Site::AttnQRope);  // [Hq, T, Dh]
      const double scaling = f.softmax_scale_dh ? 1.0 / double(Dh) : std::pow(double(Dh), -0.5);
      return op.result(ops::attn_scores(q, op.here(Site::AttnKRep), scaling));  // [Hq, T, S]
    }
    case Site::AttnProbs:  // softmax(scores + mask) in float32
      return op.result(ops::attn_probs(op.here(Site::AttnScores), additive_mask(op.s)));  // [Hq, T, S]
    case Site::AttnCtx:  // probs @ v, heads merged
      return op.result(ops::attn_ctx(op.here(Site::AttnProbs), op.here(Site::AttnVRep)));  // [T, Hq*Dh]
    case Site::AttnOut:  // o_proj (of ctx [T, Hq*Dv] for MLA)
      return op.project(Site::AttnCtx, op.W(L.o), cfg_.o_bias ? op.W(L.o_bias) : torch::Tensor());  // [T, D]
    case Site::AttnResidual:  // residual + hidden_states
      return op.result(op.layer_input() + op.here(Site::AttnOut));  // [T, D]
    case Site::MlpNorm:  // post_attention_layernorm
      return op.result(ops::rms_norm(op.here(Site::AttnResidual), op.W(L.post_attn_norm), eps));  // [T, D]
    case Site::MlpGate:  // LlamaMLP.gate_proj
      return op.project(Site::MlpNorm, op.W(L.mlp.gate), {});  // [T, F]
    case Site::MlpUp:  // up_proj
      return op.project(Site::MlpNorm, op.W(L.mlp.up), {});  // [T, F]
    case Site::MlpAct: {  // act_fn(gate) * up
      torch::Tensor g = op.here(Site::MlpGate), u = op.here(Site::MlpUp);
      return op.result(f.gate_up_swap ? ops::swiglu(u, g) : ops::swiglu(g, u));  // [T, F]
    }
    case Site::MlpDown:  // down_proj
      return op.project(Site::MlpAct, op.W(L.mlp.down), {});  // [T, D]
    case Site::Out:  // residual + hidden_states
      return op.result(op.here(Site::AttnResidual) + op.here(Site::MlpDown));  // [T, D]
    default: return std::move(op.v);  // not reached: MLA's and the MoE block's sites are theirs
  }
}

}  // namespace llmdiff::ref
