#include "ref/weights.h"

#include <algorithm>
#include <future>
#include <string>
#include <thread>

#include "dumps/errors.h"
#include "ref/ops.h"

namespace llmdiff::ref {

namespace {

torch::ScalarType stored_dtype(const WeightView& w) {
  switch (w.dtype) {
    case DType::F32: return torch::kFloat;
    case DType::BF16: return torch::kBFloat16;
    case DType::F16: return torch::kHalf;
    default:
      throw FormatError(w.file, w.name, std::string("unsupported weight dtype ") + dtype_name(w.dtype) +
                                            " (supported: F32, BF16, F16)");
  }
}

}  // namespace

torch::Tensor weight_tensor(const WeightView& w, torch::ScalarType st) {
  if (!w) return {};
  torch::Tensor t = torch::from_blob(const_cast<void*>(w.data), w.shape, torch::TensorOptions().dtype(stored_dtype(w)));
  return t.scalar_type() == st ? t : t.to(st);
}

namespace {

// dst <- src converted, in place when dst is a buffer of the same shape that
// only the slot holds, else into a new tensor. Large copies are split over
// the cores (libtorch's own loop runs on one thread in the ref's setting).
void refill(torch::Tensor& dst, const WeightView& src, torch::ScalarType st) {
  if (!src) {
    dst = torch::Tensor();
    return;
  }
  torch::Tensor from = torch::from_blob(const_cast<void*>(src.data), src.shape,
                                        torch::TensorOptions().dtype(stored_dtype(src)));
  if (from.scalar_type() == st) {
    dst = from;  // used in place from the mmap
    return;
  }
  const bool reusable = dst.defined() && dst.scalar_type() == st && dst.sizes() == from.sizes() &&
                        dst.use_count() == 1 && dst.storage().use_count() == 1;
  if (!reusable) dst = torch::empty(from.sizes(), torch::TensorOptions().dtype(st));
  const int64_t rows = from.dim() > 0 ? from.size(0) : 1;
  const int64_t workers = std::min<int64_t>(std::max(1u, std::thread::hardware_concurrency()), rows);
  if (workers <= 1 || from.numel() < (int64_t(1) << 20)) {
    dst.copy_(from);
    return;
  }
  std::vector<std::future<void>> parts;
  for (int64_t k = 1; k < workers; ++k)
    parts.push_back(std::async(std::launch::async, [&, k] {
      const int64_t a = rows * k / workers, b = rows * (k + 1) / workers;
      dst.narrow(0, a, b - a).copy_(from.narrow(0, a, b - a));
    }));
  const int64_t b0 = rows / workers;
  dst.narrow(0, 0, b0).copy_(from.narrow(0, 0, b0));
  for (auto& f : parts) f.get();
}

void release(const WeightView& v) {
  if (v) release_pages(v.data, v.bytes());
}

torch::Tensor stored_tensor(const WeightView& v) {
  return torch::from_blob(const_cast<void*>(v.data), v.shape, torch::TensorOptions().dtype(stored_dtype(v)));
}

}  // namespace

LayerByLayerWeights::LayerByLayerWeights(const ModelWeights& w, torch::ScalarType st, int slots, int64_t whole_limit)
    : w_(w), st_(st), whole_limit_(whole_limit), slots_(size_t(std::max(1, slots))) {
  torch::NoGradGuard no_grad;
  final_norm = weight_tensor(w.final_norm, st);
}

torch::Tensor LayerByLayerWeights::whole(const WeightView& v, torch::Tensor& cache) {
  if (cache.defined()) return cache;
  if (stored_dtype(v) == st_) return cache = stored_tensor(v);  // in place
  if (v.numel() * int64_t(c10::elementSize(st_)) > whole_limit_) return {};
  cache = weight_tensor(v, st_);
  release(v);
  return cache;
}

torch::Tensor LayerByLayerWeights::embed_rows(const torch::Tensor& ids) {
  torch::NoGradGuard no_grad;
  if (stored_dtype(w_.embed) == st_) return at::embedding(stored_tensor(w_.embed), ids);  // [T, D], in place
  // Conversion is elementwise: converting the rows looked up is converting
  // the table and looking them up.
  return at::embedding(stored_tensor(w_.embed), ids).to(st_);  // [T, D]
}

torch::Tensor LayerByLayerWeights::head(const torch::Tensor& x, bool embed_matrix) {
  torch::NoGradGuard no_grad;
  const bool tied = w_.lm_head_tied || w_.lm_head.data == w_.embed.data;
  const WeightView& v = embed_matrix || tied ? w_.embed : w_.lm_head;
  torch::Tensor W = whole(v, embed_matrix || tied ? embed_whole_ : head_whole_);
  if (W.defined()) return ops::linear(x, W, {});  // [T, V]
  // A block of vocabulary rows at a time: each output column is the same dot
  // product over D as in one product.
  const int64_t V = v.shape[0], D = v.shape[1];
  const int64_t block = std::max<int64_t>(1, whole_limit_ / (D * int64_t(c10::elementSize(st_))));
  torch::Tensor stored = stored_tensor(v);
  std::vector<torch::Tensor> parts;
  for (int64_t r = 0; r < V; r += block) {
    const int64_t n = std::min(block, V - r);
    parts.push_back(ops::linear(x, stored.narrow(0, r, n).to(st_), {}));  // [T, n]
    const size_t row_bytes = size_t(D) * dtype_size(v.dtype);
    release_pages(static_cast<const uint8_t*>(v.data) + size_t(r) * row_bytes, size_t(n) * row_bytes);
  }
  return torch::cat(parts, -1);  // [T, V]
}

LayerTensors LayerByLayerWeights::layer(int l) {
  if (l < 0 || size_t(l) >= w_.layers.size())
    throw UsageError("layer " + std::to_string(l) + " out of range (" + std::to_string(w_.layers.size()) + " layers)");
  ++clock_;
  Slot* slot = nullptr;
  for (Slot& s : slots_)
    if (s.layer == l) slot = &s;
  if (!slot) {
    // The least recently used slot takes the layer.
    slot = &slots_[0];
    for (Slot& s : slots_)
      if (s.used < slot->used) slot = &s;
    // A layer used in place from the mmap leaves its pages with its slot.
    if (slot->layer >= 0 && slot->in_place) w_.release_layer(slot->layer);
    torch::NoGradGuard no_grad;
    const LayerWeights& lw = w_.layers[size_t(l)];
    LayerTensors& L = slot->w;
    refill(L.input_norm, lw.input_norm, st_);
    refill(L.post_attn_norm, lw.post_attn_norm, st_);
    refill(L.q, lw.q, st_);
    refill(L.k, lw.k, st_);
    refill(L.v, lw.v, st_);
    refill(L.o, lw.o, st_);
    refill(L.q_bias, lw.q_bias, st_);
    refill(L.k_bias, lw.k_bias, st_);
    refill(L.v_bias, lw.v_bias, st_);
    refill(L.o_bias, lw.o_bias, st_);
    refill(L.q_norm, lw.q_norm, st_);
    refill(L.k_norm, lw.k_norm, st_);
    refill(L.gate, lw.gate, st_);
    refill(L.up, lw.up, st_);
    refill(L.down, lw.down, st_);
    slot->layer = l;
    slot->in_place = stored_dtype(lw.q) == st_;
    if (!slot->in_place) w_.release_layer(l);  // converted: the stored bytes are not needed any more
    ++conversions_;
  }
  slot->used = clock_;
  return slot->w;
}

}  // namespace llmdiff::ref
