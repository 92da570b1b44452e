#include "compare/against.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <tuple>
#include <unordered_map>

#include "compare/noise_floor.h"
#include "compare/report.h"
#include "dumps/base/errors.h"
#include "dumps/contract/calls.h"
#include "dumps/contract/engine.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sites.h"
#include "dumps/sampling/sampling.h"

namespace llmdiff::compare {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The metric of a noise-floor judgement (compare/noise_floor.h).
constexpr const char* kNoiseMetric = "rmse vs float64";

std::vector<int64_t> ints_of(const TensorSource& src, const std::string& name, const char* expected) {
  const TensorData t = src.get(name);
  if (!t.is_int || t.shape.size() != 1) throw FormatError(src.label(), name, std::string("expected ") + expected);
  return t.i;
}

}  // namespace

std::vector<int64_t> SequenceTimeline::prompt() const {
  return std::vector<int64_t>(tokens.begin(), tokens.begin() + std::min<int64_t>(prompt_length, int64_t(tokens.size())));
}

SequenceTimeline sequence_timeline(const TensorSource& seq) {
  SequenceTimeline tl;
  // The calls as the format places them (dumps/contract/calls.h): after a
  // prefix-cache hit, each verify call's rejected drafts rolled back.
  tl.tokens = cached_prefix(seq);
  tl.cached_prefix = int64_t(tl.tokens.size());
  const std::vector<std::vector<int64_t>> steps = seq.step_tokens();
  const std::vector<CallSpan> spans = call_spans(seq);
  int64_t length = tl.cached_prefix;
  for (int n = 0; n < int(steps.size()); ++n) {
    PlacedCall c;
    c.step = n;
    c.start = spans[size_t(n)].P;
    c.tokens = spans[size_t(n)].T;
    c.kept = c.tokens - spans[size_t(n)].rollback;
    const std::string accepted = step_name(n, Site::SpecAccepted);
    if (seq.has(accepted)) {
      const std::vector<int64_t> a = ints_of(seq, accepted, "I64 [1] (the drafts accepted)");
      if (a.size() != 1 || a[0] < 0 || a[0] >= c.tokens)
        throw FormatError(seq.label(), accepted,
                          "expected one count of accepted drafts in 0 .. " + std::to_string(c.tokens - 1) +
                              " (the call verifies " + std::to_string(c.tokens - 1) + " drafts)");
    }
    tl.tokens.resize(size_t(c.start));
    tl.tokens.insert(tl.tokens.end(), steps[size_t(n)].begin(), steps[size_t(n)].begin() + c.kept);
    length = c.start + c.kept;
    tl.calls.push_back(c);
  }
  if (seq.has("generated")) tl.generated = ints_of(seq, "generated", "I64 [M] (the generated tokens)");
  // Every generated token but the last was fed back as the next call's input.
  const int64_t fed = std::max<int64_t>(int64_t(tl.generated.size()) - 1, 0);
  tl.prompt_length = std::max<int64_t>(length - fed, 0);
  return tl;
}

const char* verdict_name(PairVerdict v) {
  switch (v) {
    case PairVerdict::Legitimate: return "legitimate";
    case PairVerdict::BugInA: return "bug-in-a";
    case PairVerdict::BugInB: return "bug-in-b";
    case PairVerdict::BugInBoth: return "bug-in-both";
  }
  return "?";
}

double PlaceDiff::ratio() const {
  if (rmse == 0) return 0;
  return threshold > 0 ? rmse / threshold : kInf;
}

std::string PlaceDiff::where() const {
  return "position " + std::to_string(position) + ", " + (layer >= 0 ? "layers." + std::to_string(layer) + "." : "") +
         site;
}

