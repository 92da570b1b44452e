#include "cli/oracle.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>

#include "cli/common.h"
#include "compare/bisect_report.h"
#include "compare/report.h"
#include "compare/tolerance.h"
#include "dumps/errors.h"
#include "dumps/names.h"
#include "impl/bugs.h"
#include "impl/impl_engine.h"
#include "ref/ops.h"
#include "ref/ref_engine.h"
#include "ref/weights.h"

namespace llmdiff::cli {

namespace ops = ref::ops;

namespace {

// Thrown by a SelectiveDump that may end the run early, once it holds every
// wanted name: the rest of the scenario is not needed.
struct AllRecorded {};

// A MemoryDump that records the wanted names: exact names by a set lookup
// (a bisection asks for every name of the candidate), patterns by glob.
// With `stop_when_complete`, a list of exact names ends the run (AllRecorded)
// as soon as the last of them is recorded: a hypothesis judged at one site
// of step 0 costs part of one forward call, not the scenario.
class SelectiveDump : public MemoryDump {
 public:
  SelectiveDump(std::string label, const std::vector<std::string>& wanted, bool stop_when_complete = false)
      : MemoryDump(std::move(label)) {
    all_ = wanted.empty();
    for (const auto& w : wanted) {
      if (w.find_first_of("*?") == std::string::npos)
        exact_.insert(w);
      else
        globs_.push_back(w);
    }
    stop_ = stop_when_complete && !all_ && globs_.empty();
    pending_ = exact_;
  }
  bool wants(const std::string& name) const override {
    return all_ || exact_.count(name) || any_glob_match(globs_, name);
  }
  void on_f32(const std::string& name, const Shape& shape, const float* data) override {
    MemoryDump::on_f32(name, shape, data);
    recorded(name);
  }
  void on_i64(const std::string& name, const Shape& shape, const int64_t* data) override {
    MemoryDump::on_i64(name, shape, data);
    recorded(name);
  }

