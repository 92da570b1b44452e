#include "bisect/spec_replay.h"

#include "compare/against.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/rows.h"
#include "dumps/contract/sites.h"

namespace llmdiff::bisect {

namespace {

const std::string kAccepted = compare::kSpecAcceptedSite;  // docs/DUMP_FORMAT.md, "Speculative decoding"

// `t` with its axis `axis` cut to its first `n` entries.
TensorData first_along(const TensorData& t, int axis, int64_t n) {
  if (axis < 0 || axis >= int(t.shape.size()) || t.shape[size_t(axis)] <= n) return t;
  std::vector<int64_t> keep(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) keep[size_t(i)] = i;
  TensorData o = select_rows(t, keep, axis);
  o.rows.clear();
  return o;
}

// Row `row` of `t` along `axis`, the axis kept (size 1).
TensorData row_of(const TensorData& t, int axis, int64_t row) {
  TensorData o = select_rows(t, {row}, axis);
  o.rows.clear();
  return o;
}

}  // namespace

bool has_verify_calls(const TensorSource& seq) {
  for (const std::string& n : seq.names()) {
    const CanonName c = parse_name(n);
    if (c.kind == CanonName::Kind::Step && c.site == kAccepted) return true;
  }
  return false;
}

SpecSplitView::SpecSplitView(const TensorSource& seq) : src_(seq) {
  const compare::SequenceTimeline tl = compare::sequence_timeline(seq);
  std::vector<std::vector<int>> pieces_of(tl.calls.size());  // source step -> view steps
  for (const compare::CallSpan& c : tl.calls) {
    const bool verify = seq.has(step_name(c.step, kAccepted));
    if (verify) verify_steps_.push_back(c.step);
    for (int64_t j = 0; j < (verify ? c.kept : 1); ++j) {
      pieces_of[size_t(c.step)].push_back(int(pieces_.size()));
      pieces_.push_back({c.step, verify ? j : -1, c.start + (verify ? j : 0), c.tokens});
    }
  }
  for (const std::string& n : seq.names()) {
    CanonName c = parse_name(n);
    if (c.kind != CanonName::Kind::Step && c.kind != CanonName::Kind::Layer) {
      names_.push_back(n);  // rope.inv_freq, generated
      continue;
    }
    if (c.step < 0 || c.step >= int(pieces_of.size())) continue;
    for (int v : pieces_of[size_t(c.step)]) {
      const Piece& p = pieces_[size_t(v)];
      CanonName out = c;
      out.step = v;
      if (p.row < 0) {
        names_.push_back(out.str());
        continue;
      }
      const std::optional<Site> s = find_site(c.site);
      if (!s || site_info(*s).scope == SiteScope::Record) continue;  // kv.*, spec.*, rows, sample.*
      if (*s == Site::LastHidden && p.row != p.tokens - 1 && !seq.has(step_name(p.step, Site::FinalNorm))) continue;
      if (*s == Site::NextLogits && p.row != p.tokens - 1 && !seq.has(step_name(p.step, Site::Logits))) continue;
      if (site_info(*s).token_axis >= 0 && seq.has(step_name(p.step, Site::Rows)))
        throw UsageError(seq.label() + ": verify call " + std::to_string(p.step) +
                         " holds a row subset (step" + std::to_string(p.step) +
                         ".rows): its kept rows cannot be replayed as calls of their own");
      names_.push_back(out.str());
    }
  }
  sort_canonical(names_);
  known_.insert(names_.begin(), names_.end());
  manifest_ = seq.manifest();
  manifest_.steps = int(pieces_.size());
}

std::string SpecSplitView::at_source(const std::string& name, const Piece& p) const {
  CanonName c = parse_name(name);
  c.step = p.step;
  return c.str();
}

TensorData SpecSplitView::get(const std::string& name) const {
  if (!known_.count(name)) throw MissingTensorError(label(), name);
  const CanonName c = parse_name(name);
  if (c.kind != CanonName::Kind::Step && c.kind != CanonName::Kind::Layer) return src_.get(name);
  const Piece& p = pieces_[size_t(c.step)];
  TensorData t;
  const std::optional<Site> s = find_site(c.site);
  if (p.row < 0 || !s) {
    t = src_.get(at_source(name, p));
  } else if ((*s == Site::LastHidden || *s == Site::NextLogits) && p.row != p.tokens - 1) {
    // Row j of the call's final_norm / logits.
    const Site rows_site = *s == Site::LastHidden ? Site::FinalNorm : Site::Logits;
    t = row_of(src_.get(step_name(p.step, rows_site)), 0, p.row);
    t.shape = {t.shape.back()};
  } else if (*s == Site::LastHidden || *s == Site::NextLogits) {
    t = src_.get(at_source(name, p));
  } else {
    const SiteInfo& info = site_info(*s);
    t = src_.get(at_source(name, p));
    if (info.token_axis >= 0) t = row_of(t, info.token_axis, p.row);
    t = first_along(t, info.key_axis, p.start + 1);  // the positions row j sees
  }
  t.name = name;
  return t;
}

std::string SpecSplitView::note() const {
  std::string steps;
  for (int s : verify_steps_) steps += (steps.empty() ? "" : ", ") + std::to_string(s);
  return "speculative verify call(s) " + steps +
         " replayed as the one-token calls of their kept rows (the rolled-back rows not judged); the view has " +
         std::to_string(pieces_.size()) + " calls";
}

}  // namespace llmdiff::bisect
