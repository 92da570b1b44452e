// The impl's one forward pass: Llama / Mistral / Qwen2 / Qwen3, their
// mixture-of-experts variants (Mixtral, Qwen2-MoE, Qwen3-MoE) and
// DeepSeek-V3's multi-head latent attention, run over the packed rows of one
// or many sequences with the KV cache behind the KvStore seam. A layer reads
// top to bottom as two named stages, attention_block (GQA, or MLA in its
// naive or absorbed form) and ffn_block (a dense SwiGLU MLP or a MoE block),
// each over every row at once; only attention itself runs sequence by
// sequence, over that sequence's own keys. Every intermediate is reported
// where it is computed, under each sequence's canonical names.
//
// With tensor parallelism (ForwardOptions::tensor_parallel = R > 1, the
// shards of impl/tensor_parallel.h) every stage runs once per rank on that
// rank's shard and its own residual stream, the ranks joined by the
// all-reduce after o_proj and after the MLP/MoE block; each rank reports its
// shards under rank{r}., the replicated names once (rank 0's, unprefixed).
//
// The single-sequence engine (impl_engine.h) is one sequence on a
// contiguous store; the continuous-batching engine (batch_engine.h) is the
// packed rows of every live sequence on a paged store. Both run every zoo
// bug that changes the forward pass (zoo::Faults, config-level bugs) and the
// batch bugs (zoo::BatchFaults) through the same code.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dumps/contract/observer.h"
#include "dumps/contract/precision.h"
#include "dumps/model/weights.h"
#include "dumps/zoo/bugs.h"
#include "impl/kernels.h"
#include "impl/kv_store.h"
#include "impl/tensor_parallel.h"
#include "impl/thread_pool.h"

namespace llmdiff::impl {

// How multi-head latent attention (deepseek_v3) runs:
// - Naive: kv_b_proj expands the latent into every head's keys and values,
//   the cache holds them in full (HF's form): Hq*(Dn+Dr+Dv) floats per token.
// - Absorbed: kv_b_proj's key rows are folded into the query (q_nope · W_uk,
//   a vector in latent space per head) and its value rows applied after
//   probs · latent; the cache holds only the latent and the shared rope key:
//   Rkv+Dr floats per token. Never observes attn.kv, k_rope, k_cache, v_cache.
enum class MlaForm { Naive, Absorbed };
const char* mla_form_name(MlaForm f);               // "naive", "absorbed"
MlaForm parse_mla_form(const std::string& text);    // throws UsageError listing both

struct ForwardOptions {
  int threads = 0;                  // 0: all cores
  std::vector<zoo::BugSpec> bugs;   // config-level, op-level and batch bugs of the zoo (sampler bugs ignored)
  // Hand each layer's mapped weight pages back to the kernel once the layer
  // is done (ModelWeights::release_layer): resident memory stays at about
  // one layer of the checkpoint, for page faults on the next call.
  bool release_weights = false;
  MlaForm mla = MlaForm::Naive;     // MLA models only
  // Roundings made on purpose (a lower-precision KV cache, rounded or 8-bit
  // matmul inputs), as a candidate's manifest declares them; empty: none.
  PrecisionProfile precision;
  // Tensor parallelism over this many ranks (impl/tensor_parallel.h); 1: none.
  int tensor_parallel = 1;
};

// One sequence's rows of a forward call.
struct SequenceRows {
  int seq = 0;                      // the sequence (names under seq{b}. when the call is batched)
  int step = 0;                     // its step number: the forward calls that included it before
  std::vector<int64_t> tokens;      // [T]
  int64_t row0 = 0, T = 0;          // rows [row0, row0 + T) of the packed batch
  std::vector<int64_t> positions;   // [T]
  std::vector<float> mask;          // [T, context]: 1 = may attend
  KvAccess kv;                      // where its keys and values go, what its attention reads
  bool all_logits = false;          // logits of every row (a speculative verify call), not only the last
  bool padding = false;             // rows added to fill a captured shape: no sequence's, reported by no name
  bool hidden = false;              // a sequence's rows reported by no name (a replayed prefix-cache hit's)
  bool reported() const { return !padding && !hidden; }
};

struct ForwardCall {
  int iteration = 0;                // the engine's forward call (rope.inv_freq is reported on call 0)
  std::vector<SequenceRows> seqs;   // in row order
  bool batched = false;             // names under seq{b}. (else the single-sequence names)
  // The layers run: all, or a shard's [first, end) from `entering` [R, D],
  // the residual stream entering layer `first`.
  int first_layer = 0, end_layer = -1;
  const std::vector<float>* entering = nullptr;
  int64_t rows() const { return seqs.empty() ? 0 : seqs.back().row0 + seqs.back().T; }
};

// The positions of a sequence's next call, the positions it writes and
// reads, and its mask, as the model and the zoo's bugs make them: P
// positions cached before the call, `pad` left-padding tokens at the
// sequence's start (masked as keys, at position 1), `ring` > 0 a ring cache
// of that many positions, `stale` positions past the cache's end that
// attention reads too (a bug's). Fills s.positions, s.kv.write_at/T/context
// and s.mask from s.tokens, s.row0.
class Forward;
void plan_rows(const Forward& f, SequenceRows& s, int64_t P, int64_t pad = 0, int64_t ring = 0, int64_t stale = 0);

class Forward {
 public:
  // Throws UsageError when a bug cannot apply to the model or the model has
  // no weights.
  Forward(const Model& model, const ForwardOptions& opt);
  ~Forward();
  Forward(const Forward&) = delete;
  Forward& operator=(const Forward&) = delete;

