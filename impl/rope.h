// Rotary position embeddings: inverse frequencies of every rope type of
// transformers 4.51.3 (modeling_rope_utils.py: default, linear, dynamic NTK,
// llama3, yarn), the cos/sin tables of one forward call and their application
// to q/k.
#pragma once
#include <cstdint>
#include <vector>

#include "dumps/model/config.h"

namespace llmdiff::impl {

struct RopeFrequencies {
  std::vector<float> inv_freq;    // [Dh/2], after rope scaling
  double attention_scaling = 1.0;  // folded into cos/sin (yarn), else 1
};

// Inverse frequencies for a forward call whose largest position is
// seq_len - 1 (only dynamic NTK depends on it). The arithmetic follows HF's
// float32 tensor ops (python-level scalars in double).
RopeFrequencies rope_frequencies(const ModelConfig& cfg, int64_t seq_len);

// cos/sin [T, Dh] for `positions` in the rotate-half layout (both halves
// equal), attention scaling folded in: angle = float32(inv_freq * position).
void rope_tables(const RopeFrequencies& f, const std::vector<int64_t>& positions, int64_t head_dim,
                 float* cos, float* sin);

// In-place RoPE on x [T, H*Dh] (rows of H heads): rotate-half pairing,
// element i with i + Dh/2: x·cos + rotate_half(x)·sin.
void apply_rope(float* x, int64_t T, int64_t H, int64_t head_dim, const float* cos, const float* sin);

// The GPT-J-style interleaved pairing (2i, 2i+1) at frequency i:
// wrong for HF Llama/Qwen checkpoints (bug zoo: rope-interleaved).
void apply_rope_interleaved(float* x, int64_t T, int64_t H, int64_t head_dim, const float* cos, const float* sin);

// DeepSeek's rope_interleave (apply_rotary_pos_emb_interleave): each row of
// `dim` values reordered from adjacent pairs to halves, x -> cat(x[0::2],
// x[1::2]), before rotate-half RoPE; rotating then turns pair (2i, 2i+1) by
// frequency i and leaves the result in halves order.
void pairs_to_halves(float* x, int64_t rows, int64_t dim);

}  // namespace llmdiff::impl
