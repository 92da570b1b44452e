#include "dumps/zoo/bugs.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "dumps/base/errors.h"

namespace llmdiff::zoo {

namespace {

// Sorted, rounded to 12 significant digits (so that config / 10 meets the
// round value it stands for), without duplicates or the config's own value.
std::vector<double> grid_without(std::vector<double> v, double config_value) {
  for (double& x : v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.12g", x);
    x = std::strtod(buf, nullptr);
  }
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  v.erase(std::remove(v.begin(), v.end(), config_value), v.end());
  return v;
}

// Inapplicability of the MoE and MLA bugs to a model without those blocks.
std::string moe_only(const ModelConfig& c) { return c.moe.enabled() ? "" : "the model has no mixture-of-experts layers"; }
std::string mla_only(const ModelConfig& c) { return c.mla.enabled ? "" : "the model has no multi-head latent attention"; }

}  // namespace

// The zoo. Grids hold common values of public checkpoints, the bug's
// default and the config value x/÷ 10.
const std::vector<BugInfo>& all_bugs() {
  static const std::vector<BugInfo> bugs = [] {
    std::vector<BugInfo> z;
    auto add = [&](Bug b, const char* name, const char* description) -> BugInfo& {
      BugInfo i;
      i.bug = b;
      i.name = name;
      i.description = description;
      z.push_back(i);
      return z.back();
    };
    {
      BugInfo& b = add(Bug::RopeInterleaved, "rope-interleaved",
                       "rotates adjacent pairs (2i, 2i+1) at frequency i instead of (i, i+Dh/2)");
      b.inapplicable = [](const ModelConfig& c) -> std::string {
        return c.mla.enabled ? "MLA's rope layout is the config's rope_interleave (see mla-rope-layout)" : "";
      };
      b.fault = &Faults::rope_interleaved;
    }
    {
      BugInfo& b = add(Bug::RopeTheta, "rope-theta", "uses another rope_theta (=VALUE; default: config theta / 10)");
      b.change_config = [](ModelConfig& c, double v) { c.rope_theta = v; };
      b.parameter = "rope theta";
      b.configured = [](const ModelConfig& c) { return c.rope_theta; };
      b.default_value = [](const ModelConfig& c) { return c.rope_theta / 10.0; };
      b.grid = [](const ModelConfig& c) {
        const double t = c.rope_theta;
        return grid_without({1e4, 5e4, 1e5, 5e5, 1e6, 1e7, t / 10, t * 10, t / 2, t * 2}, t);
      };
      b.positive_only = true;
      b.signature = Signature::InvFreqTheta;
    }
    {
      BugInfo& b = add(Bug::RopeScalingIgnored, "rope-scaling-ignored", "ignores the config's rope_scaling");
      b.inapplicable = [](const ModelConfig& c) -> std::string {
        return c.rope_scaling.type == RopeScaling::Type::Default ? "the config has no rope_scaling to ignore" : "";
      };
      b.change_config = [](ModelConfig& c, double) { c.rope_scaling = RopeScaling{}; };
      b.signature = Signature::InvFreqUnscaled;
    }
    {
      BugInfo& b = add(Bug::RopePositionReset, "rope-position-reset",
                       "positions restart at 0 in every forward call instead of continuing after the cache");
      b.fault = &Faults::position_reset;
      b.needs_cached_positions = true;
      b.signature = Signature::PositionsRestart;
    }
    {
      BugInfo& b = add(Bug::RepeatKvTile, "repeat-kv-tile",
                       "query head h reads kv head h mod Hkv instead of h / (Hq/Hkv)");
      b.inapplicable = [](const ModelConfig& c) -> std::string {
        const int64_t hq = c.num_attention_heads, hkv = c.num_key_value_heads;
        if (hkv == hq)
          return "every query head has its own kv head (Hq = Hkv = " + std::to_string(hq) +
                 "), so tiling and grouping read the same head";
        if (hkv == 1) return "all query heads share one kv head (MQA), so tiling and grouping read the same head";
        return "";
      };
      b.fault = &Faults::repeat_kv_tile;
      b.signature = Signature::KvHeadsTiled;
    }
    {
      BugInfo& b = add(Bug::MaskSquare, "mask-square",
                       "causal mask built as if the call had no past: key s allowed iff s <= t");
      b.fault = &Faults::mask_square;
      b.needs_cached_positions = true;
      b.signature = Signature::MaskIgnoresPast;
    }
    {
      BugInfo& b = add(Bug::MaskMissing, "mask-missing", "no causal mask");
      b.fault = &Faults::mask_missing;
      b.signature = Signature::MaskAllowsAll;
    }
    {
      BugInfo& b = add(Bug::KvOverwrite, "kv-overwrite",
                       "replaces the KV cache with this call's K/V instead of appending");
      b.fault = &Faults::kv_overwrite;
      b.needs_cached_positions = true;
      b.signature = Signature::CacheHoldsCallOnly;
    }
    {
      BugInfo& b = add(Bug::LastTokenFirst, "last-token-first",
                       "feeds the first position's hidden state to next_logits, not the last");
      b.fault = &Faults::last_token_first;
      b.signature = Signature::LastRowFirst;
    }
    {
      BugInfo& b = add(Bug::RmsnormEps, "rmsnorm-eps",
                       "RMSNorm epsilon other than the config's (=VALUE; default: 1e-5 if the config's is 1e-6, else "
                       "1e-6)");
      b.change_config = [](ModelConfig& c, double v) { c.rms_norm_eps = v; };
      b.parameter = "rmsnorm eps";
      b.configured = [](const ModelConfig& c) { return c.rms_norm_eps; };
      b.default_value = [](const ModelConfig& c) { return c.rms_norm_eps == 1e-6 ? 1e-5 : 1e-6; };
      b.grid = [](const ModelConfig& c) {
        const double e = c.rms_norm_eps;
        return grid_without({0.0, 1e-12, 1e-8, 1e-6, 1e-5, 1e-4, 1e-3, e / 10, e * 10}, e);
      };
    }
    {
      BugInfo& b = add(Bug::MissingBias, "missing-bias", "drops the q/k/v projection biases");
      b.inapplicable = [](const ModelConfig& c) -> std::string {
        return c.qkv_bias ? "" : "the model's q/k/v projections have no bias";
      };
      b.change_config = [](ModelConfig& c, double) { c.qkv_bias = false; };
      b.signature = Signature::RowConstantOffset;
    }
    {
      BugInfo& b = add(Bug::QkNormAfterRope, "qk-norm-after-rope",
                       "applies Qwen3's q_norm/k_norm after RoPE instead of before");
      b.inapplicable = [](const ModelConfig& c) -> std::string {
        return c.qk_norm ? "" : "the model has no per-head q_norm/k_norm (Qwen3 only)";
      };
      b.fault = &Faults::qk_norm_after_rope;
    }
    {
      BugInfo& b = add(Bug::SoftmaxScale, "softmax-scale", "scales attention scores by 1/Dh instead of 1/sqrt(Dh)");
      b.fault = &Faults::softmax_scale_dh;
      b.signature = Signature::ScoresRescaled;
    }
    {
      BugInfo& b = add(Bug::GateUpSwap, "gate-up-swap", "computes silu(up) * gate instead of silu(gate) * up");
      b.fault = &Faults::gate_up_swap;
      b.signature = Signature::GateUpSwapped;
    }
    {
      BugInfo& b = add(Bug::LmHead, "lm-head", "computes logits with the embedding matrix instead of the untied lm_head");
      b.inapplicable = [](const ModelConfig& c) -> std::string {
        return c.tie_word_embeddings ? "lm_head is tied to the embedding: both are the same matrix" : "";
      };
      b.fault = &Faults::lm_head_embed;
      b.signature = Signature::HeadOnly;
    }
    // --- mixture of experts
    auto sigmoid_only = [](const ModelConfig& c) -> std::string {
      if (!c.moe.enabled()) return moe_only(c);
      return c.moe.scoring == MoeConfig::Scoring::Sigmoid ? "" : "the router already scores by softmax";
    };
    auto bias_only = [](const ModelConfig& c) -> std::string {
      return c.moe.enabled() && c.moe.correction_bias ? "" : "the router has no e_score_correction_bias";
    };
    {
      BugInfo& b = add(Bug::MoeSoftmaxRouting, "moe-softmax-routing",
                       "scores experts by a softmax over the router logits instead of the model's sigmoid");
      b.inapplicable = sigmoid_only;
      b.fault = &Faults::moe_softmax_scoring;
    }
    {
      BugInfo& b = add(Bug::MoeTopkNorm, "moe-topk-norm",
                       "renormalises the top-k routing weights when the model does not, or not when it does");
      b.inapplicable = [](const ModelConfig& c) -> std::string {
        if (!c.moe.enabled()) return moe_only(c);
        return c.moe.top_k > 1 ? "" : "one expert per token: its renormalised weight is the same either way";
      };
      b.change_config = [](ModelConfig& c, double) { c.moe.norm_topk_prob = !c.moe.norm_topk_prob; };
    }
    {
      BugInfo& b = add(Bug::MoeBiasInWeights, "moe-bias-in-weights",
                       "weights experts by score + e_score_correction_bias (the bias only steers the choice)");
      b.inapplicable = bias_only;
      b.fault = &Faults::moe_bias_in_weights;
    }
    {
      BugInfo& b = add(Bug::MoeNoCorrectionBias, "moe-no-correction-bias",
                       "chooses experts without the e_score_correction_bias");
      b.inapplicable = bias_only;
      b.change_config = [](ModelConfig& c, double) { c.moe.correction_bias = false; };
    }
    {
      BugInfo& b = add(Bug::MoeNoGroupLimit, "moe-no-group-limit",
                       "chooses among all experts instead of the topk_group best groups");
      b.inapplicable = [](const ModelConfig& c) -> std::string {
        if (!c.moe.enabled() || c.moe.scoring != MoeConfig::Scoring::Sigmoid) return "the router has no expert groups";
        return c.moe.topk_group < c.moe.n_group ? "" : "every group is kept (topk_group = n_group)";
      };
      b.change_config = [](ModelConfig& c, double) { c.moe.topk_group = c.moe.n_group; };
    }
    {
      BugInfo& b = add(Bug::MoeRoutedScale, "moe-routed-scale", "leaves out routed_scaling_factor from the weights");
      b.inapplicable = [](const ModelConfig& c) -> std::string {
        if (!c.moe.enabled()) return moe_only(c);
        return c.moe.routed_scaling_factor != 1.0 ? "" : "routed_scaling_factor is 1";
      };
      b.change_config = [](ModelConfig& c, double) { c.moe.routed_scaling_factor = 1.0; };
    }
    {
      BugInfo& b = add(Bug::MoeSharedMissing, "moe-shared-missing", "leaves out the shared expert");
      b.inapplicable = [](const ModelConfig& c) -> std::string {
        return c.moe.enabled() && c.moe.shared_intermediate_size > 0 ? "" : "the model has no shared expert";
      };
      b.fault = &Faults::moe_shared_missing;
    }
    {
      BugInfo& b = add(Bug::MoeExpertOffByOne, "moe-expert-off-by-one",
                       "runs expert (e + 1) mod E for a token routed to expert e (expert index off by one)");
      b.inapplicable = moe_only;
      b.fault = &Faults::moe_expert_shift;
    }
    // --- multi-head latent attention
    {
      BugInfo& b = add(Bug::MlaRopeLayout, "mla-rope-layout",
                       "ignores rope_interleave: rotates the rope dims without reordering pairs to halves, or the "
                       "other way round");
      b.inapplicable = mla_only;
      b.change_config = [](ModelConfig& c, double) { c.mla.rope_interleave = !c.mla.rope_interleave; };
    }
    {
      BugInfo& b = add(Bug::MlaRopeFront, "mla-rope-front",
                       "rotates the first qk_rope_head_dim dims of each query head instead of the last");
      b.inapplicable = mla_only;
      b.fault = &Faults::mla_rope_front;
    }
    {
      BugInfo& b = add(Bug::MlaMscaleMissing, "mla-mscale-missing",
                       "leaves yarn's mscale^2 out of the softmax scaling");
      b.inapplicable = [](const ModelConfig& c) -> std::string {
        if (!c.mla.enabled) return mla_only(c);
        return c.attn_scaling() != std::pow(double(c.mla.qk_head_dim()), -0.5)
                   ? ""
                   : "the scaling has no mscale (no yarn rope_scaling with mscale_all_dim)";
      };
      b.fault = &Faults::mla_no_mscale;
    }
    {
      BugInfo& b = add(Bug::MlaValueAsKey, "mla-value-as-key",
                       "takes the keys' nope part from kv_b's value rows (an absorbed engine absorbing the wrong "
                       "half of kv_b)");
      b.inapplicable = [](const ModelConfig& c) -> std::string {
        if (!c.mla.enabled) return mla_only(c);
        return c.mla.qk_nope_head_dim == c.mla.v_head_dim ? "" : "qk_nope_head_dim != v_head_dim";
      };
      b.fault = &Faults::mla_value_as_key;
    }
    {
      BugInfo& b = add(Bug::PadKeysUnmasked, "pad-keys-unmasked",
                       "a row of a left-padded batch attends its pad tokens: the attention mask leaves the pad keys "
                       "open (only the causal part is applied)");
      b.fault = &Faults::pad_keys_unmasked;
      b.needs_padding = true;
    }
    // --- sampler: they apply to every model and act only when the run samples
    // (dumps/sampling/sampling.h); HF's processor order is penalty, temperature, top-k,
    // top-p, min-p.
    auto sampler = [&](Bug bug, const char* name, const char* description, bool SamplerFaults::*flag) {
      add(bug, name, description).sampler_fault = flag;
    };
    sampler(Bug::SamplerTopPBeforeTemperature, "sampler-top-p-before-temperature",
            "sampling: applies top-p to the scores before dividing them by the temperature",
            &SamplerFaults::top_p_before_temperature);
    sampler(Bug::SamplerTopKAfterTopP, "sampler-top-k-after-top-p",
            "sampling: applies top-k after top-p (top-p then sees the whole vocabulary)",
            &SamplerFaults::top_k_after_top_p);
    sampler(Bug::SamplerPenaltySign, "sampler-penalty-sign",
            "sampling: the repetition penalty divides every seen token's logit, negative ones too (raising them)",
            &SamplerFaults::penalty_sign);
    sampler(Bug::SamplerSoftmaxUnfiltered, "sampler-softmax-unfiltered",
            "sampling: draws from the softmax of the raw next_logits instead of the processed scores",
            &SamplerFaults::softmax_unfiltered);
    sampler(Bug::SamplerTopPOffByOne, "sampler-top-p-off-by-one",
            "sampling: top-p keeps one token too many (the most probable one it should remove)",
            &SamplerFaults::top_p_one_more);
    sampler(Bug::SamplerTopPOffByOneFewer, "sampler-top-p-off-by-one-fewer",
            "sampling: top-p keeps one token too few (removes the one whose mass crosses top_p)",
            &SamplerFaults::top_p_one_fewer);
    sampler(Bug::SamplerTemperatureTwice, "sampler-temperature-twice",
            "sampling: divides the scores by the temperature twice", &SamplerFaults::temperature_twice);
    // --- several sequences at once: they act in the continuous-batching
    // engine (impl/batch_engine.h) and are named by their fingerprints.
    auto batch = [&](Bug bug, const char* name, const char* description, bool BatchFaults::*flag, Signature sig) {
      BugInfo& b = add(bug, name, description);
      b.batch_fault = flag;
      b.signature = sig;
    };
    batch(Bug::BatchPositions, "batch-positions",
          "position ids counted from the start of the batch's rows (the padded or packed start), not from the "
          "sequence's own first token", &BatchFaults::positions_from_batch_start, Signature::PositionsShifted);
    batch(Bug::BatchCrossAttention, "packed-cross-attention",
          "packed attention that is not block-diagonal: a sequence's queries also attend the keys of the sequences "
          "before it in the same forward call", &BatchFaults::cross_attention, Signature::AttentionLeak);
    batch(Bug::SlotMappingOffByOne, "slot-mapping-off-by-one",
          "writes each new key/value one slot after the one its block table gives (slot mapping off by one)",
          &BatchFaults::slot_mapping_shift, Signature::SlotMappingOff);
    batch(Bug::ContextLenPlusOne, "context-len-plus-one",
          "attention reads one cached position too many (context length S+1: a stale slot)",
          &BatchFaults::context_one_long, Signature::ContextTooLong);
    batch(Bug::BlockReuseEarly, "block-reuse-early",
          "frees a sequence's blocks when its prefill ends, so a sequence admitted later is given them while the "
          "first still reads them", &BatchFaults::free_after_prefill, Signature::BlockShared);
    batch(Bug::BlockTableOrder, "block-table-order",
          "gathers a sequence's cache with the first two blocks of its table swapped once both are full (blocks "
          "out of order)",
          &BatchFaults::blocks_swapped, Signature::BlocksOutOfOrder);
    // --- serving features (the continuous-batching engine with the feature on)
    auto serving = [&](Bug bug, const char* name, const char* description, bool BatchFaults::*flag, Signature sig,
                       Feature feature) { batch(bug, name, description, flag, sig), z.back().feature = feature; };
    serving(Bug::PrefixHashLastBlock, "prefix-hash-last-block",
            "hashes a prefix-cache block by its own tokens only, not the whole prefix before it: a prompt whose "
            "block matches another prompt's is served that prompt's stale block",
            &BatchFaults::prefix_hash_last_block, Signature::PrefixBlockStale, Feature::PrefixCache);
    serving(Bug::PrefixSharedWrite, "prefix-shared-write",
            "writes a sequence's new positions into a partly filled block it shares with the prefix cache instead "
            "of copying it first (no copy-on-write): the block's other readers see them",
            &BatchFaults::prefix_shared_write, Signature::PrefixBlockOverwritten, Feature::PrefixCache);
    serving(Bug::SpecRollbackMissing, "spec-rollback-missing",
            "keeps a verify call's rejected drafts in the KV cache: the next call continues after them",
            &BatchFaults::spec_rollback_missing, Signature::RollbackMissing, Feature::Speculative);
    serving(Bug::SpecContextRejected, "spec-context-rejected",
            "rolls back a verify call's rejected drafts but still counts them in the context length: attention "
            "reads their stale slots", &BatchFaults::spec_context_rejected, Signature::ContextCountsRejected,
            Feature::Speculative);
    serving(Bug::SpecAcceptOffByOne, "spec-accept-off-by-one",
            "accepts one draft more than the target model agrees with (when it rejects any)",
            &BatchFaults::spec_accept_off_by_one, Signature::AcceptedMiscounted, Feature::Speculative);
    serving(Bug::BucketPadLeak, "bucket-pad-leak",
            "lets the real rows attend the padding rows added to fill a captured bucket shape",
            &BatchFaults::bucket_pad_leak, Signature::PaddingLeak, Feature::BucketPadding);
    // --- tensor parallelism: they act between the ranks of a run with R > 1
    // (impl/tensor_parallel.h) and are named rank by rank.
    {
      BugInfo& b = add(Bug::TpAllReduceMissing, "tp-allreduce-missing",
                       "tensor parallel: skips the all-reduce after o_proj and after the MLP/MoE block, so each "
                       "rank adds only its own partial sum to its residual stream");
      b.tp_fault = &TpFaults::allreduce_missing;
    }
    {
      BugInfo& b = add(Bug::TpAllReduceTwice, "tp-allreduce-twice",
                       "tensor parallel: all-reduces the MLP/MoE block's output twice (the row-parallel down "
                       "projection and the layer both reduce), so the residual stream gets R times the sum");
      b.tp_fault = &TpFaults::allreduce_twice;
    }
    {
      BugInfo& b = add(Bug::TpKvHeadsSplit, "tp-kv-heads-split",
                       "tensor parallel with fewer kv heads than ranks: rank r takes kv head r mod Hkv instead "
                       "of the one its query heads read (r*Hkv/R), splitting the kv heads where they should be "
                       "replicated");
      b.inapplicable = [](const ModelConfig& c) -> std::string {
        if (c.mla.enabled) return "multi-head latent attention has no kv heads to shard (the latent is replicated)";
        if (c.num_key_value_heads == 1) return "one kv head (MQA): every rank reads it whatever the split";
        if (c.num_key_value_heads == c.num_attention_heads)
          return "every query head has its own kv head: ranks never share one";
        return "";
      };
      b.tp_fault = &TpFaults::kv_heads_split;
    }
    return z;
  }();
  return bugs;
}

const BugInfo& bug_info(Bug b) {
  for (const BugInfo& info : all_bugs())
    if (info.bug == b) return info;
  throw Error("bug zoo: no entry for bug " + std::to_string(int(b)));
}

const BugInfo* find_bug(const std::string& name) {
  for (const BugInfo& info : all_bugs())
    if (name == info.name) return &info;
  return nullptr;
}

const BugInfo& bug_with_signature(Signature s) {
  for (const BugInfo& info : all_bugs())
    if (info.signature == s) return info;
  throw Error("bug zoo: no bug has fingerprint " + std::to_string(int(s)));
}

const char* bug_name(Bug b) { return bug_info(b).name; }

const char* feature_name(Feature f) {
  switch (f) {
    case Feature::PrefixCache: return "prefix cache";
    case Feature::Speculative: return "speculative decoding";
    case Feature::BucketPadding: return "bucket padding";
    case Feature::None: break;
  }
  return "none";
}

bool bug_takes_value(Bug b) { return bug_info(b).takes_value(); }

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
  const BugInfo* info = find_bug(name);
  if (!info) throw UsageError("unknown bug '" + name + "' (known: " + bug_list() + ")");
  BugSpec spec{info->bug, std::nullopt};
  if (eq == std::string::npos) return spec;
  if (!info->takes_value()) {
    std::string takers;
    for (const BugInfo& b : all_bugs())
      if (b.takes_value()) takers += std::string(takers.empty() ? "" : " and ") + b.name;
    throw UsageError("bug '" + name + "' takes no value (only " + takers + " do), got '" + text + "'");
  }
  const std::string value = text.substr(eq + 1);
  char* end = nullptr;
  const double v = value.empty() ? 0.0 : std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0' || !std::isfinite(v) || v < 0.0 || (info->positive_only && v == 0.0))
    throw UsageError("bug '" + name + "': value must be a " + (info->positive_only ? "positive" : "non-negative") +
                     " number, got '" + value + "'");
  spec.value = v;
  return spec;
}

