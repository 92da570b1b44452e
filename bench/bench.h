// llmdiff bench: the harness. Prefill and decode speed, peak memory and
// bandwidth efficiency of the ref and impl engines side by side, the
// debugger's own cost end to end (--e2e), the bisection of a candidate with a
// zoo bug phase by phase (--bisect), the continuous-batching engine
// (--batch) and the cost of its serving features (--serving,
// bench/serving.h), each engine or part in a forked child of its own so
// that its peak RSS is its own. cli/cmd_bench.cpp holds the flags.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace llmdiff::bench {

struct BenchOptions {
  std::string model;                   // --model DIR
  int prompt = 128;                    // prefill tokens
  int decode = 32;                     // greedy decode steps timed after the prefill
  int threads = 0;                     // engines and bandwidth probe; 0: all cores
  int repeats = 3;                     // prefill + decode runs per engine
  std::vector<std::string> engines = {"ref", "impl"};  // "none" alone: no engine
  std::string ref_dtype;               // empty: the checkpoint's torch_dtype
  uint64_t seed = 0;                   // prompt token ids
  int bandwidth_mib = 1024;            // bandwidth probe buffer
  bool json_out = false;
  bool e2e = false;                    // also time run-equivalent work
  int e2e_decode = 8;                  // decode steps of the end-to-end run
  std::string e2e_dir;                 // where its dumps go; empty: a temporary directory, removed
  std::string bisect;                  // --bisect BUG: time the bisection of an impl candidate with BUG
  std::string mla = "naive";           // impl's MLA form (deepseek_v3): naive or absorbed
  int batch = 0;                       // --batch N: the continuous-batching engine with 1 and N sequences
  int serving = 0;                     // --serving N: each serving feature's cost, N requests sharing a prefix
};

// Runs what `o` asks and prints the tables (or, with json_out, one JSON
// document; docs/BENCH_JSON.md) on stdout, progress on stderr. Returns 0, or
// 2 when a timed child failed. Throws UsageError for bad options.
int run_bench(const BenchOptions& o);

}  // namespace llmdiff::bench
