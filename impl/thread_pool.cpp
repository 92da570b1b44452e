#include "impl/thread_pool.h"
#include "dumps/base/threads.h"

namespace llmdiff::impl {

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spin iterations (~100 µs) before a waiting thread sleeps or yields.
constexpr int kSpinBeforeSleep = 4000;

}  // namespace

ThreadPool::ThreadPool(int threads) {
  threads = resolve_threads(threads);
  size_ = threads < 1 ? 1 : threads;
  threads_.reserve(size_t(size_ - 1));
  for (int i = 1; i < size_; ++i) threads_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
    generation_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::run(const std::function<void(int)>& fn) {
  if (size_ == 1) {
    fn(0);
    return;
  }
  job_ = &fn;
  pending_.store(size_ - 1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  try {
    fn(0);
  } catch (...) {
    record_error();
  }
  for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < kSpinBeforeSleep)
      cpu_relax();
    else
      std::this_thread::yield();
  }
  job_ = nullptr;
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void ThreadPool::record_error() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_) error_ = std::current_exception();
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen && spins < kSpinBeforeSleep) {
      cpu_relax();
      ++spins;
    }
    if (generation_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    try {
      (*job_)(index);
    } catch (...) {
      record_error();
    }
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace llmdiff::impl
