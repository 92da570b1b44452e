// The bug zoo: classic mistakes of LLM inference engines, switched on one at a
// time in the impl to prove that llmdiff finds them.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "dumps/config.h"

namespace llmdiff::impl {

enum class Bug {
  RopeInterleaved, RopeTheta, RopeScalingIgnored, RopePositionReset, RepeatKvTile,
  MaskSquare, MaskMissing, KvOverwrite, LastTokenFirst, RmsnormEps, MissingBias,
  QkNormAfterRope, SoftmaxScale, GateUpSwap, LmHead
};

struct BugInfo {
  Bug bug;
  const char* name;         // "rope-interleaved", ...
  const char* description;  // one line
};
const std::vector<BugInfo>& all_bugs();

// A bug with an optional numeric parameter: "rope-theta=50000", "rmsnorm-eps=1e-5".
// Without one, rope-theta uses a theta other than the config's and rmsnorm-eps
// an epsilon other than the config's (documented defaults).
struct BugSpec {
  Bug bug;
  std::optional<double> value;
  std::string str() const;
};
BugSpec parse_bug(const std::string& text);  // throws UsageError listing the bugs
const char* bug_name(Bug b);
// Empty string when the bug applies to the model, else why not.
std::string bug_inapplicable_reason(Bug b, const ModelConfig& cfg);

}  // namespace llmdiff::impl