 private:
  void recorded(const std::string& name) {
    if (stop_ && pending_.erase(name) && pending_.empty()) throw AllRecorded{};
  }
  bool all_ = true, stop_ = false;
  std::set<std::string> exact_, pending_;
  std::vector<std::string> globs_;
};

}  // namespace

// ---------------------------------------------------------------------------
// RefRunner

RefWeightCache::RefWeightCache(const Model& model) : model_(model) {}
RefWeightCache::~RefWeightCache() = default;

ref::LayerByLayerWeights& RefWeightCache::layered(ComputeDType dtype) const {
  auto& w = layered_[dtype];
  if (!w) w = std::make_unique<ref::LayerByLayerWeights>(*model_.weights, ops::torch_dtype(dtype));
  return *w;
}

std::shared_ptr<const ref::RefWeights> RefWeightCache::get(ComputeDType dtype) const {
  return std::make_shared<const ref::RefWeights>(*model_.weights, ops::torch_dtype(dtype));
}

RefRunner::RefRunner(const Model& model, std::string model_dir, int threads, const RefWeightCache& weights)
    : model_(model), dir_(std::move(model_dir)), threads_(threads), weights_(weights) {}
RefRunner::~RefRunner() = default;

std::unique_ptr<MemoryDump> RefRunner::run(const Scenario& sc, ComputeDType dtype,
                                           const std::vector<std::string>& wanted) const {
  if (dtype == ComputeDType::Float64) return truth(sc, wanted);
  // The engine and its converted weights live for this run only: a 1B model
  // is 4.4 GB in float32, not to be held through the passes that follow.
  ref::RefOptions o;
  o.dtype = dtype;
  o.threads = threads_;
  std::unique_ptr<Engine> engine = ref::make_ref_engine(model_, o, weights_.get(dtype));
  auto dump = std::make_unique<SelectiveDump>(std::string("ref ") + compute_dtype_name(dtype), wanted);
  dump->mutable_manifest() = make_manifest(*engine, model_, dir_, sc);
  run_scenario(*engine, sc, *dump);
  return dump;
}

std::string RefRunner::describe() const {
  return "llmdiff ref (libtorch, HF transformers 4.51.3 eager numerics) on " + dir_;
}

// ---------------------------------------------------------------------------
// ImplHypothesisRunner

namespace {

// Sorted, rounded to 12 significant digits (so that config / 10 meets the
// round value it stands for), without duplicates or the config's own value.
std::vector<double> grid_without(std::vector<double> v, double config_value) {
  for (double& x : v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.12g", x);
    x = std::strtod(buf, nullptr);
  }
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  v.erase(std::remove(v.begin(), v.end(), config_value), v.end());
  return v;
}

}  // namespace

std::vector<double> rope_theta_grid(const ModelConfig& cfg) {
  const double t = cfg.rope_theta;
  return grid_without({1e4, 5e4, 1e5, 5e5, 1e6, 1e7, t / 10, t * 10, t / 2, t * 2}, t);
}

std::vector<double> rmsnorm_eps_grid(const ModelConfig& cfg) {
  const double e = cfg.rms_norm_eps;
  return grid_without({0.0, 1e-12, 1e-8, 1e-6, 1e-5, 1e-4, 1e-3, e / 10, e * 10}, e);
}

ImplHypothesisRunner::ImplHypothesisRunner(const Model& model, int threads) : model_(model), threads_(threads) {}

std::vector<compare::Hypothesis> ImplHypothesisRunner::hypotheses() const {
  std::vector<compare::Hypothesis> out;
  const ModelConfig& cfg = model_.config;
  for (const auto& info : impl::all_bugs()) {
    if (!impl::bug_inapplicable_reason(info.bug, cfg).empty()) continue;
    if (info.bug == impl::Bug::RopeTheta) {
      for (double v : rope_theta_grid(cfg)) out.push_back({info.name, v});
    } else if (info.bug == impl::Bug::RmsnormEps) {
      for (double v : rmsnorm_eps_grid(cfg)) out.push_back({info.name, v});
    } else {
      out.push_back({info.name, std::nullopt});
    }
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> ImplHypothesisRunner::inapplicable() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& info : impl::all_bugs()) {
    std::string why = impl::bug_inapplicable_reason(info.bug, model_.config);
    if (!why.empty()) out.emplace_back(info.name, why);
  }
  return out;
}

std::unique_ptr<MemoryDump> ImplHypothesisRunner::run(const compare::Hypothesis& h, const Scenario& sc,
                                                      const std::vector<std::string>& wanted) const {
  impl::ImplOptions o;
  o.threads = threads_;
  if (!h.bug.empty()) {
    impl::BugSpec spec = impl::parse_bug(h.bug);
    spec.value = h.value;
    o.bugs.push_back(spec);
  }
  // Room for every forward call of the scenario, whatever the config says.
  int64_t total = 0;
  for (const auto& s : sc.steps) total += int64_t(s.size());
  o.max_seq = std::max<int64_t>(total + sc.decode, model_.config.max_position_embeddings);
  auto engine = impl::make_impl_engine(model_, o);
  auto dump = std::make_unique<SelectiveDump>(h.bug.empty() ? "impl" : "impl with " + h.str(), wanted, true);
  try {
    run_scenario(*engine, sc, *dump);
  } catch (const AllRecorded&) {
    // every wanted name is there: the rest of the scenario is skipped
  }
  return dump;
}

std::optional<double> ImplHypothesisRunner::configured(const std::string& bug) const {
  if (bug == "rope-theta") return model_.config.rope_theta;
  if (bug == "rmsnorm-eps") return model_.config.rms_norm_eps;
  return std::nullopt;
}

std::string ImplHypothesisRunner::description(const std::string& bug) const {
  for (const auto& info : impl::all_bugs())
    if (bug == info.name) return info.description;
  return "";
}

// ---------------------------------------------------------------------------
// RefLocalOracle

namespace {

double finfo_min(torch::ScalarType st) {
  switch (st) {
    case torch::kDouble: return std::numeric_limits<double>::lowest();
    case torch::kBFloat16: return double(static_cast<float>(std::numeric_limits<c10::BFloat16>::lowest()));
    case torch::kHalf: return double(static_cast<float>(std::numeric_limits<c10::Half>::lowest()));
    default: return double(std::numeric_limits<float>::lowest());
  }
}

// How a bug hypothesis changes the reference ops, as the impl's bug zoo
// defines it: config-level changes go to `cfg`, the rest to the Faults (all
// false: the reference). Throws UsageError for an unknown or inapplicable bug.
impl::Faults variant_of(const compare::Hypothesis& h, ModelConfig& cfg) {
  impl::BugSpec spec = impl::parse_bug(h.bug);
  spec.value = h.value;
  impl::check_bugs({spec}, cfg);
  return impl::apply_bugs({spec}, cfg);
}

// RoPE with adjacent pairs (2i, 2i+1) rotated at frequency i: x [H, T, Dh],
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

// Query head h reads kv head h mod Hkv: [Hkv, S, Dh] -> [Hkv*n_rep, S, Dh].
torch::Tensor repeat_kv_tile(const torch::Tensor& kv, int64_t n_rep) { return kv.repeat({n_rep, 1, 1}); }

int64_t argmax_row(const torch::Tensor& row) {
  torch::Tensor f = row.to(torch::kFloat).contiguous();
  return argmax_first(std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel()));
}

// One recompute pass over a dump: every op reads its inputs from the dump
// where the dump holds them and recomputes them (memoised) where it does not.
class Recompute {
 public:
  Recompute(ModelConfig cfg, ref::LayerByLayerWeights& w, const TensorSource& dump,
            const compare::Hypothesis* h)
      : cfg_(std::move(cfg)), w_(w), dump_(dump), st_(w.st()) {
    if (h) var_ = variant_of(*h, cfg_);
    rope_dtype_ = st_ == torch::kDouble ? torch::kDouble : torch::kFloat;
    tokens_ = dump_.step_tokens();
    int64_t at = 0;
    for (size_t s = 0; s < tokens_.size(); ++s) {
      const int64_t T = int64_t(tokens_[s].size());
      // kv-overwrite keeps only the previous call's keys.
      past_.push_back(var_.kv_overwrite ? (s == 0 ? 0 : int64_t(tokens_[s - 1].size())) : at);
      at += T;
    }
    if (dump_.has("generated")) {
      const int64_t m = numel(dump_.shape("generated"));
      first_generating_ = int(std::max<int64_t>(0, int64_t(tokens_.size()) - m));
      generated_ = m;
    }
  }

