#include "impl/kv_store.h"

#include <algorithm>
#include <cstring>

#include "dumps/base/errors.h"
#include "impl/cache_views.h"

namespace llmdiff::impl {

std::vector<float> KvStore::held(int layer, KvStream s, const KvAccess& a, int64_t* rows) {
  const float* r = read(layer, s, a);
  *rows = a.context;
  return std::vector<float>(r, r + a.context * width(s));
}

const std::vector<int64_t>& KvStore::table(int) const {
  static const std::vector<int64_t> none;
  return none;
}

void KvStore::store_rows(KvStream s, const float* src, int64_t n, float* dst) const {
  const int64_t w = width(s);
  if (s == KvStream::Latent)
    std::memcpy(dst, src, size_t(n * w) * sizeof(float));
  else
    round_activations(storage_, src, dst, n * w);
}

// ---- ContiguousKv

ContiguousKv::ContiguousKv(int layers, KvWidths widths, GgmlType storage, int64_t ring)
    : KvStore(layers, widths, storage), rows_(size_t(layers)), ring_(ring) {
  if (ring < 0) throw UsageError("impl: kv_ring must be >= 0, got " + std::to_string(ring));
}

void ContiguousKv::write(int layer, KvStream s, const KvAccess& a, const float* rows) {
  std::vector<float>& r = rows_[size_t(layer)][size_t(s)];
  const int64_t w = width(s);
  r.resize(size_t((a.write_at + a.T) * w));  // [write_at + T, width]: a call that overwrites starts again at 0
  store_rows(s, rows, a.T, r.data() + a.write_at * w);
}

const float* ContiguousKv::read(int layer, KvStream s, const KvAccess& a) {
  const std::vector<float>& r = rows_[size_t(layer)][size_t(s)];
  if (int64_t(r.size()) < a.context * width(s))
    throw UsageError("impl: the contiguous KV cache holds " + std::to_string(int64_t(r.size()) / width(s)) +
                     " positions, attention reads " + std::to_string(a.context));
  return r.data();
}

std::vector<float> ContiguousKv::held(int layer, KvStream s, const KvAccess& a, int64_t* rows) {
  if (ring_ == 0) return KvStore::held(layer, s, a, rows);
  *rows = std::min(a.context, ring_);
  read(layer, s, a);
  return ring_slots(rows_[size_t(layer)][size_t(s)], a.context, ring_, width(s));
}

std::string ContiguousKv::json() const {
  return ring_ > 0 ? "{\"kind\": \"ring\", \"capacity\": " + std::to_string(ring_) + "}" : "";
}

void ContiguousKv::clear() {
  for (auto& layer : rows_)
    for (std::vector<float>& r : layer) r.clear();
}

// ---- PagedKv

PagedKv::PagedKv(int layers, KvWidths widths, GgmlType storage, int64_t block_size, int64_t num_blocks)
    : KvStore(layers, widths, storage), B_(block_size), num_blocks_(num_blocks), pool_(size_t(layers)) {
  if (block_size <= 0) throw UsageError("batch: block size must be > 0");
  if (num_blocks <= 0) throw UsageError("batch: the paged KV cache needs at least one block");
  for (auto& layer : pool_)
    for (int s = 0; s < kKvStreams; ++s) layer[size_t(s)].assign(size_t(num_blocks * B_ * widths.of[size_t(s)]), 0.0f);
  for (int64_t i = 0; i < num_blocks; ++i) free_.push_back(i);
}

std::vector<int64_t>& PagedKv::table_of(int seq) {
  if (seq < 0) throw UsageError("batch: sequence " + std::to_string(seq) + " has no block table");
  if (size_t(seq) >= tables_.size()) tables_.resize(size_t(seq) + 1);
  return tables_[size_t(seq)];
}

const std::vector<int64_t>& PagedKv::table(int seq) const {
  if (seq < 0 || size_t(seq) >= tables_.size()) return KvStore::table(seq);
  return tables_[size_t(seq)];
}

void PagedKv::allocate(int seq, int64_t positions, int iteration) {
  std::vector<int64_t>& t = table_of(seq);
  while (int64_t(t.size()) * B_ < positions) {
    if (free_.empty())
      throw UsageError("batch: the paged KV cache's " + std::to_string(num_blocks_) + " blocks of " +
                       std::to_string(B_) + " are all in use at engine iteration " + std::to_string(iteration) +
                       " (seq" + std::to_string(seq) + " needs one more); give more blocks");
    t.push_back(free_.front());
    free_.pop_front();
  }
}

int64_t PagedKv::slot_of(int seq, int64_t p) const { return table(seq)[size_t(p / B_)] * B_ + p % B_; }

void PagedKv::release(int seq, size_t from, size_t to) {
  const std::vector<int64_t>& t = table_of(seq);
  for (size_t i = to; i > from; --i) free_.push_front(t[i - 1]);
}

void PagedKv::write(int layer, KvStream s, const KvAccess& a, const float* rows) {
  std::vector<float>& pool = pool_[size_t(layer)][size_t(s)];
  const int64_t w = width(s);
  for (int64_t t = 0; t < a.T; ++t) store_rows(s, rows + t * w, 1, &pool[size_t(a.slots[size_t(t)] * w)]);
}

const float* PagedKv::read(int layer, KvStream s, const KvAccess& a) {
  const std::vector<float>& pool = pool_[size_t(layer)][size_t(s)];
  const std::vector<int64_t>& t = table(a.seq);
  const int64_t w = width(s), S = a.context;
  std::vector<float>& out = scratch_[size_t(s)];
  out.resize(size_t(S * w));  // [S, width] in position order
  for (int64_t p = 0; p < S; ++p) {
    int64_t blk = p / B_;
    if (swapped_ && S / B_ >= 2 && blk < 2) blk = 1 - blk;
    std::copy_n(&pool[size_t((t[size_t(blk)] * B_ + p % B_) * w)], w, &out[size_t(p * w)]);
  }
  return out.data();
}

std::string PagedKv::json() const {
  return "{\"kind\": \"paged\", \"block_size\": " + std::to_string(B_) + ", \"num_blocks\": " +
         std::to_string(num_blocks_) + "}";
}

}  // namespace llmdiff::impl
