#include "compare/compare.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include "dumps/config.h"
#include "dumps/errors.h"

namespace llmdiff::compare {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<float> as_float(const TensorData& t) {
  if (!t.is_int) return t.f;
  std::vector<float> out(t.i.size());
  for (size_t k = 0; k < t.i.size(); ++k) out[k] = float(t.i[k]);
  return out;
}

std::string nonfinite_words(const NonFiniteCounts& c, const Shape& shape) {
  std::string s;
  if (c.nan) s += std::to_string(c.nan) + " NaN (first at " + index_str(unravel(c.first_nan, shape)) + ")";
  if (c.pos_inf) s += std::string(s.empty() ? "" : ", ") + std::to_string(c.pos_inf) + " +Inf";
  if (c.neg_inf) s += std::string(s.empty() ? "" : ", ") + std::to_string(c.neg_inf) + " -Inf";
  return s;
}

bool is_logits_site(const CanonName& c) {
  return (c.kind == CanonName::Kind::Step) && (c.site == "logits" || c.site == "next_logits");
}
}  // namespace

Judgement AllcloseCriterion::judge(const TensorData&, const TensorData&, const TensorComparison& cmp) const {
  Judgement j;
  j.pass = cmp.allclose.pass();
  j.metric = "allclose ratio";
  j.value = cmp.allclose.worst_ratio;
  j.threshold = 1.0;
  return j;
}

double TensorComparison::max_abs() const {
  if (!shape_match) return kInf;
  if (is_int) return ints.mismatches ? kInf : 0.0;
  return metrics.nonfinite_mismatch ? kInf : metrics.max_abs;
}

double TensorComparison::nmse() const {
  if (!shape_match) return kInf;
  if (is_int) return ints.mismatches ? kInf : 0.0;
  return metrics.nonfinite_mismatch ? kInf : metrics.nmse;
}

std::string LayerTrace::label() const {
  switch (part) {
    case Part::Pre: return "embed";
    case Part::Layer: return "layer " + std::to_string(layer);
    case Part::Post: return "head";
  }
  return "?";
}

size_t DiffResult::failing() const {
  size_t n = 0;
  for (const auto& t : tensors)
    if (!t.pass) ++n;
  return n;
}

const TensorComparison* DiffResult::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

