// Sign-SGD, AdamW and Nesterov SGD applied to one tensor at a time, in place on this rank's
// parameters. AdamW follows torch.optim.AdamW's operation order, so it can be checked against it.
#include "step_rule.h"

#include "demo/kernels.h"

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
    plans_.push_back(p.plan);
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

// d ([rows, cols]) with each chunk of `plan` scaled to unit RMS over its elements (a padded
// chunk: over those inside the tensor); a chunk of zeros stays zero. The sums are float64, so
// the result does not depend on how many chunk-rows this rank holds.
at::Tensor chunk_rms_normalized(const at::Tensor& d, const dct::ChunkPlan& plan) {
  const int64_t pad_rows = plan.padded_rows - plan.rows, pad_cols = plan.padded_cols - plan.cols;
  auto grid = [&](const at::Tensor& t) {  // [row chunks, chunk_rows, col chunks, chunk_cols]
    const at::Tensor padded =
        plan.is_padded() ? at::constant_pad_nd(t, {0, pad_cols, 0, pad_rows}) : t;
    return padded.reshape({plan.row_chunks(), plan.chunk_rows, plan.col_chunks(), plan.chunk_cols});
  };
  const at::Tensor chunks = grid(d);
  const at::Tensor squares = chunks.to(at::kDouble).square().sum({1, 3}, /*keepdim=*/true);
  const at::Tensor count = plan.is_padded()
                               ? grid(at::ones_like(d, at::kDouble)).sum({1, 3}, /*keepdim=*/true)
                               : at::full_like(squares, double(plan.chunk_numel()));
  const at::Tensor rms = (squares / count).sqrt();
  const at::Tensor scale = at::where(rms > 0, rms.reciprocal(), at::zeros_like(rms));
  const at::Tensor scaled =
      (chunks * scale.to(d.scalar_type())).reshape({plan.padded_rows, plan.padded_cols});
  return scaled.narrow(0, 0, plan.rows).narrow(1, 0, plan.cols).contiguous();
}

// d scaled so that its RMS is `rms` (a tensor of zeros stays zero), or with only_down, where it
// is above `rms` only; the sum is float64.
at::Tensor rms_scaled(const at::Tensor& d, double rms, bool only_down = false) {
  const double now = std::sqrt(kernels::sum_squares(d) / double(d.numel()));
  return now > 0.0 && (!only_down || now > rms) ? d * (rms / now) : d;
}

}  // namespace

std::pair<double, double> StepRule::bias_corrections() const {
  return {1.0 - std::pow(options_.beta1, double(step_)),
          1.0 - std::pow(options_.beta2, double(step_))};
}

at::Tensor StepRule::rescaled(size_t i, const at::Tensor& direction) const {
  const OptimizerOptions& o = options_;
  at::Tensor d = o.normalize ? chunk_rms_normalized(direction, plans_.at(i)) : direction;
  if (o.update_rms > 0.0) d = rms_scaled(d, o.update_rms);
  if (o.rms_cap > 0.0) d = rms_scaled(d, o.rms_cap, /*only_down=*/true);
  if (o.step_bound > 0.0) d = d.clamp(-o.step_bound, o.step_bound);
  return d;
}

at::Tensor StepRule::shaped(size_t i, const at::Tensor& direction) const {
  return options_.sign ? direction.sign() : rescaled(i, direction);
}

void StepRule::apply(size_t i, const at::Tensor& direction) {
  at::Tensor& p = params_.at(i);
  const OptimizerOptions& o = options_;
  if (o.weight_decay != 0.0) p.mul_(1.0 - lr_ * o.weight_decay);
  const at::Tensor d = rescaled(i, direction);
  if (o.inner == InnerKind::Sgd) {
    sgd_update(p, d, float(lr_), o.sign);
    return;
  }
  const at::Tensor grad = o.sign ? d.sign() : d;
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
  // The kernels bound the SGD rule's direction themselves, and cap its RMS over unpadded chunks;
  // AdamW's bounded or capped input and the other rescalings go through apply().
  const bool sgd = o.inner == InnerKind::Sgd && (o.rms_cap == 0.0 || !plans_.at(i).is_padded());
  const bool adamw = o.inner == InnerKind::AdamW && o.step_bound == 0.0 && o.rms_cap == 0.0;
  const bool fusable = (sgd || adamw) && !o.normalize && o.update_rms == 0.0;
  if (!fusable || params_.at(i).scalar_type() != at::kFloat) return std::nullopt;
  demo::Update u;
  u.param = params_[i];
  u.hyper = hyper();
  u.rms_cap = sgd ? o.rms_cap : 0.0;
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
  h.step_bound = options_.sign ? 0.0 : options_.step_bound;
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
