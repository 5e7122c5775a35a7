// flexdemo/runtime.h — process-wide settings shared by the library and the command.
#pragma once

namespace flexdemo {

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
