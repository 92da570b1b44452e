#include "compare/sampler_search.h"

#include <algorithm>
#include <set>

namespace llmdiff::compare {

namespace {

using P = SamplerPipeline;

bool has(const std::vector<SamplerStage>& v, SamplerStage s) { return std::find(v.begin(), v.end(), s) != v.end(); }

bool filters(const std::vector<SamplerStage>& acting) {
  return has(acting, SamplerStage::TopK) || has(acting, SamplerStage::TopP) || has(acting, SamplerStage::MinP);
}
bool scales(const std::vector<SamplerStage>& acting) {
  return has(acting, SamplerStage::Penalty) || has(acting, SamplerStage::Temperature);
}

// HF's rank of a stage (its place in HF's order).
int rank(SamplerStage s) { return int(s); }

// The stages of `order` that keep HF's relative order: a longest increasing
// run of ranks (the first such run ending earliest); the others moved.
std::vector<bool> kept_in_order(const std::vector<SamplerStage>& order) {
  const size_t n = order.size();
  std::vector<int> len(n, 1), prev(n, -1);
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < i; ++j)
      if (rank(order[j]) < rank(order[i]) && len[j] + 1 > len[i]) len[i] = len[j] + 1, prev[i] = int(j);
  std::vector<bool> kept(n, false);
  if (n == 0) return kept;
  int at = int(std::max_element(len.begin(), len.end()) - len.begin());
  for (; at >= 0; at = prev[size_t(at)]) kept[size_t(at)] = true;
  return kept;
}

int moved_count(const std::vector<SamplerStage>& order) {
  const std::vector<bool> kept = kept_in_order(order);
  return int(std::count(kept.begin(), kept.end(), false));
}

int rule_count(const P& s) {
  return (s.penalty != P::Penalty::Hf) + (s.temperature != P::Temperature::Once) + (s.top_k != P::TopK::Hf) +
         (s.top_p != P::TopP::Hf) + (s.min_p != P::MinP::Hf) + (s.probs != P::Probs::Scores);
}

// "a", "a and b", "a, b and c"
std::string join(const std::vector<std::string>& items) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i)
    s += (i == 0 ? "" : i + 1 == items.size() ? " and " : ", ") + items[i];
  return s;
}

std::string rule_words(SamplerStage st, const P& s) {
  switch (st) {
    case SamplerStage::Penalty:
      switch (s.penalty) {
        case P::Penalty::Hf: return "";
        case P::Penalty::DivideAll: return "repetition penalty divides every seen token's logit (negative ones too, raising them)";
        case P::Penalty::MultiplyAll:
          return "repetition penalty multiplies every seen token's logit (positive ones too, raising them)";
        case P::Penalty::Inverted:
          return "repetition penalty's sign rule inverted (negative logits divided, positive ones multiplied: "
                 "repetition rewarded)";
        case P::Penalty::PerOccurrence:
          return "repetition penalty applied once per occurrence in the history (HF: once per token id)";
      }
      break;
    case SamplerStage::Temperature:
      switch (s.temperature) {
        case P::Temperature::Once: return "";
        case P::Temperature::Never: return "temperature not applied";
        case P::Temperature::Twice: return "temperature applied twice";
        case P::Temperature::Multiplied: return "scores multiplied by the temperature instead of divided";
      }
      break;
    case SamplerStage::TopK:
      switch (s.top_k) {
        case P::TopK::Hf: return "";
        case P::TopK::Exclusive: return "top-k cut-off exclusive (the k-th score removed too: k - 1 tokens kept)";
        case P::TopK::OneMore: return "top-k keeps k + 1 tokens (the cut-off at the (k+1)-th score)";
      }
      break;
    case SamplerStage::TopP:
      switch (s.top_p) {
        case P::TopP::Hf: return "";
        case P::TopP::OneMore: return "top-p keeps one token more (each token judged by the next one's cumulative mass)";
        case P::TopP::OneFewer: return "top-p keeps one token fewer (the token whose mass crosses top_p removed)";
        case P::TopP::Complement:
          return "top-p compares the cumulative mass with top_p instead of 1 - top_p (a mass of about 1 - top_p kept)";
        case P::TopP::NoKeepOne: return "top-p without its keep-one rule (the most probable token may be removed)";
      }
      break;
    case SamplerStage::MinP:
      switch (s.min_p) {
        case P::MinP::Hf: return "";
        case P::MinP::Absolute: return "min-p compares the probabilities with min_p itself, not min_p x the top probability";
      }
      break;
  }
  return "";
}