std::string bug_inapplicable_reason(Bug b, const ModelConfig& cfg) {
  const BugInfo& info = bug_info(b);
  return info.inapplicable ? info.inapplicable(cfg) : "";
}

double bug_value(const BugSpec& spec, const ModelConfig& cfg) {
  const BugInfo& info = bug_info(spec.bug);
  if (!info.takes_value()) throw UsageError(std::string("bug '") + info.name + "' takes no value");
  const double config_value = info.configured(cfg);
  const double v = spec.value ? *spec.value : info.default_value(cfg);
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
    const BugInfo& info = bug_info(b.bug);
    if (info.fault) f.*(info.fault) = true;
    if (info.change_config) info.change_config(cfg, info.takes_value() ? bug_value(b, cfg) : 0.0);
  }
  return f;
}

bool SamplerFaults::any() const {
  for (const BugInfo* info : sampler_bugs())
    if (this->*(info->sampler_fault)) return true;
  return false;
}

SamplerFaults sampler_faults(const std::vector<BugSpec>& bugs) {
  SamplerFaults f;
  for (const BugSpec& b : bugs) {
    const BugInfo& info = bug_info(b.bug);
    if (info.sampler_fault) f.*(info.sampler_fault) = true;
  }
  return f;
}

std::vector<const BugInfo*> sampler_bugs() {
  std::vector<const BugInfo*> out;
  for (const BugInfo& info : all_bugs())
    if (info.is_sampler()) out.push_back(&info);
  return out;
}

