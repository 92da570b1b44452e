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

void ContiguousKv::truncate(int64_t positions) {
  for (auto& layer : rows_)
    for (int s = 0; s < kKvStreams; ++s) {
      std::vector<float>& r = layer[size_t(s)];
      r.resize(std::min(r.size(), size_t(positions * widths_.of[size_t(s)])));
    }
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
  refs_.assign(size_t(num_blocks), 0);
  owner_.assign(size_t(num_blocks), -1);
  indexed_.resize(size_t(num_blocks));
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

std::vector<int64_t> PagedKv::block_sources(int seq) const {
  if (!prefix_.on) return {};
  std::vector<int64_t> out;
  for (int64_t b : table(seq)) out.push_back(owner_[size_t(b)]);
  return out;
}

// A free block, else the least recently used indexed block no sequence holds
// (evicted from the index).
int64_t PagedKv::take_block(int seq, int iteration) {
  int64_t b = -1;
  if (!free_.empty()) {
    b = free_.front();
    free_.pop_front();
  } else {
    for (int64_t i = 0; i < num_blocks_; ++i)
      if (refs_[size_t(i)] == 0 && indexed_[size_t(i)] &&
          (b < 0 || indexed_[size_t(i)]->last_use < indexed_[size_t(b)]->last_use))
        b = i;
    if (b < 0)
      throw UsageError("batch: the paged KV cache's " + std::to_string(num_blocks_) + " blocks of " +
                       std::to_string(B_) + " are all in use at engine iteration " + std::to_string(iteration) +
                       " (seq" + std::to_string(seq) + " needs one more); give more blocks");
    by_hash_.erase(indexed_[size_t(b)]->hash);
    indexed_[size_t(b)].reset();
  }
  refs_[size_t(b)] = 1;
  owner_[size_t(b)] = seq;
  return b;
}

void PagedKv::drop_ref(int64_t block) {
  int& r = refs_[size_t(block)];
  if (r > 0) --r;
  if (r == 0 && !indexed_[size_t(block)]) free_.push_front(block);  // an indexed block stays, evictable
}

void PagedKv::allocate(int seq, int64_t positions, int iteration) {
  std::vector<int64_t>& t = table_of(seq);
  while (int64_t(t.size()) * B_ < positions) t.push_back(take_block(seq, iteration));
}

int64_t PagedKv::slot_of(int seq, int64_t p) const { return table(seq)[size_t(p / B_)] * B_ + p % B_; }

void PagedKv::release(int seq, size_t from, size_t to) {
  const std::vector<int64_t>& t = table_of(seq);
  for (size_t i = to; i > from; --i) drop_ref(t[i - 1]);
}

void PagedKv::truncate(int seq, int64_t positions) {
  std::vector<int64_t>& t = table_of(seq);
  const size_t keep = size_t((positions + B_ - 1) / B_);
  if (t.size() <= keep) return;
  release(seq, keep, t.size());
  t.resize(keep);
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
         std::to_string(num_blocks_) + (prefix_.on ? ", \"prefix_cache\": true" : "") + "}";
}

// ---- prefix cache

// FNV-1a over the parent's hash and the block's tokens (prefix-hash-last-block:
// the block's tokens alone).
uint64_t PagedKv::block_hash(uint64_t parent, const int64_t* tokens) const {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i, v >>= 8) h = (h ^ (v & 0xff)) * 1099511628211ull;
  };
  mix(prefix_.hash_last_block ? 0 : parent);
  for (int64_t i = 0; i < B_; ++i) mix(uint64_t(tokens[i]));
  return h;
}

int64_t PagedKv::lookup(int seq, const std::vector<int64_t>& prompt, int64_t max_hit) {
  std::vector<int64_t>& t = table_of(seq);
  if (!prefix_.on || !t.empty() || max_hit <= 0) return 0;
  const int64_t limit = std::min<int64_t>(max_hit, int64_t(prompt.size()));
  int64_t hit = 0;
  uint64_t parent = 0;
  auto take = [&](int64_t b) {
    ++refs_[size_t(b)];
    indexed_[size_t(b)]->last_use = ++clock_;
    t.push_back(b);
  };
  // Full blocks, each hashed over the prefix it ends.
  while (hit + B_ <= limit) {
    const uint64_t h = block_hash(parent, &prompt[size_t(hit)]);
    const auto it = by_hash_.find(h);
    if (it == by_hash_.end()) break;
    take(it->second);
    hit += B_;
    parent = h;
  }
  // Then the indexed block after them that matches the most of the rest.
  int64_t best = -1, best_len = 0;
  const uint64_t want_parent = prefix_.hash_last_block ? 0 : parent;
  for (int64_t b = 0; b < num_blocks_; ++b) {
    const std::optional<Indexed>& ix = indexed_[size_t(b)];
    if (!ix || ix->parent != want_parent) continue;
    int64_t n = 0;
    while (n < B_ && hit + n < limit && ix->tokens[size_t(n)] == prompt[size_t(hit + n)]) ++n;
    if (n > best_len) best = b, best_len = n;
  }
  if (best >= 0 && best_len < B_) {
    take(best);
    hit += best_len;
  }
  return hit;
}

void PagedKv::own_for_write(int seq, int64_t from, int64_t to, int iteration) {
  if (!prefix_.on || prefix_.shared_write) return;
  std::vector<int64_t>& t = table_of(seq);
  for (int64_t blk = from / B_; blk * B_ < to && blk < int64_t(t.size()); ++blk) {
    const int64_t shared = t[size_t(blk)];
    if (refs_[size_t(shared)] == 1 && !indexed_[size_t(shared)]) continue;  // its own
    // Copy-on-write: a block of its own with the shared block's positions before `from`.
    const int64_t copy = take_block(seq, iteration);
    const int64_t keep = std::max<int64_t>(0, std::min(B_, from - blk * B_));
    for (auto& layer : pool_)
      for (int s = 0; s < kKvStreams; ++s) {
        const int64_t w = widths_.of[size_t(s)];
        if (w == 0 || keep == 0) continue;  // a stream this model does not keep (MLA's v)
        float* pool = layer[size_t(s)].data();
        std::copy_n(pool + shared * B_ * w, keep * w, pool + copy * B_ * w);
      }
    owner_[size_t(copy)] = owner_[size_t(shared)];
    t[size_t(blk)] = copy;
    drop_ref(shared);
  }
}

void PagedKv::index_full_blocks(int seq, const std::vector<int64_t>& tokens, int64_t positions) {
  if (!prefix_.on) return;
  const std::vector<int64_t>& t = table_of(seq);
  uint64_t parent = 0;
  for (int64_t blk = 0; (blk + 1) * B_ <= std::min<int64_t>(positions, int64_t(tokens.size())) &&
                        blk < int64_t(t.size());
       ++blk) {
    const uint64_t h = block_hash(parent, &tokens[size_t(blk * B_)]);
    const int64_t b = t[size_t(blk)];
    if (!indexed_[size_t(b)] && !by_hash_.count(h)) {
      Indexed ix;
      ix.hash = h;
      ix.parent = prefix_.hash_last_block ? 0 : parent;
      ix.tokens.assign(tokens.begin() + blk * B_, tokens.begin() + (blk + 1) * B_);
      ix.last_use = ++clock_;
      indexed_[size_t(b)] = std::move(ix);
      by_hash_[h] = b;
    }
    parent = h;
  }
}

}  // namespace llmdiff::impl
