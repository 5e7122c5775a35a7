// ExchangeEveryStep (stepping.h): every `every` steps the replicator exchanges and the inner step
// rule applies the direction; the steps between fold their gradients into the replicator's state.
// With `precondition`, each gradient is divided by the root of its running mean square (each
// replica's own, or one the replicas share: second_moment.h) before it enters the replicator's
// state: here, or by the replicator as its transform reads the gradient where it offers to.
#include "second_moment.h"
#include "stepping.h"

#include "demo/kernels.h"
#include "flexdemo/comm.h"

#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <stdexcept>
#include <utility>

namespace flexdemo::optim {
namespace {

class ExchangeEveryStep final : public Stepping {
 public:
  ExchangeEveryStep(const std::vector<dct::ChunkPlan>& plans, const OptimizerOptions& options,
                    const ShardSums& shards, std::shared_ptr<comm::Communicator> group,
                    at::Device device, StepRule& inner)
      : options_(options),
        tensors_(plans.size()),
        inner_(inner),
        replicator_(make_replicator(plans, options, group, device)),
        schedule_{options.topk, options.values, options.replicate_every} {
    if (!options.precondition) return;
    started_.resize(plans.size());
    const int64_t replicas = group ? group->size() : 1;
    if (resolved_second_moment(options.second_moment, replicas) == SecondMoment::Shared) {
      shared_ = std::make_unique<SharedSecondMoment>(plans, options, shards, group, device);
      return;
    }
    for (const dct::ChunkPlan& plan : plans) {
      grad_sq_.push_back(at::zeros({plan.rows, plan.cols}, at::dtype(at::kFloat).device(device)));
    }
  }

  void step(const std::vector<at::Tensor>& given, double lr, int64_t) override {
    std::vector<at::Tensor> grads = given;
    if (options_.precondition) {
      grads = preconditioned(given);
      ++preconditioned_;
    }
    if (counters_.folded + 1 < schedule_.every) {
      ++counters_.folded;
      replicator_->accumulate(grads, folded(lr));
      return;
    }
    counters_.folded = 0;
    ++counters_.exchanges;
    inner_.begin_step(lr);
    replicator_->exchange(grads, folded(lr), inner_);
    inner_.settle();
  }

  void start(const std::vector<size_t>& tensors, const std::vector<at::Tensor>& grads,
             double lr) override {
    if (counters_.folded + 1 < schedule_.every) return;  // step() only folds them in
    // A step whose second moment is summed over the replicas preconditions its gradients all at
    // once, in step(): none can start before.
    if (sums_second_moment()) return;
    if (!options_.precondition) {
      replicator_->start(tensors, grads, folded(lr));
      return;
    }
    // Preconditioned now, once (or handed on unscaled, the replicator preconditioning them as it
    // encodes them now): step() takes these as they are.
    std::vector<at::Tensor> scaled;
    for (size_t k = 0; k < tensors.size(); ++k) {
      started_[tensors[k]] = precondition(tensors[k], grads[k]);
      scaled.push_back(*started_[tensors[k]]);
    }
    replicator_->start(tensors, scaled, folded(lr));
  }

  NamedTensors state_tensors() const override {
    NamedTensors state = replicator_->state_tensors();
    for (const auto& named : numbered(kOwnMomentState, grad_sq_)) state.push_back(named);
    if (shared_) {
      for (const auto& named : shared_->state_tensors()) state.push_back(named);
    }
    // --overlap-step's preview: the checkpoint's weights are replica 0's, each replica's own
    // parameters (the committed ones plus its own preview) are loaded after them.
    if (!replicator_->committed_params().empty()) {
      for (size_t i = 0; i < tensors_; ++i) {
        state.push_back({"previewed." + std::to_string(i), inner_.param(i)});
      }
    }
    return state;
  }

  void restore(int64_t steps, std::optional<ExchangeCounters> counters) override {
    counters_ =
        counters ? *counters : ExchangeCounters{steps / schedule_.every, steps % schedule_.every};
    preconditioned_ = steps;
    if (shared_) shared_->restore(steps);
    inner_.restore_step(counters_.exchanges);
    replicator_->restore_counters(counters_.exchanges, counters_.folded);
  }

