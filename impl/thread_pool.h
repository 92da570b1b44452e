// A small persistent thread pool for the impl's kernels. The calling thread
// takes part as worker 0; the others wait on a generation counter (spinning
// briefly, then sleeping on a condition variable), so that the hundreds of
// parallel regions of one forward call cost microseconds, not syscalls.
//
// Work is always split into fixed contiguous ranges by worker index: a kernel
// that computes each output element in one piece gives bit-identical results
// for any thread count.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace llmdiff::impl {

class ThreadPool {
 public:
  // `threads` workers in all, the caller included; 0 means one per core.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return size_; }

  // Runs fn(worker) on every worker (0 .. size()-1) and returns when all are
  // done; an exception thrown by fn on any worker is rethrown here (the
  // first one). Not reentrant: fn must not call run() itself.
  void run(const std::function<void(int)>& fn);

  // Splits [0, n) into size() contiguous ranges, fn(begin, end, worker) on
  // each non-empty one.
  template <class F>
  void parallel_for(int64_t n, F&& fn) {
    if (n <= 0) return;
    if (size_ == 1 || n == 1) {
      fn(int64_t(0), n, 0);
      return;
    }
    run([&](int w) {
      const int64_t b = n * w / size_, e = n * (w + 1) / size_;
      if (b < e) fn(b, e, w);
    });
  }

 private:
  void worker_loop(int index);
  void record_error();  // keeps the first exception of a run

  int size_ = 1;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* job_ = nullptr;
  std::exception_ptr error_;
};

}  // namespace llmdiff::impl
