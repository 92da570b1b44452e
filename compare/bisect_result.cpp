#include "compare/bisect_result.h"

#include <algorithm>

namespace llmdiff::compare {

std::optional<std::string> BisectResult::first_divergence() const {
  if (const TensorComparison* t = global.first()) return t->name;
  return std::nullopt;
}

std::optional<std::string> BisectResult::first_local_failure() const {
  if (const LocalSite* s = local.first()) return s->name;
  return std::nullopt;
}

std::optional<std::string> BisectResult::localised_at() const {
  if (auto l = first_local_failure()) return l;
  return first_divergence();
}

bool BisectResult::ok() const {
  return (global.failing() == 0 || flips_explain) && local.failing() == 0 && !global.tensors.empty();
}

bool BisectResult::sampler_fails() const { return sampling && sampling->verdict == SamplingCheck::Verdict::Fail; }

std::string verdict_headline(const Finding& f, bool ok, size_t compared, bool noise_floor,
                             std::optional<size_t> local_recomputed, const std::string& localised_at,
                             bool sampler_fails, const std::string& flipped_at, const std::string& sampler_finding) {
  const std::string sampler =
      sampler_fails ? "; the sampler fails its check" + (sampler_finding.empty() ? "" : " (" + sampler_finding + ")")
                    : "";
  if (ok && !flipped_at.empty())
    return "No divergence beyond routing flips at near-ties: the names that diverge do so after " + flipped_at +
           ", no local failure" + sampler;
  if (ok)
    return "No divergence: " + std::to_string(compared) + " names within the " +
           (noise_floor ? "noise floor" : "tolerance") +
           (local_recomputed ? ", " + std::to_string(*local_recomputed) + " local recomputes within the noise" : "") +
           sampler;
  return "Divergence, localised at " + (localised_at.empty() ? std::string("?") : localised_at) +
         ". Diagnosis: " + headline(f) + sampler;
}

std::string headline(const BisectResult& r) {
  return verdict_headline(r.finding, r.ok(), r.global.tensors.size(), r.noise_floor,
                          r.local.ran ? std::optional<size_t>(r.local.sites.size()) : std::nullopt,
                          r.localised_at().value_or(""), r.sampler_fails(),
                          r.flips_explain && !r.routing_flips.empty() ? r.routing_flips.front() : "",
                          r.sampling ? sampling_finding(*r.sampling) : "");
}

void note_routing_flips(BisectResult& r) {
  std::optional<size_t> first;
  for (size_t i = 0; i < r.global.tensors.size(); ++i) {
    const TensorComparison& t = r.global.tensors[i];
    if (!t.is_int || !t.pass || t.ints.mismatches == 0) continue;
    if (t.judgement.note.rfind("routing flip at a near-tie", 0) != 0) continue;
    if (!first) first = i;
    r.routing_flips.push_back(t.name);
    if (r.routing_flips.size() <= 8) r.notes.push_back(t.name + ": " + t.judgement.note + " (not a routing bug)");
  }
  if (r.routing_flips.size() > 8)
    r.notes.push_back(std::to_string(r.routing_flips.size() - 8) + " more routing sites flip at near-ties");
  if (!first || r.global.ok() || !r.local.ran || r.local.first_failure) return;
  for (size_t i = 0; i <= *first; ++i)
    if (!r.global.tensors[i].pass) return;
  r.flips_explain = true;
  r.notes.push_back(std::to_string(r.global.failing()) + " names diverge after " + r.global.tensors[*first].name +
                    ", whose expert choices differ from the reference's at near-ties: the tokens ran other experts "
                    "from there on, and every op is right on its own inputs");
}

std::vector<std::string> signature_sites(const BisectResult& r) {
  std::vector<std::string> names;
  if (auto at = r.localised_at()) names.push_back(*at);
  for (const TensorComparison& t : r.global.tensors) {
    if (names.size() >= 4) break;
    if (!t.pass && !t.is_int && std::find(names.begin(), names.end(), t.name) == names.end())
      names.push_back(t.name);
  }
  return names;
}

}  // namespace llmdiff::compare
