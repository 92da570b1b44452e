// ref/block_cache.h: libtorch's CPU allocations from a bounded cache of
// freed blocks, and the ref's numbers unchanged with it.
#include <gtest/gtest.h>

#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include <cstdint>
#include <thread>
#include <vector>

#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/model/weights.h"
#include "ref/block_cache.h"
#include "ref/ref_engine.h"
#include "tests/support.h"

namespace llmdiff {
namespace {

constexpr int64_t kMiB = int64_t(1) << 20;

TEST(BlockCache, AFreedBlockServesTheNextRequestOfItsSize) {
  ref::BlockCache cache(64 * kMiB, 256 << 10);
  void* first = nullptr;
  {
    c10::DataPtr a = cache.allocate(size_t(4 * kMiB));
    first = a.get();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
    static_cast<char*>(first)[4 * kMiB - 1] = 1;  // the whole request is usable
    EXPECT_EQ(cache.stats().mapped, 1);
    EXPECT_GE(cache.stats().live_bytes, 4 * kMiB);
  }
  EXPECT_EQ(cache.stats().live_bytes, 0);
  EXPECT_GE(cache.stats().cached_bytes, 4 * kMiB);
  {
    // Within an eighth of the block: the block again.
    c10::DataPtr b = cache.allocate(size_t(4 * kMiB - 100 * 1024));
    EXPECT_EQ(b.get(), first);
    EXPECT_EQ(cache.stats().reused, 1);
    EXPECT_EQ(cache.stats().cached_bytes, 0);
    // Much smaller: a block of its own (the cached one is in use anyway).
    c10::DataPtr c = cache.allocate(size_t(kMiB));
    EXPECT_NE(c.get(), first);
    EXPECT_EQ(cache.stats().mapped, 2);
  }
  {
    // Half the size: not handed a block twice its size.
    c10::DataPtr d = cache.allocate(size_t(2 * kMiB));
    EXPECT_NE(d.get(), first);
    EXPECT_EQ(cache.stats().mapped, 3);
  }
  cache.release_cached();
  EXPECT_EQ(cache.stats().cached_bytes, 0);
  EXPECT_EQ(cache.stats().released, 3);
}

TEST(BlockCache, HoldsAtMostItsLimitLeastRecentlyFreedGoingFirst) {
  ref::BlockCache cache(10 * kMiB, 256 << 10);
  std::vector<c10::DataPtr> blocks;
  std::vector<void*> where;
  for (int i = 0; i < 4; ++i) {
    blocks.push_back(cache.allocate(size_t(3 * kMiB)));
    where.push_back(blocks.back().get());
  }
  for (auto& b : blocks) b.clear();  // freed in order 0, 1, 2, 3: block 0 leaves for block 3
  EXPECT_LE(cache.stats().cached_bytes, 10 * kMiB);
  EXPECT_EQ(cache.stats().released, 1);
  std::vector<c10::DataPtr> again;
  for (int i = 0; i < 3; ++i) again.push_back(cache.allocate(size_t(3 * kMiB)));
  EXPECT_EQ(cache.stats().reused, 3);
  for (const auto& b : again) EXPECT_NE(b.get(), where[0]);
  again.clear();
  // Larger than the limit: back to the system at once.
  { c10::DataPtr big = cache.allocate(size_t(11 * kMiB)); }
  EXPECT_EQ(cache.stats().released, 2);
  EXPECT_LE(cache.stats().cached_bytes, 10 * kMiB);
}

TEST(BlockCache, SmallRequestsAndRawAllocationsComeBackThroughTheRawDeleter) {
  ref::BlockCache cache(16 * kMiB, 256 << 10);
  ASSERT_NE(cache.raw_deleter(), nullptr);
  // libtorch frees some buffers by their data pointer alone.
  void* small = cache.raw_allocate(1000);
  void* large = cache.raw_allocate(size_t(kMiB));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(large) % 64, 0u);
  EXPECT_EQ(cache.stats().mapped, 1);  // the small one is c10's
  cache.raw_deallocate(small);
  cache.raw_deallocate(large);
  EXPECT_EQ(cache.stats().live_bytes, 0);
  EXPECT_GE(cache.stats().cached_bytes, kMiB);
  c10::DataPtr zero = cache.allocate(0);  // as c10's: nothing to free
  EXPECT_EQ(cache.stats().mapped, 1);
}

TEST(BlockCache, ThreadsAllocatingAndFreeingTogetherLeaveItConsistent) {
  ref::BlockCache cache(32 * kMiB, 64 << 10);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&cache, t] {
      for (int i = 0; i < 200; ++i) {
        const size_t bytes = size_t((1 + (i + t) % 5) * 256 * 1024);
        c10::DataPtr a = cache.allocate(bytes);
        c10::DataPtr b = cache.allocate(bytes / 2);
        static_cast<char*>(a.get())[bytes - 1] = char(i);
        static_cast<char*>(b.get())[bytes / 2 - 1] = char(t);
      }
    });
  for (auto& th : threads) th.join();
  const ref::BlockCacheStats s = cache.stats();
  EXPECT_EQ(s.live_bytes, 0);
  EXPECT_LE(s.cached_bytes, 32 * kMiB);
  EXPECT_GT(s.reused, 1000);  // 1600 requests of 10 sizes
}

// Every golden model's decode scenario through the ref, with libtorch's
// allocator and then with a BlockCache serving every buffer (a block freed
// by one op reused by the next, holding its old values): the same bits.
TEST(BlockCache, RefNumbersUnchangedWhenEveryBufferComesFromTheCache) {
  const std::vector<std::string> names = testing::golden_models();
  std::vector<Model> models;
  for (const auto& m : names) models.push_back(Model::load(testing::golden_model(m)));
  // The golden decode scenario of models[k] through the ref, as HF ran it.
  auto run = [&](size_t k, const std::string& label) {
    const DumpFile golden(testing::golden_dump(names[k], "decode"));
    ref::RefOptions opt;
    opt.threads = 1;
    opt.dtype = ComputeDType::Float32;
    auto engine = ref::make_ref_engine(models[k], opt);
    MemoryDump out(label);
    run_scenario(*engine, replay_scenario(golden), out);
    return out;
  };
  std::vector<MemoryDump> before;
  for (size_t k = 0; k < models.size(); ++k) before.push_back(run(k, "default allocator"));
  // Installed for the rest of this process (each test runs alone).
  static ref::BlockCache cache(64 * kMiB, /*min_block=*/1);
  c10::SetCPUAllocator(&cache, /*priority=*/2);
  const torch::Tensor probe = torch::empty({1000});
  EXPECT_GE(cache.stats().mapped, 1);
  for (size_t k = 0; k < models.size(); ++k) {
    const std::string& m = names[k];
    const MemoryDump after = run(k, "block cache");
    const MemoryDump& was = before[k];
    ASSERT_EQ(after.names(), was.names()) << m;
    for (const auto& n : was.names()) {
      const TensorData a = after.get(n), b = was.get(n);
      ASSERT_EQ(a.shape, b.shape) << m << " " << n;
      EXPECT_EQ(a.f, b.f) << m << " " << n;
      EXPECT_EQ(a.i, b.i) << m << " " << n;
    }
  }
  EXPECT_GT(cache.stats().reused, 1000);
}

}  // namespace
}  // namespace llmdiff
