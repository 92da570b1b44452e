// Canonical names of the llm-dump/1 format (shared/spec/DUMP_FORMAT.md):
// parsing into (step, layer, site), formatting back, and the canonical order.
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace llmdiff {

// Per-step sites in spec order. Model-level sites come before "layers.*",
// per-layer sites are prefixed "layers.{i}." in full names.
const std::vector<std::string>& step_sites_before_layers();  // tokens ... embed
const std::vector<std::string>& layer_sites();               // attn_norm ... out
const std::vector<std::string>& step_sites_after_layers();   // final_norm ... next_logits

struct CanonName {
  enum class Kind { InvFreq, Step, Layer, Generated, Unknown };
  Kind kind = Kind::Unknown;
  int step = -1;      // Step, Layer
  int layer = -1;     // Layer
  std::string site;   // "mask", "attn.q", ...; the raw name for Unknown
  std::string str() const;  // formats back to the full name
};

// Parses a full name. Names outside the spec come back with Kind::Unknown.
CanonName parse_name(const std::string& name);
std::string step_name(int step, const std::string& site);                  // "step0.mask"
std::string layer_name(int step, int layer, const std::string& site);      // "step0.layers.1.attn.q"

// Sort key realising the spec's Order: rope.inv_freq, steps ascending (inside a
// step: the table order, layer by layer), generated, then unknown names sorted.
struct NameOrder {
  bool operator()(const std::string& a, const std::string& b) const;
};
void sort_canonical(std::vector<std::string>& names);

// Position of a site inside its step (0-based over before/layer/after tables
// flattened with the layer index), for ordering; -1 if unknown.
int site_rank(const std::string& site);

}  // namespace llmdiff
