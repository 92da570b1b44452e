#include "dumps/sampling/sampling.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <numeric>
#include <set>

#include "dumps/contract/engine.h"
#include "dumps/base/errors.h"
#include "dumps/contract/sites.h"

// Every float32 operation below is rounded on its own, as torch's kernels
// round them: no multiply-add is fused except the explicit std::fma calls.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace llmdiff {

namespace {

using ojson = nlohmann::ordered_json;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

const char* const kKeys[] = {"do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed"};

std::string known_keys() {
  std::string out;
  for (const char* k : kKeys) out += std::string(out.empty() ? "" : ", ") + k;
  return out;
}

bool is_known_key(const std::string& k) {
  return std::any_of(std::begin(kKeys), std::end(kKeys), [&](const char* x) { return k == x; });
}

// Shortest decimal text that reads back as exactly `v`.
std::string format_double(double v) {
  char buf[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

// ------------------------------------------------------------ parameters

[[noreturn]] void bad_value(const std::string& key, const std::string& value, const std::string& want) {
  throw UsageError("sampling: " + key + " must be " + want + ", got '" + value + "'");
}

double parse_number(const std::string& key, const std::string& value) {
  errno = 0;
  char* end = nullptr;
  const double v = value.empty() ? 0.0 : std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v)) bad_value(key, value, "a finite number");
  return v;
}

uint64_t parse_unsigned(const std::string& key, const std::string& value) {
  errno = 0;
  char* end = nullptr;
  const bool digits = !value.empty() && std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; });
  const unsigned long long v = digits ? std::strtoull(value.c_str(), &end, 10) : 0;
  if (!digits || errno == ERANGE) bad_value(key, value, "a non-negative integer");
  return uint64_t(v);
}

bool parse_bool(const std::string& key, const std::string& value) {
  if (value == "true" || value == "1") return true;
  if (value == "false" || value == "0") return false;
  bad_value(key, value, "true or false");
}

// One key of the command-line form.
void set_from_text(SamplingParams& p, const std::string& key, const std::string& value) {
  if (key == "do_sample") p.do_sample = parse_bool(key, value);
  else if (key == "temperature") p.temperature = parse_number(key, value);
  else if (key == "top_k") {
    if (value == "none") p.top_k = 0;
    else {
      const uint64_t k = parse_unsigned(key, value);
      if (k > uint64_t(std::numeric_limits<int64_t>::max())) bad_value(key, value, "a non-negative integer");
      p.top_k = int64_t(k);
    }
  } else if (key == "top_p") p.top_p = parse_number(key, value);
  else if (key == "min_p") p.min_p = parse_number(key, value);
  else if (key == "repetition_penalty") p.repetition_penalty = parse_number(key, value);
  else if (key == "seed") p.seed = parse_unsigned(key, value);
  else throw UsageError("sampling: unknown parameter '" + key + "' (known: " + known_keys() + ")");
}

double json_number(const ojson& v, const std::string& key) {
  if (!v.is_number()) bad_value(key, v.dump(), "a number");
  return v.get<double>();
}

// A JSON integer (or a float with an integral value, as Python may write it).
int64_t json_integer(const ojson& v, const std::string& key) {
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() && std::fabs(v.get<double>()) < 9e18)
    return int64_t(v.get<double>());
  bad_value(key, v.dump(), "an integer");
}

// One key of the manifest JSON; null is HF's "not set".
void set_from_json(SamplingParams& p, const std::string& key, const ojson& v) {
  const SamplingParams hf;
  if (key == "do_sample") {
    if (v.is_null()) p.do_sample = hf.do_sample;
    else if (v.is_boolean()) p.do_sample = v.get<bool>();
    else bad_value(key, v.dump(), "true or false");
  } else if (key == "temperature") {
    p.temperature = v.is_null() ? hf.temperature : json_number(v, key);
  } else if (key == "top_k") {
    p.top_k = v.is_null() ? 0 : json_integer(v, key);  // None: no TopKLogitsWarper (utils.py line 1195)
  } else if (key == "top_p") {
    p.top_p = v.is_null() ? hf.top_p : json_number(v, key);
  } else if (key == "min_p") {
    if (v.is_null()) p.min_p.reset();
    else p.min_p = json_number(v, key);
  } else if (key == "repetition_penalty") {
    p.repetition_penalty = v.is_null() ? hf.repetition_penalty : json_number(v, key);
  } else if (key == "seed") {
    if (v.is_null()) p.seed.reset();
    else if (v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0)) p.seed = v.get<uint64_t>();
    else bad_value(key, v.dump(), "a non-negative integer");
  } else {
    throw UsageError("sampling: unknown parameter '" + key + "' (known: " + known_keys() + ")");
  }
}