bool BatchFaults::any() const {
  for (const BugInfo* info : batch_bugs())
    if (this->*(info->batch_fault)) return true;
  return false;
}

BatchFaults batch_faults(const std::vector<BugSpec>& bugs) {
  BatchFaults f;
  for (const BugSpec& b : bugs) {
    const BugInfo& info = bug_info(b.bug);
    if (info.batch_fault) f.*(info.batch_fault) = true;
  }
  return f;
}

std::vector<const BugInfo*> batch_bugs() {
  std::vector<const BugInfo*> out;
  for (const BugInfo& info : all_bugs())
    if (info.is_batch()) out.push_back(&info);
  return out;
}

bool TpFaults::any() const {
  for (const BugInfo* info : tp_bugs())
    if (this->*(info->tp_fault)) return true;
  return false;
}

TpFaults tp_faults(const std::vector<BugSpec>& bugs) {
  TpFaults f;
  for (const BugSpec& b : bugs) {
    const BugInfo& info = bug_info(b.bug);
    if (info.tp_fault) f.*(info.tp_fault) = true;
  }
  return f;
}

std::vector<const BugInfo*> tp_bugs() {
  std::vector<const BugInfo*> out;
  for (const BugInfo& info : all_bugs())
    if (info.is_tensor_parallel()) out.push_back(&info);
  return out;
}

}  // namespace llmdiff::zoo
