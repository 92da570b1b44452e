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

struct QuantErrorReport {
  std::string source, quantised;  // labels of the two truths
  std::vector<QuantErrorRow> rows;  // layers ascending, then next_logits
};

// Pools each layer's `layers.{i}.out` and every step's `next_logits` over
// all steps present in both truths (RMSEs over the pooled elements).
QuantErrorReport quantisation_error(const TensorSource& source_truth, const TensorSource& quantised_truth,
                                    const TensorSource& cand);

// A text table, one row per layer and one for the logits.
std::string render_quant_error(const QuantErrorReport& r);
// The same as JSON (the "quantisation" field of llmdiff.bisect/1):
// {"source", "quantised", "rows": [{"group", "layer", "names", "source_rms",
// "quant_rmse", "cand_rmse" (null: the candidate lacks every name),
// "explained" (null likewise)}]}.
nlohmann::json quant_error_to_json(const QuantErrorReport& r);

}  // namespace llmdiff::compare
