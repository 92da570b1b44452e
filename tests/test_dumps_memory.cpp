// The heap's free pages given back to the system (dumps/base/memory.h):
// from several threads at once on the heap's first call, and only once the
// free memory adds up to what the caller asks.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <vector>

#include "dumps/base/memory.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LLMDIFF_CLANG_ASAN 1
#endif
#endif
#ifndef LLMDIFF_CLANG_ASAN
#define LLMDIFF_CLANG_ASAN 0
#endif

namespace llmdiff {
namespace {

// Resident pages of this process, in bytes.
int64_t resident_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// Four threads released at once, each giving the free heap back.
void release_from_four_threads_at_once() {
  std::atomic<int> waiting{4};
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i)
    threads.emplace_back([&waiting, i] {
      waiting.fetch_sub(1);
      while (waiting.load() > 0) {
      }
      release_free_heap(i % 2 ? 0 : 1);
    });
  for (auto& t : threads) t.join();
}

// Where malloc is replaced (the sanitizer build), these calls are the
// heap's first in each new process: a call racing the one that sets the
// heap up used to read an empty arena (181 of these 200 processes died
// when the first call was not made alone).
TEST(ReleaseFreeHeap, IsSafeFromSeveralThreadsOnTheHeapsFirstCall) {
  int died = 0;
  for (int child = 0; child < 200; ++child) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      release_from_four_threads_at_once();
      _exit(0);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++died;
  }
  EXPECT_EQ(died, 0) << "processes that died giving the heap back from four threads";
}

TEST(ReleaseFreeHeap, GivesFreedPiecesBackOnceTheyAddUpToWhatIsAsked) {
#if defined(__SANITIZE_ADDRESS__) || LLMDIFF_CLANG_ASAN
  GTEST_SKIP() << "the sanitizer's allocator keeps its own free memory";
#endif
  // 256 MiB in pieces under the mmap threshold: freed, they stay in the heap.
  const size_t piece = 64 << 10, count = 4096;
  std::vector<char*> pieces;
  for (size_t i = 0; i < count; ++i) {
    pieces.push_back(static_cast<char*>(std::malloc(piece)));
    for (size_t b = 0; b < piece; b += 4096) pieces.back()[b] = 1;
  }
  // The last piece stays: the freed ones are not at the heap's top, where
  // free() alone would give them back.
  for (size_t i = 0; i + 1 < count; ++i) std::free(pieces[i]);
  const int64_t freed = int64_t(piece) * (count - 1);
  const int64_t held = resident_bytes();
  release_free_heap(int64_t(64) << 30);  // more than is free: nothing given back
  EXPECT_GT(resident_bytes(), held - freed / 8);
  release_free_heap(freed / 2);
  EXPECT_LT(resident_bytes(), held - freed / 2);
  std::free(pieces.back());
}

}  // namespace
}  // namespace llmdiff
