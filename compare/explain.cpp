// The explainers of compare/explain.h and their ordered list.
#include "compare/explain.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <utility>

#include "compare/signature_finders.h"
#include "dumps/contract/names.h"
#include "dumps/zoo/bugs.h"

namespace llmdiff::compare {

namespace {

std::string num(double v) {
  char buf[32];
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (std::isnan(v)) return "nan";
  std::snprintf(buf, sizeof buf, "%.2g", v);
  return buf;
}

std::string joined(const std::vector<std::string>& items, const char* sep) {
  std::string s;
  for (const auto& i : items) s += (s.empty() ? "" : sep) + i;
  return s;
}

Finding finding_of(FindingKind kind, std::string evidence) {
  Finding f;
  f.kind = kind;
  f.evidence = std::move(evidence);
  return f;
}

Finding declaration(Declaration d, std::string evidence) {
  Finding f = finding_of(FindingKind::Precision, std::move(evidence));
  f.declare = d;
  return f;
}

Finding zoo_bug(Hypothesis bug, BugBasis basis, std::string description, std::string evidence) {
  Finding f = finding_of(FindingKind::ZooBug, std::move(evidence));
  f.bug = std::move(bug);
  f.basis = basis;
  f.description = std::move(description);
  return f;
}

std::string zoo_description(const std::string& bug) {
  const zoo::BugInfo* info = zoo::find_bug(bug);
  return info ? info->description : "";
}

// The manifest key of a 16-bit cache type.
std::string kv_key(ComputeDType d) { return d == ComputeDType::BFloat16 ? "bf16" : "f16"; }

// The three best hypotheses' numbers, " | "-separated.
std::string closest(const Diagnosis& d) {
  std::vector<std::string> s;
  for (size_t k = 0; k < d.ranked.size() && k < 3; ++k) s.push_back(d.ranked[k].summary);
  return joined(s, " | ");
}

// Why nothing fits, with the closest hypotheses and every fingerprint as a hint.
std::string nothing_fits_evidence(const BisectResult& r) {
  const Diagnosis& d = r.diagnosis;
  std::string s = d.clean_reproduces;
  if (s.empty()) {
    s = "no hypothesis of the bug zoo fits the evidence at " + r.localised_at().value_or("");
    const std::string numbers = closest(d);
    if (!numbers.empty()) s += "; closest: " + numbers;
    std::vector<std::string> hints;
    for (const auto& f : d.fingerprints) hints.push_back(f.evidence);
    if (!hints.empty()) s += "; hints: " + joined(hints, "; ");
    if (d.ranked.empty()) s += " (no hypotheses were tested: no model to replay)";
  }
  if (const auto& t = r.evidence.tensor_parallel; t && t->replayed && t->fits.empty())
    s += "; replaying the candidate's calls over its " + std::to_string(t->ranks) +
         " ranks with each tensor-parallel bug reproduces none of them (diverging names reproduced: " + t->tried + ")";
  if (const auto& b = r.evidence.batch_replay; b && b->fits.empty())
    s += "; replaying the batch's " + std::to_string(b->iterations) +
         " engine iterations with each batch bug reproduces none of them (diverging names reproduced: " + b->tried +
         ")";
  return s;
}

bool diagnosed(const BisectResult& r) { return r.evidence.diagnosed; }

}  // namespace

std::optional<Finding> explain_passes(const BisectResult& r) {
  if (r.localised_at()) return std::nullopt;
  return finding_of(FindingKind::Passes, "no divergence: nothing to diagnose");
}

// HF attends to every position; a ring of C positions no longer can once
// the sequence outgrows it. The wrap explains the error when the error
// starts at or after that step and nothing diverges before it.
std::optional<Finding> explain_ring_wrap(const BisectResult& r) {
  const std::optional<RingWrap>& w = r.evidence.ring;
  const std::optional<std::string> at = r.localised_at();
  if (!w || !at) return std::nullopt;
  const int step = parse_name(*at).step;
  const std::optional<std::string> first = r.first_divergence();
  if (step < w->step || (first && parse_name(*first).step < w->step)) return std::nullopt;
  Finding f = finding_of(
      FindingKind::RingWrap,
      "no bug of the model's ops: the error starts at step " + std::to_string(step) + " (" + *at +
          "), where the ring KV cache of capacity " + std::to_string(w->capacity) + " has wrapped (S = " +
          std::to_string(w->S) + " at step " + std::to_string(w->step) + ": positions < " +
          std::to_string(w->S - w->capacity) +
          " overwritten) and nothing diverges before it. HF attends to every position: compare the steps before "
          "the wrap, or give the cache at least the sequence's length");
  f.wrap_step = w->step;
  f.capacity = w->capacity;
  return f;
}

// Whether the ops failing on their own inputs lie in more than one (step,
// layer) (a step's sites outside the layers count as one more): an engine
// computing in a 16-bit type rounds the ops of every layer; one op rounded
// fails at its own name and its consumers' alone.
bool local_failures_spread(const LocalReport& l) {
  std::set<std::pair<int, int>> where;
  for (const LocalSite& s : l.sites)
    if (!s.pass) where.insert({s.parsed.step, s.parsed.kind == CanonName::Kind::Layer ? s.parsed.layer : -1});
  return where.size() > 1;
}

// Within the 16-bit noise is not enough (a float32 engine's small bug hides
// in it too): the candidate's error must also be of the 16-bit run's size,
// and where the ops were recomputed, more than one layer's must fail (a
// float32 engine rounding one op to 16 bits is that op's precision
// signature, not a dtype to declare).
std::optional<Finding> explain_weights_dtype(const BisectResult& r) {
  const std::optional<WeightsDtypeCheck>& c = r.evidence.weights_dtype;
  if (!c || !c->within_noise || !c->median_ratio || *c->median_ratio < 0.25) return std::nullopt;
  if (r.local.ran && r.local.first() && !local_failures_spread(r.local)) return std::nullopt;
  const std::string d = compute_dtype_name(c->dtype);
  Finding f = declaration(Declaration::ComputeDtype,
                          "no bug: judged as " + d + " (the dtype the weights are stored in) every name of the " +
                              "candidate is within the noise floor. It computes in " + d +
                              " (its matmul inputs rounded to the weights' dtype) while its manifest says float32; "
                              "declare \"dtype\": \"" + d + "\" in the dump's manifest");
  f.dtype = c->dtype;
  return f;
}

// A 16-bit cache by design: no op fails on its own inputs, or the only ones
// that do are attention products reading the cache within its rounding.
std::optional<Finding> explain_kv_cache(const BisectResult& r) {
  const std::optional<KvCacheRounding>& k = r.evidence.kv_cache;
  if (!k) return std::nullopt;
  const std::string d = compute_dtype_name(k->stored_as), key = kv_key(k->stored_as);
  std::string evidence;
  if (!r.local.first()) {
    evidence = "no bug: no op fails on its own inputs, and the candidate's KV cache holds every value rounded to " +
               d + " (a " + d + " cache by design, as llama.cpp's default). Declare it in the dump's manifest, " +
               "\"precision\": {\"kv_cache\": \"" + key + "\"}, so that the noise floor's second run stores its " +
               "cache the same way";
  } else if (k->products_only) {
    evidence =
        "no bug: the candidate's KV cache holds every value rounded to " + d +
        ", and the only ops that fail on their own inputs are attention products reading it (" +
        std::to_string(k->failing) + " sites, first " + k->first_product + ": local rmse " + num(k->product_rmse) +
        ", " + num(k->product_relative) + " of its rms, the size of " + d +
        " rounding): q and the probabilities multiplied by the cache in its own type, as ggml does" +
        (k->fused ? std::string(" (the dump has no attention probabilities: a fused flash attention, which also "
                                "sums the values in that type)")
                  : std::string("")) +
        ". Declare it in the dump's manifest, \"precision\": {\"kv_cache\": \"" + key +
        "\", \"matmul_input\": \"ggml\"" + (k->fused ? ", \"attention\": \"flash\"" : "") +
        "} (llama.cpp), so that the noise floor's second run computes the same way";
  } else {
    return std::nullopt;
  }
  Finding f = declaration(Declaration::KvCache, evidence);
  f.dtype = k->stored_as;
  return f;
}

// A tensor-parallel candidate: a rank check's exact finding names the bug
// with the rank; else the replay over its ranks that reproduces it.
std::optional<Finding> explain_tensor_parallel(const BisectResult& r) {
  const std::optional<TensorParallelEvidence>& t = r.evidence.tensor_parallel;
  if (!t) return std::nullopt;
  if (!t->bug.empty())
    return zoo_bug(Hypothesis{t->bug, std::nullopt}, BugBasis::Fingerprint, zoo_description(t->bug), t->text);
  if (t->fits.empty()) return std::nullopt;
  Finding f = zoo_bug(Hypothesis{t->fits.front(), std::nullopt}, BugBasis::Replay,
                      t->descriptions.empty() ? "" : t->descriptions.front(),
                      "replaying the candidate's forward calls through the impl over its " + std::to_string(t->ranks) +
                          " ranks with " + t->fits.front() + " reproduces its " + std::to_string(t->compared) +
                          " diverging names (worst " + sig::num(t->worst) + " of the agreement threshold); per bug: " +
                          t->tried);
  for (size_t k = 1; k < t->fits.size(); ++k) f.ambiguous.push_back(t->fits[k]);
  return f;
}

// The best hypothesis, when the replay or the local recompute supports it.
std::optional<Finding> explain_zoo_by_runs(const BisectResult& r) {
  const Diagnosis& d = r.diagnosis;
  if (!diagnosed(r) || d.ranked.empty() || !d.ranked.front().supported()) return std::nullopt;
  const HypothesisEvidence& best = d.ranked.front();
  std::string ev;
  if (best.hypothesis.value) ev = best.value_text + ": ";
  if (best.supported_by_local) ev += best.local_text;
  if (best.supported_by_replay) ev += (best.supported_by_local ? "; " : "") + best.replay_text;
  std::vector<std::string> prints;
  for (const auto& f : d.fingerprints)
    if (f.bug == best.hypothesis.bug) prints.push_back(f.evidence);
  if (!prints.empty()) ev += "; fingerprint: " + joined(prints, "; ");
  std::vector<std::string> ambiguous;
  for (size_t k = 1; k < d.ranked.size(); ++k) {
    const HypothesisEvidence& o = d.ranked[k];
    if (o.supported() && o.hypothesis.bug != best.hypothesis.bug && o.score >= best.score - 1e-9)
      ambiguous.push_back(o.hypothesis.str());
  }
  if (!ambiguous.empty()) ev += "; the evidence fits " + joined(ambiguous, ", ") + " equally well";
  const BugBasis basis = best.supported_by_replay && best.supported_by_local ? BugBasis::Both
                         : best.supported_by_replay                            ? BugBasis::Replay
                                                                               : BugBasis::LocalRecompute;
  Finding f = zoo_bug(best.hypothesis, basis, best.description, ev);
  f.ambiguous = ambiguous;
  return f;
}

// No run reproduces the candidate: a decisive fingerprint still names the bug
// (not where the clean run reproduces it: rounding, no bug's doing; nor where
// the localised op recomputed from the candidate's own inputs with another
// change reproduces its values: that is what the engine computed).
std::optional<Finding> explain_zoo_by_fingerprint(const BisectResult& r) {
  const Diagnosis& d = r.diagnosis;
  if (!diagnosed(r) || !d.clean_reproduces.empty()) return std::nullopt;
  const std::optional<std::string> at = r.localised_at();
  if (!d.signatures.empty() && at && d.signatures.front().name == *at && d.signatures.front().decisive &&
      d.signatures.front().recomputed)
    return std::nullopt;
  for (const Fingerprint& f : d.fingerprints) {
    if (!f.decisive) continue;
    std::string ev = f.evidence;
    const std::string numbers = closest(d);
    if (!numbers.empty()) ev += "; no replay or recompute reproduces the candidate (closest: " + numbers + ")";
    return zoo_bug(Hypothesis{f.bug, f.value}, BugBasis::Fingerprint, zoo_description(f.bug), ev);
  }
  return std::nullopt;
}

// A block reused before its sequence finished names the bug, whatever the
// sequence's own values could say.
std::optional<Finding> explain_block_reuse(const BisectResult& r) {
  const std::optional<BlockReuse>& b = r.evidence.block_reuse;
  if (!b) return std::nullopt;
  return zoo_bug(Hypothesis{b->bug, std::nullopt}, BugBasis::Fingerprint, zoo_description(b->bug),
                 b->text + "; seq" + std::to_string(b->seq) + " diverges from step " + std::to_string(b->step) +
                     " (engine iteration " + std::to_string(b->iteration) +
                     "), where another sequence has written into a block it still reads");
}

std::optional<Finding> explain_batch_replay(const BisectResult& r) {
  const std::optional<BatchReplayEvidence>& b = r.evidence.batch_replay;
  if (!b || b->fits.empty()) return std::nullopt;
  auto fit = [&](size_t k) { return Hypothesis{b->fits[k], k < b->values.size() ? b->values[k] : std::nullopt}; };
  Finding f = zoo_bug(fit(0), BugBasis::BatchReplay, b->descriptions.empty() ? "" : b->descriptions.front(),
                      "replaying the batch's " + std::to_string(b->iterations) +
                          " engine iterations through the continuous-batching engine with " + fit(0).str() +
                          " reproduces seq" + std::to_string(b->seq) + "'s " + std::to_string(b->compared) +
                          " diverging names (worst " + sig::num(b->worst) + " of the agreement threshold); per bug: " +
                          b->tried);
  for (size_t k = 1; k < b->fits.size(); ++k) f.ambiguous.push_back(fit(k).str());
  return f;
}

// The candidate agrees with the run making the profile's roundings far
// better (5x) than with the reference: the divergence is that design.
std::optional<Finding> explain_rounding_profile(const BisectResult& r) {
  const std::optional<RoundingProbe>& p = r.evidence.rounding;
  if (!p || !(p->to_plain > 0) || p->to_profile > 0.2 * p->to_plain) return std::nullopt;
  char buf[160];
  std::snprintf(buf, sizeof buf, "rmse %.3g against the impl with those roundings, %.3g against the reference",
                p->to_profile, p->to_plain);
  Finding f = declaration(Declaration::Profile,
                          "no bug: the model's weights are quantised and at " + p->at +
                              " the candidate computes what an engine rounding each matmul's inputs as ggml does "
                              "(to the dot-product type of each weight type) computes: " + buf +
                              ". Declare it in the dump's manifest, \"precision\": " + p->profile +
                              " (import --precision " + p->flags + "), so that the noise floor's second run rounds "
                              "the same way, and bisect again to judge the rest");
  f.profile = p->profile;
  return f;
}

// Every diverging name matches the reference after the same transform (the
// same kind and RoPE re-pairing), and nothing else diverges.
std::optional<Finding> explain_layout(const BisectResult& r) {
  if (!diagnosed(r)) return std::nullopt;
  std::optional<LayoutFinding> common;
  size_t explained = 0;
  for (const TensorComparison& t : r.global.tensors) {
    if (t.pass) continue;
    const LayoutFinding* match = nullptr;
    for (const LayoutFinding& f : t.findings)
      if (f.matches && f.kind != LayoutFinding::Kind::CacheLength) {
        match = &f;
        break;
      }
    if (!match) return std::nullopt;  // a divergence the layout does not explain
    if (!common) common = *match;
    if (match->kind != common->kind || match->rope != common->rope) return std::nullopt;
    ++explained;
  }
  if (!common || explained == 0) return std::nullopt;
  double worst = 0;
  for (const TensorComparison& t : r.global.tensors)
    for (const LayoutFinding& f : t.findings)
      if (f.matches) worst = std::max(worst, f.metrics.max_abs);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3g", worst);
  Finding f = finding_of(FindingKind::Layout,
                         "no bug: every one of the " + std::to_string(explained) +
                             " diverging names matches the reference after the same layout transform (" +
                             finding_kind_name(common->kind) +
                             (common->rope.empty() ? "" : ", RoPE pairs " + common->rope) + "; max error after it " +
                             buf + "), e.g. " + common->summary +
                             ". The dump holds the engine's own layout: apply that transform when exporting to "
                             "llm-dump/1");
  f.layout = *common;
  return f;
}

// A decisive signature at the localised site characterises a divergence
// outside the zoo.
std::optional<Finding> explain_signature(const BisectResult& r) {
  const std::vector<ErrorSignature>& s = r.diagnosis.signatures;
  const std::optional<std::string> at = r.localised_at();
  if (!diagnosed(r) || s.empty() || !at || !s.front().decisive || s.front().name != *at) return std::nullopt;
  const ErrorSignature& best = s.front();
  Finding f = finding_of(FindingKind::Signature, "no bug of the zoo; the error's signature at " + best.name + " is " +
                                                     best.kind + ": " + best.detail + ". " + nothing_fits_evidence(r));
  f.signature = best;
  return f;
}

std::optional<Finding> explain_nothing_fits(const BisectResult& r) {
  if (!diagnosed(r)) return finding_of(FindingKind::NotDiagnosed, "diagnosis not requested");
  return finding_of(FindingKind::NothingFits, nothing_fits_evidence(r));
}

const std::vector<Explainer>& explainers() {
  static const std::vector<Explainer> list = {
      {"passes", Need::Nothing, explain_passes},
      {"ring wrap", Need::Nothing, explain_ring_wrap},
      {"weights dtype", Need::Nothing, explain_weights_dtype},
      {"KV cache", Need::Nothing, explain_kv_cache},
      {"tensor parallel", Need::TensorParallel, explain_tensor_parallel},
      {"zoo bug by runs", Need::Diagnosis, explain_zoo_by_runs},
      {"zoo bug by fingerprint", Need::Diagnosis, explain_zoo_by_fingerprint},
      {"block reuse", Need::Nothing, explain_block_reuse},
      {"batch replay", Need::BatchReplay, explain_batch_replay},
      {"rounding profile", Need::Rounding, explain_rounding_profile},
      {"layout", Need::Diagnosis, explain_layout},
      {"signature", Need::Diagnosis, explain_signature},
      {"nothing fits", Need::Nothing, explain_nothing_fits},
  };
  return list;
}

void explain(BisectResult& r, const Gather& gather) {
  auto gathered = [&](Need n) {
    return std::find(r.evidence.gathered.begin(), r.evidence.gathered.end(), n) != r.evidence.gathered.end();
  };
  for (const Explainer& e : explainers()) {
    if (e.needs != Need::Nothing && gather && !gathered(e.needs) && gather(e.needs, r))
      r.evidence.gathered.push_back(e.needs);
    if (std::optional<Finding> f = e.explain(r)) {
      f->focus = r.localised_at().value_or("");
      r.finding = std::move(*f);
      return;
    }
  }
}

}  // namespace llmdiff::compare
