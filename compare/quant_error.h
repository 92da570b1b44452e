// How much of a quantised candidate's divergence its quantisation alone
// explains: three runs of the same forward calls are compared per layer,
//   source truth     the reference on the full-precision source checkpoint,
//   quantised truth  the reference on the quantised checkpoint's dequantised
//                    weights (both float64: no rounding of their own),
//   candidate        the engine's dump,
// quantisation error = quantised truth vs source truth (what the weights'
// rounding alone does), candidate error = candidate vs source truth.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"
#include "dumps/model/weights.h"

namespace llmdiff::compare {

struct QuantErrorRow {
  std::string group;      // "layer 3" or "next_logits"
  int layer = -1;         // -1 for the logits row
  int names = 0;          // tensors pooled (one per step)
  double source_rms = 0;  // rms of the source truth
  double quant_rmse = 0;  // quantised truth vs source truth
  double cand_rmse = -1;  // candidate vs source truth (-1: the candidate lacks every name)
  // quant_rmse / cand_rmse: about 1 when quantisation explains the
  // candidate's error; well below 1 when something else adds to it.
  double explained() const { return cand_rmse > 0 ? quant_rmse / cand_rmse : 0; }
};

// A routed expert of a MoE layer: its outputs (`moe.expert_out` rows of the
// tokens routed to it, pooled over all steps) on the quantised weights
// against the source's, and its weights' own rounding.
struct QuantExpertRow {
  int layer = 0, expert = 0;
  int rows = 0;             // tokens both truths routed to the expert
  double source_rms = 0;    // rms of those rows in the source truth
  double quant_rmse = 0;    // quantised truth vs source truth on them
  double cand_rmse = -1;    // candidate vs source truth on the tokens both routed to it (-1: none)
  std::string types;        // the quantised checkpoint's gate, up, down types ("Q4_K Q4_K Q6_K"); "" unknown
  double weight_rel = -1;   // rms(dequantised - source) / rms(source) over gate, up, down; -1 unknown
};

// A MoE layer's expert choices: how many tokens the quantisation (and the
// candidate) routed to other experts than the source weights do. A choice
// changes only where the source's scores were closer than the quantisation
// moved them: a near-tie, its size given by score_shift.
struct QuantRoutingRow {
  int layer = 0;
  int tokens = 0;           // tokens routed, pooled over all steps
  int changed = 0;          // of them routed otherwise by the quantised truth
  int cand_changed = -1;    // ... by the candidate (-1: it lacks moe.topk_ids)
  double score_shift = 0;   // largest router score change (moe.router_probs) on a changed token
};

struct QuantErrorReport {
  std::string source, quantised;  // labels of the two truths
  std::vector<QuantErrorRow> rows;  // layers ascending, then next_logits
  std::vector<QuantRoutingRow> routing;  // MoE layers ascending
  std::vector<QuantExpertRow> experts;   // (layer, expert) ascending, experts routed in both truths
};

// Pools each layer's `layers.{i}.out` and every step's `next_logits` over
// all steps present in both truths (RMSEs over the pooled elements); on MoE
// layers whose truths hold moe.topk_ids / moe.expert_out / moe.router_probs,
// the routing rows and a row per routed expert (weights not filled).
QuantErrorReport quantisation_error(const TensorSource& source_truth, const TensorSource& quantised_truth,
                                    const TensorSource& cand);

// Fills the expert rows' weight columns: each expert's gate, up and down of
// `quantised` (dequantised) against `source`'s, layer by layer.
void add_expert_weight_errors(QuantErrorReport& r, const ModelWeights& source, const ModelWeights& quantised);

// A text table, one row per layer and one for the logits; then, for MoE
// models, the routing changes per layer and a row per routed expert.
std::string render_quant_error(const QuantErrorReport& r);
// The same as JSON (the "quantisation" field of llmdiff.bisect/1):
// {"source", "quantised", "rows": [{"group", "layer", "names", "source_rms",
// "quant_rmse", "cand_rmse" (null: the candidate lacks every name),
// "explained" (null likewise)}]}.
nlohmann::json quant_error_to_json(const QuantErrorReport& r);

}  // namespace llmdiff::compare
