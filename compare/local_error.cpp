#include "compare/local_error.h"
#include "compare/parallel.h"
#include "dumps/contract/rows.h"
#include "dumps/contract/sites.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <map>

#include "compare/tolerance.h"
#include "dumps/base/dtype.h"
#include "dumps/base/errors.h"

namespace llmdiff::compare {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

namespace {

// A tensor of a source without a copy where the source holds it in memory (a
// MemoryDump, or a SubsetSource of one); read (a copy) otherwise. A 1B model's
// dumps are a GB each: judging every site would otherwise copy them eight times.
class Borrowed {
 public:
  Borrowed(const TensorSource& src, const std::string& name) {
    const TensorSource* s = &src;
    while (auto* sub = dynamic_cast<const SubsetSource*>(s)) {
      if (!sub->has(name)) break;
      s = &sub->base();
    }
    if (auto* mem = dynamic_cast<const MemoryDump*>(s)) p_ = mem->find(name);
    if (p_ && src.has(rows_name_for(name))) {  // a row subset: its rows attached, as get() does
      own_ = *p_;
      attach_rows(src, own_);
      p_ = &own_;
    }
    if (!p_) {
      own_ = src.get(name);
      p_ = &own_;
    }
  }
  const TensorData& operator*() const { return *p_; }
  const TensorData* operator->() const { return p_; }
  // Its values as floats: the stored vector itself for a float tensor.
  const std::vector<float>& floats() {
    if (!p_->is_int) return p_->f;
    converted_ = p_->floats();
    return converted_;
  }
  // Only the token rows `part` holds (dumps/contract/rows.h), when it holds some.
  void restrict_to_rows_of(const TensorData& part) {
    if (part.rows.empty() || p_->shape == part.shape) return;
    own_ = rows_like(*p_, part);
    p_ = &own_;
  }