std::string probs_words(P::Probs p) {
  switch (p) {
    case P::Probs::Scores: return "";
    case P::Probs::RawLogits: return "the token drawn from softmax(next_logits): the processed scores ignored in the draw";
    case P::Probs::Unfiltered:
      return "the token drawn from the softmax of the penalised and scaled scores before the filters (top-k, top-p, "
             "min-p ignored in the draw)";
    case P::Probs::RawKept:
      return "the token drawn from the softmax of the raw next_logits over the kept tokens (penalty and temperature "
             "left out of the draw)";
  }
  return "";
}

std::string rule_tag(SamplerStage st, const P& s) {
  switch (st) {
    case SamplerStage::Penalty: {
      const char* t[] = {"", "divides all", "multiplies all", "sign inverted", "per occurrence"};
      return t[int(s.penalty)];
    }
    case SamplerStage::Temperature: {
      const char* t[] = {"", "never", "twice", "multiplied"};
      return t[int(s.temperature)];
    }
    case SamplerStage::TopK: {
      const char* t[] = {"", "exclusive", "k + 1"};
      return t[int(s.top_k)];
    }
    case SamplerStage::TopP: {
      const char* t[] = {"", "one more", "one fewer", "1 - top_p kept", "no keep-one"};
      return t[int(s.top_p)];
    }
    case SamplerStage::MinP: return s.min_p == P::MinP::Absolute ? "absolute" : "";
  }
  return "";
}

// A pipeline as bytes, for telling pipelines apart.
std::string key(const P& s) {
  std::string k;
  for (SamplerStage st : s.order) k += char('0' + int(st));
  for (int v : {int(s.penalty), int(s.temperature), int(s.top_k), int(s.top_p), int(s.min_p), int(s.probs)})
    k += char('a' + v);
  return k;
}

// The rule variants of one stage other than HF's, applied to `base`.
std::vector<P> rule_variants(SamplerStage st, const P& base) {
  std::vector<P> out;
  auto with = [&](auto field, auto value) {
    P s = base;
    s.*field = value;
    out.push_back(s);
  };
  switch (st) {
    case SamplerStage::Penalty:
      for (P::Penalty r : {P::Penalty::DivideAll, P::Penalty::MultiplyAll, P::Penalty::Inverted, P::Penalty::PerOccurrence})
        with(&P::penalty, r);
      break;
    case SamplerStage::Temperature:
      for (P::Temperature r : {P::Temperature::Never, P::Temperature::Twice, P::Temperature::Multiplied})
        with(&P::temperature, r);
      break;
    case SamplerStage::TopK:
      for (P::TopK r : {P::TopK::Exclusive, P::TopK::OneMore}) with(&P::top_k, r);
      break;
    case SamplerStage::TopP:
      for (P::TopP r : {P::TopP::OneMore, P::TopP::OneFewer, P::TopP::Complement, P::TopP::NoKeepOne})
        with(&P::top_p, r);
      break;
    case SamplerStage::MinP: with(&P::min_p, P::MinP::Absolute); break;
  }
  return out;
}

// The distributions drawn from that differ from HF's on these stages.
std::vector<P::Probs> probs_variants(const std::vector<SamplerStage>& acting) {
  std::vector<P::Probs> out = {P::Probs::Scores};
  if (!acting.empty()) out.push_back(P::Probs::RawLogits);
  if (filters(acting) && scales(acting)) out.push_back(P::Probs::Unfiltered);
  if (filters(acting) && scales(acting)) out.push_back(P::Probs::RawKept);
  return out;
}

}  // namespace

