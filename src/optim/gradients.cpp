// Gradient utilities next to the optimizer: finiteness and clipping by the global norm across the
// ranks that hold one replica's gradient in shards.
#include "flexdemo/comm.h"
#include "flexdemo/optim.h"

#include "demo/kernels.h"

#include <ATen/ATen.h>

#include <cmath>

namespace flexdemo::optim {

bool all_finite(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> elsewhere;  // one flag each, read back together: one sync on a GPU
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) continue;
    if (t.is_cpu()) {
      if (!kernels::all_finite(t)) return false;
    } else {
      elsewhere.push_back(at::isfinite(t).all());
    }
  }
  return elsewhere.empty() || at::stack(elsewhere).all().item<bool>();
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
