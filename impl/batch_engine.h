// The impl's continuous-batching engine: several sequences served together,
// as a production inference server runs them. Each engine iteration is one
// forward call over the packed rows of every live sequence (prompt chunks
// beside single decode tokens); the weight matmuls run once over all rows,
// attention runs per sequence over its own keys, read from a paged KV cache
// (a pool of fixed-size blocks, a block allocator, a block table per
// sequence, a slot for every new token). Sequences join at the iteration
// their request names and leave when their generation is done, their blocks
// going back to the pool.
//
// It reports each sequence in single-sequence canonical form under
// `seq{b}.` (docs/DUMP_FORMAT.md "Several sequences"), the iterations as
// `iter{N}.*` and the paged bookkeeping as `kv.block_table`,
// `kv.slot_mapping` and `kv.context_len`, so that each sequence compares
// with the reference running it alone.
//
// Every model the impl runs (dense, MoE, MLA naive and absorbed), every
// precision profile; greedy or sampled decoding; float32 activations. Every
// bug of the zoo that changes the forward pass acts here too, and the batch
// bugs (zoo::BatchFaults) switch on how the sequences share the call and the
// cache.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dumps/zoo/bugs.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/observer.h"
#include "dumps/sampling/sampling.h"
#include "dumps/model/weights.h"
#include "impl/forward.h"

namespace llmdiff::impl {

// One request: its prompt, the engine iteration it arrives at, and the
// decode calls after its prompt (it generates decode + 1 tokens, the first
// from the prompt's last call).
struct BatchRequest {
  std::vector<int64_t> prompt;
  int join = 0;
  int decode = 0;
};

// "PROMPT[@JOIN][:DECODE];..." with PROMPT comma-separated token ids, e.g.
// "1,2,3,4@0:3;5,6@2" (JOIN default 0, DECODE default `decode`). Throws
// UsageError naming the request.
std::vector<BatchRequest> parse_batch_requests(const std::string& text, int decode);

// A schedule given instead of made: the calls of every engine iteration
// (a sequence's tokens in that call), e.g. read back from another engine's
// dump, so that its run can be repeated with the zoo's batch bugs.
// prompt_len[b]: sequence b's positions before its first generated token
// (those calls generate nothing; when absent, every call is prompt).
struct BatchCall {
  int seq = 0;
  std::vector<int64_t> tokens;
  // The sequence's first call after a prefix-cache hit: the hit's tokens
  // (served from the engine's own prefix cache when it has them, else
  // computed in the same call, reported by no name).
  std::vector<int64_t> cached_prefix;
  int64_t rollback = 0;  // a verify call's rejected drafts, dropped after it
  bool verify = false;   // a speculative verify call (its tokens the last accepted one and the drafts)
};
struct BatchSchedule {
  std::vector<std::vector<BatchCall>> iterations;
  std::vector<int64_t> prompt_len;
  std::vector<int64_t> padded_rows;  // per iteration (iter{N}.padded_rows; empty: none)
};

// The schedule a several-sequence dump records: each engine iteration's
// calls (iter{N}.seqs and seq_steps; without them each sequence's steps one
// after another, sequence by sequence), each sequence's step tokens, its
// prefix-cache hit and verify calls' rollbacks, its prompt length (the calls
// before the ones that fed its generated tokens, as replay_scenario reads
// them) and each iteration's padding rows. Throws FormatError naming a step
// an iteration lists that the sequence lacks.
BatchSchedule schedule_of(const TensorSource& dump);

struct BatchEngineOptions {
  int threads = 0;            // 0: all cores
  int64_t block_size = 16;    // positions per KV block
  int64_t num_blocks = 0;     // blocks in the pool; 0: enough for every request at once
  int64_t chunk = 0;          // prompt tokens of one sequence per iteration (chunked prefill); 0: all
  std::vector<zoo::BugSpec> bugs;  // any bug of the zoo (the forward's, the batch's, the sampler's)
  bool release_weights = false;    // hand each layer's mapped pages back after use (ImplOptions)
  MlaForm mla = MlaForm::Naive;    // MLA models only
  PrecisionProfile precision;      // roundings made on purpose (ImplOptions)
  // A prefix cache: a request whose prompt begins with blocks another
  // request computed is given them (kv.cached_prefix, kv.block_source).
  bool prefix_cache = false;
  // Speculative decoding (greedy): each decode call verifies up to k drafts
  // of a proposer ("ngram": the continuation of the sequence's latest n-gram
  // seen before in its own tokens; "draft": a draft model, the checkpoint's
  // first draft_layers layers), spec.draft / spec.accepted reported.
  std::string speculative;
  int spec_k = 4;
  int draft_layers = 1;
  int ngram = 3;
  // Each call's rows padded with rows of no sequence up to a multiple of
  // this (a captured graph's bucket; 0: none), iter{N}.padded_rows reported.
  int64_t bucket = 0;
  int tensor_parallel = 1;         // ranks (ImplOptions::tensor_parallel)
  // Tokens drawn with HF's logits processors instead of the argmax: sequence
  // b with these parameters and the seed seed + b (sampling_for), its own
  // draws and token history, step{N}.sample.* reported under seq{b}.
  std::optional<SamplingParams> sampling;
};

// Sequence b's sampling parameters under `o`: o.sampling with seed (0 when
// unset) + b.
SamplingParams sampling_for(const BatchEngineOptions& o, int b);

struct BatchOutcome {
  std::vector<std::vector<int64_t>> generated;  // per request, in request order
  int iterations = 0;                           // engine forward calls
  int64_t rows = 0;                             // token rows run, all calls together (padding included)
  std::vector<int64_t> iteration_rows;          // per engine iteration: its token rows
  // Per engine iteration: its wall time (run: the scheduling and drafting
  // before its forward call included).
  std::vector<double> iteration_seconds;
  std::vector<int64_t> iteration_generated;     // per engine iteration: the tokens it generated
  // What the serving features did, all sequences together.
  int64_t prompt_tokens = 0;      // the prompts' tokens (served from the prefix cache or computed)
  int64_t prefix_hit_tokens = 0;  // prompt tokens served from the prefix cache
  int64_t drafts_proposed = 0;    // drafts of the verify calls
  int64_t drafts_accepted = 0;    // drafts they kept
  int64_t padded_rows = 0;        // rows of no sequence added to fill buckets
};

class BatchEngine {
 public:
  // Throws UsageError for a bug that cannot apply to the model.
  BatchEngine(const Model& model, const BatchEngineOptions& opt);
  ~BatchEngine();
  BatchEngine(const BatchEngine&) = delete;
  BatchEngine& operator=(const BatchEngine&) = delete;

  // Serves the requests from an empty pool: request b is sequence b. Reports
  // every name through `obs`. Throws UsageError when the pool runs out of
  // blocks or a token is outside the vocabulary.
  BatchOutcome run(const std::vector<BatchRequest>& requests, Observer& obs);
  // Runs exactly the calls of `schedule` (teacher-forced: the tokens given,
  // not the engine's own); a sequence leaves after its last call.
  BatchOutcome replay(const BatchSchedule& schedule, Observer& obs);

  std::string producer() const;
  PrecisionProfile precision() const;  // the manifest's `precision`
  // {"kind": "paged", "block_size": B, "num_blocks": N}: the manifest's kv_cache.
  std::string kv_cache_json(const std::vector<BatchRequest>& requests) const;
  // The manifest's `speculative` ({"proposer": ..., "k": K}); empty: off.
  std::string speculative_json() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace llmdiff::impl
