// Measurement helpers of `llmdiff bench`.
#include "bench/support.h"
#include "dumps/base/threads.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <thread>

#include "dumps/base/errors.h"
#include "impl/kernels.h"

namespace llmdiff::bench {

namespace {

// Sum of n words read as kStreams sequential streams at once (the n words
// cut in kStreams parts), each asking kPrefetchBytes ahead of its loads, as
// the impl's GEMV reads its rows (impl/kernels.h): a single stream
// understates what the cores can read. Eight independent accumulators per
// stream (vectorised by the compiler; the loop is bound by memory bandwidth,
// not by the adds).
uint64_t sum_words(const uint64_t* p, size_t n) {
  constexpr int kStreams = impl::kGemvStreams;
  constexpr size_t kPrefetchBytes = impl::kPrefetchBytes;
  const size_t part = n / kStreams / 8 * 8;
  uint64_t a[kStreams][8] = {};
  for (size_t i = 0; i < part; i += 8)
    for (int s = 0; s < kStreams; ++s) {
      const uint64_t* q = p + size_t(s) * part + i;
      __builtin_prefetch(reinterpret_cast<const char*>(q) + kPrefetchBytes, 0, 0);
      for (int k = 0; k < 8; ++k) a[s][k] += q[k];
    }
  uint64_t sum = 0;
  for (size_t i = kStreams * part; i < n; ++i) sum += p[i];
  for (const auto& stream : a)
    for (uint64_t v : stream) sum += v;
  return sum;
}

// Runs body(t, begin, end) over `threads` contiguous slices of [0, n), one
// thread each, and returns the wall time in seconds.
template <typename Body>
double timed_slices(int threads, size_t n, Body body) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  const size_t per = (n + size_t(threads) - 1) / size_t(threads);
  for (int t = 0; t < threads; ++t) {
    const size_t b = std::min(n, per * size_t(t)), e = std::min(n, b + per);
    pool.emplace_back([=] { body(t, b, e); });
  }
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

BandwidthResult measure_read_bandwidth(int threads, size_t bytes, int repeats) {
  BandwidthResult r;
  r.threads = resolve_threads(threads);
  const size_t n = std::max<size_t>(bytes / sizeof(uint64_t), 8);
  r.buffer_bytes = n * sizeof(uint64_t);
  std::unique_ptr<uint64_t[]> buf(new uint64_t[n]);
  uint64_t* p = buf.get();
  // First touch from the reading threads, so pages sit near them.
  timed_slices(r.threads, n, [p](int, size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) p[i] = i * 0x9e3779b97f4a7c15ULL;
  });
  std::atomic<uint64_t> sink{0};
  auto pass = [&] {
    return timed_slices(r.threads, n, [p, &sink](int, size_t b, size_t e) {
      sink.fetch_add(sum_words(p + b, e - b), std::memory_order_relaxed);
    });
  };
  pass();  // warm-up
  for (int i = 0; i < std::max(1, repeats); ++i) {
    const double s = pass();
    r.all_gbs.push_back(double(r.buffer_bytes) / s * 1e-9);
  }
  r.best_gbs = *std::max_element(r.all_gbs.begin(), r.all_gbs.end());
  if (sink.load() == 0x5a5a5a5a5a5a5a5aULL) std::fputc(' ', stderr);  // keeps the sums observable
  return r;
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, name, family, model;
  auto value = [&](const char* key, std::string& into) {
    const size_t n = std::strlen(key);
    if (!into.empty() || line.compare(0, n, key) != 0) return;
    const size_t colon = line.find(':', n);
    if (colon == std::string::npos || line.find_first_not_of(" \t", n) != colon) return;
    into = line.substr(std::min(line.size(), colon + 2));
  };
  while (std::getline(in, line) && line.find_first_not_of(" \t") != std::string::npos) {
    value("model name", name);
    value("cpu family", family);
    value("model", model);
  }
  if (name.empty()) return "";
  return family.empty() || model.empty() ? name : name + ", family " + family + " model " + model;
}

namespace {
// The number after "field:" on its line of a /proc file (0 if absent).
long long proc_number(const char* path, const char* field) {
  std::ifstream in(path);
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) == 0) {
      long long v = 0;
      if (std::sscanf(line.c_str() + key.size(), "%lld", &v) == 1) return v;
    }
  }
  return 0;
}
}  // namespace

int64_t proc_status_bytes(const char* field) { return int64_t(proc_number("/proc/self/status", field)) * 1024; }

int64_t proc_io_bytes(const char* field) { return int64_t(proc_number("/proc/self/io", field)); }

ChildOutcome run_in_child(const std::function<std::string()>& fn) {
  int fds[2];
  if (::pipe(fds) != 0) throw IoError("pipe", std::strerror(errno));
  std::fflush(nullptr);  // nothing buffered may be written twice
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    throw IoError("fork", std::strerror(errno));
  }
  if (pid == 0) {
    ::close(fds[0]);
    std::string out;
    int code = 0;
    try {
      out = fn();
    } catch (const std::exception& e) {
      out = e.what();
      code = 1;
    } catch (...) {
      out = "unknown exception";
      code = 1;
    }
    size_t off = 0;
    while (off < out.size()) {
      const ssize_t w = ::write(fds[1], out.data() + off, out.size() - off);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) break;
      off += size_t(w);
    }
    ::close(fds[1]);
    std::fflush(nullptr);
    ::_exit(code);  // no static destructors or atexit handlers of the parent's state
  }
  ::close(fds[1]);
  ChildOutcome res;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    res.output.append(buf, size_t(n));
  }
  ::close(fds[0]);
  int status = 0;
  struct rusage ru;
  std::memset(&ru, 0, sizeof ru);
  while (::wait4(pid, &status, 0, &ru) < 0) {
    if (errno != EINTR) throw IoError("wait4", std::strerror(errno));
  }
  res.maxrss_bytes = int64_t(ru.ru_maxrss) * 1024;  // Linux: KiB
  if (WIFEXITED(status)) {
    res.ok = WEXITSTATUS(status) == 0;
    if (!res.ok) res.failure = res.output.empty() ? "exited with status " + std::to_string(WEXITSTATUS(status)) : res.output;
  } else if (WIFSIGNALED(status)) {
    res.failure = "killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  } else {
    res.failure = "ended abnormally";
  }
  return res;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<int64_t> bench_prompt(int64_t vocab, int n, uint64_t seed) {
  std::vector<int64_t> ids(static_cast<size_t>(n));
  uint64_t s = seed;
  for (auto& id : ids) id = int64_t(splitmix64(s) % uint64_t(vocab));
  return ids;
}

Stat stat_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  Stat s;
  s.min = v.front();
  s.max = v.back();
  const size_t m = v.size() / 2;
  s.median = v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
  return s;
}

}  // namespace llmdiff::bench
