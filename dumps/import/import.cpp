// `llmdiff import`: matching an engine's names against a mapping's rules and
// running each rule's transforms (dumps/import/import.h).
#include "dumps/import/import.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <set>

#include "dumps/base/errors.h"
#include "dumps/import/foreign.h"
#include "dumps/import/import_ops.h"
#include "dumps/import/import_pattern.h"
#include "dumps/contract/names.h"
#include "dumps/contract/precision.h"
#include "dumps/contract/rows.h"
#include "dumps/contract/sites.h"

namespace llmdiff::import {

using nlohmann::json;

namespace {

// One forward call's foreign names: base name -> its occurrences in order
// ("Qcur-0", "Qcur-0#1", ...), each (input, stored name).
struct Located {
  const ForeignTensors* input = nullptr;
  std::string name;
};
using Occurrences = std::map<std::string, std::vector<Located>>;

// "Qcur-0#2" -> ("Qcur-0", 2); a name without the suffix is occurrence 0.
std::pair<std::string, int> split_occurrence(const std::string& name, const std::string& suffix) {
  const size_t p = name.rfind(suffix);
  if (p == std::string::npos || p == 0 || p + suffix.size() >= name.size()) return {name, 0};
  const std::string digits = name.substr(p + suffix.size());
  if (digits.size() > 6 || digits.find_first_not_of("0123456789") != std::string::npos) return {name, 0};
  return {name.substr(0, p), std::stoi(digits)};
}

void add_names(Occurrences& occ, const ForeignTensors& in, const std::string& suffix) {
  std::map<std::string, std::map<int, std::string>> by_base;
  for (const std::string& n : in.names()) {
    auto [base, k] = split_occurrence(n, suffix);
    by_base[base][k] = n;
  }
  for (auto& [base, ks] : by_base)
    for (auto& [k, n] : ks) occ[base].push_back({&in, n});
}

std::string model_wide(const std::string& to) { return to == "rope.inv_freq" || to == "generated" ? to : ""; }

class Importer {
 public:
  Importer(const Mapping& m, const ModelConfig& cfg, const ImportOptions& opt, MemoryDump& out)
      : m_(m), cfg_(cfg), opt_(opt), out_(out) {
    for (const Rule& r : m.rules) patterns_.push_back(Pattern::compile(r.from));
  }

  ImportSummary run(const std::vector<std::string>& inputs) {
    if (inputs.empty()) throw UsageError("import: no input files");
    for (const std::string& p : inputs) inputs_.push_back(std::make_unique<ForeignTensors>(p));
    bool by_capture = false;
    for (const Pattern& p : patterns_) by_capture = by_capture || p.captures("step");
    // Each forward call's names.
    std::vector<Occurrences> steps;
    if (by_capture) {
      Occurrences all;
      for (const auto& in : inputs_) add_names(all, *in, m_.occurrence_suffix);
      std::set<int64_t> seen;
      for (size_t r = 0; r < patterns_.size(); ++r)
        for (const auto& [base, list] : all) {
          Captures c;
          if (patterns_[r].match(base, c) && c.count("step")) seen.insert(c["step"]);
        }
      const int64_t n = seen.empty() ? int64_t(opt_.tokens.size()) : *seen.rbegin() + 1;
      steps.assign(size_t(std::max<int64_t>(n, 1)), all);  // a rule keeps the names of its own step
    } else {
      for (const auto& in : inputs_) {
        Occurrences o;
        add_names(o, *in, m_.occurrence_suffix);
        steps.push_back(std::move(o));
      }
    }
    by_capture_ = by_capture;
    tokens_ = opt_.tokens;
    if (!tokens_.empty() && tokens_.size() != steps.size())
      throw UsageError("import: --tokens gives " + std::to_string(tokens_.size()) + " forward call(s), the inputs " +
                       std::to_string(steps.size()));
    matched_.assign(m_.rules.size(), false);
    int64_t past = 0;
    for (size_t s = 0; s < steps.size(); ++s) {
      // The tokens first: T, P and S of this call depend on them.
      if (tokens_.size() <= s) {
        run_rules(int(s), steps[s], past, -1, true);
        const std::string name = step_name(int(s), Site::Tokens);
        if (!out_.has(name))
          throw UsageError("import: forward call " + std::to_string(s) + " has no tokens: give --tokens or a rule "
                           "to \"tokens\" (" + (by_capture ? "a {step} capture" : "input " + std::to_string(s + 1)) +
                           ")");
        tokens_.push_back(out_.get(name).i);
      } else {
        TensorData t;
        t.name = step_name(int(s), Site::Tokens);
        t.is_int = true;
        t.stored = DType::I64;
        t.i = tokens_[s];
        t.shape = {int64_t(t.i.size())};
        if (!out_.has(t.name)) out_.put(t);
      }
      const int64_t T = int64_t(tokens_[s].size());
      run_rules(int(s), steps[s], past, T, false);
      past += T;
    }
    ImportSummary sum;
    sum.steps = int(steps.size());
    sum.tensors = int(out_.names().size());
    for (size_t r = 0; r < m_.rules.size(); ++r)
      if (!matched_[r] && applies(m_.rules[r])) sum.unmatched_rules.push_back(m_.rules[r].describe());
    for (const auto& in : inputs_)
      for (const std::string& n : in->names())
        if (!used_.count({in.get(), n}) && !any_glob_match(m_.ignore, n)) sum.unmapped.push_back(n);
    sum.skipped = skipped_;
    for (const auto& [s, R] : step_rows_) {  // step{N}.rows: the last R rows
      TensorData r;
      r.name = step_name(s, Site::Rows);
      r.is_int = true;
      r.stored = DType::I64;
      const int64_t T = int64_t(tokens_[size_t(s)].size());
      for (int64_t k = T - R; k < T; ++k) r.i.push_back(k);
      r.shape = {R};
      out_.put(std::move(r));
    }
    fill_manifest(int(steps.size()));
    return sum;
  }