std::string GreedyFlip::str() const {
  std::string s = "greedy flip at generated[" + std::to_string(index) + "] (position " + std::to_string(position) +
                  "): A " + std::to_string(token_a) + ", B " + std::to_string(token_b);
  if (!settled) return s + ", not settled (no float64 logits made)";
  s += ", float64 margin " + fmt_num(margin);
  if (!noise) return s + ", not settled (neither side holds the logits of that position)";
  s += near_tie ? " <= " : " > ";
  s += fmt_num(allowed) + " (2 x the sides' logit error " + fmt_num(*noise) + " + floor)";
  if (near_tie) return s + ": a near-tie";
  return s + ": beyond the rounding noise; the float64 argmax is " + std::to_string(truth_argmax);
}

int AgainstResult::bugs() const {
  return int(std::count_if(pairs.begin(), pairs.end(),
                           [](const SequencePair& p) { return p.verdict != PairVerdict::Legitimate; }));
}

int AgainstResult::exit_code() const { return bugs() > 0 || a.sampler_fails() || b.sampler_fails() ? 1 : 0; }

namespace {

// ---------------------------------------------------------------------------
// One side's sequence as the pairing reads it.

struct SideSeq {
  const TensorSource* view = nullptr;
  SequenceTimeline tl;
  std::unordered_map<std::string, double> thresholds;  // each name's noise-floor threshold

  double threshold(const std::string& name) const {
    auto it = thresholds.find(name);
    return it == thresholds.end() ? 0 : it->second;
  }
  // The call whose kept rows hold position p (kept rows never overlap).
  const PlacedCall* call_at(int64_t p) const {
    auto it = std::upper_bound(tl.calls.begin(), tl.calls.end(), p,
                               [](int64_t q, const PlacedCall& c) { return q < c.start; });
    if (it == tl.calls.begin()) return nullptr;
    --it;
    return p < it->start + it->kept ? &*it : nullptr;
  }
};

std::unordered_map<std::string, double> noise_thresholds(const BisectResult& r) {
  std::unordered_map<std::string, double> m;
  for (const TensorComparison& t : r.global.tensors)
    if (t.judgement.judged && t.judgement.metric == kNoiseMetric) m[t.name] = t.judgement.threshold;
  return m;
}

// The last tensor read, kept while the places walk its rows.
class TensorCache {
 public:
  const TensorData& get(const TensorSource& src, const std::string& name) {
    if (name != name_) {
      data_ = src.get(name);
      name_ = name;
    }
    return data_;
  }

 private:
  std::string name_;
  TensorData data_;
};

// ---------------------------------------------------------------------------
// Places: every site of the canonical table, by its order in a step.

// (group, layer, rank): sites before the layers, each layer's, after them.
using SiteOrder = std::tuple<int, int, int>;
// (position, group, layer, rank): the canonical order of places.
using PlaceOrder = std::tuple<int64_t, int, int, int>;

struct SiteSeries {
  std::string site;
  int layer = -1;
  const SiteInfo* info = nullptr;
  std::vector<std::pair<int, std::string>> a, b;  // (step, name) of each side, ascending step
};

void add_names(const TensorSource& src, std::map<SiteOrder, SiteSeries>& series, bool side_a) {
  for (const std::string& n : src.names()) {
    const CanonName c = parse_name(n);
    if (c.kind != CanonName::Kind::Step && c.kind != CanonName::Kind::Layer) continue;
    const std::optional<Site> s = find_site(c.site);
    if (!s) continue;  // outside the site table
    const SiteInfo& info = site_info(*s);
    if (info.scope == SiteScope::Record) continue;  // bookkeeping (rows, kv.*, sample.*): the settings' own
    const int group = info.scope == SiteScope::BeforeLayers ? 0 : info.scope == SiteScope::Layer ? 1 : 2;
    SiteSeries& e = series[{group, c.layer, site_rank(c.site)}];
    e.site = c.site;
    e.layer = c.layer;
    e.info = &info;
    (side_a ? e.a : e.b).emplace_back(c.step, n);
  }
  for (auto& [k, e] : series) {
    std::sort(e.a.begin(), e.a.end());
    std::sort(e.b.begin(), e.b.end());
  }
}

// Flat offsets of row `row` along `axis` of `shape`, the key axis (>= 0)
// cut to its first `keys` entries; `dims` gets the row's shape.
std::vector<int64_t> row_offsets(const Shape& shape, int axis, int64_t row, int key_axis, int64_t keys,
                                 Shape* dims) {
  const int n = int(shape.size());
  std::vector<int64_t> limit(shape.begin(), shape.end()), stride(size_t(n), 1);
  for (int d = n - 2; d >= 0; --d) stride[size_t(d)] = stride[size_t(d + 1)] * shape[size_t(d + 1)];
  if (axis >= 0) limit[size_t(axis)] = 1;
  if (key_axis >= 0) limit[size_t(key_axis)] = std::min(keys, shape[size_t(key_axis)]);
  dims->clear();
  for (int d = 0; d < n; ++d)
    if (d != axis) dims->push_back(limit[size_t(d)]);
  int64_t total = 1;
  for (int64_t l : limit) total *= l;
  std::vector<int64_t> out;
  out.reserve(size_t(std::max<int64_t>(total, 0)));
  if (total <= 0) return out;
  std::vector<int64_t> idx(size_t(n), 0);
  const int64_t base = axis >= 0 ? row * stride[size_t(axis)] : 0;
  for (int64_t k = 0; k < total; ++k) {
    int64_t off = base;
    for (int d = 0; d < n; ++d) off += idx[size_t(d)] * stride[size_t(d)];
    out.push_back(off);
    for (int d = n - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < limit[size_t(d)]) break;
      idx[size_t(d)] = 0;
    }
  }
  return out;
}

