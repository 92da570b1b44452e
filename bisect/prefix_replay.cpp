#include "bisect/prefix_replay.h"

#include "compare/against.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sites.h"

namespace llmdiff::bisect {

namespace {

// The served tokens (docs/DUMP_FORMAT.md, "Prefix cache").
const std::string kCachedPrefix = step_name(0, compare::kCachedPrefixSite);

// `name` with its step moved by `shift` (names outside the steps as they are).
std::string shifted(const std::string& name, int shift) {
  CanonName c = parse_name(name);
  if (c.kind != CanonName::Kind::Step && c.kind != CanonName::Kind::Layer) return name;
  c.step += shift;
  return c.str();
}

}  // namespace

bool has_prefix_hit(const TensorSource& seq) { return seq.has(kCachedPrefix); }

PrefixReplayView::PrefixReplayView(const TensorSource& seq) : src_(seq) {
  const TensorData p = seq.get(kCachedPrefix);
  if (!p.is_int || p.shape.size() != 1 || p.i.empty())
    throw FormatError(seq.label(), kCachedPrefix,
                      "expected I64 [H], H > 0 (the tokens served from the prefix cache), got " + shape_str(p.shape));
  prefix_ = p.i;
  names_.push_back(step_name(0, Site::Tokens));
  for (const std::string& n : seq.names())
    if (n != kCachedPrefix) names_.push_back(shifted(n, 1));
  sort_canonical(names_);
  manifest_ = seq.manifest();
  manifest_.steps = seq.num_steps() + 1;
}

std::string PrefixReplayView::source_name(const std::string& name) const {
  const CanonName c = parse_name(name);
  if ((c.kind == CanonName::Kind::Step || c.kind == CanonName::Kind::Layer) && c.step == 0) return "";
  const std::string s = shifted(name, -1);
  return s != kCachedPrefix && src_.has(s) ? s : "";
}

bool PrefixReplayView::has(const std::string& name) const {
  return name == step_name(0, Site::Tokens) || !source_name(name).empty();
}

Shape PrefixReplayView::shape(const std::string& name) const {
  if (name == step_name(0, Site::Tokens)) return {int64_t(prefix_.size())};
  const std::string s = source_name(name);
  if (s.empty()) throw MissingTensorError(label(), name);
  return src_.shape(s);
}

TensorData PrefixReplayView::get(const std::string& name) const {
  TensorData t;
  if (name == step_name(0, Site::Tokens)) {
    t.shape = {int64_t(prefix_.size())};
    t.is_int = true;
    t.stored = DType::I64;
    t.i = prefix_;
  } else {
    const std::string s = source_name(name);
    if (s.empty()) throw MissingTensorError(label(), name);
    t = src_.get(s);
  }
  t.name = name;
  return t;
}

std::string PrefixReplayView::note() const {
  return "its cached prefix of " + std::to_string(prefix_.size()) +
         " tokens (step0.kv.cached_prefix) replayed as a call of its own, step 0, not compared; the dump's step n is "
         "step n + 1 here";
}

}  // namespace llmdiff::bisect
