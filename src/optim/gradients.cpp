// Gradient utilities next to the optimizer: finiteness and clipping by the global norm across the
// ranks that hold one replica's gradient in shards.
#include "flexdemo/comm.h"
#include "flexdemo/optim.h"

#include <ATen/ATen.h>

#include <cmath>

namespace flexdemo::optim {

bool all_finite(const std::vector<OptimParam>& params) {
  for (const auto& p : params) {
    if (p.leaf.grad().defined() && !at::isfinite(p.leaf.grad()).all().item<bool>()) return false;
  }
  return true;
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