// Compares the values at `oa` of `a` with those at `ob` of `b` into `d`.
void compare_values(const TensorData& a, const std::vector<int64_t>& oa, const TensorData& b,
                    const std::vector<int64_t>& ob, PlaceDiff& d) {
  d.count = int64_t(oa.size());
  d.integer = a.is_int && b.is_int;
  double squares = 0;
  for (size_t k = 0; k < oa.size(); ++k) {
    double x, y;
    bool differ;
    if (d.integer) {
      const int64_t i = a.i[size_t(oa[k])], j = b.i[size_t(ob[k])];
      differ = i != j;
      x = double(i);
      y = double(j);
    } else {
      const float fx = a.is_int ? float(a.i[size_t(oa[k])]) : a.f[size_t(oa[k])];
      const float fy = b.is_int ? float(b.i[size_t(ob[k])]) : b.f[size_t(ob[k])];
      differ = std::memcmp(&fx, &fy, sizeof fx) != 0;
      x = fx;
      y = fy;
    }
    if (!differ) continue;
    ++d.differing;
    double e = std::isnan(x) || std::isnan(y) ? kInf : std::fabs(x - y);
    if (std::isnan(e)) e = kInf;  // inf - inf
    squares += e * e;
    if (d.at < 0 || e > d.max_abs) {
      d.max_abs = e;
      d.at = int64_t(k);
      d.value_a = x;
      d.value_b = y;
    }
  }
  d.rmse = d.count > 0 ? std::sqrt(squares / double(d.count)) : 0;
}

// The index along the token axis of `t` holding token row `row` of its call
// (a row subset holds some rows only); -1 when it does not hold it.
int64_t held_row(const TensorData& t, int axis, int64_t row) {
  if (axis >= int(t.shape.size())) return -1;
  if (t.rows.empty()) return row < t.shape[size_t(axis)] ? row : -1;
  auto it = std::lower_bound(t.rows.begin(), t.rows.end(), row);
  return it != t.rows.end() && *it == row ? int64_t(it - t.rows.begin()) : -1;
}

// What comparing a legitimate pair gathers.
struct Walk {
  const SideSeq& a;
  const SideSeq& b;
  int64_t common = 0;  // positions with the same inputs
  SequencePair& pair;
  std::optional<PlaceOrder> first_at;
  std::map<std::string, int> skipped;  // site -> places whose row shapes differ

