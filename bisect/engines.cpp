#include "bisect/engines.h"

#include <cstdio>

#include "dumps/base/errors.h"
#include "dumps/base/memory.h"
#include "dumps/zoo/bugs.h"
#include "dumps/contract/padding.h"
#include "impl/impl_engine.h"
#include "ref/ref_engine.h"

namespace llmdiff::bisect {

WeightPolicy weight_policy(const Model& model, int64_t budget) {
  WeightPolicy p;
  p.checkpoint_bytes = model.weights ? int64_t(model.weights->total_bytes()) : 0;
  p.budget_bytes = budget > 0 ? budget : default_memory_budget();
  p.stream = p.checkpoint_bytes > p.budget_bytes;
  return p;
}

std::string WeightPolicy::str() const {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s (%.2f GB checkpoint %s a %.2f GB budget)",
                stream ? "streamed layer by layer" : "resident", double(checkpoint_bytes) * 1e-9,
                stream ? "beyond" : "within", double(budget_bytes) * 1e-9);
  return buf;
}

std::unique_ptr<Engine> make_engine(const std::string& which, const Model& model, const EngineOptions& opt) {
  if (which == "ref") {
    if (!opt.inject.empty()) throw UsageError("--inject applies to the impl engine only (the ref is the golden model)");
    if (opt.mla != "naive")
      throw UsageError("--mla " + opt.mla + " applies to the impl engine only (the ref computes HF's naive form)");
    if (!opt.precision.empty())
      throw UsageError("--precision applies to the impl engine only (the ref computes HF's numerics)");
    if (opt.kv_ring != 0) throw UsageError("--kv-ring applies to the impl engine only (the ref keeps every position)");
    if (opt.tensor_parallel != 1)
      throw UsageError("--tp applies to the impl engine only (the ref computes HF's single-device numerics)");
    ref::RefOptions r;
    r.dtype = opt.dtype.empty() ? model.config.default_dtype() : parse_compute_dtype(opt.dtype);
    r.threads = opt.threads;
    return ref::make_ref_engine(model, r);
  }
  if (which == "impl") {
    if (!opt.dtype.empty() && parse_compute_dtype(opt.dtype) != ComputeDType::Float32)
      throw UsageError("the impl computes in float32 (weights in their stored dtype); --dtype " + opt.dtype +
                       " applies to the ref only");
    impl::ImplOptions o;
    o.threads = opt.threads;
    o.max_seq = opt.max_seq;
    o.release_weights = opt.release_weights;
    o.mla = impl::parse_mla_form(opt.mla);
    o.precision = PrecisionProfile::parse(opt.precision);
    o.kv_ring = opt.kv_ring;
    o.tensor_parallel = opt.tensor_parallel;
    for (const auto& b : opt.inject) o.bugs.push_back(zoo::parse_bug(b));
    return impl::make_impl_engine(model, o);
  }
  throw UsageError("unknown engine '" + which + "' (supported: ref, impl)");
}

Manifest make_manifest(const std::string& producer, const std::string& dtype, const Model& model,
                       const std::string& model_dir, const Scenario& sc) {
  Manifest m;
  m.producer = producer;
  m.model = dir_name(model_dir);
  m.config = model.config.raw_json;
  m.scenario = sc.name;
  m.steps = int(sc.steps.size()) + sc.decode;
  m.dtype = dtype;
  if (sc.left_pad > 0) set_manifest_padding(m, LeftPadding{sc.left_pad, sc.pad_token});
  return m;
}

Manifest make_manifest(const Engine& engine, const Model& model, const std::string& model_dir, const Scenario& sc) {
  Manifest m = make_manifest(engine.producer(), engine.dtype_name(), model, model_dir, sc);
  if (!engine.precision().empty()) m.extra["precision"] = engine.precision().json();
  if (!engine.kv_cache_json().empty()) m.extra["kv_cache"] = engine.kv_cache_json();
  return m;
}

std::string dir_name(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  size_t slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

}  // namespace llmdiff::bisect
