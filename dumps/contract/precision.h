// A candidate's precision profile: the roundings an engine makes on purpose
// (llama.cpp's F16 KV cache and its 8-bit activations against quantised
// weights, an accelerator's bf16 activations). Declared in a dump's manifest
// as the JSON key `precision` (docs/DUMP_FORMAT.md), applied by the impl when
// it is the noise floor's second honest run, so that the candidate is judged
// against its designed rounding and only the error beyond it is a finding.
#pragma once
#include <map>
#include <string>

#include "dumps/formats/ggml_types.h"

namespace llmdiff {

struct PrecisionProfile {
  // How the KV cache stores keys and values: F32 (exact), F16 or BF16.
  GgmlType kv_cache = GgmlType::F32;
  // What the inputs of the weight matmuls are rounded to:
  //   F32: nothing; F16 / BF16: every input to that type;
  //   Q8_0 / Q8_K: every input quantised to 8 bits in those blocks;
  //   ggml (`weights` true): per weight, ggml's vec_dot type of the
  //   weight's own type (F16 weights: F16, Q4_K: Q8_K, Q4_0: Q8_0, ...).
  // Attention's products with a 16-bit cache round q and the softmax
  // probabilities to the cache type as well when `weights` is set (ggml
  // multiplies by the cache in its own type).
  GgmlType matmul_input = GgmlType::F32;
  bool weights = false;
  // attention=flash: attention as ggml's flash attention computes it with a
  // 16-bit cache: one pass over the keys with an online softmax, q rounded to
  // the cache type, and the value sum accumulated in that type (rounded after
  // every key, rescaled when the running maximum grows).
  bool flash_attention = false;

  bool empty() const {
    return kv_cache == GgmlType::F32 && matmul_input == GgmlType::F32 && !weights && !flash_attention;
  }
  // The rounding applied to the inputs of a matmul with weights of type `w`.
  GgmlType input_rounding(GgmlType w) const;
  // `kv_cache=f16,matmul_input=ggml` (the parse() syntax); "" when empty.
  std::string str() const;
  // The manifest value: {"kv_cache": "f16", "matmul_input": "ggml"}.
  std::string json() const;

  // From `key=value,...` (keys kv_cache, matmul_input; values f32, f16,
  // bf16, and for matmul_input also q8_0, q8_k, ggml). Throws UsageError.
  static PrecisionProfile parse(const std::string& spec);
  // From a manifest's `precision` key (absent: empty). Throws FormatError
  // naming `file` for a malformed value.
  static PrecisionProfile from_manifest(const std::map<std::string, std::string>& extra, const std::string& file);
};

}  // namespace llmdiff
