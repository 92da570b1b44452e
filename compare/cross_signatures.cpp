#include "compare/cross_signatures.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "dumps/contract/calls.h"
#include "dumps/contract/sites.h"

namespace llmdiff::compare {

namespace {

// Sites computing the same op on parallel paths of one layer, each with the
// path it belongs to. A site may sit in several groups (MLA's attn.q beside
// attn.kv and attn.k_pe, GQA's beside attn.k and attn.v); the first with two
// members the dump holds is read.
struct Sibling {
  Site site;
  const char* path;
};
using SiblingGroup = std::vector<Sibling>;

const std::vector<SiblingGroup>& sibling_groups() {
  static const std::vector<SiblingGroup> groups = {
      {{Site::AttnQ, "q"}, {Site::AttnK, "k"}, {Site::AttnV, "v"}},
      {{Site::AttnQA, "q"}, {Site::AttnKvA, "kv"}},                        // MLA's down-projections
      {{Site::AttnQANorm, "q"}, {Site::AttnKvANorm, "kv"}},                // their norms
      {{Site::AttnQ, "q"}, {Site::AttnKv, "kv"}, {Site::AttnKPe, "k_pe"}}, // MLA's up-projections, k's rotary part
      {{Site::AttnQNorm, "q"}, {Site::AttnKNorm, "k"}},
      {{Site::AttnQRope, "q"}, {Site::AttnKRope, "k"}},
      {{Site::AttnKCache, "k"}, {Site::AttnVCache, "v"}},
      {{Site::AttnLatentCache, "latent"}, {Site::AttnKPeCache, "k_pe"}},
      {{Site::AttnKRep, "k"}, {Site::AttnVRep, "v"}},
      {{Site::MlpGate, "gate"}, {Site::MlpUp, "up"}},
  };
  return groups;
}

// "a", "a and b", "a, b and c".
std::string and_list(const std::vector<std::string>& items) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i) s += (i == 0 ? "" : i + 1 == items.size() ? " and " : ", ") + items[i];
  return s;
}

std::string int_list(const std::vector<int>& v) {
  std::vector<std::string> s;
  for (int x : v) s.push_back(std::to_string(x));
  return and_list(s);
}

// Every verdict of the bisection, by (step, layer, site); layer -1 for the
// sites of a step.
struct Verdicts {
  bool local = false;                                   // the local verdicts (else the global ones)
  std::map<std::tuple<int, int, std::string>, bool> fails;
  std::set<int> moe_layers;                             // layers holding moe.* names

  // At (layer, site): the steps judged and those failing, ascending.
  void steps_at(int layer, const std::string& site, std::vector<int>& judged, std::vector<int>& failing) const {
    for (const auto& [key, fail] : fails)
      if (std::get<1>(key) == layer && std::get<2>(key) == site) {
        judged.push_back(std::get<0>(key));
        if (fail) failing.push_back(std::get<0>(key));
      }
  }
  const bool* at(int step, int layer, const std::string& site) const {
    const auto it = fails.find({step, layer, site});
    return it == fails.end() ? nullptr : &it->second;
  }
};

Verdicts collect(const std::string& at, const LocalReport& local, const DiffResult& global) {
  Verdicts v;
  v.local = local.ran && local.find(at) != nullptr;
  auto add = [&](const CanonName& c, bool fail) {
    if (c.kind != CanonName::Kind::Step && c.kind != CanonName::Kind::Layer) return;
    v.fails[{c.step, c.kind == CanonName::Kind::Layer ? c.layer : -1, c.site}] = fail;
  };
  if (v.local)
    for (const LocalSite& s : local.sites) add(s.parsed, !s.pass);
  else
    for (const TensorComparison& t : global.tensors) add(t.parsed, !t.pass);
  auto note_moe = [&](const CanonName& c) {
    if (c.kind == CanonName::Kind::Layer && c.site.rfind("moe.", 0) == 0) v.moe_layers.insert(c.layer);
  };
  for (const LocalSite& s : local.sites) note_moe(s.parsed);
  for (const TensorComparison& t : global.tensors) note_moe(t.parsed);
  return v;
}

ErrorSignature only_some(const std::string& at, std::string detail) {
  ErrorSignature s;
  s.name = at;
  s.kind = kOnlySomeKind;
  s.detail = std::move(detail);
  s.fit = 1.0;  // says where the error is, not what its values are
  s.decisive = false;
  return s;
}

std::string fails_word(const Verdicts& v, size_t n) {
  if (v.local) return n == 1 ? "fails locally" : "fail locally";
  return n == 1 ? "diverges" : "diverge";
}
std::string passes_word(const Verdicts& v, size_t n) {
  if (v.local) return n == 1 ? "passes" : "pass";
  return n == 1 ? "matches the reference" : "match the reference";
}

// "every step", "steps 1, 2 and 3 of 4".
std::string steps_words(const std::vector<int>& failing, size_t judged) {
  if (failing.size() == judged) return judged == 1 ? "its one step" : "every step";
  return (failing.size() == 1 ? "step " : "steps ") + int_list(failing) + " of " + std::to_string(judged);
}

