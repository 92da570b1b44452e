// The BLAS kernels the llmdiff binary computes with (dumps/base/blas_core.h): on
// a CPU that the loaded OpenBLAS does not know, the kernels its instructions
// allow, not the generic ones; a user's OPENBLAS_CORETYPE is kept.
#include <gtest/gtest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "dumps/base/blas_core.h"
#include "tests/support.h"

using namespace llmdiff;
using namespace llmdiff::testing;

namespace {

bool has_avx2_fma() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// `bench` of the impl on a golden model (no BLAS work, a second or so): its
// JSON names the CPU and the BLAS the process loaded.
nlohmann::json bench_machine(const std::string& env) {
  std::string out;
  const int code = run_binary("bench --model " + golden_model("llama-gqa") +
                                  " --engines impl --prompt 2 --decode 1 --repeats 1 --bandwidth-mib 16 --json",
                              &out, env);
  EXPECT_EQ(code, 0) << out;
  const size_t json_at = out.find("{\n");
  if (code != 0 || json_at == std::string::npos) return nlohmann::json::object();
  return nlohmann::json::parse(out.substr(json_at));
}

}  // namespace

TEST(CliBlas, BinaryComputesOnTheKernelsItsCpuAllows) {
  const nlohmann::json j = bench_machine("-u OPENBLAS_CORETYPE");
  ASSERT_TRUE(j.contains("blas")) << j.dump();
  EXPECT_FALSE(j["cpu"].get<std::string>().empty());
  const std::string blas = j["blas"];
  if (blas.empty()) GTEST_SKIP() << "libtorch's BLAS is not OpenBLAS";
  EXPECT_NE(blas.find("OpenBLAS"), std::string::npos) << blas;
  if (!has_avx2_fma()) GTEST_SKIP() << "a CPU without AVX2: OpenBLAS's own choice stands";
  // OpenBLAS writes the core type it runs in its configuration string.
  for (const char* weak : {" Prescott ", " Core2 ", " Nehalem ", " Sandybridge ", " Penryn ", " Atom ",
                           " Barcelona ", " Bulldozer ", " Piledriver ", " Steamroller ", " Unknown "})
    EXPECT_EQ(blas.find(weak), std::string::npos) << blas << " on " << j["cpu"];
}

TEST(CliBlas, AUsersChoiceOfKernelsIsKept) {
  if (!has_avx2_fma()) GTEST_SKIP() << "Haswell kernels need AVX2 and FMA";
  const nlohmann::json j = bench_machine("OPENBLAS_CORETYPE=Haswell");
  ASSERT_TRUE(j.contains("blas")) << j.dump();
  const std::string blas = j["blas"];
  if (blas.empty()) GTEST_SKIP() << "libtorch's BLAS is not OpenBLAS";
  EXPECT_NE(blas.find(" Haswell "), std::string::npos) << blas;
}

bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

// A forced core type weaker than the CPU allows is kept, and named with what
// to do; none is named when OpenBLAS chooses, or when the forced type is as
// strong as the CPU allows.
TEST(CliBlas, AWeakerForcedChoiceIsNamed) {
  if (!has_avx2_fma()) GTEST_SKIP() << "a CPU without AVX2: no weaker choice to name";
  const std::string weak = has_avx512() ? "Haswell" : "Prescott", strong = has_avx512() ? "SkylakeX" : "Haswell";
  const nlohmann::json forced = bench_machine("OPENBLAS_CORETYPE=" + weak);
  ASSERT_TRUE(forced.contains("blas")) << forced.dump();
  if (forced["blas"].get<std::string>().empty()) GTEST_SKIP() << "libtorch's BLAS is not OpenBLAS";
  const std::string note = forced.value("blas_note", "");
  EXPECT_NE(note.find("OPENBLAS_CORETYPE=" + weak), std::string::npos) << note;
  EXPECT_NE(note.find("allows " + strong), std::string::npos) << note;
  EXPECT_NE(forced["blas"].get<std::string>().find(" " + weak + " "), std::string::npos) << forced["blas"];
  EXPECT_EQ(bench_machine("OPENBLAS_CORETYPE=" + strong).value("blas_note", "?"), "");
  EXPECT_EQ(bench_machine("-u OPENBLAS_CORETYPE").value("blas_note", "?"), "");
}

TEST(CliBlas, NothingBetterIsNamedOnceTheCoreTypeIsSet) {
  const char* was = std::getenv("OPENBLAS_CORETYPE");
  const std::string saved = was ? was : "";
  ::setenv("OPENBLAS_CORETYPE", "Haswell", 1);
  EXPECT_FALSE(better_blas_core().has_value());
  if (was)
    ::setenv("OPENBLAS_CORETYPE", saved.c_str(), 1);
  else
    ::unsetenv("OPENBLAS_CORETYPE");
  // This test program restarted itself as the binary does: its own OpenBLAS
  // (libtorch's) runs the kernels the CPU allows already.
  EXPECT_FALSE(better_blas_core().has_value()) << blas_config();
}
