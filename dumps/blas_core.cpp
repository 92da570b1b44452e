#include "dumps/blas_core.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <set>

namespace llmdiff {

namespace {

using NameFn = char* (*)();

// An OpenBLAS function of the loaded library (libtorch links libblas.so.3,
// which is OpenBLAS when Debian's alternative points there).
NameFn openblas_fn(const char* name) { return reinterpret_cast<NameFn>(dlsym(RTLD_DEFAULT, name)); }

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return s;
}

}  // namespace

std::string blas_config() {
  const NameFn config = openblas_fn("openblas_get_config");
  const char* s = config ? config() : nullptr;
  return s ? s : "";
}

std::optional<std::string> better_blas_core() {
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  if (forced && *forced) return std::nullopt;
  const NameFn corename = openblas_fn("openblas_get_corename");
  const char* chosen = corename ? corename() : nullptr;
  if (!chosen) return std::nullopt;
  // OpenBLAS's x86-64 core types without AVX2 kernels (driver/others/dynamic.c).
  static const std::set<std::string> pre_avx2 = {
      "unknown",   "katmai",  "coppermine", "northwood", "prescott", "banias",       "atom",
      "core2",     "penryn",  "dunnington", "nehalem",   "athlon",   "opteron",      "opteron_sse3",
      "barcelona", "nano",    "sandybridge", "bulldozer", "piledriver", "steamroller"};
  if (!pre_avx2.count(lower(chosen))) return std::nullopt;
  // __builtin_cpu_supports says what the CPU has and the OS saves (XCR0).
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return std::string("SkylakeX");
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return std::string("Haswell");
  return std::nullopt;
}

void restart_with_better_blas(char** argv) {
  const std::optional<std::string> core = better_blas_core();
  if (!core || ::setenv("OPENBLAS_CORETYPE", core->c_str(), 1) != 0) return;
  ::execv("/proc/self/exe", argv);
}

}  // namespace llmdiff
