// bf16 autocast on the CPU through whichever API the LibTorch in use has: 2.4 replaced the
// *_cpu_* calls by ones taking the device type and warns at run time on the old ones, which
// 1.13 (Debian's) lacks. Internal to the library.
#pragma once

#include <ATen/autocast_mode.h>
#include <torch/version.h>

namespace flexdemo::autocast {

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
inline bool cpu_enabled() {
  return at::autocast::is_autocast_enabled(at::kCPU);
}
inline void set_cpu_enabled(bool enabled) {
  at::autocast::set_autocast_enabled(at::kCPU, enabled);
}
inline void set_cpu_dtype(at::ScalarType dtype) {
  at::autocast::set_autocast_dtype(at::kCPU, dtype);
}
#else
inline bool cpu_enabled() {
  return at::autocast::is_cpu_enabled();
}
inline void set_cpu_enabled(bool enabled) {
  at::autocast::set_cpu_enabled(enabled);
}
inline void set_cpu_dtype(at::ScalarType dtype) {
  at::autocast::set_autocast_cpu_dtype(dtype);
}
#endif

}  // namespace flexdemo::autocast
