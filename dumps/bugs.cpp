#include "dumps/bugs.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "dumps/errors.h"

namespace llmdiff::zoo {

const std::vector<BugInfo>& all_bugs() {
  static const std::vector<BugInfo> bugs = {
      {Bug::RopeInterleaved, "rope-interleaved",
       "rotates adjacent pairs (2i, 2i+1) at frequency i instead of (i, i+Dh/2)"},
      {Bug::RopeTheta, "rope-theta", "uses another rope_theta (=VALUE; default: config theta / 10)"},
      {Bug::RopeScalingIgnored, "rope-scaling-ignored", "ignores the config's rope_scaling"},
      {Bug::RopePositionReset, "rope-position-reset",
       "positions restart at 0 in every forward call instead of continuing after the cache"},
      {Bug::RepeatKvTile, "repeat-kv-tile", "query head h reads kv head h mod Hkv instead of h / (Hq/Hkv)"},
      {Bug::MaskSquare, "mask-square", "causal mask built as if the call had no past: key s allowed iff s <= t"},
      {Bug::MaskMissing, "mask-missing", "no causal mask"},
      {Bug::KvOverwrite, "kv-overwrite", "replaces the KV cache with this call's K/V instead of appending"},
      {Bug::LastTokenFirst, "last-token-first", "feeds the first position's hidden state to next_logits, not the last"},
      {Bug::RmsnormEps, "rmsnorm-eps",
       "RMSNorm epsilon other than the config's (=VALUE; default: 1e-5 if the config's is 1e-6, else 1e-6)"},
      {Bug::MissingBias, "missing-bias", "drops the q/k/v projection biases"},
      {Bug::QkNormAfterRope, "qk-norm-after-rope", "applies Qwen3's q_norm/k_norm after RoPE instead of before"},
      {Bug::SoftmaxScale, "softmax-scale", "scales attention scores by 1/Dh instead of 1/sqrt(Dh)"},
      {Bug::GateUpSwap, "gate-up-swap", "computes silu(up) * gate instead of silu(gate) * up"},
      {Bug::LmHead, "lm-head", "computes logits with the embedding matrix instead of the untied lm_head"},
  };
  return bugs;
}

const char* bug_name(Bug b) {
  for (const BugInfo& info : all_bugs())
    if (info.bug == b) return info.name;
  return "unknown-bug";
}

bool bug_takes_value(Bug b) { return b == Bug::RopeTheta || b == Bug::RmsnormEps; }

namespace {

std::string bug_list() {
  std::string out;
  for (const BugInfo& info : all_bugs()) out += std::string(out.empty() ? "" : ", ") + info.name;
  return out;
}

// Shortest decimal text that reads back as exactly `v` (integers in full).
std::string format_value(double v) {
  char buf[40];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
    return buf;
  }
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

}  // namespace

std::string BugSpec::str() const {
  std::string s = bug_name(bug);
  if (value) s += "=" + format_value(*value);
  return s;
}

BugSpec parse_bug(const std::string& text) {
  const size_t eq = text.find('=');
  const std::string name = text.substr(0, eq);
  for (const BugInfo& info : all_bugs()) {
    if (name != info.name) continue;
    BugSpec spec{info.bug, std::nullopt};
    if (eq == std::string::npos) return spec;
    if (!bug_takes_value(info.bug))
      throw UsageError("bug '" + name + "' takes no value (only rope-theta and rmsnorm-eps do), got '" + text + "'");
    const std::string value = text.substr(eq + 1);
    char* end = nullptr;
    const double v = value.empty() ? 0.0 : std::strtod(value.c_str(), &end);
    const bool positive_only = info.bug == Bug::RopeTheta;
    if (value.empty() || *end != '\0' || !std::isfinite(v) || v < 0.0 || (positive_only && v == 0.0))
      throw UsageError("bug '" + name + "': value must be a " + (positive_only ? "positive" : "non-negative") +
                       " number, got '" + value + "'");
    spec.value = v;
    return spec;
  }
  throw UsageError("unknown bug '" + name + "' (known: " + bug_list() + ")");
}

std::string bug_inapplicable_reason(Bug b, const ModelConfig& cfg) {
  const int64_t hq = cfg.num_attention_heads, hkv = cfg.num_key_value_heads;
  switch (b) {
    case Bug::MissingBias:
      if (!cfg.qkv_bias) return "the model's q/k/v projections have no bias";
      break;
    case Bug::RepeatKvTile:
      if (hkv == hq)
        return "every query head has its own kv head (Hq = Hkv = " + std::to_string(hq) +
               "), so tiling and grouping read the same head";
      if (hkv == 1) return "all query heads share one kv head (MQA), so tiling and grouping read the same head";
      break;
    case Bug::QkNormAfterRope:
      if (!cfg.qk_norm) return "the model has no per-head q_norm/k_norm (Qwen3 only)";
      break;
    case Bug::LmHead:
      if (cfg.tie_word_embeddings) return "lm_head is tied to the embedding: both are the same matrix";
      break;
    case Bug::RopeScalingIgnored:
      if (cfg.rope_scaling.type == RopeScaling::Type::Default) return "the config has no rope_scaling to ignore";
      break;
    default:
      break;
  }
  return "";
}

double bug_value(const BugSpec& spec, const ModelConfig& cfg) {
  double v = 0, config_value = 0;
  switch (spec.bug) {
    case Bug::RopeTheta:
      config_value = cfg.rope_theta;
      v = spec.value ? *spec.value : cfg.rope_theta / 10.0;
      break;
    case Bug::RmsnormEps:
      config_value = cfg.rms_norm_eps;
      v = spec.value ? *spec.value : (cfg.rms_norm_eps == 1e-6 ? 1e-5 : 1e-6);
      break;
    default:
      throw UsageError(std::string("bug '") + bug_name(spec.bug) + "' takes no value");
  }
  if (v == config_value)
    throw UsageError("bug '" + spec.str() + "' uses the config's own value " + format_value(config_value) +
                     ": that is no bug");
  return v;
}

void check_bugs(const std::vector<BugSpec>& bugs, const ModelConfig& cfg) {
  for (const BugSpec& b : bugs) {
    const std::string why = bug_inapplicable_reason(b.bug, cfg);
    if (!why.empty()) throw UsageError("bug '" + b.str() + "' cannot apply to " + cfg.source + ": " + why);
    if (bug_takes_value(b.bug)) bug_value(b, cfg);
  }
}

Faults apply_bugs(const std::vector<BugSpec>& bugs, ModelConfig& cfg) {
  Faults f;
  for (const BugSpec& b : bugs) {
    switch (b.bug) {
      case Bug::RopeInterleaved: f.rope_interleaved = true; break;
      case Bug::RopeTheta: cfg.rope_theta = bug_value(b, cfg); break;
      case Bug::RopeScalingIgnored: cfg.rope_scaling = RopeScaling{}; break;
      case Bug::RopePositionReset: f.position_reset = true; break;
      case Bug::RepeatKvTile: f.repeat_kv_tile = true; break;
      case Bug::MaskSquare: f.mask_square = true; break;
      case Bug::MaskMissing: f.mask_missing = true; break;
      case Bug::KvOverwrite: f.kv_overwrite = true; break;
      case Bug::LastTokenFirst: f.last_token_first = true; break;
      case Bug::RmsnormEps: cfg.rms_norm_eps = bug_value(b, cfg); break;
      case Bug::MissingBias: cfg.qkv_bias = false; break;
      case Bug::QkNormAfterRope: f.qk_norm_after_rope = true; break;
      case Bug::SoftmaxScale: f.softmax_scale_dh = true; break;
      case Bug::GateUpSwap: f.gate_up_swap = true; break;
      case Bug::LmHead: f.lm_head_embed = true; break;
    }
  }
  return f;
}

}  // namespace llmdiff::zoo
