// The main of every test program: GoogleTest's, after choosing the BLAS
// kernels as the llmdiff binary does (dumps/base/blas_core.h), so that the tests
// compute with the kernels the tool runs on.
#include <gtest/gtest.h>

#include "dumps/base/blas_core.h"

int main(int argc, char** argv) {
  llmdiff::restart_with_better_blas(argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
