// ExchangeEveryStep (stepping.h): every `every` steps the replicator exchanges and the inner step
// rule applies the direction; the steps between fold their gradients into the replicator's state.
#include "stepping.h"

#include <stdexcept>

namespace flexdemo::optim {
namespace {

class ExchangeEveryStep final : public Stepping {
 public:
  ExchangeEveryStep(const std::vector<dct::ChunkPlan>& plans, const OptimizerOptions& options,
                    std::shared_ptr<comm::Communicator> group, at::Device device, StepRule& inner)
      : options_(options),
        tensors_(plans.size()),
        inner_(inner),
        replicator_(make_replicator(plans, options, std::move(group), device)),
        schedule_{options.topk, options.values, options.replicate_every} {}

  void step(const std::vector<at::Tensor>& grads, double lr, int64_t) override {
    if (counters_.folded + 1 < schedule_.every) {
      ++counters_.folded;
      replicator_->accumulate(grads, folded(lr));
      return;
    }
    counters_.folded = 0;
    ++counters_.exchanges;
    inner_.begin_step(lr);
    replicator_->exchange(grads, folded(lr), inner_);
  }

  void start(const std::vector<size_t>& tensors, const std::vector<at::Tensor>& grads,
             double lr) override {
    if (counters_.folded + 1 < schedule_.every) return;  // step() only folds them in
    replicator_->start(tensors, grads, folded(lr));
  }

  NamedTensors state_tensors() const override {
    NamedTensors state = replicator_->state_tensors();
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

 private:
  // The scale of a gradient entering the replicator's residual.
  double folded(double lr) const { return options_.fold_lr ? lr : 1.0; }

  OptimizerOptions options_;
  size_t tensors_;
  StepRule& inner_;
  std::unique_ptr<Replicator> replicator_;
  ExchangeSchedule schedule_;  // as set; the replicator reports the top-k and values in use
  ExchangeCounters counters_;
};

}  // namespace

std::unique_ptr<Stepping> make_exchange_every_step(const std::vector<dct::ChunkPlan>& plans,
                                                   const OptimizerOptions& options,
                                                   std::shared_ptr<comm::Communicator> group,
                                                   at::Device device, StepRule& inner) {
  return std::make_unique<ExchangeEveryStep>(plans, options, std::move(group), device, inner);
}

}  // namespace flexdemo::optim