// ------------------------------------------------------------ torch kernels

// Sleef_expf_u10 (the lane function of Sleef_expf16_u10, torch's
// Vectorized<float>::exp): round(d / ln 2) = q, Cody-Waite reduction with
// fused multiply-adds, a degree-6 polynomial, then u * 2^(q>>1) * 2^(q-(q>>1)).
float sleef_expf_u10(float d) {
  if (std::isnan(d)) return d;
  if (d < -104.0f) return 0.0f;
  if (d > 100.0f) return std::numeric_limits<float>::infinity();
  const float R_LN2f = 1.442695040888963407359924681001892137426645954152985934135449406931f;
  const float L2Uf = 0.693145751953125f, L2Lf = 1.428606765330187045e-06f;
  const float qf = std::nearbyint(d * R_LN2f);
  const int q = int(qf);
  float s = std::fma(qf, -L2Uf, d);
  s = std::fma(qf, -L2Lf, s);
  float u = 0.000198527617612853646278381f;
  u = std::fma(u, s, 0.00139304355252534151077271f);
  u = std::fma(u, s, 0.00833336077630519866943359f);
  u = std::fma(u, s, 0.0416664853692054748535156f);
  u = std::fma(u, s, 0.166666671633720397949219f);
  u = std::fma(u, s, 0.5f);
  u = 1.0f + std::fma(s * s, u, s);
  const int half = q >> 1;
  return u * std::ldexp(1.0f, half) * std::ldexp(1.0f, q - half);
}

// vec::reduce_all(+) over Vectorized<float> of 16 lanes: element i is added
// to lane i mod 16 in index order, then the lanes are reduced by halving
// (lane i += lane i + h for h = 8, 4, 2, 1: the shuffle reduction of
// vec_reduce_all). A row shorter than a vector is summed in order.
float torch_sum_f32(const std::vector<float>& x) {
  constexpr size_t kLanes = 16;
  if (x.size() < kLanes) {
    float s = x.empty() ? 0.0f : x[0];
    for (size_t i = 1; i < x.size(); ++i) s += x[i];
    return s;
  }
  float lane[kLanes];
  for (size_t i = 0; i < kLanes; ++i) lane[i] = x[i];
  for (size_t i = kLanes; i < x.size(); ++i) lane[i % kLanes] += x[i];
  for (size_t h = kLanes / 2; h >= 1; h /= 2)
    for (size_t i = 0; i < h; ++i) lane[i] += lane[i + h];
  return lane[0];
}

// torch.cumsum of a float32 CPU tensor: accumulated in double
// (at::acc_type<float, false>), each prefix rounded to float32.
std::vector<float> torch_cumsum_f32(const std::vector<float>& x) {
  std::vector<float> out(x.size());
  double acc = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    acc += double(x[i]);
    out[i] = float(acc);
  }
  return out;
}

// ------------------------------------------------------------ processors

using Pipeline = SamplerPipeline;

