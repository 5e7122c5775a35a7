// LocalSteps (stepping.h): DiLoCo's outer loop with DeMo's compression. Every step is a local step
// of the inner step rule on the replica's own gradient; every inner_steps steps the pseudo-gradient
// (anchor - now) goes through the replicator with lr 1 (DeMo's residual, top-k, encoding, mean,
// or the dense mean) and the outer step rule (Nesterov SGD, on it or on its sign) applies the
// replicas' mean to the anchors, from which every replica continues.
#include "stepping.h"

#include <ATen/ATen.h>

#include <stdexcept>

namespace flexdemo::optim {
namespace {

OptimizerOptions outer_options(const OptimizerOptions& options) {
  OptimizerOptions outer = options;
  outer.inner = InnerKind::Nesterov;
  outer.sign = options.outer_sign;
  outer.normalize = false;
  outer.update_rms = 0.0;  // the local steps' options, not the outer step's
  outer.step_bound = 0.0;
  outer.rms_cap = 0.0;
  outer.lr = options.outer_lr;
  outer.momentum = options.outer_momentum;
  outer.weight_decay = 0.0;  // the local steps decay the weights
  return outer;
}

class LocalSteps final : public Stepping {
 public:
  LocalSteps(const std::vector<dct::ChunkPlan>& plans, const OptimizerOptions& options,
             std::shared_ptr<comm::Communicator> group, at::Device device, StepRule& inner)
      : plans_(plans), options_(options), inner_(inner) {
    if (device.is_cuda() && options.replicator != ReplicatorKind::Full &&
        options.replicator != ReplicatorKind::None) {
      throw std::invalid_argument(
          "optimizer: inner_steps > 1 exchanges through the demo or random replicator on CPUs "
          "only (on a GPU: the full one)");
    }
    std::vector<OptimParam> anchors;
    for (const dct::ChunkPlan& plan : plans) {
      anchors_.push_back(at::empty({plan.rows, plan.cols}, at::dtype(at::kFloat).device(device)));
      anchors.push_back({anchors_.back(), plan});
    }
    const OptimizerOptions outer = outer_options(options);
    replicator_ = make_replicator(plans, outer, std::move(group), device);
    outer_ = std::make_unique<StepRule>(anchors, outer);
  }

  void step(const std::vector<at::Tensor>& grads, double lr, int64_t steps) override {
    if (steps == 1) {  // the parameters as training starts (after any --init-from) anchor round 1
      for (size_t i = 0; i < anchors_.size(); ++i) anchors_[i].copy_(inner_.param(i));
    }
    inner_.begin_step(lr);
    for (size_t i = 0; i < plans_.size(); ++i) {
      const dct::ChunkPlan& plan = plans_[i];
      inner_.apply(i, grads[i].defined()
                          ? grads[i].view({plan.rows, plan.cols}).to(at::kFloat)
                          : at::zeros({plan.rows, plan.cols}, anchors_[i].options()));
    }
    inner_.settle();
    if (steps % options_.inner_steps == 0) outer_step();
  }

  // The exchange is of the parameters, after the step.
  void start(const std::vector<size_t>&, const std::vector<at::Tensor>&, double) override {}

  // This replica's own parameters (loaded after the checkpoint's weights), the anchors, the outer
  // step's state and its replicator's.
  NamedTensors state_tensors() const override {
    NamedTensors state;
    for (size_t i = 0; i < plans_.size(); ++i) {
      state.push_back({"local." + std::to_string(i), inner_.param(i)});
    }
    for (auto& t : numbered("anchor", anchors_)) state.push_back(t);
    for (auto& [name, t] : outer_->state_tensors()) state.push_back({"outer." + name, t});
    for (auto& [name, t] : replicator_->state_tensors()) state.push_back({"outer." + name, t});
    return state;
  }

  void restore(int64_t steps, std::optional<ExchangeCounters>) override {
    inner_.restore_step(steps);
    outer_->restore_step(steps / options_.inner_steps);
    replicator_->restore_counters(steps / options_.inner_steps, 0);
  }

  std::vector<at::Tensor> replicated_params() const override { return anchors_; }
  ExchangeSchedule schedule() const override {
    return {options_.topk, options_.values, options_.replicate_every};
  }
  void set_schedule(const ExchangeSchedule&) override {
    throw std::invalid_argument(
        "optimizer: the exchange schedule changes with the demo replicator and inner_steps 1 "
        "only");
  }
  ExchangeCounters counters() const override { return {}; }
  Replicator& replicator() const override { return *replicator_; }

 private:
  // The replicas' mean pseudo-gradient applied to the anchors; every replica continues from them.
  void outer_step() {
    std::vector<at::Tensor> pseudo;
    for (size_t i = 0; i < plans_.size(); ++i) {
      pseudo.push_back((anchors_[i] - inner_.param(i).to(at::kFloat)).reshape({-1}));
    }
    outer_->begin_step(options_.outer_lr);
    replicator_->exchange(pseudo, 1.0, *outer_);
    for (size_t i = 0; i < plans_.size(); ++i) inner_.param(i).copy_(anchors_[i]);
  }

  std::vector<dct::ChunkPlan> plans_;
  OptimizerOptions options_;
  StepRule& inner_;
  std::vector<at::Tensor> anchors_;  // float32 [rows, cols]: the parameters of the last exchange
  std::unique_ptr<Replicator> replicator_;
  std::unique_ptr<StepRule> outer_;
};

}  // namespace

std::unique_ptr<Stepping> make_local_steps(const std::vector<dct::ChunkPlan>& plans,
                                           const OptimizerOptions& options,
                                           std::shared_ptr<comm::Communicator> group,
                                           at::Device device, StepRule& inner) {
  return std::make_unique<LocalSteps>(plans, options, std::move(group), device, inner);
}

}  // namespace flexdemo::optim