// Siblings: at the localised layer (every step with local verdicts, the
// localised step with global ones), which members of the op's group fail
// and which pass.
std::optional<ErrorSignature> sibling_signature(const std::string& at, const CanonName& c, const Verdicts& v) {
  if (c.kind != CanonName::Kind::Layer) return std::nullopt;
  const std::optional<Site> site = find_site(c.site);
  if (!site) return std::nullopt;
  for (const SiblingGroup& group : sibling_groups()) {
    if (std::none_of(group.begin(), group.end(), [&](const Sibling& s) { return s.site == *site; })) continue;
    struct Member {
      std::string name, path;
      std::vector<int> judged, failing;
    };
    std::vector<Member> present;
    for (const Sibling& s : group) {
      Member m{site_name(s.site), s.path, {}, {}};
      if (v.local) {
        v.steps_at(c.layer, m.name, m.judged, m.failing);
      } else if (const bool* fail = v.at(c.step, c.layer, m.name)) {
        m.judged.push_back(c.step);
        if (*fail) m.failing.push_back(c.step);
      }
      if (!m.judged.empty()) present.push_back(std::move(m));
    }
    if (present.size() < 2) continue;
    std::vector<std::string> fail_sites, fail_paths, pass_sites, pass_paths;
    const Member* self = nullptr;
    for (const Member& m : present) {
      if (m.name == c.site) self = &m;
      (m.failing.empty() ? pass_sites : fail_sites).push_back(m.name);
      (m.failing.empty() ? pass_paths : fail_paths).push_back(m.path);
    }
    if (!self || self->failing.empty() || pass_sites.empty()) return std::nullopt;
    std::string where = "at layer " + std::to_string(c.layer);
    if (v.local) {
      where += " (" + steps_words(self->failing, self->judged.size()) + ")";
    } else {
      where += ", step " + std::to_string(c.step);
    }
    return only_some(at, and_list(fail_sites) + " " + fails_word(v, fail_sites.size()) + " " + where + " while " +
                             and_list(pass_sites) + " " + passes_word(v, pass_sites.size()) + " there: only " +
                             and_list(fail_paths) + (fail_paths.size() == 1 ? " is" : " are") + " wrong" +
                             (v.local ? "" : " up to here") + ", " + and_list(pass_paths) +
                             (pass_paths.size() == 1 ? " is" : " are") + " right");
  }
  return std::nullopt;
}

// The forward calls' spans (P cached before, T tokens), in the sequence's
// own positions (a left-padded row's pads are masked keys, not counted);
// greedy decode calls after the given ones feed one token each.
std::vector<CallSpan> spans(const Scenario& sc) {
  std::vector<std::vector<int64_t>> steps = sc.steps;
  for (int d = 0; d < sc.decode; ++d) steps.push_back({0});
  return call_spans(steps, int64_t(sc.cached_prefix.size()), sc.rollback);
}

// "T = 5", "T = 3, 2".
std::string t_values(const std::vector<int>& steps, const std::vector<CallSpan>& calls) {
  std::vector<int64_t> ts;
  for (int s : steps)
    if (std::find(ts.begin(), ts.end(), calls[size_t(s)].T) == ts.end()) ts.push_back(calls[size_t(s)].T);
  std::string o = "T = ";
  for (size_t i = 0; i < ts.size(); ++i) o += (i ? ", " : "") + std::to_string(ts[i]);
  return o;
}

// What the failing calls share that the passing ones do not, when one
// property of the calls separates them; "" when none does.
std::string calls_in_common(const std::vector<int>& failing, const std::vector<int>& passing, const Scenario& sc) {
  const std::vector<CallSpan> calls = spans(sc);
  auto all = [&](const std::vector<int>& steps, auto pred) {
    return std::all_of(steps.begin(), steps.end(),
                       [&](int s) { return s >= 0 && size_t(s) < calls.size() && pred(calls[size_t(s)], s); });
  };
  auto known = [](const CallSpan&, int) { return true; };  // a call of the scenario
  if (!all(failing, known) || !all(passing, known)) return "";
  auto decode = [](const CallSpan& c, int) { return c.T == 1; };
  auto several = [](const CallSpan& c, int) { return c.T > 1; };
  // Speculative verify calls: those the dump reports drafts accepted for.
  auto verify = [&](const CallSpan&, int s) { return sc.rollback.count(s) != 0; };
  auto not_verify = [&](const CallSpan& c, int s) { return !verify(c, s); };
  if (!sc.rollback.empty() && all(failing, verify) && all(passing, not_verify))
    return "every speculative verify call, never another call";
  if (all(failing, decode) && all(passing, several))
    return "every decode step (T = 1), never the " + std::string(passing.size() == 1 ? "prefill" : "prompt's calls") +
           " (" + t_values(passing, calls) + ")";
  if (all(failing, several) && all(passing, decode))
    return "every call of several tokens (" + t_values(failing, calls) + "), never a decode step (T = 1)";
  auto later_chunk = [](const CallSpan& c, int) { return c.T > 1 && c.P > 0; };
  auto not_later_chunk = [&](const CallSpan& c, int s) { return !later_chunk(c, s); };
  auto first_chunk = [](const CallSpan& c, int) { return c.T > 1 && c.P == 0; };
  if (all(failing, later_chunk) && all(passing, not_later_chunk) &&
      std::any_of(passing.begin(), passing.end(), [&](int s) { return first_chunk(calls[size_t(s)], s); }))
    return "every chunk of the prompt after the first (T > 1 with positions cached before it), never the first chunk";
  // The keys a call attends to: S = P + T, their range over the failing and the passing calls.
  auto keys = [&](const std::vector<int>& steps) {
    std::pair<int64_t, int64_t> range{std::numeric_limits<int64_t>::max(), 0};
    for (int s : steps) {
      const int64_t S = calls[size_t(s)].P + calls[size_t(s)].T;
      range = {std::min(range.first, S), std::max(range.second, S)};
    }
    return range;
  };
  const auto [fail_lo, fail_hi] = keys(failing);
  const auto [pass_lo, pass_hi] = keys(passing);
  if (fail_lo > pass_hi)
    return "every call attending to more than " + std::to_string(pass_hi) + " keys (S = P + T > " +
           std::to_string(pass_hi) + "), never one attending to fewer";
  if (fail_hi < pass_lo)
    return "every call attending to at most " + std::to_string(fail_hi) + " keys (S = P + T <= " +
           std::to_string(fail_hi) + "), never one attending to more";
  return "";
}