  void record(PlaceDiff d, const PlaceOrder& order) {
    ++pair.compared;
    if (d.differing == 0) return;
    ++pair.differing;
    if (!d.integer) {
      d.threshold = std::max(a.threshold(d.name_a), b.threshold(d.name_b));
      if (!pair.largest || d.ratio() > pair.largest->ratio()) pair.largest = d;
    }
    if (!first_at || order < *first_at) {
      first_at = order;
      pair.first_difference = d;
    }
  }

  // A per-token site: row by row, each position both sides computed.
  void per_token(const SiteSeries& s, const SiteOrder& so) {
    const int axis = s.info->token_axis, key_axis = s.info->key_axis;
    TensorCache ca, cb;
    std::map<int, const std::string*> b_names;
    for (const auto& [step, name] : s.b) b_names[step] = &name;
    for (const auto& [step, name] : s.a) {
      if (step >= int(a.tl.calls.size())) continue;
      const PlacedCall& call = a.tl.calls[size_t(step)];
      for (int64_t t = 0; t < call.kept && call.start + t < common; ++t) {
        const int64_t p = call.start + t;
        const PlacedCall* other = b.call_at(p);
        if (!other) continue;  // B did not compute it (a prefix-cache hit)
        auto bn = b_names.find(other->step);
        if (bn == b_names.end()) continue;
        const TensorData& ta = ca.get(*a.view, name);
        const TensorData& tb = cb.get(*b.view, *bn->second);
        const int64_t ra = held_row(ta, axis, t), rb = held_row(tb, axis, p - other->start);
        if (ra < 0 || rb < 0) continue;
        Shape da, db;
        const std::vector<int64_t> oa = row_offsets(ta.shape, axis, ra, key_axis, p + 1, &da);
        const std::vector<int64_t> ob = row_offsets(tb.shape, axis, rb, key_axis, p + 1, &db);
        if (da != db) {
          ++skipped[s.site];
          continue;
        }
        PlaceDiff d;
        d.position = p;
        d.layer = s.layer;
        d.site = s.site;
        d.name_a = name;
        d.name_b = *bn->second;
        d.row_a = ra;
        d.row_b = rb;
        compare_values(ta, oa, tb, ob, d);
        record(std::move(d), {p, std::get<0>(so), std::get<1>(so), std::get<2>(so)});
      }
    }
  }

  // A site that is not per token: whole tensors of calls of both sides that
  // end at the same position, with nothing rolled back.
  void whole(const SiteSeries& s, const SiteOrder& so) {
    std::map<int64_t, const std::pair<int, std::string>*> b_by_end;
    for (const auto& e : s.b) {
      if (e.first >= int(b.tl.calls.size())) continue;
      const PlacedCall& c = b.tl.calls[size_t(e.first)];
      if (c.kept == c.tokens) b_by_end[c.end()] = &e;
    }
    for (const auto& [step, name] : s.a) {
      if (step >= int(a.tl.calls.size())) continue;
      const PlacedCall& c = a.tl.calls[size_t(step)];
      if (c.kept != c.tokens || c.end() > common) continue;
      auto other = b_by_end.find(c.end());
      if (other == b_by_end.end()) continue;
      const TensorData ta = a.view->get(name), tb = b.view->get(other->second->second);
      if (ta.shape != tb.shape) {
        ++skipped[s.site];
        continue;
      }
      Shape dims;
      const std::vector<int64_t> offsets = row_offsets(ta.shape, -1, 0, -1, 0, &dims);
      PlaceDiff d;
      d.position = c.end() - 1;
      d.layer = s.layer;
      d.site = s.site;
      d.name_a = name;
      d.name_b = other->second->second;
      compare_values(ta, offsets, tb, offsets, d);
      const PlaceOrder order{d.position, std::get<0>(so), std::get<1>(so), std::get<2>(so)};
      record(std::move(d), order);
    }
  }
};