 private:
  bool applies(const Rule& r) const {
    return r.model_types.empty() ||
           std::find(r.model_types.begin(), r.model_types.end(), cfg_.model_type) != r.model_types.end();
  }

  Symbols symbols(int64_t past, int64_t T, const Captures& caps) const {
    Symbols s;
    s["D"] = double(cfg_.hidden_size);
    s["F"] = double(cfg_.intermediate_size);
    s["V"] = double(cfg_.vocab_size);
    s["Hq"] = s["H"] = double(cfg_.num_attention_heads);
    s["Hkv"] = double(cfg_.num_key_value_heads);
    s["Dh"] = double(cfg_.head_dim);
    s["L"] = double(cfg_.num_hidden_layers);
    s["attn_scale"] = cfg_.attn_scaling();
    s["P"] = double(past);
    if (T >= 0) {
      s["T"] = double(T);
      s["S"] = double(past + T);
    }
    for (const auto& [k, v] : caps) s[k] = double(v);
    return s;
  }

  void run_rules(int step, const Occurrences& occ, int64_t past, int64_t T, bool tokens_only) {
    for (size_t r = 0; r < m_.rules.size(); ++r) {
      const Rule& rule = m_.rules[r];
      if (!applies(rule)) continue;
      const bool to_tokens = rule.to.size() == 1 && (rule.to[0] == "tokens" || rule.to[0] == "step{step}.tokens");
      if (to_tokens != tokens_only) continue;
      for (const auto& [base, list] : occ) {
        Captures caps;
        if (!patterns_[r].match(base, caps)) continue;
        if (by_capture_ && caps.count("step") && caps["step"] != step) continue;
        caps["step"] = step;
        const int k = rule.occurrence >= 0 ? rule.occurrence : int(list.size()) + rule.occurrence;
        if (k < 0 || k >= int(list.size())) continue;  // not that many nodes of this name
        for (const Located& l : list) used_.insert({l.input, l.name});  // the other occurrences are taken too
        matched_[r] = true;
        const Located& src = list[size_t(k)];
        std::string why;
        for (const std::string& u : rule.unless)
          if (why.empty() && occ.count(substitute(u, caps))) why = substitute(u, caps) + " is present";
        for (const std::string& r : rule.requires_)
          if (why.empty() && !occ.count(substitute(r, caps))) why = substitute(r, caps) + " is absent";
        if (!why.empty()) {
          skipped_.push_back(src.name + ": " + rule.describe() + ", as " + why);
          continue;
        }
        apply(rule, src, occ, step, past, T, caps);
      }
    }
  }

  [[noreturn]] void fail(const Rule& rule, const Located& src, const std::string& why) const {
    throw FormatError(src.input->file_of(src.name), src.name, m_.source + " " + rule.describe() + ": " + why);
  }

