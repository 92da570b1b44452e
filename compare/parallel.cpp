#include "compare/parallel.h"
#include "dumps/base/threads.h"

#include <algorithm>

namespace llmdiff::compare {


ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = default_threads();
  for (int k = 1; k < threads; ++k) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_tasks(std::unique_lock<std::mutex>& lock) {
  while (next_ < tasks_) {
    const int64_t k = next_++;
    const auto* fn = fn_;
    lock.unlock();
    std::exception_ptr error;
    try {
      (*fn)(k);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    if (error && !error_) error_ = error;
    if (++finished_ == tasks_) done_.notify_all();
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    run_tasks(lock);
  }
}

void ThreadPool::parallel_for(int64_t tasks, const std::function<void(int64_t)>& fn) {
  if (tasks <= 0) return;
  if (workers_.empty() || tasks == 1) {
    std::exception_ptr error;
    for (int64_t k = 0; k < tasks; ++k) {
      try {
        fn(k);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  fn_ = &fn;
  tasks_ = tasks;
  next_ = finished_ = 0;
  error_ = nullptr;
  ++generation_;
  wake_.notify_all();
  run_tasks(lock);
  done_.wait(lock, [&] { return finished_ == tasks_; });
  fn_ = nullptr;
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

}  // namespace llmdiff::compare
