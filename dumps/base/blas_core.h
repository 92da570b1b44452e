// Which OpenBLAS kernels libtorch's float32/float64 matrix products run on.
//
// OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernels by the CPU's
// family and model number when it is loaded. A CPU newer than the library
// (OpenBLAS 0.3.21 on an Intel Xeon of family 6, model 207) gets the generic
// "Prescott" SSE3 kernels, whatever instructions it has: no AVX2, FMA or
// AVX-512, so its float32/float64 products run several times slower than the
// CPU allows (docs/PERFORMANCE.md, "OpenBLAS's kernels"). OpenBLAS reads the
// OPENBLAS_CORETYPE variable when it is loaded, so the kernels can only be
// chosen for a process before it starts.
//
// No libtorch here: the functions look OpenBLAS up in whatever the process
// has loaded (nothing, for a program without libtorch).
#pragma once
#include <optional>
#include <string>

namespace llmdiff {

// The loaded OpenBLAS's configuration ("OpenBLAS 0.3.21 DYNAMIC_ARCH ...
// SkylakeX MAX_THREADS=64"), or "" when libtorch's BLAS is not OpenBLAS.
std::string blas_config();

// The OpenBLAS core type this CPU's instructions allow ("SkylakeX" with
// AVX-512 F/CD/BW/DQ/VL, "Haswell" with AVX2 and FMA) when the loaded
// OpenBLAS chose weaker kernels than that; nullopt when it chose as well (or
// better), when OPENBLAS_CORETYPE is set already, or when the BLAS is not
// OpenBLAS.
std::optional<std::string> better_blas_core();

// When OPENBLAS_CORETYPE is set and holds the loaded OpenBLAS to kernels
// weaker than this CPU allows (Haswell's AVX2 ones on a CPU with AVX-512,
// say), a line saying so and what to do; "" otherwise. The choice is kept
// (a user may want the same kernels on every machine): bench and --verbose
// print the line.
std::string forced_blas_core_note();

// For a program's main, before anything else: when better_blas_core() names
// a core, sets OPENBLAS_CORETYPE to it and executes the program again
// (/proc/self/exe, the same arguments), which then finds the variable set and
// goes on. Returns (the kernels unchanged) when there is nothing better or the
// execution fails.
void restart_with_better_blas(char** argv);

}  // namespace llmdiff
