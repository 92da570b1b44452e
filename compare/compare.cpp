#include "compare/compare.h"
#include "dumps/contract/rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <set>
#include <tuple>
#include <typeinfo>

#include "compare/parallel.h"
#include "dumps/model/config.h"
#include "dumps/base/errors.h"

namespace llmdiff::compare {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

std::string nonfinite_words(const NonFiniteCounts& c, const Shape& shape) {
  std::string s;
  if (c.nan) s += std::to_string(c.nan) + " NaN (first at " + index_str(unravel(c.first_nan, shape)) + ")";
  if (c.pos_inf) s += std::string(s.empty() ? "" : ", ") + std::to_string(c.pos_inf) + " +Inf";
  if (c.neg_inf) s += std::string(s.empty() ? "" : ", ") + std::to_string(c.neg_inf) + " -Inf";
  return s;
}

namespace {

bool is_logits_site(const CanonName& c) {
  return (c.kind == CanonName::Kind::Step) && (c.site == "logits" || c.site == "next_logits");
}

Judgement allclose_judgement(const TensorComparison& cmp) {
  Judgement j;
  j.pass = cmp.allclose.pass();
  j.metric = "allclose ratio";
  j.value = cmp.allclose.worst_ratio;
  j.threshold = 1.0;
  return j;
}
}  // namespace

Judgement AllcloseCriterion::judge(const TensorData&, const TensorData&, const TensorComparison& cmp) const {
  return allclose_judgement(cmp);
}

std::string ScaledMaxCriterion::name() const {
  char buf[96];
  std::snprintf(buf, sizeof buf, "scaled-max (max|a-b| <= %g x max(1, max|reference|))", scale_);
  return buf;
}

Judgement ScaledMaxCriterion::judge(const TensorData&, const TensorData&, const TensorComparison& cmp) const {
  Judgement j;
  j.metric = "max|a-b| / max(1, max|ref|)";
  j.value = cmp.metrics.nonfinite_mismatch ? kInf : cmp.metrics.max_abs / std::max(1.0, cmp.metrics.ref_max_abs);
  j.threshold = scale_;
  j.pass = j.value <= scale_;
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

namespace {
// The fields every comparison starts with.
TensorComparison start_comparison(const std::string& name, const Shape& ref_shape, const Shape& cand_shape,
                                  DType ref_stored, DType cand_stored, bool ref_int, bool cand_int,
                                  const PairContext& ctx) {
  TensorComparison c;
  c.name = name;
  c.parsed = parse_name(c.name);
  c.ref_shape = ref_shape;
  c.cand_shape = cand_shape;
  c.ref_stored = ref_stored;
  c.cand_stored = cand_stored;
  c.tolerance = ctx.tolerance;
  c.tolerance_source = ctx.tolerance_source;
  c.is_int = ref_int && cand_int;
  if (ref_int != cand_int)
    c.notes.push_back(std::string("reference stores ") + dtype_name(ref_stored) + ", candidate stores " +
                      dtype_name(cand_stored) + "; compared as floats");
  return c;
}

// Metrics, allclose, logits metrics and non-finite notes of a float pair of equal shapes.
void measure_floats(TensorComparison& c, const float* rf, const float* cf, const Shape& shape, const PairContext& ctx) {
  const int64_t n = numel(shape);
  PairMetrics pm = pair_metrics(rf, cf, n, ctx.dtype, ctx.tolerance, ctx.pool);
  c.metrics = pm.metrics;
  c.allclose = pm.allclose;
  if (is_logits_site(c.parsed) && !shape.empty()) {
    int64_t cols = shape.back();
    c.logits = logits_metrics(rf, cf, cols > 0 ? n / cols : 0, cols, ctx.pool);
  }
  if (c.metrics.cand_nonfinite.total())
    c.notes.push_back("candidate has " + nonfinite_words(c.metrics.cand_nonfinite, shape));
  if (c.metrics.ref_nonfinite.total())
    c.notes.push_back("reference has " + nonfinite_words(c.metrics.ref_nonfinite, shape));
  if (c.metrics.nonfinite_mismatch)
    c.notes.push_back(std::to_string(c.metrics.nonfinite_mismatch) + " positions are non-finite on one side only (first at " +
                      index_str(unravel(c.metrics.first_nonfinite_mismatch, shape)) + ")");
}

// The verdict from the criterion's judgement, then layout findings for a
// pair outside tolerance.
void conclude_floats(TensorComparison& c, Judgement j, const float* rf, const float* cf, const Shape& shape,
                     const PairContext& ctx) {
  c.judgement = std::move(j);
  c.pass = !c.judgement.judged || c.judgement.pass;
  if (!c.judgement.note.empty()) c.notes.push_back(c.judgement.note);
  if (!c.allclose.pass() && ctx.explain_layouts)
    c.findings = explain_value_mismatch(c.name, rf, cf, shape, ctx.tolerance, ctx.dtype, ctx.layout, ctx.pool);
}

// Float32 values a source holds in place (no copy): a MemoryDump's tensor or
// the F32 bytes of a DumpFile; null data otherwise (integers, other dtypes).
struct InPlace {
  const float* data = nullptr;
  Shape shape;
  DType stored = DType::F32;
};
InPlace in_place(const TensorSource& src, const std::string& name) {
  InPlace v;
  if (const auto* mem = dynamic_cast<const MemoryDump*>(&src)) {
    const TensorData* t = mem->find(name);
    if (t && !t->is_int && int64_t(t->f.size()) == t->numel()) {
      v.data = t->f.data();
      v.shape = t->shape;
      v.stored = t->stored;
    }
  } else if (const auto* file = dynamic_cast<const DumpFile*>(&src)) {
    const TensorInfo* info = file->file().find(name);
    if (info && info->dtype == DType::F32) {
      const void* p = file->file().data(*info);
      if (reinterpret_cast<uintptr_t>(p) % alignof(float) == 0) {
        v.data = static_cast<const float*>(p);
        v.shape = info->shape;
      }
    }
  }
  return v;
}
}  // namespace

TensorComparison compare_tensors(const TensorData& ref_whole, const TensorData& cand, const PairContext& ctx) {
  // A candidate holding some of the step's token rows (dumps/contract/rows.h) is
  // compared on those rows of the reference.
  TensorData ref_rows;
  if (!cand.rows.empty() && ref_whole.shape != cand.shape) ref_rows = rows_like(ref_whole, cand);
  const TensorData& ref = ref_rows.shape.empty() ? ref_whole : ref_rows;
  static const AllcloseCriterion kAllclose;
  const Criterion& criterion = ctx.criterion ? *ctx.criterion : kAllclose;
  TensorComparison c = start_comparison(ref.name.empty() ? cand.name : ref.name, ref.shape, cand.shape, ref.stored,
                                        cand.stored, ref.is_int, cand.is_int, ctx);
  if (&ref == &ref_rows && ref.shape == cand.shape) {
    std::string list;
    for (size_t k = 0; k < cand.rows.size() && k < 8; ++k) list += (k ? ", " : "") + std::to_string(cand.rows[k]);
    if (cand.rows.size() > 8) list += ", ...";
    c.notes.push_back("compared on the " + std::to_string(cand.rows.size()) + " token rows the candidate holds (" +
                      list + ")");
  }

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
    if (!c.pass) {
      if (std::optional<Judgement> j = criterion.judge_ints(ref, cand, c)) {
        c.judgement = *j;
        c.pass = j->pass;
        if (!j->note.empty()) c.notes.push_back(j->note);
      }
    }
    return c;
  }

  // The criterion sees the raw values as floats: an integer side is widened
  // into a float copy, a float side is used as it is.
  TensorData rview, cview;
  const TensorData* rp = &ref;
  const TensorData* cp = &cand;
  if (ref.is_int) {
    rview = ref;
    rview.is_int = false;
    rview.f = ref.floats();
    rp = &rview;
  }
  if (cand.is_int) {
    cview = cand;
    cview.is_int = false;
    cview.f = cand.floats();
    cp = &cview;
  }
  measure_floats(c, rp->f.data(), cp->f.data(), ref.shape, ctx);
  conclude_floats(c, criterion.judge(*rp, *cp, c), rp->f.data(), cp->f.data(), ref.shape, ctx);
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

namespace {
// greedy_agreement over steps 0 .. steps-1.
GreedyAgreement greedy_over_steps(const TensorSource& ref, const TensorSource& cand, int steps) {
  GreedyAgreement g;
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
}  // namespace

GreedyAgreement greedy_agreement(const TensorSource& ref, const TensorSource& cand) {
  return greedy_over_steps(ref, cand, std::max(ref.num_steps(), cand.num_steps()));
}

namespace {
// TensorSource::num_steps() of a source whose names() are `names` (listing
// and ordering the names of a large dump is not free, so it is done once).
int num_steps(const TensorSource& s, const std::vector<std::string>& names) {
  int steps = 0;
  for (const auto& n : names) {
    const int step = parse_name(n).step;
    if (step >= 0) steps = std::max(steps, step + 1);
  }
  return std::max(steps, s.manifest().steps);
}

SideSummary summarize(const TensorSource& s, const std::vector<std::string>& names) {
  SideSummary out;
  out.label = s.label();
  out.manifest = s.manifest();
  out.steps = num_steps(s, names);
  out.tensors = names.size();
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
  const std::vector<std::string> ref_names = ref.names(), cand_names = cand.names();
  r.ref = summarize(ref, ref_names);
  r.cand = summarize(cand, cand_names);
  r.dtype = diff_dtype(ref, cand, opt, &r.dtype_source);
  TolerancePolicy policy(r.dtype, opt.rtol, opt.atol, opt.overrides);
  r.base_tolerance = policy.base();
  r.overrides = opt.overrides;
  r.sites = opt.sites;
  std::shared_ptr<const Criterion> criterion = opt.criterion;
  if (!criterion) criterion = std::make_shared<AllcloseCriterion>();
  r.criterion = criterion->name();
  const bool plain_allclose = typeid(*criterion) == typeid(AllcloseCriterion);
  manifest_notes(ref, cand, r);

  ThreadPool pool(opt.threads);
  PairContext pc;
  pc.pool = &pool;
  pc.dtype = r.dtype;
  pc.layout = layout_context(ref.manifest(), cand.manifest());
  pc.criterion = criterion.get();
  pc.explain_layouts = opt.explain_layouts;

  // Both lists come in canonical order; the union needs sorting only when
  // the candidate adds names.
  std::vector<std::string> names = ref_names;
  if (cand_names != ref_names) {
    std::set<std::string> seen(names.begin(), names.end());
    for (auto& n : cand_names)
      if (!seen.count(n)) names.push_back(n);
  }
  if (!std::is_sorted(names.begin(), names.end(), NameOrder{})) sort_canonical(names);

  // Pairs of float32 tensors of equal shapes that both sources hold in place
  // are compared there, without copies, when the criterion is plain allclose
  // (which reads nothing beyond the metrics): pairs below kSplitNumel
  // elements several at a time over the pool, larger ones one after the other
  // with their passes spread over the pool. Everything else (integers, other
  // stored dtypes, shape mismatches, other criteria) is compared on copies by
  // compare_tensors, one pair at a time. Each pair's result lands in its
  // canonical slot, so the order of work never shows.
  constexpr int64_t kSplitNumel = int64_t(1) << 20;
  struct Job {
    std::string name;
    PairContext ctx;
    InPlace x, y;  // set: compared in place
    int64_t cost = 0;
  };
  std::vector<Job> jobs;
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
    Job job;
    job.name = name;
    job.ctx = pc;
    job.ctx.tolerance = policy.resolve(name, &job.ctx.tolerance_source);
    if (plain_allclose) {
      InPlace x = in_place(ref, name), y = in_place(cand, name);
      if (x.data && y.data && x.shape == y.shape) {
        job.x = std::move(x);
        job.y = std::move(y);
        // Logits rows cost a softmax per element on top of the metric pass.
        job.cost = numel(job.x.shape) * (is_logits_site(parse_name(name)) ? 16 : 1);
      }
    }
    jobs.push_back(std::move(job));
  }
  auto in_place_comparison = [](const Job& j) {
    TensorComparison c = start_comparison(j.name, j.x.shape, j.y.shape, j.x.stored, j.y.stored, false, false, j.ctx);
    measure_floats(c, j.x.data, j.y.data, j.x.shape, j.ctx);
    conclude_floats(c, allclose_judgement(c), j.x.data, j.y.data, j.x.shape, j.ctx);
    return c;
  };
  r.tensors.resize(jobs.size());
  std::vector<size_t> small;  // in-place pairs below kSplitNumel, costliest first
  for (size_t k = 0; k < jobs.size(); ++k)
    if (jobs[k].x.data && numel(jobs[k].x.shape) < kSplitNumel) small.push_back(k);
  std::stable_sort(small.begin(), small.end(), [&](size_t a, size_t b) { return jobs[a].cost > jobs[b].cost; });
  pool.parallel_for(int64_t(small.size()), [&](int64_t t) {
    Job& j = jobs[small[size_t(t)]];
    j.ctx.pool = nullptr;  // the pool already runs this pair
    r.tensors[small[size_t(t)]] = in_place_comparison(j);
  });
  for (size_t k = 0; k < jobs.size(); ++k) {
    const Job& j = jobs[k];
    if (j.x.data && numel(j.x.shape) >= kSplitNumel) r.tensors[k] = in_place_comparison(j);
  }
  // The rest on copies (a criterion such as the noise floor reads a third
  // and fourth run too): several pairs at a time over the pool, each pair on
  // one thread, the largest first. Every source is read through const,
  // thread-safe get().
  std::vector<std::pair<int64_t, size_t>> copied;  // (elements, job)
  for (size_t k = 0; k < jobs.size(); ++k) {
    if (jobs[k].x.data) continue;
    int64_t n = 0;
    try {
      n = numel(cand.shape(jobs[k].name));
    } catch (const Error&) {
    }
    copied.emplace_back(n, k);
  }
  std::stable_sort(copied.begin(), copied.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  auto on_copies = [&](size_t k) {
    const Job& j = jobs[k];
    TensorData a = ref.get(j.name), b = cand.get(j.name);
    a.name = b.name = j.name;
    r.tensors[k] = compare_tensors(a, b, j.ctx);
  };
  if (copied.size() == 1) {
    on_copies(copied[0].second);  // its passes spread over the pool
  } else {
    pool.parallel_for(int64_t(copied.size()), [&](int64_t t) {
      const size_t k = copied[size_t(t)].second;
      jobs[k].ctx.pool = nullptr;  // the pool already runs this pair
      on_copies(k);
    });
  }
  for (size_t k = 0; k < r.tensors.size(); ++k)
    if (!r.tensors[k].pass) {
      r.first_divergence = k;
      break;
    }
  // The heatmap: the first divergence, or the first diverging name whose
  // shapes agree when it is a shape mismatch.
  for (const TensorComparison& t : r.tensors)
    if (!t.pass && t.shape_match && (r.heatmap = error_heatmap(t.name, ref, cand))) break;
  if (r.tensors.empty()) r.notes.push_back("the dumps have no name in common (after the --sites filter)");
  r.layer_trace = build_layer_trace(r.tensors);
  r.greedy = greedy_over_steps(ref, cand, std::max(r.ref.steps, r.cand.steps));
  return r;
}

}  // namespace llmdiff::compare
