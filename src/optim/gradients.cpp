// Gradient utilities next to the optimizer: finiteness and clipping by the global norm across the
// ranks that hold one replica's gradient in shards.
#include "flexdemo/comm.h"
#include "flexdemo/optim.h"

#include "demo/kernels.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

namespace flexdemo::optim {

bool all_finite(const std::vector<at::Tensor>& tensors) {
  // Off the CPU: one flag a tensor, stacked per device and read back once (one sync a device).
  std::vector<std::pair<at::Device, std::vector<at::Tensor>>> elsewhere;
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) continue;
    if (t.is_cpu()) {
      if (!kernels::all_finite(t)) return false;
      continue;
    }
    auto on = std::find_if(elsewhere.begin(), elsewhere.end(),
                           [&](const auto& d) { return d.first == t.device(); });
    if (on == elsewhere.end()) on = elsewhere.insert(elsewhere.end(), {t.device(), {}});
    on->second.push_back(at::isfinite(t).all());
  }
  for (const auto& [device, flags] : elsewhere) {
    if (!at::stack(flags).all().item<bool>()) return false;
  }
  return true;
}

bool all_finite(const std::vector<OptimParam>& params) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back(p.leaf.grad());
  return all_finite(grads);
}

double clip_grad_norm(const std::vector<OptimParam>& params, double max_norm,
                      comm::Communicator& group) {
  double local = 0.0;  // summed on the host, tensor by tensor, wherever the gradients are
  for (const auto& p : params) {
    if (p.leaf.grad().defined()) local += p.leaf.grad().to(at::kDouble).pow(2).sum().item<double>();
  }
  at::Tensor sq = at::full({1}, local, at::kDouble);
  group.all_reduce(sq, comm::ReduceOp::Sum);
  const double norm = std::sqrt(sq.item<double>());
  if (norm > max_norm) {
    for (auto& p : params) {
      if (p.leaf.grad().defined()) p.leaf.mutable_grad().mul_(max_norm / norm);
    }
  }
  return norm;
}

}  // namespace flexdemo::optim
