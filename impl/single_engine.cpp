// The single-sequence engine (impl_engine.h): one sequence's forward calls
// through the one forward (impl/forward.h) on a contiguous KV cache, with
// the engine features a single sequence has: a capacity, a ring cache, a
// row of a left-padded batch, a shard of the layers.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "dumps/base/errors.h"
#include "dumps/contract/sites.h"
#include "impl/impl_engine.h"

namespace llmdiff::impl {

namespace {

ForwardOptions forward_options(const ImplOptions& opt) {
  ForwardOptions f;
  f.threads = opt.threads;
  f.bugs = opt.bugs;
  f.release_weights = opt.release_weights;
  f.mla = opt.mla;
  f.precision = opt.precision;
  f.tensor_parallel = opt.tensor_parallel;
  return f;
}

class ImplEngine final : public Engine {
 public:
  ImplEngine(const Model& model, const ImplOptions& opt)
      : fwd_(model, forward_options(opt)), bugs_(opt.bugs),
        store_(int(model.config.num_hidden_layers), fwd_.kv_widths(), opt.precision.kv_cache, opt.kv_ring) {
    const ModelConfig& c = fwd_.config();
    if (zoo::batch_faults(bugs_).any())
      throw UsageError("impl: the batch bugs act in the continuous-batching engine (dump --batch), not in a "
                       "single-sequence run");
    if (opt.max_seq < 0) throw UsageError("impl: max_seq must be >= 0, got " + std::to_string(opt.max_seq));
    capacity_ = opt.max_seq > 0 ? opt.max_seq : c.max_position_embeddings;
    if (opt.kv_ring > 0 && c.mla.enabled) throw UsageError("impl: a ring KV cache is for GQA attention, not MLA");
  }

  // A row of a left-padded batch (Engine::set_left_padding): the first
  // `pad` tokens of the first call are pads, at position 1 and masked as
  // keys (HF's generate), until reset().
  void set_left_padding(int64_t pad) override {
    if (pad < 0) throw UsageError("impl: left padding must be >= 0");
    if (cached_ != 0) throw UsageError("impl: left padding is set before a sequence's first call");
    pad_ = pad;
  }

  // A shard of the layers (Engine::set_layer_window), until reset().
  void set_layer_window(const LayerWindow& w) override {
    const int layers = int(fwd_.config().num_hidden_layers);
    if (cached_ != 0) throw UsageError("impl: a layer window is set before a sequence's first call");
    if (!w.whole() && (w.num_layers != layers || w.first < 0 || w.end > w.num_layers || w.first >= w.end ||
                       (w.first > 0 && !w.boundary)))
      throw UsageError("impl: layer window " + w.str() + " does not fit the model's " + std::to_string(layers) +
                       " layers (or lacks its boundary dump)");
    window_ = w;
  }

  void reset() override {
    cached_ = 0;
    pad_ = 0;
    window_ = {};
    store_.clear();
  }

  std::string producer() const override {
    std::string p = "llmdiff impl (" + fwd_.describe() + ")";
    for (size_t i = 0; i < bugs_.size(); ++i) p += (i == 0 ? " with bugs: " : ", ") + bugs_[i].str();
    return p;
  }
  // A verify call's rejected drafts (Engine::rollback).
  void rollback(int64_t positions) override {
    if (positions < 0 || positions > cached_)
      throw UsageError("impl: cannot roll back " + std::to_string(positions) + " of the " + std::to_string(cached_) +
                       " cached positions");
    cached_ -= positions;
    store_.truncate(cached_);
  }

  std::string dtype_name() const override { return "float32"; }
  PrecisionProfile precision() const override { return fwd_.precision(); }
  std::string kv_cache_json() const override { return store_.json(); }

  std::vector<float> forward(const std::vector<int64_t>& tokens, int step, Observer& obs) override;
  void resume(const TensorSource& dump, int step) override;

