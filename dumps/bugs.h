// The bug zoo: classic mistakes of LLM inference engines. Each bug is one
// registry entry here, used by the impl (--inject), the ref's variant ops
// (ref/graph.h) and the diagnosis (through compare/'s runner interfaces).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "dumps/config.h"

namespace llmdiff::zoo {

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

// Whether the bug takes a numeric parameter (rope-theta, rmsnorm-eps).
bool bug_takes_value(Bug b);
// The parameter a bug uses on `cfg`: the spec's value, else the default
// (rope-theta: config theta / 10; rmsnorm-eps: 1e-5 when the config's is
// 1e-6, else 1e-6). Throws UsageError when the bug takes no value or the
// value equals the config's own (no bug at all).
double bug_value(const BugSpec& spec, const ModelConfig& cfg);

// Checks a set of bugs against a model (applicability, values); throws
// UsageError naming the first bug that cannot apply and why.
void check_bugs(const std::vector<BugSpec>& bugs, const ModelConfig& cfg);

// How the bug zoo changes a forward pass (all false: no bug). Bugs that only
// change a config value (rope-theta, rope-scaling-ignored, rmsnorm-eps,
// missing-bias) are applied to the model's config instead.
struct Faults {
  bool rope_interleaved = false;    // rope-interleaved
  bool position_reset = false;      // rope-position-reset
  bool repeat_kv_tile = false;      // repeat-kv-tile
  bool mask_square = false;         // mask-square
  bool mask_missing = false;        // mask-missing
  bool kv_overwrite = false;        // kv-overwrite
  bool last_token_first = false;    // last-token-first
  bool qk_norm_after_rope = false;  // qk-norm-after-rope
  bool softmax_scale_dh = false;    // softmax-scale
  bool gate_up_swap = false;        // gate-up-swap
  bool lm_head_embed = false;       // lm-head
};

// Applies the bugs (checked by check_bugs): config-level ones to `cfg`, the
// others to the returned Faults.
Faults apply_bugs(const std::vector<BugSpec>& bugs, ModelConfig& cfg);

}  // namespace llmdiff::zoo