  // Runs `call` through the model: every sequence's new keys and values
  // written to `kv`, every site reported through `obs`. Returns each
  // sequence's next-token logits in row order [M, V] (a sequence with
  // all_logits: its T rows), or nothing for a shard that ends before the
  // last layer.
  std::vector<float> run(const ForwardCall& call, KvStore& kv, Observer& obs);

  const ModelConfig& config() const { return cfg_; }  // the model's, with the config-level bugs applied
  const zoo::Faults& faults() const { return faults_; }
  const zoo::BatchFaults& batch_faults() const { return batch_faults_; }
  int ranks() const { return tp_.ranks(); }
  const PrecisionProfile& precision() const { return opt_.precision; }
  bool absorbed() const { return absorbed_; }
  // The streams a KV store of this model needs and their widths.
  KvWidths kv_widths() const;
  // "plain C++, float32 activations[, naive MLA][, precision ...][, tensor
  // parallel over R ranks]" for a producer line.
  std::string describe() const;

 private:
  struct Buffers;
  struct Rank;
  class Sites;
  void attention_block(int l, const ForwardCall& call, KvStore& kv, Sites& site);
  void gqa_attention(int l, const ForwardCall& call, KvStore& kv, Sites& site);
  void mla_attention(int l, const ForwardCall& call, KvStore& kv, Sites& site);
  // Attention of sequence s over the keys and values it reads ([S, ·] rows
  // of k_stride / v_stride floats): softmax(q·kᵀ * scale + mask) · v into
  // its ctx rows, scores and probs reported when wanted.
  void attend(int l, const ForwardCall& call, const SequenceRows& s, AttentionArgs att, const float* new_k,
              const float* new_v, Sites& site);
  void ffn_block(int l, int64_t R, Sites& site);
  void moe_block(int l, int64_t R, Rank& k, Sites& site);
  std::vector<float> head(const ForwardCall& call, Sites& site);
  // Every rank's residual stream [n] plus the all-reduce of the ranks'
  // partial sums (their proj), after o_proj or (ffn) the MLP/MoE block.
  void add_all_reduced(int64_t n, bool ffn);
  // Rows [R, per_rank] of every rank side by side in rank order, [R,
  // ranks * per_rank] (the KV store's rows); R = 1: the one rank's own.
  const float* side_by_side(std::vector<float> Buffers::*part, int64_t R, int64_t per_rank, std::vector<float>& out);
  // A SwiGLU MLP on n rows: out [n, D] = down(silu(gate(x)) * up(x)), with
  // gate, up, act [n, F] left in the scratch given (the dense MLP reports them).
  void swiglu(const MlpShard& m, const float* x, int64_t n, float* gate, float* up, float* act, float* out);
  // matmul() of kernels.h with the inputs rounded as the precision profile
  // says for each weight's type (the jobs grouped by that rounding).
  void mm(const float* x, int64_t T, const std::vector<MatmulJob>& jobs);
  void mm(const float* x, int64_t T, const WMat& w, float* y) { mm(x, T, std::vector<MatmulJob>{{w, y}}); }

  ModelConfig cfg_;  // the model's config with the zoo's config-level bugs applied
  std::shared_ptr<ModelWeights> weights_;
  ForwardOptions opt_;
  zoo::Faults faults_;
  zoo::BatchFaults batch_faults_;
  zoo::TpFaults tp_faults_;
  bool absorbed_ = false;          // MLA in the absorbed form
  TensorParallel tp_;              // the ranks' shards (one rank: the whole model)
  std::vector<Rank> ranks_;        // each rank's shard, kv heads read and buffers
  ThreadPool pool_;
  MatmulScratch mm_;
  std::vector<float> rounded_;     // matmul inputs as the profile rounds them
  std::vector<std::vector<float>> attn_rows_;
  std::vector<float> cos_, sin_;   // [R, Dh] the call's RoPE tables (every rank's)
  std::vector<float> keys_, values_, mask_;        // attention with other sequences' rows in front
  std::vector<float> new_k_, new_v_, new_latent_;  // every rank's new cache rows side by side
  std::vector<float> reduced_, reduced_again_;     // the all-reduce's sum [R, D]
};

}  // namespace llmdiff::impl
