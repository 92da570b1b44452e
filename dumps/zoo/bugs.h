// The bug zoo: classic mistakes of LLM inference engines. Each bug is one
// registry entry (all_bugs() in bugs.cpp): its name and one-line description,
// the models it applies to, the substitution it makes (a config value, or an
// op switched through a Faults flag that the impl's forward and the ref's
// graph both honour), its parameter (value grid and default) when it has
// one, and the fingerprint the diagnosis recognises it by. The impl's
// --inject, the reference's variant runs and the diagnosis all read it here.
//
// Adding a bug: one entry below; for an op-level bug also its Faults flag and
// the op it changes in impl/forward.cpp and ref/graph.cpp (two independent
// engines compute it each their own way).
//
// Batch bugs (BatchFaults) act only in the continuous-batching engine
// (impl/batch_engine.h): how several sequences share one forward call and a
// paged KV cache. A single-sequence reference cannot run them, so the
// model-level loops skip them too; the diagnosis names them by their
// fingerprints (positions, probabilities, the paged cache's bookkeeping).
//
// Serving features' bugs (BatchFaults with a Feature: the prefix cache,
// speculative decoding, bucket padding) act only when the engine runs the
// feature (docs/SERVING.md); bisect names them by cross-sequence cache
// checks, speculative fingerprints and the batch replay with the feature on.
//
// Tensor-parallel bugs (TpFaults) act between the ranks of a tensor-parallel
// run (impl/tensor_parallel.h, `--tp R`, R > 1): the all-reduce of the
// row-parallel outputs and the sharding of the kv heads. A single-rank run
// cannot show them, so the model-level loops skip them too; a
// tensor-parallel candidate is judged rank by rank and by replay with each
// of them (bisect/tensor_parallel.h).
//
// Sampler bugs (sampler-*) change no tensor of the forward pass: they switch
// a SamplerFaults flag that the sampler (dumps/sampling/sampling.h) honours when an
// engine samples, and that compare/sampling_check tries when a dump's
// sample.* disagree with HF's processors. Whether a run samples is only known
// at run time, so they apply to every model and act only on sampling runs;
// model-level loops (variant runs, bisect hypotheses) skip them
// (BugInfo::acts_on_model).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "dumps/model/config.h"

namespace llmdiff::zoo {

enum class Bug {
  RopeInterleaved, RopeTheta, RopeScalingIgnored, RopePositionReset, RepeatKvTile,
  MaskSquare, MaskMissing, KvOverwrite, LastTokenFirst, RmsnormEps, MissingBias,
  QkNormAfterRope, SoftmaxScale, GateUpSwap, LmHead,
  // mixture of experts
  MoeSoftmaxRouting, MoeTopkNorm, MoeBiasInWeights, MoeNoCorrectionBias, MoeNoGroupLimit, MoeRoutedScale,
  MoeSharedMissing, MoeExpertOffByOne,
  // multi-head latent attention
  MlaRopeLayout, MlaRopeFront, MlaMscaleMissing, MlaValueAsKey,
  // sampler (HF's logits processors)
  SamplerTopPBeforeTemperature, SamplerTopKAfterTopP, SamplerPenaltySign, SamplerSoftmaxUnfiltered,
  SamplerTopPOffByOne, SamplerTopPOffByOneFewer, SamplerTemperatureTwice,
  // several sequences at once (the continuous-batching engine)
  BatchPositions, BatchCrossAttention, SlotMappingOffByOne, ContextLenPlusOne, BlockReuseEarly, BlockTableOrder,
  PadKeysUnmasked,
  // serving features: prefix cache, speculative decoding, bucket padding
  PrefixHashLastBlock, PrefixSharedWrite, SpecRollbackMissing, SpecContextRejected, SpecAcceptOffByOne,
  BucketPadLeak,
  // tensor parallelism (several ranks in one engine)
  TpAllReduceMissing, TpAllReduceTwice, TpKvHeadsSplit
};

// How a forward pass runs under the zoo's op-level bugs (all false: no bug).
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
  bool moe_softmax_scoring = false;  // moe-softmax-routing
  bool moe_bias_in_weights = false;  // moe-bias-in-weights
  bool moe_shared_missing = false;   // moe-shared-missing
  bool moe_expert_shift = false;     // moe-expert-off-by-one
  bool mla_rope_front = false;       // mla-rope-front
  bool mla_no_mscale = false;        // mla-mscale-missing
  bool mla_value_as_key = false;     // mla-value-as-key
  bool pad_keys_unmasked = false;    // pad-keys-unmasked (acts on a left-padded row only)
};

