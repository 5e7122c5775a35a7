// Step rules: apply a direction, the same on every replica, to this rank's tensors. Sign-SGD
// (DeMo's; plain SGD with sign off), AdamW (the same formula as torch.optim.AdamW) or SGD with
// Nesterov momentum (the same as torch.optim.SGD(nesterov=True)), with decoupled weight decay.
// With sign off, the direction may first be rescaled: each chunk to unit RMS (`normalize`), the
// whole tensor to `update_rms` (or down to `rms_cap` where above it), and each element clamped
// to `step_bound`, in that order.
// The Optimizer's inner step is one (--inner); with --inner-steps the outer step is another.
#pragma once

#include "demo/backend.h"
#include "demo/kernels.h"
#include "flexdemo/optim.h"

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace flexdemo::optim {

class StepRule {
 public:
  StepRule(const std::vector<OptimParam>& params, const OptimizerOptions& options);
  void begin_step(double lr);  // once per applied step, before the apply() calls
  // Tensor i: p *= 1 - lr*wd, then the update from direction ([rows, cols] float32).
  void apply(size_t i, const at::Tensor& direction);
  // SGD's step for tensor i before the rate: sign(direction), or the direction rescaled and
  // bounded as the options say (what apply() subtracts, times the rate, with the SGD rule).
  at::Tensor shaped(size_t i, const at::Tensor& direction) const;
  // Tensor i's update as a DeMo backend applies it fused into the decode (the same update as
  // apply()): sign-SGD with sign, or AdamW, on a float32 tensor; none otherwise (then apply()).
  std::optional<demo::Update> fused_update(size_t i) const;
  // This step's numbers (AdamW's; sign-SGD reads lr and weight_decay).
  kernels::AdamWHyper hyper() const;
  at::Tensor param(size_t i) const { return params_.at(i); }  // [rows, cols] view of tensor i
  // AdamW's moments or Nesterov's momentum, named for files (handles: loading copies into them).
  std::vector<std::pair<std::string, at::Tensor>> state_tensors() const;
  void restore_step(int64_t applied_steps) { step_ = applied_steps; }

 private:
  std::pair<double, double> bias_corrections() const;  // AdamW's 1 - beta1^t, 1 - beta2^t
  // The direction rescaled and bounded as the options say (normalize, update_rms, rms_cap,
  // step_bound).
  at::Tensor rescaled(size_t i, const at::Tensor& direction) const;

  std::vector<at::Tensor> params_;  // views [rows, cols] of the leaves
  std::vector<dct::ChunkPlan> plans_;
  OptimizerOptions options_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;  // AdamW moments (float32)
  std::vector<at::Tensor> momentum_;              // Nesterov's (float32)
  int64_t step_ = 0;
  double lr_ = 0.0;  // this step's
};

}  // namespace flexdemo::optim
