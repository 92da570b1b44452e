#include "compare/regress.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>

#include "compare/report.h"
#include "dumps/base/errors.h"

namespace llmdiff::compare {

namespace fs = std::filesystem;

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

double parse_policy_value(const std::string& key, const std::string& value) {
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(value.c_str(), &end);
  if (value.empty() || end != value.c_str() + value.size() || errno == ERANGE || !std::isfinite(v) || v < 0)
    throw UsageError("--policy " + key + ": '" + value + "' is not a finite number >= 0");
  return v;
}
}  // namespace

const char* engine_kind_name(EngineKind e) {
  switch (e) {
    case EngineKind::Ref: return "ref";
    case EngineKind::Impl: return "impl";
    case EngineKind::External: return "external";
  }
  return "?";
}

EngineKind parse_engine_kind(const std::string& s) {
  if (s == "ref") return EngineKind::Ref;
  if (s == "impl") return EngineKind::Impl;
  throw UsageError("unknown engine '" + s + "' (supported: ref, impl)");
}

const std::vector<std::string>& RegressionPolicy::keys() {
  static const std::vector<std::string> k{"f32_abs",      "bf16_ref_rtol",  "bf16_ref_atol",    "f16_ref_rtol",
                                          "f16_ref_atol", "lowp_impl_nmse", "require_all_names",
                                          "external_all_names"};
  return k;
}

void RegressionPolicy::set(const std::string& kv) {
  auto eq = kv.find('=');
  std::string all;
  for (const auto& k : keys()) all += (all.empty() ? "" : ", ") + k;
  if (eq == std::string::npos) throw UsageError("--policy '" + kv + "': expected KEY=VALUE with KEY one of " + all);
  std::string key = kv.substr(0, eq), value = kv.substr(eq + 1);
  if (key == "require_all_names" || key == "external_all_names") {
    if (value != "0" && value != "1") throw UsageError("--policy " + key + ": expected 0 or 1, got '" + value + "'");
    (key == "require_all_names" ? require_all_names : external_all_names) = value == "1";
  } else if (key == "f32_abs") {
    f32_abs = parse_policy_value(key, value);
  } else if (key == "bf16_ref_rtol") {
    bf16_ref.rtol = parse_policy_value(key, value);
  } else if (key == "bf16_ref_atol") {
    bf16_ref.atol = parse_policy_value(key, value);
  } else if (key == "f16_ref_rtol") {
    f16_ref.rtol = parse_policy_value(key, value);
  } else if (key == "f16_ref_atol") {
    f16_ref.atol = parse_policy_value(key, value);
  } else if (key == "lowp_impl_nmse") {
    lowp_impl_nmse = parse_policy_value(key, value);
  } else {
    throw UsageError("--policy '" + kv + "': unknown key '" + key + "' (keys: " + all + ")");
  }
}

std::string RegressionPolicy::describe(EngineKind engine, ComputeDType dt) const {
  std::string tail = "; integer tensors exact";
  if (engine == EngineKind::External ? external_all_names : require_all_names) tail += "; every HF name present";
  if (dt == ComputeDType::Float32 || dt == ComputeDType::Float64)
    return "every float tensor max|a-b| <= " + fmt_num(f32_abs) + " * max(1, max|HF|)" + tail;
  if (engine == EngineKind::Ref) {
    const Tolerance& t = dt == ComputeDType::BFloat16 ? bf16_ref : f16_ref;
    return std::string(compute_dtype_name(dt)) + " allclose (" + t.str() + ") on every float tensor" + tail;
  }
  return "generated identical and logits/next_logits NMSE <= " + fmt_num(lowp_impl_nmse) +
         " (other float tensors informational)" + tail;
}

std::string ScaledMaxAbsCriterion::name() const { return "max_abs <= " + fmt_num(factor_) + " * max(1, max|ref|)"; }

Judgement ScaledMaxAbsCriterion::judge(const TensorData&, const TensorData&, const TensorComparison& cmp) const {
  Judgement j;
  j.metric = "max_abs";
  j.value = cmp.max_abs();
  j.threshold = factor_ * std::max(1.0, cmp.metrics.ref_max_abs);
  j.pass = j.value <= j.threshold;
  return j;
}

std::string LogitsNmseCriterion::name() const { return "logits nmse <= " + fmt_num(bound_); }