TensorComparison compare_tensors(const TensorData& ref, const TensorData& cand, const PairContext& ctx) {
  static const AllcloseCriterion kAllclose;
  const Criterion& criterion = ctx.criterion ? *ctx.criterion : kAllclose;
  TensorComparison c;
  c.name = ref.name.empty() ? cand.name : ref.name;
  c.parsed = parse_name(c.name);
  c.ref_shape = ref.shape;
  c.cand_shape = cand.shape;
  c.ref_stored = ref.stored;
  c.cand_stored = cand.stored;
  c.tolerance = ctx.tolerance;
  c.tolerance_source = ctx.tolerance_source;
  c.is_int = ref.is_int && cand.is_int;
  if (ref.is_int != cand.is_int)
    c.notes.push_back(std::string("reference stores ") + dtype_name(ref.stored) + ", candidate stores " +
                      dtype_name(cand.stored) + "; compared as floats");

  if (ref.shape != cand.shape) {
    c.shape_match = false;
    c.pass = false;
    c.judgement.pass = false;
    c.judgement.metric = "shape";
    c.judgement.value = kInf;
    c.judgement.threshold = 0;
    c.notes.push_back("shape " + shape_str(cand.shape) + " where the reference has " + shape_str(ref.shape));
    if (ctx.explain_layouts) {
      c.findings = explain_shape_mismatch(c.name, ref, cand, ctx.tolerance, ctx.dtype, ctx.layout);
      if (c.findings.empty()) c.notes.push_back("no layout of the candidate explains the shape");
    }
    return c;
  }

  if (c.is_int) {
    c.ints = int_metrics(ref.i.data(), cand.i.data(), ref.numel());
    c.pass = c.ints.mismatches == 0;
    c.judgement.pass = c.pass;
    c.judgement.metric = "mismatches";
    c.judgement.value = double(c.ints.mismatches);
    c.judgement.threshold = 0;
    if (!c.pass)
      c.notes.push_back(std::to_string(c.ints.mismatches) + " of " + std::to_string(c.ints.count) +
                        " values differ; first at " + index_str(unravel(c.ints.first_mismatch, ref.shape)) + ": " +
                        std::to_string(c.ints.cand_value) + " where the reference has " +
                        std::to_string(c.ints.ref_value));
    return c;
  }

  std::vector<float> rf = as_float(ref), cf = as_float(cand);
  const int64_t n = ref.numel();
  c.metrics = float_metrics(rf.data(), cf.data(), n, ctx.dtype);
  c.allclose = allclose(rf.data(), cf.data(), n, ctx.tolerance);
  if (is_logits_site(c.parsed) && !ref.shape.empty()) {
    int64_t cols = ref.shape.back();
    c.logits = logits_metrics(rf.data(), cf.data(), cols > 0 ? n / cols : 0, cols);
  }
  if (c.metrics.cand_nonfinite.total())
    c.notes.push_back("candidate has " + nonfinite_words(c.metrics.cand_nonfinite, ref.shape));
  if (c.metrics.ref_nonfinite.total())
    c.notes.push_back("reference has " + nonfinite_words(c.metrics.ref_nonfinite, ref.shape));
  if (c.metrics.nonfinite_mismatch)
    c.notes.push_back(std::to_string(c.metrics.nonfinite_mismatch) + " positions are non-finite on one side only (first at " +
                      index_str(unravel(c.metrics.first_nonfinite_mismatch, ref.shape)) + ")");

  // The criterion sees the raw values as floats.
  TensorData rview, cview;
  const TensorData* rp = &ref;
  const TensorData* cp = &cand;
  if (ref.is_int) {
    rview = ref;
    rview.is_int = false;
    rview.f = rf;
    rp = &rview;
  }
  if (cand.is_int) {
    cview = cand;
    cview.is_int = false;
    cview.f = cf;
    cp = &cview;
  }
  c.judgement = criterion.judge(*rp, *cp, c);
  c.pass = !c.judgement.judged || c.judgement.pass;
  if (!c.judgement.note.empty()) c.notes.push_back(c.judgement.note);
  if (!c.allclose.pass() && ctx.explain_layouts)
    c.findings = explain_value_mismatch(c.name, *rp, *cp, ctx.tolerance, ctx.dtype, ctx.layout);
  return c;
}

ComputeDType diff_dtype(const TensorSource& ref, const TensorSource& cand, const CompareOptions& opt,
                        std::string* source) {
  if (opt.dtype) {
    if (source) *source = "--dtype";
    return *opt.dtype;
  }
  auto a = manifest_dtype(ref.manifest()), b = manifest_dtype(cand.manifest());
  if (source) *source = (a || b) ? "manifests" : "default (no manifest dtype)";
  if (a && b) return coarser_dtype(*a, *b);
  if (a) return *a;
  if (b) return *b;
  return ComputeDType::Float32;
}