std::vector<SamplerStage> acting_stages(const std::vector<SamplingParams>& params) {
  std::vector<SamplerStage> out;
  for (SamplerStage s : SamplerPipeline{}.order)
    if (std::any_of(params.begin(), params.end(), [&](const SamplingParams& p) { return stage_acts(p, s); }))
      out.push_back(s);
  return out;
}

SamplerPipeline normalised(const SamplerPipeline& s, const std::vector<SamplerStage>& acting) {
  P n;
  n.order.clear();
  for (SamplerStage st : s.order)
    if (has(acting, st)) n.order.push_back(st);
  if (has(acting, SamplerStage::Penalty)) n.penalty = s.penalty;
  if (has(acting, SamplerStage::Temperature)) n.temperature = s.temperature;
  if (has(acting, SamplerStage::TopK)) n.top_k = s.top_k;
  if (has(acting, SamplerStage::TopP)) n.top_p = s.top_p;
  if (has(acting, SamplerStage::MinP)) n.min_p = s.min_p;
  n.probs = s.probs;
  // Draws that equal HF's, or each other's, on these stages.
  if (!filters(acting) && n.probs == P::Probs::Unfiltered) n.probs = P::Probs::Scores;
  if (!filters(acting) && n.probs == P::Probs::RawKept) n.probs = P::Probs::RawLogits;
  if (!scales(acting) && n.probs == P::Probs::RawKept) n.probs = P::Probs::Scores;
  if (acting.empty() && n.probs == P::Probs::RawLogits) n.probs = P::Probs::Scores;
  // A temperature never applied has no place: put it where the fewest stages move.
  if (n.temperature == P::Temperature::Never) {
    auto at = std::find(n.order.begin(), n.order.end(), SamplerStage::Temperature);
    if (at != n.order.end()) {
      n.order.erase(at);
      std::vector<SamplerStage> best;
      for (size_t i = 0; i <= n.order.size(); ++i) {
        std::vector<SamplerStage> o = n.order;
        o.insert(o.begin() + std::ptrdiff_t(i), SamplerStage::Temperature);
        if (best.empty() || moved_count(o) < moved_count(best)) best = o;
      }
      n.order = best;
    }
  }
  return n;
}

int departure_count(const SamplerPipeline& s, const std::vector<SamplerStage>& acting) {
  const P n = normalised(s, acting);
  return moved_count(n.order) + rule_count(n);
}

std::vector<std::string> pipeline_departures(const SamplerPipeline& s, const std::vector<SamplerStage>& acting) {
  const P n = normalised(s, acting);
  std::vector<std::string> out;
  const std::vector<bool> kept = kept_in_order(n.order);
  for (size_t i = 0; i < n.order.size(); ++i) {
    if (kept[i]) continue;
    std::vector<std::string> before, after;
    for (size_t j = 0; j < n.order.size(); ++j) {
      if (j > i && rank(n.order[j]) < rank(n.order[i])) before.push_back(stage_name(n.order[j]));
      if (j < i && rank(n.order[j]) > rank(n.order[i])) after.push_back(stage_name(n.order[j]));
    }
    std::string w = std::string(stage_name(n.order[i])) + " applied";
    if (!before.empty()) w += " before " + join(before);
    if (!after.empty()) w += std::string(before.empty() ? "" : " and") + " after " + join(after);
    out.push_back(w);
  }
  for (SamplerStage st : n.order)
    if (std::string w = rule_words(st, n); !w.empty()) out.push_back(w);
  if (std::string w = probs_words(n.probs); !w.empty()) out.push_back(w);
  return out;
}