// RepetitionPenaltyLogitsProcessor (logits_process.py lines 337-342):
// score = gather(scores, input_ids); where(score < 0, score * penalty,
// score / penalty); scattered back. Each id once, however often it occurs.
// The other rules are the departures of SamplerPipeline::Penalty.
void apply_repetition_penalty(std::vector<float>& scores, const std::vector<int64_t>& history, double penalty,
                              Pipeline::Penalty rule) {
  const float pen = float(penalty);
  auto apply = [&](int64_t id) {
    if (id < 0 || id >= int64_t(scores.size()))
      throw Error("sampling: history token " + std::to_string(id) + " outside the vocabulary [0, " +
                  std::to_string(scores.size()) + ")");
    float& s = scores[size_t(id)];
    switch (rule) {
      case Pipeline::Penalty::Hf:
      case Pipeline::Penalty::PerOccurrence: s = s < 0 ? s * pen : s / pen; break;
      case Pipeline::Penalty::DivideAll: s = s / pen; break;
      case Pipeline::Penalty::MultiplyAll: s = s * pen; break;
      case Pipeline::Penalty::Inverted: s = s < 0 ? s / pen : s * pen; break;
    }
  };
  if (rule == Pipeline::Penalty::PerOccurrence) {
    for (int64_t id : history) apply(id);
    return;
  }
  for (int64_t id : std::set<int64_t>(history.begin(), history.end())) apply(id);
}

// TemperatureLogitsWarper (line 288): scores / temperature, float32.
void apply_temperature(std::vector<float>& scores, double temperature, bool multiply = false) {
  const float t = float(temperature);
  for (float& s : scores) s = multiply ? s * t : s / t;
}

// TopKLogitsWarper (lines 509, 516): k = min(max(top_k, 1), V); removes the
// scores strictly below the k-th largest, so ties with it are all kept.
// TopK::Exclusive removes the k-th too, TopK::OneMore cuts at the (k+1)-th.
void apply_top_k(std::vector<float>& scores, int64_t top_k, Pipeline::TopK rule = Pipeline::TopK::Hf) {
  const int64_t wanted = std::max<int64_t>(top_k, 1) + (rule == Pipeline::TopK::OneMore ? 1 : 0);
  const size_t k = size_t(std::min<int64_t>(wanted, int64_t(scores.size())));
  if (k == 0) return;
  std::vector<float> sorted = scores;
  std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<float>());
  const float kth = sorted[k - 1];
  const bool exclusive = rule == Pipeline::TopK::Exclusive;
  for (float& s : scores)
    if (s < kth || (exclusive && s == kth)) s = kNegInf;
}

// TopPLogitsWarper (lines 454-460): sort ascending (torch.sort on CPU keeps
// equal scores in id order), softmax of the sorted scores, float32 cumsum;
// remove where cumsum <= 1 - top_p (the scalar is rounded to float32, as
// torch compares a float32 tensor with a Python float); the last (top) entry
// is always kept. sampler-top-p-off-by-one judges entry j by cumsum[j + 1]
// (keeps the next lower token too), -fewer by cumsum[j - 1] (drops the token
// whose mass crosses the threshold); the other SamplerPipeline::TopP rules
// compare with top_p itself or exempt no entry.
void apply_top_p(std::vector<float>& scores, double top_p, Pipeline::TopP rule) {
  const size_t V = scores.size();
  if (V == 0) return;
  std::vector<size_t> order(V);
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return scores[a] < scores[b]; });
  std::vector<float> sorted(V);
  for (size_t j = 0; j < V; ++j) sorted[j] = scores[order[j]];
  const std::vector<float> cum = torch_cumsum_f32(softmax_f32(sorted));
  const float threshold = rule == Pipeline::TopP::Complement ? float(top_p) : float(1.0 - top_p);
  auto cum_at = [&](size_t j, int shift) -> float {
    if (shift < 0) return j == 0 ? 0.0f : cum[j - 1];
    if (shift > 0) return cum[std::min(j + 1, V - 1)];
    return cum[j];
  };
  const int shift = rule == Pipeline::TopP::OneMore ? 1 : rule == Pipeline::TopP::OneFewer ? -1 : 0;
  const size_t judged = rule == Pipeline::TopP::NoKeepOne ? V : V - 1;  // sorted_indices_to_remove[..., -1:] = 0
  for (size_t j = 0; j < judged; ++j)
    if (cum_at(j, shift) <= threshold) scores[order[j]] = kNegInf;
}

