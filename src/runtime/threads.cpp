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

SetThreads blas_setter() {
  return reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
}

}  // namespace

SingleThreadedBlas::SingleThreadedBlas() {
  auto get = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  if (get != nullptr && blas_setter() != nullptr) {
    saved_ = get();
    if (saved_ > 1) blas_setter()(1);
  }
}

SingleThreadedBlas::~SingleThreadedBlas() {
  if (saved_ > 1) blas_setter()(saved_);
}

void set_num_threads(int threads) {
  if (threads < 1) {
    throw std::invalid_argument("threads must be >= 1, got " + std::to_string(threads));
  }
  at::set_num_threads(threads);
  if (SetThreads set_blas = blas_setter()) set_blas(threads);
}

}  // namespace flexdemo
