#include "dumps/base/blas_core.h"

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

namespace {

// OpenBLAS's x86-64 core types without AVX2 kernels, and those with AVX-512
// ones (driver/others/dynamic.c); the others have AVX2 kernels.
bool pre_avx2_core(const std::string& core) {
  static const std::set<std::string> cores = {
      "unknown",   "katmai",  "coppermine", "northwood", "prescott", "banias",       "atom",
      "core2",     "penryn",  "dunnington", "nehalem",   "athlon",   "opteron",      "opteron_sse3",
      "barcelona", "nano",    "sandybridge", "bulldozer", "piledriver", "steamroller"};
  return cores.count(lower(core)) > 0;
}
bool avx512_core(const std::string& core) {
  static const std::set<std::string> cores = {"skylakex", "cooperlake", "sapphirerapids"};
  return cores.count(lower(core)) > 0;
}

// The strongest core type this CPU's instructions allow: "SkylakeX" with
// AVX-512 F/CD/BW/DQ/VL, "Haswell" with AVX2 and FMA (__builtin_cpu_supports
// says what the CPU has and the OS saves, XCR0), else nullopt.
std::optional<std::string> cpu_core() {
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return std::string("SkylakeX");
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return std::string("Haswell");
  return std::nullopt;
}

// The core type the loaded OpenBLAS runs ("" when the BLAS is not OpenBLAS).
std::string loaded_core() {
  const NameFn corename = openblas_fn("openblas_get_corename");
  const char* chosen = corename ? corename() : nullptr;
  return chosen ? chosen : "";
}

// Whether `core`'s kernels are weaker than those of `allowed` (cpu_core()).
bool weaker(const std::string& core, const std::string& allowed) {
  if (pre_avx2_core(core)) return true;
  return allowed == "SkylakeX" && !avx512_core(core);
}

}  // namespace

std::optional<std::string> better_blas_core() {
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  if (forced && *forced) return std::nullopt;
  const std::string chosen = loaded_core();
  if (chosen.empty() || !pre_avx2_core(chosen)) return std::nullopt;
  return cpu_core();
}

std::string forced_blas_core_note() {
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  const std::string chosen = loaded_core();
  const std::optional<std::string> allowed = cpu_core();
  if (!forced || !*forced || chosen.empty() || !allowed || !weaker(chosen, *allowed)) return "";
  return std::string("OPENBLAS_CORETYPE=") + forced + " holds OpenBLAS to " + chosen + " kernels where this CPU allows " +
         *allowed + ": unset it (or set " + *allowed + ") for faster float32/float64 products";
}

void restart_with_better_blas(char** argv) {
  const std::optional<std::string> core = better_blas_core();
  if (!core || ::setenv("OPENBLAS_CORETYPE", core->c_str(), 1) != 0) return;
  ::execv("/proc/self/exe", argv);
}

}  // namespace llmdiff