// How the sampler (dumps/sampling/sampling.h) departs from HF's logits processors
// (all false: HF's order and rules).
struct SamplerFaults {
  bool top_p_before_temperature = false;  // sampler-top-p-before-temperature
  bool top_k_after_top_p = false;         // sampler-top-k-after-top-p
  bool penalty_sign = false;              // sampler-penalty-sign
  bool softmax_unfiltered = false;        // sampler-softmax-unfiltered
  bool top_p_one_more = false;            // sampler-top-p-off-by-one
  bool top_p_one_fewer = false;           // sampler-top-p-off-by-one-fewer
  bool temperature_twice = false;         // sampler-temperature-twice
  bool any() const;
};

// How an engine that runs several sequences together (impl/batch_engine.h:
// packed rows, a paged KV cache) departs from running each alone (all false:
// it does not).
struct BatchFaults {
  bool positions_from_batch_start = false;  // batch-positions
  bool cross_attention = false;             // packed-cross-attention
  bool slot_mapping_shift = false;          // slot-mapping-off-by-one
  bool context_one_long = false;            // context-len-plus-one
  bool free_after_prefill = false;          // block-reuse-early
  bool blocks_swapped = false;              // block-table-order
  // serving features (each acts only when its feature is on: BugInfo::feature)
  bool prefix_hash_last_block = false;      // prefix-hash-last-block
  bool prefix_shared_write = false;         // prefix-shared-write
  bool spec_rollback_missing = false;       // spec-rollback-missing
  bool spec_context_rejected = false;       // spec-context-rejected
  bool spec_accept_off_by_one = false;      // spec-accept-off-by-one
  bool bucket_pad_leak = false;             // bucket-pad-leak
  bool any() const;
};

// The serving features a bug can need to act at all.
enum class Feature { None, PrefixCache, Speculative, BucketPadding };
const char* feature_name(Feature f);  // "prefix cache", "speculative decoding", "bucket padding"
// How a tensor-parallel run (impl/tensor_parallel.h) departs from the
// sharding and all-reduce of docs/DUMP_FORMAT.md "Tensor parallelism" (all
// false: it does not). They act only with R > 1 ranks.
struct TpFaults {
  bool allreduce_missing = false;  // tp-allreduce-missing
  bool allreduce_twice = false;    // tp-allreduce-twice
  bool kv_heads_split = false;     // tp-kv-heads-split
  bool any() const;
};

// The divergence patterns compare/'s fingerprints test (compare/diagnose.cpp);
// each bug names the one it leaves.
enum class Signature {
  None,
  HeadOnly,           // final_norm matches, logits do not
  LastRowFirst,       // next_logits / last_hidden are the first row's
  PositionsRestart,   // positions restart at 0 in a later call
  MaskAllowsAll,      // the mask allows every key
  MaskIgnoresPast,    // the mask allows key s iff s <= t
  CacheHoldsCallOnly, // the KV cache holds only this call's positions
  KvHeadsTiled,       // query head h reads kv head h mod Hkv
  GateUpSwapped,      // act = silu(up) * gate
  ScoresRescaled,     // scores scaled by 1/Dh
  InvFreqUnscaled,    // rope.inv_freq without the config's scaling
  InvFreqTheta,       // rope.inv_freq of another theta (fits the value)
  RowConstantOffset,  // the same vector off in every row (a bias)
  // several sequences (compare/paged_kv.h, compare/batch_report.h)
  PositionsShifted,   // a call's positions start k > 0 after the cached ones
  AttentionLeak,      // probabilities over the sequence's own keys sum to < 1
  SlotMappingOff,     // kv.slot_mapping not where the block table puts the position
  ContextTooLong,     // kv.context_len above the positions the sequence holds
  BlockShared,        // a block in the tables of two live sequences
  BlocksOutOfOrder,   // the gathered cache holds the sequence's blocks in another order
  // serving features
  PrefixBlockStale,       // a block served from the prefix cache holds another prefix's keys
  PrefixBlockOverwritten, // a shared block's positions overwritten by another sequence's
  RollbackMissing,        // the call after a verify call continues after the rejected drafts
  ContextCountsRejected,  // attention reads the rejected drafts' positions after the rollback
  AcceptedMiscounted,     // spec.accepted differs from the drafts the target's argmax agrees with
  PaddingLeak,            // the real rows attend the padding rows of a bucket
};