 private:
  TensorData own_;
  const TensorData* p_ = nullptr;
  std::vector<float> converted_;
};

}  // namespace

std::string value_str(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string Hypothesis::str() const { return value ? bug + "=" + value_str(*value) : bug; }

SubsetSource::SubsetSource(const TensorSource& base, const std::vector<std::string>& keep) : base_(base) {
  for (const auto& n : keep)
    if (base.has(n)) names_.push_back(n);
  sort_canonical(names_);
  index_.insert(names_.begin(), names_.end());
}

bool SubsetSource::has(const std::string& name) const { return index_.count(name) > 0; }

Shape SubsetSource::shape(const std::string& name) const {
  if (!has(name)) throw MissingTensorError(label(), name);
  return base_.shape(name);
}

TensorData SubsetSource::get(const std::string& name) const {
  if (!has(name)) throw MissingTensorError(label(), name);
  return base_.get(name);
}

size_t LocalReport::failing() const {
  size_t n = 0;
  for (const auto& s : sites)
    if (!s.pass) ++n;
  return n;
}

const LocalSite* LocalReport::find(const std::string& name) const {
  for (const auto& s : sites)
    if (s.name == name) return &s;
  return nullptr;
}

LocalNoise local_noise(const TensorSource& values, const Recomputed& local) {
  LocalNoise out;
  for (const auto& name : values.names()) {
    if (!local.values.has(name)) continue;
    Borrowed a(values, name), b(local.values, name);
    if (a->is_int || b->is_int || a->shape != b->shape) continue;
    int64_t bad = 0;
    const double e = rmse(a->f.data(), b->f.data(), a->numel(), &bad);
    if (bad == 0) out[name] = e;  // a non-finite honest run says nothing of the noise
  }
  return out;
}

void SecondNoise::need(const std::vector<std::string>& names) {
  if (!fill_) return;
  std::vector<std::string> ask;
  for (const auto& n : names)
    if (asked_.insert(n).second && !known_.count(n)) ask.push_back(n);
  if (ask.empty()) return;
  for (auto& [name, e] : fill_(ask)) known_.emplace(name, e);
}

RefOnDemand::RefOnDemand(Fill fill) : fill_(std::move(fill)) {}

void RefOnDemand::need(const std::vector<std::string>& names) {
  std::vector<std::string> ask;
  for (const auto& n : names)
    if (asked_.insert(n).second) ask.push_back(n);
  if (ask.empty()) return;
  made_.parts.push_back(fill_(ask));
  const MemoryDump& part = made_.parts.back()->values;
  for (const auto& n : ask)
    if (part.has(n)) made_.at[n] = &part;
}

std::vector<std::string> RefOnDemand::Made::names() const {
  std::vector<std::string> v;
  for (const auto& kv : at) v.push_back(kv.first);
  sort_canonical(v);
  return v;
}

Shape RefOnDemand::Made::shape(const std::string& name) const {
  auto it = at.find(name);
  if (it == at.end()) throw MissingTensorError(label_, name);
  return it->second->shape(name);
}

TensorData RefOnDemand::Made::get(const std::string& name) const {
  auto it = at.find(name);
  if (it == at.end()) throw MissingTensorError(label_, name);
  return it->second->get(name);
}

namespace {

// One site of judge_local (nullopt: the oracle did not recompute it). With
// `lazy`, a site whose reference values are not made yet is within the floor
// (passes) or `*wants_ref`.
std::optional<LocalSite> judge_site(const std::string& name, const TensorSource& cand, const Recomputed& cand_local,
                                    const TensorSource* ref, const Recomputed* ref_local, ComputeDType dtype,
                                    const LocalNoise* second, const RefOnDemand* lazy = nullptr,
                                    bool* wants_ref = nullptr) {
  if (!cand_local.values.has(name)) return std::nullopt;
  LocalSite s;
  s.name = name;
  s.parsed = parse_name(name);
  auto src = cand_local.source.find(name);
  if (src != cand_local.source.end()) s.source = src->second;
  Borrowed cb(cand, name), lb(cand_local.values, name);
  lb.restrict_to_rows_of(*cb);  // the recompute has every row; the candidate may hold some
  const TensorData &c = *cb, &l = *lb;
  s.cand_shape = c.shape;
  s.local_shape = l.shape;
  s.is_int = c.is_int && l.is_int;
  if (c.shape != l.shape) {
    s.shape_match = false;
    s.pass = false;
    s.max_abs = s.nmse = kInf;
    s.note = "shape " + shape_str(c.shape) + " where the recompute from its own inputs gives " + shape_str(l.shape);
    return s;
  }
  if (s.is_int) {
    for (size_t i = 0; i < c.i.size(); ++i)
      if (c.i[i] != l.i[i]) {
        if (s.int_mismatches == 0) {
          s.max_abs_at = int64_t(i);
          s.note = "value " + std::to_string(c.i[i]) + " at " + index_str(unravel(int64_t(i), c.shape)) +
                   " where the recompute gives " + std::to_string(l.i[i]);
        }
        ++s.int_mismatches;
      }
    s.pass = s.int_mismatches == 0;
    s.max_abs = s.nmse = s.pass ? 0.0 : kInf;
    return s;
  }
  const std::vector<float>& cf = cb.floats();
  const std::vector<float>& lf = lb.floats();
  diff_stats(cf.data(), lf.data(), int64_t(cf.size()), &s.max_abs, &s.max_abs_at, &s.nmse);
  int64_t bad = 0;
  const double cand_rmse = rmse(cf.data(), lf.data(), c.numel(), &bad);
  double ref_rmse = 0;
  int64_t ref_bad = 0;
  if (ref && ref_local && ref->has(name) && ref_local->values.has(name)) {
    Borrowed ab(*ref, name), bb(ref_local->values, name);
    ab.restrict_to_rows_of(c);
    bb.restrict_to_rows_of(c);
    if (ab->shape == c.shape && bb->shape == c.shape) {
      const std::vector<float>& af = ab.floats();
      const std::vector<float>& bf = bb.floats();
      ref_rmse = rmse(af.data(), bf.data(), ab->numel(), &ref_bad);
      s.has_ref_noise = true;
    }
  }
  s.noise = noise_stats(cand_rmse, ref_rmse, rms(lf.data(), l.numel()), dtype);
  if (bad > ref_bad) s.noise.finite = false;
  if (!s.has_ref_noise && lazy && lazy->missing(name)) {
    if (bad == 0 && s.noise.pass()) {  // within m x 0 + floor
      s.within_floor = true;
      s.pass = true;
    } else {
      s.pass = false;
      if (wants_ref) *wants_ref = true;
    }
    return s;
  }
  if (second && s.has_ref_noise) {
    auto it = second->find(name);
    if (it != second->end()) s.noise.second_rmse = it->second;
  }
  if (s.has_ref_noise) {
    s.pass = s.noise.pass();
    if (!s.pass) s.note = "local " + s.noise.str();
    // A KV cache stored at a lower precision than computed (llama.cpp's
    // default F16 cache) is a deliberate rounding, not a wrong copy: it
    // passes, said so.
    const std::optional<Site> site = find_site(s.parsed.site);
    if (!s.pass && s.noise.finite && site && is_kv_cache(*site)) {
      if (const std::optional<ComputeDType> grid = rounded_grid(cf.data(), lf.data(), int64_t(cf.size()))) {
        s.pass = true;
        s.stored_as = grid;
        s.note = std::string("stored as ") + compute_dtype_name(*grid) +
                 ": every value is the recompute rounded to " + compute_dtype_name(*grid) +
                 " (a lower-precision cache, not a copy error; local " + s.noise.str() + ")";
      }
    }
  } else {
    s.pass = s.noise.finite;
    s.note = "no reference noise level for this site: not judged by the noise floor (local rmse " +
             value_str(cand_rmse) + ")";
  }
  return s;
}

}  // namespace

LocalReport judge_local(const TensorSource& cand, const Recomputed& cand_local, const TensorSource* ref,
                        const Recomputed* ref_local, ComputeDType dtype, const std::vector<std::string>& sites,
                        SecondNoise* second, RefOnDemand* lazy, int threads) {
  LocalReport r;
  r.ran = true;
  r.dtype = dtype;
  const LocalNoise* known = second ? &second->known() : nullptr;
  if (lazy) ref = &lazy->values();
  // Sites are judged several at a time (each reads its own tensors through
  // const get()); the report keeps the canonical order.
  ThreadPool pool(threads);
  std::vector<std::string> names;
  for (const auto& name : cand.names())
    if (sites.empty() || any_site_glob_match(sites, name)) names.push_back(name);
  std::vector<std::optional<LocalSite>> judged(names.size());
  std::vector<char> wants(names.size(), 0);
  pool.parallel_for(int64_t(names.size()), [&](int64_t k) {
    bool w = false;
    judged[size_t(k)] = judge_site(names[size_t(k)], cand, cand_local, ref, ref_local, dtype, known, lazy, &w);
    wants[size_t(k)] = w;
  });
  std::vector<size_t> wanting;  // sites waiting for the reference's values (lazy)
  for (size_t k = 0; k < names.size(); ++k) {
    if (wants[k]) wanting.push_back(r.sites.size());
    if (judged[k])
      r.sites.push_back(std::move(*judged[k]));
    else
      r.not_recomputed.push_back(names[k]);
  }
  // The reference's values where the local error exceeds the floor alone,
  // made now, and those sites judged again.
  if (lazy && !wanting.empty()) {
    std::vector<std::string> asked;
    for (size_t k : wanting) asked.push_back(r.sites[k].name);
    lazy->need(asked);
    pool.parallel_for(int64_t(wanting.size()), [&](int64_t t) {
      const size_t k = wanting[size_t(t)];
      r.sites[k] = *judge_site(r.sites[k].name, cand, cand_local, ref, ref_local, dtype, known);
    });
  }
  // The sites that fail on the reference's noise alone, judged again with
  // the second run's (made for them now).
  if (second) {
    std::vector<size_t> again;
    std::vector<std::string> names;
    for (size_t k = 0; k < r.sites.size(); ++k)
      if (!r.sites[k].pass && r.sites[k].has_ref_noise && second->missing(r.sites[k].name)) {
        again.push_back(k);
        names.push_back(r.sites[k].name);
      }
    second->need(names);
    for (size_t k : again)
      if (second->known().count(r.sites[k].name))
        r.sites[k] = *judge_site(r.sites[k].name, cand, cand_local, ref, ref_local, dtype, &second->known());
  }
  for (size_t k = 0; k < r.sites.size(); ++k)
    if (!r.sites[k].pass) {
      r.first_failure = k;
      break;
    }
  return r;
}

std::unique_ptr<Recomputed> recompute_reference(const LocalOracle& oracle, const TensorSource& cand,
                                                const TensorSource& ref) {
  SubsetSource subset(ref, cand.names());
  return oracle.recompute(subset, ComputeDType::Float64);
}

LocalReport analyse_local(const LocalOracle& oracle, const TensorSource& cand, const TensorSource* ref,
                          ComputeDType dtype, const std::vector<std::string>& sites, const Hypothesis* h,
                          const Recomputed* ref_local, SecondNoise* second, RefOnDemand* lazy) {
  std::unique_ptr<Recomputed> own_ref_local;
  if (ref && !ref_local && !lazy) {
    own_ref_local = recompute_reference(oracle, cand, *ref);
    ref_local = own_ref_local.get();
  }
  std::unique_ptr<Recomputed> cand_local = oracle.recompute(cand, ComputeDType::Float64, h);
  LocalReport r = judge_local(cand, *cand_local, ref, ref_local, dtype, sites, second, lazy);
  if (h) r.hypothesis = h->str();
  return r;
}

namespace {

// Whether two recomputed values are the same, bit for bit.
bool same_values(const TensorSource& a, const TensorSource& b, const std::string& name) {
  if (a.has(name) != b.has(name)) return false;
  if (!a.has(name)) return true;
  Borrowed x(a, name), y(b, name);
  if (x->shape != y->shape || x->is_int != y->is_int) return false;
  if (x->is_int) return x->i == y->i;
  return x->f.size() == y->f.size() && std::memcmp(x->f.data(), y->f.data(), x->f.size() * sizeof(float)) == 0;
}

}  // namespace

bool op_unchanged_under(const LocalOracle& oracle, const TensorSource& cand, const Recomputed& clean,
                        const std::string& name, const Hypothesis& h, ComputeDType dtype) {
  const std::vector<std::string> one = {name};
  const std::unique_ptr<Recomputed> values = oracle.recompute(cand, dtype, &h, &one);
  return values && values->values.has(name) && clean.values.has(name) &&
         same_values(values->values, clean.values, name);
}

LocalReport analyse_local_variant(const LocalOracle& oracle, const TensorSource& cand, const Recomputed& clean,
                                  const LocalReport& clean_report, const TensorSource* ref, ComputeDType dtype,
                                  const std::vector<std::string>& sites, const Hypothesis& h,
                                  const Recomputed* ref_local, SecondNoise* second, RefOnDemand* lazy) {
  const std::vector<int> kinds = oracle.layer_kinds();
  if (kinds.empty()) return analyse_local(oracle, cand, ref, dtype, sites, &h, ref_local, second, lazy);
  const std::vector<std::string> names = cand.names();
  // A layer the oracle does not know is a kind of its own.
  auto kind_of = [&](int layer) {
    return layer >= 0 && size_t(layer) < kinds.size() ? kinds[size_t(layer)] : -1 - layer;
  };
  // The first layer of each kind the candidate holds.
  std::map<int, int> probe_layer;
  for (const auto& n : names) {
    const CanonName c = parse_name(n);
    if (c.kind != CanonName::Kind::Layer) continue;
    auto [it, fresh] = probe_layer.emplace(kind_of(c.layer), c.layer);
    if (!fresh) it->second = std::min(it->second, c.layer);
  }
  auto in_probe = [&](const CanonName& c) {
    return c.kind != CanonName::Kind::Layer || probe_layer.at(kind_of(c.layer)) == c.layer;
  };
  std::vector<std::string> probe;
  for (const auto& n : names)
    if (in_probe(parse_name(n))) probe.push_back(n);
  std::unique_ptr<Recomputed> probed = oracle.recompute(cand, ComputeDType::Float64, &h, &probe);
  // The sites (by layer kind) the hypothesis changed.
  std::set<std::pair<int, std::string>> changed;
  for (const auto& n : probe) {
    const CanonName c = parse_name(n);
    if (c.kind == CanonName::Kind::Layer && !same_values(probed->values, clean.values, n))
      changed.insert({kind_of(c.layer), c.site});
  }
  std::vector<std::string> rest;
  for (const auto& n : names) {
    const CanonName c = parse_name(n);
    if (in_probe(c)) continue;
    auto src = clean.source.find(n);
    const bool chained = src == clean.source.end() || src->second.find('*') != std::string::npos;
    if (chained || !clean.values.has(n) || changed.count({kind_of(c.layer), c.site})) rest.push_back(n);
  }
  // Judged where recomputed (with the row lists the judge reads), the clean
  // verdicts elsewhere.
  auto judged = [&](const std::vector<std::string>& subset, const Recomputed& values) {
    std::vector<std::string> keep = subset;
    for (const auto& n : subset)
      if (cand.has(rows_name_for(n))) keep.push_back(rows_name_for(n));
    return judge_local(SubsetSource(cand, keep), values, ref, ref_local, dtype, sites, second, lazy);
  };
  LocalReport r = clean_report;
  r.hypothesis = h.str();
  std::map<std::string, size_t> at;
  for (size_t k = 0; k < r.sites.size(); ++k) at[r.sites[k].name] = k;
  bool added = false;
  std::set<std::string> dropped;  // sites the hypothesis' ops cannot recompute
  auto merge = [&](LocalReport part) {
    dropped.insert(part.not_recomputed.begin(), part.not_recomputed.end());
    for (LocalSite& s : part.sites) {
      auto it = at.find(s.name);
      if (it != at.end()) {
        r.sites[it->second] = std::move(s);
      } else {
        at[s.name] = r.sites.size();
        r.sites.push_back(std::move(s));
        added = true;
      }
    }
  };
  merge(judged(probe, *probed));
  probed.reset();
  if (!rest.empty()) merge(judged(rest, *oracle.recompute(cand, ComputeDType::Float64, &h, &rest)));
  if (!dropped.empty())
    r.sites.erase(std::remove_if(r.sites.begin(), r.sites.end(),
                                 [&](const LocalSite& x) { return dropped.count(x.name) > 0; }),
                  r.sites.end());
  if (added) {  // canonical order, as the candidate lists its names
    std::map<std::string, size_t> order;
    for (size_t k = 0; k < names.size(); ++k) order[names[k]] = k;
    std::stable_sort(r.sites.begin(), r.sites.end(),
                     [&](const LocalSite& a, const LocalSite& b) { return order[a.name] < order[b.name]; });
  }
  r.first_failure.reset();
  for (size_t k = 0; k < r.sites.size(); ++k)
    if (!r.sites[k].pass) {
      r.first_failure = k;
      break;
    }
  return r;
}

}  // namespace llmdiff::compare