  std::vector<at::Tensor> replicated_params() const override {
    std::vector<at::Tensor> committed = replicator_->committed_params();
    if (!committed.empty()) return committed;
    std::vector<at::Tensor> views;
    for (size_t i = 0; i < tensors_; ++i) views.push_back(inner_.param(i));
    return views;
  }

  ExchangeSchedule schedule() const override { return schedule_; }
  void set_schedule(const ExchangeSchedule& schedule) override {
    if (options_.replicator != ReplicatorKind::Demo) {
      throw std::invalid_argument(
          "optimizer: the exchange schedule changes with the demo replicator and inner_steps 1 "
          "only");
    }
    if (schedule.topk <= 0 || schedule.every < 1) {
      throw std::invalid_argument("optimizer: a schedule needs topk > 0 and every >= 1, got topk " +
                                  std::to_string(schedule.topk) + ", every " +
                                  std::to_string(schedule.every));
    }
    schedule_ = schedule;
    replicator_->set_layout(schedule.topk, schedule.values);
  }
  ExchangeCounters counters() const override { return counters_; }
  Replicator& replicator() const override { return *replicator_; }

  double statistics_link_bytes() const override {
    return shared_ ? shared_->link_bytes_per_step() : 0.0;
  }

 private:
  // The scale of a gradient entering the replicator's residual.
  double folded(double lr) const { return options_.fold_lr ? lr : 1.0; }

  // Every gradient of this step preconditioned, or unscaled where the replicator preconditions
  // it as it reads it: those started early as they were then.
  std::vector<at::Tensor> preconditioned(const std::vector<at::Tensor>& grads) {
    if (sums_second_moment()) {
      return shared_->precondition_all(grads, preconditioned_ + 1);
    }
    std::vector<at::Tensor> out(grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      out[i] = started_[i] ? *std::exchange(started_[i], std::nullopt) : precondition(i, grads[i]);
    }
    if (shared_) shared_->end_step();
    return out;
  }

  // Whether this step sums the shared second moment over the replicas (every gradient at once).
  bool sums_second_moment() const { return shared_ && shared_->sums_at(preconditioned_ + 1); }

  // v = beta2 * v + (1 - beta2) * g^2, then g / (sqrt(v / (1 - beta2^t)) + eps), t this step's
  // number: AdamW's denominator on this replica's own gradient of tensor i (a missing one counts
  // as zero and stays undefined); with the shared second moment, its denominator instead. Where
  // the replicator preconditions as its transform reads the gradient (the CPU's fast path), the
  // gradient is passed on as it is and v is updated then.
  at::Tensor precondition(size_t i, const at::Tensor& grad) {
    if (shared_) return shared_->precondition(i, grad, preconditioned_ + 1);
    at::Tensor& v = grad_sq_[i];
    if (!grad.defined()) {
      v.mul_(options_.beta2);
      return {};
    }
    if (replicator_->precondition_as_read(
            i, kernels::Preconditioning{v, options_.beta2, options_.eps, preconditioned_ + 1})) {
      return grad;
    }
    const at::Tensor scaled = at::empty(grad.sizes(), v.options());
    kernels::precondition(grad, v, scaled, options_.beta2, options_.eps, preconditioned_ + 1);
    return scaled;
  }

  OptimizerOptions options_;
  size_t tensors_;
  StepRule& inner_;
  std::unique_ptr<Replicator> replicator_;
  ExchangeSchedule schedule_;  // as set; the replicator reports the top-k and values in use
  ExchangeCounters counters_;
  std::vector<at::Tensor> grad_sq_;  // precondition: each gradient's running mean square
  std::unique_ptr<SharedSecondMoment> shared_;  // precondition with second_moment shared
  int64_t preconditioned_ = 0;                   // the steps in it
  // precondition: this step's gradients started early (start()), as precondition() gave them.
  std::vector<std::optional<at::Tensor>> started_;
};

}  // namespace

std::unique_ptr<Stepping> make_exchange_every_step(const std::vector<dct::ChunkPlan>& plans,
                                                   const OptimizerOptions& options,
                                                   const ShardSums& shards,
                                                   std::shared_ptr<comm::Communicator> group,
                                                   at::Device device, StepRule& inner) {
  return std::make_unique<ExchangeEveryStep>(plans, options, shards, std::move(group), device,
                                             inner);
}

}  // namespace flexdemo::optim
