// Sign-SGD, AdamW and Nesterov SGD applied to one tensor at a time, in place on this rank's
// parameters. AdamW follows torch.optim.AdamW's operation order, so it can be checked against it.
#include "step_rule.h"

#include "demo/kernels.h"
#include "flexdemo/comm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <stdexcept>
#include <tuple>
#include <utility>

namespace flexdemo::optim {

StepRule::StepRule(const std::vector<OptimParam>& params, const OptimizerOptions& options,
                   ShardSums shards)
    : options_(options), shards_(std::move(shards)) {
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
  waits_ = measures_rms() && shards_.group && shards_.group->size() > 1;
  if (waits_ && shards_.given.size() != params.size()) {
    throw std::logic_error("StepRule: one given index per sharded tensor");
  }
}

void StepRule::begin_step(double lr) {
  ++step_;
  lr_ = lr;
  pending_.clear();  // a step that threw before its settle() leaves nothing behind
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

}  // namespace

std::pair<double, double> StepRule::bias_corrections() const {
  return {1.0 - std::pow(options_.beta1, double(step_)),
          1.0 - std::pow(options_.beta2, double(step_))};
}

at::Tensor StepRule::measured(size_t i, const at::Tensor& direction) const {
  return options_.normalize ? chunk_rms_normalized(direction, plans_.at(i)) : direction;
}

at::Tensor StepRule::rescaled(const at::Tensor& d, double squares, double count) const {
  const OptimizerOptions& o = options_;
  const double now = count > 0.0 ? std::sqrt(squares / count) : 0.0;
  at::Tensor out = d;  // a tensor of zeros stays zero
  if (o.update_rms > 0.0 && now > 0.0) out = d * (o.update_rms / now);
  if (o.rms_cap > 0.0 && now > o.rms_cap) out = d * (o.rms_cap / now);
  if (o.step_bound > 0.0) out = out.clamp(-o.step_bound, o.step_bound);
  return out;
}

void StepRule::apply(size_t i, const at::Tensor& direction) { take(i, direction, -1.0); }

void StepRule::preview(size_t i, const at::Tensor& direction, double lr) {
  take(i, direction, lr);
}

void StepRule::take(size_t i, const at::Tensor& direction, double lr) {
  if (options_.sign) {
    update(i, direction, lr, 0.0, 0.0);
    return;
  }
  const at::Tensor d = measured(i, direction);
  const double squares = measures_rms() ? kernels::sum_squares(d) : 0.0;
  if (!waits_) {
    update(i, d, lr, squares, double(d.numel()));
    return;
  }
  // The direction is the caller's only during the call; a normalized one is already a copy.
  const at::Tensor kept = options_.normalize ? d : direction.clone();
  pending_.push_back({i, squares, [this, i, kept, lr](double whole, double count) {
                        update(i, kept, lr, whole, count);
                      }});
}

void StepRule::measure(size_t i, double squares, std::function<void(double s)> step) {
  auto run = [cap = options_.rms_cap, step = std::move(step)](double whole, double count) {
    const double rms = std::sqrt(whole / count);
    step(rms > cap ? cap / rms : 1.0);
  };
  if (!waits_) {
    run(squares, double(plans_.at(i).numel()));
    return;
  }
  pending_.push_back({i, squares, std::move(run)});
}

void StepRule::settle() {
  if (!waits_) return;
  const std::vector<Pending> pending = std::exchange(pending_, {});
  // Per given tensor this shard's (sum of squares, elements) where it has an update waiting
  // (0, 0 elsewhere: a shard that skips its update, e.g. a preview of a tampered payload, does
  // not dilute the others' RMS).
  const int64_t n = shards_.tensors;
  const at::Tensor mine = at::zeros({n, 2}, at::kDouble);
  double* m = mine.data_ptr<double>();
  std::vector<char> seen(plans_.size(), 0);
  for (const Pending& u : pending) {
    if (std::exchange(seen[u.tensor], 1)) {
      throw std::logic_error("StepRule: two updates of one tensor to settle");
    }
    m[2 * shards_.given[u.tensor]] = u.squares;
    m[2 * shards_.given[u.tensor] + 1] = double(plans_[u.tensor].numel());
  }
  comm::Communicator& group = *shards_.group;
  const int shards = group.size();
  const at::Tensor all = at::empty({shards * n * 2}, mine.options().device(group.device()));
  group.all_gather(mine.view(-1).to(group.device()), all);
  const at::Tensor host = all.to(at::kCPU);
  const double* a = host.data_ptr<double>();
  for (const Pending& u : pending) {
    const int64_t g = shards_.given[u.tensor];
    double squares = 0.0, count = 0.0;  // in shard order: the same bits on every shard
    for (int r = 0; r < shards; ++r) {
      squares += a[2 * (r * n + g)];
      count += a[2 * (r * n + g) + 1];
    }
    u.run(squares, count);
  }
}

void StepRule::update(size_t i, const at::Tensor& direction, double lr, double squares,
                      double count) {
  at::Tensor& p = params_.at(i);
  const OptimizerOptions& o = options_;
  const at::Tensor d = o.sign ? direction : rescaled(direction, squares, count);
  if (lr >= 0.0) {  // a preview: SGD's step without weight decay
    p.sub_(o.sign ? d.sign() : d, lr);
    return;
  }
  if (o.weight_decay != 0.0) p.mul_(1.0 - lr_ * o.weight_decay);
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

std::optional<demo::Update> StepRule::fused_update(size_t i) {
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
  if (sgd && o.rms_cap > 0.0 && !o.sign) {
    // The cap's factor from the decode's sum of squares, now or, for a shard, at settle().
    u.measured = [this, i](double squares, std::function<void(double)> step) {
      measure(i, squares, std::move(step));
    };
  }
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