std::vector<LayerTrace> build_layer_trace(const std::vector<TensorComparison>& tensors) {
  using Key = std::tuple<int, int, int>;  // step, part, layer
  std::map<Key, LayerTrace> groups;
  const auto& before = step_sites_before_layers();
  for (const auto& t : tensors) {
    const CanonName& c = t.parsed;
    LayerTrace::Part part;
    if (c.kind == CanonName::Kind::Layer)
      part = LayerTrace::Part::Layer;
    else if (c.kind == CanonName::Kind::Step)
      part = std::find(before.begin(), before.end(), c.site) != before.end() ? LayerTrace::Part::Pre
                                                                              : LayerTrace::Part::Post;
    else
      continue;
    int layer = part == LayerTrace::Part::Layer ? c.layer : -1;
    LayerTrace& g = groups[Key{c.step, int(part), layer}];
    if (g.compared == 0) {
      g.step = c.step;
      g.part = part;
      g.layer = layer;
      g.key_site = part == LayerTrace::Part::Pre ? "embed" : part == LayerTrace::Part::Layer ? "out" : "logits";
    }
    ++g.compared;
    if (!t.pass) ++g.failing;
    if (!t.shape_match) continue;  // counted as failing; no error size to trace
    double nmse = t.nmse(), mabs = t.max_abs();
    std::string site = c.site;
    if (g.worst_nmse_site.empty() || nmse > g.worst_nmse) {
      g.worst_nmse = nmse;
      g.worst_nmse_site = site;
    }
    if (g.worst_max_abs_site.empty() || mabs > g.worst_max_abs) {
      g.worst_max_abs = mabs;
      g.worst_max_abs_site = site;
    }
    bool key = site == g.key_site || (part == LayerTrace::Part::Post && site == "next_logits" && !g.has_key);
    if (key) {
      if (site == "next_logits") g.key_site = "next_logits";
      if (site == "logits") g.key_site = "logits";
      g.has_key = true;
      g.key_nmse = nmse;
      g.key_max_abs = mabs;
    }
  }
  std::vector<LayerTrace> out;
  out.reserve(groups.size());
  for (auto& kv : groups) out.push_back(std::move(kv.second));
  return out;
}

GreedyAgreement greedy_agreement(const TensorSource& ref, const TensorSource& cand) {
  GreedyAgreement g;
  int steps = std::max(ref.num_steps(), cand.num_steps());
  for (int s = 0; s < steps; ++s) {
    std::string name = step_name(s, "next_logits");
    if (!ref.has(name) || !cand.has(name)) continue;
    TensorData a = ref.get(name), b = cand.get(name);
    if (a.is_int || b.is_int) continue;
    StepTokens st;
    st.step = s;
    st.ref_token = argmax(a.f.data(), a.numel());
    st.cand_token = argmax(b.f.data(), b.numel());
    if (st.ref_token != st.cand_token && g.first_divergent_step < 0) g.first_divergent_step = s;
    g.steps.push_back(st);
  }
  if (ref.has("generated") && cand.has("generated")) {
    TensorData a = ref.get("generated"), b = cand.get("generated");
    if (a.is_int && b.is_int) {
      g.has_generated = true;
      g.ref_generated = a.i;
      g.cand_generated = b.i;
      size_t n = std::min(a.i.size(), b.i.size());
      for (size_t k = 0; k < n && g.first_generated_mismatch < 0; ++k)
        if (a.i[k] != b.i[k]) g.first_generated_mismatch = int(k);
      if (g.first_generated_mismatch < 0 && a.i.size() != b.i.size()) g.first_generated_mismatch = int(n);
    }
  }
  return g;
}