// MinPLogitsWarper (lines 580-591): probs = softmax(scores); remove probs <
// min_p * max(probs) (float32 product); the top score is always kept.
// MinP::Absolute compares with min_p itself.
void apply_min_p(std::vector<float>& scores, double min_p, Pipeline::MinP rule = Pipeline::MinP::Hf) {
  if (scores.empty()) return;
  const std::vector<float> probs = softmax_f32(scores);
  const float top = *std::max_element(probs.begin(), probs.end());
  const float threshold = rule == Pipeline::MinP::Absolute ? float(min_p) : float(min_p) * top;
  const size_t best = size_t(argmax_first(scores));
  for (size_t i = 0; i < scores.size(); ++i)
    if (i != best && probs[i] < threshold) scores[i] = kNegInf;
}

}  // namespace

// ------------------------------------------------------------ SamplingParams

SamplingParams SamplingParams::from_json(const std::string& json_text) {
  ojson j;
  try {
    j = ojson::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(std::string("sampling: not valid JSON: ") + e.what());
  }
  if (!j.is_object()) throw UsageError("sampling: expected a JSON object, got " + j.dump());
  SamplingParams p;
  for (const auto& [key, value] : j.items()) set_from_json(p, key, value);
  p.validate();
  return p;
}

SamplingParams SamplingParams::parse(const std::string& text) {
  if (text.empty()) throw UsageError("sampling: no parameters given (e.g. temperature=0.7,top_k=40,top_p=0.9,seed=1)");
  SamplingParams p;
  p.do_sample = true;
  std::set<std::string> given;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    const size_t eq = item.find('=');
    if (eq == std::string::npos)
      throw UsageError("sampling: expected key=value, got '" + item + "' in '" + text + "'");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    if (!is_known_key(key)) throw UsageError("sampling: unknown parameter '" + key + "' (known: " + known_keys() + ")");
    if (!given.insert(key).second) throw UsageError("sampling: '" + key + "' given twice in '" + text + "'");
    set_from_text(p, key, value);
    start = comma + 1;
  }
  p.validate();
  return p;
}

void SamplingParams::validate() const {
  auto fail = [](const std::string& what, double v) {
    throw UsageError("sampling: " + what + ", got " + format_double(v));
  };
  if (!std::isfinite(temperature) || temperature <= 0) fail("temperature must be a positive number", temperature);
  if (top_k < 0) fail("top_k must be >= 0 (0: off)", double(top_k));
  if (!(top_p >= 0 && top_p <= 1)) fail("top_p must lie in [0, 1]", top_p);
  if (min_p && !(*min_p >= 0 && *min_p <= 1)) fail("min_p must lie in [0, 1]", *min_p);
  if (!std::isfinite(repetition_penalty) || repetition_penalty <= 0)
    fail("repetition_penalty must be a positive number", repetition_penalty);
}

std::string SamplingParams::to_json() const {
  ojson j;
  j["do_sample"] = do_sample;
  j["temperature"] = temperature;
  j["top_k"] = top_k;
  j["top_p"] = top_p;
  if (min_p) j["min_p"] = *min_p;
  j["repetition_penalty"] = repetition_penalty;
  if (seed) j["seed"] = *seed;
  return j.dump();
}

std::string SamplingParams::str() const {
  std::string s = std::string("do_sample=") + (do_sample ? "true" : "false");
  s += ",temperature=" + format_double(temperature);
  s += ",top_k=" + std::to_string(top_k);
  s += ",top_p=" + format_double(top_p);
  if (min_p) s += ",min_p=" + format_double(*min_p);
  s += ",repetition_penalty=" + format_double(repetition_penalty);
  if (seed) s += ",seed=" + std::to_string(*seed);
  return s;
}

bool SamplingParams::operator==(const SamplingParams& o) const {
  return do_sample == o.do_sample && temperature == o.temperature && top_k == o.top_k && top_p == o.top_p &&
         min_p == o.min_p && repetition_penalty == o.repetition_penalty && seed == o.seed;
}

std::string sampling_manifest_key(int seq) { return seq < 0 ? "sampling" : "sampling.seq" + std::to_string(seq); }

