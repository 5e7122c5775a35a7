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

// Set for the restarted program only, to what OpenBLAS took before; read and cleared at its start.
constexpr const char* kRestartedEnv = "FLEXDEMO_BLAS_RESTARTED";

// In the restarted program, what OpenBLAS took before (e.g. "Prescott"); empty: no restart.
std::string& openblas_took() {
  static std::string took;
  return took;
}

// The widest vector kernels of OpenBLAS this CPU runs: 0 older than AVX2 + FMA, 1 AVX2 + FMA
// (Haswell's), 2 AVX-512 F, CD, BW, DQ and VL (SkylakeX's; the DeMo kernels' own test in
// kernels.cpp asks for F and VL only). libgcc also checks that the OS saves the registers.
int cpu_level() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl")) {
    return 2;
  }
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
}

// Whether an OpenBLAS core is one of its kernels older than AVX2 (Prescott, Nehalem,
// Sandybridge, ...): its fallback on a CPU it does not know.
bool is_pre_avx2(std::string core) {
  for (char& c : core) c = char(std::tolower(static_cast<unsigned char>(c)));
  for (const char* modern : {"haswell", "zen", "skylakex", "cooperlake", "sapphirerapids"}) {
    if (core == modern) return false;
  }
  return true;
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
  if (const char* took = std::getenv(kRestartedEnv)) {
    // The restarted program: OpenBLAS has loaded with the chosen kernels. Children (flexdemo
    // supervise's mpirun, srun's ranks on other machines) decide for their own CPU.
    openblas_took() = took;
    unsetenv(kRestartedEnv);
    unsetenv("OPENBLAS_CORETYPE");
    return;
  }
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;  // the user's or the machine's choice
  const char* core = openblas_call("openblas_get_corename");
  const char* config = openblas_call("openblas_get_config");
  // Only a DYNAMIC_ARCH build (Debian's) has other kernels to choose; only a fallback is replaced.
  if (core == nullptr || config == nullptr || std::strstr(config, "DYNAMIC_ARCH") == nullptr ||
      !is_pre_avx2(core)) {
    return;
  }
  const int cpu = cpu_level();
  if (cpu == 0) return;
  // OpenBLAS reads OPENBLAS_CORETYPE only while it loads, before main: the process starts again,
  // from the binary's own path (not /proc/self/exe: ps and /proc/PID/comm name the path's last
  // part).
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self));
  if (n > 0 && size_t(n) < sizeof(self)) {
    self[n] = '\0';
    setenv(kRestartedEnv, core, 1);
    setenv("OPENBLAS_CORETYPE", kCoreOfLevel[cpu], 1);
    execv(self, argv);
  }
  std::fprintf(stderr, "flexdemo: could not restart with OPENBLAS_CORETYPE=%s (%s); going on "
               "with OpenBLAS's %s kernels\n", kCoreOfLevel[cpu],
               n > 0 ? std::strerror(errno) : "no path of this program", core);
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv(kRestartedEnv);
}

std::string blas_description() {
  const char* core = openblas_call("openblas_get_corename");
  if (core == nullptr) return "the BLAS LibTorch was built with (not OpenBLAS)";
  const char* config = openblas_call("openblas_get_config");  // "OpenBLAS 0.3.21 DYNAMIC_ARCH ..."
  std::string version = config != nullptr ? config : "OpenBLAS";
  const size_t first = version.find(' ');  // keep "OpenBLAS 0.3.21"
  if (first != std::string::npos) version = version.substr(0, version.find(' ', first + 1));
  std::string line = version + " " + core + " kernels";
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  if (!openblas_took().empty()) {
    line += " (chosen for this CPU; OpenBLAS alone took it for a " + openblas_took() + ")";
  } else if (forced != nullptr) {
    line += std::string(" (OPENBLAS_CORETYPE=") + forced + ")";
  }
  return line;
}

}  // namespace flexdemo
