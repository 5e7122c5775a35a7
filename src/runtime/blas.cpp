// The BLAS kernels LibTorch's matmuls run on: where OpenBLAS does not know the CPU and would run
// a fallback kernel, restarts the program with OPENBLAS_CORETYPE naming the kernels the CPU can
// run. No LibTorch here: it runs first thing in main, before MPI, threads or any matmul.
#include "flexdemo/runtime.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace flexdemo {

namespace {

constexpr const char* kChosen = "FLEXDEMO_BLAS_RESTARTED";  // set on the restart: what OpenBLAS took

// The widest vector kernels a CPU (or an OpenBLAS core) runs: 0 older than AVX2 + FMA,
// 1 AVX2 + FMA, 2 AVX-512 (F, CD, BW, DQ, VL: what OpenBLAS's SkylakeX kernels use).
int cpu_level() {
  __builtin_cpu_init();  // libgcc also checks that the OS saves the AVX-512 registers
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl")) {
    return 2;
  }
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
}

int core_level(std::string core) {
  for (char& c : core) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (core == "skylakex" || core == "cooperlake" || core == "sapphirerapids") return 2;
  if (core == "haswell" || core == "zen") return 1;
  return 0;  // Prescott, Nehalem, Sandybridge, ...: a fallback where the CPU has AVX2
}

const char* const kCoreOfLevel[] = {nullptr, "Haswell", "SkylakeX"};

// OpenBLAS's own accessors, found at run time (null where another BLAS is loaded).
const char* openblas_call(const char* name) {
  using Get = char* (*)();
  auto get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, name));
  return get != nullptr ? get() : nullptr;
}

}  // namespace

void use_native_blas(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;  // the user's or the restart's choice
  const char* core = openblas_call("openblas_get_corename");
  if (core == nullptr) return;
  const int cpu = cpu_level();
  if (cpu <= core_level(core)) return;
  // OpenBLAS reads OPENBLAS_CORETYPE only while it loads, before main: the process starts again.
  setenv(kChosen, core, 1);
  setenv("OPENBLAS_CORETYPE", kCoreOfLevel[cpu], 1);
  // The binary's own path, not /proc/self/exe: the process's name (ps, /proc/PID/comm) comes
  // from the path's last part.
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    self[n] = '\0';
    execv(self, argv);
  }
  std::fprintf(stderr, "flexdemo: could not restart with OPENBLAS_CORETYPE=%s (%s); going on "
               "with OpenBLAS's %s kernels\n", kCoreOfLevel[cpu], std::strerror(errno), core);
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv(kChosen);
}

std::string blas_description() {
  const char* core = openblas_call("openblas_get_corename");
  if (core == nullptr) return "the BLAS LibTorch was built with (not OpenBLAS)";
  const char* config = openblas_call("openblas_get_config");  // "OpenBLAS 0.3.21 DYNAMIC_ARCH ..."
  std::string version = config != nullptr ? config : "OpenBLAS";
  const size_t first = version.find(' ');  // keep "OpenBLAS 0.3.21"
  if (first != std::string::npos) version = version.substr(0, version.find(' ', first + 1));
  std::string line = version + " " + core + " kernels";
  const char* chosen = std::getenv(kChosen);
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  if (chosen != nullptr && forced != nullptr) {
    line += std::string(" (chosen for this CPU; OpenBLAS alone took it for a ") + chosen + ")";
  } else if (forced != nullptr) {
    line += std::string(" (OPENBLAS_CORETYPE=") + forced + ")";
  }
  return line;
}

}  // namespace flexdemo