  void run(compare::Recomputed& out) { run(dump_.names(), out.values, &out.source); }

  // Recomputes `names` (those it can) into `values`, with what each was
  // recomputed from in `source` (when given).
  void run(std::vector<std::string> names, Observer& values, std::map<std::string, std::string>* source) {
    torch::NoGradGuard no_grad;
    // Layer by layer, each for every step (a valid order: a layer reads the
    // layer before and its own earlier steps). Once layer l is reached, the
    // values of layer l-2 and earlier are dropped: the memo holds about two
    // layers in float64 instead of the whole dump (4 GB for a 1B model).
    auto phase = [](const CanonName& c) {
      if (c.kind == CanonName::Kind::Layer) return 1;
      if (c.kind == CanonName::Kind::Generated) return 2;
      if (c.kind == CanonName::Kind::Step &&
          (c.site == "final_norm" || c.site == "last_hidden" || c.site == "logits" || c.site == "next_logits"))
        return 2;
      return 0;
    };
    std::vector<std::pair<std::pair<int, int>, std::string>> order;
    for (auto& n : names) {
      CanonName c = parse_name(n);
      order.push_back({{phase(c), c.kind == CanonName::Kind::Layer ? c.layer : 0}, std::move(n)});
    }
    std::stable_sort(order.begin(), order.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    int reached = -1;
    for (const auto& [key, name] : order) {
      if (key.first == 1 && key.second > reached) {
        reached = key.second;
        forget_layers_before(reached - 1);
      }
      const Value* v = compute(name);
      if (!v || !v->t.defined()) continue;
      torch::Tensor t = v->t.contiguous();
      Shape shape(t.sizes().begin(), t.sizes().end());
      if (t.scalar_type() == torch::kLong) {
        values.on_i64(name, shape, t.data_ptr<int64_t>());
      } else {
        torch::Tensor f = t.to(torch::kFloat).contiguous();
        values.on_f32(name, shape, f.data_ptr<float>());
      }
      if (source) (*source)[name] = describe(*v);
    }
  }

 private:
  struct Value {
    torch::Tensor t;                       // undefined: cannot be recomputed
    std::vector<std::string> direct;       // the op's inputs: "name" (dump) or "name*" (recomputed)
    std::set<std::string> frontier;        // dump names read, transitively
  };

  static std::string describe(const Value& v) {
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

  // The value an op reads for `name`, recording it in `reads`.
  torch::Tensor input(const std::string& name, Value& reads) {
    if (dump_.has(name)) {
      auto it = dump_cache_.find(name);
      if (it == dump_cache_.end()) {
        TensorData d = dump_.get(name);
        torch::Tensor t;
        if (d.is_int)
          t = torch::tensor(d.i, torch::kLong).reshape(d.shape);
        else  // one conversion straight from the dump's values (a copy when st_ is float32)
          t = torch::from_blob(d.f.data(), d.shape, torch::kFloat).to(st_, false, /*copy=*/true);
        it = dump_cache_.emplace(name, t).first;
      }
      reads.direct.push_back(short_name(name));
      reads.frontier.insert(name);
      return it->second;
    }
    const Value* v = compute(name);
    if (!v || !v->t.defined()) throw UsageError("cannot recompute " + name);
    reads.direct.push_back(short_name(name) + "*");
    reads.frontier.insert(v->frontier.begin(), v->frontier.end());
    return v->t;
  }

  // Drops the memoised and cached values of layers < `layer`.
  void forget_layers_before(int layer) {
    auto old = [&](const std::string& name) {
      CanonName c = parse_name(name);
      return c.kind == CanonName::Kind::Layer && c.layer < layer;
    };
    for (auto it = memo_.begin(); it != memo_.end();) it = old(it->first) ? memo_.erase(it) : std::next(it);
    for (auto it = dump_cache_.begin(); it != dump_cache_.end();)
      it = old(it->first) ? dump_cache_.erase(it) : std::next(it);
  }

  static std::string short_name(const std::string& name) {
    CanonName c = parse_name(name);
    if (c.kind == CanonName::Kind::Layer) return "layers." + std::to_string(c.layer) + "." + c.site;
    if (c.kind == CanonName::Kind::Step) return c.site;
    return name;
  }

  const Value* compute(const std::string& name) {
    auto it = memo_.find(name);
    if (it != memo_.end()) return &it->second;
    if (in_progress_.count(name)) return nullptr;
    in_progress_.insert(name);
    Value v;
    try {
      v = compute_uncached(parse_name(name));
    } catch (const std::exception&) {
      v = Value{};  // an input is missing or has a shape the op cannot take
    }
    in_progress_.erase(name);
    return &memo_.emplace(name, std::move(v)).first->second;
  }

  // --- reference structure of each step -----------------------------------
  int64_t T(int s) const { return int64_t(tokens_[size_t(s)].size()); }
  int64_t P(int s) const { return past_[size_t(s)]; }

  torch::Tensor positions(int s) const {
    const int64_t start = var_.position_reset ? 0 : P(s);
    return torch::arange(start, start + T(s), torch::kLong);  // [T]
  }

  ops::RopeInit rope_for(int64_t seq_len) const {
    const bool grown = cfg_.rope_scaling.type == RopeScaling::Type::Dynamic && seq_len > cfg_.max_position_embeddings;
    return ops::rope_init(cfg_, grown ? seq_len : 0, rope_dtype_);
  }

  std::pair<torch::Tensor, torch::Tensor> rope_table(int s) {
    auto it = tables_.find(s);
    if (it != tables_.end()) return it->second;
    torch::Tensor pos = positions(s);
    auto cs = ops::rope_cos_sin(rope_for(pos.max().item<int64_t>() + 1), pos, st_);  // [T, Dh] each
    tables_[s] = cs;
    return cs;
  }

  // The additive mask [T, S] of step s.
  torch::Tensor additive_mask(int s) const {
    const int64_t t = T(s), S = var_.kv_overwrite ? t : P(s) + t;
    if (var_.mask_missing) return torch::zeros({t, S}, torch::dtype(st_));
    if (var_.mask_square) {
      torch::Tensor allowed = torch::arange(S, torch::kLong).unsqueeze(0) <= torch::arange(t, torch::kLong).unsqueeze(1);
      return torch::where(allowed, torch::zeros({t, S}, torch::dtype(st_)),
                          torch::full({t, S}, finfo_min(st_), torch::dtype(st_)));
    }
    return ops::causal_mask(cfg_, t, var_.kv_overwrite ? 0 : P(s), st_);
  }

  // Whether step s's token is the greedy pick of step s-1, to be checked
  // against it: only in a decode dump without `generated` (which, when
  // present, is where the greedy picks are checked; the step tokens may then
  // be another run's, replayed).
  bool greedy_step(int s) const {
    if (s < 1 || T(s) != 1 || generated_ > 0) return false;
    if (dump_.manifest().scenario != "decode") return false;
    for (int r = s; r < int(tokens_.size()); ++r)
      if (T(r) != 1) return false;
    return true;
  }

  // A projection `out` = linear(`in`, W, b) at step s, computed for every
  // step at once (rows stacked: one matrix product instead of one per decode
  // step, each of which would stream the whole weight). `name_at(t, site)`
  // names a site at step t. The other steps' results go to the memo; a step
  // whose input cannot be had is left to be computed alone.
  template <class NameAt>
  Value batched_linear(int s, NameAt name_at, const std::string& in, const std::string& out, const torch::Tensor& W,
                       const torch::Tensor& b) {
    std::vector<int> steps;
    std::vector<Value> values;
    std::vector<torch::Tensor> xs;
    for (int t = 0; t < int(tokens_.size()); ++t) {
      const std::string name = name_at(t, out);
      if (t != s && (memo_.count(name) || in_progress_.count(name))) continue;
      Value v;
      torch::Tensor x;
      if (t == s) {
        x = input(name_at(t, in), v);  // throws: this step cannot be recomputed
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
    torch::Tensor y = ops::linear(xs.size() == 1 ? xs[0] : torch::cat(xs, 0), W, b);  // [sum T, out]
    Value mine;
    int64_t row = 0;
    for (size_t k = 0; k < steps.size(); ++k) {
      const int64_t rows = xs[k].size(0);
      values[k].t = y.narrow(0, row, rows);  // [T, out]
      row += rows;
      if (steps[k] == s)
        mine = std::move(values[k]);
      else
        memo_.emplace(name_at(steps[k], out), std::move(values[k]));
    }
    return mine;
  }

  // --- the ops ----------------------------------------------------------------
  Value compute_uncached(const CanonName& c) {
    Value v;
    const int64_t Hq = cfg_.num_attention_heads, Hkv = cfg_.num_key_value_heads, Dh = cfg_.head_dim;
    const int64_t n_rep = Hq / Hkv;
    const double eps = cfg_.rms_norm_eps;
    auto step_in = [&](int s, const std::string& site) { return input(step_name(s, site), v); };
    if (c.kind == CanonName::Kind::InvFreq) {
      v.t = rope_for(P(0) + T(0)).inv_freq;
      return v;
    }
    if (c.kind == CanonName::Kind::Generated) {
      if (generated_ <= 0) return v;
      std::vector<int64_t> g;
      for (int s = first_generating_; s < int(tokens_.size()); ++s)
        g.push_back(argmax_row(step_in(s, "next_logits")));
      v.t = torch::tensor(g, torch::kLong);
      return v;
    }
    if (c.step < 0 || c.step >= int(tokens_.size())) return v;
    const int s = c.step;
    const int64_t t = T(s);
    if (c.kind == CanonName::Kind::Step) {
      const std::string& site = c.site;
      if (site == "tokens") {
        if (!greedy_step(s)) return v;  // tokens are the dump's input, checked only where greedy
        v.t = torch::tensor(std::vector<int64_t>{argmax_row(step_in(s - 1, "next_logits"))}, torch::kLong);
      } else if (site == "positions") {
        v.t = positions(s);
      } else if (site == "rope.cos") {
        v.t = rope_table(s).first;
      } else if (site == "rope.sin") {
        v.t = rope_table(s).second;
      } else if (site == "mask") {
        v.t = ops::mask_allowed(additive_mask(s));
      } else if (site == "embed") {
        v.t = ops::embed(w_.embed, step_in(s, "tokens"));  // [T, D]
      } else if (site == "final_norm") {
        torch::Tensor h = input(layer_name(s, int(cfg_.num_hidden_layers) - 1, "out"), v);
        v.t = ops::rms_norm(h, w_.final_norm, eps);  // [T, D]
      } else if (site == "last_hidden") {
        v.t = step_in(s, "final_norm")[var_.last_token_first ? 0 : t - 1];  // [D]
      } else if (site == "logits") {
        return batched_linear(s, [](int t, const std::string& x) { return step_name(t, x); }, "final_norm", "logits",
                              var_.lm_head_embed ? w_.embed : w_.lm_head, {});  // [T, V]
      } else if (site == "next_logits") {
        v.t = step_in(s, "logits")[var_.last_token_first ? 0 : t - 1];  // [V]
      }
      return v;
    }
    if (c.kind != CanonName::Kind::Layer || c.layer < 0 || c.layer >= int64_t(w_.num_layers())) return v;
    const int l = c.layer;
    const ref::RefWeights::Layer L = w_.layer(l);  // handles: the slot stays intact while they live
    const std::string& site = c.site;
    auto here = [&](const std::string& x) { return input(layer_name(s, l, x), v); };
    auto at_layer = [l](int t, const std::string& x) { return layer_name(t, l, x); };
    auto project = [&](const std::string& in, const torch::Tensor& W, const torch::Tensor& b) {
      return batched_linear(s, at_layer, in, site, W, b);
    };
    auto layer_input = [&]() {
      return l == 0 ? input(step_name(s, "embed"), v) : input(layer_name(s, l - 1, "out"), v);  // [T, D]
    };
    auto rope = [&](const torch::Tensor& x) {  // x [H, T, Dh]
      auto [cos, sin] = rope_table(s);
      return var_.rope_interleaved ? apply_rope_interleaved(x, cos, sin) : ops::apply_rope(x, cos, sin);
    };
    auto repeat = [&](const torch::Tensor& kv) {
      return var_.repeat_kv_tile ? repeat_kv_tile(kv, n_rep) : ops::repeat_kv(kv, n_rep);
    };
    auto cache = [&](const std::string& which, const torch::Tensor& fresh) {  // fresh [Hkv, T, Dh]
      if (s == 0 || var_.kv_overwrite) return fresh;
      return torch::cat({input(layer_name(s - 1, l, which), v), fresh}, 1);  // [Hkv, S, Dh]
    };
    const bool qk = cfg_.qk_norm;
    if (site == "attn_norm") {
      v.t = ops::rms_norm(layer_input(), L.input_norm, eps);
    } else if (site == "attn.q" || site == "attn.k" || site == "attn.v") {
      const char p = site.back();
      const torch::Tensor& W = p == 'q' ? L.q : p == 'k' ? L.k : L.v;
      const torch::Tensor& b = !cfg_.qkv_bias ? torch::Tensor() : p == 'q' ? L.q_bias : p == 'k' ? L.k_bias : L.v_bias;
      return project("attn_norm", W, b);  // [T, H*Dh]
    } else if (site == "attn.q_norm" || site == "attn.k_norm") {
      if (!qk) return v;
      const bool is_q = site == "attn.q_norm";
      const int64_t H = is_q ? Hq : Hkv;
      torch::Tensor x = here(is_q ? "attn.q" : "attn.k").view({t, H, Dh});                     // [T, H, Dh]
      if (var_.qk_norm_after_rope) x = rope(x.transpose(0, 1)).transpose(0, 1);                 // [T, H, Dh]
      v.t = ops::rms_norm(x, is_q ? L.q_norm : L.k_norm, eps).reshape({t, H * Dh});           // [T, H*Dh]
    } else if (site == "attn.q_rope" || site == "attn.k_rope") {
      const bool is_q = site == "attn.q_rope";
      const int64_t H = is_q ? Hq : Hkv;
      const std::string src = qk && !var_.qk_norm_after_rope ? (is_q ? "attn.q_norm" : "attn.k_norm")
                                                              : (is_q ? "attn.q" : "attn.k");
      v.t = rope(here(src).view({t, H, Dh}).transpose(0, 1));  // [H, T, Dh]
    } else if (site == "attn.k_cache") {
      // The cache holds the keys attention reads: after RoPE (and, with
      // qk-norm-after-rope, after the norm that follows it).
      torch::Tensor fresh = qk && var_.qk_norm_after_rope ? here("attn.k_norm").view({t, Hkv, Dh}).transpose(0, 1)
                                                          : here("attn.k_rope");  // [Hkv, T, Dh]
      v.t = cache("attn.k_cache", fresh);
    } else if (site == "attn.v_cache") {
      v.t = cache("attn.v_cache", here("attn.v").view({t, Hkv, Dh}).transpose(0, 1));
    } else if (site == "attn.k_rep") {
      v.t = repeat(here("attn.k_cache"));  // [Hq, S, Dh]
    } else if (site == "attn.v_rep") {
      v.t = repeat(here("attn.v_cache"));  // [Hq, S, Dh]
    } else if (site == "attn.scores") {
      torch::Tensor q = qk && var_.qk_norm_after_rope ? here("attn.q_norm").view({t, Hq, Dh}).transpose(0, 1)
                                                      : here("attn.q_rope");  // [Hq, T, Dh]
      const double scaling = var_.softmax_scale_dh ? 1.0 / double(Dh) : std::pow(double(Dh), -0.5);
      v.t = ops::attn_scores(q, here("attn.k_rep"), scaling);  // [Hq, T, S]
    } else if (site == "attn.probs") {
      v.t = ops::attn_probs(here("attn.scores"), additive_mask(s));  // [Hq, T, S]
    } else if (site == "attn.ctx") {
      v.t = ops::attn_ctx(here("attn.probs"), here("attn.v_rep"));  // [T, Hq*Dh]
    } else if (site == "attn.out") {
      return project("attn.ctx", L.o, cfg_.o_bias ? L.o_bias : torch::Tensor());  // [T, D]
    } else if (site == "attn_residual") {
      v.t = layer_input() + here("attn.out");  // [T, D]
    } else if (site == "mlp_norm") {
      v.t = ops::rms_norm(here("attn_residual"), L.post_attn_norm, eps);
    } else if (site == "mlp.gate") {
      return project("mlp_norm", L.gate, {});  // [T, F]
    } else if (site == "mlp.up") {
      return project("mlp_norm", L.up, {});  // [T, F]
    } else if (site == "mlp.act") {
      torch::Tensor g = here("mlp.gate"), u = here("mlp.up");
      v.t = var_.gate_up_swap ? ops::swiglu(u, g) : ops::swiglu(g, u);  // [T, F]
    } else if (site == "mlp.down") {
      return project("mlp.act", L.down, {});  // [T, D]
    } else if (site == "out") {
      v.t = here("attn_residual") + here("mlp.down");  // [T, D]
    }
    return v;
  }

  ModelConfig cfg_;
  ref::LayerByLayerWeights& w_;
  const TensorSource& dump_;
  torch::ScalarType st_, rope_dtype_ = torch::kFloat;
  impl::Faults var_;
  std::vector<std::vector<int64_t>> tokens_;
  std::vector<int64_t> past_;
  int first_generating_ = 0;
  int64_t generated_ = 0;
  std::map<std::string, Value> memo_;
  std::set<std::string> in_progress_;
  std::map<std::string, torch::Tensor> dump_cache_;
  std::map<int, std::pair<torch::Tensor, torch::Tensor>> tables_;
};

}  // namespace

// The float64 truth: the ref's ops (ref/ops.h, as the engine calls them)
// recomputed from the scenario's tokens alone, layer by layer, each layer for
// every forward call with the projections of all calls in one matrix product.
// The engine would instead run call after call, streaming the float64 weights
// (4x the bf16 checkpoint) once per decode step. The numbers are those of the
// engine in float64 up to float64 rounding (tested on every golden model).
std::unique_ptr<MemoryDump> RefRunner::truth(const Scenario& sc, const std::vector<std::string>& wanted) const {
  MemoryDump inputs("tokens");
  inputs.mutable_manifest().scenario = sc.name;
  for (size_t s = 0; s < sc.steps.size(); ++s)
    inputs.on_i64(step_name(int(s), "tokens"), {int64_t(sc.steps[s].size())}, sc.steps[s].data());
  // Every canonical name of the scenario that `wanted` asks for, but the
  // inputs (tokens) and the greedy picks (generated).
  auto dump = std::make_unique<SelectiveDump>("ref float64", wanted);
  dump->mutable_manifest().scenario = sc.name;
  dump->mutable_manifest().dtype = compute_dtype_name(ComputeDType::Float64);
  dump->mutable_manifest().config = model_.config.raw_json;
  std::vector<std::string> names;
  auto consider = [&](const std::string& n) {
    if (dump->wants(n)) names.push_back(n);
  };
  consider("rope.inv_freq");
  for (int s = 0; s < int(sc.steps.size()); ++s) {
    for (const auto& site : step_sites_before_layers())
      if (site != "tokens") consider(step_name(s, site));
    for (int l = 0; l < int(model_.config.num_hidden_layers); ++l)
      for (const auto& site : layer_sites()) consider(layer_name(s, l, site));
    for (const auto& site : step_sites_after_layers()) consider(step_name(s, site));
  }
  ref::use_threads(threads_, ComputeDType::Float64);
  Recompute pass(model_.config, weights_.layered(ComputeDType::Float64), inputs, nullptr);
  pass.run(names, *dump, nullptr);
  return dump;
}

RefLocalOracle::RefLocalOracle(const Model& model, const RefWeightCache& weights, int threads)
    : model_(model), weights_(weights), threads_(threads) {}
RefLocalOracle::~RefLocalOracle() = default;

std::unique_ptr<compare::Recomputed> RefLocalOracle::recompute(const TensorSource& dump, ComputeDType dtype,
                                                               const compare::Hypothesis* h) const {
  auto out = std::make_unique<compare::Recomputed>();
  ref::use_threads(threads_, dtype);
  Recompute pass(model_.config, weights_.layered(dtype), dump, h);
  pass.run(*out);
  return out;
}

bool RefLocalOracle::supports(const compare::Hypothesis& h) const {
  try {
    ModelConfig cfg = model_.config;
    variant_of(h, cfg);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// ---------------------------------------------------------------------------
// The pipeline

ModelOracles::ModelOracles(const std::string& model_dir, int threads)
    : dir(model_dir),
      model(Model::load(model_dir)),
      weights(model),
      reference(model, model_dir, threads, weights),
      oracle(model, weights, threads),
      hypotheses(model, threads) {}

compare::BisectResult bisect_candidate(const ModelOracles& m, const TensorSource& cand,
                                       const compare::BisectOptions& opt) {
  compare::BisectResult r = compare::bisect(cand, m.reference, &m.oracle, &m.hypotheses, opt);
  if (r.model.empty()) r.model = dir_name(m.dir);
  return r;
}

std::unique_ptr<MemoryDump> run_impl_candidate(const ModelOracles& m, const Scenario& sc, const EngineOptions& eo,
                                               const std::vector<std::string>& record) {
  std::string label = "impl";
  for (size_t k = 0; k < eo.inject.size(); ++k) label += (k == 0 ? " --inject " : ",") + eo.inject[k];
  auto cand = std::make_unique<MemoryDump>(label);
  auto engine = make_engine("impl", m.model, eo);
  cand->mutable_manifest() = make_manifest(*engine, m.model, m.dir, sc);
  cand->set_filter(record);
  run_scenario(*engine, sc, *cand);
  return cand;
}

compare::BisectResult bisect_impl_candidate(const ModelOracles& m, const MemoryDump& cand, bool bugs_injected,
                                            compare::BisectOptions opt) {
  if (!bugs_injected) opt.clean = std::shared_ptr<const TensorSource>(&cand, [](const TensorSource*) {});
  return bisect_candidate(m, cand, opt);
}

void add_bisect_cli_options(CLI::App& sub, BisectCliOptions& o) {
  sub.add_option("--tol", o.tol, "per-name tolerance GLOB=atol:X,rtol:Y (repeatable; for --no-noise-floor)");
  sub.add_option("--rtol", o.rtol, "relative tolerance (allclose; for --no-noise-floor)");
  sub.add_option("--atol", o.atol, "absolute tolerance (allclose; for --no-noise-floor)");
  sub.add_option("--sites", o.sites, "compare only names matching these globs, comma separated (e.g. 'layers.*.out,logits')");
  sub.add_flag("--no-noise-floor", o.no_noise_floor,
               "judge by allclose instead of the noise floor (no float64 reference run)");
  sub.add_flag("--no-local", o.no_local, "skip local errors (teacher forcing)");
  sub.add_flag("--no-diagnose", o.no_diagnose, "skip testing the bug hypotheses");
  sub.add_flag("--json", o.json, "print the result as JSON (schema llmdiff.bisect/1, see compare/README.md)");
  sub.add_flag("--all", o.all, "list every local site and every hypothesis tested");
  sub.add_option("--report", o.report, "also write a Markdown bisection report to this file");
  sub.add_option("--threads", o.threads, "threads (default: all cores)")->check(CLI::NonNegativeNumber);
  sub.add_flag("--verbose", o.verbose, "print each phase as it ends, with the elapsed time and peak memory, on stderr");
}

compare::BisectOptions bisect_options(const BisectCliOptions& o, const PhaseLog* log) {
  compare::BisectOptions b;
  if (log && log->enabled()) b.progress = [log](const std::string& what) { (*log)(what); };
  b.compare.rtol = o.rtol;
  b.compare.atol = o.atol;
  for (const auto& t : o.tol) b.compare.overrides.push_back(compare::parse_tolerance_override(t));
  b.compare.sites = split_list(o.sites);
  b.noise_floor = !o.no_noise_floor;
  b.local = !o.no_local;
  b.diagnose = !o.no_diagnose;
  return b;
}

int emit_bisect(const compare::BisectResult& r, const BisectCliOptions& o) {
  if (!o.report.empty()) compare::write_text_atomic(o.report, compare::render_bisect_markdown(r));
  compare::BisectTableOptions t;
  t.all = o.all;
  const std::string text = o.json ? compare::render_bisect_json(r) : compare::render_bisect_table(r, t);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
  return r.exit_code();
}

}  // namespace llmdiff::cli