Judgement LogitsNmseCriterion::judge(const TensorData&, const TensorData&, const TensorComparison& cmp) const {
  Judgement j;
  bool logits = cmp.parsed.kind == CanonName::Kind::Step &&
                (cmp.parsed.site == "logits" || cmp.parsed.site == "next_logits");
  j.metric = "nmse";
  j.value = cmp.nmse();
  j.threshold = bound_;
  if (!logits) {
    j.judged = false;
    j.pass = true;
    return j;
  }
  j.pass = j.value <= j.threshold;
  return j;
}

CompareOptions regression_options(const RegressionPolicy& p, EngineKind engine, ComputeDType dt) {
  CompareOptions o;
  o.dtype = dt;
  if (dt == ComputeDType::Float32 || dt == ComputeDType::Float64) {
    o.criterion = std::make_shared<ScaledMaxAbsCriterion>(p.f32_abs);
  } else if (engine == EngineKind::Ref) {
    const Tolerance& t = dt == ComputeDType::BFloat16 ? p.bf16_ref : p.f16_ref;
    o.rtol = t.rtol;
    o.atol = t.atol;
    o.criterion = std::make_shared<AllcloseCriterion>();
  } else {
    o.criterion = std::make_shared<LogitsNmseCriterion>(p.lowp_impl_nmse);
  }
  return o;
}

std::vector<GoldenModel> discover_golden(const std::string& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) throw UsageError("--golden " + root + ": not a directory");
  std::vector<GoldenModel> out;
  std::vector<fs::path> todo{fs::path(root)};
  while (!todo.empty()) {
    fs::path dir = todo.back();
    todo.pop_back();
    if (fs::exists(dir / "config.json", ec)) {
      GoldenModel m;
      m.dir = dir.string();
      m.name = dir.filename().string();
      if (m.name.empty() || m.name == ".") m.name = fs::absolute(dir, ec).filename().string();
      for (const auto& e : fs::directory_iterator(dir, ec)) {
        if (!e.is_regular_file()) continue;
        std::string fname = e.path().filename().string();
        if (e.path().extension() != ".safetensors" || fname.rfind("model", 0) == 0) continue;
        m.dumps.push_back(e.path().string());
      }
      std::sort(m.dumps.begin(), m.dumps.end());
      out.push_back(std::move(m));
      continue;
    }
    for (const auto& e : fs::directory_iterator(dir, ec))
      if (e.is_directory()) todo.push_back(e.path());
  }
  if (ec) throw IoError(root, "cannot list directory: " + ec.message());
  std::sort(out.begin(), out.end(), [](const GoldenModel& a, const GoldenModel& b) { return a.dir < b.dir; });
  if (out.empty()) throw UsageError("--golden " + root + ": no model directory (a directory holding config.json)");
  return out;
}

void evaluate_case(RegressionCase& c, const RegressionPolicy& p) {
  c.failures.clear();
  c.worst_name.clear();
  c.worst_metric.clear();
  c.worst_value = c.worst_threshold = 0;
  if (!c.error.empty() || !c.diff) {
    c.pass = false;
    if (c.error.empty()) c.error = "no comparison";
    c.failures.push_back("error: " + c.error);
    return;
  }
  const DiffResult& d = *c.diff;
  double worst_ratio = 0;  // a case where every judged value is 0 has no worst tensor
  for (const auto& t : d.tensors) {
    const Judgement& j = t.judgement;
    if (!j.judged) continue;
    double ratio = j.threshold > 0 ? j.value / j.threshold : (j.value > 0 ? kInf : 0.0);
    if (std::isnan(ratio)) ratio = kInf;
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      c.worst_name = t.name;
      c.worst_metric = j.metric;
      c.worst_value = j.value;
      c.worst_threshold = j.threshold;
    }
    if (!t.pass) {
      std::string line = t.name + ": ";
      if (!t.shape_match)
        line += "shape " + shape_str(t.cand_shape) + " vs HF " + shape_str(t.ref_shape);
      else
        line += j.metric + " " + fmt_num(j.value) + " > " + fmt_num(j.threshold);
      if (!t.notes.empty()) line += " (" + t.notes.front() + ")";
      c.failures.push_back(line);
    }
  }
  c.missing = d.only_in_ref;
  if (c.engine == EngineKind::External ? p.external_all_names : p.require_all_names)
    for (const auto& n : d.only_in_ref) c.failures.push_back(n + ": missing from the engine's dump");
  if (d.tensors.empty()) c.failures.push_back("no name in common with the HF dump");
  c.pass = c.failures.empty();
}

size_t RegressionReport::failing() const {
  size_t n = 0;
  for (const auto& c : cases)
    if (!c.pass) ++n;
  return n;
}

}  // namespace llmdiff::compare