  void apply(const Rule& rule, const Located& src, const Occurrences& occ, int step, int64_t past, int64_t T,
             const Captures& caps) {
    Symbols sym = symbols(past, T, caps);
    std::vector<TensorData> ts;
    try {
      TensorData t = src.input->get(src.name);
      if (m_.ggml_dims) t = reverse_dims(std::move(t));
      sym["numel"] = double(t.numel());
      if (!rule.when.empty() && eval_expr(rule.when, sym) == 0) {
        skipped_.push_back(src.name + ": " + rule.describe() + ", \"" + rule.when + "\" is false (numel " +
                           std::to_string(t.numel()) + ")");
        return;
      }
      ts.push_back(std::move(t));
      for (const Transform& tr : rule.transforms) {
        std::vector<TensorData> next;
        for (TensorData& t : ts) {
          if (tr.op == "split") {
            std::vector<int64_t> sizes;
            for (const json& d : tr.arg["sizes"]) sizes.push_back(dim(d, sym));
            for (TensorData& part : split(t, tr.arg["axis"].get<int>(), sizes)) next.push_back(std::move(part));
          } else {
            next.push_back(transform(tr, std::move(t), sym, occ, caps));
          }
        }
        ts = std::move(next);
      }
    } catch (const FormatError&) {
      throw;
    } catch (const Error& e) {
      fail(rule, src, e.what());
    }
    for (size_t k = 0; k < ts.size(); ++k) store(rule, src, step, T, substitute(rule.to[k], caps), std::move(ts[k]));
  }

  int64_t dim(const json& d, const Symbols& sym) const {
    return d.is_number_integer() ? d.get<int64_t>() : eval_int(d.get<std::string>(), sym);
  }

  TensorData transform(const Transform& tr, TensorData t, const Symbols& sym, const Occurrences& occ,
                       const Captures& caps) const {
    const json& a = tr.arg;
    if (tr.op == "reverse_dims") return reverse_dims(std::move(t));
    if (tr.op == "reshape") {
      Shape s;
      for (const json& d : a) s.push_back(dim(d, sym));
      return reshape(std::move(t), s);
    }
    if (tr.op == "permute") return permute(t, a.get<std::vector<int>>());
    if (tr.op == "transpose") {
      std::vector<int> axes(t.shape.size());
      for (size_t k = 0; k < axes.size(); ++k) axes[k] = int(k);
      const int r = int(axes.size());
      int x = a[0].get<int>(), y = a[1].get<int>();
      if (x < -r || x >= r || y < -r || y >= r)
        throw UsageError("transpose of axes " + a.dump() + " of shape " + shape_str(t.shape));
      std::swap(axes[size_t(x < 0 ? x + r : x)], axes[size_t(y < 0 ? y + r : y)]);
      return permute(t, axes);
    }
    if (tr.op == "slice")
      return slice(t, a["axis"].get<int>(), a.contains("start") ? dim(a["start"], sym) : 0, dim(a["end"], sym));
    if (tr.op == "select") return select(t, a["axis"].get<int>(), dim(a["index"], sym));
    if (tr.op == "deinterleave" || tr.op == "interleave") {
      const int64_t group = a.is_null() ? int64_t(sym.at("Dh")) : dim(a, sym);
      return tr.op == "deinterleave" ? deinterleave(t, group) : interleave(t, group);
    }
    if (tr.op == "duplicate_halves") return duplicate_halves(t);
    if (tr.op == "scale") return scale(std::move(t), a.is_number() ? a.get<double>() : eval_expr(a.get<std::string>(), sym));
    if (tr.op == "bits") return from_bits(t, a.get<std::string>());
    if (tr.op == "gather_paged") {
      const std::string table = substitute(a["block_table"].get<std::string>(), caps);
      auto it = occ.find(table);
      if (it == occ.end()) throw UsageError("gather_paged: no block table \"" + table + "\" in the inputs");
      const Located& l = it->second.back();
      const TensorData bt = l.input->get(l.name);
      if (!bt.is_int) throw UsageError("gather_paged: block table \"" + table + "\" holds floats, not block ids");
      const int64_t length = a.contains("length") ? dim(a["length"], sym) : int64_t(sym.at("S"));
      return gather_paged(t, bt.i, a.value("layout", std::string("block,slot,head,dim")), length);
    }
    throw UsageError("unknown transform " + tr.op);  // Mapping::from_json admits none
  }

