// Measurement helpers of `llmdiff bench`: the machine's streaming read
// bandwidth, per-process peak RSS, running work in a forked child, and
// min/median statistics, the seconds since a time point and the
// pseudo-random prompts.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace llmdiff::bench {

struct BandwidthResult {
  double best_gbs = 0.0;            // best of the repeats, 1e9 bytes/s
  std::vector<double> all_gbs;
  size_t buffer_bytes = 0;
  int threads = 0;
};
// Streams over a buffer of `bytes` (>> last-level cache), summing it with
// `threads` threads each reading its own contiguous slice as four streams at
// once (as the impl's GEMV reads its rows); best of `repeats` passes after
// one warm-up pass that also faults the pages in.
BandwidthResult measure_read_bandwidth(int threads, size_t bytes, int repeats);

// The CPU as /proc/cpuinfo names it, with its family and model numbers
// ("Intel(R) Xeon(R) Processor, family 6 model 207"; "" if unreadable).
std::string cpu_name();

// Bytes of /proc/self/status field "VmRSS" / "VmHWM" (0 if unreadable).
int64_t proc_status_bytes(const char* field);
// A byte count of /proc/self/io (e.g. "read_bytes": what the process made
// the storage layer fetch, its memory-mapped files included); 0 when absent.
int64_t proc_io_bytes(const char* field);

struct ChildOutcome {
  std::string output;     // what the child's function returned
  bool ok = false;        // the child exited with status 0
  std::string failure;    // why not, when !ok ("killed by signal 9", ...)
  int64_t maxrss_bytes = 0;  // the child's own peak RSS (wait4 rusage)
};
// Runs `fn` in a forked child and returns its result string (sent through a
// pipe) and its peak RSS. The child never returns into the caller: it exits
// with 0 after `fn`, or 1 after writing an exception's message. The parent must
// not have started thread pools that a fork would leave inconsistent.
ChildOutcome run_in_child(const std::function<std::string()>& fn);

// Seconds from t0 to now.
double seconds_since(std::chrono::steady_clock::time_point t0);

// Pseudo-random prompt ids in [0, vocab): splitmix64 of the seed.
std::vector<int64_t> bench_prompt(int64_t vocab, int n, uint64_t seed);

struct Stat {
  double min = 0.0, median = 0.0, max = 0.0;
};
Stat stat_of(std::vector<double> v);  // v must not be empty

}  // namespace llmdiff::bench
