#include "compare/finding.h"

#include <stdexcept>

namespace llmdiff::compare {

using nlohmann::json;

const char* kind_name(FindingKind k) {
  switch (k) {
    case FindingKind::Passes: return "passes";
    case FindingKind::ZooBug: return "zoo-bug";
    case FindingKind::Precision: return "precision";
    case FindingKind::Layout: return "layout";
    case FindingKind::RingWrap: return "kv-ring";
    case FindingKind::Signature: return "signature";
    case FindingKind::NothingFits: return "nothing-fits";
    case FindingKind::NotDiagnosed: return "not-diagnosed";
  }
  return "?";
}

const char* bug_basis_name(BugBasis b) {
  switch (b) {
    case BugBasis::Replay: return "replay";
    case BugBasis::LocalRecompute: return "local recompute";
    case BugBasis::Both: return "replay + local recompute";
    case BugBasis::Fingerprint: return "fingerprint";
    case BugBasis::BatchReplay: return "batch replay";
  }
  return "?";
}

const char* declaration_name(Declaration d) {
  switch (d) {
    case Declaration::ComputeDtype: return "dtype";
    case Declaration::KvCache: return "kv_cache";
    case Declaration::Profile: return "profile";
  }
  return "?";
}

namespace {

template <class E, size_t N>
E parse_enum(const std::string& s, const E (&values)[N], const char* (*name)(E), const char* what) {
  for (E v : values)
    if (s == name(v)) return v;
  throw std::invalid_argument(std::string("unknown finding ") + what + " \"" + s + "\"");
}

constexpr FindingKind kKinds[] = {FindingKind::Passes,    FindingKind::ZooBug,      FindingKind::Precision,
                                  FindingKind::Layout,    FindingKind::RingWrap,    FindingKind::Signature,
                                  FindingKind::NothingFits, FindingKind::NotDiagnosed};
constexpr BugBasis kBases[] = {BugBasis::Replay, BugBasis::LocalRecompute, BugBasis::Both, BugBasis::Fingerprint,
                               BugBasis::BatchReplay};
constexpr Declaration kDeclarations[] = {Declaration::ComputeDtype, Declaration::KvCache, Declaration::Profile};
constexpr LayoutFinding::Kind kLayoutKinds[] = {LayoutFinding::Kind::Permute, LayoutFinding::Kind::HeadSplit,
                                                LayoutFinding::Kind::RopePairing, LayoutFinding::Kind::CacheLength};

std::string precision_headline(const Finding& f) {
  switch (f.declare) {
    case Declaration::ComputeDtype: return std::string("declare ") + compute_dtype_name(f.dtype);
    case Declaration::KvCache: return std::string("declare the KV cache as ") + compute_dtype_name(f.dtype);
    case Declaration::Profile: return "declare \"precision\": " + f.profile;
  }
  return "";
}

}  // namespace

std::optional<Hypothesis> named_bug(const Finding& f) {
  if (f.kind != FindingKind::ZooBug) return std::nullopt;
  return f.bug;
}

std::string headline(const Finding& f) {
  switch (f.kind) {
    case FindingKind::Passes: return "no divergence";
    case FindingKind::ZooBug: return f.bug.str() + " (evidence: " + bug_basis_name(f.basis) + ")";
    case FindingKind::Precision: return "precision, not a bug: " + precision_headline(f);
    case FindingKind::Layout:
      return std::string("the engine's own layout, not a bug (") + finding_kind_name(f.layout.kind) +
             (f.layout.rope.empty() ? "" : ", RoPE pairs " + f.layout.rope) + ")";
    case FindingKind::RingWrap:
      return "a ring KV cache that wrapped, not a bug of the model's ops (capacity " + std::to_string(f.capacity) +
             ", wrapped at step " + std::to_string(f.wrap_step) + ")";
    case FindingKind::Signature:
      return "no bug of the zoo; the error's signature at " + f.signature.name + " is " + f.signature.kind;
    case FindingKind::NothingFits: return "no bug of the zoo fits";
    case FindingKind::NotDiagnosed: return "not diagnosed (the bug hypotheses were not tested)";
  }
  return "?";
}

const std::string& explanation(const Finding& f) { return f.evidence; }

std::optional<std::string> basis_label(const Finding& f) {
  switch (f.kind) {
    case FindingKind::ZooBug: return std::string(bug_basis_name(f.basis));
    case FindingKind::Precision:
    case FindingKind::Layout:
    case FindingKind::RingWrap:
    case FindingKind::Signature: return std::string(kind_name(f.kind));
    default: return std::nullopt;
  }
}

json finding_to_json(const Finding& f) {
  json j = {{"kind", kind_name(f.kind)},
            {"headline", headline(f)},
            {"explanation", explanation(f)},
            {"focus", f.focus.empty() ? json(nullptr) : json(f.focus)}};
  switch (f.kind) {
    case FindingKind::ZooBug:
      j["bug"] = f.bug.bug;
      j["value"] = f.bug.value ? json(*f.bug.value) : json(nullptr);
      j["hypothesis"] = f.bug.str();
      j["basis"] = bug_basis_name(f.basis);
      j["description"] = f.description;
      j["ambiguous"] = f.ambiguous;
      break;
    case FindingKind::Precision:
      j["declare"] = declaration_name(f.declare);
      if (f.declare == Declaration::Profile)
        j["profile"] = json::parse(f.profile);
      else
        j["dtype"] = compute_dtype_name(f.dtype);
      break;
    case FindingKind::Layout:
      j["layout"] = {
          {"kind", finding_kind_name(f.layout.kind)}, {"rope", f.layout.rope}, {"summary", f.layout.summary}};
      break;
    case FindingKind::RingWrap: j["ring"] = {{"step", f.wrap_step}, {"capacity", f.capacity}}; break;
    case FindingKind::Signature:
      j["signature"] = {{"name", f.signature.name},
                        {"kind", f.signature.kind},
                        {"detail", f.signature.detail},
                        {"fit", f.signature.fit},
                        {"decisive", f.signature.decisive},
                        {"recomputed", f.signature.recomputed}};
      break;
    default: break;
  }
  return j;
}

Finding finding_from_json(const json& j) {
  Finding f;
  f.kind = parse_enum(j.at("kind").get<std::string>(), kKinds, kind_name, "kind");
  f.evidence = j.at("explanation").get<std::string>();
  if (j.at("focus").is_string()) f.focus = j.at("focus").get<std::string>();
  switch (f.kind) {
    case FindingKind::ZooBug:
      f.bug.bug = j.at("bug").get<std::string>();
      if (j.at("value").is_number()) f.bug.value = j.at("value").get<double>();
      f.basis = parse_enum(j.at("basis").get<std::string>(), kBases, bug_basis_name, "basis");
      f.description = j.at("description").get<std::string>();
      f.ambiguous = j.at("ambiguous").get<std::vector<std::string>>();
      break;
    case FindingKind::Precision:
      f.declare = parse_enum(j.at("declare").get<std::string>(), kDeclarations, declaration_name, "declaration");
      if (f.declare == Declaration::Profile)
        f.profile = j.at("profile").dump();
      else
        f.dtype = parse_compute_dtype(j.at("dtype").get<std::string>());
      break;
    case FindingKind::Layout: {
      const json& l = j.at("layout");
      f.layout.kind = parse_enum(l.at("kind").get<std::string>(), kLayoutKinds, finding_kind_name, "layout kind");
      f.layout.rope = l.at("rope").get<std::string>();
      f.layout.summary = l.at("summary").get<std::string>();
      f.layout.matches = true;
      break;
    }
    case FindingKind::RingWrap:
      f.wrap_step = j.at("ring").at("step").get<int>();
      f.capacity = j.at("ring").at("capacity").get<int64_t>();
      break;
    case FindingKind::Signature: {
      const json& s = j.at("signature");
      f.signature.name = s.at("name").get<std::string>();
      f.signature.kind = s.at("kind").get<std::string>();
      f.signature.detail = s.at("detail").get<std::string>();
      f.signature.fit = s.at("fit").get<double>();
      f.signature.decisive = s.at("decisive").get<bool>();
      f.signature.recomputed = s.value("recomputed", false);
      break;
    }
    default: break;
  }
  return f;
}

}  // namespace llmdiff::compare
