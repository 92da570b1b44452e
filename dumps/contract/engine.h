// What every engine (the libtorch ref, the plain C++ impl) offers, and the
// driver that runs a scenario (prefill, greedy decode, chunked prefill,
// replay of an existing dump) through one, reporting to an Observer.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"
#include "dumps/contract/layer_window.h"
#include "dumps/contract/precision.h"
#include "dumps/contract/observer.h"
#include "dumps/sampling/sampling.h"

namespace llmdiff {

class Engine {
 public:
  virtual ~Engine() = default;
  // Empties the KV cache: the next forward call is step 0 at position 0.
  virtual void reset() = 0;
  // One forward call over `tokens`, at positions P..P+T-1 where P is what the
  // cache holds. Reports every site of step `step` (and rope.inv_freq on step
  // 0) through `obs`, and returns next_logits [V] as float32.
  virtual std::vector<float> forward(const std::vector<int64_t>& tokens, int step, Observer& obs) = 0;
  virtual std::string producer() const = 0;     // for the manifest
  virtual std::string dtype_name() const = 0;    // compute dtype, spec spelling
  // The roundings the engine makes on purpose (the manifest's `precision`).
  virtual PrecisionProfile precision() const { return {}; }
  // The manifest's `kv_cache` (docs/DUMP_FORMAT.md) when the cache is not
  // contiguous, e.g. {"kind": "ring", "capacity": 6}; empty: contiguous.
  virtual std::string kv_cache_json() const { return ""; }
  // Runs the next sequence (until reset()) as a row of a left-padded batch:
  // the first `pad` tokens of its first call are padding (Scenario::left_pad).
  // Throws UsageError for an engine that does not run padded rows.
  virtual void set_left_padding(int64_t pad);
  // Runs only the layers of `w` (a shard, dumps/contract/layer_window.h) until
  // reset(): each call's residual stream entering w.first is read from
  // w.boundary, and a window ending before the last layer reports no sites
  // after the layers and returns no logits. Throws UsageError for an engine
  // that does not run shards (the default, unless `w` is the whole model).
  virtual void set_layer_window(const LayerWindow& w);
  // Drops the last `positions` positions from the cache (a speculative
  // verify call's rejected drafts): the next call continues after the ones
  // kept. Throws UsageError for an engine that does not roll back (the
  // default) or more positions than it holds.
  virtual void rollback(int64_t positions);
  // Continues the sequence `dump` recorded after its forward call `step` - 1
  // (teacher-forced): the cache is filled with that call's attn.k_cache and
  // attn.v_cache of every layer, so that the next call is the dump's call
  // `step`, at position S. Throws UsageError for an engine that cannot (the
  // default), MissingTensorError or ShapeError for a dump without them.
  virtual void resume(const TensorSource& dump, int step);
};

// A scenario started after its first calls (Scenario::resume): the calls
// before `step` are not run; the engine's cache holds what `dump` recorded
// after call `step` - 1 (Engine::resume). step 0: from the first call.
struct Resume {
  int step = 0;
  const TensorSource* dump = nullptr;
};

struct Scenario {
  std::string name = "prefill";                // manifest `scenario`
  std::vector<std::vector<int64_t>> steps;     // tokens of each given forward call
  int decode = 0;                              // greedy decode calls after the given ones
  bool emit_generated = false;                 // write `generated` (decode scenarios)
  // `generated` holds the argmax of next_logits of every step from this one
  // on (the last prompt call and each decode call).
  int first_generating_step = 0;
  // Tokens drawn with HF's logits processors instead of the argmax (the
  // `sampling` manifest key): each generating step reports its
  // step{N}.sample.* names; draws from UniformStream(seed, 0 when unset).
  // `sampler_faults`: the zoo's sampler bugs switched on.
  std::optional<SamplingParams> sampling;
  zoo::SamplerFaults sampler_faults;
  // A replay of a sampling run: the token each generating step drew, by
  // step (the processors still run on the engine's own logits).
  std::map<int, int64_t> drawn;
  // A row of HF's left-padded batched generate: `left_pad` copies of
  // `pad_token` run in front of step 0's tokens (masked as keys, at position
  // 1), and every report is stripped of them (dumps/contract/padding.h).
  int64_t left_pad = 0;
  int64_t pad_token = 0;
  // A shard of the layers (bisect --layers): the calls run through these
  // layers only, from the boundary dump's residual stream
  // (Engine::set_layer_window). Whole by default.
  LayerWindow layers;
  // A prefix-cache hit (docs/DUMP_FORMAT.md, "Prefix cache"): these tokens
  // run as a call of their own before step 0, reported by no name, so that
  // step 0 starts after them.
  std::vector<int64_t> cached_prefix;
  // Speculative verify calls: the positions rolled back after step n
  // (Engine::rollback), by step.
  std::map<int, int64_t> rollback;
  // Start at a later call with the caches a dump recorded (a replay that
  // changes nothing before that call): no name of an earlier call is
  // reported, nor `generated`. Only for a plain scenario (no left padding,
  // prefix-cache hit, shard, rollback or sampling).
  Resume resume;
};

// --tokens 1,2,3 [--chunks 4,3] [--decode N]. Chunk sizes must add up to the
// token count. Throws UsageError.
Scenario make_scenario(const std::vector<int64_t>& tokens, const std::vector<int64_t>& chunks, int decode);
// Exactly the forward calls of an existing dump (each step's own tokens);
// `generated` is emitted when the dump has it (not for a sampling run).
Scenario replay_scenario(const TensorSource& dump);
// A replay that also runs the dump's sampler: its manifest `sampling`
// applied to the engine's logits at each step with sample.*, the drawn
// token taken from the dump (HF's regression of a sample golden).
Scenario replay_with_sampling(const TensorSource& dump);

// The tokens step `step` of `sc` feeds an engine: step 0 behind its left
// padding (Scenario::left_pad copies of pad_token), the others as given.
std::vector<int64_t> fed_tokens(const Scenario& sc, int step);

// Runs the scenario from an empty cache: every forward call reports step k's
// sites, then `generated` (argmax of each step's next_logits, first index on
// ties) when the scenario asks for it. Returns generated.
std::vector<int64_t> run_scenario(Engine& engine, const Scenario& sc, Observer& obs);

int64_t argmax_first(const std::vector<float>& v);

// An engine's forward calls `shift` steps after the scenario's: its call
// k + shift reported as step k, its first `shift` calls (a prefix-cache hit
// run in front of the scenario) by no name but the model-wide ones.
class StepShift final : public Observer {
 public:
  StepShift(Observer& inner, int shift) : inner_(inner), shift_(shift) {}
  bool wants(const std::string& name) const override;
  void on_f32(const std::string& name, const Shape& shape, const float* data) override;
  void on_i64(const std::string& name, const Shape& shape, const int64_t* data) override;
  // The scenario's name for the engine's `name` ("" when it reports none).
  std::string rename(const std::string& name) const;

 private:
  Observer& inner_;
  int shift_;
};

}  // namespace llmdiff