// The logits row of position p on one side: a row of `logits`, else the
// `next_logits` of a call ending there.
std::optional<std::vector<float>> logits_at(const SideSeq& s, int64_t p) {
  const PlacedCall* c = s.call_at(p);
  if (!c) return std::nullopt;
  const std::string logits = step_name(c->step, Site::Logits);
  if (s.view->has(logits)) {
    const TensorData t = s.view->get(logits);
    const int64_t r = held_row(t, 0, p - c->start);
    if (r >= 0 && t.shape.size() == 2) {
      const int64_t v = t.shape[1];
      return std::vector<float>(t.f.begin() + r * v, t.f.begin() + (r + 1) * v);
    }
  }
  const std::string next = step_name(c->step, Site::NextLogits);
  if (p == c->end() - 1 && c->kept == c->tokens && s.view->has(next)) return s.view->get(next).floats();
  return std::nullopt;
}

bool samples(const TensorSource& view) {
  const std::optional<SamplingParams> p = manifest_sampling(view.manifest(), view.label());
  return p && p->do_sample;
}

// The greedy tokens of a legitimate pair: their first difference, settled
// by the float64 margin.
void judge_flip(const SideSeq& a, const SideSeq& b, const TruthLogits& truth, SequencePair& pair) {
  const std::vector<int64_t>&ga = a.tl.generated, &gb = b.tl.generated;
  const size_t n = std::min(ga.size(), gb.size());
  if (ga.size() != gb.size() && !ga.empty() && !gb.empty())
    pair.notes.push_back("A generated " + std::to_string(ga.size()) + " tokens, B " + std::to_string(gb.size()) +
                         ": the first " + std::to_string(n) + " compared");
  size_t g = 0;
  while (g < n && ga[g] == gb[g]) ++g;
  if (g == n) return;
  if (samples(*a.view) || samples(*b.view)) {
    pair.notes.push_back("the generated tokens differ at index " + std::to_string(g) +
                         ": sampled draws, not greedy picks (each side's sampler is checked on its own logits)");
    return;
  }
  GreedyFlip f;
  f.index = int64_t(g);
  f.position = a.tl.prompt_length + int64_t(g) - 1;
  f.token_a = ga[g];
  f.token_b = gb[g];
  if (truth && f.position >= 0 && f.position < int64_t(a.tl.tokens.size())) {
    const std::vector<int64_t> fed(a.tl.tokens.begin(), a.tl.tokens.begin() + f.position + 1);
    const std::vector<float> t = truth(fed);
    if (f.token_a >= 0 && f.token_b >= 0 && f.token_a < int64_t(t.size()) && f.token_b < int64_t(t.size())) {
      f.settled = true;
      f.truth_a = t[size_t(f.token_a)];
      f.truth_b = t[size_t(f.token_b)];
      f.truth_argmax = argmax_first(t);
      f.margin = std::fabs(f.truth_a - f.truth_b);
      for (const SideSeq* s : {&a, &b}) {
        const std::optional<std::vector<float>> row = logits_at(*s, f.position);
        if (!row || row->size() != t.size()) continue;
        double e = 0;
        for (size_t i = 0; i < t.size(); ++i) e = std::max(e, double(std::fabs((*row)[i] - t[i])));
        f.noise = std::max(f.noise.value_or(0.0), e);
      }
      if (f.noise) {
        f.allowed = 2.0 * *f.noise + noise_floor_abs(std::max(std::fabs(f.truth_a), std::fabs(f.truth_b)));
        f.near_tie = f.margin <= f.allowed;
      }
    }
  }
  // A pick beyond the rounding noise is the bug of the side whose token is
  // the lower in float64.
  if (f.settled && f.noise && !f.near_tie) pair.verdict = f.truth_a < f.truth_b ? PairVerdict::BugInA : PairVerdict::BugInB;
  pair.flip = f;
}

