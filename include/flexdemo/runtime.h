// flexdemo/runtime.h — process-wide settings shared by the library and the command.
#pragma once

namespace flexdemo {

// Intra-op threads for LibTorch and, when it is the loaded BLAS, OpenBLAS (whose own pool would
// otherwise use every core whatever LibTorch is told). threads must be >= 1.
void set_num_threads(int threads);

}  // namespace flexdemo
