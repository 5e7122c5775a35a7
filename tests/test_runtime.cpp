// The BLAS kernels this test program runs on (flexdemo::use_native_blas ran in its main): never
// one of OpenBLAS's kernels older than AVX2 on a CPU that has AVX2 + FMA, unless the user chose.
#include "flexdemo/runtime.h"

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace {

const char* openblas_string(const char* name) {
  using Get = char* (*)();
  auto get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, name));
  return get != nullptr ? get() : nullptr;
}

TEST(Blas, NoFallbackKernelWhereTheCpuHasAvx2) {
  const char* core = openblas_string("openblas_get_corename");
  const char* config = openblas_string("openblas_get_config");
  const std::string line = flexdemo::blas_description();
  if (core == nullptr) {  // another BLAS (PyPI's torch brings MKL): nothing to choose
    EXPECT_EQ(line, "the BLAS LibTorch was built with (not OpenBLAS)");
    return;
  }
  EXPECT_NE(line.find(std::string(core) + " kernels"), std::string::npos) << line;
  if (const char* chosen = std::getenv("OPENBLAS_CORETYPE")) {  // set by the user: kept
    EXPECT_NE(line.find(std::string("(OPENBLAS_CORETYPE=") + chosen + ")"), std::string::npos)
        << line;
    return;
  }
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (!avx2 || config == nullptr || std::strstr(config, "DYNAMIC_ARCH") == nullptr) return;
  // The cores of OpenBLAS 0.3.x with AVX2 or wider kernels, for x86-64.
  const std::string name = core;
  EXPECT_TRUE(name == "Haswell" || name == "Zen" || name == "SkylakeX" || name == "Cooperlake" ||
              name == "SapphireRapids")
      << "this CPU has AVX2 + FMA, but OpenBLAS runs its " << name << " kernels: " << line;
}

}  // namespace
