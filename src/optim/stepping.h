// How the Optimizer turns a step's gradients into new parameters, one type per mode: every step
// through the replicator (ExchangeEveryStep: DeMo, HSDP, with replicate_every folding the steps
// between exchanges), or many local steps of the inner step rule and, every inner_steps steps,
// an outer step on the replicas' mean pseudo-gradient (LocalSteps: DiLoCo's loop with DeMo's
// compression). Internal to the optimizer; the Optimizer holds one and never branches on the mode.
#pragma once

#include "replicator.h"
#include "step_rule.h"

#include <memory>
#include <optional>
#include <vector>

namespace flexdemo::optim {

class Stepping {
 public:
  virtual ~Stepping() = default;
  // One step from this step's gradients (plan.numel() elements each, undefined = zero); `steps`
  // counts the step() calls so far, this one included.
  virtual void step(const std::vector<at::Tensor>& grads, double lr, int64_t steps) = 0;
  // Optimizer::start_exchange: these tensors' gradients are final (a hint).
  virtual void start(const std::vector<size_t>& tensors, const std::vector<at::Tensor>& grads,
                     double lr) = 0;
  // The mode's state beyond the inner step rule's, named for files.
  virtual NamedTensors state_tensors() const = 0;
  // After loading state: the steps taken and, for a schedule that changed, the exchange counters.
  virtual void restore(int64_t steps, std::optional<ExchangeCounters> counters) = 0;
  // What is identical on every replica after a step (Optimizer::replicated_params).
  virtual std::vector<at::Tensor> replicated_params() const = 0;
  virtual ExchangeSchedule schedule() const = 0;
  virtual void set_schedule(const ExchangeSchedule& schedule) = 0;
  virtual ExchangeCounters counters() const = 0;
  virtual Replicator& replicator() const = 0;
  // Bytes on the replicas' link a step besides the exchange's payloads (the shared second
  // moment's sum), as the bytes a rank of an all-gather sends each other rank.
  virtual double statistics_link_bytes() const { return 0.0; }
};

// shards: where the tensors are shards (the shared second moment sums a matrix's columns there).
std::unique_ptr<Stepping> make_exchange_every_step(const std::vector<dct::ChunkPlan>& plans,
                                                   const OptimizerOptions& options,
                                                   const ShardSums& shards,
                                                   std::shared_ptr<comm::Communicator> group,
                                                   at::Device device, StepRule& inner);
std::unique_ptr<Stepping> make_local_steps(const std::vector<dct::ChunkPlan>& plans,
                                           const OptimizerOptions& options,
                                           std::shared_ptr<comm::Communicator> group,
                                           at::Device device, StepRule& inner);

}  // namespace flexdemo::optim
