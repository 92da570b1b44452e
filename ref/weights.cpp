#include "ref/weights.h"

#include <algorithm>
#include <future>
#include <string>
#include <thread>

#include "dumps/errors.h"

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

RefWeights::RefWeights(const ModelWeights& w, torch::ScalarType dtype) : st(dtype) {
  torch::NoGradGuard no_grad;
  embed = weight_tensor(w.embed, st);
  final_norm = weight_tensor(w.final_norm, st);
  lm_head = (w.lm_head_tied || w.lm_head.data == w.embed.data) ? embed : weight_tensor(w.lm_head, st);
  // The layers are converted on all cores, a share of the layers each
  // (libtorch's own conversion loop runs on one thread in the ref's setting).
  layers.resize(w.layers.size());
  auto convert = [&](size_t i) {
    torch::NoGradGuard guard;
    const LayerWeights& lw = w.layers[i];
    Layer& L = layers[i];
    L.input_norm = weight_tensor(lw.input_norm, st);
    L.post_attn_norm = weight_tensor(lw.post_attn_norm, st);
    L.q = weight_tensor(lw.q, st);
    L.k = weight_tensor(lw.k, st);
    L.v = weight_tensor(lw.v, st);
    L.o = weight_tensor(lw.o, st);
    L.q_bias = weight_tensor(lw.q_bias, st);
    L.k_bias = weight_tensor(lw.k_bias, st);
    L.v_bias = weight_tensor(lw.v_bias, st);
    L.o_bias = weight_tensor(lw.o_bias, st);
    L.q_norm = weight_tensor(lw.q_norm, st);
    L.k_norm = weight_tensor(lw.k_norm, st);
    L.gate = weight_tensor(lw.gate, st);
    L.up = weight_tensor(lw.up, st);
    L.down = weight_tensor(lw.down, st);
  };
  const size_t workers = std::min<size_t>(std::max(1u, std::thread::hardware_concurrency()), layers.size());
  std::vector<std::future<void>> done;
  for (size_t t = 1; t < workers; ++t)
    done.push_back(std::async(std::launch::async, [&, t] {
      for (size_t i = t; i < layers.size(); i += workers) convert(i);
    }));
  for (size_t i = 0; i < layers.size(); i += std::max<size_t>(1, workers)) convert(i);
  for (auto& f : done) f.get();  // rethrows a worker's error
}

}  // namespace llmdiff::ref
