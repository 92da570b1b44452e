// The search for the pipeline a candidate's sampler runs (compare/
// sampling_check.h): when its sample.* depart from HF's processors, the
// space of pipelines around HF's (dumps/sampling/sampling.h SamplerPipeline)
// is searched for one that reproduces every step: every order of the
// processors that act, each processor's rule variants (the penalty's sign
// rules, inclusive or exclusive cut-offs, the keep-one rule, temperature
// applied 0, 1 or 2 times or multiplied) and the distribution drawn from.
//
// A pipeline's departures from HF are counted as HF's stages that must move
// (the acting stages minus their longest run kept in HF's order) plus the
// rules that differ; the search goes from one departure up, and stops at the
// first count where some pipeline reproduces the candidate: the finding is
// those pipelines, stated as their departures ("top-p applied before
// temperature and top-k"), and the zoo's sampler bug when one of them is
// that bug's pipeline.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dumps/sampling/sampling.h"
#include "dumps/zoo/bugs.h"

namespace llmdiff::compare {

using SamplerStage = SamplerPipeline::Stage;

// The stages that act under any of `params` (each sequence's own), in HF's order.
std::vector<SamplerStage> acting_stages(const std::vector<SamplingParams>& params);

// `s` with the stages outside `acting` dropped from its order and their
// rules set to HF's, and a distribution rule that draws as HF does on these
// stages set to HF's: two pipelines equal after it compute the same.
SamplerPipeline normalised(const SamplerPipeline& s, const std::vector<SamplerStage>& acting);

// The departures of `s` from HF's pipeline in words, one per moved stage and
// per rule: "top-p applied before temperature and top-k", "repetition
// penalty multiplies every seen token's logit (negative ones too)".
std::vector<std::string> pipeline_departures(const SamplerPipeline& s, const std::vector<SamplerStage>& acting);
// The number of departures (the stages moved, the rules changed).
int departure_count(const SamplerPipeline& s, const std::vector<SamplerStage>& acting);
// "repetition penalty > top-p > temperature > top-k, softmax of the scores":
// the acting stages in `s`'s order, then what the token is drawn from.
std::string pipeline_str(const SamplerPipeline& s, const std::vector<SamplerStage>& acting);

// The sampler bug of the zoo whose pipeline `s` is on these stages (nullptr: none).
const zoo::BugInfo* zoo_sampler_bug(const SamplerPipeline& s, const std::vector<SamplerStage>& acting);

// Every pipeline of 1 to `max_departures` departures on `acting`, fewest
// first, each once (normalised; pipelines that compute the same on these
// stages kept once).
std::vector<SamplerPipeline> pipeline_space(const std::vector<SamplerStage>& acting, int max_departures);

struct PipelineSearch {
  std::vector<SamplerPipeline> found;  // every pipeline of the fewest departures that reproduces; zoo bugs first
  int departures = 0;                  // their departure count (0: none found)
  int tried = 0;                       // pipelines judged
  int searched_up_to = 0;              // the departure counts searched in full
  bool budget_spent = false;           // stopped before searching `max_departures` in full
};

// Judges the pipelines of pipeline_space(acting, max_departures) in order
// with `reproduces` (true: it reproduces every step), at most `budget` of
// them, and stops after the first departure count where one does.
PipelineSearch search_pipelines(const std::vector<SamplerStage>& acting,
                                const std::function<bool(const SamplerPipeline&)>& reproduces, int max_departures,
                                int budget);

}  // namespace llmdiff::compare
