// Token sampling as HF transformers 4.51.3's `generate` does it (the
// `sample` scenario of docs/DUMP_FORMAT.md, "Sampling"): the parameters of
// the manifest key `sampling`, the logits processors in HF's order with
// float32 arithmetic that reproduces torch's CPU kernels bit for bit, the
// softmax the token is drawn from, and an inverse-CDF draw from a seeded
// uniform stream for engines that want their draws reproducible.
//
// HF's pipeline (generation/utils.py, `_get_logits_processor` and `_sample`):
//   scores = next_logits (float32)
//   1. RepetitionPenaltyLogitsProcessor  when repetition_penalty != 1 (lines 1062-1063)
//   2. only when do_sample (line 1178), min_tokens_to_keep = 1 (line 1189):
//      TemperatureLogitsWarper  temperature != 1      (lines 1193-1194)
//      TopKLogitsWarper         top_k != 0            (lines 1195-1198)
//      TopPLogitsWarper         top_p < 1             (lines 1199-1202)
//      MinPLogitsWarper         min_p given           (lines 1203-1207)
//   probs = softmax(scores)   (line 3474); token = multinomial(probs) (line 3476),
//   or argmax(scores) when greedy.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dumps/zoo/bugs.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/observer.h"

namespace llmdiff {

// HF `generate` arguments that shape the sampled distribution. Defaults are
// HF's (GenerationConfig): greedy, temperature 1, top_k 50 (configuration_
// utils.py line 425; it acts only when sampling, and 0 or null turns it off),
// top_p 1, no min_p, no repetition penalty.
struct SamplingParams {
  bool do_sample = false;
  double temperature = 1.0;
  int64_t top_k = 50;  // 0: off
  double top_p = 1.0;
  std::optional<double> min_p;
  double repetition_penalty = 1.0;
  std::optional<uint64_t> seed;

  // The JSON object of the manifest key `sampling` (HF argument names; an
  // absent key has HF's default, so an object without do_sample is greedy).
  // Throws UsageError on malformed JSON, unknown keys or bad values.
  static SamplingParams from_json(const std::string& json_text);
  // The command-line form "temperature=0.7,top_k=40,top_p=0.9,seed=1": the
  // same keys, comma-separated; do_sample is true unless given as false
  // (asking for sampling parameters means sampling). top_k=none is 0.
  // Throws UsageError naming the offending key or value.
  static SamplingParams parse(const std::string& text);

  // The manifest JSON, every key written (min_p and seed only when set), in
  // HF's argument order.
  std::string to_json() const;
  // The command-line form; parse(str()) == *this.
  std::string str() const;

  // Throws UsageError when a value is out of HF's range: temperature > 0,
  // top_k >= 0, 0 <= top_p <= 1, 0 <= min_p <= 1, repetition_penalty > 0.
  void validate() const;

  // Which processors act (the conditions of _get_logits_processor).
  bool penalises() const { return repetition_penalty != 1.0; }
  bool scales() const { return do_sample && temperature != 1.0; }
  bool top_k_filters() const { return do_sample && top_k != 0; }
  bool top_p_filters() const { return do_sample && top_p < 1.0; }
  bool min_p_filters() const { return do_sample && min_p.has_value(); }

  bool operator==(const SamplingParams& o) const;
  bool operator!=(const SamplingParams& o) const { return !(*this == o); }
};

// The manifest key holding sequence `seq`'s parameters: "sampling", or
// "sampling.seq{b}" for a sequence of a several-sequence dump (seq >= 0).
std::string sampling_manifest_key(int seq = -1);
// The parameters a dump's manifest gives for sequence `seq` (its own key,
// else the dump-wide one); nullopt when it has none (greedy). Throws
// FormatError naming `where` when the value is malformed.
std::optional<SamplingParams> manifest_sampling(const Manifest& m, const std::string& where, int seq = -1);
void set_manifest_sampling(Manifest& m, const SamplingParams& p, int seq = -1);

// softmax over one row as torch's CPU kernel computes float32 (AVX-512,
// aten/src/ATen/native/cpu/SoftMaxKernel.cpp `_vec_softmax_lastdim`):
// e = Sleef expf_u10(x - max), sum over 16 lanes (element i in lane i mod 16)
// reduced by a halving tree, then e * (1 / sum). -inf gives exactly 0.
std::vector<float> softmax_f32(const std::vector<float>& x);

// A sampler's pipeline: the processors of HF's pipeline in some order, each
// by some rule, and the scores the token is drawn from. The default is HF's
// (the order above, every rule HF's); the zoo's sampler bugs are single
// departures from it (from_faults), and compare/sampler_search.h searches
// the space of them for the pipeline a candidate's sampler runs.
struct SamplerPipeline {
  enum class Stage : uint8_t { Penalty, Temperature, TopK, TopP, MinP };
  // RepetitionPenaltyLogitsProcessor: HF multiplies a negative seen logit by
  // the penalty and divides a positive one, each id once.
  enum class Penalty : uint8_t {
    Hf,
    DivideAll,      // every seen logit divided (negative ones raised)
    MultiplyAll,    // every seen logit multiplied (positive ones raised)
    Inverted,       // negative divided, positive multiplied (repetition rewarded)
    PerOccurrence,  // HF's rule once per occurrence of the id in the history
  };
  enum class Temperature : uint8_t { Once, Never, Twice, Multiplied };
  // TopKLogitsWarper: HF removes the scores strictly below the k-th largest.
  enum class TopK : uint8_t {
    Hf,
    Exclusive,  // removes the k-th too (scores <= the k-th): k - 1 kept
    OneMore,    // the (k+1)-th largest is the cut-off: k + 1 kept
  };
  // TopPLogitsWarper: HF removes ascending-sorted entries whose cumulative
  // probability is <= 1 - top_p, the top one always kept.
  enum class TopP : uint8_t {
    Hf,
    OneMore,     // entry j judged by cumsum[j + 1]: the next lower token kept too
    OneFewer,    // entry j judged by cumsum[j - 1]: the token crossing the threshold removed
    Complement,  // compared with top_p instead of 1 - top_p: a mass of about 1 - top_p kept
    NoKeepOne,   // the top entry not exempt: every token may be removed
  };
  // MinPLogitsWarper: HF removes probs < min_p x the top probability.
  enum class MinP : uint8_t {
    Hf,
    Absolute,  // probs < min_p, not scaled by the top probability
  };
  // The distribution the token is drawn from.
  enum class Probs : uint8_t {
    Scores,      // HF: softmax(processed scores)
    RawLogits,   // softmax(next_logits): every processor ignored in the draw
    Unfiltered,  // softmax of the penalised and scaled scores, the filters ignored in the draw
    RawKept,     // softmax(next_logits) over the kept ids: penalty and temperature ignored in the draw
  };