std::optional<SamplingParams> manifest_sampling(const Manifest& m, const std::string& where, int seq) {
  auto it = m.extra.find(sampling_manifest_key(seq));
  if (it == m.extra.end() && seq >= 0) it = m.extra.find(sampling_manifest_key());
  if (it == m.extra.end()) return std::nullopt;
  try {
    return SamplingParams::from_json(it->second);
  } catch (const UsageError& e) {
    throw FormatError(where, "", "manifest '" + it->first + "': " + e.what());
  }
}

void set_manifest_sampling(Manifest& m, const SamplingParams& p, int seq) {
  m.extra[sampling_manifest_key(seq)] = p.to_json();
}

// ------------------------------------------------------------ pipeline

std::vector<float> softmax_f32(const std::vector<float>& x) {
  if (x.empty()) return {};
  float max = x[0];
  for (float v : x) max = std::max(max, v);  // vec::maximum; NaN aside, order-free
  std::vector<float> e(x.size());
  for (size_t i = 0; i < x.size(); ++i) e[i] = sleef_expf_u10(x[i] - max);
  const float inv = 1.0f / torch_sum_f32(e);
  for (float& v : e) v = v * inv;
  return e;
}

// ------------------------------------------------------------ SamplerPipeline

SamplerPipeline SamplerPipeline::from_faults(const zoo::SamplerFaults& f) {
  SamplerPipeline s;
  auto move_after = [&](Stage moved, Stage anchor) {
    s.order.erase(std::find(s.order.begin(), s.order.end(), moved));
    s.order.insert(std::find(s.order.begin(), s.order.end(), anchor) + 1, moved);
  };
  if (f.top_k_after_top_p) move_after(Stage::TopK, Stage::TopP);
  if (f.top_p_before_temperature) move_after(Stage::Temperature, Stage::TopP);
  if (f.penalty_sign) s.penalty = Penalty::DivideAll;
  if (f.temperature_twice) s.temperature = Temperature::Twice;
  if (f.top_p_one_more) s.top_p = TopP::OneMore;
  else if (f.top_p_one_fewer) s.top_p = TopP::OneFewer;
  if (f.softmax_unfiltered) s.probs = Probs::RawLogits;
  return s;
}

bool SamplerPipeline::operator==(const SamplerPipeline& o) const {
  return order == o.order && penalty == o.penalty && temperature == o.temperature && top_k == o.top_k &&
         top_p == o.top_p && min_p == o.min_p && probs == o.probs;
}

const char* stage_name(SamplerPipeline::Stage s) {
  switch (s) {
    case SamplerPipeline::Stage::Penalty: return "repetition penalty";
    case SamplerPipeline::Stage::Temperature: return "temperature";
    case SamplerPipeline::Stage::TopK: return "top-k";
    case SamplerPipeline::Stage::TopP: return "top-p";
    case SamplerPipeline::Stage::MinP: return "min-p";
  }
  return "?";
}

bool stage_acts(const SamplingParams& p, SamplerPipeline::Stage s) {
  switch (s) {
    case SamplerPipeline::Stage::Penalty: return p.penalises();
    case SamplerPipeline::Stage::Temperature: return p.scales();
    case SamplerPipeline::Stage::TopK: return p.top_k_filters();
    case SamplerPipeline::Stage::TopP: return p.top_p_filters();
    case SamplerPipeline::Stage::MinP: return p.min_p_filters();
  }
  return false;
}

std::vector<float> process_scores(const SamplingParams& p, const std::vector<float>& next_logits,
                                  const std::vector<int64_t>& history, const zoo::SamplerFaults& f) {
  return process_scores(p, next_logits, history, SamplerPipeline::from_faults(f));
}