  void store(const Rule& rule, const Located& src, int step, int64_t T, const std::string& to, TensorData t) {
    std::string full = model_wide(to);
    if (full.empty()) full = to.compare(0, 4, "step") == 0 ? to : step_name(step, to);
    const CanonName c = parse_name(full);
    const bool per_step = c.kind == CanonName::Kind::Step || c.kind == CanonName::Kind::Layer;
    if (c.kind == CanonName::Kind::Unknown || (per_step && site_rank(c.site) < 0))
      fail(rule, src, "\"" + full + "\" is not a name of llm-dump/1 (docs/DUMP_FORMAT.md)");
    if (c.kind == CanonName::Kind::Layer && c.layer >= cfg_.num_hidden_layers)
      fail(rule, src, full + ": the model has " + std::to_string(cfg_.num_hidden_layers) + " layers");
    const int64_t Tc = T >= 0 ? T : t.numel();
    int64_t past = 0;
    for (int s = 0; s < step && s < int(tokens_.size()); ++s) past += int64_t(tokens_[size_t(s)].size());
    std::optional<Shape> want = spec_shape(c, cfg_, Tc, past + Tc, 0);
    if (!want && c.kind != CanonName::Kind::Generated)
      fail(rule, src, full + " is not a site of this model (" + cfg_.model_type + ")");
    if (rule.rows_last && want) {
      // The last R token rows only: R is what the tensor holds, the same for
      // every such tensor of the step.
      const std::optional<int> axis = token_axis(c.site);
      if (!axis) fail(rule, src, full + " is not a per-token tensor: \"rows\" does not apply");
      if (int(t.shape.size()) == int(want->size()) && t.shape[size_t(*axis)] < (*want)[size_t(*axis)]) {
        const int64_t R = t.shape[size_t(*axis)];
        auto [it, fresh] = step_rows_.emplace(step, R);
        if (!fresh && it->second != R)
          fail(rule, src, full + " holds " + std::to_string(R) + " token rows, another tensor of this call " +
                              std::to_string(it->second) + " (one row list per forward call)");
        (*want)[size_t(*axis)] = R;
      }
    }
    if (want && c.kind != CanonName::Kind::Generated && *want != t.shape)
      fail(rule, src, "gives " + shape_str(t.shape) + " for " + full + ", the format's shape is " + shape_str(*want) +
                          " (add or fix a reshape/permute)");
    const bool integer = c.kind == CanonName::Kind::Generated || integer_site(c.site);
    if (integer && !t.is_int) {
      t.i.resize(t.f.size());
      for (size_t k = 0; k < t.f.size(); ++k) {
        if (t.f[k] != std::floor(t.f[k])) fail(rule, src, full + " holds integers; value " + std::to_string(t.f[k]));
        t.i[k] = int64_t(t.f[k]);
      }
      t.f.clear();
      t.is_int = true;
    } else if (!integer && t.is_int) {
      t.f = t.floats();
      t.i.clear();
      t.is_int = false;
    }
    if (out_.has(full)) {
      auto prev = made_by_.find(full);
      fail(rule, src, full + " is made twice (also by " + (prev == made_by_.end() ? "--tokens" : prev->second) + ")");
    }
    made_by_[full] = rule.describe() + " from " + src.name;
    t.name = full;
    out_.put(std::move(t));
  }

  void fill_manifest(int steps) {
    Manifest& mf = out_.mutable_manifest();
    mf.model = opt_.model_name;
    mf.config = cfg_.raw_json;
    mf.steps = steps;
    mf.dtype = opt_.dtype;
    mf.producer = opt_.producer.empty() ? "llmdiff import (mapping " + m_.source + ")" : opt_.producer;
    bool decode = steps > 1;
    for (int s = 1; s < steps; ++s) decode = decode && tokens_[size_t(s)].size() == 1;
    mf.scenario = steps == 1 ? "prefill" : decode ? "decode" : "chunked";
    if (!opt_.precision.empty()) mf.extra["precision"] = PrecisionProfile::parse(opt_.precision).json();
  }

  const Mapping& m_;
  const ModelConfig& cfg_;
  const ImportOptions& opt_;
  MemoryDump& out_;
  std::vector<Pattern> patterns_;
  std::vector<std::unique_ptr<ForeignTensors>> inputs_;
  std::vector<std::vector<int64_t>> tokens_;
  std::vector<bool> matched_;
  std::set<std::pair<const ForeignTensors*, std::string>> used_;
  std::map<std::string, std::string> made_by_;
  std::map<int, int64_t> step_rows_;  // forward call -> R, for tensors of the last R rows only
  std::vector<std::string> skipped_;
  bool by_capture_ = false;
};

}  // namespace

ImportSummary import_tensors(const std::vector<std::string>& inputs, const Mapping& mapping, const ModelConfig& model,
                             const ImportOptions& opt, MemoryDump& out) {
  Importer imp(mapping, model, opt, out);
  return imp.run(inputs);
}

}  // namespace llmdiff::import
