#include "ref/block_cache.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <unistd.h>

#include <new>
#include <string>

namespace llmdiff::ref {

// Every allocation starts with this header, 64 bytes before the data
// (libtorch frees some buffers by their data pointer alone: raw_deleter).
struct BlockCache::Block {
  const BlockCache* owner;
  void* base;
  size_t bytes;  // mapped length, whole pages (0: a small allocation of c10's)
  std::multimap<size_t, Block*>::iterator in_size;  // while cached
  std::list<Block*>::iterator in_lru;               // while cached
};

namespace {

constexpr size_t kHeader = 64;  // c10's alignment
static_assert(sizeof(void*) * 5 <= kHeader, "the block header fits in front of the data");

size_t page_rounded(size_t bytes) {
  static const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

}  // namespace

BlockCache::BlockCache(int64_t max_cached, int64_t min_block) : max_cached_(max_cached), min_block_(min_block) {}

BlockCache::~BlockCache() { release_cached(); }

c10::DataPtr BlockCache::allocate(size_t bytes) const {
  const c10::Device cpu(c10::DeviceType::CPU);
  auto data_ptr = [&](Block* b) {
    void* data = static_cast<char*>(b->base) + kHeader;
    return c10::DataPtr(data, data, &BlockCache::free_block, cpu);
  };
  if (int64_t(bytes) < min_block_) {
    void* p = c10::alloc_cpu(bytes + kHeader);
    return data_ptr(new (p) Block{this, p, 0, {}, {}});
  }
  const size_t want = page_rounded(bytes + kHeader);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_size_.lower_bound(want);
    if (it != by_size_.end() && it->first <= want + want / 8) {
      Block* b = it->second;
      by_size_.erase(it);
      lru_.erase(b->in_lru);
      stats_.cached_bytes -= int64_t(b->bytes);
      stats_.live_bytes += int64_t(b->bytes);
      ++stats_.reused;
      return data_ptr(b);
    }
  }
  void* p = ::mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "not enough memory: you tried to allocate ", bytes, " bytes (",
              double(bytes) / double(int64_t(1) << 30), " GiB)");
  Block* b = new (p) Block{this, p, want, {}, {}};
  std::lock_guard<std::mutex> lock(mu_);
  stats_.live_bytes += int64_t(want);
  ++stats_.mapped;
  return data_ptr(b);
}

c10::DeleterFnPtr BlockCache::raw_deleter() const { return &BlockCache::free_block; }

void BlockCache::free_block(void* data) {
  if (!data) return;
  auto* b = reinterpret_cast<Block*>(static_cast<char*>(data) - kHeader);
  if (b->bytes == 0) {
    c10::free_cpu(b->base);
    return;
  }
  b->owner->give_back(b);
}

void BlockCache::give_back(Block* b) const {
  std::unique_lock<std::mutex> lock(mu_);
  stats_.live_bytes -= int64_t(b->bytes);
  if (int64_t(b->bytes) > max_cached_) {
    ++stats_.released;
    lock.unlock();
    unmap(b);
    return;
  }
  // Room first, least recently freed first.
  std::list<Block*> out;
  while (!lru_.empty() && stats_.cached_bytes + int64_t(b->bytes) > max_cached_) {
    Block* old = lru_.front();
    lru_.pop_front();
    by_size_.erase(old->in_size);
    stats_.cached_bytes -= int64_t(old->bytes);
    ++stats_.released;
    out.push_back(old);
  }
  b->in_size = by_size_.emplace(b->bytes, b);
  b->in_lru = lru_.insert(lru_.end(), b);
  stats_.cached_bytes += int64_t(b->bytes);
  lock.unlock();
  for (Block* old : out) unmap(old);  // outside the lock: munmap waits for the other threads' TLBs
}

void BlockCache::unmap(Block* b) const { ::munmap(b->base, b->bytes); }

void BlockCache::release_cached() {
  std::list<Block*> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out.swap(lru_);
    by_size_.clear();
    stats_.released += int64_t(out.size());
    stats_.cached_bytes = 0;
  }
  for (Block* b : out) unmap(b);
}

BlockCacheStats BlockCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

BlockCache& use_block_cache(int64_t max_cached) {
  // Never destroyed: tensors freed during the process' exit come back to it.
  static BlockCache* cache = [max_cached] {
    auto* c = new BlockCache(max_cached);
    c10::SetCPUAllocator(c, /*priority=*/1);
    return c;
  }();
  return *cache;
}

}  // namespace llmdiff::ref
