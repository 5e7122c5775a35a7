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
  at::Tensor sq = at::zeros({1}, at::kDouble);
  for (const auto& p : params) {
    if (p.leaf.grad().defined()) sq += p.leaf.grad().to(at::kDouble).pow(2).sum();
  }
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