namespace {
SideSummary summarize(const TensorSource& s) {
  SideSummary out;
  out.label = s.label();
  out.manifest = s.manifest();
  out.steps = s.num_steps();
  out.tensors = s.names().size();
  return out;
}

// Remarks on manifests that do not describe the same model or run.
void manifest_notes(const TensorSource& ref, const TensorSource& cand, DiffResult& r) {
  const Manifest &a = ref.manifest(), &b = cand.manifest();
  if (!a.model.empty() && !b.model.empty() && a.model != b.model)
    r.notes.push_back("models differ: reference '" + a.model + "', candidate '" + b.model + "'");
  if (!a.scenario.empty() && !b.scenario.empty() && a.scenario != b.scenario)
    r.notes.push_back("scenarios differ: reference '" + a.scenario + "', candidate '" + b.scenario + "'");
  if (!a.dtype.empty() && !b.dtype.empty() && a.dtype != b.dtype)
    r.notes.push_back("compute dtypes differ: reference " + a.dtype + ", candidate " + b.dtype + "; tolerances of " +
                      compute_dtype_name(r.dtype));
  if (a.config.empty() || b.config.empty()) return;
  try {
    ModelConfig ca = parse_config(a.config, "reference manifest config");
    ModelConfig cb = parse_config(b.config, "candidate manifest config");
    auto check = [&](const char* field, double x, double y) {
      if (x != y) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "configs differ: %s %.9g (reference) vs %.9g (candidate)", field, x, y);
        r.notes.push_back(buf);
      }
    };
    check("hidden_size", double(ca.hidden_size), double(cb.hidden_size));
    check("intermediate_size", double(ca.intermediate_size), double(cb.intermediate_size));
    check("num_hidden_layers", double(ca.num_hidden_layers), double(cb.num_hidden_layers));
    check("num_attention_heads", double(ca.num_attention_heads), double(cb.num_attention_heads));
    check("num_key_value_heads", double(ca.num_key_value_heads), double(cb.num_key_value_heads));
    check("head_dim", double(ca.head_dim), double(cb.head_dim));
    check("vocab_size", double(ca.vocab_size), double(cb.vocab_size));
    check("rms_norm_eps", ca.rms_norm_eps, cb.rms_norm_eps);
    check("rope_theta", ca.rope_theta, cb.rope_theta);
    if (ca.rope_scaling.type != cb.rope_scaling.type)
      r.notes.push_back(std::string("configs differ: rope_scaling ") + rope_type_name(ca.rope_scaling.type) +
                        " (reference) vs " + rope_type_name(cb.rope_scaling.type) + " (candidate)");
  } catch (const Error&) {
    // A config that does not parse is not a reason to refuse the diff.
  }
}
}  // namespace

DiffResult compare_dumps(const TensorSource& ref, const TensorSource& cand, const CompareOptions& opt) {
  DiffResult r;
  r.ref = summarize(ref);
  r.cand = summarize(cand);
  r.dtype = diff_dtype(ref, cand, opt, &r.dtype_source);
  TolerancePolicy policy(r.dtype, opt.rtol, opt.atol, opt.overrides);
  r.base_tolerance = policy.base();
  r.overrides = opt.overrides;
  r.sites = opt.sites;
  std::shared_ptr<const Criterion> criterion = opt.criterion;
  if (!criterion) criterion = std::make_shared<AllcloseCriterion>();
  r.criterion = criterion->name();
  manifest_notes(ref, cand, r);

  PairContext pc;
  pc.dtype = r.dtype;
  pc.layout = layout_context(ref.manifest(), cand.manifest());
  pc.criterion = criterion.get();
  pc.explain_layouts = opt.explain_layouts;

  std::vector<std::string> names = ref.names();
  {
    std::vector<std::string> b = cand.names();
    std::set<std::string> seen(names.begin(), names.end());
    for (auto& n : b)
      if (!seen.count(n)) names.push_back(n);
  }
  sort_canonical(names);
  for (const auto& name : names) {
    if (!opt.sites.empty() && !any_site_glob_match(opt.sites, name)) continue;
    bool in_ref = ref.has(name), in_cand = cand.has(name);
    if (!in_cand) {
      r.only_in_ref.push_back(name);
      continue;
    }
    if (!in_ref) {
      r.only_in_cand.push_back(name);
      continue;
    }
    pc.tolerance = policy.resolve(name, &pc.tolerance_source);
    TensorData a = ref.get(name), b = cand.get(name);
    a.name = b.name = name;
    r.tensors.push_back(compare_tensors(a, b, pc));
  }
  for (size_t k = 0; k < r.tensors.size(); ++k)
    if (!r.tensors[k].pass) {
      r.first_divergence = k;
      break;
    }
  if (r.tensors.empty()) r.notes.push_back("the dumps have no name in common (after the --sites filter)");
  r.layer_trace = build_layer_trace(r.tensors);
  r.greedy = greedy_agreement(ref, cand);
  return r;
}

}  // namespace llmdiff::compare