std::string site_at(const CanonName& c) {
  return c.kind == CanonName::Kind::Layer ? c.site + " at layer " + std::to_string(c.layer) : c.site;
}

// Steps: the localised site (at its layer) fails locally at some forward
// calls and passes at the others.
std::optional<ErrorSignature> steps_signature(const std::string& at, const CanonName& c, const Verdicts& v,
                                              const Scenario& sc) {
  if (!v.local) return std::nullopt;
  std::vector<int> judged, failing, passing;
  v.steps_at(c.kind == CanonName::Kind::Layer ? c.layer : -1, c.site, judged, failing);
  if (failing.empty() || failing.size() == judged.size()) return std::nullopt;
  for (int s : judged)
    if (std::find(failing.begin(), failing.end(), s) == failing.end()) passing.push_back(s);
  std::string detail = site_at(c) + " fails locally at " + std::to_string(failing.size()) + " of " +
                       std::to_string(judged.size()) + " forward calls (" +
                       (failing.size() == 1 ? "step " : "steps ") + int_list(failing) + ") and passes at " +
                       (passing.size() == 1 ? "step " : "steps ") + int_list(passing);
  const std::string common = calls_in_common(failing, passing, sc);
  if (!common.empty()) detail += ": " + common;
  return only_some(at, detail);
}

// Layers: the localised site fails locally at some layers and passes at
// every step at the others.
std::optional<ErrorSignature> layers_signature(const std::string& at, const CanonName& c, const Verdicts& v) {
  if (!v.local || c.kind != CanonName::Kind::Layer) return std::nullopt;
  std::map<int, bool> layer_fails;
  for (const auto& [key, fail] : v.fails)
    if (std::get<1>(key) >= 0 && std::get<2>(key) == c.site) layer_fails[std::get<1>(key)] |= fail;
  std::vector<int> failing, passing;
  for (const auto& [layer, fail] : layer_fails) (fail ? failing : passing).push_back(layer);
  if (failing.empty() || passing.empty()) return std::nullopt;
  std::string detail = c.site + " fails locally at " + (failing.size() == 1 ? "layer " : "layers ") +
                       int_list(failing) + " of the " + std::to_string(layer_fails.size()) +
                       " layers holding it and passes at every step of " +
                       (passing.size() == 1 ? "layer " : "layers ") + int_list(passing);
  auto moe = [&](int l) { return v.moe_layers.count(l) != 0; };
  auto none_moe = [&](const std::vector<int>& ls) { return std::none_of(ls.begin(), ls.end(), moe); };
  auto all_moe = [&](const std::vector<int>& ls) { return std::all_of(ls.begin(), ls.end(), moe); };
  if (all_moe(failing) && none_moe(passing))
    detail += ": every MoE layer, never a dense one";
  else if (none_moe(failing) && all_moe(passing))
    detail += ": every dense layer, never a MoE one";
  return only_some(at, detail);
}

}  // namespace

std::vector<ErrorSignature> cross_name_signatures(const std::string& at, const LocalReport& local,
                                                  const DiffResult& global, const Scenario& sc) {
  std::vector<ErrorSignature> out;
  const CanonName c = parse_name(at);
  if (c.kind != CanonName::Kind::Step && c.kind != CanonName::Kind::Layer) return out;
  const Verdicts v = collect(at, local, global);
  for (std::optional<ErrorSignature> s :
       {sibling_signature(at, c, v), steps_signature(at, c, v, sc), layers_signature(at, c, v)})
    if (s) out.push_back(std::move(*s));
  return out;
}

}  // namespace llmdiff::compare