void compare_pair(const SideSeq& a, const SideSeq& b, const TruthLogits& truth, SequencePair& pair) {
  int64_t common = 0;
  const int64_t n = int64_t(std::min(a.tl.tokens.size(), b.tl.tokens.size()));
  while (common < n && a.tl.tokens[size_t(common)] == b.tl.tokens[size_t(common)]) ++common;
  pair.common_positions = common;
  std::map<SiteOrder, SiteSeries> series;
  add_names(*a.view, series, true);
  add_names(*b.view, series, false);
  Walk w{a, b, common, pair, std::nullopt, {}};
  for (const auto& [order, s] : series) {
    if (s.a.empty() || s.b.empty()) continue;
    if (s.info->token_axis >= 0)
      w.per_token(s, order);
    else
      w.whole(s, order);
  }
  for (const auto& [site, count] : w.skipped)
    pair.notes.push_back(site + ": " + std::to_string(count) + " places not compared (the two rows' shapes differ)");
  judge_flip(a, b, truth, pair);
}

std::string side_reason(const AgainstResult& r, const SequencePair& p, bool side_a) {
  const AgainstSequence& s = side_a ? r.a.sequences[p.a] : r.b.sequences[p.b];
  if (!s.ok()) return headline(s.bisect.result);
  if (p.flip) return "its greedy pick is the lower in float64: " + p.flip->str();
  return "";
}

}  // namespace

AgainstResult pair_against(AgainstSideInput a_in, AgainstSideInput b_in, const TruthLogits& truth) {
  AgainstResult r;
  std::vector<SideSeq> seqs[2];
  AgainstSideInput* in[2] = {&a_in, &b_in};
  AgainstSide* out[2] = {&r.a, &r.b};
  for (int k = 0; k < 2; ++k) {
    AgainstSideInput& i = *in[k];
    AgainstSide& o = *out[k];
    o.label = i.label;
    o.several = i.several;
    o.notes = std::move(i.notes);
    o.sampling = std::move(i.sampling);
    if (i.views.size() != i.sequences.size())
      throw Error(i.label + ": " + std::to_string(i.views.size()) + " sequence views for " +
                  std::to_string(i.sequences.size()) + " bisections");
    for (size_t s = 0; s < i.sequences.size(); ++s) {
      SideSeq ss;
      ss.view = i.views[s];
      ss.tl = sequence_timeline(*ss.view);
      ss.thresholds = noise_thresholds(i.sequences[s].result);
      AgainstSequence as;
      as.prompt = ss.tl.prompt();
      as.cached_prefix = ss.tl.cached_prefix;
      as.calls = int(ss.tl.calls.size());
      as.positions = int64_t(ss.tl.tokens.size());
      as.generated = ss.tl.generated;
      as.bisect = std::move(i.sequences[s]);
      o.sequences.push_back(std::move(as));
      seqs[k].push_back(std::move(ss));
    }
    if (r.model.empty() && !o.sequences.empty()) r.model = o.sequences.front().bisect.result.model;
  }
  // Pairs by prompt, in A's order; a repeated prompt pairs in each side's order.
  std::vector<bool> taken(r.b.sequences.size(), false);
  for (size_t i = 0; i < r.a.sequences.size(); ++i) {
    size_t j = 0;
    while (j < r.b.sequences.size() && (taken[j] || r.b.sequences[j].prompt != r.a.sequences[i].prompt)) ++j;
    if (j == r.b.sequences.size()) {
      r.only_a.push_back(i);
      continue;
    }
    taken[j] = true;
    SequencePair p;
    p.a = i;
    p.b = j;
    const bool ok_a = r.a.sequences[i].ok(), ok_b = r.b.sequences[j].ok();
    if (ok_a && ok_b)
      compare_pair(seqs[0][i], seqs[1][j], truth, p);
    else
      p.verdict = !ok_a && !ok_b ? PairVerdict::BugInBoth : !ok_a ? PairVerdict::BugInA : PairVerdict::BugInB;
    r.pairs.push_back(std::move(p));
  }
  for (size_t j = 0; j < taken.size(); ++j)
    if (!taken[j]) r.only_b.push_back(j);
  if (r.pairs.empty())
    throw UsageError(r.a.label + " and " + r.b.label +
                     " share no request: no prompt of a sequence of A is the prompt of a sequence of B");
  auto seq_names = [](const AgainstSide& s, const std::vector<size_t>& idx) {
    std::string o;
    for (size_t i : idx) o += (o.empty() ? "seq" : ", seq") + std::to_string(s.sequences[i].bisect.seq);
    return o;
  };
  if (!r.only_a.empty())
    r.notes.push_back("only in A (no sequence of B has its prompt): " + seq_names(r.a, r.only_a));
  if (!r.only_b.empty())
    r.notes.push_back("only in B (no sequence of A has its prompt): " + seq_names(r.b, r.only_b));
  return r;
}

