// libFuzzer target: a GGUF file as a model: its metadata mapped to an HF
// config (every architecture: llama with or without experts, qwen2/3,
// qwen2moe, qwen3moe, deepseek2 with q_lora or not, split or joint kv_b)
// and every weight looked up by HF name, routed experts as blocks of the
// merged tensors, MLA's kv_b assembled from attn_k_b / attn_v_b; then one
// row of each weight read. The bytes go through a file (the model loader
// maps files). A typed llmdiff::Error is the expected answer to bad input.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "dumps/base/errors.h"
#include "dumps/model/config.h"
#include "dumps/model/weights.h"
#include "fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace llmdiff;
  static const std::string path = "/tmp/llmdiff-fuzz-gguf-model-" + std::to_string(::getpid()) + ".gguf";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  const bool written = std::fwrite(data, 1, size, f) == size;
  std::fclose(f);
  if (!written) return 0;
  try {
    const ModelConfig cfg = load_config(path);
    // Sizes the loader would refuse for memory, not for format, are skipped.
    if (cfg.vocab_size * cfg.hidden_size > (int64_t(1) << 22) || cfg.num_hidden_layers > 64) return 0;
    const ModelWeights w(path, cfg);
    std::vector<float> row;
    auto touch = [&](const WeightView& v) {
      if (!v || v.cols() > (1 << 16)) return;
      row.resize(size_t(v.cols()));
      v.rows_f32(v.rows() - 1, 1, row.data());  // the last row: the end of the tensor (or expert)
    };
    touch(w.embed);
    touch(w.lm_head);
    for (const LayerWeights& L : w.layers)
      for (const WeightView* v : L.views()) touch(*v);
  } catch (const Error& e) {
    llmdiff::fuzz::check_message(e.what());
  }
  return 0;
}
