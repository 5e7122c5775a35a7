// GoogleTest main for the one-process suites: the BLAS kernels the command runs on this CPU
// (flexdemo::use_native_blas), then every test.
#include "flexdemo/runtime.h"

#include <gtest/gtest.h>

int main(int argc, char** argv) {
  flexdemo::use_native_blas(argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