std::string pair_label(const AgainstResult& r, const SequencePair& p) {
  return "seq" + std::to_string(r.a.sequences[p.a].bisect.seq) + " (A) / seq" +
         std::to_string(r.b.sequences[p.b].bisect.seq) + " (B)";
}

std::string headline(const AgainstResult& r, const SequencePair& p) {
  if (p.verdict != PairVerdict::Legitimate) {
    std::string o;
    if (p.bug_in_a()) o = "a bug in A: " + side_reason(r, p, true);
    if (p.bug_in_b()) o += (o.empty() ? "" : "; ") + std::string("a bug in B: ") + side_reason(r, p, false);
    return o;
  }
  std::string o = "legitimate: both within their noise floors";
  if (!p.first_difference) {
    o += "; identical bit for bit at the " + std::to_string(p.compared) + " places compared over " +
         std::to_string(p.common_positions) + " positions";
  } else {
    const PlaceDiff& f = *p.first_difference;
    o += "; first difference at " + f.where() + " (max |A-B| " + fmt_num(f.max_abs) + ")";
    if (p.largest)
      o += "; largest " + fmt_num(p.largest->ratio(), 2) + " x the noise-floor threshold at " + p.largest->where() +
           " (rmse of A-B " + fmt_num(p.largest->rmse) + ", threshold " + fmt_num(p.largest->threshold) +
           ", max |A-B| " + fmt_num(p.largest->max_abs) + ")";
  }
  if (p.flip) o += "; " + p.flip->str();
  return o;
}

std::string headline(const AgainstResult& r) {
  std::string sampler;
  if (r.a.sampler_fails()) sampler += "; A's sampler fails its check";
  if (r.b.sampler_fails()) sampler += "; B's sampler fails its check";
  std::string unpaired;
  if (!r.only_a.empty()) unpaired += "; " + std::to_string(r.only_a.size()) + " sequence(s) only in A";
  if (!r.only_b.empty()) unpaired += "; " + std::to_string(r.only_b.size()) + " sequence(s) only in B";
  for (const SequencePair& p : r.pairs)
    if (p.verdict != PairVerdict::Legitimate) {
      const int n = r.bugs();
      return pair_label(r, p) + ": " + headline(r, p) +
             (n > 1 ? " (" + std::to_string(n) + " of " + std::to_string(r.pairs.size()) + " pairs have a bug)" : "") +
             unpaired + sampler;
    }
  std::string o = "legitimate: " + std::to_string(r.pairs.size()) + " sequence" + (r.pairs.size() == 1 ? "" : "s") +
                  " aligned by prompt, each side within its noise floor";
  const SequencePair* worst = nullptr;
  int ties = 0, unsettled = 0;
  for (const SequencePair& p : r.pairs) {
    if (p.largest && (!worst || p.largest->ratio() > worst->largest->ratio())) worst = &p;
    if (p.flip) ++(p.flip->near_tie ? ties : unsettled);
  }
  if (worst)
    o += "; largest difference " + fmt_num(worst->largest->ratio(), 2) + " x the noise-floor threshold (" +
         pair_label(r, *worst) + ", " + worst->largest->where() + ")";
  else
    o += "; identical bit for bit";
  if (ties) o += "; " + std::to_string(ties) + " greedy flip(s) at a near-tie";
  if (unsettled) o += "; " + std::to_string(unsettled) + " greedy flip(s) not settled";
  return o + unpaired + sampler;
}

}  // namespace llmdiff::compare
