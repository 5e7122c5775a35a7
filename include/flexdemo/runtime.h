// flexdemo/runtime.h — process-wide settings shared by the library and the command.
#pragma once

#include <string>

namespace flexdemo {

// ====== BLAS ======
// Where OpenBLAS runs one of its kernels older than AVX2 on a CPU that has AVX2 or AVX-512 (its
// fallback on a model it does not know: Debian's 0.3.21 takes an Emerald Rapids Xeon for a
// Prescott, training 2-3x slower), restarts this program (exec of its own binary, same argv)
// with OPENBLAS_CORETYPE naming the kernels the CPU runs: SkylakeX with AVX-512, Haswell with
// AVX2 + FMA. OpenBLAS reads that variable only while it loads, so call this first thing in main,
// before MPI, threads or files. An OPENBLAS_CORETYPE already set (by the user or the machine) is
// respected; another BLAS, or an OpenBLAS built for one CPU only, is left alone. The restarted
// program finds FLEXDEMO_BLAS_RESTARTED (what OpenBLAS took) and clears both variables, so its
// children decide for their own CPU. Returns when no restart is needed, or when it failed (one
// line on stderr; the run goes on).
void use_native_blas(char** argv);  // argv: main's, null-terminated

// Which BLAS kernels run, for a run's header: "OpenBLAS 0.3.21 SkylakeX kernels (chosen for
// this CPU; OpenBLAS alone took it for a Prescott)".
std::string blas_description();

// ====== Threads ======

// Intra-op threads for LibTorch and, when it is the loaded BLAS, OpenBLAS (whose own pool would
// otherwise use every core whatever LibTorch is told). threads must be >= 1.
void set_num_threads(int threads);

// While alive, OpenBLAS runs on one thread: for GEMMs issued from inside at::parallel_for, whose
// threads already occupy the cores (two pools spinning for the same cores is 4x slower here).
class SingleThreadedBlas {
 public:
  SingleThreadedBlas();
  ~SingleThreadedBlas();
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int saved_ = 0;  // OpenBLAS's thread count before; 0: OpenBLAS is not loaded
};

}  // namespace flexdemo
