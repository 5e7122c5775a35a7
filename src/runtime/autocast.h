// bf16 autocast on a device type (CPU or CUDA) through whichever API the LibTorch in use has: 2.4
// replaced the per-device calls (*_cpu_*, *_gpu_*) by ones taking the device type and warns at run
// time on the old ones, which 1.13 (Debian's) lacks. Internal to the library.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <torch/version.h>

namespace flexdemo::autocast {

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
inline bool enabled(c10::DeviceType device) {
  return at::autocast::is_autocast_enabled(device);
}
inline void set_enabled(c10::DeviceType device, bool on) {
  at::autocast::set_autocast_enabled(device, on);
}
inline void set_dtype(c10::DeviceType device, at::ScalarType dtype) {
  at::autocast::set_autocast_dtype(device, dtype);
}
#else
inline bool enabled(c10::DeviceType device) {
  return device == c10::kCPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
}
inline void set_enabled(c10::DeviceType device, bool on) {
  if (device == c10::kCPU) {
    at::autocast::set_cpu_enabled(on);
  } else {
    at::autocast::set_enabled(on);
  }
}
inline void set_dtype(c10::DeviceType device, at::ScalarType dtype) {
  if (device == c10::kCPU) {
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
}
#endif

}  // namespace flexdemo::autocast
