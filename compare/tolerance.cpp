#include "compare/tolerance.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "dumps/base/errors.h"
#include "dumps/contract/names.h"

namespace llmdiff::compare {

std::string Tolerance::str() const {
  char buf[96];
  std::snprintf(buf, sizeof buf, "rtol %.3g atol %.3g", rtol, atol);
  return buf;
}

Tolerance default_tolerance(ComputeDType d) {
  switch (d) {
    case ComputeDType::Float32: return {1.3e-6, 1e-5};
    case ComputeDType::BFloat16: return {1.6e-2, 1e-5};
    case ComputeDType::Float16: return {1e-3, 1e-5};
    case ComputeDType::Float64: return {1e-7, 1e-7};
  }
  return {};
}

namespace {
int coarseness(ComputeDType d) {
  switch (d) {
    case ComputeDType::Float64: return 0;
    case ComputeDType::Float32: return 1;
    case ComputeDType::Float16: return 2;
    case ComputeDType::BFloat16: return 3;
  }
  return 1;
}
}  // namespace

ComputeDType coarser_dtype(ComputeDType a, ComputeDType b) {
  return coarseness(a) >= coarseness(b) ? a : b;
}

std::optional<ComputeDType> manifest_dtype(const Manifest& m) {
  if (m.dtype.empty()) return std::nullopt;
  try {
    return parse_compute_dtype(m.dtype);
  } catch (const Error&) {
    return std::nullopt;
  }
}

namespace {
double parse_tol_value(const std::string& key, const std::string& value, const std::string& text) {
  if (value.empty()) throw UsageError("--tol '" + text + "': " + key + " has no value");
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(value.c_str(), &end);
  if (end != value.c_str() + value.size() || errno == ERANGE)
    throw UsageError("--tol '" + text + "': " + key + " value '" + value + "' is not a number");
  if (!std::isfinite(v) || v < 0)
    throw UsageError("--tol '" + text + "': " + key + " must be a finite number >= 0, got '" + value + "'");
  return v;
}
}  // namespace

ToleranceOverride parse_tolerance_override(const std::string& text) {
  const std::string usage = " (expected GLOB=atol:X, GLOB=rtol:X or GLOB=atol:X,rtol:Y)";
  auto eq = text.rfind('=');
  if (eq == std::string::npos) throw UsageError("--tol '" + text + "': missing '='" + usage);
  ToleranceOverride o;
  o.text = text;
  o.glob = text.substr(0, eq);
  if (o.glob.empty()) throw UsageError("--tol '" + text + "': empty name glob" + usage);
  std::string spec = text.substr(eq + 1);
  if (spec.empty()) throw UsageError("--tol '" + text + "': empty tolerance" + usage);
  size_t pos = 0;
  while (pos <= spec.size()) {
    size_t comma = spec.find(',', pos);
    std::string item = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (item.empty()) throw UsageError("--tol '" + text + "': empty item" + usage);
    auto colon = item.find(':');
    if (colon == std::string::npos) throw UsageError("--tol '" + text + "': '" + item + "' lacks ':'" + usage);
    std::string key = item.substr(0, colon), value = item.substr(colon + 1);
    if (key == "atol")
      o.atol = parse_tol_value(key, value, text);
    else if (key == "rtol")
      o.rtol = parse_tol_value(key, value, text);
    else
      throw UsageError("--tol '" + text + "': unknown key '" + key + "'" + usage);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return o;
}

std::string strip_step_prefix(const std::string& name) {
  CanonName c = parse_name(name);
  if (c.kind == CanonName::Kind::Step) return c.site;
  if (c.kind == CanonName::Kind::Layer) return "layers." + std::to_string(c.layer) + "." + c.site;
  return name;
}

bool site_glob_match(const std::string& glob, const std::string& name) {
  if (glob_match(glob, name)) return true;
  std::string bare = strip_step_prefix(name);
  return bare != name && glob_match(glob, bare);
}

bool any_site_glob_match(const std::vector<std::string>& globs, const std::string& name) {
  for (const auto& g : globs)
    if (site_glob_match(g, name)) return true;
  return false;
}

std::vector<std::string> split_list(const std::string& csv) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= csv.size()) {
    size_t comma = csv.find(',', pos);
    std::string item = csv.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (!item.empty()) out.push_back(item);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

TolerancePolicy::TolerancePolicy(ComputeDType dtype, std::optional<double> rtol,
                                 std::optional<double> atol, std::vector<ToleranceOverride> overrides)
    : dtype_(dtype), base_(default_tolerance(dtype)), overrides_(std::move(overrides)) {
  base_source_ = std::string(compute_dtype_name(dtype)) + " default";
  if (rtol) base_.rtol = *rtol;
  if (atol) base_.atol = *atol;
  if (rtol || atol) base_source_ = "--rtol/--atol";
}

Tolerance TolerancePolicy::resolve(const std::string& name, std::string* source) const {
  Tolerance t = base_;
  std::string src = base_source_;
  for (const auto& o : overrides_) {
    if (!site_glob_match(o.glob, name)) continue;
    if (o.rtol) t.rtol = *o.rtol;
    if (o.atol) t.atol = *o.atol;
    src = "--tol " + o.text;
  }
  if (source) *source = src;
  return t;
}

}  // namespace llmdiff::compare
