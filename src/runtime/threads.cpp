// Thread settings: LibTorch's intra-op pool and OpenBLAS's pool, found at run time so that
// flexdemo does not depend on which BLAS Debian's alternatives picked.
#include "flexdemo/runtime.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <stdexcept>
#include <string>

namespace flexdemo {

namespace {

using SetThreads = void (*)(int);
using GetThreads = int (*)();

// OpenBLAS's thread controls, looked up once (null when another BLAS is loaded): the guard
// below runs around every chunked DCT of the optimizer step.
struct BlasThreads {
  SetThreads set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  GetThreads get = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
};
const BlasThreads& blas_threads() {
  static const BlasThreads controls;
  return controls;
}

}  // namespace

SingleThreadedBlas::SingleThreadedBlas() {
  const BlasThreads& blas = blas_threads();
  if (blas.get != nullptr && blas.set != nullptr) {
    saved_ = blas.get();
    if (saved_ > 1) blas.set(1);
  }
}

SingleThreadedBlas::~SingleThreadedBlas() {
  if (saved_ > 1) blas_threads().set(saved_);
}

void set_num_threads(int threads) {
  if (threads < 1) {
    throw std::invalid_argument("threads must be >= 1, got " + std::to_string(threads));
  }
  at::set_num_threads(threads);
  if (blas_threads().set != nullptr) blas_threads().set(threads);
}

}  // namespace flexdemo
