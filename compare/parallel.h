// A small fixed pool of worker threads for compare/'s data-parallel loops.
// Callers split work into tasks that write disjoint outputs and combine them
// in a fixed order afterwards, so results never depend on the thread count.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace llmdiff::compare {

class ThreadPool {
 public:
  // `threads` counts the calling thread too: 1 (or less) runs every task
  // inline; 0 means default_threads().
  explicit ThreadPool(int threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }
  // Runs fn(0) .. fn(tasks - 1), each exactly once, on the workers and the
  // calling thread; returns when all are done. The first exception a task
  // throws is rethrown here (the remaining tasks still run). Not reentrant:
  // one parallel_for at a time per pool.
  void parallel_for(int64_t tasks, const std::function<void(int64_t)>& fn);

 private:
  void worker_loop();
  void run_tasks(std::unique_lock<std::mutex>& lock);  // claims tasks until none is left

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t tasks_ = 0, next_ = 0, finished_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};


}  // namespace llmdiff::compare
