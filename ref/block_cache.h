// libtorch's CPU allocations served from a bounded cache of freed blocks.
//
// libtorch allocates a fresh buffer for every op result. A pass of the
// decoder graph makes the same shapes layer after layer, and runs of a
// bisection follow each other with the same shapes again: from glibc, large
// buffers are mapped and unmapped (the kernel zeroes every page again on the
// next use), or kept as heap pieces that must be trimmed back to the system
// (and are faulted in again after). BlockCache keeps freed blocks of at
// least `min_block` bytes, up to `max_cached` bytes of them, and hands one
// back for a request of its size (at most an eighth larger): the pages stay
// mapped and resident, and no fault, zeroing or trim happens for them.
// Blocks past the limit (least recently freed first) go back to the system.
// Smaller requests are c10's own allocations.
#pragma once
#include <c10/core/Allocator.h>

#include <cstdint>
#include <list>
#include <map>
#include <mutex>

namespace llmdiff::ref {

struct BlockCacheStats {
  int64_t reused = 0;        // requests served from the cache
  int64_t mapped = 0;        // requests that mapped a new block
  int64_t cached_bytes = 0;  // freed bytes held now
  int64_t live_bytes = 0;    // bytes of large blocks in use now
  int64_t released = 0;      // blocks handed back to the system
};

class BlockCache final : public c10::Allocator {
 public:
  explicit BlockCache(int64_t max_cached, int64_t min_block = int64_t(256) << 10);
  ~BlockCache() override;  // blocks still in use must not outlive it
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // 64-byte aligned, as c10's allocator. Throws c10::Error ("not enough
  // memory: ... bytes") when the system has no more.
  c10::DataPtr allocate(size_t bytes) const override;
  c10::DeleterFnPtr raw_deleter() const override;
  // Hands every cached block back to the system.
  void release_cached();
  BlockCacheStats stats() const;

 private:
  struct Block;
  static void free_block(void* data);
  void give_back(Block* b) const;
  void unmap(Block* b) const;

  const int64_t max_cached_, min_block_;
  mutable std::mutex mu_;
  mutable std::multimap<size_t, Block*> by_size_;  // cached blocks
  mutable std::list<Block*> lru_;                 // cached blocks, least recently freed first
  mutable BlockCacheStats stats_;
};

// Makes a BlockCache of `max_cached` bytes libtorch's CPU allocator for the
// rest of the process (the first call; later calls return the same cache).
// Called once, by a program's main: every tensor allocated after it comes
// from the cache.
BlockCache& use_block_cache(int64_t max_cached);

}  // namespace llmdiff::ref