 private:
  Forward fwd_;
  std::vector<zoo::BugSpec> bugs_;
  ContiguousKv store_;
  int64_t capacity_ = 0;  // KV cache capacity in tokens
  int64_t cached_ = 0;    // keys in the cache (P)
  int64_t pad_ = 0;       // left padding of this sequence (set_left_padding)
  LayerWindow window_;    // the layers each call runs (set_layer_window): all by default
  std::vector<float> entering_;  // a shard's residual stream entering its first layer [T, D]
};

std::vector<float> ImplEngine::forward(const std::vector<int64_t>& tokens, int step, Observer& obs) {
  const ModelConfig& c = fwd_.config();
  const int64_t T = int64_t(tokens.size()), V = c.vocab_size, D = c.hidden_size;
  if (T == 0) throw UsageError("impl: a forward call needs at least one token");
  for (int64_t t = 0; t < T; ++t)
    if (tokens[size_t(t)] < 0 || tokens[size_t(t)] >= V)
      throw UsageError("impl: token id " + std::to_string(tokens[size_t(t)]) + " at index " + std::to_string(t) +
                       " of step " + std::to_string(step) + " is outside the vocabulary [0, " + std::to_string(V) +
                       ")");
  SequenceRows s;
  s.step = step;
  s.tokens = tokens;
  plan_rows(fwd_, s, cached_, pad_, store_.ring());
  const int64_t S = s.kv.write_at + T;  // keys held after this call
  if (S > capacity_)
    throw UsageError("impl: KV cache capacity exceeded at step " + std::to_string(step) + ": " +
                     std::to_string(cached_) + " cached + " + std::to_string(T) + " new tokens > capacity " +
                     std::to_string(capacity_) + " (max_position_embeddings of " + c.source +
                     " unless the engine's max_seq overrides it)");

  ForwardCall call;
  call.iteration = step;
  call.seqs.push_back(std::move(s));
  if (!window_.whole()) {
    call.first_layer = window_.first;
    call.end_layer = window_.end;
    if (window_.first > 0) {  // the residual stream entering its first layer, as the boundary dump holds it
      const std::string name = window_.boundary_name(step);
      const TensorData b = window_.boundary->get(name);
      if (b.is_int || b.shape != Shape{T, D})
        throw ShapeError(window_.boundary->label(), name, shape_str({T, D}), shape_str(b.shape));
      entering_ = b.f;
      call.entering = &entering_;
    }
  }
  std::vector<float> next = fwd_.run(call, store_, obs);
  cached_ = S;
  return next;
}

// The caches `dump` recorded after call `step` - 1 (Engine::resume), into
// the store's streams: keys and values from attn.k_cache / attn.v_cache
// [H, S, D] to rows [S, H*D]; MLA's latent rows from attn.latent_cache
// [S, Rkv] beside attn.k_pe_cache [S, Dr].
void ImplEngine::resume(const TensorSource& dump, int step) {
  const ModelConfig& c = fwd_.config();
  if (step <= 0) throw UsageError("impl: resumes at a call after the first, not " + std::to_string(step));
  if (cached_ != 0 || pad_ != 0 || !window_.whole() || store_.ring() > 0 || fwd_.ranks() != 1)
    throw UsageError("impl: resumes a plain sequence only (no padding, shard, ring cache or ranks)");
  auto read = [&](int layer, Site site) {
    const std::string name = layer_name(step - 1, layer, site);
    if (!dump.has(name)) throw MissingTensorError(dump.label(), name);
    TensorData t = dump.get(name);
    if (t.is_int) throw ShapeError(dump.label(), name, "float values", "integers");
    return t;
  };
  // Every cache holds the same S positions, within the capacity: checked at
  // the first one, before anything is written.
  int64_t S = -1;
  auto check_rows = [&](const TensorData& t, int64_t rows, const std::string& what) {
    if (S < 0) S = rows;
    if (rows != S || rows <= 0)
      throw ShapeError(dump.label(), what, std::to_string(S) + " cached positions", shape_str(t.shape));
    if (S > capacity_)
      throw UsageError("impl: KV cache capacity exceeded resuming " + dump.label() + " at call " +
                       std::to_string(step) + ": " + std::to_string(S) + " cached positions > capacity " +
                       std::to_string(capacity_));
  };
  for (int layer = 0; layer < int(c.num_hidden_layers); ++layer) {
    for (KvStream stream : {KvStream::Key, KvStream::Value}) {
      const int64_t width = store_.width(stream);
      if (width == 0) continue;
      const Site site = stream == KvStream::Key ? Site::AttnKCache : Site::AttnVCache;
      const TensorData t = read(layer, site);  // [H, S, D]
      const std::string name = layer_name(step - 1, layer, site);
      if (t.shape.size() != 3 || t.shape[0] * t.shape[2] != width)
        throw ShapeError(dump.label(), name, "[H, S, D] with H*D = " + std::to_string(width), shape_str(t.shape));
      const int64_t H = t.shape[0], rows = t.shape[1], D = t.shape[2];
      check_rows(t, rows, name);
      std::vector<float> r(size_t(rows * width));  // [S, H*D]
      for (int64_t h = 0; h < H; ++h)
        for (int64_t p = 0; p < rows; ++p)
          std::copy_n(t.f.data() + (h * rows + p) * D, D, r.data() + p * width + h * D);
      KvAccess a;
      a.T = a.context = rows;
      store_.write(layer, stream, a, r.data());
    }
    if (const int64_t width = store_.width(KvStream::Latent); width > 0) {
      const TensorData lat = read(layer, Site::AttnLatentCache), pe = read(layer, Site::AttnKPeCache);  // [S, Rkv], [S, Dr]
      const std::string name = layer_name(step - 1, layer, Site::AttnLatentCache);
      if (lat.shape.size() != 2 || pe.shape.size() != 2 || lat.shape[0] != pe.shape[0] ||
          lat.shape[1] + pe.shape[1] != width)
        throw ShapeError(dump.label(), name, "[S, Rkv] beside [S, Dr] with Rkv + Dr = " + std::to_string(width),
                         shape_str(lat.shape) + " and " + shape_str(pe.shape));
      const int64_t rows = lat.shape[0], R = lat.shape[1], Dr = pe.shape[1];
      check_rows(lat, rows, name);
      std::vector<float> r(size_t(rows * width));  // [S, Rkv + Dr]
      for (int64_t p = 0; p < rows; ++p) {
        std::copy_n(lat.f.data() + p * R, R, r.data() + p * width);
        std::copy_n(pe.f.data() + p * Dr, Dr, r.data() + p * width + R);
      }
      KvAccess a;
      a.T = a.context = rows;
      store_.write(layer, KvStream::Latent, a, r.data());
    }
  }
  cached_ = S;
}

}  // namespace

std::unique_ptr<Engine> make_impl_engine(const Model& model, const ImplOptions& opt) {
  return std::make_unique<ImplEngine>(model, opt);
}

}  // namespace llmdiff::impl
