// Runs a test body once per instruction set of the fast path's kernels that this CPU has.
#pragma once

#include "demo/kernels.h"

#include <vector>

namespace flexdemo::isa_testing {

inline std::vector<kernels::Isa> supported_isas() {
  std::vector<kernels::Isa> isas;
  for (kernels::Isa isa :
       {kernels::Isa::Baseline, kernels::Isa::Avx2, kernels::Isa::Avx512, kernels::Isa::Portable}) {
    if (kernels::supported(isa)) isas.push_back(isa);
  }
  return isas;
}

// Sets the kernels' instruction set for a scope.
class ScopedIsa {
 public:
  explicit ScopedIsa(kernels::Isa isa) : saved_(kernels::active_isa()) {
    kernels::set_active_isa(isa);
  }
  ~ScopedIsa() { kernels::set_active_isa(saved_); }
  ScopedIsa(const ScopedIsa&) = delete;
  ScopedIsa& operator=(const ScopedIsa&) = delete;

 private:
  kernels::Isa saved_;
};

}  // namespace flexdemo::isa_testing
