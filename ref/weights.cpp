#include "ref/weights.h"
#include "dumps/base/threads.h"

#include <algorithm>
#include <future>
#include <string>
#include <thread>

#include "dumps/base/errors.h"
#include "ref/ops.h"

namespace llmdiff::ref {

namespace {

torch::ScalarType stored_dtype(const WeightView& w) {
  if (w.quantized()) return torch::kFloat;  // dequantised
  switch (w.dtype) {
    case DType::F32: return torch::kFloat;
    case DType::BF16: return torch::kBFloat16;
    case DType::F16: return torch::kHalf;
    default:
      throw FormatError(w.file, w.name, std::string("unsupported weight dtype ") + dtype_name(w.dtype) +
                                            " (supported: F32, BF16, F16)");
  }
}

// Rows [r0, r0+n) of a block-quantised weight, dequantised: [n, cols] float32.
torch::Tensor dequantized_rows(const WeightView& w, int64_t r0, int64_t n) {
  const Shape shape = w.shape.size() >= 2 ? Shape{n, w.cols()} : w.shape;
  torch::Tensor t = torch::empty(shape, torch::TensorOptions().dtype(torch::kFloat));
  w.rows_f32(r0, n, t.data_ptr<float>());
  return t;
}

// The stored tensor: the mapped bytes in place, or a ggml block type
// dequantised to float32 (ggml's dequantize_row_*).
torch::Tensor stored_tensor(const WeightView& v) {
  if (v.quantized()) return dequantized_rows(v, 0, v.rows()).view(v.shape);
  torch::Tensor t = torch::from_blob(const_cast<void*>(v.data), v.shape, torch::TensorOptions().dtype(stored_dtype(v)));
  if (v.interleaved_heads == 0) return t;
  // Rows stored in llama.cpp's order: gathered into HF's (a copy).
  std::vector<int64_t> order(size_t(v.rows()));
  for (int64_t r = 0; r < v.rows(); ++r) order[size_t(r)] = v.stored_row(r);
  return t.index_select(0, torch::tensor(order, torch::kLong));
}

// Whether the stored bytes are already a tensor of dtype `st`, in HF's order.
bool stored_as(const WeightView& v, torch::ScalarType st) {
  return !v.quantized() && v.interleaved_heads == 0 && stored_dtype(v) == st;
}

}  // namespace

torch::Tensor weight_tensor(const WeightView& w, torch::ScalarType st) {
  if (!w) return {};
  torch::Tensor t = stored_tensor(w);
  return t.scalar_type() == st ? t : t.to(st);
}

namespace {

// dst <- src converted, dst a buffer of src's shape in the compute dtype.
// Large copies are split over the cores (libtorch's own loop runs on one
// thread in the ref's setting).
void convert_into(torch::Tensor& dst, const torch::Tensor& from) {
  const int64_t rows = from.dim() > 0 ? from.size(0) : 1;
  const int64_t workers = std::min<int64_t>(default_threads(), rows);
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
  if (v && !v.owned) release_pages(v.data, v.bytes());
}

}  // namespace

LayerByLayerWeights::LayerByLayerWeights(const ModelWeights& w, torch::ScalarType st, int64_t budget,
                                         int64_t whole_limit)
    : w_(w), st_(st), budget_(budget), whole_limit_(whole_limit) {
  torch::NoGradGuard no_grad;
  final_norm = weight_tensor(w.final_norm, st);
}

const LayerWeights& LayerByLayerWeights::layer(int l) const {
  if (l < 0 || size_t(l) >= w_.layers.size())
    throw UsageError("layer " + std::to_string(l) + " out of range (" + std::to_string(w_.layers.size()) + " layers)");
  return w_.layers[size_t(l)];
}

torch::Tensor LayerByLayerWeights::weight(const WeightView& v) {
  if (!v) return {};
  ++clock_;
  for (Entry& e : held_)
    if (e.view == &v) {
      e.used = clock_;
      return e.t;
    }
  torch::NoGradGuard no_grad;
  const bool in_place = stored_as(v, st_);
  const int64_t bytes = v.numel() * int64_t(c10::elementSize(st_));
  // Make room, least recently used first.
  torch::Tensor reuse;
  while (budget_ > 0 && !held_.empty() && held_bytes_ + bytes > budget_) {
    auto lru = std::min_element(held_.begin(), held_.end(), [](const Entry& a, const Entry& b) { return a.used < b.used; });
    if (lru->in_place) {
      release(*lru->view);
    } else if (!in_place && !reuse.defined() && lru->t.sizes() == c10::IntArrayRef(v.shape) &&
               lru->t.use_count() == 1 && lru->t.storage().use_count() == 1) {
      reuse = std::move(lru->t);  // nobody else holds it: its pages are reused
    }
    held_bytes_ -= lru->bytes;
    held_.erase(lru);
  }
  Entry e;
  e.view = &v;
  e.bytes = bytes;
  e.used = clock_;
  e.in_place = in_place;
  if (in_place) {
    e.t = stored_tensor(v);
  } else {
    e.t = reuse.defined() ? reuse : torch::empty(v.shape, torch::TensorOptions().dtype(st_));
    if (v.quantized() && st_ == torch::kFloat)
      v.rows_f32(0, v.rows(), e.t.data_ptr<float>());  // dequantised in place
    else
      convert_into(e.t, stored_tensor(v));
    release(v);  // converted: the stored bytes are not needed any more
    ++conversions_;
  }
  held_bytes_ += bytes;
  held_.push_back(e);
  return e.t;
}

torch::Tensor LayerByLayerWeights::whole(const WeightView& v, torch::Tensor& cache) {
  if (cache.defined()) return cache;
  if (stored_as(v, st_)) return cache = stored_tensor(v);  // in place
  if (v.numel() * int64_t(c10::elementSize(st_)) > whole_limit_) return {};
  cache = weight_tensor(v, st_);
  release(v);
  return cache;
}

torch::Tensor LayerByLayerWeights::embed_rows(const torch::Tensor& ids) {
  torch::NoGradGuard no_grad;
  if (w_.embed.quantized()) {
    // Only the rows looked up are dequantised.
    const torch::Tensor flat = ids.reshape({-1}).to(torch::kLong).contiguous();
    std::vector<torch::Tensor> rows;
    for (int64_t i = 0; i < flat.numel(); ++i) rows.push_back(dequantized_rows(w_.embed, flat[i].item<int64_t>(), 1));
    Shape out = ids.sizes().vec();
    out.push_back(w_.embed.cols());
    return torch::cat(rows, 0).view(out).to(st_);  // [T, D]
  }
  if (stored_as(w_.embed, st_)) return at::embedding(stored_tensor(w_.embed), ids);  // [T, D], in place
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
  // product over D as in one product. Blocks of at most 64 MiB: each
  // converted block's buffer is the next one's (ref/block_cache.h), and two
  // passes side by side hold a block each, not a quarter of a GB each.
  const int64_t V = v.shape[0], D = v.shape[1];
  const int64_t block_bytes = std::min(whole_limit_, int64_t(64) << 20);
  const int64_t block = std::max<int64_t>(1, block_bytes / (D * int64_t(c10::elementSize(st_))));
  std::vector<torch::Tensor> parts;
  for (int64_t r = 0; r < V; r += block) {
    const int64_t n = std::min(block, V - r);
    const torch::Tensor rows = v.quantized() ? dequantized_rows(v, r, n) : stored_tensor(v).narrow(0, r, n);
    parts.push_back(ops::linear(x, rows.to(st_), {}));  // [T, n]
    if (!v.owned) release_pages(static_cast<const uint8_t*>(v.data) + size_t(r) * v.row_bytes(), size_t(n) * v.row_bytes());
  }
  return torch::cat(parts, -1);  // [T, V]
}

}  // namespace llmdiff::ref
