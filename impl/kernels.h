// The impl's numeric kernels: plain C++ loops written so that the compiler
// vectorises them (GCC vector extensions for the few reductions), weights read
// in their stored dtype (F32, BF16, F16, or ggml blocks) and converted on the
// fly, f32 activations and accumulation.
//
// Every kernel computes each output element in one piece with a fixed order
// of operations, whatever the split of the work over threads: results are
// bit-identical for any thread count.
#pragma once
#include <cstdint>
#include <vector>

#include "dumps/base/dtype.h"
#include "dumps/model/weights.h"
#include "impl/thread_pool.h"

namespace llmdiff::impl {

// How a GEMV reads its weights: kGemvStreams rows at once, each a
// sequential stream asking kPrefetchBytes ahead of its loads (one core keeps
// more reads in flight over a few streams than over one). `bench`'s
// bandwidth probe reads memory the same way.
constexpr int kGemvStreams = 4;
constexpr int kPrefetchBytes = 1024;

// A row-major matrix [rows, cols] in its stored dtype (typically a view into
// the checkpoint's mmap).
struct WMat {
  const void* data = nullptr;
  DType dtype = DType::F32;
  int64_t rows = 0, cols = 0;
  // A ggml block type (GGUF weights): rows of blocks, read in place by the
  // GEMV (Q8_0; Q4_0, Q4_K, Q5_K and Q6_K with AVX-512) or dequantised a
  // row at a time with ggml's dequantize_row_*, the same values either way
  // (dtype is then F32).
  GgmlType quant = GgmlType::F32;
  // Rows stored in another order (WeightView::interleaved_heads): row r is
  // stored row src_row(r). 0: in order.
  int64_t interleaved_heads = 0;
  // Columns [col0, col0 + cols) of stored rows of `stride` values (0:
  // cols): a view of some of the columns (a row-parallel shard), in place.
  int64_t col0 = 0, stride = 0;
  bool quantized() const { return ggml_is_quantized(quant); }
  int64_t src_row(int64_t r) const;
  int64_t row_len() const { return stride > 0 ? stride : cols; }  // values of one stored row
};
// A 2-D weight as a WMat; a 1-D one (norm weight, bias) as one row.
WMat wmat(const WeightView& w);
// Rows [r0, r0 + n) of m, in place (interleaved rows: whole heads only).
// Throws UsageError when the rows are outside m.
WMat row_view(const WMat& m, int64_t r0, int64_t n);
// Columns [c0, c0 + n) of m, in place. Throws UsageError when outside m.
WMat col_view(const WMat& m, int64_t c0, int64_t n);

// Converts cols [c0, c0+n) of row `row` of m to float32.
void load_row(const WMat& m, int64_t row, int64_t c0, int64_t n, float* dst);

// Scratch buffers of the matmul, reused between calls (one panel per worker).
class MatmulScratch {
 public:
  std::vector<float> xt;                   // x transposed [cols, T padded]
  std::vector<float> xi;                   // a few tokens' x interleaved for bfloat16 GEMVs
  std::vector<std::vector<float>> panels;  // per worker: a block of W rows as f32
};

// y[T, W.rows] = x[T, W.cols] · Wᵀ. T <= 8 streams W row by row (GEMV at
// memory bandwidth; a few tokens, e.g. a batch of decodes, each take every
// chunk of rows from cache, and each token's result is bit for bit its
// T = 1 result); larger T converts blocks of W rows to f32 once and runs a
// register-blocked kernel over all T rows of x.
void matmul(ThreadPool& pool, MatmulScratch& scratch, const float* x, int64_t T, const WMat& W, float* y);

// Several weights applied to one input (q/k/v, gate/up): x is prepared once
// and the rows of all of them are shared out over the workers together.
struct MatmulJob {
  WMat w;    // [rows, K]
  float* y;  // [T, rows]
};
void matmul(ThreadPool& pool, MatmulScratch& scratch, const float* x, int64_t T, const std::vector<MatmulJob>& jobs);

// y[t, :] += b for each of T rows of length b.cols.
void add_bias(const WMat& b, int64_t T, float* y);

// RMSNorm over rows of length n: y = w * (x * rsqrt(mean(x²) + eps)), each
// product rounded to float32 as HF does. `w` is one row of n values; rows in
// parallel; y may alias x.
void rms_norm(ThreadPool& pool, const float* x, int64_t rows, int64_t n, const WMat& w, float eps, float* y);

// dst[i] = a[i] + b[i]
void add(const float* a, const float* b, int64_t n, float* dst);

// act[i] = silu(g[i]) * u[i], silu(g) = g / (1 + exp(-g)), in parallel.
void silu_mul(ThreadPool& pool, const float* g, const float* u, int64_t n, float* act);

// Σ a[i]·b[i] with 16 partial sums and a fixed final reduction.
float dot(const float* a, const float* b, int64_t n);

// Scaled dot-product attention of one forward call, every (query head, row)
// pair in parallel. The KV cache is token-major: row s of `k`/`v` holds all
// kv heads of key s ([S, Hkv*Dh] / [S, Hkv*Dv]), or any rows `k_stride` /
// `v_stride` floats apart (MLA's absorbed form reads keys [latent | k_pe]
// and values [latent] from the same rows).
struct AttentionArgs {
  int64_t T = 0, S = 0, Hq = 0, Hkv = 0, Dh = 0;
  int64_t Dv = 0;                  // value / ctx width per head; 0: Dh
  int64_t k_stride = 0;            // floats from key row s to s+1; 0: Hkv*Dh
  int64_t v_stride = 0;            // floats from value row s to s+1; 0: Hkv*Dv
  // Floats from one kv head to the next within a row, keys and values alike
  // (rows holding copies of one shared head, e.g. each rank's latent); 0: Dh
  // for keys, Dv for values.
  int64_t kv_head_step = 0;
  const float* q = nullptr;        // [T, Hq*Dh], after RoPE
  const float* k = nullptr;        // [S, Hkv*Dh]
  const float* v = nullptr;        // [S, Hkv*Dv]
  const float* mask = nullptr;     // [T, S], 1 = may attend
  const int* kv_head = nullptr;    // [Hq]: kv head read by each query head
  float scale = 1.0f;              // applied to q·k after the dot product
  // The operands of q·k and p·v (q and the probabilities) rounded to this
  // type first (F16/BF16: an engine multiplying by a 16-bit cache in the
  // cache's type; F32: not rounded). scores and probs are recorded before.
  GgmlType product_rounding = GgmlType::F32;
  // With product_rounding 16-bit: ctx as ggml's flash attention computes it
  // (one pass, online softmax, the value sum kept in that type).
  bool flash = false;
  float* scores = nullptr;         // optional [Hq, T, S]: every q·k*scale, masked or not
  float* probs = nullptr;          // optional [Hq, T, S]: softmax, masked entries 0
  float* ctx = nullptr;            // [T, Hq*Dv]
};
// `row_scratch` holds one row of S floats per worker.
void attention(ThreadPool& pool, std::vector<std::vector<float>>& row_scratch, const AttentionArgs& a);

// One token's mixture-of-experts routing: the K = m.top_k experts chosen
// from `probs` [E] (softmax probabilities, or DeepSeek-V3's sigmoid scores)
// and their combination weights, written in ascending expert id. `bias` [E]
// (nullptr: none) is DeepSeek-V3's e_score_correction_bias: it steers the
// choice (score + bias), the weights come from the unbiased probs.
// Group-limited choice when m.topk_group < m.n_group: each group of
// E/n_group experts scores the sum of its two best, experts outside the
// topk_group best groups get choice score 0.0 (HF's masked_fill: not -inf,
// so they can still beat negative scores). Ties go to the lower id. The
// weights are renormalised over the chosen with m.norm_topk_prob (summed
// best first; sigmoid scoring adds 1e-20), then scaled by
// m.routed_scaling_factor; float32 throughout.
void moe_route(const MoeConfig& m, const float* probs, const float* bias, int64_t* ids, float* weights);

// A product of every head's vectors with that head's own block of rows of one
// weight (multi-head latent attention's absorption of kv_b_proj): head h's
// input row t is x + t*x_row + h*x_head, its matrix W_h the rows
// [h*w_head + w_row0, h*w_head + w_row0 + w_rows) of w, its output row t
// y + t*y_row + h*y_head.
struct HeadMatmul {
  int64_t T = 0, H = 0;
  const float* x = nullptr;
  int64_t x_row = 0, x_head = 0;
  WMat w;
  int64_t w_head = 0, w_row0 = 0, w_rows = 0;
  float* y = nullptr;
  int64_t y_row = 0, y_head = 0;
};
// y_h[t] = W_h · x_h[t]: [w_rows] from [w.cols] (a dot per output element).
void head_matmul(ThreadPool& pool, const HeadMatmul& m);
// y_h[t] = W_hᵀ · x_h[t]: [w.cols] from [w_rows] (Σ over W_h's rows in order).
void head_matmul_t(ThreadPool& pool, const HeadMatmul& m);

}  // namespace llmdiff::impl
