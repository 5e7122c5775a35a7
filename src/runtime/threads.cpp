// Thread settings: LibTorch's intra-op pool and OpenBLAS's pool, found at run time so that
// flexdemo does not depend on which BLAS Debian's alternatives picked.
#include "flexdemo/runtime.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <stdexcept>
#include <string>

namespace flexdemo {

void set_num_threads(int threads) {
  if (threads < 1) {
    throw std::invalid_argument("threads must be >= 1, got " + std::to_string(threads));
  }
  at::set_num_threads(threads);
  using SetThreads = void (*)(int);
  if (auto set_blas =
          reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set_blas(threads);
  }
}

}  // namespace flexdemo
