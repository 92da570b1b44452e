// Synthetic HF checkpoints: config.json + model.safetensors (sharded with
// model.safetensors.index.json when large) holding random weights of a real
// model's shapes, so that llmdiff can be exercised and timed at real scale
// without downloading anything.
//
// Weights are drawn from an own deterministic generator (splitmix64 +
// Box-Muller in double precision), never from <random> distributions whose
// output is implementation-defined: the same seed gives the same bytes. Each
// tensor gets its own stream (seed mixed with the tensor's name) cut into
// fixed blocks, so the result depends neither on tensor order nor on threads.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dumps/model/config.h"
#include "dumps/base/dtype.h"
#include "dumps/formats/safetensors.h"

namespace llmdiff::synth {

// --- presets -----------------------------------------------------------------

struct SynthPreset {
  std::string name;         // "tinyllama-1.1b", "tiny-llama", ...
  std::string description;  // one line
};
const std::vector<SynthPreset>& synth_presets();
// config.json text of a preset (keys sorted, as HF writes them). Throws
// UsageError listing the presets for an unknown name.
std::string synth_preset_config(const std::string& name);

// --- weights -----------------------------------------------------------------

// How a tensor is initialised: value = mean + scale * N(0, 1).
struct SynthTensor {
  std::string name;  // HF name
  Shape shape;
  double mean = 0.0;
  double scale = 1.0;
};

// Scale constants. With them a pre-norm decoder keeps realistic activations:
// attention scores of std ~ linear^2 (peaked, not uniform, attention), logits
// of std ~ logit (not flat), a residual stream that grows slowly with depth.
struct SynthScales {
  double linear = 1.5;      // Linear weight [out, in]: N(0,1) * linear / sqrt(in)
  double logit = 3.0;       // embedding and lm_head: N(0,1) * logit / sqrt(hidden)
  double norm_jitter = 0.1; // RMSNorm weights: 1 + norm_jitter * N(0,1)
  double bias = 0.1;        // biases: bias * N(0,1)
};

// Every tensor the checkpoint of `cfg` holds, in HF named_parameters order
// (a tied lm_head is not stored).
std::vector<SynthTensor> synth_tensor_plan(const ModelConfig& cfg, const SynthScales& scales = {});

// The generator: n values mean + scale * N(0,1) of the stream (seed, tensor
// name), converted to `dtype` (F32, BF16 or F16) into `out` (n * dtype_size
// bytes). Blocks of the stream are spread over `threads` (0: all cores); the
// bytes do not depend on it.
void synth_fill(uint64_t seed, const SynthTensor& t, DType dtype, void* out, int threads);

// --- checkpoints -------------------------------------------------------------

struct SynthOptions {
  std::string config_json;  // config.json text (a preset's or a user's file)
  std::string config_source = "config.json";  // names the config in errors
  DType dtype = DType::BF16;                  // storage dtype; written as torch_dtype
  uint64_t seed = 0;
  uint64_t shard_size = 2000000000ULL;        // bytes of tensor data per shard, at most (a larger tensor gets its own)
  int threads = 0;                            // 0: all cores
  bool force = false;                         // replace a checkpoint that synth did not write
  SynthScales scales;
};

// Safetensors metadata key that marks the files synth writes (value: the seed).
inline constexpr const char* kSynthMetadataKey = "llmdiff_synth_seed";

struct SynthResult {
  ModelConfig config;                 // as written
  std::vector<std::string> files;     // weight files written (names inside the directory)
  size_t tensors = 0;
  uint64_t parameters = 0;
  uint64_t data_bytes = 0;            // tensor bytes (index total_size)
};

// Writes a checkpoint into `dir` (created if needed). Streams: one tensor is
// generated and written at a time. Every file goes through a temporary and a
// rename; a previous config.json is removed first and the new one is written
// last, so a directory with a config.json is always complete. Weight files of
// an earlier checkpoint that the new one does not use are removed. A
// directory holding a checkpoint synth did not write (a real model) is left
// alone with a UsageError unless opt.force. Throws ConfigError / UsageError /
// IoError.
SynthResult write_synth_checkpoint(const std::string& dir, const SynthOptions& opt);

// "2GB", "500MB", "64KiB", "123" (bytes) -> bytes. Throws UsageError.
uint64_t parse_byte_size(const std::string& text);
// DType of a --dtype value (f32/float32/bf16/bfloat16/f16/float16). Throws UsageError.
DType parse_storage_dtype(const std::string& text);
// "float32" / "bfloat16" / "float16" for torch_dtype.
const char* torch_dtype_name(DType t);

}  // namespace llmdiff::synth