std::string pipeline_str(const SamplerPipeline& s, const std::vector<SamplerStage>& acting) {
  const P n = normalised(s, acting);
  std::string out;
  for (SamplerStage st : n.order) {
    const std::string tag = rule_tag(st, n);
    out += (out.empty() ? "" : " > ") + std::string(stage_name(st)) + (tag.empty() ? "" : " (" + tag + ")");
  }
  const char* draws[] = {"softmax of the scores", "softmax of next_logits", "softmax of the unfiltered scores",
                         "softmax of next_logits over the kept ids"};
  return (out.empty() ? std::string("no processor") : out) + "; token from the " + draws[int(n.probs)];
}

const zoo::BugInfo* zoo_sampler_bug(const SamplerPipeline& s, const std::vector<SamplerStage>& acting) {
  const P n = normalised(s, acting);
  if (n == normalised(P{}, acting)) return nullptr;
  for (const zoo::BugInfo* bug : zoo::sampler_bugs()) {
    zoo::SamplerFaults f;
    f.*(bug->sampler_fault) = true;
    if (normalised(P::from_faults(f), acting) == n) return bug;
  }
  return nullptr;
}

std::vector<SamplerPipeline> pipeline_space(const std::vector<SamplerStage>& acting, int max_departures) {
  // Every order of the acting stages (HF's first).
  std::vector<std::vector<SamplerStage>> orders;
  {
    std::vector<SamplerStage> o = acting;  // HF's order: the first permutation
    do orders.push_back(o);
    while (std::next_permutation(o.begin(), o.end(), [](SamplerStage a, SamplerStage b) { return rank(a) < rank(b); }));
  }
  // Rule combinations: each acting stage HF's rule or one of its variants.
  std::vector<P> rules = {P{}};
  for (SamplerStage st : acting) {
    std::vector<P> next;
    for (const P& base : rules) {
      next.push_back(base);
      for (const P& v : rule_variants(st, base)) next.push_back(v);
    }
    rules = std::move(next);
  }
  // Each normalised pipeline once, at its own departure count.
  std::vector<std::pair<int, P>> all;
  std::set<std::string> seen;
  for (const std::vector<SamplerStage>& o : orders) {
    const int moved = moved_count(o);
    if (moved > max_departures) continue;
    for (const P& r : rules) {
      const int rc = rule_count(r);
      for (P::Probs pr : probs_variants(acting)) {
        // Normalising only lowers the count, and the normalised pipeline is in
        // the grid itself: the ones above the bound can be left out first.
        if (moved + rc + (pr != P::Probs::Scores) > max_departures) continue;
        P s = r;
        s.order = o;
        s.probs = pr;
        s = normalised(s, acting);
        const int cost = moved_count(s.order) + rule_count(s);
        if (cost == 0 || cost > max_departures || !seen.insert(key(s)).second) continue;
        all.push_back({cost, s});
      }
    }
  }
  std::stable_sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<P> out;
  out.reserve(all.size());
  for (auto& [cost, s] : all) out.push_back(std::move(s));
  return out;
}

PipelineSearch search_pipelines(const std::vector<SamplerStage>& acting,
                                const std::function<bool(const SamplerPipeline&)>& reproduces, int max_departures,
                                int budget) {
  PipelineSearch out;
  const std::vector<P> space = pipeline_space(acting, max_departures);
  int level = 0;
  for (const P& s : space) {
    const int cost = departure_count(s, acting);
    if (cost != level) {
      if (!out.found.empty()) break;  // the fewest departures that reproduce: done
      out.searched_up_to = level;
      level = cost;
    }
    if (out.tried >= budget) {
      out.budget_spent = true;
      break;
    }
    ++out.tried;
    if (reproduces(s)) out.found.push_back(s);
  }
  if (!out.budget_spent) out.searched_up_to = out.found.empty() ? max_departures : level;
  if (!out.found.empty()) {
    out.departures = level;
    std::stable_sort(out.found.begin(), out.found.end(), [&](const P& a, const P& b) {
      return (zoo_sampler_bug(a, acting) != nullptr) > (zoo_sampler_bug(b, acting) != nullptr);
    });
  }
  return out;
}

}  // namespace llmdiff::compare