  std::vector<Stage> order = {Stage::Penalty, Stage::Temperature, Stage::TopK, Stage::TopP, Stage::MinP};
  Penalty penalty = Penalty::Hf;
  Temperature temperature = Temperature::Once;
  TopK top_k = TopK::Hf;
  TopP top_p = TopP::Hf;
  MinP min_p = MinP::Hf;
  Probs probs = Probs::Scores;

  // The pipeline of the zoo's sampler bugs `f` (all false: HF's).
  static SamplerPipeline from_faults(const zoo::SamplerFaults& f);
  bool operator==(const SamplerPipeline& o) const;
  bool operator!=(const SamplerPipeline& o) const { return !(*this == o); }
};

// Stage names as the reports say them: "repetition penalty", "temperature",
// "top-k", "top-p", "min-p".
const char* stage_name(SamplerPipeline::Stage s);
// Whether stage `s` acts under `p` (SamplingParams::penalises() ...).
bool stage_acts(const SamplingParams& p, SamplerPipeline::Stage s);

// The logits processors of HF's pipeline (above) on `next_logits` [V]:
// `history` is generate's running input_ids, the prompt and every token drawn
// before this step (every token fed to the engine up to this step). Returns
// the processed scores [V] with -inf where filtered (HF's `output_scores`).
// `faults` departs from HF the way the zoo's sampler bugs do.
// Throws Error when a history id is outside [0, V).
std::vector<float> process_scores(const SamplingParams& p, const std::vector<float>& next_logits,
                                  const std::vector<int64_t>& history, const zoo::SamplerFaults& faults = {});

// The same processors in `pipeline`'s order, each by its rule.
std::vector<float> process_scores(const SamplingParams& p, const std::vector<float>& next_logits,
                                  const std::vector<int64_t>& history, const SamplerPipeline& pipeline);

// The distribution the token is drawn from: softmax(scores), or under the
// sampler-softmax-unfiltered bug softmax(next_logits).
std::vector<float> sample_probs(const std::vector<float>& scores, const std::vector<float>& next_logits,
                                const zoo::SamplerFaults& faults = {});
// The distribution `pipeline` draws from, given the scores it processed
// (`scores` = process_scores(p, next_logits, history, pipeline)).
std::vector<float> sample_probs(const SamplingParams& p, const std::vector<float>& scores,
                                const std::vector<float>& next_logits, const std::vector<int64_t>& history,
                                const SamplerPipeline& pipeline);

// Inverse-CDF draw: the smallest id whose float32 cumulative probability,
// summed in ascending id order (c += probs[i]), exceeds u. When rounding
// leaves the total at or below u, the last id with nonzero probability. An id
// of probability 0 is never chosen. Throws Error on an empty or all-zero row.
int64_t pick_inverse_cdf(const std::vector<float>& probs, float u);

// The seeded uniform draws of llmdiff's sampler: splitmix64 over the seed
// (state += 0x9e3779b97f4a7c15, then the usual xor-shift-multiply finaliser),
// one 64-bit output x per draw, u = (x >> 40) * 2^-24: a float in [0, 1)
// with 24 random bits, exact in float32 and in a dump's F32 `sample.u`.
// Draw n (0-based) of a run is the n-th call of next() after construction.
class UniformStream {
 public:
  explicit UniformStream(uint64_t seed) : state_(seed) {}
  uint64_t next_u64();
  float next();

 private:
  uint64_t state_;
};

// One step's draw with everything a dump records under step{N}.sample.
struct SampledStep {
  std::vector<float> scores, probs;
  std::optional<float> u;  // sampling: the uniform draw; greedy: none
  int64_t token = -1;
};
// Processes `next_logits`, then picks the token: greedy = argmax of the
// scores (first index on ties), sampling = pick_inverse_cdf(probs, the next
// draw of `stream`).
SampledStep sample_step(const SamplingParams& p, const std::vector<float>& next_logits,
                        const std::vector<int64_t>& history, UniformStream& stream,
                        const zoo::SamplerFaults& faults = {});
// Reports step{step}.sample.scores / probs / u / token (names prefixed with
// `prefix`, e.g. "seq1.") to `obs`, each when it wants it.
void report_sample(Observer& obs, int step, const SampledStep& s, const std::string& prefix = "");

}  // namespace llmdiff
