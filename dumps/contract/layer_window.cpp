#include "dumps/contract/layer_window.h"

#include <algorithm>

#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sites.h"

namespace llmdiff {

std::string LayerWindow::boundary_name(int step) const { return layer_name(step, first - 1, Site::Out); }

std::string LayerWindow::str() const {
  return std::to_string(first) + ":" + std::to_string(end < 0 ? num_layers : end);
}

LayerWindow parse_layer_window(const std::string& text, int num_layers) {
  auto bad = [&](const std::string& why) {
    return UsageError("--layers '" + text + "': " + why + " (expected A:B, layers A to B-1 of the model's " +
                      std::to_string(num_layers) + ")");
  };
  const size_t colon = text.find(':');
  if (colon == std::string::npos) throw bad("no ':'");
  auto number = [&](const std::string& s, int fallback) {
    if (s.empty()) return fallback;
    if (s.size() > 6 || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }))
      throw bad("'" + s + "' is not a layer index");
    return std::stoi(s);
  };
  LayerWindow w;
  w.num_layers = num_layers;
  w.first = number(text.substr(0, colon), 0);
  w.end = number(text.substr(colon + 1), num_layers);
  if (w.end > num_layers) throw bad("the model has " + std::to_string(num_layers) + " layers");
  if (w.first >= w.end) throw bad("an empty range");
  return w;
}

namespace {

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// The sites after the layers, a sampler's names and `generated`: the
// finishing shard's.
bool after_layers(const CanonName& c) {
  if (c.kind == CanonName::Kind::Generated) return true;
  if (c.kind != CanonName::Kind::Step) return false;
  const auto& after = step_sites_after_layers();
  return std::find(after.begin(), after.end(), c.site) != after.end() || starts_with(c.site, "sample.");
}

}  // namespace

bool in_window(const LayerWindow& w, const std::string& name) {
  if (w.whole()) return true;
  const CanonName c = parse_name(name);
  if (c.kind == CanonName::Kind::Layer) return w.has_layer(c.layer);
  if (after_layers(c)) return w.finishes();
  return w.starts();
}

void check_boundary(const LayerWindow& w, const TensorSource& dump) {
  if (w.first == 0) return;
  const int steps = dump.num_steps();
  for (int s = 0; s < steps; ++s)
    if (!dump.has(w.boundary_name(s)))
      throw MissingTensorError(dump.label() + " (a shard of layers " + w.str() + " starts from the residual stream "
                               "entering layer " + std::to_string(w.first) + ")",
                               w.boundary_name(s));
}

WindowSource::WindowSource(const TensorSource& base, const LayerWindow& w) : base_(base), window_(w) {
  for (const auto& n : base.names())
    if (in_window(w, n)) names_.push_back(n);
  index_.insert(names_.begin(), names_.end());
}

bool WindowSource::readable(const std::string& name) const {
  if (index_.count(name)) return true;
  const CanonName c = parse_name(name);
  // `generated` says which calls were greedy: what tokens are inputs.
  if (c.kind == CanonName::Kind::InvFreq || c.kind == CanonName::Kind::Generated) return true;
  if (c.kind == CanonName::Kind::Layer) return window_.first > 0 && c.layer == window_.first - 1 && c.site == site_name(Site::Out);
  if (c.kind != CanonName::Kind::Step) return false;
  const auto& before = step_sites_before_layers();
  return std::find(before.begin(), before.end(), c.site) != before.end();
}

bool WindowSource::has(const std::string& name) const { return readable(name) && base_.has(name); }

Shape WindowSource::shape(const std::string& name) const {
  if (!has(name)) throw MissingTensorError(label(), name);
  return base_.shape(name);
}

TensorData WindowSource::get(const std::string& name) const {
  if (!has(name)) throw MissingTensorError(label(), name);
  return base_.get(name);
}

}  // namespace llmdiff