// Each stage acts only when its parameter asks for it; greedy decoding runs
// the penalty alone, no warpers (utils.py line 1178: stage_acts).
std::vector<float> process_scores(const SamplingParams& p, const std::vector<float>& next_logits,
                                  const std::vector<int64_t>& history, const SamplerPipeline& pipeline) {
  using Stage = SamplerPipeline::Stage;
  std::vector<float> scores = next_logits;
  for (Stage s : pipeline.order) {
    if (!stage_acts(p, s)) continue;
    switch (s) {
      case Stage::Penalty: apply_repetition_penalty(scores, history, p.repetition_penalty, pipeline.penalty); break;
      case Stage::Temperature: {
        using T = SamplerPipeline::Temperature;
        const int times = pipeline.temperature == T::Never ? 0 : pipeline.temperature == T::Twice ? 2 : 1;
        for (int i = 0; i < times; ++i) apply_temperature(scores, p.temperature, pipeline.temperature == T::Multiplied);
        break;
      }
      case Stage::TopK: apply_top_k(scores, p.top_k, pipeline.top_k); break;
      case Stage::TopP: apply_top_p(scores, p.top_p, pipeline.top_p); break;
      case Stage::MinP: apply_min_p(scores, *p.min_p, pipeline.min_p); break;
    }
  }
  return scores;
}

std::vector<float> sample_probs(const std::vector<float>& scores, const std::vector<float>& next_logits,
                                const zoo::SamplerFaults& f) {
  return softmax_f32(f.softmax_unfiltered ? next_logits : scores);
}

std::vector<float> sample_probs(const SamplingParams& p, const std::vector<float>& scores,
                                const std::vector<float>& next_logits, const std::vector<int64_t>& history,
                                const SamplerPipeline& pipeline) {
  using Probs = SamplerPipeline::Probs;
  switch (pipeline.probs) {
    case Probs::Scores: return softmax_f32(scores);
    case Probs::RawLogits: return softmax_f32(next_logits);
    case Probs::Unfiltered: {
      SamplerPipeline scaling = pipeline;  // the same penalty and temperature, no filter
      scaling.order.clear();
      for (SamplerPipeline::Stage s : pipeline.order)
        if (s == SamplerPipeline::Stage::Penalty || s == SamplerPipeline::Stage::Temperature) scaling.order.push_back(s);
      return softmax_f32(process_scores(p, next_logits, history, scaling));
    }
    case Probs::RawKept: {
      std::vector<float> kept = next_logits;
      for (size_t i = 0; i < kept.size() && i < scores.size(); ++i)
        if (!std::isfinite(scores[i])) kept[i] = kNegInf;
      return softmax_f32(kept);
    }
  }
  return softmax_f32(scores);
}

int64_t pick_inverse_cdf(const std::vector<float>& probs, float u) {
  float cum = 0.0f;
  int64_t last_nonzero = -1;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (!(probs[i] > 0.0f)) continue;
    cum += probs[i];
    last_nonzero = int64_t(i);
    if (cum > u) return last_nonzero;
  }
  if (last_nonzero < 0) throw Error("sampling: no token has a nonzero probability");
  return last_nonzero;
}

uint64_t UniformStream::next_u64() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

float UniformStream::next() { return float(next_u64() >> 40) * 0x1p-24f; }

SampledStep sample_step(const SamplingParams& p, const std::vector<float>& next_logits,
                        const std::vector<int64_t>& history, UniformStream& stream, const zoo::SamplerFaults& f) {
  SampledStep s;
  s.scores = process_scores(p, next_logits, history, f);
  s.probs = sample_probs(s.scores, next_logits, f);
  if (p.do_sample) {
    s.u = stream.next();
    s.token = pick_inverse_cdf(s.probs, *s.u);
  } else {
    s.token = argmax_first(s.scores);
  }
  return s;
}

void report_sample(Observer& obs, int step, const SampledStep& s, const std::string& prefix) {
  auto name = [&](Site site) { return prefix + step_name(step, site); };
  const Shape v = {int64_t(s.scores.size())};
  if (obs.wants(name(Site::SampleScores))) obs.on_f32(name(Site::SampleScores), v, s.scores.data());
  if (obs.wants(name(Site::SampleProbs))) obs.on_f32(name(Site::SampleProbs), {int64_t(s.probs.size())}, s.probs.data());
  if (s.u && obs.wants(name(Site::SampleU))) obs.on_f32(name(Site::SampleU), {1}, &*s.u);
  if (obs.wants(name(Site::SampleToken))) obs.on_i64(name(Site::SampleToken), {1}, &s.token);
}

}  // namespace llmdiff
