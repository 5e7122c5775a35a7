// Sign-SGD, AdamW and Nesterov SGD applied to one tensor at a time, in place on this rank's
// parameters. AdamW follows torch.optim.AdamW's operation order, so it can be checked against it.
#include "step_rule.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>

namespace flexdemo::optim {

StepRule::StepRule(const std::vector<OptimParam>& params, const OptimizerOptions& options)
    : options_(options) {
  for (const OptimParam& p : params) {
    params_.push_back(
        p.leaf.view(-1).narrow(0, 0, p.plan.numel()).view({p.plan.rows, p.plan.cols}));
    const auto floats = at::dtype(at::kFloat).device(p.leaf.device());
    if (options.inner == InnerKind::AdamW) {
      exp_avg_.push_back(at::zeros({p.plan.rows, p.plan.cols}, floats));
      exp_avg_sq_.push_back(at::zeros({p.plan.rows, p.plan.cols}, floats));
    } else if (options.inner == InnerKind::Nesterov) {
      momentum_.push_back(at::zeros({p.plan.rows, p.plan.cols}, floats));
    }
  }
}

void StepRule::begin_step(double lr) {
  ++step_;
  lr_ = lr;
}

namespace {

// p -= lr * sign(d) (or lr * d) with one pass over memory where the layout allows it.
void sgd_update(at::Tensor& p, const at::Tensor& d, float lr, bool sign) {
  if (p.is_cpu() && d.is_cpu() && p.scalar_type() == at::kFloat && p.is_contiguous() &&
      d.is_contiguous() && d.scalar_type() == at::kFloat) {
    float* dst = p.data_ptr<float>();
    const float* u = d.data_ptr<float>();
    at::parallel_for(0, p.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
      if (sign) {
        for (int64_t i = begin; i < end; ++i) dst[i] -= lr * float((u[i] > 0.0f) - (u[i] < 0.0f));
      } else {
        for (int64_t i = begin; i < end; ++i) dst[i] -= lr * u[i];
      }
    });
    p.unsafeGetTensorImpl()->bump_version();  // written through its pointer, as ATen's ops would
    return;
  }
  p.sub_(sign ? d.sign() : d, lr);
}

}  // namespace

std::pair<double, double> StepRule::bias_corrections() const {
  return {1.0 - std::pow(options_.beta1, double(step_)),
          1.0 - std::pow(options_.beta2, double(step_))};
}

void StepRule::apply(size_t i, const at::Tensor& direction) {
  at::Tensor& p = params_.at(i);
  const OptimizerOptions& o = options_;
  if (o.weight_decay != 0.0) p.mul_(1.0 - lr_ * o.weight_decay);
  if (o.inner == InnerKind::Sgd) {
    sgd_update(p, direction, float(lr_), o.sign);
    return;
  }
  const at::Tensor grad = o.sign ? direction.sign() : direction;
  if (o.inner == InnerKind::Nesterov) {  // buf = mu * buf + g; p -= lr * (g + mu * buf)
    at::Tensor& buf = momentum_[i];
    buf.mul_(o.momentum).add_(grad);
    p.sub_(grad.add(buf, o.momentum), lr_);
    return;
  }
  at::Tensor& m = exp_avg_[i];
  at::Tensor& v = exp_avg_sq_[i];
  const auto [bias_correction1, bias_correction2] = bias_corrections();
  m.mul_(o.beta1).add_(grad, 1.0 - o.beta1);
  v.mul_(o.beta2).addcmul_(grad, grad, 1.0 - o.beta2);
  const at::Tensor denom = (v.sqrt() / std::sqrt(bias_correction2)).add_(o.eps);
  p.addcdiv_(m, denom, -lr_ / bias_correction1);
}

std::optional<demo::Update> StepRule::fused_update(size_t i) const {
  const OptimizerOptions& o = options_;
  const bool fusable = (o.inner == InnerKind::Sgd && o.sign) || o.inner == InnerKind::AdamW;
  if (!fusable || params_.at(i).scalar_type() != at::kFloat) return std::nullopt;
  demo::Update u;
  u.param = params_[i];
  u.hyper = hyper();
  if (o.inner == InnerKind::AdamW) {
    u.rule = demo::Update::Rule::AdamW;
    u.exp_avg = exp_avg_[i];
    u.exp_avg_sq = exp_avg_sq_[i];
  }
  return u;
}

kernels::AdamWHyper StepRule::hyper() const {
  kernels::AdamWHyper h;
  h.lr = lr_;
  h.weight_decay = options_.weight_decay;
  h.beta1 = options_.beta1;
  h.beta2 = options_.beta2;
  h.eps = options_.eps;
  std::tie(h.bias_correction1, h.bias_correction2) = bias_corrections();
  h.sign = options_.sign;
  return h;
}

std::vector<std::pair<std::string, at::Tensor>> StepRule::state_tensors() const {
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (size_t i = 0; i < exp_avg_.size(); ++i) {
    state.push_back({"exp_avg." + std::to_string(i), exp_avg_[i]});
    state.push_back({"exp_avg_sq." + std::to_string(i), exp_avg_sq_[i]});
  }
  for (size_t i = 0; i < momentum_.size(); ++i) {
    state.push_back({"momentum." + std::to_string(i), momentum_[i]});
  }
  return state;
}

}  // namespace flexdemo::optim