struct BugSpec;

struct BugInfo {
  Bug bug;
  const char* name;         // "rope-interleaved", ...
  const char* description;  // one line
  // Empty when the bug applies to the model, else why not (null: always applies).
  std::string (*inapplicable)(const ModelConfig& cfg) = nullptr;
  // The substitution: a config change, a Faults flag, or a SamplerFaults
  // flag (one of them).
  void (*change_config)(ModelConfig& cfg, double value) = nullptr;
  bool Faults::*fault = nullptr;
  bool SamplerFaults::*sampler_fault = nullptr;
  bool BatchFaults::*batch_fault = nullptr;
  bool TpFaults::*tp_fault = nullptr;
  // A parameterised bug: the config value it replaces ("rope theta"), the
  // model's own value, the value used when none is given, and the values a
  // diagnosis tries (the config's own is left out).
  const char* parameter = nullptr;
  double (*configured)(const ModelConfig& cfg) = nullptr;
  double (*default_value)(const ModelConfig& cfg) = nullptr;
  std::vector<double> (*grid)(const ModelConfig& cfg) = nullptr;
  bool positive_only = false;  // the parameter must be > 0 (else >= 0)
  // Acts only on a row of a left-padded batch (Scenario::left_pad > 0): a
  // run without padding is the clean model's, so no need to replay it there.
  bool needs_padding = false;
  // Acts only on a forward call that attends to positions earlier calls
  // cached (a decode step, a later chunk): every call before the first such
  // one runs as the clean model's, so a replay may start there with the
  // candidate's own caches (compare::HypothesisRunner::replay_start).
  bool needs_cached_positions = false;
  // Acts only when the engine runs this serving feature (None: always).
  Feature feature = Feature::None;
  Signature signature = Signature::None;
  bool takes_value() const { return parameter != nullptr; }
  // Whether the bug changes the model's forward pass (a config change or a
  // Faults flag); false for sampler bugs, which only act when sampling.
  bool acts_on_model() const { return change_config != nullptr || fault != nullptr; }
  bool is_sampler() const { return sampler_fault != nullptr; }
  // Acts only in an engine running several sequences at once.
  bool is_batch() const { return batch_fault != nullptr; }
  // Acts only between the ranks of a tensor-parallel run.
  bool is_tensor_parallel() const { return tp_fault != nullptr; }
};
const std::vector<BugInfo>& all_bugs();
const BugInfo& bug_info(Bug b);
// The entry by name (nullptr when unknown).
const BugInfo* find_bug(const std::string& name);
// The bug whose fingerprint is `s`.
const BugInfo& bug_with_signature(Signature s);

// A bug with an optional numeric parameter: "rope-theta=50000", "rmsnorm-eps=1e-5".
// Without one, the entry's default is used.
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
// The parameter a bug uses on `cfg`: the spec's value, else the entry's
// default. Throws UsageError when the bug takes no value or the value equals
// the config's own (no bug at all).
double bug_value(const BugSpec& spec, const ModelConfig& cfg);

// Checks a set of bugs against a model (applicability, values); throws
// UsageError naming the first bug that cannot apply and why.
void check_bugs(const std::vector<BugSpec>& bugs, const ModelConfig& cfg);

// Applies the bugs (checked by check_bugs): config-level ones to `cfg`, the
// op-level ones to the returned Faults. Sampler bugs are left out (see
// sampler_faults).
Faults apply_bugs(const std::vector<BugSpec>& bugs, ModelConfig& cfg);

// The sampler bugs among `bugs`, as the flags the sampler honours.
SamplerFaults sampler_faults(const std::vector<BugSpec>& bugs);
// The entries of the sampler bugs, in registry order.
std::vector<const BugInfo*> sampler_bugs();

// The batch bugs among `bugs`, as the flags the batching engine honours.
BatchFaults batch_faults(const std::vector<BugSpec>& bugs);
// The entries of the batch bugs, in registry order.
std::vector<const BugInfo*> batch_bugs();

// The tensor-parallel bugs among `bugs`, as the flags the ranks honour.
TpFaults tp_faults(const std::vector<BugSpec>& bugs);
// The entries of the tensor-parallel bugs, in registry order.
std::vector<const BugInfo*> tp_bugs();

}  // namespace llmdiff::zoo
